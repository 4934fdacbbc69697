"""Real daemons for tests: a subprocess per daemon, on a private ipc or tcp socket."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hicached import Client
from hicached.arena import arena_path

PAGE_TOKENS = 16
PAGE_BYTES = 4096

NS = dict(
    model="test/model",
    kv_dtype="bfloat16",
    layout="layer_first",
    page_tokens=PAGE_TOKENS,
    page_bytes=PAGE_BYTES,
)


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def page_bytes_for(tokens: np.ndarray, page_bytes: int = PAGE_BYTES, salt: int = 0) -> np.ndarray:
    """Deterministic fake KV: page i's bytes depend on tokens[: (i+1) * PAGE_TOKENS]."""
    n = len(tokens) // PAGE_TOKENS
    out = np.empty((n, page_bytes), dtype=np.uint8)
    for i in range(n):
        seed = hash((salt, tuple(int(t) for t in tokens[: (i + 1) * PAGE_TOKENS]))) & 0xFFFFFFFF
        out[i] = np.random.default_rng(seed).integers(0, 256, page_bytes, dtype=np.uint8)
    return out


class Daemon:
    """A hicached daemon subprocess with its own runtime dir and config."""

    def __init__(
        self, *, tcp: bool = False, extra: str = "", size_mib: int = 16, slab_mib: int = 1
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hc-", dir="/tmp"))
        self.runtime = self.dir / "run"
        self.endpoint = (
            f"tcp://127.0.0.1:{free_tcp_port()}" if tcp else f"ipc://{self.runtime}/hicached.sock"
        )
        self.config = self.dir / "hicached.toml"
        self.config.write_text(
            f'[server]\nendpoint = "{self.endpoint}"\nruntime_dir = "{self.runtime}"\n{extra}\n'
            f"[pool]\nsize_mib = {size_mib}\nslab_mib = {slab_mib}\nmax_page_bytes = 262144\n"
            f'[storage]\ndata_dir = "{self.dir / "data"}"\n'
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "daemon.log"

    def start(self, timeout: float = 20.0) -> Daemon:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hicached", "serve", "--config", str(self.config)],
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}"
                )
            try:
                with Client(self.endpoint, timeout=0.5) as client:
                    client.stats()
                return self
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"daemon did not answer within {timeout}s:\n{self.log.read_text()}")

    def client(self, timeout: float = 5.0, name: str = "") -> Client:
        return Client(self.endpoint, timeout=timeout, name=name).connect()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        arena_path("/dev/shm", self.runtime).unlink(missing_ok=True)  # left by a SIGKILL
        shutil.rmtree(self.dir, ignore_errors=True)
