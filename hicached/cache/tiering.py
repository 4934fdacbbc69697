"""Tiering: which pages go from L2 to L3, and what events say of L3.

The cache decides *what* moves; the tier (daemon/tier.py, behind the
``TierPort`` the cache is given) does the moving. The write policy
(cache/policy.py) says *when* a page goes; this module does the rest:

- a write holds its page's slot (pinned, or kept out of the free list after
  an eviction) until the backend is done with it, so splitting or evicting
  index nodes never loses or corrupts one; ``writing`` has the keys in flight;
- write_back writes a page that leaves L2 unwritten, and the pages before it
  that L3 lacks, nearest first (``_write_ancestors``);
- a page L3 lets go of while it stays in L2 is written again at most once a
  stay in L2, and never while L3 proves smaller than L2 (``forget_l3``);
- the L3 BlockStored of a page goes out after its parent's (``ChainOrder``),
  naming the page as the engine does, with the parent and token ids its
  ``Origin`` keeps while the page is in L2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from hicached.cache import eventlog
from hicached.cache.chainorder import ChainOrder
from hicached.cache.sessions import KeyedPage, Lease, NamespaceState
from hicached.cache.writes import token_ids
from hicached.state.pool import GEN_GRANULE
from hicached.wire.hashing import TOKEN_BYTES

if TYPE_CHECKING:
    from hicached.cache.desk import Cache

# keys let go of during the startup scan (and between the tries of a failed one)
# that it remembers (16-32 bytes each); past this the scan stops learning, and
# lookups ask the store
SCAN_FORGOTTEN_MAX = 1 << 20

__all__ = ["HeldEvent", "InBoth", "Origin", "TierPort", "Tiering"]


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

    def lookup(self, ns: bytes, keys: list[bytes], answer: Callable[[int], None]) -> None:
        """Ask the store how many leading ``keys`` it holds; those it holds are
        learned (unless it let go of pages meanwhile), and ``answer`` is told."""
        ...

    @property
    def down(self) -> bool:
        """The store is marked down (its breaker is open): no read of it can be
        served now, so no page is reported as found there."""
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
    ns: NamespaceState


def _held_bytes(event: HeldEvent) -> int:
    """What a held event takes, as the event queue counts its events."""
    return eventlog.EVENT_BYTES + eventlog.KEY_BYTES + eventlog.TOKEN_BYTES * len(event.tokens)


@dataclass(slots=True)
class InBoth:
    """An L2 page that L3 holds too: where it is, and when L3 took it."""

    ns: NamespaceState
    slot: int
    at: int  # bytes L3 had acknowledged when it took the page (-1: unknown)
    rewritten: bool  # written again in this stay in L2 after L3 let it go


class Tiering:
    """L3 writes, rewrites and write-backs, and the L3 events of pages."""

    def __init__(self, desk: Cache) -> None:
        self.desk = desk
        config = desk.config
        self.medium = config.storage.backend.upper()  # what L3 events call the tier
        self.writing: set[bytes] = set()  # keys with an L3 write in flight
        self.hits: dict[bytes, int] = {}  # write_through_selective: matches per key
        self.counters: dict[str, int] = {}
        # With events and an L3 tier: each L2 page's parent and token ids, for the
        # BlockStored of its L3 write whenever it happens (the index keeps keys only).
        self.origins: dict[bytes, Origin] = {}
        # L3 BlockStored events that wait for their parent's: a chain's go out parent first
        # (within the event queue's bounds: each carries its page's token ids)
        self.order: ChainOrder[HeldEvent] = ChainOrder(
            config.events.queue_events,
            self._publish,
            max_bytes=config.events.queue_mib << 20,
            size=_held_bytes,
        )
        # L2 pages that L3 holds too, as far as this daemon wrote or read them: what
        # a rewrite needs when L3 lets one go while it stays in L2.
        self.both: dict[bytes, InBoth] = {}
        self.taken = 0  # bytes L3 has acknowledged since the start
        self.undersized = False  # L3 lets go of pages sooner than L2 does
        # L2 pages L3 let go of that are not written again in this stay in L2
        self.let_go: set[bytes] = set()
        self.drops = 0  # calls that told of pages L3 let go of (lookups compare)
        # while the startup scan lists L3, and between tries of a failed one: the
        # keys L3 let go of meanwhile, which a listing may still name
        # (``scan_may_learn``); None when no scan runs or is to be tried again
        self._scan_forgotten: set[bytes] | None = None
        self.scan_overflow = False  # more let go of during the scan than it remembers
        # keys L3 told of letting go while a write of them was in flight: that
        # write's acknowledgement may come after the store let go of what it wrote
        # (a store that answers a call before the call's waiter runs: the memory
        # store evicting it for a later call), so it does not make them known
        self.lost_writing: set[bytes] = set()

    def count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    def bound_for_l3(self, key: bytes) -> bool:
        """L3 holds page ``key``, or a write carries it there."""
        return key in self.desk.l3 or key in self.writing

    # -- pages entering and leaving L2 ----------------------------------------------

    def token_origins(
        self, keys: list[bytes], slots: list[int], start: int, tokens: bytes, page_tokens: int
    ) -> None:
        """Keep what the L3 events (and write-backs) of token pages ``start..`` of
        a sequence stored in ``slots`` will need: nothing without events, or
        without an L3 store configured (an adopted pool's pages come before
        the store opens, so the config says, not the tier)."""
        if not self.desk.events.enabled or not self.desk.config.storage.backend:
            return
        step = page_tokens * TOKEN_BYTES
        origins = self.origins
        for i in range(start, len(keys)):
            up = keys[i - 1] if i else None
            origins[keys[i]] = Origin(up, up, tokens[i * step : (i + 1) * step], slots[i])

    def keyed_origins(self, pages: list[KeyedPage], slots: list[int]) -> None:
        """The same for key-addressed pages: each names its parent."""
        if not self.desk.events.enabled or not self.desk.config.storage.backend:
            return
        origins = self.origins
        for page, slot in zip(pages, slots, strict=True):
            origins[page.key] = Origin(page.parent or None, page.eparent or None, b"", slot)

    def in_both(self, ns: NamespaceState, keys: list[bytes], slots: list[int]) -> None:
        """Pages now in L2 that L3 holds (read from it, or written before), at an
        age in L3 this daemon does not know."""
        l3, both = self.desk.l3, self.both
        for key, slot in zip(keys, slots, strict=True):
            if key in l3:
                both[key] = InBoth(ns, slot, -1, False)

    def left_l2(self, ns: NamespaceState, key: bytes, slot: int, write_back: bool) -> bool:
        """Page ``key`` was evicted from ``slot``: forget what L3 needed of it
        while in L2; under write_back, write it (and its ancestors) if L3 lacks
        it. True when a write now holds the slot."""
        self.hits.pop(key, None)
        origin = self.origins.pop(key, None) if self.origins else None
        self.both.pop(key, None)
        self.let_go.discard(key)
        written = False
        if write_back and key not in self.desk.l3 and key not in self.writing:
            # the page leaving L2 first: the queue's room is its before its ancestors'
            written = self.write(ns, key, slot, origin, evicted=True)
            if written and origin is not None:
                self._write_ancestors(ns, origin)
        if key not in self.writing:
            self.order.orphan(key)  # no L3 event of it is on its way
        return written

    def _write_ancestors(self, ns: NamespaceState, origin: Origin) -> None:
        """write_back: the pages before a page on its way to L3 that L2 still
        holds and L3 lacks go too (as the write queue has room), so L3 holds its
        prefix; its event waits for theirs (``_stored``). Nearest first, and
        no further than the first the queue refuses: each step costs one lookup,
        so a full queue costs one refused write an eviction, not a walk."""
        up, origins, l3, writing = origin.up, self.origins, self.desk.l3, self.writing
        for _ in range(self.desk.config.server.max_pages_per_request):
            if up is None or up in l3 or up in writing:
                return
            above = origins.get(up)  # an origin is kept while its page is in L2
            if above is None or not self.write(ns, up, above.slot):
                return
            up = above.up

    # -- writes --------------------------------------------------------------------------

    def count_hit(self, ns: NamespaceState, keys: list[bytes], slots: list[int]) -> None:
        """write_through_selective: a prefix matched often enough goes to L3.

        Only the deepest page of each match is counted: its prefix is matched
        at least as often, and is written along with it.
        """
        last = keys[-1]
        if last in self.desk.l3:
            return
        count = self.hits.get(last, 0) + 1
        if count < self.desk.config.storage.selective_hits:
            self.hits[last] = count
            return
        self.hits.pop(last, None)
        self.write_pages(ns, keys, slots)

    def write_pages(self, ns: NamespaceState, keys: list[bytes], slots: list[int]) -> None:
        """Write the pages L3 lacks, but those it let go of in this stay in L2 that
        are not to be written again (``forget_l3``); those it holds are noted as
        held by both tiers."""
        l3, writing, let_go, both = self.desk.l3, self.writing, self.let_go, self.both
        for key, slot in zip(keys, slots, strict=True):
            if key in l3:
                if key not in both:
                    both[key] = InBoth(ns, slot, -1, False)
            elif key in let_go:
                self.count("rewrite_skipped")
            elif key not in writing:
                self.write(ns, key, slot)

    def write(
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
        keeps, after its parent's own (``_stored``).
        """
        desk = self.desk
        tier = desk.tier
        assert tier is not None
        if origin is None:
            origin = self.origins.get(key)
        spec = ns.spec
        named = ns.kind.l3_name(key)
        if evicted:
            desk.l2.hold(slot)
        else:
            desk.pool.pin([slot])
        self.writing.add(key)
        ns.open += 1

        def done(ok: bool) -> None:
            self.writing.discard(key)
            self.count("written" if ok else "write_failed")
            doubt = False
            if key in self.lost_writing:
                self.lost_writing.discard(key)
                if ok:  # the store let go of it before this acknowledgement came
                    self.count("written_let_go")
                    self.taken += spec.page_bytes
                    ok, doubt = False, True
            if ok:
                desk.l3.add(key)
                self.taken += spec.page_bytes
                if not evicted:
                    self.both[key] = InBoth(ns, slot, self.taken, rewrite)
                if named is not None:
                    self._stored(key, named, origin, ns)
            else:
                self.order.orphan(key)  # those waiting for it go out as they are
                if evicted:
                    desk.keyed.l3_forgotten((key,))
            if evicted:
                desk.l2.give_back(slot)
            else:
                ns.index.unpinned(desk.pool.unpin([slot]))
            ns.open -= 1
            desk.names.forget_if_unused(ns)
            if doubt:
                # What the store let go of may have been an older copy (a recycled
                # segment, a damaged record read meanwhile), and then it holds the
                # page this write stored: not known, a complete index would answer
                # it as absent for good. The store is asked; what it holds is learned.
                tier.lookup(ns.digest, [key], _unheard)

        if tier.write(ns, key, slot, done):
            return True
        self.writing.discard(key)
        ns.open -= 1
        self.count("write_not_queued")
        if evicted:
            desk.l2.unhold(slot)
        else:
            ns.index.unpinned(desk.pool.unpin([slot]))
        self.order.orphan(key)
        return False

    def _stored(self, key: bytes, named: bytes, origin: Origin | None, ns: NamespaceState) -> None:
        """The L3 BlockStored of page ``key``: now, or once its parent's went out
        when the parent's write is in flight (write_back sends a page's
        ancestors ahead of it, ``_write_ancestors``), so a chain's events go out
        parent first. At most ``events.queue_events`` wait; past that the
        longest waiting go out as they are."""
        if not self.desk.events.enabled:
            return
        tokens = token_ids(origin.tokens, 0, ns.spec.page_tokens) if origin else []
        event = HeldEvent(named, origin.eparent if origin else None, tokens, ns)
        up = origin.up if origin is not None else None
        coming = up is not None and (up in self.writing or self.order.holds(up))
        self.order.add(key, up, event, coming=coming)

    def _publish(self, event: HeldEvent) -> None:
        ns = event.ns
        ns.kind.stored_one(ns, event.key, event.parent, event.tokens, self.medium)

    # -- what L3 holds -------------------------------------------------------------------

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
        pages written last, and ``undersized`` says so until L3 lets go of
        pages L2 no longer holds.
        """
        desk = self.desk
        self.drops += 1
        keys = list(keys)
        forgotten = self._scan_forgotten
        if forgotten is not None:
            if len(forgotten) + len(keys) > SCAN_FORGOTTEN_MAX:
                self.scan_overflow = True
            else:
                forgotten.update(keys)
        order = self.order
        if order:
            writing = self.writing
            for key in keys:  # known or not: an event still held must not follow the drop
                order.drop(key, coming=key in writing)
        l3 = desk.l3
        self.lost_writing.update(key for key in keys if key in self.writing)
        gone = [key for key in keys if key in l3]
        for key in gone:
            l3.discard(key)
        ns_of = desk.names.by_digest.get(ns_digest)
        kind = ns_of.kind if ns_of is not None else desk.tokens  # unknown: the keys as they are
        named = kind.event_keys(gone)
        left = desk.keyed.l3_let_go(gone)  # event names of key-addressed pages outside L2
        if left and kind is desk.keyed:
            named, left = [*named, *left], []
        model = desk.names.model_of(ns_digest)
        kind.removed(named, self.medium, model)
        desk.keyed.removed(left, self.medium, model)
        if not gone or desk.tier is None:
            return
        both = self.both
        found = [(key, both.pop(key)) for key in gone if key in both]
        if not desk.policy.rewrites:
            return  # written when it leaves L2, if at all
        l2_bytes = desk.pool.used_bytes
        taken = self.taken
        short = any(page.at >= 0 and taken - page.at <= l2_bytes for _, page in found)
        self.undersized = short
        rewritten = skipped = 0
        for key, page in found:
            if short or page.rewritten:
                self.let_go.add(key)  # not written again in this stay, by any path
                skipped += 1
            elif key not in self.writing:
                rewritten += self.write(page.ns, key, page.slot, rewrite=True)
        self.count("rewritten", rewritten)
        self.count("rewrite_skipped", skipped)

    def learn_l3(self, ns_digest: bytes, keys: list[bytes]) -> int:
        """A lookup found ``keys`` in L3: known from now on, and announced as the
        scan announces what it finds (it announces no key known before it);
        returns how many were not known."""
        l3 = self.desk.l3
        new = [key for key in keys if key not in l3]
        if new:
            l3.update(new)
            self.announce_l3(ns_digest, new)
        return len(new)

    def announce_l3(self, ns_digest: bytes, keys: list[bytes]) -> None:
        """The startup scan found ``keys`` in L3: one BlockStored for them, with no
        parent or token ids (the store keeps neither), and the namespace's
        page_tokens and model where it is registered, else 0 and ""."""
        ns = self.desk.names.by_digest.get(ns_digest)
        if ns is not None and not ns.kind.announces_scan:
            return
        size, model = (ns.spec.page_tokens, ns.spec.model) if ns is not None else (0, "")
        self.desk.events.stored(keys, None, [], size, self.medium, model)

    def scan_begins(self) -> None:
        """The startup scan starts listing L3: remember what L3 lets go of from now,
        on top of what it let go of since an earlier try began (a store may let go
        of a page and still list it: S3 keeps a bad object in place), unless that
        overflowed: a try then starts afresh."""
        if self._scan_forgotten is None or self.scan_overflow:
            self._scan_forgotten, self.scan_overflow = set(), False

    def scan_may_learn(self, key: bytes) -> bool:
        """Whether the scan may add ``key`` to what L3 holds: not if L3 let go of
        it since the scan began (a listing may name a page dropped after it was
        listed, and L3 would then be said to hold a page it lacks), and nothing
        more once more keys were let go of than are remembered."""
        forgotten = self._scan_forgotten
        return not self.scan_overflow and (forgotten is None or key not in forgotten)

    def scan_ends(self) -> None:
        """No scan follows (a listing ended, none is tried again, or the tier
        stops): what L3 let go of is no longer remembered for it."""
        self._scan_forgotten = None

    def unwritten_pages(self) -> list[tuple[NamespaceState, bytes, int, int]]:
        """Every L2 page that L3 lacks, no write is carrying and is to be written
        again (``_not_again``): (namespace, key, slot, the slot's generation
        now), in one go."""
        return [page for batch in self.unwritten_batches(1 << 62) for page in batch]

    def unwritten_batches(
        self, most: int
    ) -> Iterator[list[tuple[NamespaceState, bytes, int, int]]]:
        """``unwritten_pages`` in batches of at most ``most`` pages, for a caller
        that lets requests run between them (a million pages take about half a
        second to list). Each index's slots are taken first; each batch is read
        from the index when it is asked for, a page's key, slot and generation
        together, so ``write_back`` of it writes a slot's bytes under their own
        key. Pages stored after the start are not listed, pages gone since are
        left out, an index gone since ends its part. A batch may be empty."""
        desk = self.desk
        for index in list(desk.l2.indexes()):
            slots = index.slots()
            for start in range(0, len(slots), most):
                if not any(live is index for live in desk.l2.indexes()):
                    break
                l3, writing, namespaces = desk.l3, self.writing, desk.names.by_id
                let_go = self._not_again()
                gens = desk.pool.gens
                yield [
                    (namespaces[owner], key, slot, int(gens[slot // GEN_GRANULE]))
                    for key, slot, owner in index.pages_at(slots[start : start + most])
                    if key not in l3 and key not in writing and key not in let_go
                ]

    def _not_again(self) -> set[bytes] | frozenset[bytes]:
        """Pages L3 let go of that are not written again in this stay in L2, by
        any path, where the policy rewrites (``forget_l3``); where it does not
        (write_back, after a reload), a page leaving L2 is written all the
        same, and so is one the stop's flush finds."""
        return self.let_go if self.desk.policy.rewrites else frozenset()

    def write_back(self, pages: list[tuple[NamespaceState, bytes, int, int]]) -> int:
        """Queue writes of ``pages`` (from ``unwritten_pages``) that are still in L2
        and still unwritten; returns how many were queued."""
        queued = 0
        l3, gens, let_go = self.desk.l3, self.desk.pool.gens, self._not_again()
        for ns, key, slot, gen in pages:
            if key in l3 or key in self.writing or key in let_go:
                continue
            if int(gens[slot // GEN_GRANULE]) != gen and not ns.index.has(key, slot):
                continue  # freed since (or a neighbour in its granule was), perhaps reused
            queued += self.write(ns, key, slot)
        return queued


def _unheard(found: int) -> None:
    """The answer of a lookup nobody waits on (what it found is learned already)."""
