"""Bounded tables on a real daemon: sessions, namespaces, clients that fail fast."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import zmq

import hicached
from hicached import protocol as p
from hicached.errors import BadRequest, DaemonUnavailable, DeadlineExceeded
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for


def _hello(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
    """A client that says hello and goes away without a goodbye."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(p.encode(p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)))
        assert sock.poll(5000), "no reply to hello"
        assert isinstance(p.reply_decoder.decode(sock.recv()), p.HelloOk)
    finally:
        sock.close()


def test_a_hello_flood_never_locks_out_status_or_an_engine(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(extra="max_clients = 64")
    with d.client() as engine:
        ns = engine.register(**NS)
        toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
        engine.store(ns, toks, page_bytes_for(toks))
        hit = engine.match(ns, toks)  # a lease: this session is never the one to go
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            for _ in range(1100):
                _hello(ctx, d.endpoint)
        finally:
            ctx.term()
        with d.client() as status:  # what `hicached status` does
            stats = status.stats()
        assert stats.clients <= 64
        assert np.array_equal(engine.read_pages(hit), page_bytes_for(toks))
        engine.release(hit)  # the same session: its lease is still known
        assert engine.stats().requests["hello"] >= 1101


def test_probes_leave_the_session_count_flat(daemon: Daemon) -> None:
    for _ in range(200):
        with daemon.client() as probe:
            probe.stats()
    with daemon.client() as c:
        stats = c.stats()
        assert stats.clients == 1  # each probe said goodbye
        assert stats.requests["goodbye"] >= 200


def test_namespaces_are_reclaimed_when_nobody_uses_them(
    daemon_factory: Callable[..., Daemon],
) -> None:
    # 1 MiB pool: 256 pages of 4 KiB; at most 2 namespaces at once
    d = daemon_factory(size_mib=1, extra="")
    d.stop()
    d.config.write_text(d.config.read_text().replace("[pool]\n", "[pool]\nmax_namespaces = 2\n"))
    d.start()
    for i in range(50):  # registered, unused, gone with the client
        with d.client() as c:
            c.register(**{**NS, "model": f"test/idle-{i}"})
    full = np.arange(256 * PAGE_TOKENS, dtype=np.uint32)
    pages = page_bytes_for(full)
    for i in range(6):  # each fills the pool: the previous one's pages go, then it does
        with d.client() as c:
            ns = c.register(**{**NS, "model": f"test/full-{i}"})
            assert c.store(ns, full, pages).published == 256
    with d.client() as c:
        assert c.stats().namespaces == 1  # the last one, kept by its pages
        c.register(**{**NS, "model": "test/another"})
        c.register(**{**NS, "model": "test/and-another"})  # the unused one makes way
        assert c.stats().namespaces == 2
        with pytest.raises(hicached.HicachedError, match="max_namespaces"):
            c.register(**{**NS, "model": "test/one-too-many"})  # both are in use


def test_a_call_to_a_stopped_daemon_fails_at_once(daemon: Daemon) -> None:
    c = daemon.client(timeout=5.0)
    try:
        c.stats()
        daemon.stop()
        started = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            c.stats()
        assert time.monotonic() - started < 2.0, "it waited for the request timeout"
    finally:
        c.close()


async def test_the_async_reader_restarts_after_a_failure(daemon: Daemon) -> None:
    async with hicached.AsyncClient(daemon.endpoint) as c:
        await c.stats()
        reader = c._reader
        assert reader is not None
        reader.cancel()  # the reader ends (fault injection)
        await asyncio.wait([reader])
        assert (await c.stats()).clients == 1  # a new reader answers


async def test_a_call_queued_behind_max_in_flight_keeps_its_own_deadline(
    daemon: Daemon,
) -> None:
    """The daemon stops answering (SIGSTOP): five calls behind one slot each
    fail at about their own timeout, not one after another's."""
    assert daemon.proc is not None
    async with hicached.AsyncClient(daemon.endpoint, timeout=1.0, max_in_flight=1) as c:
        await c.stats()
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            results = await asyncio.gather(*(c.stats() for _ in range(5)), return_exceptions=True)
            waited = time.monotonic() - started
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert all(isinstance(r, DeadlineExceeded) for r in results), results
        assert waited < 3.0, f"queued calls waited {waited:.2f}s (one after another: 5.0s)"


@pytest.mark.parametrize("bound", [0, -1, 1.5, True])
async def test_max_in_flight_is_a_whole_number_of_requests(daemon: Daemon, bound: object) -> None:
    """max_in_flight = 0 made every call wait out its timeout and fail with
    "0 requests stayed in flight" (no call could ever be sent); -1 failed at
    the first call with asyncio's ValueError. Refused where it is given."""
    with pytest.raises(BadRequest, match="max_in_flight"):
        hicached.AsyncClient(daemon.endpoint, timeout=0.4, max_in_flight=bound)  # type: ignore[arg-type]
    async with hicached.AsyncClient(daemon.endpoint, timeout=1.0, max_in_flight=1) as c:
        assert (await c.stats()).clients >= 1  # the bound itself serves


def test_replies_ignore_fields_a_newer_daemon_adds() -> None:
    newer = msgspec.msgpack.encode(
        {"op": "match_ok", "id": 3, "hits": 1, "offsets": [0], "lease": 9, "new_field": [1, 2]}
    )
    reply = p.reply_decoder.decode(newer)
    assert isinstance(reply, p.MatchOk) and reply.lease == 9


def _raw_session(
    endpoint: str, option: int, value: int
) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes], int]:
    """A bare DEALER (with one socket option set) that said hello and registered NS."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(option, value)
    sock.connect(endpoint)
    sock.send(p.encode(p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)))
    assert sock.poll(5000)
    sock.recv()
    sock.send(p.encode(p.RegisterNamespace(id=2, spec=p.NamespaceSpec(**NS))))  # type: ignore[arg-type]
    assert sock.poll(5000)
    ok = p.reply_decoder.decode(sock.recv())
    assert isinstance(ok, p.NamespaceOk)
    return ctx, sock, ok.ns


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_queued_requests_are_bounded_in_bytes(daemon_factory: Callable[..., Daemon]) -> None:
    """1,000 requests of 1 MiB sent at once to a daemon slower than the sender: the
    daemon reads them as it goes (backpressure), its memory does not hold them all."""
    d = daemon_factory(size_mib=64)
    assert d.proc is not None
    pid = d.proc.pid
    ctx, sock, ns_id = _raw_session(d.endpoint, zmq.SNDHWM, 2000)
    try:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 1 << 30, (1 << 18) - 64, dtype=np.uint32).tobytes()
        base = _rss_kib(pid)
        # reserves of ~16K pages each (slow to serve), all different
        for i in range(1000):
            seq = tokens[: -4 * (i + 1)] + i.to_bytes(4, "little")
            sock.send(p.encode(p.Reserve(id=10 + i, ns=ns_id, tokens=seq)))
        peak, answered = 0, 0
        while answered < 1000 and sock.poll(30_000):
            sock.recv()
            answered += 1
            if answered % 20 == 0:
                peak = max(peak, _rss_kib(pid))
        assert answered == 1000  # nothing was lost to the bound
        grew_mib = (peak - base) / 1024
        assert grew_mib < 200, f"the daemon grew by {grew_mib:.0f} MiB"  # unbounded: ~780
    finally:
        sock.close()
        ctx.term()


def test_pages_of_departed_clients_never_lock_out_a_new_namespace(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(size_mib=4, extra="")
    d.stop()
    d.config.write_text(d.config.read_text().replace("[pool]\n", "[pool]\nmax_namespaces = 2\n"))
    d.start()
    toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
    for i in range(6):  # each leaves its pages behind in a pool with room to spare
        with d.client() as c:
            ns = c.register(**{**NS, "model": f"test/gone-{i}"})
            assert c.store(ns, toks, page_bytes_for(toks)).published == 4
    with d.client() as c:
        stats = c.stats()
        assert stats.namespaces <= 2 and stats.pages <= 8  # the oldest made way
        ns = c.register(**{**NS, "model": "test/newest"})
        assert c.store(ns, toks, page_bytes_for(toks)).published == 4


async def test_an_async_burst_larger_than_the_reply_queue_loses_nothing(daemon: Daemon) -> None:
    async with hicached.AsyncClient(daemon.endpoint, timeout=30.0) as c:
        ns = await c.register(**NS)
        toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
        await c.store(ns, toks, page_bytes_for(toks))
        hits = await asyncio.gather(*(c.match(ns, toks) for _ in range(3000)))
        assert all(hit.hits == 4 for hit in hits)
        await asyncio.gather(*(c.release(hit) for hit in hits))
        stats = await c.stats()
        assert stats.leases == 0 and stats.dropped.get("send_full", 0) == 0


def test_replies_a_client_never_reads_are_bounded_and_release_their_leases(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(size_mib=64)
    assert d.proc is not None
    pid = d.proc.pid
    with d.client() as c:
        ns = c.register(**NS)
        toks = np.arange(16000 * PAGE_TOKENS, dtype=np.uint32)  # 16,000 pages: long replies
        c.store(ns, toks, np.zeros((16000, 4096), dtype=np.uint8))
    ctx, sock, ns_id = _raw_session(d.endpoint, zmq.RCVHWM, 1)  # it reads nothing back
    try:
        base = _rss_kib(pid)
        packed = toks.tobytes()
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sent = 0
        for i in range(3000):
            try:
                sock.send(p.encode(p.Match(id=10 + i, ns=ns_id, tokens=packed)))
            except zmq.Again:
                break  # the daemon reads this client no further: backpressure
            sent += 1
        time.sleep(2.0)
        grew_mib = (_rss_kib(pid) - base) / 1024
    finally:
        sock.close()
        ctx.term()
    with d.client() as c:
        deadline = time.monotonic() + 10
        while (stats := c.stats()).dropped.get("send_full", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sent > 1000 and stats.dropped.get("send_full", 0) > 0
        # the leases of replies that could not be sent ended with them
        assert stats.leases <= sent - stats.dropped["send_full"]
    assert grew_mib < 200, f"the daemon grew by {grew_mib:.0f} MiB"


@pytest.mark.parametrize("tcp", [False, True], ids=["ipc", "tcp"])
def test_a_reply_whose_client_is_gone_ends_the_lease_it_granted(
    daemon_factory: Callable[..., Daemon], tcp: bool
) -> None:
    """A client sends a reserve and disconnects before the daemon reads it
    (held by SIGSTOP): the reply has nowhere to go (``unroutable``), so the
    lease it granted ends at once, as one whose reply finds a full queue
    does, instead of holding its slots until leases.ttl_s.

    Woken together, the daemon's I/O thread may see the disconnect only after
    the reply went into the closing connection (lost there: that lease ends
    at its TTL), or before the request was read (the request is lost with
    it); so clients are sent until one reply is unroutable, and every lease
    still held is one of a reply that went out."""
    d = daemon_factory(tcp=tcp)
    assert d.proc is not None
    tokens = np.arange(4 * PAGE_TOKENS, dtype=np.uint32).tobytes()
    sent_out = 0  # replies that went into a closing connection: their leases remain
    with d.client() as c:
        for _ in range(20):
            before = c.stats()
            ctx, sock, ns_id = _raw_session(d.endpoint, zmq.LINGER, 2000)
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                sock.send(p.encode(p.Reserve(id=3, ns=ns_id, tokens=tokens)))
                sock.close()
                ctx.term()  # lingers until the request is written, then disconnects
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 3
            served = before.requests.get("reserve", 0) + 1
            while (stats := c.stats()).requests.get("reserve", 0) < served:
                if time.monotonic() > deadline:
                    break  # read only after its connection was gone: lost with it
                time.sleep(0.05)
            unroutable = stats.dropped.get("unroutable", 0) - before.dropped.get("unroutable", 0)
            if stats.requests.get("reserve", 0) == served and not unroutable:
                sent_out += 1
            held = (stats.leases, stats.reserved_pages)
            assert held == (sent_out, 4 * sent_out), (held, sent_out)
            if unroutable:
                return
        raise AssertionError("no reply of 20 was unroutable")
