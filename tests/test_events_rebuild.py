"""A late subscriber rebuilds, from KV events and replay alone, the exact set of
(page, medium) the daemon holds, checked against the daemon's own index after
a random workload with restarts (write_through and write_back runs, a small
pool that evicts, a small file store that recycles, prefetches from L3).

The daemon runs in this process, on this test's loop, so that its index can be
read when the subscriber has caught up; the subscriber decodes nothing itself:
vLLM's own classes decode what it received (tests/test_vllm_events.py).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from hicached import AsyncClient
from hicached.cache import Cache
from hicached.config import Config, parse_config
from hicached.events import END_SEQ, block_hash
from hicached.server import Server
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS
from tests.test_vllm_events import VllmDecoder, vllm_decode, vllm_python  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(1200)

RUNS = ("write_through", "write_back", "write_back", "write_through")
OPS_PER_RUN = 1000


def config_for(where: Path, policy: str) -> Config:
    return parse_config(
        f'[server]\nendpoint = "ipc://{where}/run/hicached.sock"\nruntime_dir = "{where}/run"\n'
        "[pool]\nsize_mib = 1\nslab_mib = 1\nmax_page_bytes = 65536\npopulate = false\n"
        "[metrics]\nenabled = false\n"
        f'[storage]\nbackend = "file"\nwrite_policy = "{policy}"\ndata_dir = "{where}/data"\n'
        "[storage.file]\ncapacity_mib = 4\nsegment_mib = 1\nio_threads = 2\n"
        f'[events]\nendpoint = "ipc://{where}/ev/events.sock"\n'
        f'replay_endpoint = "ipc://{where}/ev/replay.sock"\nbatch_events = 8\n'
    )


def daemon_view(cache: Cache) -> set[tuple[int, str]]:
    """(block hash, medium) of every page in L2's index and in the L3 set."""
    out = set()
    indexes = {id(ns.index): ns.index for ns in cache.namespaces.values()}
    for index in indexes.values():
        for node in index.nodes():
            out.update((int(block_hash(k)), "CPU") for k in node.keys)
    known = cache.l3._young | cache.l3._old
    out.update((int(block_hash(k)), cache.l3_medium) for k in known)
    return out


def rebuild(batches: list[dict[str, Any]]) -> set[tuple[int, str]]:
    """What a router knows of this host from vLLM-decoded batches, in seq order."""
    view: set[tuple[int, str]] = set()
    for batch in batches:
        for e in batch["events"]:
            if e["type"] == "AllBlocksCleared":
                view.clear()
            elif e["type"] == "BlockStored":
                view.update((h, e["medium"]) for h in e["block_hashes"])
            else:
                view.difference_update((h, e["medium"]) for h in e["block_hashes"])
    return view


class LateSubscriber:
    """Joins when the daemon has been running a while: subscribes, then asks a
    replay from 0, and keeps every frame of both (each seq once)."""

    def __init__(self, ctx: zmq.asyncio.Context, where: Path) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # a test reader: keep everything
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(f"ipc://{where}/ev/events.sock")
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(f"ipc://{where}/ev/replay.sock")
        self.frames: dict[int, tuple[bytes, bytes, bytes]] = {}
        self.replayed = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        await asyncio.sleep(0.3)  # the subscription reaches the daemon first
        await self.replay.send_multipart([b"", (0).to_bytes(8, "big")])
        poller = zmq.asyncio.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.replay, zmq.POLLIN)
        while True:
            for sock, _ in await poller.poll():
                frames = await sock.recv_multipart()
                if sock is self.replay:
                    frames = frames[1:]
                    if frames[1] == END_SEQ:
                        self.replayed.set()
                        continue
                topic, seq, payload = frames
                self.frames.setdefault(int.from_bytes(seq, "big"), (topic, seq, payload))

    def caught_up(self, last: int) -> bool:
        return self.replayed.is_set() and len(self.frames) == last + 1

    async def close(self) -> list[tuple[bytes, bytes, bytes]]:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sub.close()
        self.replay.close()
        assert sorted(self.frames) == list(range(len(self.frames))), "a gap in seq"
        return [self.frames[s] for s in sorted(self.frames)]


