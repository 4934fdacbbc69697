"""Run in the SGLang venv (tests/engines/sglang_venv.py): hicached's HiCache
storage backend with a hybrid model's host pools, driven by SGLang's own
classes against a real daemon.

    python sglang_hybrid_check.py ENDPOINT SCENARIO...   # one JSON object on stdout

The pools are SGLang's: ``MHATokenToKVPoolHost`` for the KV, a sliding
window and a draft model, ``MambaPoolHost`` for Mamba state (its buffers as
SGLang's device pool hands them over, on CPU), DeepSeek V4's
``LogicalHostPool`` anchor and ``DeepSeekV4PagedHostPool``; they are grouped
in SGLang's ``HostPoolGroup`` and registered as its cache controller does
(the anchor, then every entry through ``register_mem_host_pool_v2``, then
``on_host_pools_registered``). Stores go as the hybrid controller sends them
(sidecars per trailing-window group with ``_trailing_chain_groups``, then the
KV pages), queries carry its placeholder keys. ``hybrid_write`` and
``hybrid_read:FILE`` run in two processes: the second reads what the first
wrote (FILE: the first's report) into pools of its own, and each reports the
SHA-256 of every page it wrote or read; ``lost_write`` and ``lost_read:FILE``
likewise, with one pool's page missing in L3 between them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import sglang_check as base  # tests/engines, beside this script
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import _trailing_chain_groups
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from hicached.client import Client
from hicached.integrations.sglang import HicachedStorage
from tests.engines import answer_and_exit

PAGE = base.PAGE
WINDOW = 2  # sliding-window pages a prefix needs
TRAILING, ALL = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES
KV, SWA, MAMBA, DRAFT = PoolName.KV, PoolName.SWA, PoolName.MAMBA, PoolName.DRAFT
C4 = PoolName.DEEPSEEK_V4_C4
Facts = dict[str, Any]
Info = HiCacheStorageExtraInfo


# -- SGLang's host pools, filled with random bytes -----------------------------------


def fill(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.numel():
            raw = tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))


def mha_pool(layout: str, layers: int, heads: int = 2) -> MHATokenToKVPoolHost:
    """A KV-like host pool (sliding window, draft model) over a CPU device pool."""
    dev = MHATokenToKVPool(
        512, PAGE, torch.bfloat16, heads, 64, layers, "cpu", False, start_layer=0, end_layer=layers
    )
    host = MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        1.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device_capacity_tokens=dev.size,
        start_layer=0,
        end_layer=layers,
    )
    fill(host.kv_buffer)
    return host


def mamba_pool(side: bool = False, big: bool = False, slots: int = 24) -> MambaPoolHost:
    """SGLang's Mamba host pool over the state buffers a device pool hands over
    (fp32 temporal, bf16 conv; ``side``: a slot side state, which SGLang's
    zero-copy addresses leave out; ``big``: a state larger than the test
    daemon's max_page_bytes)."""
    heads = 64 if big else 2
    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, slots, heads, 32, 32, dtype=torch.float32),
        conv=(torch.zeros(2, slots, 8, 3, dtype=torch.bfloat16),),
        extra_checkpoint_buffers=(torch.zeros(slots, 5, dtype=torch.int32),) if side else (),
    )
    pool = MambaPoolHost(info, 4.0, 0, device_capacity=slots, pin_memory=False, layout="page_first")
    fill(*pool.kv_buffer)
    return pool


def c4_pool() -> DeepSeekV4PagedHostPool:
    pool = DeepSeekV4PagedHostPool(
        pool_name=str(C4),
        device_buffers=[torch.zeros(1), torch.zeros(1)],  # two layers; only their count is used
        item_bytes=96,
        num_host_pages=32,
        slot_page_size=PAGE,
        layout="page_first",
        pin_memory=False,
    )
    fill(pool.kv_buffer)
    return pool


GROUPS: dict[str, Callable[[], dict[PoolName, Any]]] = {
    # KV + sliding window + Mamba + draft KV, rows copied zero-copy
    "rows": lambda: {
        KV: base.host_pool("page_first"),
        SWA: mha_pool("page_first", 1),
        MAMBA: mamba_pool(),
        DRAFT: mha_pool("page_first", 1, heads=1),
    },
    # another layout, and a Mamba pool with a side state: flat pages
    "flat": lambda: {
        KV: base.host_pool("layer_first"),
        SWA: mha_pool("layer_first", 1),
        MAMBA: mamba_pool(side=True),
    },
    # DeepSeek V4: a logical anchor, the KV in a compressed pool
    "logical": lambda: {
        KV: LogicalHostPool(512, PAGE, layout="page_first"),
        C4: c4_pool(),
    },
}
KV_DERIVED = (DRAFT, C4)  # pools that take the KV pool's host indices, all pages


