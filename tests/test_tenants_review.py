"""Tenant isolation, from an outside review: what one tenant's process can learn
of another tenant through the daemon's other doors (KV events, replays).

The tests run client processes as other users (forks of this one that switch
uid, as in tests/test_arenas.py), against a daemon whose tenants are one
user's uid and another user's primary gid; they need root and useradd, and
are skipped, saying why, elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from hicached import Client, CurveKeys
from hicached.config import parse_config
from hicached.errors import ConfigError
from hicached.wire.events import BlockStored, decode_batch
from tests.support import NS, PAGE_TOKENS, Daemon, free_tcp_port, page_bytes_for
from tests.test_client_group import as_user, become
from tests.test_reload import _sighup
from tests.test_tenants import Users, users

_ = (users,)  # a fixture, used by name
MARK = 7_000_000  # alpha's token ids start here: no other test stores them


def _pw(uid: int) -> pwd.struct_passwd:
    return pwd.getpwuid(uid)


def _tokens() -> np.ndarray:
    return np.arange(MARK, MARK + 4 * PAGE_TOKENS, dtype=np.uint32)


def _stored_tokens(payload: bytes) -> set[int]:
    batch = decode_batch(payload)
    return {t for e in batch.events if isinstance(e, BlockStored) for t in e.token_ids}


def _listen(
    events: str, replay: str, seconds: float, curve: CurveKeys | None = None
) -> Callable[[], dict[str, object]]:
    """Subscribe to the events socket for ``seconds``, then ask the replay socket
    for every batch from 0: which of alpha's token ids were seen each way."""

    def work() -> dict[str, object]:
        ctx = zmq.Context()
        seen_live: set[int] = set()
        seen_replay: set[int] = set()

        def socket(kind: int, where: str) -> zmq.Socket[bytes]:
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                sock.curve_serverkey = curve.server_public
                sock.curve_publickey = curve.public
                sock.curve_secretkey = curve.secret
            if kind == zmq.SUB:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(where)
            return sock

        try:
            sub = socket(zmq.SUB, events)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if sub.poll(100):
                    _, _, payload = sub.recv_multipart()
                    seen_live |= _stored_tokens(payload)
            dealer = socket(zmq.DEALER, replay)
            dealer.setsockopt(zmq.SNDTIMEO, 2000)
            # refused, the daemon closed the connection: none is left to send on
            with contextlib.suppress(zmq.Again):
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while dealer.poll(1500):
                frames = dealer.recv_multipart()
                if len(frames) != 4 or not frames[1]:
                    break
                seen_replay |= _stored_tokens(frames[3])
        finally:
            ctx.destroy(linger=0)
        mark = set(range(MARK, MARK + 4 * PAGE_TOKENS))
        return {"live": len(seen_live & mark), "replay": len(seen_replay & mark)}

    return work


class _Forked:
    """``work`` in a fork of this process as ``user``, running while the test goes on."""

    def __init__(self, user: pwd.struct_passwd, work: Callable[[], dict[str, object]]) -> None:
        self.user = user
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no pytest from here on, only os._exit
            code = 0
            try:
                os.close(read)
                become(user)
                result = work()
            except BaseException as exc:
                result, code = {"crash": f"{type(exc).__name__}: {exc}"}, 1
            try:
                os.write(write, json.dumps(result).encode())
            finally:
                os._exit(code)
        os.close(write)
        self.pid, self.read = pid, read

    def result(self, timeout: float = 30.0) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                raise AssertionError(f"the process as {self.user.pw_name} did not finish")
            time.sleep(0.02)
        with os.fdopen(self.read, "rb") as pipe:
            return dict(json.loads(pipe.read() or b"{}"))


def _store(endpoint: str) -> Callable[[], dict[str, object]]:
    def work() -> dict[str, object]:
        with Client(endpoint, timeout=5.0) as c:
            ns = c.register(**NS)
            c.store(ns, _tokens(), page_bytes_for(_tokens()))
        return {"stored": True}

    return work


@pytest.fixture
def events_daemon(users: Users) -> Iterator[Daemon]:
    """tests/test_tenants.py's tenant daemon, with KV events and replay over ipc
    in its runtime directory (the directory its client group reaches)."""
    (alpha_uid, _), (_, beta_gid), _ = users.ids
    d = Daemon(
        size_mib=16,
        extra=f'client_group = "{users.group}"',
        tail=(
            f"[tenants.alpha]\nuids = [{alpha_uid}]\n"
            f"[tenants.beta]\ngids = [{beta_gid}]\n"
            "[events]\nflush_interval_s = 0.05\n"
        ),
    )
    text = d.config.read_text().replace(
        "[events]\n",
        f'[events]\nendpoint = "ipc://{d.runtime}/events.sock"\n'
        f'replay_endpoint = "ipc://{d.runtime}/replay.sock"\n',
    )
    d.config.write_text(text)
    os.chmod(d.dir, 0o711)
    try:
        yield d.start()
    finally:
        d.cleanup()


