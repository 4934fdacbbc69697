"""The daemon's waits with a deadline, none of which can lose a cancel.

Before Python 3.12, ``asyncio.wait_for`` gives back what it waited for when a
cancel meets that end in the same turn of the loop, and the cancel is lost:
the task goes on as if nothing had happened. A background task stopped at
shutdown (the lease sweep, woken by a reload; the writer of adopted pages,
woken as the write queue drains) would then run on, and the stop that
awaits it would not end. These waits are built on ``asyncio.wait``, whose
own waiter raises the cancel whatever else finished in that turn; ruff
keeps ``asyncio.wait_for`` out of the daemon.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Collection
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("hicached.daemon")

#: how long a stop waits for a task that has nothing to finish once cancelled
#: (a sweep, a flusher): past it, the stop goes on and says so
TASK_STOP_S = 5.0


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Whether ``event`` was set within ``timeout`` seconds (at once if set)."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=max(timeout, 0.0))
    finally:
        waiter.cancel()
    return event.is_set()


async def bounded(aw: Awaitable[T], timeout: float) -> T:
    """``await aw``, or ``TimeoutError`` once ``timeout`` seconds have passed; a
    cancel of the caller cancels ``aw`` too. What is given up on is cancelled,
    not awaited (unlike ``wait_for``): a backend call that ignores its cancel
    goes on in the background, its end retrieved when it comes."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait((task,), timeout=max(timeout, 0.0))
    except BaseException:
        _let_go(task)
        raise
    if not done:
        _let_go(task)
        raise TimeoutError
    return task.result()


def _let_go(task: asyncio.Future[Any]) -> None:
    """Cancel what is no longer waited for; its end, whatever it is, is
    retrieved when it comes (never "exception was never retrieved")."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def end_tasks(tasks: Collection[asyncio.Future[Any]], timeout: float, what: str) -> int:
    """Cancel ``tasks`` and wait ``timeout`` seconds at most for them to end.
    Returns how many still run then (logged, under ``what``); a task's own
    error is logged, not raised, so the rest of a stop runs all the same."""
    running = [task for task in tasks if not task.done()]
    for task in running:
        task.cancel()
    left: set[asyncio.Future[Any]] = set()
    if running:
        _, left = await asyncio.wait(running, timeout=max(timeout, 0.0))
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.error("%s ended with an error", what, exc_info=task.exception())
    if left:
        log.warning("%s: %d still running %.1fs after being cancelled", what, len(left), timeout)
    return len(left)


async def unless_set(aw: Awaitable[Any], event: asyncio.Event, what: str) -> bool:
    """``await aw`` unless ``event`` is set first: then ``aw`` is cancelled
    and given ``TASK_STOP_S`` to end (logged, under ``what``). Whether ``aw``
    ended; its error is raised."""
    task = asyncio.ensure_future(aw)
    if not event.is_set():
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await end_tasks([task], TASK_STOP_S, what)
            raise
        finally:
            waiter.cancel()
    if task.done():
        task.result()
        return True
    log.warning("stopped before %s ended", what)
    await end_tasks([task], TASK_STOP_S, what)
    return False
