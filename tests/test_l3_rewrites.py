"""An L3 store smaller than L2, through a real daemon: what L3 lets go of while
L2 keeps it is written again at most once a stay, never in a loop, so pages
written stay within a small multiple of pages committed, and an idle daemon
writes nothing; the daemon says that L3 is smaller than L2."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zmq

from hicached import Client
from tests.l3util import settle_writes, storage, wait_for
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon
from tests.test_vllm_events import (  # noqa: F401 (fixtures)
    Capture,
    VllmDecoder,
    events_dir,
    events_toml,
    vllm_decode,
    vllm_python,
)

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


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_events_of_an_undersized_l3_carry_tokens_and_go_out_parents_first(
    daemon_factory: Callable[..., Daemon],
    events_dir: Path,  # noqa: F811 (the fixture)
    vllm_python: VllmDecoder,  # noqa: F811 (the fixture)
    policy: str,
) -> None:
    """Under the same workload, with sequences that share their heads: vLLM's own
    classes decode every batch; every BlockStored of a token namespace carries
    its pages' token ids (rewrites and write-backs included), and each page's
    parent was stored in the same medium before it, in every medium."""
    d = daemon_factory(
        size_mib=POOL_MIB,
        slab_mib=1,
        storage=storage("file", policy),
        tail=SMALL_STORE + events_toml(events_dir, "batch_events = 16\n"),
    )
    capture = Capture(f"ipc://{events_dir}/events.sock")
    capture.sub.setsockopt(zmq.RCVHWM, 0)  # a test reader: keeps everything
    try:
        with d.client(timeout=10) as c:
            ns = c.register(**NS)
            heads = [np.arange(2 * PAGE_TOKENS, dtype=np.uint32) + np.uint32(h) for h in range(8)]
            data = np.zeros((8, PAGE_BYTES), np.uint8)
            for i in range(300):
                tail = np.arange(6 * PAGE_TOKENS, dtype=np.uint32) + np.uint32(10**6 + i * 1000)
                c.store(ns, np.concatenate([heads[i % 8] * 7919, tail]), data)
                if i % 16 == 15:
                    settle_writes(c)
            quiet(c)
            last = c.stats()
            assert last.l3["written"] > 0 and last.l3.get("write_failed", 0) == 0
            assert last.l3.get("write_not_queued", 0) == 0  # else a parent may never be stored
            deadline = time.monotonic() + 10
            while capture.sub.poll(300) or not capture.frames:
                capture.frames.append(tuple(capture.sub.recv_multipart()))  # type: ignore[arg-type]
                assert time.monotonic() < deadline
    finally:
        capture.close()
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in capture.frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap, with a reader that keeps all"
    batches = vllm_decode(vllm_python, capture.frames)
    seen: dict[str, set[int]] = {}
    counted = {"CPU": 0, "FILE": 0}
    for batch in batches:
        for e in batch["events"]:
            if e["type"] != "BlockStored":
                continue
            hashes_ = e["block_hashes"]
            assert len(e["token_ids"]) == len(hashes_) * PAGE_TOKENS, e
            mine = seen.setdefault(e["medium"], set())
            parent = e["parent_block_hash"]
            for h in hashes_:
                assert parent is None or parent in mine, f"{e['medium']} child before parent"
                mine.add(h)
                parent = h
            counted[e["medium"]] += len(hashes_)
    assert counted["CPU"] > 0 and counted["FILE"] > 0
