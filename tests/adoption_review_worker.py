"""A client process for tests/test_adoption_review.py: token and key-addressed
stores (commit masks included), reads, prefetches from L3 and their commits,
across daemon restarts, checking every byte it reads.

Usage: python -m tests.adoption_review_worker ENDPOINT LOG WORKER OPS

The log gets ``ACK t s`` (a token sequence whose store was acknowledged
whole), ``ACK k s MASK`` (a key-addressed store: MASK says which pages the
commit published) and ``LIE ...`` for a page read with bytes other than its
own (there must never be one). A daemon that is down or restarting is waited
out; the process ends after OPS operations.
"""

from __future__ import annotations

import hashlib
import random
import sys
import time

import numpy as np

from hicached.client import Client
from hicached.errors import HicachedError

PAGES = 4
PAGE_TOKENS = 4
PAGE_BYTES = 8192
TOKEN_SPEC = {
    "model": "test/review-tokens",
    "kv_dtype": "bf16",
    "layout": "flat",
    "page_tokens": PAGE_TOKENS,
    "page_bytes": PAGE_BYTES,
}
KEYED_SPEC = {**TOKEN_SPEC, "model": "test/review-keyed", "key_scheme": "vllm-sha256"}


def tokens(s: int) -> list[int]:
    return [s * 1000 + t for t in range(PAGES * PAGE_TOKENS)]


def keys(s: int) -> list[bytes]:
    out, parent = [], bytes(32)
    for i in range(PAGES):
        parent = hashlib.sha256(parent + s.to_bytes(8, "little") + bytes([i])).digest()
        out.append(parent + bytes(4))
    return out


def pattern(s: int, kind: str, pages: int = PAGES) -> np.ndarray:
    salt = 1 if kind == "k" else 0
    rows = np.empty((pages, PAGE_BYTES), dtype=np.uint8)
    for i in range(pages):
        rng = np.random.default_rng([s, i, salt])
        rows[i] = rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8)
    return rows


def check(log, what: str, s: int, got: np.ndarray, mask: list[bool] | None = None) -> None:
    want = pattern(s, what, len(got))
    for j in range(len(got)):
        if not np.array_equal(got[j], want[j]):
            log.write(f"LIE {what} {s} {j}\n")


def main(endpoint: str, log_path: str, worker: int, ops: int) -> None:
    rng = random.Random(worker)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - one line each, as it happens
    client = Client(endpoint, timeout=2.0, name=f"review-{worker}")
    tns = kns = None
    acked_t: list[int] = []
    acked_k: list[int] = []
    i = 0
    while i < ops:
        try:
            if tns is None or kns is None:  # the daemon may be down already: retried too
                tns = client.register(**TOKEN_SPEC)
                kns = client.register(**KEYED_SPEC)
            s = worker * 1_000_000 + i
            op = rng.random()
            i += 1
            if op < 0.3:
                ok = client.store(tns, tokens(s), pattern(s, "t"))
                if ok.published + ok.duplicates == PAGES:
                    acked_t.append(s)
                    log.write(f"ACK t {s}\n")
            elif op < 0.55:
                res = client.reserve_keys(kns, keys(s))
                mask = [rng.random() < 0.8 for _ in res.indices]
                data = pattern(s, "k")[res.indices]
                client.write_pages(res, data)
                ok = client.commit(res, ok=mask)
                if ok.published == sum(mask):
                    acked_k.append(s)
                    published = "".join("1" if m else "0" for m in mask)
                    log.write(f"ACK k {s} {published}\n")
            elif op < 0.75 and acked_t:
                old = rng.choice(acked_t)
                hit = client.match(tns, tokens(old))
                try:
                    got = client.read_pages(hit)
                    check(log, "t", old, got)
                except HicachedError:
                    pass  # a stale handle is a miss, not a lie
                finally:
                    client.release(hit)
            elif op < 0.85 and acked_k:
                old = rng.choice(acked_k)
                hit = client.match_keys(kns, keys(old))
                try:
                    got = client.read_pages(hit)
                    check(log, "k", old, got)
                except HicachedError:
                    pass
                finally:
                    client.release(hit)
            elif acked_t or acked_k:
                keyed = bool(acked_k) and (not acked_t or rng.random() < 0.5)
                old = rng.choice(acked_k if keyed else acked_t)
                if keyed:
                    pf = client.prefetch_keys(kns, keys(old))
                else:
                    pf = client.prefetch(tns, tokens(old))
                deadline = time.monotonic() + 5
                while pf.lease and time.monotonic() < deadline:
                    if client.progress(pf).done:
                        break
                    time.sleep(0.005)
                client.commit(pf)
                hit = client.match_keys(kns, keys(old)) if keyed else client.match(tns, tokens(old))
                try:
                    got = client.read_pages(hit)
                    check(log, "k" if keyed else "t", old, got)
                except HicachedError:
                    pass
                finally:
                    client.release(hit)
        except HicachedError:
            time.sleep(0.02)  # the daemon is down or restarting: go on when it is back
    log.write("DONE\n")
    log.close()
    client.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
