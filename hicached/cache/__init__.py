"""What each request does: sessions, namespaces, leases, the L3 write policy,
prefetch, KV event records, and ``Cache``, the front desk that composes them.
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
