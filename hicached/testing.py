"""Real processes for tests and benchmarks: a daemon, an S3 server, a Mooncake master.

Each instance gets a private runtime directory and config under /tmp (ipc
socket paths must stay short) and cleans up its pool file even after SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from hicached.client import Client, CurveKeys
from hicached.daemon.journal import journal_path
from hicached.wire.arena import arena_path
from hicached.wire.arenas import stale_tenant_files


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DaemonProcess:
    """``hicached serve`` as a child process with its own runtime dir and config.

    ``extra`` is TOML appended to the ``[server]`` section (more sections may
    follow); ``storage`` is TOML inside ``[storage]``, ``metrics`` inside
    ``[metrics]``, and ``tail`` comes last (for tables such as ``[storage.file]``).
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
        metrics: str = "port = 0",  # any free port: daemons side by side
        curve: CurveKeys | None = None,  # the keys this harness connects with
        fresh: bool = True,
        adopt: bool = True,  # pool.adopt
        module: str = "hicached",  # run as ``python -m module serve ...``
        # HICACHED_ALLOW_FAULTS=1 in the daemon's environment: the faulty backend
        # (hicached_backends/faulty.py) refuses to start without it
        allow_faults: bool = False,
    ) -> None:
        self.curve = curve
        self.allow_faults = allow_faults
        self.module = module
        # each start makes a new pool (serve --fresh), so a restart empties L2 as
        # tests of L3 want; False: a start adopts the pool the last stop left
        self.fresh = fresh
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
            f"adopt = {'true' if adopt else 'false'}\n"
            f"[metrics]\n{metrics}\n"
            f'[storage]\ndata_dir = "{self.dir / "data"}"\n{storage}\n{tail}\n'
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "daemon.log"

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        """Start the daemon and wait until it answers a request."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    self.module,
                    "serve",
                    "--config",
                    str(self.config),
                    *(["--fresh"] if self.fresh else []),
                ],
                stdout=log,
                stderr=log,
                env=self.env(),
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}"
                )
            try:
                with Client(self.endpoint, timeout=0.5, curve=self.curve) as client:
                    client.stats()
                return self
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"daemon did not answer within {timeout}s:\n{self.log.read_text()}")

    def env(self) -> dict[str, str]:
        """The daemon's environment: this process's, with fault injection
        allowed only where asked for (``allow_faults``)."""
        env = dict(os.environ)
        env.pop("HICACHED_ALLOW_FAULTS", None)
        if self.allow_faults:
            env["HICACHED_ALLOW_FAULTS"] = "1"
        return env

    def client(self, timeout: float = 5.0, name: str = "") -> Client:
        """A connected client; use it in a ``with`` block."""
        client = Client(self.endpoint, timeout=timeout, name=name, curve=self.curve)
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
        pool = arena_path("/dev/shm", self.runtime)  # left for the next start
        pool.unlink(missing_ok=True)
        journal_path(pool).unlink(missing_ok=True)
        for arena in stale_tenant_files("/dev/shm", self.runtime):  # a killed daemon's
            arena.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


class S3Server:
    """``moto_server`` on loopback, in its own process."""

    def __init__(self, port: int = 0) -> None:
        self.port = port or free_tcp_port()  # a port: a store that comes up where one was expected
        self.endpoint = f"http://127.0.0.1:{self.port}"
        exe = shutil.which("moto_server", path=str(Path(sys.executable).parent))
        cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
        self.proc = subprocess.Popen(
            [*cmd, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("moto_server exited") from None
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto_server did not start")

    def client(self) -> object:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        return name

    def stop(self) -> None:
        _terminate(self.proc)


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it is still there after 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


class MooncakeMaster:
    """A real ``mooncake_master`` on loopback with its embedded HTTP metadata server."""

    def __init__(self, client_ttl_s: int = 5, ports: tuple[int, int] | None = None) -> None:
        # ports: (rpc, http metadata), for a master that comes up where one was expected
        self.rpc_port, self.http_port = ports or (free_tcp_port(), free_tcp_port())
        self.metrics_port = free_tcp_port()
        self.master = f"127.0.0.1:{self.rpc_port}"
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        exe = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
        exe = exe or shutil.which("mooncake_master")
        if exe is None:
            raise RuntimeError("mooncake_master not found: pip install 'hicached[mooncake]'")
        self.log = open(f"/tmp/hc-mooncake-{self.rpc_port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                exe,
                f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                f"--client_ttl={client_ttl_s}",
            ],
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError("mooncake_master exited; see " + self.log.name)
            try:
                with socket.create_connection(("127.0.0.1", self.rpc_port), timeout=1):
                    pass
                with socket.create_connection(("127.0.0.1", self.http_port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("mooncake_master did not start")

    def toml(self, segment_mib: int = 64) -> str:
        return (
            "[storage.mooncake]\n"
            f'master = "{self.master}"\n'
            f'metadata_server = "{self.metadata}"\n'
            f"global_segment_mib = {segment_mib}\n"
            "local_buffer_mib = 16\n"
        )

    def stop(self) -> None:
        _terminate(self.proc)
        self.log.close()


def mooncake_master() -> Iterator[MooncakeMaster]:
    master = MooncakeMaster()
    try:
        yield master
    finally:
        master.stop()


def scrape(
    url: str,
    timeout: float = 5.0,
    context: ssl.SSLContext | None = None,
    token: str | None = None,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET a Prometheus endpoint (with ``token`` as its bearer token);
    {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
