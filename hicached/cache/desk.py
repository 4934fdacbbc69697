"""The daemon's request handler: sessions, namespaces, leases, L2 and L3 policy.

Synchronous and free of I/O: the server decodes a request, calls ``handle``
and sends back whatever it returns. Expected outcomes (a miss, a full pool)
are part of the reply; misuse raises a HicachedError that becomes an error
reply; a broken invariant is an assertion.

The state lives in smaller pieces: sessions, namespaces and leases in
cache/sessions.py, slot allocation and eviction in state/l2.py, the set of keys L3 holds
in state/l3state.py. This module decides what each request does with them.

Leases: a *write* lease belongs to a reservation (its fresh slots, plus a pin
on the pages that were already present so they cannot be evicted before the
commit); a *read* lease pins the pages a match returned; a *prefetch* lease
is a write lease whose fresh slots are filled from L3 in the background.
Leases expire after ``leases.ttl_s`` so a client that dies cannot hold
memory forever; the fresh slots of an expired write lease sit in quarantine
for ``leases.quarantine_s`` before reuse, so a copy that a client began just
before its deadline cannot land in another key's page.

L3: the cache decides *what* moves (write policy, prefetch plans) and keeps
track of which keys L3 holds; the tier (daemon/tier.py) does the moving. Pending
L3 writes are tracked per page key and hold their slot (pinned, or kept
out of the free list after an eviction) until the backend is done with it,
so splitting or evicting index nodes never loses or corrupts one.

Unknown is not absent: while the record of what L3 holds is incomplete (the
startup scan runs, or keys were forgotten to stay within
``storage.known_keys``), a match or exists whose L3 part stops at a key the
record does not know returns an ``L3Lookup`` instead of its reply; the server
has the tier ask the backend about those keys under a deadline, and sends
what ``finish`` makes of the answer. Requests the record can answer return
their reply at once, as always.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, get_args

import msgspec
import numpy as np

from hicached.cache.chainorder import ChainOrder
from hicached.cache.eventlog import EventLog
from hicached.cache.policy import write_policy
from hicached.cache.sessions import (
    KeyedPage,
    Lease,
    LeaseTable,
    NamespaceState,
    PrefetchState,
    Session,
)
from hicached.config import Config
from hicached.errors import (
    BadRequest,
    ForeignLease,
    ForeignTenant,
    HicachedError,
    InvalidNamespace,
    ResourceExhausted,
    SessionLost,
    TooLarge,
    UnknownLease,
    UnknownNamespace,
    VersionMismatch,
)
from hicached.state.index import PageIndex
from hicached.state.l2 import DEFAULT_TENANT, L2, TenantBook, TenantFigures, Victims
from hicached.state.l3state import KnownKeys
from hicached.state.pool import GEN_GRANULE, SlotPool
from hicached.wire import protocol as p
from hicached.wire.events import MEDIUM_L2, Cleared, event_key
from hicached.wire.hashing import TOKEN_BYTES, KeyCache, engine_page_keys, page_keys
from hicached.wire.namespace import MAX_KEY_BYTES, NamespaceSpec, namespace_digest, validate_spec

__all__ = [
    "OP_NAMES",
    "Cache",
    "L3Lookup",
    "Lease",
    "NamespaceState",
    "PrefetchState",
    "Session",
    "TierPort",
]

MAX_SLOTS_PER_SLAB = 1 << 16  # so a page size's slots a slab are listed in bounded memory
OP_NAMES = {cls: str(cls.__struct_config__.tag) for cls in get_args(p.AnyRequest)}


class TierPort(Protocol):
    """What the cache asks of the L3 tier (daemon/tier.py); all calls return at once."""

    def write(
        self, ns: NamespaceState, key: bytes, slot: int, done: Callable[[bool], None]
    ) -> bool:
        """Queue a write of the page in ``slot``; ``done(ok)`` runs when it ends."""
        ...

    def prefetch(self, lease: Lease) -> None:
        """Start reading ``lease.prefetch.keys`` into slots the cache will plan."""
        ...


class Origin(NamedTuple):
    """What the L3 BlockStored of an L2 page names besides the page itself."""

    up: bytes | None  # the daemon's key of the page before it (None: first, or unnamed)
    eparent: bytes | None  # what events call that page
    tokens: bytes  # the page's packed token ids (none in a key-addressed namespace)
    slot: int  # the page's own slot (it keeps it while it stays in L2)


class HeldEvent(NamedTuple):
    """An L3 BlockStored waiting for its parent's to go out first."""

    key: bytes  # what events call the page
    parent: bytes | None
    tokens: list[int]
    page_tokens: int
    model: str


@dataclass(slots=True)
class InBoth:
    """An L2 page that L3 holds too: where it is, and when L3 took it."""

    ns: NamespaceState
    slot: int
    at: int  # bytes L3 had acknowledged when it took the page (-1: unknown)
    rewritten: bool  # written again in this stay in L2 after L3 let it go


