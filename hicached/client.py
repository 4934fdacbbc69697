"""Engine-side client: talk to the daemon, map its pool, copy pages zero-copy.

``Client`` is synchronous and ``AsyncClient`` is for asyncio; both run the
same exchange logic (hello, namespace registration, transparent re-hello and
re-registration after a daemon restart) and differ only in how they wait.
Neither is thread-safe: use one per thread or task group.

Typical use::

    with hicached.Client() as c:
        ns = c.register(model="org/m", kv_dtype="bfloat16", layout="layer_first",
                        page_tokens=64, page_bytes=65536)
        c.store(ns, tokens, pages)          # pages: (n_full_pages, page_bytes)
        hit = c.match(ns, tokens)
        data = c.read_pages(ns, hit.offsets)
        c.release(hit)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from hicached import protocol as p
from hicached.arena import Arena
from hicached.config import check_endpoint, default_endpoint
from hicached.errors import (
    BadRequest,
    DaemonUnavailable,
    DeadlineExceeded,
    HicachedError,
    SessionLost,
    UnknownLease,
)
from hicached.hashing import pack_tokens
from hicached.namespace import NamespaceSpec

R = TypeVar("R", bound=p.Reply)
Exchange = Generator[p.Request, p.AnyReply, Any]


class CurveKeys(NamedTuple):
    """CURVE keys for a tcp:// daemon that requires them (Z85 text, as bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_key_file: str, client_secret_file: str) -> CurveKeys:
        """From certificate files as `hicached keygen` writes them: the daemon's
        public one (``.key``) and this client's secret one (``.key_secret``)."""
        import zmq.auth

        try:
            server_public, _ = zmq.auth.load_certificate(server_key_file)
            public, secret = zmq.auth.load_certificate(client_secret_file)
        except (OSError, ValueError) as exc:
            raise BadRequest(f"cannot read CURVE keys: {exc}") from None
        if not secret:
            raise BadRequest(f"{client_secret_file} holds no secret key: give the .key_secret file")
        return cls(server_public, public, secret)


@dataclass(slots=True, eq=False)
class Namespace:
    """A registered namespace; ``id`` is updated if the daemon restarts."""

    spec: NamespaceSpec
    id: int
    digest: bytes

    @property
    def page_tokens(self) -> int:
        return self.spec.page_tokens

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes


@dataclass(slots=True)
class Reservation:
    """Slots to fill for pages ``present .. present + len(offsets)`` of a sequence."""

    ns: Namespace
    lease: int
    present: int
    offsets: list[int]
    pool_full: bool
    instance: int


@dataclass(slots=True)
class Hit:
    """The leading ``hits`` pages of a sequence, in ``offsets``, under ``lease``;
    ``l3_hits`` more pages are known to be in L3."""

    ns: Namespace
    hits: int
    offsets: list[int]
    lease: int
    instance: int
    l3_hits: int = 0


@dataclass(slots=True)
class Prefetch:
    """A background load from L3 of the pages after the first ``l2_hits``.

    ``lease`` 0 means there was nothing to load (no L3, or all in L2).
    """

    ns: Namespace
    lease: int
    l2_hits: int
    instance: int


class Progress(msgspec.Struct, frozen=True):
    """``completed`` leading pages are in L2; see protocol.ProgressOk."""

    planned: int
    completed: int
    done: bool
    failed: bool


