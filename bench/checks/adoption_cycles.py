"""Pages matched after a restart / pages committed before it, over many
restarts: three client processes (tests/adoption_worker.py) store, read back
and prefetch while the daemon is stopped at random moments, N times with
kill -9 and N times with SIGTERM, and started again to adopt its pool. After
each restart every sequence acknowledged before the stop is matched. One JSON
object: per way of stopping, the cycles, pages committed before the stops,
pages matched after them, their ratio, and reads with another key's bytes
(there must be none).

    PYTHONPATH=. .venv/bin/python bench/checks/adoption_cycles.py [N]
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hicached.testing import DaemonProcess
from tests.adoption_worker import PAGES, SPEC, pattern, tokens

ROOT = Path(__file__).resolve().parents[2]


def acknowledged(logs: list[Path]) -> tuple[list[int], int]:
    acked, lies = [], 0
    for log in logs:
        for line in log.read_text().splitlines():
            if line.startswith("ACK"):
                acked.append(int(line.split()[1]))
            lies += line.startswith("LIE")
    return acked, lies


def matched(d: DaemonProcess, sequences: list[int]) -> int:
    pages = 0
    with d.client(timeout=30) as c:
        ns = c.register(**SPEC)
        for s in sequences:
            hit = c.match(ns, tokens(s))
            try:
                got = c.read_pages(hit)
                ok = sum(1 for i in range(len(got)) if (got[i] == pattern(s)[i]).all())
                pages += ok
            finally:
                c.release(hit)
    return pages


def run(cycles: int) -> dict[str, object]:
    tmp = Path(tempfile.mkdtemp(prefix="hc-cycles-"))
    d = DaemonProcess(fresh=False, size_mib=512, max_page_bytes=1 << 20)
    d.start()
    logs = [tmp / f"worker{w}.log" for w in range(3)]
    for log in logs:
        log.touch()
    per = 40 * cycles  # sequences each worker stores: the pool holds them all
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.adoption_worker", d.endpoint, str(log), str(w), str(per)],
            cwd=ROOT,
            stderr=subprocess.DEVNULL,
        )
        for w, log in enumerate(logs)
    ]
    rng = random.Random(1)
    out: dict[str, dict[str, float]] = {
        how: {"cycles": 0, "committed_pages": 0, "matched_pages": 0} for how in ("kill9", "sigterm")
    }
    try:
        for cycle in range(2 * cycles):
            how = "kill9" if cycle % 2 == 0 else "sigterm"
            time.sleep(rng.uniform(0.1, 1.0))
            if how == "kill9":
                d.kill()
            else:
                d.stop()
            before, _ = acknowledged(logs)
            d.start()
            figures = out[how]
            figures["cycles"] += 1
            figures["committed_pages"] += PAGES * len(before)
            figures["matched_pages"] += matched(d, before)
        for worker in workers:
            worker.wait(600)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        d.cleanup()
    _, lies = acknowledged(logs)
    for figures in out.values():
        figures["ratio"] = round(figures["matched_pages"] / max(1, figures["committed_pages"]), 6)
    return {"stops": out, "reads_with_other_bytes": lies}


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 20), indent=2))
