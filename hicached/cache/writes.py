"""Writes: reservations of fresh slots, and the commits that publish them.

A reservation takes fresh slots for the pages of a sequence that L2 lacks
under a write lease, and pins the pages it has so they stay until the
commit; the client copies into the fresh slots, then commits. A commit
publishes its pages in the namespace's index (a page another client
published meanwhile is a duplicate: its slot is freed), sends their
BlockStored events, and hands them to the write policy for L3.

In a key-addressed namespace each page comes with its parent (the key before
it), and a commit may name the pages it publishes with a mask: a worker that
failed a copy leaves its page out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hicached.cache.sessions import Handlers, KeyedPage, Lease, NamespaceState, Session
from hicached.errors import BadRequest
from hicached.wire import protocol as p
from hicached.wire.arena import GEN_GRANULE
from hicached.wire.events import MEDIUM_L2, event_name, split_name
from hicached.wire.hashing import TOKEN_BYTES, engine_page_keys
from hicached.wire.journal import PageRecord
from hicached.wire.namespace import MAX_KEY_BYTES

if TYPE_CHECKING:
    from hicached.cache.desk import Cache

__all__ = ["Writes", "chain", "check_count", "token_ids"]


class Writes:
    """Reservations and commits; counts the pages clients committed into L2."""

    def __init__(self, desk: Cache) -> None:
        self.desk = desk
        self.committed = 0  # pages clients committed into L2 (prefetches aside)

    def handlers(self) -> Handlers:
        return {p.Reserve: self.reserve, p.ReserveKeys: self.reserve_keys, p.Commit: self.commit}

    def reserve(self, session: Session, msg: p.Reserve) -> p.ReserveOk:
        desk = self.desk
        ns = desk.names.of(session, msg.ns)
        keys = desk.names.token_keys(ns, msg.tokens)
        present = ns.index.match(keys)
        lease = desk.leasing.new(session, ns, present)
        want = len(keys) - len(present)
        fresh = desk.l2.alloc(ns.book, ns.spec.page_bytes, want)
        lease.keys = keys[: len(present) + len(fresh)]
        lease.fresh = fresh
        desk.journal.alloc(fresh, ns.spec.page_bytes, ns.book.name)
        lease.tokens = msg.tokens
        if not fresh:
            desk.leasing.drop(lease)  # nothing to write: no lease is kept open
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

    def reserve_keys(self, session: Session, msg: p.ReserveKeys) -> p.ReserveKeysOk:
        desk = self.desk
        ns = desk.names.of(session, msg.ns)
        keys = desk.names.engine_keys(ns, msg.keys)
        check_sequence("reservation", msg.keys, msg.parent)
        found = ns.table.find(keys)
        present = [slot for slot in found if slot >= 0]
        missing = [i for i, slot in enumerate(found) if slot < 0]
        lease = desk.leasing.new(session, ns, present)  # pinned before alloc can evict them
        fresh = desk.l2.alloc(ns.book, ns.spec.page_bytes, len(missing))
        indices = missing[: len(fresh)]
        pages = chain(ns, keys, msg.keys, msg.parent)
        lease.fresh = fresh
        desk.journal.alloc(fresh, ns.spec.page_bytes, ns.book.name)
        lease.chain = [pages[i] for i in indices]
        mask = bytes(slot >= 0 for slot in found)
        pool_full = len(fresh) < len(missing)
        if not fresh:
            desk.leasing.drop(lease)
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

    def commit(self, session: Session, msg: p.Commit) -> p.CommitOk:
        desk = self.desk
        lease = desk.leases.get(msg.lease)
        if lease is not None and lease.session is session and not lease.writing:
            raise BadRequest(f"lease {msg.lease} is a read lease; release it instead")
        check_count("commit pages", msg.pages)
        lease = desk.leasing.take(session, msg.lease)
        fresh = lease.fresh
        pf = lease.prefetch
        ready = len(fresh) if pf is None else pf.completed
        if lease.chain is not None:
            return self._commit_keyed(lease, msg, ready)
        if msg.mask:
            desk.leasing.end(lease)
            raise BadRequest("a commit mask is for key-addressed reservations only; lease ended")
        count = ready if msg.pages < 0 else msg.pages
        if count > ready:
            desk.leasing.end(lease)
            what = "reserved" if pf is None else "has read"
            raise BadRequest(f"commit of {count} pages, but the lease {what} {ready}; lease ended")
        ns = lease.ns
        n = len(lease.pinned) + count
        keys = lease.keys[:n]
        slots = lease.pinned + fresh[:count]
        published, unused = ns.tree.insert(keys, slots, ns.id)
        ns.pages += published
        lease.fresh = fresh[count:]
        if pf is None:
            # written by the client, whose other threads may copy into them still:
            # they end with the lease, as the pages after ``count`` do (Leasing.end)
            lease.fresh = unused + lease.fresh
        else:
            for slot in unused:
                desk.l2.free(slot, ns.spec.page_bytes)
        desk.leasing.end(lease)
        new = n - published
        page_tokens = ns.spec.page_tokens
        if published and desk.journal.on:
            self._record(ns, keys, slots, new, lease.tokens)
        if published:
            parent = keys[new - 1] if new else None
            tokens = token_ids(lease.tokens, new * page_tokens, n * page_tokens)
            desk.events.stored(keys[new:], parent, tokens, page_tokens, MEDIUM_L2, ns.spec.model)
        if pf is None:
            self.committed += published
        if published and desk.tier is not None:
            tiering = desk.tiering
            tiering.token_origins(keys, slots, new, lease.tokens, page_tokens)
            # A prefetch's pages were recorded as held by L3 as they were read; one
            # that L3 dropped since (a recycled segment) must not be recorded again.
            if pf is not None:
                tiering.in_both(ns, keys[new:], slots[new:])
            else:
                desk.policy.committed(tiering, ns, keys[new:], slots[new:])
        return p.CommitOk(id=msg.id, published=published, duplicates=count - published)

    def _record(
        self, ns: NamespaceState, keys: list[bytes], slots: list[int], new: int, tokens: bytes
    ) -> None:
        """Journal token pages ``new..`` of a commit, each with its parent and tokens."""
        gens = self.desk.pool.gens
        step = ns.spec.page_tokens * TOKEN_BYTES
        published = slots[new:]
        at = np.asarray(published, dtype=np.int64) // GEN_GRANULE
        records = [
            PageRecord(
                ns.id,
                keys[i],
                keys[i - 1] if i else b"",
                slot,
                gen,
                tokens[i * step : (i + 1) * step],
            )
            for i, slot, gen in zip(
                range(new, len(keys)), published, gens[at].tolist(), strict=True
            )
        ]
        self.desk.journal.publish(records)

    def _commit_keyed(self, lease: Lease, msg: p.Commit, ready: int) -> p.CommitOk:
        """Commit a key-addressed lease: the pages its mask (or ``pages``) names
        enter the index, each under its parent; the other fresh slots are freed."""
        assert lease.chain is not None
        desk = self.desk
        ns, fresh, pages = lease.ns, lease.fresh, lease.chain
        if msg.mask:
            if len(msg.mask) != ready or lease.prefetch is not None or msg.pages != -1:
                desk.leasing.end(lease)
                raise BadRequest(
                    f"commit mask of {len(msg.mask)} bytes for a lease of {ready} fresh slots "
                    "(a reservation's commit takes one byte per slot and no pages; a "
                    "prefetch's, none); lease ended"
                )
            chosen = [j for j, ok in enumerate(msg.mask) if ok]
        else:
            count = ready if msg.pages < 0 else msg.pages
            if count > ready:
                desk.leasing.end(lease)
                raise BadRequest(
                    f"commit of {count} pages, but the lease holds {ready}; lease ended"
                )
            chosen = list(range(count))
        stored: list[KeyedPage] = []
        slots: list[int] = []
        taken = set()
        for j in chosen:
            page, slot = pages[j], fresh[j]
            if ns.table.insert(page.key, slot, ns.id, page.parent):
                stored.append(page)
                slots.append(slot)
                taken.add(j)
        lease.fresh = [slot for j, slot in enumerate(fresh) if j not in taken]
        ns.pages += len(stored)
        if lease.prefetch is None:
            # an adopted write handle must not write into a page once it is published
            for slot in slots:
                desk.pool.bump(slot)
        if stored and desk.journal.on:
            desk.journal.publish(_keyed_records(desk.pool.gens, ns, stored, slots))
        desk.leasing.end(lease)
        if stored:
            desk.keyed.remember(stored)
            desk.keyed.stored(ns, stored, MEDIUM_L2)
        if lease.prefetch is None:
            self.committed += len(stored)
        if stored and desk.tier is not None:
            tiering = desk.tiering
            tiering.keyed_origins(stored, slots)
            keys = [page.key for page in stored]
            if lease.prefetch is not None:
                tiering.in_both(ns, keys, slots)
            else:
                desk.policy.committed(tiering, ns, keys, slots)
        return p.CommitOk(id=msg.id, published=len(stored), duplicates=len(chosen) - len(stored))


def _keyed_records(
    gens: np.ndarray, ns: NamespaceState, stored: list[KeyedPage], slots: list[int]
) -> list[PageRecord]:
    """Journal records of a key-addressed commit: each page's event key and KV
    group apart (PageRecord.egroup), as daemons that know no group read them."""
    records = []
    for page, slot in zip(stored, slots, strict=True):
        ekey, group = split_name(page.ekey)
        eparent = split_name(page.eparent)[0] if page.eparent else b""
        records.append(
            PageRecord(
                ns.id,
                page.key,
                page.parent,
                slot,
                int(gens[slot // GEN_GRANULE]),
                b"",
                ekey,
                eparent,
                -1 if group is None else group,
            )
        )
    return records


def chain(
    ns: NamespaceState, keys: list[bytes], ekeys: list[bytes], parent: bytes
) -> list[KeyedPage]:
    """Each key of a key-addressed namespace with its parent (the key before it;
    ``parent`` for the first), as the daemon and as events name them (their
    event names: wire/events.py)."""
    scheme = ns.spec.key_scheme
    events = [event_name(scheme, k) for k in ekeys]
    up = engine_page_keys(ns.digest, [parent])[0] if parent else b""
    eup = event_name(scheme, parent) if parent else b""
    out = []
    for key, ekey in zip(keys, events, strict=True):
        out.append(KeyedPage(key, up, ekey, eup))
        up, eup = key, ekey
    return out


def check_count(what: str, count: int) -> None:
    """A count of pages where -1 means "all": another negative is refused, never
    read as "all", since a caller's count that went below zero (an agreed length
    less the L2 hits) would otherwise publish or read pages nobody agreed on."""
    if count < -1:
        raise BadRequest(f"{what} must be -1 (all) or a count of pages, got {count}")


def check_sequence(what: str, keys: list[bytes], parent: bytes) -> None:
    """Keys that follow one another in one sequence, after ``parent`` (empty:
    none or unknown): each differs from the others and from ``parent``, and
    ``parent`` is no longer than a key may be."""
    if len(parent) > MAX_KEY_BYTES:
        raise BadRequest(f"parent must be at most {MAX_KEY_BYTES} bytes")
    named = set(keys)
    if len(named) != len(keys) or parent in named:
        raise BadRequest(
            f"keys of one {what} must differ from each other and from parent: they follow "
            "one another in one sequence"
        )


def token_ids(tokens: bytes, start: int, end: int) -> list[int]:
    """Token ids ``start:end`` of a packed (uint32 LE) sequence."""
    return np.frombuffer(tokens, dtype="<u4")[start:end].tolist()
