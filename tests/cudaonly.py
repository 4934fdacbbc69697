"""A stand-in for an NCCL-only backend, for tests on machines without a GPU.

Importing this module registers ``cudaonly``: a backend that declares CUDA as
its only device (as NCCL does) and runs on gloo underneath. The rank
agreement decides what a group can carry from the declared devices alone, so
this exercises exactly the check an NCCL group meets; no real NCCL group can
be made without a GPU. Rank functions live here so that a spawned rank
imports (and so registers) it before its process group is made.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hicached.dist import Agreement, Fields, RankFailure, Topology

NAME = "cudaonly"


def _make(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _make, devices=["cuda"])

FIELDS = Fields(min=("pages",), max=("busy",))


def _refused(make: Any) -> str:
    try:
        make()
    except RankFailure as exc:
        return str(exc)
    return "accepted"


def _agree(topo: Topology) -> dict[str, int]:
    """The values agreed on the third step (with PP, stage 0 hears the last stage late)."""
    agreement = Agreement(topo, FIELDS)
    for _ in range(3):
        out = agreement.agree("cudaonly", pages=10 + topo.rank, busy=int(topo.rank == 1))
    agreement.close()
    return out


def engine_groups(topo: Topology) -> dict[str, Any]:
    """Default group gloo: an engine passes a CUDA-only group, a mixed one, a gloo one."""
    ranks = list(range(dist.get_world_size()))
    cuda_only = dist.new_group(ranks, backend=NAME)
    mixed = dist.new_group(ranks, backend=f"cpu:gloo,cuda:{NAME}")
    return {
        "attn": _refused(lambda: Topology.from_groups(tp_group=cuda_only, attn_group=cuda_only)),
        "tp": _refused(lambda: Topology.from_groups(tp_group=cuda_only)),
        "mixed": _agree(Topology.from_groups(tp_group=mixed, timeout=15)),
    }


def cuda_only_default(topo: Topology) -> dict[str, Any]:
    """Default group CUDA-only (as an engine that initialised NCCL): ``Topology.create``
    made gloo groups for itself; ``from_groups`` with PP needs a CPU group for the relay."""
    stage = topo.stage_size
    stage_groups = [dist.new_group(list(range(s * stage, (s + 1) * stage))) for s in range(2)]
    gloo_stage_groups = [
        dist.new_group(list(range(s * stage, (s + 1) * stage)), backend="gloo") for s in range(2)
    ]

    def wrap(attn: Any, relay: Any) -> Topology:
        return Topology.from_groups(
            tp_group=attn,  # TP is the whole stage here
            attn_group=attn,
            pp_rank=topo.pp_rank,
            pp_size=topo.pp_size,
            pp_prev=topo.pp_prev,
            pp_next=topo.pp_next,
            pp_group=relay,
            timeout=15,
        )

    mine = topo.pp_rank
    return {
        "default_backend": str(dist.get_backend_config()),
        "created": _agree(topo),
        "has_relay_group": topo.relay_group is not None,
        "stage_group": _refused(lambda: wrap(stage_groups[mine], topo.relay_group)),
        "no_relay_group": _refused(lambda: wrap(gloo_stage_groups[mine], None)),
        "with_relay_group": _agree(wrap(gloo_stage_groups[mine], topo.relay_group)),
    }
