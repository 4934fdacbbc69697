"""The slot allocator: exact allocation order, slab reuse, alignment, pins."""

from __future__ import annotations

import pytest

from hicached.pool import SlotPool

MIB = 1 << 20


def test_allocates_lowest_slot_of_lowest_slab_first() -> None:
    pool = SlotPool(4 * MIB, MIB)
    got = [pool.alloc(256 * 1024) for _ in range(6)]
    assert got == [0, 262144, 524288, 786432, MIB, MIB + 262144]
    assert pool.free_slabs == 2
    assert pool.used_bytes == 6 * 256 * 1024


def test_freed_slot_is_reused_first_and_empty_slab_returns_to_arena() -> None:
    pool = SlotPool(2 * MIB, MIB)
    a = [pool.alloc(512 * 1024) for _ in range(4)]
    assert a == [0, 512 * 1024, MIB, MIB + 512 * 1024]
    assert pool.alloc(512 * 1024) is None
    pool.free(512 * 1024)
    assert pool.alloc(512 * 1024) == 512 * 1024
    pool.free(MIB)
    pool.free(MIB + 512 * 1024)
    assert pool.free_slabs == 1
    # the freed slab now serves another page size
    assert pool.alloc(4096) == MIB


def test_slots_are_aligned_to_the_page_size_across_the_arena() -> None:
    pool = SlotPool(3 * MIB, MIB)
    page = 300_000
    offsets = []
    while (slot := pool.alloc(page)) is not None:
        offsets.append(slot)
    assert all(o % page == 0 for o in offsets)
    assert all(o + page <= 3 * MIB for o in offsets)
    assert len(set(offsets)) == len(offsets)
    # slab 1 starts at 1 MiB; its first aligned slot is 4 * 300_000
    assert offsets[3] == 1_200_000


def test_sizes_do_not_share_a_slab() -> None:
    pool = SlotPool(2 * MIB, MIB)
    small = pool.alloc(4096)
    big = pool.alloc(65536)
    assert small == 0 and big == MIB
    assert pool.alloc(1 << 19) is None  # no slab left for a third size


def test_pins_count_and_guard_free() -> None:
    pool = SlotPool(MIB, MIB)
    slot = pool.alloc(4096)
    assert slot is not None
    pool.pin([slot])
    pool.pin([slot])
    assert pool.unpin([slot]) == []
    with pytest.raises(AssertionError, match="pinned"):
        pool.free(slot)
    assert pool.unpin([slot]) == [slot]
    pool.free(slot)
    assert pool.used_bytes == 0


def test_a_leases_slots_pin_and_unpin_together_and_shared_ones_stay() -> None:
    """Many slots at once (a key-addressed lease): the pins add up with other
    leases' pins and with a slot named twice; an unpin frees only what no other
    pin holds, and a slot without a pin is a broken invariant."""
    pool = SlotPool(MIB, MIB)
    slots = [pool.alloc(4096) for _ in range(6)]
    assert None not in slots
    first = [s for s in slots[:4] if s is not None]
    second = [s for s in slots[2:] if s is not None]
    pool.pin(first)
    pool.pin(second)  # slots[2:4] held twice
    assert pool.unpin(first) == first[:2]  # the shared two stay pinned
    assert set(pool.pins) == set(second)
    with pytest.raises(AssertionError, match="pinned"):
        pool.free(second[0])
    assert pool.unpin(second) == second
    assert pool.pins == {}
    twice = [first[0], first[1], first[0]]
    pool.pin(twice)
    assert pool.pins == {first[0]: 2, first[1]: 1}
    assert pool.unpin(twice) == [first[1], first[0]]
    assert pool.pins == {}
    with pytest.raises(KeyError):
        pool.unpin(first[:2])
    for slot in first + second[2:]:
        pool.free(slot)
    assert pool.used_bytes == 0


# -- arenas (tenant arenas, daemon/arenas.py) ---------------------------------------


def test_a_partitioned_pool_gives_each_arena_its_own_slabs_only() -> None:
    pool = SlotPool(8 * MIB, MIB)
    pool.partition([(0, 4 * MIB), (4 * MIB, 2 * MIB)])  # the last 2 MiB: no arena's
    assert pool.arenas == 2
    b = [pool.alloc(512 * 1024, 1) for _ in range(5)]
    assert b == [4 * MIB, 4 * MIB + 512 * 1024, 5 * MIB, 5 * MIB + 512 * 1024, None]
    assert pool.free_slabs_in(1) == 0 and pool.free_slabs_in(0) == 4
    assert pool.alloc(4096, 0) == 0  # arena 0 is untouched by arena 1's use
    assert pool.alloc(4096, 2) is None and pool.alloc(4096, -1) is None  # no such arena
    pool.free(5 * MIB)
    pool.free(5 * MIB + 512 * 1024)
    assert pool.free_slabs_in(1) == 1  # the slab went back to its own arena
    assert pool.alloc(4096, 1) == 5 * MIB
    assert pool.slabs_of(4096) == 2 and pool.slabs_of(4096, 1) == 1


def test_slots_are_aligned_from_the_start_of_their_arena() -> None:
    """A client maps its arena alone: offset - start must be a whole row."""
    pool = SlotPool(8 * MIB, MIB)
    start, page = 3 * MIB, 300_000
    pool.partition([(0, start), (start, 5 * MIB)])
    offsets = []
    while (slot := pool.alloc(page, 1)) is not None:
        offsets.append(slot)
    assert all((o - start) % page == 0 for o in offsets)
    assert all(start <= o and o + page <= 8 * MIB for o in offsets)
    assert offsets[:4] == [start, start + page, start + 2 * page, start + 4 * page]
