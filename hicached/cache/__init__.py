"""What each request does: clients, namespaces (and their kinds), leasing,
reads, writes, prefetch, tiering to L3, write policies, the KV event log, and
``Cache``, the front desk that composes them (cache/desk.py lists the rooms).
Synchronous and free of I/O (no sockets, no event loop, no threads), owned by
the event-loop thread; the daemon's I/O side lives in daemon/."""

from hicached.cache.desk import (
    OP_NAMES,
    Cache,
    L3Lookup,
    Lease,
    NamespaceState,
    PrefetchState,
    Session,
    TierPort,
)

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
