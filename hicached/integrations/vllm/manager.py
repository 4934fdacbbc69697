"""The scheduler side of hicached's vLLM tier: lookups that never wait for the
daemon and report a hit only where every KV cache group can restore it, loads
under read leases, stores published per chunk for all its groups or not at all.

Two threads: vLLM's scheduler calls the manager; the manager's own event loop
thread (link.py) talks to the daemon. The loop thread never touches what the
scheduler reads: it leaves each lookup answer in the request's ``incoming``
(under a hand-over lock of the manager's own, held for an assignment), and
the scheduler's thread takes it at the first lookup of a request's lookup
pass, so a lookup's HIT and the ``prepare_load`` after it see one answer,
with vLLM 0.32 (which holds no lock) and 0.33 (which holds ``lock``, another
lock, for a whole step) alike.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from hicached.client.handles import Hit, Reservation
from hicached.errors import HicachedError
from hicached.integrations.common import parts
from hicached.integrations.hybrid import Answer, Group, lookup
from hicached.integrations.vllm.groups import KVGroup
from hicached.integrations.vllm.link import Link
from hicached.integrations.vllm.settings import UNREACHABLE, Settings, info_labels
from hicached.integrations.vllm.specs import HicachedLoadSpec, HicachedStoreSpec
from hicached.wire.namespace import NamespaceSpec

log = logging.getLogger(__name__)

# vLLM 0.33 tells a manager when the workers have reported every job in flight
# at a cache reset (on_reset_flushed); vLLM 0.32 never does.
REPORTS_FLUSH = hasattr(OffloadingManager, "on_reset_flushed")

# -- per request ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Question:
    """The keys one question asks about: per group (in the engine's group order)
    its keys, the token position where each one's chunk ends, and the key of
    the chunk right before each (where that chunk was asked about too)."""

    keys: list[list[bytes]]
    positions: list[list[int]]
    before: list[dict[bytes, bytes]]

    def asked(self) -> frozenset[bytes]:
        return frozenset(k for keys in self.keys for k in keys)


@dataclass(frozen=True, slots=True)
class _Answer:
    """The daemon's answer to a question, as vLLM's lookups read it."""

    answer: Answer
    asked: frozenset[bytes]
    until: float  # monotonic: ask again after this

    def result(self, key: bytes) -> LookupResult | None:
        if key in self.answer.hits:
            return LookupResult.HIT
        if key in self.answer.pending:
            return LookupResult.HIT_PENDING
        if key in self.asked:
            return LookupResult.MISS
        return None  # a key this question did not know: ask again


@dataclass(slots=True)
class _Store:
    """One prepare_store's reservations, a group's in the order of its keys (more
    than one where the daemon took them in parts): (group, reservation, the
    reservation's slots the workers fill, in their order), and the key each
    of those slots is filled for."""

    parts: list[tuple[int, Reservation, list[int]]]
    keys: list[list[bytes]]  # per part, the key of each slot the workers fill


@dataclass(slots=True)
class _Request:
    """The manager's state for one request. The scheduler thread owns it, but
    ``incoming``, which the loop thread hands over under the manager's lock."""

    scan: list[bytes] = field(default_factory=list)  # keys this step's lookups showed
    ends: dict[int, bytes] = field(default_factory=dict)  # and their chunks' ends -> block hash
    unknown: bool = False  # some keys had no answer: ask at the step's end
    asking: concurrent.futures.Future[None] | None = None  # the question in flight
    answer: _Answer | None = None  # what this step's lookups and load read
    incoming: _Answer | None = None  # newer, taken at the next pass's first lookup
    loading: _Answer | None = None  # handed to a load; ends at complete_load
    offers: int = 0  # answers the loop thread left so far (under the manager's lock)
    stores: dict[frozenset[bytes], _Store] = field(default_factory=dict)
    before: dict[bytes, bytes] = field(default_factory=dict)  # key -> the key before it
    # group -> the end and key of its last chunk stored
    last_stored: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    finished: bool = False

    def idle(self) -> bool:
        return self.finished and not self.stores and self.loading is None

    def can_ask(self) -> bool:
        return self.asking is None or self.asking.done()


# -- the manager ------------------------------------------------------------------------


class HicachedManager(OffloadingManager):
    """Scheduler side: which chunks every group can restore from hicached, leases
    for loads, slots for stores.

    Each KV cache group has a namespace of its own. vLLM's scheduler asks about
    full-attention groups forward from the first chunk and about window groups
    (sliding window, chunked local, Mamba state) backward from the hit's end;
    the manager answers from one question per request that covers every group
    at every position any lookup showed (a group's key at a position is the
    block hash there and the group's index), so a key is a HIT only where all
    groups restore the prefix to the same end (hybrid.lookup), and then under
    a read lease.
    """

    def __init__(self, settings: Settings, groups: list[KVGroup], world_size: int) -> None:
        self.settings = settings
        self.groups = groups
        self._tokens = [g.spec.page_tokens for g in groups]  # tokens a chunk, per group
        self._index = {g.group_id.to_bytes(4, "big"): g.index for g in groups}
        writers = groups[0].layout.writers(world_size)  # the workers that write a store
        self._link = Link(settings, [(g.spec, g.events) for g in groups], writers)
        # hands answers from the loop thread to the scheduler's; never ``lock``
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # an answer was left
        # vLLM 0.33's, held for whole steps; nothing of ours takes it (see ``lock``)
        self._step_lock = threading.Lock()
        # Leases of the transfers in flight at a cache reset, ended once vLLM says
        # the workers reported them (on_reset_flushed).
        self._flushing: list[Hit | Reservation] = []
        self._requests: dict[str, _Request] = {}
        self._asking: dict[str, _Request] = {}  # requests with keys to ask at the step's end
        self._publishing: set[concurrent.futures.Future[None]] = set()  # finished stores

    @property
    def namespace(self) -> NamespaceSpec:
        """The namespace of the first group's pages (of a model of one group: all)."""
        return self.groups[0].spec

    def _request(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request()
        return req

    def _group(self, key: bytes) -> int:
        group = self._index.get(key[-4:])
        assert group is not None, "a key of a KV cache group this spec was not given"
        return group

    # -- lookups ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        req = self._request(req_context.req_id)
        if not req.scan:
            self._adopt(req)  # a lookup pass starts: the newest answer, for all of it
        req.scan.append(key)
        end = self._chunk_end(key, req_context)
        if end is None:
            return LookupResult.MISS  # a partial tail (a state mid-chunk): never stored here
        req.ends.setdefault(end, key[:-4])
        answer = req.answer
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

    def _chunk_end(self, key: bytes, req_context: ReqContext) -> int | None:
        """Where the chunk the key names ends (vLLM records where each key's tokens
        end); None if that is not the end of a whole chunk of its group (a
        partial tail's boundary)."""
        end = req_context.get_offload_key_position(key)
        return end if end is not None and end % self._tokens[self._group(key)] == 0 else None

    def _adopt(self, req: _Request) -> None:
        """Take the newest answer the loop thread left; the one it replaces ends
        (unless a load reads through it), and so does one no longer fresh.

        Freshness is decided here, once a pass: vLLM counts a pass's HITs up
        to its first MISS and loads them, so an answer that went stale after
        some HITs of a pass must still serve that pass and its prepare_load
        (``_until`` leaves it well inside its leases)."""
        with self._lock:
            incoming, req.incoming = req.incoming, None
        if incoming is not None:
            self._drop(req.answer, req)
            req.answer = incoming
        if req.answer is not None and not self._fresh(req.answer):
            self._drop(req.answer, req)
            req.answer = None

    def on_schedule_end(self, context: Any) -> None:
        """Ask for the keys the lookups of this step could not answer, one question
        per request: every group at every position the lookups showed."""
        asked: list[tuple[_Request, int]] = []
        for req in self._asking.values():
            if req.unknown and req.can_ask() and req.ends:
                question = _question(req, self.groups, self._tokens)
                with self._lock:
                    asked.append((req, req.offers))
                req.asking = self._link.submit(self._ask(req, question))
            req.unknown = False
        self._asking.clear()
        for req in self._requests.values():
            req.scan.clear()
            req.ends.clear()  # the next question asks about what the next pass shows
        self._await_answers(asked)

    def _await_answers(self, asked: list[tuple[_Request, int]]) -> None:
        """Wait, ``lookup_wait_s`` at most, until the loop thread has answered
        each question just asked (an answer left, or the question over). Waiting
        here lets that thread run at once; otherwise the scheduler's next steps
        hold the GIL while it waits for it, and a hit's load starts steps later."""
        if not asked or self.settings.lookup_wait_s <= 0:
            return
        deadline = time.monotonic() + self.settings.lookup_wait_s
        with self._answered:
            for req, offers in asked:
                while req.offers == offers and not (req.asking is None or req.asking.done()):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._answered.wait(left)

    async def _ask(self, req: _Request, question: _Question) -> None:
        """Ask the daemon what every group can restore (hybrid.lookup); hand the
        answer, and meanwhile the one that names pages loading from L3, over.
        hybrid.lookup asks about as many keys a request as the daemon takes
        (its ``server.max_pages_per_request``), a question of more in parts."""
        asked = question.asked()
        try:
            client, namespaces = await self._link.session()

            def offer(answer: Answer) -> None:
                self._offer(req, _Answer(answer, asked, self._until(answer)))

            groups = [
                Group(ns, g.kind, keys, ends, before)
                for ns, g, keys, ends, before in zip(
                    namespaces,
                    self.groups,
                    question.keys,
                    question.positions,
                    question.before,
                    strict=True,
                )
            ]
            answer = await lookup(
                client,
                groups,
                prefetch_timeout_s=self.settings.prefetch_timeout_s,
                on_pending=offer,
            )
            offer(answer)
        except UNREACHABLE as exc:
            self._link.failed()
            self._miss(req, question, exc)
        except HicachedError as exc:
            self._miss(req, question, exc)
        except Exception as exc:  # a bug must not leave the request waiting for ever
            log.exception("hicached: lookup failed")
            self._miss(req, question, exc)

    def _miss(self, req: _Request, question: _Question, exc: BaseException) -> None:
        log.debug("hicached: lookup failed, a miss: %s", exc)
        until = time.monotonic() + self.settings.answer_ttl_s
        self._offer(req, _Answer(Answer(), question.asked(), until))

    def _offer(self, req: _Request, answer: _Answer) -> None:
        """Leave an answer for the scheduler (loop thread); an answer nobody took
        yet, or one for a finished request, ends here."""
        old: _Answer | None
        with self._answered:
            if req.finished:
                old = answer
            else:
                old, req.incoming = req.incoming, answer
            req.offers += 1
            self._answered.notify_all()
        if old is not None:
            self._link.release(old.answer.leases)

    def _fresh(self, answer: _Answer) -> bool:
        """Not too old, and from the daemon that runs now (a restarted one holds
        other slots: a load through the old lease could fail, and vLLM takes
        no failed load)."""
        instance = self._link.instance()
        if any(hit.instance != instance for hit in answer.answer.leases):
            return False
        return time.monotonic() < answer.until

    def _until(self, answer: Answer) -> float:
        """When an answer is asked again: soon, and well before its leases end (for
        the copy that follows a hit), yet never at once (a short lease halves)."""
        now = time.monotonic()
        until = now + self.settings.answer_ttl_s
        for hit in answer.leases:
            slack = min(self.settings.lease_slack_s, (hit.deadline - now) / 2)
            until = min(until, hit.deadline - slack)
        return until

    def _drop(self, answer: _Answer | None, req: _Request) -> None:
        """End an answer's leases, unless a load reads through them."""
        if answer is not None and answer is not req.loading:
            self._link.release(answer.answer.leases)

    # -- loads --------------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        req = self._request(req_context.req_id)
        answer = req.answer
        assert answer is not None, "a load of keys never found"
        # per group: the places read through each of its handles, in the keys' order
        places: list[dict[int, list[int]]] = [{} for _ in self.groups]
        hits = answer.answer.hits
        for key in keys:
            assert key in hits, "a load of keys that were no hits"
            group, part, place = hits[key]
            places[group].setdefault(part, []).append(place)
        handles = []
        for hits_of, mine in zip(answer.answer.handles, places, strict=True):
            assert list(mine) == sorted(mine), "a group's keys to load out of order"
            handles.append([hits_of[part].select(read).portable() for part, read in mine.items()])
        req.loading = answer
        return HicachedLoadSpec(handles)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        req = self._requests.get(req_context.req_id)
        if req is None or req.loading is None:
            return
        loading, req.loading = req.loading, None
        if req.answer is loading:
            req.answer = None
        self._link.release(loading.answer.leases)
        self._forget_if_idle(req_context.req_id, req)

    # -- stores -------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        req = self._request(req_context.req_id)
        empty = HicachedStoreSpec([[] for _ in self.groups], self._link.acks)
        nothing = PrepareStoreOutput([], empty, [])
        # each group's keys and their chunks' ends; a partial tail's key (a state
        # that ends mid-chunk) is never looked up here
        by_group: dict[int, list[tuple[int, bytes]]] = {}
        for key in keys:
            end = self._chunk_end(key, req_context)
            if end is not None:
                by_group.setdefault(self._group(key), []).append((end, key))
        if not by_group or not self._link.available():
            return nothing  # not stored: a later request recomputes them
        runs = [run for g, mine in by_group.items() for run in _runs(req, g, mine, self._tokens[g])]
        asked = self._link.submit(self._reserve(runs))
        try:
            granted = asked.result(self.settings.timeout_s)
        except (HicachedError, *UNREACHABLE) as exc:
            log.debug("hicached: reserve failed, not stored: %s", exc)
            asked.add_done_callback(functools.partial(_release_late, self._link))
            return nothing
        store, fresh = _whole_chunks(granted)
        if not fresh:
            self._link.release(res for _, res, _ in granted)
            return nothing  # all there already (or no room for some group): nothing to write
        req.stores[frozenset(fresh)] = store
        handles: list[list[Any]] = [[] for _ in self.groups]
        for g, res, slots in store.parts:
            if slots:
                handles[g].append(res.select(slots).portable())
        return PrepareStoreOutput(fresh, HicachedStoreSpec(handles, self._link.acks), [])

    async def _reserve(
        self, runs: list[tuple[int, list[bytes], bytes | None]]
    ) -> list[tuple[int, Reservation, list[bytes]]]:
        """Reservations of each run's keys (group, keys, the key before them),
        and the keys each one reserves (a run's in parts of as many keys as the
        daemon takes a request, ``keys_per_request``, each part's parent the
        key before it); if one fails, the others end."""
        granted: list[tuple[int, Reservation, list[bytes]]] = []
        client, namespaces = await self._link.session()
        try:
            for g, mine, parent in runs:
                for part in parts(len(mine), client.keys_per_request(mine)):
                    some = mine[part.start : part.stop]
                    res = await client.reserve_keys(namespaces[g], some, parent=parent)
                    granted.append((g, res, some))
                    parent = some[-1]
        except BaseException as exc:
            if isinstance(exc, UNREACHABLE):
                self._link.failed()
            self._link.release(res for _, res, _ in granted)
            raise
        return granted

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        req = self._requests.get(req_context.req_id)
        store = req.stores.pop(frozenset(keys), None) if req is not None else None
        if store is None:
            return
        publishing = self._link.submit(self._finish_store(store, success))
        self._publishing.add(publishing)
        publishing.add_done_callback(self._publishing.discard)
        assert req is not None
        self._forget_if_idle(req_context.req_id, req)

    async def _finish_store(self, store: _Store, success: bool) -> None:
        """Publish the pages every worker wrote, a chunk only with all its groups'
        pages (a chunk some group's page of is missing is published in none);
        release the rest. The groups commit one after another: a failed commit
        leaves the groups after it unpublished (docs/engines.md)."""
        link = self._link
        try:
            client, _ = await link.session()
            written: list[list[bool]] = []
            for _, res, slots in store.parts:
                # (workers say nothing of a group they had no slot of to fill)
                flags = await link.written(res, len(slots)) if success and slots else []
                if flags is None or not success:  # some worker never said: nothing of it
                    link.release(res for _, res, _ in store.parts)
                    return
                written.append(flags)
            bad = {
                key[:-4]
                for keys, flags in zip(store.keys, written, strict=True)
                for key, ok in zip(keys, flags, strict=True)
                if not ok
            }
            parts = list(zip(store.parts, store.keys, written, strict=True))
            for i, ((_, res, slots), keys, flags) in enumerate(parts):
                mask = [False] * len(res.offsets)
                for slot, key, ok in zip(slots, keys, flags, strict=True):
                    mask[slot] = ok and key[:-4] not in bad
                try:
                    if any(mask):
                        await client.commit(res, ok=mask)
                    else:
                        await client.release(res)
                except (HicachedError, *UNREACHABLE) as exc:
                    # the commits are requests of their own: once one fails, the
                    # parts after it publish nothing of this store (those before it
                    # stay published, unused: a lookup needs every group's page); one
                    # whose answer never came may not have reached the daemon either
                    unsure = [res] if isinstance(exc, UNREACHABLE) else []
                    link.release(unsure + [later for (_, later, _), _, _ in parts[i + 1 :]])
                    raise
        except (HicachedError, *UNREACHABLE) as exc:
            if isinstance(exc, UNREACHABLE):
                link.failed()
            log.debug("hicached: store not published: %s", exc)

    # -- requests -----------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        req = self._requests.get(req_context.req_id)
        if req is None:
            return
        with self._lock:
            req.finished = True
            incoming, req.incoming = req.incoming, None
        for answer in (incoming, req.answer):
            self._drop(answer, req)
        req.answer = None
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
        at once with vLLM 0.32, which never says it). Answers still on their
        way end as they arrive (the requests are finished)."""
        for req in self._requests.values():
            with self._lock:
                req.finished = True
                incoming, req.incoming = req.incoming, None
            held: list[Hit | Reservation] = []
            for answer in {id(a): a for a in (incoming, req.answer) if a}.values():
                if answer is not req.loading:
                    held += answer.answer.leases
            in_flight: list[Hit | Reservation] = []
            if req.loading is not None:
                in_flight += req.loading.answer.leases
            for store in req.stores.values():
                in_flight += [res for _, res, _ in store.parts]
            if REPORTS_FLUSH:
                self._flushing += in_flight
            else:
                held += in_flight
            req.answer = req.loading = None
            req.stores.clear()
            self._link.release(held)
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
        self._link.release(flushing)

    @property
    def lock(self) -> threading.Lock:
        """What vLLM 0.33 holds across a step (a lookup's HIT to the prepare_load
        that pins it) and around every other call but ``shutdown``: a real lock,
        as vLLM asks of a manager with a thread of its own. That thread never
        takes it (it leaves answers under ``_lock``, a lock of its own, held
        for an assignment): it must not wait for a step that may be waiting
        for it (``prepare_store`` waits for the loop thread's reservations)."""
        return self._step_lock

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        """vLLM 0.33's ``vllm:kv_offload_config_info`` labels: the namespace of
        each KV cache group's pages, one series each
        (``HicachedOffloadingSpec.config_info_keys``)."""
        return [info_labels(g.spec) for g in self.groups]

    def shutdown(self) -> None:
        """Publish the stores that finished (within their deadline), then leave."""
        wait = self.settings.ack_timeout_s + self.settings.timeout_s
        concurrent.futures.wait(list(self._publishing), timeout=wait)
        self._link.close()


def _question(req: _Request, groups: Sequence[KVGroup], page_tokens: list[int]) -> _Question:
    """What to ask about ``req``: each group's keys at the chunk ends its pages
    end at (``page_tokens``: tokens a chunk, per group); a chunk's key after
    the chunk before is noted as its store's parent."""
    ends = sorted(req.ends)
    keys, positions, befores = [], [], []
    for group in groups:
        tokens = page_tokens[group.index]
        mine = [end for end in ends if end % tokens == 0]
        suffix = group.group_id.to_bytes(4, "big")
        chain = [req.ends[end] + suffix for end in mine]
        before = {
            chain[i]: chain[i - 1]
            for i in range(1, len(mine))
            if mine[i] - mine[i - 1] == tokens  # the chunk before: a load's and a store's parent
        }
        req.before.update(before)
        keys.append(chain)
        positions.append(mine)
        befores.append(before)
    return _Question(keys, positions, befores)


def _runs(
    req: _Request, g: int, mine: list[tuple[int, bytes]], tokens: int
) -> list[tuple[int, list[bytes], bytes | None]]:
    """Group ``g``'s keys to store (with their chunks' ends; ``tokens`` a chunk)
    in runs of chunks that follow one another, each with the key of the
    chunk before its first, where known (None: the first chunk, or one after
    a hole); a reservation enters its keys as one sequence, so a hole starts
    another. The chunk before is the one the scheduler showed before it, or
    this group's last one stored."""
    runs: list[tuple[int, list[bytes], bytes | None]] = []
    last_end, last_key = req.last_stored.get(g, (0, b""))
    for end, key in mine:
        follows = bool(last_key) and end - last_end == tokens
        if runs and follows:
            runs[-1][1].append(key)
        else:
            runs.append((g, [key], req.before.get(key) or (last_key if follows else None)))
        last_end, last_key = end, key
    req.last_stored[g] = (last_end, last_key)
    return runs


def _release_late(
    link: Link, asked: concurrent.futures.Future[list[tuple[int, Reservation, list[bytes]]]]
) -> None:
    """Reservations granted after prepare_store gave up on them: end them."""
    if not asked.cancelled() and asked.exception() is None:
        link.release(res for _, res, _ in asked.result())


def _whole_chunks(
    granted: list[tuple[int, Reservation, list[bytes]]],
) -> tuple[_Store, list[bytes]]:
    """What to write of each reservation (group, reservation, its keys): the fresh
    keys of the chunks whose every page (of every group this store names) is
    either in L2 already or has a slot; a chunk some group got no slot for is
    stored in none."""
    missing: set[bytes] = set()
    fresh: list[dict[int, int]] = []  # per reservation: key index -> slot
    for _, res, keys in granted:
        slot_of = {i: slot for slot, i in enumerate(res.indices)}
        fresh.append(slot_of)
        for i, key in enumerate(keys):
            if not res.present_mask[i] and i not in slot_of:
                missing.add(key[:-4])
    parts, stored, kept = [], [], []
    for (g, res, keys), slot_of in zip(granted, fresh, strict=True):
        mine = [(i, s) for i, s in slot_of.items() if keys[i][:-4] not in missing]
        parts.append((g, res, [s for _, s in mine]))
        stored.append([keys[i] for i, _ in mine])
        kept += stored[-1]
    return _Store(parts, stored), kept
