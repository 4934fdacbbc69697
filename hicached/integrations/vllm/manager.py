"""The scheduler side of hicached's vLLM tier: lookups that never wait for the
daemon, loads under read leases, stores committed by what every worker wrote.

Two threads: vLLM's scheduler calls the manager; the manager's own event loop
thread talks to the daemon. The loop thread never touches what the scheduler
reads: it hands each lookup answer over through a queue, and the scheduler's
thread applies it where no lookup of the step has relied on the one before
(``HicachedManager._take_answers``), so a lookup's HIT and the
``prepare_load`` after it see one answer, with vLLM 0.32 (which holds no lock)
and 0.33 (which holds ``lock`` for a whole step) alike.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from hicached.client import AsyncClient
from hicached.client.handles import Hit, Namespace, Reservation
from hicached.errors import HicachedError
from hicached.integrations.vllm.settings import (
    MAX_QUESTION,
    UNREACHABLE,
    Settings,
    info_labels,
)
from hicached.integrations.vllm.specs import Ack, HicachedLoadSpec, HicachedStoreSpec
from hicached.wire.namespace import NamespaceSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

# vLLM 0.33 tells a manager when the workers have reported every job in flight
# at a cache reset (on_reset_flushed); vLLM 0.32 never does.
REPORTS_FLUSH = hasattr(OffloadingManager, "on_reset_flushed")

# -- the scheduler side -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Answer:
    """What the daemon said about some keys: the first ``l2`` are readable under
    ``hit``'s lease, the next ``pending`` are on their way from L3."""

    keys: dict[bytes, int]  # key -> its place in the question
    hit: Hit | None
    l2: int
    pending: int
    until: float  # monotonic: ask again after this
    capped: bool = False  # the question left keys out: those are misses

    def result(self, key: bytes) -> LookupResult | None:
        i = self.keys.get(key)
        if i is None:
            return LookupResult.MISS if self.capped else None
        if i < self.l2:
            return LookupResult.HIT
        if i < self.l2 + self.pending:
            return LookupResult.HIT_PENDING
        return LookupResult.MISS


@dataclass(slots=True)
class _Request:
    """The manager's state for one request (the scheduler's thread alone: the
    loop thread hands its answers over)."""

    scan: list[bytes] = field(default_factory=list)  # keys this step's lookups showed
    unknown: bool = False  # some of them had no answer: ask at the step's end
    asking: concurrent.futures.Future[None] | None = None  # the question in flight
    answer: _Answer | None = None
    loading: _Answer | None = None  # handed to a load; ends at complete_load
    stores: dict[frozenset[bytes], Reservation] = field(default_factory=dict)
    before: dict[bytes, bytes] = field(default_factory=dict)  # key -> the key before it
    last_stored: bytes | None = None
    finished: bool = False

    def idle(self) -> bool:
        return self.finished and not self.stores and self.loading is None

    def can_ask(self) -> bool:
        return self.asking is None or self.asking.done()


