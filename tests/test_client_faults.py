"""The client against a daemon that misbehaves, and misuse of the client itself:
every call ends by its deadline with an error of hicached.errors.

A misbehaving daemon is a fake one (tests/fake_daemon.py, fault injection:
garbage, another request's id, the wrong reply, floods); the rest runs against
real daemons."""

from __future__ import annotations

import threading

import pytest

import hicached
from hicached.errors import DeadlineExceeded
from hicached.wire import protocol as p
from tests.fake_daemon import FakeDaemon, hello_ok


def _flooding(done: threading.Event) -> object:
    """Answers hello, then answers the next request with a stream of messages
    that are none of its reply (undecodable bytes and replies under other ids)
    until the test is over or 60 s passed."""

    def behave(fake: FakeDaemon, peer: bytes, request: p.Request) -> None:
        if isinstance(request, p.Hello):
            fake.send(peer, hello_ok(request))
            return
        garbage, other = b"\xc1 not msgpack", p.encode(p.Ok(id=request.id + 1000))
        for _ in range(3_000_000):
            if done.is_set():
                return
            fake.send(peer, garbage)
            fake.send(peer, other)
        done.set()  # the flood ran out before the call ended

    return behave


def test_a_flood_of_messages_that_are_not_the_reply_ends_the_call_at_its_deadline() -> None:
    done = threading.Event()
    with FakeDaemon(_flooding(done)) as fake:  # type: ignore[arg-type]
        client = hicached.Client(fake.endpoint, timeout=0.3, map_pool=False)
        try:
            client.connect()
            with pytest.raises(DeadlineExceeded):
                client.stats()
            assert not done.is_set(), "the call ended only when the flood did"
        finally:
            done.set()
            client.close()
