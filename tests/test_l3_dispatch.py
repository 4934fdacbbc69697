"""The dispatcher's bounds with a backend that hangs past op_timeout_s.

In process, on one event loop: a backend whose calls wait on a gate stands
in for a hung store (fault injection), so the test decides when calls end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

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


async def test_hung_calls_keep_their_slots_and_pages_in_flight_count(tmp_path: Path) -> None:
    backend = GatedBackend(tmp_path)
    # 4 call slots: writes may hold 2 of them, one stays free for reads and one
    # for existence checks
    d = Dispatcher(backend, config(concurrency=4), "gated")
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
    assert time.monotonic() - started < 1.0  # not op_timeout_s
    assert d.running == 1 and d.hung_calls == 1  # still running: its slot stays taken
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
    assert time.monotonic() - started < 1.0
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
