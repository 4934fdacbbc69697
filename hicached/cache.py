"""The daemon's state machine: sessions, namespaces, leases, pool and index.

Synchronous and free of I/O: the server decodes a request, calls ``handle``
and sends back whatever it returns. Expected outcomes (a miss, a full pool)
are part of the reply; misuse raises a HicachedError that becomes an error
reply; a broken invariant is an assertion.

Leases: a *write* lease belongs to a reservation (its fresh slots, plus a pin
on the pages that were already present so they cannot be evicted before the
commit); a *read* lease pins the pages a match returned. Leases expire after
``leases.ttl_s`` so a client that dies cannot hold memory forever.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

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
from hicached.hashing import TOKEN_BYTES, KeyCache
from hicached.index import PageIndex
from hicached.namespace import NamespaceSpec, namespace_digest, validate_spec
from hicached.pool import SlotPool

_OP_NAMES = {cls: str(cls.__struct_config__.tag) for cls in get_args(p.AnyRequest)}


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
class Lease:
    id: int
    session: Session
    ns: Namespace
    deadline: float
    pinned: list[int]  # slots of indexed pages held against eviction
    keys: list[bytes] = field(default_factory=list)  # write leases: every page's key
    fresh: list[int] = field(default_factory=list)  # write leases: slots to fill

    @property
    def writing(self) -> bool:
        return bool(self.keys)


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
        self.expired_leases = 0
        self.key_cache = KeyCache(config.server.key_cache_pages)

    # -- dispatch --------------------------------------------------------------

    def handle(self, routing_id: bytes, request: p.AnyRequest) -> p.AnyReply:
        """Apply one request; never raises for a request's own faults."""
        op = _OP_NAMES[type(request)]
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
                index = self.indexes[spec.page_bytes] = PageIndex()
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
        """Drop a lease's pins and free its unused fresh slots."""
        pool = self.pool
        if lease.pinned:
            lease.ns.index.unpinned(pool.unpin(lease.pinned))
        for slot in lease.fresh:
            pool.free(slot)
        lease.pinned = []
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
        """Up to ``count`` free slots of the namespace's page size, evicting LRU pages."""
        page_bytes = ns.spec.page_bytes
        pool = self.pool
        out: list[int] = []
        while len(out) < count:
            slot = pool.alloc(page_bytes)
            if slot is None:
                victims = ns.index.evict(count - len(out), pool.pins)
                if not victims:
                    break
                self.evicted_pages += len(victims)
                for victim in victims:
                    pool.free(victim)
                continue
            out.append(slot)
        return out

    def commit(self, session: Session, msg: p.Commit) -> p.CommitOk:
        lease = self.leases.get(msg.lease)
        if lease is not None and lease.session is session and not lease.writing:
            raise BadRequest(f"lease {msg.lease} is a read lease; release it instead")
        lease = self._take_lease(session, msg.lease)
        fresh = lease.fresh
        count = len(fresh) if msg.pages < 0 else msg.pages
        if count > len(fresh):
            self._end_lease(lease)
            raise BadRequest(
                f"commit of {count} pages, but the lease reserved {len(fresh)}; lease aborted"
            )
        present = len(lease.keys) - len(fresh)
        published, unused = lease.ns.index.insert(
            lease.keys[: present + count], lease.pinned + fresh[:count]
        )
        lease.fresh = fresh[count:] + unused
        self._end_lease(lease)
        return p.CommitOk(id=msg.id, published=published, duplicates=count - published)

    def match(self, session: Session, msg: p.Match) -> p.MatchOk:
        ns = self._namespace(session, msg.ns)
        slots = ns.index.match(self._keys(ns, msg.tokens))
        lease_id = 0
        if msg.lease and slots:
            lease_id = self._new_lease(session, ns, slots).id
        return p.MatchOk(id=msg.id, hits=len(slots), offsets=slots, lease=lease_id)

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
            expired_leases=self.expired_leases,
        )
