"""hicached's vLLM tier under vLLM's ``replicated_layout`` and
``canonical_layout``, with vLLM 0.32's own classes at TP 2 (and 1, and 4),
against a real daemon. Prints one JSON object of what it saw;
tests/test_vllm_layouts.py checks it.

    vllm_layout_check.py ENDPOINT

No engine runs (vLLM's CPU build runs no model at TP > 1 on this host kind);
what an engine would hand the connector is built with vLLM's functions: the
VllmConfig from ``EngineArgs`` (a tiny MLA model, DeepSeek-V2, and a tiny
GQA one, Llama, written here as config files only), the KV cache configs from
``get_kv_cache_configs`` (the layers' KV cache specs as their attention
layers make them), and the offloading config from the connector itself.
The scheduler side is vLLM's ``OffloadingConnector`` in the SCHEDULER role,
in this process; each worker rank is an ``OffloadingConnector`` in the
WORKER role in a process of its own, with KV tensors of the shape a GPU
attention backend gives them, so vLLM's connector decides which ranks store
and vLLM derives the canonical mappings. The steps of a scheduler and its
workers are played in turn: this process asks the manager, hands the
transfer specs to the rank processes over pipes (pickled, as vLLM's
executor hands them), and reads the pages in the pool with a client of its
own. Each rank's ``submit_store`` is wrapped to count the stores vLLM's
connector submits to it (a count; the call goes on unchanged).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import importlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from tests.engines import answer_and_exit

# vLLM's workers here are this process's forks: nothing runs threads before them
MP = multiprocessing.get_context("fork")

BLOCK = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_BYTES = 4 << 20  # each worker's KV cache
MODELS = {
    "mla": {  # DeepSeek-V2 with MLA: a latent of 64 + 16 a token, the same on every rank
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "first_k_dense_replace": 2,
    },
    "gqa": {  # Llama with 4 KV heads of 32: TP 2 splits them, TP 4 too, one each
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
    },
    "gqa2": {  # Llama with 2 KV heads: TP 4 holds each head on two ranks
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
}
COMMON = {
    "vocab_size": 512,
    "num_hidden_layers": len(LAYERS),
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclasses.dataclass(frozen=True)
class Engine:
    """One engine's configuration: its model, parallelism and hicached's options."""

    model: str  # a key of MODELS
    tp: int = 1
    pp: int = 1
    canonical: bool = False
    quant: bool = False  # KV quantized per token and head
    odd: bool = False  # KV tensors in a shape vLLM's canonical mapping does not know


def model_dir(root: Path, name: str) -> str:
    where = root / name
    where.mkdir(exist_ok=True)
    # every rank process writes it: whole files only (a rename), never one half-written
    tmp = where / f".config.{os.getpid()}.json"
    tmp.write_text(json.dumps({**COMMON, **MODELS[name]}))
    os.replace(tmp, where / "config.json")
    return str(where)


def engine_config(
    model: str, endpoint: str, options: dict[str, Any] | None = None, **engine: Any
) -> Any:
    """The VllmConfig an engine makes of its arguments for ``model`` (a
    model_dir), BLOCK-token blocks and prefix caching, with hicached's
    offloading spec for the daemon at ``endpoint`` as its KV connector
    (``options``: more of the spec's settings); ``engine``: more arguments
    (parallel sizes, the executor)."""
    from vllm.engine.arg_utils import EngineArgs

    extra: dict[str, Any] = {
        "spec_name": "HicachedOffloadingSpec",
        "spec_module_path": "hicached.integrations.vllm",
        "endpoint": endpoint,
        "timeout_s": 5.0,
        **(options or {}),
    }
    args = EngineArgs(
        model=model,
        **engine,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        max_model_len=1024,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256",
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    vllm_config = args.create_engine_config()
    vllm_config.cache_config.kv_cache_layout = "LBNHC"  # as the engine core resolves it: NHD
    return vllm_config


def configs(root: Path, endpoint: str, e: Engine, rank: int) -> tuple[Any, Any, Any]:
    """(VllmConfig, the scheduler's KVCacheConfig, this rank's) of engine ``e``."""
    import torch
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec

    options = {"canonical_layout": True} if e.canonical else {}
    vllm_config = engine_config(
        model_dir(root, e.model),
        endpoint,
        options,
        tensor_parallel_size=e.tp,
        pipeline_parallel_size=e.pp,
        distributed_executor_backend="mp",
    )
    vllm_config.parallel_config.rank = rank
    if e.model == "mla":  # as MLAAttention.get_kv_cache_spec makes it
        spec: Any = MLAAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=64 + 16,
            dtype=torch.bfloat16,
            cache_dtype_str="auto",
        )
    else:
        heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
        quant = KVQuantMode.INT8_PER_TOKEN_HEAD if e.quant else KVQuantMode.NONE
        spec = FullAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=heads,
            head_size=32,
            dtype=torch.int8 if e.quant else torch.bfloat16,
            kv_quant_mode=quant,
        )
    world = e.tp * e.pp
    per_worker = [{name: spec for name in LAYERS}] * world
    workers = get_kv_cache_configs(vllm_config, per_worker, [KV_BYTES] * world)
    scheduler = generate_scheduler_kv_cache_config(workers)
    for kv in (scheduler, workers[rank]):
        kv.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return vllm_config, scheduler, workers[rank]


# -- a worker rank, in a process of its own ---------------------------------------------


def rank_main(conn: Connection, root: Path, endpoint: str) -> None:
    """Serve one worker rank's steps: ``start`` an engine's worker connector,
    ``store``/``load`` a transfer through it, ``blocks`` (its KV blocks'
    bytes), ``stop``."""
    state: dict[str, Any] = {"root": root, "endpoint": endpoint}
    while True:
        op, args = conn.recv()
        try:
            conn.send(("ok", STEPS[op](state, *args)))
        except Exception as exc:  # the check reads the error
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        if op == "stop":
            return


def start(state: dict[str, Any], e: Engine, rank: int, seed: int) -> Any:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    stop(state)
    vllm_config, _, kv_config = configs(state["root"], state["endpoint"], e, rank)
    blocks = kv_config.num_blocks
    gen = torch.Generator().manual_seed(seed)
    kv = {}
    for name in LAYERS:
        spec = kv_config.kv_cache_groups[0].kv_cache_spec
        if e.model == "mla":
            shape: tuple[int, ...] = (blocks, BLOCK, spec.head_size)
        elif e.odd:  # K and V side by side in each token's head: no shape vLLM maps
            shape = (blocks, BLOCK, spec.num_kv_heads, 2 * spec.head_size)
        else:  # split K and V, NHD: (blocks, 2, tokens, heads, head size)
            shape = (blocks, 2, BLOCK, spec.num_kv_heads, spec.head_size)
        raw = torch.randint(-128, 128, (blocks, spec.page_size_bytes), generator=gen)
        kv[name] = raw.to(torch.int8).view(spec.dtype).view(shape)
    connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_config)
    connector.register_kv_caches(kv)
    worker = connector.connector_worker
    submitted: list[int] = []
    real = worker.worker.submit_store

    def counted(job_id: int, src: Any, dst: Any) -> bool:  # counts what vLLM submits
        submitted.append(job_id)
        return bool(real(job_id, src, dst))

    worker.worker.submit_store = counted
    state.update(connector=connector, kv=kv, submitted=submitted)
    return {"blocks": blocks}


def store(state: dict[str, Any], job: int, ids: list[int], dst: Any) -> Any:
    """One store job, as vLLM's connector runs it: queued at a step's end, submitted
    at the next step's start; until vLLM counts it completed on this rank."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    worker = state["connector"].connector_worker
    src = GPULoadStoreSpec(ids, [len(ids)], [0])
    worker.prepare_store_kv(OffloadingConnectorMetadata({}, {job: TransferJob("r", src, dst)}))
    worker.start_kv_transfers(OffloadingConnectorMetadata({}, {}))
    done = until(lambda: _completed(worker, job))
    return {"completed": done, "submitted": job in state["submitted"]}


def load(state: dict[str, Any], job: int, ids: list[int], src: Any) -> Any:
    """One load job into blocks ``ids``; their bytes once vLLM hears it finished."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    worker = state["connector"].connector_worker
    for tensor in state["kv"].values():
        tensor[ids] = 0
    dst = GPULoadStoreSpec(ids, [len(ids)], [0])
    worker.start_kv_transfers(OffloadingConnectorMetadata({job: TransferJob("r", src, dst)}, {}))
    done = until(lambda: "r" in worker.get_finished(set())[1])  # its request's load
    return {"finished": done, "blocks": blocks(state, ids)}


def blocks(state: dict[str, Any], ids: list[int]) -> list[bytes]:
    """Each layer's bytes of blocks ``ids`` (as the tensors hold them)."""
    import torch

    return [t[ids].contiguous().view(torch.uint8).numpy().tobytes() for t in state["kv"].values()]


def stop(state: dict[str, Any]) -> None:
    if "connector" in state:
        state.pop("connector").shutdown()


STEPS = {"start": start, "store": store, "load": load, "blocks": blocks, "stop": stop}


def _completed(worker: Any, job: int) -> bool:
    worker.get_finished(set())
    meta = worker.build_connector_worker_meta()
    return meta is not None and job in meta.completed_jobs


def until(ready: Any, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(0.005)
    return False


class Rank:
    """A rank process and its pipe."""

    def __init__(self, root: Path, endpoint: str) -> None:
        self.conn, theirs = MP.Pipe()
        self.proc = MP.Process(target=rank_main, args=(theirs, root, endpoint), daemon=True)
        self.proc.start()

    def ask(self, op: str, *args: Any) -> Any:
        self.conn.send((op, args))
        if not self.conn.poll(120):
            raise TimeoutError(f"rank step {op} took over 120 s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        """Stop the rank's connector and its process (killed if it has not
        ended 10 s later)."""
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.ask("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def start_all(ranks: list[Rank], e: Engine, seeds: list[int]) -> None:
    """Engine ``e``'s worker connectors, rank r in ``ranks[r]``, KV drawn from seed r."""
    for r, (rank, seed) in enumerate(zip(ranks, seeds, strict=True)):
        rank.conn.send(("start", (e, r, seed)))
    _answers(ranks, "start")


def on_all(ranks: list[Rank], op: str, *args: Any) -> list[Any]:
    """One step on every rank at once (as an executor runs it on every worker)."""
    for rank in ranks:
        rank.conn.send((op, args))
    return _answers(ranks, op)


def _answers(ranks: list[Rank], op: str) -> list[Any]:
    out = []
    for rank in ranks:
        if not rank.conn.poll(120):
            raise TimeoutError(f"rank step {op} took over 120 s")
        status, value = rank.conn.recv()
        if status == "error":
            raise RuntimeError(value)
        out.append(value)
    return out


# -- the scheduler's side, in this process ----------------------------------------------


def scheduler(root: Path, endpoint: str, e: Engine) -> tuple[Any, Any]:
    """vLLM's connector in the SCHEDULER role for engine ``e``, and its
    OffloadingConfig as vLLM builds it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    vllm_config, kv_config, _ = configs(root, endpoint, e, 0)
    offloading = build_offloading_config(vllm_config, kv_config)
    return OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_config), offloading


def refused(root: Path, endpoint: str, e: Engine) -> str:
    """Why the scheduler's connector for ``e`` did not start ("" if it did)."""
    try:
        connector, _ = scheduler(root, endpoint, e)
    except ValueError as exc:
        return str(exc)
    connector.connector_scheduler.manager.shutdown()
    return ""


def keys(n: int, salt: bytes) -> list[bytes]:
    out, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + salt + bytes([i])).digest()
        out.append(parent + bytes(4))
    return out


def context(req_id: str, ks: list[bytes]) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id)
    for i, key in enumerate(ks):
        ctx.set_offload_key_position(key, (i + 1) * BLOCK)
    return ctx


