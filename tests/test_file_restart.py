"""The file store after restarts: it resumes at its newest records and recycles
the oldest segment first, exactly as if it had never stopped.

Every page here is new and the same size, so the store's contents follow from
the count written alone: page ``i`` lands in the ``i // PER_SEGMENT``-th
segment ever filled, and the last ``SEGMENTS`` of those are what is kept.
"""

from __future__ import annotations

import asyncio
import errno
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash

from hicached_backends.base import BackendEnv, BackendError, PageRef
from hicached_backends.file import FileBackend
from hicached_backends.file_layout import SUPER, SUPER_BYTES, superblock
from hicached_backends.file_readers import segment_name
from hicached_backends.options import FileOptions
from hicached_backends.record import HEADER_BYTES, pack_header

NS = bytes([0xC5]) * 16
PAGE = (64 << 10) - HEADER_BYTES  # one record is exactly 64 KiB
SEGMENTS = 4
PER_SEGMENT = ((1 << 20) - SUPER_BYTES) // (64 << 10)  # 15 records in a 1 MiB segment


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (PAGE // 4 + 1))[:PAGE]


def expected_kept(written: int) -> list[int]:
    """Pages a ring of SEGMENTS segments holds after ``written`` new pages."""
    if written == 0:
        return []
    first_kept = max(0, (written - 1) // PER_SEGMENT - SEGMENTS + 1)
    return list(range(first_kept * PER_SEGMENT, written))


class Store:
    """A file store on ``path`` that can be stopped and started again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.forgotten: list[int] = []  # every page the store dropped, in order
        self.backend: FileBackend | None = None

    async def start(self) -> FileBackend:
        options = FileOptions(
            path=str(self.path), capacity_mib=SEGMENTS, segment_mib=1, io_threads=2
        )
        backend = FileBackend(options, BackendEnv(self.path))
        backend.on_forget = self._forgot
        await backend.open()
        self.backend = backend
        return backend

    def _forgot(self, ns: bytes, keys: list[bytes]) -> None:
        assert ns == NS
        self.forgotten += [int.from_bytes(k, "big") for k in keys]

    async def stop(self, *, crash: bool = False) -> None:
        """Close the store; ``crash`` leaves it as a killed process would: no
        superblock is written, only what each put made durable is there."""
        backend, self.backend = self.backend, None
        assert backend is not None
        if not crash:
            await backend.close()
            return
        backend._unlock()  # the files are closed as the kernel closes a dead process's
        assert backend._pool is not None
        backend._pool.shutdown(wait=True)
        backend._pool = None

    async def put(self, pages: range, batch: int = 7) -> None:
        assert self.backend is not None
        for lo in range(pages.start, pages.stop, batch):
            chunk = range(lo, min(lo + batch, pages.stop))
            refs = [PageRef(key(i), memoryview(bytearray(payload(i)))) for i in chunk]
            assert await self.backend.put(NS, refs) == [True] * len(refs)

    async def kept(self) -> list[int]:
        """The pages the store lists, after checking that each one reads back intact."""
        assert self.backend is not None
        listed = sorted([int.from_bytes(k, "big") async for ns, k in self.backend.scan()])
        bufs = [bytearray(PAGE) for _ in listed]
        refs = [PageRef(key(i), memoryview(b)) for i, b in zip(listed, bufs, strict=True)]
        assert await self.backend.get(NS, refs) == [True] * len(listed)
        assert all(bytes(b) == payload(i) for i, b in zip(listed, bufs, strict=True))
        return listed


async def test_restart_at_a_generation_tie_resumes_at_the_newest_segment(
    tmp_path: Path,
) -> None:
    """Fill the ring and wrap into the first segment again: under per-segment
    generations every segment then holds generation 1, so which one is newest
    can only come from an ordering that survives the restart."""
    store = Store(tmp_path / "pages")
    await store.start()
    written = SEGMENTS * PER_SEGMENT + 5  # the last 5 pages went into segment 0 again
    await store.put(range(written))
    assert store.forgotten == list(range(PER_SEGMENT))  # segment 0's first use
    await store.stop()

    await store.start()
    assert await store.kept() == expected_kept(written)  # nothing lost by the restart
    await store.put(range(written, written + 1))
    assert await store.kept() == list(range(PER_SEGMENT, written + 1)), "newest pages recycled"
    assert store.forgotten == list(range(PER_SEGMENT))

    # Segment 0 fills up; the next page recycles segment 1, the oldest.
    end = (SEGMENTS + 1) * PER_SEGMENT + 1
    await store.put(range(written + 1, end))
    assert await store.kept() == list(range(2 * PER_SEGMENT, end))
    assert store.forgotten == list(range(2 * PER_SEGMENT))
    await store.stop()


async def test_restarts_in_a_row_evict_oldest_first(tmp_path: Path) -> None:
    """Stop (cleanly or as if killed) at many points, segment edges and
    wrap-arounds included, with writes between; after every step the store
    holds exactly the pages a store that never stopped holds, and it has
    dropped exactly the oldest pages, in the order they were written."""
    store = Store(tmp_path / "restarted")
    twin = Store(tmp_path / "never-stopped")
    await store.start()
    await twin.start()
    written = 0
    steps = [
        5,  # part of the first segment
        PER_SEGMENT - 5,  # the first segment exactly full
        2 * PER_SEGMENT,
        PER_SEGMENT + 3,  # wraps into segment 0: all segments tied per-segment
        1,  # resumes in segment 0, still tied
        PER_SEGMENT - 4,  # segment 0 exactly full again
        7,
        3 * PER_SEGMENT,  # more than a lap in one go
        PER_SEGMENT,
        1,
        4 * PER_SEGMENT + 2,
        11,
    ]
    for n, count in enumerate(steps):
        await store.put(range(written, written + count))
        await twin.put(range(written, written + count))
        written += count
        await store.stop(crash=n % 2 == 1)
        await store.start()
        kept = await store.kept()
        assert kept == expected_kept(written), f"after step {n} ({written} pages written)"
        assert kept == await twin.kept()
        assert store.forgotten == list(range(written - len(kept)))
        assert twin.forgotten == store.forgotten
    await store.stop()
    await twin.stop()


def _write_old_store(path: Path) -> None:
    """Segments as format version 1 wrote them (generations counted per
    segment), full of records; segment 2's superblock is unreadable."""
    old = [(3, 1000), (2, 2000), (6, 3000), (2, 4000)]  # (generation, first page)
    for n, (generation, first) in enumerate(old):
        with open(path / f"segment-{n:05d}.hcs", "r+b") as f:
            raw = SUPER.pack(b"HCS1", 1, 0, generation, SUPER_BYTES)
            f.write(raw + struct.pack("<Q", xxhash.xxh3_64_intdigest(raw)))
            f.seek(SUPER_BYTES)
            for i in range(first, first + PER_SEGMENT):
                f.write(pack_header(NS, key(i), payload(i), generation) + payload(i))
    with open(path / "segment-00002.hcs", "r+b") as f:
        f.write(bytes(64))


async def test_an_old_format_store_is_dropped_and_never_read(tmp_path: Path) -> None:
    """Segments of format version 1 (generations counted per segment, so they
    cannot be ordered) are dropped at start; their leftover records never come
    back, even where an old generation is higher than the new ones would start
    or stands behind an unreadable superblock."""
    store = Store(tmp_path / "pages")
    await store.start()
    await store.stop()
    _write_old_store(store.path)

    await store.start()
    assert await store.kept() == []
    # Segment 2 ends up holding fewer new records than old ones, so leftovers of
    # generation 6 (behind the unreadable superblock) follow the new records there.
    written = 2 * PER_SEGMENT + 5
    await store.put(range(written))
    await store.stop()
    await store.start()
    assert await store.kept() == list(range(written))
    await store.stop()


# -- failed writes ---------------------------------------------------------------
# The disk faults below are injected by replacing os.pwritev / os.fdatasync for
# one call (a fake for fault injection only); every other call is the real one.


def _refs(pages: range) -> list[PageRef]:
    return [PageRef(key(i), memoryview(bytearray(payload(i)))) for i in pages]


async def test_a_failed_write_takes_no_room_and_hides_no_later_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write group fails after part of it reached the file. Its space goes
    back: the store holds as much as before, and the pages written after it
    survive a restart (a hole below them would end the restart's scan)."""
    store = Store(tmp_path / "pages")
    backend = await store.start()
    await store.put(range(5))
    used = backend.stats()["bytes_used"]
    real = os.pwritev

    def torn(fd: int, iov: list[Any], offset: int) -> int:
        monkeypatch.setattr(os, "pwritev", real)
        real(fd, iov[:1], offset)  # the first record's header reaches the file
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "pwritev", torn)
    with pytest.raises(BackendError, match="write failed"):
        await backend.put(NS, _refs(range(100, 103)))
    assert backend.stats()["bytes_used"] == used, "a failed write took room"
    await store.put(range(5, 9))
    for crash in (False, True):
        await store.stop(crash=crash)
        await store.start()
        assert await store.kept() == list(range(9)), "acknowledged pages lost"


async def test_after_a_failed_fsync_nothing_past_it_is_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group A's fsync fails while group B, written after A in the same segment,
    waits for its own. B's pages there are answered False, not True: if A's
    bytes never reached the disk, a restart's scan ends at them and never
    reaches B's. Writes then go on in the next segment."""
    store = Store(tmp_path / "pages")
    backend = await store.start()
    await store.put(range(3))
    real = os.fdatasync
    entered, release = threading.Event(), threading.Event()

    def failing(fd: int) -> None:
        monkeypatch.setattr(os, "fdatasync", real)
        entered.set()
        release.wait(10)
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fdatasync", failing)
    a = asyncio.ensure_future(backend.put(NS, _refs(range(100, 102))))
    await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
    b = asyncio.ensure_future(backend.put(NS, _refs(range(200, 202))))
    for _ in range(1000):  # until B is written and waits for A's fsync (10 s at most)
        await asyncio.sleep(0.01)
        if backend.segments[0].write_off > SUPER_BYTES + 5 * 64 * 1024:
            break
    release.set()
    with pytest.raises(BackendError, match="fsync failed"):
        await a
    assert await b == [False, False], "pages past a failed fsync were acknowledged"
    await store.put(range(3, 6))  # into the next segment
    assert backend.active == 1
    await store.stop()
    fd = os.open(tmp_path / "pages" / segment_name(0), os.O_RDONLY)
    try:  # the closed segment's frontier ends before what the failed fsync may have lost
        assert superblock(fd)[3] == SUPER_BYTES + 3 * (64 << 10)
    finally:
        os.close(fd)
    await store.start()
    for crash in (False, True):
        await store.stop(crash=crash)
        await store.start()
        kept = await store.kept()  # every listed page reads back intact
        assert [i for i in kept if i < 100] == list(range(6))


async def test_a_put_larger_than_the_ring_answers_false_for_what_it_cannot_keep(
    tmp_path: Path,
) -> None:
    """One call with more pages than the ring holds must not recycle a segment
    that holds its own earlier pages and still answer True for them."""
    store = Store(tmp_path / "pages")
    backend = await store.start()
    count = SEGMENTS * PER_SEGMENT + 10
    answers = await backend.put(NS, _refs(range(count)))
    stored = [i for i, ok in enumerate(answers) if ok]
    assert 0 < len(stored) < count
    assert await store.kept() == stored, "a page answered True is not stored"
    await store.stop()
    await store.start()
    assert await store.kept() == stored


STRAGGLER_NS = bytes([0xAB]) * 16
STRAGGLER_RECORD = 64 << 10
STRAGGLER_PAGE = STRAGGLER_RECORD - HEADER_BYTES
STRAGGLERS = 32  # two threads of 16 records; thread B writes two runs of 8 (512 KiB each)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _buf(fill: int) -> memoryview:
    return memoryview(bytearray([fill]) * STRAGGLER_PAGE)


async def _start(path: Path) -> FileBackend:
    b = FileBackend(
        FileOptions(path=str(path), capacity_mib=16, segment_mib=4, io_threads=2, read_processes=0),
        BackendEnv(path),
    )
    await b.open()
    return b


@pytest.mark.asyncio
async def test_a_failed_put_ends_after_its_threads_so_no_record_holds_a_slots_next_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection at the disk (os.pwritev): one I/O thread's write fails
    with EIO while another's is slow. The put fails; the daemon then frees its
    slots and another key's bytes land there. No thread may still be hashing
    and writing those slots: after the next group and a restart, none of the
    failed put's keys reads back as a verified hit with the next owner's bytes."""
    backend = await _start(tmp_path)
    real = os.pwritev
    go = threading.Event()
    at0 = SUPER_BYTES
    at16 = SUPER_BYTES + 16 * STRAGGLER_RECORD

    def disk(fd: int, iov: list[memoryview], offset: int) -> int:
        if offset == at0:
            raise OSError(errno.EIO, "injected")
        if offset == at16:
            go.wait(10)
        return real(fd, iov, offset)

    monkeypatch.setattr(os, "pwritev", disk)
    pages = [PageRef(_key(i), _buf(1)) for i in range(STRAGGLERS)]
    threading.Timer(0.5, go.set).start()  # the slow write ends in 0.5 s
    with pytest.raises(BackendError):
        await asyncio.wait_for(backend.put(STRAGGLER_NS, pages), 5)
    returned_early = not go.is_set()
    assert not returned_early, "put() ended while one of its threads still read the slots"
    for p in pages:  # the call is over: the daemon frees the slots, another key's bytes land
        p.buf[:] = b"\x09" * STRAGGLER_PAGE
    await asyncio.sleep(1.0)
    monkeypatch.setattr(os, "pwritev", real)
    ok = await backend.put(STRAGGLER_NS, [PageRef(_key(100 + i), _buf(5)) for i in range(24)])
    assert ok == [True] * 24
    await backend.close()
    backend = await _start(tmp_path)
    try:
        lies = []
        for i in range(STRAGGLERS):
            out = _buf(0)
            got = await backend.get(STRAGGLER_NS, [PageRef(_key(i), out)])
            if got == [True] and bytes(out) == b"\x09" * STRAGGLER_PAGE:
                lies.append(i)
        assert lies == [], (
            f"put() returned early={returned_early}; keys {lies} read back as verified hits "
            "holding the bytes of the slots' next owner"
        )
    finally:
        await backend.close()


async def test_a_record_forged_inside_a_page_is_never_read_after_a_restart(
    tmp_path: Path,
) -> None:
    """A page's bytes are whatever a client stored, another tenant's included.
    Past the end of a recycled segment's new records lie the bytes of its
    earlier use, and where pages of other sizes were written there, the
    restart's scan meets them in the middle of a payload: a header forged
    there, with the generation the segment was to carry next and checksums
    that match, would be read as a record of a key its writer does not own
    (another namespace's), and served. Generations cannot be foretold, so no
    forged header carries the current one.

    Fault injection: none; the forged bytes are ordinary page payloads."""
    record = 4096  # the writer's records: a 4032-byte payload and its header
    small = record - HEADER_BYTES
    victim_ns, victim_page = bytes([0x77]) * 16, 4096
    victim = PageRef(key(10**9), memoryview(bytearray(b"v" * victim_page)))
    target = key(10**9 + 1)  # a page of the victim's, not stored by anyone
    per_segment = ((1 << 20) - SUPER_BYTES) // record
    # Generations run 1 (segment 0), 2 (segment 1), then 3 (segment 0 again).
    # Segment 0's first use: record k at SUPER_BYTES + k * record. After the
    # victim's record (4160 bytes) in its second use, the scan reads on at
    # SUPER_BYTES + 4160: the start of the payload of record 1 of the first use.
    forged_off = SUPER_BYTES + HEADER_BYTES + victim_page
    payloads = [bytearray(i.to_bytes(4, "little") * (small // 4)) for i in range(per_segment)]
    # the forged payload: the rest of record 1's payload, record 2's header, and
    # the start of record 2's payload, all known to the writer
    header_2 = pack_header(NS, key(2), bytes(payloads[2]), 1)
    body = bytes(payloads[1][HEADER_BYTES:]) + header_2 + bytes(payloads[2])
    forged_payload = body[:victim_page]
    payloads[1][:HEADER_BYTES] = pack_header(victim_ns, target, forged_payload, 3)
    assert forged_off == SUPER_BYTES + record + HEADER_BYTES  # where record 1's payload begins

    path = tmp_path / "pages"
    options = FileOptions(path=str(path), capacity_mib=2, segment_mib=1, io_threads=1)
    backend = FileBackend(options, BackendEnv(path))
    await backend.open()
    for i in range(2 * per_segment):  # segment 0's first use, then segment 1's
        buf = payloads[i] if i < per_segment else bytearray(small)
        page = PageRef(key(i), memoryview(buf))
        assert await backend.put(NS, [page]) == [True]
    assert await backend.put(victim_ns, [victim]) == [True]  # segment 0, second use
    await backend.close()

    backend = FileBackend(options, BackendEnv(path))
    await backend.open()
    try:
        assert (victim_ns, victim.key) in backend.index
        buf = bytearray(victim_page)
        assert await backend.get(victim_ns, [PageRef(target, memoryview(buf))]) == [False], (
            "a forged record was read as the victim's page"
        )
    finally:
        await backend.close()
