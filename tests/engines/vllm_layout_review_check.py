"""Adversarial checks of hicached's vLLM offload layouts (tests/engines/
vllm_layout_check.py's machinery: vLLM 0.32's own connector classes, the
scheduler here and one process per worker rank, a real daemon). Prints one
JSON object; tests/test_vllm_layouts_review.py checks it.

    vllm_layout_review_check.py ENDPOINT

- packed: one engine's attention backend keeps K and V split ((blocks, 2,
  tokens, heads, head): FlashAttention's), another's packs them per head
  ((blocks, heads, tokens, 2 x head) in NHD order: HPC_ATTN's). vLLM
  certifies both as canonical "v1-nhd" pages, but their canonical bytes are
  arranged differently: the packed engine must never load the split one's
  pages as its own.
- cross_tp: canonical pages a TP 2 engine stored, loaded at TP 4 (each rank
  its head), and a TP 4 engine's loaded at TP 2.
- replicated_slow / replicated_failed: MLA at TP 2 (replicated_layout), rank
  0 slow (the scheduler hears of the store before rank 0 copied) or failing
  (a fault injected into its copies): no hit before rank 0's copy is done,
  none at all after it failed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from tests.engines import answer_and_exit
from tests.engines import vllm_layout_check as base
from tests.engines.vllm_layout_check import BLOCK, LAYERS, Rank


@dataclasses.dataclass(frozen=True)
class Engine(base.Engine):
    packed: bool = False  # K and V packed per head, NHD order (HPC_ATTN's shape)
    fail: bool = False  # fault injection: every copy of this rank raises


def start(state: dict[str, Any], e: Engine, rank: int, seed: int) -> Any:
    """vllm_layout_check.start, with the packed K/V shape and fault injection."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    from hicached.errors import HicachedError

    base.stop(state)
    vllm_config, _, kv_config = base.configs(state["root"], state["endpoint"], e, rank)
    blocks = kv_config.num_blocks
    gen = torch.Generator().manual_seed(seed)
    kv = {}
    for name in LAYERS:
        spec = kv_config.kv_cache_groups[0].kv_cache_spec
        raw = torch.randint(-128, 128, (blocks, spec.page_size_bytes), generator=gen)
        raw = raw.to(torch.int8).view(spec.dtype)
        if e.model == "mla":
            kv[name] = raw.view(blocks, BLOCK, spec.head_size)
        elif e.packed:  # physical (blocks, tokens, heads, 2 x head), seen as (b, h, t, 2 x head)
            phys = raw.view(blocks, BLOCK, spec.num_kv_heads, 2 * spec.head_size)
            kv[name] = phys.permute(0, 2, 1, 3)
        else:
            kv[name] = raw.view(blocks, 2, BLOCK, spec.num_kv_heads, spec.head_size)
    connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_config)
    connector.register_kv_caches(kv)
    worker = connector.connector_worker
    submitted: list[int] = []
    real = worker.worker.submit_store

    def counted(job_id: int, src: Any, dst: Any) -> bool:
        submitted.append(job_id)
        return bool(real(job_id, src, dst))

    worker.worker.submit_store = counted
    if e.fail:  # fault injection: this rank's copies fail as a lost daemon's would

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise HicachedError("injected copy failure")

        worker.worker._copies.plan = broken
    state.update(connector=connector, kv=kv, submitted=submitted)
    refs = connector.connector_worker.worker._copies
    return {"blocks": blocks, "copies": type(refs).__name__}


def raw_blocks(state: dict[str, Any], ids: list[int]) -> list[bytes]:
    """Each layer's physical bytes of blocks ``ids`` (memory order)."""
    import torch

    out = []
    for t in state["kv"].values():
        phys = t.permute(0, 2, 1, 3) if t.dim() == 4 and not t.is_contiguous() else t
        out.append(phys[ids].contiguous().view(torch.uint8).numpy().tobytes())
    return out


base.STEPS["start"] = start
base.STEPS["raw"] = raw_blocks


def _split(layer: bytes, n: int, heads: int) -> np.ndarray:
    """(n, 2, tokens, heads, head bytes) of split K/V bytes."""
    return np.frombuffer(layer, np.uint8).reshape(n, 2, BLOCK, heads, -1)


def packed(root: Path, endpoint: str, ranks: list[Rank], client: Any) -> dict[str, Any]:
    from hicached.wire.namespace import namespace_digest

    facts: dict[str, Any] = {}
    split2 = Engine("gqa", tp=2, canonical=True)
    packed1 = Engine("gqa", tp=1, canonical=True, packed=True)
    base.start_all(ranks[:2], split2, [51, 52])
    connector, _ = base.scheduler(root, endpoint, split2)
    manager = connector.connector_scheduler.manager
    ks, ids = base.keys(4, b"packed"), [5, 9, 2, 30]
    try:
        spec = manager.groups[0].spec
        base.stored(manager, ranks[:2], ks, ids, 1)  # the split engine's pages are there
    finally:
        manager.shutdown()
    connector1, _ = base.scheduler(root, endpoint, packed1)
    manager1 = connector1.connector_scheduler.manager
    try:
        spec1 = manager1.groups[0].spec
        facts["same_namespace"] = namespace_digest(spec1) == namespace_digest(spec)
        try:
            facts["packed_worker"] = ranks[0].ask("start", packed1, 0, 53)["copies"]
        except RuntimeError as exc:  # the packed worker refuses canonical_layout at its start
            facts["packed_worker"] = f"refused: {exc}"
            return facts
    finally:
        manager1.shutdown()
    return facts


