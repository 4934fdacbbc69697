"""A damaged record is a miss on every read path, with the batched verifier.

Pages are written by the real backends (file store with its I/O threads or its
reader processes, Mooncake against a real master, the memory store), then
damaged where the backend keeps them: a byte of the payload flipped, or the
second half of the header zeroed (a torn write). Every read of a damaged page
must answer False, hot (pages in the page cache) and cold (cache dropped), and
every other page of the same batch must still come back whole. Batches are made
large enough, with a small slice size, that the checksums run in parallel
slices too. Nothing is faked: the damage is done to the real file or object.
"""

from __future__ import annotations

import asyncio
import errno
import os
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest

from hicached.wire.arena import Arena
from hicached_backends import checksums
from hicached_backends.base import Backend, BackendEnv, BackendError, PageRef
from hicached_backends.file import FileBackend
from hicached_backends.file_reads import FAILED_READS
from hicached_backends.memory import MemoryBackend
from hicached_backends.options import FileOptions, MemoryOptions, MooncakeOptions, usable_cpus
from hicached_backends.record import HEADER_BYTES
from tests.services import MooncakeMaster

pytestmark = pytest.mark.timeout(120)

NS = bytes(range(16))
PAGE = 16 << 10
PAGES = 48
BAD = 17  # the page that is damaged

Damage = Callable[[bytearray], None]


