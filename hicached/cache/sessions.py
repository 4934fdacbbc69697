"""Sessions, namespaces and leases: who holds what, and until when.

Synchronous and free of I/O, owned by the event-loop thread like the rest of
the daemon's state.

- A *session* is one connected client (a ZeroMQ routing id) and, when tenants
  are configured, the peer it is: its tenant, named by the connection's
  credentials (daemon/requests.py), never by what it sends. It ends on
  ``goodbye``, when it has been idle for ``server.session_idle_s`` without a
  lease, or when the session table (or, with tenants, its tenant's share of
  it) is full and a newcomer needs its place (the longest idle session that
  holds no lease goes first; with tenants, only one of the newcomer's tenant).
- A *namespace* lives while a session has it registered, a page of it is in
  L2, or a lease or an L3 write of it is open; then it is forgotten, so
  ``pool.max_namespaces`` bounds the live ones, not a lifetime count.
- A *lease* pins pages (read leases) or owns fresh slots to fill (write and
  prefetch leases) until it is committed, released or expires. The table is
  kept in deadline order (a renewal moves a lease to the end), so expiry
  looks only at leases that are due.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hicached.cache.kinds import NamespaceKind
from hicached.state.index import PageIndex
from hicached.state.keyindex import KeyIndex
from hicached.state.l2 import Index, TenantBook
from hicached.wire.namespace import EventMeta, NamespaceSpec
from hicached.wire.protocol import GatherReport


@dataclass(slots=True, eq=False)
class NamespaceState:
    id: int
    spec: NamespaceSpec
    digest: bytes
    index: Index
    book: TenantBook  # its tenant's share of L2
    kind: NamespaceKind  # token- or key-addressed (cache/kinds.py)
    sessions: int = 0  # sessions that registered it
    pages: int = 0  # its pages in L2
    open: int = 0  # its open leases and L3 writes
    # what its events say of its pages beyond their keys (vLLM's KV cache spec
    # kind and window), from the first registration that gave it
    events: EventMeta | None = None

    @property
    def unused(self) -> bool:
        return not (self.sessions or self.pages or self.open)

    @property
    def tree(self) -> PageIndex:
        """The index of a token namespace."""
        assert isinstance(self.index, PageIndex), "a token namespace"
        return self.index

    @property
    def table(self) -> KeyIndex:
        """The index of a key-addressed namespace."""
        assert isinstance(self.index, KeyIndex), "a key-addressed namespace"
        return self.index


@dataclass(slots=True, eq=False)
class Session:
    id: int
    routing_id: bytes
    client: str
    pid: int
    last_seen: float
    # Who the peer is: its tenant's name; "!..." = a peer no tenant lists (what
    # it is, for messages); None = tenants are off, a namespace names its own.
    peer: str | None = None
    # the share of the shared bounds it counts against (cache/shares.py): its
    # tenant's name, "!" for a peer of no tenant; None = tenants are off
    share: str | None = None
    seq: int = 0  # the sessions' order of coming (the id is random: cache/clients.py)
    namespaces: set[int] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)
    # the client process's scattered-copy kernels, as it last reported them
    # (a fixed set of checked fields: bounded; None: not reported)
    gather: GatherReport | None = None


@dataclass(slots=True)
class PrefetchState:
    """Progress of one prefetch; ``keys`` are the pages after the L2 hit."""

    keys: list[bytes]
    planned: int = -1  # pages being read; -1 until L3 has been asked
    completed: int = 0  # leading pages read and verified
    done: bool = False
    failed: bool = False
    running: bool = True  # the reader may still write into fresh slots, or call the store
    ended: bool = False  # the lease ended; the reader frees what is left
    known: int = 0  # leading keys the record of L3 knew when the store was asked


class KeyedPage(NamedTuple):
    """A page of a key-addressed namespace on its way into L2."""

    key: bytes  # the daemon's key
    parent: bytes  # the daemon's key of the page before it in its sequence (b"": none)
    ekey: bytes  # its event name (wire/events.py: the engine's event key and KV group)
    eparent: bytes  # the event name of its parent (b"": none)


@dataclass(slots=True, eq=False)
class Lease:
    id: int
    session: Session
    ns: NamespaceState
    deadline: float
    pinned: list[int]  # slots of indexed pages held against eviction
    # the slots pinned in the pool for them: all of them in a key-addressed
    # namespace; in a token namespace only the last, since its pages form a
    # path from the root of the radix tree and eviction takes a leaf's pages
    # from its tail: a pinned page keeps every page before it on its path
    pins: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # write leases: every page's key
    fresh: list[int] = field(default_factory=list)  # write leases: slots to fill
    prefetch: PrefetchState | None = None
    tokens: bytes = b""  # write leases: the sequence, for events
    # key-addressed write leases: one per fresh slot (reserve) or per key to read (prefetch)
    chain: list[KeyedPage] | None = None

    @property
    def writing(self) -> bool:
        return bool(self.keys) or self.prefetch is not None or self.chain is not None

    @property
    def client_writes(self) -> bool:
        """The client copies into this lease's fresh slots (not the L3 reader)."""
        return self.prefetch is None and bool(self.fresh)


