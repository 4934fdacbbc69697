"""The radix index: exact match, split and eviction orders."""

from __future__ import annotations

import itertools

from hicached.index import PageIndex


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def keys(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def slots_of(evicted: list[tuple[bytes, int, int]]) -> list[int]:
    return [slot for _, slot, _ in evicted]


def test_insert_then_match_prefix() -> None:
    ix = PageIndex()
    assert ix.insert(keys(1, 2, 3, 4), [10, 11, 12, 13]) == (4, [])
    assert ix.match(keys(1, 2, 3, 4)) == [10, 11, 12, 13]
    assert ix.match(keys(1, 2, 9)) == [10, 11]
    assert ix.match(keys(9, 1)) == []
    assert ix.match(keys(1, 2, 3, 4, 5)) == [10, 11, 12, 13]
    assert ix.pages == 4


def test_split_keeps_both_fragments_and_their_slots() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2, 3, 4), [10, 11, 12, 13])
    assert ix.insert(keys(1, 2, 5, 6), [10, 11, 20, 21]) == (2, [])
    (head,) = ix.root.children.values()
    assert head.keys == keys(1, 2) and head.slots == [10, 11]
    tails = sorted((n.keys, n.slots) for n in head.children.values())
    assert tails == [(keys(3, 4), [12, 13]), (keys(5, 6), [20, 21])]
    assert ix.node_of[10] is head and ix.node_of[12] is not head
    assert ix.match(keys(1, 2, 5, 6)) == [10, 11, 20, 21]
    assert ix.match(keys(1, 2, 3, 4)) == [10, 11, 12, 13]
    assert ix.pages == 6


def test_insert_reports_slots_of_pages_already_present() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2), [10, 11])
    assert ix.insert(keys(1, 2, 3), [30, 31, 32]) == (1, [30, 31])
    assert ix.insert(keys(1), [40]) == (0, [40])
    assert ix.match(keys(1, 2, 3)) == [10, 11, 32]


def test_insert_ending_inside_a_run_adds_nothing() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2, 3), [10, 11, 12])
    assert ix.insert(keys(1, 2), [10, 11]) == (0, [])
    assert len(ix.root.children) == 1 and ix.pages == 3


def test_eviction_takes_the_tail_of_the_least_recently_used_leaf() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2, 3), [10, 11, 12])  # leaf A
    ix.insert(keys(7, 8), [20, 21])  # leaf B
    ix.match(keys(1, 2, 3))  # A is now more recent than B
    assert slots_of(ix.evict(3, {})) == [21, 20, 12]
    assert ix.match(keys(7)) == []
    assert ix.match(keys(1, 2, 3)) == [10, 11]
    assert ix.pages == 2


def test_eviction_after_split_goes_leaf_first_then_parent() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2, 3, 4), [10, 11, 12, 13])
    ix.insert(keys(1, 2, 5, 6), [10, 11, 20, 21])
    ix.match(keys(1, 2, 3, 4))
    # [5, 6] is the older leaf; then [3, 4]; only then the shared head [1, 2]
    assert slots_of(ix.evict(6, {})) == [21, 20, 13, 12, 11, 10]
    assert ix.pages == 0 and not ix.root.children


def test_pinned_tail_stops_eviction_until_unpinned() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2, 3), [10, 11, 12])
    ix.insert(keys(5), [50])
    pins = {12: 1}
    assert slots_of(ix.evict(10, pins)) == [50]
    assert slots_of(ix.evict(10, pins)) == []
    del pins[12]
    ix.unpinned([12])
    assert slots_of(ix.evict(10, pins)) == [12, 11, 10]


def test_pinned_middle_page_keeps_its_prefix() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2, 3, 4), [10, 11, 12, 13])
    pins = {11: 1, 10: 1}  # a lease on the first two pages
    assert slots_of(ix.evict(10, pins)) == [13, 12]
    assert ix.match(keys(1, 2, 3)) == [10, 11]


def test_stale_heap_entries_do_not_grow_without_bound() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2), [10, 11])
    for _ in range(5000):
        ix.match(keys(1, 2))
    assert len(ix._heap) <= 2 * ix.pages + 1025
    assert ix.evict(1, {}) == [(k(2), 11, 0)]


