"""Run in the SGLang venv (tests/engines/sglang_venv.py): hicached's HiCache
storage backend driven by SGLang's own classes against a real daemon.

    python sglang_check.py ENDPOINT SCENARIO...   # one JSON object on stdout

Backends come from SGLang's ``StorageBackendFactory`` with the dynamic extra
config, host pools are SGLang's ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost`` (built on CPU over CPU device pools, unpinned), and
keys are SGLang's ``get_hash_str`` page hashes. Every scenario reports plain
facts under its name (or ``error``: a traceback); the test asserts on them.
A second host pool and backend stand for a second SGLang instance.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

warnings.simplefilter("ignore")  # SGLang's import-time notes on a CPU-only host

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from hicached.client import Client  # noqa: E402
from hicached.integrations.sglang import HicachedStorage  # noqa: E402
from tests.engines import answer_and_exit  # noqa: E402

PAGE = 16  # tokens a page
LAYERS = 2
MODEL = "/models/Test/Tiny-MHA"  # a path, as SGLang passes a local model
Facts = dict[str, Any]


def extra(endpoint: str) -> dict[str, Any]:
    return {
        "backend_name": "hicached",
        "module_path": "hicached.integrations.sglang",
        "class_name": "HicachedStorage",
        "interface_v1": 1,
        "endpoint": endpoint,
        "timeout_s": 10.0,  # a loaded test host, not a slow daemon
        "retry_s": 1.0,
        "prefetch_timeout_s": 10.0,
    }


def host_pool(layout: str, mla: bool = False, tokens: int = 512) -> Any:
    """SGLang's host pool over a CPU device pool, filled with random bytes."""
    if mla:
        dev = MLATokenToKVPool(
            tokens, PAGE, torch.bfloat16, 64, 16, LAYERS, "cpu", False, 0, LAYERS
        )
        host = MLATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info,
            1.0,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device_capacity_tokens=dev.size,
            start_layer=dev.start_layer,
            end_layer=dev.end_layer,
            target_layer_num=dev.layer_num,
            override_kv_cache_dim=dev.kv_cache_dim,
        )
    else:
        dev = MHATokenToKVPool(
            tokens,
            PAGE,
            torch.bfloat16,
            2,
            64,
            LAYERS,
            "cpu",
            False,
            start_layer=0,
            end_layer=LAYERS,
        )
        host = MHATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info,
            1.0,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device_capacity_tokens=dev.size,
            start_layer=dev.start_layer,
            end_layer=dev.end_layer,
        )
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    return host


def backend(
    endpoint: str, pool: Any, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False
) -> HicachedStorage:
    """A backend as SGLang's cache controller makes one: the factory, then the pool."""
    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout != "layer_first",
        model_name=MODEL,
        extra_config=extra(endpoint),
    )
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    made.register_mem_pool_host(pool)
    return made


_seed = [0]


