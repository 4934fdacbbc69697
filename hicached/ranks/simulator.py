"""An engine simulator: ranks with fake GPU KV, driving a real daemon.

``simulate(endpoint, tp=, cp=, pp=)`` launches one model instance's ranks
(gloo on CPU). Each rank has a fake "GPU" KV buffer whose bytes are a
deterministic function of (token ids, layer, shard), and runs a multi-turn
workload: conversations that share a system prompt, each turn extending the
last. Per turn every rank prefetches through the PrefetchCoordinator (so all
ranks agree on one length), loads the agreed pages from L2 into its GPU
buffer and checks every byte, "computes" the rest, and stores the sequence.
Between conversations L2 is flushed (rank 0 fills the pool), so later turns
come back from L3. The result per rank lists the lengths it used, for
comparing ranks, and what it loaded from where.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import xxhash

from hicached.ranks.agreement import Topology

PAGE_TOKENS = 16
LAYERS = 2
LAYER_BYTES = 2048
PAGE_BYTES = LAYERS * LAYER_BYTES


@dataclass(frozen=True)
class Workload:
    conversations: int = 3
    turns: int = 3
    system_pages: int = 4
    user_pages: int = 2
    reply_pages: int = 1
    seed: int = 1


def expected_page(tokens: np.ndarray, page: int, shard: tuple[int, ...]) -> np.ndarray:
    """Page ``page`` of this shard's KV: every layer's bytes from the prefix through it."""
    prefix = tokens[: (page + 1) * PAGE_TOKENS].astype("<u4").tobytes()
    out = np.empty(PAGE_BYTES, dtype=np.uint8)
    for layer in range(LAYERS):
        seed = xxhash.xxh64_intdigest(prefix, seed=hash((layer, *shard)) & 0xFFFFFFFF)
        out[layer * LAYER_BYTES : (layer + 1) * LAYER_BYTES] = np.random.default_rng(seed).integers(
            0, 256, LAYER_BYTES, dtype=np.uint8
        )
    return out


def rank_workload(topo: Topology, endpoint: str, workload: Workload) -> dict[str, Any]:
    import torch.distributed as dist

    from hicached.client import Client
    from hicached.ranks.coordination import PrefetchCoordinator, StopPolicy

    shard = (topo.tp_rank, topo.cp_rank, topo.pp_rank)
    client = Client(endpoint, timeout=10).connect()
    ns = client.register(
        model="sim/model",
        kv_dtype="bfloat16",
        layout="layer_first",
        page_tokens=PAGE_TOKENS,
        page_bytes=PAGE_BYTES,
        tp_rank=topo.tp_rank,
        tp_size=topo.tp_size,
        cp_rank=topo.cp_rank,
        cp_size=topo.cp_size,
        pp_stage=topo.pp_rank,
        pp_size=topo.pp_size,
    )
    coordinator = PrefetchCoordinator(client, topo, ns, policy=StopPolicy("wait_complete"))
    rng = np.random.default_rng(workload.seed)  # the same on every rank: one request stream
    system = rng.integers(0, 50_000, workload.system_pages * PAGE_TOKENS).astype(np.uint32)
    gpu = np.zeros((0, PAGE_BYTES), dtype=np.uint8)
    lengths: list[int] = []
    counts = {"pages_l2": 0, "pages_l3": 0, "pages_computed": 0, "verified_bytes": 0}
    started = time.monotonic()
    requests = 0
    for conversation in range(workload.conversations):
        history = system.copy()
        for _turn in range(workload.turns):
            user = rng.integers(0, 50_000, workload.user_pages * PAGE_TOKENS).astype(np.uint32)
            tokens = np.concatenate([history, user])
            pages = len(tokens) // PAGE_TOKENS
            coordinator.start(tokens)
            decision = None
            while decision is None:
                decision = coordinator.step()
            length = decision.kv_pages
            hit = client.match(ns, tokens)
            gpu = client.read_pages(hit.select(range(length)))  # L2 -> "GPU"
            client.release(hit)
            for page in range(length):  # every loaded byte is checked
                if not np.array_equal(gpu[page], expected_page(tokens, page, shard)):
                    raise AssertionError(f"rank {topo.rank}: page {page} came back wrong")
            counts["verified_bytes"] += length * PAGE_BYTES
            counts["pages_l2"] += decision.l2_pages
            counts["pages_l3"] += length - decision.l2_pages
            counts["pages_computed"] += pages - length
            full = np.stack([expected_page(tokens, p, shard) for p in range(pages)])
            client.store(ns, tokens, full)  # pages already present are skipped
            lengths.append(length)
            requests += 1
            reply = rng.integers(0, 50_000, workload.reply_pages * PAGE_TOKENS).astype(np.uint32)
            history = np.concatenate([tokens, reply])
        _flush_l2(client, topo, conversation)
    coordinator.close()
    elapsed = time.monotonic() - started
    dist.barrier()
    client.close()
    return {
        "lengths": lengths,
        **counts,
        "requests": requests,
        "seconds": round(elapsed, 3),
        "workload": asdict(workload),
    }


def _flush_l2(client: Any, topo: Topology, conversation: int) -> None:
    """Rank 0 fills the pool with other pages, after every rank's writes to L3 settle."""
    import torch.distributed as dist

    _settle(client)
    dist.barrier()
    if topo.rank == 0:
        filler = client.register(
            model="sim/filler",
            kv_dtype="bfloat16",
            layout="layer_first",
            page_tokens=PAGE_TOKENS,
            page_bytes=PAGE_BYTES,
        )
        pages = client.stats().pool_bytes // PAGE_BYTES
        toks = (np.arange(pages * PAGE_TOKENS) + (conversation + 1) * 10**7).astype(np.uint32)
        client.store(filler, toks, np.zeros((pages, PAGE_BYTES), dtype=np.uint8))
        _settle(client)
    dist.barrier()


def _settle(client: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.l3.get("queued", 0) == 0 and stats.pinned_pages == 0:
            return
        time.sleep(0.02)
    raise TimeoutError("L3 writes did not settle")


def simulate(
    endpoint: str, *, tp: int = 1, cp: int = 1, pp: int = 1, workload: Workload | None = None
) -> list[dict[str, Any]]:
    """Run the workload on every rank of a tp x cp x pp instance; per-rank results."""
    from hicached.ranks import launch

    return launch(
        rank_workload,
        endpoint,
        workload or Workload(),
        tp=tp,
        cp=cp,
        pp=pp,
        timeout=30,
        deadline=300,
    )
