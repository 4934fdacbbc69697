"""Build (once) and find the SGLang virtual environment that engine-side tests use.

Same scheme as ``tests/engines/venv.py`` (the vLLM one): a folder named after
the pin under ``$HICACHED_ENGINE_VENVS`` (default ``~/.cache/hicached/engines``),
a stamp written last, a file lock around the build.

    python -m tests.engines.sglang_venv   # build if needed, print its python

SGLang itself goes in without its dependencies (they pull in CUDA kernels
and servers the tests never import); what the imported modules need comes
next, at SGLang's own pins where it has them. torch is 2.14.1, not the local
CPU 2.13.0 wheel: ``sglang.srt.configs`` imports torchvision, whose wheels
link against CUDA torch, so no torchvision loads beside the CPU build. The
CUDA build runs on a host without a GPU. hicached is not installed: the tests
put the clone on ``PYTHONPATH`` and install its runtime dependencies here.

SGLang's page hashes come from a C++ extension built on first use; the build
compiles it into ``torch-extensions`` inside the venv (``extensions_dir``), so
``env()`` must be used for every process run with this python.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from tests.engines.venv import built, locked_build, root, run

SGLANG = "sglang==0.5.23"
TORCH = ("torch==2.14.1", "torchvision==0.29.1")
# What sglang.srt.mem_cache (storage factory, host pools, page hashes) imports,
# pinned where SGLang pins it; then hicached's own runtime dependencies.
NEEDS = (
    "aiohttp",
    "apache-tvm-ffi==0.1.11",
    "compressed-tensors==0.18.0",
    "dill",
    "gguf",
    "ipython",
    "orjson",
    "packaging",
    "pillow",
    "psutil",
    "pybase64",
    "pydantic",
    "requests",
    "sentencepiece==0.2.1",
    "starlette",
    "tokenizers==0.23.2",
    "tqdm",
    "transformers==5.19.0",
    "msgspec",
    "numpy",
    "prometheus-client",
    "pyzmq",
    "xxhash",
)
PIN = " ".join((SGLANG, *TORCH, *NEEDS))
SMOKE = (
    "import sglang.srt.mem_cache.storage, sglang.srt.mem_cache.pool_host.mha\n"
    "from sglang.srt.mem_cache.utils import get_hash_str\n"
    "assert len(get_hash_str(list(range(8)), None, page_size=4)) == 2\n"
)


def venv_dir() -> Path:
    return root() / SGLANG.replace("==", "-")


def python() -> Path:
    return venv_dir() / "bin" / "python"


def extensions_dir() -> Path:
    return venv_dir() / "torch-extensions"


def env(pythonpath: Path | None = None) -> dict[str, str]:
    """Environment for this venv's python: the prebuilt hash extension, no GPU
    probing noise, and ``pythonpath`` (the clone) first on the path."""
    out = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions_dir()))
    out.pop("PYTHONPATH", None)
    if pythonpath is not None:
        out["PYTHONPATH"] = str(pythonpath)
    return out


def ready() -> bool:
    return built(venv_dir(), PIN)


def build(base_python: str = sys.executable) -> Path:
    """The venv's python, building the venv first if it is missing or stale."""

    def install(pip: list[str], log: Path) -> None:
        pip = [*pip, "-q"]
        run([*pip, "install", "--no-deps", SGLANG], log)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
            constraints.write("\n".join(TORCH) + "\n")
        try:
            run([*pip, "install", "-c", constraints.name, *TORCH, *NEEDS], log)
        finally:
            os.unlink(constraints.name)
        # builds the hash extension where env() points every later run
        extensions = f"TORCH_EXTENSIONS_DIR={extensions_dir()}"
        run(["/usr/bin/env", extensions, pip[0], "-W", "ignore", "-c", SMOKE], log)
        if not extensions_dir().is_dir():
            raise RuntimeError(f"the smoke test built nothing in {extensions_dir()}; log {log}")

    return locked_build(venv_dir(), PIN, install, base_python)


if __name__ == "__main__":
    print(build())
