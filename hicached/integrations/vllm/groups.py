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
the pages an engine stored before stay found. What a page holds of each
worker (vLLM's direct, replicated or canonical offload layout) is the
engine's ``PageLayout`` (layouts.py); the copies each worker makes, copies.py.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig

from hicached.integrations.common import default_revision, safe_model
from hicached.integrations.hybrid import Kind, Prefix, Window
from hicached.integrations.vllm.layouts import (
    CANONICAL,
    DIRECT,
    PageLayout,
    canonical_pages,
    layer_specs,
    page_layout,
)
from hicached.integrations.vllm.settings import Settings, key_scheme
from hicached.wire.namespace import EventMeta, NamespaceSpec

__all__ = ["KVGroup", "engine_groups"]


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group: ``index`` is its place in the OffloadingConfig (and in
    every transfer's ``group_sizes``), ``group_id`` vLLM's index, the last four
    bytes of its keys; ``block_bytes`` one worker's bytes of one block;
    ``layout`` the engine's offload layout; ``canonical`` (canonical layout
    only) the bytes of each layer's canonical page of one block; ``events``
    what the namespace's KV events say of the group (vLLM's spec kind and
    sliding window; None for a group built outside vLLM's connector)."""

    index: int
    group_id: int
    kind: Kind
    block_bytes: int
    spec: NamespaceSpec
    layout: PageLayout = DIRECT
    canonical: tuple[int, ...] = ()
    events: EventMeta | None = None


def engine_groups(config: OffloadingConfig, settings: Settings) -> list[KVGroup]:
    """The engine's groups, each with its namespace: one chunk of every layer of
    the group a page, as the engine's offload layout holds it (layouts.py;
    by default every worker's part, worker r's at ``r * page_bytes //
    shards``). Raises ValueError, saying why, for a layout or a group kind
    hicached does not take."""
    if config.worker_kv_bytes_per_block <= 0:
        raise ValueError("vLLM gave no KV bytes per block: is the KV cache allocated?")
    chunk = config.cache.blocks_per_chunk
    kv_config, vllm_config = _connector_configs()
    layout = page_layout(config, kv_config, vllm_config)
    if kv_config is None and len(config.groups) > 1:
        raise ValueError(
            "hicached's vLLM tier needs the KV cache groups' specs of a model with "
            f"{len(config.groups)} groups, which only vLLM's OffloadingConnector hands on: "
            "load HicachedOffloadingSpec through kv_connector OffloadingConnector"
        )
    groups = []
    for index, group in enumerate(config.groups):
        tokens = group.tokens_per_block * chunk
        events: EventMeta | None = None
        if kv_config is None:  # one group, built outside vLLM: full attention, as always
            kind: Kind = Prefix()
            block_bytes = config.worker_kv_bytes_per_block
        else:
            vllm_group = kv_config.kv_cache_groups[group.group_id]
            kind = kind_of(
                vllm_group.kv_cache_spec, tokens, getattr(vllm_group, "is_eagle_group", False)
            )
            events = event_meta(vllm_group.kv_cache_spec)
            block_bytes = (
                config.worker_kv_bytes_per_block
                if len(config.groups) == 1
                else group_block_bytes(vllm_group)
            )
        canonical: tuple[int, ...] = ()
        if layout is CANONICAL:
            total_heads = vllm_config.model_config.get_total_num_kv_heads()
            canonical = canonical_pages(vllm_group, config.parallel.tp_size, total_heads)
        name = f"{layout.layout(config)}_b{group.tokens_per_block}"  # sub-blocks differ by size
        if len(config.groups) > 1:
            # the group's own name: its index, its kind and (digested) its layers, so
            # no other grouping of the same model's layers ever reads these pages
            made = f"{group.group_id}|{kind.label}|{','.join(group.layer_names)}"
            digest = hashlib.sha256(made.encode()).hexdigest()[:8]
            name = f"{name}_g{group.group_id}_{kind.name}_{digest}"
        world = config.parallel.world_size
        page_bytes = layout.page_bytes(block_bytes, canonical, chunk, world)
        spec = _spec(config, settings, layout, name, tokens, page_bytes)
        groups.append(
            KVGroup(index, group.group_id, kind, block_bytes, spec, layout, canonical, events)
        )
    return groups


def event_meta(spec: Any) -> EventMeta:
    """What the KV events of a group of vLLM KV cache spec ``spec`` say of it, as
    vLLM's own events say it (``kv_cache_spec_kind``,
    ``kv_cache_spec_sliding_window``: vLLM's KVCacheManager.take_events)."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return EventMeta(
        kind=get_kv_cache_spec_kind(spec).value,
        sliding_window=get_kv_cache_spec_sliding_window(spec),
    )


def kind_of(spec: Any, tokens_per_chunk: int, eagle: bool = False) -> Kind:
    """The group kind of a vLLM KV cache spec: its window as vLLM's offloading
    scheduler counts it (chunks a hit needs before its end), or the whole
    prefix for full attention. ``eagle``: the group holds an EAGLE/MTP
    drafter's layers (vLLM's ``is_eagle_group``)."""
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
    if chunks is None:
        return Prefix()
    # a hit vLLM ends inside its last chunk (a token budget; a whole prompt's hit,
    # one token short, with extra retained tokens) needs a sliding window one
    # chunk longer (vLLM's load_window_size_in_chunks: never more, as the right
    # padding is under a chunk); a drafter's group is asked for one chunk past
    # the hit's end, to be dropped, and a window one chunk longer to its end:
    # read them where they are there
    lead = tokens_per_chunk * ((name == "sliding") + eagle)
    return Window(chunks * tokens_per_chunk, name, lead)


def group_block_bytes(group: Any) -> int:
    """One worker's bytes of one block of a group, as vLLM's offloading worker
    copies it: every layer's unpadded page (a Mamba state without the padding
    that makes its page as large as an attention block)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    total = 0
    for _, layer in layer_specs(group):
        if isinstance(layer, AttentionSpec):
            total += layer.unpadded_page_size_bytes
        elif isinstance(layer, MambaSpec):
            total += replace(layer, page_size_padded=None).page_size_bytes
        else:
            raise ValueError(f"hicached's vLLM tier cannot copy a {type(layer).__name__} layer")
    return total


