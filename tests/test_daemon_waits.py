"""A stop always ends: no wait of the daemon loses a cancel that comes in the
same turn of the loop as the end it waited for (``asyncio.wait_for`` before
Python 3.12 does), and a stop waits for its tasks under a deadline.

The helpers are driven on a real event loop; the shutdown test runs a real
Server in this process, with real sockets, and wakes its lease sweep (as a
reload does) in the turn its stop cancels it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from pathlib import Path

import pytest

from hicached.daemon.server import Server
from hicached.daemon.waits import bounded, end_tasks, unless_set, wait_event
from tests.support import in_process_config

pytestmark = pytest.mark.timeout(30)


async def _settled() -> None:
    """Let every task that can run, run, until each waits."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_cancel_in_the_turn_the_event_is_set_ends_a_wait_for_it() -> None:
    event = asyncio.Event()
    woken = 0

    async def loop_until_cancelled() -> None:
        nonlocal woken
        while True:
            await wait_event(event, 10.0)
            event.clear()
            woken += 1

    task = asyncio.create_task(loop_until_cancelled())
    await _settled()
    event.set()
    task.cancel()  # the same turn: the event's waiter ends before the task runs
    done, _ = await asyncio.wait({task}, timeout=2.0)
    assert done == {task} and task.cancelled()
    assert woken == 0


async def test_wait_event_says_whether_the_event_came_in_time() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0) is True
    assert await wait_event(event, 0.0) is True  # set already: no wait


async def test_a_cancel_in_the_turn_the_awaited_call_ends_is_raised_and_a_late_call_times_out() -> (
    None
):
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(bounded(done, 10.0))
    await _settled()
    done.set_result(7)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    slow: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await bounded(slow, 0.01)
    assert slow.cancelled()  # what timed out is cancelled, as wait_for does
    assert await bounded(asyncio.sleep(0, result=3), 1.0) == 3


async def test_end_tasks_gives_up_on_a_task_that_will_not_end_and_logs_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fault injection: a task that catches its cancel and goes on stands for
    one whose cancel was lost."""
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    async def failing() -> None:
        raise RuntimeError("broken")

    async def quiet() -> None:
        await asyncio.sleep(10)

    tasks = [asyncio.create_task(stubborn()), asyncio.create_task(quiet())]
    tasks.append(asyncio.create_task(failing()))
    await _settled()
    with caplog.at_level(logging.WARNING, logger="hicached.daemon"):
        left = await end_tasks(tasks, 0.2, "test tasks")
    assert left == 1
    assert not tasks[0].done() and tasks[1].cancelled()
    assert "test tasks: 1 still running" in caplog.text
    assert "test tasks ended with an error" in caplog.text and "broken" in caplog.text
    release.set()
    tasks[0].cancel()
    await asyncio.wait({tasks[0]}, timeout=2.0)
    assert tasks[0].done()


async def test_unless_set_ends_what_it_waits_for_when_the_event_comes_first() -> None:
    """A start waits on its store; a stop's event cancels it (and a start
    that ended, or failed, is its own answer, set event or not)."""
    event = asyncio.Event()
    ended = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    waiting = asyncio.ensure_future(unless_set(slow(), event, "the start"))
    await _settled()
    assert not waiting.done()
    event.set()
    assert await asyncio.wait_for(waiting, 5) is False
    assert ended.is_set()
    assert await unless_set(asyncio.sleep(0), asyncio.Event(), "the start") is True

    async def fails() -> None:
        raise RuntimeError("no pool")

    with pytest.raises(RuntimeError, match="no pool"):
        await unless_set(fails(), asyncio.Event(), "the start")
    # set before: what it would wait for never runs
    ran = False

    async def never() -> None:
        nonlocal ran
        ran = True

    assert await unless_set(never(), event, "the start") is False
    assert not ran


async def test_a_stop_that_cancels_the_sweep_as_a_reload_wakes_it_ends() -> None:
    where = Path(tempfile.mkdtemp(prefix="hc-", dir="/tmp"))
    daemon = Server(in_process_config(where))
    try:
        await daemon.startup()
        daemon._serving()
        await _settled()  # the sweep waits for its interval or a reload
        daemon._resweep.set()  # a reload, in the turn the stop cancels the sweep
        stopping = asyncio.create_task(daemon.shutdown())
        done, _ = await asyncio.wait({stopping}, timeout=10.0)
        assert done == {stopping}, "the stop did not end"
        stopping.result()
    finally:
        shutil.rmtree(where, ignore_errors=True)
