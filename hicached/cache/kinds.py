"""Namespace kinds: pages named by token ids, or by the engine's own keys.

A namespace's kind is an object chosen once, when the namespace is registered
(``NamespaceState.kind``), and asked wherever the two kinds differ, instead
of a branch on ``spec.keyed`` at each place:

- which operations address it: token ids (``match``, ``reserve``,
  ``prefetch``) or keys (the ``*_keys`` operations);
- which pages of a lease are pinned in the pool: all of them, or only the
  last of a token path (its pages form a path from the root of the radix
  tree and eviction takes a leaf's pages from its tail, so a pinned page
  keeps every page before it);
- what events call its pages: the daemon's keys, or the engine's keys (with
  their KV cache group: event names, wire/events.py), which
  the daemon remembers while a page is in L2 and, once it left L2, while L3
  holds it (or a write carries it there), so that the BlockRemoved of either
  tier names it as the engine does;
- whether the L3 startup scan announces its pages: the store keeps the
  daemon's keys only, which a key-addressed namespace's events never name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

from hicached.errors import BadRequest

if TYPE_CHECKING:
    from hicached.cache.eventlog import EventLog
    from hicached.cache.sessions import KeyedPage, NamespaceState

__all__ = ["KeyedKind", "NamespaceKind", "TokenKind"]


class NamespaceKind:
    """What differs between the two kinds of namespace."""

    events: EventLog
    keyed: ClassVar[bool]
    announces_scan: ClassVar[bool]  # the L3 startup scan announces its pages

    def by_tokens(self, ns: NamespaceState) -> None:
        """Refuse a token-addressed operation where pages are named by key."""

    def by_keys(self, ns: NamespaceState) -> None:
        """Refuse a key-addressed operation where pages are named by tokens."""

    def pins(self, pinned: list[int]) -> list[int]:
        """The slots to pin in the pool for a lease on the indexed pages ``pinned``."""
        raise NotImplementedError

    def event_keys(self, keys: list[bytes], *, forget: bool = False) -> list[bytes]:
        """What events call the L2 pages ``keys`` (``forget``: they leave L2)."""
        raise NotImplementedError

    def left_l2(self, keys: list[bytes]) -> list[bytes]:
        """What the BlockRemoved of pages that left L2 names."""
        return self.event_keys(keys, forget=True)

    def l3_name(self, key: bytes) -> bytes | None:
        """What the L3 BlockStored of L2 page ``key`` names (None: not known)."""
        raise NotImplementedError

    def removed(self, names: list[bytes], medium: str, model: str) -> None:
        """The BlockRemoved of pages that events call ``names``."""
        raise NotImplementedError

    def stored_one(
        self,
        ns: NamespaceState,
        name: bytes,
        parent: bytes | None,
        tokens: list[int],
        medium: str,
    ) -> None:
        """The BlockStored of one page outside L2 (an L3 write, a prefetch's
        find), as events call it and its parent."""
        spec = ns.spec
        self.events.stored([name], parent, tokens, spec.page_tokens, medium, spec.model)


class TokenKind(NamespaceKind):
    """Pages named by the daemon's chained keys over token ids (a radix tree)."""

    keyed = False
    announces_scan = True

    def __init__(self, events: EventLog) -> None:
        self.events = events

    def by_keys(self, ns: NamespaceState) -> None:
        raise BadRequest(
            f"namespace {ns.id} names its pages by token ids (key_scheme 'tokens'): "
            "register one with the engine's key_scheme to address pages by key"
        )

    def pins(self, pinned: list[int]) -> list[int]:
        return pinned[-1:]

    def event_keys(self, keys: list[bytes], *, forget: bool = False) -> list[bytes]:
        return keys

    def l3_name(self, key: bytes) -> bytes | None:
        return key

    def removed(self, names: list[bytes], medium: str, model: str) -> None:
        self.events.removed(names, medium, model)