def _connector_configs() -> tuple[Any, Any]:
    """The KVCacheConfig and VllmConfig of the OffloadingConnector that is
    building this spec.

    vLLM 0.32 hands an offloading spec its OffloadingConfig only, which names
    each group's layers but not their kind (how much of a prefix a hit needs)
    nor their bytes per block, nor the model's KV heads (a canonical page's
    size); the connector that creates the spec, on the scheduler and on each
    worker, holds them in the ``kv_cache_config`` and ``vllm_config`` of its
    ``__init__``. (None, None) when the spec is not built by a connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig

    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), OffloadingConnector):
            found = frame.f_locals.get("kv_cache_config")
            if not isinstance(found, KVCacheConfig):
                return None, None
            return found, frame.f_locals.get("vllm_config")
        frame = frame.f_back
    return None, None


def _spec(
    config: OffloadingConfig,
    settings: Settings,
    layout: PageLayout,
    name: str,
    tokens: int,
    page_bytes: int,
) -> NamespaceSpec:
    return NamespaceSpec(
        model=settings.model or safe_model(config.model.name),
        revision=settings.revision or default_revision(config.model.name),
        kv_dtype=re.sub(r"[^a-z0-9_]", "_", config.model.dtype.lower()),
        layout=name,
        page_tokens=tokens,
        page_bytes=page_bytes,
        tenant=settings.tenant,
        key_scheme=key_scheme(settings.hash_algo),
        **layout.parallel(config.parallel),
    )
