"""The L2 page index: a compressed radix tree over chained page keys.

Synchronous, owned by the event-loop thread, no I/O. One index serves all
namespaces of one page size (keys are seeded by the namespace digest, so
namespaces never collide) and orders their pages for eviction. Every node
remembers its *owner*, the namespace that stored it, so an evicted page can
be written back under the right namespace. Indexes of different page sizes
may share one clock, which makes their recency comparable.

Invariants:
- the pages in the tree are prefix-closed: a page is present only if its
  parent page is, so a match never skips a hole;
- every page of a node was last used at the node's ``tick``: a match or an
  insert that ends part-way through a node splits it there, so the head it
  touched takes the new tick and the untouched tail keeps its own. A use
  touches a whole prefix, so a parent is never older than its children;
- every leaf whose tail page is unpinned has a heap entry for its current
  tick (a split keeps the tail node, and so its entry);
- eviction takes pages from the tail of the least recently used leaf, so it
  keeps the tree prefix-closed and evicts exactly in per-page LRU order among
  the pages without children; a pinned page stops eviction of its leaf until
  the pin is dropped. A lease pins only the last page of the prefix it holds:
  eviction cannot reach a page before it on its path (its own node is
  emptied from the tail, and a node with children is never evicted), so the
  whole prefix stays.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Iterator, Mapping, Sequence

_ne = operator.ne


class Node:
    """A run of pages: ``keys[i]`` is stored in slot ``slots[i]``."""

    __slots__ = ("alive", "children", "keys", "owner", "parent", "queued", "slots", "tick")

    def __init__(
        self, keys: list[bytes], slots: list[int], parent: Node | None, tick: int, owner: int = 0
    ) -> None:
        self.keys = keys
        self.slots = slots
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.tick = tick
        self.owner = owner
        self.alive = True
        # the tick of this node's entry in the eviction heap, 0 when it has none:
        # an unpin that finds its entry still there pushes nothing
        self.queued = 0

    def __repr__(self) -> str:
        return f"Node(pages={len(self.keys)}, children={len(self.children)}, tick={self.tick})"


def _common(run: list[bytes], keys: Sequence[bytes], start: int) -> int:
    """Length of the common prefix of ``run`` and ``keys[start:]``."""
    n = len(run)
    other = keys[start : start + n]
    if run == other:
        return n
    # where they part, found at C speed: a flag per pair, then its first True
    differ = list(map(_ne, run, other))
    return differ.index(True) if True in differ else len(differ)


class PageIndex:
    """Which pages are in L2, in which slots, and which to evict first."""

    def __init__(self, clock: Iterator[int] | None = None) -> None:
        self.root = Node([], [], None, 0)
        self.pages = 0
        self.node_of: dict[int, Node] = {}
        self._clock = clock if clock is not None else itertools.count(1)
        self._heap: list[tuple[int, int, Node]] = []
        self._seq = itertools.count()

    # -- queries -------------------------------------------------------------

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of the leading pages of ``keys`` that are present; marks them used.

        A match that ends inside a node splits it, so only the matched pages
        become more recent.
        """
        tick = next(self._clock)
        node = self.root
        out: list[int] = []
        i, n = 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            m = _common(child.keys, keys, i)
            partial = m < len(child.keys)
            if partial:
                child = self._split(child, m)
            child.tick = tick
            out.extend(child.slots)
            i += m
            node = child
            if partial:
                break
        if node is not self.root and not node.children:
            self._push(node)
        return out

    def starts(self, key: bytes) -> bool:
        """Whether a sequence whose first page is ``key`` has that page here."""
        return key in self.root.children

    def has(self, key: bytes, slot: int) -> bool:
        """Whether page ``key`` is in ``slot`` in this index now."""
        node = self.node_of.get(slot)
        return node is not None and node.keys[node.slots.index(slot)] == key

    def slots(self) -> list[int]:
        """Every page's slot, now (a list: the index may change while it is used)."""
        return list(self.node_of)

    def pages_at(self, slots: Sequence[int]) -> list[tuple[bytes, int, int]]:
        """(key, slot, owner) of the pages in ``slots`` now; slots no page holds
        are left out. Each node's pages are read once per call, however many of
        its slots are asked for."""
        out: list[tuple[bytes, int, int]] = []
        node_of = self.node_of
        keys_of: dict[Node, dict[int, bytes]] = {}  # a node's slot -> key
        for slot in slots:
            node = node_of.get(slot)
            if node is None:
                continue
            keys = keys_of.get(node)
            if keys is None:
                keys = keys_of[node] = dict(zip(node.slots, node.keys, strict=True))
            out.append((keys[slot], slot, node.owner))
        return out

    def items(self) -> Iterator[tuple[bytes, int, int]]:
        """Every page as (key, slot, owner)."""
        for node in self.nodes():
            owner = node.owner
            for key, slot in zip(node.keys, node.slots, strict=True):
                yield key, slot, owner

    def nodes(self) -> list[Node]:
        out: list[Node] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # -- updates ---------------------------------------------------------------

    def insert(
        self, keys: Sequence[bytes], slots: Sequence[int], owner: int = 0
    ) -> tuple[int, list[int]]:
        """Insert pages ``keys`` stored in ``slots`` by namespace ``owner``; leading
        pages may exist already.

        Returns ``(published, unused)``: how many pages are new, and the given
        slots that were not needed because that page already had another slot.
        """
        assert len(keys) == len(slots), "one slot per key"
        tick = next(self._clock)
        node = self.root
        unused: list[int] = []
        i, n = 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                leaf = Node(list(keys[i:]), list(slots[i:]), node, tick, owner)
                node.children[keys[i]] = leaf
                for slot in leaf.slots:
                    self.node_of[slot] = leaf
                self.pages += n - i
                self._push(leaf)
                return n - i, unused
            m = _common(child.keys, keys, i)
            if m < len(child.keys):
                # Only the head is used; the tail keeps its tick and heap entry.
                child = self._split(child, m)
            child.tick = tick
            for have, given in zip(child.slots, slots[i : i + m], strict=True):
                if have != given:
                    unused.append(given)
            i += m
            node = child
        if node is not self.root and not node.children:
            self._push(node)
        return 0, unused

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after ``at`` pages; the new parent holds the head, ``node`` the tail.

        Both keep ``node``'s tick. The tail stays the same object, so a heap
        entry for it stays valid; the head has a child and needs none.
        """
        parent = node.parent
        assert parent is not None and 0 < at < len(node.keys), "split inside a run only"
        head = Node(node.keys[:at], node.slots[:at], parent, node.tick, node.owner)
        parent.children[head.keys[0]] = head
        node.keys = node.keys[at:]
        node.slots = node.slots[at:]
        node.parent = head
        head.children[node.keys[0]] = node
        for slot in head.slots:
            self.node_of[slot] = head
        return head

    def oldest(self) -> int | None:
        """The clock tick of the least recently used leaf, or None without pages."""
        heap = self._heap
        while heap:
            tick, _, node = heap[0]
            if node.alive and not node.children and node.tick == tick and node.slots:
                return tick
            heapq.heappop(heap)  # stale entry
        return None

    def evict(self, count: int, pins: Mapping[int, int]) -> list[tuple[bytes, int, int]]:
        """Remove up to ``count`` unpinned pages, least recently used leaf first.

        Returns their (key, slot, owner) in eviction order; the caller frees the slots.
        """
        out: list[tuple[bytes, int, int]] = []
        # self._heap is read each round: a push below may compact it into a new list
        while len(out) < count and self._heap:
            tick, _, node = heapq.heappop(self._heap)
            if not node.alive or node.children or node.tick != tick:
                continue  # stale entry
            node.queued = 0  # its entry is out of the heap; pushed again below if due
            first = node.keys[0]
            while node.slots and len(out) < count:
                slot = node.slots[-1]
                if slot in pins:
                    break
                node.slots.pop()
                del self.node_of[slot]
                out.append((node.keys.pop(), slot, node.owner))
            if not node.slots:
                self._remove(node, first)
            elif len(out) >= count and node.slots[-1] not in pins:
                self._push(node)
            # else: its tail is pinned; unpinned() pushes it again
        self.pages -= len(out)
        return out

    def drop_owner(self, owner: int, pins: Mapping[int, int]) -> list[tuple[bytes, int, int]]:
        """Remove every page of namespace ``owner`` that no pin holds (a namespace's
        pages form whole subtrees under the root: its digest seeds every key).

        Returns their (key, slot, owner), deepest first; the caller frees the slots.
        """
        out: list[tuple[bytes, int, int]] = []
        for first, top in list(self.root.children.items()):
            if top.owner != owner:
                continue
            subtree = [top]
            for node in subtree:  # grows while it is walked: breadth first
                subtree.extend(node.children.values())
            if any(slot in pins for node in subtree for slot in node.slots):
                continue  # a lease holds part of it: it stays, whole
            for node in reversed(subtree):
                for key, slot in zip(reversed(node.keys), reversed(node.slots), strict=True):
                    del self.node_of[slot]
                    out.append((key, slot, owner))
                node.alive = False
                node.parent = None
            del self.root.children[first]
        self.pages -= len(out)
        return out

    def _remove(self, node: Node, first: bytes) -> None:
        parent = node.parent
        assert parent is not None, "the root is never removed"
        del parent.children[first]
        node.alive = False
        node.parent = None
        if parent is not self.root and not parent.children:
            self._push(parent)

    def pinned_beyond(self, tails: list[int], pins: Mapping[int, int]) -> int:
        """Pages on the root paths that end at ``tails`` (the pinned last pages
        of leases) that ``pins`` does not hold itself: what those leases hold
        beyond their pins. Costs the distinct pages of those paths, not the
        leases' pages (leases over one prefix share it)."""
        held: dict[Node, int] = {}  # leading pages of each node on a path
        for slot in tails:
            node: Node | None = self.node_of.get(slot)
            if node is None:
                continue
            # a lease's last page stays its node's tail (nodes never grow at
            # the tail, and eviction stops at it), so this is the whole node
            count = len(node.slots) if node.slots[-1] == slot else node.slots.index(slot) + 1
            while node is not None and node is not self.root and held.get(node, 0) < count:
                held[node] = count
                node = node.parent
                count = len(node.slots) if node is not None else 0
        return sum(
            1 for node, count in held.items() for slot in node.slots[:count] if slot not in pins
        )

    def unpinned(self, slots: list[int]) -> None:
        """A slot lost its last pin: the leaf whose tail it is is evictable again.

        The pins of this index are single slots: a lease's last page (the
        cache's ``_new_lease``) or a page on its way to L3. Of ``slots``, only
        the last is looked at.
        """
        if not slots:
            return
        slot = slots[-1]
        node = self.node_of.get(slot)
        if (
            node is not None
            and not node.children
            and node.slots[-1] == slot
            and node.queued != node.tick  # eviction found it pinned and dropped its entry
        ):
            self._push(node)

    def _push(self, node: Node) -> None:
        heap = self._heap
        node.queued = node.tick
        heapq.heappush(heap, (node.tick, next(self._seq), node))
        if len(heap) > 2 * self.pages + 1024:
            leaves = [n for n in self.nodes() if not n.children]
            for n in leaves:
                n.queued = n.tick
            self._heap = [(n.tick, next(self._seq), n) for n in leaves]
            heapq.heapify(self._heap)