def stored(manager: Any, ranks: list[Rank], ks: list[bytes], ids: list[int], job: int) -> Any:
    """A store of ``ks`` from blocks ``ids``, through every rank, published."""
    ctx = context(f"store-{job}", ks)
    out = manager.prepare_store(ks, ctx)
    assert list(out.keys_to_store) == ks, "not every key was given a slot"
    results = on_all(ranks, "store", job, ids, out.store_spec)
    manager.complete_store(ks, ctx)
    concurrent.futures.wait(list(manager._publishing), timeout=20)
    return results


def loaded(manager: Any, ranks: list[Rank], ks: list[bytes], ids: list[int], job: int) -> Any:
    """Lookups as vLLM's scheduler steps make them until every key is a HIT, then
    a load of them into blocks ``ids`` on every rank; what each rank loaded."""
    ctx = context(f"load-{job}", ks)
    seen: list[str] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        seen = [manager.lookup(k, ctx).name for k in ks]
        manager.on_schedule_end(None)
        if seen == ["HIT"] * len(ks):
            break
        time.sleep(0.02)
    if seen != ["HIT"] * len(ks):
        return {"lookups": seen}
    spec = manager.prepare_load(ks, ctx)
    results = on_all(ranks, "load", job, ids, spec)
    manager.complete_load(ks, ctx)
    manager.on_request_finished(ctx)
    return {"lookups": seen, "ranks": results}


