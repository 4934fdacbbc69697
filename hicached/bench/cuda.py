"""CUDA path: GPU <-> pool slots through the pinned (registered) mapping.

Baselines in the same run, same bytes and slot order: a copy between the
GPU tensor and a torch pinned host tensor (what the best staging buffer
could do), and the same slot copies before the pool is registered
(pageable memory). Slots are taken in allocation order (one run) and
shuffled (one DMA per page). Each copy is timed in pairs of rounds with its
baseline, who goes first alternating (bench/paired.py).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import numpy as np

from hicached.bench.control import _daemon
from hicached.bench.data import reserve_slots
from hicached.bench.paired import Paired
from hicached.client import Client


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench cuda needs a CUDA device")
    pages, page_bytes = args.pages, args.page_bytes
    nbytes = pages * page_bytes
    device = torch.device("cuda")

    gpu = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, device=device)
    back = torch.empty_like(gpu)
    pinned = torch.empty((pages, page_bytes), dtype=torch.uint8, pin_memory=True)
    paired = Paired(nbytes, sync=torch.cuda.synchronize)

    def d2h() -> object:  # the baseline of writes: GPU -> a torch pinned buffer
        return pinned.copy_(gpu, non_blocking=True)

    def h2d() -> object:  # the baseline of reads: a torch pinned buffer -> GPU
        return back.copy_(pinned, non_blocking=True)

    with _daemon(args.endpoint) as endpoint, Client(endpoint, timeout=10.0) as client:
        ns, res, tokens = reserve_slots(client, "bench/cuda", pages, page_bytes)
        order = np.random.default_rng(1).permutation(pages).tolist()
        writes = {"": res, "_scattered": res.select(order)}
        for state in ("pageable", "pinned"):
            if state == "pinned":
                client.pin_memory()
            for tag, handle in writes.items():
                paired.measure(
                    f"{state}_write{tag}",
                    functools.partial(client.write_pages, handle, gpu),
                    d2h,
                    "raw_d2h_pinned",
                )
        client.write_pages(res, gpu)
        client.commit(res)
        hit = client.match(ns, tokens)
        reads = {"": hit, "_scattered": hit.select(order)}
        for state in ("pinned", "pageable"):
            if state == "pageable":
                client.unpin_memory()
            for tag, got in reads.items():
                paired.measure(
                    f"{state}_read{tag}",
                    functools.partial(client.read_pages, got, back),
                    h2d,
                    "raw_h2d_pinned",
                )
        client.read_pages(hit, back)
        assert torch.equal(gpu, back), "a GPU round trip through the pool lost bytes"
        assert torch.equal(
            torch.from_numpy(client.read_pages(reads["_scattered"])), gpu[order].cpu()
        ), "the pool holds other bytes than the GPU sent"
        client.release(hit)
    figures = paired.result()
    return {
        "figures": figures,
        "params": {
            "pages": pages,
            "page_bytes": page_bytes,
            "bytes": nbytes,
            "pairs": paired.pairs,
            "device": torch.cuda.get_device_name(),
        },
        "targets": {"pinned_write_vs_raw": ">= 0.9", "pinned_read_vs_raw": ">= 0.9"},
    }
