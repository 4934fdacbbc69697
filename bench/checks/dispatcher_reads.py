"""What the L3 dispatcher's call slots cost prefetch reads: hot 64 KiB pages
of a file store read through ``Dispatcher.get`` (every batch issued at once,
as prefetches issue them), against the same reads driven on the backend
directly with ``storage.concurrency`` calls at once (``hicached bench l3``'s
raw baseline), in turns, in one process. One JSON line: each one's GB/s
(medians of the rounds) and their ratio.

    PYTHONPATH=. .venv/bin/python bench/checks/dispatcher_reads.py [ROUNDS]

Two checkouts in alternating runs (``BASE_DIR NEW_DIR [RUNS]``, each run
importing hicached from its own; ``git worktree add --detach DIR COMMIT``):

    .venv/bin/python bench/checks/dispatcher_reads.py BASE_DIR NEW_DIR 5
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAGES, PAGE_BYTES = 1024, 64 << 10


async def measure(rounds: int) -> dict[str, float]:
    import msgspec

    from hicached.bench.l3 import NS, Buffers, _drive
    from hicached.config import StorageConfig
    from hicached.daemon.dispatcher import Dispatcher
    from hicached_backends.file import FileBackend
    from hicached_backends.options import FileOptions

    with (
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(dir="/dev/shm") as pool,
    ):
        buf = Buffers(PAGES, PAGE_BYTES, Path(pool))
        options = FileOptions(path=str(Path(tmp) / "store"), capacity_mib=256, segment_mib=32)
        backend = FileBackend(options, buf.env(Path(tmp)))
        config = msgspec.convert({"backend": "file"}, StorageConfig)
        dispatcher = Dispatcher(backend, config, "file")
        await dispatcher.start()
        try:
            await _drive(backend, "put", buf.refs(buf.src), config)
            step = config.batch_pages

            async def through_dispatcher() -> float:
                refs = buf.refs(buf.dst)
                started = time.perf_counter()
                batches = [refs[i : i + step] for i in range(0, len(refs), step)]
                got = await asyncio.gather(*(dispatcher.get(NS, b) for b in batches))
                assert all(all(r) for r in got), "a read failed"
                return time.perf_counter() - started

            await through_dispatcher()  # warm: page cache, readers
            await _drive(backend, "get", buf.refs(buf.dst), config)
            raw, ours = [], []
            for _ in range(rounds):
                raw.append(await _drive(backend, "get", buf.refs(buf.dst), config))
                ours.append(await through_dispatcher())
        finally:
            await dispatcher.stop(time.monotonic() + 5.0)
            buf.close()
    gb = PAGES * PAGE_BYTES / 1e9
    return {
        "raw_gbps": round(gb / statistics.median(raw), 3),
        "dispatcher_gbps": round(gb / statistics.median(ours), 3),
        "ratio": round(statistics.median(raw) / statistics.median(ours), 3),
    }


def alternate(base: str, new: str, runs: int) -> dict[str, object]:
    """Runs of each checkout in turns, each importing hicached from its own."""
    ratios: dict[str, list[float]] = {"base": [], "new": []}
    for _ in range(runs):
        for name, tree in (("base", base), ("new", new)):
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run(
                [sys.executable, __file__], env=env, capture_output=True, text=True, check=True
            )
            ratios[name].append(json.loads(out.stdout.splitlines()[-1])["ratio"])
    return {
        name: {"median": statistics.median(r), "low": min(r), "high": max(r), "runs": r}
        for name, r in ratios.items()
    }


if __name__ == "__main__":
    if len(sys.argv) >= 3:
        runs = int(sys.argv[3]) if len(sys.argv) > 3 else 5
        print(json.dumps(alternate(sys.argv[1], sys.argv[2], runs)))
    else:
        rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
        print(json.dumps(asyncio.run(measure(rounds))))
