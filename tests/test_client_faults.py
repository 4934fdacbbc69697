"""The client against a daemon that misbehaves, and misuse of the client itself:
every call ends by its deadline with an error of hicached.errors.

A misbehaving daemon is a fake one (tests/fake_daemon.py, fault injection:
garbage, another request's id, the wrong reply, floods); the rest runs against
real daemons."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest
import zmq

import hicached
from hicached.cli import main
from hicached.config import ServerConfig
from hicached.errors import (
    BadRequest,
    DaemonUnavailable,
    DeadlineExceeded,
    HicachedError,
    VersionMismatch,
)
from hicached.wire import protocol as p
from tests.fake_daemon import FakeDaemon, hello_ok
from tests.support import NS, PAGE_TOKENS, Daemon, in_child, page_bytes_for


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


def _answering(reply_to_hello: object, reply_to_rest: object = None) -> object:
    """Answers hello with ``reply_to_hello(request)``, anything else with
    ``reply_to_rest(request)`` (fault injection: replies of the wrong kind)."""

    def behave(fake: FakeDaemon, peer: bytes, request: p.Request) -> None:
        make = reply_to_hello if isinstance(request, p.Hello) else reply_to_rest
        if make is not None:
            fake.send(peer, make(request))  # type: ignore[operator]

    return behave


@pytest.mark.parametrize(
    "reply",
    [
        lambda r: p.Ok(id=r.id),
        lambda r: p.MatchOk(id=r.id, hits=0, offsets=[]),
    ],
    ids=["ok", "match_ok"],
)
def test_a_hello_answered_with_another_reply_is_a_clear_error(reply: object) -> None:
    with FakeDaemon(_answering(reply)) as fake:  # type: ignore[arg-type]
        client = hicached.Client(fake.endpoint, timeout=1.0, map_pool=False)
        try:
            with pytest.raises(HicachedError, match="HelloOk"):
                client.connect()
        finally:
            client.close()


def test_a_hello_answered_in_another_major_version_is_refused() -> None:
    with FakeDaemon(_answering(lambda r: hello_ok(r, major=p.PROTOCOL_MAJOR + 1))) as fake:  # type: ignore[arg-type]
        client = hicached.Client(fake.endpoint, timeout=1.0, map_pool=False)
        try:
            with pytest.raises(VersionMismatch):
                client.connect()
        finally:
            client.close()


async def test_an_async_hello_answered_with_another_reply_is_a_clear_error() -> None:
    with FakeDaemon(_answering(lambda r: p.Ok(id=r.id))) as fake:  # type: ignore[arg-type]
        client = hicached.AsyncClient(fake.endpoint, timeout=1.0, map_pool=False)
        try:
            with pytest.raises(HicachedError, match="HelloOk"):
                await client.connect()
        finally:
            await client.close()


def test_a_namespace_registered_again_answered_with_another_reply_is_a_clear_error() -> None:
    hellos = iter([1, 2])  # the second hello is another instance: a restart

    def rest(request: p.Request) -> p.Reply:
        if isinstance(request, p.RegisterNamespace) and len(fake.requests) <= 2:
            return p.NamespaceOk(id=request.id, ns=7, digest=b"d" * 16)
        if isinstance(request, p.Stats):
            return p.Error(id=request.id, code="no_session", message="hello first")
        return p.Ok(id=request.id)  # the registration after the restart

    behave = _answering(lambda r: hello_ok(r, instance=next(hellos)), rest)
    with FakeDaemon(behave) as fake:  # type: ignore[arg-type]
        client = hicached.Client(fake.endpoint, timeout=1.0, map_pool=False)
        try:
            client.register(**NS)
            with pytest.raises(HicachedError, match="NamespaceOk"):
                client.stats()  # says hello again, registers again
        finally:
            client.close()


def test_status_against_something_that_is_not_a_daemon_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with FakeDaemon(_answering(lambda r: p.Ok(id=r.id))) as fake:  # type: ignore[arg-type]
        assert main(["status", "--endpoint", fake.endpoint, "--timeout", "1"]) == 2
    assert "HelloOk" in capsys.readouterr().err


def test_a_client_used_in_a_forked_child_says_so_and_leaves_the_parents_session(
    daemon: Daemon,
) -> None:
    with daemon.client(timeout=1.0) as c:
        ns = c.register(**NS)
        toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
        hit = c.match(ns, toks)

        def child() -> str:
            try:
                c.stats()
            except BadRequest as exc:
                said = f"BadRequest: {exc}"
            c.close()  # only this process's copy: the parent's session stays
            return said

        assert in_child(child).startswith("BadRequest: this client was made in another process")
        assert np.array_equal(c.read_pages(hit), page_bytes_for(toks))
        c.release(hit)  # the parent's lease is still its own
        assert c.stats().leases == 0


async def test_an_async_client_used_in_a_forked_child_says_so(daemon: Daemon) -> None:
    c = hicached.AsyncClient(daemon.endpoint, timeout=1.0)
    try:
        await c.connect()

        def child() -> str:
            return str(asyncio.run(c.stats()).instance)

        assert in_child(child).startswith("BadRequest: this client was made in another process")
        assert (await c.stats()).clients >= 1
    finally:
        await c.close()


def test_a_client_shared_by_threads_gives_each_call_its_own_reply(daemon: Daemon) -> None:
    """Calls from several threads on one Client take turns: none takes another's
    reply (which timed both out and left the other's lease held)."""
    failures: list[BaseException] = []
    with daemon.client(timeout=5.0) as c:
        ns = c.register(**NS)

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(40):
                    toks = rng.integers(0, 50_000, 4 * PAGE_TOKENS).astype(np.uint32)
                    c.store(ns, toks, page_bytes_for(toks))
                    hit = c.match(ns, toks)
                    assert np.array_equal(c.read_pages(hit), page_bytes_for(toks))
                    c.release(hit)
            except BaseException as exc:  # pragma: no cover - reported below
                failures.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not failures, failures
        assert c.stats().leases == 0


def test_close_during_a_call_on_another_thread_ends_the_call_cleanly(daemon: Daemon) -> None:
    """close() while a call waits on a daemon that hangs: the call fails with
    DaemonUnavailable, close returns, and later calls say the client is closed
    (a closed socket under the waiting call raised zmq's errors, or libzmq
    aborted the process)."""
    c = daemon.client(timeout=10.0)
    c.register(**NS)
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            c.stats()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.3)  # the call is waiting for its reply
        c.close()
        t.join(10)
        assert not t.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], DaemonUnavailable), outcome
        with pytest.raises(BadRequest, match="closed"):
            c.stats()
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)


