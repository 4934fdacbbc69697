"""Model-based test of the page index alone: exact per-page LRU across splits.

Sequences over a three-token alphabet share prefixes constantly, so runs are
split by inserts and by matches that end inside them. The model keeps every
present page (named by its token prefix) with its slot, owner and last-use
tick: an insert uses every page of the inserted sequence, a match the pages it
returns. Eviction order: among unpinned pages with no child page present, the
smallest tick first (equal ticks lie on one path; the deepest goes first).
Pins come from read leases, so they are prefix-closed like the cache's.
"""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicached.index import Node, PageIndex

SLOTS = 16
SEQ = st.lists(st.integers(0, 2), min_size=1, max_size=6)
Page = tuple[int, ...]


def key(page: Page) -> bytes:
    return b"p" + bytes(page)


class IndexMachine(RuleBasedStateMachine):
    PINS = True

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.index = PageIndex(self._ticks())
        self.free = list(range(SLOTS))
        self.slot: dict[Page, int] = {}  # the model: every present page ...
        self.owner: dict[Page, int] = {}
        self.used: dict[Page, int] = {}  # ... and the tick of its last use
        self.pins: dict[int, int] = {}  # slot -> lease count, as the pool keeps it
        self.leases: list[list[int]] = []

    def _ticks(self) -> Iterator[int]:
        while True:
            yield self.now

    def _use(self) -> int:
        """The tick the next index call takes."""
        self.now += 1
        return self.now

    def _present(self, seq: list[int]) -> int:
        n = 0
        while n < len(seq) and tuple(seq[: n + 1]) in self.slot:
            n += 1
        return n

    def _victim(self) -> Page | None:
        parents = {page[:-1] for page in self.slot}
        leaves = [
            page for page in self.slot if page not in parents and self.slot[page] not in self.pins
        ]
        if not leaves:
            return None
        return min(leaves, key=lambda page: (self.used[page], -len(page)))

    # -- rules -----------------------------------------------------------------

    @rule(seq=SEQ, owner=st.sampled_from([1, 2]), racing=st.booleans())
    def insert(self, seq: list[int], owner: int, racing: bool) -> None:
        """Store ``seq``, cut to fit the free slots. A writer that raced another
        brings fresh slots for every page; those of present pages come back."""
        if racing:
            seq = seq[: len(self.free)]
            present = self._present(seq)
            given = [self.free.pop() for _ in seq]
            unused = given[:present]
        else:
            present = self._present(seq)
            seq = seq[: present + len(self.free)]
            given = [self.slot[tuple(seq[: i + 1])] for i in range(present)]
            given += [self.free.pop() for _ in range(len(seq) - present)]
            unused = []
        tick = self._use()
        got = self.index.insert([key(tuple(seq[: i + 1])) for i in range(len(seq))], given, owner)
        assert got == (len(seq) - present, unused)
        self.free.extend(unused)
        for i in range(len(seq)):
            page = tuple(seq[: i + 1])
            if page not in self.slot:
                self.slot[page] = given[i]
                self.owner[page] = owner
            self.used[page] = tick

    @rule(seq=SEQ)
    def match(self, seq: list[int]) -> None:
        n = self._present(seq)
        tick = self._use()
        got = self.index.match([key(tuple(seq[: i + 1])) for i in range(len(seq))])
        assert got == [self.slot[tuple(seq[: i + 1])] for i in range(n)]
        for i in range(n):
            self.used[tuple(seq[: i + 1])] = tick

    @rule(count=st.integers(1, 8))
    def evict(self, count: int) -> None:
        expected: list[tuple[bytes, int, int]] = []
        while len(expected) < count:
            page = self._victim()
            if page is None:
                break
            expected.append((key(page), self.slot.pop(page), self.owner.pop(page)))
            del self.used[page]
        assert self.index.evict(count, self.pins) == expected
        self.free.extend(slot for _, slot, _ in expected)
        assert self.index.pages == len(self.slot)  # survivors, checked in full below

    @precondition(lambda self: self.PINS)
    @rule(seq=SEQ)
    def lease(self, seq: list[int]) -> None:
        """A read lease: match and pin what was found."""
        self.match(seq)
        slots = [self.slot[tuple(seq[: i + 1])] for i in range(self._present(seq))]
        if slots:
            for slot in slots:
                self.pins[slot] = self.pins.get(slot, 0) + 1
            self.leases.append(slots)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        slots = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        last: list[int] = []
        for slot in slots:
            self.pins[slot] -= 1
            if not self.pins[slot]:
                del self.pins[slot]
                last.append(slot)
        self.index.unpinned(last)

    # -- invariants --------------------------------------------------------------

    @invariant()
    def same_pages_as_the_model(self) -> None:
        index = self.index
        seen: dict[bytes, tuple[int, int, int]] = {}  # key -> (slot, owner, tick)
        stack: list[Node] = [index.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.alive and child.parent is node, "a child with another parent"
                assert child.keys and child.keys[0] == first, "a child under the wrong key"
                assert len(child.keys) == len(child.slots)
                for k, s in zip(child.keys, child.slots, strict=True):
                    assert index.node_of[s] is child, "node_of disagrees with the tree"
                    seen[k] = (s, child.owner, child.tick)
                stack.append(child)
        want = {
            key(page): (self.slot[page], self.owner[page], self.used[page]) for page in self.slot
        }
        assert seen == want  # same pages, slots, owners and per-page ticks
        assert index.pages == len(index.node_of) == len(self.slot)

    @invariant()
    def every_evictable_leaf_is_in_the_heap(self) -> None:
        index = self.index
        queued = {
            id(node)
            for tick, _, node in index._heap
            if node.alive and not node.children and node.tick == tick
        }
        for node in index.nodes():
            if not node.children and node.slots[-1] not in self.pins:
                assert id(node) in queued, f"{node} has no heap entry"
        # a pinned leaf may be out of the heap until unpinned
        leaves = [n for n in index.nodes() if not n.children]
        free = [n.tick for n in leaves if n.slots[-1] not in self.pins]
        oldest = index.oldest()
        if oldest is None:
            assert not free
        else:
            assert min(n.tick for n in leaves) <= oldest <= min(free, default=oldest)
        if not self.pins:
            assert oldest == min(free, default=None)


class UnpinnedIndexMachine(IndexMachine):
    PINS = False


IndexMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
UnpinnedIndexMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
test_index_lru = IndexMachine.TestCase
test_index_lru_unpinned = UnpinnedIndexMachine.TestCase
