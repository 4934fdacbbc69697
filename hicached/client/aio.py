"""The asyncio client: many requests in flight (``max_in_flight``), each under
its own deadline, replies matched to requests by id."""

from __future__ import annotations

import asyncio
import contextlib
import time
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
    _keys,
    _prefetch_keys_msg,
    _released,
)
from hicached.client.deadline import within
from hicached.client.handles import (
    Fetch,
    FetchProgress,
    Hit,
    KeysFound,
    Namespace,
    Reservation,
)
from hicached.errors import (
    BadRequest,
    DaemonUnavailable,
    DeadlineExceeded,
    SessionLost,
)
from hicached.wire import protocol as p
from hicached.wire.hashing import pack_tokens
from hicached.wire.namespace import EventMeta, NamespaceSpec


class AsyncClient(_Core):
    """asyncio client; many requests may be in flight at once (``max_in_flight``;
    more wait in the client, as the daemon keeps a bounded number of replies).
    The other options are ``Client``'s."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 5.0,
        name: str = "",
        curve: CurveKeys | None = None,
        map_pool: bool = True,
        connect_timeout: float = 0.5,
        max_in_flight: int = 64,
        prefault: bool = False,
        max_reply_bytes: int = p.MAX_REPLY_BYTES,
    ) -> None:
        # 0 would let no call out (each waits out its timeout); checked before any socket
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise BadRequest(
                f"max_in_flight must be a whole number of requests >= 1, got {max_in_flight!r}"
            )
        super().__init__(
            endpoint, timeout, name, curve, map_pool, connect_timeout, prefault, max_reply_bytes
        )
        self.max_in_flight = max_in_flight  # requests awaiting replies; more wait here
        self._slots: asyncio.Semaphore | None = None
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._configure(self._sock)
        self._pending: dict[int, asyncio.Future[p.AnyReply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one handshake at a time
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the calls

    async def __aenter__(self) -> AsyncClient:
        try:
            await self.connect()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Say goodbye (the daemon ends this session and its leases), then close.
        Calls waiting for replies end with ``DaemonUnavailable``; later calls
        (of this task or others) raise ``BadRequest``."""
        if self._forked():
            # the socket and the event loop's poller are the parent's too (an
            # epoll set survives fork): only this process's state is let go of
            self._closing, self._hello = True, None
            self._pool.close()
            return
        self._bind()  # the reader to stop is this loop's
        self._closing = True  # no new reader, no request out, while the socket closes
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._shut(self._sock, self._ctx)

    async def _read(self) -> None:
        while True:
            payload = await self._sock.recv()
            try:
                reply = p.reply_decoder.decode(payload)
            except msgspec.MsgspecError:
                continue  # not a reply this client understands
            future = self._pending.pop(reply.id, None)
            if future is None or future.done():  # its call was cancelled, or timed out
                self._unclaimed(self._sock, reply)
            else:
                future.set_result(reply)

    def _bind(self) -> None:
        """Calls run on one event loop at a time. Once the loop of the calls
        before has stopped (an ``asyncio.run`` that ended), the client moves to
        the running one: the reader, semaphore and lock of the old loop would
        never wake here. While that loop still runs, the call is refused."""
        self._check_process()  # a forked child's copy of the loop looks as if it ran
        loop = asyncio.get_running_loop()
        old = self._loop
        if loop is old:
            return
        if old is not None and old.is_running():
            raise BadRequest(
                "this AsyncClient is in use on another event loop: make one client per loop"
            )
        self._loop = loop
        if self._reader is not None:
            self._reader.remove_done_callback(self._fail_all)
            if not self._reader.done() and not _gone(old):
                self._reader.cancel()  # runs down if its loop ever runs again
            self._reader = None
        self._pending.clear()  # futures of the old loop: nothing waits on them here
        self._slots = None
        self._lock = asyncio.Lock()

    async def _roundtrip(self, request: p.Request) -> p.AnyReply:
        self._bind()
        # The daemon holds a bounded number of replies per client: never ask for more.
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        started = time.monotonic()
        try:  # a call queued behind max_in_flight others keeps its own deadline
            await within(self._slots.acquire(), self.timeout)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"{self.max_in_flight} requests to {self.endpoint} stayed in flight for "
                f"{self.timeout:.3g}s: this one was not sent"
            ) from None
        try:
            return await self._roundtrip_now(request, self.timeout - (time.monotonic() - started))
        finally:
            self._slots.release()

    async def _roundtrip_now(self, request: p.Request, budget: float) -> p.AnyReply:
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done():  # first call, or the reader failed
            if self._reader is not None:
                self._reader.remove_done_callback(self._fail_all)
                self._fail_all(self._reader)  # its waiters fail now, not the new ones
            self._reader = loop.create_task(self._read())
            self._reader.add_done_callback(self._fail_all)
        if budget < 0.001:
            raise DeadlineExceeded(f"no time left of {self.timeout:.3g}s to send this request")
        payload, request_id = self._stamp(request, budget), request.id
        sock = self._sock
        if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
            # no connection (IMMEDIATE): wait briefly for one, as after a restart
            wait_ms = int(min(budget, self.connect_timeout) * 1000)
            if not await sock.poll(wait_ms, zmq.POLLOUT):  # type: ignore[call-arg]
                self._redial(sock)  # for the next call
                raise self._unavailable()
        future: asyncio.Future[p.AnyReply] = loop.create_future()
        self._pending[request_id] = future
        try:
            await sock.send(payload)
            return await within(future, budget)
        except asyncio.CancelledError:
            if _answered(future):
                self._unclaimed(sock, future.result())  # it came, but the call is cancelled
            raise
        except asyncio.TimeoutError:
            if _answered(future):
                return future.result()  # it came as the deadline did
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
                self._redial(sock)  # the connection went away: for the next call
                raise self._dropped() from None
            raise DeadlineExceeded(
                f"no reply from the daemon at {self.endpoint} within {budget:.3g}s"
            ) from None
        finally:
            self._pending.pop(request_id, None)

    def _fail_all(self, task: asyncio.Task[None]) -> None:
        """The reader died: every waiter fails now instead of at its deadline."""
        if task.cancelled():
            exc: BaseException = DaemonUnavailable("client closed")
        else:
            exc = task.exception() or DaemonUnavailable("reader stopped")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._pending.clear()

    async def _do(self, gen: Exchange) -> Any:
        if self._hello is None:
            await self.connect()  # one hello at a time, not one inside each exchange
        result = await self._drive(gen)
        self._report_gather(self._sock)  # once a session, when the process has a pick
        return result

    async def _drive(self, gen: Exchange) -> Any:
        try:
            request = next(gen)
            while True:
                request = gen.send(await self._roundtrip(request))
        except StopIteration as stop:
            return stop.value

    async def _call(self, make: Callable[[], p.Request], expect: type[R]) -> R:
        """``_exchange`` without a generator to drive (see ``Client._call``)."""
        for attempt in range(_SESSION_TRIES):
            if self._hello is None:
                await self.connect()
            reply = await self._roundtrip(make())
            if isinstance(reply, expect):
                return reply
            self._refused(reply, expect, attempt)
        raise SessionLost("the daemon keeps forgetting this client")  # pragma: no cover

    async def connect(self) -> AsyncClient:
        self._bind()
        async with self._lock:
            if self._hello is None:
                await self._drive(self._handshake())
                self._report_gather(self._sock)
        return self

    async def register(
        self, spec: NamespaceSpec | None = None, *, events: EventMeta | None = None, **fields: Any
    ) -> Namespace:
        """Register a namespace (``spec``, or its fields); ``events``: what its KV
        events say of its pages (EventMeta; protocol 1.6, not sent to older
        daemons)."""
        return await self._do(self._register(spec, fields, events))

    async def reserve(self, ns: Namespace, tokens: Any) -> Reservation:
        return await self._do(self._reserve(ns, tokens))

    async def commit(
        self,
        res: Reservation | Fetch,
        pages: int | None = None,
        *,
        ok: Sequence[bool] | None = None,
    ) -> p.CommitOk:
        return await self._do(self._commit(res, pages, ok))

    async def exists_keys(self, ns: Namespace, keys: Sequence[bytes]) -> KeysFound:
        wire = _keys(keys)
        return self._found(
            await self._call(lambda: p.ExistsKeys(id=0, ns=ns.id, keys=wire), p.ExistsKeysOk)
        )

    async def match_keys(self, ns: Namespace, keys: Sequence[bytes], *, lease: bool = True) -> Hit:
        wire, sent = _keys(keys), time.monotonic()
        ok = await self._call(
            lambda: p.MatchKeys(id=0, ns=ns.id, keys=wire, lease=lease), p.MatchOk
        )
        return self._hit(ns, ok, sent)

    async def reserve_keys(
        self, ns: Namespace, keys: Sequence[bytes], *, parent: bytes | None = None
    ) -> Reservation:
        return await self._do(self._reserve_keys(ns, keys, parent))

    async def prefetch_keys(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        *,
        max_pages: int = -1,
        parent: bytes | None = None,
    ) -> Fetch:
        wire = _keys(keys)
        ok = await self._call(
            lambda: _prefetch_keys_msg(ns.id, wire, max_pages, parent, self._minor()), p.PrefetchOk
        )
        return Fetch(ns, ok.lease, ok.l2_hits, self._instance)

    async def prefetch(self, ns: Namespace, tokens: Any, *, max_pages: int = -1) -> Fetch:
        packed = pack_tokens(tokens)
        ok = await self._call(
            lambda: p.Prefetch(id=0, ns=ns.id, tokens=packed, max_pages=max_pages), p.PrefetchOk
        )
        return Fetch(ns, ok.lease, ok.l2_hits, self._instance)

    async def progress(self, pf: Fetch) -> FetchProgress:
        return await self._do(self._progress(pf))

    async def cancel(self, pf: Fetch) -> None:
        await self._end(pf)

    async def abort(self, res: Reservation) -> None:
        await self._end(res)

    async def match(self, ns: Namespace, tokens: Any, *, lease: bool = True) -> Hit:
        packed, sent = pack_tokens(tokens), time.monotonic()
        ok = await self._call(
            lambda: p.Match(id=0, ns=ns.id, tokens=packed, lease=lease), p.MatchOk
        )
        return self._hit(ns, ok, sent)

    async def release(self, handle: Hit | Reservation | Fetch) -> None:
        await self._end(handle)

    async def _end(self, handle: Hit | Reservation | Fetch) -> None:
        """``_release``. A release cancelled, or out of time, before the daemon
        answered (waiting for its turn, or for a stalled daemon, which drops a
        request past its deadline) goes out again without waiting: whoever gave
        up on it may never ask again (``load``, a cleanup that was cancelled),
        and the lease would pin its pages until it expired."""
        send = self._releasing(handle)  # a view is refused before anything
        try:
            await self._do(self._release(handle))
        except (asyncio.CancelledError, DeadlineExceeded) as exc:
            if send and self._left_open(handle, exc):
                self._let_go(self._sock, handle.lease)
            _released(handle)
            raise

    async def renew(self, handle: Reservation | Hit) -> None:
        await self._do(self._renew(handle))

    async def stats(self, *, session: bool = True) -> p.DaemonStats:
        return await self._do(self._stats(session))

    async def store(self, ns: Namespace, tokens: Any, pages: np.ndarray) -> p.CommitOk:
        res = await self.reserve(ns, tokens)
        try:
            self._store_data(res, pages)
        except BaseException:
            await self.abort(res)
            raise
        try:
            return await self.commit(res)
        except BaseException as exc:
            # ``res`` never reaches the caller: a commit that did not go out
            # (cancelled, or out of time waiting for its turn) or was refused
            # would leave its lease holding the slots until it expired (unless
            # the daemon said it is not open, or not this client's)
            if self._left_open(res, exc):
                self._let_go(self._sock, res.lease)
            raise

    async def load(self, ns: Namespace, tokens: Any) -> np.ndarray:
        hit = await self.match(ns, tokens)
        try:
            return self.read_pages(hit)
        finally:
            await self.release(hit)


def _answered(future: asyncio.Future[p.AnyReply]) -> bool:
    """Whether the reply came (not a failure, not given up)."""
    return future.done() and not future.cancelled() and future.exception() is None


def _gone(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether ``loop`` is gone (its tasks can no longer be cancelled)."""
    return loop is None or loop.is_closed()