def hybrid(
    endpoint: str, pools: dict[PoolName, Any], *, tp_rank: int = 0, tp_size: int = 1
) -> HicachedStorage:
    """A backend as SGLang's hybrid cache controller attaches one."""
    mla = isinstance(pools[KV], (MLATokenToKVPoolHost, LogicalHostPool))  # rank-replicated KV
    made = base.backend(endpoint, pools[KV], tp_rank=tp_rank, tp_size=tp_size, mla=mla)
    group = HostPoolGroup(
        [
            PoolEntry(name, pool, None, lambda layer: layer, is_primary_index_anchor=name == KV)
            for name, pool in pools.items()
        ]
    )
    for entry in group.entries:
        made.register_mem_host_pool_v2(entry.host_pool, entry.name)
    made.on_host_pools_registered()
    return made


# -- what SGLang sends -------------------------------------------------------------


class Slots:
    """Host slots for ``n`` pages in each pool of a group: KV (and the pools that
    share its indices) and the sliding window a page each, Mamba a state each."""

    def __init__(self, pools: dict[PoolName, Any], n: int, skip: int = 0) -> None:
        self.pools = pools
        self.kv = base.alloc(pools[KV], n, skip)
        self.swa = base.alloc(pools[SWA], n, skip) if SWA in pools else None
        if MAMBA in pools:
            pools[MAMBA].alloc(skip)
        self.mamba = pools[MAMBA].alloc(n) if MAMBA in pools else None

    def of(self, name: PoolName, pages: range) -> torch.Tensor:
        """The host indices of ``pages`` in pool ``name``."""
        if name == MAMBA:
            assert self.mamba is not None
            return self.mamba[pages.start : pages.stop]
        rows = self.swa if name == SWA else self.kv
        assert rows is not None
        return rows[pages.start * PAGE : pages.stop * PAGE]

    def place(self, name: PoolName, page: int) -> int:
        return int(self.of(name, range(page, page + 1))[0])

    def digest(self, name: PoolName, page: int) -> str:
        data = self.pools[name].get_data_page(self.place(name, page), flat=True)
        return hashlib.sha256(base.bytes_of(data).numpy().tobytes()).hexdigest()


def store_node(
    made: HicachedStorage, slots: Slots, keys: list[str], start: int, end: int
) -> dict[str, list[bool]]:
    """Back up the pages ``start:end`` of ``keys`` as the hybrid controller does:
    sidecars first (KV-derived pools over the node, trailing pools over their
    window, the Mamba state at its end), each trailing group under its own
    prefix, then the KV pages."""
    transfers = []
    for name in slots.pools:
        if name in KV_DERIVED:
            pages = range(start, end)
        elif name == SWA:
            pages = range(max(start, end - WINDOW), end)
        elif name == MAMBA:
            pages = range(end - 1, end)
        else:
            continue
        transfers.append(
            PoolTransfer(
                name=name,
                host_indices=slots.of(name, pages),  # a node's state: its last page's slot
                keys=keys[pages.start : pages.stop],
                hit_policy=ALL if name in KV_DERIVED else TRAILING,
            )
        )
    out: dict[str, list[bool]] = {}
    for info, group in _trailing_chain_groups(keys[:start], keys[start:end], transfers):
        out.update({str(k): v for k, v in made.batch_set_v2(group, info).items()})
    host = slots.kv[start * PAGE : end * PAGE]
    out[str(KV)] = made.batch_set_v1(keys[start:end], host, Info(prefix_keys=keys[:start]))
    return out


def query(pools: dict[PoolName, Any]) -> list[PoolTransfer]:
    """The sidecar transfers of a prefetch query: placeholders, as SGLang sends."""
    out = []
    for name in pools:
        if name in KV_DERIVED:
            out.append(PoolTransfer(name=name, indices_from_pool=KV))
        elif name == SWA:
            out.append(
                PoolTransfer(name=name, keys=["__placeholder__"] * WINDOW, hit_policy=TRAILING)
            )
        elif name == MAMBA:
            out.append(PoolTransfer(name=name, keys=["__placeholder__"], hit_policy=TRAILING))
    return out


