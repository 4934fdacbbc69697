"""The L2 index of key-addressed namespaces: pages named by the engine's own keys.

Synchronous, owned by the event-loop thread, no I/O. Engines that bring
their own page keys (docs/engines.md) ask about any run of keys, not only
runs that start a sequence, and may store a page whose predecessor is not in
L2 (a hole). So this index is a flat table, key -> page, where each page may
name its *parent* (the page before it in its sequence, when that page was in
L2 as it was stored). The parent links keep the prefix order the radix tree
keeps for token namespaces:

- a page with a child in L2 is not evicted before that child, so eviction
  takes sequences from their tails, least recently used first;
- a use (a match) marks every page it returns with one clock tick, as the
  radix tree does, so recency is comparable with the other indexes on the
  same clock (state/l2.py);
- every page without a child in L2 and without a pin has a heap entry for its
  current tick; stale entries are skipped, and ``unpinned`` or the loss of
  the last child pushes a page again.

Keys here are the daemon's keys (16 bytes, the engine key hashed under the
namespace digest, cache/desk.py), so namespaces never share one.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping, Sequence


class Entry:
    """One page: its slot, its namespace, its parent page and its children in L2."""

    __slots__ = ("alive", "children", "key", "owner", "parent", "queued", "slot", "tick")

    def __init__(self, key: bytes, slot: int, owner: int, parent: Entry | None, tick: int) -> None:
        self.key = key
        self.slot = slot
        self.owner = owner
        self.parent = parent
        self.children = 0
        self.tick = tick
        self.alive = True
        # the tick of this page's entry in the eviction heap, 0 when it has none:
        # an unpin that finds its entry still there pushes nothing
        self.queued = 0


class KeyIndex:
    """Which key-addressed pages are in L2, in which slots, and which to evict first."""

    def __init__(self, clock: Iterator[int] | None = None) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._by_slot: dict[int, Entry] = {}
        self._clock = clock if clock is not None else itertools.count(1)
        self._heap: list[tuple[int, int, Entry]] = []
        self._seq = itertools.count()

    @property
    def pages(self) -> int:
        return len(self._entries)

    # -- queries ---------------------------------------------------------------

    def present(self, keys: Sequence[bytes]) -> bytes:
        """Which of ``keys`` are in L2, a byte each (1: in L2); recency is left as it is."""
        return bytes(map(self._entries.__contains__, keys))

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of the leading run of ``keys`` that is in L2; marks them used."""
        return self.find(keys, leading=True)

    def find(self, keys: Sequence[bytes], *, leading: bool = False) -> list[int]:
        """The slot of each of ``keys`` (-1 where absent), holes and all, or of the
        leading run only; marks the pages found used."""
        entries = self._entries
        tick = next(self._clock)
        out: list[int] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                if leading:
                    break
                out.append(-1)
                continue
            entry.tick = tick
            out.append(entry.slot)
            # pages of a run need not be linked (holes, unknown parents): each
            # without children needs an entry for its new tick, not only the last
            if not entry.children:
                self._push(entry)
        return out

    def has(self, key: bytes, slot: int) -> bool:
        entry = self._by_slot.get(slot)
        return entry is not None and entry.key == key

    def slots(self) -> list[int]:
        """Every page's slot, now (a list: the index may change while it is used)."""
        return list(self._by_slot)

    def pages_at(self, slots: Sequence[int]) -> list[tuple[bytes, int, int]]:
        """(key, slot, owner) of the pages in ``slots`` now; slots no page holds
        are left out."""
        by_slot = self._by_slot
        return [
            (entry.key, slot, entry.owner)
            for slot in slots
            if (entry := by_slot.get(slot)) is not None
        ]

    def items(self) -> Iterator[tuple[bytes, int, int]]:
        """Every page as (key, slot, owner)."""
        for entry in self._entries.values():
            yield entry.key, entry.slot, entry.owner

    # -- updates ---------------------------------------------------------------

    def insert(self, key: bytes, slot: int, owner: int, parent: bytes = b"") -> bool:
        """Add a page; False if ``key`` is in L2 already (the caller keeps its slot)."""
        if key in self._entries:
            return False
        up = self._entries.get(parent) if parent else None
        entry = Entry(key, slot, owner, up, next(self._clock))
        if up is not None:
            up.children += 1
            # the parent was used as its child was stored: it is no older than it
            up.tick = entry.tick
        self._entries[key] = entry
        self._by_slot[slot] = entry
        self._push(entry)
        return True

    def oldest(self) -> int | None:
        """The clock tick of the least recently used evictable page, or None."""
        heap = self._heap
        while heap:
            tick, _, entry = heap[0]
            if entry.alive and not entry.children and entry.tick == tick:
                return tick
            heapq.heappop(heap)  # stale entry
        return None

    def evict(self, count: int, pins: Mapping[int, int]) -> list[tuple[bytes, int, int]]:
        """Remove up to ``count`` unpinned pages without children in L2, least
        recently used first; returns their (key, slot, owner), the caller frees them."""
        out: list[tuple[bytes, int, int]] = []
        while len(out) < count and self._heap:
            tick, _, entry = heapq.heappop(self._heap)
            if not entry.alive or entry.children or entry.tick != tick:
                continue  # stale entry
            if entry.slot in pins:
                entry.queued = 0  # out of the heap: unpinned() pushes it again
                continue
            parent = entry.parent  # _remove unlinks it
            self._remove(entry)
            out.append((entry.key, entry.slot, entry.owner))
            if parent is not None and parent.alive and not parent.children:
                self._push(parent)
        return out

    def drop_owner(self, owner: int, pins: Mapping[int, int]) -> list[tuple[bytes, int, int]]:
        """Remove every page of namespace ``owner``, unless a pin holds one of them
        (then all stay). Children go before their parents."""
        mine = [entry for entry in self._entries.values() if entry.owner == owner]
        if any(entry.slot in pins for entry in mine):
            return []
        # leaves first, then each parent as its last child goes: linear in pages
        leaves = [entry for entry in mine if not entry.children]
        out = []
        while leaves:
            entry = leaves.pop()
            parent = entry.parent
            self._remove(entry)
            out.append((entry.key, entry.slot, owner))
            if parent is not None and not parent.children:
                leaves.append(parent)
        return out

    def unpinned(self, slots: list[int]) -> None:
        """Slots lost their last pin: those pages without children are evictable again."""
        by_slot = self._by_slot
        for slot in slots:
            entry = by_slot.get(slot)
            # pushed only if eviction found it pinned and dropped its entry
            if entry is not None and not entry.children and entry.queued != entry.tick:
                self._push(entry)

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.key]
        del self._by_slot[entry.slot]
        entry.alive = False
        parent = entry.parent
        if parent is not None:
            parent.children -= 1
            entry.parent = None

    def _push(self, entry: Entry) -> None:
        heap = self._heap
        entry.queued = entry.tick
        heapq.heappush(heap, (entry.tick, next(self._seq), entry))
        if len(heap) > 2 * len(self._entries) + 1024:
            leaves = [e for e in self._entries.values() if not e.children]
            for e in leaves:
                e.queued = e.tick
            self._heap = [(e.tick, next(self._seq), e) for e in leaves]
            heapq.heapify(self._heap)
