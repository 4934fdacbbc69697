"""The dispatcher's bounds with a backend that hangs past op_timeout_s, and
the order it hands call slots out in (checks, then reads, then writes).

In process, on one event loop: a backend whose calls wait on a gate stands
in for a hung or slow store (fault injection), so the test decides when
calls end, and the order of calls, not their timing, is asserted.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np

from hicached.config import StorageConfig
from hicached.dispatcher import Dispatcher, WriteJob
from hicached_backends.base import BackendEnv, BackendError, PageRef
from hicached_backends.memory import MemoryBackend
from hicached_backends.options import MemoryOptions

NS = bytes(16)


class GatedBackend(MemoryBackend):
    """A memory backend whose puts and gets wait for ``gate``: hung until it opens."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(MemoryOptions(), BackendEnv(data_dir=tmp))
        self.gate = asyncio.Event()
        self.calls = 0
        self.peak = 0
        self.started = 0

    async def _hang(self) -> None:
        self.calls += 1
        self.started += 1
        self.peak = max(self.peak, self.calls)
        try:
            await self.gate.wait()
        finally:
            self.calls -= 1

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        await self._hang()
        return await super().put(ns, pages)

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        await self._hang()
        return await super().get(ns, pages)


def config(**kw: object) -> StorageConfig:
    base = dict(
        backend="memory",
        op_timeout_s=0.05,
        concurrency=2,
        batch_pages=2,
        queue_pages=8,
        retries=0,
        breaker_failures=10**6,  # keep calling: the bounds, not the breaker, are tested
    )
    return msgspec.convert({**base, **kw}, StorageConfig)


def job(i: int, done: list[bool]) -> WriteJob:
    return WriteJob(NS, i.to_bytes(16, "big"), memoryview(bytearray(64)), done.append)


async def write_four(d: Dispatcher) -> list[bool]:
    """Pages 0-3 submitted as writes: their answers, once all four have one
    (or a second on, whatever came)."""
    done: list[bool] = []
    for i in range(4):
        assert d.submit_write(job(i, done))
    for _ in range(100):
        if len(done) == 4:
            break
        await asyncio.sleep(0.01)
    return done


async def test_hung_calls_keep_their_slots_and_pages_in_flight_count(tmp_path: Path) -> None:
    backend = GatedBackend(tmp_path)
    # 3 call slots (and one for existence checks): writes may hold 2 of them,
    # one stays free for reads
    d = Dispatcher(backend, config(concurrency=3), "gated")
    await d.start()
    done: list[bool] = []
    accepted = sum(d.submit_write(job(i, done)) for i in range(30))
    assert accepted == 8 and d.counters["write_dropped_full"] == 22
    for _ in range(40):  # 16 timeouts' worth: hung calls must not let more calls in
        await asyncio.sleep(0.02)
        assert d.queued + d.writing <= 8
        assert backend.calls <= 2
    assert backend.peak == 2 and backend.started == 2  # no call beyond the slots
    assert d.hung_calls == 2 and d.running == 2
    assert d.counters["timeouts"] == 2 and d.counters["slot_timeouts"] == 2
    # batches that found no slot failed and left the bound; the hung ones hold theirs
    assert d.writing == 4 and done.count(False) == 4 and d.queued == 0
    assert d.room == 4
    backend.gate.set()  # the store answers at last
    await asyncio.sleep(0.05)
    assert d.hung_calls == 0 and d.running == 0 and d.writing == 0
    assert done.count(True) == 4  # the late calls finished their pages
    assert d.room == 8 and d.submit_write(job(200, done))
    await d.stop(time.monotonic() + 1.0)
    assert backend.records  # the last write went through before the stop


