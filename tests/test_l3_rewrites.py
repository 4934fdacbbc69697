"""An L3 store smaller than L2, through a real daemon: what L3 lets go of while
L2 keeps it is written again at most once a stay, never in a loop, so pages
written stay within a small multiple of pages committed, and an idle daemon
writes nothing; the daemon says that L3 is smaller than L2."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from hicached import Client
from tests.l3util import settle_writes, storage, wait_for
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon

POOL_MIB = 4  # 1,024 pages of 4 KiB
SMALL_STORE = "[storage.file]\ncapacity_mib = 2\nsegment_mib = 1\nio_threads = 2\n"


def quiet(c: Client) -> None:
    """Wait until no L3 write is queued, in flight, or holding an L2 slot."""

    def done() -> bool:
        s = c.stats()
        busy = s.l3.get("queued", 0) + s.l3.get("in_flight_pages", 0)
        return busy + s.pinned_pages + s.writeback_pages == 0

    wait_for(done)


def fill(c: Client, sequences: int, pages: int, *, matched: bool) -> int:
    """Store ``sequences`` sequences of ``pages`` pages (matching each after its
    store when ``matched``); returns the pages stored."""
    ns = c.register(**NS)
    data = np.zeros((pages, PAGE_BYTES), np.uint8)
    for i in range(sequences):
        tokens = np.arange(pages * PAGE_TOKENS, dtype=np.uint32) + np.uint32(i * 10**6)
        data[:, :8] = i % 251
        c.store(ns, tokens, data)
        if matched:
            c.match(ns, tokens, lease=False)
        if i % 16 == 15:
            settle_writes(c)  # L3 writes pin their pages: let L2 make room
    return sequences * pages


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_an_l3_smaller_than_l2_is_written_a_bounded_number_of_times(
    daemon_factory: Callable[..., Daemon], policy: str
) -> None:
    more = "selective_hits = 1\n" if policy == "write_through_selective" else ""
    d = daemon_factory(
        size_mib=POOL_MIB, slab_mib=1, storage=storage("file", policy, more), tail=SMALL_STORE
    )
    with d.client(timeout=10) as c:
        stored = fill(c, 400, 8, matched=policy == "write_through_selective")
        quiet(c)
        stats = c.stats()
        committed = stats.committed_pages
        assert stored // 2 <= committed <= stored  # a full pool may refuse some
        written = stats.l3["written"]
        assert committed * 0.5 <= written <= 2 * committed, (written, committed)
        assert stats.l3_write_amplification == pytest.approx(written / committed, abs=1e-3)
        if policy != "write_back":  # write_back writes what leaves L2: no rewrite to bound
            assert stats.l3_undersized
            assert stats.l3.get("rewrite_skipped", 0) > 0
        time.sleep(2.0)  # idle: nothing more is written
        idle = c.stats()
        assert idle.l3["written"] == written
        assert idle.l3.get("queued", 0) == 0