def result(r: PoolTransferResult) -> Facts:
    return {
        "kv": r.kv_hit_pages,
        "hits": {str(k): v for k, v in r.extra_pool_hit_pages.items()},
        "restorable": r.restorable_prefix_pages,
    }


def named(results: dict[Any, list[bool]]) -> dict[str, list[bool]]:
    return {str(k): v for k, v in results.items()}


# -- the two processes -------------------------------------------------------------

N = 6  # pages: two nodes of three, a Mamba state at the end of each


def hybrid_write(endpoint: str) -> Facts:
    facts: Facts = {}
    for group, make in GROUPS.items():
        pools = make()
        made = hybrid(endpoint, pools)
        keys = base.page_hashes(N)
        slots = Slots(pools, N)
        sets = [store_node(made, slots, keys, 0, 3), store_node(made, slots, keys, 3, N)]
        written: dict[str, dict[str, str]] = {}
        for name in pools:
            if name == KV and made.logical:
                continue  # no bytes
            pages = {SWA: [1, 2, 4, 5], MAMBA: [2, 5]}.get(name, range(N))
            written[str(name)] = {keys[j]: slots.digest(name, j) for j in pages}
        facts[group] = {
            "keys": keys,
            "set": sets,
            "exists": result(made.batch_exists_v2(keys, query(pools))),
            "written": written,
            "layouts": {name: f["layout"] for name, f in made.link.fields.items()},
            "page_bytes": {name: f["page_bytes"] for name, f in made.link.fields.items()},
            "copies": {name: type(pool.pages).__name__ for name, pool in made.pools.items()},
        }
    return facts


def hybrid_read(endpoint: str, path: str) -> Facts:
    with open(path) as f:
        wrote = json.load(f)["hybrid_write"]
    facts: Facts = {}
    for group, make in GROUPS.items():
        pools = make()  # other random bytes, and the pages in other rows
        made = hybrid(endpoint, pools)
        keys = wrote[group]["keys"]
        slots = Slots(pools, N, skip=3)
        got: Facts = {"exists": result(made.batch_exists_v2(keys, query(pools)))}
        if not made.logical:  # a key twice in one read, first (from L3 when only it holds them)
            asked = [keys[0], keys[1], keys[0], keys[1], keys[2]]  # k2 follows k1: read too
            rows = base.alloc(pools[KV], len(asked))
            got["kv_repeat"] = made.batch_get_v1(asked, rows)
            got["kv_repeat_read"] = [
                hashlib.sha256(
                    base.bytes_of(pools[KV].get_data_page(int(rows[j * PAGE]), flat=True))
                    .numpy()
                    .tobytes()
                ).hexdigest()
                for j in range(len(asked))
            ]
        got["kv"] = made.batch_get_v1(keys, slots.kv)
        read: dict[str, dict[str, str]] = {}
        if not made.logical:
            read[str(KV)] = {keys[j]: slots.digest(KV, j) for j in range(N)}
        for name in pools:
            if name in KV_DERIVED:  # read with the KV pages, over the KV indices
                t = PoolTransfer(name=name, host_indices=slots.kv, keys=keys)
                got[str(name)] = named(made.batch_get_v2([t]))[str(name)]
                read[str(name)] = {keys[j]: slots.digest(name, j) for j in range(N)}
        for end in (3, N):  # the sidecars of each node's end, as a prefetch of it loads them
            window = range(end - WINDOW, end)
            ts = []
            if SWA in pools:
                ts.append(
                    PoolTransfer(
                        name=SWA,
                        host_indices=slots.of(SWA, window),
                        keys=keys[window.start : end],
                        hit_policy=TRAILING,
                    )
                )
            if MAMBA in pools:
                ts.append(
                    PoolTransfer(
                        name=MAMBA,
                        host_indices=slots.of(MAMBA, range(end - 1, end)),
                        keys=[keys[end - 1]],
                        hit_policy=TRAILING,
                    )
                )
            if ts:
                got[f"sidecars{end}"] = named(
                    made.batch_get_v2(ts, Info(prefix_keys=keys[: window.start]))
                )
        if SWA in pools:
            read[str(SWA)] = {keys[j]: slots.digest(SWA, j) for j in (1, 2, 4, 5)}
        if MAMBA in pools:  # a node's state went to the slot of its last page
            read[str(MAMBA)] = {keys[j]: slots.digest(MAMBA, j) for j in (2, 5)}
        got["read"] = read
        facts[group] = got
    return facts


