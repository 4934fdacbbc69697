"""How the engine side waits with a deadline: ``within``.

Before Python 3.12, ``asyncio.wait_for`` gives back what it waited for when a
cancel meets that end in the same turn of the loop, and the cancel is lost:
the cancelled task goes on as if nothing had happened. A call its caller gave
up returns its reply to no one (a read lease in it pins pages until it
expires), a task being stopped keeps running. ``within`` awaits in the task
itself under ``asyncio.timeout`` (3.11 on), which raises the cancel. Python
3.10 has no ``asyncio.timeout``: there a timer cancels the task at the
deadline, and that cancel is told from others by the timer having fired
(``asyncio.timeout``'s way, less the count of cancels 3.10 does not keep: a
cancel from elsewhere in the very turn the deadline passes reads as the
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
    """``within`` for Python 3.10 (and the tests, on any Python)."""
    task = asyncio.current_task()
    assert task is not None, "within() runs in a task"
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(max(timeout, 0.0), expire)
    try:
        return await aw
    except asyncio.CancelledError:
        if fired:
            raise asyncio.TimeoutError from None
        raise
    finally:
        timer.cancel()