async def test_an_async_client_refuses_calls_once_closed(daemon: Daemon) -> None:
    c = hicached.AsyncClient(daemon.endpoint, timeout=2.0)
    await c.connect()
    await c.close()
    with pytest.raises(BadRequest, match="closed"):
        await c.stats()
    await c.close()  # twice is fine


def test_an_async_client_moves_to_a_new_event_loop_once_the_old_one_ended(
    daemon: Daemon,
) -> None:
    """One AsyncClient through two asyncio.run()s (its semaphore and lock were the
    first loop's: calls that waited on them in the second raised RuntimeError)."""
    c = hicached.AsyncClient(daemon.endpoint, timeout=5.0, max_in_flight=2)

    async def burst() -> list[object]:
        return await asyncio.gather(*[c.stats() for _ in range(8)], return_exceptions=True)

    first = asyncio.run(burst())
    second = asyncio.run(burst())
    asyncio.run(c.close())
    assert all(isinstance(s, p.DaemonStats) for s in first + second), first + second


def test_an_async_client_in_use_on_one_loop_is_refused_on_another(daemon: Daemon) -> None:
    c = hicached.AsyncClient(daemon.endpoint, timeout=5.0)
    busy, leave = threading.Event(), threading.Event()

    async def hold() -> None:
        await c.stats()
        busy.set()
        await asyncio.to_thread(leave.wait, 30)  # the first loop still runs, with the client

    t = threading.Thread(target=asyncio.run, args=(hold(),))
    t.start()
    try:
        assert busy.wait(10)
        with pytest.raises(BadRequest, match="another event loop"):
            asyncio.run(c.stats())
    finally:
        leave.set()
        t.join(10)
    asyncio.run(c.close())


@pytest.mark.parametrize("what", ["timeout", "connect_timeout"])
def test_a_timeout_too_long_for_a_deadline_is_refused(what: str) -> None:
    """A deadline in milliseconds must fit the wire's integer: 1e300 seconds
    raised msgspec's OverflowError on every call."""
    with pytest.raises(BadRequest, match=what):
        hicached.Client("tcp://127.0.0.1:5557", **{what: 1e300})  # type: ignore[arg-type]