async def test_a_cancelled_read_waits_for_its_call_no_longer_than_the_stop(
    tmp_path: Path,
) -> None:
    backend = GatedBackend(tmp_path)
    d = Dispatcher(backend, config(op_timeout_s=30.0), "gated")
    await d.start()
    reader = asyncio.ensure_future(d.get(NS, [PageRef(bytes(16), memoryview(bytearray(64)))]))
    await asyncio.sleep(0.05)
    assert d.running == 1
    started = time.monotonic()
    d.stop_by = started + 0.2
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await d.stop(started + 0.2)
    assert time.monotonic() - started < 5.0  # not op_timeout_s (30 s)
    # still running: its slot stays taken; cancelled well within op_timeout_s, it
    # is not one of the calls past their timeout (the stop's log line tells them apart)
    assert d.running == 1 and d.hung_calls == 0
    backend.gate.set()
    await asyncio.sleep(0.01)
    assert d.running == 0 and d.hung_calls == 0


async def test_stop_drains_in_flight_writes_within_its_deadline(tmp_path: Path) -> None:
    backend = GatedBackend(tmp_path)
    d = Dispatcher(backend, config(op_timeout_s=5.0), "gated")
    await d.start()
    done: list[bool] = []
    for i in range(6):
        d.submit_write(job(i, done))
    await asyncio.sleep(0.01)

    async def open_gate() -> None:
        await asyncio.sleep(0.2)
        backend.gate.set()

    opener = asyncio.ensure_future(open_gate())
    started = time.monotonic()
    await d.stop(started + 3.0)
    await opener
    assert time.monotonic() - started < 2.0
    assert d.writing == 0 and d.queued == 0
    assert done == [True] * 6 and d.counters["write_dropped_stop"] == 0


class SlowWrites(MemoryBackend):
    """Puts wait for ``gate`` (a slow store taking background writes); gets do not."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(MemoryOptions(), BackendEnv(data_dir=tmp))
        self.gate = asyncio.Event()
        self.puts = 0
        self.peak = 0

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        self.puts += 1
        self.peak = max(self.peak, self.puts)
        try:
            await self.gate.wait()
        finally:
            self.puts -= 1
        return await super().put(ns, pages)


async def test_reads_never_wait_behind_writes(tmp_path: Path) -> None:
    backend = SlowWrites(tmp_path)
    d = Dispatcher(backend, config(op_timeout_s=5.0, queue_pages=64, concurrency=2), "slow")
    await d.start()
    done: list[bool] = []
    assert all(d.submit_write(job(i, done)) for i in range(40))  # writers busy, more queued
    await asyncio.sleep(0.05)
    buf = bytearray(64)
    started = time.monotonic()
    for _ in range(5):  # prefetch reads: each finds a call slot at once
        assert await asyncio.wait_for(d.get(NS, [PageRef(bytes(16), memoryview(buf))]), 1.0) == [
            False
        ]  # not stored: a miss, promptly
    assert time.monotonic() - started < 3.0  # no read waited for a writer's call (5 s)
    assert backend.peak == 1  # writes hold at most concurrency - 1 call slots
    backend.gate.set()
    for _ in range(200):
        if len(done) == 40:
            break
        await asyncio.sleep(0.01)
    assert done == [True] * 40  # and every write still went through
    await d.stop(time.monotonic() + 5)


class Outage(MemoryBackend):
    """A memory backend that is down (every call and its health probe fail)
    while ``down`` is set: fault injection."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(MemoryOptions(), BackendEnv(data_dir=tmp))
        self.down = True
        self.probes = 0
        self.probing = 0
        self.peak_probing = 0

    async def health(self) -> None:
        self.probes += 1
        self.probing += 1
        self.peak_probing = max(self.peak_probing, self.probing)
        try:
            await asyncio.sleep(0.01)  # within op_timeout_s (0.05)
            if self.down:
                raise BackendError("injected outage", retriable=True)
        finally:
            self.probing -= 1

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        if self.down:
            raise BackendError("injected outage", retriable=True)
        return await super().get(ns, pages)


