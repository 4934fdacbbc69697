"""The file store's reads of records (``read_records``: the code its I/O
threads and its reader processes, file_readers.py, both run), and the count
of each page's failed reads.

A read of a record ends in one of three states: ``GOOD``
(read whole and verified), ``BAD`` (proven bad: the store drops the page) or
``FAILED`` (an OSError that proves nothing of the record: the page stays).
A page whose reads fail ``FAILED_READS`` times in a row is dropped all the
same (``FailedReads``): a sector that cannot be read would otherwise be a
known page that misses at every read and is never stored again.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from hicached_backends.record import HEADER_BYTES, verify_many

if TYPE_CHECKING:  # (file_layout.py imports the reader processes, which import this)
    from hicached_backends.base import PageRef
    from hicached_backends.file_layout import Loc

    Todo = list[tuple[int, Loc, PageRef]]  # (the page's index in a call, its record, its buffer)

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024
# a reader's preadv reads at most this much before it hashes what it read, from the
# CPU's cache: read and hash of a 64 KiB page 13.8 us, against 15.3 when a 4 MiB run
# is read first (the preadv alone: 10.7; docs/perf.md)
CACHED_RUN_BYTES = 512 << 10

# What a read found of one record (a reader's reply byte). Only BAD proves the
# record wrong, and only it makes the store drop the page; a FAILED read says
# nothing of the record (an I/O error, no file descriptor or memory left): the
# page stays, and a later read may find it intact. Neither is ever a hit.
BAD = 0  # not the intact record of that key and generation: bad header, wrong
# size, checksum mismatch, another key's record, cut short, or no segment file
GOOD = 1  # read whole and verified
FAILED = 2  # the read failed: the record is unknown, not bad


FAILED_READS = 3
# the counts are kept for this many pages at most
FAILED_READS_KEPT = 4096


class FailedReads:
    """How many times in a row each page's record failed to read."""

    def __init__(self) -> None:
        self._counts: dict[tuple[bytes, bytes], tuple[Loc, int]] = {}

    def read(self, key: tuple[bytes, bytes]) -> None:
        """``key``'s record was read: its count starts again."""
        self._counts.pop(key, None)

    def failed(self, key: tuple[bytes, bytes], loc: Loc) -> bool:
        """Count a failed read of ``key``'s record at ``loc``; True once its
        reads have failed FAILED_READS times in a row (the count is forgotten
        then). Past FAILED_READS_KEPT pages the counts start over, which only
        delays a drop."""
        last, count = self._counts.get(key, (loc, 0))
        count = count + 1 if last is loc else 1
        if count >= FAILED_READS:
            self._counts.pop(key, None)
            return True
        if len(self._counts) >= FAILED_READS_KEPT and key not in self._counts:
            self._counts.clear()
        self._counts[key] = (loc, count)
        return False


async def read_on_threads(
    pool: ThreadPoolExecutor | None,
    threads: int,
    fd_of: Callable[[int], int],
    ns: bytes,
    todo: Todo,
) -> list[tuple[int, int]]:
    """Read and verify pages (sorted by place) on up to ``threads`` of ``pool``'s
    threads: each page's index and state."""
    loop = asyncio.get_running_loop()
    threads = min(threads, len(todo))
    cut = [len(todo) * k // threads for k in range(threads + 1)]
    parts = [
        loop.run_in_executor(pool, _read_chunk, fd_of, ns, todo[cut[k] : cut[k + 1]])
        for k in range(threads)
    ]
    # a thread cannot be stopped: a cancelled read returns when its threads have
    # ended, so none writes a buffer after the call that lent it
    await settle(parts)
    return [item for part in parts for item in part.result()]


def _read_chunk(fd_of: Callable[[int], int], ns: bytes, chunk: Todo) -> list[tuple[int, int]]:
    """Read and verify pages (sorted by place) on this thread."""
    found = read_records(
        fd_of,
        ns,
        [loc.segment for _, loc, _ in chunk],
        [loc.offset for _, loc, _ in chunk],
        [loc.generation for _, loc, _ in chunk],
        [page.key for _, _, page in chunk],
        [page.buf for _, _, page in chunk],
    )
    return [(index, state) for (index, _, _), state in zip(chunk, found, strict=True)]


def read_records(
    fd_of: Callable[[int], int],
    ns: bytes,
    segments: Sequence[int],
    offsets: Sequence[int],
    generations: Sequence[int],
    keys: Sequence[bytes],
    bufs: Sequence[memoryview],
    *,
    native: bool = True,
    as_read: bool = False,
) -> list[int]:
    """Read records (sorted by place) into ``bufs`` and verify them: GOOD where
    a page was read whole and its record is the intact one of (ns, key) at that
    generation; FAILED where its read raised an OSError other than ENOENT (a
    disk's EIO, EMFILE, ENOMEM, EINTR: nothing is known of the record); BAD
    otherwise (no such segment or segment file, a file that ends inside the
    record, a record that does not verify). Back-to-back records of a
    segment are read by one preadv.
    ``native``: hash without the GIL (for threads), once every run is read; a
    reader process, which shares its GIL with no one, calls the Python
    function, which costs less. ``as_read``: read runs of at most
    ``CACHED_RUN_BYTES`` and hash each (Python function) right after its
    preadv, while its pages are still in the CPU's cache; only for buffers
    that do not overlap (``disjoint``), since a later run would otherwise
    write over a page already hashed."""
    n = len(keys)
    heads = memoryview(bytearray(HEADER_BYTES * n))
    lengths = [buf.nbytes for buf in bufs]
    run_bytes = CACHED_RUN_BYTES if as_read else 1 << 62
    read = [False] * n
    failed = [False] * n
    sums: list[int] | None = [0] * n if as_read else None
    i = 0
    while i < n:
        segment, start = segments[i], offsets[i]
        end = start + HEADER_BYTES + lengths[i]
        j = i + 1
        while (
            j < n
            and 2 * (j - i) < IOV_MAX
            and segments[j] == segment
            and offsets[j] == end
            and end - start + HEADER_BYTES + lengths[j] <= run_bytes
        ):
            end += HEADER_BYTES + lengths[j]
            j += 1
        iov: list[memoryview] = []
        for k in range(i, j):
            iov += (heads[k * HEADER_BYTES : (k + 1) * HEADER_BYTES], bufs[k])
        try:
            got = os.preadv(fd_of(segment), iov, start)
        except FileNotFoundError:  # no segment file (a reader opens it): no record there
            got = -1
        except OSError:  # the read failed, not the record
            got = -1
            failed[i:j] = [True] * (j - i)
        except (LookupError, OverflowError):  # no such segment or offset
            got = -1
        read[i:j] = [got == end - start] * (j - i)
        if sums is not None and got == end - start:
            sums[i:j] = map(xxhash.xxh3_64_intdigest, bufs[i:j])
        i = j
    verified = verify_many(
        np.frombuffer(heads, np.uint8).reshape(n, HEADER_BYTES),
        bufs,
        ns,
        keys,
        generations,
        addresses=None if native else [None] * n,
        payload_sums=sums,
    )
    return [
        FAILED if lost else GOOD if whole and ok else BAD
        for lost, whole, ok in zip(failed, read, verified, strict=True)
    ]


async def settle(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every future is done, through any number of cancellations,
    then raise CancelledError if there was one. For work that writes into
    caller buffers: the call that lent them must not end before it does."""
    pending = set(futures)
    cancelled = False
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
