"""Model-based test of hybrid models' namespaces (hicached/integrations/hybrid.py)
against a real daemon whose pool is small enough that eviction never stops.

Three KV cache groups of different kinds and page sizes, one key-addressed
namespace each: full attention (a page per 16 tokens), a sliding window of
48 tokens (a page per 16 tokens) and a recurrent state (a page per 32 tokens,
a window of one page). Random interleavings of:

- stores of chunks of random token sequences, every group's pages of a chunk
  together: a reservation per group, then the commits one group after another,
  a chunk some group got no slot for published in none (the protocol of the
  vLLM manager's ``prepare_store`` / ``_finish_store``, written out here:
  hybrid.py has no store of its own, and the manager's code imports vLLM);
  some of them with one group's commit failing;
- lookups of random prefixes through ``hybrid.lookup``, whose hits are read
  back at once, and some held (their leases open) and read again after every
  step;
- evictions: pages stored in another namespace of one group's page size,
  which take that group's least recently used pages (and now and then a slab
  from another size), so groups lose pages independently; such pressure
  right before a lookup of a sequence stored lately; and such pressure in the
  middle of a lookup, between its probes and its leases;
- releases of held hits.

Fault injection, the only fakes here: a store's failing commit is made by
ending that group's reservation just before its commit, as an expired lease
would be ended, so the daemon really refuses the commit (the groups after it
are released, as the manager does); and the lookups' client (``Pressing``)
stores pages of another namespace right after one of a lookup's probes
answers, when a rule asks it to. Every answer comes from the real daemon.

Invariants (a cache may forget, never lie):
- every page of a hit reads back the bytes stored under its key, in every
  group (a pattern derived from the key), at once and while its lease is held;
- a hit's end is one every group restores with what the model knows was
  committed, and the largest end that what the daemon holds restores (asked
  after the lookup, which pins what it names; with pages leaving during the
  lookup, an end that what it holds restores): a group's page evicted ends
  every hit that needs it, never a partial hit;
- a chunk whose commit failed in one group is never part of a hit that needs
  that group's page there; the daemon holds no page that was not committed;
- leases: the daemon holds exactly the leases of the hits kept, and pins
  exactly their pages (a lookup hands on or ends every lease it took).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import hicached
from hicached.client.handles import KeysFound, Namespace, Reservation
from hicached.errors import HicachedError
from hicached.integrations.hybrid import Answer, Group, Kind, Prefix, Window, lookup
from tests.support import Daemon

UNIT = 16  # tokens a sequence symbol stands for: the smallest page of any group


@dataclass(frozen=True)
class GroupSpec:
    name: str
    kind: Kind
    page_tokens: int
    page_bytes: int


GROUPS = [
    GroupSpec("full", Prefix(), 16, 64 * 1024),  # 15-16 pages a slab
    GroupSpec("sliding", Window(48, "sliding"), 16, 32 * 1024),  # a window of 3 pages
    GroupSpec("state", Window(32, "state"), 32, 96 * 1024),  # one page at the end
]
MAX_UNITS = 8
SEQ = st.lists(st.integers(0, 1), min_size=1, max_size=MAX_UNITS).map(tuple)  # units of 16 tokens
MASK = st.one_of(st.none(), st.integers(0, 255))  # None: every page from ``start`` on
# a sequence stored before (an index into those the example stored), or a new one
BASE = st.one_of(st.integers(0, 15), st.integers(0, 15), SEQ)
FAIL = st.sampled_from([None] * 9 + [0, 1, 2])  # the group whose commit fails
HELD_MAX = 3
# Ten slabs of 1 MiB for three page sizes (and the fillers'): a few sequences'
# pages, so eviction is constant. Slots a store did not publish (a failed
# commit's, a dropped chunk's) stay out of use until their lease's deadline
# (leases.ttl_s, longer than an example) and a quarantine after it, so the pool
# also shrinks as an example goes on, and no-space answers come up too.
POOL: dict[str, Any] = dict(size_mib=10, slab_mib=1)

# Across examples: that the runs reached what the invariants are about.
SEEN = dict.fromkeys(
    ["hits", "lowered", "failed_commits", "evicted", "rereads", "looks", "pressed", "in_parts"],
    0,
)


def spec(g: GroupSpec, filler: bool = False) -> dict[str, Any]:
    return dict(
        model="org/hybrid-filler" if filler else "org/hybrid",
        kv_dtype="bfloat16",
        layout=f"test_{g.name}",
        page_tokens=g.page_tokens,
        page_bytes=g.page_bytes,
        key_scheme="vllm-sha256",
    )


def pattern(key: bytes, size: int) -> np.ndarray:
    """The bytes of the page stored under ``key``."""
    return np.resize(np.frombuffer(hashlib.sha256(key).digest() + key, dtype=np.uint8), size)


def positions(g: GroupSpec, units: int) -> list[int]:
    """Where this group's chunks of a sequence of ``units`` symbols end (tokens)."""
    return list(range(g.page_tokens, units * UNIT + 1, g.page_tokens))