def _flip_payload(record: bytearray) -> None:
    record[HEADER_BYTES + PAGE // 2] ^= 0x40


def _tear_header(record: bytearray) -> None:
    record[HEADER_BYTES // 2 : HEADER_BYTES] = bytes(HEADER_BYTES // 2)


DAMAGES = {"payload byte flipped": _flip_payload, "header torn": _tear_header}


class Pages:
    """Source pages and read targets in one pool file, as the daemon maps it."""

    def __init__(self, tmp: Path) -> None:
        self.arena = Arena.create(tmp / "pool", 2 * PAGES * PAGE, populate=False)
        rows = self.arena.array.reshape(2 * PAGES, PAGE)
        self.src, self.dst = rows[:PAGES], rows[PAGES:]
        self.src[:] = np.random.default_rng(11).integers(0, 256, self.src.shape, dtype=np.uint8)
        self.keys = [struct.pack("<QQ", 5, i) for i in range(PAGES)]
        self.env = BackendEnv(tmp, pool=self.arena.array.data, pool_path=str(self.arena.path))

    def refs(self, rows: np.ndarray) -> list[PageRef]:
        return [PageRef(k, rows[i].data) for i, k in enumerate(self.keys)]

    async def read(self, backend: Backend) -> list[bool]:
        self.dst[:] = 0
        return await backend.get(NS, self.refs(self.dst))

    def check(self, got: list[bool]) -> None:
        assert got == [i != BAD for i in range(PAGES)]
        good = [i for i in range(PAGES) if i != BAD]
        assert np.array_equal(self.src[good], self.dst[good])


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    # so that a batch of 768 KiB is hashed in parallel slices where a pool is given
    monkeypatch.setattr(checksums, "SLICE_BYTES", 64 << 10)


def _damage_file(backend: FileBackend, key: bytes, damage: Damage, cold: bool) -> None:
    loc = backend.index[(NS, key)]
    fd = backend.segments[loc.segment].fd
    record = bytearray(os.pread(fd, HEADER_BYTES + loc.length, loc.offset))
    damage(record)
    os.pwrite(fd, bytes(record), loc.offset)
    if cold:
        for seg in backend.segments:
            os.fdatasync(seg.fd)
            os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
@pytest.mark.parametrize("cold", [False, True], ids=["hot", "cold"])
@pytest.mark.parametrize("readers", [0, 2], ids=["threads", "readers"])
async def test_file_store_refuses_a_damaged_record(
    tmp_path: Path, readers: int, cold: bool, damage: Damage
) -> None:
    pages = Pages(tmp_path)
    options = FileOptions(
        path=str(tmp_path / "store"),
        capacity_mib=8,
        segment_mib=2,
        io_threads=2,
        read_processes=readers,
    )
    backend = FileBackend(options, pages.env)
    await backend.open()
    try:
        assert all(await backend.put(NS, pages.refs(pages.src)))
        assert all(await pages.read(backend))  # intact: all of it
        _damage_file(backend, pages.keys[BAD], damage, cold)
        pages.check(await pages.read(backend))
        stats = backend.stats()
        assert stats["bad_records"] == 1 and (NS, pages.keys[BAD]) not in backend.index
        # the path asked for is the one that answered
        assert stats.get("reader_pages", 0) == (2 * PAGES if readers else 0)
        pages.check(await pages.read(backend))  # dropped: still a miss
    finally:
        await backend.close()


OneThread = tuple[Pages, FileBackend, list[bytes]]


@pytest.fixture
async def one_thread(tmp_path: Path) -> AsyncIterator[OneThread]:
    """A file store open on one I/O thread and no reader processes, where a
    test can fault the reads it makes (``os.preadv``): its pages, the store,
    and the keys it forgets (``on_forget``) as it forgets them."""
    pages = Pages(tmp_path)
    options = FileOptions(
        path=str(tmp_path / "store"),
        capacity_mib=8,
        segment_mib=2,
        io_threads=1,
        read_processes=0,
    )
    backend = FileBackend(options, pages.env)
    forgotten: list[bytes] = []
    backend.on_forget = lambda ns, keys: forgotten.extend(keys)
    await backend.open()
    try:
        yield pages, backend, forgotten
    finally:
        await backend.close()


async def test_file_store_keeps_a_page_whose_read_failed(
    one_thread: OneThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fails (EIO) proves nothing of the record: that read is a
    miss, counted in ``read_errors``, and the page stays, held, listed and
    read whole and verified next time. A call none of whose pages could be
    read fails, retriable (the dispatcher tries it again), and drops nothing.

    Fault injection: ``os.preadv``, which the I/O threads read records with,
    is replaced in this process to raise EIO: once, for the first of two
    records that are not adjacent (two preadv calls, on one thread), then for
    every read."""
    pages, backend, forgotten = one_thread
    assert all(await backend.put(NS, pages.refs(pages.src)))
    real = os.preadv
    reads: list[int] = []

    def eio_once(fd: int, buffers: list[memoryview], offset: int) -> int:
        reads.append(offset)
        if len(reads) == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", eio_once)
    dst = pages.refs(pages.dst)
    pages.dst[:] = 0
    assert await backend.get(NS, [dst[0], dst[2]]) == [False, True]
    assert len(reads) == 2 and np.array_equal(pages.dst[2], pages.src[2])
    stats = backend.stats()
    assert stats["read_errors"] == 1 and stats["bad_records"] == 0 and forgotten == []
    assert await backend.exists(NS, pages.keys) == PAGES
    assert [key async for ns, key in backend.scan() if ns == NS] == pages.keys
    assert await backend.get(NS, [dst[0]]) == [True]  # the next read: the page, verified
    assert np.array_equal(pages.dst[0], pages.src[0])

    def eio(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(BackendError) as failed:
        await pages.read(backend)
    assert failed.value.retriable
    stats = backend.stats()
    assert stats["read_errors"] == 1 + PAGES and stats["bad_records"] == 0
    assert forgotten == [] and len(backend.index) == PAGES
    monkeypatch.setattr(os, "preadv", real)
    assert all(await pages.read(backend))
    assert np.array_equal(pages.src, pages.dst)


async def test_file_store_drops_a_page_whose_reads_keep_failing(
    one_thread: OneThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record that fails to read FAILED_READS times in a row (a sector that
    cannot be read) is dropped and forgotten, so that the page can be stored
    anew; a read of it that succeeds starts the count again, and the other
    pages of the same calls stay.

    Fault injection: ``os.preadv`` is replaced in this process to raise EIO
    for reads at the first record's offset while ``broken`` is set."""
    pages, backend, forgotten = one_thread
    assert all(await backend.put(NS, pages.refs(pages.src)))
    real = os.preadv
    first = backend.index[(NS, pages.keys[0])].offset
    broken = [True]

    def eio_at_first(fd: int, buffers: list[memoryview], offset: int) -> int:
        if broken[0] and offset == first:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", eio_at_first)
    dst = pages.refs(pages.dst)
    for _ in range(FAILED_READS - 1):
        assert await backend.get(NS, [dst[0], dst[2]]) == [False, True]
    broken[0] = False  # one read that succeeds: the count starts again
    assert await backend.get(NS, [dst[0]]) == [True]
    broken[0] = True
    for _ in range(FAILED_READS - 1):
        assert await backend.get(NS, [dst[0], dst[2]]) == [False, True]
    assert forgotten == [] and (NS, pages.keys[0]) in backend.index
    assert await backend.get(NS, [dst[0], dst[2]]) == [False, True]
    assert forgotten == [pages.keys[0]] and (NS, pages.keys[0]) not in backend.index
    assert backend.stats()["read_errors"] == 2 * FAILED_READS - 1
    assert await backend.exists(NS, pages.keys[:1]) == 0
    assert await backend.exists(NS, pages.keys[1:]) == PAGES - 1
    broken[0] = False
    assert all(await backend.put(NS, [pages.refs(pages.src)[0]]))  # stored anew
    pages.dst[0] = 0
    assert await backend.get(NS, [dst[0]]) == [True]
    assert np.array_equal(pages.dst[0], pages.src[0])


async def test_file_store_writes_records_of_several_calls_and_segments(tmp_path: Path) -> None:
    """Concurrent puts of two namespaces share a write group, and a group that
    fills a segment goes on in the next: every record's header carries its own
    namespace and generation, checksummed on the write threads."""
    pages = Pages(tmp_path)
    options = FileOptions(
        path=str(tmp_path / "store"), capacity_mib=4, segment_mib=1, read_processes=0
    )
    backend = FileBackend(options, pages.env)
    other = bytes(16)
    await backend.open()
    try:
        refs = pages.refs(pages.src)
        assert all(await backend.put(bytes([9]) * 16, refs))  # 3/4 of the first segment
        half = PAGES // 2
        assert await asyncio.gather(
            backend.put(NS, refs[:half]), backend.put(other, refs[half:])
        ) == [[True] * half, [True] * (PAGES - half)]
        placed = [(NS, k) for k in pages.keys[:half]] + [(other, k) for k in pages.keys[half:]]
        assert {backend.index[key].segment for key in placed} == {0, 1}
        dst = pages.refs(pages.dst)
        assert await backend.get(NS, dst[:half]) == [True] * half
        assert await backend.get(other, dst[half:]) == [True] * (PAGES - half)
        assert np.array_equal(pages.src, pages.dst)
        assert await backend.get(other, dst[:1]) == [False]  # not under another namespace
    finally:
        await backend.close()


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_mooncake_refuses_a_damaged_object(
    tmp_path: Path, mooncake: MooncakeMaster, damage: Damage
) -> None:
    from hicached_backends.mooncake import MooncakeBackend

    pages = Pages(tmp_path)
    options = MooncakeOptions(
        master=mooncake.master,
        metadata_server=mooncake.metadata,
        global_segment_mib=32,
        local_buffer_mib=16,
        threads=1,  # so that 2 CPUs give each batch's checksums two slices
        verify_threads=2,
    )
    backend = MooncakeBackend(options, pages.env)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(backend.open())
        assert backend._parts > 1 or usable_cpus() < 2
        loop.run_until_complete(backend.delete(NS, pages.keys))  # left by an earlier test
        assert all(loop.run_until_complete(backend.put(NS, pages.refs(pages.src))))
        assert all(loop.run_until_complete(pages.read(backend)))
        store, name = backend._store, backend.names(NS, [pages.keys[BAD]])[0]
        record = bytearray(store.get(name))
        assert len(record) == HEADER_BYTES + PAGE
        damage(record)
        assert store.upsert(name, bytes(record)) == 0
        pages.check(loop.run_until_complete(pages.read(backend)))
        assert backend.stats()["bad_objects"] == 1
    finally:
        loop.run_until_complete(backend.delete(NS, pages.keys))
        loop.run_until_complete(backend.close())
        loop.close()


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
async def test_memory_store_refuses_a_damaged_record(tmp_path: Path, damage: Damage) -> None:
    pages = Pages(tmp_path)
    backend = MemoryBackend(MemoryOptions(), pages.env)
    assert all(await backend.put(NS, pages.refs(pages.src)))
    record = bytearray(backend.records[(NS, pages.keys[BAD])])
    damage(record)
    backend.records[(NS, pages.keys[BAD])] = bytes(record)
    pages.check(await pages.read(backend))
    assert (NS, pages.keys[BAD]) not in backend.records
