"""Adversarial checks of hicached's vLLM scheduler side (HicachedManager),
driven in the vLLM 0.32 venv against a real daemon, with vLLM's own lookup
loop (``OffloadingConnectorScheduler._maximal_prefix_lookup``) deciding the
hit from the manager's answers, as vLLM's scheduler does. Prints one JSON
object of what it saw; tests/test_vllm_manager_review.py checks it.

    vllm_manager_review_check.py ENDPOINT [DAEMON_PID [LIMITED_ENDPOINT]]

LIMITED_ENDPOINT: a second daemon whose ``server.max_pages_per_request`` is
LIMIT (the ``limit`` and ``commit_timeout`` scenarios').

One scenario (``budget``) runs vLLM's scheduler side whole rather than its
lookup loops alone: vLLM's ``OffloadingConnector`` in the SCHEDULER role for
a model of a full-attention group and a sliding-window group (its configs
built with vLLM's functions, as tests/engines/vllm_layout_check.py builds
them), its ``get_num_new_matched_tokens`` given a token budget, vLLM's
KVCacheManager allocating the hit's blocks, and the load it plans run by
vLLM's connector in the WORKER role in this process, on KV in host memory.

Fault injection, where a scenario says so: the manager's clock jumps past
its answer's ``until`` in the middle of a lookup pass (as time passing
does), the link is marked down (as the loop thread marks it when another
request finds the daemon unreachable), and a commit's answer never comes
(the manager's client raises TimeoutError for it).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext

import hicached.integrations.vllm.manager as manager_module
from hicached import Client
from hicached.integrations.hybrid import Window
from hicached.integrations.vllm import KVGroup, Settings, engine_groups
from hicached.integrations.vllm.manager import HicachedManager
from hicached.integrations.vllm.specs import HicachedLoadSpec
from tests.engines import answer_and_exit
from tests.engines.vllm_layout_check import LAYERS, engine_config, model_dir, until
from tests.engines.vllm_worker_check import config


def context(req_id: str, keys: list[bytes], tokens: int) -> ReqContext:
    ctx = ReqContext(req_id)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * tokens)
    return ctx


class _Clock:
    """The manager's clock (fault injection): the real one, plus ``skew``."""

    def __init__(self) -> None:
        self.skew = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skew

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def prefix_lookup(manager: HicachedManager, keys: list[bytes], ctx: ReqContext) -> int | None:
    """vLLM's own full-attention lookup over ``keys`` (None: deferred)."""
    scheduler = SimpleNamespace(
        manager=manager, _events_tracker=SimpleNamespace(record_lookup=lambda *a: None)
    )
    group = SimpleNamespace()
    return OffloadingConnectorScheduler._maximal_prefix_lookup(
        scheduler,  # type: ignore[arg-type]
        keys,
        ctx,
        SimpleNamespace(),  # type: ignore[arg-type]
        group,  # type: ignore[arg-type]
        0,
    )


def stale_mid_pass(endpoint: str) -> dict[str, Any]:
    """The answer's ``until`` passes between two lookups of one pass while the
    link is down: vLLM counts the HITs it already got and loads them."""
    facts: dict[str, Any] = {}
    cfg = config()
    settings = Settings(endpoint=endpoint, timeout_s=5.0, lookup_wait_s=1.0)
    groups = engine_groups(cfg, settings)
    spec = groups[0].spec
    keys = [hashlib.sha256(b"stale %d" % i).digest() + bytes(4) for i in range(4)]
    with Client(endpoint, timeout=5.0) as client:
        ns = client.register(spec)
        res = client.reserve_keys(ns, keys)
        client.write_pages(res, np.ones((len(keys), spec.page_bytes), np.uint8))
        client.commit(res)
    clock = _Clock()
    real_time = manager_module.time
    manager_module.time = clock  # type: ignore[assignment]
    manager = HicachedManager(settings, groups, cfg.parallel.world_size)
    try:
        ctx = context("stale", keys, spec.page_tokens)
        with manager.lock:
            facts["first"] = prefix_lookup(manager, keys, ctx)
            manager.on_schedule_end(None)
        lookup = manager.lookup
        seen: list[str] = []

        def timed(key: bytes, req_context: ReqContext) -> LookupResult:
            if len(seen) == 2:  # fault injection: time passes, the daemon seems down
                clock.skew = 3600.0
                manager._link.failed()
            result = lookup(key, req_context)
            seen.append(result.name)
            return result

        manager.lookup = timed  # type: ignore[method-assign]
        with manager.lock:
            hit = prefix_lookup(manager, keys, ctx)
            facts["second"] = hit
            facts["seen"] = seen
            if hit:
                try:
                    load = manager.prepare_load(keys[:hit], ctx)
                    assert isinstance(load, HicachedLoadSpec)
                    (mine,) = load.handles
                    facts["load"] = sum(len(h.offsets) for h in mine)
                except AssertionError as exc:
                    facts["load"] = f"AssertionError: {exc}"
                else:
                    manager.complete_load(keys[:hit], ctx)
            manager.on_schedule_end(None)
    finally:
        manager_module.time = real_time  # type: ignore[assignment]
        manager.shutdown()
    return facts


