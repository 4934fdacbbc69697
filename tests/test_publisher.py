"""The event publisher on this test's event loop: replays in slices, and a
reader that stops reading gets an end marker where its replay stopped."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from hicached.config import EventsConfig
from hicached.daemon.requests import SKIP_BATCH as SKIP_FRAMES
from hicached.events import (
    END_SEQ,
    REPLAY_SLICE,
    SUBSCRIBER_DROPS,
    SUBSCRIBERS_CUT,
    EventLog,
    Publisher,
    batch_decoder,
)
from hicached.wire.events import Stored

pytestmark = pytest.mark.timeout(30)


class Setup:
    def __init__(self, where: Path, **config: Any) -> None:
        self.config = EventsConfig(
            endpoint=f"ipc://{where}/events.sock",
            replay_endpoint=f"ipc://{where}/replay.sock",
            batch_events=1,
            flush_interval_s=600.0,  # flushed by hand
            **config,
        )
        self.log = EventLog(100_000, enabled=True, max_bytes=self.config.queue_mib << 20)
        self.dropped: dict[str, int] = {}
        self.publisher = Publisher(self.config, self.log, self.dropped)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.readers: list[zmq.Socket[Any]] = []

    def publish(self, batches: int, tokens: int = 16) -> None:
        for i in range(batches):
            self.log.stored([i.to_bytes(16, "big")], None, list(range(tokens)), 16, "CPU")
        self.publisher.flush()

    def reader(self, hwm: int = 1000) -> zmq.Socket[Any]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.connect(self.config.replay_endpoint)
        self.readers.append(sock)
        return sock


def bind(sock: zmq.Socket[bytes], endpoint: str, key: str) -> None:
    sock.bind(endpoint)


@pytest.fixture
async def setup(request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    where = Path(tempfile.mkdtemp(prefix="hc-pub-", dir="/tmp"))
    s = Setup(where, **getattr(request, "param", {}))
    s.publisher.start(s.ctx, bind)
    try:
        yield s
    finally:
        await s.publisher.stop()
        for sock in s.readers:
            sock.close()
        s.ctx.term()
        shutil.rmtree(where, ignore_errors=True)


async def recv(sock: zmq.Socket[Any], timeout: float = 10.0) -> list[bytes]:
    """The next message, letting the loop run while it is awaited."""
    deadline = time.monotonic() + timeout
    while not sock.poll(0):
        assert time.monotonic() < deadline, "nothing arrived"
        await asyncio.sleep(0.002)
    return sock.recv_multipart()


async def read_replay(sock: zmq.Socket[Any]) -> list[int]:
    """One replay's seqs up to its end marker."""
    seqs: list[int] = []
    while True:
        _, _topic, seq, payload = await recv(sock)
        if seq == END_SEQ:
            return seqs
        batch_decoder.decode(payload)
        seqs.append(int.from_bytes(seq, "big"))


async def test_a_long_replay_goes_out_in_slices_with_the_loop_free_between(
    setup: Setup,
) -> None:
    setup.publish(10_000)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    try:
        reader = setup.reader()
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        assert await read_replay(reader) == list(range(10_000))
    finally:
        other.cancel()
    assert ticks >= 10_000 // REPLAY_SLICE
    assert setup.dropped == {}


# batch_kib 32: the reader's queue (buffer_mib / 32 readers / 32 KiB) holds a whole replay.
@pytest.mark.parametrize(
    "setup", [{"replay_batches": 100, "replay_timeout_s": 1.0, "batch_kib": 32}], indirect=True
)
async def test_a_reader_that_stops_reading_gets_an_end_marker_where_its_replay_stopped(
    setup: Setup,
) -> None:
    setup.publish(100, tokens=4000)  # ~12 KB each: more than the socket buffers hold
    reader = setup.reader(hwm=1)
    reader.send_multipart([b"", (0).to_bytes(8, "big")])
    reader.send_multipart([b"", (0).to_bytes(8, "big")])
    # Reads nothing for longer than replay_timeout_s: the first replay fits its
    # queue, the second waits for room, then is cut; its end marker waits.
    await asyncio.sleep(1.5)
    first = await read_replay(reader)
    second = await read_replay(reader)
    assert first == list(range(100))
    assert len(second) < 100 and second == first[: len(second)]
    assert setup.dropped == {"replay_send": 100 - len(second)}