def page_hashes(pages: int, prior: str | None = None) -> list[str]:
    _seed[0] += 1
    gen = torch.Generator().manual_seed(_seed[0])
    tokens = torch.randint(0, 150_000, (pages * PAGE,), generator=gen).tolist()
    keys = get_hash_str(tokens, prior, page_size=PAGE)
    assert isinstance(keys, list) and len(keys) == pages
    return keys


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """Compared as bytes: random bf16 bits hold NaNs, which equal nothing."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def page(pool: Any, indices: torch.Tensor, j: int) -> torch.Tensor:
    return bytes_of(pool.get_data_page(int(indices[j * PAGE]), flat=True)).clone()


def digest(endpoint: str, made: HicachedStorage) -> str:
    """The digest of the namespace a backend registers."""
    assert made.fields is not None
    with Client(endpoint) as c:
        return c.register(**made.fields).digest.hex()


def same_pages(a: Any, ia: torch.Tensor, b: Any, ib: torch.Tensor, n: int) -> list[bool]:
    return [torch.equal(page(a, ia, j), page(b, ib, j)) for j in range(n)]


def alloc(pool: Any, pages: int, skip: int = 0) -> torch.Tensor:
    """Host slots for ``pages`` pages, after ``skip`` pages left allocated (so two
    pools put the same page in different rows)."""
    if skip:
        pool.alloc(skip * PAGE)
    return pool.alloc(pages * PAGE)


# -- scenarios ------------------------------------------------------------------------


def factory(endpoint: str) -> Facts:
    pool = host_pool("page_first")
    made = backend(endpoint, pool, tp_rank=1, tp_size=2)
    return {"class": type(made).__name__, "module": type(made).__module__, "fields": made.fields}


def roundtrip(endpoint: str, layout: str) -> Facts:
    """TP 2: each rank stores its shard in its namespace; a second instance reads them."""
    n = 6
    keys = page_hashes(n)
    facts: Facts = {}
    written, backends = [], []
    for rank in (0, 1):
        a = host_pool(layout)
        ia = alloc(a, n)
        backends.append(backend(endpoint, a, tp_rank=rank, tp_size=2))
        facts[f"set{rank}"] = backends[-1].batch_set_v1(keys, ia)
        written.append((a, ia))
    facts["same_namespace"] = len({digest(endpoint, made) for made in backends}) == 1
    for rank in (0, 1):
        b = host_pool(layout)
        ib = alloc(b, n, skip=3)
        other = backend(endpoint, b, tp_rank=rank, tp_size=2)
        facts[f"exists{rank}"] = other.batch_exists(keys)
        facts[f"get{rank}"] = other.batch_get_v1(keys, ib)
        a, ia = written[rank]
        facts[f"same{rank}"] = same_pages(a, ia, b, ib, n)
        a, ia = written[1 - rank]
        facts[f"same_as_other_rank{rank}"] = any(same_pages(a, ia, b, ib, n))
    return facts


def mla(endpoint: str, layout: str) -> Facts:
    """MLA, TP 2: one namespace for both ranks, written by rank 0 only."""
    n = 5
    keys, others = page_hashes(n), page_hashes(n)
    a0, a1 = host_pool(layout, mla=True), host_pool(layout, mla=True)
    i0, i1 = alloc(a0, n), alloc(a1, n)
    rank0 = backend(endpoint, a0, tp_rank=0, tp_size=2, mla=True)
    rank1 = backend(endpoint, a1, tp_rank=1, tp_size=2, mla=True)
    facts: Facts = {"writer": [rank0.writer, rank1.writer]}
    facts["rank1_set"] = rank1.batch_set_v1(others, i1)
    facts["rank1_stored"] = rank0.batch_exists(others)
    facts["rank0_set"] = rank0.batch_set_v1(keys, i0)
    facts["same_namespace"] = digest(endpoint, rank0) == digest(endpoint, rank1)
    for rank in (0, 1):
        b = host_pool(layout, mla=True)
        ib = alloc(b, n, skip=2)
        reader = backend(endpoint, b, tp_rank=rank, tp_size=2, mla=True)
        facts[f"exists{rank}"] = reader.batch_exists(keys)
        facts[f"get{rank}"] = reader.batch_get_v1(keys, ib)
        facts[f"same{rank}"] = same_pages(a0, i0, b, ib, n)
    return facts


def partial(endpoint: str) -> Facts:
    """A page missing in the middle: existence and reads stop there."""
    n = 7
    keys = page_hashes(n)
    a = host_pool("page_first")
    ia = alloc(a, n)
    made = backend(endpoint, a)
    upto, after = 3, 4
    facts: Facts = {
        "set_head": made.batch_set_v1(keys[:upto], ia[: upto * PAGE]),
        "set_tail": made.batch_set_v1(keys[after:], ia[after * PAGE :]),
        "exists": made.batch_exists(keys),
        "exists_tail": made.batch_exists(keys[after:]),
    }
    b = host_pool("page_first")
    ib = alloc(b, n, skip=1)
    facts["get"] = backend(endpoint, b).batch_get_v1(keys, ib)
    facts["same_head"] = same_pages(a, ia, b, ib, upto)
    return facts


def skip_present(endpoint: str) -> Facts:
    """A page already stored is not written again: changed host bytes under the
    same key leave the stored page as it was."""
    n = 4
    keys = page_hashes(n)
    more = page_hashes(2, prior=keys[-1])
    a = host_pool("page_first")
    ia = alloc(a, n + 2)
    made = backend(endpoint, a)
    facts: Facts = {"first": made.batch_set_v1(keys, ia[: n * PAGE])}
    before = [page(a, ia, j) for j in range(n)]
    a.kv_buffer.view(torch.uint8).add_(1)  # every host byte changes
    with Client(extra(endpoint)["endpoint"]) as c:
        ns = c.register(**made.fields)
        published = c.stats().pages
        facts["again"] = made.batch_set_v1(keys, ia[: n * PAGE])
        facts["new_pages_again"] = c.stats().pages - published
        info = HiCacheStorageExtraInfo(prefix_keys=keys)
        facts["next"] = made.batch_set_v1(more, ia[n * PAGE :], info)
        facts["new_pages_next"] = c.stats().pages - published
        facts["in_l2"] = c.exists_keys(ns, [bytes.fromhex(k) for k in keys + more]).in_l2
    b = host_pool("page_first")
    ib = alloc(b, n)
    facts["get"] = backend(endpoint, b).batch_get_v1(keys, ib)
    facts["kept_first"] = [torch.equal(before[j], page(b, ib, j)) for j in range(n)]
    return facts


def flat(endpoint: str) -> Facts:
    """Without interface_v1: SGLang's flat data pages, the same bytes as v1's."""
    n = 3
    keys, flat_keys = page_hashes(n), page_hashes(n)
    a = host_pool("layer_first")
    ia = alloc(a, n)
    made = backend(endpoint, a)
    facts: Facts = {"v1_set": made.batch_set_v1(keys, ia)}
    targets = [a.get_dummy_flat_data_page() for _ in range(n)]
    got = made.batch_get(keys, targets)
    facts["flat_get"] = [t is not None for t in got]
    facts["flat_same"] = [torch.equal(bytes_of(targets[j]), page(a, ia, j)) for j in range(n)]
    facts["flat_set"] = made.batch_set(
        flat_keys, [a.get_data_page(int(ia[j * PAGE])) for j in range(n)]
    )
    b = host_pool("layer_first")
    ib = alloc(b, n, skip=2)
    facts["v1_get"] = backend(endpoint, b).batch_get_v1(flat_keys, ib)
    facts["v1_same"] = same_pages(a, ia, b, ib, n)
    facts["exists_one"] = made.exists(keys[0])
    facts["get_missing"] = made.get(page_hashes(1)[0], a.get_dummy_flat_data_page()) is None
    return facts


def bad_input(endpoint: str) -> Facts:
    """Keys that are not page hashes are misses; indices that do not cover the
    keys' pages are ValueError; float indices, and flat pages of another size
    than the pool's, are hicached's BadRequest before anything is copied."""
    a = host_pool("page_first")
    made = backend(endpoint, a)
    keys = page_hashes(3)
    ia = alloc(a, 3)
    facts: Facts = {"set_good": made.batch_set_v1(keys, ia)}
    wrong = {
        "short": [keys[0], "abc", keys[2]],
        "upper": [keys[0], keys[1].upper(), keys[2]],
        "not_str": [keys[0], bytes.fromhex(keys[1]), keys[2]],
        "not_hex": [keys[0], "z" * 64, keys[2]],
    }
    for name, bad in wrong.items():
        facts[f"exists_{name}"] = made.batch_exists(bad)
        facts[f"set_{name}"] = made.batch_set_v1(bad, ia)
        facts[f"get_{name}"] = made.batch_get_v1(bad, alloc(a, 3))
    calls: dict[str, Callable[[], object]] = {
        "set_short_indices": lambda: made.batch_set_v1(keys, ia[:-1]),
        "get_long_indices": lambda: made.batch_get_v1(keys[:2], ia),
        "set_unaligned": lambda: made.batch_set_v1(keys[:1], ia[1 : PAGE + 1]),
        "get_scattered": lambda: made.batch_get_v1(keys[:1], ia[:PAGE].flip(0)),
        "flat_get_targets": lambda: made.batch_get(keys, [a.get_dummy_flat_data_page()]),
    }
    # a good target first: the call must refuse the bad one before it copies any page
    page = a.get_dummy_flat_data_page()
    good = torch.full_like(page, 7.0)
    half = torch.zeros(page.numel() // 2, dtype=page.dtype)
    strided = torch.zeros(2 * page.numel(), dtype=page.dtype)[::2]
    flat_keys, float_keys = page_hashes(2), page_hashes(3)
    calls["flat_get_small_target"] = lambda: made.batch_get(keys[:2], [good, half])
    calls["flat_get_strided_target"] = lambda: made.batch_get(keys[:2], [good, strided])
    calls["flat_set_small_page"] = lambda: made.batch_set(flat_keys, [page, half])
    # 0.5 past each slot: an int64 cast reads the right pages from the wrong indices
    calls["get_float_indices"] = lambda: made.batch_get_v1(keys, ia.to(torch.float64) + 0.5)
    calls["set_float_indices"] = lambda: made.batch_set_v1(float_keys, ia.float())
    for name, call in calls.items():
        try:
            facts[name] = repr(call())
        except Exception as exc:
            facts[name] = f"{type(exc).__name__}: {exc}"
    facts["flat_get_good_target_untouched"] = bool((good == 7.0).all())
    facts["flat_set_stored"] = made.batch_exists(flat_keys)
    facts["set_float_stored"] = made.batch_exists(float_keys)
    facts["empty"] = [
        made.batch_exists([]),
        made.batch_set_v1([], ia[:0]),
        made.batch_get_v1([], ia[:0]),
    ]
    return facts


def down(_: str, nowhere: str) -> Facts:
    """No daemon at the endpoint: misses, quickly, no exception."""
    endpoint = nowhere
    a = host_pool("page_first")
    started = time.monotonic()
    made = backend(endpoint, a)
    keys = page_hashes(4)
    ia = alloc(a, 4)
    facts: Facts = {"built_s": time.monotonic() - started}
    started = time.monotonic()
    facts["exists"] = made.batch_exists(keys)
    facts["set"] = made.batch_set_v1(keys, ia)
    facts["get"] = made.batch_get_v1(keys, ia)
    facts["first_calls_s"] = time.monotonic() - started
    started = time.monotonic()
    for _ in range(20):
        made.batch_exists(keys)
    facts["backed_off_s"] = time.monotonic() - started
    made.close()
    return facts


def dies(endpoint: str, pid: str) -> Facts:
    """The daemon is killed under a working backend: misses, no exception."""
    a = host_pool("page_first")
    made = backend(endpoint, a)
    keys = page_hashes(4)
    ia = alloc(a, 4)
    facts: Facts = {
        "set_alive": made.batch_set_v1(keys, ia),
        "exists_alive": made.batch_exists(keys),
    }
    os.kill(int(pid), signal.SIGKILL)
    time.sleep(0.5)
    started = time.monotonic()
    facts["exists"] = made.batch_exists(keys)
    facts["set"] = made.batch_set_v1(page_hashes(2), ia[: 2 * PAGE])
    facts["get"] = made.batch_get_v1(keys, ia)
    facts["calls_s"] = time.monotonic() - started
    made.close()
    return facts


def l3(endpoint: str) -> Facts:
    """Pages that L2 let go of come back from L3 through batch_get_v1."""
    n = 8
    keys = page_hashes(n)
    a = host_pool("page_first")
    ia = alloc(a, n)
    made = backend(endpoint, a)
    facts: Facts = {"set": made.batch_set_v1(keys, ia)}
    wanted = [bytes.fromhex(k) for k in keys]
    with Client(endpoint) as c:
        ns = c.register(**made.fields)
        facts.update(to_l3(c, ns, made, wanted, ia))
        before = c.stats()
        b = host_pool("page_first")
        ib = alloc(b, n, skip=5)
        other = backend(endpoint, b)
        facts["exists"] = other.batch_exists(keys)
        facts["get"] = other.batch_get_v1(keys, ib)
        facts["same"] = same_pages(a, ia, b, ib, n)
        after = c.stats()
        facts["l3_pages_read"] = after.match_pages.get("l3", 0) - before.match_pages.get("l3", 0)
        facts["l3"] = {k: after.l3.get(k, 0) - before.l3.get(k, 0) for k in after.l3}
        facts["in_l2_after"] = c.exists_keys(ns, wanted).in_l2
    return facts


def l3_parents(endpoint: str, events: str) -> Facts:
    """A read whose first pages L2 holds and whose next ones only L3 does: the
    pages L3 gives back enter L2 under the page before them, as the daemon's
    BlockStored events (``events``: its endpoint) of their return say."""
    import zmq

    from hicached.events import batch_decoder
    from hicached.wire.events import MEDIUM_L2, block_hash

    n = 6
    keys = page_hashes(n)
    a = host_pool("page_first")
    ia = alloc(a, 8)  # 8 pages: to_l3's filler takes them
    made = backend(endpoint, a)
    wanted = [bytes.fromhex(k) for k in keys]
    hashes = [block_hash(k) for k in wanted]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events)

    def stored(wait_s: float) -> dict[Any, Any]:
        """Each block the L2 BlockStored events name until none came for
        ``wait_s``: its parent."""
        parents: dict[Any, Any] = {}
        while sub.poll(int(wait_s * 1000)):
            _, _, payload = sub.recv_multipart()
            for e in batch_decoder.decode(payload).events:
                if type(e).__name__ == "BlockStored" and e.medium == MEDIUM_L2:
                    before = [e.parent_block_hash, *e.block_hashes][:-1]
                    parents.update(zip(e.block_hashes, before, strict=True))
        return parents

    try:
        facts: Facts = {"set": made.batch_set_v1(keys, ia[: n * PAGE])}
        with Client(endpoint) as c:
            ns = c.register(**made.fields)
            facts.update(to_l3(c, ns, made, wanted, ia))
            stored(0.3)  # what the stores before announced
            b = host_pool("page_first")
            ib = alloc(b, n)
            other = backend(endpoint, b)
            facts["get_first"] = other.batch_get_v1(keys[:3], ib[: 3 * PAGE])
            facts["get"] = other.batch_get_v1(keys, ib)
        parents = stored(1.0)
    finally:
        sub.close()
        ctx.term()
    # per page back from L3: the index of its parent's page (-1: none or another)
    facts["parents"] = [
        hashes.index(parents[h]) if parents[h] in hashes else -1 for h in hashes if h in parents
    ]
    return facts


def to_l3(c: Client, ns: Any, made: HicachedStorage, wanted: list[bytes], rows: Any) -> Facts:
    """Store filler pages until L2 lets go of the pages of ``wanted`` (L3 keeps
    them): the rounds it took and where the pages are then."""
    filler_rows = rows[: PAGE * 8].repeat(16)  # 128 pages' slots: any bytes will do
    rounds = 0
    while any(c.exists_keys(ns, wanted).in_l2) and rounds < 32:  # 8 times the pool
        settle(c)
        made.batch_set_v1(page_hashes(128), filler_rows)
        rounds += 1
    found = c.exists_keys(ns, wanted)
    return {"filler_rounds": rounds, "in_l2": found.in_l2, "in_l3": found.in_l3}


def repeats(endpoint: str) -> Facts:
    """A page hash twice in one call. The daemon takes a key once in a
    reservation or a prefetch: each is sent once and answered at every page
    that names it. Stores of repeats, then reads of repeats whose pages only
    L3 holds (v1 and flat), every page filled."""
    a = host_pool("page_first")
    made = backend(endpoint, a)
    facts: Facts = {}
    ia = alloc(a, 8)  # 8 pages: to_l3's filler takes them
    x, y, z = page_hashes(3), page_hashes(3), page_hashes(3)
    with Client(endpoint) as c:
        ns = c.register(**made.fields)
        published = c.stats().pages
        # the same host bytes under a key at its two pages, as SGLang would have them
        rows = torch.cat([ia[: 2 * PAGE], ia[:PAGE]])
        facts["set_aba"] = made.batch_set_v1([x[0], x[1], x[0]], rows)
        facts["new_pages_aba"] = c.stats().pages - published
        rows = torch.cat([ia[2 * PAGE : 3 * PAGE], ia[2 * PAGE : 4 * PAGE]])
        facts["set_aab"] = made.batch_set_v1([y[0], y[0], y[1]], rows)
        rows = torch.cat(
            [ia[4 * PAGE : 6 * PAGE], ia[4 * PAGE : 5 * PAGE], ia[2 * PAGE : 3 * PAGE]]
        )
        facts["set_abac"] = made.batch_set_v1([z[0], z[1], z[0], z[2]], rows)
        facts["new_pages"] = c.stats().pages - published
        facts["stored_abac"] = c.exists_keys(ns, [bytes.fromhex(k) for k in z]).in_l2
        flat = page_hashes(2)
        pages = [a.get_data_page(int(ia[j * PAGE])) for j in (0, 1, 0)]
        facts["flat_set"] = made.batch_set([flat[0], flat[1], flat[0]], pages)
        facts["flat_stored"] = made.batch_exists(flat)
        # pages only in L3, asked with repeats
        stored = {x[0]: 0, x[1]: 1, y[0]: 2, y[1]: 3}  # where each page's bytes are in ia
        facts.update(to_l3(c, ns, made, [bytes.fromhex(k) for k in stored], ia))
        asked = [x[0], x[0], x[1], y[0], x[1]]
        flat_asked = [y[0], y[1], y[1]]
        b = host_pool("page_first")
        ib = alloc(b, len(asked), skip=3)
        other = backend(endpoint, b)
        facts["exists"] = other.batch_exists(asked)
        facts["get"] = other.batch_get_v1(asked, ib)
        facts["same"] = [
            torch.equal(page(a, ia, stored[k]), page(b, ib, j)) for j, k in enumerate(asked)
        ]
        # a key again past a miss: the read stops at the miss, the first page stays read
        facts["get_past_miss"] = other.batch_get_v1([x[0], page_hashes(1)[0], x[0]], ib[: 3 * PAGE])
        targets = [a.get_dummy_flat_data_page() for _ in flat_asked]
        got = other.batch_get(flat_asked, targets)
        facts["flat_get"] = [t is not None for t in got]
        facts["flat_same"] = [
            torch.equal(bytes_of(t), page(a, ia, stored[k]))
            for t, k in zip(targets, flat_asked, strict=True)
        ]
    return facts


def limit(_: str, small: str) -> Facts:
    """A daemon that takes at most 4 pages a request (``small``): a query over
    more keys (SGLang's hybrid controller asks about a whole request's pages at
    once) still counts the leading pages stored, and reads and stores of more
    pages move them all, 4 a request."""
    n = 10
    keys = page_hashes(n)
    a = host_pool("page_first")
    ia = alloc(a, 2 * n)
    made = backend(small, a)
    facts: Facts = {"set": []}
    for first in range(0, n, 4):
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:first])
        rows = ia[first * PAGE : min(first + 4, n) * PAGE]
        facts["set"] += made.batch_set_v1(keys[first : first + 4], rows, info)
    facts["exists"] = made.batch_exists(keys)
    facts["exists_past"] = made.batch_exists(keys + page_hashes(3))
    facts["exists_v2"] = made.batch_exists_v2(keys).kv_hit_pages
    facts["get"] = made.batch_get_v1(keys, ia[n * PAGE :])
    facts["same"] = same_pages(a, ia[: n * PAGE], a, ia[n * PAGE :], n)
    more = page_hashes(6)
    facts["set_more"] = made.batch_set_v1(more, ia[: 6 * PAGE])
    facts["exists_more"] = made.batch_exists(more)
    facts["get_more"] = made.batch_get_v1(more, ia[n * PAGE : (n + 6) * PAGE])
    facts["same_more"] = same_pages(a, ia[: 6 * PAGE], a, ia[n * PAGE :], 6)
    return facts


def settle(c: Client, timeout: float = 30.0) -> None:
    """Wait until no L3 write is queued or in flight (evictions wait for them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = c.stats()
        if stats.l3.get("queued", 0) == 0 and stats.pinned_pages == 0:
            return
        time.sleep(0.02)


SCENARIOS: dict[str, Callable[..., Facts]] = {
    "factory": factory,
    "roundtrip": roundtrip,
    "mla": mla,
    "partial": partial,
    "skip_present": skip_present,
    "flat": flat,
    "bad_input": bad_input,
    "down": down,
    "dies": dies,
    "l3": l3,
    "l3_parents": l3_parents,
    "repeats": repeats,
    "limit": limit,
}


class Kept(logging.Handler):
    """What the backend logged during a scenario (a healthy one logs nothing)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def main(endpoint: str, *scenarios: str) -> None:
    """Each scenario as NAME or NAME:ARG (its one extra argument)."""
    out: dict[str, Facts] = {}
    kept = Kept()
    logging.getLogger("hicached").addHandler(kept)
    for scenario in scenarios:
        name, _, arg = scenario.partition(":")
        args = [arg] if arg else []
        started = time.monotonic()
        kept.lines = []
        try:
            out[scenario] = SCENARIOS[name](endpoint, *args)
        except Exception:
            out[scenario] = {"error": traceback.format_exc()}
        out[scenario]["seconds"] = round(time.monotonic() - started, 3)
        out[scenario]["log"] = kept.lines
    answer_and_exit(out, default=repr)


if __name__ == "__main__":
    main(*sys.argv[1:])
