"""The file store's reader processes: real child processes reading into a
real pool file. Faults are real too: readers are killed (SIGKILL) or stopped
(SIGSTOP) by signal, records are corrupted in the segment file, and a reader
is fed requests it must refuse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from hicached.arena import Arena
from hicached_backends.base import BackendEnv, PageRef
from hicached_backends.file import FileBackend
from hicached_backends.file_readers import (
    MAX_RECORDS,
    RECORD,
    ReaderLost,
    Readers,
    disjoint,
    shares,
)
from hicached_backends.options import FileOptions

pytestmark = pytest.mark.timeout(120)

NS = bytes(range(16))
PAGE = 32 << 10  # 3 MiB a read: spread over both readers (parts of 1 MiB at least)
PAGES = 96


class Store:
    def __init__(self, tmp: Path, readers: int = 2, deadline_s: float = 30.0) -> None:
        self.arena = Arena.create(tmp / "pool", 2 * PAGES * PAGE, populate=False)
        rows = self.arena.array.reshape(2 * PAGES, PAGE)
        self.src, self.dst = rows[:PAGES], rows[PAGES:]
        self.src[:] = np.random.default_rng(7).integers(0, 256, self.src.shape, dtype=np.uint8)
        self.keys = [struct.pack("<QQ", 1, i) for i in range(PAGES)]
        options = FileOptions(
            path=str(tmp / "store"),
            capacity_mib=8,
            segment_mib=2,
            io_threads=2,
            read_processes=readers,
            reader_deadline_s=deadline_s,
        )
        env = BackendEnv(tmp, pool=self.arena.array.data, pool_path=str(self.arena.path))
        self.backend = FileBackend(options, env)

    def refs(self, rows: np.ndarray) -> list[PageRef]:
        return [PageRef(k, rows[i].data) for i, k in enumerate(self.keys)]

    async def get(self) -> list[bool]:
        self.dst[:] = 0
        return await self.backend.get(NS, self.refs(self.dst))

    def pids(self) -> list[int]:
        readers = self.backend._readers
        assert readers is not None
        return [
            r.child.transport.get_pid()
            for r in readers.readers
            if r.alive and r.child is not None and r.child.transport is not None
        ]

    def stat(self, name: str) -> int:
        return self.backend.stats()[name]


@pytest_asyncio.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = Store(tmp_path, deadline_s=2.0)
    await s.backend.open()
    assert all(await s.backend.put(NS, s.refs(s.src)))
    yield s
    await s.backend.close()


async def _until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_readers_read_and_verify_into_the_pool(store: Store) -> None:
    assert store.stat("readers_alive") == 2
    assert all(await store.get())
    assert np.array_equal(store.src, store.dst)
    assert store.stat("reader_pages") == PAGES  # the readers answered, not the threads


async def test_a_corrupt_record_is_a_miss_and_dropped(store: Store) -> None:
    loc = store.backend.index[(NS, store.keys[5])]
    seg = store.backend.segments[loc.segment]
    at = loc.offset + 64 + 100  # a payload byte
    byte = os.pread(seg.fd, 1, at)
    os.pwrite(seg.fd, bytes([byte[0] ^ 0xFF]), at)
    forgotten: list[bytes] = []
    store.backend.on_forget = lambda ns, keys: forgotten.extend(keys)
    got = await store.get()
    assert got == [i != 5 for i in range(PAGES)]
    assert forgotten == [store.keys[5]] and (NS, store.keys[5]) not in store.backend.index
    assert store.stat("bad_records") == 1 and store.stat("reader_pages") == PAGES
    good = [i for i in range(PAGES) if i != 5]
    assert np.array_equal(store.src[good], store.dst[good])


async def test_a_read_a_reader_could_not_make_keeps_the_page(store: Store) -> None:
    """A reader answers a read that failed apart from a bad record: such pages
    are a miss and stay known (``read_errors``), while those of a segment file
    that is gone (ENOENT: no record there) are bad records, dropped.

    Fault injection, before any reader has opened a segment (each opens one at
    its first read of it): segment 0's file is moved away, and segment 1's is
    put aside with a directory in its place, whose reads fail (EISDIR). A
    reader keeps the segment it opened, so the pages are read again once the
    readers are killed (SIGKILL), on the threads, which kept the file open."""
    backend = store.backend
    segment = {i: backend.index[(NS, key)].segment for i, key in enumerate(store.keys)}
    gone = [i for i in range(PAGES) if segment[i] == 0]
    failing = [i for i in range(PAGES) if segment[i] == 1]
    assert gone and failing and len(gone) + len(failing) == PAGES
    files = [backend.dir / f"segment-{n:05d}.hcs" for n in (0, 1)]
    aside = [path.with_suffix(".aside") for path in files]
    for path, moved in zip(files, aside, strict=True):
        path.rename(moved)
    files[1].mkdir()
    forgotten: list[bytes] = []
    backend.on_forget = lambda ns, keys: forgotten.extend(keys)
    assert await store.get() == [False] * PAGES
    assert store.stat("reader_pages") == PAGES  # the readers answered, not the threads
    assert store.stat("bad_records") == len(gone) and store.stat("read_errors") == len(failing)
    assert sorted(forgotten) == sorted(store.keys[i] for i in gone)
    assert all((NS, store.keys[i]) in backend.index for i in failing)
    files[1].rmdir()
    for path, moved in zip(files, aside, strict=True):
        moved.rename(path)
    for pid in store.pids():
        os.kill(pid, signal.SIGKILL)
    await _until(lambda: store.stat("readers_alive") == 0)
    got = await store.get()
    assert got == [segment[i] == 1 for i in range(PAGES)]
    assert np.array_equal(store.src[failing], store.dst[failing])


async def test_pages_lent_one_slot_are_answered_for_the_last_read_only(store: Store) -> None:
    """A reader hashes each run right after reading it; where two pages of a
    request share a slot, the later overwrites the earlier after its hash, so
    the reader must hash them only once all are read, as the threads do."""
    store.dst[:] = 0
    slot = store.dst[0].data
    pages = [PageRef(store.keys[3], slot), PageRef(store.keys[20], slot)]  # two runs
    got = await store.backend.get(NS, pages)
    assert store.stat("reader_pages") == 2  # a reader answered, not the threads
    assert np.array_equal(store.dst[0], store.src[20])
    assert got == [False, True]  # True for the first page would be a lie


def test_shares_fill_the_least_loaded_readers_to_one_level() -> None:
    mib = 1 << 20
    # idle readers split a read in parts of `least` or more
    assert shares([0, 0], 4 * mib, mib, 4 * mib) == [2 * mib, 2 * mib]
    assert shares([0, 0, 0], 2 * mib, mib, 4 * mib) == [mib, mib, 0]
    assert shares([0, 0], mib // 2, mib, 4 * mib) == [mib // 2, 0]
    # beside a queue, a large read levels the readers and a small one goes whole
    assert shares([32 * mib, 32 * mib], 64 * mib, mib, 4 * mib) == [32 * mib, 32 * mib]
    assert shares([32 * mib, 0], 64 * mib, mib, 4 * mib) == [16 * mib, 48 * mib]
    assert shares([2 * mib, 2 * mib], 4 * mib, mib, 4 * mib) == [4 * mib, 0]
    assert shares([3 * mib, 2 * mib], 4 * mib, mib, 4 * mib) == [0, 4 * mib]
    assert shares([8 * mib, 0, 2 * mib], 5 * mib, mib, mib) == [0, 7 * mib // 2, 3 * mib // 2]
    # every byte is given, none twice, whatever the division leaves
    for loads, nbytes in (([5, 0, 7], 1000), ([1, 2, 3, 4], 7), ([0], 0), ([9, 9], 1)):
        got = shares(loads, nbytes, 3, 5)
        assert sum(got) == nbytes and min(got) >= 0
    assert shares([], 10, 1, 1) == []


async def test_a_large_read_beside_a_stuck_one_goes_to_the_idle_reader(tmp_path: Path) -> None:
    """Pages of 8 MiB: a reader stuck (SIGSTOP) on one has 8 MiB queued. Each
    next read of two pages must go whole to the idle reader, whatever the
    rotation: a part's first record is its own, so the busy reader, if it
    came first, would take a page it cannot read until its deadline."""
    page, pages = 8 << 20, 3
    arena = Arena.create(tmp_path / "pool", 2 * pages * page, populate=False)
    rows = arena.array.reshape(2 * pages, page)
    src, dst = rows[:pages], rows[pages:]
    src[:] = np.random.default_rng(3).integers(0, 256, src.shape, dtype=np.uint8)
    keys = [struct.pack("<QQ", 2, i) for i in range(pages)]
    options = FileOptions(
        path=str(tmp_path / "store"),
        capacity_mib=64,
        segment_mib=32,
        io_threads=2,
        read_processes=2,
        reader_deadline_s=60.0,
    )
    env = BackendEnv(tmp_path, pool=arena.array.data, pool_path=str(arena.path))
    backend = FileBackend(options, env)
    await backend.open()
    try:
        assert all(await backend.put(NS, [PageRef(k, src[i].data) for i, k in enumerate(keys)]))
        readers = backend._readers
        assert readers is not None
        children = [reader.child for reader in readers.readers]
        assert all(child is not None for child in children)
        pids = {child: child.transport.get_pid() for child in children}  # type: ignore[union-attr]
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        stuck = asyncio.ensure_future(backend.get(NS, [PageRef(keys[0], dst[0].data)]))
        await _until(lambda: any(child.queued for child in pids))
        busy = next(child for child in pids if child.queued)
        idle = next(child for child in pids if child is not busy)
        os.kill(pids[idle], signal.SIGCONT)
        for _ in range(2):  # both turns of the rotation
            dst[1:] = 0
            got = await asyncio.wait_for(
                backend.get(NS, [PageRef(keys[i], dst[i].data) for i in (1, 2)]), 10
            )
            assert got == [True, True] and np.array_equal(src[1:], dst[1:])
            assert busy.queued == page and not stuck.done()
        os.kill(pids[busy], signal.SIGCONT)
        assert await asyncio.wait_for(stuck, 10) == [True]
        assert np.array_equal(src[0], dst[0])
        assert backend.stats()["readers_lost"] == 0 and backend.stats()["reader_pages"] == 5
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await backend.close()


def test_disjoint_ranges() -> None:
    u8 = np.uint64
    assert disjoint(np.array([0, 10, 20], u8), np.array([10, 10, 10], u8))
    assert disjoint(np.array([20, 0, 10], u8), np.array([10, 10, 10], u8))
    assert not disjoint(np.array([20, 0, 9], u8), np.array([10, 10, 10], u8))
    assert not disjoint(np.array([5, 5], u8), np.array([1, 1], u8))
    assert disjoint(np.array([5, 5], u8), np.array([0, 1], u8))  # an empty range overlaps nothing
    assert disjoint(np.array([], u8), np.array([], u8))


async def test_a_killed_reader_loses_nothing_and_comes_back(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    victim = store.pids()[0]
    os.kill(victim, signal.SIGKILL)
    await _until(lambda: store.stat("readers_alive") == 1)
    assert store.stat("readers_lost") == 1
    assert all(await store.get())  # the survivor and, as needed, the threads
    assert np.array_equal(store.src, store.dst)
    # started again (at most once a second) by a later read
    await asyncio.sleep(1.1)
    assert all(await store.get())
    await _until(lambda: store.stat("readers_alive") == 2)
    assert victim not in store.pids()
    assert any("file reader" in r.message and "ended" in r.message for r in caplog.records)


async def test_a_hung_reader_is_killed_at_its_deadline(store: Store) -> None:
    pids = store.pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # hangs mid-stream, as on a dead disk
    t0 = time.monotonic()
    got = await asyncio.wait_for(store.get(), 20)
    took = time.monotonic() - t0
    assert all(got) and np.array_equal(store.src, store.dst)
    assert 1.5 < took < 10, took  # the deadline (2 s), then the threads
    assert store.stat("readers_lost") == 2
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_cancelled_read_ends_the_readers_that_still_write(
    store: Store, cancels: int
) -> None:
    """Cancelled once, or again while it ends its readers."""
    pids = store.pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    task = asyncio.ensure_future(store.get())
    await asyncio.sleep(0.3)
    for _ in range(cancels):
        task.cancel()
        await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await task
    # when the call has ended, nothing of it can write a slot any more
    assert not any(_alive(pid) for pid in pids)


async def test_buffers_outside_the_pool_are_read_on_threads(store: Store) -> None:
    mine = [bytearray(PAGE) for _ in range(PAGES)]
    refs = [PageRef(k, memoryview(b)) for k, b in zip(store.keys, mine, strict=True)]
    assert all(await store.backend.get(NS, refs))
    assert all(bytes(b) == store.src[i].tobytes() for i, b in enumerate(mine))
    assert store.stat("reader_pages") == 0


async def test_close_ends_the_readers_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Store(tmp_path)
    await s.backend.open()
    pids = s.pids()
    assert len(pids) == 2
    await s.backend.close()
    assert not any(_alive(pid) for pid in pids)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_no_pool_file_means_threads(tmp_path: Path) -> None:
    options = FileOptions(path=str(tmp_path / "store"), capacity_mib=8, segment_mib=2)
    backend = FileBackend(options, BackendEnv(tmp_path))
    await backend.open()
    try:
        assert backend._readers is None and "readers_alive" not in backend.stats()
    finally:
        await backend.close()


def test_a_reader_refuses_what_it_cannot_take(tmp_path: Path) -> None:
    """Requests outside the pool or the store are answered 0 unread; a frame of
    the wrong size ends the reader."""
    arena = Arena.create(tmp_path / "pool", 4 * PAGE, populate=False)
    (tmp_path / "store").mkdir()
    arena.array[:] = 0x5A
    argv = [sys.executable, "-m", "hicached_backends.file_readers", str(arena.path)]
    argv += [str(4 * PAGE), str(tmp_path / "store"), "2", "off", str(os.getpid())]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    with proc:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.read(4) == struct.pack("<I", 0)  # ready
        records = np.zeros(4, RECORD)
        records["length"] = PAGE
        records["slot"] = [4 * PAGE, 3 * PAGE + 1, 0, 0]  # past the pool; over its end
        records["segment"] = [0, 0, 2, 0]  # the third: past the store
        records["offset"] = 4096
        body = NS + records.tobytes()
        proc.stdin.write(struct.pack("<I", len(body)) + body)
        proc.stdin.flush()
        assert proc.stdout.read(4) == struct.pack("<I", 4)
        # the fourth names a segment file that does not exist: unread, not a crash
        assert proc.stdout.read(4) == bytes(4)
        assert (arena.array == 0x5A).all()  # no slot was touched
        proc.stdin.write(struct.pack("<I", 17) + bytes(17))  # not a whole record
        proc.stdin.flush()
        assert proc.wait(10) == 3
    arena.close()


def test_readers_under_the_default_event_loop(tmp_path: Path) -> None:
    """The benches run asyncio's own loop, whose child watcher must be the only
    one to reap a reader: each stop leaves exit code 0, and asyncio logs no
    'Unknown child process' (status 255) for a reaped one."""
    script = f"""