async def test_queue_drops_use_up_a_sequence_number(setup: Setup) -> None:
    sub = setup.ctx.socket(zmq.SUB)
    setup.readers.append(sub)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(setup.config.endpoint)
    await asyncio.sleep(0.3)
    setup.log.max_events = 2
    setup.publish(5)  # two queued, three dropped
    setup.publish(1)
    seqs: list[int] = []
    while len(seqs) < 3:
        seqs.append(int.from_bytes((await recv(sub))[1], "big"))
    assert seqs == [0, 1, 3]
    assert setup.dropped == {"events_queue": 3}


@pytest.mark.parametrize("setup", [{"replay_batches": 100, "replay_timeout_s": 3.0}], indirect=True)
async def test_one_reader_cannot_take_every_replay_and_a_refusal_is_answered(
    setup: Setup,
) -> None:
    """A reader that asks 40 times and reads nothing holds two replays (one sent,
    one waiting); the rest are refused at once. Another reader is served, and
    a refused request gets its end marker, not silence."""
    setup.publish(100, tokens=4000)  # ~20 KB each: the greedy reader's queue fills
    greedy = setup.reader(hwm=1)
    for _ in range(40):
        greedy.send_multipart([b"", (0).to_bytes(8, "big")])
    await asyncio.sleep(0.3)
    assert setup.dropped.get("replay_busy") == 38
    other = setup.reader()
    other.send_multipart([b"", (0).to_bytes(8, "big")])
    assert await read_replay(other) == list(range(100))
    malformed = setup.reader()
    malformed.send_multipart([b"", b"\x00\x01"])  # not 8 bytes
    assert (await recv(malformed, timeout=2.0))[2] == END_SEQ


async def test_a_request_of_many_frames_is_refused_and_read_over_several_turns(
    setup: Setup,
) -> None:
    """A replay request is two frames past the reader's identity: a message of
    many more is refused at once (its end marker, counted) and the rest of its
    frames let go of SKIP_FRAMES a turn, none kept, the loop free between; the
    request behind it is served. It was read whole in one turn, as a list: a
    message of 3 million frames held the daemon's loop for seconds, its
    requests past their deadlines, and took twice what libzmq held of it."""
    setup.publish(3)
    hostile = setup.reader()
    hostile.send_multipart([b""] * (3 * SKIP_FRAMES + 5))
    hostile.send_multipart([b"", (0).to_bytes(8, "big")])
    router = setup.publisher._router
    assert router is not None and router.poll(5000)
    setup.publisher._on_requests()  # one turn: the refusal, and SKIP_FRAMES frames past it
    assert setup.dropped["bad_replay_request"] == 1
    assert getattr(setup.publisher, "_skipping", False), "the whole message was read in one turn"
    assert await recv(hostile) == [b"", b"", END_SEQ, b""]
    assert await read_replay(hostile) == [0, 1, 2]
    assert setup.dropped["bad_replay_request"] == 1 and not setup.publisher._skipping


def subscriber(setup: Setup, hwm: int = 1000) -> zmq.Socket[Any]:
    sub = setup.ctx.socket(zmq.SUB)
    setup.readers.append(sub)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, hwm)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(setup.config.endpoint)
    return sub


def drain(sock: zmq.Socket[Any], into: list[int]) -> None:
    while sock.poll(0):
        into.append(int.from_bytes(sock.recv_multipart()[1], "big"))


