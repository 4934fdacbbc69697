"""Shared test data: a namespace and deterministic fake KV pages."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hicached.config import Config, parse_config
from hicached.testing import DaemonProcess as Daemon
from hicached.testing import free_tcp_port

__all__ = [
    "LAYOUTS",
    "NS",
    "PAGE_BYTES",
    "PAGE_TOKENS",
    "Daemon",
    "free_tcp_port",
    "in_child",
    "metrics_token",
    "page_bytes_for",
]

PAGE_TOKENS = 16
PAGE_BYTES = 4096

# The parallel layouts every rank test runs on.
LAYOUTS = {
    "tp2": dict(tp=2),
    "cp2": dict(cp=2),
    "pp2": dict(pp=2),
    "tp2xcp2": dict(tp=2, cp=2),
    "tp2xpp2": dict(tp=2, pp=2),
}

NS = dict(
    model="test/model",
    kv_dtype="bfloat16",
    layout="layer_first",
    page_tokens=PAGE_TOKENS,
    page_bytes=PAGE_BYTES,
)


def page_bytes_for(tokens: np.ndarray, page_bytes: int = PAGE_BYTES, salt: int = 0) -> np.ndarray:
    """Deterministic fake KV: page i's bytes depend on tokens[: (i+1) * PAGE_TOKENS]
    and ``salt`` alone, the same in every process (a hash chained page by page:
    linear in the tokens)."""
    n = len(tokens) // PAGE_TOKENS
    out = np.empty((n, page_bytes), dtype=np.uint8)
    words = np.asarray(tokens[: n * PAGE_TOKENS], dtype=np.int64).tobytes()
    step = PAGE_TOKENS * 8
    chain = hashlib.blake2b(str(salt).encode(), digest_size=8)
    for i in range(n):
        chain.update(words[i * step : (i + 1) * step])
        seed = int.from_bytes(chain.copy().digest(), "little")
        out[i] = np.random.default_rng(seed).integers(0, 256, page_bytes, dtype=np.uint8)
    return out


def in_child(work: Callable[[], str], limit: float = 30.0) -> str:
    """``work()`` in a forked child: what it returned, or what it raised
    (``Type: message``); fails if the child is still running after ``limit``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            said = work()
        except BaseException as exc:
            said = f"{type(exc).__name__}: {exc}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + limit
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the child was still running after {limit}s")
            time.sleep(0.02)
        with os.fdopen(read, "rb") as pipe:
            return pipe.read().decode()
    finally:
        with contextlib.suppress(OSError):
            os.close(read)


def metrics_token(directory: Path, name: str = "metrics.token") -> tuple[str, str]:
    """A bearer token in a file of this user's, mode 0600, in ``directory``:
    (the ``[metrics]`` lines of a daemon that requires it, the token)."""
    token = secrets.token_hex(32)
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")  # a trailing newline, as `openssl rand -hex 32 > FILE` leaves
    return f'port = 0\ntoken_file = "{path}"', token


def in_process_config(where: Path) -> Config:
    """The config of a daemon run in the test's own process, under ``where``:
    a 2 MiB pool not prefaulted, no metrics."""
    return parse_config(
        f'[server]\nendpoint = "ipc://{where}/run/hicached.sock"\nruntime_dir = "{where}/run"\n'
        "[pool]\nsize_mib = 2\nslab_mib = 1\nmax_page_bytes = 65536\npopulate = false\n"
        "[metrics]\nenabled = false\n"
    )
