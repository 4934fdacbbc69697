"""hicached's vLLM worker (HicachedWorker) under vLLM 0.32's OffloadingWorker
contract, and vLLM 0.33's expedited loads, driven directly in this venv's
python against a real daemon, with KV in host memory and the copy thread on
(and off, for one expedited load). Prints one JSON object of what it saw;
tests/test_vllm_worker.py checks it.

    vllm_worker_check.py ENDPOINT

Fault injection: the copy between the KV tensors and the slots
(``hicached.client.mapping._copy_rows``) is wrapped to wait at a gate the
check opens, so a copy is seen still under way after ``submit_*`` returned.
The scheduler's part (reserving, committing, the lease of a hit, the socket
that takes the workers' word) is played here with a client of its own and a
real PULL socket, as HicachedManager plays it.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    TransferResult,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

import hicached.client.mapping as mapping
from hicached import Client
from hicached.integrations.vllm import Settings, engine_groups
from hicached.integrations.vllm.specs import Ack, HicachedLoadSpec, HicachedStoreSpec
from hicached.integrations.vllm.worker import HicachedWorker
from tests.engines import answer_and_exit

LAYERS, BLOCKS, BLOCK_BYTES = 2, 16, 1024


class Gate:
    """Holds every copy between KV tensors and slots until opened (fault injection)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()  # a copy reached the gate
        self.copied = threading.Event()  # a copy's bytes moved
        real = mapping._copy_rows

        def held(*args: Any, **kwargs: Any) -> None:
            self.entered.set()
            if not self.open.wait(30):
                raise TimeoutError("the gate was never opened")
            real(*args, **kwargs)
            self.copied.set()

        mapping._copy_rows = held

    def close(self) -> None:
        self.open.clear()
        self.entered.clear()
        self.copied.clear()