def window_lookup(manager: HicachedManager, keys: list[bytes], ctx: ReqContext) -> int | None:
    """vLLM's own sliding-window lookup over ``keys`` (a window of two chunks)."""
    scheduler = SimpleNamespace(manager=manager)
    return OffloadingConnectorScheduler._sliding_window_lookup(
        scheduler,  # type: ignore[arg-type]
        keys,
        2,
        ctx,
        2,
    )


def hybrid(endpoint: str) -> dict[str, Any]:
    """A full-attention group and a sliding window of two chunks (groups 0 and
    1, each a namespace of its own): full attention holds chunks 1-6 of each
    prompt; the window holds chunks 5 and 6 of prompt A (as vLLM stores a
    window), only chunk 5 of prompt B (chunk 6's page never stored). vLLM's
    own lookups decide each hit, and a hit's load is prepared."""
    facts: dict[str, Any] = {}
    cfg = config()
    settings = Settings(endpoint=endpoint, timeout_s=5.0, lookup_wait_s=1.0)
    (full,) = engine_groups(cfg, settings)
    window_spec = msgspec.structs.replace(full.spec, layout=full.spec.layout + "_g1_sliding")
    window = KVGroup(
        1, 1, Window(2 * full.spec.page_tokens, "sliding"), full.block_bytes, window_spec
    )
    groups = [full, window]
    tokens = full.spec.page_tokens
    chunks = {
        p: [hashlib.sha256(b"%s %d" % (p.encode(), i)).digest() for i in range(6)]
        for p in ("A", "B")
    }
    with Client(endpoint, timeout=5.0) as client:
        for group, spec, stored in ((0, full.spec, range(6)), (1, window_spec, None)):
            ns = client.register(spec)
            for p, hashes in chunks.items():
                mine = stored or ([4, 5] if p == "A" else [4])
                keys = [hashes[i] + group.to_bytes(4, "big") for i in mine]
                res = client.reserve_keys(ns, keys)
                client.write_pages(res, np.ones((len(keys), spec.page_bytes), np.uint8))
                client.commit(res)
    manager = HicachedManager(settings, groups, cfg.parallel.world_size)
    try:
        for p, hashes in chunks.items():
            full_keys = [h + bytes(4) for h in hashes]
            window_keys = [h + (1).to_bytes(4, "big") for h in hashes]
            ctx = context(p, full_keys, tokens)
            for i, key in enumerate(window_keys):
                ctx.set_offload_key_position(key, (i + 1) * tokens)
            got: dict[str, Any] = {}
            for step in ("first", "second"):
                with manager.lock:
                    f = prefix_lookup(manager, full_keys, ctx)
                    w = window_lookup(manager, window_keys[: f or 6], ctx)
                    got[step] = [f, w]
                    if step == "second" and f and w:
                        n = min(f, w)
                        load = manager.prepare_load(full_keys[:n] + window_keys[n - 2 : n], ctx)
                        assert isinstance(load, HicachedLoadSpec)
                        got["load"] = [sum(len(h.offsets) for h in mine) for mine in load.handles]
                        manager.complete_load(full_keys[:n] + window_keys[n - 2 : n], ctx)
                    manager.on_schedule_end(None)
            facts[p] = got
    finally:
        manager.shutdown()
    return facts


