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
