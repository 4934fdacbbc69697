"""Data path: copying pages into and out of leased pool slots vs raw memcpy.

The baseline copies the same bytes between two plain, prefaulted numpy
buffers in this process. Slot copies go through Client.write_pages and
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
from hicached.client import Client, Namespace, Reservation

REPEATS = 15


def _gbps(nbytes: int, fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(nbytes / float(np.median(times)) / 1e9, 2)


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
        figures = {
            "memcpy_gbps": _gbps(nbytes, lambda: np.copyto(dst, src)),
            "slot_write_gbps": _gbps(nbytes, lambda: client.write_pages(res, src)),
            "slot_write_scattered_gbps": _gbps(
                nbytes, lambda: client.write_pages(res_shuffled, src)
            ),
        }
        client.write_pages(res, src)
        client.commit(res)
        hit = client.match(ns, tokens)
        hit_shuffled = hit.select(order)
        figures["slot_read_gbps"] = _gbps(nbytes, lambda: client.read_pages(hit, dst))
        figures["slot_read_scattered_gbps"] = _gbps(
            nbytes, lambda: client.read_pages(hit_shuffled, dst)
        )
        if "torch" in sys.modules:  # the gather above used torch; measure numpy's too
            torch = sys.modules.pop("torch")
            try:
                figures["slot_read_scattered_numpy_gbps"] = _gbps(
                    nbytes, lambda: client.read_pages(hit_shuffled, dst)
                )
            finally:
                sys.modules["torch"] = torch
        assert np.array_equal(client.read_pages(hit), src), "slot copy lost bytes"
        client.release(hit)
    memcpy = figures["memcpy_gbps"]
    for name in [k[: -len("_gbps")] for k in list(figures) if k.startswith("slot_")]:
        figures[f"{name}_vs_memcpy"] = round(figures[f"{name}_gbps"] / memcpy, 3)
    return {
        "figures": figures,
        "params": {"pages": pages, "page_bytes": page_bytes, "bytes": nbytes, "repeats": REPEATS},
        "targets": {"slot_write_vs_memcpy": ">= 0.9", "slot_read_vs_memcpy": ">= 0.9"},
    }
