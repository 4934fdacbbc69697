"""Real services the tests start themselves: an S3 server (moto's server mode)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from hicached.testing import free_tcp_port

CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


class S3Server:
    """``moto_server`` on loopback, in its own process."""

    def __init__(self) -> None:
        self.port = free_tcp_port()
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
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


class MooncakeMaster:
    """A real ``mooncake_master`` on loopback with its embedded HTTP metadata server."""

    def __init__(self, client_ttl_s: int = 5) -> None:
        self.rpc_port, self.http_port, self.metrics_port = (free_tcp_port() for _ in range(3))
        self.master = f"127.0.0.1:{self.rpc_port}"
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        exe = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
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
        import socket

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
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
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def mooncake_master() -> Iterator[MooncakeMaster]:
    master = MooncakeMaster()
    try:
        yield master
    finally:
        master.stop()
