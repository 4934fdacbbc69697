"""The client under races: calls of other tasks and threads, daemon restarts,
close() and fork() meeting a call or a copy half-way. Every case ends with
the key's own bytes or an error of hicached.errors, by its deadline; all run
against real daemons."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import hicached
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for


def test_an_async_hello_while_another_task_says_hello_keeps_the_new_ids(daemon: Daemon) -> None:
    """After a restart, a task whose exchange meets the lost session says hello
    again; a second task that says hello meanwhile reset every namespace id to
    0 once the first had registered them, so the first task's request went
    out as namespace 0 (UnknownNamespace). A hello to the instance the ids
    are already of keeps them."""

    async def run() -> None:
        async with hicached.AsyncClient(daemon.endpoint, timeout=3.0) as c:
            a = await c.register(**{**NS, "model": "test/a"})
            await c.register(**{**NS, "model": "test/b"})
            daemon.kill()
            daemon.start()
            toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
            loop = asyncio.get_running_loop()
            first = loop.create_task(c.store(a, toks, page_bytes_for(toks)))
            # the first task has the new daemon's HelloOk and registers its namespaces
            for _ in range(100_000):
                if c._hello is None and a.id == 0:
                    break
                await asyncio.sleep(0)
            else:
                pytest.fail("the first task never said hello to the new daemon")
            second = loop.create_task(c.stats())  # says hello of its own meanwhile
            assert (await first).published == 2
            await second
            hit = await c.match(a, toks)
            assert np.array_equal(c.read_pages(hit), page_bytes_for(toks))
            await c.release(hit)

    asyncio.run(run())
