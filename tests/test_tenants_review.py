"""Tenant isolation, from an outside review: what one tenant's process can learn
of another tenant through the daemon's other doors (KV events, replays).

The tests run client processes as other users (forks of this one that switch
uid, as in tests/test_arenas.py), against a daemon whose tenants are one
user's uid and another user's primary gid; they need root and useradd, and
are skipped, saying why, elsewhere.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq

from hicached import Client
from hicached.wire.events import BlockStored, decode_batch
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for
from tests.test_client_group import as_user, become
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


def _listen(events: str, replay: str, seconds: float) -> Callable[[], dict[str, object]]:
    """Subscribe to the events socket for ``seconds``, then ask the replay socket
    for every batch from 0: which of alpha's token ids were seen each way."""

    def work() -> dict[str, object]:
        ctx = zmq.Context()
        seen_live: set[int] = set()
        seen_replay: set[int] = set()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(events)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if sub.poll(100):
                    _, _, payload = sub.recv_multipart()
                    seen_live |= _stored_tokens(payload)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
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
