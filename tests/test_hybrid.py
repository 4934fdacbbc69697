"""Hybrid models (hicached/integrations/hybrid.py): the prefix every KV cache
group can restore, in exact order, and asked of a real daemon whose
namespaces hold each group's pages: a full-attention group, a sliding window
and a recurrent state, with pages in L2, only in L3, or gone."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import zmq

import hicached
from hicached import Client
from hicached.client.handles import Namespace
from hicached.events import batch_decoder, block_hash
from hicached.integrations.hybrid import (
    Answer,
    Group,
    GroupView,
    Prefix,
    Window,
    lookup,
    restorable_end,
)
from hicached.wire.events import MEDIUM_L2
from hicached.wire.protocol import PREFETCH_PARENT_MINOR
from tests.l3util import settle_writes, wait_for
from tests.support import Daemon

FULL, SLIDING, STATE = Prefix(), Window(64, "sliding"), Window(32, "state")
CHUNK = 32  # tokens a chunk
FILE_L3 = 'backend = "file"\nwrite_policy = "write_through"\n'
FILE_OPTIONS = "[storage.file]\ncapacity_mib = 16\nsegment_mib = 4\n"


def view(kind: Any, present: str, chunk: int = CHUNK) -> GroupView:
    """A group's keys at chunk ends chunk, 2 chunk, ...; ``present``: one
    character a key, 'x' there and '.' missing."""
    positions = [(i + 1) * chunk for i in range(len(present))]
    return GroupView(kind, positions, [c == "x" for c in present])


# -- the intersection, in exact order ----------------------------------------------------


def test_a_window_group_restores_only_where_its_window_was_stored() -> None:
    # full attention holds chunks 1-6; the sliding window (two chunks) only 5-6
    assert restorable_end([view(FULL, "xxxxxx"), view(SLIDING, "....xx")]) == 6 * CHUNK
    # without chunk 6's window page no end works: 5 needs 4 and 5
    assert restorable_end([view(FULL, "xxxxxx"), view(SLIDING, "....x.")]) == 0
    # a window stored at chunk 3 serves a hit there, not past it
    assert restorable_end([view(FULL, "xxxxxx"), view(SLIDING, ".xx...")]) == 3 * CHUNK
    # full attention's leading run ends at 4: the window at 6 is out of reach
    assert restorable_end([view(FULL, "xxxx.x"), view(SLIDING, "..xxxx")]) == 4 * CHUNK
    assert restorable_end([view(FULL, "xx.xxx"), view(SLIDING, "....xx")]) == 0


def test_a_recurrent_state_is_one_page_at_the_end() -> None:
    # states stored at chunks 4 and 8 (two requests' ends): the later one wins
    full = view(FULL, "xxxxxxxxxx")
    assert restorable_end([full, view(STATE, "...x...x..")]) == 8 * CHUNK
    # that state gone: the earlier one, never a hit past it
    assert restorable_end([full, view(STATE, "...x......")]) == 4 * CHUNK
    assert restorable_end([full, view(STATE, "..........")]) == 0


def test_every_group_must_end_at_the_same_place() -> None:
    # chunks of 32 tokens for attention, a state every 64: ends are multiples of 64
    full = view(FULL, "xxxxxxx")  # 32 .. 224
    state = view(STATE, "x.x", chunk=64)  # 64, 128 (missing), 192
    assert restorable_end([full, state]) == 192
    # three groups: the intersection of all three
    assert restorable_end([full, state, view(SLIDING, "....x.x")]) == 0
    assert restorable_end([full, state, view(SLIDING, "....xx.")]) == 192
    assert restorable_end([view(FULL, "")]) == 0
    assert restorable_end([]) == 0


def test_what_a_hit_needs_of_each_group() -> None:
    full, sliding, state = view(FULL, "xxxxxx"), view(SLIDING, "xxxxxx"), view(STATE, "xxxxxx")
    assert list(full.needed(4 * CHUNK)) == [0, 1, 2, 3]
    assert list(sliding.needed(4 * CHUNK)) == [2, 3]  # chunks 3 and 4
    assert list(state.needed(4 * CHUNK)) == [3]
    # the keys asked about may start later (the engine has the first ones): clipped
    late = GroupView(SLIDING, [96, 128], [True, True])
    assert list(late.needed(96)) == [0] and late.restores(96)


# -- asked of a daemon ---------------------------------------------------------------------

# each group's namespace: its own page size, as an engine's groups have
SPECS = {
    "full": dict(page_bytes=8192),
    "sliding": dict(page_bytes=4096),
    "state": dict(page_bytes=6144),
}


def spec(group: str) -> dict[str, Any]:
    return dict(
        model="org/hybrid",
        kv_dtype="bfloat16",
        layout=f"test_{group}",
        page_tokens=CHUNK,
        key_scheme="vllm-sha256",
        **SPECS[group],
    )


def chain(n: int, group: int, salt: int = 0) -> list[bytes]:
    """vLLM-style keys: a chained block hash and the group index."""
    out, parent = [], bytes(32)
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([salt, i])).digest()
        out.append(parent + group.to_bytes(4, "big"))
    return out


def data(group: str, n: int) -> np.ndarray:
    size = SPECS[group]["page_bytes"]
    return np.random.default_rng(len(group)).integers(0, 256, (n, size), dtype=np.uint8)


def store(
    c: Client, ns: Namespace, keys: list[bytes], pages: np.ndarray, at: Sequence[int]
) -> None:
    """Pages ``at`` (chunk indices) of ``keys`` into ``ns``."""
    res = c.reserve_keys(ns, [keys[i] for i in at])
    c.write_pages(res, pages[list(at)][res.indices])
    assert c.commit(res).published == len(at)


class Model:
    """Three groups (full, a two-chunk sliding window, a state) over 8 chunks."""

    N = 8

    def __init__(self, c: Client) -> None:
        self.ns = {name: c.register(**spec(name)) for name in SPECS}
        self.keys = {name: chain(self.N, g) for g, name in enumerate(SPECS)}
        self.pages = {name: data(name, self.N) for name in SPECS}
        self.kinds = {"full": FULL, "sliding": SLIDING, "state": STATE}

    def store(self, c: Client, name: str, at: Sequence[int]) -> None:
        store(c, self.ns[name], self.keys[name], self.pages[name], at)

    def groups(self, nss: dict[str, Namespace]) -> list[Group]:
        positions = [(i + 1) * CHUNK for i in range(self.N)]
        return [Group(nss[n], self.kinds[n], self.keys[n], positions) for n in SPECS]


async def ask(d: Daemon, model: Model, **kwargs: Any) -> tuple[Answer, hicached.AsyncClient]:
    c = hicached.AsyncClient(d.endpoint, timeout=5.0)
    nss = {name: await c.register(**spec(name)) for name in SPECS}
    return await lookup(c, model.groups(nss), prefetch_timeout_s=10.0, **kwargs), c


def read_hit(c: hicached.AsyncClient, model: Model, answer: Answer) -> None:
    """Every page of the hit reads back what was stored under its key."""
    names = list(SPECS)
    for key, (g, part, place) in answer.hits.items():
        handle = answer.handles[g][part]
        name = names[g]
        page = c.read_pages(handle.select([place]))[0]
        assert np.array_equal(page, model.pages[name][model.keys[name].index(key)])


async def test_a_hit_leases_what_each_group_needs_at_its_end(daemon: Daemon) -> None:
    with daemon.client() as c:
        model = Model(c)
        model.store(c, "full", range(8))
        model.store(c, "sliding", [4, 5, 6, 7])  # windows at chunks 6 and 8
        model.store(c, "state", [5])  # a state at chunk 6 only
    answer, ac = await ask(daemon, model)
    try:
        assert answer.end == 6 * CHUNK
        want = {*model.keys["full"][:6], *model.keys["sliding"][4:6], model.keys["state"][5]}
        assert set(answer.hits) == want  # nothing past 6, nothing of the window before 5
        read_hit(ac, model, answer)
        with daemon.client() as c:  # full attention's first lease holds all 8 of its pages
            assert c.stats().pinned_pages == 8 + 2 + 1
    finally:
        for hit in answer.leases:
            await ac.release(hit)
        await ac.close()


async def test_a_group_that_lacks_its_pages_makes_a_miss_and_holds_nothing(
    daemon: Daemon,
) -> None:
    with daemon.client() as c:
        model = Model(c)
        model.store(c, "full", range(8))
        model.store(c, "sliding", [5, 6, 7])
        model.store(c, "state", [])  # no state anywhere
    answer, ac = await ask(daemon, model)
    await ac.close()
    assert (answer.end, answer.hits, answer.leases) == (0, {}, [])
    with daemon.client() as c:
        assert c.stats().pinned_pages == 0


def restarted(
    daemon_factory: Callable[..., Daemon], stored: dict[str, Sequence[int]]
) -> tuple[Daemon, Model]:
    """A daemon with a file L3 that stored the chunks ``stored`` names of each
    group, wrote them through and restarted: they are in L3 alone, and known
    there again, when it returns."""
    d = daemon_factory(storage=FILE_L3, tail=FILE_OPTIONS)
    with d.client() as c:
        model = Model(c)
        for name, at in stored.items():
            model.store(c, name, at)
        settle_writes(c)
    d.stop()
    d.start()
    with d.client() as c:
        nss = {name: c.register(**spec(name)) for name in stored}
        keys = {name: [model.keys[name][i] for i in at] for name, at in stored.items()}
        wait_for(lambda: all(all(c.exists_keys(nss[n], keys[n]).in_l3) for n in stored))
    return d, model


async def test_pages_only_l3_holds_come_back_first(daemon_factory: Callable[..., Daemon]) -> None:
    d, model = restarted(daemon_factory, {"full": range(8), "sliding": [6, 7], "state": [7]})
    seen: list[Answer] = []
    answer, ac = await ask(d, model, on_pending=seen.append)
    try:
        assert answer.end == 8 * CHUNK
        assert len(seen) == 1 and seen[0].leases == [] and not seen[0].hits
        assert set(answer.hits) == seen[0].pending  # what was loading is what is read
        read_hit(ac, model, answer)
    finally:
        for hit in answer.leases:
            await ac.release(hit)
        await ac.close()


class Forgetful(hicached.AsyncClient):
    """Fault injection: says the sliding window's last page is there after it
    was evicted (an answer the eviction overtook between the two requests)."""

    def __init__(self, *args: Any, gone: bytes, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gone = gone

    async def exists_keys(self, ns: Namespace, keys: Sequence[bytes]) -> Any:
        found = await super().exists_keys(ns, keys)
        in_l2 = [l2 or key == self.gone for key, l2 in zip(keys, found.in_l2, strict=True)]
        return type(found)(found.l2, found.leading, in_l2, found.in_l3)


async def test_a_page_gone_before_its_lease_lowers_the_end(daemon: Daemon) -> None:
    with daemon.client() as c:
        model = Model(c)
        model.store(c, "full", range(8))
        model.store(c, "sliding", [2, 3, 6])  # window at 4, and half of one at 8
        model.store(c, "state", [3, 7])
    ac = Forgetful(daemon.endpoint, timeout=5.0, gone=model.keys["sliding"][7])
    try:
        nss = {name: await ac.register(**spec(name)) for name in SPECS}
        answer = await lookup(ac, model.groups(nss), prefetch_timeout_s=1.0)
        # the probe saw a window at 8; its lease found half of it: the end is 4
        assert answer.end == 4 * CHUNK
        assert model.keys["sliding"][7] not in answer.hits
        read_hit(ac, model, answer)
        with daemon.client() as c:
            assert c.stats().pinned_pages == 8 + 2 + 1  # the leases at 8 were given back
        for hit in answer.leases:
            await ac.release(hit)
    finally:
        await ac.close()


@pytest.mark.parametrize("missing", ["full", "sliding", "state"])
def test_each_group_can_end_a_hit(missing: str) -> None:
    """The same model with one group's page at the end gone: a shorter hit."""
    present = {"full": "xxxxxxxx", "sliding": "..xx..xx", "state": "...x...x"}
    present[missing] = {"full": "xxxxxxx.", "sliding": "..xx...x", "state": "...x...."}[missing]
    kinds = {"full": FULL, "sliding": SLIDING, "state": STATE}
    assert restorable_end([view(kinds[n], p) for n, p in present.items()]) == 4 * CHUNK


