"""The daemon's request handler: sessions, namespaces, leases, L2 and L3 policy.

Synchronous and free of I/O: the server decodes a request, calls ``handle``
and sends back whatever it returns. Expected outcomes (a miss, a full pool)
are part of the reply; misuse raises a HicachedError that becomes an error
reply; a broken invariant is an assertion.

The state lives in smaller pieces: sessions, namespaces and leases in
sessions.py, slot allocation and eviction in l2.py, the set of keys L3 holds
in l3state.py. This module decides what each request does with them.

Leases: a *write* lease belongs to a reservation (its fresh slots, plus a pin
on the pages that were already present so they cannot be evicted before the
commit); a *read* lease pins the pages a match returned; a *prefetch* lease
is a write lease whose fresh slots are filled from L3 in the background.
Leases expire after ``leases.ttl_s`` so a client that dies cannot hold
memory forever; the fresh slots of an expired write lease sit in quarantine
for ``leases.quarantine_s`` before reuse, so a copy that a client began just
before its deadline cannot land in another key's page.

L3: the cache decides *what* moves (write policy, prefetch plans) and keeps
track of which keys L3 holds; the tier (storage.py) does the moving. Pending
L3 writes are tracked per page key and hold their slot (pinned, or kept
out of the free list after an eviction) until the backend is done with it,
so splitting or evicting index nodes never loses or corrupts one.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
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
from hicached.l2 import L2, Victims
from hicached.l3state import KnownKeys
from hicached.namespace import namespace_digest, validate_spec
from hicached.pool import GEN_GRANULE, SlotPool
from hicached.sessions import Lease, LeaseTable, NamespaceState, PrefetchState, Session

__all__ = ["OP_NAMES", "Cache", "Lease", "NamespaceState", "PrefetchState", "Session", "TierPort"]

OP_NAMES = {cls: str(cls.__struct_config__.tag) for cls in get_args(p.AnyRequest)}


class TierPort(Protocol):
    """What the cache asks of the L3 tier (storage.py); all calls return at once."""

    def write(
        self, ns: NamespaceState, key: bytes, slot: int, done: Callable[[bool], None]
    ) -> bool:
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
        gens: np.ndarray | None = None,
        instance: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pool_path = pool_path
        self.instance = instance if instance is not None else secrets.randbits(63)
        self.clock = clock
        self.started = clock()
        mib = 1 << 20
        self.pool = SlotPool(config.pool.size_mib * mib, config.pool.slab_mib * mib, gens)
        self.l2 = L2(self.pool, self._evicted)
        self.indexes = self.l2.indexes  # page_bytes -> index
        self.namespaces: dict[int, NamespaceState] = {}
        self._ns_by_digest: dict[bytes, NamespaceState] = {}
        self._ns_ids = itertools.count(1)  # never reused: a stale id cannot name another
        # routing id -> session, least recently seen first
        self.sessions: OrderedDict[bytes, Session] = OrderedDict()
        self._next_session = 1
        # Lease ids count up from a random start: unique, and unlikely to be
        # valid again after a restart (ownership is checked either way).
        self.leases = LeaseTable(secrets.randbits(62))
        self.requests: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.expired_leases = 0
        self.key_cache = KeyCache(config.server.key_cache_pages)
        self.tier: TierPort | None = None
        self.l3 = KnownKeys(config.storage.known_keys)  # keys L3 holds, as far as we know
        self.writing: set[bytes] = set()  # keys with an L3 write in flight
        self._hits: dict[bytes, int] = {}  # write_through_selective: matches per key
        self.l3_counters: dict[str, int] = {}
        self.match_pages = {"asked": 0, "l2": 0, "l3": 0}
        self.metrics_endpoint = ""  # set by the server when it serves metrics
        self.events = EventLog(config.events.queue_events, enabled=bool(config.events.endpoint))
        self.events.add(AllBlocksCleared())  # a new daemon's L2 starts empty
        self.l3_medium = config.storage.backend.upper()

    @property
    def evicted_pages(self) -> int:
        return self.l2.evicted_pages

    @property
    def reclaimed_slabs(self) -> int:
        return self.l2.reclaimed_slabs

    # -- dispatch --------------------------------------------------------------

    def handle(self, routing_id: bytes, request: p.AnyRequest) -> p.AnyReply:
        """Apply one request; never raises for a request's own faults."""
        op = OP_NAMES[type(request)]
        self.requests[op] = self.requests.get(op, 0) + 1
        try:
            if isinstance(request, p.Hello):
                return self.hello(routing_id, request)
            if isinstance(request, p.Goodbye):
                self.goodbye(routing_id)
                return p.Ok(id=request.id)
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
                case p.Renew():
                    return self.renew(session, request)
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
                self._make_room()
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
            gen_granule=GEN_GRANULE,
        )

    def _make_room(self) -> None:
        """The session table is full: the longest idle session without a lease
        (one without namespaces first) makes way; with none, the newcomer is refused."""
        fallback = None
        for session in self.sessions.values():  # least recently seen first
            if session.leases:
                continue
            if not session.namespaces:
                self._end_session(session)
                return
            if fallback is None:
                fallback = session
        if fallback is None:
            raise ResourceExhausted(
                f"{len(self.sessions)} clients hold leases, the limit (server.max_clients); "
                "close idle clients or raise the limit"
            )
        self._end_session(fallback)

    def session(self, routing_id: bytes) -> Session:
        session = self.sessions.get(routing_id)
        if session is None:
            raise SessionLost("this daemon does not know the client (restarted?): send hello first")
        session.last_seen = self.clock()
        self.sessions.move_to_end(routing_id)
        return session

    def goodbye(self, routing_id: bytes) -> None:
        session = self.sessions.get(routing_id)
        if session is not None:
            self._end_session(session)

    def _end_session(self, session: Session) -> None:
        """Forget a client: its leases end (write slots to quarantine), its namespaces
        lose a user."""
        del self.sessions[session.routing_id]
        for lease_id in list(session.leases):
            lease = self.leases.get(lease_id)
            if lease is not None:
                self.leases.pop(lease)
                self._end_lease(lease, stale=True)
        for ns_id in session.namespaces:
            ns = self.namespaces.get(ns_id)
            if ns is not None:
                ns.sessions -= 1
                self._maybe_forget(ns)
        session.namespaces.clear()

    def _maybe_forget(self, ns: NamespaceState) -> None:
        """A namespace nobody uses (no session, page, lease or L3 write) is forgotten."""
        if ns.unused and self.namespaces.get(ns.id) is ns:
            del self.namespaces[ns.id]
            del self._ns_by_digest[ns.digest]

    def register(self, session: Session, msg: p.RegisterNamespace) -> p.NamespaceOk:
        spec = msg.spec
        validate_spec(spec, self.config.pool.max_page_bytes)
        digest = namespace_digest(spec)
        ns = self._ns_by_digest.get(digest)
        if ns is None:
            if len(self.namespaces) >= self.config.pool.max_namespaces:
                raise ResourceExhausted(
                    f"{len(self.namespaces)} namespaces are in use, the limit (pool.max_namespaces)"
                )
            index = self.l2.index(spec.page_bytes)
            ns = NamespaceState(next(self._ns_ids), spec, digest, index)
            self.namespaces[ns.id] = ns
            self._ns_by_digest[digest] = ns
        if ns.id not in session.namespaces:
            session.namespaces.add(ns.id)
            ns.sessions += 1
        return p.NamespaceOk(id=msg.id, ns=ns.id, digest=digest)

    def _namespace(self, session: Session, ns_id: int) -> NamespaceState:
        if ns_id not in session.namespaces:
            raise UnknownNamespace(
                f"namespace {ns_id} is not registered by this client: register it first"
            )
        return self.namespaces[ns_id]

    def _keys(self, ns: NamespaceState, tokens: bytes) -> list[bytes]:
        if len(tokens) % TOKEN_BYTES:
            raise BadRequest("tokens must be packed little-endian uint32 values")
        limit = self.config.server.max_pages_per_request
        if len(tokens) // (ns.spec.page_tokens * TOKEN_BYTES) > limit:
            raise TooLarge(
                f"the sequence covers more than {limit} pages (server.max_pages_per_request)"
            )
        return self.key_cache.keys(ns.digest, tokens, ns.spec.page_tokens)

    # -- leases ------------------------------------------------------------------

    def _new_lease(self, session: Session, ns: NamespaceState, pinned: list[int]) -> Lease:
        if len(self.leases) >= self.config.leases.max_leases:
            raise ResourceExhausted(
                f"{len(self.leases)} leases are open, the limit (leases.max_leases): "
                "release or commit leases sooner"
            )
        deadline = self.clock() + self.config.leases.ttl_s
        lease = Lease(self.leases.next_id(), session, ns, deadline, pinned)
        self.pool.pin(pinned)
        self.leases.add(lease)
        ns.holds += 1
        return lease

    def _take_lease(self, session: Session, lease_id: int) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise UnknownLease(f"lease {lease_id} is not open (committed, released or expired)")
        if lease.session is not session:
            raise ForeignLease(f"lease {lease_id} belongs to another client")
        self.leases.pop(lease)
        return lease

    def _end_lease(self, lease: Lease, *, stale: bool = False) -> None:
        """Drop a lease's pins and free its unused fresh slots.

        ``stale``: the lease expired or its client left without ending it; a
        copy into its fresh slots may still be running, so they go to
        quarantine instead of the free list. A prefetch reader may still be
        writing into fresh slots: then they are left to it, and
        ``prefetch_finished`` frees them.
        """
        pool = self.pool
        if lease.pinned:
            lease.ns.index.unpinned(pool.unpin(lease.pinned))
        lease.pinned = []
        ns = lease.ns
        ns.holds -= 1
        pf = lease.prefetch
        if pf is not None:
            pf.ended = True
            if pf.running:
                ns.holds += 1  # the reader still holds it; released when it finishes
                return
        if stale and lease.client_writes:
            self.l2.quarantine(lease.fresh, self.clock() + self.config.leases.quarantine_s)
        else:
            for slot in lease.fresh:
                pool.free(slot, ns.spec.page_bytes)
        lease.fresh = []
        self._maybe_forget(ns)

    def renew(self, session: Session, msg: p.Renew) -> p.RenewOk:
        lease = self.leases.get(msg.lease)
        if lease is None:
            raise UnknownLease(f"lease {msg.lease} is not open (committed, released or expired)")
        if lease.session is not session:
            raise ForeignLease(f"lease {msg.lease} belongs to another client")
        ttl = self.config.leases.ttl_s
        self.leases.renew(lease, self.clock() + ttl)
        return p.RenewOk(id=msg.id, ttl_s=ttl)

    # -- operations ----------------------------------------------------------------

    def reserve(self, session: Session, msg: p.Reserve) -> p.ReserveOk:
        ns = self._namespace(session, msg.ns)
        keys = self._keys(ns, msg.tokens)
        present = ns.index.match(keys)
        lease = self._new_lease(session, ns, present)
        want = len(keys) - len(present)
        fresh = self.l2.alloc(ns.index, ns.spec.page_bytes, want)
        lease.keys = keys[: len(present) + len(fresh)]
        lease.fresh = fresh
        lease.tokens = msg.tokens
        if not fresh:
            # Nothing to write: no lease is kept open.
            self.leases.pop(lease)
            self._end_lease(lease)
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

    def _evicted(self, victims: Victims) -> None:
        """Free evicted slots; under write_back, first write pages L3 lacks (under
        the namespace that stored each page), holding their slots until then."""
        write_back = self.tier is not None and self.config.storage.write_policy == "write_back"
        hits = self._hits
        self.events.removed([key for key, _, _ in victims], MEDIUM_L2)
        owners: set[NamespaceState] = set()
        for key, slot, owner in victims:
            hits.pop(key, None)
            ns = self.namespaces[owner]
            ns.pages -= 1
            owners.add(ns)
            unwritten = key not in self.l3 and key not in self.writing
            if write_back and unwritten and self._write(ns, key, slot, evicted=True):
                continue
            self.pool.free(slot, ns.spec.page_bytes)
        for ns in owners:
            self._maybe_forget(ns)

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
        ns = lease.ns
        n = len(lease.pinned) + count
        keys = lease.keys[:n]
        slots = lease.pinned + fresh[:count]
        published, unused = ns.index.insert(keys, slots, ns.id)
        ns.pages += published
        lease.fresh = fresh[count:]
        for slot in unused:
            self.pool.free(slot, ns.spec.page_bytes)
        self._end_lease(lease)
        new = n - published
        if published:
            page_tokens = ns.spec.page_tokens
            parent = keys[new - 1] if new else None
            tokens = _token_ids(lease.tokens, new * page_tokens, n * page_tokens)
            self.events.stored(keys[new:], parent, tokens, page_tokens, MEDIUM_L2)
        if published and self.tier is not None:
            if pf is not None:
                self.l3.update(keys[new:])  # these came from L3
            elif self.config.storage.write_policy == "write_through":
                self._write_pages(ns, keys, slots, new, lease.tokens)
        return p.CommitOk(id=msg.id, published=published, duplicates=count - published)

    def match(self, session: Session, msg: p.Match) -> p.MatchOk:
        ns = self._namespace(session, msg.ns)
        keys = self._keys(ns, msg.tokens)
        slots = ns.index.match(keys)
        hits = len(slots)
        lease_id = 0
        if msg.lease and slots:
            lease_id = self._new_lease(session, ns, slots).id
        l3_hits = self.l3.leading(keys, hits) if self.l3 else 0
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

    def _count_hit(
        self, ns: NamespaceState, keys: list[bytes], slots: list[int], tokens: bytes
    ) -> None:
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
        self, ns: NamespaceState, keys: list[bytes], slots: list[int], start: int, tokens: bytes
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
        ns: NamespaceState,
        key: bytes,
        slot: int,
        *,
        evicted: bool,
        parent: bytes | None = None,
        tokens: list[int] | None = None,
    ) -> bool:
        """Send one page to L3; its slot is held until the write ends.

        ``evicted``: the page already left the index; its slot is held on its
        way back to the free list (counted by the allocator) until the write
        ends, instead of pinned.
        """
        assert self.tier is not None
        if evicted:
            self.l2.hold(slot)
        else:
            self.pool.pin([slot])
        self.writing.add(key)
        ns.holds += 1

        def done(ok: bool) -> None:
            self.writing.discard(key)
            self._count_l3("written" if ok else "write_failed")
            if ok:
                self.l3.add(key)
                self.events.stored([key], parent, tokens or [], ns.spec.page_tokens, self.l3_medium)
            if evicted:
                self.l2.give_back(slot)
            else:
                ns.index.unpinned(self.pool.unpin([slot]))
            ns.holds -= 1
            self._maybe_forget(ns)

        if self.tier.write(ns, key, slot, done):
            return True
        self.writing.discard(key)
        ns.holds -= 1
        self._count_l3("write_not_queued")
        if evicted:
            self.l2.unhold(slot)
        else:
            ns.index.unpinned(self.pool.unpin([slot]))
        return False

    def _count_l3(self, what: str, n: int = 1) -> None:
        self.l3_counters[what] = self.l3_counters.get(what, 0) + n

    def forget_l3(self, keys: Iterable[bytes]) -> None:
        """The backend no longer holds these pages. Those still in L2 are written
        again under the write-through policies, so L3 never keeps a sequence
        whose head it lost while that head sits in L2 (write_back writes them
        when they leave L2, as L3 lacks them now)."""
        gone = [key for key in keys if key in self.l3]
        for key in gone:
            self.l3.discard(key)
        self.events.removed(gone, self.l3_medium)
        if not gone or self.tier is None or self.config.storage.write_policy == "write_back":
            return
        wanted = set(gone)
        rewritten = 0
        for ns, key, slot, _ in self.unwritten_pages():
            if key in wanted:
                rewritten += self._write(ns, key, slot, evicted=False)
        self._count_l3("rewritten", rewritten)

    def unwritten_pages(self) -> list[tuple[NamespaceState, bytes, int, int]]:
        """Every L2 page that L3 lacks and no write is carrying: (namespace, key,
        slot, the slot's generation now)."""
        out = []
        l3, writing, namespaces = self.l3, self.writing, self.namespaces
        gens = self.pool.gens
        for index in self.indexes.values():
            for node in index.nodes():
                ns = namespaces[node.owner]
                for key, slot in zip(node.keys, node.slots, strict=True):
                    if key not in l3 and key not in writing:
                        out.append((ns, key, slot, int(gens[slot // GEN_GRANULE])))
        return out

    def write_back(self, pages: list[tuple[NamespaceState, bytes, int, int]]) -> int:
        """Queue writes of ``pages`` (from ``unwritten_pages``) that are still in L2
        and still unwritten; returns how many were queued."""
        queued = 0
        gens = self.pool.gens
        for ns, key, slot, gen in pages:
            if key in self.l3 or key in self.writing:
                continue
            if int(gens[slot // GEN_GRANULE]) != gen:
                # freed since (or a neighbour in its granule was): look the page up
                node = ns.index.node_of.get(slot)
                if node is None or node.keys[node.slots.index(slot)] != key:
                    continue  # evicted since, perhaps reused
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
        ns = lease.ns
        want = min(available, len(pf.keys))
        fresh = self.l2.alloc(ns.index, ns.spec.page_bytes, want)
        lease.fresh = fresh
        lease.keys = lease.keys + pf.keys[: len(fresh)]
        pf.planned = len(fresh)
        if len(fresh) < want:
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
            ns = lease.ns
            for slot in lease.fresh:
                self.pool.free(slot, ns.spec.page_bytes)
            lease.fresh = []
            ns.holds -= 1
            self._maybe_forget(ns)

    def release(self, session: Session, lease_id: int) -> None:
        self._end_lease(self._take_lease(session, lease_id))

    # -- housekeeping -----------------------------------------------------------------

    def expire(self) -> int:
        """End leases past their deadline, free quarantined slots whose time is up
        and forget idle sessions; returns leases ended."""
        now = self.clock()
        ended = 0
        for lease in self.leases.due(now):
            self._end_lease(lease, stale=True)
            ended += 1
        self.expired_leases += ended
        self.l2.release_quarantine(now)
        idle = now - self.config.server.session_idle_s
        stale = []
        for session in self.sessions.values():  # least recently seen first
            if session.last_seen >= idle:
                break
            if not session.leases:
                stale.append(session)
        for session in stale:
            self._end_session(session)
        return ended

    def stats(self) -> p.DaemonStats:
        pool = self.pool
        used = pool.used_bytes
        reserved = sum(len(lease.fresh) for lease in self.leases)
        return p.DaemonStats(
            instance=self.instance,
            uptime_s=round(self.clock() - self.started, 3),
            pool_bytes=pool.arena_bytes,
            pool_used_bytes=used,
            pool_free_bytes=pool.arena_bytes - used,
            slab_bytes=pool.slab_bytes,
            pages=self.l2.pages,
            pinned_pages=len(pool.pins),
            reserved_pages=reserved,
            namespaces=len(self.namespaces),
            clients=len(self.sessions),
            leases=len(self.leases),
            requests=dict(self.requests),
            errors=dict(self.errors),
            dropped=dict(self.dropped),
            evicted_pages=self.l2.evicted_pages,
            reclaimed_slabs=self.l2.reclaimed_slabs,
            expired_leases=self.expired_leases,
            quarantined_pages=self.l2.quarantined,
            writeback_pages=sum(self.l2.returning.values()) - self.l2.quarantined,
            l3_backend=self.config.storage.backend if self.tier is not None else "",
            l3_state=getattr(self.tier, "state", "") if self.tier is not None else "",
            l3_pages_known=len(self.l3),
            l3_known_max=self.l3.limit,
            l3={**self.l3_counters, **(getattr(self.tier, "counters", None) or {})},
            match_pages=dict(self.match_pages),
            events_pending=len(self.events.pending),
            metrics_endpoint=self.metrics_endpoint,
        )


def _token_ids(tokens: bytes, start: int, end: int) -> list[int]:
    """Token ids ``start:end`` of a packed (uint32 LE) sequence."""
    return np.frombuffer(tokens, dtype="<u4")[start:end].tolist()
