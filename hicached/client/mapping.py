"""The client's mapping of the pool, and the copies through handles.

A copy takes a handle (client/handles.py), never bare offsets, and is fenced:

- before: the handle must be open, from the daemon instance this client is
  connected to, and before its deadline (the lease's, on this client's clock,
  less a margin); and its slots' generations must still be those it was
  granted with;
- after a read: the generations are read again (seqlock style); a slot that
  changed owner while it was copied makes the copy a miss (``StaleHandle``,
  with the count of leading pages that were intact);
- after a write: the same check. A write cannot land in another key's page in
  the first place: the daemon quarantines the slots of an expired write lease
  for longer than the margin (leases.quarantine_s).

Numpy arrays, CPU torch tensors (through numpy) and CUDA tensors (client/cuda.py)
take the same fences. A copy may also be started and finished apart
(``start_write``/``start_read`` give a ``PendingCopy``): a CUDA copy then runs
on the caller's stream while the caller goes on, and the fence after it is
checked once its bytes have moved, before anyone may use them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from hicached.client.gather import gather, scatter
from hicached.client.handles import Hit, Namespace, Reservation, check_kind
from hicached.client.inputs import (
    At,
    check_empty,
    cuda_tensor,
    destination_bytes,
    segment_bytes,
    segmented,
    source_bytes,
)
from hicached.client.pieces import starts_of
from hicached.errors import BadRequest, StaleHandle
from hicached.wire.arena import Arena

log = logging.getLogger(__name__)

# Below this many rows per run of rows adjacent on both sides, one gather or
# scatter over all rows beats a slice copy per run.
_RUN_ROWS = 4

# How often a wait for a CUDA copy looks at its event, and how long unpinning
# waits for the copies still in flight through the pool.
_POLL_S = 0.0005
_DRAIN_S = 10.0


def _copy_rows(
    pool: np.ndarray,
    idx: np.ndarray,
    views: list[np.ndarray],
    picks: np.ndarray | None,
    starts: list[int],
    to_pool: bool,
) -> None:
    """Copy page j's bytes between pool row ``idx[j]`` and row ``picks[j]`` (or
    j) of each view, view i's at byte ``starts[i]`` of the page. Runs of rows
    adjacent on both sides (fresh slots and a request's blocks usually are)
    go as slice copies, with no gathered temporary; scattered rows as one
    fancy-indexed copy."""
    rows = np.arange(len(idx)) if picks is None else picks
    cuts = np.flatnonzero((np.diff(idx) != 1) | (np.diff(rows) != 1)) + 1
    runs = len(cuts) + 1
    if len(idx) >= _RUN_ROWS * runs:
        firsts = np.concatenate(([0], cuts)).tolist()
        ends = [*cuts.tolist(), len(idx)]
        spans = [(int(idx[s]), int(rows[s]), e - s) for s, e in zip(firsts, ends, strict=True)]
        for view, start in zip(views, starts, strict=True):
            end = start + view.shape[1]
            for slot, row, n in spans:
                if to_pool:
                    pool[slot : slot + n, start:end] = view[row : row + n]
                else:
                    view[row : row + n] = pool[slot : slot + n, start:end]
        return
    for view, start in zip(views, starts, strict=True):
        end = start + view.shape[1]
        if to_pool:
            pool[idx, start:end] = view if picks is None else view[picks]
        elif picks is None:
            view[...] = pool[idx, start:end]
        else:
            view[picks] = pool[idx, start:end]


def _row_bytes(tensor: Any) -> int:
    """Bytes in one row (first-axis entry) of a tensor (nbytes: one attribute
    read; this runs for every layer of every copy)."""
    return int(tensor.nbytes) // max(1, int(tensor.shape[0]))


class PendingCopy:
    """A copy through a handle, started: its bytes may still be moving (a CUDA
    copy runs on its stream; a host copy is done when it is started).

    ``done()`` says whether they have moved, ``finish()`` (once done) checks
    the fence after the copy, ``result()`` waits and then finishes. Until
    ``finish()`` returns, nothing copied may be used: a slot that changed
    owner since the copy began makes a read a miss and a write one not to
    commit (``StaleHandle``). ``path`` names the way the bytes went
    (client/cuda.py; ``host`` for host memory).
    """

    __slots__ = ("_begin", "_end", "_gens", "_gidx", "_out", "_seconds", "_stale", "_want", "path")

    def __init__(
        self,
        path: str,
        gens: np.ndarray,
        gidx: np.ndarray,
        want: np.ndarray,
        stale: str,
        out: Any = None,
        *,
        begin: Any = None,
        end: Any = None,
        seconds: float = 0.0,
    ) -> None:
        self.path = path
        self._gens = gens  # the pool's generations (a view: it keeps the mapping alive)
        self._gidx = gidx
        self._want = want
        self._stale = stale
        self._out = out
        self._begin, self._end = begin, end  # CUDA events around the copy, or None
        self._seconds = seconds

    def done(self) -> bool:
        """The bytes have moved (never waits)."""
        return self._end is None or bool(self._end.query())

    def wait(self, timeout: float) -> bool:
        """Until the bytes have moved or ``timeout`` seconds passed; whether they have."""
        if math.isnan(timeout):  # no deadline a clock reaches: a copy that hangs, forever
            raise ValueError("wait takes a timeout in seconds, not NaN")
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def finish(self) -> Any:
        """The fence after the copy, once done; a read's ``out``. Raises
        ``StaleHandle`` when a slot changed owner since the copy began."""
        if not self.done():
            raise RuntimeError("finish() before the copy is done: wait() for it first")
        if len(self._gidx):
            moved = self._gens[self._gidx] != self._want
            if moved.any():
                raise StaleHandle(self._stale, int(moved.argmax()))
        return self._out

    def result(self) -> Any:
        """Wait for the copy (a CUDA copy: its stream up to it), then ``finish()``."""
        if self._end is not None:
            self._end.synchronize()
        return self.finish()

    def seconds(self) -> float:
        """How long the bytes took to move (on the device, for a CUDA copy), once done."""
        if self._begin is not None and self._end is not None:
            return float(self._begin.elapsed_time(self._end)) / 1000.0
        return self._seconds


def _nothing(out: Any = None) -> PendingCopy:
    """A copy of no pages: done, and nothing to check after it."""
    none = np.empty(0, dtype=np.int64)
    return PendingCopy("none", none, none, none, "", out)


def lease_margin(ttl_s: float) -> float:
    """How long before a lease's deadline the client stops copying through it."""
    return min(1.0, ttl_s / 10)


class PoolMapping:
    """One process's mapping of the daemon's pool (and its CUDA registration)."""

    def __init__(
        self,
        arena: Arena,
        instance: int,
        gen_granule: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        pool_id: int = 0,
        base: int = 0,
    ) -> None:
        self.arena = arena
        self.instance = instance
        self.pool_id = pool_id
        # the daemon's offset of this file's first slot (tenant arenas; 0: the whole
        # pool): handles carry the daemon's offsets, copies go to ``offset - base``
        self.base = base
        # instances before this one that served this pool: their read handles are fenced
        # by generations alone (a page the new daemon did not adopt has moved on)
        self.earlier: set[int] = set()
        self.granule = gen_granule
        self.clock = clock  # the clock of the handles' deadlines
        self._pinned = False
        self._mapped: Any = None  # the pool's CUDA view, for gather/scatter kernels
        # CUDA copies through this mapping that may still be moving bytes: the
        # mapping stays registered and mapped until they are done
        self._inflight: deque[PendingCopy] = deque()
        self._closed = False  # close() began: no copy begins through this mapping
        # held while a CUDA copy is queued and while the pool is unregistered: a copy
        # on one thread never launches with the pool's CUDA view that another
        # thread's unpin (Client.close, a restart's remap) is taking away.
        # Reentrant (see _turn): a signal handler that closes the client (an
        # engine's shutdown) runs on the thread that may hold it
        self._launching = threading.RLock()
        self._busy = False  # a holder of _launching is inside its turn
        self._deferred: Callable[[], None] | None = None  # what a nested call left to it

    # -- handles -------------------------------------------------------------------

    def snapshot(self, offsets: list[int]) -> np.ndarray:
        """The generations of ``offsets`` now (taken when a handle is made)."""
        if not offsets:
            return np.empty(0, dtype=self.arena.gens.dtype)
        idx = np.asarray(offsets, dtype=np.int64)  # a new array: changed in place below
        if self.base:
            idx -= self.base
        idx //= self.granule
        return self.arena.gens.take(idx)

    def adopted_by(self, instance: int) -> None:
        """A restarted daemon (``instance``) adopted this pool."""
        self.earlier.add(self.instance)
        self.instance = instance

    def _fence(self, handle: Reservation | Hit, what: str) -> tuple[np.ndarray, np.ndarray]:
        """The checks before a copy; the pool's bytes and generations for it,
        taken once: views that keep the mapping alive (Arena.close leaves a
        mapping open while views of it live), so a close on another thread
        (Client.close, a restart's remap) cannot pull the memory from under
        the copy, and a copy that begins after it is refused. Taken before
        the flag is read: close() sets it before it empties the arena."""
        array, gens = self.arena.array, self.arena.gens
        if self._closed:
            raise StaleHandle(
                f"this client's mapping of the pool was closed (the client closed, or the "
                f"daemon restarted): the {what} is a miss"
            )
        if handle.closed:
            raise StaleHandle(f"this {what} is closed (committed, aborted or released)")
        earlier = isinstance(handle, Hit) and handle.instance in self.earlier
        if handle.instance != self.instance and not earlier:
            raise StaleHandle(f"the daemon restarted since this {what} was granted")
        if self.clock() >= handle.deadline:
            raise StaleHandle(
                f"this {what}'s lease is at or past its deadline: renew it before long copies"
            )
        if handle.lease and len(handle.gens) != len(handle.offsets):
            # granted to a client that maps no pool (map_pool=False): no generations
            # were noted, and a copy without them would have no fence at all
            raise BadRequest(
                f"this {what} was granted to a client that does not map the pool: "
                "copy through handles of a client that does"
            )
        return array, gens

    @staticmethod
    def _moved(gens: np.ndarray, handle: Reservation | Hit, gidx: np.ndarray) -> int:
        """-1 when every slot keeps its generation, else the first that moved."""
        moved = gens[gidx] != handle.gens
        return int(moved.argmax()) if moved.any() else -1

    # -- copies ----------------------------------------------------------------------

    def write(self, res: Reservation, data: Any, rows: Any = None, at: At = None) -> None:
        """Copy ``data`` (one page per slot of ``res``) into its slots; a list of
        segments, ``rows`` or ``at`` make a segmented copy (``segments``)."""
        self.start_write(res, data, rows, at).result()

    def read(self, hit: Hit, out: Any = None, rows: Any = None, at: At = None) -> Any:
        """Copy the slots of ``hit`` into ``out`` (n, page_bytes), in one call; a
        list of segments, ``rows`` or ``at`` make a segmented copy (``segments``)."""
        return self.start_read(hit, out, rows, at).result()

    def start_write(
        self, res: Reservation, data: Any, rows: Any = None, at: At = None
    ) -> PendingCopy:
        """``write``, started: a CUDA copy is queued on the current stream and not
        waited for; the fence before it is checked now, the one after it by the
        ``PendingCopy``."""
        check_kind(res, Reservation, "write_pages", "a Reservation (from reserve)")
        offsets = res.offsets
        if not offsets:
            self._fence(res, "reservation")
            check_empty(data, rows, at, "the data")
            return _nothing()
        if segmented(data, rows, at):
            return self.start_segments(res, data, rows, 0 if at is None else at, to_pool=True)
        ns = res.ns
        on_gpu = cuda_tensor(data)
        # the source is ready before the fences: nothing slow runs between them and the copy
        src = data if on_gpu else source_bytes(data, len(offsets), ns.page_bytes)
        array, gens = self._fence(res, "reservation")
        idx, gidx = self._row_index(ns, offsets)
        if self._moved(gens, res, gidx) >= 0:
            raise StaleHandle("a slot of this reservation changed owner: reserve again")
        rows = self.arena.rows(ns.page_bytes, array)
        stale = (
            "a slot changed owner during the write (the lease outlived its quarantine): "
            "do not commit"
        )
        if on_gpu:
            from hicached.client import cuda

            return self._on_gpu(
                data.device,
                lambda: cuda.copy(rows, idx, data, to_pool=True, mapped=self._mapped),
                res,
                gens,
                gidx,
                stale,
            )
        started = time.perf_counter()
        if len(idx) == 1:
            rows[idx[0]] = src[0]
        elif np.all(np.diff(idx) == 1):
            rows[idx[0] : idx[-1] + 1] = src  # contiguous slots: one memcpy
        else:
            scatter(rows, idx, src)  # numpy's or torch's, the faster here (client/gather.py)
        took = time.perf_counter() - started
        return PendingCopy("host", gens, gidx, res.gens, stale, seconds=took)

    def start_read(self, hit: Hit, out: Any = None, rows: Any = None, at: At = None) -> PendingCopy:
        """``read``, started: a CUDA copy is queued on the current stream and not
        waited for; ``out`` holds the pages only once the ``PendingCopy``
        finished without ``StaleHandle``."""
        check_kind(hit, Hit, "read_pages", "a Hit (from a leased match)")
        array, gens = self._fence(hit, "hit")
        if not hit.lease and hit.offsets:
            raise BadRequest("this hit holds no lease: match with lease=True to copy its pages")
        if segmented(out, rows, at):
            if out is None:
                raise ValueError("a segmented read needs out: the arrays or tensors to fill")
            if hit.offsets:
                at = 0 if at is None else at
                return self.start_segments(hit, out, rows, at, to_pool=False, out=out)
            return _nothing(out)
        ns = hit.ns
        offsets = hit.offsets
        if not offsets:  # nothing to copy
            check_empty(out, rows, at, "out")
            return _nothing(np.empty((0, ns.page_bytes), dtype=np.uint8) if out is None else out)
        idx, gidx = self._row_index(ns, offsets)
        moved = self._moved(gens, hit, gidx)
        if moved >= 0:
            raise StaleHandle(
                "a page of this hit left its slot: it is a miss now", 0
            )  # none copied
        rows = self.arena.rows(ns.page_bytes, array)
        stale = "a page was reused while it was read: it is a miss"
        if cuda_tensor(out):
            from hicached.client import cuda

            return self._on_gpu(
                out.device,
                lambda: cuda.copy(rows, idx, out, to_pool=False, mapped=self._mapped),
                hit,
                gens,
                gidx,
                stale,
                out,
            )
        started = time.perf_counter()
        if out is None:
            out = np.empty((len(idx), ns.page_bytes), dtype=np.uint8)
        dst = destination_bytes(out, len(idx), ns.page_bytes)
        if np.all(np.diff(idx) == 1):
            dst[...] = rows[idx[0] : idx[-1] + 1]
        else:
            gather(rows, idx, dst)  # numpy's or torch's, the faster here (client/gather.py)
        took = time.perf_counter() - started
        return PendingCopy("host", gens, gidx, hit.gens, stale, out, seconds=took)

    def segments(
        self,
        handle: Reservation | Hit,
        segs: Any,
        rows: Any,
        at: int | Sequence[int],
        *,
        to_pool: bool,
    ) -> None:
        """One fenced copy between the slots of ``handle`` and several arrays or
        tensors (*segments*): page j's bytes from ``at`` on are row j of each
        segment, in order, or row ``rows[j]`` of each when ``rows`` is given
        (the segments are then whole engine tensors, rows first: vLLM's
        per-layer KV, SGLang's K and V). ``at`` places the data inside each
        slot: worker r of a wide page copies at ``r * page_bytes // shards``;
        a list places each segment at a byte of its own (segments with gaps
        between them: a worker's heads in vLLM's canonical pages), no two over
        one another."""
        self.start_segments(handle, segs, rows, at, to_pool=to_pool).result()

    def start_segments(
        self,
        handle: Reservation | Hit,
        segs: Any,
        rows: Any,
        at: int | Sequence[int],
        *,
        to_pool: bool,
        out: Any = None,
    ) -> PendingCopy:
        """``segments``, started (``start_write``, ``start_read``); ``out`` is what
        the ``PendingCopy`` gives back once finished."""
        segs = list(segs) if isinstance(segs, list | tuple) else [segs]
        if not segs:
            raise ValueError("a segmented copy needs at least one segment")
        ns = handle.ns
        n = len(handle.offsets)
        on_gpu = cuda_tensor(segs[0])
        if on_gpu and not all(cuda_tensor(seg) for seg in segs):
            raise ValueError("segments must all be CUDA tensors or all host memory")
        if on_gpu and any(seg.dim() < 1 for seg in segs):
            raise ValueError("segments must be arrays or tensors with one row per page or block")
        views: list[Any] = (
            segs if on_gpu else [segment_bytes(s, writable=not to_pool) for s in segs]
        )
        widths = [_row_bytes(seg) if on_gpu else seg.shape[1] for seg in views]
        starts = starts_of(at, widths, ns.page_bytes)
        picks = None
        if rows is not None:
            try:
                given = np.asarray(rows)
            except (TypeError, ValueError):  # a tensor on a device, a ragged list
                raise ValueError(
                    "rows must be a flat list, numpy array or CPU tensor of integers in host "
                    "memory, one per page"
                ) from None
            if given.size and given.dtype.kind not in "iu":
                raise ValueError(f"rows must be integers (block numbers), not {given.dtype}")
            picks = given.astype(np.int64, copy=False).reshape(-1)
            if not to_pool and len(np.unique(picks)) != len(picks):
                raise ValueError("rows to read into must differ: two pages cannot fill one row")
            height = min(int(seg.shape[0]) for seg in views)
            if len(picks) != n or (n and (int(picks.min()) < 0 or int(picks.max()) >= height)):
                among = f"in 0..{height - 1}" if height else "(a segment has no rows)"
                raise ValueError(f"rows must be {n} row numbers {among}, one per page")
        elif any(int(seg.shape[0]) != n for seg in views):
            raise ValueError(f"each segment must have {n} rows, one per page (or give rows)")
        what = "reservation" if to_pool else "hit"
        array, gens = self._fence(handle, what)
        idx, gidx = self._row_index(ns, handle.offsets)
        if self._moved(gens, handle, gidx) >= 0:
            raise StaleHandle(f"a slot of this {what} changed owner: it is a miss now")
        pool = self.arena.rows(ns.page_bytes, array)
        stale = f"a slot of this {what} changed owner during the copy: a miss"
        if on_gpu:
            from hicached.client import cuda

            return self._on_gpu(
                views[0].device,
                lambda: cuda.copy_segments(
                    pool, idx, views, picks, starts, to_pool=to_pool, mapped=self._mapped
                ),
                handle,
                gens,
                gidx,
                stale,
                out,
            )
        started = time.perf_counter()
        _copy_rows(pool, idx, views, picks, starts, to_pool)
        took = time.perf_counter() - started
        return PendingCopy("host", gens, gidx, handle.gens, stale, out, seconds=took)

    def _on_gpu(
        self,
        device: Any,
        launch: Callable[[], str],
        handle: Reservation | Hit,
        gens: np.ndarray,
        gidx: np.ndarray,
        stale: str,
        out: Any = None,
    ) -> PendingCopy:
        """Queue a CUDA copy between two events on the current stream; refused
        (StaleHandle) once close() began, which may have unregistered the pool
        since the fence was checked."""
        from hicached.client import cuda

        with self._turn():
            if self._closed:
                raise StaleHandle(
                    "this client's mapping of the pool was closed during the copy's start "
                    "(the client closed, or the daemon restarted): nothing was copied"
                )
            begin = cuda.mark(device, timing=True)
            path = launch()
            end = cuda.mark(device, timing=True)
            pending = PendingCopy(path, gens, gidx, handle.gens, stale, out, begin=begin, end=end)
            while self._inflight and self._inflight[0].done():
                self._inflight.popleft()
            self._inflight.append(pending)
        return pending

    def _row_index(self, ns: Namespace, offsets: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``offsets`` and their generation counters; a cache must never
        lie, so every offset is checked."""
        pb = ns.page_bytes
        try:
            arr = np.asarray(offsets, dtype=np.int64) - self.base
        except OverflowError:  # past 2**63: no slot of any pool (a handle from elsewhere)
            raise ValueError(f"offsets must be slots of {pb} bytes inside the pool") from None
        if int(arr.min()) < 0 or int(arr.max()) + pb > self.arena.size or (arr % pb).any():
            raise ValueError(f"offsets must be slots of {pb} bytes inside the pool")
        return arr // pb, arr // self.granule

    # -- CUDA --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _turn(self, then: Callable[[], None] | None = None) -> Iterator[bool]:
        """Hold ``_launching``: yields True for this thread's turn, False for a
        call nested in it. A signal handler runs on a thread that may be inside
        its turn (queuing a copy, pinning, draining), and waiting for the lock
        there would wait for itself; so a nested unpin or close (``then``) is
        left to the turn and done as it ends, never under a copy being queued."""
        with self._launching:
            if self._busy:  # only this thread gets here while another call is in its turn
                if then is not None and (self._deferred is None or then == self.close):
                    self._deferred = then
                yield False
                return
            self._busy = True
            try:
                yield True
            finally:
                self._busy = False
                deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred()

    def pin(self) -> None:
        """Register the mapping with CUDA as pinned memory (once)."""
        with self._turn():
            if self._pinned:
                return
            from hicached.client import cuda

            self._mapped = cuda.register(self.arena.array)
            self._pinned = True

    @property
    def pinned(self) -> bool:
        return self._pinned

    def unpin(self) -> None:
        """Unregister the mapping from CUDA (if pinned), once the copies still in
        flight through it are done; a copy being queued on another thread is
        queued first, and drained with the rest."""
        with self._turn(self.unpin) as mine:
            if mine:
                self._unpin()

    def _unpin(self) -> None:
        if self._pinned and self._drained():
            from hicached.client import cuda

            self._pinned, self._mapped = False, None
            cuda.unregister(self.arena.array)

    def _drained(self) -> bool:
        """Wait (up to _DRAIN_S) for the CUDA copies still moving bytes through
        the pool; False if some are not done by then: a GPU that hangs."""
        deadline = time.monotonic() + _DRAIN_S
        while self._inflight:
            if not self._inflight[0].wait(max(0.0, deadline - time.monotonic())):
                log.error(
                    "hicached: %d CUDA copies through the pool did not finish in %.0f s; "
                    "the pool stays registered and mapped",
                    len(self._inflight),
                    _DRAIN_S,
                )
                return False
            self._inflight.popleft()
        return True

    def close(self) -> None:
        """Unregister (if pinned), then unmap; a mapping that copies still use
        (see ``_drained``) stays mapped, since freeing it under them could
        corrupt another mapping's memory."""
        self._closed = True  # before the arena empties: see _fence
        with self._turn(self.close) as mine:
            if mine:
                self._unpin()
                if not self._pinned:
                    self.arena.close()