import asyncio, sys
from pathlib import Path
from hicached.arena import Arena
from hicached_backends.file_readers import Readers

async def main():
    arena = Arena.create(Path({str(tmp_path)!r}) / "pool", 1 << 20, populate=False)
    readers = Readers(4, pool=arena.array.data, pool_path=str(arena.path), huge_pages="off",
                      store=Path({str(tmp_path)!r}), n_segments=1, deadline_s=10)
    await readers.start()
    await readers.stop()
    codes = [r.child.transport.get_returncode() for r in readers.readers]
    assert codes == [0] * 4, codes
    arena.close()

for _ in range(8):
    asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Unknown child" not in done.stderr, done.stderr


async def test_a_read_past_a_request_s_records_is_split(tmp_path: Path) -> None:
    """More records than one request may carry (MAX_RECORDS), with one reader:
    several requests, none refused."""
    n, size = MAX_RECORDS + 100, 64
    arena = Arena.create(tmp_path / "pool", 2 * n * size, populate=False)
    rows = arena.array.reshape(2 * n, size)
    rows[:n] = np.random.default_rng(3).integers(0, 256, (n, size), dtype=np.uint8)
    keys = [struct.pack("<QQ", 2, i) for i in range(n)]
    options = FileOptions(path=str(tmp_path / "store"), capacity_mib=64, segment_mib=16)
    env = BackendEnv(tmp_path, pool=arena.array.data, pool_path=str(arena.path))
    backend = FileBackend(msgspec.structs.replace(options, read_processes=1), env)
    await backend.open()
    try:
        assert all(await backend.put(NS, [PageRef(k, rows[i].data) for i, k in enumerate(keys)]))
        got = await backend.get(NS, [PageRef(k, rows[n + i].data) for i, k in enumerate(keys)])
        assert all(got) and np.array_equal(rows[:n], rows[n:])
        stats = backend.stats()
        assert (stats["reader_pages"], stats["readers_lost"]) == (n, 0)
    finally:
        await backend.close()
        arena.close()


