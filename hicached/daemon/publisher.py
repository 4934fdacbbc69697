"""KV events for cache-aware routers: the XPUB and replay sockets.

The cache (synchronous) appends events to an ``EventLog``, a bounded queue
that drops and counts when full. The server's ``Publisher`` sends them in
batches on a ZeroMQ XPUB socket (plain SUB sockets subscribe to it as to a
PUB) as frames ``[topic, seq, payload]``: seq is an 8-byte big-endian counter,
payload a msgpack ``KVEventBatch`` encoded as vLLM encodes it now (events as
maps; ``events.format = "array"`` gives the older positional layout). Events
the queue dropped use up a sequence number that is never sent, so
subscribers see a gap. A batch that a subscriber's full queue refuses is
dropped for every subscriber and counted (XPUB_NODROP makes ZeroMQ refuse
it instead of dropping it unseen): its sequence number is a gap on the live
stream, and the batch is kept for replay. The publisher keeps the last
batches for a replay ROUTER, which answers as vLLM's does: a client sends
``start_seq`` (8 bytes, big-endian) and gets every kept batch from there as
``[topic, seq, payload]``, then ``[b"", END_SEQ, b""]``. The publisher never
blocks the daemon: a replay goes out in slices between which the loop runs
other work, and a subscriber that falls behind catches up through replay.

Memory, in bytes (ZeroMQ counts messages, so bytes are bounded by capping
both): a batch's payload is at most ``events.batch_kib`` (``encode_within``
splits a larger one), so a socket queue of ``n`` messages holds at most ``n``
such batches. The events socket queues ``live_hwm`` of them per subscriber,
within ``events.buffer_mib`` (the subscribers' queues share one copy of each
batch); the replay socket ``replay_hwm`` per reader, within ``buffer_mib`` for
all the readers served at once together (``max_replays``: ``MAX_REPLAYS``, or
as many as ``buffer_mib`` holds batches, if fewer); the replay ring keeps at most
``events.replay_mib``, and a replay in progress reads the ring a slice at a
time, so it keeps no batch the ring let go of.

Media: ``CPU`` for L2 (the shared host pool), the backend's name in capitals
(``FILE``, ``S3``, ``MOONCAKE``, ...) for L3. The cache records events with
hicached's 16-byte page keys (docs/keys.md); on the wire a block hash is, by
default, vLLM's 64-bit integer form of the key (``block_hash``). A
BlockStored's parent is the key of the page before its first block, or None
at the start of a sequence (and where it is not known).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import functools
import itertools
import logging
import socket
import time
from collections.abc import Callable

import zmq

from hicached.cache.eventlog import EventLog
from hicached.config import EventsConfig
from hicached.daemon.requests import let_go
from hicached.daemon.waits import TASK_STOP_S, end_tasks
from hicached.wire.events import END_SEQ, AnyEvent, WireFormat
from hicached.wire.namespace import MAX_MODEL_CHARS

log = logging.getLogger("hicached.events")

# Reason under which batches are counted that a subscriber's full queue refused.
SUBSCRIBER_DROPS = "events_subscriber_full"
# Times the events socket was bound anew to cut a subscriber that kept the
# live stream refused for events.stall_s (every subscriber reconnects).
SUBSCRIBERS_CUT = "events_subscribers_cut"
# Subscription messages read per flush (each subscriber sends one or two a
# connection; reading them keeps the socket's own queue of them short).
SUBSCRIPTIONS_PER_FLUSH = 1024
# Refused batches are logged at most this often, in seconds.
REFUSAL_WARNING_S = 60.0
# Replay messages sent before the loop runs other work.
REPLAY_SLICE = 256
# Replays served at once (fewer where buffer_mib holds fewer batches: max_replays),
# and per reader (one sent, one waiting for it); a request beyond either is refused
# at once with an end marker and counted (replay_busy).
MAX_REPLAYS = 32
REPLAYS_PER_READER = 2
# Replay requests read per wake-up before other work gets the loop.
REPLAY_REQUESTS_PER_WAKE = 64
# Batches not sent because one page's event alone is larger than events.batch_kib
# (a gap in the sequence numbers; an event of several pages is split instead).
OVERSIZED_DROPS = "events_oversized"
# What libzmq keeps per queued batch beside its payload: three frames of 64
# bytes in the pipe, the payload's refcounted header and the allocator's own,
# and a topic longer than 33 bytes (kept apart from the frame).
MESSAGE_OVERHEAD_BYTES = 512
# What the replay ring keeps per batch beside its payload: the tuple, the seq
# and the bytes object's header.
REPLAY_ENTRY_BYTES = 160
# The largest message the replay socket takes from its peers (ZMQ_MAXMSGSIZE; a
# larger one drops that peer's connection before it is buffered): a replay
# request's frames are at most 8 bytes. The events socket takes a flag byte and
# a prefix no longer than the longest topic (subscription_bytes).
PEER_MESSAGE_BYTES = 4096


def _queue_messages(budget: int, config: EventsConfig) -> int:
    """Batches of the largest size that fit in ``budget`` bytes (at least one)."""
    return max(1, budget // (config.batch_kib * 1024 + MESSAGE_OVERHEAD_BYTES))


def live_hwm(config: EventsConfig) -> int:
    """The events socket's high-water mark: ``events.hwm``, lowered so that one
    subscriber's queue of batches of the largest size fits ``events.buffer_mib``.
    The queues of several subscribers hold the same batches (libzmq shares a
    message among them), each adding 192 bytes of frames per batch."""
    return min(config.hwm, _queue_messages(config.buffer_mib << 20, config))


def max_replays(config: EventsConfig) -> int:
    """Replays served at once: ``MAX_REPLAYS``, fewer where ``events.buffer_mib``
    holds fewer batches of the largest size (at least one). A reader's queue
    holds one batch at the least, so 32 readers that read nothing would hold
    32 batches whatever the buffer: with buffer_mib = 1 and batch_kib = 1024,
    32 MiB."""
    return max(1, min(MAX_REPLAYS, _queue_messages(config.buffer_mib << 20, config)))


def replay_hwm(config: EventsConfig) -> int:
    """The replay socket's high-water mark per reader: the queues of the
    ``max_replays`` readers served at once, of batches of the largest size,
    fit ``events.buffer_mib`` together (each reader's queue holds its own
    copies), and one whole replay and its end marker are never refused more
    room than they need."""
    budget = (config.buffer_mib << 20) // max_replays(config)
    return min(config.replay_batches + 1, _queue_messages(budget, config))


# What a subscription message adds to its prefix: ZMTP 3.1's command name with
# its length byte (b"\x0bUNSUBSCRIBE", 12 bytes, or b"\x09SUBSCRIBE", which
# libzmq 4.3 sends; ZMTP 3.0's flag byte is less), and CURVE's MESSAGE box
# around it over tcp (command name, nonce, MAC and flags: 33 bytes).
SUBSCRIPTION_HEADER_BYTES = 12 + 33
# The bound covers a peer's handshake too: CURVE's INITIATE takes about 280
# bytes, and a routing id or properties a subscriber sets add theirs.
HANDSHAKE_BYTES = 1024


def subscription_bytes(config: EventsConfig) -> int:
    """The largest message the events socket takes from a subscriber: a
    subscription to a prefix as long as the longest topic frame of
    ``events.topic`` here (the longest model id in each {model}) with its
    header, or HANDSHAKE_BYTES where that is more; a longer prefix matches
    nothing.

    libzmq keeps every distinct prefix its subscribers hold, a node of about 48
    bytes a byte, for as long as they stay connected: with prefixes of up to
    4 KiB, a subscriber that sent 2,000 distinct ones grew the daemon by 380 MiB.
    A longer message drops its subscriber's connection before it is kept."""
    longest = config.topic.format(host=socket.gethostname(), model="m" * MAX_MODEL_CHARS)
    return max(HANDSHAKE_BYTES, SUBSCRIPTION_HEADER_BYTES + len(longest.encode()))


