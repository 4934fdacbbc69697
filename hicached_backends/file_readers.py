"""Reader processes of the file store: verified reads beside the daemon's GIL.

In one process, every checksum of a small page gives up the GIL and takes it
back, and the I/O threads queue for it: verified hot reads of 64 KiB pages
stay at a fraction of a raw preadv however many cores are free (docs/perf.md).
A reader is a child process with an interpreter of its own. It maps the pool
file, opens the segment files read-only, reads each requested record's
header into its own memory and its payload straight into the pool slot, and
verifies it (``read_records``: the same code the I/O threads run).

Wire, over the reader's stdin and stdout (little-endian; no pickle):

    request: u32 body length | namespace digest 16 B | records (``RECORD``)
    reply:   u32 length | one byte per record (``GOOD``, ``BAD`` or ``FAILED``)

A reader says it is ready with one empty reply. It answers requests in
order, and ends at EOF on its stdin or on a request it cannot take (wrong
size, too many records), so a reply is never out of step. A record whose
segment or slot lies outside the store or the pool is answered BAD unread.

The parent side (``Readers``) has one task per reader that takes its replies
in order. A reader that dies, or answers no request within ``deadline_s``,
is killed and waited for: from then on it writes no slot. Its open requests
fail with ReaderLost, and the caller reads those pages on its threads. The
reader is started again on a later request, at most once a second (after
starts that failed, less often).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hicached_backends.file_reads import (
    read_records,
    settle,
)
from hicached_backends.record import address_of, all_within

log = logging.getLogger("hicached.file")

#: one record to read: where it is in the store, what it must be, which slot it fills
RECORD = np.dtype(
    [
        ("segment", "<u4"),
        ("length", "<u4"),
        ("offset", "<u8"),
        ("generation", "<u8"),
        ("slot", "<u8"),  # byte offset of the page's slot in the pool
        ("key", "S16"),
    ]
)
MAX_RECORDS = 1 << 16  # records in one request (3 MiB of body)
_FRAME = struct.Struct("<I")
_RESTART_EVERY_S = 1.0
_STOP_GRACE_S = 2.0  # a stopping reader's time to finish its request and exit, then it is killed
PART_BYTES = 1 << 20  # payload bytes of a read's part, at least, when it is spread
# the same for a reader with requests queued: it stays busy without, and a request
# costs the daemon about 80 us of CPU
BUSY_PART_BYTES = 4 << 20
_WATCH_S = 1.0  # how often a reader's oldest request is checked against the deadline
_PR_SET_PDEATHSIG = 1  # prctl(2): a signal for this process when its parent dies


def segment_name(index: int) -> str:
    return f"segment-{index:05d}.hcs"


def disjoint(starts: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether no two of these byte ranges overlap."""
    order = np.argsort(starts, kind="stable")
    ends = starts[order] + lengths[order]
    return bool((ends[:-1] <= starts[order][1:]).all())


