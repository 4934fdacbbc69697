"""What a file store (file.py) keeps on disk, and the scan that reads it back.

A segment file is a 4 KiB superblock (magic, format version, generation,
durable frontier, checksum) and records packed after it (record.py). At start
``SegmentScan`` opens every segment of the ring (allocating those missing, down
to what the disk holds), reads each superblock and rebuilds the index from the
record headers; records past the durable frontier are checksummed whole, and
the first bad one ends its segment. It also finds the highest generation any
segment file has carried (the ring's, and files past it from a larger
capacity), so that the next one is above them all (``next_generation``).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from hicached_backends.file_readers import segment_name
from hicached_backends.options import FileOptions
from hicached_backends.record import HEADER_BYTES, parse_header, verify

log = logging.getLogger("hicached.file")

SUPER = struct.Struct("<4sHHQQ")  # magic, version, pad, generation, durable frontier
SUPER_MAGIC = b"HCS1"
SUPER_VERSION = 2  # generations are store-wide sequence numbers (see above)
SUPER_BYTES = 4096
MIB = 1 << 20


@dataclass(slots=True)
class Loc:
    segment: int
    offset: int
    length: int
    generation: int


@dataclass(slots=True)
class Segment:
    id: int
    path: Path
    fd: int
    generation: int = 0  # 0: holds nothing
    write_off: int = SUPER_BYTES
    durable_off: int = SUPER_BYTES
    keys: list[tuple[bytes, bytes]] = field(default_factory=list)
    dirty_super: bool = True
    # where a group whose fsync failed began: nothing at or past it is published,
    # the frontier stays below it, and the segment takes no more records until
    # it is recycled
    failed_at: int | None = None


_LOAD_CHUNK = 4 << 20  # bytes of a segment read at once when its index is rebuilt


class SegmentScan:
    """The startup scan of a file store's segments (the store's state, set by it)."""

    options: FileOptions
    dir: Path
    segment_bytes: int
    n_segments: int
    segments: list[Segment]
    index: dict[tuple[bytes, bytes], Loc]
    top: int
    counters: dict[str, int]

    def _load_all(self) -> None:
        dropped = 0  # segments of an older format
        for i in range(self.n_segments):
            path = self.dir / segment_name(i)
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
            seg = Segment(i, path, fd)
            self.segments.append(seg)
            highest, old_format = self._load(seg)
            self.top = max(self.top, highest)
            dropped += old_format
            if self.n_segments >= 8 and (i + 1) % max(1, self.n_segments // 8) == 0:
                log.info(
                    "file store %s: scanned %d/%d segments, %d pages",
                    self.dir,
                    i + 1,
                    self.n_segments,
                    len(self.index),
                )
        self.top = max(self.top, self._beyond_ring())
        if dropped:
            log.warning("file store %s: dropped %d segments of an older format", self.dir, dropped)

    def _load(self, seg: Segment) -> tuple[int, bool]:
        """Rebuild the index entries of one segment from its record headers.

        Returns the highest generation the file's records can carry, and
        whether it was written by an older format (and is dropped)."""
        intact, version, generation, durable = superblock(seg.fd)
        if not intact or version != SUPER_VERSION or generation == 0:
            # Nothing here can be trusted to be current: the segment holds nothing,
            # and its superblock is left alone until the segment is used again.
            seg.generation, seg.write_off, seg.durable_off = 0, SUPER_BYTES, SUPER_BYTES
            seg.dirty_super = False
            return _leftover_generation(seg.fd), intact and version != SUPER_VERSION
        seg.generation, seg.durable_off, seg.dirty_super = generation, durable, False
        off = SUPER_BYTES
        end = self.segment_bytes
        # headers are read from large chunks, not one pread each: a million small
        # records would otherwise cost a million system calls at every start
        chunk, chunk_off = b"", off
        while off + HEADER_BYTES <= end:
            at = off - chunk_off
            if at < 0 or at + HEADER_BYTES > len(chunk):
                chunk_off, at = off, 0
                chunk = os.pread(seg.fd, min(_LOAD_CHUNK, end - off), off)
            header = parse_header(chunk[at : at + HEADER_BYTES])
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
            known = self.index.get(key)
            if known is None or known.generation <= generation:  # stored twice: the newest serves
                self.index[key] = Loc(seg.id, off, header.length, generation)
                seg.keys.append(key)
            off = rec_end
        seg.write_off = off
        if seg.durable_off > off:
            seg.durable_off = off
            seg.dirty_super = True
        # Above the superblock's only if a crash kept a new use's first record
        # but not its superblock.
        return _leftover_generation(seg.fd), False

    def _beyond_ring(self) -> int:
        """The highest generation in segment files past the ring (kept from a
        larger capacity, or left by a disk that filled up): they may come back."""
        highest = 0
        for path in self.dir.glob("segment-*.hcs"):
            try:
                if int(path.stem.removeprefix("segment-")) < self.n_segments:
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except (ValueError, OSError):
                continue
            try:
                highest = max(highest, _leftover_generation(fd))
            finally:
                os.close(fd)
        return highest


def next_generation(top: int) -> int:
    """The generation after ``top``: a sequence number in the high 32 bits, so
    generations still rise, and 32 random bits below it. A page's payload is
    whatever a client stored, and a restart's scan may meet the bytes of a
    segment's earlier use in the middle of a payload (past the end of its new
    records, where pages of other sizes lay): a record header forged there
    would be read as a record of any namespace and key if its writer could
    foretell the generation the segment was to carry next."""
    return ((top >> 32) + 1) << 32 | secrets.randbits(32)


def superblock(fd: int) -> tuple[bool, int, int, int]:
    """(intact, version, generation, durable frontier) of a segment's superblock."""
    raw = os.pread(fd, SUPER.size + 8, 0)
    if len(raw) < SUPER.size + 8:
        return False, 0, 0, 0
    magic, version, _pad, generation, durable = SUPER.unpack_from(raw)
    (check,) = struct.unpack_from("<Q", raw, SUPER.size)
    intact = magic == SUPER_MAGIC and check == xxhash.xxh3_64_intdigest(raw[: SUPER.size])
    return intact, version, generation, durable


def _leftover_generation(fd: int) -> int:
    """The highest generation a segment file's records can carry: an intact
    superblock of any version names its latest use; without one, the record at
    the start was written by the latest use that wrote any."""
    intact, _version, generation, _durable = superblock(fd)
    first = parse_header(os.pread(fd, HEADER_BYTES, SUPER_BYTES))
    return max(generation if intact else 0, first.generation if first is not None else 0)