class _Link:
    """The manager's one session with the daemon, on a private event loop thread.

    Lookups run there while the scheduler goes on; every lease the manager
    holds belongs to this one session, so any of its calls can end any of
    them. The workers' words on their stores arrive there too.
    """

    def __init__(self, settings: Settings, spec: NamespaceSpec, world_size: int) -> None:
        self.settings = settings
        self.spec = spec
        self.world_size = world_size
        self.down_until = 0.0  # monotonic; calls wait until then after a failure
        self._dir = Path(tempfile.mkdtemp(prefix="hicached-vllm-"))  # 0700: only us
        # gone at close, or at exit for an engine that never closes its connector
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        self.acks = f"ipc://{self._dir}/acks.sock"
        self._acks: dict[tuple[int, int], tuple[float, dict[int, bytes]]] = {}
        self._ack_event: asyncio.Event | None = None
        self._client: AsyncClient | None = None
        self._ns: Namespace | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hicached-vllm")
        self._thread.daemon = True
        self._thread.start()
        self.call(self._start(), settings.timeout_s)

    # -- running things on the loop -----------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it, at most ``timeout`` seconds."""
        return self.submit(coro).result(timeout)

    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def instance(self) -> int:
        """The daemon instance this session last spoke to (0: none yet)."""
        try:
            return self._client.mapping.instance if self._client is not None else 0
        except HicachedError:
            return 0

    def close(self) -> None:
        """Say goodbye (the daemon ends every lease of this session), stop the loop."""
        try:
            self.call(self._stop(), self.settings.timeout_s)
        except Exception as exc:  # shutting down: nothing left to tell
            log.debug("hicached: closing the session: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.settings.timeout_s)
        self._remove_dir()

    async def _start(self) -> None:
        self._ack_event = asyncio.Event()
        # The pool is mapped here too, though only the workers copy: handles carry
        # the slots' generations as they were granted, which the copies check.
        self._client = AsyncClient(
            self.settings.endpoint or None,
            timeout=self.settings.timeout_s,
            name=f"vllm-scheduler-{os.getpid()}",
            connect_timeout=min(0.2, self.settings.timeout_s),
        )
        self._zmq = zmq.asyncio.Context()
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.acks)
        self._reader = self._loop.create_task(self._read_acks(self._pull))

    async def _stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._pull is not None and self._zmq is not None:
            self._pull.close()
            self._zmq.term()
        if self._client is not None:
            await self._client.close()

    async def session(self) -> tuple[AsyncClient, Namespace]:
        """The client and the namespace, registering it on first use; marks the
        daemon down for ``retry_s`` when it cannot be reached."""
        assert self._client is not None, "the link is not started"
        try:
            if self._ns is None:
                self._ns = await self._client.register(self.spec)
            return self._client, self._ns
        except UNREACHABLE:
            self.failed()
            raise

    def failed(self) -> None:
        self.down_until = time.monotonic() + self.settings.retry_s

    async def guarded(self, op: Callable[[AsyncClient, Namespace], Coroutine[Any, Any, T]]) -> T:
        client, ns = await self.session()
        try:
            return await op(client, ns)
        except UNREACHABLE:
            self.failed()
            raise

    # -- the workers' words on their stores ---------------------------------------------

    async def _read_acks(self, sock: zmq.asyncio.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(Ack)
        assert self._ack_event is not None
        while True:
            payload = await sock.recv()
            try:
                ack = decoder.decode(payload)
            except msgspec.MsgspecError:
                continue
            now = time.monotonic()
            _, ranks = self._acks.setdefault((ack.instance, ack.lease), (now, {}))
            ranks[ack.rank] = ack.written
            self._ack_event.set()
            self._ack_event = asyncio.Event()
            stale = now - 4 * (self.settings.ack_timeout_s + self.settings.timeout_s)
            for lease in [k for k, (t, _) in self._acks.items() if t < stale]:
                del self._acks[lease]  # of a store nobody finished (reset, abort)

    async def written(self, res: Reservation) -> list[bool] | None:
        """Which slots of ``res`` every worker wrote; None if some worker never said."""
        deadline = time.monotonic() + self.settings.ack_timeout_s
        key = (res.instance, res.lease)
        while len(self._acks.get(key, (0.0, {}))[1]) < self.world_size:
            left = deadline - time.monotonic()
            event = self._ack_event
            assert event is not None
            try:
                await asyncio.wait_for(event.wait(), max(left, 0.0))
            except asyncio.TimeoutError:
                self._acks.pop(key, None)
                return None
        _, ranks = self._acks.pop(key)
        n = len(res.offsets)
        return [all(len(w) == n and w[i] for w in ranks.values()) for i in range(n)]


class HicachedManager(OffloadingManager):
    """Scheduler side: which keys hicached has, leases for loads, slots for stores."""

    def __init__(self, settings: Settings, spec: NamespaceSpec, world_size: int) -> None:
        self.settings = settings
        self._link = _Link(settings, spec, world_size)
        self._requests: dict[str, _Request] = {}
        self._asking: dict[str, _Request] = {}  # requests with keys to ask at the step's end
        self._publishing: set[concurrent.futures.Future[None]] = set()  # finished stores
        # vLLM 0.33's, held for whole steps; nothing of ours takes it (see ``lock``)
        self._step_lock = threading.Lock()
        # Answers the loop thread handed over, and those held for the step's end.
        # Bounded by the requests: one question in flight each, two answers at most.
        self._arrived: queue.SimpleQueue[tuple[_Request, _Answer]] = queue.SimpleQueue()
        self._held: list[tuple[_Request, _Answer]] = []
        # Leases of the transfers in flight at a cache reset, ended once vLLM says
        # the workers reported them (on_reset_flushed).
        self._flushing: list[Hit | Reservation] = []

    @property
    def namespace(self) -> NamespaceSpec:
        """The namespace this engine's pages are in."""
        return self._link.spec

    def _request(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request()
        return req

    # -- lookups ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._arrived.empty():
            self._take_answers()
        req = self._request(req_context.req_id)
        req.scan.append(key)
        answer = req.answer
        if answer is not None and not self._fresh(answer):
            self._drop_answer(req)
            answer = None
        if answer is not None:
            result = answer.result(key)
            if result is not None:
                return result
        if not self._link.available():
            return LookupResult.MISS
        if req.can_ask():
            req.unknown = True
            self._asking[req_context.req_id] = req
        return LookupResult.RETRY  # asked at this step's end; the next step knows

    def on_schedule_end(self, context: Any) -> None:
        """Ask for the keys the lookups of this step could not answer, one question
        per request, each the whole chain its lookups showed."""
        for req in self._asking.values():
            if req.unknown and req.can_ask() and req.scan:
                chain = list(dict.fromkeys(req.scan))  # one pass's keys, once each
                req.before.update(zip(chain[1:], chain[:-1], strict=True))
                req.asking = self._link.submit(self._ask(req, chain[:MAX_QUESTION]))
            req.unknown = False
        self._asking.clear()
        for req in self._requests.values():
            req.scan.clear()
        self._take_answers(step_over=True)

    async def _ask(self, req: _Request, keys: list[bytes]) -> None:
        """Lease the leading keys in L2; bring the ones L3 holds into L2 first."""
        link, settings = self._link, self.settings
        places = {key: i for i, key in enumerate(keys)}
        capped = len(keys) == MAX_QUESTION
        try:
            hit = await link.guarded(lambda c, ns: c.match_keys(ns, keys))
            until = self._until(hit)
            self._answer(req, _Answer(places, hit, hit.hits, hit.l3_hits, until, capped))
            if hit.l3_hits:
                hit = await self._from_l3(keys, hit)
                self._answer(req, _Answer(places, hit, hit.hits, 0, self._until(hit), capped))
        except (HicachedError, *UNREACHABLE) as exc:
            log.debug("hicached: lookup failed, a miss: %s", exc)
            until = time.monotonic() + settings.answer_ttl_s
            self._answer(req, _Answer(places, None, 0, 0, until, capped))

    async def _from_l3(self, keys: list[bytes], hit: Hit) -> Hit:
        """Load the keys after ``hit`` from L3 into L2, within prefetch_timeout_s,
        and lease the longer hit (or keep ``hit`` if nothing came)."""
        link = self._link
        fetch = await link.guarded(lambda c, ns: c.prefetch_keys(ns, keys))
        deadline = time.monotonic() + self.settings.prefetch_timeout_s
        client, _ = await link.session()
        pause = 0.001
        try:
            while not (progress := await client.progress(fetch)).done:
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.02)
            if not progress.completed:
                await client.release(fetch)
                return hit
            await client.commit(fetch, pages=progress.completed)
        except BaseException:  # the prefetch's lease ends now, not at its TTL
            with contextlib.suppress(HicachedError, *UNREACHABLE):
                await client.release(fetch)
            raise
        # ``hit`` stays leased: a load may copy through it already; _answer ends
        # its lease once the longer answer replaces it, unless a load holds it
        return await link.guarded(lambda c, ns: c.match_keys(ns, keys))

    def _fresh(self, answer: _Answer) -> bool:
        """Not too old, and from the daemon that runs now (a restarted one holds
        other slots: a load through the old lease could fail, and vLLM takes
        no failed load)."""
        hit = answer.hit
        if hit is not None and hit.lease and hit.instance != self._link.instance():
            return False
        return time.monotonic() < answer.until

    def _until(self, hit: Hit) -> float:
        """When an answer is asked again: soon, and well before its lease ends (for
        the copy that follows a hit), yet never at once (a short lease halves)."""
        now = time.monotonic()
        slack = min(self.settings.lease_slack_s, (hit.deadline - now) / 2)
        return min(now + self.settings.answer_ttl_s, hit.deadline - slack)

    def _answer(self, req: _Request, answer: _Answer) -> None:
        """Hand an answer to the scheduler's thread (from the loop thread); it is
        applied at the next lookup, or at the step's end for a request looked up
        in this step (``_take_answers``). Never waits for ``lock``: vLLM 0.33
        holds it for a whole step, in which ``prepare_store`` waits for this
        thread."""
        self._arrived.put((req, answer))

    def _take_answers(self, *, step_over: bool = False) -> None:
        """Apply the answers handed over, in the order they came (the scheduler's
        thread). Those of requests already looked up in this step wait for its
        end (``step_over``): a lookup's HIT and the prepare_load that follows
        it must see the same answer."""
        held = self._held
        while True:
            try:
                held.append(self._arrived.get_nowait())
            except queue.Empty:
                break
        self._held = []
        for req, answer in held:
            if req.scan and not step_over:
                self._held.append((req, answer))
            else:
                self._apply_answer(req, answer)

    def _apply_answer(self, req: _Request, answer: _Answer) -> None:
        """Replace the request's answer, ending the old one's lease."""
        old, req.answer = req.answer, answer
        if old is not None and old is not req.loading and old.hit not in (None, answer.hit):
            self._release(old.hit)
        if req.finished and req.loading is None and answer.hit is not None:
            req.answer = None  # finished while it was asked for
            self._release(answer.hit)

    def _drop_answer(self, req: _Request) -> None:
        answer, req.answer = req.answer, None
        if answer is not None and answer is not req.loading and answer.hit is not None:
            self._release(answer.hit)

    def _release(self, handle: Hit | Reservation) -> None:
        """End a lease in the background (from any thread); a daemon that is gone
        ended it already."""
        self._link.submit(self._release_now(handle))

    async def _release_now(self, handle: Hit | Reservation) -> None:
        try:
            await self._link.guarded(lambda c, ns: c.release(handle))
        except (HicachedError, *UNREACHABLE) as exc:
            log.debug("hicached: release: %s", exc)

    # -- loads --------------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        req = self._request(req_context.req_id)
        answer = req.answer
        assert answer is not None and answer.hit is not None, "a load of keys never found"
        places = [answer.keys[key] for key in keys]
        assert all(i < answer.l2 for i in places), "a load of keys that were no hits"
        req.loading = answer
        return HicachedLoadSpec(answer.hit.select(places).portable())

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        req = self._requests.get(req_context.req_id)
        if req is None or req.loading is None:
            return
        loading, req.loading = req.loading, None
        if req.answer is loading:
            req.answer = None
        if loading.hit is not None:
            self._release(loading.hit)
        self._forget_if_idle(req_context.req_id, req)

    # -- stores -------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        req = self._request(req_context.req_id)
        chain = list(keys)
        nothing = PrepareStoreOutput([], HicachedStoreSpec(None, self._link.acks), [])
        if not chain or not self._link.available():
            return nothing  # not stored: a later request recomputes them
        parent = req.before.get(chain[0], req.last_stored)
        req.last_stored = chain[-1]
        asked = self._link.submit(
            self._link.guarded(lambda c, ns: c.reserve_keys(ns, chain, parent=parent))
        )
        try:
            res = asked.result(self.settings.timeout_s)
        except (HicachedError, *UNREACHABLE) as exc:
            log.debug("hicached: reserve failed, not stored: %s", exc)
            asked.add_done_callback(self._release_late)
            return nothing
        fresh = [chain[i] for i in res.indices]
        if not fresh:
            self._release(res)  # all there already (or no room): nothing to write
            return nothing
        req.stores[frozenset(fresh)] = res
        return PrepareStoreOutput(fresh, HicachedStoreSpec(res.portable(), self._link.acks), [])

    def _release_late(self, asked: concurrent.futures.Future[Reservation]) -> None:
        """A reservation granted after prepare_store gave up on it: end it."""
        if not asked.cancelled() and asked.exception() is None:
            self._release(asked.result())

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        req = self._requests.get(req_context.req_id)
        res = req.stores.pop(frozenset(keys), None) if req is not None else None
        if res is None:
            return
        publishing = self._link.submit(self._finish_store(res, success))
        self._publishing.add(publishing)
        publishing.add_done_callback(self._publishing.discard)
        assert req is not None
        self._forget_if_idle(req_context.req_id, req)

    async def _finish_store(self, res: Reservation, success: bool) -> None:
        """Publish the slots every worker wrote; release the rest."""
        try:
            written = await self._link.written(res) if success else None
            if written is None or not any(written):
                await self._link.guarded(lambda c, ns: c.release(res))
            else:
                await self._link.guarded(lambda c, ns: c.commit(res, ok=written))
        except (HicachedError, *UNREACHABLE) as exc:
            log.debug("hicached: store not published: %s", exc)

    # -- requests -----------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        req = self._requests.get(req_context.req_id)
        if req is None:
            return
        req.finished = True
        self._drop_answer(req)
        self._forget_if_idle(req_context.req_id, req)

    def _forget_if_idle(self, req_id: str, req: _Request) -> None:
        if req.idle():
            self._requests.pop(req_id, None)
            self._asking.pop(req_id, None)

    def take_events(self) -> Iterable[Any]:
        return ()  # the daemon publishes its own KV events (docs/events.md)

    def reset_cache(self) -> None:
        """vLLM forgets its transfers: end every lease this manager holds. The
        leases of loads and stores the workers may still copy through end once
        vLLM says the workers reported them (vLLM 0.33, ``on_reset_flushed``;
        at once with vLLM 0.32, which never says it)."""
        for req in self._requests.values():
            self._drop_answer(req)
            for handle in [*req.stores.values(), *([req.loading.hit] if req.loading else [])]:
                if handle is not None and REPORTS_FLUSH:
                    self._flushing.append(handle)
                elif handle is not None:
                    self._release(handle)
            req.finished, req.loading = True, None  # answers still on their way are released
        self._requests.clear()
        self._asking.clear()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: the workers reported every job in flight at the last reset,
        so nothing copies through those jobs' leases any more: end them. Until
        then a load's pages stay pinned, for a load whose lease ended under it
        could find its slots reused and be reported failed, which vLLM does not
        survive. (Slots are never handed back to vLLM: what a late copy may
        write is the daemon's, fenced by quarantine and generations, so no
        other wait is needed after a reset.)"""
        flushing, self._flushing = self._flushing, []
        for handle in flushing:
            self._release(handle)

    @property
    def lock(self) -> threading.Lock:
        """What vLLM 0.33 holds across a step (a lookup's HIT to the prepare_load
        that pins it) and around every other call but ``shutdown``: a real lock,
        as vLLM asks of a manager with a thread of its own. That thread never
        takes it (it hands answers over, ``_answer``): it must not wait for a
        step that may be waiting for it."""
        return self._step_lock

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        """vLLM 0.33's ``vllm:kv_offload_config_info`` labels: the namespace this
        engine's pages live in (``HicachedOffloadingSpec.config_info_keys``)."""
        return [info_labels(self._link.spec)]

    def shutdown(self) -> None:
        """Publish the stores that finished (within their deadline), then leave."""
        wait = self.settings.ack_timeout_s + self.settings.timeout_s
        concurrent.futures.wait(list(self._publishing), timeout=wait)
        self._link.close()
