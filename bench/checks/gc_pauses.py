"""How long the interpreter's garbage collections hold the daemon's loop with a
daemon-sized index, with the collector as the interpreter leaves it and as the
daemon tunes it (server.gc_freeze, daemon/collector.py), in alternating trials,
each in a fresh process (what a freeze leaves behind would carry over).

A trial builds a cache as the daemon does (``Cache``, one key-addressed
namespace: one index entry a page, as vLLM's and SGLang's pages are; or, with
KIND ``tokens``, a token namespace) and does,
with the daemon's ``Collector`` hooked (it freezes only when tuned):
- fill: store PAGES pages, in sequences of 128 keys, into a pool of PAGES slots;
- churn: store PAGES/2 more (each evicts the least recently used pages) and
  match each stored sequence once: as many objects made as freed, so the
  interpreter, which counts what was made less what was freed, seldom collects;
- listing: list the pages L3 lacks (all of them: no store) a batch at a time,
  as the adoption pass does, then in one go, as the write-back flush at a stop
  does (bench/checks/unwritten_listing.py): objects made by the million.
Churn and listing are the fixed workload whose holds are compared.
A "hold" is one collection, from the collector's start callback to its stop.
For each phase and way: the longest hold and their sum (ms), the full
collections, medians over the trials with their spread (min..max); ratios of
each way's medians to the untuned ones; the phases' wall seconds.

    PYTHONPATH=. .venv/bin/python bench/checks/gc_pauses.py [PAGES] [ROUNDS] [keys|tokens]
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PAGE_BYTES = 4096
SEQUENCE_PAGES = 128
_FIGURES = ("longest_ms", "sum_ms", "full_collections", "longest_young_ms", "wall_s")
WAYS = ("untuned", "thresholds", "tuned")
THRESHOLDS = (50000, 20, 100)  # a raise seen in services: young collections 70x rarer


def _keys(sequence: int) -> list[bytes]:
    base = sequence * SEQUENCE_PAGES
    return [(base + i).to_bytes(16, "little") for i in range(SEQUENCE_PAGES)]


def trial(
    pages: int, tuned: bool, thresholds: tuple[int, ...] = (), keyed: bool = True
) -> dict[str, object]:
    """One trial in this process; the figures of each phase. ``thresholds``:
    the interpreter's, set instead of its own (untuned otherwise). ``keyed``:
    a key-addressed namespace, else a token one (the radix tree: one node a
    sequence, the slot map a million references)."""
    from hicached.cache import Cache
    from hicached.config import Config, PoolConfig, StorageConfig
    from hicached.daemon.collector import Collector
    from hicached.daemon.tier import _LIST_BATCH_PAGES
    from hicached.wire import protocol as p
    from hicached.wire.hashing import pack_tokens

    if thresholds:
        gc.set_threshold(*thresholds)
    holds: list[tuple[int, float]] = []
    collector = Collector(freeze=tuned)
    due: list[Callable[[], None]] = []  # what the daemon's loop would run next
    collector.schedule = due.append

    def turn() -> None:
        """The loop's turn between two requests (or two batches of a listing)."""
        while due:
            due.pop()()
        collector.stored(cache.committed_pages)  # the daemon's sweep, 4 times a second

    collector.on_pause = lambda generation, seconds: holds.append((generation, seconds))
    collector.start()
    size_mib = -(-pages * PAGE_BYTES >> 20)
    config = Config(
        pool=PoolConfig(size_mib=size_mib, slab_mib=1, max_page_bytes=PAGE_BYTES),
        storage=StorageConfig(backend="memory"),  # pages L3 lacks are listed
    )
    # the pool's bytes are never touched: its file need not exist
    cache = Cache(config, pool_path="/unused", gens=np.zeros(size_mib * 256 + 1, np.uint32))
    rid = b"bench"
    cache.handle(rid, p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR))
    spec = p.NamespaceSpec(
        model="bench/gc",
        kv_dtype="bf16",
        layout="l",
        page_tokens=1,
        page_bytes=PAGE_BYTES,
        **({"key_scheme": "vllm-sha256"} if keyed else {}),  # type: ignore[arg-type]
    )
    ok = cache.handle(rid, p.RegisterNamespace(id=2, spec=spec))
    assert isinstance(ok, p.NamespaceOk), ok
    collector.settle("started")  # as the daemon does before it serves

    def store(sequence: int) -> None:
        if keyed:
            keys = _keys(sequence)
            res = cache.handle(rid, p.ReserveKeys(id=3, ns=ok.ns, keys=keys))
            match: p.Request = p.MatchKeys(id=5, ns=ok.ns, keys=keys, lease=False)
        else:
            base = sequence * SEQUENCE_PAGES
            tokens = pack_tokens(np.arange(base, base + SEQUENCE_PAGES, dtype=np.uint32))
            res = cache.handle(rid, p.Reserve(id=3, ns=ok.ns, tokens=tokens))
            match = p.Match(id=5, ns=ok.ns, tokens=tokens, lease=False)
        assert isinstance(res, p.ReserveOk | p.ReserveKeysOk), res
        assert len(res.offsets) == SEQUENCE_PAGES, res.pool_full
        done = cache.handle(rid, p.Commit(id=4, lease=res.lease))
        assert isinstance(done, p.CommitOk), done
        hit = cache.handle(rid, match)
        assert isinstance(hit, p.MatchOk) and hit.hits == SEQUENCE_PAGES, hit
        turn()

    def listing() -> None:
        listed = 0
        for batch in cache.tiering.unwritten_batches(_LIST_BATCH_PAGES):
            listed += len(batch)
            turn()
        whole = cache.tiering.unwritten_pages()
        turn()
        assert listed == len(whole) == cache.stats().pages, (listed, len(whole))

    phases: dict[str, object] = {}
    filled = pages // SEQUENCE_PAGES
    for name, work in (
        ("fill", lambda: [store(s) for s in range(filled)]),
        ("churn", lambda: [store(s) for s in range(filled, filled + filled // 2)]),
        ("listing", listing),
    ):
        holds.clear()
        started = time.perf_counter()
        work()
        wall = time.perf_counter() - started
        full = [s for g, s in holds if g == 2]
        phases[name] = {
            "longest_ms": round(max((s for _, s in holds), default=0.0) * 1e3, 2),
            "sum_ms": round(sum(s for _, s in holds) * 1e3, 2),
            "full_collections": len(full),
            "longest_young_ms": round(max((s for g, s in holds if g < 2), default=0.0) * 1e3, 3),
            "wall_s": round(wall, 2),
        }
    stats = cache.stats()
    assert stats.pages == pages - pages % SEQUENCE_PAGES, (stats.pages, pages)
    phases["frozen_objects"] = gc.get_freeze_count()
    phases["freezes"] = collector.freezes
    collector.stop()
    return phases


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def main(pages: int, rounds: int, kind: str) -> dict[str, object]:
    runs: dict[str, list[dict[str, object]]] = {way: [] for way in WAYS}
    for i in range(rounds):
        # each way goes first in turn, so drift on a shared machine hits all
        for way in WAYS[i % 3 :] + WAYS[: i % 3]:
            out = subprocess.run(
                [sys.executable, __file__, "--trial", str(pages), way, kind],
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=1800,
            )
            runs[way].append(json.loads(out.stdout))
    result: dict[str, object] = {
        "pages": pages,
        "rounds": rounds,
        "kind": kind,
        "python": sys.version.split()[0],
        "thresholds": THRESHOLDS,
    }
    for phase in ("fill", "churn", "listing"):
        figures: dict[str, dict[str, object]] = {}
        for way, trials in runs.items():
            figures[way] = {
                key: _spread([float(t[phase][key]) for t in trials])  # type: ignore[index]
                for key in _FIGURES
            }
        for way in WAYS[1:]:
            figures[f"{way}_over_untuned"] = {
                key: _ratio(figures[way][key], figures["untuned"][key])
                for key in ("longest_ms", "sum_ms")
            }
        result[phase] = figures
    result["frozen_objects"] = {way: [t["frozen_objects"] for t in runs[way]] for way in runs}
    result["freezes"] = {way: [t["freezes"] for t in runs[way]] for way in runs}
    return result


def _ratio(new: object, base: object) -> float | None:
    n, b = new["median"], base["median"]  # type: ignore[index]
    return round(n / b, 3) if b else None


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trial":
        way = sys.argv[3]
        thresholds = THRESHOLDS if way == "thresholds" else ()
        keyed = sys.argv[4] == "keys"
        print(json.dumps(trial(int(sys.argv[2]), way == "tuned", thresholds, keyed)))
    else:
        args = sys.argv[1:]
        pages = int(args[0]) if args else 1 << 20
        rounds = int(args[1]) if len(args) > 1 else 3
        kind = args[2] if len(args) > 2 else "keys"
        if kind not in ("keys", "tokens"):
            raise SystemExit(f"kind {kind!r}: keys or tokens")
        print(json.dumps(main(pages, rounds, kind)))
