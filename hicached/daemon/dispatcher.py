"""Runs every L3 operation of one backend, so the event loop never blocks on it.

- Writes wait in a bounded queue: pages queued plus pages in flight (taken by
  a writer and not finished, hung calls included) are at most
  ``storage.queue_pages``, so a hung backend pins at most that many L2 slots;
  beyond it a write is dropped and counted. Writers take batches of up to
  ``batch_pages`` pages of one namespace.
- ``concurrency`` call slots bound the backend calls running at once, and
  one more is kept for existence checks. A call keeps its slot until it
  really ends, even past its timeout; a call that finds no free slot within
  ``op_timeout_s`` fails (and counts toward the breaker), so a hung backend
  holds at most ``concurrency`` + 1 calls.
- Slots go to three classes of waiters in order, each first in, first out:
  existence checks (``exists``: a request's L3 lookup, a prefetch's first
  step), then reads (``get``: a prefetch's pages), then writes (``put``).
  Checks sit on a new request's time to first token and are cheap; a read
  batch can take many milliseconds, so a check queued behind reads would
  often run past ``lookup_timeout_s`` and turn an L3 hit into a miss.
- The slot kept for checks is held by one or free: while no check holds a
  slot, reads and writes leave one free, so a check finds a slot at once
  however many slow reads run and queue; reads and writes may still run
  ``concurrency`` calls between them, as without it (a check may also take
  one of their slots that is free when it comes). Checks that hang do not
  keep reads from the slots left.
- Writes never take the last of the slots reads and writes share when there
  are two or more, so a read never waits behind background writes, even hung
  ones.
- Reads cannot starve behind checks: while a read waits that could take a
  slot, at most ``concurrency - 1`` checks in a row (one, with one or two
  slots) take one before that read does.
- A retriable failure is retried with exponential backoff, ``retries``
  times; then the call fails. A timed-out call is not retried: it may still
  own its buffers (below).
- An answer that breaks the backend contract (a put's or get's flags not one
  a page, an existence count past the keys asked of) is a failed call,
  counted in ``bad_answers``: no flag is matched to the wrong page, and the
  writers go on. Flags in any sequence of a length (a numpy array) are one
  a page; an iterator's are not (no length to check). A flag is a bool or
  the integer 0 or 1: an item that is another number (a store's code) makes
  the answer a contract break, not a page read.
- A circuit breaker (daemon/breaker.py): ``breaker_failures`` failed calls
  in a row, or a store that does not answer at the start, mark the backend
  down; calls then fail at once while probes bring it up again.
- A call that times out is *not* abandoned: its completion callback runs
  when the backend finally returns, so the pool slots it reads or writes stay
  held until then; meanwhile it counts in ``hung_calls``.
- Stopping has one deadline (``stop_by``): queued writes get until then, and a
  cancelled read or write waits for its backend task no longer than that (a
  cancelled existence check, which owns no buffer, not at all).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import operator
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hicached.config import StorageConfig
from hicached.daemon.breaker import Breaker
from hicached.daemon.waits import bounded, end_tasks, wait_event
from hicached_backends.base import Backend, BackendError, PageRef

log = logging.getLogger("hicached.dispatcher")
T = TypeVar("T")


@dataclass(slots=True)
class WriteJob:
    ns: bytes
    key: bytes
    buf: memoryview
    done: Callable[[bool], None]


#: Call slots beyond ``concurrency`` kept for existence checks: reads and writes
#: leave them free while no check holds a slot.
_KEPT_FOR_CHECKS = 1
#: Classes of calls waiting for a slot, in the order they are served.
_CHECK, _READ, _WRITE = _CLASSES = (0, 1, 2)


def _class_of(what: str) -> int:
    """A backend call's class by its name: exists, put, and reads (the rest)."""
    return _CHECK if what == "exists" else _WRITE if what == "put" else _READ


class Unavailable(Exception):
    """The backend is down (breaker open) or the call ran out of attempts."""