class LeaseTable:
    """Open leases in deadline order, with ids that are hard to guess after a
    restart (ownership is checked either way), and how many each tenant's
    sessions hold (``held``, by ``Session.share``; with tenants on).

    A prefetch lease that ends while the tier's store calls for it still run
    leaves the table but still counts (``reading``, and in ``held``) until
    they have returned (``read_ended``): else a client could release and
    prefetch again in a loop and keep more store reads running than its
    bound of leases, up to every call slot the tenants share."""

    def __init__(self) -> None:
        self._leases: OrderedDict[int, Lease] = OrderedDict()
        self.held: dict[str, int] = {}
        self._reading: set[Lease] = set()  # leases ended whose prefetch reads still run

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def open(self) -> int:
        """What counts against ``leases.max_leases``: the leases in the table and
        those ended while their reads run."""
        return len(self._leases) + len(self._reading)

    @property
    def reading(self) -> int:
        """Leases ended while their prefetch reads run (``keep_reading``)."""
        return len(self._reading)

    def __iter__(self) -> Iterator[Lease]:
        return iter(self._leases.values())

    def counted(self) -> Iterator[Lease]:
        """Every lease that counts (``open``): those in the table, then those
        ended while their reads run, whose fresh slots the reader still fills."""
        yield from self._leases.values()
        yield from self._reading

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def next_id(self) -> int:
        """A random id that no open lease has. Not one counted up: the ids a
        tenant's client got would tell it how many leases every tenant opened
        in between (the activity its stats keep from it); from the OS's
        random source, since a seeded generator's next outputs follow from
        enough of its past ones."""
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:  # 2**-63 a lease: all but never
            lease_id = secrets.randbits(63) or 1
        return lease_id

    def add(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        session = lease.session
        session.leases.add(lease.id)
        share = session.share
        if share is not None:
            self.held[share] = self.held.get(share, 0) + 1

    def pop(self, lease: Lease) -> None:
        del self._leases[lease.id]
        session = lease.session
        session.leases.discard(lease.id)
        share = session.share
        if share is not None:
            self.held[share] -= 1

    def keep_reading(self, lease: Lease) -> None:
        """``lease``, popped, ended while its prefetch reads run: it counts on."""
        self._reading.add(lease)
        share = lease.session.share
        if share is not None:
            self.held[share] = self.held.get(share, 0) + 1

    def read_ended(self, lease: Lease) -> None:
        """The reads of ``lease``, kept counted by ``keep_reading``, have returned."""
        assert lease in self._reading, "a read ended that was not counted"
        self._reading.remove(lease)
        share = lease.session.share
        if share is not None:
            self.held[share] -= 1

    def renew(self, lease: Lease, deadline: float) -> None:
        """Move the deadline on; the lease goes to the end of the order."""
        lease.deadline = deadline
        self._leases.move_to_end(lease.id)

    def due(self, now: float) -> Iterator[Lease]:
        """Pop and yield the leases whose deadline has passed, oldest first."""
        leases = self._leases
        while leases:
            lease = leases[next(iter(leases))]
            if lease.deadline > now:
                return
            self.pop(lease)
            yield lease


# What each request family answers (cache/desk.py joins them): request type ->
# its handler, called with the request's session and the request.
Handlers = dict[type, Callable[[Session, Any], Any]]