# -- a token budget that ends a hybrid hit inside a chunk -------------------------------

BLOCK, WINDOW = 16, 32  # tokens a block (and a chunk), and the sliding window's
CHUNKS = 12  # whole chunks of each prompt
# the token budget: vLLM's hit is one token less (with a window group the last token
# is computed again), 129, inside chunk 9
BUDGET = 8 * BLOCK + 2


class Engine:
    """vLLM's connector in both roles for a model of two KV cache groups: full
    attention (layer 0) and a sliding window of WINDOW tokens (layer 1). The
    scheduler's side as vLLM's Scheduler drives it (a KVCacheManager of its
    own allocates each hit's blocks); the worker's in this process, its KV in
    host memory, random bytes."""

    def __init__(self, endpoint: str, extra_retained: int = 0, eagle: bool = False) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_configs,
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        self.root = tempfile.TemporaryDirectory(prefix="hc-budget-")  # the model's config
        vllm_config = engine_config(model_dir(Path(self.root.name), "gqa"), endpoint)
        shape = {"block_size": BLOCK, "num_kv_heads": 4, "head_size": 32, "dtype": torch.bfloat16}
        specs = {
            LAYERS[0]: FullAttentionSpec(**shape),
            LAYERS[1]: SlidingWindowSpec(**shape, sliding_window=WINDOW),
        }
        # vLLM's engine gives every sliding window ``num_prefill_lookahead_tokens - 1``
        # extra retained tokens (get_kv_cache_configs; multi-module MTP of as many
        # speculative tokens as that lookahead): it is set here as the engine's
        # property says it, a speculative config needing a drafter model of its own
        config_type = type(vllm_config)
        lookahead = config_type.__dict__["num_prefill_lookahead_tokens"]
        if extra_retained:
            config_type.num_prefill_lookahead_tokens = property(  # type: ignore[method-assign,assignment]
                lambda _: extra_retained + 1
            )
        try:
            (worker_kv,) = get_kv_cache_configs(vllm_config, [specs], [4 << 20])
        finally:
            config_type.num_prefill_lookahead_tokens = lookahead  # type: ignore[method-assign]
        kv_config = generate_scheduler_kv_cache_config([worker_kv])
        for kv in (kv_config, worker_kv):
            kv.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
            # the window's layers as an EAGLE/MTP drafter's, as vLLM's engine marks
            # a drafter's group (a speculative config would need a drafter model)
            kv.kv_cache_groups[1].is_eagle_group = eagle
        self.kv_config = kv_config
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_config)
        self.scheduler = self.connector.connector_scheduler
        self.manager: HicachedManager = self.scheduler.manager  # type: ignore[assignment]
        self.kv_manager = KVCacheManager(
            kv_config, 1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK
        )
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.worker = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, worker_kv)
        blocks = worker_kv.num_blocks
        gen = torch.Generator().manual_seed(7)
        self.kv = {  # split K and V, NHD, as a CPU attention backend shapes them
            name: torch.randint(-128, 128, (blocks, spec.page_size_bytes), generator=gen)
            .to(torch.int8)
            .view(torch.bfloat16)
            .view(blocks, 2, BLOCK, 4, 32)
            for name, spec in specs.items()
        }
        self.worker.register_kv_caches(self.kv)
        self.jobs = 1000  # the store jobs' ids (vLLM's own loads count from 0)

    def request(self, req_id: str, tokens: list[int]) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        return Request(req_id, tokens, SamplingParams(max_tokens=1), None, block_hasher=self.hasher)

    def keys(self, request: Any, group: int) -> list[bytes]:
        from vllm.v1.kv_offload.base import make_offload_key

        return [make_offload_key(h, group) for h in request.block_hashes]

    def block(self, group: int, block_id: int) -> bytes:
        """Group ``group``'s layer's bytes of one block."""
        import torch

        return bytes(self.kv[LAYERS[group]][block_id].contiguous().view(torch.uint8).numpy())

    def store(
        self, request: Any, chunks: list[list[int]], whole: bool = True
    ) -> dict[int, dict[int, int]]:
        """Store ``chunks[g]`` of each group g as vLLM stores them: the manager's
        slots, the worker's copy from blocks of the group's own (300 + chunk for
        full attention, 400 + chunk for the window), the manager publishing
        it. The block each stored chunk came from, per group. ``whole``: every
        key must get a slot (else the keys that did are stored, as vLLM stores
        those prepare_store names)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
            TransferJob,
        )
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        ctx = ReqContext(f"store-{request.request_id}")
        keys, ids, sources = [], [], {}
        for g, mine in enumerate(chunks):
            every = self.keys(request, g)
            sources[g] = {i: 300 + 100 * g + i for i in mine}
            for i in mine:
                ctx.set_offload_key_position(every[i], (i + 1) * BLOCK)
                keys.append(every[i])
                ids.append(sources[g][i])
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and (list(out.keys_to_store) == keys or not whole), (
            "not every key got a slot"
        )
        stored = set(out.keys_to_store)
        if not stored:
            return {g: {} for g in sources}
        ids = [i for key, i in zip(keys, ids, strict=True) if key in stored]
        every_group = [self.keys(request, g) for g in range(len(chunks))]
        sources = {
            g: {i: b for i, b in mine.items() if every_group[g][i] in stored}
            for g, mine in sources.items()
        }
        keys = [key for key in keys if key in stored]
        self.jobs += 1
        sizes = [len(sources[g]) for g in range(len(chunks))]
        src = GPULoadStoreSpec(ids, sizes, [0] * len(chunks))
        worker = self.worker.connector_worker
        assert worker is not None
        job = {self.jobs: TransferJob(ctx.req_id, src, out.store_spec)}
        worker.prepare_store_kv(OffloadingConnectorMetadata({}, job))
        worker.start_kv_transfers(OffloadingConnectorMetadata({}, {}))

        def completed() -> bool:
            worker.get_finished(set())
            meta = worker.build_connector_worker_meta()
            return meta is not None and self.jobs in meta.completed_jobs

        assert until(completed), "the store was never completed"
        self.manager.complete_store(keys, ctx)
        published = list(self.manager._publishing)
        concurrent.futures.wait(published, timeout=20)
        return sources

    def hit(self, request: Any, budget: int | None) -> dict[str, Any]:
        """vLLM's lookups for a new request, step after step, until they decide:
        the hit, and each window key's answer in the pass that decided it."""
        self.scheduler.on_new_request(request)
        lookup = self.manager.lookup
        seen: list[str] = []

        def recorded(key: bytes, req_context: ReqContext) -> LookupResult:
            result = lookup(key, req_context)
            if key[-4:] == (1).to_bytes(4, "big"):
                seen.append(result.name)
            return result

        self.manager.lookup = recorded  # type: ignore[method-assign]
        try:
            # steps until the daemon's answers came (an engine steps every few ms)
            deadline = time.monotonic() + 60
            while True:
                seen.clear()
                hit, _ = self.scheduler.get_num_new_matched_tokens(request, 0, budget)
                if hit is not None or time.monotonic() > deadline:
                    break
                self.manager.on_schedule_end(None)
                time.sleep(0.005)
        finally:
            del self.manager.lookup
        return {"hit": hit, "window_lookups": seen}

    def load(self, request: Any, hit: int, sources: dict[int, dict[int, int]]) -> dict[str, Any]:
        """The hit's blocks, as vLLM's scheduler allocates them, and the load vLLM
        plans into them, run by the worker: which chunks of each group it
        loaded and whether each block now holds the bytes stored from it."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
        )

        computed, _, _ = self.kv_manager.get_computed_blocks(request)
        allocated = self.kv_manager.allocate_slots(
            request,
            0,  # the load is asynchronous: nothing is computed this step
            new_computed_blocks=computed,
            num_external_computed_tokens=hit,
            delay_cache_blocks=True,
        )
        assert allocated is not None, "no room for the hit's blocks"
        try:
            self.scheduler.update_state_after_alloc(
                request, self.kv_manager.get_blocks(request.request_id), hit
            )
        except AssertionError as exc:  # the manager's prepare_load: keys that were no hits
            return {"error": f"AssertionError: {exc}"}
        jobs = dict(self.scheduler._current_batch_load_jobs)
        self.scheduler._current_batch_load_jobs.clear()
        (transfer,) = jobs.values()
        dst = transfer.dst_spec
        loaded: dict[int, list[int]] = {}
        targets: dict[int, list[int]] = {}
        first = 0
        for g, (count, start) in enumerate(zip(dst.group_sizes, dst.block_indices, strict=True)):
            targets[g] = [int(b) for b in dst.block_ids[first : first + count]]
            loaded[g] = list(range(int(start), int(start) + count))  # one block a chunk
            first += count
            for b in targets[g]:
                self.kv[LAYERS[g]][b] = 0
        worker = self.worker.connector_worker
        assert worker is not None
        worker.start_kv_transfers(OffloadingConnectorMetadata(jobs, {}))
        finished = until(lambda: transfer.req_id in worker.get_finished(set())[1])
        same = all(
            i in sources[g] and self.block(g, b) == self.block(g, sources[g][i])
            for g in loaded
            for i, b in zip(loaded[g], targets[g], strict=True)
        )
        return {"loaded": [loaded[g] for g in sorted(loaded)], "finished": finished, "same": same}

    def hit_and_load(
        self, req_id: str, prompt: list[int], budget: int | None, sources: dict[int, dict[int, int]]
    ) -> dict[str, Any]:
        """A new request for ``prompt`` from lookup to end: its hit, and where
        there is one, its load checked against the blocks ``sources`` names."""
        request = self.request(req_id, prompt)
        got = self.hit(request, budget)
        if got["hit"]:
            got.update(self.load(request, got["hit"], sources))
        self.finish(request)
        return got

    def kinds(self) -> list[list[Any]]:
        """What the manager made of vLLM's groups (groups.kind_of): (label, lead tokens)."""
        return [[g.kind.label, getattr(g.kind, "lead", 0)] for g in self.manager.groups]

    def finish(self, request: Any) -> None:
        """The request ends: its load done, its lookups' leases end, its blocks free."""
        state = self.scheduler._req_status.pop(request.request_id)
        self.manager.complete_load([], state.req_context)
        self.manager.on_request_finished(state.req_context)
        self.kv_manager.free(request)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
        self.root.cleanup()


