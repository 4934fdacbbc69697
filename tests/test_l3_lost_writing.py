"""A write acknowledged after the store told of letting go of its key.

In process, with the real cache, tier, dispatcher and memory store. The store
tells the daemon it let go of a page while a write of that page is in flight
for two reasons: it dropped what that write stored before the daemon heard of
the acknowledgement (the memory store evicting it for a later call), or it
dropped an older copy of the page while the new one was on its way (a file
store recycling the segment of a copy written before a restart, a damaged
record found by a read). The daemon cannot tell the two apart from the calls;
after the first the store lacks the page, after the second it holds it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from hicached import protocol as p
from hicached.cache import Cache
from hicached.config import Config, PoolConfig, StorageConfig
from hicached.daemon.tier import Tier
from hicached.hashing import pack_tokens, page_keys
from hicached.wire.arena import Arena
from hicached_backends.base import BackendEnv, PageRef
from hicached_backends.memory import MemoryBackend
from hicached_backends.options import MemoryOptions

PAGE = 64 * 1024
SPEC = p.NamespaceSpec(model="m", kv_dtype="bfloat16", layout="l", page_tokens=1, page_bytes=PAGE)


async def until(what: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not what():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_write_the_store_holds_is_known_though_an_older_copy_was_let_go(
    tmp_path: Path,
) -> None:
    """The store holds an older copy of page K (put there directly: fault
    injection standing in for a persistent store's copy from before a
    restart) and a filler page, and keeps two pages. The daemon, whose index
    of L3 is complete, writes X then K: X's write pushes the old K out (the
    store tells of it while K's write is queued), K's write stores K again and
    is acknowledged. The store then holds K, so the daemon must not take K for
    a page L3 lacks (its complete index would answer every match of K with a
    miss, and under write_through nothing writes K again)."""
    config = Config(
        pool=PoolConfig(size_mib=1, slab_mib=1, max_page_bytes=PAGE),
        storage=StorageConfig(
            backend="memory",
            write_policy="write_through",
            concurrency=1,
            batch_pages=1,
            scan_on_start=False,
            memory=MemoryOptions(max_pages=2),
        ),
    )
    arena = Arena.create(tmp_path / "pool", 1 << 20, populate=False)
    cache = Cache(config, pool_path=str(arena.path), gens=arena.gens)
    backend = MemoryBackend(config.storage.memory, BackendEnv(data_dir=tmp_path))
    tier = Tier(cache, backend, arena)
    cache.tier = tier
    await tier.start()
    try:
        cache.l3.listed(True)  # the scan ended: a key not known is a page L3 lacks
        cache.handle(b"a", p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR))
        reg = cache.handle(b"a", p.RegisterNamespace(id=2, spec=SPEC))
        assert isinstance(reg, p.NamespaceOk)
        x_tokens, k_tokens = pack_tokens([1]), pack_tokens([2])
        (x,), (k,) = page_keys(reg.digest, x_tokens, 1), page_keys(reg.digest, k_tokens, 1)
        await backend.put(reg.digest, [PageRef(k, memoryview(bytearray(PAGE)))])
        await backend.put(reg.digest, [PageRef(b"filler-" + bytes(9), memoryview(bytearray(PAGE)))])
        for i, tokens in enumerate((x_tokens, k_tokens)):  # queued in this order
            res = cache.handle(b"a", p.Reserve(id=10 + i, ns=reg.ns, tokens=tokens))
            assert isinstance(res, p.ReserveOk) and res.lease
            assert isinstance(cache.handle(b"a", p.Commit(id=20 + i, lease=res.lease)), p.CommitOk)
        assert cache.writing == {x, k}
        await until(lambda: not cache.writing and not tier._lookups)
        assert (reg.digest, k) in backend.records and (reg.digest, x) in backend.records
        assert x in cache.l3
        assert k in cache.l3, "the store holds K, but the daemon takes it for a page L3 lacks"
    finally:
        await tier.stop()
        arena.close()
