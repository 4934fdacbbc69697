"""vLLM's KV cache groups as hicached keeps them: each group's kind, its page
geometry and its namespace, and on a worker the tensors its pages come from.

A hybrid model's layers fall into several KV cache groups, each of one kind
(full attention, sliding window, chunked local attention, Mamba / GDN state)
and with its own bytes per block. vLLM's OffloadingConnector names each
group's chunks by keys of their own (``block_hash || group index``) and hands
the scheduler's lookups, loads and stores for all groups to one spec. Each
group gets a key-addressed namespace of its own, so its pages are as large as
its blocks (a GDN state page need not be padded to an attention block's size);
the engine's keys are kept as they are. The kinds decide what a hit needs of
each group (hicached/integrations/hybrid.py), as vLLM's scheduler decides
which keys of each group it asks about and loads
(``get_sliding_window_size_in_chunks``).

A model of one group keeps the namespace it always had (the layout
``vllm_<layout>_b<block tokens>``, pages of every KV tensor's whole rows), so
the pages an engine stored before stay found.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from hicached.integrations.common import default_revision, safe_model
from hicached.integrations.hybrid import Kind, Prefix, Window
from hicached.integrations.vllm.settings import Settings, key_scheme
from hicached.wire.namespace import NamespaceSpec

__all__ = ["KVGroup", "Layout", "engine_groups"]


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group: ``index`` is its place in the OffloadingConfig (and in
    every transfer's ``group_sizes``), ``group_id`` vLLM's index, the last four
    bytes of its keys; ``block_bytes`` one worker's bytes of one block."""

    index: int
    group_id: int
    kind: Kind
    block_bytes: int
    spec: NamespaceSpec


def engine_groups(config: OffloadingConfig, settings: Settings) -> list[KVGroup]:
    """The engine's groups, each with its namespace: one chunk of every layer of
    the group on every worker a page, worker r's part at ``r * page_bytes //
    shards``."""
    if config.canonical_layout or config.replicated_layout:
        raise ValueError(
            "hicached's vLLM tier copies vLLM's own block layout: unset canonical_layout"
        )
    if config.worker_kv_bytes_per_block <= 0:
        raise ValueError("vLLM gave no KV bytes per block: is the KV cache allocated?")
    chunk = config.cache.blocks_per_chunk
    kv_config = _kv_cache_config()
    if kv_config is None and len(config.groups) > 1:
        raise ValueError(
            "hicached's vLLM tier needs the KV cache groups' specs of a model with "
            f"{len(config.groups)} groups, which only vLLM's OffloadingConnector hands on: "
            "load HicachedOffloadingSpec through kv_connector OffloadingConnector"
        )
    groups = []
    for index, group in enumerate(config.groups):
        tokens = group.tokens_per_block * chunk
        if kv_config is None:  # one group, built outside vLLM: full attention, as always
            kind: Kind = Prefix()
            block_bytes = config.worker_kv_bytes_per_block
        else:
            vllm_group = kv_config.kv_cache_groups[group.group_id]
            kind = kind_of(vllm_group.kv_cache_spec, tokens)
            block_bytes = (
                config.worker_kv_bytes_per_block
                if len(config.groups) == 1
                else group_block_bytes(vllm_group)
            )
        layout = _layout(config, group.tokens_per_block)
        if len(config.groups) > 1:
            # the group's own name: its index, its kind and (digested) its layers, so
            # no other grouping of the same model's layers ever reads these pages
            made = f"{group.group_id}|{kind.label}|{','.join(group.layer_names)}"
            digest = hashlib.sha256(made.encode()).hexdigest()[:8]
            layout = f"{layout}_g{group.group_id}_{kind.name}_{digest}"
        spec = _spec(config, settings, layout, tokens, block_bytes)
        groups.append(KVGroup(index, group.group_id, kind, block_bytes, spec))
    return groups


def kind_of(spec: Any, tokens_per_chunk: int) -> Kind:
    """The group kind of a vLLM KV cache spec: its window as vLLM's offloading
    scheduler counts it (chunks a hit needs before its end), or the whole
    prefix for full attention."""
    try:  # vLLM 0.33 moved it to the connector's config module
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            get_sliding_window_size_in_chunks,
        )
    except ImportError:  # vLLM 0.32
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
            get_sliding_window_size_in_chunks,
        )
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    names = (
        (SlidingWindowSpec, "sliding"),
        (ChunkedLocalAttentionSpec, "local"),
        (MambaSpec, "mamba"),
        (FullAttentionSpec, "full"),
    )
    name = next((n for cls, n in names if isinstance(spec, cls)), None)
    if name is None:
        raise ValueError(
            f"hicached's vLLM tier cannot offload a KV cache group of {type(spec).__name__}"
        )
    chunks = get_sliding_window_size_in_chunks(spec, tokens_per_chunk)
    return Prefix() if chunks is None else Window(chunks * tokens_per_chunk, name)