class Dispatcher:
    """Queues, batches, retries and guards the calls to one backend."""

    def __init__(self, backend: Backend, config: StorageConfig, name: str) -> None:
        self.backend = backend
        self.config = config
        self.name = name
        self._queue: collections.deque[WriteJob] = collections.deque()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()  # set when written pages leave the bound
        # ``concurrency`` slots, and one kept for existence checks (the module docstring)
        self._free_slots = config.concurrency + _KEPT_FOR_CHECKS
        # Call slots by class (_CHECK, _READ, _WRITE; the module docstring says why):
        # waiters in the order they are served, and slots each class holds.
        self._waiters: tuple[collections.deque[asyncio.Future[None]], ...] = tuple(
            collections.deque() for _ in _CLASSES
        )
        self._held = [0] * len(_CLASSES)
        self._keep_for_reads = 1 if config.concurrency > 1 else 0  # left by writes
        self._checks_max = max(1, config.concurrency - 1)  # in a row past a waiting read
        self._checks_in_a_row = 0
        self._hung: set[asyncio.Future[Any]] = set()  # calls past their timeout, still running
        self._tasks: list[asyncio.Task[None]] = []
        self._accepting = False
        #: monotonic time by which a stop must be done; inf while serving
        self.stop_by = math.inf
        self.running = 0  # backend calls in progress, hung ones included
        self.writing = 0  # pages taken from the queue and not finished
        #: called with (operation, seconds) when a backend call attempt ends
        self.on_call: Callable[[str, float], None] | None = None
        self.counters: collections.Counter[str] = collections.Counter()
        self.breaker = Breaker(config, backend.health, name, self.counters)

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Open the backend. A store that does not answer now (a retriable
        error) is down from the start: L2 serves, and the probe (its health)
        brings it up once it answers."""
        unreachable: BackendError | None = None
        try:
            await self.backend.open()
        except BackendError as exc:
            if not exc.retriable:
                raise
            unreachable = exc
        self._accepting = self.breaker.probes = True
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._writer()) for _ in range(self.config.concurrency)]
        if unreachable is not None:
            self.breaker.down_from_start(unreachable.message)

    async def stop(self, until: float) -> None:
        """Finish queued and in-flight writes until ``until`` (monotonic), drop
        what is left, then close the backend."""
        self._accepting = False
        self.stop_by = min(self.stop_by, until)
        self.breaker.stop()
        while (self._queue or self.writing) and time.monotonic() < until:
            self._wake.set()
            await self.wait_room(min(0.05, max(0.0, until - time.monotonic())))
        dropped = len(self._queue)
        while self._queue:
            self._queue.popleft().done(False)
        if dropped:
            self.counters["write_dropped_stop"] += dropped
            log.warning("%s: %d queued writes not done by the stop deadline", self.name, dropped)
        # a writer cancelled in a call waits for it until the stop deadline (its
        # grace): a second past it, the stop goes on without it
        await end_tasks(self._tasks, max(1.0, until + 1.0 - time.monotonic()), self.name)
        self._tasks = []
        if self.running:
            log.warning(
                "%s: %d backend calls (%d past their timeout) still running at the stop deadline",
                self.name,
                self.running,
                len(self._hung),
            )
        # Closing waits for no call still running (each backend's close leaves
        # its threads to end on their own); a close that hangs itself is given
        # up on a second past the deadline.
        try:
            await bounded(self.backend.close(), max(1.0, until + 1.0 - time.monotonic()))
        except TimeoutError:
            log.warning("%s: the backend did not close by the stop deadline", self.name)
        except Exception:  # the rest of the daemon's stop runs all the same
            log.exception("%s: closing the backend failed", self.name)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def hung_calls(self) -> int:
        """Calls past ``op_timeout_s`` whose backend task is still running."""
        return len(self._hung)

    @property
    def room(self) -> int:
        """Pages that may still be queued: the bound less queued and in-flight pages."""
        return self.config.queue_pages - len(self._queue) - self.writing

    @property
    def state(self) -> str:
        return "down" if self.breaker.down else "up"

    @property
    def cooling(self) -> bool:
        """Down, and within the cooldown or probing: calls fail without a probe."""
        return self.breaker.cooling

    async def wait_room(self, timeout: float) -> None:
        """Return when written pages leave the queue bound, or after ``timeout``."""
        self._room.clear()
        await wait_event(self._room, timeout)

    # -- writes ----------------------------------------------------------------------

    def submit_write(self, job: WriteJob) -> bool:
        """Queue one page write; False (and counted) when it cannot be taken."""
        if not self._accepting:
            self.counters["write_refused_stopping"] += 1
            return False
        if self.cooling:
            self.counters["write_skipped_down"] += 1
            return False
        if self.room <= 0:
            self.counters["write_dropped_full"] += 1
            return False
        self._queue.append(job)
        self._wake.set()
        return True

    async def _writer(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            batch = self._take_batch()
            self.writing += len(batch)
            try:
                results = await self.call(
                    self.backend.put, batch[0].ns, [PageRef(j.key, j.buf) for j in batch]
                )
            except Unavailable:
                results = [False] * len(batch)
            except _Late as late:
                late.then(functools.partial(self._finish, batch))  # slots stay held till it ends
                continue
            self._finish(batch, results)

    def _take_batch(self) -> list[WriteJob]:
        first = self._queue.popleft()
        batch = [first]
        skipped: list[WriteJob] = []
        while self._queue and len(batch) < self.config.batch_pages:
            job = self._queue.popleft()
            (batch if job.ns == first.ns else skipped).append(job)
        self._queue.extendleft(reversed(skipped))
        return batch

    def _finish(self, batch: list[WriteJob], results: Sequence[bool] | BaseException) -> None:
        self.writing -= len(batch)
        self._room.set()
        ok_list = [False] * len(batch)
        if not isinstance(results, BaseException):
            ok_list = self._flags("put", results, len(batch)) or ok_list
        for job, ok in zip(batch, ok_list, strict=True):
            self.counters["pages_written" if ok else "write_failed"] += 1
            job.done(bool(ok))

    def _flags(self, what: str, answer: object, n: int) -> list[bool] | None:
        """A put's or a get's answer for ``n`` pages, a flag a page; None (a failed
        call, counted in ``bad_answers``) when it is not one flag a page: a
        backend that breaks the contract (a third-party one's bug) must not
        have its flags matched to the wrong pages, nor stop the writers."""
        if _in_order(answer):
            try:
                if len(answer) == n:  # type: ignore[arg-type]
                    return [_flag(flag) for flag in answer]  # type: ignore[attr-defined]
            except (TypeError, ValueError):  # an item that is no flag (a code, an array's row)
                pass
        self._bad_answer(what, f"{type(answer).__name__} of {_length(answer)} for {n} pages")
        return None

    def _bad_answer(self, what: str, why: str) -> None:
        self.counters["bad_answers"] += 1
        self.breaker.failed(f"{what} answered {why}")
        log.error("%s: %s answered %s; taken as a failed call", self.name, what, why)

    # -- call slots ------------------------------------------------------------------

    def _can_take(self, kind: int) -> bool:
        """Whether a call of class ``kind`` may take a free slot now (waiters of
        the classes before it aside)."""
        free = self._free_slots
        keep = _KEPT_FOR_CHECKS if self._held[_CHECK] == 0 else 0
        if kind == _WRITE:
            return free > self._keep_for_reads + keep
        if kind == _READ:
            return free > keep
        return free > 0 and not self._read_due()

    def _read_due(self) -> bool:
        """A waiting read could take a slot, and checks took enough in a row."""
        return (
            self._checks_in_a_row >= self._checks_max
            and bool(self._waiters[_READ])
            and self._can_take(_READ)
        )

    def _take(self, kind: int) -> None:
        if kind == _CHECK:
            if not self._waiters[_READ]:
                self._checks_in_a_row = 0
            elif self._can_take(_READ):
                self._checks_in_a_row += 1  # a waiting read could have had this slot
        elif kind == _READ:
            self._checks_in_a_row = 0
        self._free_slots -= 1
        self._held[kind] += 1

    async def _take_slot(self, kind: int) -> bool:
        """A call slot, waiting at most ``op_timeout_s``, in class order (the
        module docstring)."""
        if self._can_take(kind) and not any(self._waiters[k] for k in range(kind + 1)):
            self._take(kind)
            return True
        waiters = self._waiters[kind]
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            await asyncio.wait({waiter}, timeout=self.config.op_timeout_s)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._give_slot(kind)  # handed over just as we were cancelled
            else:
                self._drop_waiter(waiter, waiters)
            raise
        if waiter.done():
            return True
        self._drop_waiter(waiter, waiters)
        return False

    def _drop_waiter(
        self, waiter: asyncio.Future[None], waiters: collections.deque[asyncio.Future[None]]
    ) -> None:
        waiter.cancel()
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)
        self._hand_over()  # a later waiter may take what this one was kept from

    def _give_slot(self, kind: int) -> None:
        self._free_slots += 1
        self._held[kind] -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        """Free slots to waiters: the first class, in order, that may take one."""
        while True:
            kind = next((k for k in _CLASSES if self._waiters[k] and self._can_take(k)), None)
            if kind is None:
                return
            waiter = self._waiters[kind].popleft()
            if not waiter.done():
                self._take(kind)
                waiter.set_result(None)

    def _ended(self, what: str, started: float, task: asyncio.Future[Any]) -> None:
        """A backend task ended (in time or not): its slot is free only now."""
        self.running -= 1
        self._hung.discard(task)
        self._give_slot(_class_of(what))
        if not task.cancelled():
            task.exception()  # retrieved here; the caller or _Late reads it too
        if self.on_call is not None:
            self.on_call(what, time.monotonic() - started)

    def _grace(self) -> float:
        """How long a cancelled call waits for its backend task."""
        return max(0.0, min(self.config.op_timeout_s, self.stop_by - time.monotonic()))

    async def _attempt(
        self, fn: Callable[..., Awaitable[T]], args: tuple[object, ...], what: str
    ) -> asyncio.Future[T]:
        """Start ``fn(*args)`` in a call slot and wait up to ``op_timeout_s``; the
        returned task may still be running (then it is hung and keeps its slot)."""
        kind = _class_of(what)
        if not await self._take_slot(kind):
            self.counters["slot_timeouts"] += 1
            self.breaker.failed(f"{what}: no call slot came free within op_timeout_s")
            raise Unavailable(f"{self.name}: every call slot is busy")
        self.running += 1
        started = time.monotonic()
        try:
            task = asyncio.ensure_future(fn(*args))
        except BaseException:
            self.running -= 1
            self._give_slot(kind)
            raise
        task.add_done_callback(functools.partial(self._ended, what, started))
        try:
            await asyncio.wait({task}, timeout=self.config.op_timeout_s)
        except asyncio.CancelledError:
            # the call may be writing into pool slots: let it end first (a check
            # writes into none: a stop need not wait for one that hangs)
            if kind != _CHECK:
                await asyncio.wait({task}, timeout=self._grace())
            raise
        if not task.done():  # past its timeout (not one cancelled by a stop before it)
            self._hung.add(task)
        return task

    # -- calls -----------------------------------------------------------------------

    async def call(self, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        """``fn(*args)`` on the backend with the breaker, retries and the timeout.

        Raises Unavailable when the backend is down or every attempt failed.
        A timed-out attempt is not retried (it may still own its buffers): it
        raises _Late, whose task is still running and holds its call slot.
        """
        if self.breaker.down and not await self.breaker.probe():
            raise Unavailable(f"{self.name} is down")
        what = getattr(fn, "__name__", "call")
        attempts = self.config.retries + 1
        for attempt in range(attempts):
            task = await self._attempt(fn, args, what)
            if not task.done():
                self.counters["timeouts"] += 1
                self.breaker.failed(f"{what} timed out")
                raise _Late(task)
            exc = task.exception()
            if exc is None:
                self.breaker.failures = 0
                return task.result()
            self.breaker.failed(f"{what}: {exc}")
            if not isinstance(exc, BackendError):
                log.error("%s: unexpected error in %s", self.name, what, exc_info=exc)
            if not (isinstance(exc, BackendError) and exc.retriable) or attempt == attempts - 1:
                raise Unavailable(str(exc)) from exc
            self.counters["retries"] += 1
            await asyncio.sleep(self.config.retry_backoff_s * (2**attempt))
            if self.cooling:
                raise Unavailable(f"{self.name} is down")
        raise AssertionError("unreachable")  # pragma: no cover

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int | None:
        """Leading keys held by the backend; None when it cannot tell now (down,
        or too late): not the same as 0, which says it holds none."""
        return (await self.exists_late(ns, keys))[0]

    async def exists_late(
        self, ns: bytes, keys: Sequence[bytes]
    ) -> tuple[int | None, asyncio.Future[Any] | None]:
        """As ``exists``, with the backend call that ran past ``op_timeout_s``
        and still runs (None: none does), for a caller whose bound must hold
        until the call really ends (a prefetch: cache/prefetch.py)."""
        try:
            found = await self.call(self.backend.exists, ns, keys)
        except Unavailable:
            return None, None
        except _Late as late:
            return None, late.task
        try:
            count = operator.index(found)
        except TypeError:
            count = -1
        if not 0 <= count <= len(keys):
            self._bad_answer("exists", f"{found!r} for {len(keys)} keys")
            return None, None
        return count, None

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        """Read pages into their slots; all False when the backend fails.

        Returns only once no backend thread can still write into the slots.
        """
        try:
            result = await self.call(self.backend.get, ns, pages)
        except Unavailable:
            return [False] * len(pages)
        except _Late as late:
            await late.wait()
            return [False] * len(pages)
        flags = self._flags("get", result, len(pages))
        if flags is None:
            return [False] * len(pages)
        self.counters["pages_read"] += sum(flags)
        return flags


def _in_order(answer: object) -> bool:
    """Whether an answer holds its items in order, to be matched to pages by
    place: a list or tuple, a numpy array; not a string, a mapping, a set, nor
    an iterator (no length to check)."""
    if isinstance(answer, (str, bytes, bytearray, memoryview, Mapping, AbstractSet)):
        return False
    return hasattr(answer, "__len__") and hasattr(answer, "__getitem__")


def _flag(item: object) -> bool:
    """An answer's item as a flag: a bool (numpy's too), or the integer 0 or 1.
    Anything else raises (TypeError, ValueError): a store's code (bytes read,
    a negative error) is true as a truth value, and a page never read would
    count as read."""
    if isinstance(item, (bool, np.bool_)):
        return bool(item)
    number = operator.index(item)  # type: ignore[arg-type]
    if number not in (0, 1):
        raise ValueError(f"{number} is no flag")
    return bool(number)


def _length(answer: object) -> str:
    """How long an answer is, for a log line."""
    try:
        return str(len(answer))  # type: ignore[arg-type]
    except TypeError:
        return "no length"


class _Late(Exception):
    """The last attempt timed out; its task is still running and owns its buffers."""

    def __init__(self, task: asyncio.Future[Any]) -> None:
        super().__init__("timed out")
        self.task = task

    def then(self, callback: Callable[[Sequence[bool] | BaseException], None]) -> None:
        def finished(task: asyncio.Future[Any]) -> None:
            if task.cancelled():
                callback(asyncio.CancelledError())
                return
            exc = task.exception()
            callback(exc if exc is not None else task.result())

        self.task.add_done_callback(finished)

    async def wait(self) -> None:
        await asyncio.wait({self.task})
