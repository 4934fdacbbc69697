"""Functions that run inside rank processes (importable by spawned children)."""

from __future__ import annotations

import time
from typing import Any

from hicached.dist import Agreement, Fields, Topology

FIELDS = Fields(min=("pages", "acks"), max=("busy", "done"), cautious=(("busy", 1),))


def agree_steps(topo: Topology, steps: int) -> dict[str, Any]:
    """Constant per-rank values; every step's agreed values, as each rank saw them."""
    agreement = Agreement(topo, FIELDS)
    seen = []
    for _ in range(steps):
        seen.append(
            agreement.agree(
                "test.step",
                pages=10 + topo.rank,
                acks=100 - topo.rank,
                busy=int(topo.rank == 1),
                done=int(topo.rank == 0),
            )
        )
    agreement.close()
    return {"seen": seen, "collectives": agreement.collectives, "pending": len(agreement.pending)}


def skip_a_sync(topo: Topology, skipper: int) -> str:
    sites = ("sync.first", "sync.second", "sync.third", "sync.fourth")
    agreement = Agreement(topo, FIELDS, sites=sites)
    values = dict(pages=1, acks=1, busy=0, done=0)
    agreement.agree("sync.first", **values)
    if topo.rank != skipper:
        agreement.agree("sync.second", **values)
    agreement.agree("sync.third", **values)
    agreement.agree("sync.fourth", **values)
    return "no error"


def many_steps(topo: Topology, steps: int, jitter_rank: int) -> dict[str, int]:
    """Write-ack style: acks grow at different paces per stage; all apply the same counts."""
    agreement = Agreement(topo, Fields(min=("acks",)))
    applied = []
    worst_pending = 0
    for step in range(steps):
        if topo.rank == jitter_rank and step % 50 == 0:
            time.sleep(0.01)  # this stage's acks (and steps) lag now and then
        local = step // (2 if topo.pp_rank else 1)  # stages finish backups at different rates
        agreed = agreement.agree("acks", acks=local)["acks"]
        assert agreed <= local, "a rank was told more backups finished than it has"
        applied.append(agreed)
        worst_pending = max(worst_pending, len(agreement.pending))
    agreement.close()
    return {"last": applied[-1], "sum": sum(applied), "worst_pending": worst_pending}


def sleep_then_agree(topo: Topology) -> str:
    agreement = Agreement(topo, FIELDS)
    values = dict(pages=1, acks=1, busy=0, done=0)
    for _ in range(1000):
        agreement.agree("loop", **values)
        time.sleep(0.01)
    return "finished"