class KeyedKind(NamespaceKind):
    """Pages named by the engine's own keys (a key table with parent links).

    With events on, it keeps what events call each page: ``ekeys`` for pages
    in L2; ``l3_ekeys`` for pages that left L2 but are in L3 or on their way
    (as many as the L3 record remembers: ``l3_forgotten`` drops the rest).
    ``bound_for_l3(key)``: L3 holds the page or a write carries it there.
    """

    keyed = True
    announces_scan = False

    def __init__(self, events: EventLog, bound_for_l3: Callable[[bytes], bool]) -> None:
        self.events = events
        self.bound_for_l3 = bound_for_l3
        self.ekeys: dict[bytes, bytes] = {}  # the daemon's key -> the engine's
        self.l3_ekeys: dict[bytes, bytes] = {}

    def by_tokens(self, ns: NamespaceState) -> None:
        raise BadRequest(
            f"namespace {ns.id} names its pages by key (key_scheme "
            f"{ns.spec.key_scheme!r}): use the *_keys operations, not token ids"
        )

    def pins(self, pinned: list[int]) -> list[int]:
        return pinned

    def event_keys(self, keys: list[bytes], *, forget: bool = False) -> list[bytes]:
        if not self.events.enabled:
            return keys
        get = self.ekeys.pop if forget else self.ekeys.get
        found = (get(key, None) for key in keys)
        return [ekey for ekey in found if ekey is not None]

    def left_l2(self, keys: list[bytes]) -> list[bytes]:
        """The engine's keys of pages that left L2; those of pages in L3, or on
        their way there, are kept for the BlockRemoved of the store letting
        them go."""
        if not self.events.enabled:
            return keys
        ekeys, l3_ekeys, bound = self.ekeys, self.l3_ekeys, self.bound_for_l3
        named = []
        for key in keys:
            ekey = ekeys.pop(key, None)
            if ekey is not None:
                named.append(ekey)
                if bound(key):
                    l3_ekeys[key] = ekey
        return named

    def l3_name(self, key: bytes) -> bytes | None:
        return self.ekeys.get(key)

    def remember(self, pages: list[KeyedPage]) -> None:
        """Pages entered L2: named from there (not from the L3 side) from now on."""
        if self.events.enabled:
            ekeys, l3_ekeys = self.ekeys, self.l3_ekeys
            for page in pages:
                ekeys[page.key] = page.ekey
                if l3_ekeys:
                    l3_ekeys.pop(page.key, None)

    def stored(self, ns: NamespaceState, pages: list[KeyedPage], medium: str) -> None:
        """BlockStored events for ``pages``, one per run that follows on (and is
        of one KV cache group)."""
        spec, events, meta = ns.spec, self.events, ns.events
        run: list[bytes] = []
        parent = b""
        for page in pages:
            if run and page.eparent != run[-1]:
                events.stored_named(run, parent, spec.page_tokens, medium, spec.model, meta)
                run = []
            if not run:
                parent = page.eparent
            run.append(page.ekey)
        if run:
            events.stored_named(run, parent, spec.page_tokens, medium, spec.model, meta)

    def removed(self, names: list[bytes], medium: str, model: str) -> None:
        self.events.removed_named(names, medium, model)

    def stored_one(
        self,
        ns: NamespaceState,
        name: bytes,
        parent: bytes | None,
        tokens: list[int],
        medium: str,
    ) -> None:
        spec = ns.spec
        self.events.stored_named([name], parent, spec.page_tokens, medium, spec.model, ns.events)

    def l3_let_go(self, keys: Iterable[bytes]) -> list[bytes]:
        """The engine's keys of pages outside L2 that L3 let go of (forgotten here)."""
        if not self.l3_ekeys:
            return []
        pop = self.l3_ekeys.pop
        return [ekey for key in keys if (ekey := pop(key, None)) is not None]

    def l3_forgotten(self, keys: Iterable[bytes]) -> None:
        """The L3 record dropped ``keys`` to stay within its bound: so do the
        engine's keys kept for them."""
        if self.l3_ekeys:
            pop = self.l3_ekeys.pop
            for key in keys:
                pop(key, None)
