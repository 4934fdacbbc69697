"""Leasing: how leases begin, are renewed and end.

A *write* lease belongs to a reservation (its fresh slots, plus a pin on the
pages that were already present so they cannot be evicted before the
commit); a *read* lease pins the pages a match returned; a *prefetch* lease
is a write lease whose fresh slots are filled from L3 in the background.
With tenants, a tenant's sessions hold at most its share of
``leases.max_leases`` at once (cache/shares.py). A prefetch lease that ends
while its store reads run counts against both bounds until they have
returned (LeaseTable.keep_reading): what bounds a client's leases bounds its
reads of the store too. Leases expire after
``leases.ttl_s`` so a client that dies cannot hold memory forever; the fresh
slots of a write lease that ends without a commit of all of them sit in
quarantine (``free_after``: one rule for every end) so a copy a client began
just before its deadline, or one another of its threads has under way as the
lease ends, cannot land in another key's page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicached.cache.sessions import Handlers, Lease, LeaseTable, NamespaceState, Session
from hicached.cache.shares import over
from hicached.errors import ForeignLease, ResourceExhausted, UnknownLease
from hicached.wire import protocol as p

if TYPE_CHECKING:
    from hicached.cache.desk import Cache

__all__ = ["Leasing"]


class Leasing:
    """The open leases and the rules of their lives."""

    def __init__(self, desk: Cache) -> None:
        self.desk = desk
        # Lease ids are random (LeaseTable.next_id): unique, and unlikely to be
        # valid again after a restart (ownership is checked either way).
        self.table = LeaseTable()
        self.expired = 0  # leases ended at their deadline

    def handlers(self) -> Handlers:
        return {p.Release: self._release_request, p.Renew: self.renew}

    def new(self, session: Session, ns: NamespaceState, pinned: list[int]) -> Lease:
        """A lease of ``session`` on the indexed pages in ``pinned``, pinned now."""
        desk = self.desk
        config = desk.config.leases
        share = session.share
        if share is not None:  # with tenants: its tenant's share first (cache/shares.py)
            bounds = desk.shares.of(share)
            held = self.table.held.get(share, 0)
            if bounds is not None and held >= bounds.leases:
                raise ResourceExhausted(f"{over(share, 'leases', held)}: release or commit sooner")
        table_open = self.table.open
        if table_open >= config.max_leases:
            # with tenants, no count: it adds up every tenant's leases, which a
            # tenant's peer is not to learn (stats keep it from them too)
            what = (
                f"{table_open} leases are open, the limit"
                if share is None
                else "the daemon's open leases, every tenant's together, are at the limit"
            )
            raise ResourceExhausted(
                f"{what} (leases.max_leases = {config.max_leases}): release or commit leases sooner"
            )
        lease = Lease(self.table.next_id(), session, ns, desk.clock() + config.ttl_s, pinned)
        lease.pins = ns.kind.pins(pinned)
        desk.pool.pin(lease.pins)
        self.table.add(lease)
        ns.open += 1
        return lease

    def take(self, session: Session, lease_id: int) -> Lease:
        """Lease ``lease_id`` of ``session``, out of the table."""
        lease = self.table.get(lease_id)
        if lease is None:
            raise UnknownLease(f"lease {lease_id} is not open (committed, released or expired)")
        if lease.session is not session:
            raise ForeignLease(f"lease {lease_id} belongs to another client")
        self.table.pop(lease)
        return lease

    def drop(self, lease: Lease) -> None:
        """End a lease still in the table (one with nothing to hold after all)."""
        self.table.pop(lease)
        self.end(lease)

    def end(self, lease: Lease) -> None:
        """Drop a lease's pins and free its unused fresh slots.

        Fresh slots the client copies into go to quarantine instead of the free
        list, however the lease ends (``free_after``: one rule for every end):
        a copy into them may still be running, one begun just before the
        deadline of a lease that expired or whose client left, or one that
        another thread of the client has under way as it releases the lease
        or commits fewer pages. A prefetch reader may still be
        writing into fresh slots: then they are left to it, the lease counts
        on against its bounds (``LeaseTable.keep_reading``), and the
        prefetch's end frees them and the count (cache/prefetch.py).
        """
        desk = self.desk
        if lease.pins:
            lease.ns.index.unpinned(desk.pool.unpin(lease.pins))
        lease.pins = lease.pinned = []
        ns = lease.ns
        ns.open -= 1
        pf = lease.prefetch
        if pf is not None:
            pf.ended = True
            if pf.running:
                ns.open += 1  # the reader still holds it; released when it finishes
                self.table.keep_reading(lease)
                return
        if lease.client_writes:
            until = self.free_after(lease)
            desk.l2.quarantine(lease.fresh, until)
            # a restart keeps the quarantine's end, neither shortens nor prolongs it
            desk.journal.alloc(lease.fresh, ns.spec.page_bytes, ns.book.name, until)
        else:
            for slot in lease.fresh:
                desk.l2.free(slot, ns.spec.page_bytes)
        lease.fresh = []
        desk.names.forget_if_unused(ns)

    def free_after(self, lease: Lease) -> float:
        """When a client's copies into ``lease``'s fresh slots are over for sure.

        The one rule for every way a write lease ends without a commit of all
        its slots (release, a commit of fewer pages or with a mask, goodbye, a
        session dropped, expiry):
        the copier checks the lease's deadline before each copy, so the slots
        sit out ``leases.quarantine_s`` past that deadline, or past now if it
        is over. Worker processes copy through an adopted key-addressed
        reservation until that deadline whatever its owner does, so the end of
        the owner's session does not move it.
        """
        desk = self.desk
        return max(desk.clock(), lease.deadline) + desk.config.leases.quarantine_s

    def renew(self, session: Session, msg: p.Renew) -> p.RenewOk:
        lease = self.table.get(msg.lease)
        if lease is None:
            raise UnknownLease(f"lease {msg.lease} is not open (committed, released or expired)")
        if lease.session is not session:
            raise ForeignLease(f"lease {msg.lease} belongs to another client")
        ttl = self.desk.config.leases.ttl_s
        self.table.renew(lease, self.desk.clock() + ttl)
        return p.RenewOk(id=msg.id, ttl_s=ttl)

    def release(self, session: Session, lease_id: int) -> None:
        self.end(self.take(session, lease_id))

    def _release_request(self, session: Session, msg: p.Release) -> p.Ok:
        self.release(session, msg.lease)
        return p.Ok(id=msg.id)

    def expire(self, now: float) -> int:
        """End the leases past their deadline; returns how many."""
        ended = 0
        for lease in self.table.due(now):
            self.end(lease)
            ended += 1
        self.expired += ended
        return ended
