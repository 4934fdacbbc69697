"""Helpers for tests of the L3 tier through a real daemon."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hicached import Client, Fetch, FetchProgress, Namespace
from hicached.hashing import pack_tokens, page_keys
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon, page_bytes_for

FILE_STORE = "[storage.file]\ncapacity_mib = 8\nsegment_mib = 2\nio_threads = 2\n"


def storage(backend: str, policy: str = "write_through", more: str = "") -> str:
    return f'backend = "{backend}"\nwrite_policy = "{policy}"\n{more}'


def wait_for(what: Callable[[], object], timeout: float = 15.0, step: float = 0.02) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


def l3_count(c: Client, name: str) -> int:
    return int(c.stats().l3.get(name, 0))


def settle_writes(c: Client) -> None:
    """Wait until no L3 write is queued or in flight (the write-backs of
    evicted pages hold their slots unpinned: ``writeback_pages``)."""

    def settled() -> bool:
        s = c.stats()
        busy = s.l3.get("queued", 0) + s.l3.get("in_flight_pages", 0)
        return busy + s.pinned_pages + s.writeback_pages == 0

    wait_for(settled)


def evict_everything(c: Client, ns: Namespace, salt: int = 7) -> None:
    """Fill a 1 MiB pool with other pages, so every unpinned page is evicted (in
    sequences of as many pages as the daemon takes a request)."""
    settle_writes(c)
    step = c.pages_per_request(4 * PAGE_TOKENS) or 256
    for first in range(0, 256, step):
        pages = min(step, 256 - first)
        start = salt * 10**7 + first * PAGE_TOKENS
        filler = (np.arange(pages * PAGE_TOKENS, dtype=np.uint32) + start).astype(np.uint32)
        c.store(ns, filler, np.zeros((pages, PAGE_BYTES), np.uint8))
    settle_writes(c)


def wait_prefetch(c: Client, pf: Fetch, timeout: float = 15.0) -> FetchProgress:
    return wait_for(lambda: (p := c.progress(pf)).done and p, timeout)  # type: ignore[return-value]


def read_back(c: Client, ns: Namespace, toks: np.ndarray) -> None:
    """Evict ``toks``'s pages from L2, prefetch them from L3 whole, and check
    their bytes."""
    evict_everything(c, ns)
    pf = c.prefetch(ns, toks)
    assert wait_prefetch(c, pf).completed == len(toks) // PAGE_TOKENS
    c.commit(pf)
    assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))


EARLY = np.arange(0, 4 * PAGE_TOKENS, dtype=np.uint32)  # stored while L3 is down


def down_and_l2_serves(d: Daemon, c: Client) -> Namespace:
    """A daemon whose store did not answer at its start: L3 down from the
    first request, said in its log, and L2 storing and loading all the same
    (4 pages, EARLY). The namespace it registered."""
    assert c.stats().l3_state == "down"
    ns = c.register(**NS)
    c.store(ns, EARLY, page_bytes_for(EARLY))
    assert np.array_equal(c.load(ns, EARLY), page_bytes_for(EARLY))
    assert "not reachable at start" in d.log.read_text()
    return ns


def written_and_read_back(c: Client, ns: Namespace) -> None:
    """Once L3 is up: 8 new pages are written there, and the 4 stored while it
    was down (write_through writes what it missed once the store is up), and
    all are read back whole from it."""
    toks = np.arange(10**6, 10**6 + 8 * PAGE_TOKENS, dtype=np.uint32)
    c.store(ns, toks, page_bytes_for(toks))
    wait_for(lambda: l3_count(c, "written") >= 12)
    read_back(c, ns, toks)
    read_back(c, ns, EARLY)


def record_offset(store: Path, ns_digest: bytes, tokens: np.ndarray, page: int) -> tuple[Path, int]:
    """Where the file store keeps page ``page`` of ``tokens``: (segment file, header offset)."""
    return record_at(store, ns_digest, page_keys(ns_digest, pack_tokens(tokens), PAGE_TOKENS)[page])


def record_at(store: Path, ns_digest: bytes, key: bytes) -> tuple[Path, int]:
    """Where the file store keeps the record of ``key`` (the daemon's key):
    (segment file, header offset)."""
    for segment in sorted(store.glob("segment-*.hcs")):
        data = segment.read_bytes()
        at = data.find(ns_digest + key)
        if at >= 0:
            return segment, at - 16
    raise AssertionError("record not found")


def refused_start(d: Daemon, reason: str) -> None:
    """``d`` (not started) must exit 2 at start, saying ``reason``; cleaned up."""
    try:
        d.start()
    except RuntimeError as exc:
        assert "exited with 2" in str(exc) and reason in str(exc), str(exc)
    else:
        raise AssertionError(f"the daemon started; expected it to refuse: {reason}")
    finally:
        d.cleanup()