def needed(g: GroupSpec, mine: list[int], end: int) -> list[int]:
    """The positions of this group's pages a hit ending at ``end`` needs (the
    model's own reading of the kinds, not hybrid.py's)."""
    if g.name == "full":
        return [p for p in mine if p <= end]
    window = {"sliding": 48, "state": 32}[g.name]
    return [p for p in mine if end - window < p <= end]


def best_end(units: int, has: Callable[[int, int], bool]) -> int:
    """The largest end every group restores, ``has(group, position)`` saying
    which pages are there; 0 if none."""
    ends = set.intersection(*(set(positions(g, units)) for g in GROUPS))
    for end in sorted(ends, reverse=True):
        if all(restores(n, units, end, has) for n in range(len(GROUPS))):
            return end
    return 0


def restores(n: int, units: int, end: int, has: Callable[[int, int], bool]) -> bool:
    g = GROUPS[n]
    return all(has(n, p) for p in needed(g, positions(g, units), end))


class Pressing(hicached.AsyncClient):
    """Fault injection: pool pressure (real pages stored by another client)
    right after one of a lookup's window probes answers, so that pages the
    lookup saw there leave L2 before it leases them, as the daemon's own
    eviction for another client's store may do between two requests. And
    ``limit``: where set, the most keys a request takes as this client tells
    a lookup (as a daemon's ``server.max_pages_per_request`` or
    ``server.max_message_bytes`` does), so that
    lookups ask about a group's keys in parts and read a hit through a lease
    a part."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.press: Callable[[], None] | None = None
        self.skip = 0  # probes to let by first
        self.limit = 0

    def keys_per_request(self, keys: Sequence[bytes]) -> int:
        return self.limit or super().keys_per_request(keys)

    async def exists_keys(self, ns: Namespace, keys: Sequence[bytes]) -> KeysFound:
        found = await super().exists_keys(ns, keys)
        if self.press is not None:
            if self.skip:
                self.skip -= 1
            else:
                press, self.press = self.press, None
                press()
        return found


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # a daemon of its own: each example starts from an empty pool, and a
        # failing one replays the same
        self.daemon = Daemon(**POOL).start()
        self.loop = asyncio.new_event_loop()
        self.c = self.daemon.client()
        self.ac = Pressing(self.daemon.endpoint, timeout=5.0)
        self.ns = [self.c.register(**spec(g)) for g in GROUPS]
        self.filler = [self.c.register(**spec(g, filler=True)) for g in GROUPS]
        self.ans = [self.run(self.ac.register(**spec(g))) for g in GROUPS]
        self.committed: list[set[bytes]] = [set() for _ in GROUPS]  # ever published
        self.failed: list[set[bytes]] = [set() for _ in GROUPS]  # a commit refused them
        self.held: list[tuple[Answer, int, tuple[int, ...]]] = []  # (answer, units, seq)
        self.fillers = itertools.count()
        self.sequences: list[tuple[int, ...]] = []  # those stored, for lookups to ask about

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def pick(self, base: int | tuple[int, ...]) -> tuple[int, ...]:
        """A sequence: one stored before (by index, from the latest), or ``base``."""
        if isinstance(base, tuple):
            return base
        return self.sequences[-1 - base % len(self.sequences)] if self.sequences else ()

    def key(self, n: int, seq: tuple[int, ...], end: int) -> bytes:
        """Group ``n``'s key for the chunk of ``seq`` ending at token ``end``: the
        chained hash of the tokens before ``end`` and the group's index (vLLM's)."""
        digest = hashlib.sha256(bytes(seq[: end // UNIT])).digest()
        return digest + n.to_bytes(4, "big")

    # -- stores ---------------------------------------------------------------------------

    @initialize(seq=SEQ, limit=st.sampled_from([0, 0, 1, 2, 3]))
    def first(self, seq: tuple[int, ...], limit: int) -> None:
        """A sequence stored whole before anything else, for lookups to find; and
        the most keys of a group one of the lookups' requests asks about (0: all)."""
        self.ac.limit = limit
        self.put(seq, [positions(g, len(seq)) for g in GROUPS], None)

    @rule(base=BASE, more=SEQ, fail=FAIL)
    def store(self, base: int | tuple[int, ...], more: tuple[int, ...], fail: int | None) -> None:
        """Store a sequence (one stored before, extended) as an engine does: every
        group's pages (the daemon skips those it holds)."""
        s = (self.pick(base) + more)[:MAX_UNITS]
        self.put(s, [positions(g, len(s)) for g in GROUPS], fail)

    @rule(
        base=BASE,
        more=SEQ,
        start=st.integers(0, MAX_UNITS - 1),
        sliding=MASK,
        state=MASK,
        fail=FAIL,
    )
    def store_some(
        self,
        base: int | tuple[int, ...],
        more: tuple[int, ...],
        start: int,
        sliding: int | None,
        state: int | None,
        fail: int | None,
    ) -> None:
        """Store some chunks of a sequence: full attention from unit ``start`` on,
        the other groups where their mask says (None: as full attention)."""
        s = (self.pick(base) + more)[:MAX_UNITS]
        start = min(start, len(s) - 1)
        chosen: list[list[int]] = []
        for g, mask in zip(GROUPS, [None, sliding, state], strict=True):
            mine = [p for p in positions(g, len(s)) if p > start * UNIT]
            if mask is not None:
                mine = [p for p in mine if mask >> (p // UNIT - 1) & 1]
            chosen.append(mine)
        self.put(s, chosen, fail)

    def put(self, s: tuple[int, ...], chosen: list[list[int]], fail: int | None) -> None:
        """Store each group's chunks of ``s`` ending at ``chosen[group]``, every
        group's page of a chunk together; ``fail``: the group whose commit fails
        (fault injection)."""
        if s in self.sequences:
            self.sequences.remove(s)
        self.sequences.append(s)
        # a reservation per group, each under the key before its first
        parts: list[tuple[int, Reservation, list[int]]] = []
        for n, mine in enumerate(chosen):
            if not mine:
                continue
            g = GROUPS[n]
            before = mine[0] - g.page_tokens
            parent = self.key(n, s, before) if before > 0 else None
            keys = [self.key(n, s, p) for p in mine]
            parts.append((n, self.c.reserve_keys(self.ns[n], keys, parent=parent), mine))
        # a chunk some group got no slot for is published in none
        dropped = {
            mine[i]
            for _, res, mine in parts
            for i in range(len(mine))
            if not res.present_mask[i] and i not in res.indices
        }
        failing = fail is not None and any(n == fail and res.lease for n, res, _ in parts)
        gone = False
        for n, res, mine in parts:
            if not res.lease:
                continue  # nothing reserved, nothing pinned
            fresh = [mine[i] for i in res.indices]
            keys = [self.key(n, s, p) for p in fresh]
            if gone:  # an earlier group's commit failed: this one publishes nothing
                self.c.release(res)
                continue
            size = GROUPS[n].page_bytes
            self.c.write_pages(res, np.stack([pattern(k, size) for k in keys]))
            mask = [p not in dropped for p in fresh]
            if failing and n == fail:
                # fault injection: the lease ends before its commit (as at its expiry)
                self.c.release(res)
                try:
                    self.c.commit(res, ok=mask)
                except HicachedError:
                    gone = True
                else:
                    raise AssertionError("the commit of an ended reservation went through")
                self.failed[n].update(k for k, ok in zip(keys, mask, strict=True) if ok)
                SEEN["failed_commits"] += 1
                continue
            published = self.c.commit(res, ok=mask).published
            assert published == sum(mask), f"{published} pages published of {sum(mask)}"
            self.committed[n].update(k for k, ok in zip(keys, mask, strict=True) if ok)

    # -- lookups --------------------------------------------------------------------------

    @rule(
        base=BASE,
        cut=st.one_of(st.none(), st.integers(1, MAX_UNITS)),
        more=st.one_of(st.just(()), SEQ),
        keep=st.booleans(),
    )
    def look_up(
        self,
        base: int | tuple[int, ...],
        cut: int | None,
        more: tuple[int, ...],
        keep: bool,
        moved: bool = False,
    ) -> None:
        """Look up a sequence stored before (or a new one), or a prefix of it
        (``cut`` units), or it extended by ``more``. ``moved``: pages may leave
        L2 while the lookup runs."""
        SEEN["looks"] += 1
        s = (self.pick(base)[:cut] + more)[:MAX_UNITS]
        if not s:
            return
        units = len(s)
        groups = [
            Group(
                self.ans[n],
                g.kind,
                [self.key(n, s, p) for p in positions(g, units)],
                positions(g, units),
            )
            for n, g in enumerate(GROUPS)
        ]
        answer: Answer = self.run(lookup(self.ac, groups, prefetch_timeout_s=1.0))
        try:
            self.check(answer, units, s, moved)
        except BaseException:
            self.run(self.release(answer))
            raise
        if keep and answer.end and len(self.held) < HELD_MAX:
            self.held.append((answer, units, s))
        else:
            self.run(self.release(answer))

    def check(self, answer: Answer, units: int, s: tuple[int, ...], moved: bool) -> None:
        """What one answer must be, against the model and against what the daemon
        holds right after it: the largest end that restores, or, when pages
        left L2 during the lookup (``moved``), an end that restores (a lookup
        whose pages keep leaving gives up: a miss)."""
        end = answer.end
        # what the daemon holds of this sequence now (nothing moved since the lookup)
        there: list[dict[int, bool]] = []
        for n, g in enumerate(GROUPS):
            mine = positions(g, units)
            found = self.c.exists_keys(self.ns[n], [self.key(n, s, p) for p in mine])
            there.append(dict(zip(mine, found.in_l2, strict=True)))
            for p, l2 in there[-1].items():
                key = self.key(n, s, p)
                assert not l2 or key in self.committed[n], f"{g.name} holds a page never committed"
        best = best_end(units, lambda n, p: there[n][p])
        if not moved:
            assert end == best, f"hit at {end}, but what the daemon holds restores {best}"
        elif end:
            assert all(
                restores(n, units, end, lambda n, p: there[n][p]) for n in range(len(GROUPS))
            ), f"hit at {end}, which what the daemon holds does not restore"
        if not end:
            assert (answer.hits, answer.leases) == ({}, [])
            stored = best_end(units, lambda n, p: self.key(n, s, p) in self.committed[n])
            SEEN["lowered"] += stored > 0  # stored once, gone from some group since
            return
        want: set[bytes] = set()
        for n, g in enumerate(GROUPS):
            for p in needed(g, positions(g, units), end):
                key = self.key(n, s, p)
                assert key not in self.failed[n] or key in self.committed[n], (
                    f"a hit at {end} needs {g.name}'s page at {p}, whose commit failed"
                )
                assert key in self.committed[n], f"a hit at {end} needs {g.name}'s page at {p}"
                want.add(key)
        assert set(answer.hits) == want, "a hit's pages are what each group needs at its end"
        self.read(answer, s)
        SEEN["hits"] += 1
        SEEN["in_parts"] += any(len(mine) > 1 for mine in answer.handles)
        if end < best_end(units, lambda n, p: self.key(n, s, p) in self.committed[n]):
            SEEN["lowered"] += 1

    def read(self, answer: Answer, s: tuple[int, ...]) -> None:
        """Every page of the hit reads back the bytes stored under its key."""
        by_group: dict[tuple[int, int], list[tuple[bytes, int]]] = {}
        for key, (n, part, place) in answer.hits.items():
            by_group.setdefault((n, part), []).append((key, place))
        for (n, part), pages in by_group.items():
            handle = answer.handles[n][part]
            got = self.ac.read_pages(handle.select([place for _, place in pages]))
            for (key, _), page in zip(pages, got, strict=True):
                want = pattern(key, GROUPS[n].page_bytes)
                assert np.array_equal(page, want), f"{GROUPS[n].name}: bytes not stored there"

    @precondition(lambda self: bool(self.held))
    @rule(which=st.integers(0, HELD_MAX - 1))
    def release_held(self, which: int) -> None:
        answer, _, _ = self.held.pop(which % len(self.held))
        self.run(self.release(answer))

    async def release(self, answer: Answer) -> None:
        for hit in answer.leases:
            await self.ac.release(hit)

    # -- evictions ------------------------------------------------------------------------

    @rule(group=st.integers(0, len(GROUPS) - 1), pages=st.integers(1, 32))
    def evict(self, group: int, pages: int) -> None:
        """Pool pressure in one group's page size: pages of another namespace of
        that size are stored, and the least recently used pages go (now and then
        a slab of another size)."""
        before = self.c.stats().evicted_pages
        keys = [
            hashlib.sha256(next(self.fillers).to_bytes(8, "big")).digest() for _ in range(pages)
        ]
        res = self.c.reserve_keys(self.filler[group], keys)
        if res.lease:
            size = GROUPS[group].page_bytes
            self.c.write_pages(res, np.zeros((len(res.offsets), size), dtype=np.uint8))
            self.c.commit(res)
        SEEN["evicted"] += self.c.stats().evicted_pages - before

    @rule(group=st.integers(0, len(GROUPS) - 1), pages=st.integers(16, 64), which=st.integers(0, 7))
    def evict_and_look_up(self, group: int, pages: int, which: int) -> None:
        """The case the answers' exactness is most about: pressure in one group's
        page size, then a lookup of a sequence stored lately, whose pages of
        that group may be gone while the other groups' are there."""
        self.evict(group, pages)
        self.look_up(which, None, (), keep=False)

    @rule(
        group=st.integers(1, len(GROUPS) - 1),
        pages=st.integers(8, 64),
        skip=st.integers(0, 1),
        which=st.integers(0, 7),
    )
    def look_up_while_evicting(self, group: int, pages: int, skip: int, which: int) -> None:
        """A lookup during which a window group's pages leave L2: after one of
        its probes (``skip`` probes in) pool pressure in that group's page size
        (fault injection: see Pressing)."""
        before = self.c.stats().evicted_pages
        self.ac.press, self.ac.skip = (lambda: self.evict(group, pages)), skip
        try:
            self.look_up(which, None, (), keep=False, moved=True)
        finally:
            self.ac.press = None
        SEEN["pressed"] += self.c.stats().evicted_pages > before

    # -- leases ---------------------------------------------------------------------------

    @invariant()
    def held_hits_read_what_was_stored(self) -> None:
        """Hits kept across stores and evictions still read what was stored."""
        for answer, _, s in self.held:
            self.read(answer, s)
            SEEN["rereads"] += 1

    @invariant()
    def leases_are_the_held_hits(self) -> None:
        stats = self.c.stats()
        leases = [hit for answer, _, _ in self.held for hit in answer.leases]
        assert stats.leases == len(leases), f"{stats.leases} leases open, {len(leases)} held"
        slots = {(hit.ns.id, off) for hit in leases for off in hit.offsets}
        assert stats.pinned_pages == len(slots), (
            f"{stats.pinned_pages} pages pinned, the held hits lease {len(slots)}"
        )

    def teardown(self) -> None:
        try:
            for answer, _, _ in self.held:
                self.run(self.release(answer))
            self.run(self.ac.close())
        finally:
            self.c.close()
            self.loop.close()
            self.daemon.cleanup()


def test_hybrid_namespaces_model() -> None:
    from hypothesis.stateful import run_state_machine_as_test

    for k in SEEN:
        SEEN[k] = 0
    # No shrinking: every example starts a daemon (a third of a second), so
    # shrinking a failure would take minutes; the failing steps are printed as
    # they ran, and the example database replays them first next time.
    run_state_machine_as_test(
        HybridMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=30,
            deadline=None,
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
        ),
    )
    # the runs reached what the invariants are about
    assert all(SEEN.values()), f"some cases never came up: {SEEN}"