def test_pages_remember_their_owner_and_indexes_share_a_clock() -> None:
    clock = itertools.count(1)
    small, large = PageIndex(clock), PageIndex(clock)
    small.insert(keys(1, 2, 3), [10, 11, 12], owner=7)
    large.insert(keys(5), [50], owner=9)
    small.insert(keys(1, 2, 8), [10, 11, 13], owner=7)  # splits the run; the head keeps owner 7
    assert {n.owner for n in small.nodes()} == {7}
    oldest_small, oldest_large = small.oldest(), large.oldest()
    assert oldest_small is not None and oldest_large is not None
    assert oldest_small < oldest_large  # page 3 was last used before the large page was stored
    small.match(keys(1, 2, 3))
    large.match(keys(5))
    assert large.oldest() > small.oldest()  # type: ignore[operator]
    assert sorted(small.evict(10, {})) == sorted(
        [(k(3), 12, 7), (k(8), 13, 7), (k(2), 11, 7), (k(1), 10, 7)]
    )
    assert small.oldest() is None


def test_partial_match_splits_and_leaves_the_tail_older() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2, 3, 4), [10, 11, 12, 13])
    ix.insert(keys(7), [70])
    assert ix.match(keys(1, 2)) == [10, 11]
    (head,) = (n for n in ix.root.children.values() if n.keys[0] == k(1))
    assert head.keys == keys(1, 2) and ix.node_of[12] is not head
    # pages 3 and 4 were last used before page 7; pages 1 and 2 after it
    assert slots_of(ix.evict(5, {})) == [13, 12, 70, 11, 10]


def test_insert_ending_inside_a_run_leaves_the_tail_older() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2, 3), [10, 11, 12])
    ix.insert(keys(7), [70])
    assert ix.insert(keys(1, 2), [10, 11]) == (0, [])
    assert slots_of(ix.evict(4, {})) == [12, 70, 11, 10]


def test_split_leaves_the_old_leaf_evictable() -> None:
    ix = PageIndex()
    ix.insert(keys(1, 2), [10, 11])
    ix.insert(keys(1, 3), [10, 12])  # [2] becomes a leaf of its own, as old as before
    ix.insert(keys(7), [70])
    assert ix.oldest() == 1
    assert slots_of(ix.evict(1, {})) == [11]
    assert slots_of(ix.evict(3, {})) == [12, 10, 70]


def test_split_runs_stay_lru_under_pressure() -> None:
    """Pages that shared a split prefix age like any others (a regression:
    they were never evicted and crowded out every newer page)."""
    ix = PageIndex()
    free = list(range(256))

    def store(run: list[bytes]) -> None:
        present = ix.match(run)
        need = len(run) - len(present)
        if len(free) < need:
            free.extend(slots_of(ix.evict(need - len(free), {})))
        fresh = [free.pop() for _ in range(need)]
        assert ix.insert(run, present + fresh) == (need, [])

    for i in range(200):
        store(keys(3 * i, 3 * i + 1))  # R + a
        store(keys(3 * i, 3 * i + 2))  # R + b: splits R + a
    unrelated = [k(10_000 + j) for j in range(1000)]
    for key in unrelated:
        store([key])
    survivors = {key for node in ix.nodes() for key in node.keys}
    assert ix.pages == 256
    assert survivors == set(unrelated[-256:])


def test_compaction_during_eviction_keeps_lru_order() -> None:
    ix = PageIndex()
    ix.insert(keys(*range(100, 200)), list(range(100, 200)))  # one long leaf, tick 1
    ix.insert(keys(1, 2, 3), [10, 11, 12])
    ix.match(keys(1, 2))
    ix.match(keys(1))  # a chain [1] -> [2] -> [3], at ticks 4, 3, 2
    ix.insert(keys(5), [50])
    ix.insert(keys(6), [60])
    while len(ix._heap) < 2 * ix.pages + 1024:  # stale entries up to the bound
        ix.match(keys(6))
    assert len(ix.evict(100, {})) == 100  # the bound shrinks, the heap stays
    # removing [3] pushes [2] and compacts the heap; removing [2] then pushes [1],
    # which must still go before [5]
    assert slots_of(ix.evict(4, {})) == [12, 11, 10, 50]
    assert len(ix._heap) <= 2 * ix.pages + 1025