class _Core:
    """What both clients share: state, message building and the exchange logic."""

    def __init__(
        self,
        endpoint: str | None,
        timeout: float,
        name: str,
        curve: CurveKeys | None,
        map_pool: bool,
    ) -> None:
        self.endpoint = endpoint or default_endpoint()
        try:
            check_endpoint(self.endpoint, remote=curve is not None)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self.curve = curve
        self.map_pool = map_pool
        self.timeout = timeout
        self.name = name or f"pid-{os.getpid()}"
        self._ids = itertools.count(1)
        self._hello: p.HelloOk | None = None
        self._arena: Arena | None = None
        self._pin = False  # pin_memory() was asked for
        self._pinned: Arena | None = None  # the arena registered with CUDA
        self._mapped: Any = None  # its CUDA view, for gather/scatter kernels
        self._namespaces: list[Namespace] = []
        self._instance = 0

    # -- exchanges ------------------------------------------------------------

    def _exchange(
        self, make: Callable[[], p.Request], expect: type[R]
    ) -> Generator[p.Request, p.AnyReply, R]:
        """Send ``make()``; re-hello and retry once if the daemon forgot this client."""
        for attempt in range(2):
            if self._hello is None:
                yield from self._handshake()
            reply = yield make()
            if isinstance(reply, p.Error):
                if reply.code == SessionLost.code and attempt == 0:
                    self._hello = None
                    continue
                raise reply.to_exception()
            if not isinstance(reply, expect):
                raise HicachedError(
                    f"expected {expect.__name__} from the daemon, got {type(reply).__name__}"
                )
            return reply
        raise SessionLost("the daemon keeps forgetting this client")  # pragma: no cover

    def _handshake(self) -> Exchange:
        reply = yield p.Hello(
            id=0, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR, client=self.name, pid=os.getpid()
        )
        if isinstance(reply, p.Error):
            raise reply.to_exception()
        assert isinstance(reply, p.HelloOk)
        if self.map_pool and (self._arena is None or reply.instance != self._instance):
            self._close_arena()  # another daemon's pool: unpin and unmap the old one
            self._arena = Arena.attach(reply.pool_path, reply.pool_bytes)
            if self._pin:
                self._pin_arena()
        self._instance = reply.instance
        self._hello = reply
        for ns in self._namespaces:
            ok = yield p.RegisterNamespace(id=0, spec=ns.spec)
            if isinstance(ok, p.Error):
                raise ok.to_exception()
            assert isinstance(ok, p.NamespaceOk)
            ns.id = ok.ns

    def _register(self, spec: NamespaceSpec | None, fields: dict[str, Any]) -> Exchange:
        if spec is None:
            try:
                spec = msgspec.convert(fields, NamespaceSpec)
            except msgspec.ValidationError as exc:
                raise BadRequest(f"namespace: {exc}") from None
        elif fields:
            raise TypeError("pass either a NamespaceSpec or its fields, not both")
        ok = yield from self._exchange(lambda: p.RegisterNamespace(id=0, spec=spec), p.NamespaceOk)
        for ns in self._namespaces:
            if ns.digest == ok.digest:
                ns.id = ok.ns
                return ns
        ns = Namespace(spec, ok.ns, ok.digest)
        self._namespaces.append(ns)
        return ns

    def _reserve(self, ns: Namespace, tokens: Any) -> Exchange:
        packed = pack_tokens(tokens)
        ok = yield from self._exchange(
            lambda: p.Reserve(id=0, ns=ns.id, tokens=packed), p.ReserveOk
        )
        return Reservation(ns, ok.lease, ok.present, ok.offsets, ok.pool_full, self._instance)

    def _commit(self, res: Reservation | Prefetch, pages: int | None) -> Exchange:
        if not res.lease:
            return p.CommitOk(id=0, published=0, duplicates=0)
        if res.instance != self._instance:
            raise UnknownLease("the daemon restarted since this reservation; reserve again")
        count = -1 if pages is None else pages
        return (
            yield from self._exchange(
                lambda: p.Commit(id=0, lease=res.lease, pages=count), p.CommitOk
            )
        )

    def _match(self, ns: Namespace, tokens: Any, lease: bool) -> Exchange:
        packed = pack_tokens(tokens)
        ok = yield from self._exchange(
            lambda: p.Match(id=0, ns=ns.id, tokens=packed, lease=lease), p.MatchOk
        )
        return Hit(ns, ok.hits, ok.offsets, ok.lease, self._instance, ok.l3_hits)

    def _prefetch(self, ns: Namespace, tokens: Any, max_pages: int) -> Exchange:
        packed = pack_tokens(tokens)
        ok = yield from self._exchange(
            lambda: p.Prefetch(id=0, ns=ns.id, tokens=packed, max_pages=max_pages), p.PrefetchOk
        )
        return Prefetch(ns, ok.lease, ok.l2_hits, self._instance)

    def _progress(self, pf: Prefetch) -> Exchange:
        if not pf.lease:
            return Progress(planned=0, completed=0, done=True, failed=False)
        if pf.instance != self._instance:
            raise UnknownLease("the daemon restarted since this prefetch; start it again")
        ok = yield from self._exchange(lambda: p.Progress(id=0, lease=pf.lease), p.ProgressOk)
        return Progress(ok.planned, ok.completed, ok.done, ok.failed)

    def _release(self, lease: int, instance: int) -> Exchange:
        if not lease or instance != self._instance:
            return None  # nothing held, or it ended with the daemon that granted it
        yield from self._exchange(lambda: p.Release(id=0, lease=lease), p.Ok)
        return None

    def _stats(self) -> Exchange:
        ok = yield from self._exchange(lambda: p.Stats(id=0), p.StatsOk)
        return ok.stats

    def _stamp(self, request: p.Request, timeout: float | None) -> tuple[int, bytes, float]:
        budget = self.timeout if timeout is None else timeout
        request.id = next(self._ids)
        request.deadline_ms = int((time.time() + budget) * 1000)
        return request.id, p.encode(request), budget

    # -- the pool -------------------------------------------------------------

    @property
    def arena(self) -> Arena:
        if not self.map_pool:
            raise BadRequest("this client does not map the pool (map_pool=False)")
        if self._arena is None:
            raise DaemonUnavailable("not connected: call connect() first")
        return self._arena

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        """Options of the one DEALER socket; CURVE keys when given."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve is not None:
            sock.curve_serverkey = self.curve.server_public
            sock.curve_publickey = self.curve.public
            sock.curve_secretkey = self.curve.secret
        sock.connect(self.endpoint)

    def rows(self, ns: Namespace) -> np.ndarray:
        """The pool as a (slots, page_bytes) uint8 array, zero-copy."""
        return self.arena.rows(ns.page_bytes)

    def page(self, ns: Namespace, offset: int) -> np.ndarray:
        """One slot as a writable uint8 array of ``page_bytes``, zero-copy."""
        return self.rows(ns)[offset // ns.page_bytes]

    def pin_memory(self) -> None:
        """Register this client's mapping of the pool with CUDA as pinned memory,
        now and after every reconnect, so that copies between GPU tensors and
        slots need no staging buffer (hicached/cuda.py, docs/perf.md)."""
        self._pin = True
        if self._arena is not None and self._pinned is None:
            self._pin_arena()

    def _pin_arena(self) -> None:
        from hicached import cuda

        self._mapped = cuda.register(self.arena.array)
        self._pinned = self.arena

    def write_pages(self, ns: Namespace, offsets: list[int], data: Any) -> None:
        """Copy ``data`` (n pages of page_bytes) into the slots at ``offsets``.

        ``data`` is a numpy array (one copy call), or a CUDA tensor (DMA per
        run of adjacent slots, or one scatter kernel; finished on return).
        """
        if cuda_tensor(data):
            from hicached import cuda

            rows = self.rows(ns)
            idx = self._row_index(ns, offsets, len(rows))
            cuda.copy(rows, idx, data, to_pool=True, mapped=self._mapped)
            return
        src = np.asarray(data).reshape(len(offsets), -1).view(np.uint8)
        if src.shape[1] != ns.page_bytes:
            raise ValueError(f"each page must be {ns.page_bytes} bytes, got {src.shape[1]}")
        rows = self.rows(ns)
        idx = self._row_index(ns, offsets, len(rows))
        if len(idx) == 1:
            rows[idx[0]] = src[0]
        elif len(idx) and np.all(np.diff(idx) == 1):
            rows[idx[0] : idx[-1] + 1] = src  # contiguous slots: one memcpy
        else:
            rows[idx] = src

    def read_pages(self, ns: Namespace, offsets: list[int], out: Any = None) -> Any:
        """Copy the slots at ``offsets`` into ``out`` (n, page_bytes), in one call.

        ``out`` may be a CUDA tensor (DMA per run of adjacent slots, or one
        gather kernel; finished on return).
        """
        rows = self.rows(ns)
        idx = self._row_index(ns, offsets, len(rows))
        if cuda_tensor(out):
            from hicached import cuda

            cuda.copy(rows, idx, out, to_pool=False, mapped=self._mapped)
            return out
        if out is None:
            out = np.empty((len(idx), ns.page_bytes), dtype=np.uint8)
        if len(idx) and np.all(np.diff(idx) == 1):
            out[...] = rows[idx[0] : idx[-1] + 1]
        elif "torch" in sys.modules and out.flags.c_contiguous:
            # glibc's memcpy of single pages out of 4 KiB-page shared memory can run
            # at a fraction of memory speed; torch's copy kernel does not (docs/perf.md)
            torch = sys.modules["torch"]
            torch.index_select(
                torch.from_numpy(rows), 0, torch.from_numpy(idx), out=torch.from_numpy(out)
            )
        else:
            # indices are checked above; "clip" lets numpy gather straight into out
            np.take(rows, idx, axis=0, out=out, mode="clip")
        return out

    @staticmethod
    def _row_index(ns: Namespace, offsets: list[int], n_rows: int) -> np.ndarray:
        """Rows of ``offsets``; a cache must never lie, so every offset is checked."""
        idx = np.asarray(offsets, dtype=np.int64)
        if len(idx) and (
            int(idx.min()) < 0
            or int(idx.max()) >= n_rows * ns.page_bytes
            or (idx % ns.page_bytes).any()
        ):
            raise ValueError(f"offsets must be slots of {ns.page_bytes} bytes inside the pool")
        return idx // ns.page_bytes

    def tensor(self, ns: Namespace) -> Any:
        """The pool as a (slots, page_bytes) uint8 torch tensor sharing its memory."""
        import torch

        return torch.from_numpy(self.rows(ns))

    def _store_data(self, res: Reservation, pages: np.ndarray) -> None:
        if not res.offsets:
            return
        src = np.asarray(pages)
        self.write_pages(res.ns, res.offsets, src[res.present : res.present + len(res.offsets)])

    def _close_arena(self) -> None:
        if self._pinned is not None:
            from hicached import cuda

            pinned, self._pinned, self._mapped = self._pinned, None, None
            cuda.unregister(pinned.array)
        if self._arena is not None:
            self._arena.close()
            self._arena = None


def cuda_tensor(obj: object) -> bool:
    """A torch tensor on a GPU (checked without importing torch)."""
    return type(obj).__module__.startswith("torch") and bool(getattr(obj, "is_cuda", False))


def _run(gen: Exchange, roundtrip: Callable[[p.Request], p.AnyReply]) -> Any:
    try:
        request = next(gen)
        while True:
            request = gen.send(roundtrip(request))
    except StopIteration as stop:
        return stop.value


class Client(_Core):
    """Synchronous client. ``timeout`` bounds every request, in seconds.

    ``curve``: keys for a tcp:// daemon that requires CURVE. ``map_pool``:
    False on a host that does not share the daemon's memory (control calls
    only: match, prefetch, progress, stats; no slot copies).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 5.0,
        name: str = "",
        curve: CurveKeys | None = None,
        map_pool: bool = True,
    ) -> None:
        super().__init__(endpoint, timeout, name, curve, map_pool)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._configure(self._sock)
        self._rcvtimeo = -1

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
        self._sock.close(linger=0)
        self._ctx.term()
        self._close_arena()

    def _roundtrip(self, request: p.Request, timeout: float | None = None) -> p.AnyReply:
        request_id, payload, budget = self._stamp(request, timeout)
        sock = self._sock
        sock.send(payload)
        deadline = time.monotonic() + budget
        wait_ms = max(1, int(budget * 1000))
        if wait_ms != self._rcvtimeo:  # a blocking receive: one wake-up, no poll
            sock.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._rcvtimeo = wait_ms
        while True:
            if time.monotonic() >= deadline:
                what = "daemon" if self._hello else "daemon (is it running?)"
                raise DeadlineExceeded(
                    f"no reply from the {what} at {self.endpoint} within {budget:.3g}s"
                )
            try:
                reply = p.reply_decoder.decode(sock.recv())
            except zmq.Again:
                continue
            if reply.id == request_id:
                return reply
            # else: the late reply of a request that timed out; drop it

    def _do(self, gen: Exchange) -> Any:
        return _run(gen, self._roundtrip)

    def connect(self) -> Client:
        """Say hello and map the pool; raises if the daemon does not answer in time."""
        if self._hello is None:
            self._do(self._handshake())
        return self

    def register(self, spec: NamespaceSpec | None = None, **fields: Any) -> Namespace:
        return self._do(self._register(spec, fields))

    def reserve(self, ns: Namespace, tokens: Any) -> Reservation:
        return self._do(self._reserve(ns, tokens))

    def commit(self, res: Reservation | Prefetch, pages: int | None = None) -> p.CommitOk:
        """Publish the first ``pages`` pages of a reservation or a prefetch (None: all
        reserved, or all read so far); the rest is released."""
        return self._do(self._commit(res, pages))

    def prefetch(self, ns: Namespace, tokens: Any, *, max_pages: int = -1) -> Prefetch:
        """Start loading from L3 the pages of ``tokens`` after its L2 hit."""
        return self._do(self._prefetch(ns, tokens, max_pages))

    def progress(self, pf: Prefetch) -> Progress:
        return self._do(self._progress(pf))

    def cancel(self, pf: Prefetch) -> None:
        """Give up a prefetch; its slots are freed once no read is writing into them."""
        self._do(self._release(pf.lease, pf.instance))

    def abort(self, res: Reservation) -> None:
        self._do(self._release(res.lease, res.instance))

    def match(self, ns: Namespace, tokens: Any, *, lease: bool = True) -> Hit:
        return self._do(self._match(ns, tokens, lease))

    def release(self, hit: Hit) -> None:
        self._do(self._release(hit.lease, hit.instance))

    def stats(self) -> p.DaemonStats:
        return self._do(self._stats())

    def store(self, ns: Namespace, tokens: Any, pages: np.ndarray) -> p.CommitOk:
        """Store every full page of ``tokens``; ``pages[i]`` holds page i's bytes."""
        res = self.reserve(ns, tokens)
        try:
            self._store_data(res, pages)
        except BaseException:
            self.abort(res)
            raise
        return self.commit(res)

    def load(self, ns: Namespace, tokens: Any) -> np.ndarray:
        """Copy out the leading pages of ``tokens`` present in L2 (n, page_bytes)."""
        hit = self.match(ns, tokens)
        try:
            return self.read_pages(ns, hit.offsets)
        finally:
            self.release(hit)