class L3Lookup:
    """A reply that waits on L3: the record of what L3 holds is incomplete and
    does not know ``keys`` (of namespace digest ``ns``, in order), so the
    backend is asked how many of them it holds before they are answered as
    absent. ``finish(found)`` makes the reply, ``found`` being that leading
    count (0 when the backend could not tell in time: the reply says what the
    record knows then, and a miss is always legal). ``lease``: the read lease
    the reply will carry (0 for none), ended if the reply cannot be sent;
    ``id``: the request's, for an error reply."""

    __slots__ = ("finish", "id", "keys", "lease", "ns")

    def __init__(
        self,
        ns: bytes,
        keys: list[bytes],
        finish: Callable[[int], p.AnyReply],
        request_id: int,
        lease: int = 0,
    ) -> None:
        self.ns = ns
        self.keys = keys
        self.finish = finish
        self.id = request_id
        self.lease = lease


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
        self._set_quotas(config)
        self.namespaces: dict[int, NamespaceState] = {}
        self._ns_by_digest: dict[bytes, NamespaceState] = {}
        # never reused, and from a random start: a stale id, of this daemon or of
        # the one before a restart, cannot name another namespace
        self._ns_ids = itertools.count(secrets.randbits(40) + 1)
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
        self.policy = write_policy(config.storage.write_policy)  # when pages go to L3
        self.l3 = KnownKeys(config.storage.known_keys)  # keys L3 holds, as far as we know
        self.l3.on_forgotten = self._l3_keys_forgotten
        self.writing: set[bytes] = set()  # keys with an L3 write in flight
        self._hits: dict[bytes, int] = {}  # write_through_selective: matches per key
        self.l3_counters: dict[str, int] = {}
        self.match_pages = {"asked": 0, "l2": 0, "l3": 0}
        self.metrics_endpoint = ""  # set by the server when it serves metrics
        self.events = EventLog(config.events.queue_events, enabled=bool(config.events.endpoint))
        self.events.add(Cleared())  # a new daemon's L2 starts empty; L3 is announced by its scan
        self.l3_medium = config.storage.backend.upper()
        # With events and an L3 tier: each L2 page's parent and token ids, for the
        # BlockStored of its L3 write whenever it happens (the index keeps keys only).
        self._origins: dict[bytes, Origin] = {}
        # L3 BlockStored events that wait for their parent's: a chain's go out parent first
        self._order: ChainOrder[HeldEvent] = ChainOrder(
            config.events.queue_events, self._publish_l3
        )
        # L2 pages that L3 holds too, as far as this daemon wrote or read them: what
        # a rewrite needs when L3 lets one go while it stays in L2.
        self._both: dict[bytes, InBoth] = {}
        self._l3_taken = 0  # bytes L3 has acknowledged since the start
        self.committed_pages = 0  # pages clients committed into L2 (prefetches aside)
        self.l3_undersized = False  # L3 lets go of pages sooner than L2 does
        # L2 pages L3 let go of that are not written again in this stay in L2
        self._let_go: set[bytes] = set()
        self.l3_drops = 0  # calls that told of pages L3 let go of (lookups compare)
        # key-addressed pages in L2, with events on: the daemon's key -> the engine's
        # (event) key, for the events of pages that leave L2 or reach L3
        self._ekeys: dict[bytes, bytes] = {}
        # the same for key-addressed pages that left L2 but are in L3 (or on their
        # way): the BlockRemoved of the store letting one go names it; as many as
        # the L3 record remembers
        self._l3_ekeys: dict[bytes, bytes] = {}
        # what answers each request of a session (hello and goodbye come before one)
        self._handlers: dict[type, Callable[[Session, Any], p.AnyReply | L3Lookup]] = {
            p.RegisterNamespace: self.register,
            p.Reserve: self.reserve,
            p.Commit: self.commit,
            p.Match: self.match,
            p.Prefetch: self.prefetch,
            p.ExistsKeys: self.exists_keys,
            p.MatchKeys: self.match_keys,
            p.ReserveKeys: self.reserve_keys,
            p.PrefetchKeys: self.prefetch_keys,
            p.Progress: self.progress,
            p.Release: self._release_request,
            p.Renew: self.renew,
            p.Stats: lambda _, msg: p.StatsOk(id=msg.id, stats=self.stats()),
        }

    @property
    def evicted_pages(self) -> int:
        return self.l2.evicted_pages

    @property
    def reclaimed_slabs(self) -> int:
        return self.l2.reclaimed_slabs

    # -- dispatch --------------------------------------------------------------

    def handle(
        self, routing_id: bytes, request: p.AnyRequest, peer: str | None = None
    ) -> p.AnyReply | L3Lookup:
        """Apply one request; never raises for a request's own faults. A match
        or exists may return an ``L3Lookup`` to finish once L3 was asked.

        ``peer``: who sent it, as the connection's credentials say (daemon/server.py):
        its tenant's name, "!..." for a peer no tenant lists, or None when
        tenants are off. A session stays with the peer that opened it.
        """
        op = OP_NAMES[type(request)]
        self.requests[op] = self.requests.get(op, 0) + 1
        try:
            if isinstance(request, p.Hello):
                return self.hello(routing_id, request, peer)
            if isinstance(request, p.Goodbye):
                self.goodbye(routing_id, peer)
                return p.Ok(id=request.id)
            if isinstance(request, p.Stats) and routing_id not in self.sessions:
                # a probe takes no client slot: `hicached status` answers even
                # while every slot is held by clients with leases (crashed ones too)
                return p.StatsOk(id=request.id, stats=self.stats())
            session = self.session(routing_id, peer)
            handler = self._handlers.get(type(request))
            if handler is not None:
                return handler(session, request)
            raise BadRequest(f"unhandled request {op}")  # pragma: no cover
        except HicachedError as exc:
            self.count_error(exc.code)
            return p.Error.of(request.id, exc)

    def count_drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def count_error(self, code: str) -> None:
        """An error reply the server made itself (a malformed request, a fault)."""
        self.errors[code] = self.errors.get(code, 0) + 1

    def undelivered(self, routing_id: bytes, reply: p.AnyReply | L3Lookup) -> None:
        """A reply could not be sent (the client reads no replies): a lease it
        granted ends now, as the client never learned of it."""
        lease_id = getattr(reply, "lease", 0)
        session = self.sessions.get(routing_id)
        lease = self.leases.get(lease_id) if lease_id and session is not None else None
        if lease is not None and lease.session is session:
            self.leases.pop(lease)
            self._end_lease(lease)

    # -- sessions and namespaces ---------------------------------------------

    def hello(self, routing_id: bytes, msg: p.Hello, peer: str | None = None) -> p.HelloOk:
        if msg.major != p.PROTOCOL_MAJOR:
            raise VersionMismatch(
                f"client speaks protocol {msg.major}.{msg.minor}, this daemon speaks "
                f"{p.PROTOCOL_MAJOR}.{p.PROTOCOL_MINOR}: install matching hicached versions"
            )
        session = self.sessions.get(routing_id)
        if session is not None:
            _same_peer(session, peer)
        else:
            if len(self.sessions) >= self.config.server.max_clients:
                self._make_room()
            session = Session(
                self._next_session, routing_id, msg.client[:64], msg.pid, self.clock(), peer
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
            huge_pages=self.config.pool.huge_pages,
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

    def session(self, routing_id: bytes, peer: str | None = None) -> Session:
        session = self.sessions.get(routing_id)
        if session is None:
            raise SessionLost("this daemon does not know the client (restarted?): send hello first")
        _same_peer(session, peer)
        session.last_seen = self.clock()
        self.sessions.move_to_end(routing_id)
        return session

    def goodbye(self, routing_id: bytes, peer: str | None = None) -> None:
        session = self.sessions.get(routing_id)
        if session is not None and session.peer == peer:
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

    def _drop_an_unused_namespace(self, book: TenantBook) -> None:
        """Make room for a new namespace: the oldest one no client has registered
        loses its pages (written back first under write_back) and is forgotten.
        With tenants, only one of ``book``'s tenant: never another tenant's pages."""
        tenants = bool(self.config.tenants)
        for ns in list(self.namespaces.values()):  # oldest first
            if ns.sessions or ns.holds or not ns.pages or (tenants and ns.book is not book):
                continue
            victims = ns.index.drop_owner(ns.id, self.pool.pins)
            if victims:
                self.l2.evicted_pages += len(victims)
                self._evicted(victims)
            if ns.id not in self.namespaces:
                return

    def register(self, session: Session, msg: p.RegisterNamespace) -> p.NamespaceOk:
        spec = msg.spec
        validate_spec(spec, self.config.pool.max_page_bytes)
        slab = self.config.pool.slab_mib << 20
        if slab // spec.page_bytes > MAX_SLOTS_PER_SLAB:
            # a slab's free slots are listed when it is carved: bound that list
            raise InvalidNamespace(
                f"page_bytes {spec.page_bytes} is too small for slabs of "
                f"{self.config.pool.slab_mib} MiB: at least {-(-slab // MAX_SLOTS_PER_SLAB)} "
                f"(at most {MAX_SLOTS_PER_SLAB} pages a slab)"
            )
        spec = _own_spec(session, spec)
        digest = namespace_digest(spec)
        ns = self._ns_by_digest.get(digest)
        if ns is None:
            book = self.l2.book(spec.tenant if session.peer is not None else DEFAULT_TENANT)
            if len(self.namespaces) >= self.config.pool.max_namespaces:
                self._drop_an_unused_namespace(book)
            if len(self.namespaces) >= self.config.pool.max_namespaces:
                raise ResourceExhausted(
                    f"{len(self.namespaces)} namespaces are in use, the limit (pool.max_namespaces)"
                )
            index = self.l2.index(spec.page_bytes, book.name, spec.keyed)
            ns = NamespaceState(next(self._ns_ids), spec, digest, index, book)
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
        self._pages(ns, tokens)
        return self.key_cache.keys(ns.digest, tokens, ns.spec.page_tokens)

    def _pages(self, ns: NamespaceState, tokens: bytes) -> int:
        """The full pages of ``tokens`` in a token namespace, after checking them."""
        if ns.spec.keyed:
            raise BadRequest(
                f"namespace {ns.id} names its pages by key (key_scheme "
                f"{ns.spec.key_scheme!r}): use the *_keys operations, not token ids"
            )
        if len(tokens) % TOKEN_BYTES:
            raise BadRequest("tokens must be packed little-endian uint32 values")
        limit = self.config.server.max_pages_per_request
        pages = len(tokens) // (ns.spec.page_tokens * TOKEN_BYTES)
        if pages > limit:
            raise TooLarge(
                f"the sequence covers more than {limit} pages (server.max_pages_per_request)"
            )
        return pages

    def _ikeys(self, ns: NamespaceState, keys: list[bytes]) -> list[bytes]:
        """The daemon's keys for a key-addressed namespace's own ``keys``."""
        if not ns.spec.keyed:
            raise BadRequest(
                f"namespace {ns.id} names its pages by token ids (key_scheme 'tokens'): "
                "register one with the engine's key_scheme to address pages by key"
            )
        limit = self.config.server.max_pages_per_request
        if len(keys) > limit:
            raise TooLarge(f"{len(keys)} keys, more than {limit} (server.max_pages_per_request)")
        if not keys:
            return []
        sizes = list(map(len, keys))
        shortest, longest = min(sizes), max(sizes)
        if shortest < 1 or longest > MAX_KEY_BYTES:
            bad = shortest if shortest < 1 else longest
            raise BadRequest(f"keys must be 1-{MAX_KEY_BYTES} bytes, got one of {bad}")
        # the joined keys name the list (lengths included): a scheduler asks again and again
        return self.key_cache.engine_keys(ns.digest, keys, bytes(sizes))

    def _remember_ekeys(self, ns: NamespaceState, pages: list[KeyedPage]) -> None:
        if self.events.enabled:
            ekeys, l3_ekeys = self._ekeys, self._l3_ekeys
            for page in pages:
                ekeys[page.key] = page.ekey
                if l3_ekeys:
                    l3_ekeys.pop(page.key, None)  # back in L2: named from there

    def _event_keys(
        self, ns: NamespaceState, keys: list[bytes], *, forget: bool = False
    ) -> list[bytes]:
        """What events call ``keys``: themselves in a token namespace, the engine's
        keys in a key-addressed one (those not remembered are left out)."""
        if not ns.spec.keyed or not self.events.enabled:
            return keys
        ekeys = self._ekeys
        get = ekeys.pop if forget else ekeys.get
        found = (get(key, None) for key in keys)
        return [ekey for ekey in found if ekey is not None]

    # -- leases ------------------------------------------------------------------

    def _new_lease(self, session: Session, ns: NamespaceState, pinned: list[int]) -> Lease:
        if len(self.leases) >= self.config.leases.max_leases:
            raise ResourceExhausted(
                f"{len(self.leases)} leases are open, the limit (leases.max_leases): "
                "release or commit leases sooner"
            )
        deadline = self.clock() + self.config.leases.ttl_s
        lease = Lease(self.leases.next_id(), session, ns, deadline, pinned)
        lease.pins = pinned if ns.spec.keyed else pinned[-1:]
        self.pool.pin(lease.pins)
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
        quarantine instead of the free list, as a key-addressed reservation's
        always do (``_free_after``: one rule for every end). A prefetch reader may still be
        writing into fresh slots: then they are left to it, and
        ``prefetch_finished`` frees them.
        """
        pool = self.pool
        if lease.pins:
            lease.ns.index.unpinned(pool.unpin(lease.pins))
        lease.pins = lease.pinned = []
        ns = lease.ns
        ns.holds -= 1
        pf = lease.prefetch
        if pf is not None:
            pf.ended = True
            if pf.running:
                ns.holds += 1  # the reader still holds it; released when it finishes
                return
        if lease.client_writes and (stale or lease.chain is not None):
            self.l2.quarantine(lease.fresh, self._free_after(lease))
        else:
            for slot in lease.fresh:
                self.l2.free(slot, ns.spec.page_bytes)
        lease.fresh = []
        self._maybe_forget(ns)

    def _free_after(self, lease: Lease) -> float:
        """When a client's copies into ``lease``'s fresh slots are over for sure.

        The one rule for every way a write lease ends without a commit of all
        its slots (release, a commit mask, goodbye, a session dropped, expiry):
        the copier checks the lease's deadline before each copy, so the slots
        sit out ``leases.quarantine_s`` past that deadline, or past now if it
        is over. Worker processes copy through an adopted key-addressed
        reservation until that deadline whatever its owner does, so the end of
        the owner's session does not move it.
        """
        return max(self.clock(), lease.deadline) + self.config.leases.quarantine_s

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
        fresh = self.l2.alloc(ns.book, ns.spec.page_bytes, want)
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
        write_back = self.tier is not None and self.policy.writes_back
        hits, origins = self._hits, self._origins
        owners: dict[NamespaceState, list[bytes]] = {}
        # parents first: eviction takes a sequence from its tail, L3 gets it from its head
        for key, slot, owner in reversed(victims):
            hits.pop(key, None)
            ns = self.namespaces[owner]
            ns.pages -= 1
            ns.book.evicted += 1
            owners.setdefault(ns, []).append(key)
            origin = origins.pop(key, None) if origins else None
            self._both.pop(key, None)
            self._let_go.discard(key)
            written = False
            if write_back and key not in self.l3 and key not in self.writing:
                # the page leaving L2 first: the queue's room is its before its ancestors'
                written = self._write(ns, key, slot, origin, evicted=True)
                if written and origin is not None:
                    self._write_ancestors(ns, origin)
            if key not in self.writing:
                self._order.orphan(key)  # no L3 event of it is on its way
            if written:
                continue
            self.l2.free(slot, ns.spec.page_bytes)
        for ns, keys in owners.items():
            if ns.spec.keyed and self.events.enabled:
                named = self._keyed_left_l2(keys)
            else:
                named = self._event_keys(ns, keys, forget=True)
            self.events.removed(named, MEDIUM_L2, ns.spec.model)
            self._maybe_forget(ns)

    def _keyed_left_l2(self, keys: list[bytes]) -> list[bytes]:
        """The engine's keys of key-addressed pages that left L2; those of pages
        in L3, or on their way there, are kept for the BlockRemoved of the store
        letting them go."""
        ekeys, l3_ekeys, l3, writing = self._ekeys, self._l3_ekeys, self.l3, self.writing
        named = []
        for key in keys:
            ekey = ekeys.pop(key, None)
            if ekey is not None:
                named.append(ekey)
                if key in l3 or key in writing:
                    l3_ekeys[key] = ekey
        return named

    def _write_ancestors(self, ns: NamespaceState, origin: Origin) -> None:
        """write_back: the pages before a page on its way to L3 that L2 still
        holds and L3 lacks go too (as the write queue has room), so L3 holds its
        prefix; its event waits for theirs (``_stored_l3``). Nearest first, and
        no further than the first the queue refuses: each step costs one lookup,
        so a full queue costs one refused write an eviction, not a walk."""
        up, origins, l3, writing = origin.up, self._origins, self.l3, self.writing
        for _ in range(self.config.server.max_pages_per_request):
            if up is None or up in l3 or up in writing:
                return
            above = origins.get(up)  # an origin is kept while its page is in L2
            if above is None or not self._write(ns, up, above.slot):
                return
            up = above.up

    def commit(self, session: Session, msg: p.Commit) -> p.CommitOk:
        lease = self.leases.get(msg.lease)
        if lease is not None and lease.session is session and not lease.writing:
            raise BadRequest(f"lease {msg.lease} is a read lease; release it instead")
        lease = self._take_lease(session, msg.lease)
        fresh = lease.fresh
        pf = lease.prefetch
        ready = len(fresh) if pf is None else pf.completed
        if lease.chain is not None:
            return self._commit_keyed(lease, msg, ready)
        if msg.mask:
            self._end_lease(lease)
            raise BadRequest("a commit mask is for key-addressed reservations only; lease ended")
        count = ready if msg.pages < 0 else msg.pages
        if count > ready:
            self._end_lease(lease)
            what = "reserved" if pf is None else "has read"
            raise BadRequest(f"commit of {count} pages, but the lease {what} {ready}; lease ended")
        ns = lease.ns
        n = len(lease.pinned) + count
        keys = lease.keys[:n]
        slots = lease.pinned + fresh[:count]
        published, unused = ns.tree.insert(keys, slots, ns.id)
        ns.pages += published
        lease.fresh = fresh[count:]
        for slot in unused:
            self.l2.free(slot, ns.spec.page_bytes)
        self._end_lease(lease)
        new = n - published
        page_tokens = ns.spec.page_tokens
        if published:
            parent = keys[new - 1] if new else None
            tokens = _token_ids(lease.tokens, new * page_tokens, n * page_tokens)
            self.events.stored(keys[new:], parent, tokens, page_tokens, MEDIUM_L2, ns.spec.model)
        if pf is None:
            self.committed_pages += published
        if published and self.tier is not None:
            if self.events.enabled:
                self._remember_origins(keys, slots, new, lease.tokens, page_tokens)
            # A prefetch's pages were recorded as held by L3 as they were read; one
            # that L3 dropped since (a recycled segment) must not be recorded again.
            if pf is not None:
                self._in_both(ns, keys[new:], slots[new:])
            else:
                self.policy.committed(self, ns, keys[new:], slots[new:])
        return p.CommitOk(id=msg.id, published=published, duplicates=count - published)

    def match(self, session: Session, msg: p.Match) -> p.MatchOk | L3Lookup:
        ns, tokens = self._namespace(session, msg.ns), msg.tokens
        pages = self._pages(ns, tokens)
        seed, page_tokens = ns.digest, ns.spec.page_tokens
        tag, keys = self.key_cache.cached(seed, tokens)
        if keys is None:
            first = page_keys(seed, tokens, page_tokens, max_pages=1)
            if (
                first
                and not ns.tree.starts(first[0])
                and first[0] not in self.l3
                and self.l3.complete
            ):
                # the first page is in neither tier, so none is: a miss, without
                # hashing the rest (a store of it hashes them, as it would anyway);
                # while L3's record is incomplete, L3 is asked about them all
                return self._match(session, ns, [], msg.lease, msg.id, asked=pages)
            keys = self.key_cache.compute(tag, seed, tokens, page_tokens)
        return self._match(session, ns, keys, msg.lease, msg.id)

    def _match(
        self,
        session: Session,
        ns: NamespaceState,
        keys: list[bytes],
        lease: bool,
        request_id: int,
        asked: int | None = None,
    ) -> p.MatchOk | L3Lookup:
        """The leading ``keys`` in L2 (pinned under a read lease if asked), and how
        many more L3 holds; for ``match`` and ``match_keys`` alike (``asked``:
        the pages asked for, when ``keys`` stops short of them). Where the L3
        part stops at a key an incomplete record does not know, an L3Lookup
        for the rest."""
        slots = ns.index.match(keys) if keys else []
        hits = len(slots)
        lease_id = self._new_lease(session, ns, slots).id if lease and slots else 0
        l3_hits = self.l3.leading(keys, hits) if self.l3 else 0
        asked = len(keys) if asked is None else asked
        counted = self.match_pages
        counted["asked"] += asked
        counted["l2"] += hits
        ns.book.asked += asked
        ns.book.hits += hits
        if hits and self.tier is not None:
            self.policy.matched(self, ns, keys[:hits], slots)
        known = hits + l3_hits
        if known < len(keys) and not self.l3.complete:
            unknown = keys[known:]

            def finish(found: int) -> p.MatchOk:
                more = max(found, self.l3.leading(unknown, 0))  # the scan may have found them
                counted["l3"] += l3_hits + more
                return p.MatchOk(
                    id=request_id, hits=hits, offsets=slots, lease=lease_id, l3_hits=l3_hits + more
                )

            return L3Lookup(ns.digest, unknown, finish, request_id, lease_id)
        counted["l3"] += l3_hits
        return p.MatchOk(id=request_id, hits=hits, offsets=slots, lease=lease_id, l3_hits=l3_hits)

    # -- key-addressed operations ----------------------------------------------------

    def exists_keys(self, session: Session, msg: p.ExistsKeys) -> p.ExistsKeysOk | L3Lookup:
        ns = self._namespace(session, msg.ns)
        keys = self._ikeys(ns, msg.keys)
        in_l2 = ns.table.present(keys)  # a byte per key: 1 in L2, | 2 in L3
        where = in_l2
        if self.l3:
            in_l3 = np.array(self.l3.which(keys), dtype=np.uint8) << 1
            where = (np.frombuffer(in_l2, dtype=np.uint8) | in_l3).tobytes()
        leading = _leading(where)
        if leading < len(keys) and not self.l3.complete:
            return self._exists_lookup(msg.id, ns, keys, in_l2, leading)
        return p.ExistsKeysOk(id=msg.id, l2=_leading(in_l2), leading=leading, where=where)

    def _exists_lookup(
        self, request_id: int, ns: NamespaceState, keys: list[bytes], in_l2: bytes, known: int
    ) -> L3Lookup:
        """``exists_keys`` past its ``known`` leading keys, once L3 was asked:
        the run the backend holds from there is marked as in L3."""
        unknown = keys[known:]

        def finish(found: int) -> p.ExistsKeysOk:
            flags = np.frombuffer(in_l2, dtype=np.uint8).copy()
            if self.l3:  # as known now: the scan may have found more meanwhile
                flags |= np.array(self.l3.which(keys), dtype=np.uint8) << 1
            flags[known : known + found] |= 2
            where = flags.tobytes()
            return p.ExistsKeysOk(
                id=request_id, l2=_leading(in_l2), leading=_leading(where), where=where
            )

        return L3Lookup(ns.digest, unknown, finish, request_id)

    def match_keys(self, session: Session, msg: p.MatchKeys) -> p.MatchOk | L3Lookup:
        ns = self._namespace(session, msg.ns)
        return self._match(session, ns, self._ikeys(ns, msg.keys), msg.lease, msg.id)

    def _chain(
        self, ns: NamespaceState, keys: list[bytes], ekeys: list[bytes], parent: bytes
    ) -> list[KeyedPage]:
        """Each key with its parent (the key before it; ``parent`` for the first),
        as the daemon and as events name them."""
        scheme = ns.spec.key_scheme
        events = [event_key(scheme, k) for k in ekeys]
        up = engine_page_keys(ns.digest, [parent])[0] if parent else b""
        eup = event_key(scheme, parent) if parent else b""
        out = []
        for key, ekey in zip(keys, events, strict=True):
            out.append(KeyedPage(key, up, ekey, eup))
            up, eup = key, ekey
        return out

    def reserve_keys(self, session: Session, msg: p.ReserveKeys) -> p.ReserveKeysOk:
        ns = self._namespace(session, msg.ns)
        keys = self._ikeys(ns, msg.keys)
        if msg.parent and len(msg.parent) > MAX_KEY_BYTES:
            raise BadRequest(f"parent must be at most {MAX_KEY_BYTES} bytes")
        named = set(msg.keys)
        if len(named) != len(msg.keys) or msg.parent in named:
            raise BadRequest(
                "keys of one reservation must differ from each other and from parent: "
                "they follow one another in one sequence"
            )
        found = ns.table.find(keys)
        present = [slot for slot in found if slot >= 0]
        missing = [i for i, slot in enumerate(found) if slot < 0]
        lease = self._new_lease(session, ns, present)  # pinned before alloc can evict them
        fresh = self.l2.alloc(ns.book, ns.spec.page_bytes, len(missing))
        indices = missing[: len(fresh)]
        chain = self._chain(ns, keys, msg.keys, msg.parent)
        lease.fresh = fresh
        lease.chain = [chain[i] for i in indices]
        mask = bytes(slot >= 0 for slot in found)
        pool_full = len(fresh) < len(missing)
        if not fresh:
            self.leases.pop(lease)
            self._end_lease(lease)
            return p.ReserveKeysOk(
                id=msg.id, lease=0, present=mask, indices=[], offsets=[], pool_full=pool_full
            )
        return p.ReserveKeysOk(
            id=msg.id,
            lease=lease.id,
            present=mask,
            indices=indices,
            offsets=fresh,
            pool_full=pool_full,
        )

    def prefetch_keys(self, session: Session, msg: p.PrefetchKeys) -> p.PrefetchOk:
        ns = self._namespace(session, msg.ns)
        keys = self._ikeys(ns, msg.keys)
        present = ns.index.match(keys)
        n = len(present)
        wanted = keys[n:] if msg.max_pages < 0 else keys[n : n + msg.max_pages]
        if self.tier is None or not wanted:
            held = self._l2_only(session, ns, present, keys[:n], [])
            return p.PrefetchOk(id=msg.id, lease=held, l2_hits=n)
        if len(set(msg.keys)) != len(msg.keys):
            raise BadRequest("keys of one prefetch must differ: they follow one another")
        lease = self._new_lease(session, ns, present)
        lease.keys = keys[:n]
        parent = msg.keys[n - 1] if n else b""
        lease.chain = self._chain(ns, wanted, msg.keys[n : n + len(wanted)], parent)
        lease.prefetch = PrefetchState(wanted)
        self._count_l3("prefetches")
        self.tier.prefetch(lease)
        return p.PrefetchOk(id=msg.id, lease=lease.id, l2_hits=n)

    def _commit_keyed(self, lease: Lease, msg: p.Commit, ready: int) -> p.CommitOk:
        """Commit a key-addressed lease: the pages its mask (or ``pages``) names
        enter the index, each under its parent; the other fresh slots are freed."""
        assert lease.chain is not None
        ns, fresh, chain = lease.ns, lease.fresh, lease.chain
        if msg.mask:
            if len(msg.mask) != ready or lease.prefetch is not None or msg.pages != -1:
                self._end_lease(lease)
                raise BadRequest(
                    f"commit mask of {len(msg.mask)} bytes for a lease of {ready} fresh slots "
                    "(a reservation's commit takes one byte per slot and no pages; a "
                    "prefetch's, none); lease ended"
                )
            chosen = [j for j, ok in enumerate(msg.mask) if ok]
        else:
            count = ready if msg.pages < 0 else msg.pages
            if count > ready:
                self._end_lease(lease)
                raise BadRequest(
                    f"commit of {count} pages, but the lease holds {ready}; lease ended"
                )
            chosen = list(range(count))
        stored: list[KeyedPage] = []
        slots: list[int] = []
        taken = set()
        for j in chosen:
            page, slot = chain[j], fresh[j]
            if ns.table.insert(page.key, slot, ns.id, page.parent):
                stored.append(page)
                slots.append(slot)
                taken.add(j)
        lease.fresh = [slot for j, slot in enumerate(fresh) if j not in taken]
        ns.pages += len(stored)
        if lease.prefetch is None:
            # an adopted write handle must not write into a page once it is published
            for slot in slots:
                self.pool.bump(slot)
        self._end_lease(lease)
        if stored:
            self._remember_ekeys(ns, stored)
            self._stored_events(ns, stored, MEDIUM_L2)
        if lease.prefetch is None:
            self.committed_pages += len(stored)
        if stored and self.tier is not None:
            if self.events.enabled:
                for page, slot in zip(stored, slots, strict=True):
                    up = page.parent or None
                    self._origins[page.key] = Origin(up, page.eparent or None, b"", slot)
            keys = [page.key for page in stored]
            if lease.prefetch is not None:
                self._in_both(ns, keys, slots)
            else:
                self.policy.committed(self, ns, keys, slots)
        return p.CommitOk(id=msg.id, published=len(stored), duplicates=len(chosen) - len(stored))

    def _stored_events(self, ns: NamespaceState, pages: list[KeyedPage], medium: str) -> None:
        """BlockStored events for key-addressed pages, one per run that follows on."""
        spec = ns.spec
        run: list[bytes] = []
        parent = b""
        for page in pages:
            if run and page.eparent != run[-1]:
                self.events.stored(run, parent or None, [], spec.page_tokens, medium, spec.model)
                run = []
            if not run:
                parent = page.eparent
            run.append(page.ekey)
        if run:
            self.events.stored(run, parent or None, [], spec.page_tokens, medium, spec.model)

    def _remember_origins(
        self, keys: list[bytes], slots: list[int], start: int, tokens: bytes, page_tokens: int
    ) -> None:
        """Keep what the L3 events (and write-backs) of token pages ``start..`` of
        a sequence stored in ``slots`` will need."""
        step = page_tokens * TOKEN_BYTES
        origins = self._origins
        for i in range(start, len(keys)):
            up = keys[i - 1] if i else None
            origins[keys[i]] = Origin(up, up, tokens[i * step : (i + 1) * step], slots[i])

    def _in_both(self, ns: NamespaceState, keys: list[bytes], slots: list[int]) -> None:
        """Pages now in L2 that L3 holds (read from it, or written before), at an
        age in L3 this daemon does not know."""
        l3, both = self.l3, self._both
        for key, slot in zip(keys, slots, strict=True):
            if key in l3:
                both[key] = InBoth(ns, slot, -1, False)

    def count_hit(self, ns: NamespaceState, keys: list[bytes], slots: list[int]) -> None:
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
        self.write_pages(ns, keys, slots)

    def write_pages(self, ns: NamespaceState, keys: list[bytes], slots: list[int]) -> None:
        """Write the pages L3 lacks, but those it let go of in this stay in L2 that
        are not to be written again (``forget_l3``); those it holds are noted as
        held by both tiers."""
        l3, writing, let_go = self.l3, self.writing, self._let_go
        for key, slot in zip(keys, slots, strict=True):
            if key in l3:
                if key not in self._both:
                    self._both[key] = InBoth(ns, slot, -1, False)
            elif key in let_go:
                self._count_l3("rewrite_skipped")
            elif key not in writing:
                self._write(ns, key, slot)

    def _write(
        self,
        ns: NamespaceState,
        key: bytes,
        slot: int,
        origin: Origin | None = None,
        *,
        evicted: bool = False,
        rewrite: bool = False,
    ) -> bool:
        """Send one page to L3; its slot is held until the write ends.

        ``evicted``: the page already left the index (and ``origin`` with it);
        its slot is held on its way back to the free list (counted by the
        allocator) until the write ends, instead of pinned. ``rewrite``: L3 let
        go of the page while it stayed in L2. The write's BlockStored names the
        page as events do (the engine's key in a key-addressed namespace: none
        there when it is not known), with the parent and token ids its origin
        keeps, after its parent's own (``_stored_l3``).
        """
        assert self.tier is not None
        if origin is None:
            origin = self._origins.get(key)
        spec = ns.spec
        named = self._ekeys.get(key) if spec.keyed else key
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
                self._l3_taken += spec.page_bytes
                if not evicted:
                    self._both[key] = InBoth(ns, slot, self._l3_taken, rewrite)
                if named is not None:
                    self._stored_l3(key, named, origin, spec)
            else:
                self._order.orphan(key)  # those waiting for it go out as they are
                if evicted:
                    self._l3_ekeys.pop(key, None)
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
        self._order.orphan(key)
        return False

    def _stored_l3(
        self, key: bytes, named: bytes, origin: Origin | None, spec: NamespaceSpec
    ) -> None:
        """The L3 BlockStored of page ``key``: now, or once its parent's went out
        when the parent's write is in flight (write_back sends a page's
        ancestors ahead of it, ``_write_ancestors``), so a chain's events go out
        parent first. At most ``events.queue_events`` wait; past that the
        longest waiting go out as they are."""
        if not self.events.enabled:
            return
        tokens = _token_ids(origin.tokens, 0, spec.page_tokens) if origin else []
        event = HeldEvent(
            named, origin.eparent if origin else None, tokens, spec.page_tokens, spec.model
        )
        up = origin.up if origin is not None else None
        coming = up is not None and (up in self.writing or self._order.holds(up))
        self._order.add(key, up, event, coming=coming)

    def _publish_l3(self, event: HeldEvent) -> None:
        self.events.stored(
            [event.key], event.parent, event.tokens, event.page_tokens, self.l3_medium, event.model
        )

    def _count_l3(self, what: str, n: int = 1) -> None:
        self.l3_counters[what] = self.l3_counters.get(what, 0) + n

    def forget_l3(self, keys: Iterable[bytes], ns_digest: bytes = b"") -> None:
        """The backend no longer holds these pages (of namespace ``ns_digest``,
        where known).

        Under the write-through policies a page L3 let go of while it stays in
        L2 is written again, so L3 does not keep a sequence whose head it lost
        while that head sits in L2; write_back writes it when it leaves L2. A
        rewrite is bounded: at most once per stay in L2, and none while L3
        proves smaller than L2 (it let go of a page after taking fewer bytes
        than L2 holds): rewriting then would only push out other pages L2
        holds, which would be rewritten in turn, for ever. L3 then keeps the
        pages written last, and ``l3_undersized`` says so until L3 lets go of
        pages L2 no longer holds.
        """
        self.l3_drops += 1
        keys = list(keys)
        order = self._order
        if order:
            writing = self.writing
            for key in keys:  # known or not: an event still held must not follow the drop
                order.drop(key, coming=key in writing)
        gone = [key for key in keys if key in self.l3]
        for key in gone:
            self.l3.discard(key)
        ns_of = self._ns_by_digest.get(ns_digest)
        named = self._event_keys(ns_of, gone) if ns_of is not None else gone
        if self._l3_ekeys:
            l3_ekeys = self._l3_ekeys
            left = [ekey for key in gone if (ekey := l3_ekeys.pop(key, None)) is not None]
            named = [*named, *left]
        self.events.removed(named, self.l3_medium, self._model_of(ns_digest))
        if not gone or self.tier is None:
            return
        both = self._both
        found = [(key, both.pop(key)) for key in gone if key in both]
        if not self.policy.rewrites:
            return  # written when it leaves L2, if at all
        l2_bytes = self.pool.used_bytes
        taken = self._l3_taken
        short = any(page.at >= 0 and taken - page.at <= l2_bytes for _, page in found)
        self.l3_undersized = short
        rewritten = skipped = 0
        for key, page in found:
            if short or page.rewritten:
                self._let_go.add(key)  # not written again in this stay, by any path
                skipped += 1
            elif key not in self.writing:
                rewritten += self._write(page.ns, key, page.slot, rewrite=True)
        self._count_l3("rewritten", rewritten)
        self._count_l3("rewrite_skipped", skipped)

    def _l3_keys_forgotten(self, keys: set[bytes]) -> None:
        """The L3 record dropped ``keys`` to stay within its bound: so do the
        engine's keys kept for them."""
        if self._l3_ekeys:
            pop = self._l3_ekeys.pop
            for key in keys:
                pop(key, None)

    def _model_of(self, ns_digest: bytes) -> str:
        ns = self._ns_by_digest.get(ns_digest)
        return ns.spec.model if ns is not None else ""

    def learn_l3(self, ns_digest: bytes, keys: list[bytes]) -> int:
        """A lookup found ``keys`` in L3: known from now on, and announced as the
        scan announces what it finds (it announces no key known before it);
        returns how many were not known."""
        l3 = self.l3
        new = [key for key in keys if key not in l3]
        if new:
            l3.update(new)
            self.announce_l3(ns_digest, new)
        return len(new)

    def announce_l3(self, ns_digest: bytes, keys: list[bytes]) -> None:
        """The startup scan found ``keys`` in L3: one BlockStored for them, with no
        parent or token ids (the store keeps neither), and the namespace's
        page_tokens and model where it is registered, else 0 and ""."""
        ns = self._ns_by_digest.get(ns_digest)
        if ns is not None and ns.spec.keyed:
            return  # the store keeps the daemon's keys only, which the engine's events never name
        size, model = (ns.spec.page_tokens, ns.spec.model) if ns is not None else (0, "")
        self.events.stored(keys, None, [], size, self.l3_medium, model)

    def unwritten_pages(self) -> list[tuple[NamespaceState, bytes, int, int]]:
        """Every L2 page that L3 lacks and no write is carrying: (namespace, key,
        slot, the slot's generation now)."""
        out = []
        l3, writing, namespaces = self.l3, self.writing, self.namespaces
        gens = self.pool.gens
        for index in self.l2.indexes():
            for key, slot, owner in index.items():
                if key not in l3 and key not in writing:
                    out.append((namespaces[owner], key, slot, int(gens[slot // GEN_GRANULE])))
        return out

    def write_back(self, pages: list[tuple[NamespaceState, bytes, int, int]]) -> int:
        """Queue writes of ``pages`` (from ``unwritten_pages``) that are still in L2
        and still unwritten; returns how many were queued."""
        queued = 0
        gens = self.pool.gens
        for ns, key, slot, gen in pages:
            if key in self.l3 or key in self.writing:
                continue
            if int(gens[slot // GEN_GRANULE]) != gen and not ns.index.holds(key, slot):
                continue  # freed since (or a neighbour in its granule was), perhaps reused
            queued += self._write(ns, key, slot)
        return queued

    def prefetch(self, session: Session, msg: p.Prefetch) -> p.PrefetchOk:
        ns = self._namespace(session, msg.ns)
        keys = self._keys(ns, msg.tokens)
        present = ns.index.match(keys)
        wanted = keys[len(present) :]
        if msg.max_pages >= 0:
            wanted = wanted[: msg.max_pages]
        if self.tier is None or not wanted:
            held = self._l2_only(session, ns, present, keys[: len(present)], None, msg.tokens)
            return p.PrefetchOk(id=msg.id, lease=held, l2_hits=len(present))
        lease = self._new_lease(session, ns, present)
        lease.keys = keys[: len(present)]
        lease.prefetch = PrefetchState(wanted)
        lease.tokens = msg.tokens
        self._count_l3("prefetches")
        self.tier.prefetch(lease)
        return p.PrefetchOk(id=msg.id, lease=lease.id, l2_hits=len(present))

    def _l2_only(
        self,
        session: Session,
        ns: NamespaceState,
        present: list[int],
        keys: list[bytes],
        chain: list[KeyedPage] | None,
        tokens: bytes = b"",
    ) -> int:
        """A prefetch with nothing to read (all in L2, or no L3): its L2 hit is
        still held until the commit, as for any prefetch, so ranks that agree on
        it find it there. The lease (0 for no hit) reports done at once."""
        if not present:
            return 0
        lease = self._new_lease(session, ns, present)
        lease.keys = keys
        lease.chain = chain
        lease.tokens = tokens
        lease.prefetch = PrefetchState([], planned=0, done=True, running=False)
        return lease.id

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
        fresh = self.l2.alloc(ns.book, ns.spec.page_bytes, want)
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
            key = pf.keys[pf.completed]
            if key not in self.l3:  # L3 holds a page we did not know of: announce it
                self.l3.add(key)
                self._announce_read(lease, pf.completed)
            pf.completed += 1
            self._count_l3("pages_prefetched")
        return not pf.ended

    def _announce_read(self, lease: Lease, j: int) -> None:
        """An L3 BlockStored for page ``j`` of a prefetch, found in L3 by reading it."""
        pf, spec = lease.prefetch, lease.ns.spec
        assert pf is not None
        if lease.chain is not None:
            page = lease.chain[j]
            self.events.stored(
                [page.ekey], page.eparent or None, [], spec.page_tokens, self.l3_medium, spec.model
            )
            return
        i = len(lease.keys) - pf.planned + j  # its place in the sequence
        parent = lease.keys[i - 1] if i else None
        tokens = _token_ids(lease.tokens, i * spec.page_tokens, (i + 1) * spec.page_tokens)
        self.events.stored(
            [pf.keys[j]], parent, tokens, spec.page_tokens, self.l3_medium, spec.model
        )

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
                self.l2.free(slot, ns.spec.page_bytes)
            lease.fresh = []
            ns.holds -= 1
            self._maybe_forget(ns)

    def release(self, session: Session, lease_id: int) -> None:
        self._end_lease(self._take_lease(session, lease_id))

    def _release_request(self, session: Session, msg: p.Release) -> p.Ok:
        self.release(session, msg.lease)
        return p.Ok(id=msg.id)

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

    # -- tenants and reloads ---------------------------------------------------------

    def _set_quotas(self, config: Config) -> None:
        """Each configured tenant's quota, in its book (created if new)."""
        mib = 1 << 20
        for name, tenant in config.tenants.items():
            book = self.l2.book(name)
            book.max_slots, book.max_bytes = tenant.max_pages, tenant.max_mib * mib

    def reconfigure(self, config: Config) -> dict[str, int]:
        """Run with ``config`` from now on (a reload: only keys that may change at
        run time differ, config.reload_plan). A tenant whose quota went down
        gives up its least recently used unleased pages at once; returns the
        pages each such tenant gave up."""
        self.config = config
        self.policy = write_policy(config.storage.write_policy)
        self._set_quotas(config)
        evicted = {}
        for name in config.tenants:
            book = self.l2.book(name)
            if book.max_slots or book.max_bytes:
                n = self.l2.enforce(book)
                if n:
                    evicted[name] = n
        return evicted

    def tenant_figures(self) -> list[TenantFigures]:
        """Per-tenant figures for metrics, in name order."""
        return [
            TenantFigures(
                tenant=book.name,
                pages=book.pages,
                slots=book.slots,
                bytes=book.bytes,
                max_slots=book.max_slots,
                max_bytes=book.max_bytes,
                asked=book.asked,
                hits=book.hits,
                evicted=book.evicted,
                quota_evicted=book.quota_evicted,
            )
            for book in sorted(self.l2.books.values(), key=lambda b: b.name)
        ]

    def stats(self) -> p.DaemonStats:
        pool = self.pool
        used = pool.used_bytes
        reserved = sum(len(lease.fresh) for lease in self.leases)
        # pages held against eviction: those pinned (key-addressed leases' pages,
        # token leases' last pages, writes to L3 in flight), and the pages of
        # token leases' paths before their last
        tails: dict[PageIndex, list[int]] = {}  # by index: the last pinned page of each
        for lease in self.leases:
            if len(lease.pinned) > len(lease.pins):
                tails.setdefault(lease.ns.tree, []).append(lease.pins[-1])
        held = len(pool.pins) + sum(ix.held_beyond(t, pool.pins) for ix, t in tails.items())
        written = self.l3_counters.get("written", 0)
        return p.DaemonStats(
            instance=self.instance,
            uptime_s=round(self.clock() - self.started, 3),
            pool_bytes=pool.arena_bytes,
            pool_used_bytes=used,
            pool_free_bytes=pool.arena_bytes - used,
            slab_bytes=pool.slab_bytes,
            pages=self.l2.pages,
            pinned_pages=held,
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
            committed_pages=self.committed_pages,
            l3_undersized=self.l3_undersized,
            l3_write_amplification=round(written / self.committed_pages, 3)
            if self.committed_pages
            else 0.0,
            l3={
                **self.l3_counters,
                **({"events_out_of_order": order} if (order := self._order.out_of_order) else {}),
                **(getattr(self.tier, "counters", None) or {}),
            },
            match_pages=dict(self.match_pages),
            events_pending=len(self.events.pending),
            metrics_endpoint=self.metrics_endpoint,
        )


def _leading(flags: bytes) -> int:
    """How many leading bytes of ``flags`` are set (not 0)."""
    first = flags.find(0)
    return len(flags) if first < 0 else first


def _same_peer(session: Session, peer: str | None) -> None:
    """A session's requests come from the peer that opened it; a connection of
    another tenant that reuses its routing id is refused, not served as it."""
    if session.peer != peer:
        raise ForeignTenant(
            "this client id belongs to a session of another peer: connect again "
            "without setting a routing id"
        )


def _own_spec(session: Session, spec: NamespaceSpec) -> NamespaceSpec:
    """The namespace as registered by this session's peer: with tenants on, its
    tenant is the connection's; one left at the default is filled from it, and
    another tenant's is refused."""
    peer = session.peer
    if peer is None or spec.tenant == peer:
        return spec  # tenants off: the tenant named is a salt like any other field
    if peer.startswith("!"):
        raise ForeignTenant(
            f"this connection ({peer[1:]}) belongs to no tenant, so it may register no "
            "namespace: list its uid, gid or CURVE key under [tenants] in the daemon's "
            "config, or mark one tenant others = true"
        )
    if spec.tenant == DEFAULT_TENANT:
        return msgspec.structs.replace(spec, tenant=peer)
    raise ForeignTenant(
        f"namespace of tenant {spec.tenant!r} refused: this connection belongs to tenant "
        f"{peer!r} (its credentials say so); leave tenant unset or set it to {peer!r}"
    )


def _token_ids(tokens: bytes, start: int, end: int) -> list[int]:
    """Token ids ``start:end`` of a packed (uint32 LE) sequence."""
    return np.frombuffer(tokens, dtype="<u4")[start:end].tolist()
