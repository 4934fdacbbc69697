"""The request loop: from the ROUTER socket to the cache and back.

The socket is read by a drain loop: the event loop wakes on the socket's file
descriptor and this receives without blocking until the socket is empty, a
bounded batch (``server.drain_batch``) at a time, then lets other work run.
Every request gets a reply or is counted as dropped: a message too large or
undecodable gets an error reply when its id can be read; a fault while
serving one (a bug) becomes an ``internal`` error reply (its log line rate
limited) and the drain goes on with the next message. A reply that waits on
L3 goes out once the tier has asked the backend (``L3Lookup``).

The daemon's lifecycle (binding the socket, closing it, reloads) is
daemon/server.py's; this owns no socket, only reads and answers on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import msgspec
import zmq

from hicached.cache import OP_NAMES, Cache, L3Lookup
from hicached.config import ServerConfig
from hicached.daemon.journal import JournalFile
from hicached.daemon.metrics import Metrics
from hicached.daemon.tenants import is_operator, user_id
from hicached.daemon.tier import Tier
from hicached.errors import BadRequest, HicachedError, TooLarge
from hicached.wire import protocol as p
from hicached.wire.peek import peek_request

log = logging.getLogger("hicached")

TOO_DEEP = "malformed request: values nested deeper than any request has"
INTERNAL = (
    "the daemon failed on this request (a bug; the daemon's log has the details); it may "
    "have been applied in part, and a lease it opened expires after leases.ttl_s"
)

# socket flags and options as plain ints: pyzmq converts its enums on every call
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_POLLIN = int(zmq.POLLIN)
# frames past a request's two read and let go of in one turn of the event loop:
# a message of millions of frames is read over many turns, other work between
SKIP_BATCH = 4096


def let_go(sock: zmq.Socket[bytes]) -> bool:
    """Read and let go of the rest of a message that is not a request, up to
    ``SKIP_BATCH`` frames (a peer may send millions: none is kept, and the
    event loop is not held while they are read); True once its last frame
    was read, False when frames remain for another turn."""
    recv = sock.recv
    return any(not recv(_NOBLOCK, copy=False).more for _ in range(SKIP_BATCH))


class RequestLoop:
    """Serves the requests on ``sock`` (bound, owned and closed by the server).

    ``config``: the server section, replaced on a reload (``drain_batch`` may
    change at run time). ``tenants``: the socket's peers carry their tenant as
    the ZAP User-Id. ``metrics`` times each request; ``tier`` answers the
    lookups of requests that wait on L3; ``journal`` (pool.adopt) is written
    before any reply goes out."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        cache: Cache,
        config: ServerConfig,
        *,
        tenants: bool,
        metrics: Metrics | None,
        tier: Tier | None,
        journal: JournalFile | None = None,
    ) -> None:
        self.sock = sock
        self.journal = journal  # written before each reply: what a reply says is in it
        self.cache = cache
        self.config = config
        self.tenants = tenants
        self.metrics = metrics
        self.tier = tier
        self._fault_logged = -math.inf  # monotonic time of the last logged internal error
        self._faults_unlogged = 0  # internal errors since then, not logged
        self._skipping = False  # the frames of a message that is not a request remain

    def start(self) -> None:
        """Read on the socket's readiness, and once now: messages may be queued."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.fileno(), self._drain)
        loop.call_soon(self._drain)

    def stop(self) -> None:
        """Read no more (the socket stays open until its owner closes it)."""
        if not self.sock.closed:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())

    def _drain(self) -> None:
        """Handle what the socket holds, up to ``drain_batch`` requests a turn.

        Frame by frame, with integer flags. With tenants a request's frame is
        read as a frame, for the User-Id that the ZAP handler gave its
        connection (the peer's tenant); without, as bytes, and ``RCVMORE``
        says whether more frames follow (a frame object costs more than the
        option). After each request one ``EVENTS`` read says whether another
        waits, which also re-arms the socket's file descriptor; no empty
        receive is raised.
        """
        sock = self.sock
        if sock.closed:  # stopped, with a turn still queued
            return
        if self._skipping and not self._skip():
            return
        recv, get, tenants = sock.recv, sock.getsockopt, self.tenants
        for _ in range(self.config.drain_batch):
            try:
                routing_id = recv(_NOBLOCK)
            except zmq.Again:
                return
            # a message's frames arrive together, and a routing id never alone
            if tenants:
                frame = recv(_NOBLOCK, copy=False)
                frames, peer, more = [routing_id, frame.bytes], user_id(frame), frame.more
            else:
                frame = None
                frames, peer, more = [routing_id, recv(_NOBLOCK)], None, bool(get(_RCVMORE))
            if more:  # not a request (_handle counts it): the rest is read and let go
                frames.append(b"")  # one frame past a request's two, however many came
            try:
                self._handle(frames, peer, frame)
            except Exception as exc:  # a bug: this request fails, the others go on
                self._fault(frames, exc)
            if more:
                self._skipping = True
                if not self._skip():
                    return
            if not int(get(_EVENTS)) & _POLLIN:
                return
        asyncio.get_running_loop().call_soon(self._drain)  # more may wait; let others run first

    def _skip(self) -> bool:
        """``let_go`` of the rest of a message that is not a request; False when
        frames remain: another turn of the drain is queued to read on."""
        if let_go(self.sock):
            self._skipping = False
            return True
        asyncio.get_running_loop().call_soon(self._drain)
        return False

    def _handle(
        self, frames: list[bytes], peer: str | None = None, frame: zmq.Frame | None = None
    ) -> None:
        """One request; ``frame`` (with tenants) says whether its peer is the
        operator, asked of stats alone."""
        cache = self.cache
        if len(frames) != 2:
            cache.count_drop("bad_frames")
            return
        routing_id, payload = frames
        if len(payload) > self.config.max_message_bytes:
            self._reject(
                routing_id,
                payload,
                TooLarge(
                    f"message of {len(payload)} bytes exceeds server.max_message_bytes "
                    f"({self.config.max_message_bytes})"
                ),
            )
            return
        try:
            request = p.request_decoder.decode(payload)
        except msgspec.MsgspecError as exc:
            self._reject(routing_id, payload, BadRequest(f"malformed request: {exc}"))
            return
        except RecursionError:
            self._reject(routing_id, payload, BadRequest(TOO_DEEP))
            return
        if request.deadline_ms and request.deadline_ms < time.time() * 1000:
            cache.count_drop("past_deadline")
            return
        operator = frame is not None and type(request) is p.Stats and is_operator(frame)
        if self.metrics is None:
            reply = cache.handle(routing_id, request, peer, operator=operator)
        else:
            started = time.perf_counter()
            reply = cache.handle(routing_id, request, peer, operator=operator)
            self.metrics.observe_request(OP_NAMES[type(request)], time.perf_counter() - started)
        if isinstance(reply, L3Lookup):  # L3's record is incomplete: the backend is asked
            self._lookup(routing_id, reply, request.deadline_ms)
            return
        self._send(routing_id, reply)

    def _lookup(self, routing_id: bytes, lookup: L3Lookup, deadline_ms: int) -> None:
        """Send a reply that waits on L3 once the tier has asked the backend (or
        at its deadline); a lease it carries ends if it cannot be sent, or if
        the request's own deadline passed meanwhile (its client gave up on it
        and would drop the reply: the lease would pin its pages until its TTL)."""
        cache, tier = self.cache, self.tier

        def answer(found: int) -> None:
            if self.sock.closed:  # stopping: nobody reads it
                cache.count_drop("unroutable")
                cache.undelivered(routing_id, lookup)
                return
            if deadline_ms and deadline_ms < time.time() * 1000:
                cache.count_drop("past_deadline")
                cache.undelivered(routing_id, lookup)
                return
            try:
                reply = lookup.finish(found)
            except Exception as exc:  # a bug: this request fails, the daemon goes on
                cache.undelivered(routing_id, lookup)
                cache.count_error("internal")
                log.error(
                    "internal error finishing request %d after an L3 lookup",
                    lookup.id,
                    exc_info=exc,
                )
                reply = p.Error(id=lookup.id, code="internal", message=INTERNAL)
            self._send(routing_id, reply)
            # out of the drain: a send may have taken the socket's wake-up (its
            # descriptor signals edges); requests that came meanwhile are read now
            if int(self.sock.getsockopt(_EVENTS)) & _POLLIN:
                asyncio.get_running_loop().call_soon(self._drain)

        if tier is None:  # pragma: no cover - the cache asks only with a tier
            answer(0)
        else:
            tier.lookup(lookup.ns, lookup.keys, answer)

    def _reject(self, routing_id: bytes, payload: bytes, exc: HicachedError) -> None:
        """Answer an unusable message if it names a request id, else drop and count it."""
        cache = self.cache
        try:
            request_id = p.envelope_decoder.decode(payload).id
        except msgspec.MsgspecError:
            cache.count_drop("malformed")
            return
        except RecursionError:  # nested too deep to skip: read the id from the map's head
            found = peek_request(payload)[1]
            if found is None:
                cache.count_drop("malformed")
                return
            request_id = found
        cache.count_error(exc.code)
        self._send(routing_id, p.Error.of(request_id, exc))

    def _fault(self, frames: list[bytes], exc: Exception) -> None:
        """A request made the daemon fail: log it, count it, and answer
        ``internal`` when its id can be read (else drop and count it)."""
        cache = self.cache
        cache.count_error("internal")
        op, request_id = peek_request(frames[-1]) if len(frames) == 2 else ("", None)
        now = time.monotonic()
        if now - self._fault_logged >= 1.0:  # a request that keeps failing must not flood the log
            more = self._faults_unlogged
            log.error(
                "internal error on %s request (id %s)%s",
                op if op.isidentifier() and len(op) <= 32 else "an unknown",
                request_id,
                f"; {more} more since the last report" if more else "",
                exc_info=exc,
            )
            self._fault_logged, self._faults_unlogged = now, 0
        else:
            self._faults_unlogged += 1
        if request_id is None:
            cache.count_drop("internal")
            return
        try:
            self._send(frames[0], p.Error(id=request_id, code="internal", message=INTERNAL))
        except Exception:  # pragma: no cover - the reply itself failed
            cache.count_drop("internal")

    def _send(self, routing_id: bytes, reply: p.AnyReply) -> None:
        """Queue ``reply`` for its client; one that cannot be queued (the
        client's queue is full, or the client is gone) is counted, and a lease
        it granted ends (``undelivered``)."""
        sock, payload = self.sock, p.encode(reply)
        if self.journal is not None:
            self.journal.flush()
        try:
            # two sends with integer flags: a third of what send_multipart costs;
            # a message queues whole or not at all (the HWM admits messages)
            sock.send(routing_id, _SNDMORE_NOBLOCK)
            sock.send(payload, _NOBLOCK)
        except zmq.Again:
            self.cache.count_drop("send_full")
            self.cache.undelivered(routing_id, reply)
        except zmq.ZMQError:  # its client is gone: nobody will use what it granted
            self.cache.count_drop("unroutable")
            self.cache.undelivered(routing_id, reply)