async def test_a_cancelled_read_on_threads_outlives_its_threads(tmp_path: Path) -> None:
    s = Store(tmp_path, readers=0)
    await s.backend.open()
    try:
        assert all(await s.backend.put(NS, s.refs(s.src)))
        for _ in range(20):
            task = asyncio.ensure_future(s.get())
            await asyncio.sleep(0)  # the threads have their parts
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            seen = s.dst.copy()
            await asyncio.sleep(0.05)
            assert np.array_equal(seen, s.dst), "a buffer was written after its read ended"
    finally:
        await s.backend.close()


async def test_close_does_not_wait_out_a_stuck_reader(tmp_path: Path) -> None:
    s = Store(tmp_path, deadline_s=30.0)
    await s.backend.open()
    pids = s.pids()
    os.kill(pids[0], signal.SIGSTOP)
    t0 = time.monotonic()
    await s.backend.close()
    assert time.monotonic() - t0 < 10  # a short grace, then killed; not the 30 s deadline
    assert not any(_alive(pid) for pid in pids)


async def test_readers_that_start_serve_beside_one_that_does_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    arena = Arena.create(tmp_path / "pool", 1 << 20, populate=False)
    readers = Readers(
        2,
        pool=arena.array.data,
        pool_path=str(arena.path),
        huge_pages="off",
        store=tmp_path,
        n_segments=1,
        deadline_s=30,
    )
    readers.readers[1].argv = [sys.executable, "-c", "raise SystemExit(1)"]  # fails at start
    try:
        t0 = time.monotonic()
        with pytest.raises(ReaderLost, match="did not start"):
            await readers.start()
        assert time.monotonic() - t0 < 10  # known at its exit, not at the 30 s deadline
        assert readers.stats()["readers_alive"] == 1
        child = readers.readers[0].child
        assert child is not None and child.transport is not None
        os.kill(child.transport.get_pid(), signal.SIGKILL)  # a later loss still counts
        await _until(lambda: readers.stats()["readers_lost"] == 1)
        assert any("file reader ended" in r.message for r in caplog.records)
    finally:
        await readers.stop()
        arena.close()


async def test_a_reader_that_cannot_be_spawned_leaves_the_store_on_threads(
    store: Store,
) -> None:
    """No interpreter at the reader's path (a replaced install, no descriptors
    left): the store reads on its threads, retries later, and closes cleanly."""
    readers = store.backend._readers
    assert readers is not None
    for reader in readers.readers:
        reader.argv = ["/nonexistent/python3", *reader.argv[1:]]
    for pid in store.pids():
        os.kill(pid, signal.SIGKILL)
    await _until(lambda: store.stat("readers_alive") == 0)
    for _ in range(3):
        assert all(await store.get()) and np.array_equal(store.src, store.dst)
        await asyncio.sleep(0.6)
    assert store.stat("readers_alive") == 0
    # close (in the fixture) must not raise the failed starts' errors
