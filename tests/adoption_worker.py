"""A client process for tests/test_adoption.py: stores sequences, reads back
earlier ones and prefetches them, across daemon restarts, without restarting.

Usage: python -m tests.adoption_worker ENDPOINT LOG WORKER SEQUENCES

Each sequence ``s`` is PAGES pages of PAGE_TOKENS tokens derived from ``s``;
page ``i``'s bytes are a pattern of (s, i). The log gets ``ACK s`` once a store
of all its pages was acknowledged, and ``LIE s i`` for a page read back with
bytes other than its own (there must never be one). Errors of a daemon that
is down or restarting are retried; the process ends after SEQUENCES stores.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np

from hicached.client import Client
from hicached.errors import HicachedError

PAGES = 4
PAGE_TOKENS = 4
PAGE_BYTES = 16384
SPEC = {
    "model": "test/adoption",
    "kv_dtype": "bf16",
    "layout": "flat",
    "page_tokens": PAGE_TOKENS,
    "page_bytes": PAGE_BYTES,
}


def tokens(s: int) -> list[int]:
    return [s * 1000 + t for t in range(PAGES * PAGE_TOKENS)]


def pattern(s: int, pages: int = PAGES) -> np.ndarray:
    rows = np.empty((pages, PAGE_BYTES), dtype=np.uint8)
    for i in range(pages):
        rows[i] = np.random.default_rng([s, i]).integers(0, 256, PAGE_BYTES, dtype=np.uint8)
    return rows


def main(endpoint: str, log_path: str, worker: int, sequences: int) -> None:
    rng = random.Random(worker)
    acked: list[int] = []
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - one line each, as it happens
    client = Client(endpoint, timeout=2.0, name=f"adoption-{worker}")
    ns = None
    i = 0
    while i < sequences:
        try:
            if ns is None:  # the daemon may be down already: connecting is retried too
                ns = client.register(**SPEC)
            s = worker * 1_000_000 + i
            ok = client.store(ns, tokens(s), pattern(s))
            i += 1
            if ok.published + ok.duplicates == PAGES:
                acked.append(s)
                log.write(f"ACK {s}\n")
            if acked and rng.random() < 0.5:
                old = rng.choice(acked)
                hit = client.match(ns, tokens(old))
                try:
                    got = client.read_pages(hit)
                except HicachedError:
                    got = None  # a stale handle is a miss, not a lie
                finally:
                    client.release(hit)
                if got is not None:
                    want = pattern(old, len(got))
                    for j in range(len(got)):
                        if not np.array_equal(got[j], want[j]):
                            log.write(f"LIE {old} {j}\n")
            if acked and rng.random() < 0.2:
                assert ns is not None
                fetch = client.prefetch(ns, tokens(rng.choice(acked)))
                client.release(fetch)
        except HicachedError:
            time.sleep(0.02)  # the daemon is down or restarting: go on when it is back
    log.write("DONE\n")
    log.close()
    client.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