# -- what a hit is ------------------------------------------------------------------


def set_pages(
    made: HicachedStorage, slots: Slots, keys: list[str], name: PoolName, pages: list[int]
) -> list[bool]:
    """Store pool ``name``'s pages ``pages`` of ``keys``, a call per run of
    consecutive pages, each under the keys before it."""
    out: list[bool] = []
    runs: list[list[int]] = []
    for page in pages:
        if runs and runs[-1][-1] == page - 1:
            runs[-1].append(page)
        else:
            runs.append([page])
    for run in runs:
        span = range(run[0], run[-1] + 1)
        info = Info(prefix_keys=keys[: span.start])
        if name == KV:
            out += made.batch_set_v1(keys[span.start : span.stop], slots.of(KV, span), info)
        else:
            t = PoolTransfer(
                name=name, host_indices=slots.of(name, span), keys=keys[span.start : span.stop]
            )
            out += named(made.batch_set_v2([t], info))[str(name)]
    return out


def stops(endpoint: str) -> Facts:
    """``batch_exists_v2`` stops at the first page the KV pool or an all-pages
    pool lacks, and a trailing pool restores only the prefixes it ends."""
    pools = {
        KV: base.host_pool("page_first"),
        DRAFT: mha_pool("page_first", 1, 1),
        MAMBA: mamba_pool(),
    }
    made = hybrid(endpoint, pools)
    n, facts = 7, {}
    q = [
        PoolTransfer(name=DRAFT, indices_from_pool=KV),
        PoolTransfer(name=MAMBA, keys=["__placeholder__"], hit_policy=TRAILING),
    ]
    cases = {  # KV pages, draft pages, Mamba states (after page i + 1)
        "kv_hole": ([0, 1, 2, 3, 5, 6], list(range(7)), [1, 3]),
        "draft_hole": (list(range(7)), [0, 1, 2, 4, 5, 6], [1, 5]),
        "only_kv": (list(range(7)), [], []),
    }
    for case, (kv, draft, mamba) in cases.items():
        keys, slots = base.page_hashes(n), Slots(pools, n)
        sets = [
            set_pages(made, slots, keys, name, pages)
            for name, pages in ((KV, kv), (DRAFT, draft), (MAMBA, mamba))
        ]
        facts[case] = result(made.batch_exists_v2(keys, q))
        facts[f"{case}_set"] = all(all(s) for s in sets)
        t = PoolTransfer(name=DRAFT, host_indices=slots.kv, keys=keys)
        facts[f"{case}_draft_get"] = named(made.batch_get_v2([t]))[str(DRAFT)]
    return facts


def half(endpoint: str) -> Facts:
    """A page one pool stored and another did not is never a hit, nor read."""
    pools = {
        KV: base.host_pool("page_first"),
        SWA: mha_pool("page_first", 1),
        MAMBA: mamba_pool(),
        DRAFT: mha_pool("page_first", 1, 1),
    }
    made = hybrid(endpoint, pools)
    q = query(pools)
    facts: Facts = {}
    # a node's sidecars stored, its KV pages never (the engine went away between)
    keys, slots = base.page_hashes(3), Slots(pools, 3)
    ts = [
        PoolTransfer(
            name=SWA, host_indices=slots.of(SWA, range(1, 3)), keys=keys[1:], hit_policy=TRAILING
        ),
        PoolTransfer(
            name=MAMBA,
            host_indices=slots.of(MAMBA, range(2, 3)),
            keys=keys[2:],
            hit_policy=TRAILING,
        ),
        PoolTransfer(name=DRAFT, host_indices=slots.kv, keys=keys),
    ]
    facts["sidecars_set"] = named(made.batch_set_v2(ts, Info(prefix_keys=[])))
    facts["sidecars_only"] = result(made.batch_exists_v2(keys, q))
    # one call, two pools: the window's host indices are one short, so it stores
    # nothing, and the draft pool's pages of the same keys are not published either
    keys, slots = base.page_hashes(3), Slots(pools, 3)
    ts = [
        PoolTransfer(name=DRAFT, host_indices=slots.kv, keys=keys),
        PoolTransfer(name=SWA, host_indices=slots.of(SWA, range(3))[:-1], keys=keys),
    ]
    facts["one_fails_set"] = named(made.batch_set_v2(ts, Info(prefix_keys=[])))
    with Client(endpoint) as c:
        draft = c.register(**made.link.fields[str(DRAFT)])
        found = c.exists_keys(draft, [bytes.fromhex(k) for k in keys])
        facts["one_fails_published"] = [
            a or b for a, b in zip(found.in_l2, found.in_l3, strict=True)
        ]
    facts["one_fails_kv_set"] = made.batch_set_v1(keys, slots.kv)
    facts["one_fails"] = result(
        made.batch_exists_v2(keys, [PoolTransfer(name=DRAFT, indices_from_pool=KV)])
    )
    # KV and the window stored, the Mamba state not: no prefix ends on a state
    keys, slots = base.page_hashes(3), Slots(pools, 3)
    facts["no_state_set"] = made.batch_set_v1(keys, slots.kv) + set_pages(
        made, slots, keys, SWA, [1, 2]
    )
    trailing = [t for t in q if t.name in (SWA, MAMBA)]
    facts["no_state"] = result(made.batch_exists_v2(keys, trailing))
    ts = [
        PoolTransfer(
            name=SWA, host_indices=slots.of(SWA, range(1, 3)), keys=keys[1:], hit_policy=TRAILING
        ),
        PoolTransfer(
            name=MAMBA,
            host_indices=slots.of(MAMBA, range(2, 3)),
            keys=keys[2:],
            hit_policy=TRAILING,
        ),
    ]
    facts["no_state_get"] = named(made.batch_get_v2(ts, Info(prefix_keys=keys[:1])))
    return facts