def test_a_window_with_a_lead_reads_the_chunk_before_it_where_it_is_there() -> None:
    """A token budget may end a hit inside its last chunk; the window that ends
    there reaches one chunk further back. That chunk is read where it is there,
    never needed: without it the hit at the chunk's end stands as before."""
    leading = Window(64, "sliding", lead=CHUNK)
    full = view(FULL, "xxxxxxxx")
    stored = view(leading, "....xxxx")  # chunks 5-8: the window at 8, and chunk 6 before it
    assert restorable_end([full, stored]) == 8 * CHUNK
    assert list(stored.wanted(8 * CHUNK)) == [5, 6, 7]
    assert list(stored.needed(8 * CHUNK)) == [6, 7]
    short = view(leading, "...xx.xx")  # a hole before the window: nothing more is read
    assert list(short.wanted(8 * CHUNK)) == [6, 7]
    assert restorable_end([full, short]) == 8 * CHUNK
    assert list(view(SLIDING, "xxxxxxxx").wanted(8 * CHUNK)) == [6, 7]  # no lead: the window


async def test_a_hit_ending_inside_a_chunk_finds_the_window_it_needs(daemon: Daemon) -> None:
    """The sliding window's chunk before the window at the hit's end is leased
    and answered with the hit, so an engine whose budget ends the hit inside
    the last chunk still restores it; the state keeps its one page."""
    with daemon.client() as c:
        model = Model(c)
        model.kinds["sliding"] = Window(64, "sliding", lead=CHUNK)
        model.store(c, "full", range(8))
        model.store(c, "sliding", [5, 6, 7])
        model.store(c, "state", [6, 7])
    answer, ac = await ask(daemon, model)
    try:
        assert answer.end == 8 * CHUNK
        want = {*model.keys["full"], *model.keys["sliding"][5:], model.keys["state"][7]}
        assert set(answer.hits) == want
        read_hit(ac, model, answer)
        with daemon.client() as c:
            assert c.stats().pinned_pages == 8 + 3 + 1
    finally:
        for hit in answer.leases:
            await ac.release(hit)
        await ac.close()


