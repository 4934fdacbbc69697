"""The front desk: every request the daemon answers, and the figures it keeps.

Synchronous and free of I/O: the server decodes a request, calls ``handle``
and sends back whatever it returns. Expected outcomes (a miss, a full pool)
are part of the reply; misuse raises a HicachedError that becomes an error
reply; a broken invariant is an assertion.

``Cache`` composes the rooms that do the work, each owning its state and
declaring the requests it answers (``handlers()``); the dispatch table is
their union, built once, and a request type two rooms claim is a bug found
at construction:

- cache/clients.py: sessions, from hello to goodbye, and the gather reports
  their clients send;
- cache/namespaces.py: namespaces, their kinds (cache/kinds.py) and the
  checks of the pages a request names;
- cache/leasing.py: leases, their renewal, end and quarantine;
- cache/reads.py: match, match_keys, exists_keys (and L3 lookups);
- cache/writes.py: reservations and commits;
- cache/prefetch.py: prefetches, and what the tier's reads of them mean;
- cache/tiering.py: L3 writes, rewrites, write-backs and L3 events.

With tenants, cache/shares.py gives each tenant its share of the bounds
every client shares (sessions, leases, namespaces), which the rooms count
against as they open and close what they hold.

The state below them lives in state/ (pool, index, L2 allocation and
eviction, the set of keys L3 holds); what the desk keeps itself is the
figures (requests, errors, drops), expiry, reloads and stats.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from typing import get_args

import numpy as np

from hicached.cache.adopt import Adopted, adopt
from hicached.cache.chainorder import ChainOrder
from hicached.cache.clients import Clients
from hicached.cache.eventlog import EventLog
from hicached.cache.journal import NoRecorder, Recorder
from hicached.cache.kinds import KeyedKind, TokenKind
from hicached.cache.leasing import Leasing
from hicached.cache.namespaces import MAX_SLOTS_PER_SLAB, Namespaces
from hicached.cache.policy import write_policy
from hicached.cache.prefetch import Prefetches
from hicached.cache.reads import L3Lookup, Reads
from hicached.cache.sessions import (
    Handlers,
    Lease,
    NamespaceState,
    PrefetchState,
    Session,
)
from hicached.cache.shares import Bounds, Shares
from hicached.cache.tiering import HeldEvent, InBoth, Origin, Tiering, TierPort
from hicached.cache.writes import Writes
from hicached.config import Config
from hicached.errors import BadRequest, HicachedError
from hicached.state.index import PageIndex
from hicached.state.l2 import L2, TenantBook, Victims
from hicached.state.l3state import KnownKeys
from hicached.state.pool import SlotPool
from hicached.wire import protocol as p
from hicached.wire.events import MEDIUM_L2, Cleared
from hicached.wire.hashing import KeyCache
from hicached.wire.journal import Record

__all__ = [
    "MAX_SLOTS_PER_SLAB",
    "OP_NAMES",
    "Cache",
    "HeldEvent",
    "InBoth",
    "L3Lookup",
    "Lease",
    "NamespaceState",
    "Origin",
    "PrefetchState",
    "Session",
    "TierPort",
]

OP_NAMES = {cls: str(cls.__struct_config__.tag) for cls in get_args(p.AnyRequest)}


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
        journal: Recorder | None = None,
        pool_id: int = 0,
    ) -> None:
        self.config = config
        self.pool_path = pool_path
        self.pool_id = pool_id  # the pool file's id: clients keep a mapping of the same one
        self.instance = instance if instance is not None else secrets.randbits(63)
        self.clock = clock
        self.started = clock()
        mib = 1 << 20
        self.pool = SlotPool(config.pool.size_mib * mib, config.pool.slab_mib * mib, gens)
        self.l2 = L2(self.pool, self.evicted)
        # what the pool journal must say, for a restarted daemon (cache/journal.py)
        self.journal = journal if journal is not None else NoRecorder()
        if self.journal.on:
            self.l2.on_free = self.journal.freed
        self.adopted: Adopted | None = None  # what this daemon took over at start
        self._set_quotas(config)
        self.shares = Shares(config)  # each tenant's part of the shared bounds
        server = config.server
        self.key_cache = KeyCache(server.key_cache_pages, server.key_cache_token_mib << 20)
        self.events = EventLog(
            config.events.queue_events,
            enabled=bool(config.events.endpoint),
            max_bytes=config.events.queue_mib << 20,
        )
        self.events.add(Cleared())  # a new daemon's L2 starts empty; L3 is announced by its scan
        # the L3 port (daemon/tier.py), once its store is open (``use_tier``)
        self.tier: TierPort | None = None
        self.policy = write_policy(config.storage.write_policy)  # when pages go to L3
        self.requests: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.metrics_endpoint = ""  # where metrics are served, for stats ("": nowhere)
        # the process's garbage collector figures, for stats (daemon/collector.py)
        self._collector: Callable[[], p.CollectorStats] | None = None
        # the rooms
        self.tiering = Tiering(self)
        self.tokens = TokenKind(self.events)
        self.keyed = KeyedKind(self.events, self.tiering.bound_for_l3)
        self.clients = Clients(self)
        self.names = Namespaces(self)
        self.leasing = Leasing(self)
        self.reads = Reads(self)
        self.writes = Writes(self)
        self.prefetches = Prefetches(self)
        self.l3 = KnownKeys(config.storage.known_keys)  # keys L3 holds, as far as we know
        self.l3.on_forgotten = self.keyed.l3_forgotten
        # the state the rooms own, under the names the daemon and its tests read
        self.sessions = self.clients.sessions
        self.namespaces = self.names.by_id
        self.leases = self.leasing.table
        self.match_pages = self.reads.pages
        self.l3_counters = self.tiering.counters
        self.writing = self.tiering.writing
        # what answers each request of a session (hello, goodbye and stats, which
        # may come without one, are answered by handle itself)
        self._handlers: Handlers = {}
        rooms = (self.clients, self.names, self.leasing, self.reads, self.writes, self.prefetches)
        for room in rooms:
            table = room.handlers()
            twice = table.keys() & self._handlers.keys()
            if twice:
                raise TypeError(f"requests {sorted(OP_NAMES[t] for t in twice)} answered twice")
            self._handlers.update(table)

    # -- dispatch ------------------------------------------------------------------

    def handle(
        self,
        routing_id: bytes,
        request: p.AnyRequest,
        peer: str | None = None,
        *,
        operator: bool = False,
    ) -> p.AnyReply | L3Lookup:
        """Apply one request; never raises for a request's own faults. A match
        or exists may return an ``L3Lookup`` to finish once L3 was asked.

        ``peer``: who sent it, as the connection's credentials say (daemon/server.py):
        its tenant's name, "!..." for a peer no tenant lists, or None when
        tenants are off. A session stays with the peer that opened it.
        ``operator``: the peer runs as root or as the daemon's own user
        (daemon/tenants.py), who may see the daemon's totals in any case.
        """
        kind = type(request)
        op = OP_NAMES[kind]
        requests = self.requests
        requests[op] = requests.get(op, 0) + 1
        try:
            handler = self._handlers.get(kind)
            if handler is not None:  # a session's request
                reply: p.AnyReply | L3Lookup = handler(
                    self.clients.session(routing_id, peer), request
                )
                return reply
            if isinstance(request, p.Hello):
                return self.clients.hello(routing_id, request, peer)
            if isinstance(request, p.Goodbye):
                self.clients.goodbye(routing_id, peer)
                return p.Ok(id=request.id)
            if isinstance(request, p.Stats):
                # a probe takes no client slot: `hicached status` answers even
                # while every slot is held by clients with leases (crashed ones
                # too); a session's own stays with its peer
                if routing_id in self.sessions:
                    self.clients.session(routing_id, peer)
                return p.StatsOk(id=request.id, stats=self.stats(peer, operator=operator))
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
        """A reply could not be sent (the client reads no replies, or is gone):
        a lease it granted ends now, as the client never learned of it."""
        lease_id = getattr(reply, "lease", 0)
        session = self.sessions.get(routing_id)
        lease = self.leases.get(lease_id) if lease_id and session is not None else None
        if lease is not None and lease.session is session:
            self.leasing.drop(lease)

    def use_tier(self, tier: TierPort) -> None:
        """L3's store is open: pages go there and come back through ``tier`` from now on."""
        self.tier = tier

    def serve_metrics(self, endpoint: str) -> None:
        """Metrics are served at ``endpoint`` (stats say where)."""
        self.metrics_endpoint = endpoint

    def report_collector(self, figures: Callable[[], p.CollectorStats]) -> None:
        """Stats carry the process's garbage collector figures, taken by ``figures``."""
        self._collector = figures

    # -- L2 ------------------------------------------------------------------------

    def adopt(self, records: list[Record]) -> Adopted:
        """Take over the pool of the daemon before this one, from its journal's
        records (cache/adopt.py); before any request is served."""
        leases = self.config.leases
        self.adopted = adopt(self, records, self.clock() + leases.ttl_s + leases.quarantine_s)
        return self.adopted

    def evicted(self, victims: Victims) -> None:
        """Free evicted slots; under write_back, first write pages L3 lacks (under
        the namespace that stored each page), holding their slots until then."""
        write_back = self.tier is not None and self.policy.writes_back
        tiering, namespaces = self.tiering, self.names.by_id
        owners: dict[NamespaceState, list[bytes]] = {}
        # parents first: eviction takes a sequence from its tail, L3 gets it from its head
        forget = self.journal.freed
        for key, slot, owner in reversed(victims):
            ns = namespaces[owner]
            ns.pages -= 1
            ns.book.evicted += 1
            owners.setdefault(ns, []).append(key)
            if tiering.left_l2(ns, key, slot, write_back):
                forget(slot)  # held for its write-back: no restart adopts it
            else:
                self.l2.free(slot, ns.spec.page_bytes)  # which tells the journal
        for ns, keys in owners.items():
            ns.kind.removed(ns.kind.left_l2(keys), MEDIUM_L2, ns.spec.model)
            self.names.forget_if_unused(ns)

    # -- what the tier calls (daemon/tier.py) ----------------------------------------

    def forget_l3(self, keys: Iterable[bytes], ns_digest: bytes = b"") -> None:
        self.tiering.forget_l3(keys, ns_digest)

    def learn_l3(self, ns_digest: bytes, keys: list[bytes]) -> int:
        return self.tiering.learn_l3(ns_digest, keys)

    def announce_l3(self, ns_digest: bytes, keys: list[bytes]) -> None:
        self.tiering.announce_l3(ns_digest, keys)

    def unwritten_pages(self) -> list[tuple[NamespaceState, bytes, int, int]]:
        return self.tiering.unwritten_pages()

    def write_back(self, pages: list[tuple[NamespaceState, bytes, int, int]]) -> int:
        return self.tiering.write_back(pages)

    def adopted_unwritten(
        self, most: int
    ) -> Iterator[list[tuple[NamespaceState, bytes, int, int]]] | None:
        """Once L3's listing ended, after a start that adopted pages: the L2 pages
        L3 lacks and no write carries, in batches of at most ``most``
        (``Tiering.unwritten_batches``), where the write policy writes adopted
        pages (write_through: their writes were queued or under way when the
        daemon before stopped); None otherwise."""
        if self.adopted is None or not self.adopted.pages or not self.policy.writes_all:
            return None
        return self.tiering.unwritten_batches(most)

    def prefetch_started(self, lease: Lease) -> None:
        self.prefetches.started(lease)

    def prefetch_planned(self, lease: Lease, available: int | None) -> list[int]:
        return self.prefetches.planned(lease, available)

    def prefetch_progress(self, lease: Lease, results: list[bool], *, learn: bool = True) -> bool:
        return self.prefetches.progress_of(lease, results, learn=learn)

    def prefetch_finished(self, lease: Lease) -> None:
        self.prefetches.finished(lease)

    @property
    def l3_drops(self) -> int:
        return self.tiering.drops

    @property
    def l3_undersized(self) -> bool:
        return self.tiering.undersized

    @property
    def l3_medium(self) -> str:
        return self.tiering.medium

    # -- what tests and tools read ---------------------------------------------------

    @property
    def committed_pages(self) -> int:
        return self.writes.committed

    @property
    def expired_leases(self) -> int:
        return self.leasing.expired

    @property
    def evicted_pages(self) -> int:
        return self.l2.evicted_pages

    @property
    def reclaimed_slabs(self) -> int:
        return self.l2.reclaimed_slabs

    @property
    def _order(self) -> ChainOrder[HeldEvent]:
        return self.tiering.order

    @property
    def _origins(self) -> dict[bytes, Origin]:
        return self.tiering.origins

    def _l3_keys_forgotten(self, keys: set[bytes]) -> None:
        self.keyed.l3_forgotten(keys)

    def _keys(self, ns: NamespaceState, tokens: bytes) -> list[bytes]:
        return self.names.token_keys(ns, tokens)

    def write_pages(self, ns: NamespaceState, keys: list[bytes], slots: list[int]) -> None:
        self.tiering.write_pages(ns, keys, slots)

    def release(self, session: Session, lease_id: int) -> None:
        self.leasing.release(session, lease_id)

    # -- housekeeping -----------------------------------------------------------------

    def expire(self) -> int:
        """End leases past their deadline, free quarantined slots whose time is up
        and forget idle sessions; returns leases ended."""
        now = self.clock()
        ended = self.leasing.expire(now)
        self.l2.release_quarantine(now)
        self.clients.end_idle(now - self.config.server.session_idle_s)
        return ended

    def _set_quotas(self, config: Config) -> None:
        """Each configured tenant's quota, in its book (created if new)."""
        mib = 1 << 20
        for name, tenant in config.tenants.items():
            book = self.l2.book(name)
            book.max_slots, book.max_bytes = tenant.max_pages, tenant.max_mib * mib

    def reconfigure(self, config: Config) -> dict[str, int]:
        """Run with ``config`` from now on (a reload: only keys that may change at
        run time differ, daemon/reload.py). A tenant whose quota went down
        gives up its least recently used unleased pages at once; returns the
        pages each such tenant gave up."""
        self.config = config
        self.policy = write_policy(config.storage.write_policy)
        self._set_quotas(config)
        self.shares.configure(config)
        evicted = {}
        for name in config.tenants:
            book = self.l2.book(name)
            if book.max_slots or book.max_bytes:
                n = self.l2.enforce(book)
                if n:
                    evicted[name] = n
        return evicted

    def tenant_figures(self) -> list[p.TenantStats]:
        """Per-tenant figures for metrics, in name order."""
        books = sorted(self.l2.books.values(), key=lambda b: b.name)
        return [self._figures(book) for book in books]

    def _tenant_view(self, tenant: str) -> p.DaemonStats:
        """Stats for a peer of ``tenant``: the daemon's totals (pages, requests,
        hits, errors, L3 counters, the collector's pauses) add up every
        tenant's activity, which a tenant is not to see, so they are zeros and
        empty; what it may see is its own tenant's figures (``tenant``), its
        own clients' gather reports, its pool (its arena, where it has one)
        and the L3 tier's health."""
        arenas = self.clients.arenas
        arena = arenas.get(tenant) if arenas is not None else None
        tier = self.tier
        return p.DaemonStats(
            instance=self.instance,
            uptime_s=round(self.clock() - self.started, 3),
            pool_bytes=arena.size if arena is not None else self.pool.arena_bytes,
            pool_used_bytes=0,
            pool_free_bytes=0,
            slab_bytes=self.pool.slab_bytes,
            pages=0,
            pinned_pages=0,
            reserved_pages=0,
            namespaces=0,
            clients=0,
            leases=0,
            requests={},
            errors={},
            dropped={},
            evicted_pages=0,
            expired_leases=0,
            l3_backend=self.config.storage.backend if tier is not None else "",
            l3_state=getattr(tier, "state", "") if tier is not None else "",
            metrics_endpoint=self.metrics_endpoint,
            gather_clients=self.clients.gather_clients(tenant),
            tenant=self._own_tenant(tenant),
            scope="tenant",
        )

    def _own_tenant(self, viewer: str | None) -> p.TenantStats | None:
        """The figures of ``viewer``'s own tenant, for its stats: with tenants on
        (a viewer), and one it belongs to; never another tenant's."""
        book = self.l2.books.get(viewer) if viewer is not None else None
        if book is None:
            return None
        return self._figures(book)

    def _figures(self, book: TenantBook) -> p.TenantStats:
        """One tenant's figures, as metrics and its own peers' stats carry them:
        its share of L2, and with tenants what it holds of the shared bounds."""
        name = book.name
        bounds = self.shares.of(name) or Bounds(0, 0, 0)
        return p.TenantStats(
            tenant=name,
            pages=book.pages,
            slots=book.slots,
            bytes=book.bytes,
            max_slots=book.max_slots,
            max_bytes=book.max_bytes,
            asked=book.asked,
            hits=book.hits,
            evicted=book.evicted,
            quota_evicted=book.quota_evicted,
            clients=self.clients.held.get(name, 0),
            leases=self.leases.held.get(name, 0),
            namespaces=self.names.held.get(name, 0) if bounds.clients else 0,
            max_clients=bounds.clients,
            max_leases=bounds.leases,
            max_namespaces=bounds.namespaces,
        )

    def stats(self, viewer: str | None = None, *, operator: bool = False) -> p.DaemonStats:
        """The daemon's figures, as ``viewer`` (the asking peer, ``handle``'s
        ``peer``) may see them: with tenants on, a tenant's peer gets its own
        tenant's figures and none of the totals (``_tenant_view``) unless it is
        the ``operator`` (root, the daemon's user: they can read the daemon's
        memory anyway); a peer of no tenant (status only) gets the totals. The
        clients listed by name (``gather_clients``) are the viewer's own only."""
        if viewer is not None and not viewer.startswith("!") and not operator:
            return self._tenant_view(viewer)
        pool = self.pool
        used = pool.used_bytes
        # with the slots of ended prefetches that their reads still fill: they
        # count as open leases (``leases`` below) and take pool bytes until then
        reserved = sum(len(lease.fresh) for lease in self.leases.counted())
        # pages held against eviction: those pinned (key-addressed leases' pages,
        # token leases' last pages, writes to L3 in flight), and the pages of
        # token leases' paths before their last
        tails: dict[PageIndex, list[int]] = {}  # by index: the last pinned page of each
        for lease in self.leases:
            if len(lease.pinned) > len(lease.pins):
                tails.setdefault(lease.ns.tree, []).append(lease.pins[-1])
        held = len(pool.pins) + sum(ix.pinned_beyond(t, pool.pins) for ix, t in tails.items())
        tiering, tier = self.tiering, self.tier
        written = tiering.counters.get("written", 0)
        committed = self.committed_pages
        order = tiering.order.out_of_order
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
            leases=self.leases.open,  # ended prefetches whose reads run count too
            requests=dict(self.requests),
            errors=dict(self.errors),
            dropped=dict(self.dropped),
            evicted_pages=self.l2.evicted_pages,
            reclaimed_slabs=self.l2.reclaimed_slabs,
            expired_leases=self.expired_leases,
            quarantined_pages=self.l2.quarantined,
            writeback_pages=sum(self.l2.returning.values()) - self.l2.quarantined,
            l3_backend=self.config.storage.backend if tier is not None else "",
            l3_state=getattr(tier, "state", "") if tier is not None else "",
            l3_pages_known=len(self.l3),
            l3_known_max=self.l3.limit,
            committed_pages=committed,
            l3_undersized=tiering.undersized,
            l3_write_amplification=round(written / committed, 3) if committed else 0.0,
            l3={
                **tiering.counters,
                **({"events_out_of_order": order} if order else {}),
                **(getattr(tier, "counters", None) or {}),
            },
            match_pages=dict(self.reads.pages),
            events_pending=len(self.events.pending),
            metrics_endpoint=self.metrics_endpoint,
            adopted_pages=self.adopted.pages if self.adopted else 0,
            adoption_dropped=dict(self.adopted.dropped) if self.adopted else {},
            gather_clients=self.clients.gather_clients(viewer),
            collector=self._collector() if self._collector is not None else None,
            tenant=self._own_tenant(viewer),
        )
