"""Model-based test of the daemon's state (pool + index + leases).

Random interleavings of reserve / write / commit / abort / match / release /
lease expiry from two clients, on a pool of only 8 slots so eviction is
constant. Page contents are simulated: a reserved slot is "written" with the
key of the page it will hold. The invariants: a match never returns a slot
whose content is not that page (a cache may forget, never lie); a slot is
never owned twice; a pinned page never changes; the pool's books balance.
"""

from __future__ import annotations

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicached import protocol as p
from hicached.cache import Cache
from hicached.config import Config, LeaseConfig, PoolConfig
from hicached.hashing import pack_tokens, page_keys

PAGE = 256 * 1024  # 4 slots per 1 MiB slab, 2 slabs
SPEC = p.NamespaceSpec(model="m/x", kv_dtype="bfloat16", layout="l", page_tokens=1, page_bytes=PAGE)
SEQ = st.lists(st.integers(0, 2), min_size=1, max_size=5)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        config = Config(
            pool=PoolConfig(size_mib=2, slab_mib=1, max_page_bytes=PAGE),
            leases=LeaseConfig(ttl_s=10.0),
        )
        self.cache = Cache(config, pool_path="/nonexistent", clock=self.clock)
        self.ids = iter(range(1, 10**9))
        self.ns = 0
        for rid in (b"A", b"B"):
            ok = self.call(rid, p.Hello(id=0, major=p.PROTOCOL_MAJOR, minor=0))
            assert isinstance(ok, p.HelloOk)
            reg = self.call(rid, p.RegisterNamespace(id=0, spec=SPEC))
            assert isinstance(reg, p.NamespaceOk)
            self.ns = reg.ns
        self.content: dict[int, bytes] = {}  # slot -> key of the page written there
        self.writes: list[tuple[bytes, p.ReserveOk, list[bytes]]] = []
        self.reads: list[tuple[bytes, p.MatchOk, dict[int, bytes]]] = []

    def call(self, rid: bytes, request: p.Request) -> p.AnyReply:
        request.id = next(self.ids)
        # through the wire encoding, as the server does
        decoded = p.request_decoder.decode(p.encode(request))
        return self.cache.handle(rid, decoded)

    def keys(self, seq: list[int]) -> list[bytes]:
        ns = self.cache.namespaces[self.ns]
        return page_keys(ns.digest, pack_tokens(seq), 1)

    # -- rules -----------------------------------------------------------------

    @rule(rid=st.sampled_from([b"A", b"B"]), seq=SEQ)
    def reserve(self, rid: bytes, seq: list[int]) -> None:
        reply = self.call(rid, p.Reserve(id=0, ns=self.ns, tokens=pack_tokens(seq)))
        assert isinstance(reply, p.ReserveOk)
        keys = self.keys(seq)
        assert reply.present + len(reply.offsets) <= len(keys)
        for i, slot in enumerate(reply.offsets):
            self.content[slot] = keys[reply.present + i]  # the client writes its page
        if reply.lease:
            self.writes.append((rid, reply, keys))
        else:
            assert reply.offsets == []

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.writes) - 1))
        rid, res, keys = self.writes.pop(i)
        pages = data.draw(st.integers(-1, len(res.offsets)))
        reply = self.call(rid, p.Commit(id=0, lease=res.lease, pages=pages))
        assert isinstance(reply, p.CommitOk), reply
        n = len(res.offsets) if pages < 0 else pages
        assert reply.published + reply.duplicates == n
        # what was just committed is there now (commit allocates nothing, evicts nothing)
        got = self.cache.namespaces[self.ns].index.match(keys[: res.present + n])
        assert len(got) == res.present + n

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid, res, _ = self.writes.pop(data.draw(st.integers(0, len(self.writes) - 1)))
        assert isinstance(self.call(rid, p.Release(id=0, lease=res.lease)), p.Ok)

    @rule(rid=st.sampled_from([b"A", b"B"]), seq=SEQ, lease=st.booleans())
    def match(self, rid: bytes, seq: list[int], lease: bool) -> None:
        reply = self.call(rid, p.Match(id=0, ns=self.ns, tokens=pack_tokens(seq), lease=lease))
        assert isinstance(reply, p.MatchOk)
        keys = self.keys(seq)
        assert reply.hits == len(reply.offsets) <= len(keys)
        for i, slot in enumerate(reply.offsets):
            assert self.content.get(slot) == keys[i], "a match returned a slot holding other bytes"
        if reply.lease:
            self.reads.append((rid, reply, {s: self.content[s] for s in reply.offsets}))

    @precondition(lambda self: self.reads)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid, hit, snapshot = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        for slot, key in snapshot.items():
            assert self.content[slot] == key, "a pinned page was overwritten"
            assert slot in self.cache.namespaces[self.ns].index.node_of, "a pinned page was evicted"
        assert isinstance(self.call(rid, p.Release(id=0, lease=hit.lease)), p.Ok)

    @precondition(lambda self: self.reads or self.writes)
    @rule()
    def foreign_release_is_refused(self) -> None:
        rid, lease = (
            (self.reads[0][0], self.reads[0][1].lease)
            if self.reads
            else (self.writes[0][0], self.writes[0][1].lease)
        )
        other = b"B" if rid == b"A" else b"A"
        reply = self.call(other, p.Release(id=0, lease=lease))
        assert isinstance(reply, p.Error) and reply.code == "foreign_lease"

    @rule()
    def leases_expire(self) -> None:
        self.clock.now += 11.0
        ended = self.cache.expire()
        assert ended == len(self.reads) + len(self.writes)
        self.reads.clear()
        self.writes.clear()

    # -- invariants --------------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        cache = self.cache
        index = cache.namespaces[self.ns].index
        indexed = [slot for node in index.nodes() for slot in node.slots]
        fresh = [slot for lease in cache.leases.values() for slot in lease.fresh]
        assert len(indexed) == len(set(indexed)) == index.pages
        assert not set(indexed) & set(fresh), "a slot is both indexed and reserved"
        assert len(fresh) == len(set(fresh)), "a slot was reserved twice"
        assert cache.pool.used_bytes == (len(indexed) + len(fresh)) * PAGE
        pinned = {s for _, hit, _ in self.reads for s in hit.offsets}
        assert pinned <= set(cache.pool.pins)
        assert set(cache.pool.pins) <= set(indexed)

    @invariant()
    def tree_is_prefix_closed(self) -> None:
        index = self.cache.namespaces[self.ns].index
        for node in index.nodes():
            assert node.keys, "an empty node was left in the tree"
            assert all(index.node_of[s] is node for s in node.slots)
            assert node.parent is not None
            if node.parent is not index.root:
                assert node.parent.children[node.keys[0]] is node


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_cache_model = CacheMachine.TestCase


def test_stats_encode() -> None:
    machine = CacheMachine()
    assert msgspec.msgpack.decode(p.encode(machine.cache.stats()))["pool_bytes"] == 2 << 20
