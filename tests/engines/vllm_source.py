"""Fetch (once) the source of the vLLM release whose interfaces hicached's vLLM
tier must also meet, for tests that read it without running it.

The engine tests run vLLM 0.32 (tests/engines/venv.py); vLLM 0.33 changed the
offloading interfaces, and tests/test_vllm_conformance.py compares hicached's
classes with 0.33's by their source. Only the wheel is needed, not an
installed vLLM: ``pip download --no-deps`` fetches it into
``$HICACHED_ENGINE_VENVS`` (default ``~/.cache/hicached/engines``), in a folder
named after the pin, and the few ``.py`` files the tests read are unpacked
beside it. Both are reused while the pin and the file list are unchanged (a
stamp written last holds them, so an unpacking cut short is started over), and
a file lock keeps two test runs from fetching at once.

    python -m tests.engines.vllm_source    # fetch if needed, print the source root

A wheel already in ``$HICACHED_WHEELS`` (default ``/opt/wheels``) is taken
from there instead of the index.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.engines import venv

VLLM = "vllm==0.33.0"
# What the conformance test reads: the offloading interfaces, their config,
# the event structs (and the block hash type they name), and the connector
# that calls them (and builds the spec, whose frame groups.py reads).
FILES = (
    "vllm/v1/kv_offload/base.py",
    "vllm/v1/kv_offload/config.py",
    "vllm/distributed/kv_events.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
)
STAMP = ".hicached-pin"


def where() -> Path:
    """The folder of this pin: the wheel in ``wheel/``, the files in ``src/``."""
    return venv.root() / (VLLM.replace("==", "-") + "-source")


def stamp_text() -> str:
    return "\n".join((VLLM, *FILES))


def ready() -> bool:
    stamp = where() / STAMP
    return stamp.is_file() and stamp.read_text() == stamp_text()


def _wheel(folder: Path) -> Path | None:
    name = VLLM.split("==")[0]
    found = sorted(folder.glob(f"{name}-{VLLM.split('==')[1]}-*.whl"))
    return found[0] if found else None


def fetch(timeout_s: float = 1800) -> Path:
    """The root of the unpacked source (``vllm/...`` below it), fetched first
    if it is missing or was fetched for another pin or file list."""
    home = where()
    src = home / "src"
    if ready():
        return src
    home.parent.mkdir(parents=True, exist_ok=True)
    with (home.parent / f".{home.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be fetching it
        if ready():
            return src
        wheels = home / "wheel"
        wheels.mkdir(parents=True, exist_ok=True)
        wheel = _wheel(wheels)
        if wheel is None:
            local = os.environ.get("HICACHED_WHEELS", "/opt/wheels")
            links = ["--find-links", local] if Path(local).is_dir() else []
            cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download"]
            cmd += ["--no-deps", "--only-binary=:all:", "-q", "-d", str(wheels), *links, VLLM]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            wheel = _wheel(wheels)
            if done.returncode or wheel is None:
                raise RuntimeError(
                    f"pip download {VLLM} failed ({done.returncode}):\n{done.stderr[-4000:]}"
                )
        (home / STAMP).unlink(missing_ok=True)
        shutil.rmtree(src, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            for name in FILES:
                target = src / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
        (home / STAMP).write_text(stamp_text())
    return src


def wheel_text(name: str) -> str:
    """A file of the wheel that ``FILES`` does not name, read from the wheel
    itself (the unpacked files and their stamp stay as other runs left them)."""
    fetch()
    wheel = _wheel(where() / "wheel")
    if wheel is None:
        raise RuntimeError(f"no {VLLM} wheel in {where() / 'wheel'}")
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(name).decode()


if __name__ == "__main__":
    print(fetch())