class AsyncClient(_Core):
    """asyncio client; many requests may be in flight at once."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 5.0,
        name: str = "",
        curve: CurveKeys | None = None,
        map_pool: bool = True,
    ) -> None:
        super().__init__(endpoint, timeout, name, curve, map_pool)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._configure(self._sock)
        self._pending: dict[int, asyncio.Future[p.AnyReply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one handshake at a time

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
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._sock.close(linger=0)
        self._ctx.term()
        self._close_arena()

    async def _read(self) -> None:
        while True:
            payload = await self._sock.recv()
            reply = p.reply_decoder.decode(payload)
            future = self._pending.pop(reply.id, None)
            if future is not None and not future.done():
                future.set_result(reply)

    async def _roundtrip(self, request: p.Request, timeout: float | None = None) -> p.AnyReply:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
            self._reader.add_done_callback(self._fail_all)
        request_id, payload, budget = self._stamp(request, timeout)
        future: asyncio.Future[p.AnyReply] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self._sock.send(payload)
            return await asyncio.wait_for(future, budget)
        except asyncio.TimeoutError:
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
        try:
            request = next(gen)
            while True:
                request = gen.send(await self._roundtrip(request))
        except StopIteration as stop:
            return stop.value

    async def connect(self) -> AsyncClient:
        async with self._lock:
            if self._hello is None:
                await self._do(self._handshake())
        return self

    async def register(self, spec: NamespaceSpec | None = None, **fields: Any) -> Namespace:
        return await self._do(self._register(spec, fields))

    async def reserve(self, ns: Namespace, tokens: Any) -> Reservation:
        return await self._do(self._reserve(ns, tokens))

    async def commit(self, res: Reservation | Prefetch, pages: int | None = None) -> p.CommitOk:
        return await self._do(self._commit(res, pages))

    async def prefetch(self, ns: Namespace, tokens: Any, *, max_pages: int = -1) -> Prefetch:
        return await self._do(self._prefetch(ns, tokens, max_pages))

    async def progress(self, pf: Prefetch) -> Progress:
        return await self._do(self._progress(pf))

    async def cancel(self, pf: Prefetch) -> None:
        await self._do(self._release(pf.lease, pf.instance))

    async def abort(self, res: Reservation) -> None:
        await self._do(self._release(res.lease, res.instance))

    async def match(self, ns: Namespace, tokens: Any, *, lease: bool = True) -> Hit:
        return await self._do(self._match(ns, tokens, lease))

    async def release(self, hit: Hit) -> None:
        await self._do(self._release(hit.lease, hit.instance))

    async def stats(self) -> p.DaemonStats:
        return await self._do(self._stats())

    async def store(self, ns: Namespace, tokens: Any, pages: np.ndarray) -> p.CommitOk:
        res = await self.reserve(ns, tokens)
        try:
            self._store_data(res, pages)
        except BaseException:
            await self.abort(res)
            raise
        return await self.commit(res)

    async def load(self, ns: Namespace, tokens: Any) -> np.ndarray:
        hit = await self.match(ns, tokens)
        try:
            return self.read_pages(ns, hit.offsets)
        finally:
            await self.release(hit)
