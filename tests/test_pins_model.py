"""Model-based test of pins against both indexes' eviction heaps.

The pool's real pin counts (``SlotPool.pin``/``unpin``, with its one-pass fast
path) drive both indexes as the cache drives them: a token lease pins its last
page, a keyed lease every page it found (duplicates included), a write to L3
one page anywhere in a run. Leases overlap, end in any order, end after
eviction passed over their pages, and namespaces are dropped while pins are
held; floods of matches make the heaps compact.

Invariants: a pinned slot is never evicted; every page that no pin holds and
that has no child in L2 has a live entry in its index's heap (else it would
never be evicted again: L2 capacity lost); and once every pin is gone,
eviction empties both indexes.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicached.index import PageIndex
from hicached.keyindex import KeyIndex
from hicached.state.pool import SlotPool

SEQ = st.lists(st.integers(0, 2), min_size=1, max_size=6)


def key(owner: int, seq: list[int], n: int) -> bytes:
    return bytes([owner, *seq[:n]])


class PinMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(1 << 20, 1 << 20)
        self.tree = PageIndex()
        self.table = KeyIndex()
        self.next_slot = 0
        # open pins: (index, slots pinned in the pool)
        self.leases: list[tuple[PageIndex | KeyIndex, list[int]]] = []

    def _slots(self, n: int) -> list[int]:
        out = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return out

    def _pin(self, index: PageIndex | KeyIndex, slots: list[int]) -> None:
        if slots:
            self.pool.pin(slots)
            self.leases.append((index, slots))

    # -- token-addressed pages -------------------------------------------------

    @rule(seq=SEQ, owner=st.sampled_from([1, 2]))
    def store(self, seq: list[int], owner: int) -> None:
        keys = [key(owner, seq, i + 1) for i in range(len(seq))]
        slots = self._slots(len(seq))
        self.tree.insert(keys, slots, owner)

    @rule(seq=SEQ, owner=st.sampled_from([1, 2]), lease=st.booleans())
    def match(self, seq: list[int], owner: int, lease: bool) -> None:
        found = self.tree.match([key(owner, seq, i + 1) for i in range(len(seq))])
        if lease:
            self._pin(self.tree, found[-1:])  # a token lease pins its last page

    @rule(data=st.data())
    def write_pin(self, data: st.DataObject) -> None:
        """A page on its way to L3: one slot anywhere in a run."""
        slots = sorted(self.tree.node_of) + sorted(self.table._by_slot)
        if slots:
            slot = data.draw(st.sampled_from(slots))
            index = self.tree if slot in self.tree.node_of else self.table
            self._pin(index, [slot])

    # -- key-addressed pages ---------------------------------------------------

    @rule(seq=SEQ, owner=st.sampled_from([3, 4]), skip=st.integers(0, 6))
    def store_keys(self, seq: list[int], owner: int, skip: int) -> None:
        for i in range(len(seq)):
            if i == skip:
                continue  # a hole: the next page's parent is not in L2
            k, parent = key(owner, seq, i + 1), key(owner, seq, i) if i else b""
            [slot] = self._slots(1)
            self.table.insert(k, slot, owner, parent)

    @rule(seq=SEQ, owner=st.sampled_from([3, 4]), lease=st.booleans(), twice=st.booleans())
    def find_keys(self, seq: list[int], owner: int, lease: bool, twice: bool) -> None:
        keys = [key(owner, seq, i + 1) for i in range(len(seq))]
        if twice:
            keys = keys + keys[:2]  # a list naming pages twice
        found = [slot for slot in self.table.find(keys) if slot >= 0]
        if lease:
            self._pin(self.table, found)  # a keyed lease pins every page

    # -- both ----------------------------------------------------------------------

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        index, slots = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        index.unpinned(self.pool.unpin(slots))

    @rule(count=st.integers(1, 12))
    def evict(self, count: int) -> None:
        pins = dict(self.pool.pins)
        for index in (self.tree, self.table):
            for _, slot, _ in index.evict(count, self.pool.pins):
                assert slot not in pins, f"pinned slot {slot} evicted"

    @rule(owner=st.sampled_from([1, 2, 3, 4]))
    def drop_owner(self, owner: int) -> None:
        index = self.tree if owner < 3 else self.table
        for _, slot, _ in index.drop_owner(owner, self.pool.pins):
            assert slot not in self.pool.pins, f"pinned slot {slot} dropped"

    @rule(seq=SEQ, owner=st.sampled_from([1, 3]))
    def flood(self, seq: list[int], owner: int) -> None:
        """Enough matches of one sequence to make the heaps compact."""
        keys = [key(owner, seq, i + 1) for i in range(len(seq))]
        index = self.tree if owner < 3 else self.table
        for _ in range(700):
            index.match(keys)

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def pinned_slots_stay(self) -> None:
        for index, slots in self.leases:
            present = index.node_of if isinstance(index, PageIndex) else index._by_slot
            for slot in slots:
                assert slot in present, f"pinned slot {slot} left its index"

    @invariant()
    def unpinned_leaves_are_in_the_heap(self) -> None:
        pins = self.pool.pins
        tree = self.tree
        live = {id(n) for t, _, n in tree._heap if n.alive and not n.children and n.tick == t}
        for node in tree.nodes():
            if not node.children and node.slots[-1] not in pins:
                assert id(node) in live, f"{node} is out of the heap: never evicted again"
        table = self.table
        live = {id(e) for t, _, e in table._heap if e.alive and not e.children and e.tick == t}
        for entry in table._entries.values():
            if not entry.children and entry.slot not in pins:
                assert id(entry) in live, f"page {entry.key!r} is out of the heap"

    def teardown(self) -> None:
        while self.leases:
            index, slots = self.leases.pop()
            index.unpinned(self.pool.unpin(slots))
        assert not self.pool.pins
        for index in (self.tree, self.table):
            index.evict(1 << 30, self.pool.pins)
            assert index.pages == 0, "pages left that eviction cannot reach"


PinMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=40, deadline=None)
test_pins_and_heaps = PinMachine.TestCase
