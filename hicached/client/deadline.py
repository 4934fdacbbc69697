"""How the engine side waits with a deadline: ``within``.

Before Python 3.12, ``asyncio.wait_for`` gives back what it waited for when a
cancel meets that end in the same turn of the loop, and the cancel is lost:
the cancelled task goes on as if nothing had happened. A call its caller gave
up returns its reply to no one (a read lease in it pins pages until it
expires), a task being stopped keeps running. ``within`` awaits in the task
itself under ``asyncio.timeout`` (3.11 on), which raises the cancel; on 3.10
it is ``wait_for``, fault and all."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

_timeout = getattr(asyncio, "timeout", None)


async def within(aw: Awaitable[T], timeout: float) -> T:
    """``await aw``, or ``TimeoutError`` once ``timeout`` seconds have passed
    (at once for 0 or less, unless ``aw`` is done)."""
    if _timeout is None:  # pragma: no cover (Python 3.10)
        return await asyncio.wait_for(aw, max(timeout, 0.0))
    async with _timeout(max(timeout, 0.0)):
        return await aw
