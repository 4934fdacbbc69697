"""A hicached daemon in a subprocess, for tests, benchmarks and examples.

Each instance gets a private runtime directory and config under /tmp (ipc
socket paths must stay short) and cleans up its pool file even after SIGKILL.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hicached.arena import arena_path
from hicached.client import Client


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DaemonProcess:
    """``hicached serve`` as a child process with its own runtime dir and config.

    ``extra`` is TOML appended to the ``[server]`` section (more sections may
    follow); ``storage`` is TOML inside ``[storage]``, and ``tail`` comes last
    (for tables such as ``[storage.file]``).
    """

    def __init__(
        self,
        *,
        tcp: bool = False,
        extra: str = "",
        size_mib: int = 16,
        slab_mib: int = 1,
        max_page_bytes: int = 262144,
        populate: bool = True,
        storage: str = "",
        tail: str = "",
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hc-", dir="/tmp"))
        self.runtime = self.dir / "run"
        self.endpoint = (
            f"tcp://127.0.0.1:{free_tcp_port()}" if tcp else f"ipc://{self.runtime}/hicached.sock"
        )
        self.config = self.dir / "hicached.toml"
        self.config.write_text(
            f'[server]\nendpoint = "{self.endpoint}"\nruntime_dir = "{self.runtime}"\n{extra}\n'
            f"[pool]\nsize_mib = {size_mib}\nslab_mib = {slab_mib}\n"
            f"max_page_bytes = {max_page_bytes}\n"
            f"populate = {'true' if populate else 'false'}\n"
            f'[storage]\ndata_dir = "{self.dir / "data"}"\n{storage}\n{tail}\n'
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "daemon.log"

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        """Start the daemon and wait until it answers a request."""
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
        """A connected client; use it in a ``with`` block."""
        client = Client(self.endpoint, timeout=timeout, name=name)
        try:
            return client.connect()
        except BaseException:
            client.close()
            raise

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signal the daemon and return its exit status."""
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

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
