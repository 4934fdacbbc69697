"""What the pool journal costs the daemon: reserve + commit of 64-page
sequences (64 tokens, 4 KiB pages) through the cache's own request handling,
with the journal's recorder (whose records are taken after each reply, as the
request loop writes them) and without it, in turns, in one process.

    PYTHONPATH=. .venv/bin/python bench/checks/journal_cost.py
"""

from __future__ import annotations

import json
import time

import numpy as np

from hicached.cache import Cache
from hicached.cache.journal import Recorder
from hicached.config import Config, PoolConfig
from hicached.wire import protocol as p
from hicached.wire.hashing import pack_tokens

SEQUENCES = 1500


def commit_us(journal: Recorder | None) -> float:
    """Microseconds per reserve + commit of one 64-page sequence."""
    config = Config(pool=PoolConfig(size_mib=512, slab_mib=64, max_page_bytes=65536))
    cache = Cache(config, pool_path="/unused", journal=journal)
    rid = b"bench"
    cache.handle(rid, p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR))
    spec = p.NamespaceSpec(
        model="bench/journal", kv_dtype="bf16", layout="l", page_tokens=64, page_bytes=4096
    )
    ok = cache.handle(rid, p.RegisterNamespace(id=2, spec=spec))
    assert isinstance(ok, p.NamespaceOk)
    started = time.perf_counter()
    for i in range(SEQUENCES):
        tokens = pack_tokens(np.arange(i * 4096, (i + 1) * 4096, dtype=np.uint32))
        res = cache.handle(rid, p.Reserve(id=3, ns=ok.ns, tokens=tokens))
        assert isinstance(res, p.ReserveOk)
        cache.handle(rid, p.Commit(id=4, lease=res.lease, pages=-1))
        if journal is not None:
            journal.take()  # what the request loop writes before the reply
    return (time.perf_counter() - started) / SEQUENCES * 1e6


def main() -> dict[str, object]:
    rounds = []
    for _ in range(3):
        without, with_ = commit_us(None), commit_us(Recorder())
        rounds.append({"without_us": round(without, 1), "with_us": round(with_, 1)})
    ratios = sorted(r["with_us"] / r["without_us"] for r in rounds)  # type: ignore[operator]
    return {"rounds": rounds, "ratio_median": round(ratios[1], 3)}


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