def topic_template(config: EventsConfig) -> Callable[[str], bytes]:
    """``model -> topic frame`` for ``events.topic``, with {host} filled in."""
    host = socket.gethostname()
    template = config.topic
    if "{model}" not in template:
        fixed = template.format(host=host).encode()
        return lambda _model: fixed
    cache: dict[str, bytes] = {}

    def topic(model: str) -> bytes:
        frame = cache.get(model)
        if frame is None:
            frame = cache[model] = template.format(host=host, model=model).encode()
        return frame

    return topic


def _model(event: AnyEvent) -> str:
    return event.model


def _seq(batch: tuple[int, bytes, bytes]) -> int:
    return batch[0]


class Replay:
    """The last published batches, for the replay socket: (seq, topic, payload).

    At most ``keep`` batches and ``max_bytes`` bytes (payloads, plus
    ``REPLAY_ENTRY_BYTES`` each; the topic frames are shared): the oldest go
    first. The newest batch is kept whatever its size: a ring of one batch
    (``replay_mib`` = ``batch_kib`` / 1024, which the config accepts) would
    otherwise let go of a batch that fills it, and of every batch before it,
    the moment it came. The sequence numbers kept only grow, with gaps where
    batches were not sent (``skip``)."""

    def __init__(self, keep: int, max_bytes: int) -> None:
        self.batches: collections.deque[tuple[int, bytes, bytes]] = collections.deque()
        self.keep = keep
        self.max_bytes = max_bytes
        self.bytes = 0  # what the kept batches take, counted as above
        self.seq = -1

    def next(self, topic: bytes, payload: bytes) -> bytes:
        """Number a batch and keep it; returns its seq frame."""
        self.seq += 1
        batches = self.batches
        batches.append((self.seq, topic, payload))
        self.bytes += len(payload) + REPLAY_ENTRY_BYTES
        while len(batches) > 1 and (len(batches) > self.keep or self.bytes > self.max_bytes):
            self.bytes -= len(batches.popleft()[2]) + REPLAY_ENTRY_BYTES
        return self.seq.to_bytes(8, "big")

    def skip(self) -> None:
        """Use up a sequence number for events that were dropped: a gap."""
        self.seq += 1

    def between(self, start: int, last: int, most: int) -> list[tuple[int, bytes, bytes]]:
        """Up to ``most`` kept batches numbered ``start`` to ``last``, oldest first."""
        batches = self.batches
        first = bisect.bisect_left(batches, start, key=_seq)
        return list(
            itertools.takewhile(
                lambda b: b[0] <= last, itertools.islice(batches, first, first + most)
            )
        )

    def count(self, start: int, last: int) -> int:
        """How many kept batches are numbered ``start`` to ``last``."""
        batches = self.batches
        return bisect.bisect_right(batches, last, key=_seq) - bisect.bisect_left(
            batches, start, key=_seq
        )