@pytest.fixture
async def where() -> AsyncIterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hc-rb-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def workload(
    c: AsyncClient, rng: random.Random, ops: int, prefixes: list[np.ndarray]
) -> None:
    """Random stores (sharing prefixes), matches and prefetches from L3."""
    ns = await c.register(**NS)
    zeros = np.zeros((16, PAGE_BYTES), np.uint8)
    for _ in range(ops):
        base = rng.choice(prefixes)
        extra = rng.randrange(0, 6)
        tail = np.array(
            [rng.randrange(1, 1 << 20) for _ in range(extra * PAGE_TOKENS)], dtype=np.uint32
        )
        toks = np.concatenate([base[: rng.randrange(1, 6) * PAGE_TOKENS], tail])
        roll = rng.random()
        if roll < 0.6:
            await c.store(ns, toks, zeros[: len(toks) // PAGE_TOKENS])
            if rng.random() < 0.3:
                prefixes.append(toks)
        elif roll < 0.8:
            hit = await c.match(ns, toks, lease=False)
            del hit
        else:
            pf = await c.prefetch(ns, rng.choice(prefixes))
            if pf.lease:
                deadline = time.monotonic() + 10
                while not (await c.progress(pf)).done:
                    assert time.monotonic() < deadline, "prefetch stalled"
                    await asyncio.sleep(0.005)
                await c.commit(pf)
        if rng.random() < 0.05:
            await asyncio.sleep(0.02)  # let writes and events move


async def quiet(server: Server) -> int:
    """Wait until no L3 write is queued or in flight and every event is published;
    the last seq published."""
    cache, tier, publisher = server.cache, server.tier, server.publisher
    assert cache is not None and tier is not None and publisher is not None
    deadline = time.monotonic() + 30
    while True:
        d = tier.dispatcher
        idle = not cache.writing and d.queued == 0 and d.writing == 0 and not tier.scanning
        if idle and not cache.events.pending:
            await asyncio.sleep(0.05)  # the flush that sent the last of them
            if not cache.events.pending and not cache.writing:
                return publisher.replay.seq
        assert time.monotonic() < deadline, "the daemon did not settle"
        await asyncio.sleep(0.02)


async def test_a_late_subscriber_rebuilds_the_daemons_pages_across_restarts(
    where: Path,
    vllm_python: VllmDecoder,  # noqa: F811 (the fixture)
) -> None:
    rng = random.Random(20261122)
    ctx = zmq.asyncio.Context()
    prefixes = [
        np.array([rng.randrange(1, 1 << 20) for _ in range(8 * PAGE_TOKENS)], dtype=np.uint32)
        for _ in range(12)
    ]
    runs: list[tuple[list[tuple[bytes, bytes, bytes]], set[tuple[int, str]]]] = []
    try:
        for policy in RUNS:
            server = Server(config_for(where, policy))
            task = asyncio.create_task(server.run())
            await asyncio.wait_for(server.ready.wait(), 30)
            try:
                async with AsyncClient(server.endpoint, timeout=10) as c:
                    await workload(c, rng, OPS_PER_RUN // 2, prefixes)
                    late = LateSubscriber(ctx, where)
                    await workload(c, rng, OPS_PER_RUN // 2, prefixes)
                last = await quiet(server)
                deadline = time.monotonic() + 30
                while not late.caught_up(last):
                    assert time.monotonic() < deadline, f"{len(late.frames)} of {last + 1}"
                    await asyncio.sleep(0.02)
                assert server.cache is not None
                view = daemon_view(server.cache)
                assert any(m == "CPU" for _, m in view) and any(m == "FILE" for _, m in view)
                runs.append((await late.close(), view))
            finally:
                server.stop()
                await asyncio.wait_for(task, 60)
    finally:
        ctx.term()
    # vLLM's classes decode all of it, in one go
    frames = [f for run, _ in runs for f in run]
    batches = vllm_decode(vllm_python, frames)
    at = 0
    for run, view in runs:
        mine = batches[at : at + len(run)]
        at += len(run)
        assert mine[0]["events"][0] == {"type": "AllBlocksCleared"}
        assert rebuild(mine) == view