async def test_the_breaker_reports_down_until_one_probe_passes(tmp_path: Path) -> None:
    """Down until a health probe passes, not just until the cooldown ends; one
    probe at a time however many calls arrive; a probe after each cooldown
    even with no calls, so an idle daemon sees the backend come back; and one
    more failure after it reopens the breaker."""
    backend = Outage(tmp_path)
    d = Dispatcher(backend, config(breaker_failures=2, breaker_cooldown_s=0.2), "outage")
    await d.start()
    try:
        page = [PageRef(bytes(16), memoryview(bytearray(64)))]
        for _ in range(2):
            assert await d.get(NS, page) == [False]
        assert d.state == "down"
        await asyncio.sleep(0.3)  # the cooldown is over, and still no probe passed
        assert d.state == "down"
        await asyncio.gather(*(d.get(NS, page) for _ in range(20)))
        assert backend.peak_probing == 1, "calls after the cooldown probed side by side"
        backend.down = False  # it comes back; no call is made
        for _ in range(60):  # the next probe, within a cooldown or two
            if d.state == "up":
                break
            await asyncio.sleep(0.05)
        assert d.state == "up"
        backend.down = True
        assert await d.get(NS, page) == [False]
        assert d.state == "down", "one failure after a passed probe reopens it"
    finally:
        await d.stop(time.monotonic() + 1.0)


class Turns(MemoryBackend):
    """Fault injection: a memory backend whose calls of the kinds in ``held``
    wait until the test lets them end, one at a time (``let``), as slow store
    calls would; ``started`` logs every call's start in order ("get3": a get
    whose first key is 3), so a test sees which call the dispatcher let in."""

    def __init__(self, tmp: Path, held: set[str]) -> None:
        super().__init__(MemoryOptions(), BackendEnv(data_dir=tmp))
        self.held = held
        self.gates = {what: asyncio.Semaphore(0) for what in ("exists", "get", "put")}
        self.started: list[str] = []
        self.running: collections.Counter[str] = collections.Counter()

    def let(self, what: str, n: int = 1) -> None:
        for _ in range(n):
            self.gates[what].release()

    async def _turn(self, what: str, key: bytes) -> None:
        self.started.append(f"{what}{int.from_bytes(key, 'big')}")
        if what not in self.held:
            return
        self.running[what] += 1
        try:
            await self.gates[what].acquire()
        finally:
            self.running[what] -= 1

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        await self._turn("exists", keys[0])
        return await super().exists(ns, keys)

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        await self._turn("get", pages[0].key)
        return await super().get(ns, pages)

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        await self._turn("put", pages[0].key)
        return await super().put(ns, pages)


def page(i: int) -> list[PageRef]:
    return [PageRef(i.to_bytes(16, "big"), memoryview(bytearray(64)))]


def key(i: int) -> list[bytes]:
    return [i.to_bytes(16, "big")]


