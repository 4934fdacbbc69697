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