def budget(endpoint: str) -> dict[str, Any]:
    """Prompt A: every chunk of both groups stored; prompt B: the same, but the
    window's chunk 7 (index 6). A budget of BUDGET tokens ends vLLM's hit
    inside chunk 9 (index 8), so vLLM asks the window group for three chunks
    (load_window_size_in_chunks), the two of the window and the one before."""
    facts: dict[str, Any] = {}
    engine = Engine(endpoint)
    try:
        facts["kinds"] = engine.kinds()
        (_, window) = engine.scheduler.config.kv_group_configs
        facts["window_chunks"] = window.sliding_window_size_in_chunks
        facts["load_window_chunks"] = window.load_window_size_in_chunks(BUDGET - 1)
        rng = np.random.default_rng(3)
        prompts = {p: rng.integers(3, 500, CHUNKS * BLOCK + 5).tolist() for p in "AB"}
        every = list(range(CHUNKS))
        sources = {
            "A": engine.store(engine.request("A", prompts["A"]), [every, every]),
            "B": engine.store(engine.request("B", prompts["B"]), [every, every[:6] + every[7:]]),
        }
        for name, p, cap in (("A", "A", BUDGET), ("B", "B", BUDGET), ("B_whole", "B", None)):
            facts[name] = engine.hit_and_load(name, prompts[p], cap, sources[p])
    finally:
        engine.shutdown()
    return facts