async def until(what: Callable[[], object], timeout: float = 5.0) -> None:
    """Wait (generously) until ``what()`` holds: a deadline, not a measurement."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out waiting for the dispatcher"
        await asyncio.sleep(0.005)


async def queued() -> None:
    """Let tasks just created run up to their wait for a call slot."""
    for _ in range(3):
        await asyncio.sleep(0)


async def test_existence_checks_go_before_queued_reads(tmp_path: Path) -> None:
    """A slow check holds the slot kept for checks, two slow reads hold both
    call slots and three more wait: a second check, issued after them, takes
    the first slot that comes free, before every queued read (which still go
    in the order they came)."""
    backend = Turns(tmp_path, held={"get", "exists"})
    d = Dispatcher(backend, config(op_timeout_s=30.0, concurrency=2), "turns")
    await d.start()
    try:
        first = asyncio.ensure_future(d.exists(NS, key(8)))
        await until(lambda: backend.running["exists"] == 1)
        reads = [asyncio.ensure_future(d.get(NS, page(i))) for i in range(5)]
        await until(lambda: backend.running["get"] == 2)
        check = asyncio.ensure_future(d.exists(NS, key(9)))
        await queued()
        assert backend.started == ["exists8", "get0", "get1"]  # the check waits too
        backend.let("get")  # the first read ends
        await until(lambda: backend.running["exists"] == 2)
        assert backend.started[:4] == ["exists8", "get0", "get1", "exists9"]
        backend.let("exists", 2)  # not stored: both say none
        assert await asyncio.wait_for(asyncio.gather(first, check), 5.0) == [0, 0]
        backend.let("get", 4)
        assert await asyncio.wait_for(asyncio.gather(*reads), 5.0) == [[False]] * 5
        assert backend.started[4:] == ["get2", "get3", "get4"]
    finally:
        backend.let("get", 10)
        backend.let("exists", 10)
        await d.stop(time.monotonic() + 1.0)


async def test_a_check_finds_its_slot_however_many_reads_run(tmp_path: Path) -> None:
    """Two call slots: slow reads take both however many queue, never the one
    kept for checks, so a check runs at once; checks that hang keep no read
    from the slots left."""
    backend = Turns(tmp_path, held={"get", "exists"})
    d = Dispatcher(backend, config(op_timeout_s=30.0, concurrency=2), "turns")
    await d.start()
    try:
        reads = [asyncio.ensure_future(d.get(NS, page(i))) for i in range(4)]
        await until(lambda: backend.running["get"] == 2)
        await queued()
        assert backend.running["get"] == 2  # reads have their two slots, no more
        check = asyncio.ensure_future(d.exists(NS, key(9)))
        await until(lambda: backend.running["exists"] == 1)  # no read has ended
        assert backend.started == ["get0", "get1", "exists9"]
        backend.let("exists")
        assert await asyncio.wait_for(check, 5.0) == 0
        backend.let("get", 2)  # the two queued reads take their places
        await until(lambda: len(backend.started) == 5)
        assert backend.started[3:] == ["get2", "get3"] and backend.running["get"] == 2
        backend.let("get", 2)
        await asyncio.wait_for(asyncio.gather(*reads), 5.0)
        # checks hold the kept slot and one of the two others, and hang: a read
        # still takes the last
        checks = [asyncio.ensure_future(d.exists(NS, key(i))) for i in (10, 11)]
        await until(lambda: backend.running["exists"] == 2)
        read = asyncio.ensure_future(d.get(NS, page(5)))
        await until(lambda: backend.running["get"] == 1)
        backend.let("get")
        assert await asyncio.wait_for(read, 5.0) == [False]
        backend.let("exists", 2)
        assert await asyncio.wait_for(asyncio.gather(*checks), 5.0) == [0, 0]
    finally:
        backend.let("get", 10)
        backend.let("exists", 10)
        await d.stop(time.monotonic() + 1.0)


async def test_reads_do_not_starve_behind_existence_checks(tmp_path: Path) -> None:
    """Two slots, slow reads and slow checks: with a read and several checks
    waiting, a check goes first, and then the read, not the next check."""
    backend = Turns(tmp_path, held={"get", "exists"})
    d = Dispatcher(backend, config(op_timeout_s=30.0, concurrency=2), "turns")
    await d.start()
    try:
        reads = [asyncio.ensure_future(d.get(NS, page(i))) for i in range(3)]
        await until(lambda: backend.running["get"] == 2)
        checks = [asyncio.ensure_future(d.exists(NS, key(i))) for i in (10, 11, 12)]
        await until(lambda: backend.running["exists"] == 1)  # the kept slot
        await queued()
        backend.let("get")  # a read's slot: the first check waiting takes it
        await until(lambda: backend.running["exists"] == 2)
        backend.let("exists")  # this slot goes to the read, which waited longer
        await until(lambda: backend.running["get"] == 2)
        assert backend.started == ["get0", "get1", "exists10", "exists11", "get2"]
        backend.let("get", 3)
        backend.let("exists", 2)
        await asyncio.wait_for(asyncio.gather(*reads, *checks), 5.0)
        assert backend.started[5:] == ["exists12"]
    finally:
        backend.let("get", 10)
        backend.let("exists", 10)
        await d.stop(time.monotonic() + 1.0)


async def test_a_cancelled_existence_check_gives_its_slot_on(tmp_path: Path) -> None:
    """A check cancelled while it waits leaves the queue; one cancelled just as
    a slot is handed to it gives that slot to the next waiter; no slot is lost."""
    backend = Turns(tmp_path, held={"get", "exists"})
    d = Dispatcher(backend, config(op_timeout_s=30.0, concurrency=2), "turns")
    await d.start()
    try:
        kept = asyncio.ensure_future(d.exists(NS, key(8)))  # holds the slot kept for checks
        await until(lambda: backend.running["exists"] == 1)
        reads = [asyncio.ensure_future(d.get(NS, page(i))) for i in range(2)]
        await until(lambda: backend.running["get"] == 2)
        check = asyncio.ensure_future(d.exists(NS, key(9)))
        reads.append(asyncio.ensure_future(d.get(NS, page(2))))
        await queued()
        check.cancel()  # while it waits
        backend.let("get")
        await until(lambda: "get2" in backend.started)
        assert backend.started == ["exists8", "get0", "get1", "get2"] and check.cancelled()

        check = asyncio.ensure_future(d.exists(NS, key(10)))
        reads.append(asyncio.ensure_future(d.get(NS, page(3))))
        await queued()

        def cancel_the_check(what: str, seconds: float) -> None:
            if what == "get":  # a read ended and handed its slot to the check
                d.on_call = None
                check.cancel()  # before the check could run

        d.on_call = cancel_the_check
        backend.let("get")
        await until(lambda: "get3" in backend.started)
        assert backend.started == ["exists8", "get0", "get1", "get2", "get3"]
        assert await asyncio.gather(check, return_exceptions=True) != [0]
        assert check.cancelled()
        backend.let("get", 2)
        await asyncio.wait_for(asyncio.gather(*reads), 5.0)
        backend.let("exists")
        assert await asyncio.wait_for(kept, 5.0) == 0
        assert d.running == 0
        # both slots are free again: two reads run at once
        reads = [asyncio.ensure_future(d.get(NS, page(i))) for i in (4, 5)]
        await until(lambda: backend.running["get"] == 2)
        backend.let("get", 2)
        await asyncio.wait_for(asyncio.gather(*reads), 5.0)
        assert d.counters["slot_timeouts"] == 0
    finally:
        backend.let("get", 10)
        backend.let("exists", 10)
        await d.stop(time.monotonic() + 1.0)


async def test_writes_leave_a_slot_for_reads_and_checks_keep_theirs(tmp_path: Path) -> None:
    """Three slots and hung writes: writes hold two, a slow read takes the
    third; a second read waits, and a check runs in the slot kept for it."""
    backend = Turns(tmp_path, held={"put", "get"})
    d = Dispatcher(backend, config(op_timeout_s=30.0, concurrency=3, queue_pages=64), "turns")
    await d.start()
    done: list[bool] = []
    try:
        assert all(d.submit_write(job(i, done)) for i in range(40))
        await until(lambda: backend.running["put"] == 2)
        first = asyncio.ensure_future(d.get(NS, page(100)))
        await until(lambda: backend.running["get"] == 1)
        second = asyncio.ensure_future(d.get(NS, page(101)))
        assert await asyncio.wait_for(d.exists(NS, key(9)), 5.0) == 0
        assert backend.running == {"put": 2, "get": 1} and "get101" not in backend.started
        backend.let("get", 2)
        assert await asyncio.wait_for(asyncio.gather(first, second), 5.0) == [[False]] * 2
        assert backend.running["put"] == 2  # no write took the slots the reads left
        backend.held = set()
        backend.let("put", 2)
        await until(lambda: len(done) == 40)
        assert done == [True] * 40
    finally:
        backend.held = set()
        backend.let("put", 10)
        backend.let("get", 10)
        await d.stop(time.monotonic() + 1.0)


class MiscountingBackend(MemoryBackend):
    """A backend that breaks its contract (a third-party one with a bug):
    while ``wrong`` is set, a put or a get answers for one page fewer than it
    was given, and an existence check counts past the keys it was asked of."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(MemoryOptions(), BackendEnv(data_dir=tmp))
        self.wrong = True

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        got = await super().put(ns, pages)
        return got[1:] if self.wrong else got

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        got = await super().get(ns, pages)
        return got[1:] if self.wrong else got

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        found = await super().exists(ns, keys)
        return found + 5 if self.wrong else found