# -- one pool's page lost in L3 ------------------------------------------------------

# case: (pool, page, how): "unstored", every pool's pages but that one were stored
# (an engine that stopped between a node's calls); "damaged", all were, and the
# test flips a byte of that page's record in its segment file while the daemon is
# down. Then the daemon starts with an empty L2, and every read comes from L3.
LOST = {
    "draft_unstored": (DRAFT, 3, "unstored"),
    "window_unstored": (SWA, 4, "unstored"),
    "first_state_unstored": (MAMBA, 2, "unstored"),
    "kv_unstored": (KV, 4, "unstored"),
    "draft_damaged": (DRAFT, 3, "damaged"),
    "state_damaged": (MAMBA, 5, "damaged"),
    "kv_damaged": (KV, 4, "damaged"),
}
NODES = {KV: range(N), SWA: (1, 2, 4, 5), MAMBA: (2, 5), DRAFT: range(N)}  # two nodes' pages


def lost_write(endpoint: str) -> Facts:
    """Each case's two nodes in every pool (the ``rows`` group), under keys of its
    own, but for the page an ``unstored`` case leaves out; with each pool's
    namespace digest, by which the test finds a ``damaged`` case's record."""
    facts: Facts = {}
    for case, (lost, page, how) in LOST.items():
        pools = GROUPS["rows"]()
        made = hybrid(endpoint, pools)
        keys, slots = base.page_hashes(N), Slots(pools, N)
        sets = {
            str(name): set_pages(
                made,
                slots,
                keys,
                name,
                [j for j in pages if how == "damaged" or (name, j) != (lost, page)],
            )
            for name, pages in NODES.items()
        }
        with Client(endpoint) as c:
            spaces = {name: c.register(**f).digest.hex() for name, f in made.link.fields.items()}
        facts[case] = {
            "lost": [str(lost), page, how],
            "keys": keys,
            "set": sets,
            "spaces": spaces,
            "written": {
                str(name): {keys[j]: slots.digest(name, j) for j in pages}
                for name, pages in NODES.items()
            },
        }
    return facts


