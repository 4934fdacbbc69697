"""How long the event loop is held while the L2 pages L3 lacks are listed
(the writes of adopted pages after a restart, the write-back flush at a
stop): a cache with a million 64 KiB pages in sequences of 128, none in L3,
listed in one go (``Tiering.unwritten_pages``) and a batch at a time
(``unwritten_batches``, as the adoption pass lists them): the whole listing's
seconds each way, and the batches' milliseconds (first, median, longest) with
the interpreter's full collections that ran among them.

    PYTHONPATH=. .venv/bin/python bench/checks/unwritten_listing.py [PAGES]
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import numpy as np

from hicached.cache import Cache
from hicached.config import Config, PoolConfig, StorageConfig
from hicached.daemon.tier import _LIST_BATCH_PAGES
from hicached.wire import protocol as p
from hicached.wire.hashing import pack_tokens

PAGE_BYTES = 64 << 10
SEQUENCE_PAGES = 128


def main(pages: int) -> dict[str, object]:
    size_mib = pages * PAGE_BYTES >> 20
    config = Config(
        pool=PoolConfig(size_mib=size_mib, slab_mib=64, max_page_bytes=PAGE_BYTES),
        storage=StorageConfig(backend="memory"),
    )
    # the pool's bytes are never touched: its file need not exist
    cache = Cache(config, pool_path="/unused", gens=np.zeros(size_mib * 256 + 1, np.uint32))
    rid = b"bench"
    cache.handle(rid, p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR))
    spec = p.NamespaceSpec(
        model="bench/listing", kv_dtype="bf16", layout="l", page_tokens=1, page_bytes=PAGE_BYTES
    )
    ok = cache.handle(rid, p.RegisterNamespace(id=2, spec=spec))
    assert isinstance(ok, p.NamespaceOk)
    for start in range(0, pages, SEQUENCE_PAGES):
        tokens = pack_tokens(np.arange(start, start + SEQUENCE_PAGES, dtype=np.uint32))
        res = cache.handle(rid, p.Reserve(id=3, ns=ok.ns, tokens=tokens))
        assert isinstance(res, p.ReserveOk) and len(res.offsets) == SEQUENCE_PAGES, res
        done = cache.handle(rid, p.Commit(id=4, lease=res.lease))
        assert isinstance(done, p.CommitOk)
    tiering = cache.tiering
    started = time.perf_counter()
    whole = len(tiering.unwritten_pages())
    at_once = time.perf_counter() - started
    times, listed, full = [], 0, [0]

    def count_full(phase: str, info: dict[str, int]) -> None:
        full[0] += phase == "stop" and info["generation"] == 2

    gc.callbacks.append(count_full)
    started = time.perf_counter()
    batches = tiering.unwritten_batches(_LIST_BATCH_PAGES)
    while True:
        t = time.perf_counter()
        batch = next(batches, None)
        times.append(time.perf_counter() - t)
        if batch is None:
            break
        listed += len(batch)
    in_batches = time.perf_counter() - started
    gc.callbacks.remove(count_full)
    assert whole == listed == pages, (whole, listed, pages)
    return {
        "pages": pages,
        "batch_pages": _LIST_BATCH_PAGES,
        "at_once_s": round(at_once, 3),
        "in_batches_s": round(in_batches, 3),
        # the first batch takes each index's slot list; a batch during which the
        # interpreter's full collection ran is the longest
        "first_batch_ms": round(times[0] * 1e3, 2),
        "median_batch_ms": round(statistics.median(times) * 1e3, 2),
        "longest_batch_ms": round(max(times) * 1e3, 2),
        "full_collections": full[0],
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20)))
