"""Prefetch: every decision about bringing pages from L3 into L2.

A prefetch holds the pages of its sequence that L2 has (as a reservation
does) and asks the tier (daemon/tier.py) to read what follows from L3 into
fresh slots; the client follows its progress, then commits what was read.
The tier keeps only the loop that asks, reads and reports; what each answer
means is decided here:

- ``started``: what the record of L3 knows of the keys as the tier asks;
- ``planned``: the store holds ``available`` leading pages: what it no
  longer holds is forgotten, and slots are taken for as many as fit; a store
  that could not tell (down, too late) fails the prefetch and makes it forget
  nothing, since the pages may well be there;
- ``progress``: a batch was read; a gap ends the prefetch, since nothing
  after it may ever be committed; a page L3 held unknown is announced
  (unless the store let pages go during the read);
- ``finished``: the reader is done with the slots and its store calls have
  returned: the slots are freed here if the lease ended meanwhile, and the
  lease stops counting against its bounds then, not at its end (a client
  that releases a prefetch and opens another keeps no more reads running
  than its leases allow).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicached.cache.sessions import (
    Handlers,
    KeyedPage,
    Lease,
    NamespaceState,
    PrefetchState,
    Session,
)
from hicached.cache.writes import chain, check_count, check_sequence, token_ids
from hicached.errors import BadRequest, ForeignLease, UnknownLease
from hicached.wire import protocol as p

if TYPE_CHECKING:
    from hicached.cache.desk import Cache

__all__ = ["Prefetches"]


class Prefetches:
    """Prefetch requests, and what the tier's reads of them mean."""

    def __init__(self, desk: Cache) -> None:
        self.desk = desk

    def handlers(self) -> Handlers:
        return {
            p.Prefetch: self.prefetch,
            p.PrefetchKeys: self.prefetch_keys,
            p.Progress: self.progress,
        }

    def prefetch(self, session: Session, msg: p.Prefetch) -> p.PrefetchOk:
        desk = self.desk
        check_count("prefetch max_pages", msg.max_pages)
        ns = desk.names.of(session, msg.ns)
        keys = desk.names.token_keys(ns, msg.tokens)
        present = ns.index.match(keys)
        n = len(present)
        wanted = keys[n:] if msg.max_pages < 0 else keys[n : n + msg.max_pages]
        if desk.tier is None or not wanted:
            held = self._l2_only(session, ns, present, keys[:n], None, msg.tokens)
            return p.PrefetchOk(id=msg.id, lease=held, l2_hits=n)
        lease = desk.leasing.new(session, ns, present)
        lease.keys = keys[:n]
        lease.tokens = msg.tokens
        return self._start(lease, wanted, msg.id, n)

    def prefetch_keys(self, session: Session, msg: p.PrefetchKeys) -> p.PrefetchOk:
        desk = self.desk
        check_count("prefetch max_pages", msg.max_pages)
        ns = desk.names.of(session, msg.ns)
        check_sequence("prefetch", msg.keys, msg.parent)  # whatever L2 and L3 hold
        keys = desk.names.engine_keys(ns, msg.keys)
        present = ns.index.match(keys)
        n = len(present)
        wanted = keys[n:] if msg.max_pages < 0 else keys[n : n + msg.max_pages]
        if desk.tier is None or not wanted:
            held = self._l2_only(session, ns, present, keys[:n], [])
            return p.PrefetchOk(id=msg.id, lease=held, l2_hits=n)
        lease = desk.leasing.new(session, ns, present)
        lease.keys = keys[:n]
        parent = msg.keys[n - 1] if n else msg.parent
        lease.chain = chain(ns, wanted, msg.keys[n : n + len(wanted)], parent)
        return self._start(lease, wanted, msg.id, n)

    def _start(
        self, lease: Lease, wanted: list[bytes], request_id: int, l2_hits: int
    ) -> p.PrefetchOk:
        """Hand the lease to the tier, which reads ``wanted`` after its ``l2_hits``
        pages (the reply counts those: the tier may plan reads before it returns)."""
        desk = self.desk
        assert desk.tier is not None
        lease.prefetch = PrefetchState(wanted)
        desk.tiering.count("prefetches")
        desk.tier.prefetch(lease)
        return p.PrefetchOk(id=request_id, lease=lease.id, l2_hits=l2_hits)

    def _l2_only(
        self,
        session: Session,
        ns: NamespaceState,
        present: list[int],
        keys: list[bytes],
        pages: list[KeyedPage] | None,
        tokens: bytes = b"",
    ) -> int:
        """A prefetch with nothing to read (all in L2, or no L3): its L2 hit is
        still held until the commit, as for any prefetch, so ranks that agree on
        it find it there. The lease (0 for no hit) reports done at once."""
        if not present:
            return 0
        lease = self.desk.leasing.new(session, ns, present)
        lease.keys = keys
        lease.chain = pages
        lease.tokens = tokens
        lease.prefetch = PrefetchState([], planned=0, done=True, running=False)
        return lease.id

    def progress(self, session: Session, msg: p.Progress) -> p.ProgressOk:
        lease = self.desk.leases.get(msg.lease)
        if lease is None:
            raise UnknownLease(
                f"prefetch {msg.lease} is not open (committed, cancelled or expired)"
            )
        if lease.session is not session:
            raise ForeignLease(f"prefetch {msg.lease} belongs to another client")
        if lease.prefetch is None:  # open, but no read from L3: not "not open"
            what = "a reservation" if lease.writing else "a read lease"
            raise BadRequest(
                f"lease {msg.lease} is {what}, not a prefetch: progress is asked of "
                "the lease a prefetch returned"
            )
        pf = lease.prefetch
        return p.ProgressOk(
            id=msg.id, planned=pf.planned, completed=pf.completed, done=pf.done, failed=pf.failed
        )

    # -- what the tier's reads mean ----------------------------------------------

    def started(self, lease: Lease) -> None:
        """The tier asks the store which pages it holds: note how many leading
        ones the record of L3 knows now (what it learns while the store
        answers is not what the answer may contradict). A tier that does not
        call this first forgets nothing in ``planned``: the record then keeps
        keys the store may have let go of, which a prefetch reads as a gap."""
        pf = lease.prefetch
        assert pf is not None
        l3 = self.desk.l3
        known = 0
        for key in pf.keys:
            if key not in l3:
                break
            known += 1
        pf.known = known

    def planned(self, lease: Lease, available: int | None) -> list[int]:
        """The store holds ``available`` leading pages: those it was known to
        hold past them it no longer does; take slots for as many as fit. None:
        the store could not tell; the prefetch fails, forgetting nothing."""
        desk = self.desk
        pf = lease.prefetch
        assert pf is not None
        ns = lease.ns
        if available is None:
            # done: a check past its timeout may still run, and the lease counts
            # until it ends (``finished``), but nothing more comes of it
            pf.failed = pf.done = True
            pf.planned = 0
            desk.tiering.count("prefetch_store_silent")
            return []
        if available < pf.known:
            desk.tiering.forget_l3(pf.keys[available : pf.known], ns.digest)
        if pf.ended:
            pf.planned = 0
            return []
        want = min(available, len(pf.keys))
        fresh = desk.l2.alloc(ns.book, ns.spec.page_bytes, want)
        lease.fresh = fresh
        lease.keys = lease.keys + pf.keys[: len(fresh)]
        pf.planned = len(fresh)
        if len(fresh) < want:
            desk.tiering.count("prefetch_pool_short")
        return fresh

    def progress_of(self, lease: Lease, results: list[bool], *, learn: bool = True) -> bool:
        """Record a batch of reads, in order; False when the prefetch should stop.
        ``learn``: a page read that the record of L3 does not know is known from
        now on; False when the store told of letting pages go during the read (it
        may have let go of what it had just read: known again, a match would
        count it as an L3 hit, and write_back would not write it when it leaves L2)."""
        desk = self.desk
        pf = lease.prefetch
        assert pf is not None
        l3, count = desk.l3, desk.tiering.count
        for ok in results:
            if not ok:  # a gap: nothing after it may ever be committed
                pf.failed = True
                count("prefetch_truncated")
                return False
            key = pf.keys[pf.completed]
            if learn and key not in l3:  # L3 holds a page we did not know of: announce it
                l3.add(key)
                self._announce_read(lease, pf.completed)
            pf.completed += 1
            count("pages_prefetched")
        return not pf.ended

    def _announce_read(self, lease: Lease, j: int) -> None:
        """An L3 BlockStored for page ``j`` of a prefetch, found in L3 by reading it."""
        desk = self.desk
        pf, spec = lease.prefetch, lease.ns.spec
        assert pf is not None
        medium = desk.tiering.medium
        if lease.chain is not None:
            page = lease.chain[j]
            lease.ns.kind.stored_one(lease.ns, page.ekey, page.eparent or None, [], medium)
            return
        i = len(lease.keys) - pf.planned + j  # its place in the sequence
        parent = lease.keys[i - 1] if i else None
        tokens = token_ids(lease.tokens, i * spec.page_tokens, (i + 1) * spec.page_tokens)
        desk.events.stored([pf.keys[j]], parent, tokens, spec.page_tokens, medium, spec.model)

    def finished(self, lease: Lease) -> None:
        """The reader is done with the lease's slots, and no store call of it runs."""
        desk = self.desk
        pf = lease.prefetch
        assert pf is not None
        pf.running = False
        pf.done = True
        pf.planned = max(pf.planned, 0)
        if pf.ended:  # the lease ended while reading: free what it left
            ns = lease.ns
            for slot in lease.fresh:
                desk.l2.free(slot, ns.spec.page_bytes)
            lease.fresh = []
            ns.open -= 1
            desk.leases.read_ended(lease)
            desk.names.forget_if_unused(ns)
