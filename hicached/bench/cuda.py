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
        ns, res, tokens = reserve_slots(client, "bench/cuda", pages, page_bytes)
        order = np.random.default_rng(1).permutation(pages).tolist()
        writes = {"": res, "_scattered": res.select(order)}
        for state in ("pageable", "pinned"):
            if state == "pinned":
                client.pin_memory()
            for tag, handle in writes.items():
                figures[f"{state}_write{tag}_gbps"] = gbps(
                    functools.partial(client.write_pages, handle, gpu)
                )
        client.write_pages(res, gpu)
        client.commit(res)
        hit = client.match(ns, tokens)
        reads = {"": hit, "_scattered": hit.select(order)}
        for state in ("pinned", "pageable"):
            if state == "pageable":
                client.unpin_memory()
            for tag, got in reads.items():
                figures[f"{state}_read{tag}_gbps"] = gbps(
                    functools.partial(client.read_pages, got, back)
                )
        client.read_pages(hit, back)
        assert torch.equal(gpu, back), "a GPU round trip through the pool lost bytes"
        assert torch.equal(
            torch.from_numpy(client.read_pages(reads["_scattered"])), gpu[order].cpu()
        ), "the pool holds other bytes than the GPU sent"
        client.release(hit)
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