def test_status_with_a_timeout_too_long_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--endpoint", "tcp://127.0.0.1:5557", "--timeout", "1e300"]) == 2
    assert "timeout" in capsys.readouterr().err


# Fault injection: a reply larger than the client takes. The fake daemon
# answers the first stats after hello with a valid StatsOk of 4 MiB (as a
# broken or hostile endpoint might send gigabytes); the client takes at most
# 1 MiB. libzmq refuses the message from its length header and drops the
# connection; the client dials again, so the next call is answered.
_REPLY_BOUND = 1 << 20


def _stats(request: p.Request, backend: str = "") -> p.StatsOk:
    figures = (
        "uptime_s pool_bytes pool_used_bytes pool_free_bytes slab_bytes pages pinned_pages "
        "reserved_pages namespaces clients leases evicted_pages expired_leases"
    )
    zero = dict.fromkeys(figures.split(), 0)
    stats = p.DaemonStats(
        instance=1, requests={}, errors={}, dropped={}, l3_backend=backend, **zero
    )
    return p.StatsOk(id=request.id, stats=stats)


def _oversized_once(sent: list[int]) -> object:
    def behave(fake: FakeDaemon, peer: bytes, request: p.Request) -> None:
        if isinstance(request, p.Hello):
            fake.send(peer, hello_ok(request))
        elif not sent:
            payload = p.encode(_stats(request, "x" * (4 * _REPLY_BOUND)))
            sent.append(len(payload))
            fake.send(peer, payload)
        else:
            fake.send(peer, _stats(request))

    return behave


def test_a_reply_over_max_reply_bytes_is_refused_and_the_next_call_is_answered() -> None:
    sent: list[int] = []
    with FakeDaemon(_oversized_once(sent)) as fake:  # type: ignore[arg-type]
        client = hicached.Client(
            fake.endpoint, timeout=2.0, map_pool=False, max_reply_bytes=_REPLY_BOUND
        )
        try:
            client.connect()
            with pytest.raises(DaemonUnavailable, match="max_reply_bytes"):
                client.stats()
            assert sent and sent[0] > 4 * _REPLY_BOUND  # the message did go out
            assert client.stats().l3_backend == ""  # dialled again: answered
        finally:
            client.close()


async def test_an_async_reply_over_max_reply_bytes_is_refused_and_a_later_call_answered() -> None:
    sent: list[int] = []
    with FakeDaemon(_oversized_once(sent)) as fake:  # type: ignore[arg-type]
        client = hicached.AsyncClient(
            fake.endpoint, timeout=0.5, map_pool=False, max_reply_bytes=_REPLY_BOUND
        )
        try:
            await client.connect()
            with pytest.raises(DaemonUnavailable, match="max_reply_bytes"):
                await client.stats()
            assert sent and sent[0] > 4 * _REPLY_BOUND
            assert (await client.stats()).l3_backend == ""  # dialled again: answered
        finally:
            await client.close()


def test_a_daemon_whose_replies_may_pass_max_reply_bytes_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    big = _answering(lambda r: hello_ok(r, max_pages_per_request=1 << 20))
    with FakeDaemon(big) as fake:  # type: ignore[arg-type]
        client = hicached.Client(
            fake.endpoint, timeout=1.0, map_pool=False, max_reply_bytes=_REPLY_BOUND
        )
        try:
            client.connect()
        finally:
            client.close()
    assert "max_reply_bytes" in caplog.text and "1048576 pages" in caplog.text


def test_the_default_reply_bound_holds_what_a_default_daemon_sends() -> None:
    with FakeDaemon(_answering(hello_ok)) as fake:  # type: ignore[arg-type]
        client = hicached.Client(fake.endpoint, timeout=1.0, map_pool=False)
        try:
            assert client.max_reply_bytes == p.MAX_REPLY_BYTES
            assert client._sock.getsockopt(zmq.MAXMSGSIZE) == p.MAX_REPLY_BYTES
        finally:
            client.close()
    pages = ServerConfig().max_pages_per_request
    assert pages * p.REPLY_BYTES_PER_PAGE + p.REPLY_BYTES_BESIDE_PAGES <= p.MIN_REPLY_BYTES
    with pytest.raises(BadRequest, match="max_reply_bytes"):
        hicached.Client("tcp://127.0.0.1:5557", max_reply_bytes=4096)