async def test_answers_of_the_wrong_length_are_a_failed_call(tmp_path: Path) -> None:
    """A put answered with fewer flags than pages killed the writer task (its
    answers are matched to the pages strictly): its pages stayed in flight
    for good, their slots pinned, and with every writer gone no write ran
    again. A get answered short was passed on, so a prefetch matched the
    flags to the wrong pages (page k's flag for page k + 1): a page never
    read could be counted as read. An existence count past the keys asked of
    was passed on as well. Each is now a failed call: writes fail, reads
    miss, a count is no answer, and the dispatcher serves on."""
    backend = MiscountingBackend(tmp_path)
    d = Dispatcher(backend, config(concurrency=1, op_timeout_s=5.0), "miscounting")
    await d.start()
    done = await write_four(d)
    assert done == [False] * 4, "pages answered for by a put's wrong answer"
    assert d.writing == 0
    pages = [PageRef(i.to_bytes(16, "big"), memoryview(bytearray(64))) for i in range(3)]
    assert await d.get(NS, pages) == [False] * 3
    assert await d.exists(NS, [page.key for page in pages]) is None
    assert d.counters["bad_answers"] == 4  # two puts of two pages, a get, a check
    backend.wrong = False
    more = await write_four(d)
    assert more == [True] * 4, "the writer did not serve on"
    assert await d.get(NS, pages) == [True] * 3
    assert await d.exists(NS, [page.key for page in pages]) == 3
    await d.stop(time.monotonic() + 1.0)


