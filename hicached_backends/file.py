"""Local file backend: a ring of large preallocated segment files.

Layout of a segment: a 4 KiB superblock, then records (record.py) packed
back to back. The superblock holds the segment's *generation* and its
*durable frontier*: every record that ends before it was fsynced. A
generation is a sequence number of the whole store (in its high 32 bits;
the low 32 are random, so that no page's bytes can carry a record header of
a generation to come: ``next_generation``): each time a segment is taken
into use it gets the next one, so no two segments share one, the segment
with the highest holds the newest records, and every record left in a file
from an earlier use carries a lower generation than the current one.
Generation 0 marks a segment that holds nothing. Writing:
records of a batch are written with positional I/O from a small thread pool,
then one fdatasync per touched segment; only then are they published in the
in-memory index (so a read never sees an unsynced record). The frontier is
written with the next batch, before its fsync.

Startup rebuilds the index from record headers, segment by segment; records
past the frontier are also checksummed, and the first bad one ends that
segment (it and everything after it are discarded and overwritten later).
Writing resumes in the segment with the highest generation, so a restart
changes neither where the next record goes nor which segment goes next.

Capacity: when the active segment is full, the segment with the lowest
generation (an empty one first) is recycled: its records leave the index
(the daemon is told), it gets the next generation, and records of older
generations in it are ignored from then on.

Format versions (the superblock's version field): 1 counted generations per
segment, so after the ring wrapped several segments could share one and the
newest could not be told apart. Segments of version 1, like segments whose
superblock is unreadable, are dropped at start: they hold nothing, their
superblock stays as it is until the segment is used again, and the
generations their leftovers carry are counted so that no later generation
can match them.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import logging
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from hicached_backends.base import Backend, BackendEnv, BackendError, PageRef, let_go
from hicached_backends.file_layout import (
    MIB,
    SUPER,
    SUPER_BYTES,
    SUPER_MAGIC,
    SUPER_VERSION,
    Loc,
    Segment,
    SegmentScan,
    next_generation,
)
from hicached_backends.file_readers import RECORD, ReaderLost, Readers
from hicached_backends.file_reads import (
    BAD,
    CACHED_RUN_BYTES,
    FAILED,
    GOOD,
    IOV_MAX,
    FailedReads,
    read_on_threads,
    settle,
)
from hicached_backends.options import FileOptions
from hicached_backends.record import (
    HEADER_BYTES,
    address_of,
    checksums,
    nbytes,
    pack_headers,
)

if TYPE_CHECKING:
    from hicached_backends.file_reads import Todo

log = logging.getLogger("hicached.file")

LOCK_NAME = "store.lock"  # held (flock) by the daemon that has the store open


@dataclass(slots=True)
class _Entry:
    """One record a write group plans: where it goes, and the flag it answers."""

    seg: Segment
    generation: int
    offset: int
    ns: bytes
    page: PageRef
    out: list[bool]  # the put call's answers
    at: int  # this page's place in them

    @property
    def end(self) -> int:
        return self.offset + HEADER_BYTES + len(self.page.buf)


@dataclass(slots=True)
class _Group:
    """Writes of concurrent put calls that share one fsync."""

    batch: list[tuple[bytes, Sequence[PageRef], asyncio.Future[list[bool]]]]
    plan: list[_Entry] = field(default_factory=list)
    outcomes: list[list[bool]] = field(default_factory=list)
    ends: dict[int, tuple[Segment, int, int]] = field(default_factory=dict)
    starts: dict[int, tuple[Segment, int, int]] = field(default_factory=dict)

    def fail(self, exc: BaseException, own: asyncio.Future[list[bool]]) -> None:
        """Fail every call of the group but ``own``, whose caller raises ``exc`` itself."""
        for *_, fut in self.batch:
            if fut.done() or fut is own:
                continue
            if isinstance(exc, asyncio.CancelledError):
                fut.cancel()
            else:
                fut.set_exception(exc)


class FileBackend(SegmentScan, Backend):
    options_type = FileOptions
    lists = True

    def __init__(self, options: FileOptions, env: BackendEnv) -> None:
        super().__init__(options, env)
        self.dir = Path(options.path) if options.path else env.data_dir / "pages"
        self.segment_bytes = options.segment_mib * MIB
        self.n_segments = options.capacity_mib // options.segment_mib
        self.segments: list[Segment] = []
        self.index: dict[tuple[bytes, bytes], Loc] = {}
        self.active = 0
        self.top = 0  # the highest generation any segment file has carried
        self._pool: ThreadPoolExecutor | None = None
        self._readers: Readers | None = None
        self._lock = -1  # the open lock file while the store is open
        self._write_lock = asyncio.Lock()  # planning and writing records
        self._sync_lock = asyncio.Lock()  # fsync and publication, in group order
        self._pending: list[tuple[bytes, Sequence[PageRef], asyncio.Future[list[bool]]]] = []
        self.counters = {
            "recycled_segments": 0,
            "bad_records": 0,
            "read_errors": 0,  # pages whose read failed (an OSError): kept, not dropped
            "discarded_on_start": 0,
        }
        self._failed_reads = FailedReads()

    # -- lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        self._pool = ThreadPoolExecutor(self.options.io_threads, thread_name_prefix="hicached-file")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._open_sync)
        except OSError as exc:
            self._pool.shutdown(wait=True)
            self._pool = None
            raise BackendError(f"file store at {self.dir}: {exc.strerror or exc}") from None
        count = self.options.readers()
        if count and self.env.pool is not None and self.env.pool_path:
            readers = Readers(
                count,
                pool=self.env.pool,
                pool_path=self.env.pool_path,
                huge_pages=self.env.pool_huge_pages,
                store=self.dir,
                n_segments=self.n_segments,
                deadline_s=self.options.reader_deadline_s,
            )
            try:
                await readers.start()
            except ReaderLost as exc:  # the threads read meanwhile; starts are tried again
                log.error("file store %s: %s; reading on threads", self.dir, exc)
            self._readers = readers

    def _open_sync(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # one daemon a store: two would write the same segments at the same offsets
        lock = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise OSError(errno.EBUSY, f"in use by another daemon (it holds {LOCK_NAME})") from None
        self._lock = lock
        try:
            self._load_all()
            self._take_up()
        except BaseException:
            self._unlock()
            raise

    def _take_up(self) -> None:
        """Writing resumes in the segment with the highest generation."""
        used = [seg for seg in self.segments if seg.generation]
        if used:
            self.active = max(used, key=lambda seg: seg.generation).id
        else:  # a new store: its first segment is taken into use
            self.active = 0
            self._recycle(self.segments[0])
        log.info(
            "file store %s: %d pages in %d segments", self.dir, len(self.index), self.n_segments
        )

    def _unlock(self) -> None:
        for seg in self.segments:
            os.close(seg.fd)
        self.segments = []
        if self._lock >= 0:
            os.close(self._lock)  # closing the file lets go of its lock
            self._lock = -1

    async def close(self) -> None:
        if self._pool is None:
            return
        if self._readers is not None:
            readers, self._readers = self._readers, None
            await readers.stop()
        async with self._write_lock:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._close_sync)
        let_go(self._pool)  # a read still stuck in the kernel is not waited for
        self._pool = None

    def _close_sync(self) -> None:
        try:
            for seg in self.segments:
                # a closed segment's frontier stays below what a failed fsync may have lost
                end = (
                    seg.write_off if seg.failed_at is None else min(seg.durable_off, seg.failed_at)
                )
                seg.dirty_super = seg.dirty_super or seg.durable_off != end
                try:
                    self._write_super(seg, end)
                    os.fdatasync(seg.fd)
                except OSError as exc:
                    # the frontier on disk stays where it was, below every record a
                    # restart must check: a failing disk costs that start time, and
                    # the other segments and the daemon's stop go on
                    log.error("file store %s: closing %s: %s", self.dir, seg.path.name, exc)
        finally:
            self._unlock()

    async def health(self) -> None:
        if self._pool is None or not self.dir.is_dir():
            raise BackendError(f"file store at {self.dir} is not open", retriable=True)

    # -- operations ----------------------------------------------------------------

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if (ns, key) not in self.index:
                break
            n += 1
        return n

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        """Write pages durably. Concurrent calls are grouped, and groups are
        pipelined: one group's records are written while the previous group's
        fsync runs; fsync and publication stay in order."""
        if self._pool is None:
            raise BackendError("file store is closed", retriable=True)
        done: asyncio.Future[list[bool]] = asyncio.get_running_loop().create_future()
        self._pending.append((ns, pages, done))
        group: _Group | None = None
        async with self._write_lock:
            if any(fut is done for *_, fut in self._pending):  # not taken by another group yet
                batch, self._pending = self._pending, []
                group = _Group(batch)
                try:
                    await self._write_group(group)
                except BaseException as exc:
                    group.fail(exc, done)
                    raise
        if group is not None:
            try:  # cancelled while waiting for the lock too: the group's calls end
                async with self._sync_lock:
                    await self._sync_group(group)
            except BaseException as exc:
                group.fail(exc, done)
                raise
        return await done

    def _plan(self, group: _Group) -> None:
        """Place every page of the group's calls. A page whose record cannot be
        placed is answered False: larger than a segment, or the ring would have to
        recycle a segment this group writes to already."""
        planned: set[tuple[bytes, bytes]] = set()
        for ns, pages, _ in group.batch:
            out = [True] * len(pages)
            for i, page in enumerate(pages):
                key = (ns, page.key)
                if key in self.index or key in planned:
                    continue  # already stored: writes are idempotent
                size = HEADER_BYTES + len(page.buf)
                seg = self._room(size, group.starts) if size <= self._usable else None
                if seg is None:
                    out[i] = False
                    continue
                group.starts.setdefault(seg.id, (seg, seg.generation, seg.write_off))
                group.plan.append(_Entry(seg, seg.generation, seg.write_off, ns, page, out, i))
                planned.add(key)
                seg.write_off += size
            group.outcomes.append(out)
        for entry in group.plan:
            group.ends[entry.seg.id] = (entry.seg, entry.generation, entry.seg.write_off)

    async def _write_group(self, group: _Group) -> None:
        """Plan every queued page and write the records (not yet durable)."""
        self._plan(group)
        if not group.plan:
            return
        segs = [seg for seg, _, _ in group.ends.values()]
        loop = asyncio.get_running_loop()
        plan = group.plan
        threads = min(self.options.io_threads, len(plan))
        cut = [len(plan) * k // threads for k in range(threads + 1)]
        try:
            await loop.run_in_executor(self._pool, self._write_supers, segs)
            writes = [
                loop.run_in_executor(self._pool, self._write_records, plan[cut[k] : cut[k + 1]])
                for k in range(threads)
            ]
            # every thread reads and hashes the call's pool slots: the call ends after
            # the last of them, or a slot freed on a failure could be hashed with its
            # next owner's bytes into a record that verifies (found by a later scan)
            await settle(writes)
            for write in writes:
                write.result()  # the first OSError reaches the handler below
        except OSError as exc:
            # Nothing of this group is published, and no later group has been placed
            # (they wait for this lock): its space goes back, so a failing disk takes
            # no room from the records before it, and a restart's scan, which ends at
            # the first record it cannot read, finds no hole below later records.
            for seg, generation, start in group.starts.values():
                if seg.generation == generation and seg.failed_at is None:
                    seg.write_off = start
            raise BackendError(f"file store write failed: {exc.strerror or exc}") from None

    async def _sync_group(self, group: _Group) -> None:
        """fsync what the group wrote, then publish it; groups pass here in order."""
        if group.plan:
            segs = [seg for seg, _, _ in group.ends.values()]
            try:
                await asyncio.get_running_loop().run_in_executor(self._pool, self._sync, segs)
            except OSError as exc:
                # Later groups may have written past this group's records already:
                # the segment is closed to writes where this group began, and no
                # record at or past that point is published (so none is answered True).
                # An fsync reports a write-back error once per file, whichever
                # group's pages it was: a segment a later group recycled is
                # closed from its start.
                for seg, generation, start in group.starts.values():
                    at = start if seg.generation == generation else SUPER_BYTES
                    seg.failed_at = at if seg.failed_at is None else min(at, seg.failed_at)
                raise BackendError(f"file store fsync failed: {exc.strerror or exc}") from None
            for entry in group.plan:
                seg = entry.seg
                if seg.generation != entry.generation or (
                    seg.failed_at is not None and entry.offset >= seg.failed_at
                ):
                    # recycled meanwhile by a later group (the ring wrapped around), or
                    # past an earlier group's failed fsync: not stored
                    entry.out[entry.at] = False
                    continue
                key = (entry.ns, entry.page.key)
                self.index[key] = Loc(seg.id, entry.offset, len(entry.page.buf), entry.generation)
                seg.keys.append(key)
            for seg, generation, end in group.ends.values():
                if seg.generation != generation or end <= seg.durable_off:
                    continue
                if seg.failed_at is None or end <= seg.failed_at:
                    seg.durable_off = end
                    seg.dirty_super = True
        for (_, _, fut), out in zip(group.batch, group.outcomes, strict=True):
            if not fut.done():
                fut.set_result(out)

    @property
    def _usable(self) -> int:
        """Bytes of records one segment holds."""
        return self.segment_bytes - SUPER_BYTES

    def _room(
        self, size: int, keep: dict[int, tuple[Segment, int, int]] | None = None
    ) -> Segment | None:
        """The segment the next record of ``size`` bytes goes to; None if that
        would recycle a segment in ``keep`` (a group's own)."""
        seg = self.segments[self.active]
        if seg.failed_at is None and seg.write_off + size <= self.segment_bytes:
            return seg
        # The oldest segment: an empty one first (in ring order), else the lowest
        # generation. Generations rise along the ring, so this is the next one.
        n = self.n_segments
        seg = min(self.segments, key=lambda s: (s.generation, (s.id - self.active - 1) % n))
        if keep is not None and seg.id in keep:
            return None
        self.active = seg.id
        self._recycle(seg)
        return seg

    def _recycle(self, seg: Segment) -> None:
        """Empty a segment for reuse: forget its records, give it the next generation."""
        forgotten: dict[bytes, list[bytes]] = {}
        for key in seg.keys:
            loc = self.index.get(key)
            if loc is not None and loc.segment == seg.id:
                del self.index[key]
                forgotten.setdefault(key[0], []).append(key[1])
        if seg.keys:
            self.counters["recycled_segments"] += 1
        seg.keys = []
        self.top = next_generation(self.top)
        seg.generation = self.top
        seg.write_off = seg.durable_off = SUPER_BYTES
        seg.dirty_super = True
        seg.failed_at = None
        for ns, keys in forgotten.items():
            self.forgot(ns, keys)

    def _write_super(self, seg: Segment, durable: int) -> None:
        if not seg.dirty_super:
            return
        raw = SUPER.pack(SUPER_MAGIC, SUPER_VERSION, 0, seg.generation, durable)
        os.pwrite(seg.fd, raw + struct.pack("<Q", xxhash.xxh3_64_intdigest(raw)), 0)
        seg.dirty_super = False

    def _write_supers(self, segs: list[Segment]) -> None:
        """The frontier reached by earlier groups goes out with this group's fsync."""
        for seg in segs:
            self._write_super(seg, seg.durable_off)

    @staticmethod
    def _write_records(plan: list[_Entry]) -> None:
        """Checksum and write records, on one I/O thread. Back-to-back records of
        a segment go out in one pwritev, in runs of at most ``CACHED_RUN_BYTES``
        (at least one record); each run's payloads are hashed in one batched call
        (checksums.py) right before its write, so the write copies them from the
        CPU's cache, and the threads hash side by side, off the event loop."""
        i = 0
        while i < len(plan):
            seg, start, end = plan[i].seg, plan[i].offset, plan[i].end
            j = i + 1
            while (
                j < len(plan)
                and 2 * (j - i) < IOV_MAX
                and plan[j].seg is seg
                and plan[j].offset == end
                and plan[j].end - start <= CACHED_RUN_BYTES
            ):
                end = plan[j].end
                j += 1
            run = plan[i:j]
            bufs = [entry.page.buf for entry in run]
            lengths = list(map(nbytes, bufs))
            headers = pack_headers(
                [entry.ns for entry in run],
                [entry.page.key for entry in run],
                lengths,
                checksums(bufs, lengths=lengths),
                [entry.generation for entry in run],
            )
            iov: list[bytes | memoryview] = []
            for header, buf in zip(headers, bufs, strict=True):
                iov += (header, buf)
            written = os.pwritev(seg.fd, iov, start)
            if written != end - start:
                raise OSError(f"short write ({written} of {end - start} bytes)")
            i = j

    @staticmethod
    def _sync(segs: list[Segment]) -> None:
        for seg in segs:
            os.fdatasync(seg.fd)

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        """Read and verify pages. A record proven bad (``BAD``: it does not
        verify, or its file is gone) is a miss and is dropped; a read that
        failed (``FAILED``: EIO, EMFILE, ENOMEM...) is a miss and the page
        stays, for a later read to find. If no page of the call could be read,
        the call fails (retriable), as the other stores' calls do when the
        store fails and not a page."""
        if self._pool is None:
            raise BackendError("file store is closed", retriable=True)
        out = [False] * len(pages)
        todo: list[tuple[int, Loc, PageRef]] = []
        for i, page in enumerate(pages):
            loc = self.index.get((ns, page.key))
            if loc is not None and loc.length == len(page.buf):
                todo.append((i, loc, page))
        if not todo:
            return out
        todo.sort(key=lambda item: (item[1].segment, item[1].offset))
        readers = self._readers
        slots = None
        if readers is not None and readers.available():
            slots = readers.slots(
                [address_of(page.buf) for _, _, page in todo], [loc.length for _, loc, _ in todo]
            )
        if readers is not None and slots is not None:
            results = await read_in_readers(
                ns, todo, slots, readers, functools.partial(self._read_on_threads, ns)
            )
        else:
            results = await self._read_on_threads(ns, todo)
        read = {i: loc for i, loc, _ in todo}
        failed = 0
        for i, state in results:
            out[i] = state == GOOD
            key = (ns, pages[i].key)
            if state == GOOD:
                self._failed_reads.read(key)
                continue
            if state == FAILED:  # nothing is known of the record: it stays, unless
                failed += 1  # its reads keep failing (a bad sector is never read)
                if not self._failed_reads.failed(key, read[i]):
                    continue
            else:
                self.counters["bad_records"] += 1
                self._failed_reads.read(key)
            if self.index.get(key) is read[i]:  # a bad record is a miss and is dropped
                del self.index[key]  # (not a newer one, written while this was read)
                self.forgot(ns, [pages[i].key])
        self.counters["read_errors"] += failed
        if failed == len(todo):
            raise BackendError(
                f"file store read failed ({failed} pages; they stay stored)", retriable=True
            )
        return out

    async def _read_on_threads(self, ns: bytes, todo: Todo) -> list[tuple[int, int]]:
        return await read_on_threads(
            self._pool, self.options.io_threads, lambda segment: self.segments[segment].fd, ns, todo
        )

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.index.pop((ns, key), None)  # the space returns when its segment is recycled

    async def scan(self) -> AsyncIterator[tuple[bytes, bytes]]:
        for ns, key in list(self.index):
            yield ns, key

    def stats(self) -> dict[str, int]:
        used = sum(seg.write_off - SUPER_BYTES for seg in self.segments)
        readers = self._readers.stats() if self._readers is not None else {}
        return {"pages": len(self.index), "bytes_used": used, **self.counters, **readers}


async def read_in_readers(
    ns: bytes,
    todo: Todo,
    slots: list[int],
    readers: Readers,
    on_threads: Callable[[Todo], Awaitable[list[tuple[int, int]]]],
) -> list[tuple[int, int]]:
    """Read in the reader processes; a part whose reader is lost is read by
    ``on_threads``."""
    records = np.empty(len(todo), RECORD)
    records["segment"] = [loc.segment for _, loc, _ in todo]
    records["length"] = [loc.length for _, loc, _ in todo]
    records["offset"] = [loc.offset for _, loc, _ in todo]
    records["generation"] = [loc.generation for _, loc, _ in todo]
    records["slot"] = slots
    records["key"] = [page.key for _, _, page in todo]
    results: list[tuple[int, int]] = []
    for lo, hi, reply in await readers.read(ns, records):
        part = todo[lo:hi]
        if reply is None:
            results += await on_threads(part)
        else:  # a byte the reader cannot send reads as BAD: never a hit
            results += [
                (i, state if state in (GOOD, FAILED) else BAD)
                for (i, _, _), state in zip(part, reply, strict=True)
            ]
    return results