Bind = Callable[["zmq.Socket[bytes]", str, str], None]


class Publisher:
    """Sends the cache's KV events and serves replays; owned by the server.

    ``start`` binds the XPUB socket (and the replay ROUTER when configured)
    and publishes what the ``EventLog`` holds every ``flush_interval_s``;
    ``stop`` publishes what is still queued and closes the sockets, giving
    queued messages ``close_linger_s`` to leave. Drops are counted in the
    ``dropped`` counters (the cache's, which status and metrics export).

    Live batches, with several subscribers: a batch goes to every subscriber
    or to none. The socket queues up to ``hwm`` messages per subscriber and,
    with XPUB_NODROP, refuses a batch when any subscriber's queue is full
    (the send never blocks); the batch is then dropped for all of them,
    counted once (``events_subscriber_full``), and its sequence number stays
    a gap on the live stream, so each subscriber's gaps are exactly the
    counted drops: no subscriber misses a batch that was not counted. The
    refused batch is kept for replay like any other, where a subscriber that
    saw the gap fetches it. Nothing is held back for a retry: memory stays
    the replay ring's, and the next batch is offered as if nothing happened,
    so the live stream resumes for everyone as soon as the slow subscriber
    reads (or goes away). A subscriber that stays connected and never reads
    keeps the live stream down for all of them, each seeing counted gaps
    that replay fills; ZeroMQ has no way to drop one subscriber's copy and
    count it, and a socket that dropped silently could not count at all.
    After ``stall_s`` of refusals the socket is bound anew (``_cut_subscribers``):
    every subscriber reconnects, and the live stream reaches the readers again.
    (libzmq 4.3.5 keeps a refused batch's subscribers matched until a send
    succeeds, so a full queue refuses the batches of other topics too.)

    A replay goes to its reader in slices of ``REPLAY_SLICE`` messages with
    the loop free between them. The ROUTER refuses (never silently drops) a
    message for a reader whose queue is full (``replay_hwm`` messages, a whole
    replay where ``events.buffer_mib`` allows), and the replay waits for the
    reader. A reader that reads nothing
    for ``replay_timeout_s`` gets the end marker after the last batch sent,
    so it knows where the replay stopped; what was not sent is counted
    (``replay_send``). Replays to one reader run one after the other.
    """

    def __init__(self, config: EventsConfig, log: EventLog, dropped: dict[str, int]) -> None:
        self.config = config
        self.log = log
        self.dropped = dropped
        self.replay = Replay(config.replay_batches, config.replay_mib << 20)
        self._batch_bytes = config.batch_kib * 1024
        self._max_replays = max_replays(config)
        self.wire = WireFormat(config)
        self.topic = topic_template(config)
        self._by_model = "{model}" in config.topic
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._bind: Bind | None = None
        self._refused_since: float | None = None  # the live stream is refused since
        self._rebinding = False  # cut: the events socket is to be bound again
        self._rebind_failed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._replays: dict[bytes, asyncio.Task[None]] = {}  # each reader's last replay
        self._per_reader: collections.Counter[bytes] = collections.Counter()  # live replays
        self._live: set[asyncio.Task[None]] = set()
        self._skipping = False  # the frames of a message that is not a request remain
        self._warned_at = -REFUSAL_WARNING_S  # when refused batches were last logged
        log.count_drops_in(dropped)

    def _count(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, ctx: zmq.Context[zmq.Socket[bytes]], bind: Bind) -> None:
        """Bind the sockets with ``bind(socket, endpoint, config key)`` and start
        publishing; call on the event loop."""
        cfg = self.config
        loop = self._loop = asyncio.get_running_loop()
        self._ctx, self._bind = ctx, bind
        self._open_pub()
        if cfg.replay_endpoint:
            router = ctx.socket(zmq.ROUTER)
            self._router = router
            router.setsockopt(zmq.LINGER, 0)
            # Refuse, never drop: a send beyond the reader's queue raises instead.
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.SNDHWM, replay_hwm(cfg))
            router.setsockopt(zmq.MAXMSGSIZE, PEER_MESSAGE_BYTES)
            bind(router, cfg.replay_endpoint, "events.replay_endpoint")
            loop.add_reader(router.fileno(), self._on_requests)
        self._flusher = loop.create_task(self._flush_loop())

    def _open_pub(self) -> zmq.Socket[bytes]:
        assert self._ctx is not None and self._bind is not None
        pub = self._ctx.socket(zmq.XPUB)
        self._pub = pub  # closed by close() whatever fails below: the context waits for it
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, live_hwm(self.config))
        # A subscriber's full queue refuses the send (zmq.Again), so the drop is ours
        # to count; a PUB socket would drop the batch for that subscriber unseen.
        pub.setsockopt(zmq.XPUB_NODROP, 1)
        pub.setsockopt(zmq.MAXMSGSIZE, subscription_bytes(self.config))
        self._bind(pub, self.config.endpoint, "events.endpoint")
        return pub

    def _cut_subscribers(self) -> zmq.Socket[bytes] | None:
        """The live stream stayed refused for ``stall_s``: a subscriber is connected
        but reads nothing. Bind the events socket anew, which cuts every
        subscriber's connection and discards their queues; they reconnect on their
        own, see a gap, and fill it from replay."""
        self._count(SUBSCRIBERS_CUT)
        log.warning(
            "KV events: the live stream was refused for %.1fs (a subscriber reads "
            "nothing): the events socket is bound anew, every subscriber reconnects",
            self.config.stall_s,
        )
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        self._refused_since = None
        self._rebinding = True
        return self._rebind()

    def _rebind(self) -> zmq.Socket[bytes] | None:
        """Bind the events socket again after a cut; None while the address is not
        free yet (a TCP port the old socket still holds): tried again next flush,
        the events waiting in the queue meanwhile (bounded by queue_events)."""
        try:
            pub = self._open_pub()
        except zmq.ZMQError as exc:
            if self._pub is not None:
                self._pub.close(linger=0)
                self._pub = None
            if not self._rebind_failed:
                self._rebind_failed = True
                log.warning("KV events: binding the events socket again: %s; retrying", exc)
            return None
        self._rebinding = self._rebind_failed = False
        return pub

    async def stop(self) -> None:
        """Publish every queued event, then close within ``close_linger_s``."""
        if self._flusher is not None:
            await end_tasks((self._flusher,), TASK_STOP_S, "the KV events flusher")
            self._flusher = None
        self._stop_reading()
        await end_tasks(list(self._live), TASK_STOP_S, "KV event replays")
        self.flush()
        self.close(self.config.close_linger_s)

    def close(self, linger_s: float = 0.0) -> None:
        """Close the sockets (idempotent); queued messages get ``linger_s`` to leave."""
        self._stop_reading()
        linger_ms = int(linger_s * 1000)
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=linger_ms)
        self._pub = self._router = None

    def _stop_reading(self) -> None:
        if self._router is not None and self._loop is not None:
            with contextlib.suppress(Exception):  # the loop may be closing
                self._loop.remove_reader(self._router.fileno())

    # -- publishing --------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.flush_interval_s)
            try:
                self.flush()
            except Exception:  # a bug: logged, and publishing goes on
                log.exception("publishing KV events failed")

    def flush(self) -> None:
        """Publish what the log holds, in batches; never blocks."""
        pub = self._pub
        if pub is None and self._rebinding:
            pub = self._rebind()
        if pub is None or pub.closed:  # closed: its bind failed, and the start with it
            return
        self._read_subscriptions(pub)
        log, size = self.log, self.config.batch_events
        while True:
            events, gap = log.take(size)
            if events:
                if self._by_model:
                    for model, run in itertools.groupby(events, _model):
                        self._publish(pub, model, list(run))
                else:
                    self._publish(pub, "", events)
                if self._stalled():
                    new = self._cut_subscribers()
                    if new is None:
                        return
                    pub = new
            if gap:
                self.replay.skip()
            elif not events:
                return

    def _publish(self, pub: zmq.Socket[bytes], model: str, events: list[AnyEvent]) -> None:
        topic, payload = self.topic(model), self.wire.encode(events)
        if len(payload) <= self._batch_bytes:
            self._send_batch(pub, topic, payload)
            return
        # Too large for the queues' bounds: as several batches, each event whole
        # where it fits, in order (rare: 64 commits of 2,048-token prompts fit 1 MiB).
        for piece in self.wire.encode_within(events, self._batch_bytes):
            if piece is not None:
                self._send_batch(pub, topic, piece)
                continue
            self.replay.skip()
            self._count(OVERSIZED_DROPS)
            log.warning(
                "a KV event of one page is larger than events.batch_kib (%d): it is "
                "dropped (%s); raise batch_kib for pages this large",
                self.config.batch_kib,
                OVERSIZED_DROPS,
            )

    def _send_batch(self, pub: zmq.Socket[bytes], topic: bytes, payload: bytes) -> None:
        seq = self.replay.next(topic, payload)  # kept for replay, sent or not
        try:
            pub.send_multipart([topic, seq, payload], zmq.NOBLOCK)
            self._refused_since = None
        except zmq.Again:
            if self._refused_since is None:
                self._refused_since = time.monotonic()
            # Some subscriber's queue is full: nobody got it (a gap for all), counted.
            self._count(SUBSCRIBER_DROPS)
            now = time.monotonic()
            if now - self._warned_at >= REFUSAL_WARNING_S:
                self._warned_at = now
                log.warning(
                    "a KV event subscriber's queue is full (events.hwm): batches are "
                    "dropped for every subscriber until it reads (%d so far, %s)",
                    self.dropped[SUBSCRIBER_DROPS],
                    SUBSCRIBER_DROPS,
                )

    def _stalled(self) -> bool:
        """Whether every send has been refused for ``stall_s`` (0: never cut)."""
        since, stall = self._refused_since, self.config.stall_s
        return since is not None and stall > 0 and time.monotonic() - since >= stall

    def _read_subscriptions(self, pub: zmq.Socket[bytes]) -> None:
        """Read what subscribers sent (subscribe and unsubscribe messages) so the
        socket does not keep them; nothing is done with them."""
        for _ in range(SUBSCRIPTIONS_PER_FLUSH):
            try:
                pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    # -- replay ------------------------------------------------------------------------

    def _on_requests(self) -> None:
        """[id, (b"",) start_seq] -> [id, (b"",) topic, seq, payload] ...
        [id, (b"",) b"", END_SEQ, b""], as vLLM's replay socket answers."""
        sock, loop = self._router, self._loop
        if sock is None or loop is None:
            return
        if self._skipping and not self._skip(sock, loop):
            return
        for _ in range(REPLAY_REQUESTS_PER_WAKE):
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            # A request has 2 or 3 frames: a third past the identity is enough to
            # refuse it, and the rest is let go of unread a turn at a time (a peer
            # that sent millions held the loop, and doubled their memory, as a list).
            frames = [frame.bytes]
            while frame.more and len(frames) < 4:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
                frames.append(frame.bytes)
            envelope, body = frames[:-1], frames[-1]
            if frame.more or not envelope or len(body) != 8 or len(frames) > 3:
                self._count("bad_replay_request")
                if len(frames) > 3:  # its identity, and the delimiter a DEALER sent
                    envelope = frames[:2] if frames[1] == b"" else frames[:1]
                self._refuse(envelope)
                if frame.more:
                    self._skipping = True
                    if not self._skip(sock, loop):
                        return
                continue
            reader = envelope[0]
            busy = len(self._live) >= self._max_replays
            if busy or self._per_reader[reader] >= REPLAYS_PER_READER:
                self._count("replay_busy")
                self._refuse(envelope)
                continue
            start = int.from_bytes(body, "big")  # unsigned, as vLLM reads it
            task = loop.create_task(self._replay(envelope, start, self._replays.get(reader)))
            self._replays[reader] = task
            self._per_reader[reader] += 1
            self._live.add(task)
            task.add_done_callback(functools.partial(self._replay_done, reader))
        loop.call_soon(self._on_requests)  # more may wait; let others run first

    def _skip(self, sock: zmq.Socket[bytes], loop: asyncio.AbstractEventLoop) -> bool:
        """``let_go`` of the rest of a message that is not a request; False when
        frames remain (another turn reads on)."""
        if let_go(sock):
            self._skipping = False
            return True
        loop.call_soon(self._on_requests)
        return False

    def _refuse(self, envelope: list[bytes]) -> None:
        """Answer a request that is not served with the end marker alone, so the
        reader learns it at once (nothing is sent if its queue is full)."""
        if envelope and self._router is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._router.send_multipart([*envelope, b"", END_SEQ, b""], zmq.NOBLOCK)

    def _replay_done(self, reader: bytes, task: asyncio.Task[None]) -> None:
        self._live.discard(task)
        self._per_reader[reader] -= 1
        if not self._per_reader[reader]:
            del self._per_reader[reader]
        if self._replays.get(reader) is task:
            del self._replays[reader]
        if not task.cancelled() and task.exception() is not None:
            log.error("a replay failed", exc_info=task.exception())

    def _poke(self) -> None:
        """Sends can take the socket's readable signal: look for requests again."""
        sock, loop = self._router, self._loop
        if sock is not None and loop is not None and int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
            loop.call_soon(self._on_requests)

    async def _replay(
        self, envelope: list[bytes], start: int, before: asyncio.Task[None] | None
    ) -> None:
        if before is not None:
            await asyncio.wait([before])  # the reader's earlier replay goes first
        # The batches kept from ``start`` up to the newest now, read from the ring a
        # slice at a time: one that leaves the ring before its turn is a gap here
        # too, and a replay in progress holds no more than a slice of them.
        replay, last = self.replay, self.replay.seq
        while batches := replay.between(start, last, REPLAY_SLICE):
            sent = await self._send(envelope, batches)
            if sent < len(batches):
                self._count("replay_send", replay.count(batches[sent][0], last))
                break
            start = batches[-1][0] + 1
        # The end marker follows the last batch sent: the reader knows where it stopped.
        if not await self._send(envelope, [(-1, b"", b"")]):
            self._count("replay_send")

    async def _send(self, envelope: list[bytes], batches: list[tuple[int, bytes, bytes]]) -> int:
        """Send ``[*envelope, topic, seq, payload]`` in order, a slice at a time, waiting
        while the reader's queue is full; returns how many went out before the
        reader went away or read nothing for ``replay_timeout_s``."""
        loop = asyncio.get_running_loop()
        timeout = self.config.replay_timeout_s
        sent, total = 0, len(batches)
        stalled_since = loop.time()
        pause = 0.001
        while sent < total:
            sock = self._router
            if sock is None:
                return sent
            before = sent
            end = min(sent + REPLAY_SLICE, total)
            try:
                while sent < end:
                    seq, topic, payload = batches[sent]
                    sock.send_multipart(
                        [*envelope, topic, seq.to_bytes(8, "big", signed=True), payload],
                        zmq.NOBLOCK,
                    )
                    sent += 1
            except zmq.Again:
                pass  # the reader's queue is full
            except zmq.ZMQError:
                return sent  # the reader is gone
            self._poke()
            if sent > before:
                stalled_since, pause = loop.time(), 0.001
                await asyncio.sleep(0)
            elif loop.time() - stalled_since >= timeout:
                return sent
            else:
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.05)
        return sent