def page_bytes_in_pool(client: Any, spec: Any, ks: list[bytes]) -> list[bytes]:
    """The bytes of the pages of ``ks`` in namespace ``spec``."""
    ns = client.register(spec)
    hit = client.match_keys(ns, ks)
    try:
        return [bytes(row) for row in client.read_pages(hit)]
    finally:
        client.release(hit)


def hits(client: Any, spec: Any, ks: list[bytes]) -> int:
    ns = client.register(spec)
    hit = client.match_keys(ns, ks, lease=False)
    return len(hit.offsets)


# -- the checks -------------------------------------------------------------------------


def replicated(root: Path, endpoint: str, ranks: list[Rank], client: Any) -> dict[str, Any]:
    """MLA at TP 2: vLLM sets replicated_layout; rank 0 alone stores one copy,
    both ranks load it; the namespace is replicated and its keys never a
    per-rank namespace's, nor theirs its."""
    from hicached.integrations.vllm import Settings, engine_groups
    from hicached.wire.namespace import namespace_digest

    facts: dict[str, Any] = {}
    e = Engine("mla", tp=2)
    # the ranks hold different bytes here, so that which rank wrote a page shows
    start_all(ranks, e, [1, 2])
    connector, offloading = scheduler(root, endpoint, e)
    manager = connector.connector_scheduler.manager
    try:
        facts["vllm_replicated_layout"] = offloading.replicated_layout
        spec = manager.groups[0].spec
        facts["spec"] = {"replicated": spec.replicated, "shards": spec.shards}
        facts["page_bytes"] = spec.page_bytes
        facts["block_bytes"] = offloading.worker_kv_bytes_per_block
        before = client.stats()
        ks, ids = keys(4, b"mla"), [3, 7, 1, 12]
        facts["stores"] = stored(manager, ranks, ks, ids, 1)
        after = client.stats()
        facts["pages_committed"] = after.committed_pages - before.committed_pages
        facts["pool_bytes_used"] = after.pool_used_bytes - before.pool_used_bytes
        sources = [rank.ask("blocks", ids) for rank in ranks]
        in_pool = page_bytes_in_pool(client, spec, ks)
        facts["pages_are_rank0s_blocks"] = in_pool == _pages(sources[0], 4)
        targets = [0, 2, 4, 5]
        got = loaded(manager, ranks, ks, targets, 2)
        facts["lookups"] = got["lookups"]
        facts["loads_finished"] = [r["finished"] for r in got["ranks"]]
        first, second = (r["blocks"] for r in got["ranks"])
        facts["ranks_loaded_the_same_bytes"] = first == second
        facts["loaded_rank0s_blocks"] = first == sources[0]
        # the per-rank (direct) namespace of the same engine: other keys, both ways
        direct = dataclasses.replace(offloading, replicated_layout=False)
        per_rank = engine_groups(direct, Settings(endpoint=endpoint))[0].spec
        facts["direct_spec"] = {"replicated": per_rank.replicated, "shards": per_rank.shards}
        facts["digests_differ"] = namespace_digest(per_rank) != namespace_digest(spec)
        facts["direct_hits_of_replicated_keys"] = hits(client, per_rank, ks)
        other = keys(2, b"direct")
        ns = client.register(per_rank)
        res = client.reserve_keys(ns, other)
        client.write_pages(res, np.zeros((len(other), per_rank.page_bytes), np.uint8))
        client.commit(res)
        facts["direct_hits_of_direct_keys"] = hits(client, per_rank, other)
        facts["replicated_hits_of_direct_keys"] = hits(client, spec, other)
    finally:
        manager.shutdown()
    return facts