def group_block_bytes(group: Any) -> int:
    """One worker's bytes of one block of a group, as vLLM's offloading worker
    copies it: every layer's unpadded page (a Mamba state without the padding
    that makes its page as large as an attention block)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
    total = 0
    for name in group.layer_names:
        layer = per_layer.get(name, spec)
        if isinstance(layer, AttentionSpec):
            total += layer.unpadded_page_size_bytes
        elif isinstance(layer, MambaSpec):
            total += replace(layer, page_size_padded=None).page_size_bytes
        else:
            raise ValueError(f"hicached's vLLM tier cannot copy a {type(layer).__name__} layer")
    return total


def _kv_cache_config() -> Any:
    """The KVCacheConfig of the OffloadingConnector that is building this spec.

    vLLM 0.32 hands an offloading spec its OffloadingConfig only, which names
    each group's layers but not their kind (how much of a prefix a hit needs)
    nor their bytes per block; the connector that creates the spec, on the
    scheduler and on each worker, holds both in its ``kv_cache_config``. None
    when the spec is not built by a connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig

    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), OffloadingConnector):
            found = frame.f_locals.get("kv_cache_config")
            return found if isinstance(found, KVCacheConfig) else None
        frame = frame.f_back
    return None


def _layout(config: OffloadingConfig, block_tokens: int) -> str:
    layout = re.sub(r"[^a-z0-9_]", "_", (config.kv_cache_layout or "default").lower())
    return f"vllm_{layout}_b{block_tokens}"  # the sub-blocks of a chunk differ by block size


def _spec(
    config: OffloadingConfig, settings: Settings, layout: str, tokens: int, block_bytes: int
) -> NamespaceSpec:
    parallel = config.parallel
    return NamespaceSpec(
        model=settings.model or safe_model(config.model.name),
        revision=settings.revision or default_revision(config.model.name),
        kv_dtype=re.sub(r"[^a-z0-9_]", "_", config.model.dtype.lower()),
        layout=layout,
        page_tokens=tokens,
        page_bytes=block_bytes * config.cache.blocks_per_chunk * parallel.world_size,
        tp_size=parallel.tp_size,
        cp_size=parallel.pcp_size * parallel.dcp_size,
        pp_size=parallel.pp_size,
        tenant=settings.tenant,
        key_scheme=key_scheme(settings.hash_algo),
        shards=parallel.world_size,
    )


# -- the worker's side ------------------------------------------------------------------


class Layout:
    """Where one worker's part of each group's pages comes from: per group, the
    tensors whose rows, in order, make one block (vLLM's per-layer references
    into its KV tensors, each cut to the layer's unpadded page), and where the
    worker's part starts in a page.

    A model of one group copies every KV tensor's whole rows, as it always did.
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, groups: list[KVGroup], rank: int, chunk: int
    ) -> None:
        tensors = [t.tensor for t in kv_caches.tensors]
        if len(groups) == 1:
            self.segments: list[list[Any]] = [tensors]
        else:
            self.segments = [
                [_cut(tensors[ref.tensor_idx], ref.page_size_bytes) for ref in refs]
                for refs in kv_caches.group_data_refs
            ]
        self.block_bytes = [sum(_row_bytes(t) for t in segs) for segs in self.segments]
        for group, found in zip(groups, self.block_bytes, strict=True):
            if found != group.block_bytes:
                raise ValueError(
                    f"vLLM's KV tensors hold {found} bytes a block of group {group.group_id}, "
                    f"its KV cache specs {group.block_bytes}: a layout hicached's vLLM tier "
                    "cannot copy"
                )
        self.rank = rank
        self.chunk = chunk

    def size(self, gpu: GPULoadStoreSpec) -> int:
        """The bytes a transfer of these blocks copies on this worker."""
        return sum(n * b for n, b in zip(gpu.group_sizes, self.block_bytes, strict=True))

    def plan(
        self, gpu: GPULoadStoreSpec, pages: list[int]
    ) -> list[tuple[int, list[int], Any, int]]:
        """One transfer's copies, one per group and block place in a chunk: (group,
        pages, the blocks that go with them, where in each slot). ``pages``: the
        pages of each group's handle. A load may start mid-chunk."""
        plan = []
        first = 0
        for g, (count, start) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            blocks = np.asarray(gpu.block_ids[first : first + count], dtype=np.int64)
            first += count
            places = np.arange(len(blocks)) + start % self.chunk
            page_of = places // self.chunk
            last = int(page_of[-1]) + 1 if len(blocks) else 0
            assert last == pages[g], "blocks and pages disagree"
            for sub in range(self.chunk):
                mine = places % self.chunk == sub
                if mine.any():
                    at = (self.rank * self.chunk + sub) * self.block_bytes[g]
                    plan.append((g, page_of[mine].tolist(), blocks[mine], at))
        return plan


def _cut(tensor: Any, nbytes: int) -> Any:
    """The first ``nbytes`` of each row of a (blocks, bytes) tensor: a strided view."""
    per = tensor.element_size()
    assert tensor.dim() == 2 and nbytes % per == 0, "vLLM's block tensors are (blocks, bytes)"
    return tensor if nbytes == _row_bytes(tensor) else tensor[:, : nbytes // per]


def _row_bytes(tensor: Any) -> int:
    return int(tensor.shape[1]) * int(tensor.element_size())