# -- the reader process ------------------------------------------------------------------


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        part = os.read(fd, left)
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _die_with(parent: int) -> bool:
    """Have the kernel kill this reader (SIGKILL) when the daemon dies, however
    it dies; False if it is gone already. A reader the daemon leaves behind (a
    kill -9) would go on writing its queued requests' pages into the pool,
    which the next daemon adopts and whose slots it hands to new pages
    (docs/restarts.md): they would hold another page's bytes."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return os.getppid() == parent  # it died before prctl: no signal will come


def serve(
    pool_path: str, pool_bytes: int, store: str, n_segments: int, huge_pages: str, parent: int
) -> int:
    """The reader's main loop; returns its exit code. ``parent``: the daemon's
    pid; the reader dies with it."""
    if not _die_with(parent):
        return 0
    from hicached.wire.arena import Arena  # here, so that importing this module stays light

    # A reader lives as long as its stdin: the daemon closes it at its stop, or dies.
    # Signals meant for the daemon's group (a terminal's ^C, a service stop) would
    # otherwise end readers before the daemon stops reading.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    arena = Arena.attach(pool_path, pool_bytes, huge_pages=huge_pages)
    pool = arena.array.data
    # page-table entries for the whole pool, off the request path
    threading.Thread(target=arena.prefault, daemon=True).start()
    fds: dict[int, int] = {}

    def fd_of(segment: int) -> int:
        fd = fds.get(segment)
        if fd is None:
            path = os.path.join(store, segment_name(segment))
            fd = fds[segment] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    _write_all(1, _FRAME.pack(0))  # ready
    while True:
        head = _read_exact(0, _FRAME.size)
        if head is None:
            return 0
        (size,) = _FRAME.unpack(head)
        if size < 16 or (size - 16) % RECORD.itemsize or size > 16 + MAX_RECORDS * RECORD.itemsize:
            print(f"hicached file reader: a request of {size} bytes", file=sys.stderr)
            return 3
        body = _read_exact(0, size)
        if body is None:
            return 0
        ns, records = body[:16], np.frombuffer(body, RECORD, offset=16)
        slots, lengths = records["slot"], records["length"].astype(np.uint64)
        fits = (
            (records["segment"] < n_segments)
            & (lengths <= pool_bytes)
            & (slots <= pool_bytes - np.minimum(lengths, pool_bytes))
        )
        out = bytearray(len(records))  # BAD where a record does not fit
        take = np.flatnonzero(fits).tolist()
        if take:
            chosen = records[take]
            bufs = [
                pool[slot : slot + length]
                for slot, length in zip(
                    chosen["slot"].tolist(), chosen["length"].tolist(), strict=True
                )
            ]
            key_bytes = chosen["key"].tobytes()
            found = read_records(
                fd_of,
                ns,
                chosen["segment"].tolist(),
                chosen["offset"].tolist(),
                chosen["generation"].tolist(),
                [key_bytes[16 * k : 16 * k + 16] for k in range(len(take))],
                bufs,
                native=False,
                as_read=disjoint(chosen["slot"], chosen["length"].astype(np.uint64)),
            )
            for at, state in zip(take, found, strict=True):
                out[at] = state
        _write_all(1, _FRAME.pack(len(out)) + bytes(out))


# -- the parent side ---------------------------------------------------------------------


def shares(loads: Sequence[int], nbytes: int, least: int, least_busy: int) -> list[int]:
    """Bytes of a read of ``nbytes`` to give each reader, which has ``loads``
    bytes queued: the least loaded are filled to one level, as many of them as
    can each take ``least`` or more (``least_busy`` or more where the reader
    has a queue already); the least loaded one always takes a part."""
    order = sorted(range(len(loads)), key=loads.__getitem__)
    out = [0] * len(loads)
    for k in range(len(order), 0, -1):
        chosen = order[:k]
        level = (sum(loads[i] for i in chosen) + nbytes) // k
        if k == 1 or all(level - loads[i] >= (least_busy if loads[i] else least) for i in chosen):
            for i in chosen:
                out[i] = level - loads[i]
            out[chosen[0]] += nbytes - sum(out)  # what the division left over
            return out
    return out  # no readers


class ReaderLost(Exception):
    """A reader died or missed its deadline: read its pages another way."""


class _Child(asyncio.SubprocessProtocol):
    """One run of a reader process: its replies arrive by callback, in order."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.transport: asyncio.SubprocessTransport | None = None
        self.stdin: asyncio.WriteTransport | None = None
        self.inbox = bytearray()
        # requests sent and not answered yet, with when each was sent and its payload bytes
        self.waiting: collections.deque[tuple[asyncio.Future[bytes], float, int]] = (
            collections.deque()
        )
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.exited: asyncio.Future[None] = loop.create_future()
        self.up = False  # ready, and not lost since
        self.why = ""  # why it was lost ("" while it is not)
        self.watch: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports do not subclass asyncio's)
        self.transport = typing.cast(asyncio.SubprocessTransport, transport)
        self.stdin = typing.cast(asyncio.WriteTransport, self.transport.get_pipe_transport(0))

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        inbox = self.inbox
        inbox += data
        at = 0
        while len(inbox) - at >= _FRAME.size:
            (size,) = _FRAME.unpack_from(inbox, at)
            if len(inbox) - at - _FRAME.size < size:
                break
            body = bytes(inbox[at + _FRAME.size : at + _FRAME.size + size])
            at += _FRAME.size + size
            if not self.ready.done():
                self.up = True
                self.ready.set_result(None)
                self.watch = asyncio.get_running_loop().call_later(_WATCH_S, self._watch)
            elif self.waiting:
                fut, _, _ = self.waiting.popleft()
                if not fut.done():
                    fut.set_result(body)
            else:
                self.lose("it sent a reply to no request")
                return
        del inbox[:at]

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1:
            self.lose("it closed its output")

    def process_exited(self) -> None:
        """Only now, with the process gone, are its requests failed: from here on
        nothing writes their slots."""
        self.up = False
        if self.watch is not None:
            self.watch.cancel()
        if not self.exited.done():
            self.exited.set_result(None)
        why = self.why or "it exited"
        while self.waiting:
            fut, _, _ = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(ReaderLost(why))

    def lose(self, why: str) -> None:
        """Take no more requests and kill the process; process_exited fails the rest."""
        self.up = False
        if not self.why:
            self.why = why
        if self.transport is not None and self.transport.get_returncode() is None:
            # os.kill, not transport.kill(): that polls the child first and so may
            # reap it under the loop's child watcher, which then reports it lost
            # with status 255. A zombie ignores the signal; its pid stays ours
            # until the watcher reaps it.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.transport.get_pid(), signal.SIGKILL)

    def _watch(self) -> None:
        """Every _WATCH_S while the reader runs: kill it once its oldest request
        has waited past the deadline."""
        if self.waiting and time.monotonic() - self.waiting[0][1] >= self.deadline_s:
            self.lose(f"it answered no request within {self.deadline_s:g} s")
            return
        self.watch = asyncio.get_running_loop().call_later(_WATCH_S, self._watch)

    def send(self, body: bytes, nbytes: int = 0) -> asyncio.Future[bytes]:
        """Send a request (``nbytes``: the payload bytes it reads); its reply, in time."""
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if not self.up or self.stdin is None or self.stdin.is_closing():
            fut.set_exception(ReaderLost(self.why or "it is not running"))
            return fut
        self.waiting.append((fut, time.monotonic(), nbytes))
        self.stdin.write(_FRAME.pack(len(body)) + body)
        return fut

    @property
    def queued(self) -> int:
        """Payload bytes of the requests waiting for their replies."""
        return sum(nbytes for _, _, nbytes in self.waiting)

    async def end(self) -> None:
        """Kill the process and wait until it is gone: then it writes no slot."""
        self.lose("it was ended")
        await asyncio.shield(self.exited)


