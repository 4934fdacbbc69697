"""Reads: what a client may find, in L2 and in L3 (match, match_keys, exists_keys).

A match returns the leading pages of a sequence that L2 holds (pinned under
a read lease if asked) and how many more L3 holds. Unknown is not absent:
while the record of what L3 holds is incomplete (the startup scan runs, or
keys were forgotten to stay within ``storage.known_keys``), a read whose L3
part stops at a key the record does not know returns an ``L3Lookup``
instead of its reply; the server has the tier ask the backend about those
keys under a deadline, and sends what ``finish`` makes of the answer.
Requests the record can answer return their reply at once, as always.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from hicached.cache.sessions import Handlers, NamespaceState, Session
from hicached.wire import protocol as p
from hicached.wire.hashing import page_keys

if TYPE_CHECKING:
    from hicached.cache.desk import Cache

__all__ = ["L3Lookup", "Reads"]


class L3Lookup:
    """A reply that waits on L3: the record of what L3 holds is incomplete and
    does not know ``keys`` (of namespace digest ``ns``, in order), so the
    backend is asked how many of them it holds before they are answered as
    absent. ``finish(found)`` makes the reply, ``found`` being that leading
    count (0 when the backend could not tell in time: the reply says what the
    record knows then, and a miss is always legal). ``lease``: the read lease
    the reply will carry (0 for none), ended if the reply cannot be sent;
    ``id``: the request's, for an error reply."""

    __slots__ = ("finish", "id", "keys", "lease", "ns")

    def __init__(
        self,
        ns: bytes,
        keys: list[bytes],
        finish: Callable[[int], p.AnyReply],
        request_id: int,
        lease: int = 0,
    ) -> None:
        self.ns = ns
        self.keys = keys
        self.finish = finish
        self.id = request_id
        self.lease = lease


class Reads:
    """Matches and existence checks; counts the pages asked for and found."""

    def __init__(self, desk: Cache) -> None:
        self.desk = desk
        self.pages = {"asked": 0, "l2": 0, "l3": 0}

    def handlers(self) -> Handlers:
        return {p.Match: self.match, p.MatchKeys: self.match_keys, p.ExistsKeys: self.exists_keys}

    def match(self, session: Session, msg: p.Match) -> p.MatchOk | L3Lookup:
        desk = self.desk
        ns, tokens = desk.names.of(session, msg.ns), msg.tokens
        pages = desk.names.token_pages(ns, tokens)
        seed, page_tokens = ns.digest, ns.spec.page_tokens
        tag, keys = desk.key_cache.cached(seed, tokens)
        if keys is None:
            first = page_keys(seed, tokens, page_tokens, max_pages=1)
            l3 = desk.l3
            if first and not ns.tree.starts(first[0]) and first[0] not in l3 and l3.complete:
                # the first page is in neither tier, so none is: a miss, without
                # hashing the rest (a store of it hashes them, as it would anyway);
                # while L3's record is incomplete, L3 is asked about them all
                return self._match(session, ns, [], msg.lease, msg.id, asked=pages)
            keys = desk.key_cache.compute(tag, seed, tokens, page_tokens, first)
        return self._match(session, ns, keys, msg.lease, msg.id)

    def match_keys(self, session: Session, msg: p.MatchKeys) -> p.MatchOk | L3Lookup:
        names = self.desk.names
        ns = names.of(session, msg.ns)
        return self._match(session, ns, names.engine_keys(ns, msg.keys), msg.lease, msg.id)

    def _match(
        self,
        session: Session,
        ns: NamespaceState,
        keys: list[bytes],
        lease: bool,
        request_id: int,
        asked: int | None = None,
    ) -> p.MatchOk | L3Lookup:
        """The leading ``keys`` in L2 (pinned under a read lease if asked), and how
        many more L3 holds; for ``match`` and ``match_keys`` alike (``asked``:
        the pages asked for, when ``keys`` stops short of them). Where the L3
        part stops at a key an incomplete record does not know, an L3Lookup
        for the rest."""
        desk = self.desk
        l3 = desk.l3
        slots = ns.index.match(keys) if keys else []
        hits = len(slots)
        lease_id = desk.leasing.new(session, ns, slots).id if lease and slots else 0
        # while the store is down no read of it can be served: none is an L3 hit
        down = self._l3_down()
        l3_hits = l3.leading(keys, hits) if l3 and not down else 0
        asked = len(keys) if asked is None else asked
        counted = self.pages
        counted["asked"] += asked
        counted["l2"] += hits
        ns.book.asked += asked
        ns.book.hits += hits
        if hits and desk.tier is not None:
            desk.policy.matched(desk.tiering, ns, keys[:hits], slots)
        known = hits + l3_hits
        if known < len(keys) and not l3.complete and not down:
            unknown = keys[known:]

            def finish(found: int) -> p.MatchOk:
                more = max(found, desk.l3.leading(unknown, 0))  # the scan may have found them
                counted["l3"] += l3_hits + more
                return p.MatchOk(
                    id=request_id, hits=hits, offsets=slots, lease=lease_id, l3_hits=l3_hits + more
                )

            return L3Lookup(ns.digest, unknown, finish, request_id, lease_id)
        counted["l3"] += l3_hits
        return p.MatchOk(id=request_id, hits=hits, offsets=slots, lease=lease_id, l3_hits=l3_hits)

    def _l3_down(self) -> bool:
        """Whether the store is marked down: what the record knows of it is then
        no hit (a miss is always legal), and it is not asked."""
        tier = self.desk.tier
        return tier is not None and tier.down

    def exists_keys(self, session: Session, msg: p.ExistsKeys) -> p.ExistsKeysOk | L3Lookup:
        desk = self.desk
        ns = desk.names.of(session, msg.ns)
        keys = desk.names.engine_keys(ns, msg.keys)
        in_l2 = ns.table.present(keys)  # a byte per key: 1 in L2, | 2 in L3
        where = in_l2
        l3 = desk.l3
        down = self._l3_down()
        if l3 and not down:
            in_l3 = np.array(l3.which(keys), dtype=np.uint8) << 1
            where = (np.frombuffer(in_l2, dtype=np.uint8) | in_l3).tobytes()
        leading = _leading(where)
        if leading < len(keys) and not l3.complete and not down:
            return self._exists_lookup(msg.id, ns, keys, in_l2, leading)
        return p.ExistsKeysOk(id=msg.id, l2=_leading(in_l2), leading=leading, where=where)

    def _exists_lookup(
        self, request_id: int, ns: NamespaceState, keys: list[bytes], in_l2: bytes, known: int
    ) -> L3Lookup:
        """``exists_keys`` past its ``known`` leading keys, once L3 was asked:
        the run the backend holds from there is marked as in L3."""
        unknown = keys[known:]
        desk = self.desk

        def finish(found: int) -> p.ExistsKeysOk:
            flags = np.frombuffer(in_l2, dtype=np.uint8).copy()
            l3 = desk.l3
            if l3:  # as known now: the scan may have found more meanwhile
                flags |= np.array(l3.which(keys), dtype=np.uint8) << 1
            flags[known : known + found] |= 2
            where = flags.tobytes()
            return p.ExistsKeysOk(
                id=request_id, l2=_leading(in_l2), leading=_leading(where), where=where
            )

        return L3Lookup(ns.digest, unknown, finish, request_id)


def _leading(flags: bytes) -> int:
    """How many leading bytes of ``flags`` are set (not 0)."""
    first = flags.find(0)
    return len(flags) if first < 0 else first
