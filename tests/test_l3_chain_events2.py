"""Chain-ordered L3 events at their edges: parents named in a loop, a prefetch
that finds pages gone, a write queue that stays full under write_back, and a
page the L3 record forgot before the store let it go (tests/l3rig.py)."""

from __future__ import annotations

import asyncio
import time

import msgspec

from hicached import protocol as p
from hicached.cache.chainorder import ChainOrder
from hicached.events import Removed, Stored
from hicached.hashing import pack_tokens
from hicached.l3state import KnownKeys
from tests.l3rig import KEYED, Harness, l3_view


def test_keyed_parents_that_name_each_other_do_not_hold_l3_events_for_ever() -> None:
    """A key-addressed client stores page a under parent b, then b under parent
    a (the daemon accepts both). Both are written through and L3 acknowledges
    both: neither L3 BlockStored waits for the other's for ever, and nothing
    stays held."""
    h = Harness("write_through")
    h.hello()
    ns = h.register(KEYED)
    for keys, parent in (([b"a"], b"b"), ([b"b"], b"a")):
        r = h.call(b"A", p.ReserveKeys(id=0, ns=ns.ns, keys=keys, parent=parent))
        assert isinstance(r, p.ReserveKeysOk) and r.lease
        assert isinstance(h.call(b"A", p.Commit(id=0, lease=r.lease)), p.CommitOk)
    written = list(h.tier.pending)
    assert len(written) == 2
    for key in written:
        h.tier.finish(key)
    tns = h.register()
    h.store(tns, list(range(100, 108)))  # the pool is full: both keyed pages leave L2
    for key in list(h.tier.pending):
        h.tier.finish(key)
    assert h.cache.namespaces[ns.ns].pages == 0
    believed = l3_view(h.events())
    assert {b"a", b"b"} <= believed, "L3 holds both pages; their BlockStored never went out"
    assert len(h.cache._order) == 0, "events held for pages long gone from L2"


def test_a_prefetch_that_finds_pages_gone_announces_their_removal_under_their_model() -> None:
    """A prefetch that finds the store holding fewer pages than the daemon knew
    of tells of them under their namespace: the BlockRemoved carries the model
    (the default topic is kv@{host}@{model}: a router subscribed to the model's
    topic must get it)."""
    from hicached.storage import Tier
    from hicached_backends.memory import MemoryBackend
    from hicached_backends.options import MemoryOptions

    async def main() -> None:
        h = Harness("write_through")
        h.hello()
        ns = h.register()
        seq = [1, 2]
        keys = h.store(ns, seq)
        for key in keys:
            h.tier.finish(key)  # L3 holds them: announced in L3 under model "m"
        h.store(ns, list(range(100, 108)))  # they leave L2
        stored = [e for e in h.events() if isinstance(e, Stored) and e.medium == "MEMORY"]
        assert {k for e in stored for k in e.keys} >= set(keys)
        assert all(e.model == "m" for e in stored)
        # the store no longer holds them (another host deleted them, a lost update...)
        store = MemoryBackend(MemoryOptions(), None)  # type: ignore[arg-type]
        tier = Tier(h.cache, store, None)  # type: ignore[arg-type]
        await tier.start()
        h.cache.tier = tier
        ok = h.call(b"A", p.Prefetch(id=0, ns=ns.ns, tokens=pack_tokens(seq)))
        assert isinstance(ok, p.PrefetchOk), ok
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not tier._prefetches:
                break
        assert all(k not in h.cache.l3 for k in keys)  # the daemon forgot them
        removed = [e for e in h.events() if isinstance(e, Removed) and e.medium == "MEMORY"]
        assert removed, "no BlockRemoved at all"
        assert [e.model for e in removed] == ["m"] * len(removed), (
            "BlockRemoved published under another model's topic than the BlockStored"
        )

    asyncio.run(main())


