"""Data path: copying pages into and out of leased pool slots vs raw memcpy.

The baseline copies the same bytes between two plain, prefaulted numpy
buffers in this process, in rounds paired with each slot copy's (who goes
first alternates). Slot copies go through Client.write_pages and
Client.read_pages on the shared mapping, for slots in allocation order
(contiguous) and in a shuffled order (a gather/scatter of single pages), which
take the kernel the client picked for this process (client/gather.py). Both
kernels are also timed by themselves on the same shuffled slots
(``slot_gather_numpy`` ...), and ``gather`` reports the client's pick with the
rates of its own short measurement, so a pick can be checked against the
longer, paired figures of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from hicached.bench.control import _daemon
from hicached.bench.paired import Paired
from hicached.client import Client, Namespace, Reservation
from hicached.client.gather import GATHERS, KERNELS, SCATTERS, Kernel, gather_choice


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


def _kernels() -> tuple[Kernel, ...]:
    """The scattered-copy kernels this process can run (torch's only if loaded)."""
    return KERNELS if "torch" in sys.modules else ("numpy",)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Engines have torch loaded; the client then picks numpy's or torch's kernels.
    with contextlib.suppress(ImportError):
        importlib.import_module("torch")
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
        rows = client.mapping.arena.rows(page_bytes)
        slots = np.asarray(res_shuffled.offsets, dtype=np.int64) // page_bytes
        for name in _kernels():  # into the reservation's own slots, rewritten below
            measure(f"slot_scatter_{name}", partial(SCATTERS[name], rows, slots, src))
        client.write_pages(res, src)
        client.commit(res)
        hit = client.match(ns, tokens)
        hit_shuffled = hit.select(order)
        measure("slot_read", lambda: client.read_pages(hit, dst))
        measure("slot_read_scattered", lambda: client.read_pages(hit_shuffled, dst))
        for name in _kernels():
            measure(f"slot_gather_{name}", partial(GATHERS[name], rows, slots, dst))
        assert np.array_equal(client.read_pages(hit), src), "slot copy lost bytes"
        client.release(hit)
    figures = paired.result()
    choice = gather_choice()
    return {
        "figures": figures,
        # the client's pick for scattered copies, with the rates that decided it
        "gather": choice.as_dict() if choice is not None else {"how": "numpy: torch not loaded"},
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
