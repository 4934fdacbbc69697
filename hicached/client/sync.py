"""The synchronous client: one request at a time, each under ``timeout``."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from hicached.client.core import (
    _SESSION_TRIES,
    CurveKeys,
    Exchange,
    R,
    _Core,
    _decode,
    _keys,
    _prefetch_keys_msg,
    _released,
    _run,
)
from hicached.client.dealer import _NOBLOCK
from hicached.client.handles import (
    Fetch,
    FetchProgress,
    Hit,
    KeysFound,
    Namespace,
    PortableHandle,
    Reservation,
    check_kind,
)
from hicached.errors import (
    DaemonUnavailable,
    DeadlineExceeded,
    ForeignLease,
    LeaseEnded,
    SessionLost,
)
from hicached.wire import protocol as p
from hicached.wire.hashing import pack_tokens
from hicached.wire.namespace import EventMeta, NamespaceSpec

# The most leases a client keeps to release at its next turn (``_orphan``); one
# past it is left to expire, as every one was before.
MAX_ORPHANS = 1024


class Client(_Core):
    """Synchronous client. ``timeout`` bounds every request, in seconds.

    ``curve``: keys for a tcp:// daemon that requires CURVE. ``map_pool``:
    False on a host that does not share the daemon's memory (control calls
    only: match, prefetch, progress, stats; no slot copies).
    ``connect_timeout``: how long a request waits for a connection to the
    daemon before ``DaemonUnavailable`` (covers a daemon restart's reconnect).
    ``prefault``: map the pool's pages in on a background thread after each
    connect, so first copies fault nothing; the connect itself never faults
    the pool in (a large pool maps in one system call). ``max_reply_bytes``:
    the largest message taken from the daemon (wire/protocol.py's
    MAX_REPLY_BYTES by default, far above what a daemon sends); a larger one
    drops the connection before it is buffered, and the call ends at its
    timeout.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 5.0,
        name: str = "",
        curve: CurveKeys | None = None,
        map_pool: bool = True,
        connect_timeout: float = 0.5,
        prefault: bool = False,
        max_reply_bytes: int = p.MAX_REPLY_BYTES,
    ) -> None:
        super().__init__(
            endpoint, timeout, name, curve, map_pool, connect_timeout, prefault, max_reply_bytes
        )
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._configure(self._sock)
        self._rcvtimeo = -1
        # one call at a time on the socket (a call of another thread would take
        # this one's reply); reentrant: a call may say hello first (connect)
        self._turn = threading.RLock()
        # leases of handles that never reached their caller, whose ending could
        # not go out (no turn in time, an interrupt): (instance, lease), each
        # released without waiting at the next turn any thread takes
        self._orphans: deque[tuple[int, int]] = deque(maxlen=MAX_ORPHANS)

    def __enter__(self) -> Client:
        try:
            self.connect()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Say goodbye (the daemon ends this session and its leases), then close.
        A call another thread waits in ends with ``DaemonUnavailable``; later
        calls raise ``BadRequest``."""
        self._closing = True  # a waiting call sees it within one receive slice
        if self._forked():
            # the turn may be held by a thread of the parent, which this process lacks
            self._shut(self._sock, self._ctx)
            return
        if not self._turn.acquire(timeout=self.timeout):
            raise DeadlineExceeded(f"a call on this client did not end within {self.timeout:.3g}s")
        try:
            self._shut(self._sock, self._ctx)
        finally:
            self._turn.release()

    def _take_turn(self) -> None:
        """Wait, at most ``timeout``, for the calls of other threads to end; in a
        forked child, refuse at once (a parent's thread may hold the turn there)."""
        self._check_process()
        if not self._turn.acquire(timeout=self.timeout):
            raise DeadlineExceeded(
                f"calls of other threads held this client for {self.timeout:.3g}s"
            )
        while self._orphans:
            instance, lease = self._orphans.popleft()
            if instance == self._instance:  # one that ended with its daemon is gone
                self._let_go(self._sock, lease)

    def _orphan(self, handle: Hit | Reservation | Fetch, exc: BaseException) -> None:
        """The request that ended ``handle`` failed with ``exc``, and its lease
        may still be open (unless the daemon said it is not open, or not this
        client's): release it at the next turn (a call of this client's may
        never come: then it ends at its expiry, as before)."""
        if self._left_open(handle, exc):
            self._orphans.append((handle.instance, handle.lease))

    def _roundtrip(self, request: p.Request) -> p.AnyReply:
        sock = self._sock
        try:
            return self._ask(sock, request)
        except zmq.ZMQError:
            # close() in a signal handler that ran on this call's thread (an
            # engine's shutdown) closed the socket under the call
            if sock.closed:
                raise DaemonUnavailable("client closed") from None
            raise

    def _ask(self, sock: zmq.Socket[Any], request: p.Request) -> p.AnyReply:
        """Send ``request`` and wait, at most ``timeout``, for its reply."""
        payload, request_id, budget = self._stamp(request), request.id, self.timeout
        sent = time.monotonic()
        try:
            sock.send(payload, _NOBLOCK)
        except zmq.Again:
            # no connection (IMMEDIATE): wait briefly for one, as after a restart
            if not sock.poll(int(min(budget, self.connect_timeout) * 1000), zmq.POLLOUT):
                self._redial(sock)  # for the next call
                raise self._unavailable() from None
            sock.send(payload, zmq.NOBLOCK)
        slice_ms = max(1, int(min(budget, 0.1) * 1000))
        if slice_ms != self._rcvtimeo:  # a blocking receive: one wake-up, no poll
            sock.setsockopt(zmq.RCVTIMEO, slice_ms)
            self._rcvtimeo = slice_ms
        while True:
            try:
                reply = _decode(sock.recv())
            except zmq.Again:
                if self._closing:  # close() on another thread
                    raise DaemonUnavailable("client closed") from None
                if time.monotonic() >= sent + budget:
                    raise DeadlineExceeded(
                        f"no reply from the daemon at {self.endpoint} within {budget:.3g}s"
                    ) from None
                if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
                    self._redial(sock)  # the connection went away: for the next call
                    raise self._dropped() from None
                continue
            except msgspec.MsgspecError:
                pass  # not a reply this client understands: keep waiting
            else:
                if reply.id == request_id:
                    return reply
                # the late reply of a request that timed out or was interrupted,
                # or of the gather report, which no call waits for
                self._unclaimed(sock, reply)
            # a daemon that sends nothing but other messages never lets recv
            # time out: the deadline is checked after each of them too
            if time.monotonic() >= sent + budget:
                raise DeadlineExceeded(
                    f"no reply from the daemon at {self.endpoint} within {budget:.3g}s"
                )

    def _do(self, gen: Exchange) -> Any:
        self._take_turn()
        try:
            result = _run(gen, self._roundtrip)
            self._report_gather(self._sock)  # once a session, when the process has a pick
        finally:
            self._turn.release()
        return result

    def _call(self, make: Callable[[], p.Request], expect: type[R], instance: int = 0) -> R:
        """``_exchange`` without a generator to drive: the path of the operations
        an engine makes every step (match, exists_keys, prefetch, release)."""
        self._take_turn()
        try:
            for attempt in range(_SESSION_TRIES):
                if self._hello is None:
                    self.connect()
                self._same_instance(instance)
                reply = self._roundtrip(make())  # made anew: a new hello may renumber them
                if isinstance(reply, expect):
                    return reply
                self._refused(reply, expect, attempt)
        finally:
            self._turn.release()
        raise SessionLost("the daemon keeps forgetting this client")  # pragma: no cover

    def connect(self) -> Client:
        """Say hello and map the pool; raises if the daemon does not answer in time."""
        if self._hello is None:
            self._do(self._handshake())
        return self

    def register(
        self, spec: NamespaceSpec | None = None, *, events: EventMeta | None = None, **fields: Any
    ) -> Namespace:
        """Register a namespace (``spec``, or its fields); ``events``: what its KV
        events say of its pages (EventMeta; protocol 1.6, not sent to older
        daemons)."""
        return self._do(self._register(spec, fields, events))

    def reserve(self, ns: Namespace, tokens: Any) -> Reservation:
        return self._do(self._reserve(ns, tokens))

    def commit(
        self,
        res: Reservation | Fetch,
        pages: int | None = None,
        *,
        ok: Sequence[bool] | None = None,
    ) -> p.CommitOk:
        """Publish the first ``pages`` pages of a reservation or a prefetch (None: all
        reserved, or all read so far); the rest is released. ``ok`` (key-addressed
        reservations): one flag per fresh slot, publishing only the pages written."""
        return self._do(self._commit(res, pages, ok))

    def exists_keys(self, ns: Namespace, keys: Sequence[bytes]) -> KeysFound:
        """Where the pages of ``keys`` are (L2, L3); pins nothing."""
        wire = _keys(keys)
        return self._found(
            self._call(lambda: p.ExistsKeys(id=0, ns=ns.id, keys=wire), p.ExistsKeysOk)
        )

    def adopt(self, handle: PortableHandle) -> Reservation | Hit:
        check_kind(handle, PortableHandle, "adopt", "a PortableHandle (from portable())")
        if handle.instance != self._instance:
            self.stats()  # a handle of another instance: say hello to the daemon there now
        return super().adopt(handle)

    def match_keys(self, ns: Namespace, keys: Sequence[bytes], *, lease: bool = True) -> Hit:
        """The leading ``keys`` in L2, pinned under a read lease (``lease``)."""
        wire, sent = _keys(keys), time.monotonic()
        ok = self._call(lambda: p.MatchKeys(id=0, ns=ns.id, keys=wire, lease=lease), p.MatchOk)
        return self._hit(ns, ok, sent)

    def reserve_keys(
        self, ns: Namespace, keys: Sequence[bytes], *, parent: bytes | None = None
    ) -> Reservation:
        """Slots for the ``keys`` not in L2 (``indices`` says which); ``parent``: the
        key before ``keys[0]`` in its sequence."""
        return self._do(self._reserve_keys(ns, keys, parent))

    def prefetch_keys(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        *,
        max_pages: int = -1,
        parent: bytes | None = None,
    ) -> Fetch:
        """Start loading from L3 the ``keys`` after their leading L2 run; ``parent``:
        the key before ``keys[0]`` in its sequence (a daemon of protocol 1.11 or
        later takes it)."""
        wire = _keys(keys)
        ok = self._call(
            lambda: _prefetch_keys_msg(ns.id, wire, max_pages, parent, self._minor()), p.PrefetchOk
        )
        return Fetch(ns, ok.lease, ok.l2_hits, self._instance)

    def prefetch(self, ns: Namespace, tokens: Any, *, max_pages: int = -1) -> Fetch:
        """Start loading from L3 the pages of ``tokens`` after its L2 hit."""
        packed = pack_tokens(tokens)
        ok = self._call(
            lambda: p.Prefetch(id=0, ns=ns.id, tokens=packed, max_pages=max_pages), p.PrefetchOk
        )
        return Fetch(ns, ok.lease, ok.l2_hits, self._instance)

    def progress(self, pf: Fetch) -> FetchProgress:
        return self._do(self._progress(pf))

    def cancel(self, pf: Fetch) -> None:
        """Give up a prefetch; its slots are freed once no read is writing into them."""
        self._do(self._release(pf))

    def abort(self, res: Reservation) -> None:
        self._do(self._release(res))

    def match(self, ns: Namespace, tokens: Any, *, lease: bool = True) -> Hit:
        """The leading pages of ``tokens`` in L2, pinned under a read lease (``lease``)."""
        packed, sent = pack_tokens(tokens), time.monotonic()
        ok = self._call(lambda: p.Match(id=0, ns=ns.id, tokens=packed, lease=lease), p.MatchOk)
        return self._hit(ns, ok, sent)

    def release(self, handle: Hit | Reservation | Fetch) -> None:
        """End a handle's lease: unpin a hit, abort a reservation, cancel a prefetch."""
        # ``_release`` without a generator to drive: an engine releases every hit
        send = self._releasing(handle)  # a view is refused before anything
        # one turn for the release and the report after it (the lock is
        # reentrant): another thread's call in between could hold the report
        # past its timeout, and a release that was done would raise
        try:
            self._take_turn()
        except BaseException as exc:
            if send:
                self._orphan(handle, exc)
            _released(handle)
            raise
        try:
            try:
                if send:
                    self._call(lambda: p.Release(id=0, lease=handle.lease), p.Ok, handle.instance)
            except LeaseEnded:
                pass  # it ended with the daemon that granted it: released
            except ForeignLease:
                raise  # another client's lease: this handle stays as it was
            except BaseException as exc:
                # out of time or interrupted: the daemon may not have it (one
                # past its deadline drops it), so it goes again at the next turn
                if send:
                    self._orphan(handle, exc)
                _released(handle)
                raise
            _released(handle)
            self._report_gather(self._sock)  # as after every call through _do
        finally:
            self._turn.release()

    def renew(self, handle: Reservation | Hit) -> None:
        """Push the handle's lease deadline ``leases.ttl_s`` into the future."""
        self._do(self._renew(handle))

    def stats(self, *, session: bool = True) -> p.DaemonStats:
        """The daemon's figures. ``session=False`` asks without saying hello when
        this client has no session (a probe: it takes no client slot)."""
        return self._do(self._stats(session))

    def store(self, ns: Namespace, tokens: Any, pages: np.ndarray) -> p.CommitOk:
        """Store every full page of ``tokens``; ``pages[i]`` holds page i's bytes."""
        res = self.reserve(ns, tokens)
        try:
            self._store_data(res, pages)
        except BaseException:
            try:
                self.abort(res)
            except BaseException as exc:
                self._orphan(res, exc)  # ended at the next turn
                raise
            raise
        try:
            return self.commit(res)
        except BaseException as exc:
            # ``res`` never reaches the caller: a commit that did not go out (no
            # turn in time, an interrupt) or was refused leaves its slots held
            self._orphan(res, exc)
            raise

    def load(self, ns: Namespace, tokens: Any) -> np.ndarray:
        """Copy out the leading pages of ``tokens`` present in L2 (n, page_bytes)."""
        hit = self.match(ns, tokens)
        try:
            return self.read_pages(hit)
        finally:
            self.release(hit)
