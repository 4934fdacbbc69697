"""The L2 slot allocator: fixed-size page slots carved from slabs of one arena.

Synchronous and free of I/O; the arena's bytes live elsewhere (wire/arena.py).
A slot is named by its byte offset in the arena. Each page size is a *class*
that draws whole slabs from the arena; a slab goes back to the arena as soon
as all its slots are free again, so page sizes share the arena over time.

Slots are aligned to their page size across the whole arena, so a client can
view the arena as rows of ``page_bytes`` and copy many pages in one call
(row = offset // page_bytes). Pins count readers and writers of a slot; a
pinned slot is never freed (that is an assertion, not a policy).

Every allocated slot is recorded with its page size, so freeing a free slot,
or a slot as another size than it was given out with, is caught at once
(``SlotStateError``) instead of corrupting the free lists.

Generations: ``gens`` holds one counter per ``GEN_GRANULE`` bytes of the
arena, shared with every client through the pool file's header (wire/arena.py).
The counter of a slot's first granule is bumped whenever the slot is freed,
that is whenever it may next belong to another key. A client notes the
counters when it is handed a slot and checks them after copying out of it
(seqlock style): a copy that raced a reuse is reported as a miss, never as
bytes. Pages smaller than a granule share counters with their neighbours,
which can only cause spurious misses.

Arenas: a pool may be cut into arenas (``partition``), contiguous runs of whole
slabs, one per tenant where tenants' pages live in files of their own
(daemon/arenas.py). A slot is then drawn from one arena only, and a slab never
leaves its arena: a tenant's pages stay in its own file. Slots are aligned to
their page size from the start of their arena, so a client that maps only its
arena (``offset - start`` is its file offset) sees whole rows too. Unpartitioned,
the pool is one arena, the whole of it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

import numpy as np

from hicached.wire.arena import GEN_DTYPE, GEN_GRANULE, gen_count

_ZEROS = itertools.repeat(0)  # the default of each pop

try:  # what Counter counts with: mapping[x] = mapping.get(x, 0) + 1 for each x, in C
    from collections import _count_elements  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a Python without it: the same, in Python

    def _count_elements(mapping: dict[int, int], iterable: Iterable[int]) -> None:
        get = mapping.get
        for x in iterable:
            mapping[x] = get(x, 0) + 1


class SlotStateError(AssertionError):
    """A slot was freed that is not allocated, or freed as another page size."""


NO_ARENA = -1  # the arena of a tenant the pool gives nothing to


class _SizeClass:
    __slots__ = ("arena", "page_bytes", "partial", "slabs", "slots_per_slab", "used")

    def __init__(self, page_bytes: int, arena: int = 0) -> None:
        self.page_bytes = page_bytes
        self.arena = arena
        # slab id -> free slot offsets of that slab, highest first (pop gives the lowest)
        self.partial: dict[int, list[int]] = {}
        self.used = 0
        self.slabs = 0
        self.slots_per_slab = 0


class SlotPool:
    """Allocates page slots; knows nothing of keys, leases or the index."""

    def __init__(self, arena_bytes: int, slab_bytes: int, gens: np.ndarray | None = None) -> None:
        assert slab_bytes > 0 and arena_bytes >= slab_bytes, "arena must hold at least one slab"
        if gens is None:
            gens = np.zeros(gen_count(arena_bytes), dtype=GEN_DTYPE)
        assert len(gens) >= gen_count(arena_bytes), "one generation counter per granule"
        self.gens = gens
        self.arena_bytes = arena_bytes
        self.slab_bytes = slab_bytes
        self.n_slabs = arena_bytes // slab_bytes
        # per arena: its free slabs, a heap (lowest slab first), and its first byte
        self._free: list[list[int]] = [list(range(self.n_slabs))]
        self._starts = [0]
        self._ends = [self.n_slabs * slab_bytes]
        self._slab_class: list[_SizeClass | None] = [None] * self.n_slabs
        self._slab_used = [0] * self.n_slabs
        # (arena, page_bytes) -> that page size's slabs in that arena
        self._classes: dict[tuple[int, int], _SizeClass] = {}
        self.pins: dict[int, int] = {}
        self.allocated: dict[int, int] = {}  # slot offset -> its page size

    def partition(self, arenas: list[tuple[int, int]]) -> None:
        """Cut the pool into arenas of (first byte, bytes), each a whole number of
        slabs; arena ``i`` is the ``i``-th. Slabs outside every arena are never
        given out. Before any slot is."""
        assert not self.allocated, "a pool is partitioned before it gives out any slot"
        free: list[list[int]] = []
        end = 0
        for start, size in arenas:
            assert start % self.slab_bytes == 0 and size % self.slab_bytes == 0 and size > 0, (
                f"arena ({start}, {size}) is not whole slabs of {self.slab_bytes} bytes"
            )
            assert start >= end and start + size <= self.n_slabs * self.slab_bytes, (
                f"arena ({start}, {size}) overlaps another or passes the pool"
            )
            end = start + size
            free.append(list(range(start // self.slab_bytes, end // self.slab_bytes)))
        self._free = free
        self._starts = [start for start, _ in arenas]
        self._ends = [start + size for start, size in arenas]

    @property
    def arenas(self) -> int:
        """How many arenas the pool has (1 unless partitioned)."""
        return len(self._free)

    # -- allocation ------------------------------------------------------

    def alloc(self, page_bytes: int, arena: int = 0) -> int | None:
        """Offset of a free slot of ``page_bytes`` in ``arena``, or None when no slab
        of that arena has room (or there is no such arena: ``NO_ARENA``)."""
        cls = self._classes.get((arena, page_bytes))
        if cls is None:
            if not 0 <= arena < len(self._free):
                return None
            cls = self._classes[arena, page_bytes] = _SizeClass(page_bytes, arena)
        if not cls.partial and not self._carve(cls):
            return None
        slab, free = next(iter(cls.partial.items()))
        offset = free.pop()
        if not free:
            del cls.partial[slab]
        self._slab_used[slab] += 1
        cls.used += 1
        self.allocated[offset] = page_bytes
        return offset

    def bump(self, offset: int) -> None:
        """The slot changes hands without being freed (a page another process
        may still hold a write handle to is published): handles taken before
        now no longer match it."""
        self.gens[offset // GEN_GRANULE] += 1

    def free(self, offset: int, page_bytes: int | None = None) -> None:
        """Return a slot (given out for ``page_bytes``, when the caller knows it);
        its slab goes back to the arena when it is empty. Its generation moves on."""
        size = self.allocated.pop(offset, None)
        if size is None:
            raise SlotStateError(f"slot {offset} freed but not allocated (a double free?)")
        if (page_bytes is not None and size != page_bytes) or offset in self.pins:
            self.allocated[offset] = size
            why = "while pinned" if offset in self.pins else f"as {page_bytes} bytes"
            raise SlotStateError(f"slot {offset} of {size} bytes freed {why}")
        self.gens[offset // GEN_GRANULE] += 1
        slab = offset // self.slab_bytes
        cls = self._slab_class[slab]
        assert cls is not None and cls.page_bytes == size, f"slot {offset}: slab books disagree"
        self._slab_used[slab] -= 1
        cls.used -= 1
        if self._slab_used[slab] == 0:
            cls.partial.pop(slab, None)
            cls.slabs -= 1
            self._slab_class[slab] = None
            heapq.heappush(self._free[cls.arena], slab)
        else:
            cls.partial.setdefault(slab, []).append(offset)

    def _carve(self, cls: _SizeClass) -> bool:
        free = self._free[cls.arena]
        if not free:
            return False
        slab = heapq.heappop(free)
        base = slab * self.slab_bytes
        end = base + self.slab_bytes
        pb = cls.page_bytes
        start = self._starts[cls.arena]
        first = start + -(-(base - start) // pb) * pb  # aligned to the page size in its arena
        offsets = list(range(first, end - pb + 1, pb))
        assert offsets, f"slab of {self.slab_bytes} bytes holds no page of {pb} bytes"
        offsets.reverse()
        cls.partial[slab] = offsets
        cls.slots_per_slab = max(cls.slots_per_slab, len(offsets))
        self._slab_class[slab] = cls
        cls.slabs += 1
        return True

    def adopt(self, slots: dict[int, int]) -> set[int]:
        """Take ``slots`` (offset -> page size) as allocated, on a fresh pool: the
        pages a restarted daemon adopts (cache/adopt.py). A slot that does not
        fit the geometry (misaligned from its arena's start, outside every
        arena, or in a slab that another page size claims first) is refused;
        returns the refused offsets."""
        assert not self.allocated, "a pool adopts before it gives out any slot"
        refused: set[int] = set()
        by_slab: dict[int, dict[int, int]] = {}
        sizes: dict[int, int] = {}
        arena_of: dict[int, int] = {}  # slab -> its arena
        for offset, size in slots.items():
            slab = offset // self.slab_bytes
            base = slab * self.slab_bytes
            arena = arena_of.get(slab)
            if arena is None:
                arena = arena_of[slab] = self._arena_at(base)
            fits = size > 0 and arena >= 0 and slab < self.n_slabs
            if fits:
                start = self._starts[arena]
                first = start + -(-(base - start) // size) * size
                fits = (
                    (offset - start) % size == 0
                    and offset >= first
                    and offset + size <= min(base + self.slab_bytes, self._ends[arena])
                    and sizes.setdefault(slab, size) == size
                )
            if fits:
                by_slab.setdefault(slab, {})[offset] = size
            else:
                refused.add(offset)
        for slab, taken in by_slab.items():
            size = sizes[slab]
            base = slab * self.slab_bytes
            arena = self._arena_at(base)
            cls = self._classes.get((arena, size))
            if cls is None:
                cls = self._classes[arena, size] = _SizeClass(size, arena)
            start = self._starts[arena]
            first = start + -(-(base - start) // size) * size
            offsets = range(first, base + self.slab_bytes - size + 1, size)
            free = [offset for offset in reversed(offsets) if offset not in taken]
            if free:
                cls.partial[slab] = free
            cls.slots_per_slab = max(cls.slots_per_slab, len(offsets))
            self._slab_class[slab] = cls
            cls.slabs += 1
            cls.used += len(taken)
            self._slab_used[slab] = len(taken)
            self.allocated.update(taken)
        for free in self._free:
            free[:] = [slab for slab in free if slab not in by_slab]
            heapq.heapify(free)
        return refused

    def _arena_at(self, offset: int) -> int:
        """The arena holding byte ``offset`` of the pool, or -1."""
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if start <= offset < end:
                return i
        return -1

    # -- pins ------------------------------------------------------------

    def pin(self, offsets: list[int]) -> None:
        """Add one pin to each slot (a slot named twice gets two)."""
        if len(offsets) == 1:  # a token lease: its last page only
            offset = offsets[0]
            self.pins[offset] = self.pins.get(offset, 0) + 1
        else:  # a keyed lease's pages in one pass at C speed (Counter's counting)
            _count_elements(self.pins, offsets)

    def unpin(self, offsets: list[int]) -> list[int]:
        """Drop one pin from each slot; returns the slots no longer pinned."""
        pins = self.pins
        if len(offsets) > 1:
            # the common case, a lease whose slots no other pin holds: every
            # count is 1, and they all go in one pass at C speed. Otherwise the
            # counts go back and the loop below runs: a slot named twice came
            # out whole at its first name (0 at the next), a slot without a
            # pin (a broken invariant) makes the loop's KeyError
            counts = list(map(pins.pop, offsets, _ZEROS))
            if counts.count(1) == len(counts):
                return list(offsets)
            for offset, count in zip(offsets, counts, strict=True):
                if count:
                    pins[offset] = count
        freed = []
        for offset in offsets:
            count = pins[offset] - 1
            if count:
                pins[offset] = count
            else:
                del pins[offset]
                freed.append(offset)
        return freed

    # -- figures -----------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return sum(cls.used * cls.page_bytes for cls in self._classes.values())

    @property
    def free_slabs(self) -> int:
        return sum(len(free) for free in self._free)

    def free_slabs_in(self, arena: int) -> int:
        """Free slabs of ``arena``."""
        return len(self._free[arena]) if 0 <= arena < len(self._free) else 0

    def size_of(self, offset: int) -> int | None:
        """The page size slot ``offset`` was given out for, or None when it is free."""
        return self.allocated.get(offset)

    def _of_size(self, page_bytes: int, arena: int | None) -> list[_SizeClass]:
        if arena is not None:
            cls = self._classes.get((arena, page_bytes))
            return [cls] if cls else []
        return [cls for (_, size), cls in self._classes.items() if size == page_bytes]

    def slabs_of(self, page_bytes: int, arena: int | None = None) -> int:
        """Slabs the page size holds now (in ``arena``, or in all)."""
        return sum(cls.slabs for cls in self._of_size(page_bytes, arena))

    def slots_per_slab(self, page_bytes: int) -> int:
        return max((cls.slots_per_slab for cls in self._of_size(page_bytes, None)), default=0)

    def used_slots(self, page_bytes: int) -> int:
        return sum(cls.used for cls in self._of_size(page_bytes, None))
