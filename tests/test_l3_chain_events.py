"""L3 writes that end in any order, pages that leave L2 or L3 meanwhile, lookups
that race with drops, and rewrites under every policy: the L3 events stay in
chain order and never announce a page L3 let go of, and the record never
counts one. Driven at the Cache level with an L3 tier whose writes wait until
the test ends them (tests/l3rig.py)."""

from __future__ import annotations

import pytest

from hicached import protocol as p
from hicached.events import Stored
from hicached.hashing import pack_tokens
from tests.l3rig import KEYED, Harness, l3_order_faults, l3_view


def test_a_held_child_event_waits_for_its_parent_even_when_the_parent_leaves_l2() -> None:
    """G, P, C written through; P's and C's writes end while G's runs: P's
    BlockStored waits for G's, C's for P's. P and C then leave L2: P reached L3
    and its event still waits, so C's keeps waiting behind it."""
    h = Harness("write_through")
    h.hello()
    ns = h.register()
    g, parent, child = h.store(ns, [1, 2, 3])
    h.events()
    h.tier.finish(parent)
    h.tier.finish(child)
    h.store(ns, list(range(100, 107)))  # the pool is full: evicts C and P (G is pinned)
    assert parent not in h.cache._origins and child not in h.cache._origins  # left L2
    h.tier.finish(g)
    events = h.events()
    assert l3_order_faults(events) == []


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_page_l3_lets_go_of_while_its_event_waits_is_never_announced(
    policy: str,
) -> None:
    """C's write ends while its parent's runs: its BlockStored waits. The store
    then lets C go (a recycled segment) and it is not written again: its
    BlockRemoved goes out, and the waiting BlockStored never does (it would
    tell every subscriber that L3 holds C)."""
    h = Harness(policy)
    h.hello()
    ns = h.register()
    g, parent, child = h.store(ns, [1, 2, 3])
    if policy == "write_back":
        h.store(ns, list(range(100, 108)))  # all three leave L2: written back, parents first
    assert set(h.tier.pending) == {g, parent, child}
    h.tier.finish(child)
    h.cache.forget_l3([child], ns.digest)
    assert child not in h.cache.l3 and child not in h.tier.pending  # not rewritten
    h.tier.finish(parent)
    h.tier.finish(g)
    believed = l3_view(h.events())
    assert child not in believed, "subscribers believe L3 holds a page it let go of"


def test_a_page_written_again_while_its_event_waits_is_announced_once() -> None:
    """K's event waits for P's (P's write runs); L3 lets K go and K, still in
    L2, is written again; its second BlockStored waits too. When P's write
    ends, K is announced once, after P, and nothing is left waiting."""
    h = Harness("write_through", size_mib=4)
    h.hello()
    ns = h.register()
    seq = [1, 2]
    parent, k = h.store(ns, seq)
    h.tier.finish(k)
    base = 1000
    for _ in range(6):  # L3 takes more than L2 holds, K kept hot in L2: not "undersized"
        for key in h.store(ns, list(range(base, base + 4))):
            if key in h.tier.pending:
                h.tier.finish(key)
        base += 100
        h.call(b"A", p.Match(id=0, ns=ns.ns, tokens=pack_tokens(seq), lease=False))
    h.cache.forget_l3([k], ns.digest)
    assert k in h.tier.pending  # rewritten
    h.tier.finish(k)
    h.events()
    h.tier.finish(parent)
    events = h.events()
    assert len(h.cache._order) == 0
    assert l3_order_faults(events) == []
    stored_k = [e for e in events if isinstance(e, Stored) and k in e.keys]
    assert len(stored_k) == 1


def test_a_keyed_page_l3_lets_go_of_after_it_left_l2_is_removed_in_events() -> None:
    """write_back writes a key-addressed page as it leaves L2 and announces it
    in L3 under the engine's key; when the store later lets it go, its
    BlockRemoved names that key too (routers would believe L3 holds it for ever)."""
    h = Harness("write_back")
    h.hello()
    ns = h.register(KEYED)
    res = h.call(b"A", p.ReserveKeys(id=0, ns=ns.ns, keys=[b"e1", b"e2"], parent=b""))
    assert isinstance(res, p.ReserveKeysOk) and res.lease
    assert isinstance(h.call(b"A", p.Commit(id=0, lease=res.lease)), p.CommitOk)
    tokens = list(range(100, 108))
    spec_ns = h.register()
    h.store(spec_ns, tokens)  # evicts both keyed pages: written back
    for key in list(h.tier.pending):
        h.tier.finish(key)
    written = [k for k in h.tier.written if k in h.cache.l3]
    events = h.events()
    before = l3_view(events)
    h.cache.forget_l3(written, ns.digest)  # the store lets them go
    after = l3_view(events + h.events())
    assert before, "the L3 writes were announced"
    assert not after, "subscribers still believe L3 holds pages it let go of"


