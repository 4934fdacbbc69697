"""The client under races: calls of other tasks and threads, daemon restarts,
close() and fork() meeting a call or a copy half-way. Every case ends with
the key's own bytes or an error of hicached.errors, by its deadline; all run
against real daemons."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import hicached
from hicached.errors import (
    BadRequest,
    DaemonUnavailable,
    DeadlineExceeded,
    HicachedError,
    StaleHandle,
    UnknownLease,
)
from hicached.wire.protocol import DaemonStats
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon, in_child, page_bytes_for


def test_an_async_hello_while_another_task_says_hello_keeps_the_new_ids(daemon: Daemon) -> None:
    """After a restart, a task whose exchange meets the lost session says hello
    again; a second task that says hello meanwhile reset every namespace id to
    0 once the first had registered them, so the first task's request went
    out as namespace 0 (UnknownNamespace). A hello to the instance the ids
    are already of keeps them."""

    async def run() -> None:
        async with hicached.AsyncClient(daemon.endpoint, timeout=3.0) as c:
            a = await c.register(**{**NS, "model": "test/a"})
            await c.register(**{**NS, "model": "test/b"})
            daemon.kill()
            daemon.start()
            toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
            loop = asyncio.get_running_loop()
            first = loop.create_task(c.store(a, toks, page_bytes_for(toks)))
            # the first task has the new daemon's HelloOk and registers its namespaces
            for _ in range(100_000):
                if c._hello is None and a.id == 0:
                    break
                await asyncio.sleep(0)
            else:
                pytest.fail("the first task never said hello to the new daemon")
            second = loop.create_task(c.stats())  # says hello of its own meanwhile
            assert (await first).published == 2
            await second
            hit = await c.match(a, toks)
            assert np.array_equal(c.read_pages(hit), page_bytes_for(toks))
            await c.release(hit)

    asyncio.run(run())


def test_a_forked_child_is_told_at_once_though_a_parent_thread_held_the_client(
    daemon: Daemon,
) -> None:
    """fork() while another thread of the parent is in a call: the child's copy
    of the turn is held by a thread the child does not have. A call there
    waited out its timeout and raised DeadlineExceeded ("calls of other
    threads held this client"), and close() raised too, leaving the child's
    copy of the socket and mapping open; the call is refused at once, saying
    why, and close() closes."""
    c = daemon.client(timeout=3.0)
    c.register(**NS)
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # the parent's call waits for its reply
    waiting = threading.Thread(target=_quietly, args=(c.stats,))
    try:
        waiting.start()
        time.sleep(0.3)

        def child() -> str:
            started = time.monotonic()
            try:
                c.stats()
                said = "answered"
            except HicachedError as exc:
                said = f"{type(exc).__name__}: {exc}"
            c.close()
            return f"{said} | {time.monotonic() - started:.1f}s"

        said, took = in_child(child).rsplit(" | ", 1)
        assert said.startswith("BadRequest: this client was made in another process"), said
        assert float(took.rstrip("s")) < 2.0  # not the call's timeout (3 s)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        waiting.join(10)
        c.close()


def test_an_async_client_closes_in_a_forked_child(daemon: Daemon) -> None:
    """close() of an AsyncClient in a forked child closes the child's copies
    (it raised BadRequest, like a call, from its event-loop check); the
    parent's session goes on."""

    async def run() -> None:
        c = hicached.AsyncClient(daemon.endpoint, timeout=2.0)
        try:
            await c.connect()

            def child() -> str:
                asyncio.run(c.close())
                return "closed"

            assert in_child(child) == "closed"
            assert (await c.stats()).clients >= 1
        finally:
            await c.close()

    asyncio.run(run())


def _quietly(call: Callable[[], object]) -> None:
    """``call()`` on a thread of its own, whatever error of the client ends it."""
    with contextlib.suppress(HicachedError):
        call()


def test_close_while_other_threads_copy_ends_their_copies_with_errors_of_the_client(
    daemon: Daemon,
) -> None:
    """close() unmaps the pool while other threads copy through handles (copies
    take no turn): a copy that had begun finishes on memory it keeps mapped,
    one that begins after the close is refused; the race raised IndexError
    (numpy on the emptied arrays of the closed mapping). Never another key's
    bytes, never a crash."""
    toks = np.arange(32 * PAGE_TOKENS, dtype=np.uint32)
    want = page_bytes_for(toks)
    strays: list[BaseException] = []
    for _ in range(8):
        c = daemon.client(timeout=2.0)
        ns = c.register(**NS)
        c.store(ns, toks, want)
        hit = c.match(ns, toks)
        res = c.reserve(ns, toks + 100_000)
        stop = threading.Event()
        data = np.ones((32, PAGE_BYTES), dtype=np.uint8)
        threads = [
            threading.Thread(target=_until, args=(stop, strays, _read_as, c, hit, want)),
            threading.Thread(target=_until, args=(stop, strays, c.write_pages, res, data)),
        ]
        for t in threads:
            t.start()
        time.sleep(0.05)
        c.close()
        time.sleep(0.02)
        stop.set()
        for t in threads:
            t.join(10)
        assert not strays, strays
    with pytest.raises(BadRequest, match="closed"):
        c.read_pages(hit)


def _until(
    stop: threading.Event, strays: list[BaseException], copy: Callable[..., object], *args: object
) -> None:
    """``copy(*args)`` again and again until ``stop``; errors other than the
    client's are kept in ``strays``."""
    while not stop.is_set():
        try:
            copy(*args)
        except HicachedError:
            pass
        except BaseException as exc:
            strays.append(exc)


def _read_as(c: hicached.Client, hit: hicached.Hit, want: np.ndarray) -> None:
    """Read ``hit``: its pages must be ``want``."""
    got = c.read_pages(hit)
    assert np.array_equal(got, want), "another key's bytes"


def test_a_read_while_another_thread_remaps_after_a_restart_is_served_or_a_miss(
    daemon: Daemon,
) -> None:
    """A thread reads through a hit while another thread's call finds the daemon
    restarted and maps the new pool: the read is served from the pool it was
    granted in (kept mapped for its lease) or is a miss (StaleHandle); while
    the new pool was being mapped, reads said "not connected: call connect()
    first" (DaemonUnavailable), of a client that was connected."""
    c = daemon.client(timeout=3.0)
    try:
        ns = c.register(**NS)
        for round in range(3):
            toks = np.arange(16 * PAGE_TOKENS, dtype=np.uint32) + round * 100_000
            want = page_bytes_for(toks)
            c.store(ns, toks, want)
            hit = c.match(ns, toks)
            strays: list[BaseException] = []
            served = [0]
            stop = threading.Event()
            reader = threading.Thread(target=_reads, args=(stop, strays, served, c, hit, want))
            reader.start()
            try:
                daemon.stop()
                daemon.start()
                c.stats()  # says hello to the new daemon and maps its pool
                time.sleep(0.05)
            finally:
                stop.set()
                reader.join(10)
            assert not strays, strays
            assert served[0] > 0
            c.release(hit)
    finally:
        c.close()


def _reads(
    stop: threading.Event,
    strays: list[BaseException],
    served: list[int],
    c: hicached.Client,
    hit: hicached.Hit,
    want: np.ndarray,
) -> None:
    """Read ``hit`` until ``stop``: its own pages (counted in ``served``) or a
    miss; anything else is kept in ``strays``."""
    while not stop.is_set():
        try:
            got = c.read_pages(hit)
        except StaleHandle:
            continue
        except BaseException as exc:
            strays.append(exc)
            continue
        if np.array_equal(got, want):
            served[0] += 1
        else:
            strays.append(AssertionError("another key's bytes"))


@pytest.mark.parametrize("call", ["release", "abort", "commit", "renew"])
def test_a_lease_bound_call_that_finds_the_daemon_restarted_is_not_asked_again(
    daemon: Daemon, call: str
) -> None:
    """The first call after a restart learns of it (the session is lost), says
    hello and asks again; a request bound to a lease was asked again of the
    new daemon, which never granted that lease: a release (or abort) raised
    UnknownLease ("lease ... is not open") though the lease had ended with
    the daemon, and a commit or renew said so rather than that the daemon
    restarted. Such a request is not asked again: a release is done, the
    others say the daemon restarted."""
    keyed = {**NS, "model": "test/keyed", "key_scheme": "vllm-sha256"}
    c = daemon.client(timeout=3.0)
    try:
        ns, kns = c.register(**NS), c.register(**keyed)
        toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
        hit = c.match(ns, toks)
        res = c.reserve_keys(kns, [bytes([k]) * 32 for k in range(4)])
        daemon.kill()
        daemon.start()
        if call == "release":
            c.release(hit)  # the step path (Client._call)
            assert hit.closed
        elif call == "abort":
            c.abort(res)  # the exchange path (_exchange)
            assert res.closed
        else:
            with pytest.raises(UnknownLease, match="restarted"):
                c.commit(res) if call == "commit" else c.renew(hit)
        assert c.stats().leases == 0  # the new daemon granted none
    finally:
        c.close()


def test_an_async_release_that_finds_the_daemon_restarted_is_done(daemon: Daemon) -> None:
    """AsyncClient.release as the first call after a restart: done, as the
    lease ended with the daemon (it raised UnknownLease from the new one)."""

    async def run() -> None:
        async with hicached.AsyncClient(daemon.endpoint, timeout=3.0) as c:
            ns = await c.register(**NS)
            toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
            await c.store(ns, toks, page_bytes_for(toks))
            hit = await c.match(ns, toks)
            daemon.kill()
            daemon.start()
            await c.release(hit)
            assert hit.closed and (await c.stats()).leases == 0

    asyncio.run(run())


async def no_lease_left(c: hicached.AsyncClient) -> None:
    """Every lease the daemon granted ends within 10 s, and no page stays pinned."""
    for _ in range(200):
        if not (await c.stats()).leases:
            break
        await asyncio.sleep(0.05)
    stats = await c.stats()
    assert stats.leases == 0 and stats.pinned_pages == 0


def test_a_lease_granted_to_a_cancelled_call_is_released(daemon: Daemon) -> None:
    """A match cancelled while its reply was on the way: the read lease the
    daemon granted reached no handle, and pinned its pages until it expired
    (leases.ttl_s, 30 s); it is released once its reply arrives."""

    async def run() -> None:
        async with hicached.AsyncClient(daemon.endpoint, timeout=3.0) as c:
            ns = await c.register(**NS)
            toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
            await c.store(ns, toks, page_bytes_for(toks))
            for _ in range(5):
                call = asyncio.get_running_loop().create_task(c.match(ns, toks))
                for _ in range(1000):  # until its request is out, waiting for the reply
                    if c._pending:
                        break
                    await asyncio.sleep(0)
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
            await no_lease_left(c)  # the replies arrive after the cancels

    asyncio.run(run())


def test_a_call_cancelled_once_its_reply_is_in_raises_the_cancel_and_releases_its_lease(
    daemon: Daemon, engine_waits: str
) -> None:
    """A match cancelled after its reply came but before its task ran again:
    the wait for the reply gave the reply back and dropped the cancel, so the
    call returned a Hit its caller never saw, pinning its pages until the
    lease expired (leases.ttl_s). It raises the cancel; the lease is released."""

    async def run() -> None:
        async with hicached.AsyncClient(daemon.endpoint, timeout=3.0) as c:
            ns = await c.register(**NS)
            toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
            await c.store(ns, toks, page_bytes_for(toks))
            landed = 0
            for _ in range(100):  # until three cancels met a reply that was in
                call = asyncio.get_running_loop().create_task(c.match(ns, toks))
                for _ in range(1000):  # until its request is out, waiting for the reply
                    if c._pending:
                        break
                    await asyncio.sleep(0)
                (reply,) = c._pending.values()
                for _ in range(200_000):  # until the reader has it: seconds at most
                    if reply.done():
                        break
                    await asyncio.sleep(0)
                assert reply.done()
                if call.done():  # its task ran first: a Hit of its own
                    await c.release(call.result())
                    continue
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                landed += 1
                if landed == 3:
                    break
            assert landed == 3
            await no_lease_left(c)  # the releases go out as the cancels are raised

    asyncio.run(run())


@pytest.mark.parametrize("call", ["store", "load"])
def test_an_async_store_or_load_cancelled_before_its_last_request_went_out_ends_its_lease(
    daemon: Daemon, call: str
) -> None:
    """store and load end the lease they took, which their caller never sees,
    with a request of its own (commit, release). Cancelled while that request
    waited for its turn (max_in_flight calls in flight), they raised the cancel
    and left the lease open: a reservation holding its slots, or a hit pinning
    its pages, until it expired (leases.ttl_s). The lease is released."""

    async def run() -> None:
        async with hicached.AsyncClient(daemon.endpoint, timeout=3.0, max_in_flight=1) as c:
            ns = await c.register(**NS)
            toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
            if call == "load":
                await c.store(ns, toks, page_bytes_for(toks))
            loop = asyncio.get_running_loop()
            task = loop.create_task(
                c.store(ns, toks, page_bytes_for(toks)) if call == "store" else c.load(ns, toks)
            )
            await _turns_until(lambda: bool(c._pending))  # its reserve (match) is out
            other = loop.create_task(c.stats())  # waits for the one turn
            slots = c._slots
            assert slots is not None
            await _turns_until(lambda: bool(slots._waiters))
            (turn,) = slots._waiters
            # the reply came and the turn went to the other call: the commit
            # (release) waits for the next one
            await _turns_until(lambda: task.done() or any(w is not turn for w in slots._waiters))
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await other
            stats = await _settled(c)
            assert stats.leases == 0 and stats.pinned_pages == 0

    asyncio.run(run())


def test_an_async_release_given_up_at_its_deadline_still_ends_the_lease(daemon: Daemon) -> None:
    """A release whose reply did not come in time (a stalled daemon) raised
    DeadlineExceeded, and the daemon, once it ran again, dropped the request
    as past its deadline: the lease pinned its pages until it expired
    (leases.ttl_s), though its hit was closed. The release goes out again as
    the call gives up."""

    async def run() -> None:
        async with hicached.AsyncClient(daemon.endpoint, timeout=1.0) as c:
            ns = await c.register(**NS)
            toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
            await c.store(ns, toks, page_bytes_for(toks))
            hit = await c.match(ns, toks)
            assert daemon.proc is not None
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(DeadlineExceeded):
                    await c.release(hit)
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            assert hit.closed
            stats = await _settled(c)
            assert stats.leases == 0 and stats.pinned_pages == 0

    asyncio.run(run())


async def _turns_until(done: Callable[[], bool]) -> None:
    """Let the loop run until ``done()``: seconds at most."""
    for _ in range(200_000):
        if done():
            return
        await asyncio.sleep(0)
    pytest.fail("never came to pass")


async def _settled(c: hicached.AsyncClient) -> DaemonStats:
    """The daemon's stats once no lease is open, or after 5 s: releases sent
    without waiting are answered after the calls that sent them end."""
    for _ in range(100):
        if not (await c.stats()).leases:
            break
        await asyncio.sleep(0.05)
    return await c.stats()


@pytest.mark.parametrize("call", ["store", "load"])
def test_a_sync_store_or_load_whose_last_request_gets_no_turn_ends_its_lease_at_the_next(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Another thread holds the client from a store's or a load's page copy
    until past the call's timeout (fault injection: it takes the client's
    turn, as a long call of its own would): the commit or release that ends
    the call never goes out (DeadlineExceeded), and the lease, on a handle
    the caller never sees, held its slots or pages until it expired. It is
    released at the next call any thread makes."""
    c = daemon.client(timeout=1.0)
    try:
        ns = c.register(**NS)
        toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
        if call == "load":
            c.store(ns, toks, page_bytes_for(toks))
        held, done = threading.Event(), threading.Event()

        def hold() -> None:
            with c._turn:
                held.set()
                done.wait(10)

        name = "_store_data" if call == "store" else "read_pages"
        copy = getattr(c, name)

        def copying(*args: Any, **kwargs: Any) -> Any:
            out = copy(*args, **kwargs)
            threading.Thread(target=hold, daemon=True).start()
            assert held.wait(5)
            return out

        monkeypatch.setattr(c, name, copying)
        with pytest.raises(DeadlineExceeded):
            if call == "store":
                c.store(ns, toks, page_bytes_for(toks))
            else:
                c.load(ns, toks)
        done.set()
        stats = c.stats()  # its turn sends the release first
        assert stats.leases == 0 and stats.pinned_pages == 0
    finally:
        c.close()


def test_a_lease_granted_to_an_interrupted_call_is_released(daemon: Daemon) -> None:
    """A match interrupted (KeyboardInterrupt) while the daemon was about to
    answer: the next call meets the late reply and releases the read lease it
    grants, which no handle holds (its pages stayed pinned until it expired)."""
    c = daemon.client(timeout=5.0)
    try:
        ns = c.register(**NS)
        toks = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # the match waits for its reply
        interrupt = threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGINT))
        # Python's own handler: a process started in the background by a shell
        # without job control inherits SIGINT ignored, and keeps it so
        before = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            interrupt.start()
            with pytest.raises(KeyboardInterrupt):
                c.match(ns, toks)
        finally:
            interrupt.join(5)
            signal.signal(signal.SIGINT, before)
            os.kill(daemon.proc.pid, signal.SIGCONT)  # now it answers, before the deadline
        for _ in range(100):
            if not c.stats().leases:
                break
            time.sleep(0.05)
        stats = c.stats()
        assert stats.leases == 0 and stats.pinned_pages == 0
    finally:
        c.close()


def test_close_from_a_signal_handler_during_a_call_ends_the_call_cleanly(daemon: Daemon) -> None:
    """close() from a signal handler (an engine's shutdown on SIGTERM) that runs
    on the thread of a call waiting for its reply: the socket closes under
    that call, which raised zmq's ZMQError ("Socket operation on non-socket");
    it ends with DaemonUnavailable, as a call of another thread does."""
    c = daemon.client(timeout=3.0)
    c.register(**NS)
    assert daemon.proc is not None
    before = signal.signal(signal.SIGUSR1, lambda *_: c.close())
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # the call waits for its reply
    closer = threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGUSR1))
    try:
        closer.start()
        with pytest.raises(DaemonUnavailable, match="closed"):
            c.stats()
        with pytest.raises(BadRequest, match="closed"):
            c.stats()
    finally:
        closer.join(5)
        signal.signal(signal.SIGUSR1, before)
        os.kill(daemon.proc.pid, signal.SIGCONT)
        c.close()


def test_a_number_too_large_for_the_wire_is_a_bad_request(daemon: Daemon) -> None:
    """An integer argument past what msgpack carries (2**64) raised msgspec's
    OverflowError from the encoder; it is a BadRequest, and the client goes on."""
    with daemon.client(timeout=2.0) as c:
        ns = c.register(**NS)
        toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
        with pytest.raises(BadRequest, match="too large"):
            c.prefetch(ns, toks, max_pages=2**70)
        res = c.reserve(ns, toks)
        with pytest.raises(BadRequest, match="too large"):
            c.commit(res, 2**70)
        with pytest.raises(BadRequest, match="too large"):
            c.register(**{**NS, "page_bytes": 2**70})
        c.abort(res)
        assert c.stats().leases == 0


def test_a_view_selected_with_bools_copies_the_pages_they_number(daemon: Daemon) -> None:
    """select() takes page numbers; bools are 0 and 1 as everywhere in Python.
    The offsets were picked as numbers and the generations as a numpy mask,
    so the view's fence checked other slots' generations than its own (or
    raised IndexError)."""
    with daemon.client(timeout=2.0) as c:
        ns = c.register(**NS)
        toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
        want = page_bytes_for(toks)
        c.store(ns, toks, want)
        hit = c.match(ns, toks)
        view = hit.select([True, False])
        assert view.offsets == [hit.offsets[1], hit.offsets[0]]
        assert list(view.gens) == [hit.gens[1], hit.gens[0]]
        assert np.array_equal(c.read_pages(view), want[[1, 0]])
        with pytest.raises(IndexError, match="page numbers"):
            hit.select([0.5])
        c.release(hit)


@pytest.mark.parametrize("end", ["abort", "commit", "duplicates"])
def test_a_write_under_way_when_another_thread_ends_its_reservation_lands_in_no_other_page(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """A thread's copy into a token reservation has passed its fences when
    another thread of the client aborts the reservation, commits fewer of its
    pages than the copy fills, or commits pages another client published
    meanwhile (duplicates). The slots the lease did not publish went
    back to the free list at once, the next reservation (another client's)
    got them, and the copy, going on, wrote over that client's committed page:
    a read of its key returned the first thread's bytes. The slots of a write
    lease that ends with pages unpublished wait out their quarantine, whatever
    ends it. Fault injection: the copying thread is held between its fences
    and its copy, as a thread the scheduler sets aside there is."""
    from hicached.client.mapping import PoolMapping

    checked, resume = threading.Event(), threading.Event()
    moved = PoolMapping._moved

    def held(gens: np.ndarray, handle: hicached.Reservation, gidx: np.ndarray) -> int:
        first = moved(gens, handle, gidx)
        if threading.current_thread().name == "copier":
            checked.set()
            assert resume.wait(10), "never resumed"
        return first

    monkeypatch.setattr(PoolMapping, "_moved", staticmethod(held))
    toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
    theirs = toks + 500_000
    want = page_bytes_for(theirs)
    with daemon.client() as c, daemon.client() as other:
        ns, their_ns = c.register(**NS), other.register(**NS)
        res = c.reserve(ns, toks)
        assert len(res.offsets) == 2
        errors: list[BaseException] = []

        def copy() -> None:
            try:
                c.write_pages(res, np.full((2, PAGE_BYTES), 0xEE, dtype=np.uint8))
            except BaseException as exc:
                errors.append(exc)

        copier = threading.Thread(target=copy, name="copier")
        copier.start()
        try:
            assert checked.wait(10)
            if end == "abort":
                c.abort(res)
            elif end == "commit":
                assert c.commit(res, pages=1).published == 1  # page 0 is the client's own
            else:  # another client published the pages first: the commit gives the slots back
                other.store(their_ns, toks, page_bytes_for(toks))
                assert c.commit(res).duplicates == 2
            got = other.reserve(their_ns, theirs)
            other.write_pages(got, want[got.present :])
            other.commit(got)
        finally:
            resume.set()
            copier.join(10)
        assert not copier.is_alive()
        assert all(isinstance(exc, StaleHandle) for exc in errors), errors
        assert np.array_equal(other.load(their_ns, theirs), want), "another client's bytes"
