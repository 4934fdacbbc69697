"""CUDA path: GPU <-> pool slots through the pinned (registered) mapping.

Baselines in the same run, same bytes and slot order: a copy between the
GPU tensor and a torch pinned host tensor (what the best staging buffer
could do), and the same slot copies before the pool is registered
(pageable memory). Slots are taken in allocation order (one run) and
shuffled (one DMA per page).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hicached.bench.control import _daemon
from hicached.bench.data import reserve_slots
from hicached.client import Client

REPEATS = 15


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench cuda needs a CUDA device")
    pages, page_bytes = args.pages, args.page_bytes
    nbytes = pages * page_bytes
    device = torch.device("cuda")

    def gbps(fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return round(nbytes / float(np.median(times)) / 1e9, 2)

    gpu = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, device=device)
    back = torch.empty_like(gpu)
    pinned = torch.empty((pages, page_bytes), dtype=torch.uint8, pin_memory=True)
    figures: dict[str, float] = {
        "raw_d2h_pinned_gbps": gbps(lambda: pinned.copy_(gpu, non_blocking=True)),
        "raw_h2d_pinned_gbps": gbps(lambda: back.copy_(pinned, non_blocking=True)),
    }
    with _daemon(args.endpoint) as endpoint, Client(endpoint, timeout=10.0) as client:
        ns, res = reserve_slots(client, "bench/cuda", pages, page_bytes)
        offsets = res.offsets
        shuffled = [int(x) for x in np.random.default_rng(1).permutation(offsets)]
        orders = {"": offsets, "_scattered": shuffled}
        for state in ("pageable", "pinned"):
            if state == "pinned":
                client.pin_memory()
            for tag, order in orders.items():
                figures[f"{state}_write{tag}_gbps"] = gbps(
                    functools.partial(client.write_pages, ns, order, gpu)
                )
                figures[f"{state}_read{tag}_gbps"] = gbps(
                    functools.partial(client.read_pages, ns, order, back)
                )
        client.write_pages(ns, shuffled, gpu)
        client.read_pages(ns, shuffled, back)
        assert torch.equal(gpu, back), "a GPU round trip through the pool lost bytes"
        assert torch.equal(torch.from_numpy(client.read_pages(ns, shuffled)), gpu.cpu()), (
            "the pool holds other bytes than the GPU sent"
        )
        client.abort(res)
    for key in list(figures):
        if key.startswith(("pinned_", "pageable_")):
            raw = figures["raw_d2h_pinned_gbps" if "_write" in key else "raw_h2d_pinned_gbps"]
            figures[key.replace("_gbps", "_vs_raw")] = round(figures[key] / raw, 3)
    return {
        "figures": figures,
        "params": {
            "pages": pages,
            "page_bytes": page_bytes,
            "bytes": nbytes,
            "repeats": REPEATS,
            "device": torch.cuda.get_device_name(),
        },
        "targets": {"pinned_write_vs_raw": ">= 0.9", "pinned_read_vs_raw": ">= 0.9"},
    }