# -- multi-module MTP: a sliding window with extra retained tokens -----------------------

EXTRA = 1  # extra_retained_tokens: MTP of two speculative tokens


def mtp(endpoint: str) -> dict[str, Any]:
    """The sliding window of WINDOW tokens with EXTRA retained tokens (as vLLM's
    engine sets them for multi-module MTP), a prompt of CHUNKS whole chunks,
    every chunk of both groups stored, no token budget. vLLM cuts a whole
    prompt's hit one token short (the last token is computed again), so the
    window that ends there, widened by the extra tokens, reaches into a chunk
    before the window at the last chunk's end (load_window_size_in_chunks)."""
    facts: dict[str, Any] = {}
    engine = Engine(endpoint, extra_retained=EXTRA)
    try:
        facts["kinds"] = engine.kinds()
        (_, window) = engine.scheduler.config.kv_group_configs
        facts["extra_retained"] = window.kv_cache_spec.extra_retained_tokens
        facts["window_chunks"] = window.sliding_window_size_in_chunks
        facts["load_window_chunks"] = window.load_window_size_in_chunks(CHUNKS * BLOCK - 1)
        prompt = np.random.default_rng(5).integers(3, 500, CHUNKS * BLOCK).tolist()
        every = list(range(CHUNKS))
        sources = engine.store(engine.request("A", prompt), [every, every])
        facts["A"] = engine.hit_and_load("A_mtp", prompt, None, sources)
    finally:
        engine.shutdown()
    return facts


