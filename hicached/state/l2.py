"""L2 allocation: slots for new pages, LRU eviction across page sizes and
tenants, per-tenant quotas, and the slots on their way back.

Synchronous and free of I/O. The pool (state/pool.py) hands out slots; the page
indexes (state/index.py, one per tenant and page size, on one shared recency clock)
say which pages to evict. This module decides how many: an allocation evicts
at most as many pages as it asked slots for. An evicted page that keeps its
slot for a while (its write-back to L3 is in flight) counts against that
budget, so the request stops short and the caller answers ``pool_full``; it
never empties the index to serve one request. Slots on their way back
(write-backs in flight, quarantined slots of expired write leases) are not
counted as coming back: a hung L3 store or a long quarantine must not starve
L2, and the write queue's bound (storage.queue_pages) caps what write-backs hold.

Tenants: every slot given out is charged to one tenant (its ``TenantBook``)
until it is free again, whether it holds an indexed page, waits to be filled
under a lease, or is on its way back. A tenant with a quota (``max_slots``,
``max_bytes``) that would go past it evicts its own least recently used
unpinned pages first, and gets no more than fits: its pressure never evicts
another tenant's page. When the pool itself is full, pages of every tenant
compete by recency, as pages of every size do; quotas that add up to no more
than the pool (in whole slabs per page size) keep that from happening.

Tenant arenas (``use_arenas``): where each tenant's pages live in an arena of
their own (state/pool.py ``partition``), a tenant's slots come from its arena
only, and when its arena is full its own least recently used pages make way:
tenants never compete, the arena's size bounds the tenant as a quota does. A
tenant without an arena gets no slot.

What happens to an evicted page (freed at once, or held for a write-back) is
the cache's policy: it is handed to ``on_evict``, which frees each slot or
``hold``s it until its write-back ends.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from hicached.state.index import PageIndex
from hicached.state.keyindex import KeyIndex
from hicached.state.pool import NO_ARENA, SlotPool

Victims = list[tuple[bytes, int, int]]  # (key, slot, owner namespace id)
# The radix tree of token namespaces, or the key table of key-addressed ones.
Index = PageIndex | KeyIndex

DEFAULT_TENANT = "default"

# Pages evicted per step when tenants compete by recency: small enough that the
# order across their indexes stays close to one LRU order.
_STEP = 16


class TenantBook:
    """One tenant's part of L2: its page indexes, the slots charged to it, its quota
    (0 = none) and what happened to its pages."""

    __slots__ = (
        "arena",
        "asked",
        "bytes",
        "evicted",
        "hits",
        "indexes",
        "max_bytes",
        "max_slots",
        "name",
        "quota_evicted",
        "slots",
    )

    def __init__(self, name: str, max_slots: int = 0, max_bytes: int = 0, arena: int = 0) -> None:
        self.name = name
        self.arena = arena  # the pool's arena its slots come from (state/pool.py)
        # (page_bytes, keyed) -> this tenant's index of token or key-addressed pages
        self.indexes: dict[tuple[int, bool], Index] = {}
        self.slots = 0  # slots charged: indexed, under a lease, on their way back
        self.bytes = 0
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self.evicted = 0  # its pages evicted, for any reason
        self.quota_evicted = 0  # of those, evicted to keep it within its quota
        self.hits = 0  # pages its matches found in L2
        self.asked = 0  # pages its matches asked for

    @property
    def pages(self) -> int:
        return sum(index.pages for index in self.indexes.values())

    def over(self, page_bytes: int, more: int) -> tuple[int, int]:
        """By how many slots and bytes ``more`` slots of ``page_bytes`` would pass
        the quota (each <= 0 when they fit)."""
        slots = self.slots + more - self.max_slots if self.max_slots else 0
        size = self.bytes + more * page_bytes - self.max_bytes if self.max_bytes else 0
        return slots, size

    def room(self, page_bytes: int) -> int | None:
        """Slots of ``page_bytes`` the quota still allows; None without a quota."""
        room = None
        if self.max_slots:
            room = self.max_slots - self.slots
        if self.max_bytes:
            fit = (self.max_bytes - self.bytes) // page_bytes
            room = fit if room is None else min(room, fit)
        return None if room is None else max(0, room)


class L2:
    """The pool's slots, who holds them, and the page indexes that order their eviction."""

    def __init__(self, pool: SlotPool, on_evict: Callable[[Victims], None]) -> None:
        self.pool = pool
        self.books: dict[str, TenantBook] = {}
        self._holder: dict[int, TenantBook] = {}  # allocated slot -> tenant charged
        self._clock = itertools.count(1)  # one recency clock for every index
        self._on_evict = on_evict
        self.returning: dict[int, int] = {}  # page_bytes -> slots held on their way back
        # (until, slot, size), soonest first: a heap, as release times need not come in order
        self._quarantine: list[tuple[float, int, int]] = []
        self.evicted_pages = 0
        self.reclaimed_slabs = 0
        # hears every slot freed (the pool journal's records, cache/journal.py)
        self.on_free: Callable[[int], None] | None = None
        self._arena_of: dict[str, int] | None = None  # with tenant arenas: tenant -> arena

    def book(self, tenant: str = DEFAULT_TENANT) -> TenantBook:
        book = self.books.get(tenant)
        if book is None:
            book = self.books[tenant] = TenantBook(tenant, arena=self._arena(tenant))
        return book

    def use_arenas(self, arenas: dict[str, tuple[int, int]]) -> None:
        """Give each tenant an arena of the pool, tenant -> (first byte, bytes);
        a tenant not named gets none. Before any slot is given out."""
        names = list(arenas)
        self.pool.partition([arenas[name] for name in names])
        self._arena_of = {name: i for i, name in enumerate(names)}
        for book in self.books.values():
            book.arena = self._arena(book.name)

    def _arena(self, tenant: str) -> int:
        if self._arena_of is None:
            return 0
        return self._arena_of.get(tenant, NO_ARENA)

    def index(self, page_bytes: int, tenant: str = DEFAULT_TENANT, keyed: bool = False) -> Index:
        """The index of ``tenant``'s pages of ``page_bytes`` (key-addressed ones: ``keyed``)."""
        indexes = self.book(tenant).indexes
        index = indexes.get((page_bytes, keyed))
        if index is None:
            made = KeyIndex(self._clock) if keyed else PageIndex(self._clock)
            index = indexes[page_bytes, keyed] = made
        return index

    def indexes(self, page_bytes: int | None = None) -> Iterator[Index]:
        """Every tenant's index (of ``page_bytes`` only, when given)."""
        for book in self.books.values():
            for (size, _), index in book.indexes.items():
                if page_bytes is None or size == page_bytes:
                    yield index

    @property
    def pages(self) -> int:
        return sum(index.pages for index in self.indexes())

    def free(self, slot: int, page_bytes: int | None = None) -> None:
        """Return a slot to the pool; its tenant is no longer charged for it."""
        size = self.pool.allocated.get(slot)
        self.pool.free(slot, page_bytes)  # raises on a double free, before any books change
        book = self._holder.pop(slot, None)
        if book is not None and size is not None:
            book.slots -= 1
            book.bytes -= size
        if self.on_free is not None:
            self.on_free(slot)

    def charge(self, book: TenantBook, slots: list[int], page_bytes: int) -> None:
        """Charge allocated ``slots`` to ``book``'s tenant (slots the pool adopted)."""
        holder = self._holder
        for slot in slots:
            holder[slot] = book
        book.slots += len(slots)
        book.bytes += len(slots) * page_bytes

    def holder(self, slot: int) -> TenantBook | None:
        return self._holder.get(slot)

    # -- slots held on their way back --------------------------------------------

    def hold(self, slot: int) -> None:
        """``slot`` left the index but is not free yet (a write-back reads it)."""
        size = self.pool.allocated[slot]
        self.returning[size] = self.returning.get(size, 0) + 1

    def unhold(self, slot: int) -> None:
        """A held slot stays allocated after all (its write was not queued)."""
        self.returning[self.pool.allocated[slot]] -= 1

    def give_back(self, slot: int) -> None:
        """A held slot is free now."""
        size = self.pool.allocated[slot]
        self.returning[size] -= 1
        self.free(slot, size)

    def quarantine(self, slots: list[int], until: float) -> None:
        """Slots a late client copy may still reach: reused only after ``until``."""
        for slot in slots:
            self.hold(slot)
            heapq.heappush(self._quarantine, (until, slot, self.pool.allocated[slot]))

    @property
    def quarantined(self) -> int:
        return len(self._quarantine)

    def release_quarantine(self, now: float) -> int:
        """Free the quarantined slots whose time is up; returns how many."""
        q = self._quarantine
        n = 0
        while q and q[0][0] <= now:
            _, slot, _ = heapq.heappop(q)
            self.give_back(slot)
            n += 1
        return n

    # -- allocation ------------------------------------------------------------------

    def alloc(self, book: TenantBook, page_bytes: int, count: int) -> list[int]:
        """Up to ``count`` free slots of ``page_bytes`` for ``book``'s tenant.

        Within its quota first: past it, the tenant's own least recently used
        pages go (at most ``count`` of them) and it gets only what fits. Then
        from the pool: pages of every size and tenant compete by recency; when
        the least recently used page is of another size, that size gives back
        a whole slab (its LRU pages go until one of its slabs is empty), so no
        page size can hold the pool against another forever.
        """
        if book.max_slots or book.max_bytes:
            count = self._within_quota(book, page_bytes, count)
        pool = self.pool
        out: list[int] = []
        budget = count  # pages this request may evict of its own size
        reclaim = True  # give up taking slabs once an attempt frees none
        arena = book.arena
        if arena == NO_ARENA:
            return []
        while len(out) < count:
            slot = pool.alloc(page_bytes, arena)
            if slot is not None:
                out.append(slot)
                continue
            other = self._other_size_to_reclaim(page_bytes, arena) if reclaim else None
            if other is not None:
                reclaim = self._reclaim_slab(other, arena)
                continue
            want = min(budget, count - len(out))
            if want <= 0:
                break
            evicted = self._evict_lru(page_bytes, want, arena)
            if not evicted:
                break
            budget -= evicted
        holder = self._holder
        for slot in out:
            holder[slot] = book
        book.slots += len(out)
        book.bytes += len(out) * page_bytes
        return out

    def _within_quota(self, book: TenantBook, page_bytes: int, count: int) -> int:
        """Evict the tenant's own LRU pages until ``count`` more slots fit its quota
        (at most ``count`` pages); returns how many fit now."""
        budget = count
        while budget > 0:
            slots, size = book.over(page_bytes, count)
            if slots <= 0 and size <= 0:
                break
            index, each = self._oldest(_sized(book.indexes))
            if index is None:
                break  # all it holds is leased or on its way back
            want = min(budget, max(slots, -(-size // each)))
            victims = index.evict(want, self.pool.pins)
            if victims:
                budget -= len(victims)
                book.quota_evicted += len(victims)
                self._evicted(victims)
        room = book.room(page_bytes)
        return count if room is None else min(count, room)

    def enforce(self, book: TenantBook) -> int:
        """Bring a tenant within a quota lowered at run time: as many of its least
        recently used unpinned pages go as it holds too many slots (a page on
        its way back stays charged until its slot is free); returns how many went."""
        slots, size = book.over(1, 0)
        evicted = 0
        while slots > 0 or size > 0:
            index, each = self._oldest(_sized(book.indexes))
            if index is None:
                break  # what is left is leased or on its way back
            want = max(1, min(64, max(slots, -(-size // each))))
            victims = index.evict(want, self.pool.pins)
            if not victims:
                continue  # that index holds only pinned pages (it has no entry left)
            slots -= len(victims)
            size -= len(victims) * each
            evicted += len(victims)
            book.quota_evicted += len(victims)
            self._evicted(victims)
        return evicted

    def _oldest(self, indexes: Iterator[tuple[int, Index]]) -> tuple[Index | None, int]:
        """The index whose least recently used leaf is oldest, and its page size."""
        best, choice, size = None, None, 0
        for page_bytes, index in indexes:
            tick = index.oldest()
            if tick is not None and (best is None or tick < best):
                best, choice, size = tick, index, page_bytes
        return choice, size

    def _in_arena(self, page_bytes: int, arena: int) -> Iterator[Index]:
        """The indexes of ``page_bytes`` of the tenants whose slots come from ``arena``."""
        for book in self.books.values():
            if book.arena != arena:
                continue
            for (size, _), index in book.indexes.items():
                if size == page_bytes:
                    yield index

    def _evict_lru(self, page_bytes: int, count: int, arena: int = 0) -> int:
        """Evict up to ``count`` pages of ``page_bytes``, least recently used first
        over the indexes of that size of every tenant of ``arena``; returns how
        many went."""
        done = 0
        candidates = [(page_bytes, index) for index in self._in_arena(page_bytes, arena)]
        while done < count:
            index, _ = self._oldest(iter(candidates))
            if index is None:
                break
            step = count - done if len(candidates) == 1 else min(_STEP, count - done)
            victims = index.evict(step, self.pool.pins)
            if victims:
                done += len(victims)
                self._evicted(victims)
        return done

    def _evicted(self, victims: Victims) -> None:
        self.evicted_pages += len(victims)
        self._on_evict(victims)

    def _other_size_to_reclaim(self, page_bytes: int, arena: int = 0) -> int | None:
        """The other page size (in ``arena``) whose LRU page is older than every
        page of ``page_bytes`` (any with pages, when it has none), or None."""
        sizes = {
            size for book in self.books.values() if book.arena == arena for size, _ in book.indexes
        }
        if len(sizes) < 2:
            return None
        oldest = [index.oldest() for index in self._in_arena(page_bytes, arena)]
        best = min((tick for tick in oldest if tick is not None), default=None)
        choice = None
        for size in sizes:
            if size == page_bytes or not self.pool.slabs_of(size, arena):
                continue
            for index in self._in_arena(size, arena):
                tick = index.oldest()
                if tick is not None and (best is None or tick < best):
                    best, choice = tick, size
        return choice

    def _reclaim_slab(self, page_bytes: int, arena: int = 0) -> bool:
        """Evict LRU pages of ``page_bytes`` (in ``arena``) until one of its slabs
        there is free; bounded by two slabs' worth of pages. True if a slab came back."""
        pool = self.pool
        before = pool.free_slabs_in(arena)
        budget = 2 * max(1, pool.slots_per_slab(page_bytes))
        while pool.free_slabs_in(arena) == before and budget > 0:
            evicted = self._evict_lru(page_bytes, min(budget, 64), arena)
            if not evicted:
                break
            budget -= evicted
        if pool.free_slabs_in(arena) > before:
            self.reclaimed_slabs += 1
            return True
        return False


def _sized(indexes: dict[tuple[int, bool], Index]) -> Iterator[tuple[int, Index]]:
    """(page_bytes, index) for each of a tenant's indexes."""
    for (size, _), index in indexes.items():
        yield size, index