@pytest.mark.parametrize("setup", [{"hwm": 20, "replay_batches": 5000}], indirect=True)
async def test_a_full_subscriber_queue_drops_a_batch_for_all_counted_as_its_gap(
    setup: Setup,
) -> None:
    """A subscriber that stops reading: once its queue (hwm 20 on each side, and
    the socket buffers) is full, each batch is refused, dropped for every
    subscriber and counted. What it reads later has gaps exactly where the
    count says; a subscriber that kept reading got the same batches, no more,
    no fewer; the dropped batches are in the replay; the stream then goes on."""
    slow, fast = subscriber(setup, hwm=20), subscriber(setup)
    await asyncio.sleep(0.3)  # let the subscriptions reach the publisher
    fast_seqs: list[int] = []
    total = 0
    for _ in range(60):  # ~3 KB a batch: the slow queue and its buffers fill early on
        setup.publish(20, tokens=1000)
        total += 20
        await asyncio.sleep(0.002)
        drain(fast, fast_seqs)
    dropped = setup.dropped.get(SUBSCRIBER_DROPS, 0)
    assert 0 < dropped < total
    slow_seqs: list[int] = []
    while len(slow_seqs) < total - dropped:
        slow_seqs.append(int.from_bytes((await recv(slow))[1], "big"))
    drain(fast, fast_seqs)
    missing = sorted(set(range(total)) - set(slow_seqs))
    assert len(missing) == dropped and slow_seqs == sorted(slow_seqs)
    assert fast_seqs == slow_seqs
    assert setup.dropped == {SUBSCRIBER_DROPS: dropped}
    # The dropped batches were kept: a replay from the first gap has them all.
    reader = setup.reader()
    reader.send_multipart([b"", missing[0].to_bytes(8, "big")])
    assert await read_replay(reader) == list(range(missing[0], total))
    # Both read again: the live stream goes on for both, with nothing dropped.
    setup.publish(10)
    after_slow, after_fast = (
        [await recv(slow) for _ in range(10)],
        [await recv(fast) for _ in range(10)],
    )
    want = [seq.to_bytes(8, "big") for seq in range(total, total + 10)]
    assert [m[1] for m in after_slow] == want == [m[1] for m in after_fast]
    assert setup.dropped == {SUBSCRIBER_DROPS: dropped}


async def test_subscription_messages_are_read_not_kept(setup: Setup) -> None:
    """The XPUB socket passes subscribe and unsubscribe messages up; each flush
    reads them, so subscribers that come and go leave nothing queued."""
    for i in range(50):
        sub = setup.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, f"kv@{i}".encode())
        sub.connect(setup.config.endpoint)
        await asyncio.sleep(0.005)
        sub.close()
    await asyncio.sleep(0.3)
    pub = setup.publisher._pub
    assert pub is not None and pub.poll(0)  # subscribe and unsubscribe messages wait
    setup.publisher.flush()
    assert not pub.poll(0)
    assert setup.dropped == {}


@pytest.mark.parametrize("setup", [{"hwm": 20, "stall_s": 0.4}], indirect=True)
async def test_a_subscriber_that_never_reads_is_cut_after_stall_s(setup: Setup) -> None:
    """A subscriber that stays connected and reads nothing keeps the live stream
    refused for everyone; after ``stall_s`` the events socket is bound anew,
    which cuts every connection: the reading subscriber reconnects on its own
    and the live stream reaches it again (the gap is replay's to fill)."""
    subscriber(setup, hwm=20)  # the one that reads nothing
    fast = subscriber(setup)
    await asyncio.sleep(0.3)  # let the subscriptions reach the publisher
    fast_seqs: list[int] = []
    total = 0
    deadline = time.monotonic() + 10
    while not setup.dropped.get(SUBSCRIBERS_CUT):
        assert time.monotonic() < deadline, "the stalled stream was never cut"
        setup.publish(20, tokens=1000)
        total += 20
        await asyncio.sleep(0.01)
        drain(fast, fast_seqs)
    assert setup.dropped.get(SUBSCRIBER_DROPS, 0) > 0
    cut_at = total
    await asyncio.sleep(0.5)  # the subscribers reconnect
    setup.publish(5)
    total += 5
    got = [int.from_bytes((await recv(fast))[1], "big") for _ in range(5)]
    assert got == list(range(cut_at, total)), "the live stream did not come back"


