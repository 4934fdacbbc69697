"""How the engine side waits with a deadline: ``within``.

Before Python 3.12, ``asyncio.wait_for`` gives back what it waited for when a
cancel meets that end in the same turn of the loop, and the cancel is lost:
the cancelled task goes on as if nothing had happened. A call its caller gave
up returns its reply to no one (a read lease in it pins pages until it
expires), a task being stopped keeps running. ``within`` awaits in the task
itself under ``asyncio.timeout`` (3.11 on), which raises the cancel. Python
3.10 has no ``asyncio.timeout``: there a timer cancels the task at the
deadline, and that cancel is told from others by a marker it carries
(3.10 keeps no count of cancels: one from elsewhere that comes in the very
turn the deadline passes, just before the timer's, reads as the
deadline's)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

_timeout = getattr(asyncio, "timeout", None)


async def within(aw: Awaitable[T], timeout: float) -> T:
    """``await aw``, or ``asyncio.TimeoutError`` once ``timeout`` seconds have
    passed (at once for 0 or less, unless ``aw`` is done)."""
    if _timeout is None:
        return await _within_by_timer(aw, timeout)
    async with _timeout(max(timeout, 0.0)):
        return await aw


async def _within_by_timer(aw: Awaitable[T], timeout: float) -> T:
    """``within`` for Python 3.10 (and the tests, on any Python). The timer's
    cancel carries a marker of its own: any other cancel, even one that comes
    while ``aw`` still cleans up after the deadline's, stays a cancel. One
    ``within`` at a time in a task (none of the callers nests them)."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("within() runs in a task")
    marker = object()
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        task.cancel(marker)

    timer = asyncio.get_running_loop().call_later(max(timeout, 0.0), expire)
    try:
        return await aw
    except asyncio.CancelledError as exc:
        if not (fired and exc.args and exc.args[0] is marker):
            raise
        uncancel = getattr(task, "uncancel", None)  # 3.11 on: the deadline's cancel is spent
        if uncancel is not None:
            uncancel()
        raise asyncio.TimeoutError from None
    finally:
        timer.cancel()