class Outdated(hicached.AsyncClient):
    """Fault injection: says L3 holds a page it no longer holds (an answer an
    L3 eviction overtook between the look and the load)."""

    def __init__(self, *args: Any, gone: bytes, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gone = gone

    async def exists_keys(self, ns: Namespace, keys: Sequence[bytes]) -> Any:
        found = await super().exists_keys(ns, keys)
        in_l3 = [l3 or key == self.gone for key, l3 in zip(keys, found.in_l3, strict=True)]
        return type(found)(found.l2, found.leading, found.in_l2, in_l3)


async def test_a_lead_that_l3_lost_leaves_the_window_it_needs_loaded(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """The chunk before the window is loaded apart from the window: when L3 no
    longer has it, the window's pages still come back, and the hit stands."""
    d, model = restarted(daemon_factory, {"full": range(8), "sliding": [6, 7], "state": [7]})
    model.kinds["sliding"] = Window(64, "sliding", lead=CHUNK)
    ac = Outdated(d.endpoint, timeout=5.0, gone=model.keys["sliding"][5])
    try:
        nss = {name: await ac.register(**spec(name)) for name in SPECS}
        answer = await lookup(ac, model.groups(nss), prefetch_timeout_s=10.0)
        assert answer.end == 8 * CHUNK
        assert model.keys["sliding"][5] not in answer.hits
        read_hit(ac, model, answer)
        for hit in answer.leases:
            await ac.release(hit)
    finally:
        await ac.close()


async def test_a_lead_only_l3_holds_is_not_waited_for(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Every page the hit needs is in L2 and only the chunk before the window
    is in L3: the hit is answered at once without it (no pending answer, no
    load), since a lead is read where it is in L2, never waited for."""
    d, _ = restarted(daemon_factory, {"sliding": [5]})
    with d.client() as c:
        model = Model(c)  # the same keys and pages, in namespaces registered anew
        model.store(c, "full", range(8))
        model.store(c, "sliding", [6, 7])
        model.store(c, "state", [7])
        settle_writes(c)  # so that the pages pinned at the end are the hit's alone
    model.kinds["sliding"] = Window(64, "sliding", lead=CHUNK)
    seen: list[Answer] = []
    answer, ac = await ask(d, model, on_pending=seen.append)
    try:
        assert answer.end == 8 * CHUNK
        assert seen == []
        assert set(answer.hits) == {
            *model.keys["full"],
            *model.keys["sliding"][6:],
            model.keys["state"][7],
        }
        read_hit(ac, model, answer)
    finally:
        for hit in answer.leases:
            await ac.release(hit)
        await ac.close()
    with d.client() as c:
        assert c.stats().pinned_pages == 0


def stored_events(sub: zmq.Socket, medium: str, count: int) -> list[Any]:
    """The BlockStored events of ``medium`` until they name ``count`` blocks."""
    stored: list[Any] = []
    deadline = time.monotonic() + 10
    while sum(len(e.block_hashes) for e in stored) < count:
        assert time.monotonic() < deadline, f"{stored} name fewer than {count} blocks"
        if sub.poll(100):
            _, _, payload = sub.recv_multipart()
            stored += [
                e
                for e in batch_decoder.decode(payload).events
                if type(e).__name__ == "BlockStored" and e.medium == medium
            ]
    return stored


async def test_a_group_of_more_keys_than_a_message_holds_is_asked_about_in_parts(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A daemon whose requests hold 4,096 bytes at most (server.max_message_bytes,
    far below its 16,384 pages a request) and a full-attention group of 120
    keys of 36 bytes: a request naming all of them is over the bound (the
    lookup failed with TooLarge). Each request now names as many as a message
    holds, and the hit is all 120 chunks, read through a lease a part."""
    d = daemon_factory(extra="max_message_bytes = 4096")
    keys = chain(120, 0)
    pages = np.random.default_rng(3).integers(0, 256, (120, 4096), dtype=np.uint8)
    with d.client() as c:
        ns = c.register(**spec("sliding"))
        step = c.keys_per_request(keys)
        assert 1 < step < len(keys)
        parent = None
        for first in range(0, len(keys), step):
            at = list(range(first, min(first + step, len(keys))))
            res = c.reserve_keys(ns, [keys[i] for i in at], parent=parent)
            c.write_pages(res, pages[at][res.indices])
            assert c.commit(res).published == len(at)
            parent = keys[at[-1]]
    ac = hicached.AsyncClient(d.endpoint, timeout=5.0)
    try:
        group = Group(
            await ac.register(**spec("sliding")), FULL, keys, [CHUNK * (i + 1) for i in range(120)]
        )
        answer = await lookup(ac, [group], prefetch_timeout_s=5.0)
        assert answer.end == 120 * CHUNK
        assert len(answer.handles[0]) == -(-120 // step)
        for key, (_, part, place) in answer.hits.items():
            got = ac.read_pages(answer.handles[0][part].select([place]))[0]
            assert np.array_equal(got, pages[keys.index(key)])
        for hit in answer.leases:
            await ac.release(hit)
    finally:
        await ac.close()


def restart_with_events(d: Daemon) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
    """Restart ``d`` (L2 empty, L3 kept) publishing KV events, and subscribe."""
    d.stop()
    d.config.write_text(
        d.config.read_text() + f'[events]\nendpoint = "ipc://{d.runtime}/events.sock"\n'
    )
    d.start()
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{d.runtime}/events.sock")
    return ctx, sub


def parents_of(events: list[Any]) -> dict[bytes, bytes | None]:
    """Each block the BlockStored ``events`` name, and the block before it."""
    return {
        h: up
        for e in events
        for h, up in zip(e.block_hashes, [e.parent_block_hash, *e.block_hashes][:-1], strict=True)
    }


@pytest.mark.parametrize("minor", [None, PREFETCH_PARENT_MINOR - 1])
async def test_pages_loaded_from_l3_in_parts_keep_their_parents(
    daemon_factory: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch, minor: int | None
) -> None:
    """A daemon that takes two keys a request: six chunks of full attention,
    only in L3, come back in three prefetches of two. Each page enters L2
    under the page before it (a part's first under the last of the part
    before, not as the start of a sequence), as one prefetch of all six
    would enter them, and the BlockStored events that announce them say so.
    A daemon older than 1.11 (tests/old_daemon.py) is sent no parent, which
    it would refuse: the hit stands, each part's first page without one."""
    old = {}
    if minor is not None:
        monkeypatch.setenv("HICACHED_TEST_DAEMON_MINOR", str(minor))
        old = {"module": "tests.old_daemon"}
    d = daemon_factory(storage=FILE_L3, tail=FILE_OPTIONS, extra="max_pages_per_request = 2", **old)
    with d.client() as c:
        model = Model(c)
        keys = model.keys["full"][:6]
        parent = None
        for at in ([0, 1], [2, 3], [4, 5]):
            res = c.reserve_keys(model.ns["full"], [keys[i] for i in at], parent=parent)
            c.write_pages(res, model.pages["full"][at][res.indices])
            assert c.commit(res).published == 2
            parent = keys[at[-1]]
        settle_writes(c)
    ctx, sub = restart_with_events(d)
    ac = hicached.AsyncClient(d.endpoint, timeout=5.0)
    try:
        with d.client() as c:
            ns = c.register(**spec("full"))
            wait_for(lambda: all(all(c.exists_keys(ns, keys[i : i + 2]).in_l3) for i in (0, 2, 4)))
        await asyncio.sleep(0.2)  # the subscription reaches the daemon
        group = Group(
            await ac.register(**spec("full")), FULL, keys, [CHUNK * (i + 1) for i in range(6)]
        )
        answer = await lookup(ac, [group], prefetch_timeout_s=10.0)
        assert answer.end == 6 * CHUNK and len(answer.handles[0]) == 3
        for hit in answer.leases:
            await ac.release(hit)
        parents = parents_of(stored_events(sub, MEDIUM_L2, 6))
        hashes = [block_hash(k[:-4]) for k in keys]
        if minor is None:
            assert [parents[h] for h in hashes] == [None, *hashes[:-1]]
        else:
            assert [parents[h] for h in hashes] == [
                None,
                hashes[0],
                None,
                hashes[2],
                None,
                hashes[4],
            ]
    finally:
        await ac.close()
        sub.close()
        ctx.term()


async def test_window_pages_loaded_from_l3_enter_l2_under_the_chunk_before(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A window of four chunks, its pages only in L3, asked about at chunks 1-6
    and 8 (the engine showed no chunk 7, so no key before chunk 8's is known):
    a hit at chunk 8 loads chunks 5, 6 and 8. Chunk 5 enters L2 under chunk 4,
    the chunk before it, not as a sequence's start; chunk 8 under none, not
    under chunk 6 across the hole (as vLLM's events announce a window's
    pages: each under the chunk before it in the request)."""
    d = daemon_factory(storage=FILE_L3, tail=FILE_OPTIONS)
    keys = chain(8, 1)
    with d.client() as c:
        ns = c.register(**spec("sliding"))
        store(c, ns, keys, data("sliding", 8), range(8))
        settle_writes(c)
    ctx, sub = restart_with_events(d)
    ac = hicached.AsyncClient(d.endpoint, timeout=5.0)
    try:
        with d.client() as c:
            ns = c.register(**spec("sliding"))
            wait_for(lambda: all(c.exists_keys(ns, keys).in_l3))
        await asyncio.sleep(0.2)  # the subscription reaches the daemon
        shown = [0, 1, 2, 3, 4, 5, 7]
        asked = [keys[i] for i in shown]
        before = {keys[i]: keys[i - 1] for i in shown if i and i - 1 in shown}
        group = Group(
            await ac.register(**spec("sliding")),
            Window(4 * CHUNK, "sliding"),
            asked,
            [CHUNK * (i + 1) for i in shown],
            before,
        )
        answer = await lookup(ac, [group], prefetch_timeout_s=10.0)
        assert answer.end == 8 * CHUNK
        assert sorted(answer.hits) == sorted([keys[4], keys[5], keys[7]])
        for hit in answer.leases:
            await ac.release(hit)
        parents = parents_of(stored_events(sub, MEDIUM_L2, 3))
        hashes = [block_hash(k[:-4]) for k in keys]
        assert {h: parents[h] for h in (hashes[4], hashes[5], hashes[7])} == {
            hashes[4]: hashes[3],
            hashes[5]: hashes[4],
            hashes[7]: None,
        }
    finally:
        await ac.close()
        sub.close()
        ctx.term()


class Watched(hicached.AsyncClient):
    """Counts the calls begun, by name, for a test to cancel a lookup in the
    middle of one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.begun: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.begun[name] = self.begun.get(name, 0) + 1

    async def progress(self, pf: Any) -> Any:
        self._count("progress")
        return await super().progress(pf)

    async def release(self, handle: Any) -> None:
        self._count("release")
        await super().release(handle)


async def turns_until(done: Callable[[], bool]) -> None:
    """Let the loop run until ``done()``: seconds at most."""
    for _ in range(200_000):
        if done():
            return
        await asyncio.sleep(0)
    pytest.fail("never came to pass")


async def settled(c: hicached.AsyncClient) -> tuple[int, int]:
    """The leases open and the pages they pin, once none is, or after 5 s."""
    for _ in range(100):
        if not (await c.stats()).leases:
            break
        await asyncio.sleep(0.05)
    stats = await c.stats()
    return stats.leases, stats.pinned_pages


async def test_a_cancel_while_a_failed_lookup_releases_its_leases_releases_them_all(
    daemon: Daemon,
) -> None:
    """A lookup that fails releases the leases it took, one request each, before
    it raises; a cancel that came meanwhile (its caller giving up on it) ended
    the releases at the one in flight, and the leases after it pinned their
    pages until they expired (leases.ttl_s). Every one is released."""
    with daemon.client() as c:
        model = Model(c)
        model.store(c, "full", range(8))
        model.store(c, "sliding", range(8))
    ac = Watched(daemon.endpoint, timeout=5.0)
    try:
        nss = {name: await ac.register(**spec(name)) for name in SPECS}
        positions = [(i + 1) * CHUNK for i in range(model.N)]
        unknown = Namespace(nss["state"].spec, 0, b"")  # no daemon's: its request fails
        groups = [
            Group(nss["full"], FULL, model.keys["full"], positions),
            Group(nss["sliding"], FULL, model.keys["sliding"], positions),
            Group(unknown, FULL, model.keys["state"], positions),
        ]
        asked = asyncio.get_running_loop().create_task(lookup(ac, groups, prefetch_timeout_s=1.0))
        await turns_until(lambda: "release" in ac.begun or asked.done())
        assert not asked.done()
        asked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asked
        assert await settled(ac) == (0, 0)
    finally:
        await ac.close()


async def test_a_lookup_cancelled_twice_while_pages_come_from_l3_releases_every_prefetch(
    daemon_factory: Callable[..., Daemon], engine_waits: str
) -> None:
    """A lookup cancelled while pages come back from L3 releases each part's
    prefetch; cancelled again meanwhile (a caller that gives up twice, as
    asyncio.run's end cancels every task left), it stopped at the release in
    flight, and the prefetches after it held their slots until they expired
    (leases.ttl_s). Every one is released."""
    d = daemon_factory(storage=FILE_L3, tail=FILE_OPTIONS, extra="max_pages_per_request = 2")
    with d.client() as c:
        model = Model(c)
        keys = model.keys["full"]
        parent = None
        for at in ([0, 1], [2, 3], [4, 5], [6, 7]):
            res = c.reserve_keys(model.ns["full"], [keys[i] for i in at], parent=parent)
            c.write_pages(res, model.pages["full"][at][res.indices])
            assert c.commit(res).published == 2
            parent = keys[at[-1]]
        settle_writes(c)
    d.stop()
    d.start()
    with d.client() as c:
        ns = c.register(**spec("full"))
        wait_for(lambda: all(all(c.exists_keys(ns, keys[i : i + 2]).in_l3) for i in (0, 2, 4, 6)))
    ac = Watched(d.endpoint, timeout=5.0)
    try:
        group = Group(
            await ac.register(**spec("full")), FULL, keys, [(i + 1) * CHUNK for i in range(8)]
        )
        asked = asyncio.get_running_loop().create_task(lookup(ac, [group], prefetch_timeout_s=10.0))
        await turns_until(lambda: "progress" in ac.begun or asked.done())
        assert not asked.done()
        asked.cancel()
        await turns_until(lambda: "release" in ac.begun or asked.done())
        assert not asked.done()
        asked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asked
        assert await settled(ac) == (0, 0)
    finally:
        await ac.close()