def cross_tp(root: Path, endpoint: str, ranks: list[Rank], client: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for name, (tp_in, tp_out) in {"2to4": (2, 4), "4to2": (4, 2)}.items():
        e_in = Engine("gqa", tp=tp_in, canonical=True)
        e_out = Engine("gqa", tp=tp_out, canonical=True)
        base.start_all(ranks[:tp_in], e_in, [60 + r for r in range(tp_in)])
        connector, _ = base.scheduler(root, endpoint, e_in)
        manager = connector.connector_scheduler.manager
        ks, ids = base.keys(3, name.encode()), [4, 11, 7]
        try:
            base.stored(manager, ranks[:tp_in], ks, ids, 1)
            parts = [r.ask("blocks", ids) for r in ranks[:tp_in]]
        finally:
            manager.shutdown()
        per = 4 // tp_in
        full = [
            np.concatenate([_split(p[layer], 3, per) for p in parts], axis=3)
            for layer in range(len(LAYERS))
        ]
        base.start_all(ranks[:tp_out], e_out, [70 + r for r in range(tp_out)])
        connector, _ = base.scheduler(root, endpoint, e_out)
        manager = connector.connector_scheduler.manager
        try:
            got = base.loaded(manager, ranks[:tp_out], ks, [2, 3, 9], 2)
        finally:
            manager.shutdown()
        share = 4 // tp_out
        facts[name] = {
            "lookups": got["lookups"],
            "each_rank_loaded_its_heads": [
                r["blocks"]
                == [
                    np.ascontiguousarray(f[:, :, :, i * share : (i + 1) * share]).tobytes()
                    for f in full
                ]
                for i, r in enumerate(got.get("ranks", []))
            ],
        }
    return facts


def _lookups_for(manager: Any, ks: list[bytes], seconds: float) -> list[list[str]]:
    """Every lookup answer seen over ``seconds`` (a scheduler's steps)."""
    seen = []
    deadline = time.monotonic() + seconds
    ctx = base.context(f"look-{time.monotonic_ns()}", ks)
    while time.monotonic() < deadline:
        seen.append([manager.lookup(k, ctx).name for k in ks])
        manager.on_schedule_end(None)
        time.sleep(0.05)
    manager.on_request_finished(ctx)
    return seen


def replicated(root: Path, endpoint: str, ranks: list[Rank], client: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    e = Engine("mla", tp=2)
    # rank 0 slow: rank 1 says it is done, the scheduler hears of the store, rank 0 later
    base.start_all(ranks[:2], e, [81, 82])
    connector, _ = base.scheduler(root, endpoint, e)
    manager = connector.connector_scheduler.manager
    try:
        ks, ids = base.keys(3, b"slow"), [1, 2, 3]
        ctx = base.context("slow", ks)
        out = manager.prepare_store(ks, ctx)
        ranks[1].ask("store", 1, ids, out.store_spec)
        manager.complete_store(ks, ctx)
        before = _lookups_for(manager, ks, 1.0)
        facts["slow_hit_before_rank0"] = any("HIT" in s for s in before)
        ranks[0].ask("store", 1, ids, out.store_spec)
        concurrent.futures.wait(list(manager._publishing), timeout=20)
        facts["slow_pages_in_pool"] = base.hits(client, manager.groups[0].spec, ks)
        after = _lookups_for(manager, ks, 2.0)
        facts["slow_hit_after_rank0"] = after[-1]
    finally:
        manager.shutdown()
    # rank 0 fails its copy: nothing of the store is ever a hit
    base.start_all(ranks[:2], Engine("mla", tp=2), [83, 84])
    ranks[0].ask("start", Engine("mla", tp=2, fail=True), 0, 83)
    connector, _ = base.scheduler(root, endpoint, e)
    manager = connector.connector_scheduler.manager
    try:
        ks, ids = base.keys(3, b"failed"), [1, 2, 3]
        before = client.stats().committed_pages
        base.stored(manager, ranks[:2], ks, ids, 1)
        seen = _lookups_for(manager, ks, 1.0)
        facts["failed_any_hit"] = any("HIT" in s for s in seen)
        facts["failed_pages_committed"] = client.stats().committed_pages - before
    finally:
        manager.shutdown()
    return facts


def main(endpoint: str) -> dict[str, Any]:
    from hicached import Client

    root = Path(tempfile.mkdtemp(prefix="hc-layouts-review-"))
    base.preload()
    ranks = [Rank(root, endpoint) for _ in range(4)]
    facts: dict[str, Any] = {}
    try:
        with Client(endpoint, timeout=5.0) as client:
            for name, check in (
                ("packed", packed),
                ("cross_tp", cross_tp),
                ("replicated", replicated),
            ):
                try:
                    facts[name] = check(root, endpoint, ranks, client)
                except Exception:  # the test reads the error
                    facts[name] = {"error": traceback.format_exc()[-3000:]}
    finally:
        for rank in ranks:
            rank.close()
    return facts


if __name__ == "__main__":
    answer_and_exit(main(sys.argv[1]), default=repr)
