"""A prefetch's reply counts the pages it found in L2, whenever the tier plans
its reads: the L3 port here (a stand-in for daemon/tier.py, which plans from a
task of its own) plans inside ``prefetch()``, as TierPort allows, which puts
the pages to read into the lease before the reply is made."""

from __future__ import annotations

from hicached.cache import Cache, Lease
from hicached.config import Config, PoolConfig, StorageConfig
from hicached.wire import protocol as p
from hicached.wire.hashing import pack_tokens

PAGE = 64 * 1024
SPEC = p.NamespaceSpec(model="m", kv_dtype="bf16", layout="l", page_tokens=1, page_bytes=PAGE)
KEYED = p.NamespaceSpec(
    model="m", kv_dtype="bf16", layout="l", page_tokens=1, page_bytes=PAGE, key_scheme="vllm-sha256"
)


class SyncTier:
    down = False  # the store is up

    def __init__(self) -> None:
        self.cache: Cache | None = None

    def write(self, ns: object, key: bytes, slot: int, done: object) -> bool:
        return False  # nothing reaches L3 here

    def prefetch(self, lease: Lease) -> None:
        assert self.cache is not None
        # the store holds every page asked for: plan them now
        self.cache.prefetch_started(lease)
        assert lease.prefetch is not None
        self.cache.prefetch_planned(lease, len(lease.prefetch.keys))


def _cache() -> tuple[Cache, SyncTier]:
    cfg = Config(
        pool=PoolConfig(size_mib=2, slab_mib=1, max_page_bytes=PAGE),
        storage=StorageConfig(backend="memory"),
    )
    cache = Cache(cfg, pool_path="/nonexistent")
    tier = SyncTier()
    tier.cache = cache
    cache.tier = tier
    assert isinstance(
        cache.handle(b"A", p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)), p.HelloOk
    )
    return cache, tier


def test_prefetch_l2_hits_counts_only_l2_pages() -> None:
    cache, _ = _cache()
    ns = cache.handle(b"A", p.RegisterNamespace(id=2, spec=SPEC))
    res = cache.handle(b"A", p.Reserve(id=3, ns=ns.ns, tokens=pack_tokens([1, 2])))
    assert isinstance(cache.handle(b"A", p.Commit(id=4, lease=res.lease)), p.CommitOk)
    reply = cache.handle(b"A", p.Prefetch(id=5, ns=ns.ns, tokens=pack_tokens([1, 2, 3, 4, 5])))
    assert isinstance(reply, p.PrefetchOk), reply
    assert reply.l2_hits == 2  # two pages in L2; three more are being read from L3


def test_prefetch_keys_l2_hits_counts_only_l2_pages() -> None:
    cache, _ = _cache()
    ns = cache.handle(b"A", p.RegisterNamespace(id=2, spec=KEYED))
    res = cache.handle(b"A", p.ReserveKeys(id=3, ns=ns.ns, keys=[b"a", b"b"]))
    assert isinstance(cache.handle(b"A", p.Commit(id=4, lease=res.lease)), p.CommitOk)
    reply = cache.handle(b"A", p.PrefetchKeys(id=5, ns=ns.ns, keys=[b"a", b"b", b"c", b"d"]))
    assert isinstance(reply, p.PrefetchOk), reply
    assert reply.l2_hits == 2
