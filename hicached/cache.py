"""The daemon's state machine: sessions, namespaces, leases, pool and index.

Synchronous and free of I/O: the server decodes a request, calls ``handle``
and sends back whatever it returns. Expected outcomes (a miss, a full pool)
are part of the reply; misuse raises a HicachedError that becomes an error
reply; a broken invariant is an assertion.

Leases: a *write* lease belongs to a reservation (its fresh slots, plus a pin
on the pages that were already present so they cannot be evicted before the
commit); a *read* lease pins the pages a match returned; a *prefetch* lease
is a write lease whose fresh slots are filled from L3 in the background.
Leases expire after ``leases.ttl_s`` so a client that dies cannot hold
memory forever.

L3: the cache decides *what* moves (write policy, prefetch plans) and keeps
track of which keys L3 holds; a Tier (storage.py) does the moving. Pending
L3 writes are tracked per page key and hold their slot (pinned, or kept
out of the free list after an eviction) until the backend is done with it,
so splitting or evicting index nodes never loses or corrupts one.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, get_args

import numpy as np

from hicached import protocol as p
from hicached.config import Config
from hicached.errors import (
    BadRequest,
    ForeignLease,
    HicachedError,
    ResourceExhausted,
    SessionLost,
    TooLarge,
    UnknownLease,
    UnknownNamespace,
    VersionMismatch,
)
from hicached.events import MEDIUM_L2, AllBlocksCleared, EventLog
from hicached.hashing import TOKEN_BYTES, KeyCache
from hicached.index import PageIndex
from hicached.namespace import NamespaceSpec, namespace_digest, validate_spec
from hicached.pool import SlotPool

OP_NAMES = {cls: str(cls.__struct_config__.tag) for cls in get_args(p.AnyRequest)}


_LEASE_MASK = (1 << 63) - 1


@dataclass(slots=True)
class Namespace:
    id: int
    spec: NamespaceSpec
    digest: bytes
    index: PageIndex


@dataclass(slots=True)
class Session:
    id: int
    routing_id: bytes
    client: str
    pid: int
    last_seen: float
    namespaces: set[int] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)


@dataclass(slots=True)
class PrefetchState:
    """Progress of one prefetch; ``keys`` are the pages after the L2 hit."""

    keys: list[bytes]
    planned: int = -1  # pages being read; -1 until L3 has been asked
    completed: int = 0  # leading pages read and verified
    done: bool = False
    failed: bool = False
    running: bool = True  # the reader may still write into fresh slots
    ended: bool = False  # the lease ended; the reader frees what is left


@dataclass(slots=True)
class Lease:
    id: int
    session: Session
    ns: Namespace
    deadline: float
    pinned: list[int]  # slots of indexed pages held against eviction
    keys: list[bytes] = field(default_factory=list)  # write leases: every page's key
    fresh: list[int] = field(default_factory=list)  # write leases: slots to fill
    prefetch: PrefetchState | None = None
    tokens: bytes = b""  # write leases: the sequence, for events

    @property
    def writing(self) -> bool:
        return bool(self.keys) or self.prefetch is not None


class Tier(Protocol):
    """What the cache asks of the L3 tier (storage.py); all calls return at once."""

    def write(self, ns: Namespace, key: bytes, slot: int, done: Callable[[bool], None]) -> bool:
        """Queue a write of the page in ``slot``; ``done(ok)`` runs when it ends."""
        ...

    def prefetch(self, lease: Lease) -> None:
        """Start reading ``lease.prefetch.keys`` into slots the cache will plan."""
        ...


class Cache:
    """Everything the daemon knows; owned by the event-loop thread."""

    def __init__(
        self,
        config: Config,
        *,
        pool_path: str,
        instance: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pool_path = pool_path
        self.instance = instance if instance is not None else secrets.randbits(63)
        self.clock = clock
        self.started = clock()
        mib = 1 << 20
        self.pool = SlotPool(config.pool.size_mib * mib, config.pool.slab_mib * mib)
        self.indexes: dict[int, PageIndex] = {}  # page_bytes -> index
        self._clock = itertools.count(1)  # one recency clock for every index
        self.namespaces: dict[int, Namespace] = {}
        self._ns_by_digest: dict[bytes, Namespace] = {}
        self.sessions: dict[bytes, Session] = {}  # routing id -> session
        self.leases: dict[int, Lease] = {}  # insertion order == deadline order
        self._next_session = 1
        # Lease ids count up from a random start: unique, and unlikely to be
        # valid again after a restart (ownership is checked either way).
        self._next_lease = secrets.randbits(62)
        self.requests: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.evicted_pages = 0
        self.reclaimed_slabs = 0  # slabs taken from one page size for another
        self.expired_leases = 0
        self.key_cache = KeyCache(config.server.key_cache_pages)
        self.tier: Tier | None = None
        self.l3: set[bytes] = set()  # keys L3 holds, as far as we know
        self.writing: set[bytes] = set()  # keys with an L3 write in flight
        self._hits: dict[bytes, int] = {}  # write_through_selective: matches per key
        self.l3_counters: dict[str, int] = {}
        self.match_pages = {"asked": 0, "l2": 0, "l3": 0}
        self.metrics_endpoint = ""  # set by the server when it serves metrics
        self.events = EventLog(config.events.queue_events, enabled=bool(config.events.endpoint))
        self.events.add(AllBlocksCleared())  # a new daemon's L2 starts empty
        self.l3_medium = config.storage.backend.upper()

    # -- dispatch --------------------------------------------------------------

    def handle(self, routing_id: bytes, request: p.AnyRequest) -> p.AnyReply:
        """Apply one request; never raises for a request's own faults."""
        op = OP_NAMES[type(request)]
        self.requests[op] = self.requests.get(op, 0) + 1
        try:
            if isinstance(request, p.Hello):
                return self.hello(routing_id, request)
            session = self.session(routing_id)
            match request:
                case p.RegisterNamespace():
                    return self.register(session, request)
                case p.Reserve():
                    return self.reserve(session, request)
                case p.Commit():
                    return self.commit(session, request)
                case p.Match():
                    return self.match(session, request)
                case p.Prefetch():
                    return self.prefetch(session, request)
                case p.Progress():
                    return self.progress(session, request)
                case p.Release():
                    self.release(session, request.lease)
                    return p.Ok(id=request.id)
                case p.Stats():
                    return p.StatsOk(id=request.id, stats=self.stats())
            raise BadRequest(f"unhandled request {op}")  # pragma: no cover
        except HicachedError as exc:
            self.errors[exc.code] = self.errors.get(exc.code, 0) + 1
            return p.Error.of(request.id, exc)

    def count_drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    # -- sessions and namespaces ---------------------------------------------

    def hello(self, routing_id: bytes, msg: p.Hello) -> p.HelloOk:
        if msg.major != p.PROTOCOL_MAJOR:
            raise VersionMismatch(
                f"client speaks protocol {msg.major}.{msg.minor}, this daemon speaks "
                f"{p.PROTOCOL_MAJOR}.{p.PROTOCOL_MINOR}: install matching hicached versions"
            )
        session = self.sessions.get(routing_id)
        if session is None:
            if len(self.sessions) >= self.config.server.max_clients:
                raise ResourceExhausted(
                    f"{len(self.sessions)} clients are connected, the limit "
                    "(server.max_clients); close idle clients or raise the limit"
                )
            session = Session(
                self._next_session, routing_id, msg.client[:64], msg.pid, self.clock()
            )
            self._next_session += 1
            self.sessions[routing_id] = session
        return p.HelloOk(
            id=msg.id,
            major=p.PROTOCOL_MAJOR,
            minor=p.PROTOCOL_MINOR,
            instance=self.instance,
            session=session.id,
            pool_path=self.pool_path,
            pool_bytes=self.pool.arena_bytes,
            lease_ttl_s=self.config.leases.ttl_s,
            max_message_bytes=self.config.server.max_message_bytes,
            max_pages_per_request=self.config.server.max_pages_per_request,
        )

    def session(self, routing_id: bytes) -> Session:
        session = self.sessions.get(routing_id)
        if session is None:
            raise SessionLost("this daemon does not know the client (restarted?): send hello first")
        session.last_seen = self.clock()
        return session

    def register(self, session: Session, msg: p.RegisterNamespace) -> p.NamespaceOk:
        spec = msg.spec
        validate_spec(spec, self.config.pool.max_page_bytes)
        digest = namespace_digest(spec)
        ns = self._ns_by_digest.get(digest)
        if ns is None:
            if len(self.namespaces) >= self.config.pool.max_namespaces:
                raise ResourceExhausted(
                    f"{len(self.namespaces)} namespaces are registered, the limit "
                    "(pool.max_namespaces)"
                )
            index = self.indexes.get(spec.page_bytes)
            if index is None:
                index = self.indexes[spec.page_bytes] = PageIndex(self._clock)
            ns = Namespace(len(self.namespaces) + 1, spec, digest, index)
            self.namespaces[ns.id] = ns
            self._ns_by_digest[digest] = ns
        session.namespaces.add(ns.id)
        return p.NamespaceOk(id=msg.id, ns=ns.id, digest=digest)

    def _namespace(self, session: Session, ns_id: int) -> Namespace:
        if ns_id not in session.namespaces:
            raise UnknownNamespace(
                f"namespace {ns_id} is not registered by this client: register it first"
            )
        return self.namespaces[ns_id]

    def _keys(self, ns: Namespace, tokens: bytes) -> list[bytes]:
        if len(tokens) % TOKEN_BYTES:
            raise BadRequest("tokens must be packed little-endian uint32 values")
        limit = self.config.server.max_pages_per_request
        if len(tokens) // (ns.spec.page_tokens * TOKEN_BYTES) > limit:
            raise TooLarge(
                f"the sequence covers more than {limit} pages (server.max_pages_per_request)"
            )
        return self.key_cache.keys(ns.digest, tokens, ns.spec.page_tokens)

    # -- leases ------------------------------------------------------------------

    def _new_lease(self, session: Session, ns: Namespace, pinned: list[int]) -> Lease:
        if len(self.leases) >= self.config.leases.max_leases:
            raise ResourceExhausted(
                f"{len(self.leases)} leases are open, the limit (leases.max_leases): "
                "release or commit leases sooner"
            )
        lease_id = self._next_lease = (self._next_lease + 1) & _LEASE_MASK or 1
        lease = Lease(lease_id, session, ns, self.clock() + self.config.leases.ttl_s, pinned)
        self.pool.pin(pinned)
        self.leases[lease_id] = lease
        session.leases.add(lease_id)
        return lease

    def _take_lease(self, session: Session, lease_id: int) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise UnknownLease(f"lease {lease_id} is not open (committed, released or expired)")
        if lease.session is not session:
            raise ForeignLease(f"lease {lease_id} belongs to another client")
        del self.leases[lease_id]
        session.leases.discard(lease_id)
        return lease

    def _end_lease(self, lease: Lease) -> None:
        """Drop a lease's pins and free its unused fresh slots.

        A prefetch reader may still be writing into fresh slots: then they are
        left to it, and ``prefetch_finished`` frees them.
        """
        pool = self.pool
        if lease.pinned:
            lease.ns.index.unpinned(pool.unpin(lease.pinned))
        lease.pinned = []
        pf = lease.prefetch
        if pf is not None:
            pf.ended = True
            if pf.running:
                return
        for slot in lease.fresh:
            pool.free(slot)
        lease.fresh = []

    # -- operations ----------------------------------------------------------------

    def reserve(self, session: Session, msg: p.Reserve) -> p.ReserveOk:
        ns = self._namespace(session, msg.ns)
        keys = self._keys(ns, msg.tokens)
        present = ns.index.match(keys)
        lease = self._new_lease(session, ns, present)
        want = len(keys) - len(present)
        fresh = self._alloc(ns, want)
        lease.keys = keys[: len(present) + len(fresh)]
        lease.fresh = fresh
        lease.tokens = msg.tokens
        if not lease.keys or not fresh:
            # Nothing to write: no lease is kept open.
            self._end_lease(lease)
            del self.leases[lease.id]
            session.leases.discard(lease.id)
            return p.ReserveOk(
                id=msg.id, lease=0, present=len(present), offsets=[], pool_full=want > 0
            )
        return p.ReserveOk(
            id=msg.id,
            lease=lease.id,
            present=len(present),
            offsets=fresh,
            pool_full=len(fresh) < want,
        )

    def _alloc(self, ns: Namespace, count: int) -> list[int]:
        """Up to ``count`` free slots of the namespace's page size, evicting LRU pages.

        Pages of every size compete by recency: when the least recently used
        page is of another size, that size gives back a whole slab (its LRU
        pages go until one of its slabs is empty), so no page size can hold
        the pool against another forever.
        """
        page_bytes = ns.spec.page_bytes
        pool = self.pool
        out: list[int] = []
        reclaim = True  # give up taking slabs once an attempt frees none
        while len(out) < count:
            slot = pool.alloc(page_bytes)
            if slot is not None:
                out.append(slot)
                continue
            other = self._other_size_to_reclaim(ns.index) if reclaim else None
            if other is not None:
                reclaim = self._reclaim_slab(other)
                continue
            victims = ns.index.evict(count - len(out), pool.pins)
            if not victims:
                break
            self._evicted(victims)
        return out

    def _other_size_to_reclaim(self, own: PageIndex) -> int | None:
        """The other page size whose LRU page is older than all of ``own``'s
        (any with pages, when ``own`` has none), or None."""
        if len(self.indexes) < 2:
            return None
        best = own.oldest()
        choice = None
        for page_bytes, index in self.indexes.items():
            if index is own or not self.pool.slabs_of(page_bytes):
                continue
            tick = index.oldest()
            if tick is not None and (best is None or tick < best):
                best, choice = tick, page_bytes
        return choice

    def _reclaim_slab(self, page_bytes: int) -> bool:
        """Evict LRU pages of ``page_bytes`` until one of its slabs is free; bounded
        by two slabs' worth of pages. True if a slab came back."""
        pool, index = self.pool, self.indexes[page_bytes]
        before = pool.free_slabs
        budget = 2 * max(1, pool.slots_per_slab(page_bytes))
        while pool.free_slabs == before and budget > 0:
            victims = index.evict(min(budget, 64), pool.pins)
            if not victims:
                break
            budget -= len(victims)
            self._evicted(victims)
        if pool.free_slabs > before:
            self.reclaimed_slabs += 1
            return True
        return False

    def _evicted(self, victims: list[tuple[bytes, int, int]]) -> None:
        """Free evicted slots; under write_back, first write pages L3 lacks (under
        the namespace that stored each page)."""
        self.evicted_pages += len(victims)
        write_back = self.tier is not None and self.config.storage.write_policy == "write_back"
        hits = self._hits
        self.events.removed([key for key, _, _ in victims], MEDIUM_L2)
        for key, slot, owner in victims:
            hits.pop(key, None)
            ns = self.namespaces.get(owner)
            unwritten = key not in self.l3 and key not in self.writing
            if (
                write_back
                and unwritten
                and ns is not None
                and self._write(ns, key, slot, evicted=True)
            ):
                continue
            self.pool.free(slot)

    def commit(self, session: Session, msg: p.Commit) -> p.CommitOk:
        lease = self.leases.get(msg.lease)
        if lease is not None and lease.session is session and not lease.writing:
            raise BadRequest(f"lease {msg.lease} is a read lease; release it instead")
        lease = self._take_lease(session, msg.lease)
        fresh = lease.fresh
        pf = lease.prefetch
        ready = len(fresh) if pf is None else pf.completed
        count = ready if msg.pages < 0 else msg.pages
        if count > ready:
            self._end_lease(lease)
            what = "reserved" if pf is None else "has read"
            raise BadRequest(f"commit of {count} pages, but the lease {what} {ready}; lease ended")
        n = len(lease.pinned) + count
        keys = lease.keys[:n]
        slots = lease.pinned + fresh[:count]
        published, unused = lease.ns.index.insert(keys, slots, lease.ns.id)
        lease.fresh = fresh[count:]
        for slot in unused:
            self.pool.free(slot)
        self._end_lease(lease)
        new = n - published
        if published:
            page_tokens = lease.ns.spec.page_tokens
            parent = keys[new - 1] if new else None
            tokens = _token_ids(lease.tokens, new * page_tokens, n * page_tokens)
            self.events.stored(keys[new:], parent, tokens, page_tokens, MEDIUM_L2)
        if published and self.tier is not None:
            if pf is not None:
                self.l3.update(keys[new:])  # these came from L3
            elif self.config.storage.write_policy == "write_through":
                self._write_pages(lease.ns, keys, slots, new, lease.tokens)
        return p.CommitOk(id=msg.id, published=published, duplicates=count - published)

    def match(self, session: Session, msg: p.Match) -> p.MatchOk:
        ns = self._namespace(session, msg.ns)
        keys = self._keys(ns, msg.tokens)
        slots = ns.index.match(keys)
        hits = len(slots)
        lease_id = 0
        if msg.lease and slots:
            lease_id = self._new_lease(session, ns, slots).id
        l3_hits = 0
        if self.l3:
            l3 = self.l3
            for key in keys[hits:]:
                if key not in l3:
                    break
                l3_hits += 1
        counted = self.match_pages
        counted["asked"] += len(keys)
        counted["l2"] += hits
        counted["l3"] += l3_hits
        if (
            hits
            and self.tier is not None
            and self.config.storage.write_policy == "write_through_selective"
        ):
            self._count_hit(ns, keys[:hits], slots, msg.tokens)
        return p.MatchOk(id=msg.id, hits=hits, offsets=slots, lease=lease_id, l3_hits=l3_hits)

    # -- L3 ------------------------------------------------------------------------------

    def _count_hit(self, ns: Namespace, keys: list[bytes], slots: list[int], tokens: bytes) -> None:
        """write_through_selective: a prefix matched often enough goes to L3.

        Only the deepest page of each match is counted: its prefix is matched
        at least as often, and is written along with it.
        """
        last = keys[-1]
        if last in self.l3:
            return
        count = self._hits.get(last, 0) + 1
        if count < self.config.storage.selective_hits:
            self._hits[last] = count
            return
        self._hits.pop(last, None)
        self._write_pages(ns, keys, slots, 0, tokens)

    def _write_pages(
        self, ns: Namespace, keys: list[bytes], slots: list[int], start: int, tokens: bytes
    ) -> None:
        """Write pages ``start..`` of a sequence that L3 lacks, each with its parent
        and token ids for its L3 event."""
        page_tokens = ns.spec.page_tokens
        for i in range(start, len(keys)):
            key = keys[i]
            if key not in self.l3 and key not in self.writing:
                ids = _token_ids(tokens, i * page_tokens, (i + 1) * page_tokens)
                parent = keys[i - 1] if i else None
                self._write(ns, key, slots[i], evicted=False, parent=parent, tokens=ids)

    def _write(
        self,
        ns: Namespace,
        key: bytes,
        slot: int,
        *,
        evicted: bool,
        parent: bytes | None = None,
        tokens: list[int] | None = None,
    ) -> bool:
        """Send one page to L3; its slot is held until the write ends.

        ``evicted``: the page already left the index; its slot is freed after
        the write instead of unpinned.
        """
        assert self.tier is not None
        if not evicted:
            self.pool.pin([slot])
        self.writing.add(key)

        def done(ok: bool) -> None:
            self.writing.discard(key)
            self._count_l3("written" if ok else "write_failed")
            if ok:
                self.l3.add(key)
                self.events.stored([key], parent, tokens or [], ns.spec.page_tokens, self.l3_medium)
            if evicted:
                self.pool.free(slot)
            else:
                ns.index.unpinned(self.pool.unpin([slot]))

        if self.tier.write(ns, key, slot, done):
            return True
        self.writing.discard(key)
        self._count_l3("write_not_queued")
        if not evicted:
            ns.index.unpinned(self.pool.unpin([slot]))
        return False

    def _count_l3(self, what: str, n: int = 1) -> None:
        self.l3_counters[what] = self.l3_counters.get(what, 0) + n

    def forget_l3(self, keys: Iterable[bytes]) -> None:
        """The backend no longer holds these pages."""
        gone = [key for key in keys if key in self.l3]
        self.l3.difference_update(gone)
        self.events.removed(gone, self.l3_medium)

    def flush(self) -> int:
        """Queue a write of every L2 page L3 lacks (graceful stop); returns how many."""
        queued = 0
        for ns in self.namespaces.values():
            for node in ns.index.nodes():
                for key, slot in zip(node.keys, node.slots, strict=True):
                    if key not in self.l3 and key not in self.writing:
                        queued += self._write(ns, key, slot, evicted=False)
        return queued

    def prefetch(self, session: Session, msg: p.Prefetch) -> p.PrefetchOk:
        ns = self._namespace(session, msg.ns)
        keys = self._keys(ns, msg.tokens)
        present = ns.index.match(keys)
        wanted = keys[len(present) :]
        if msg.max_pages >= 0:
            wanted = wanted[: msg.max_pages]
        if self.tier is None or not wanted:
            return p.PrefetchOk(id=msg.id, lease=0, l2_hits=len(present))
        lease = self._new_lease(session, ns, present)
        lease.keys = keys[: len(present)]
        lease.prefetch = PrefetchState(wanted)
        lease.tokens = msg.tokens
        self._count_l3("prefetches")
        self.tier.prefetch(lease)
        return p.PrefetchOk(id=msg.id, lease=lease.id, l2_hits=len(present))

    def progress(self, session: Session, msg: p.Progress) -> p.ProgressOk:
        lease = self.leases.get(msg.lease)
        if lease is None or lease.prefetch is None:
            raise UnknownLease(
                f"prefetch {msg.lease} is not open (committed, cancelled or expired)"
            )
        if lease.session is not session:
            raise ForeignLease(f"prefetch {msg.lease} belongs to another client")
        pf = lease.prefetch
        return p.ProgressOk(
            id=msg.id, planned=pf.planned, completed=pf.completed, done=pf.done, failed=pf.failed
        )

    def prefetch_planned(self, lease: Lease, available: int) -> list[int]:
        """L3 holds ``available`` leading pages: take slots for as many as fit."""
        pf = lease.prefetch
        assert pf is not None
        if pf.ended:
            pf.planned = 0
            return []
        fresh = self._alloc(lease.ns, min(available, len(pf.keys)))
        lease.fresh = fresh
        lease.keys = lease.keys + pf.keys[: len(fresh)]
        pf.planned = len(fresh)
        if len(fresh) < min(available, len(pf.keys)):
            self._count_l3("prefetch_pool_short")
        return fresh

    def prefetch_progress(self, lease: Lease, results: list[bool]) -> bool:
        """Record a batch of reads, in order; False when the prefetch should stop."""
        pf = lease.prefetch
        assert pf is not None
        for ok in results:
            if not ok:  # a gap: nothing after it may ever be committed
                pf.failed = True
                self._count_l3("prefetch_truncated")
                return False
            self.l3.add(pf.keys[pf.completed])
            pf.completed += 1
            self._count_l3("pages_prefetched")
        return not pf.ended

    def prefetch_finished(self, lease: Lease) -> None:
        """The reader is done with the lease's slots."""
        pf = lease.prefetch
        assert pf is not None
        pf.running = False
        pf.done = True
        pf.planned = max(pf.planned, 0)
        if pf.ended:  # the lease ended while reading: free what it left
            for slot in lease.fresh:
                self.pool.free(slot)
            lease.fresh = []

    def release(self, session: Session, lease_id: int) -> None:
        self._end_lease(self._take_lease(session, lease_id))

    # -- housekeeping -----------------------------------------------------------------

    def expire(self) -> int:
        """End leases past their deadline and forget idle sessions; returns leases ended."""
        now = self.clock()
        ended = 0
        for lease_id, lease in list(self.leases.items()):
            if lease.deadline > now:
                break  # leases are kept in deadline order
            del self.leases[lease_id]
            lease.session.leases.discard(lease_id)
            self._end_lease(lease)
            ended += 1
        self.expired_leases += ended
        idle = now - self.config.server.session_idle_s
        for routing_id, session in list(self.sessions.items()):
            if session.last_seen < idle and not session.leases:
                del self.sessions[routing_id]
        return ended

    def stats(self) -> p.DaemonStats:
        pool = self.pool
        used = pool.used_bytes
        reserved = sum(len(lease.fresh) for lease in self.leases.values())
        return p.DaemonStats(
            instance=self.instance,
            uptime_s=round(self.clock() - self.started, 3),
            pool_bytes=pool.arena_bytes,
            pool_used_bytes=used,
            pool_free_bytes=pool.arena_bytes - used,
            slab_bytes=pool.slab_bytes,
            pages=sum(index.pages for index in self.indexes.values()),
            pinned_pages=len(pool.pins),
            reserved_pages=reserved,
            namespaces=len(self.namespaces),
            clients=len(self.sessions),
            leases=len(self.leases),
            requests=dict(self.requests),
            errors=dict(self.errors),
            dropped=dict(self.dropped),
            evicted_pages=self.evicted_pages,
            reclaimed_slabs=self.reclaimed_slabs,
            expired_leases=self.expired_leases,
            l3_backend=self.config.storage.backend if self.tier is not None else "",
            l3_state=getattr(self.tier, "state", "") if self.tier is not None else "",
            l3_pages_known=len(self.l3),
            l3={**self.l3_counters, **(getattr(self.tier, "counters", None) or {})},
            match_pages=dict(self.match_pages),
            events_pending=len(self.events.pending),
            metrics_endpoint=self.metrics_endpoint,
        )


def _token_ids(tokens: bytes, start: int, end: int) -> list[int]:
    """Token ids ``start:end`` of a packed (uint32 LE) sequence."""
    return np.frombuffer(tokens, dtype="<u4")[start:end].tolist()