def eagle(endpoint: str) -> dict[str, Any]:
    """The sliding window group as an EAGLE/MTP drafter's (vLLM's ``is_eagle_group``):
    vLLM asks it for one chunk past the hit's end and a window one chunk
    longer, then drops that chunk from the hit. Prompt A of CHUNKS whole chunks
    without a budget; prompt B with BUDGET, which ends the hit inside chunk 9
    (index 8), where the window is widened too. Every chunk of both groups
    stored."""
    facts: dict[str, Any] = {}
    engine = Engine(endpoint, eagle=True)
    try:
        facts["kinds"] = engine.kinds()
        facts["eagle"] = [g.is_eagle_group for g in engine.scheduler.config.kv_group_configs]
        rng = np.random.default_rng(11)
        every = list(range(CHUNKS))
        for name, length, cap in (("A", CHUNKS * BLOCK, None), ("B", CHUNKS * BLOCK + 5, BUDGET)):
            prompt = rng.integers(3, 500, length).tolist()
            sources = engine.store(engine.request(name, prompt), [every, every])
            facts[name] = engine.hit_and_load(f"{name}_eagle", prompt, cap, sources)
    finally:
        engine.shutdown()
    return facts


def widening(endpoint: str) -> dict[str, Any]:
    """vLLM's widened window (load_window_size_in_chunks, at every hit end inside
    a chunk) against the window and lead hicached gives the group
    (groups.kind_of), over windows, extra retained tokens and chunk sizes:
    the most chunks the widening adds beyond the window, and each lead."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        GroupOffloadConfig,
        get_sliding_window_size_in_chunks,
    )
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from hicached.integrations.vllm.groups import kind_of

    most, short, leads = 0, 0, set()
    for tokens in (16, 32):
        for window in range(1, 2 * tokens + 2):
            for extra in range(2 * tokens + 2):
                spec = SlidingWindowSpec(
                    block_size=tokens,
                    num_kv_heads=1,
                    head_size=8,
                    dtype=torch.bfloat16,
                    sliding_window=window,
                    extra_retained_tokens=extra,
                )
                chunks = get_sliding_window_size_in_chunks(spec, tokens)
                assert chunks is not None
                group = SimpleNamespace(
                    sliding_window_size_in_chunks=chunks,
                    kv_cache_spec=spec,
                    tokens_per_chunk=tokens,
                )
                kind = kind_of(spec, tokens)
                assert isinstance(kind, Window) and kind.tokens == chunks * tokens
                leads.add(kind.lead // tokens)
                for end in range(4 * tokens, 5 * tokens):
                    widened = GroupOffloadConfig.load_window_size_in_chunks(group, end)  # type: ignore[arg-type]
                    assert widened is not None
                    most = max(most, widened - chunks)
                    short += (widened - chunks) * tokens > kind.lead
    return {"most": most, "short": short, "leads": sorted(leads)}


# -- a daemon that takes a few pages a request ------------------------------------------

LIMIT = 1  # the second daemon's server.max_pages_per_request
LONG = 10  # whole chunks of the prompt, more than LIMIT


def limit(endpoint: str) -> dict[str, Any]:
    """A daemon that takes LIMIT pages a request (its max_pages_per_request) and
    a prompt of LONG whole chunks of both groups: the store vLLM prepares
    reserves every chunk of each group, LIMIT a reservation, and the worker
    fills them; the lookup after it asks about LIMIT keys a request, and the
    hit is every chunk, read through a lease a part, each block loaded
    holding the bytes stored from it."""
    facts: dict[str, Any] = {}
    engine = Engine(endpoint)
    try:
        prompt = np.random.default_rng(13).integers(3, 500, LONG * BLOCK + 5).tolist()
        every = list(range(LONG))
        sources = engine.store(engine.request("A", prompt), [every, every])
        facts["stored"] = [sorted(sources[g]) for g in sorted(sources)]
        facts["A"] = engine.hit_and_load("A_limit", prompt, None, sources)
    finally:
        engine.shutdown()
    return facts


def commit_timeout(endpoint: str) -> dict[str, Any]:
    """The daemon that takes LIMIT pages a request and a store of LONG chunks of
    both groups, a reservation a part; the first part's commit gets no answer
    in time (fault injection: the manager's client raises TimeoutError for
    it, the only fake). The store publishes nothing after it, and every
    reservation of the store ends at once, not at its lease's end."""
    facts: dict[str, Any] = {}
    engine = Engine(endpoint)
    try:
        link = engine.manager._link
        client, _ = link.submit(link.session()).result(5)
        commit = client.commit
        calls: list[int] = []

        async def late(res: Any, **kwargs: Any) -> Any:
            calls.append(res.lease)
            if len(calls) == 1:
                raise TimeoutError("fault injection: the commit's answer never came")
            return await commit(res, **kwargs)

        client.commit = late  # type: ignore[method-assign]
        prompt = np.random.default_rng(17).integers(3, 500, LONG * BLOCK + 5).tolist()
        every = list(range(LONG))
        engine.store(engine.request("T", prompt), [every, every])
        facts["commits"] = len(calls)
        with Client(endpoint) as c:
            facts["leases"] = until(lambda: c.stats().leases == 0, 5.0)
            facts["left"] = c.stats().leases
            facts["pages"] = c.stats().pages
    finally:
        engine.shutdown()
    return facts