class _Reader:
    """One reader: its process now, and when to start it again."""

    def __init__(self, argv: list[str], env: dict[str, str], deadline_s: float) -> None:
        self.argv, self.env, self.deadline_s = argv, env, deadline_s
        self.child: _Child | None = None
        self.starting: asyncio.Task[None] | None = None
        self.last_start = -_RESTART_EVERY_S
        self.backoff_s = _RESTART_EVERY_S
        self.lost = 0
        self.stopping = False

    @property
    def alive(self) -> bool:
        return self.child is not None and self.child.up

    async def start(self) -> None:
        self.last_start = time.monotonic()
        loop = asyncio.get_running_loop()
        child = _Child(self.deadline_s)
        try:
            await loop.subprocess_exec(
                lambda: child,
                *self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,
                env=self.env,
            )
        except OSError as exc:  # no file descriptors, no processes, no interpreter
            self.backoff_s = min(60.0, 2 * self.backoff_s)
            raise ReaderLost(f"a file reader could not be started: {exc}") from None
        child.exited.add_done_callback(lambda _: self._ended(child))
        try:
            # ready, or gone before it was (then at once, not at the deadline)
            await asyncio.wait(
                {child.ready, child.exited},
                timeout=self.deadline_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        except BaseException:
            await child.end()
            raise
        if not child.up:
            child.why = child.why or f"it did not start within {self.deadline_s:g} s"
            await child.end()
            self.backoff_s = min(60.0, 2 * self.backoff_s)
            code = child.transport.get_returncode() if child.transport else None
            raise ReaderLost(
                f"a file reader did not start ({child.why}; exit code {code}; "
                "its errors are in the daemon's log)"
            )
        self.backoff_s = _RESTART_EVERY_S
        self.child = child

    def _ended(self, child: _Child) -> None:
        if child.transport is not None:
            child.transport.close()  # the process is gone: its pipes go too
        if child is not self.child or self.stopping:
            return
        self.lost += 1
        code = child.transport.get_returncode() if child.transport else None
        log.warning(
            "file reader ended (%s, exit code %s); its pages are read on threads",
            child.why or "it exited",
            code,
        )

    def restart_later(self) -> None:
        """Start the process again: at most once a second, and after failed
        starts, less often (up to once a minute)."""
        if self.stopping or (self.starting is not None and not self.starting.done()):
            return
        if time.monotonic() - self.last_start < self.backoff_s:
            return

        async def again() -> None:
            try:
                await self.start()
            except ReaderLost as exc:
                log.warning("%s", exc)
            except Exception:  # never out of this task: stop() awaits it
                self.backoff_s = min(60.0, 2 * self.backoff_s)
                log.exception("a file reader could not be started")

        self.starting = asyncio.create_task(again())

    async def stop(self) -> None:
        """Close stdin (the reader exits), then kill what is left; idempotent."""
        self.stopping = True
        if self.starting is not None:
            self.starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.starting
        child = self.child
        if child is None:
            return
        child.up = False
        if child.stdin is not None:
            child.stdin.close()
        with contextlib.suppress(asyncio.TimeoutError):
            grace = min(self.deadline_s, _STOP_GRACE_S)
            await asyncio.wait_for(asyncio.shield(child.exited), grace)
        await child.end()
        if child.transport is not None:
            child.transport.close()


class Readers:
    """The reader processes of one store; ``read`` spreads a batch over them."""

    def __init__(
        self,
        count: int,
        *,
        pool: memoryview,
        pool_path: str,
        huge_pages: str,
        store: Path,
        n_segments: int,
        deadline_s: float,
    ) -> None:
        base = address_of(pool)
        if base is None:
            raise ValueError("the pool must be writable memory")
        self.base, self.size = base, pool.nbytes
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
        argv = [
            sys.executable,
            "-m",
            __name__,
            pool_path,
            str(self.size),
            str(store),
            str(n_segments),
            huge_pages,
            str(os.getpid()),  # the reader dies with this process
        ]
        self.readers = [_Reader(argv, env, deadline_s) for _ in range(count)]
        self._next = 0
        self.pages = 0  # pages the readers answered for (read and verified, or not)

    async def start(self) -> None:
        """Start every reader; raise ReaderLost if one did not start (those that
        did serve, and the others are tried again later)."""
        try:
            results = await asyncio.gather(
                *(reader.start() for reader in self.readers), return_exceptions=True
            )
        except BaseException:
            await self.stop()
            raise
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, ReaderLost):
                await self.stop()
                raise result
        for result in results:
            if isinstance(result, ReaderLost):
                raise result

    async def stop(self) -> None:
        await asyncio.gather(*(reader.stop() for reader in self.readers))

    def slots(self, addresses: Sequence[int | None], lengths: Sequence[int]) -> list[int] | None:
        """Pool offsets of these buffers, or None unless every one lies in the pool."""
        if not addresses or None in addresses:
            return None
        at: list[int] = addresses  # type: ignore[assignment]  # no None, checked above
        if not all_within(self.base, self.size, at, lengths):
            return None
        return [a - self.base for a in at]

    def available(self) -> int:
        """Readers that take requests now; the others are started again meanwhile."""
        n = 0
        for reader in self.readers:
            if reader.alive:
                n += 1
            else:
                reader.restart_later()
        return n

    async def read(self, ns: bytes, records: np.ndarray) -> list[tuple[int, int, bytes | None]]:
        """Read and verify ``records`` (RECORD rows, in store order) on the readers.

        The read is spread over the readers by payload bytes: the least loaded
        are filled to one level of queued bytes, as many as can each take
        PART_BYTES or more, BUSY_PART_BYTES where a reader has a queue
        (``shares``). So a lone read is split over idle readers; one beside
        others goes whole to the least loaded reader unless it is large.
        Returns (start, end, reply) of each part: the reply has a byte a
        record, or is None where the part's reader was lost (read those
        records another way). Returns only when no reader still works on any
        part of the call."""
        n = len(records)
        live = [reader for reader in self.readers if reader.alive and reader.child is not None]
        if not live or n == 0:
            return [(0, n, None)]
        first = self._next % len(live)
        self._next += 1
        live = live[first:] + live[:first]  # ties go round
        # bounds[i]: payload bytes before record i
        bounds = np.concatenate(([0], np.cumsum(records["length"], dtype=np.int64)))
        children = [typing.cast(_Child, reader.child) for reader in live]
        give = shares(
            [child.queued for child in children], int(bounds[-1]), PART_BYTES, BUSY_PART_BYTES
        )
        # the least loaded first: a part's first record is its own however large,
        # so an idle reader is never left out behind a busy one
        taking = sorted(
            ((child, share) for child, share in zip(children, give, strict=True) if share),
            key=lambda item: item[0].queued,
        )
        if not taking:  # no payload bytes at all
            taking = [(min(children, key=lambda child: child.queued), 0)]
        # twice each record's middle: a record goes to the part its middle falls in
        middles = bounds[:-1] + bounds[1:]
        sent: list[_Child] = []
        cut = [0]
        total = 0
        for k, (child, share) in enumerate(taking):
            lo = cut[-1]
            if lo == n:
                break
            total += share
            hi = n
            if k < len(taking) - 1:  # the last takes what is left
                at = int(np.searchsorted(middles, 2 * total, side="right"))
                hi = min(n, max(lo + 1, at))
            # no request over MAX_RECORDS: then several go to one reader, in turn
            pieces = -(-(hi - lo) // MAX_RECORDS)
            cut += [lo + (hi - lo) * j // pieces for j in range(1, pieces + 1)]
            sent += [child] * pieces
        futs = [
            child.send(
                ns + records[cut[k] : cut[k + 1]].tobytes(),
                int(bounds[cut[k + 1]] - bounds[cut[k]]),
            )
            for k, child in enumerate(sent)
        ]
        try:
            await asyncio.wait(futs)
        except asyncio.CancelledError:
            # slots of this call may still be written: end those readers, and
            # return only when they are gone
            busy = {child for child, fut in zip(sent, futs, strict=True) if not fut.done()}
            for child in busy:
                child.lose("a read it served was cancelled")
            try:
                await settle([child.exited for child in busy])
            finally:
                for fut in futs:
                    if fut.done() and not fut.cancelled():
                        fut.exception()  # retrieved: the call is cancelled anyway
            raise
        out: list[tuple[int, int, bytes | None]] = []
        for k, fut in enumerate(futs):
            lo, hi = cut[k], cut[k + 1]
            exc = fut.exception()
            if exc is None and len(reply := fut.result()) == hi - lo:
                out.append((lo, hi, reply))
                self.pages += hi - lo
            elif exc is None or isinstance(exc, ReaderLost):
                out.append((lo, hi, None))
            else:
                raise exc
        return out

    def stats(self) -> dict[str, int]:
        return {
            "readers_alive": sum(reader.alive for reader in self.readers),
            "readers_lost": sum(reader.lost for reader in self.readers),
            "reader_pages": self.pages,
        }


if __name__ == "__main__":
    pool_path, pool_bytes, store, n_segments, huge_pages, parent = sys.argv[1:7]
    try:
        sys.exit(serve(pool_path, int(pool_bytes), store, int(n_segments), huge_pages, int(parent)))
    except BrokenPipeError:  # the daemon is gone
        sys.exit(0)
