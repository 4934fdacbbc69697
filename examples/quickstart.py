"""Store KV pages in one process, match and verify them from another.

Run a daemon first (``make serve``), then ``python examples/quickstart.py``.
It connects to $HICACHED_ENDPOINT or the default endpoint and exits 0 only
if every byte read back through the second process matches.
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import numpy as np

import hicached

PAGE_TOKENS = 64
PAGE_BYTES = 64 * 1024
NAMESPACE = dict(
    model="example/quickstart",
    kv_dtype="bfloat16",
    layout="layer_first",
    page_tokens=PAGE_TOKENS,
    page_bytes=PAGE_BYTES,
)


def tokens() -> np.ndarray:
    return np.arange(1000, 1000 + 16 * PAGE_TOKENS, dtype=np.uint32)  # 16 full pages


def expected_pages(toks: np.ndarray) -> np.ndarray:
    """Deterministic fake KV bytes: page i is a function of its tokens."""
    pages = toks.size // PAGE_TOKENS
    rng = np.random.default_rng(int(toks[:PAGE_TOKENS].sum()))
    return rng.integers(0, 256, size=(pages, PAGE_BYTES), dtype=np.uint8)


def writer() -> None:
    with hicached.Client(name="quickstart-writer") as client:
        ns = client.register(**NAMESPACE)
        toks = tokens()
        result = client.store(ns, toks, expected_pages(toks))
        print(f"writer: stored {result.published} pages ({result.duplicates} already there)")


def reader(queue: mp.Queue) -> None:
    with hicached.Client(name="quickstart-reader") as client:
        ns = client.register(**NAMESPACE)
        toks = tokens()
        hit = client.match(ns, toks)
        try:
            got = client.read_pages(hit)
        finally:
            client.release(hit)
        want = expected_pages(toks)
        ok = hit.hits == len(want) and np.array_equal(got, want)
        print(f"reader: matched {hit.hits}/{len(want)} pages, bytes {'match' if ok else 'DIFFER'}")
        queue.put(ok)


def main() -> int:
    ctx = mp.get_context("spawn")
    w = ctx.Process(target=writer)
    w.start()
    w.join(30)
    if w.exitcode != 0:
        print("writer failed", file=sys.stderr)
        return 1
    queue: mp.Queue = ctx.Queue()
    r = ctx.Process(target=reader, args=(queue,))
    r.start()
    r.join(30)
    return 0 if r.exitcode == 0 and queue.get(timeout=5) else 1


if __name__ == "__main__":
    sys.exit(main())
