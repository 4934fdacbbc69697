"""Adoption: how long a restarted daemon takes to serve the pool it adopted.

For each case (a pool of ``--pool-mib`` MiB in pages of ``--page-bytes``, and a
pool of a million 4 KiB pages), a real daemon's pool is filled with committed
pages (whole sequences of 1,024 pages; the bytes are whatever the slots hold:
only counts and times matter here), then the daemon is stopped (SIGTERM, and
kill -9) and started again, adopting the pool:

- ``ready_s``: from the start of the new process until it answers a request;
- ``first_hit_s``: until a match of a sequence stored before the stop hits;
- ``served``: pages matched after the restart / pages committed before it;

beside the raw baseline of the same run: a fresh start with a new pool of the
same size (``fresh_ready_s``), which is what a restart cost before adoption.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from hicached.client import Client
from hicached.testing import DaemonProcess

CHAIN = 1024  # pages a stored sequence has


def _sequence(i: int, pages: int = CHAIN) -> np.ndarray:
    return (np.arange(pages, dtype=np.uint32) + np.uint32(i) * np.uint32(CHAIN)) | np.uint32(
        1 << 31
    )


def _spec(page_bytes: int) -> dict[str, Any]:
    return dict(
        model="bench/adopt", kv_dtype="bfloat16", layout="l", page_tokens=1, page_bytes=page_bytes
    )


def _fill(client: Client, ns: Any, sequences: int) -> int:
    committed = 0
    for i in range(sequences):
        res = client.reserve(ns, _sequence(i))
        ok = client.commit(res)
        committed += ok.published
    return committed


def _served(client: Client, ns: Any, sequences: int) -> int:
    return sum(client.match(ns, _sequence(i), lease=False).hits for i in range(sequences))


def _restart(d: DaemonProcess, how: str, ns_spec: dict[str, Any]) -> tuple[float, float]:
    """Stop ``d`` as ``how`` says, start it again; (ready_s, first_hit_s)."""
    if how == "sigterm":
        d.stop()
    else:
        d.kill()
    started = time.perf_counter()
    d.start(timeout=600)
    ready = time.perf_counter() - started
    with Client(d.endpoint, timeout=60) as c:
        ns = c.register(**ns_spec)
        while c.match(ns, _sequence(0), lease=False).hits == 0:
            time.sleep(0.001)
    return ready, time.perf_counter() - started


def _case(mib: int, page_bytes: int) -> dict[str, Any]:
    slab_mib = max(64, page_bytes >> 20)
    sequences = int((mib << 20) * 0.95) // (page_bytes * CHAIN)
    spec = _spec(page_bytes)
    d = DaemonProcess(
        fresh=True,
        size_mib=mib,
        slab_mib=slab_mib,
        max_page_bytes=page_bytes,
        metrics="enabled = false",
    )
    try:
        started = time.perf_counter()
        d.start(timeout=600)
        fresh_ready = time.perf_counter() - started
        with Client(d.endpoint, timeout=60) as c:
            committed = _fill(c, c.register(**spec), sequences)
        d.fresh = False
        out: dict[str, Any] = {
            "pool_mib": mib,
            "page_bytes": page_bytes,
            "pages": committed,
            "fresh_ready_s": round(fresh_ready, 3),
        }
        for how in ("sigterm", "kill9"):
            ready, first = _restart(d, how, spec)
            with Client(d.endpoint, timeout=60) as c:
                served = _served(c, c.register(**spec), sequences)
                adopted = c.stats().adopted_pages
            out[how] = {
                "ready_s": round(ready, 3),
                "first_hit_s": round(first, 3),
                "adopted_pages": adopted,
                "served": round(served / committed, 6) if committed else 0.0,
                "ready_vs_fresh": round(ready / fresh_ready, 3),
            }
        return out
    finally:
        d.cleanup()


def run(args: argparse.Namespace) -> dict[str, Any]:
    cases = [_case(args.pool_mib, args.page_bytes)]
    million = getattr(args, "million", True)
    if million:
        cases.append(_case(4096, 4096))  # a million pages of 4 KiB
    return {"cases": cases}