def test_write_back_ancestor_walk_is_not_quadratic_under_a_full_write_queue() -> None:
    """write_back, one long sequence in L2, an L3 write queue with room for one
    page (L3 slower than eviction): each eviction of the sequence's tail
    queues the leaving page and stops at the first ancestor the queue refuses,
    so refused writes an eviction stay bounded (not a walk of the sequence)."""
    page = 4096
    spec = msgspec.structs.replace(KEYED, key_scheme="tokens", page_bytes=page)
    h = Harness("write_back", size_mib=16, tier_limit=1)
    h.hello()
    ns = h.register(spec)
    n = 4000
    h.store(ns, list(range(n)))
    h.store(ns, list(range(10**6, 10**6 + 4096 - n)))  # the pool is now full
    assert not h.tier.pending and h.cache.pool.used_bytes == 16 << 20  # full, nothing evicted yet
    evictions = 20
    started = time.perf_counter()
    for i in range(evictions):
        for key in list(h.tier.pending):
            h.tier.finish(key)  # one page of room again
        h.store(ns, [2 * 10**6 + 7 * i])
    took = time.perf_counter() - started
    refused = h.cache.l3_counters.get("write_not_queued", 0)
    assert refused <= 2 * evictions, (
        f"{refused} refused writes for {evictions} evictions ({took:.2f}s)"
    )


def test_a_held_event_of_a_page_the_store_let_go_of_is_not_sent_when_the_record_forgot_it() -> None:
    """C's write ends while its parent's runs: its BlockStored waits. The L3
    record (storage.known_keys) forgets C to stay within its bound, then the
    store lets C go and says so: C's waiting BlockStored is never sent."""
    h = Harness("write_through", size_mib=4)
    h.cache.l3 = KnownKeys(4)
    h.cache.l3.on_forgotten = h.cache._l3_keys_forgotten
    h.hello()
    ns = h.register()
    g, parent, child = h.store(ns, [1, 2, 3])
    h.tier.finish(child)
    assert h.cache._order.holds(child)
    for key in h.store(ns, [50, 51, 52, 53]):  # other writes: the record forgets C
        h.tier.finish(key)
    assert child not in h.cache.l3
    h.cache.forget_l3([child], ns.digest)  # the store let C go, and said so
    h.tier.finish(parent)
    h.tier.finish(g)
    assert child not in l3_view(h.events()), "BlockStored sent after the store let the page go"


def test_events_held_for_their_parents_are_bounded_in_bytes_too() -> None:
    """A held event carries its page's token ids: bounded by count alone
    (events.queue_events, 100,000), the events waiting behind a slow parent
    write could take gigabytes. Past events.queue_mib the longest waiting goes
    out as it is, counted as out of order, as past the count."""
    out: list[str] = []
    order: ChainOrder[str] = ChainOrder(100, out.append, max_bytes=1000, size=len)
    for i in range(3):
        order.add(f"k{i}".encode(), b"parent", "x" * 300, coming=True)
    assert out == [] and order.bytes == 900 and len(order) == 3
    order.add(b"k3", b"parent", "y" * 300, coming=True)  # 1200 bytes: the oldest goes out
    assert out == ["x" * 300] and order.out_of_order == 1
    assert order.bytes == 900 and len(order) == 3
    order.drop(b"k1")  # a page L3 let go of: its event is never sent, its bytes freed
    assert order.bytes == 600
    order.ready(b"parent")  # the parent's went out: those held follow, in order
    assert out == ["x" * 300, "x" * 300, "y" * 300] and order.bytes == 0 and len(order) == 0
    # the daemon's own: the event queue's byte bound, and what a page's tokens take
    h = Harness("write_through")
    tiering = h.cache.tiering
    assert tiering.order.max_bytes == h.config.events.queue_mib << 20
    h.hello()
    ns = h.register()
    g, parent, child = h.store(ns, [1, 2, 3])
    h.tier.finish(child)  # its parent's write runs: its event waits, tokens and all
    assert tiering.order.holds(child) and tiering.order.bytes > 0
    h.tier.finish(parent)
    h.tier.finish(g)
    assert len(tiering.order) == 0 and tiering.order.bytes == 0