def lost_read(endpoint: str, path: str) -> Facts:
    """Each case of ``lost_write`` from L3 alone: the hit; one read of the
    sidecar pools over both nodes (the draft pool's pages, the window and the
    state that end the second node), one of the window and the state that end
    the first, the KV pages; the hit again. ``read``: the digest of every page
    a read reported read, by pool."""
    with open(path) as f:
        wrote = json.load(f)["lost_write"]
    facts: Facts = {}
    for case in LOST:
        pools = GROUPS["rows"]()
        made = hybrid(endpoint, pools)
        keys = wrote[case]["keys"]
        slots = Slots(pools, N, skip=3)
        got: Facts = {"exists": result(made.batch_exists_v2(keys, query(pools)))}
        read: dict[str, dict[str, str]] = {str(name): {} for name in NODES}
        for end in (N, 3):
            window = range(end - WINDOW, end)
            state = range(end - 1, end)
            ts = [
                PoolTransfer(
                    name=SWA,
                    host_indices=slots.of(SWA, window),
                    keys=keys[window.start : end],
                    hit_policy=TRAILING,
                ),
                PoolTransfer(
                    name=MAMBA,
                    host_indices=slots.of(MAMBA, state),
                    keys=keys[state.start : end],
                    hit_policy=TRAILING,
                ),
            ]
            if end == N:
                ts.insert(0, PoolTransfer(name=DRAFT, host_indices=slots.kv, keys=keys))
            done = named(made.batch_get_v2(ts, Info(prefix_keys=keys[: window.start])))
            got[f"get{end}"] = done
            for t in ts:
                pages = range(N) if t.name == DRAFT else window if t.name == SWA else state
                for j, ok in zip(pages, done[str(t.name)], strict=True):
                    if ok:
                        read[str(t.name)][keys[j]] = slots.digest(t.name, j)
        got["kv"] = made.batch_get_v1(keys, slots.kv)
        read[str(KV)] = {keys[j]: slots.digest(KV, j) for j in range(N) if got["kv"][j]}
        got["read"] = read
        got["exists_after"] = result(made.batch_exists_v2(keys, query(pools)))
        facts[case] = got
    return facts


def mla_mamba(endpoint: str) -> Facts:
    """MLA KV under TP 2 is one namespace that rank 0 writes; Mamba state is
    each rank's own, written and read by each rank."""
    keys, facts = base.page_hashes(3), {}
    wrote = {}
    for rank in (0, 1):
        pools = {KV: base.host_pool("page_first", mla=True), MAMBA: mamba_pool()}
        made = hybrid(endpoint, pools, tp_rank=rank, tp_size=2)
        slots = Slots(pools, 3)
        facts[f"replicated{rank}"] = {n: f["replicated"] for n, f in made.link.fields.items()}
        facts[f"set{rank}"] = store_node(made, slots, keys, 0, 3)
        wrote[rank] = {name: slots.digest(name, 2) for name in (KV, MAMBA)}
    for rank in (0, 1):
        pools = {KV: base.host_pool("page_first", mla=True), MAMBA: mamba_pool()}
        made = hybrid(endpoint, pools, tp_rank=rank, tp_size=2)
        slots = Slots(pools, 3, skip=1)
        facts[f"exists{rank}"] = result(made.batch_exists_v2(keys, query(pools)))
        facts[f"get{rank}"] = made.batch_get_v1(keys, slots.kv)
        t = PoolTransfer(
            name=MAMBA,
            host_indices=slots.of(MAMBA, range(2, 3)),
            keys=keys[2:],
            hit_policy=TRAILING,
        )
        facts[f"state{rank}"] = named(made.batch_get_v2([t], Info(prefix_keys=keys[:2])))[
            str(MAMBA)
        ]
        read = {name: slots.digest(name, 2) for name in (KV, MAMBA)}
        facts[f"kv_same{rank}"] = read[KV] == wrote[0][KV]
        facts[f"state_same{rank}"] = read[MAMBA] == wrote[rank][MAMBA]
        facts[f"state_other{rank}"] = read[MAMBA] == wrote[1 - rank][MAMBA]
    return facts


def bad(endpoint: str) -> Facts:
    """What breaks SGLang's contract raises ValueError; a sidecar's indices that
    do not cover its pages are misses; a page the daemon refuses fails the attach."""
    pools = {KV: base.host_pool("page_first"), MAMBA: mamba_pool()}
    made = hybrid(endpoint, pools)
    keys = base.page_hashes(2)
    state = PoolTransfer(name=MAMBA, host_indices=torch.empty(0, dtype=torch.int64), keys=keys[1:])
    calls: dict[str, Callable[[], object]] = {
        "block_groups": lambda: made.batch_exists_v2(
            keys, [PoolTransfer(name=MAMBA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)]
        ),
        "unregistered": lambda: made.batch_exists_v2(
            keys, [PoolTransfer(name=SWA, keys=keys, hit_policy=TRAILING)]
        ),
        "unregistered_set": lambda: made.batch_set_v2([PoolTransfer(name=SWA, keys=keys)]),
        "too_big": lambda: hybrid(
            endpoint, {KV: base.host_pool("page_first"), MAMBA: mamba_pool(big=True)}
        ),
    }
    facts: Facts = {}
    for name, call in calls.items():
        try:
            facts[name] = repr(call())
        except Exception as exc:
            facts[name] = f"{type(exc).__name__}: {exc}"
    facts["short_set"] = named(made.batch_set_v2([state]))
    facts["short_get"] = named(made.batch_get_v2([state]))
    facts["empty"] = [
        result(made.batch_exists_v2([], [])),
        made.batch_set_v2([]),
        made.batch_get_v2([]),
        named(made.batch_set_v2([PoolTransfer(name=MAMBA, host_indices=torch.empty(0), keys=[])])),
    ]
    return facts


