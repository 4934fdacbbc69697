"""A write to L3 in flight when its index node splits is neither lost
nor misdirected; every fragment is persisted, and no slot is reused meanwhile.

The tier here holds acknowledgements until the test releases them (timing
injection only; the cache under test is the real one)."""

from __future__ import annotations

from collections.abc import Callable

from hicached import protocol as p
from hicached.cache import Cache, Lease, NamespaceState
from hicached.config import Config, EventsConfig, PoolConfig, StorageConfig
from hicached.events import Stored
from hicached.hashing import pack_tokens, page_keys

SPEC = p.NamespaceSpec(model="m/x", kv_dtype="bfloat16", layout="l", page_tokens=1, page_bytes=4096)


class HeldTier:
    """Accepts writes and acknowledges them only when told to."""

    down = False  # the store is up

    def __init__(self) -> None:
        self.held: list[tuple[bytes, int, Callable[[bool], None]]] = []
        self.stored: list[bytes] = []

    def write(
        self, ns: NamespaceState, key: bytes, slot: int, done: Callable[[bool], None]
    ) -> bool:
        self.held.append((key, slot, done))
        return True

    def prefetch(self, lease: Lease) -> None:  # pragma: no cover - not used here
        raise AssertionError

    def ack_all(self) -> None:
        held, self.held = self.held, []
        for key, _slot, done in held:
            self.stored.append(key)
            done(True)


def store(cache: Cache, rid: bytes, ns: int, tokens: list[int]) -> None:
    res = cache.handle(rid, p.Reserve(id=1, ns=ns, tokens=pack_tokens(tokens)))
    assert isinstance(res, p.ReserveOk)
    assert isinstance(cache.handle(rid, p.Commit(id=2, lease=res.lease)), p.CommitOk)


def test_a_split_while_writing_through_persists_every_fragment() -> None:
    config = Config(
        pool=PoolConfig(size_mib=1, slab_mib=1, max_page_bytes=4096),
        storage=StorageConfig(backend="file"),
        events=EventsConfig(
            endpoint="ipc:///nonexistent/events.sock"
        ),  # the log is on; nothing binds
    )
    cache = Cache(config, pool_path="x")
    tier = HeldTier()
    cache.tier = tier
    cache.handle(b"a", p.Hello(id=0, major=p.PROTOCOL_MAJOR, minor=0))
    reg = cache.handle(b"a", p.RegisterNamespace(id=0, spec=SPEC))
    assert isinstance(reg, p.NamespaceOk)
    ns = cache.namespaces[reg.ns]
    first = page_keys(ns.digest, pack_tokens([1, 2, 3, 4]), 1)
    second = page_keys(ns.digest, pack_tokens([1, 2, 5, 6]), 1)

    store(cache, b"a", reg.ns, [1, 2, 3, 4])  # write-through of [1,2,3,4] is now in flight
    assert [k for k, _, _ in tier.held] == first
    pinned = {slot for _, slot, _ in tier.held}
    assert pinned <= set(cache.pool.pins), "a slot an L3 write reads must stay pinned"

    store(cache, b"a", reg.ns, [1, 2, 5, 6])  # splits [1,2,3,4] into [1,2] + [3,4]
    head = ns.index.root.children[first[0]]
    assert head.keys == first[:2] and {tuple(c.keys) for c in head.children.values()} == {
        tuple(first[2:]),
        tuple(second[2:]),
    }
    # pressure before the ack: nothing pinned by the write may be evicted or reused
    victims = ns.index.evict(100, cache.pool.pins)
    assert not {slot for _, slot in victims} & pinned

    tier.ack_all()  # acks of the old node's write arrive after the split
    assert all(key in cache.l3 for key in first), "a fragment of a split node was left unpersisted"
    assert not set(cache.pool.pins) & pinned
    assert sorted(tier.stored) == sorted(set(tier.stored)), "a page was written twice"
    # [5,6] was written too (write-through of the second sequence), [1,2] only once
    assert set(second[2:]) <= set(tier.stored) and tier.stored.count(first[0]) == 1

    # the events: no stored event lost or wrong across the split
    events = [event for event, _ in cache.events.pending]
    l2 = [e for e in events if isinstance(e, Stored) and e.medium == "CPU"]
    assert [(e.keys, e.parent, e.tokens) for e in l2] == [
        (first, None, [1, 2, 3, 4]),
        (second[2:], first[1], [5, 6]),  # only the new fragment, chained to the shared [1, 2]
    ]
    l3 = [e for e in events if isinstance(e, Stored) and e.medium == "FILE"]
    by_key = {e.keys[0]: e for e in l3}
    assert all(len(e.keys) == 1 for e in l3) and len(by_key) == len(l3) == 6
    for seq in (first, second):
        for i, key in enumerate(seq):
            event = by_key[key]
            assert event.parent == (seq[i - 1] if i else None)
            assert event.tokens == [[1, 2, 3, 4], [1, 2, 5, 6]][seq is second][i : i + 1]
