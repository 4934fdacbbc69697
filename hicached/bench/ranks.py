"""Rank agreement: the per-step cost of one packed agreement vs the raw collectives.

For 2 and 4 ranks (one TP group), each step carries a realistic step's
decisions: agreed prefetch pages, two sidecar pools' hit pages, finished
backups (MIN), must-not-terminate and terminated (MAX), plus the
fingerprint. Timed in blocks of 100 identical steps (so the ranks run in
step and a figure is the steady per-step cost), blocks alternating, medians:
(a) one raw all_reduce of a tensor with as many int64 elements, and (b) the
same decisions taken the old way, one all_reduce per decision. Then the
engine simulator's end-to-end figures against a daemon started here.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from hicached.ranks.agreement import Agreement, Fields, Topology

FIELDS = Fields(
    min=("kv", "swa", "state", "acks"),
    max=("must_not_terminate", "terminated"),
    cautious=(("must_not_terminate", 1),),
)


def _bench_rank(topo: Topology, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    agreement = Agreement(topo, FIELDS, sites=("bench.step",))
    group = topo.stage_group
    width = FIELDS.width
    values = dict(kv=40 + topo.rank, swa=2, state=1, acks=7, must_not_terminate=0, terminated=0)
    block = 100

    def raw_same() -> None:
        dist.all_reduce(
            torch.tensor([1] * width, dtype=torch.int64), op=dist.ReduceOp.MIN, group=group
        )

    def separate() -> None:  # one collective per decision, as engines did before packing them
        for name in FIELDS.min:
            dist.all_reduce(
                torch.tensor([values[name]], dtype=torch.int64), op=dist.ReduceOp.MIN, group=group
            )
        for name in FIELDS.max:
            dist.all_reduce(
                torch.tensor([values[name]], dtype=torch.int64), op=dist.ReduceOp.MAX, group=group
            )

    ways = [lambda: agreement.agree("bench.step", **values), raw_same, separate]
    for way in ways:  # warm up every path
        for _ in range(20):
            way()
    before = agreement.collectives
    agreed_steps = 0
    per_block: list[list[float]] = [[], [], []]
    for _ in range(max(1, steps // block)):  # blocks alternate; all ranks run the same order
        for k, way in enumerate(ways):
            dist.barrier(group=group)
            t0 = time.perf_counter_ns()
            for _ in range(block):
                way()
            per_block[k].append((time.perf_counter_ns() - t0) / block)
            agreed_steps += block if k == 0 else 0
    lat = [float(np.median(x)) for x in per_block]
    per_step = (agreement.collectives - before) / steps
    agreement.close()
    return {
        "p50_us": [float(np.percentile(lat[k], 50)) / 1000 for k in range(3)],
        "collectives_per_step": per_step,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hicached.ranks import launch
    from hicached.ranks.simulator import Workload, simulate
    from hicached.testing import DaemonProcess

    steps = max(100, args.requests)
    figures: dict[str, float] = {}
    for ranks in (2, 4):
        results = launch(_bench_rank, steps, tp=ranks, timeout=30, deadline=600)
        agree, same, separate = results[0]["p50_us"]
        tag = f"{ranks}r"
        figures[f"agree_us_{tag}"] = round(agree, 1)
        figures[f"allreduce_same_us_{tag}"] = round(same, 1)
        figures[f"separate_us_{tag}"] = round(separate, 1)
        figures[f"agree_vs_allreduce_{tag}"] = round(agree / same, 3)
        figures[f"agree_vs_separate_{tag}"] = round(agree / separate, 3)
        figures["collectives_per_step"] = results[0]["collectives_per_step"]
    with DaemonProcess(size_mib=1, slab_mib=1, storage='backend = "memory"\n') as daemon:
        workload = Workload(conversations=3, turns=4)
        started = time.monotonic()
        sim = simulate(daemon.endpoint, tp=2, workload=workload)
        wall = time.monotonic() - started
    figures["sim_requests"] = sim[0]["requests"]
    figures["sim_requests_per_s"] = round(sim[0]["requests"] / max(r["seconds"] for r in sim), 2)
    figures["sim_pages_from_l2"] = sum(r["pages_l2"] for r in sim)
    figures["sim_pages_from_l3"] = sum(r["pages_l3"] for r in sim)
    figures["sim_verified_bytes"] = sum(r["verified_bytes"] for r in sim)
    figures["sim_wall_s_with_startup"] = round(wall, 2)
    return {
        "figures": figures,
        "params": {
            "steps": steps,
            "elements": FIELDS.width,
            "decisions": len(FIELDS.min) + len(FIELDS.max),
            "simulator": "tp=2, 3 conversations x 4 turns, memory L3",
        },
        "targets": {
            "agree_vs_allreduce": "<= 1.2",
            "agree_vs_separate": "<= 0.5",
            "collectives_per_step": "== 1",
        },
    }