class NumpyBackend(MemoryBackend):
    """A backend that answers a put or a get with a numpy array of flags, one a
    page (a third-party one built on numpy), and an existence check with a
    numpy integer."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(MemoryOptions(), BackendEnv(data_dir=tmp))

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        return np.array(await super().put(ns, pages), dtype=bool)  # type: ignore[return-value]

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        return np.array(await super().get(ns, pages), dtype=bool)  # type: ignore[return-value]

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        return np.int64(await super().exists(ns, keys))  # type: ignore[return-value]


async def test_an_array_of_one_flag_a_page_is_an_answer(tmp_path: Path) -> None:
    """An answer of one flag a page is one whatever sequence holds it: a numpy
    array of flags (served before answers were checked) was taken for a
    contract break, every put and get a failed call, so such a backend's
    writes all failed, its reads all missed, and its breaker opened."""
    d = Dispatcher(NumpyBackend(tmp_path), config(concurrency=1, op_timeout_s=5.0), "numpy")
    await d.start()
    done = await write_four(d)
    assert done == [True] * 4, "a put's flags in an array were refused"
    pages = [PageRef(i.to_bytes(16, "big"), memoryview(bytearray(64))) for i in range(5)]
    assert await d.get(NS, pages) == [True] * 4 + [False]
    assert await d.exists(NS, [page.key for page in pages]) == 4
    assert d.counters["bad_answers"] == 0
    await d.stop(time.monotonic() + 1.0)


class CodesBackend(MemoryBackend):
    """A backend that answers a get with its store's codes, one a page (bytes
    read, or a negative error), where a flag a page is due (a third-party
    one's bug)."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(MemoryOptions(), BackendEnv(data_dir=tmp))

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        got = await super().get(ns, pages)
        return [len(p.buf) if ok else -704 for p, ok in zip(pages, got, strict=True)]  # type: ignore[misc]


async def test_an_answer_of_numbers_other_than_flags_is_a_failed_call(tmp_path: Path) -> None:
    """A get answered with codes, not flags, was passed on item by item as
    truth values: an error code (-704, no such object) is true, so a page the
    backend never read was counted read, and its slot's bytes served as the
    page's. An item that is neither a flag nor 0 or 1 makes the answer a
    contract break: a failed call, every page a miss."""
    d = Dispatcher(CodesBackend(tmp_path), config(concurrency=1, op_timeout_s=5.0), "codes")
    await d.start()
    pages = [PageRef(i.to_bytes(16, "big"), memoryview(bytearray(64))) for i in range(3)]
    assert await d.get(NS, pages) == [False] * 3, "a page never read counted as read"
    assert d.counters["bad_answers"] == 1
    await d.stop(time.monotonic() + 1.0)