def parents(endpoint: str) -> dict[str, Any]:
    """Three stores of one request, both groups: chunks 0-2, then 3-4, then 6, 8
    and 9 (no chunk 5 or 7 stored or shown). Each reservation the manager
    asks for, per group: its chunks and the chunk its first enters L2 under
    (its BlockStored parent), recorded on the way to the daemon."""
    facts: dict[str, Any] = {}
    engine = Engine(endpoint)
    try:
        link = engine.manager._link
        client, _ = link.submit(link.session()).result(5)
        reserve_keys = client.reserve_keys
        asked: list[tuple[list[bytes], bytes | None]] = []

        async def recorded(ns: Any, keys: list[bytes], **kwargs: Any) -> Any:
            asked.append((list(keys), kwargs.get("parent")))
            return await reserve_keys(ns, keys, **kwargs)

        client.reserve_keys = recorded  # type: ignore[method-assign]
        prompt = np.random.default_rng(19).integers(3, 500, LONG * BLOCK + 5).tolist()
        request = engine.request("P", prompt)
        for chunks in ([0, 1, 2], [3, 4], [6, 8, 9]):
            engine.store(request, [chunks, chunks])
        index = {key: i for g in (0, 1) for i, key in enumerate(engine.keys(request, g))}
        facts["reservations"] = [
            [int.from_bytes(keys[0][-4:], "big"), [index[k] for k in keys], index.get(parent)]
            for keys, parent in asked
        ]
    finally:
        engine.shutdown()
    return facts


def main(endpoint: str, daemon_pid: int = 0, limited: str = "") -> dict[str, Any]:
    facts: dict[str, Any] = {}
    scenarios = (
        ("stale_mid_pass", stale_mid_pass),
        ("hybrid", hybrid),
        ("budget", budget),
        ("mtp", mtp),
        ("widening", widening),
        ("eagle", eagle),
        ("parents", parents),
    )
    runs = [(name, scenario, endpoint) for name, scenario in scenarios]
    if limited:
        runs.append(("limit", limit, limited))
        runs.append(("commit_timeout", commit_timeout, limited))
    for name, scenario, at in runs:
        try:
            facts[name] = scenario(at)
        except Exception:
            facts[name] = {"error": traceback.format_exc()}
    return facts


if __name__ == "__main__":
    args = sys.argv[1:]
    answer_and_exit(main(args[0], int(args[1]) if len(args) > 1 else 0, *args[2:3]))
