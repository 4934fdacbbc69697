"""Which prefixes of a request every host pool can restore: SGLang's fold of
per-pool hit policies over what storage holds (``batch_exists_v2``).

The KV pool holds every page of a prefix; each sidecar pool says by its hit
policy which of its pages a prefix needs:

- ``all_pages``: every page of the prefix (a draft model's KV, a sparse
  indexer, DeepSeek V4's compressed KV);
- ``trailing_pages``: only the last ``len(transfer.keys)`` pages (a sliding
  window's KV, one Mamba state): such a pool may restore 5 pages and 3, but
  not 4, so the result is the *set* of restorable prefix lengths, which SGLang
  intersects over ranks, not a length.

A prefix is restorable when the KV pool and every sidecar pool can restore
it; the hit is the longest. A page one pool holds and another lacks restores
nothing that needs it from both. This is the fold of SGLang's own v2
backends (``HiCacheFile``, ``MooncakeStore``), which refuse any other policy;
so does this one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hicache_storage import PoolTransferResult as Result

POLICIES = (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES)


def check_policy(transfer: PoolTransfer) -> None:
    """Refuse a hit policy no v2 backend of SGLang implements."""
    if transfer.hit_policy not in POLICIES:
        policy = getattr(transfer.hit_policy, "value", transfer.hit_policy)
        raise ValueError(
            f"pool {transfer.name}: hit policy {policy} is not one hicached "
            f"(or SGLang's own storage backends) can answer; it answers "
            f"{', '.join(str(p.value) for p in POLICIES)}"
        )


def fold(
    kv_pages: int, transfers: Sequence[PoolTransfer], present: Mapping[str, Sequence[bool]]
) -> Result:
    """The restorable prefixes of a request whose leading ``kv_pages`` KV pages
    are stored, where ``present[name][i]`` says whether pool ``name`` holds
    page ``i`` (for every page below ``kv_pages``). Per pool, the hit pages
    are the longest prefix that pool alone restores (left out when none)."""
    hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        have = present[transfer.name]
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            boundary = next((i for i in range(kv_pages) if not have[i]), kv_pages)
            ok = set(range(1, boundary + 1))
        else:  # trailing pages: the window that ends at the prefix's end
            window = max(1, len(transfer.keys or ()))
            ok = {
                end
                for end in range(1, kv_pages + 1)
                if all(have[i] for i in range(max(0, end - window), end))
            }
            boundary = max(ok, default=0)
        if boundary:
            hits[transfer.name] = boundary
        restorable = [end for end in restorable if end in ok]
    return Result(restorable[-1] if restorable else 0, hits, restorable)
