"""Model-based test of the daemon's state (pool + index + leases).

Random interleavings of reserve / write / commit / abort / match / release /
lease expiry from two clients and two page sizes, on a pool of only two
slabs, so eviction and slabs passing between the sizes are constant. Page
contents are simulated: a reserved slot is "written" with the key of the page
it will hold. The invariants: a match never returns a slot whose content is
not that page (a cache may forget, never lie); no byte of the pool is owned
twice; a pinned page never changes; the pool's books balance.
"""

from __future__ import annotations

import itertools

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicached import protocol as p
from hicached.cache import Cache
from hicached.config import Config, LeaseConfig, PoolConfig
from hicached.hashing import pack_tokens, page_keys
from hicached.index import PageIndex

PAGE = 256 * 1024  # 4 slots per 1 MiB slab, 2 slabs
SIZES = {"small": PAGE, "large": 2 * PAGE}  # 4 or 2 pages a slab
SPECS = {
    name: p.NamespaceSpec(
        model=f"m/{name}", kv_dtype="bfloat16", layout="l", page_tokens=1, page_bytes=size
    )
    for name, size in SIZES.items()
}
SEQ = st.lists(st.integers(0, 2), min_size=1, max_size=5)
WHICH = st.sampled_from(sorted(SIZES))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        config = Config(
            pool=PoolConfig(size_mib=2, slab_mib=1, max_page_bytes=2 * PAGE),
            leases=LeaseConfig(ttl_s=10.0),
        )
        self.cache = Cache(config, pool_path="/nonexistent", clock=self.clock)
        self.ids = iter(range(1, 10**9))
        self.ns: dict[str, int] = {}
        for rid in (b"A", b"B"):
            ok = self.call(rid, p.Hello(id=0, major=p.PROTOCOL_MAJOR, minor=0))
            assert isinstance(ok, p.HelloOk)
            for name, spec in SPECS.items():
                reg = self.call(rid, p.RegisterNamespace(id=0, spec=spec))
                assert isinstance(reg, p.NamespaceOk)
                self.ns[name] = reg.ns
        self.content: dict[int, bytes] = {}  # slot -> key of the page written there
        self.writes: list[tuple[bytes, str, p.ReserveOk, list[bytes]]] = []
        self.reads: list[tuple[bytes, str, p.MatchOk, dict[int, bytes]]] = []

    def call(self, rid: bytes, request: p.Request) -> p.AnyReply:
        request.id = next(self.ids)
        # through the wire encoding, as the server does
        decoded = p.request_decoder.decode(p.encode(request))
        return self.cache.handle(rid, decoded)

    def keys(self, which: str, seq: list[int]) -> list[bytes]:
        ns = self.cache.namespaces[self.ns[which]]
        return page_keys(ns.digest, pack_tokens(seq), 1)

    def index(self, which: str) -> PageIndex:
        return self.cache.namespaces[self.ns[which]].index

    # -- rules -----------------------------------------------------------------

    @rule(rid=st.sampled_from([b"A", b"B"]), which=WHICH, seq=SEQ)
    def reserve(self, rid: bytes, which: str, seq: list[int]) -> None:
        reply = self.call(rid, p.Reserve(id=0, ns=self.ns[which], tokens=pack_tokens(seq)))
        assert isinstance(reply, p.ReserveOk)
        keys = self.keys(which, seq)
        assert reply.present + len(reply.offsets) <= len(keys)
        for i, slot in enumerate(reply.offsets):
            assert slot % SIZES[which] == 0, "a slot is not aligned to its page size"
            self.content[slot] = keys[reply.present + i]  # the client writes its page
            if which == "large":  # it also overwrites whatever a small slot held there
                self.content.pop(slot + PAGE, None)
        if reply.lease:
            self.writes.append((rid, which, reply, keys))
        else:
            assert reply.offsets == []

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.writes) - 1))
        rid, which, res, keys = self.writes.pop(i)
        pages = data.draw(st.integers(-1, len(res.offsets)))
        reply = self.call(rid, p.Commit(id=0, lease=res.lease, pages=pages))
        assert isinstance(reply, p.CommitOk), reply
        n = len(res.offsets) if pages < 0 else pages
        assert reply.published + reply.duplicates == n
        # what was just committed is there now (commit allocates nothing, evicts nothing)
        got = self.index(which).match(keys[: res.present + n])
        assert len(got) == res.present + n

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid, _, res, _ = self.writes.pop(data.draw(st.integers(0, len(self.writes) - 1)))
        assert isinstance(self.call(rid, p.Release(id=0, lease=res.lease)), p.Ok)

    @rule(rid=st.sampled_from([b"A", b"B"]), which=WHICH, seq=SEQ, lease=st.booleans())
    def match(self, rid: bytes, which: str, seq: list[int], lease: bool) -> None:
        tokens = pack_tokens(seq)
        reply = self.call(rid, p.Match(id=0, ns=self.ns[which], tokens=tokens, lease=lease))
        assert isinstance(reply, p.MatchOk)
        keys = self.keys(which, seq)
        assert reply.hits == len(reply.offsets) <= len(keys)
        for i, slot in enumerate(reply.offsets):
            assert self.content.get(slot) == keys[i], "a match returned a slot holding other bytes"
        if reply.lease:
            self.reads.append((rid, which, reply, {s: self.content[s] for s in reply.offsets}))

    @precondition(lambda self: self.reads)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid, which, hit, snapshot = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        for slot, key in snapshot.items():
            assert self.content[slot] == key, "a pinned page was overwritten"
            assert slot in self.index(which).node_of, "a pinned page was evicted"
        assert isinstance(self.call(rid, p.Release(id=0, lease=hit.lease)), p.Ok)

    @precondition(lambda self: self.reads or self.writes)
    @rule()
    def foreign_release_is_refused(self) -> None:
        rid, lease = (
            (self.reads[0][0], self.reads[0][2].lease)
            if self.reads
            else (self.writes[0][0], self.writes[0][2].lease)
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
        owned: list[tuple[int, int]] = []  # (offset, bytes) of every slot in use
        all_indexed: set[int] = set()
        for which, size in SIZES.items():
            index = self.index(which)
            indexed = [slot for node in index.nodes() for slot in node.slots]
            assert len(indexed) == len(set(indexed)) == index.pages
            owned += [(slot, size) for slot in indexed]
            all_indexed |= set(indexed)
        fresh = [
            (slot, lease.ns.spec.page_bytes)
            for lease in cache.leases.values()
            for slot in lease.fresh
        ]
        owned += fresh
        owned.sort()
        for (a, size), (b, _) in itertools.pairwise(owned):
            assert a + size <= b, f"slots at {a} and {b} share bytes"
        assert cache.pool.used_bytes == sum(size for _, size in owned)
        pinned = {s for _, _, hit, _ in self.reads for s in hit.offsets}
        assert pinned <= set(cache.pool.pins)
        assert set(cache.pool.pins) <= all_indexed

    @invariant()
    def tree_is_prefix_closed(self) -> None:
        for which in SIZES:
            self._prefix_closed(self.index(which), self.ns[which])

    def _prefix_closed(self, index: PageIndex, owner: int) -> None:
        for node in index.nodes():
            assert node.owner == owner
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