@pytest.mark.parametrize("setup", [{"replay_mib": 1, "batch_kib": 16}], indirect=True)
async def test_the_replay_ring_keeps_at_most_replay_mib(setup: Setup) -> None:
    """200 batches of about 12 KB, more than 1 MiB: the ring lets the oldest go
    and a replay from 0 gets the newest, none missing between them."""
    setup.publish(200, tokens=4000)
    ring = setup.publisher.replay
    assert sum(len(payload) for _, _, payload in ring.batches) <= ring.bytes <= 1 << 20
    reader = setup.reader()
    reader.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = await read_replay(reader)
    assert 50 < len(seqs) < 100 and seqs == list(range(200 - len(seqs), 200))
    assert setup.dropped == {}


@pytest.mark.parametrize("setup", [{"batch_kib": 16}], indirect=True)
async def test_a_one_page_event_over_batch_kib_is_dropped_and_counted_as_a_gap(
    setup: Setup,
) -> None:
    sub = subscriber(setup)
    await asyncio.sleep(0.3)  # let the subscription reach the publisher
    setup.publish(1)
    big = list(range(100_000, 105_000))  # one page of 5,000 tokens: 25 KB
    setup.log.stored([b"p" * 16], None, big, len(big), "CPU")
    setup.publish(1)
    seqs = [int.from_bytes((await recv(sub))[1], "big") for _ in range(2)]
    assert seqs == [0, 2]
    assert setup.dropped == {"events_oversized": 1}


@pytest.mark.parametrize(
    "setup",
    [
        # 1,000 events of 4,000 token ids are queued at once: 160 MB as queue_mib counts
        {
            "replay_batches": 1000,
            "batch_kib": 16,
            "buffer_mib": 1,
            "replay_timeout_s": 5.0,
            "queue_mib": 256,
        }
    ],
    indirect=True,
)
async def test_a_replay_in_progress_holds_no_batch_the_ring_let_go_of(setup: Setup) -> None:
    """The replay reads the ring a slice at a time as it goes. The ring moves on
    while the reader waits (1,000 batches of about 12 KB: more than the socket
    buffers hold), and the replay ends at the first batch the ring no longer
    has, with its end marker, instead of keeping the old ring alive for it."""
    setup.publish(1000, tokens=4000)
    reader = setup.reader(hwm=1)
    reader.send_multipart([b"", (0).to_bytes(8, "big")])
    await asyncio.sleep(0.3)  # the replay starts and fills every queue on the way
    setup.publish(1000, tokens=4000)  # the ring now holds 1000..1999 only
    seqs = await read_replay(reader)
    assert 0 < len(seqs) < 1000 and seqs == list(range(len(seqs)))
    assert setup.dropped == {}


@pytest.mark.parametrize("setup", [{"replay_mib": 1, "batch_kib": 1024}], indirect=True)
async def test_a_batch_of_replay_mib_is_kept_for_replay(setup: Setup) -> None:
    """replay_mib = batch_kib / 1024 is accepted as a ring that holds one batch:
    a batch that fills it (its payload within REPLAY_ENTRY_BYTES of 1 MiB) is
    the newest kept, not let go of at once with every batch before it."""
    setup.publish(2)
    wire, small = setup.publisher.wire, 1 << 16  # tokens below 128: a byte each
    head = len(wire.encode([Stored([b"p" * 16], None, [1] * small, 16, "CPU")])) - small
    tokens = (1 << 20) - 10 - head
    setup.log.stored([b"p" * 16], None, [1] * tokens, 16, "CPU")
    setup.publisher.flush()
    ring = setup.publisher.replay
    assert [len(payload) for _, _, payload in ring.batches] == [(1 << 20) - 10]
    reader = setup.reader()
    reader.send_multipart([b"", (0).to_bytes(8, "big")])
    assert await read_replay(reader) == [2]  # the two before it make room for it
    assert setup.dropped == {}
