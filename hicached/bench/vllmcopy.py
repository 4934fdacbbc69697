"""vLLM-shaped GPU <-> pool copies (part of ``hicached bench cuda``).

vLLM's KV is one GPU tensor per layer, rows by block id; a page of its
namespace is one block of every layer. A store gathers the blocks of a
request, scattered over the tensors, into pages; a load scatters pages back
into other blocks. Two shapes, as measured on the H200 host (PERF-NOTES.md):
32 layers of 1024 blocks of 64 KiB, 64 random blocks into 64 pages of 2 MiB;
and 64 layers of 16 KiB blocks, 128 random blocks into 128 pages of 1 MiB.

Each copy is timed in pairs of rounds with one contiguous copy of the same
bytes between the GPU and a torch pinned buffer (the link's limit), by the
table kernel and by the ways from before it (client/cuda.py), and reports
which way each one went.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from hicached.bench.paired import Paired
from hicached.client import Client

# name -> (layers, bytes a block, blocks a layer, pages copied)
SHAPES = {
    "vllm_32x64k": (32, 64 << 10, 1024, 64),
    "vllm_64x16k": (64, 16 << 10, 1024, 128),
}


# Copies queued back to back in the streamed figures, as an engine's worker
# queues them (integrations/vllm/worker.py waits for none before the next).
STREAM = 8


def streamed(start: Callable[[], Any]) -> Callable[[], object]:
    """``STREAM`` copies started back to back, then each finished (its fence
    checked): what a worker that does not wait between copies sees, the CPU
    work of one copy overlapping the bytes of the one before."""

    def run() -> object:
        pending = [start() for _ in range(STREAM)]
        for copy in pending:
            copy.result()
        return pending

    return run


def repeated(copy: Callable[[], object]) -> Callable[[], object]:
    """The baseline of a streamed figure: ``STREAM`` copies queued back to back."""
    return lambda: [copy() for _ in range(STREAM)]


def run_shapes(client: Client, pairs: int = 15) -> dict[str, Any]:
    """Every shape, each way; the pool must be pinned (``client.pin_memory()``)."""
    import torch

    from hicached.client import cuda, kernel

    out: dict[str, Any] = {"table_kernel": kernel.unusable() or "on"}
    try:
        for name, shape in SHAPES.items():
            out[name] = _shape(client, name, *shape, pairs=pairs)
            torch.cuda.empty_cache()  # the shape's tensors are gone: give their memory back
    finally:
        cuda.TABLE_KERNEL = True
    return out


def _shape(
    client: Client, name: str, layers: int, block: int, blocks: int, pages: int, *, pairs: int
) -> dict[str, Any]:
    import torch

    from hicached.client import cuda

    page_bytes = layers * block
    nbytes = pages * page_bytes
    rng = np.random.default_rng(0)
    kv = [
        torch.randint(0, 256, (blocks, block), dtype=torch.uint8, device="cuda")
        for _ in range(layers)
    ]
    back = [torch.zeros_like(t) for t in kv]
    rows = rng.choice(blocks, pages, replace=False)
    back_rows = rng.choice(blocks, pages, replace=False)
    flat = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, device="cuda")
    pinned = torch.empty((pages, page_bytes), dtype=torch.uint8, pin_memory=True)
    paired = Paired(nbytes, pairs=pairs, sync=torch.cuda.synchronize)
    stream = Paired(nbytes * STREAM, pairs=pairs, sync=torch.cuda.synchronize)

    def d2h() -> object:  # the writes' baseline: one contiguous copy into a pinned buffer
        return pinned.copy_(flat, non_blocking=True)

    def h2d() -> object:
        return flat.copy_(pinned, non_blocking=True)

    ns = client.register(
        model=f"bench/{name}",
        kv_dtype="uint8",
        layout="layer_first",
        page_tokens=16,
        page_bytes=page_bytes,
        key_scheme="vllm-sha256",
    )
    keys = [hashlib.sha256(b"%s %d" % (name.encode(), i)).digest() + bytes(4) for i in range(pages)]
    res = client.reserve_keys(ns, keys)
    if len(res.offsets) != pages:
        client.abort(res)
        raise SystemExit(f"the pool gave {len(res.offsets)} of {pages} slots; use a larger pool")
    paths: dict[str, str] = {}
    for way in ("kernel", "fallback"):
        cuda.TABLE_KERNEL = way == "kernel"
        started = client.start_write(res, kv, rows=rows)
        paths[f"write_{way}"] = started.path
        started.result()
        write = functools.partial(client.write_pages, res, kv, rows=rows)
        paired.measure(f"write_{way}", write, d2h, "raw_d2h_pinned")
        start = functools.partial(client.start_write, res, kv, rows=rows)
        stream.measure(f"write_{way}_streamed", streamed(start), repeated(d2h), "raw_d2h_streamed")
    client.commit(res)
    hit = client.match_keys(ns, keys)
    equal = True
    for way in ("kernel", "fallback"):
        cuda.TABLE_KERNEL = way == "kernel"
        for t in back:
            t.zero_()
        started = client.start_read(hit, back, rows=back_rows)
        paths[f"read_{way}"] = started.path
        started.result()
        equal = equal and all(
            torch.equal(b[back_rows], k[rows]) for b, k in zip(back, kv, strict=True)
        )
        read = functools.partial(client.read_pages, hit, back, rows=back_rows)
        paired.measure(f"read_{way}", read, h2d, "raw_h2d_pinned")
        start = functools.partial(client.start_read, hit, back, rows=back_rows)
        stream.measure(f"read_{way}_streamed", streamed(start), repeated(h2d), "raw_h2d_streamed")
    client.release(hit)
    return {
        "figures": {**paired.result(), **stream.result()},
        "paths": paths,
        "bytes_equal": equal,
        "params": {
            "layers": layers,
            "block_bytes": block,
            "blocks": blocks,
            "pages": pages,
            "page_bytes": page_bytes,
            "bytes": nbytes,
        },
        "targets": {"write_kernel_vs_raw": ">= 0.9", "read_kernel_vs_raw": ">= 0.9"},
    }
