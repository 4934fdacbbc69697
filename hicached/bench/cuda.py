"""CUDA path: GPU <-> pool slots through the pinned (registered) mapping.

Baselines in the same run, same bytes and slot order: a copy between the
GPU tensor and a torch pinned host tensor (what the best staging buffer
could do), and the same slot copies before the pool is registered
(pageable memory). Slots are taken in allocation order (one run: DMA) and
shuffled (the table kernel, and ``_fallback``: the gather/scatter kernel it
replaces). Then vLLM-shaped copies (bench/vllmcopy.py). Each copy is timed in
pairs of rounds with its baseline, who goes first alternating
(bench/paired.py); ``paths`` says which way each copy went (client/cuda.py).
The ``*_streamed`` figures queue copies back to back and then finish them, as
the vLLM worker does (bench/vllmcopy.py), against as many raw copies queued so:
one copy's CPU work then overlaps the bytes of the one before.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import numpy as np

from hicached.bench.control import _daemon
from hicached.bench.data import reserve_slots
from hicached.bench.paired import Paired
from hicached.bench.vllmcopy import STREAM, repeated, run_shapes, streamed
from hicached.client import Client

# The vLLM shapes take 128 MiB of slots each, in slabs of their own page size.
POOL_MIB = 1024


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from hicached.client import cuda, kernel

    if not torch.cuda.is_available():
        raise SystemExit("bench cuda needs a CUDA device")
    pages, page_bytes = args.pages, args.page_bytes
    nbytes = pages * page_bytes
    device = torch.device("cuda")

    gpu = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, device=device)
    back = torch.empty_like(gpu)
    pinned = torch.empty((pages, page_bytes), dtype=torch.uint8, pin_memory=True)
    paired = Paired(nbytes, sync=torch.cuda.synchronize)
    stream = Paired(nbytes * STREAM, sync=torch.cuda.synchronize)  # bench/vllmcopy.py
    paths: dict[str, str] = {}

    def d2h() -> object:  # the baseline of writes: GPU -> a torch pinned buffer
        return pinned.copy_(gpu, non_blocking=True)

    def h2d() -> object:  # the baseline of reads: a torch pinned buffer -> GPU
        return back.copy_(pinned, non_blocking=True)

    def ways(state: str, tag: str) -> list[tuple[str, bool]]:
        """(suffix, table kernel on) for each way to time this copy."""
        both = state == "pinned" and tag == "_scattered"
        return [("", True), ("_fallback", False)] if both else [("", True)]

    with _daemon(args.endpoint, POOL_MIB) as endpoint, Client(endpoint, timeout=10.0) as client:
        ns, res, tokens = reserve_slots(client, "bench/cuda", pages, page_bytes)
        order = np.random.default_rng(1).permutation(pages).tolist()
        writes = {"": res, "_scattered": res.select(order)}
        try:
            for state in ("pageable", "pinned"):
                if state == "pinned":
                    client.pin_memory()
                for tag, handle in writes.items():
                    for suffix, table in ways(state, tag):
                        cuda.TABLE_KERNEL = table
                        name = f"{state}_write{tag}{suffix}"
                        started = client.start_write(handle, gpu)
                        paths[name] = started.path
                        started.result()
                        paired.measure(
                            name,
                            functools.partial(client.write_pages, handle, gpu),
                            d2h,
                            "raw_d2h_pinned",
                        )
                        if state == "pinned":
                            start = functools.partial(client.start_write, handle, gpu)
                            stream.measure(
                                f"{name}_streamed",
                                streamed(start),
                                repeated(d2h),
                                "raw_d2h_streamed",
                            )
            cuda.TABLE_KERNEL = True
            client.write_pages(res, gpu)
            client.commit(res)
            hit = client.match(ns, tokens)
            reads = {"": hit, "_scattered": hit.select(order)}
            for state in ("pinned", "pageable"):
                if state == "pageable":
                    client.unpin_memory()
                for tag, got in reads.items():
                    for suffix, table in ways(state, tag):
                        cuda.TABLE_KERNEL = table
                        name = f"{state}_read{tag}{suffix}"
                        started = client.start_read(got, back)
                        paths[name] = started.path
                        started.result()
                        paired.measure(
                            name,
                            functools.partial(client.read_pages, got, back),
                            h2d,
                            "raw_h2d_pinned",
                        )
                        if state == "pinned":
                            start = functools.partial(client.start_read, got, back)
                            stream.measure(
                                f"{name}_streamed",
                                streamed(start),
                                repeated(h2d),
                                "raw_h2d_streamed",
                            )
        finally:
            cuda.TABLE_KERNEL = True
        client.read_pages(hit, back)
        assert torch.equal(gpu, back), "a GPU round trip through the pool lost bytes"
        assert torch.equal(
            torch.from_numpy(client.read_pages(reads["_scattered"])), gpu[order].cpu()
        ), "the pool holds other bytes than the GPU sent"
        client.release(hit)
        client.pin_memory()
        shapes = run_shapes(client, paired.pairs)
    figures = {**paired.result(), **stream.result()}
    return {
        "figures": figures,
        "paths": paths,
        "table_kernel": kernel.unusable() or "on",
        "vllm": shapes,
        "params": {
            "pages": pages,
            "page_bytes": page_bytes,
            "bytes": nbytes,
            "pairs": paired.pairs,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": getattr(kernel.triton, "__version__", None),
        },
        "targets": {"pinned_write_vs_raw": ">= 0.9", "pinned_read_vs_raw": ">= 0.9"},
    }