def down(_: str, nowhere: str) -> Facts:
    """No daemon: v2 calls answer nothing stored, one flag per page, quickly."""
    pools = {KV: base.host_pool("page_first"), SWA: mha_pool("page_first", 1), MAMBA: mamba_pool()}
    made = hybrid(nowhere, pools)
    keys, slots = base.page_hashes(3), Slots(pools, 3)
    ts = [
        PoolTransfer(
            name=SWA, host_indices=slots.of(SWA, range(1, 3)), keys=keys[1:], hit_policy=TRAILING
        ),
        PoolTransfer(
            name=MAMBA,
            host_indices=slots.of(MAMBA, range(2, 3)),
            keys=keys[2:],
            hit_policy=TRAILING,
        ),
    ]
    started = time.monotonic()
    facts: Facts = {
        "exists": result(made.batch_exists_v2(keys, query(pools))),
        "set": named(made.batch_set_v2(ts, Info(prefix_keys=keys[:1]))),
        "get": named(made.batch_get_v2(ts, Info(prefix_keys=keys[:1]))),
    }
    facts["calls_s"] = time.monotonic() - started
    made.close()
    return facts


def parents(_: str, endpoint: str) -> Facts:
    """On a daemon of its own (one page size): a store under prefix_keys keeps
    its sequence's order, so L2 evicts it from its tail; without them the
    second half of a sequence is a sequence of its own, and the first half's
    tail goes first. KV pages (v1) and a sliding window's (v2) alike."""
    pools = {KV: base.host_pool("page_first"), SWA: mha_pool("page_first", 2)}
    made = hybrid(endpoint, pools)
    n = 8
    chains = {name: base.page_hashes(n) for name in ("kv", "swa", "unlinked")}
    slots = {name: Slots(pools, n) for name in chains}
    for name, keys in chains.items():
        for span in (range(0, 4), range(4, n)):
            info = None if name == "unlinked" else Info(prefix_keys=keys[: span.start])
            part = keys[span.start : span.stop]
            if name == "swa":
                t = PoolTransfer(name=SWA, host_indices=slots[name].of(SWA, span), keys=part)
                assert all(named(made.batch_set_v2([t], info))[str(SWA)])
            else:
                assert all(made.batch_set_v1(part, slots[name].of(KV, span), info))
    first_loss: dict[str, list[bool]] = {}
    with Client(endpoint) as c:
        spaces = {
            "kv": c.register(**made.link.fields["kv"]),
            "swa": c.register(**made.link.fields["swa"]),
        }
        spaces["unlinked"] = spaces["kv"]
        page_bytes = spaces["kv"].page_bytes
        assert page_bytes == spaces["swa"].page_bytes
        fillers = 0
        while len(first_loss) < len(chains) and fillers < 1000:
            for name, keys in chains.items():
                found = c.exists_keys(spaces[name], [bytes.fromhex(k) for k in keys]).in_l2
                if name not in first_loss and not all(found):
                    first_loss[name] = found
            res = c.reserve_keys(spaces["kv"], [hashlib.sha256(b"filler%d" % fillers).digest()])
            c.write_pages(res, torch.zeros(1, page_bytes, dtype=torch.uint8))
            c.commit(res)
            fillers += 1
    return {"first_loss": first_loss, "fillers": fillers}