@pytest.mark.timeout(120)
def test_a_tenants_process_reads_no_other_tenants_kv_events(
    events_daemon: Daemon, users: Users
) -> None:
    """beta's user reaches the request socket (the client group), so it must not
    read the events of alpha's pages there either: they carry alpha's token ids."""
    (a_uid, _), (b_uid, _), _ = users.ids
    events = f"ipc://{events_daemon.runtime}/events.sock"
    replay = f"ipc://{events_daemon.runtime}/replay.sock"
    beta = _Forked(_pw(b_uid), _listen(events, replay, 4.0))
    # the daemon's own user (an operator's router) does see them: events flow
    mine = _Forked(_pw(os.getuid()), _listen(events, replay, 4.0))
    time.sleep(1.0)  # both subscriptions reach the daemon
    assert as_user(_pw(a_uid), _store(events_daemon.endpoint)) == {"stored": True}
    seen_by_daemon_user = mine.result()
    assert seen_by_daemon_user == {"live": 4 * PAGE_TOKENS, "replay": 4 * PAGE_TOKENS}
    assert beta.result() == {"live": 0, "replay": 0}


# -- KV events over tcp ----------------------------------------------------------------


def _keygen(directory: Path, name: str) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    return Path(public), Path(secret)


@pytest.mark.timeout(120)
def test_a_tenants_curve_key_subscribes_to_no_kv_events(tmp_path: Path) -> None:
    """Over tcp every tenant's CURVE key is authorized, for its requests: it must
    not open the events sockets too, which carry every tenant's pages. A key
    that no tenant lists (a router's) does."""
    server_public, server_secret = _keygen(tmp_path / "server", "daemon")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    made = {name: _keygen(tmp_path / "clients", name) for name in ("a1", "b1", "router")}
    for name, (public, _) in made.items():
        shutil.copy(public, authorized / f"{name}.key")
    events, replay = (f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2))
    keys = {n: CurveKeys.load(str(server_public), str(secret)) for n, (_, secret) in made.items()}
    d = Daemon(
        tcp=True,
        curve=keys["a1"],
        tail=(
            f'[curve]\nsecret_key_file = "{server_secret}"\n'
            f'authorized_keys_dir = "{authorized}"\n'
            '[tenants.alpha]\ncurve_keys = ["a1.key"]\n'
            '[tenants.beta]\ncurve_keys = ["b1.key"]\n'
            f'[events]\nendpoint = "{events}"\nreplay_endpoint = "{replay}"\n'
            "flush_interval_s = 0.05\n"
        ),
    )
    try:
        d.start()
        beta = _Forked(_pw(os.getuid()), _listen(events, replay, 4.0, keys["b1"]))
        router = _Forked(_pw(os.getuid()), _listen(events, replay, 4.0, keys["router"]))
        time.sleep(1.0)  # both subscriptions reach the daemon
        with Client(d.endpoint, timeout=5.0, curve=keys["a1"]) as alpha:
            ns = alpha.register(**NS)
            alpha.store(ns, _tokens(), page_bytes_for(_tokens()))
        assert router.result() == {"live": 4 * PAGE_TOKENS, "replay": 4 * PAGE_TOKENS}
        assert beta.result() == {"live": 0, "replay": 0}
    finally:
        d.cleanup()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (  # no CURVE: every local process reaches a loopback port
            '[tenants.a]\nuids = [1001]\n[events]\nendpoint = "tcp://127.0.0.1:5560"\n',
            "events.endpoint: with [tenants]",
        ),
        (
            '[tenants.a]\nuids = [1001]\n[events]\nendpoint = "ipc:///tmp/e.sock"\n'
            'replay_endpoint = "tcp://127.0.0.1:5561"\n',
            "events.replay_endpoint: with [tenants]",
        ),
        (  # with CURVE, an others tenant over tcp takes every key a router could have
            '[server]\nendpoint = "tcp://127.0.0.1:5557"\n'
            '[curve]\nsecret_key_file = "/k/d.key_secret"\nauthorized_keys_dir = "/k"\n'
            '[tenants.a]\nothers = true\n[events]\nendpoint = "tcp://127.0.0.1:5560"\n',
            "events.endpoint: tenants.a takes every CURVE key",
        ),
    ],
)
def test_tenants_refuse_kv_events_on_tcp_that_tenants_reach(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(text)


# -- SIGHUP while a tenant holds leases -------------------------------------------------


def test_sighup_that_removes_a_tenant_or_moves_its_uid_changes_no_ones_tenant(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A reload that drops alpha and gives its uid to beta, while alpha's client
    holds a lease and its arena is mapped: refused until a restart, so alpha's
    handle reads alpha's bytes, and its connection stays alpha's (a register
    after it still gets alpha's namespace, not beta's)."""
    me = os.getuid()
    d = daemon_factory(tail=f"[tenants.alpha]\nuids = [{me}]\n[tenants.beta]\nuids = [65000]\n")
    base = d.config.read_text()
    toks = _tokens()
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, toks, page_bytes_for(toks))
        held = c.match(ns, toks)
        assert held.hits == 4
        moved = base.replace(f"[tenants.alpha]\nuids = [{me}]\n", "").replace(
            "uids = [65000]", f"uids = [65000, {me}]"
        )
        lines = _sighup(d, moved)
        assert "tenants.alpha changed" in lines and "tenants.beta.uids changed" in lines, lines
        assert np.array_equal(c.read_pages(held), page_bytes_for(toks))
        assert c.register(**NS).digest == ns.digest
        c.release(held)
    with d.client() as fresh:  # a new connection: still alpha's, by the running config
        again = fresh.register(**NS)
        assert again.digest == ns.digest
        assert fresh.match(again, toks, lease=False).hits == 4
