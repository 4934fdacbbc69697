"""Data path: copying pages into and out of leased pool slots vs raw memcpy.

The baseline copies the same bytes between two plain, prefaulted numpy
buffers in this process, in rounds paired with each slot copy's (who goes
first alternates). Slot copies go through Client.write_pages and
Client.read_pages on the shared mapping, for slots in allocation order
(contiguous) and in a shuffled order (a gather/scatter of single pages).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hicached.bench.control import _daemon
from hicached.bench.paired import Paired
from hicached.client import Client, Namespace, Reservation


def reserve_slots(
    client: Client, model: str, pages: int, page_bytes: int
) -> tuple[Namespace, Reservation, np.ndarray]:
    """A namespace of ``page_bytes`` pages, a reservation of ``pages`` fresh slots and
    the tokens it is for."""
    ns = client.register(
        model=model,
        kv_dtype="bfloat16",
        layout="layer_first",
        page_tokens=16,
        page_bytes=page_bytes,
    )
    tokens = np.arange(pages * 16, dtype=np.uint32) + int(time.time())
    res = client.reserve(ns, tokens)
    if len(res.offsets) < pages:
        client.abort(res)
        raise SystemExit(f"the pool gave {len(res.offsets)} of {pages} slots; use a larger pool")
    return ns, res, tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Engines have torch loaded; the client then gathers scattered pages with it.
    with contextlib.suppress(ImportError):
        import torch
    pages, page_bytes = args.pages, args.page_bytes
    nbytes = pages * page_bytes
    src = np.random.default_rng(0).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    dst = np.ones_like(src)
    with _daemon(args.endpoint) as endpoint, Client(endpoint, timeout=10.0) as client:
        ns, res, tokens = reserve_slots(client, "bench/data", pages, page_bytes)
        order = np.random.default_rng(1).permutation(pages).tolist()
        res_shuffled = res.select(order)
        paired = Paired(nbytes, against="memcpy")

        def measure(name: str, fn: Callable[[], object]) -> None:
            paired.measure(name, fn, lambda: np.copyto(dst, src), "memcpy")

        measure("slot_write", lambda: client.write_pages(res, src))
        measure("slot_write_scattered", lambda: client.write_pages(res_shuffled, src))
        client.write_pages(res, src)
        client.commit(res)
        hit = client.match(ns, tokens)
        hit_shuffled = hit.select(order)
        measure("slot_read", lambda: client.read_pages(hit, dst))
        measure("slot_read_scattered", lambda: client.read_pages(hit_shuffled, dst))
        if "torch" in sys.modules:  # the gather above used torch; measure numpy's too
            torch = sys.modules.pop("torch")
            try:
                measure("slot_read_scattered_numpy", lambda: client.read_pages(hit_shuffled, dst))
            finally:
                sys.modules["torch"] = torch
        assert np.array_equal(client.read_pages(hit), src), "slot copy lost bytes"
        client.release(hit)
    figures = paired.result()
    return {
        "figures": figures,
        "params": {
            "pages": pages,
            "page_bytes": page_bytes,
            "bytes": nbytes,
            "pairs": paired.pairs,
            "note": "each copy and memcpy in pairs of rounds that alternate who goes first; "
            "GB/s: medians; _vs_memcpy: the median per-pair ratio, with its lowest and highest",
        },
        "targets": {"slot_write_vs_memcpy": ">= 0.9", "slot_read_vs_memcpy": ">= 0.9"},
    }
