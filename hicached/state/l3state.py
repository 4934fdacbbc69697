"""What the daemon remembers of L3: which keys it holds, bounded.

The set is fed by write acknowledgements, prefetch reads and the startup
scan, and consulted by every match (``l3_hits``) and every write decision (a
page L3 holds is not sent again). It is a hint, never a promise: a read from
L3 is verified whatever the set says, so forgetting a key costs at most a
repeated write or an unreported L3 hit.

Bounded in two generations: keys are added to the young one; when it holds
half the bound, it becomes the old one and the previous old generation is
forgotten whole. Lookups see both. That keeps the most recently learned keys
at a cost of one set entry per key (no per-key order to maintain).

Unknown is not absent: the set is ``complete`` only once a listing of the
store has ended and while no key was forgotten to stay within the bound.
While it is not, a key it does not know is asked of the backend before a
match or an exists answers it as absent (cache.L3Lookup, storage.Tier.lookup).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class KnownKeys:
    """Keys L3 holds as far as this daemon knows, at most ``limit`` of them."""

    __slots__ = ("_old", "_young", "complete", "forgotten", "limit", "on_forgotten")

    def __init__(self, limit: int) -> None:
        assert limit >= 2, "the bound must hold two generations"
        self.limit = limit
        self._young: set[bytes] = set()
        self._old: set[bytes] = set()
        self.forgotten = 0  # keys dropped to stay within the bound
        # told of each generation dropped to stay within the bound
        self.on_forgotten: Callable[[set[bytes]], None] | None = None
        #: every key the store holds is known: its listing ended (the tier says
        #: when; without a store, nothing is unknown) and none was forgotten
        self.complete = True

    def __contains__(self, key: bytes) -> bool:
        return key in self._young or key in self._old

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def __bool__(self) -> bool:
        return bool(self._young) or bool(self._old)

    def add(self, key: bytes) -> None:
        if key in self._old:
            return
        young = self._young
        young.add(key)
        if len(young) >= self.limit // 2:
            self.forgotten += len(self._old)
            if self.on_forgotten is not None and self._old:
                self.on_forgotten(self._old)
            self._old = young
            self._young = set()
            if self.forgotten:
                self.complete = False

    def listed(self, done: bool) -> None:
        """Whether a listing of the whole store has ended (False while it runs,
        after it failed, or when the store was never listed)."""
        self.complete = done and not self.forgotten

    def update(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.add(key)

    def discard(self, key: bytes) -> None:
        self._young.discard(key)
        self._old.discard(key)

    def which(self, keys: list[bytes]) -> list[bool]:
        """Whether each of ``keys`` is known."""
        young, old = self._young, self._old
        if not old:
            return [key in young for key in keys]
        return [key in young or key in old for key in keys]

    def leading(self, keys: list[bytes], start: int) -> int:
        """How many of ``keys[start:]``, in order, are known."""
        n = 0
        young, old = self._young, self._old
        for key in keys[start:]:
            if key not in young and key not in old:
                break
            n += 1
        return n
