"""CURVE on tcp://: only peers with an authorized key get answers or events."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from hicached import Client, CurveKeys
from hicached.errors import DaemonUnavailable, DeadlineExceeded, HicachedError
from tests.support import NS, PAGE_TOKENS, Daemon, free_tcp_port, page_bytes_for


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "keygen", str(directory), name],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert f"{name}.key_secret" in out
    return directory / f"{name}.key", directory / f"{name}.key_secret"


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    made = {
        "server": keygen(tmp_path / "server", "daemon"),
        "engine": keygen(tmp_path / "clients", "engine"),
        "stranger": keygen(tmp_path / "strangers", "stranger"),
    }
    (tmp_path / "authorized").mkdir()
    (tmp_path / "authorized" / "engine.key").write_bytes(made["engine"][0].read_bytes())
    assert (made["server"][1].stat().st_mode & 0o777) == 0o600
    return made


def test_only_authorized_clients_and_subscribers_are_served(
    daemon_factory: Callable[..., Daemon], keys: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    server_public, server_secret = keys["server"]
    engine = CurveKeys.load(str(server_public), str(keys["engine"][1]))
    stranger = CurveKeys.load(str(server_public), str(keys["stranger"][1]))
    events, replay = free_tcp_port(), free_tcp_port()
    d = daemon_factory(
        tcp=True,
        curve=engine,
        tail=(
            f'[events]\nendpoint = "tcp://127.0.0.1:{events}"\n'
            f'replay_endpoint = "tcp://127.0.0.1:{replay}"\n'
            f'[curve]\nsecret_key_file = "{server_secret}"\n'
            f'authorized_keys_dir = "{tmp_path / "authorized"}"\n'
        ),
    )
    ctx = zmq.Context()
    subs = {}
    for who, curve in (("engine", engine), ("stranger", stranger), ("plain", None)):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if curve is not None:
            sub.curve_serverkey, sub.curve_publickey = curve.server_public, curve.public
            sub.curve_secretkey = curve.secret
        sub.connect(f"tcp://127.0.0.1:{events}")
        subs[who] = sub
    try:
        time.sleep(0.5)  # subscriptions reach the publisher
        with d.client() as c:  # the engine's keys: served, pool mapped on this host
            ns = c.register(**NS)
            toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
            assert c.store(ns, toks, page_bytes_for(toks)).published == 4
        with Client(d.endpoint, timeout=2.0, curve=engine, map_pool=False) as remote:
            ns = remote.register(**NS)  # as from another host: control calls only
            assert remote.match(ns, toks, lease=False).hits == 4
            with pytest.raises(HicachedError, match="map_pool=False"):
                remote.read_pages(remote.match(ns, toks))
        for curve in (stranger, None):  # an unknown key, or no CURVE at all: no answer
            with (
                pytest.raises((DeadlineExceeded, DaemonUnavailable)),
                Client(d.endpoint, timeout=1.0, curve=curve, map_pool=False) as other,
            ):
                other.stats()
        status = [sys.executable, "-m", "hicached", "status", "--endpoint", d.endpoint]
        out = subprocess.run(
            [
                *status,
                "--curve-server-key",
                str(server_public),
                "--curve-key",
                str(keys["engine"][1]),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0 and f"hicached at {d.endpoint}" in out.stdout, out.stderr
        half = subprocess.run(
            [*status, "--curve-key", str(keys["engine"][1])],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert half.returncode != 0 and "go together" in half.stderr
        assert subs["engine"].poll(5000), "the authorized subscriber got no events"
        topic, _seq, payload = subs["engine"].recv_multipart()
        assert topic.startswith(b"kv@") and msgspec.msgpack.decode(payload)
        for who in ("stranger", "plain"):
            assert not subs[who].poll(300), f"the {who} subscriber got events"
    finally:
        for sub in subs.values():
            sub.close()
        ctx.term()


def test_keygen_refuses_to_overwrite_or_to_take_a_path_as_name(tmp_path: Path) -> None:
    keygen(tmp_path, "host-1")
    for name in ("host-1", "../evil", "a/b"):
        out = subprocess.run(
            [sys.executable, "-m", "hicached", "keygen", str(tmp_path), name],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host-1.key", "host-1.key_secret"]


def test_off_loopback_needs_curve_and_curve_needs_its_files(tmp_path: Path) -> None:
    from hicached.config import parse_config
    from hicached.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unless \[curve\] keys"):
        parse_config('[server]\nendpoint = "tcp://0.0.0.0:5557"\n')
    with pytest.raises(ConfigError, match="go together"):
        parse_config('[curve]\nsecret_key_file = "/k"\n')
    config = parse_config(
        '[server]\nendpoint = "tcp://0.0.0.0:5557"\n'
        '[curve]\nsecret_key_file = "/k"\nauthorized_keys_dir = "/d"\n'
    )
    assert config.server.endpoint == "tcp://0.0.0.0:5557"
    # a daemon whose key file is missing says so and exits
    d = Daemon(
        tcp=True,
        tail=f'[curve]\nsecret_key_file = "{tmp_path / "nope"}"\n'
        f'authorized_keys_dir = "{tmp_path}"\n',
    )
    with pytest.raises(RuntimeError, match=r"curve\.secret_key_file: .*nope: cannot open it"):
        d.start(timeout=20)
    d.cleanup()
    # nor does one whose authorized keys include a file that holds no key
    # (it failed with a traceback)
    import zmq.auth

    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    keys.mkdir()
    authorized.mkdir()
    _, secret = zmq.auth.create_certificates(keys, "server")
    (authorized / "notakey.key").write_text("not a certificate\n")
    d = Daemon(
        tcp=True,
        tail=f'[curve]\nsecret_key_file = "{secret}"\nauthorized_keys_dir = "{authorized}"\n',
    )
    with pytest.raises(RuntimeError, match=r"curve\.authorized_keys_dir: cannot read .*notakey"):
        d.start(timeout=20)
    d.cleanup()