@contextlib.contextmanager
def slot_moves(page: int, when: str) -> Iterator[None]:
    """Fault injection: page ``page`` of the next read's hit looks as if its slot
    changed owner, before the copy ("pre") or during it ("post"), as the
    client's fences see a slot reused under a lease that ended."""
    from hicached.client import mapping

    orig_read, orig_seg = mapping.PoolMapping.start_read, mapping.PoolMapping.start_segments
    armed = [True]

    def bump(handle: Any) -> None:
        if armed[0] and len(handle.gens) > page:
            armed[0] = False
            handle.gens[page] += 1

    def start_read(self: Any, hit: Any, out: Any = None, rows: Any = None, at: Any = None) -> Any:
        if when == "pre":
            bump(hit)
        pending = orig_read(self, hit, out, rows, at)
        if when == "post":
            bump(hit)
        return pending

    def start_segments(self: Any, handle: Any, segs: Any, rows: Any, at: Any, **kw: Any) -> Any:
        if when == "pre" and not kw["to_pool"]:
            bump(handle)
        pending = orig_seg(self, handle, segs, rows, at, **kw)
        if when == "post" and not kw["to_pool"]:
            bump(handle)
        return pending

    mapping.PoolMapping.start_read = start_read  # type: ignore[method-assign]
    mapping.PoolMapping.start_segments = start_segments  # type: ignore[method-assign]
    try:
        yield
    finally:
        mapping.PoolMapping.start_read = orig_read  # type: ignore[method-assign]
        mapping.PoolMapping.start_segments = orig_seg  # type: ignore[method-assign]


def stale(endpoint: str) -> Facts:
    """A slot reused while a read copies its pages (fault injection above):
    a page reported read holds the bytes stored, for Mamba pools copied by
    rows and through flat pages (a side state), and for flat KV pages
    (``batch_get``, SGLang without interface_v1)."""
    out: Facts = {}
    n = 4
    for when in ("pre", "post"):
        for side in (False, True):
            w_pools = {KV: base.host_pool("page_first"), MAMBA: mamba_pool(side=side)}
            r_pools = {KV: base.host_pool("page_first"), MAMBA: mamba_pool(side=side)}
            writer, reader = hybrid(endpoint, w_pools), hybrid(endpoint, r_pools)
            keys = base.page_hashes(n)
            ws, rs = Slots(w_pools, n), Slots(r_pools, n, skip=2)
            put = PoolTransfer(name=MAMBA, host_indices=ws.mamba, keys=keys, hit_policy=TRAILING)
            assert all(named(writer.batch_set_v2([put], Info(prefix_keys=[])))["mamba"])
            get = PoolTransfer(name=MAMBA, host_indices=rs.mamba, keys=keys, hit_policy=TRAILING)
            with slot_moves(2, when):
                got = named(reader.batch_get_v2([get], Info(prefix_keys=[])))["mamba"]
            same = [
                digest(w_pools[MAMBA], ws.mamba[j]) == digest(r_pools[MAMBA], rs.mamba[j])
                for j in range(n)
            ]
            kind = type(reader.pools[str(MAMBA)].pages).__name__
            out[f"mamba_{kind}_{when}"] = {"read": got, "same": same}
        wp, rp = base.host_pool("page_first"), base.host_pool("page_first")
        writer, reader = base.backend(endpoint, wp), base.backend(endpoint, rp)
        keys = base.page_hashes(n)
        places = base.alloc(wp, n)
        assert all(writer.batch_set_v1(keys, places))
        targets = [rp.get_dummy_flat_data_page().zero_() for _ in range(n)]
        with slot_moves(2, when):
            pages = reader.batch_get(keys, targets)
        out[f"flat_kv_{when}"] = {
            "read": [page is not None for page in pages],
            "same": [
                page is not None and torch.equal(base.bytes_of(page), base.page(wp, places, j))
                for j, page in enumerate(pages)
            ],
        }
    return out


def digest(pool: Any, place: Any) -> str:
    data = pool.get_data_page(int(place), flat=True)
    return hashlib.sha256(base.bytes_of(data).numpy().tobytes()).hexdigest()


SCENARIOS: dict[str, Callable[..., Facts]] = {
    "hybrid_write": hybrid_write,
    "hybrid_read": hybrid_read,
    "stops": stops,
    "half": half,
    "mla_mamba": mla_mamba,
    "bad": bad,
    "down": down,
    "parents": parents,
    "stale": stale,
    "lost_write": lost_write,
    "lost_read": lost_read,
}


def main(endpoint: str, *scenarios: str) -> None:
    """Each scenario as NAME or NAME:ARG (its one extra argument)."""
    out: dict[str, Facts] = {}
    kept = base.Kept()
    logging.getLogger("hicached").addHandler(kept)
    for scenario in scenarios:
        name, _, arg = scenario.partition(":")
        started = time.monotonic()
        kept.lines = []
        try:
            out[name] = SCENARIOS[name](endpoint, *([arg] if arg else []))
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        out[name]["seconds"] = round(time.monotonic() - started, 3)
        out[name]["log"] = kept.lines
    answer_and_exit(out, default=repr)


if __name__ == "__main__":
    main(*sys.argv[1:])
