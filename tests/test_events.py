"""KV events from a real daemon to a real subscriber, in vLLM's format, with replay."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from hicached import Client, Namespace
from hicached.config import EventsConfig, parse_config
from hicached.daemon.publisher import PEER_MESSAGE_BYTES
from hicached.errors import ConfigError
from hicached.events import (
    END_SEQ,
    EVENT_BYTES,
    KEY_BYTES,
    TOKEN_BYTES,
    BlockRemoved,
    BlockStored,
    Cleared,
    EventLog,
    KVEventBatch,
    Removed,
    Stored,
    WireFormat,
    batch_decoder,
    block_hash,
    event_bytes,
    topic_template,
)
from hicached.hashing import pack_tokens, page_keys
from tests.l3util import FILE_STORE, evict_everything, l3_count, refused_start, wait_for
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon, page_bytes_for


def collect(
    sub: zmq.Socket, until: Callable[[list[tuple[int, KVEventBatch]]], bool]
) -> list[tuple[int, KVEventBatch]]:
    got: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + 15
    while not until(got):
        assert time.monotonic() < deadline, f"events did not arrive: {[s for s, _ in got]}"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic.startswith(b"kv@")  # kv@<host>@<model>, as routers filter
            got.append((int.from_bytes(seq, "big"), batch_decoder.decode(payload)))
    return got


def hk(keys: list[bytes]) -> list[int | bytes]:
    """Page keys as block hashes on the wire (vLLM's 64-bit integers)."""
    return [block_hash(k) for k in keys]


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
            assert stored[0].medium == "CPU" and stored[0].block_hashes == hk(keys)
            assert stored[0].parent_block_hash is None and stored[0].token_ids == toks.tolist()
            assert stored[0].block_size == PAGE_TOKENS
            l3 = [e for e in stored if e.medium == "MEMORY"]
            assert sorted(e.block_hashes[0] for e in l3) == sorted(hk(keys))
            evict_everything(c, ns)
            got += collect(
                sub,
                lambda g: any(
                    isinstance(e, BlockRemoved) and block_hash(keys[0]) in e.block_hashes
                    for e in flat(g)
                ),
            )
            removed = {k for e in flat(got) if isinstance(e, BlockRemoved) for k in e.block_hashes}
            assert set(hk(keys)) <= removed
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
            _, _topic, seq, payload = replay.recv_multipart()
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


# -- the publisher under pressure ------------------------------------------------------


@pytest.fixture
def events_dir() -> Iterator[Path]:
    """A private directory (0700) for ipc event sockets."""
    path = Path(tempfile.mkdtemp(prefix="hc-ev-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def events_daemon(
    factory: Callable[..., Daemon], where: Path, events: str = "", **kwargs: object
) -> tuple[Daemon, str, str]:
    """A daemon publishing on ipc sockets in ``where``; returns it, its PUB and
    its replay endpoint."""
    pub, replay = f"ipc://{where}/events.sock", f"ipc://{where}/replay.sock"
    tail = f'[events]\nendpoint = "{pub}"\nreplay_endpoint = "{replay}"\n{events}'
    return factory(tail=tail, **kwargs), pub, replay


def subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.5)  # let the subscription reach the publisher
    return sub


def store_one_page_each(c: Client, ns: Namespace, count: int, first: int = 0) -> list[bytes]:
    """``count`` one-page sequences (one commit, one event each); their page keys."""
    keys = []
    for i in range(first, first + count):
        toks = np.arange(i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, np.zeros((1, PAGE_BYTES), np.uint8))
        keys += page_keys(ns.digest, pack_tokens(toks), PAGE_TOKENS)
    return keys


def read_replay(sock: zmq.Socket, pause_every: int = 0, pause_s: float = 0.0) -> list[int]:
    """Every seq of one replay up to its end marker, reading as slowly as asked."""
    seqs: list[int] = []
    while True:
        assert sock.poll(10_000), f"replay stalled after {len(seqs)} batches"
        _, _topic, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            assert payload == b""
            return seqs
        batch_decoder.decode(payload)
        seqs.append(int.from_bytes(seq, "big"))
        if pause_every and len(seqs) % pause_every == 0:
            time.sleep(pause_s)


def test_event_log_leaves_one_gap_per_run_of_drops() -> None:
    log = EventLog(max_events=2, enabled=True)
    counters: dict[str, int] = {}
    log.add(Cleared())
    log.count_drops_in(counters)
    for i in range(5):  # one more fits, four are dropped: one gap after it
        log.removed([bytes([i])], "CPU")
    assert log.dropped == 4 and counters == {"events_queue": 4}
    events, gap = log.take(10)
    assert [type(e).__name__ for e in events] == ["Cleared", "Removed"]
    assert gap and log.gaps == 0
    log.removed([b"x"], "CPU")
    log.removed([b"y"], "CPU")
    log.removed([b"z"], "CPU")  # dropped: a second gap, after y
    assert log.take(1) == ([Removed([b"x"], "CPU")], False)
    assert log.take(5) == ([Removed([b"y"], "CPU")], True)
    assert log.take(5) == ([], False)
    assert counters == {"events_queue": 5}


def test_replay_of_many_batches_to_a_slow_reader_is_complete(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    pages = 5200  # one event per page's L3 write: more than 5,000 batches
    d, _, replay_at = events_daemon(
        daemon_factory,
        events_dir,
        "batch_events = 1\n",
        size_mib=48,
        storage='backend = "memory"\n',
    )
    with d.client() as c:
        ns = c.register(**NS)
        toks = np.arange(pages * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, np.zeros((pages, PAGE_BYTES), np.uint8))
        wait_for(lambda: l3_count(c, "written") == pages)
        wait_for(lambda: c.stats().events_pending == 0)
        time.sleep(0.2)  # the last flush
    ctx = zmq.Context()
    reader = ctx.socket(zmq.DEALER)
    try:
        reader.setsockopt(zmq.LINGER, 0)
        reader.setsockopt(zmq.RCVHWM, 10)  # a slow reader holds little
        reader.connect(replay_at)
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = read_replay(reader, pause_every=500, pause_s=0.1)
        assert len(seqs) >= pages + 2  # AllBlocksCleared, the L2 commit, every L3 write
        assert seqs == list(range(len(seqs)))
        with d.client() as c:
            assert not {k for k in c.stats().dropped if k.startswith("replay")}
    finally:
        reader.close()
        ctx.term()


def test_a_slow_reader_asking_twice_gets_two_complete_replays(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    # The second replay does not fit the reader's queue: it waits for room.
    d, _, replay_at = events_daemon(
        daemon_factory, events_dir, "batch_events = 1\nreplay_batches = 600\n", size_mib=8
    )
    with d.client() as c:
        ns = c.register(**NS)
        store_one_page_each(c, ns, 700)
        wait_for(lambda: c.stats().events_pending == 0)
        time.sleep(0.2)
    ctx = zmq.Context()
    reader = ctx.socket(zmq.DEALER)
    try:
        reader.setsockopt(zmq.LINGER, 0)
        reader.setsockopt(zmq.RCVHWM, 10)
        reader.connect(replay_at)
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.5)  # both asked before reading anything
        first = read_replay(reader, pause_every=100, pause_s=0.05)
        second = read_replay(reader)
        assert len(first) == 600 and first == list(range(first[0], first[0] + 600))
        assert second == first
        with d.client() as c:
            assert not {k for k in c.stats().dropped if k.startswith("replay")}
    finally:
        reader.close()
        ctx.term()


def test_events_committed_right_before_a_graceful_stop_reach_subscribers(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    # Nothing is published on a timer here: every event goes out during the
    # stop, more bytes of them than the socket buffers hold.
    d, pub, _ = events_daemon(
        daemon_factory,
        events_dir,
        "batch_events = 1\nflush_interval_s = 600.0\n",
        size_mib=32,
        metrics="enabled = false",
    )
    ctx = zmq.Context()
    sub = subscriber(ctx, pub)
    try:
        keys: list[bytes] = []
        with d.client() as c:
            ns = c.register(**NS)
            for i in range(100):
                toks = np.arange(i * 64 * PAGE_TOKENS, (i + 1) * 64 * PAGE_TOKENS, dtype=np.uint32)
                c.store(ns, toks, np.zeros((64, PAGE_BYTES), np.uint8))
                keys += page_keys(ns.digest, pack_tokens(toks), PAGE_TOKENS)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        got = collect(
            sub,
            lambda g: (
                sum(len(e.block_hashes) for e in flat(g) if isinstance(e, BlockStored)) >= len(keys)
            ),
        )
        stored = [k for e in flat(got) if isinstance(e, BlockStored) for k in e.block_hashes]
        assert stored == hk(keys)
        seqs = [s for s, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert d.proc.wait(15) == 0  # a clean exit (a second signal would force one)
    finally:
        sub.close()
        ctx.term()


def test_a_queue_overflow_is_counted_and_leaves_a_seq_gap(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    d, pub, replay_at = events_daemon(
        daemon_factory, events_dir, "queue_events = 4\nflush_interval_s = 0.5\n"
    )
    ctx = zmq.Context()
    sub = subscriber(ctx, pub)
    sockets = [sub]
    try:
        with d.client() as c:
            ns = c.register(**NS)
            keys = store_one_page_each(c, ns, 20)  # far more than 4 between two flushes
            time.sleep(1.0)
            keys += store_one_page_each(c, ns, 1, first=20)  # published after the gap
            got = collect(
                sub,
                lambda g: any(
                    isinstance(e, BlockStored) and block_hash(keys[-1]) in e.block_hashes
                    for e in flat(g)
                ),
            )
            dropped = c.stats().dropped.get("events_queue", 0)
        stored = [k for e in flat(got) if isinstance(e, BlockStored) for k in e.block_hashes]
        assert dropped > 0 and len(stored) + dropped == len(keys)
        assert stored == [k for k in hk(keys) if k in set(stored)]  # in order, some missing
        seqs = [s for s, _ in got]
        missing = set(range(seqs[0], seqs[-1])) - set(seqs)
        assert 1 <= len(missing) <= dropped
        # the gap is real: replay has nothing for it either
        replay = ctx.socket(zmq.DEALER)
        sockets.append(replay)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(replay_at)
        replay.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        assert read_replay(replay) == seqs
    finally:
        for sock in sockets:
            sock.close()
        ctx.term()


def test_event_log_bounds_its_bytes_as_well_as_its_events() -> None:
    """One event may carry a whole commit's token ids: a queue bounded by count
    alone could hold gigabytes. Past max_bytes events are dropped and counted
    like those past max_events, and an event larger than max_bytes alone too."""
    tokens = list(range(1000, 2000))  # 1,000 token ids: about 40 KB each
    size = event_bytes(Stored([b"k" * 16], None, tokens, 1000, "CPU"))
    assert size == EVENT_BYTES + KEY_BYTES + 1000 * TOKEN_BYTES
    log = EventLog(max_events=1000, enabled=True, max_bytes=3 * size)
    counters: dict[str, int] = {}
    log.count_drops_in(counters)
    for i in range(5):  # three fit, two are dropped: one gap after the third
        log.stored([bytes([i]) * 16], None, tokens, 1000, "CPU")
    assert log.dropped == 2 and counters == {"events_queue": 2} and log.bytes == 3 * size
    events, gap = log.take(10)
    assert len(events) == 3 and gap and log.bytes == 0
    log.stored([b"x" * 16], None, list(range(4000)), 1000, "CPU")  # alone over the bound
    log.removed([b"y" * 16], "CPU")
    assert log.dropped == 3 and log.take(10) == ([], True)  # the gap comes first
    assert log.take(10) == ([Removed([b"y" * 16], "CPU")], False)


def test_a_queue_over_queue_mib_is_counted_and_leaves_a_seq_gap(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    """A real daemon whose commits carry 8,192 token ids each (about 330 KB in
    the queue): queue_mib = 1 holds three, far below queue_events; the rest
    between two flushes are dropped and counted, and the later ones go out."""
    d, pub, _ = events_daemon(
        daemon_factory, events_dir, "queue_mib = 1\nflush_interval_s = 0.5\n", size_mib=8
    )
    spec = {**NS, "model": "test/long-pages", "page_tokens": 4096, "page_bytes": 4096}
    ctx = zmq.Context()
    sub = subscriber(ctx, pub)
    try:
        with d.client() as c:
            ns = c.register(**spec)
            keys: list[bytes] = []

            def store(i: int) -> None:
                toks = np.arange(i * 8192, (i + 1) * 8192, dtype=np.uint32)
                c.store(ns, toks, np.zeros((2, 4096), np.uint8))
                keys.extend(page_keys(ns.digest, pack_tokens(toks), 4096))

            for i in range(12):  # far more than three between two flushes
                store(i)
            time.sleep(1.0)
            store(12)  # published after the gap
            got = collect(
                sub,
                lambda g: any(
                    isinstance(e, BlockStored) and block_hash(keys[-1]) in e.block_hashes
                    for e in flat(g)
                ),
            )
            dropped = c.stats().dropped.get("events_queue", 0)
        stored = [k for e in flat(got) if isinstance(e, BlockStored) for k in e.block_hashes]
        assert dropped > 0 and len(stored) + 2 * dropped == len(keys)
        assert stored == [k for k in hk(keys) if k in set(stored)]  # in order, some missing
    finally:
        sub.close()
        ctx.term()


def test_a_subscriber_too_slow_for_the_hwm_sees_exactly_the_counted_drops(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    """One subscriber stops reading (its queue holds 20 batches, the daemon's
    hwm 20) while the daemon publishes a few hundred batches of ~3 KB; another
    reads all along. A batch the full queue refuses is dropped for both and
    counted: the slow one, reading again, misses exactly the counted batches,
    and the fast one got exactly what the slow one got."""
    d, pub, replay_at = events_daemon(
        daemon_factory,
        events_dir,
        "batch_events = 1\nhwm = 20\n",
        size_mib=8,
        storage='backend = "memory"\n',
    )
    ctx = zmq.Context()
    slow = ctx.socket(zmq.SUB)
    slow.setsockopt(zmq.RCVHWM, 20)
    sockets = [slow]
    fast_seqs: list[int] = []
    done = threading.Event()

    def read_fast(sub: zmq.Socket) -> None:
        while not done.is_set():
            if sub.poll(20):
                fast_seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))

    try:
        slow.setsockopt(zmq.LINGER, 0)
        slow.setsockopt(zmq.SUBSCRIBE, b"")
        slow.connect(pub)
        fast = subscriber(ctx, pub)
        sockets.append(fast)
        reader = ctx.socket(zmq.DEALER)
        sockets.append(reader)
        reader.setsockopt(zmq.LINGER, 0)
        reader.connect(replay_at)
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        first = len(read_replay(reader))  # published before the subscribers joined
        thread = threading.Thread(target=read_fast, args=(fast,), daemon=True)
        thread.start()
        pages, page_tokens = 400, 1024  # one L3 write event (~3 KB) per page
        with d.client() as c:
            ns = c.register(**{**NS, "page_tokens": page_tokens})
            for i in range(pages // 100):  # 100 pages a store: within max_message_bytes
                toks = np.arange(
                    i * 100 * page_tokens, (i + 1) * 100 * page_tokens, dtype=np.uint32
                )
                c.store(ns, toks, np.zeros((100, PAGE_BYTES), np.uint8))
            wait_for(lambda: l3_count(c, "written") == pages)
            wait_for(lambda: c.stats().events_pending == 0)
            time.sleep(0.2)  # the last flush
            dropped = c.stats().dropped
        reader.send_multipart([b"", first.to_bytes(8, "big")])
        published = read_replay(reader)  # the refused batches were kept too
        assert len(published) > pages and published == list(range(first, first + len(published)))
        counted = dropped.get("events_subscriber_full", 0)
        assert 0 < counted < len(published)
        assert "events_queue" not in dropped
        slow_seqs: list[int] = []
        while len(slow_seqs) < len(published) - counted:
            assert slow.poll(5_000), f"stalled after {len(slow_seqs)} batches"
            seq = int.from_bytes(slow.recv_multipart()[1], "big")
            if seq >= first:  # not the AllBlocksCleared, had it come after the subscription
                slow_seqs.append(seq)
        assert not slow.poll(300)  # nothing beyond the batches not counted
        missing = set(published) - set(slow_seqs)
        assert len(missing) == counted and slow_seqs == sorted(slow_seqs)
        wait_for(lambda: len([s for s in fast_seqs if s >= first]) >= len(slow_seqs), timeout=5.0)
        done.set()
        thread.join(5)
        assert [s for s in fast_seqs if s >= first] == slow_seqs
    finally:
        done.set()
        for sock in sockets:
            sock.close()
        ctx.term()


# -- the events command -----------------------------------------------------------------

HOST = socket.gethostname()
MODEL = str(NS["model"])


def test_hicached_events_prints_the_stream_from_a_sequence_number(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    d, _, _ = events_daemon(daemon_factory, events_dir, size_mib=1)
    with d.client() as c:
        ns = c.register(**NS)
        toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, np.zeros((2, PAGE_BYTES), np.uint8))
        keys = page_keys(ns.digest, pack_tokens(toks), PAGE_TOKENS)
        wait_for(lambda: c.stats().events_pending == 0)
    time.sleep(0.2)
    args = ["--endpoint", f"ipc://{events_dir}/events.sock"]
    args += ["--replay-endpoint", f"ipc://{events_dir}/replay.sock"]
    out = _cli("events", *args, "--from", "0", "--json", "--count", "2")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["seq"] for line in lines] == [0, 1]
    assert lines[0]["events"] == [{"type": "AllBlocksCleared"}]
    assert lines[1]["topic"] == f"kv@{HOST}@{MODEL}" and lines[1]["data_parallel_rank"] == 0
    assert lines[1]["events"][0]["block_hashes"] == hk(keys)
    text = _cli("events", *args, "--from", "1", "--count", "1")
    assert text.startswith(f"#1 kv@{HOST}@{MODEL}") and "BlockStored CPU 2 blocks" in text
    # live: what happens from now on
    live = subprocess.Popen(
        [sys.executable, "-m", "hicached", "events", *args, "--json", "--count", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1.5)  # it has subscribed
        with d.client() as c:
            ns = c.register(**NS)
            more = np.arange(2 * PAGE_TOKENS, 3 * PAGE_TOKENS, dtype=np.uint32)
            c.store(ns, more, np.zeros((1, PAGE_BYTES), np.uint8))
        out, _ = live.communicate(timeout=30)
    finally:
        live.kill()
    (line,) = [json.loads(x) for x in out.splitlines()]
    assert line["seq"] == 2 and line["events"][0]["medium"] == "CPU"


def test_hicached_events_follows_a_daemon_restart(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    """A restarted daemon numbers its batches from 0 again: the command must show
    them (its AllBlocksCleared first, fetched by replay if the live stream missed
    it), not take them for batches it has shown already."""
    d, pub, replay = events_daemon(daemon_factory, events_dir, size_mib=1)
    command = [sys.executable, "-m", "hicached", "events", "--endpoint", pub]
    live = subprocess.Popen(
        [*command, "--replay-endpoint", replay, "--json", "--idle-exit", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C's signal at its default: a test run started in the background
        # by a shell without job control passes it on ignored, and the command
        # would then end at --idle-exit only
        preexec_fn=_sigint_default,
    )
    try:
        time.sleep(1.5)  # it has subscribed
        with d.client() as c:
            ns = c.register(**NS)
            store_one_page_each(c, ns, 3)  # seq 1 and on
            wait_for(lambda: c.stats().events_pending == 0)
        time.sleep(0.5)
        d.stop()
        d.start()  # seq 0 (AllBlocksCleared) again, then 1
        time.sleep(1.0)  # it has subscribed again (seq 0 went out before: a gap to replay)
        with d.client() as c:
            ns = c.register(**NS)
            keys = store_one_page_each(c, ns, 1, first=10)
            wait_for(lambda: c.stats().events_pending == 0)
        time.sleep(1.0)
        live.send_signal(signal.SIGINT)
        out, err = live.communicate(timeout=30)
    finally:
        live.kill()
    lines = [json.loads(x) for x in out.splitlines()]
    seqs = [x["seq"] for x in lines]
    assert seqs and seqs[0] == 1, (out, err)  # the first daemon's commits
    restart = next((i for i in range(1, len(seqs)) if seqs[i] <= seqs[i - 1]), None)
    assert restart is not None, f"nothing shown after the restart: {seqs}\n{err}"
    after = lines[restart:]
    assert [x["seq"] for x in after] == list(range(len(after))), (out, err)
    assert after[0]["events"] == [{"type": "AllBlocksCleared"}]
    stored = [e for x in after for e in x["events"] if e["type"] == "BlockStored"]
    assert [e["block_hashes"] for e in stored] == [hk(keys)]


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "hicached", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        ("format = 'json'\n", "events.format", "one of map, array"),
        ("block_hashes = 'int32'\n", "events.block_hashes", "one of int, bytes"),
        ("topic = 'kv@{pod}@{model}'\n", "events.topic", "{host} and {model}"),
        ("data_parallel_rank = -1\n", "events.data_parallel_rank", "negative"),
    ],
)
def test_bad_events_config_names_its_key(text: str, key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("[events]\n" + text, "x.toml")
    message = str(info.value)
    assert message.startswith(f"x.toml: {key}: ") and hint in message, message


def test_the_topic_fills_in_host_and_model() -> None:
    topic = topic_template(EventsConfig())
    assert topic("org/m") == f"kv@{HOST}@org/m".encode() and topic("") == f"kv@{HOST}@".encode()
    assert topic_template(EventsConfig(topic="kv@{host}@fixed"))("org/m") == (
        f"kv@{HOST}@fixed".encode()
    )


def test_block_hashes_are_vllms_64_bit_form_of_the_key() -> None:
    key = bytes(range(16))
    assert block_hash(key) == int.from_bytes(key[8:], "big") == 0x08090A0B0C0D0E0F
    assert block_hash(key, "bytes") == key
    wire = WireFormat(EventsConfig()).wire(Stored([key], key, [1], 1, "CPU"))
    assert isinstance(wire, BlockStored)
    assert wire.block_hashes == [block_hash(key)] and wire.parent_block_hash == block_hash(key)


@pytest.mark.parametrize("which", ["endpoint", "replay_endpoint"])
def test_an_events_socket_in_an_open_directory_stops_the_start(tmp_path: Path, which: str) -> None:
    """A refused bind of an events socket (here: a directory other users may
    enter) stops the start with exit 2 and the reason, with an L3 store open;
    the daemon hung in its stop before, its context waiting for the socket that
    never bound."""
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    private = tmp_path / "ev"
    where = {"endpoint": private, "replay_endpoint": private}
    where[which] = open_dir
    d = Daemon(
        storage='backend = "file"\n',
        tail=FILE_STORE
        + f'[events]\nendpoint = "ipc://{where["endpoint"]}/events.sock"\n'
        + f'replay_endpoint = "ipc://{where["replay_endpoint"]}/replay.sock"\n',
    )
    refused_start(d, "is open to other users")


def test_a_replay_request_over_the_peer_bound_drops_that_connection_unread(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    """A replay request is 8 bytes: a peer that sends megabytes (not a reader)
    loses its connection before the daemon buffers them, and the daemon goes
    on serving replays to others."""
    d, _, replay_at = events_daemon(daemon_factory, events_dir)
    ctx = zmq.Context()
    hostile, reader = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock in (hostile, reader):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(replay_at)
        hostile.send_multipart([b"", b"x" * (PEER_MESSAGE_BYTES + 1)])
        hostile.send_multipart([b"", b"x" * 9])  # after it, on the same connection
        time.sleep(0.3)
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        assert read_replay(reader)[0] == 0  # AllBlocksCleared, as ever
        with d.client() as c:
            # neither reached the replay socket: the connection ended at the first
            assert c.stats().dropped.get("bad_replay_request", 0) == 0
    finally:
        hostile.close()
        reader.close()
        ctx.term()


def _rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) >> 10
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_subscription_longer_than_any_topic_drops_its_connection_unkept(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    """libzmq keeps every distinct prefix subscribers hold, about 48 bytes a
    byte: a subscriber that sent 2,000 distinct prefixes of 2,000 bytes (each
    within the 4 KiB the events socket took) grew the daemon by some 190 MiB.
    A prefix longer than the longest topic matches nothing; its message (past
    1 KiB, a handshake's room, here) drops the subscriber's connection before it
    is kept. A subscriber of the longest topic there can be (a model id of the
    most characters) is served."""
    d, pub_at, _ = events_daemon(daemon_factory, events_dir)
    assert d.proc is not None
    model = "m" * 128 + "/" + "n" * 128  # the longest model id a namespace takes
    topic = f"kv@{socket.gethostname()}@{model}".encode()
    ctx = zmq.Context()
    hostile = ctx.socket(zmq.XSUB)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.setsockopt(zmq.SNDHWM, 0)
    reader = ctx.socket(zmq.SUB)
    reader.setsockopt(zmq.LINGER, 0)
    reader.setsockopt(zmq.SUBSCRIBE, topic)
    try:
        before = _rss_mib(d.proc.pid)
        hostile.connect(pub_at)
        for i in range(2000):
            hostile.send(b"\x01" + i.to_bytes(8, "big") * 250)
        reader.connect(pub_at)
        time.sleep(1.0)  # let the subscriptions reach the publisher (or not)
        grown = _rss_mib(d.proc.pid) - before
        assert grown < 32, f"the daemon grew by {grown} MiB"
        with d.client() as c:
            ns = c.register(**{**NS, "model": model})
            store_one_page_each(c, ns, 1)
        assert reader.poll(10_000), "the subscriber of the longest topic got nothing"
        assert reader.recv_multipart()[0] == topic
    finally:
        hostile.close()
        reader.close()
        ctx.term()


def test_a_replay_from_past_2_63_is_read_unsigned_as_vllm_reads_it(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    """vLLM reads start_seq as an unsigned 8-byte number, and so does `hicached
    events --from` (0 to 2**64-1); read signed, a start from 2**63 on was
    negative and replayed every kept batch, from 0."""
    d, _, replay_at = events_daemon(daemon_factory, events_dir)
    with d.client() as c:
        ns = c.register(**NS)
        store_one_page_each(c, ns, 3)
        wait_for(lambda: c.stats().events_pending == 0)
    ctx = zmq.Context()
    reader = ctx.socket(zmq.DEALER)
    try:
        reader.setsockopt(zmq.LINGER, 0)
        reader.connect(replay_at)
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        assert read_replay(reader)[:1] == [0]  # what is kept, from 0
        for start in (1 << 63, (1 << 64) - 1):
            reader.send_multipart([b"", start.to_bytes(8, "big")])
            assert read_replay(reader) == [], start  # the end marker alone
    finally:
        reader.close()
        ctx.term()
