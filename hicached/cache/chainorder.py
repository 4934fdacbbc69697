"""L3 BlockStored events in chain order: a page's event waits while its parent's
is still to come.

Synchronous and free of I/O, owned by the event-loop thread with the cache.
Writes to L3 end in any order (several calls run at once, and write_back sends
a page's ancestors just as the page leaves L2), but a router that builds a
tree from events must see a parent before its child. So the event of a page
whose parent's write is still in flight (or whose parent's own event waits)
is held until the parent's goes out, and then published right after it.

A held event never outlives the reason it waits: a parent whose write fails,
or that leaves L2 unwritten, releases those waiting for it as they are; a page
that L3 lets go of before its event went out loses that event (a removal must
never be followed by a stale BlockStored); at most ``limit`` events wait,
taking at most ``max_bytes`` (as ``size`` counts them: an event carries its
page's token ids), and past either the longest waiting goes out as it is
(counted in ``out_of_order``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

E = TypeVar("E")

_LOOP_STEPS = 64  # held parents looked through for a loop back to the page


class ChainOrder(Generic[E]):
    """Events held for their parents' (keys are the daemon's page keys)."""

    __slots__ = (
        "_emit",
        "_held",
        "_size",
        "_waiting",
        "bytes",
        "limit",
        "max_bytes",
        "out_of_order",
    )

    def __init__(
        self,
        limit: int,
        emit: Callable[[E], None],
        *,
        max_bytes: int = 64 << 20,
        size: Callable[[E], int] = lambda _: 0,
    ) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self.bytes = 0  # what the held events take, as ``size`` counts them
        self.out_of_order = 0  # events sent before their parent's to stay within the limits
        self._emit = emit
        self._size = size
        # key -> (parent, event, its size), oldest first
        self._held: dict[bytes, tuple[bytes, E, int]] = {}
        self._waiting: dict[bytes, list[bytes]] = {}  # parent -> keys held for it

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, key: bytes) -> bool:
        """Whether the event of ``key`` waits for its parent's."""
        return key in self._held

    def add(self, key: bytes, up: bytes | None, event: E, *, coming: bool) -> None:
        """The event of page ``key`` (parent ``up``): held while ``coming`` (the
        parent's event is still to come), else published with those waiting for it.
        A second event of one key replaces the first."""
        if key in self._held:
            self._unhold(key)
        if up is not None and coming and not self._loops(key, up):
            size = self._size(event)
            self._held[key] = (up, event, size)
            self.bytes += size
            self._waiting.setdefault(up, []).append(key)
            while len(self._held) > self.limit or self.bytes > self.max_bytes:
                oldest = next(iter(self._held))
                self.out_of_order += 1
                late = self._unhold(oldest)
                self._emit(late)
                self.ready(oldest)
            return
        self._emit(event)
        self.ready(key)

    def _loops(self, key: bytes, up: bytes) -> bool:
        """Whether ``up`` waits, through the events held above it, for ``key``
        itself (parents named by a client can loop): then nothing would release
        them. The walk stops after ``_LOOP_STEPS`` (a longer loop waits until
        the limit lets it out)."""
        held = self._held
        for _ in range(_LOOP_STEPS):
            if up == key:
                return True
            entry = held.get(up)
            if entry is None:
                return False
            up = entry[0]
        return False

    def ready(self, key: bytes) -> None:
        """The event of ``key`` went out: those held for it follow, and theirs."""
        stack = self._waiting.pop(key, [])[::-1]
        while stack:
            child = stack.pop()
            entry = self._held.pop(child, None)
            if entry is None:
                continue
            self.bytes -= entry[2]
            self._emit(entry[1])
            stack.extend(self._waiting.pop(child, [])[::-1])

    def orphan(self, key: bytes) -> None:
        """No event of ``key`` is on its way (its write failed, or it left L2
        unwritten): those held for it go out as they are. A key whose own event
        waits keeps them: they follow it."""
        if key not in self._held:
            self.ready(key)

    def drop(self, key: bytes, *, coming: bool = False) -> None:
        """L3 let go of ``key``: its held event, if any, is never sent (its
        BlockRemoved went out); those held for it go out as they are, unless
        another event of it is ``coming`` (a write of it runs again)."""
        if key in self._held:
            self._unhold(key)
        if not coming:
            self.ready(key)

    def _unhold(self, key: bytes) -> E:
        up, event, size = self._held.pop(key)
        self.bytes -= size
        siblings = self._waiting[up]
        siblings.remove(key)
        if not siblings:
            del self._waiting[up]
        return event