def test_a_lookup_answer_older_than_a_drop_is_not_learned() -> None:
    """While the record is incomplete, a match asks the store about K. The store
    answers "held", then lets K go before that answer reaches the loop: the
    record does not learn K (matches would count it in l3_hits, and an event
    would announce it)."""
    import asyncio

    from hicached.cache import L3Lookup
    from hicached.storage import Tier
    from hicached_backends.memory import MemoryBackend
    from hicached_backends.options import MemoryOptions

    class GatedStore(MemoryBackend):
        gate: asyncio.Event

        async def exists(self, ns: bytes, keys: object) -> int:
            n = await super().exists(ns, keys)  # type: ignore[arg-type]
            await self.gate.wait()  # the answer travels back to the loop
            return n

    async def main() -> None:
        h = Harness("write_through")
        store = GatedStore(MemoryOptions(), None)  # type: ignore[arg-type]
        store.gate = asyncio.Event()
        tier = Tier(h.cache, store, None)  # type: ignore[arg-type]
        await tier.start()  # no scan configured: the record is incomplete
        h.cache.tier = tier
        h.hello()
        ns = h.register()
        tokens = pack_tokens([5])
        (key,) = __import__("hicached.hashing").hashing.page_keys(ns.digest, tokens, 1)
        store.records[(ns.digest, key)] = (
            b"x"  # another daemon's page, or one from before a restart
        )
        ask = h.call(b"A", p.Match(id=0, ns=ns.ns, tokens=tokens, lease=False))
        assert isinstance(ask, L3Lookup)
        replies: list[int] = []
        tier.lookup(ask.ns, ask.keys, replies.append)
        await asyncio.sleep(0.01)
        del store.records[(ns.digest, key)]
        store.forgot(ns.digest, [key])  # the store let it go: the daemon is told
        store.gate.set()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if replies:
                break
        h.cache.l3.listed(True)  # say the scan ended
        hit = h.call(b"A", p.Match(id=0, ns=ns.ns, tokens=tokens, lease=False))
        assert isinstance(hit, p.MatchOk)
        held = await store.exists(ns.digest, [key]) if store.gate.is_set() else -1
        assert held == 0
        assert hit.l3_hits == 0, "match counts an L3 page the store let go of (and was told)"

    asyncio.run(main())


def test_selective_writes_no_page_again_that_an_undersized_l3_let_go_of() -> None:
    """write_through_selective (selective_hits = 1): a hot sequence stays in L2;
    L3 (proved undersized) lets it go after each write. The next matches do not
    write it again in this stay in L2."""
    import msgspec

    h = Harness("write_through_selective")
    h.config.storage = msgspec.structs.replace(h.config.storage, selective_hits=1)
    h.hello()
    ns = h.register()
    seq = [1, 2]
    keys = h.store(ns, seq)
    for _ in range(5):
        h.call(b"A", p.Match(id=0, ns=ns.ns, tokens=pack_tokens(seq), lease=False))
        for key in list(h.tier.pending):
            h.tier.finish(key)
        h.cache.forget_l3(keys, ns.digest)
        assert h.cache.l3_undersized
    assert h.cache.l3_counters["written"] <= 2 * len(keys), h.cache.l3_counters


def test_write_back_queues_the_page_leaving_l2_before_its_ancestors() -> None:
    """write_back with events on: the ancestors written ahead of a leaving page
    (they stay in L2) never take the write queue's room from the page itself,
    so what write_back keeps does not depend on whether events are on."""
    kept = {}
    for events in (False, True):
        h = Harness("write_back", tier_limit=4, events=events)
        h.hello()
        ns = h.register()
        keys = h.store(ns, list(range(1, 9)))  # fills the 8-slot pool
        h.store(ns, [500])  # evicts the leaf
        kept[events] = keys[-1] in h.tier.pending
    assert kept == {False: True, True: True}, kept