def config() -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, tuple(f"layer.{i}" for i in range(LAYERS)), 0),),
        worker_kv_bytes_per_block=LAYERS * BLOCK_BYTES,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="worker-check",
        model=OffloadingModelConfig("check/model", "int8"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def until(worker: HicachedWorker, job: int, seconds: float = 10.0) -> TransferResult | None:
    """get_finished, called as an engine calls it, until ``job`` is reported."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for result in worker.get_finished():
            if result.job_id == job:
                return result
        time.sleep(0.005)
    return None


def quiet(worker: HicachedWorker, seconds: float = 0.2) -> list[int]:
    """What get_finished reports over ``seconds`` (the copy held at its gate)."""
    seen: list[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen += [r.job_id for r in worker.get_finished()]
        time.sleep(0.01)
    return seen


def main(endpoint: str) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    gate = Gate()
    cfg = config()
    settings = Settings(endpoint=endpoint, copy_thread=True, timeout_s=5.0)
    gen = torch.Generator().manual_seed(5)
    tensors = [
        torch.randint(-128, 128, (BLOCKS, BLOCK_BYTES), dtype=torch.int8, generator=gen)
        for _ in range(LAYERS)
    ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, BLOCK_BYTES) for t in tensors], group_data_refs=[[]]
    )
    groups = engine_groups(cfg, settings)  # one full-attention group
    worker = HicachedWorker(kv, settings, cfg, groups)
    where = Path(tempfile.mkdtemp(prefix="hc-worker-"))
    acks = f"ipc://{where}/acks.sock"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(acks)
    keys = [hashlib.sha256(b"page %d" % i).digest() + bytes(4) for i in range(4)]
    blocks = [3, 7, 1, 12]
    targets = [0, 2, 4, 5]

    def spec(ids: list[int]) -> GPULoadStoreSpec:
        return GPULoadStoreSpec(ids, [len(ids)], [0])

    def block_bytes(rows: list[int]) -> np.ndarray:
        """Those KV blocks as pages (every layer's block, in order)."""
        return np.concatenate([t[rows].view(torch.uint8).numpy() for t in tensors], axis=1)

    try:
        with Client(endpoint, timeout=5.0) as scheduler:
            ns = scheduler.register(groups[0].spec)
            # a store, held at its gate: submit returns, nothing is reported, then it is
            res = scheduler.reserve_keys(ns, keys)
            gate.close()
            store = HicachedStoreSpec([[res.portable()]], acks)
            facts["store_submitted"] = worker.submit_store(1, spec(blocks), store)
            facts["store_copy_began"] = gate.entered.wait(10)
            facts["store_reported_while_held"] = quiet(worker)
            facts["store_word_while_held"] = bool(pull.poll(0))
            gate.open.set()
            got = until(worker, 1)
            facts["store_result"] = None if got is None else got.success
            facts["store_word"] = (
                list(msgspec.msgpack.decode(pull.recv(), type=Ack).written)
                if pull.poll(5000)
                else None
            )
            scheduler.commit(res)
            hit = scheduler.match_keys(ns, keys)
            facts["stored_bytes_equal"] = bool(
                np.array_equal(scheduler.read_pages(hit), block_bytes(blocks))
            )
            # a load, held at its gate, into other blocks
            for t in tensors:
                t[targets] = 0
            gate.close()
            load = HicachedLoadSpec([[hit.portable()]])
            facts["load_submitted"] = worker.submit_load(2, load, spec(targets))
            facts["load_copy_began"] = gate.entered.wait(10)
            facts["load_reported_while_held"] = quiet(worker)
            gate.open.set()
            got = until(worker, 2)
            facts["load_result"] = None if got is None else got.success
            facts["loaded_bytes_equal"] = bool(
                np.array_equal(block_bytes(targets), block_bytes(blocks))
            )
            # wait() returns once a held job is done, and it is reported after
            gate.close()
            worker.submit_load(3, HicachedLoadSpec([[hit.portable()]]), spec(targets))
            threading.Timer(0.3, gate.open.set).start()
            worker.wait({3})
            facts["gate_open_when_wait_returned"] = gate.open.is_set()
            facts["reported_after_wait"] = [(r.job_id, r.success) for r in worker.get_finished()]
            # vLLM 0.33's expedited load, as its connector makes one: submit_load(...,
            # expedited=True), then wait() before the forward pass. It goes ahead of
            # a load queued before it (the thread is held at the gate by a third).
            first, second, third = [0, 2, 4, 5], [6, 8, 9, 10], [11, 13, 14, 15]
            for t in tensors:
                t[first + second + third] = 0
            gate.close()
            worker.submit_load(10, HicachedLoadSpec([[hit.portable()]]), spec(first))
            facts["regular_held"] = gate.entered.wait(10)
            worker.submit_load(11, HicachedLoadSpec([[hit.portable()]]), spec(second))
            facts["expedited_submitted"] = worker.submit_load(
                12, HicachedLoadSpec([[hit.portable()]]), spec(third), expedited=True
            )
            facts["expedited_returned_while_held"] = not gate.open.is_set()
            threading.Timer(0.3, gate.open.set).start()
            worker.wait({12})
            facts["expedited_loaded_when_wait_returned"] = bool(
                np.array_equal(block_bytes(third), block_bytes(blocks))
            )
            reported: list[tuple[int, bool]] = []
            deadline = time.monotonic() + 10
            while len(reported) < 3 and time.monotonic() < deadline:
                reported += [(r.job_id, r.success) for r in worker.get_finished()]
                time.sleep(0.005)
            facts["reported_in_order"] = reported
            # with copies in the submit call (the default for KV in host memory), an
            # expedited load is there when submit_load returns
            inline = HicachedWorker(kv, Settings(endpoint=endpoint, timeout_s=5.0), cfg, groups)
            try:
                for t in tensors:
                    t[third] = 0
                inline.submit_load(13, HicachedLoadSpec([[hit.portable()]]), spec(third), True)
                facts["inline_loaded_at_return"] = bool(
                    np.array_equal(block_bytes(third), block_bytes(blocks))
                )
                inline.wait({13})
                facts["inline_reported"] = [(r.job_id, r.success) for r in inline.get_finished()]
            finally:
                inline.shutdown()
            # a load that wait() finds unfinished at its deadline (4 x timeout_s) raises
            short = HicachedWorker(
                kv, Settings(endpoint=endpoint, copy_thread=True, timeout_s=0.5), cfg, groups
            )
            try:
                short.submit_load(14, HicachedLoadSpec([[hit.portable()]]), spec(first))
                until(short, 14)  # its session is up
                gate.close()
                short.submit_load(15, HicachedLoadSpec([[hit.portable()]]), spec(first))
                try:
                    short.wait({15})
                    facts["late_load_wait"] = "returned"
                except TimeoutError as exc:
                    facts["late_load_wait"] = str(exc)
                facts["gate_open_when_it_raised"] = gate.open.is_set()
                gate.open.set()
                got = until(short, 15)
                facts["late_load_result"] = None if got is None else got.success
            finally:
                gate.open.set()
                short.shutdown()
            # a load whose slots change owner after its bytes moved, before it is
            # reported: reported failed
            late = scheduler.match_keys(ns, keys)
            gate.close()
            gate.open.set()
            worker.submit_load(4, HicachedLoadSpec([[late.portable()]]), spec(targets))
            facts["stale_copied"] = gate.copied.wait(10)
            scheduler.release(late)
            scheduler.release(hit)
            others = [hashlib.sha256(b"other %d" % i).digest() + bytes(4) for i in range(600)]
            taken = scheduler.reserve_keys(ns, others)  # the pool's every slot: ours move
            facts["slots_taken"] = len(taken.offsets)
            got = until(worker, 4)
            facts["stale_result"] = None if got is None else got.success
            scheduler.abort(taken)
    finally:
        worker.shutdown()
        pull.close()
        ctx.term()
    return facts


if __name__ == "__main__":
    answer_and_exit(main(sys.argv[1]))