def _pages(layers: list[bytes], n: int) -> list[bytes]:
    """Pages of one copy of ``n`` blocks: each block of every layer in turn."""
    rows = [np.frombuffer(layer, np.uint8).reshape(n, -1) for layer in layers]
    return [b"".join(row[i].tobytes() for row in rows) for i in range(n)]


def canonical(root: Path, endpoint: str, ranks: list[Rank], client: Any) -> dict[str, Any]:
    """GQA at TP 2 with canonical_layout: both ranks write their heads into one
    canonical page (every head, as at TP 1); an engine at TP 1 finds the pages
    (the same namespace) and loads its whole blocks from them; canonical and
    direct namespaces never share keys."""
    from hicached.integrations.vllm import Settings, engine_groups
    from hicached.wire.namespace import namespace_digest

    facts: dict[str, Any] = {}
    e2, e1 = Engine("gqa", tp=2, canonical=True), Engine("gqa", tp=1, canonical=True)
    start_all(ranks, e2, [11, 12])  # each rank its two of the four heads
    connector, offloading = scheduler(root, endpoint, e2)
    manager = connector.connector_scheduler.manager
    try:
        facts["vllm"] = {
            "canonical_layout": offloading.canonical_layout,
            "is_parallelism_agnostic": offloading.parallel.is_parallelism_agnostic,
        }
        spec = manager.groups[0].spec
        facts["spec"] = {
            "layout": spec.layout,
            "tp": [spec.tp_rank, spec.tp_size],
            "shards": spec.shards,
            "page_bytes": spec.page_bytes,
        }
        ks, ids = keys(4, b"gqa"), [5, 9, 2, 30]
        facts["stores"] = stored(manager, ranks, ks, ids, 1)
        halves = [rank.ask("blocks", ids) for rank in ranks]  # each rank's two heads
        in_pool = page_bytes_in_pool(client, spec, ks)
        facts["pages_are_every_head_in_order"] = in_pool == _canonical_pages(halves, 4)
        # the whole blocks an engine at TP 1 holds: each rank's heads side by side
        full = _full_blocks(halves, 4)
    finally:
        manager.shutdown()
    connector1, _ = scheduler(root, endpoint, e1)
    manager1 = connector1.connector_scheduler.manager
    try:
        spec1 = manager1.groups[0].spec
        facts["tp1_same_namespace"] = namespace_digest(spec1) == namespace_digest(spec)
        ranks[0].ask("start", e1, 0, 13)
        targets = [1, 6, 8, 10]
        got = loaded(manager1, ranks[:1], ks, targets, 2)
        facts["tp1_lookups"] = got["lookups"]
        facts["tp1_loaded_whole_blocks"] = got["ranks"][0]["blocks"] == full
        # the direct layout's namespace of the TP 2 engine: never these keys
        direct = dataclasses.replace(offloading, canonical_layout=False)
        per_rank = engine_groups(direct, Settings(endpoint=endpoint))[0].spec
        facts["direct_layout"] = per_rank.layout
        facts["digests_differ"] = namespace_digest(per_rank) != namespace_digest(spec)
        facts["direct_hits_of_canonical_keys"] = hits(client, per_rank, ks)
    finally:
        manager1.shutdown()
    return facts


