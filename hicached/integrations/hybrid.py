"""Hybrid models: one chunk of tokens kept as several KV cache groups, and the
prefix that every group can restore.

An engine may keep a model's layers in several *groups*, each of its own kind
and page size: full attention (every chunk of a prefix is needed to go on
from its end), sliding-window or chunked-local attention (only the chunks
inside the window before the end), Mamba or linear-attention state (only the
state at the end: a window of one chunk). Each group's pages live in a
key-addressed namespace of their own (their own page_bytes). A prefix ending
at ``end`` can be restored only if *every* group has what its kind needs there,
so a hit is the largest ``end`` that all groups accept (the intersection over
groups), and the pages it reads are, per group, what that group needs at
``end`` (and, for a window with a ``lead``, the pages just before it that are
there): a half-present prefix is a miss, never a partial load.

``restorable_end`` is that intersection, synchronous and without I/O.
``lookup`` asks the daemon: what the groups hold (a full-attention group's
leading run under a read lease at once, a window group's keys one by one),
the end all of them can restore, the pages of that end loaded from L3 first
where only L3 holds them, then read leases on exactly those pages, and the
end again from what the leases hold, so an answer never names a page that was
evicted in between. A request to the daemon covers its
``server.max_pages_per_request`` keys at most (fewer where more would be
over its ``server.max_message_bytes``), so a group with more is asked
about in parts, and its hit is read through a lease a part. Engine-neutral:
the vLLM integration builds the groups from vLLM's KV cache specs
(hicached/integrations/vllm/groups.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise

from hicached.client import AsyncClient
from hicached.client.handles import Fetch, Hit, Namespace
from hicached.errors import HicachedError
from hicached.integrations.common import parts

__all__ = [
    "ABSENT",
    "IN_L2",
    "IN_L3",
    "Answer",
    "Group",
    "GroupView",
    "Kind",
    "Prefix",
    "Window",
    "lookup",
    "parts",
    "restorable_end",
]

# Where a key's page is, as far as the daemon knows.
ABSENT, IN_L2, IN_L3 = 0, 1, 2


# -- kinds ------------------------------------------------------------------------------


class Kind:
    """What a group of one kind needs of the chunks before a hit's end: the pages
    whose chunks end after ``since(end)`` and at or before ``end``."""

    name = ""

    @property
    def label(self) -> str:
        """The kind and its size, for names and logs."""
        return self.name

    def since(self, end: int) -> int:
        raise NotImplementedError

    async def probe(
        self, client: AsyncClient, ns: Namespace, keys: list[bytes], held: list[Hit]
    ) -> Probe:
        """Where each of ``keys`` is (ABSENT, IN_L2, IN_L3), and the read leases
        the question already takes (each also added to ``held`` as it is taken,
        for the lookup to release should a later request fail)."""
        raise NotImplementedError


# A read lease and the index, among its group's keys, of the first key it holds.
Leased = tuple[Hit, int]


@dataclass(frozen=True, slots=True)
class Probe:
    """A first look at a group's keys: where each one is, and the read leases the
    look took, if it took some (on a leading run of the keys, a lease a part)."""

    flags: list[int]
    leases: list[Leased] = field(default_factory=list)


class Prefix(Kind):
    """Full attention: every chunk from the first one asked about up to the end.
    Its leading run is asked for with a read lease at once (one request a
    part: for a model of one such group, the whole lookup), part after part
    while each part is there whole."""

    name = "full"

    def since(self, end: int) -> int:
        return -1

    async def probe(
        self, client: AsyncClient, ns: Namespace, keys: list[bytes], held: list[Hit]
    ) -> Probe:
        flags: list[int] = []
        leases: list[Leased] = []
        for part in parts(len(keys), client.keys_per_request(keys)):
            hit = await client.match_keys(ns, keys[part.start : part.stop])
            if hit.lease:
                held.append(hit)
                leases.append((hit, part.start))
            flags += [IN_L2] * hit.hits + [IN_L3] * hit.l3_hits
            if len(flags) < part.stop:
                break  # the prefix ends in this part
        return Probe(flags + [ABSENT] * (len(keys) - len(flags)), leases)


@dataclass(frozen=True)
class Window(Kind):
    """Sliding-window or chunked-local attention, or a recurrent state (a window
    of one chunk): only the chunks ending in the last ``tokens`` tokens before the
    end. The keys may have holes (an engine stores a window's chunks, not the
    whole prefix), so each key is asked about on its own, without a lease.

    ``lead``: tokens before the window that a hit also serves where they are
    there, never needs: an engine whose hit ends inside the last chunk needs
    the window that ends there, which reaches one chunk further back (vLLM's
    ``load_window_size_in_chunks``), and one that asks a drafter's group for
    one chunk past its hit's end needs a window one chunk longer there (vLLM's
    EAGLE/MTP groups)."""

    tokens: int
    name: str = "window"
    lead: int = 0

    @property
    def label(self) -> str:
        return f"{self.name}{self.tokens}"

    def since(self, end: int) -> int:
        return end - self.tokens

    async def probe(
        self, client: AsyncClient, ns: Namespace, keys: list[bytes], held: list[Hit]
    ) -> Probe:
        flags: list[int] = []
        for part in parts(len(keys), client.keys_per_request(keys)):
            found = await client.exists_keys(ns, keys[part.start : part.stop])
            flags += [
                IN_L2 if l2 else IN_L3 if l3 else ABSENT
                for l2, l3 in zip(found.in_l2, found.in_l3, strict=True)
            ]
        return Probe(flags)


# -- the intersection -------------------------------------------------------------------


class GroupView:
    """One group's keys asked about, by the token position where each one's chunk
    ends (ascending), and which of them are there."""

    __slots__ = ("_absent", "_present", "kind", "positions")

    def __init__(self, kind: Kind, positions: Sequence[int], present: Sequence[bool]) -> None:
        assert len(positions) == len(present), "one presence flag per key"
        assert all(a < b for a, b in pairwise(positions)), "positions must ascend"
        self.kind = kind
        self.positions = list(positions)
        self._present = [bool(p) for p in present]
        # absent[i]: how many of the first i keys are missing
        self._absent = [0, *accumulate(not p for p in present)]

    def needed(self, end: int) -> range:
        """The indices of the keys a hit ending at ``end`` needs of this group."""
        lo = bisect_right(self.positions, self.kind.since(end))
        return range(lo, bisect_right(self.positions, end))

    def wanted(self, end: int) -> range:
        """The indices of the keys a hit ending at ``end`` reads of this group: the
        keys it needs, and before them those of the kind's ``lead`` that are
        there, in one run (a hole ends it)."""
        need = self.needed(end)
        lead = getattr(self.kind, "lead", 0)
        if not lead or not need:
            return need
        lo = bisect_right(self.positions, self.kind.since(end) - lead)
        start = need.start
        while start > lo and self._present[start - 1]:
            start -= 1
        return range(start, need.stop)

    def restores(self, end: int) -> bool:
        """This group has a key ending at ``end`` and every key it needs there."""
        need = self.needed(end)
        if not need or self.positions[need.stop - 1] != end:
            return False
        return self._absent[need.stop] == self._absent[need.start]


def restorable_end(views: Sequence[GroupView]) -> int:
    """The largest chunk end that every group can restore (0: none): an end where
    each group has a key, and has every page its kind needs before it."""
    if not views:
        return 0
    ends = set(views[0].positions).intersection(*(v.positions for v in views[1:]))
    for end in sorted(ends, reverse=True):
        if all(view.restores(end) for view in views):
            return end
    return 0


# -- asking the daemon ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Group:
    """One group's part of a question: its namespace, its kind, and its keys by
    the position where each key's chunk ends (ascending). ``before``: where
    the engine knows them, the key of the chunk right before each key's (a
    page loaded from L3 enters L2 under it, as the engine's own events would
    announce it); a key without one follows no key (the first chunk, or one
    after a hole). None: the keys follow one another, the first none."""

    ns: Namespace
    kind: Kind
    keys: list[bytes]
    positions: list[int]
    before: Mapping[bytes, bytes] | None = None


@dataclass(slots=True)
class Answer:
    """What the groups can restore: ``end`` (0: nothing), and for each key of the
    hit, its group, which of that group's handles it is read through and its
    place there. Per group, ``handles`` are the read leases its keys are read
    through, in the keys' order (more than one where the daemon took the
    group's keys in parts; none for a group without keys in the hit).
    ``pending`` keys are on their way from L3 (ask again). The answer owns
    ``leases`` (its handles'), which whoever drops it releases."""

    end: int = 0
    hits: dict[bytes, tuple[int, int, int]] = field(default_factory=dict)
    handles: list[list[Hit]] = field(default_factory=list)
    pending: frozenset[bytes] = frozenset()
    leases: list[Hit] = field(default_factory=list)


async def lookup(
    client: AsyncClient,
    groups: Sequence[Group],
    *,
    prefetch_timeout_s: float,
    on_pending: Callable[[Answer], None] | None = None,
) -> Answer:
    """The hit every group can restore, under read leases on its pages (a
    full-attention group's leading run is leased whole, by its first request).

    Pages only L3 holds are loaded into L2 first, for at most
    ``prefetch_timeout_s``; meanwhile ``on_pending`` gets an answer that names
    them pending (and holds no lease). A page that left L2 between the first
    look and its lease is taken as absent and the end found again (a few
    times at most, then it is a miss). On an error or a cancel, every lease
    taken so far is released before it is raised, a cancel meanwhile
    notwithstanding. Each request to the daemon asks about as many keys of
    one group as the daemon takes a request at most (``parts``,
    ``keys_per_request``), so no question is refused as too large."""
    held: list[Hit] = []
    try:
        probes = [
            await g.kind.probe(client, g.ns, g.keys, held) if g.keys else Probe([]) for g in groups
        ]
        present = [[f != ABSENT for f in p.flags] for p in probes]
        # per group: the leases its hit may be read through
        leases: list[list[Leased]] = [list(p.leases) for p in probes]
        loaded = False
        end = 0
        for _ in range(ROUNDS):
            views = [
                GroupView(g.kind, g.positions, on) for g, on in zip(groups, present, strict=True)
            ]
            end = restorable_end(views)
            if not end:
                break
            if not loaded:
                loaded = True
                if not await _load(
                    client, groups, probes, views, end, prefetch_timeout_s, on_pending
                ):
                    _skip_leads_in_l3(probes, present, views, end)
                    views = [
                        GroupView(g.kind, g.positions, on)
                        for g, on in zip(groups, present, strict=True)
                    ]
            needs = [view.wanted(end) for view in views]
            short = False
            for n, (g, need) in enumerate(zip(groups, needs, strict=True)):
                if _cover(leases[n], need) is not None:
                    continue
                got, found = await _lease(client, g, need, held)
                if found == len(need):
                    leases[n] = got
                else:  # that page left L2 (or never came from L3): absent now
                    present[n][need.start + found] = False
                    short = True
            if not short:
                break
        else:
            end = 0  # pages kept leaving: a miss
        return await _answer(client, groups, present, leases, held, end)
    except BaseException:
        await _release(client, held)
        raise


# How often a lookup finds its end again after a page it meant to lease was gone.
ROUNDS = 4


async def _lease(
    client: AsyncClient, g: Group, need: range, held: list[Hit]
) -> tuple[list[Leased], int]:
    """Read leases on group ``g``'s keys ``need``, a part a request, while each
    part is in L2 whole: the leases (each also in ``held``) and how many of
    the keys, from the first, they hold."""
    got: list[Leased] = []
    found = 0
    for part in parts(len(need), client.keys_per_request(g.keys)):
        first = need.start + part.start
        hit = await client.match_keys(g.ns, g.keys[first : need.start + part.stop])
        if hit.lease:
            held.append(hit)
            got.append((hit, first))
        found += hit.hits
        if hit.hits < len(part):
            break
    return got, found


def _cover(leases: Sequence[Leased], need: range) -> list[tuple[Hit, int, range]] | None:
    """The leases the keys ``need`` are read through, in the keys' order: each
    with the index of its first key and the keys of ``need`` read through it
    (each key through one lease); None where some key is in none of them."""
    cover: list[tuple[Hit, int, range]] = []
    at = need.start
    while at < need.stop:
        holding = [(hit, first) for hit, first in leases if first <= at < first + hit.hits]
        if not holding:
            return None
        hit, first = max(holding, key=lambda lease: lease[1] + lease[0].hits)
        stop = min(need.stop, first + hit.hits)
        cover.append((hit, first, range(at, stop)))
        at = stop
    return cover


async def _answer(
    client: AsyncClient,
    groups: Sequence[Group],
    present: list[list[bool]],
    leases: list[list[Leased]],
    held: list[Hit],
    end: int,
) -> Answer:
    """The answer for ``end``: each needed key's place in one of its group's
    leases; the leases it does not read through are released now."""
    hits: dict[bytes, tuple[int, int, int]] = {}
    handles: list[list[Hit]] = [[] for _ in groups]
    if end:
        for n, (g, on) in enumerate(zip(groups, present, strict=True)):
            cover = _cover(leases[n], GroupView(g.kind, g.positions, on).wanted(end))
            assert cover is not None, "an end beyond the leases"
            for part, (hit, first, read) in enumerate(cover):
                handles[n].append(hit)
                hits.update((g.keys[i], (n, part, i - first)) for i in read)
    used = {id(h) for mine in handles for h in mine}
    await _release(client, [h for h in held if id(h) not in used])
    return Answer(end, hits, handles, leases=[h for h in held if id(h) in used])


async def _load(
    client: AsyncClient,
    groups: Sequence[Group],
    probes: list[Probe],
    views: list[GroupView],
    end: int,
    timeout_s: float,
    on_pending: Callable[[Answer], None] | None,
) -> bool:
    """Bring the pages a hit at ``end`` reads that only L3 holds into L2, saying
    meanwhile (``on_pending``) that the hit's keys are on their way; False
    when no page it needs is in L3 only (nothing loaded). A window's lead is
    loaded only beside pages the hit needs (never a wait of its own, for pages
    the hit does without), and apart from them: a prefetch stops at a page
    that does not come, and a lead L3 no longer has must not keep back the
    window after it."""
    loading: list[tuple[Group, list[bytes]]] = []
    leads: list[tuple[Group, list[bytes]]] = []
    for g, p, view in zip(groups, probes, views, strict=True):
        need, wanted = view.needed(end), view.wanted(end)
        for part, into in ((range(wanted.start, need.start), leads), (need, loading)):
            if any(p.flags[i] == IN_L3 for i in part):
                into.append((g, [g.keys[i] for i in part]))
    if not loading:
        return False
    loading += leads
    if on_pending is not None:
        pairs = zip(groups, views, strict=True)
        pending = frozenset(g.keys[i] for g, view in pairs for i in view.wanted(end))
        on_pending(Answer(end, handles=[[] for _ in groups], pending=pending))
    await _from_l3(client, loading, timeout_s)
    return True


def _skip_leads_in_l3(
    probes: list[Probe], present: list[list[bool]], views: list[GroupView], end: int
) -> None:
    """Nothing a hit at ``end`` needs was loaded from L3: the lead pages that
    only L3 holds are taken as absent, so the hit is leased at once without
    them (a lead is read where it is in L2, never waited for)."""
    for p, on, view in zip(probes, present, views, strict=True):
        wanted, need = view.wanted(end), view.needed(end)
        for i in range(wanted.start, need.start):
            if p.flags[i] == IN_L3:
                on[i] = False


async def _from_l3(
    client: AsyncClient, loading: list[tuple[Group, list[bytes]]], timeout_s: float
) -> None:
    """Load these keys of each group from L3 into L2 (all at once, a prefetch a
    part, within ``timeout_s``); the leading pages of each part that arrived
    in time are committed, the rest released. Whatever did not come is found
    absent by the leases after."""
    fetches: list[Fetch] = []
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    try:
        for g, keys in loading:
            for run, parent in _runs(g, keys):
                for part in parts(len(run), client.keys_per_request(run)):
                    # a part's first page enters L2 under the last key of the part before
                    before = run[part.start - 1] if part.start else parent
                    some = run[part.start : part.stop]
                    fetches.append(await client.prefetch_keys(g.ns, some, parent=before))
        completed = dict.fromkeys(range(len(fetches)), 0)
        waiting = list(completed)
        while True:
            for n in list(waiting):
                progress = await client.progress(fetches[n])
                completed[n] = progress.completed
                if progress.done:
                    waiting.remove(n)
            if not waiting or time.monotonic() >= deadline:
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.02)
        for n, fetch in enumerate(fetches):
            if completed[n]:
                await client.commit(fetch, pages=completed[n])
            else:
                await client.release(fetch)
    except BaseException:  # the prefetches' leases end now, not at their TTL
        await _release(client, fetches)
        raise


