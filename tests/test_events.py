"""KV events from a real daemon to a real subscriber, in vLLM's format, with replay."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import zmq

from hicached.events import END_SEQ, BlockRemoved, BlockStored, KVEventBatch, batch_decoder
from hicached.hashing import pack_tokens, page_keys
from tests.l3util import evict_everything, l3_count, wait_for
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for


def collect(
    sub: zmq.Socket, until: Callable[[list[tuple[int, KVEventBatch]]], bool]
) -> list[tuple[int, KVEventBatch]]:
    got: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + 15
    while not until(got):
        assert time.monotonic() < deadline, f"events did not arrive: {got}"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            got.append((int.from_bytes(seq, "big"), batch_decoder.decode(payload)))
    return got


def flat(batches: list[tuple[int, KVEventBatch]]) -> list[object]:
    return [e for _, b in batches for e in b.events]


def test_events_follow_l2_and_l3_and_can_be_replayed(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(size_mib=1, slab_mib=1, storage='backend = "memory"\n')
    # events on, in the daemon's private runtime dir
    d.stop()
    text = (
        d.config.read_text().replace("[log]", "")
        + f'[events]\nendpoint = "ipc://{d.runtime}/events.sock"\nreplay_endpoint = "ipc://{d.runtime}/replay.sock"\n'
    )
    d.config.write_text(text)
    d.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{d.runtime}/events.sock")
    sockets = [sub]
    try:
        with d.client() as c:
            ns = c.register(**NS)
            time.sleep(0.3)  # let the subscription reach the publisher
            toks = np.arange(0, 3 * PAGE_TOKENS, dtype=np.uint32)
            c.store(ns, toks, page_bytes_for(toks))
            wait_for(lambda: l3_count(c, "written") == 3)
            keys = page_keys(ns.digest, pack_tokens(toks), PAGE_TOKENS)
            got = collect(sub, lambda g: sum(isinstance(e, BlockStored) for e in flat(g)) >= 4)
            stored = [e for e in flat(got) if isinstance(e, BlockStored)]
            assert stored[0].medium == "CPU" and stored[0].block_hashes == keys
            assert stored[0].parent_block_hash is None and stored[0].token_ids == toks.tolist()
            assert stored[0].block_size == PAGE_TOKENS
            l3 = [e for e in stored if e.medium == "MEMORY"]
            assert sorted(e.block_hashes[0] for e in l3) == sorted(keys)
            evict_everything(c, ns)
            got += collect(
                sub,
                lambda g: any(
                    isinstance(e, BlockRemoved) and keys[0] in e.block_hashes for e in flat(g)
                ),
            )
            removed = {k for e in flat(got) if isinstance(e, BlockRemoved) for k in e.block_hashes}
            assert set(keys) <= removed
            seqs = [s for s, _ in got]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        # a late subscriber catches up through replay, from any sequence number
        replay = ctx.socket(zmq.DEALER)
        sockets.append(replay)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(f"ipc://{d.runtime}/replay.sock")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(5000)
            _, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((int.from_bytes(seq, "big"), batch_decoder.decode(payload)))
        assert [s for s, _ in replayed][: len(seqs)] == list(range(len(replayed)))[: len(seqs)]
        assert replayed[0][0] == 0 and type(replayed[0][1].events[0]).__name__ == "AllBlocksCleared"
        assert {s for s, _ in got} <= {s for s, _ in replayed}
    finally:
        for sock in sockets:
            sock.close()
        ctx.term()
