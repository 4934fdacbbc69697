"""The engine side's wait with a deadline (``client/deadline.within``) never
loses a cancel, both ways it runs (``engine_waits``: asyncio.timeout from
3.11, the timer that cancels the task on 3.10): a cancel that meets the end
of its wait in the same turn is raised, not dropped as ``asyncio.wait_for``
drops it before 3.12; a semaphore slot granted in that turn goes back."""

from __future__ import annotations

import asyncio

import pytest

from hicached.client.deadline import within

pytestmark = pytest.mark.timeout(30)


async def _settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_cancel_in_the_turn_the_reply_lands_is_raised(engine_waits: str) -> None:
    reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    call = asyncio.create_task(within(reply, 10.0))
    await _settled()
    reply.set_result(5)
    call.cancel()  # the same turn: the reply is in before the call runs again
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_wait_past_its_deadline_times_out_and_one_done_in_time_returns(
    engine_waits: str,
) -> None:
    slow: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(asyncio.TimeoutError):
        await within(slow, 0.01)
    assert slow.cancelled()  # awaited in the task: the deadline's cancel reached it
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    done.set_result(3)
    assert await within(done, 0.0) == 3  # done already: no wait, even at 0
    assert await within(asyncio.sleep(0.01, result=4), 5.0) == 4
    # a cancel from elsewhere well before the deadline stays a cancel
    call = asyncio.create_task(within(asyncio.sleep(10), 5.0))
    await _settled()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_slot_granted_in_the_turn_its_waiter_is_cancelled_goes_back(
    engine_waits: str,
) -> None:
    slots = asyncio.Semaphore(1)
    await slots.acquire()
    waiter = asyncio.create_task(within(slots.acquire(), 10.0))
    await _settled()
    slots.release()  # grants the slot to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiter
    # the slot is free again: taken at once, not after a deadline
    await within(slots.acquire(), 1.0)
    assert slots.locked()


async def test_a_cancel_while_the_awaited_call_cleans_up_after_its_deadline_stays_a_cancel(
    engine_waits: str,
) -> None:
    cleaning = asyncio.Event()

    async def slow_to_end() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            cleaning.set()
            await asyncio.sleep(0.05)  # cleaning up after the deadline's cancel

    call = asyncio.create_task(within(slow_to_end(), 0.01))
    await asyncio.wait_for(cleaning.wait(), 5.0)
    call.cancel()  # the caller's own cancel, while the cleanup runs
    with pytest.raises(asyncio.CancelledError):
        await call