def _runs(g: Group, keys: list[bytes]) -> list[tuple[list[bytes], bytes | None]]:
    """``keys`` of group ``g`` in runs of chunks that follow one another, each
    with the key its first follows (None: none, or not known): a prefetch
    enters its pages in L2 as one sequence, so a hole starts another."""
    if g.before is None:
        return [(keys, None)]
    runs: list[tuple[list[bytes], bytes | None]] = []
    for key in keys:
        parent = g.before.get(key)
        if runs and parent is not None and parent == runs[-1][0][-1]:
            runs[-1][0].append(key)
        else:
            runs.append(([key], parent))
    return runs


# The releases under way in tasks of their own (``_release``): the loop keeps
# only weak references to its tasks.
_RELEASING: set[asyncio.Task[None]] = set()


async def _release(client: AsyncClient, leases: Sequence[Hit | Fetch]) -> None:
    """End leases this lookup will not hand on; a daemon that is gone ended them.
    They end in a task of their own, which a cancel of the lookup meanwhile
    (its caller giving up on it, once or again) does not stop: the leases
    after the one in flight would pin their pages until they expired."""
    releasing = asyncio.get_running_loop().create_task(_release_each(client, leases))
    _RELEASING.add(releasing)
    releasing.add_done_callback(_RELEASING.discard)
    await asyncio.shield(releasing)


async def _release_each(client: AsyncClient, leases: Sequence[Hit | Fetch]) -> None:
    for handle in leases:
        with contextlib.suppress(HicachedError, TimeoutError, asyncio.TimeoutError):
            await client.release(handle)
