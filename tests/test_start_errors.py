"""A start the config or the files it names cannot give exits 2 with the key
and what is wrong, at once: no traceback, no hang on a FIFO, no read of a
device without end, no memory run away with. Each case runs the real
``hicached serve`` on a config of its own (found by attacking the start)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _fifo(where: Path) -> str:
    path = where / "fifo"
    os.mkfifo(path)
    return str(path)


def _file(where: Path) -> str:
    path = where / "file"
    path.write_text("not a directory")
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# name -> (the config's tail, made in a scratch dir; what stderr must say)
CASES: dict[str, tuple[Callable[[Path], str], str]] = {
    "runtime_dir is a file": (
        lambda d: "",  # the base config's runtime_dir is made a file below
        "cannot make it a directory",
    ),
    "tls_cert is a FIFO": (
        lambda d: (
            f"[metrics]\nenabled = true\nport = {_free_port()}\n"
            f'tls_cert = "{_fifo(d)}"\ntls_key = "{d}/key.pem"\n'
        ),
        "metrics.tls_cert: ",
    ),
    "CURVE secret key is a FIFO": (
        lambda d: f'[curve]\nsecret_key_file = "{_fifo(d)}"\nauthorized_keys_dir = "{d}"\n',
        "curve.secret_key_file: ",
    ),
    "CURVE secret key is /dev/zero": (
        lambda d: f'[curve]\nsecret_key_file = "/dev/zero"\nauthorized_keys_dir = "{d}"\n',
        "curve.secret_key_file: /dev/zero: not a regular file",
    ),
    "events endpoint cannot be bound": (
        lambda d: f'[events]\nendpoint = "ipc://{d}/{"e" * 150}"\n',
        "events.endpoint: cannot listen",
    ),
    "NUL in a name": (
        lambda d: '[events]\ngroup = "a\\u0000b"\n',
        "events.group: holds a NUL character",
    ),
    "integer past any knob": (
        lambda d: "[storage]\nconcurrency = 1180591620717411303424\n",
        "storage.concurrency: 1180591620717411303424 is past any knob's range",
    ),
    "S3 endpoint that is no URL": (
        lambda d: (
            '[storage]\nbackend = "s3"\n[storage.s3]\nbucket = "b"\nendpoint_url = "http://[::1"\n'
        ),
        "storage.s3: endpoint_url 'http://[::1' or region '' cannot be used",
    ),
    "S3 region that is no region": (
        lambda d: (
            '[storage]\nbackend = "s3"\n[storage.s3]\nbucket = "b"\nregion = "no such region!/"\n'
        ),
        "cannot be used",
    ),
    "storage calls past their bound": (
        lambda d: "[storage]\nconcurrency = 5000\n",
        "concurrency must be at most 1024",
    ),
    "no such client group": (lambda d: "", "server.client_group"),  # set below
    # pool.shm_dir set below, to d / "absent" and to d / "file"
    "shm_dir does not exist": (lambda d: "", "pool.shm_dir: "),
    "shm_dir is a file": (lambda d: "", "pool.shm_dir: "),
    "a file store's path is a file": (
        lambda d: f'[storage]\nbackend = "file"\n[storage.file]\npath = "{_file(d)}/pages"\n',
        "storage.file.path: ",
    ),
    "the data dir of a file store is a file": (
        lambda d: f'[storage]\nbackend = "file"\ndata_dir = "{_file(d)}"\n',
        "storage.data_dir: ",
    ),
    "options of another package's backend for a built-in one": (
        lambda d: f'[storage]\nbackend = "file"\ndata_dir = "{d}"\n[storage.extra]\nfoo = 1\n',
        "storage.extra: backend 'file' takes its options from [storage.file]",
    ),
}
# what check-config finds too: all but what only a start meets (a directory to
# make, an endpoint to bind, an S3 client to build)
CHECKED = [
    case
    for case in CASES
    if case not in ("runtime_dir is a file", "events endpoint cannot be bound")
    and not case.startswith("S3")
]


@pytest.mark.parametrize(
    ("command", "case"),
    [("serve", case) for case in CASES] + [("check-config", case) for case in CHECKED],
)
def test_a_start_the_config_cannot_give_exits_2_naming_the_key(
    tmp_path: Path, command: str, case: str
) -> None:
    tail, says = CASES[case]
    run = tmp_path / "run"
    if case == "runtime_dir is a file":
        run.write_text("not a directory")
    group = 'client_group = "hicached-no-such-group"\n' if case == "no such client group" else ""
    body = tail(tmp_path)
    shm = tmp_path
    if case.startswith("shm_dir"):
        shm = tmp_path / ("absent" if "not exist" in case else _file(tmp_path))
    config = tmp_path / "c.toml"
    config.write_text(
        f'[server]\nendpoint = "ipc://{tmp_path}/hicached.sock"\nruntime_dir = "{run}"\n{group}'
        f"[pool]\nsize_mib = 8\nslab_mib = 4\npopulate = false\nadopt = false\n"
        f'shm_dir = "{shm}"\n'
        + ("" if "[metrics]" in body else "[metrics]\nenabled = false\n")
        + body
    )
    how = ["serve", "--config"] if command == "serve" else [command]
    out = subprocess.run(
        [sys.executable, "-m", "hicached", *how, str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