def _canonical_pages(halves: list[list[bytes]], n: int) -> list[bytes]:
    """vLLM's canonical page (split K and V, NHD) of each of ``n`` blocks, every
    layer's in turn, from each rank's (blocks, 2, tokens, heads, head) bytes:
    K of every token with every head (rank 0's, then rank 1's), then V."""
    pages = []
    for b in range(n):
        layers = []
        for layer in range(len(LAYERS)):
            parts = [np.frombuffer(h[layer], np.uint8).reshape(n, 2, BLOCK, -1)[b] for h in halves]
            layers.append(np.concatenate(parts, axis=-1).tobytes())  # (2, tokens, heads * head)
        pages.append(b"".join(layers))
    return pages


def _full_blocks(halves: list[list[bytes]], n: int) -> list[bytes]:
    """Each layer's bytes of ``n`` blocks at TP 1: every rank's heads side by side."""
    return [
        np.concatenate(
            [np.frombuffer(h[layer], np.uint8).reshape(n, 2, BLOCK, -1) for h in halves], axis=-1
        ).tobytes()
        for layer in range(len(LAYERS))
    ]


def canonical_turns(root: Path, endpoint: str, ranks: list[Rank], client: Any) -> dict[str, Any]:
    """MLA at TP 2 with canonical_layout: the latent (the same on both ranks) is
    written once a page, by rank ``slot % 2`` (vLLM's writer rotation); with
    different bytes on each rank here, each page shows which rank wrote it."""
    facts: dict[str, Any] = {}
    e = Engine("mla", tp=2, canonical=True)
    start_all(ranks, e, [21, 22])
    connector, offloading = scheduler(root, endpoint, e)
    manager = connector.connector_scheduler.manager
    try:
        facts["vllm_replicated_layout"] = offloading.replicated_layout
        spec = manager.groups[0].spec
        facts["page_bytes"] = spec.page_bytes
        ks, ids = keys(6, b"turns"), [4, 8, 15, 16, 23, 42]
        facts["stores"] = stored(manager, ranks, ks, ids, 1)
        sources = [rank.ask("blocks", ids) for rank in ranks]
        ns = client.register(spec)
        hit = client.match_keys(ns, ks)
        pages = client.read_pages(hit)
        slots = [offset // spec.page_bytes for offset in hit.offsets]
        client.release(hit)
        mine = [_pages(source, len(ids)) for source in sources]
        facts["writer_of_each_page"] = [
            [r for r in range(2) if bytes(page) == mine[r][j]] for j, page in enumerate(pages)
        ]
        facts["slot_parity"] = [slot % 2 for slot in slots]
    finally:
        manager.shutdown()
    return facts


def tp4(root: Path, endpoint: str, ranks: list[Rank], client: Any) -> dict[str, Any]:
    """2 KV heads at TP 4 with canonical_layout: each head on two ranks; the
    canonical page holds each head once, and all four ranks load their head
    back."""
    facts: dict[str, Any] = {}
    e = Engine("gqa2", tp=4, canonical=True)
    start_all(ranks, e, [31, 31, 32, 32])  # ranks 2h and 2h + 1 hold head h alike
    connector, _ = scheduler(root, endpoint, e)
    manager = connector.connector_scheduler.manager
    try:
        spec = manager.groups[0].spec
        facts["page_bytes"] = spec.page_bytes
        ks, ids = keys(4, b"tp4"), [2, 3, 5, 7]
        facts["stores"] = stored(manager, ranks, ks, ids, 1)
        sources = [rank.ask("blocks", ids) for rank in ranks]
        facts["pages_are_every_head_once"] = page_bytes_in_pool(client, spec, ks) == (
            _canonical_pages([sources[0], sources[2]], 4)
        )
        got = loaded(manager, ranks, ks, [9, 10, 11, 12], 2)
        facts["lookups"] = got["lookups"]
        facts["each_rank_loaded_its_head"] = [
            r["blocks"] == sources[i] for i, r in enumerate(got["ranks"])
        ]
    finally:
        manager.shutdown()
    return facts


def refusals(root: Path, endpoint: str, ranks: list[Rank]) -> dict[str, str]:
    """What hicached refuses of canonical_layout, and why (the messages)."""
    facts = {
        "pp": refused(root, endpoint, Engine("gqa", tp=1, pp=2, canonical=True)),
        "per_token_head": refused(root, endpoint, Engine("gqa", tp=2, canonical=True, quant=True)),
    }
    try:  # a KV tensor shape vLLM cannot certify: the worker refuses at its start
        ranks[0].ask("start", Engine("gqa", tp=2, canonical=True, odd=True), 0, 41)
        facts["uncertified_worker"] = ""
    except RuntimeError as exc:
        facts["uncertified_worker"] = str(exc).splitlines()[0]
    return facts


def preload() -> None:
    """What every rank imports, imported once before the ranks are forked (a
    vLLM import takes seconds)."""
    for module in (
        "torch",
        "vllm.engine.arg_utils",
        "vllm.v1.core.kv_cache_utils",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
        "hicached.integrations.vllm",
    ):
        importlib.import_module(module)


def main(endpoint: str) -> dict[str, Any]:
    from hicached import Client

    root = Path(tempfile.mkdtemp(prefix="hc-layouts-"))
    preload()
    ranks = [Rank(root, endpoint) for _ in range(4)]  # before any thread of this process
    facts: dict[str, Any] = {}
    try:
        with Client(endpoint, timeout=5.0) as client:
            facts["replicated"] = replicated(root, endpoint, ranks[:2], client)
            facts["canonical"] = canonical(root, endpoint, ranks[:2], client)
            facts["turns"] = canonical_turns(root, endpoint, ranks[:2], client)
            facts["tp4"] = tp4(root, endpoint, ranks, client)
            facts["refused"] = refusals(root, endpoint, ranks)
    finally:
        for rank in ranks:
            rank.close()
    return facts


if __name__ == "__main__":
    answer_and_exit(main(sys.argv[1]), default=repr)
