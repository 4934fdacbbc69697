"""Local file backend: a ring of large preallocated segment files.

Layout of a segment: a 4 KiB superblock, then records (record.py) packed
back to back. The superblock holds the segment's *generation* and its
*durable frontier*: every record that ends before it was fsynced. Writing:
records of a batch are written with positional I/O from a small thread pool,
then one fdatasync per touched segment; only then are they published in the
in-memory index (so a read never sees an unsynced record). The frontier is
written with the next batch, before its fsync.

Startup rebuilds the index from record headers, segment by segment; records
past the frontier are also checksummed, and the first bad one ends that
segment (it and everything after it are discarded and overwritten later).

Capacity: when the ring is full, the oldest segment is recycled: its records
leave the index (the daemon is told), its generation goes up, and records
of older generations in it are ignored from then on.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import struct
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from hicached_backends.base import Backend, BackendEnv, BackendError, PageRef
from hicached_backends.options import FileOptions
from hicached_backends.record import HEADER_BYTES, pack_header, parse_header, verify

log = logging.getLogger("hicached.file")

SUPER = struct.Struct("<4sHHQQ")  # magic, version, pad, generation, durable frontier
SUPER_MAGIC = b"HCS1"
SUPER_BYTES = 4096
MIB = 1 << 20


@dataclass(slots=True)
class _Loc:
    segment: int
    offset: int
    length: int
    generation: int


@dataclass(slots=True)
class _Segment:
    id: int
    path: Path
    fd: int
    generation: int = 0
    write_off: int = SUPER_BYTES
    durable_off: int = SUPER_BYTES
    keys: list[tuple[bytes, bytes]] = field(default_factory=list)
    dirty_super: bool = True


class FileBackend(Backend):
    options_type = FileOptions

    def __init__(self, options: FileOptions, env: BackendEnv) -> None:
        super().__init__(options, env)
        self.dir = Path(options.path) if options.path else env.data_dir / "pages"
        self.segment_bytes = options.segment_mib * MIB
        self.n_segments = options.capacity_mib // options.segment_mib
        self.segments: list[_Segment] = []
        self.index: dict[tuple[bytes, bytes], _Loc] = {}
        self.active = 0
        self._pool: ThreadPoolExecutor | None = None
        self._write_lock = asyncio.Lock()
        self.counters = {"recycled_segments": 0, "bad_records": 0, "discarded_on_start": 0}

    # -- lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        self._pool = ThreadPoolExecutor(self.options.io_threads, thread_name_prefix="hicached-file")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._open_sync)
        except OSError as exc:
            raise BackendError(f"file store at {self.dir}: {exc.strerror or exc}") from None

    def _open_sync(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        newest = (-1, 0)
        for i in range(self.n_segments):
            path = self.dir / f"segment-{i:05d}.hcs"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if os.fstat(fd).st_size < self.segment_bytes:
                try:
                    os.posix_fallocate(fd, 0, self.segment_bytes)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    os.close(fd)
                    path.unlink(missing_ok=True)
                    if not self.segments:
                        raise OSError(
                            exc.errno, f"no room for one segment of {self.options.segment_mib} MiB"
                        ) from None
                    log.warning(
                        "file store %s: disk full after %d of %d segments; running with %d MiB",
                        self.dir,
                        i,
                        self.n_segments,
                        i * self.options.segment_mib,
                    )
                    self.n_segments = i
                    break
            seg = _Segment(i, path, fd)
            self.segments.append(seg)
            self._load(seg)
            if seg.generation > newest[0] or (seg.generation == newest[0] and seg.keys):
                newest = (seg.generation, i)
            if self.n_segments >= 8 and (i + 1) % max(1, self.n_segments // 8) == 0:
                log.info(
                    "file store %s: scanned %d/%d segments, %d pages",
                    self.dir,
                    i + 1,
                    self.n_segments,
                    len(self.index),
                )
        self.active = newest[1]
        log.info(
            "file store %s: %d pages in %d segments", self.dir, len(self.index), self.n_segments
        )

    def _load(self, seg: _Segment) -> None:
        """Rebuild the index entries of one segment from its record headers."""
        raw = os.pread(seg.fd, SUPER.size + 8, 0)
        magic, version, _pad, generation, durable = SUPER.unpack_from(raw)
        (check,) = struct.unpack_from("<Q", raw, SUPER.size)
        if (
            magic != SUPER_MAGIC
            or version != 1
            or check != xxhash.xxh3_64_intdigest(raw[: SUPER.size])
        ):
            seg.generation, seg.write_off, seg.durable_off = 0, SUPER_BYTES, SUPER_BYTES
            seg.dirty_super = True
            return
        seg.generation, seg.durable_off, seg.dirty_super = generation, durable, False
        off = SUPER_BYTES
        end = self.segment_bytes
        while off + HEADER_BYTES <= end:
            header = parse_header(os.pread(seg.fd, HEADER_BYTES, off))
            if header is None or header.generation != generation:
                break
            rec_end = off + HEADER_BYTES + header.length
            if rec_end > end:
                break
            if rec_end > durable:  # written after the last known fsync: check it all
                payload = os.pread(seg.fd, header.length, off + HEADER_BYTES)
                if not verify(
                    os.pread(seg.fd, HEADER_BYTES, off), payload, header.ns, header.key, generation
                ):
                    # a record torn by a crash: wipe its header so no later scan meets it
                    os.pwrite(seg.fd, bytes(HEADER_BYTES), off)
                    os.fdatasync(seg.fd)
                    self.counters["discarded_on_start"] += 1
                    break
            key = (header.ns, header.key)
            if key not in self.index:  # a page stored twice: the first record found serves
                self.index[key] = _Loc(seg.id, off, header.length, generation)
                seg.keys.append(key)
            off = rec_end
        seg.write_off = off
        if seg.durable_off > off:
            seg.durable_off = off
            seg.dirty_super = True

    async def close(self) -> None:
        if self._pool is None:
            return
        async with self._write_lock:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._close_sync)
        self._pool.shutdown(wait=True)
        self._pool = None

    def _close_sync(self) -> None:
        for seg in self.segments:
            seg.dirty_super = seg.dirty_super or seg.durable_off != seg.write_off
            self._write_super(seg, seg.write_off)
            os.fdatasync(seg.fd)
            os.close(seg.fd)
        self.segments = []

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
        if self._pool is None:
            raise BackendError("file store is closed", retriable=True)
        async with self._write_lock:
            plan: list[tuple[_Segment, int, int, bytes, PageRef]] = []
            out = [True] * len(pages)
            for i, page in enumerate(pages):
                if (ns, page.key) in self.index:
                    continue  # already stored: writes are idempotent
                size = HEADER_BYTES + len(page.buf)
                if size > self.segment_bytes - SUPER_BYTES:
                    out[i] = False
                    continue
                seg = self._room(size)
                header = pack_header(ns, page.key, page.buf, seg.generation)
                plan.append((seg, seg.generation, seg.write_off, header, page))
                seg.write_off += size
            if not plan:
                return out
            touched = {id(seg): seg for seg, *_ in plan}
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._write_batch, plan, list(touched.values())
                )
            except OSError as exc:
                # Nothing of this batch is published; its space is simply skipped.
                raise BackendError(
                    f"file store write failed: {exc.strerror or exc}", retriable=False
                ) from None
            for seg, generation, off, _header, page in plan:
                if seg.generation != generation:
                    continue  # this batch wrapped around the ring and recycled it
                key = (ns, page.key)
                self.index[key] = _Loc(seg.id, off, len(page.buf), seg.generation)
                seg.keys.append(key)
            for seg in touched.values():
                seg.durable_off = seg.write_off
                seg.dirty_super = True
            return out

    def _room(self, size: int) -> _Segment:
        seg = self.segments[self.active]
        if seg.write_off + size <= self.segment_bytes:
            return seg
        self.active = (self.active + 1) % self.n_segments
        seg = self.segments[self.active]
        self._recycle(seg)
        return seg

    def _recycle(self, seg: _Segment) -> None:
        """Empty a segment for reuse: forget its records, bump its generation."""
        forgotten: dict[bytes, list[bytes]] = {}
        for key in seg.keys:
            loc = self.index.get(key)
            if loc is not None and loc.segment == seg.id:
                del self.index[key]
                forgotten.setdefault(key[0], []).append(key[1])
        if seg.keys:
            self.counters["recycled_segments"] += 1
        seg.keys = []
        seg.generation += 1
        seg.write_off = seg.durable_off = SUPER_BYTES
        seg.dirty_super = True
        for ns, keys in forgotten.items():
            self.forgot(ns, keys)

    def _write_super(self, seg: _Segment, durable: int) -> None:
        if not seg.dirty_super:
            return
        raw = SUPER.pack(SUPER_MAGIC, 1, 0, seg.generation, durable)
        os.pwrite(seg.fd, raw + struct.pack("<Q", xxhash.xxh3_64_intdigest(raw)), 0)
        seg.dirty_super = False

    def _write_batch(
        self, plan: list[tuple[_Segment, int, int, bytes, PageRef]], segs: list[_Segment]
    ) -> None:
        for seg in segs:  # the frontier reached by earlier batches, before this one's fsync
            self._write_super(seg, seg.durable_off)
        for seg, _generation, off, header, page in plan:
            written = os.pwritev(seg.fd, [header, page.buf], off)
            if written != len(header) + len(page.buf):
                raise OSError(f"short write ({written} bytes)")
        for seg in segs:
            os.fdatasync(seg.fd)

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        if self._pool is None:
            raise BackendError("file store is closed", retriable=True)
        out = [False] * len(pages)
        todo: list[tuple[int, _Loc, PageRef]] = []
        for i, page in enumerate(pages):
            loc = self.index.get((ns, page.key))
            if loc is not None and loc.length == len(page.buf):
                todo.append((i, loc, page))
        if not todo:
            return out
        loop = asyncio.get_running_loop()
        threads = min(self.options.io_threads, len(todo))
        chunks = [todo[k::threads] for k in range(threads)]
        results = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self._read_chunk, ns, chunk) for chunk in chunks)
        )
        for chunk_result in results:
            for i, ok in chunk_result:
                out[i] = ok
                if not ok:
                    self.counters["bad_records"] += 1
                    key = (ns, pages[i].key)
                    loc = self.index.get(key)
                    if loc is not None:  # a bad record is a miss and is dropped
                        del self.index[key]
                        self.forgot(ns, [pages[i].key])
        return out

    def _read_chunk(
        self, ns: bytes, chunk: list[tuple[int, _Loc, PageRef]]
    ) -> list[tuple[int, bool]]:
        out = []
        header = bytearray(HEADER_BYTES)
        for i, loc, page in chunk:
            try:
                n = os.preadv(self.segments[loc.segment].fd, [header, page.buf], loc.offset)
            except (OSError, IndexError):
                out.append((i, False))
                continue
            ok = n == HEADER_BYTES + len(page.buf) and verify(
                header, page.buf, ns, page.key, loc.generation
            )
            out.append((i, ok))
        return out

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.index.pop((ns, key), None)  # the space returns when its segment is recycled

    async def scan(self) -> AsyncIterator[tuple[bytes, bytes]]:
        for ns, key in list(self.index):
            yield ns, key

    def stats(self) -> dict[str, int]:
        used = sum(seg.write_off - SUPER_BYTES for seg in self.segments)
        return {"pages": len(self.index), "bytes_used": used, **self.counters}
