"""L2 allocation: slots for new pages, LRU eviction across page sizes, and the
slots on their way back.

Synchronous and free of I/O. The pool (pool.py) hands out slots; the page
indexes (index.py, one per page size, on one shared recency clock) say which
pages to evict. This module decides how many: an allocation evicts at most
as many pages as it asked slots for. An evicted page that keeps its slot for
a while (its write-back to L3 is in flight) counts against that budget, so
the request stops short and the caller answers ``pool_full``; it never
empties the index to serve one request. Slots on their way back (write-backs
in flight, quarantined slots of expired write leases) are not counted as
coming back: a hung L3 store or a long quarantine must not starve L2, and
the write queue's bound (storage.queue_pages) caps what write-backs hold.

What happens to an evicted page (freed at once, or held for a write-back) is
the cache's policy: it is handed to ``on_evict``, which frees each slot or
``hold``s it until its write-back ends.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

from hicached.index import PageIndex
from hicached.pool import SlotPool

Victims = list[tuple[bytes, int, int]]  # (key, slot, owner namespace id)


class L2:
    """The pool's slots and the page indexes that order their eviction."""

    def __init__(self, pool: SlotPool, on_evict: Callable[[Victims], None]) -> None:
        self.pool = pool
        self.indexes: dict[int, PageIndex] = {}  # page_bytes -> index
        self._clock = itertools.count(1)  # one recency clock for every index
        self._on_evict = on_evict
        self.returning: dict[int, int] = {}  # page_bytes -> slots held on their way back
        self._quarantine: collections.deque[tuple[float, int, int]] = collections.deque()
        self.evicted_pages = 0
        self.reclaimed_slabs = 0

    def index(self, page_bytes: int) -> PageIndex:
        index = self.indexes.get(page_bytes)
        if index is None:
            index = self.indexes[page_bytes] = PageIndex(self._clock)
        return index

    @property
    def pages(self) -> int:
        return sum(index.pages for index in self.indexes.values())

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
        self.pool.free(slot, size)

    def quarantine(self, slots: list[int], until: float) -> None:
        """Slots a late client copy may still reach: reused only after ``until``."""
        for slot in slots:
            self.hold(slot)
            self._quarantine.append((until, slot, self.pool.allocated[slot]))

    @property
    def quarantined(self) -> int:
        return len(self._quarantine)

    def release_quarantine(self, now: float) -> int:
        """Free the quarantined slots whose time is up; returns how many."""
        q = self._quarantine
        n = 0
        while q and q[0][0] <= now:
            _, slot, _ = q.popleft()
            self.give_back(slot)
            n += 1
        return n

    # -- allocation ------------------------------------------------------------------

    def alloc(self, index: PageIndex, page_bytes: int, count: int) -> list[int]:
        """Up to ``count`` free slots of ``page_bytes``, evicting LRU pages of ``index``.

        Pages of every size compete by recency: when the least recently used
        page is of another size, that size gives back a whole slab (its LRU
        pages go until one of its slabs is empty), so no page size can hold
        the pool against another forever.
        """
        pool = self.pool
        out: list[int] = []
        budget = count  # pages this request may evict of its own size
        reclaim = True  # give up taking slabs once an attempt frees none
        while len(out) < count:
            slot = pool.alloc(page_bytes)
            if slot is not None:
                out.append(slot)
                continue
            other = self._other_size_to_reclaim(index) if reclaim else None
            if other is not None:
                reclaim = self._reclaim_slab(other)
                continue
            want = min(budget, count - len(out))
            if want <= 0:
                break
            victims = index.evict(want, pool.pins)
            if not victims:
                break
            budget -= len(victims)
            self._evicted(victims)
        return out

    def _evicted(self, victims: Victims) -> None:
        self.evicted_pages += len(victims)
        self._on_evict(victims)

    def _other_size_to_reclaim(self, own: PageIndex) -> int | None:
        """The other page size whose LRU page is older than all of ``own``'s
        (any with pages, when ``own`` has none), or None."""
        if len(self.indexes) < 2:
            return None
        best = own.oldest()
        choice = None
        for page_bytes, index in self.indexes.items():
            if index is own or not self.pool.slabs_of(page_bytes):
                continue
            tick = index.oldest()
            if tick is not None and (best is None or tick < best):
                best, choice = tick, page_bytes
        return choice

    def _reclaim_slab(self, page_bytes: int) -> bool:
        """Evict LRU pages of ``page_bytes`` until one of its slabs is free; bounded
        by two slabs' worth of pages. True if a slab came back."""
        pool, index = self.pool, self.indexes[page_bytes]
        before = pool.free_slabs
        budget = 2 * max(1, pool.slots_per_slab(page_bytes))
        while pool.free_slabs == before and budget > 0:
            victims = index.evict(min(budget, 64), pool.pins)
            if not victims:
                break
            budget -= len(victims)
            self._evicted(victims)
        if pool.free_slabs > before:
            self.reclaimed_slabs += 1
            return True
        return False
