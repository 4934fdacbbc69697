"""How a KV cache group's pages hold the workers' bytes: vLLM's offload
layouts, one object per engine, chosen once (``page_layout``) from vLLM's
OffloadingConfig. The scheduler takes each group's namespace from it and the
workers they wait for; each worker its copies (copies.py).

- direct (vLLM's default): a page holds one chunk of every worker's blocks,
  worker r's part at ``r * page_bytes // world``; every worker writes its
  part. The namespace has the TP, CP and PP sizes and ``shards`` = world.
- replicated (``replicated_layout``, which vLLM sets for MLA at TP > 1, TP
  alone, on one node): the workers' bytes are identical, so a page holds
  one copy; rank 0 writes it (vLLM's connector submits stores to no other),
  every rank reads it. The namespace is ``replicated`` (``tp=replicated``).
- canonical (``canonical_layout`` in ``kv_connector_extra_config``): a page
  holds vLLM's canonical page of each layer, all heads and no parallelism;
  each worker writes its heads, and bytes several workers hold alike one of
  them a page, in turn. The namespace has no parallel coordinates.

The layout is part of every namespace's digest (a ``replicated`` namespace
leaves the TP coordinates out and says so; a canonical one names vLLM's
canonical format in its layout), so pages of two layouts never share a key.
Replicated pages serve every TP size of the model, as vLLM's own file tier
shares them; canonical pages serve every TP size, which vLLM allows only
where it finds the canonical bytes parallelism-agnostic, and hicached takes
``canonical_layout`` only there (``Canonical.check`` says what it refuses).
"""

from __future__ import annotations

import re
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig, OffloadingParallelConfig

__all__ = ["CANONICAL", "DIRECT", "REPLICATED", "PageLayout", "canonical_pages", "page_layout"]


class PageLayout:
    """One offload layout: what a page of a group holds, whose bytes, and the
    namespace fields that keep it apart from every other layout."""

    name = ""

    def page_bytes(self, block: int, canonical: tuple[int, ...], chunk: int, world: int) -> int:
        """A page of a group whose worker holds ``block`` bytes of a block
        (``canonical``: each layer's canonical page, canonical layout only)."""
        raise NotImplementedError

    def parallel(self, parallel: OffloadingParallelConfig) -> dict[str, Any]:
        """The namespace's parallel fields (``NamespaceSpec``)."""
        raise NotImplementedError

    def layout(self, config: OffloadingConfig) -> str:
        """The namespace's layout, before the block size."""
        kv = re.sub(r"[^a-z0-9_]", "_", (config.kv_cache_layout or "default").lower())
        return f"vllm_{kv}"

    def writers(self, world: int) -> frozenset[int]:
        """The workers whose word a store waits for: those that write its pages."""
        return frozenset(range(world))


class Direct(PageLayout):
    """vLLM's default: each worker's blocks side by side in a wide page."""

    name = "direct"

    def page_bytes(self, block: int, canonical: tuple[int, ...], chunk: int, world: int) -> int:
        return block * chunk * world

    def parallel(self, parallel: OffloadingParallelConfig) -> dict[str, Any]:
        return dict(
            tp_size=parallel.tp_size,
            cp_size=parallel.pcp_size * parallel.dcp_size,
            pp_size=parallel.pp_size,
            shards=parallel.world_size,
        )


class Replicated(PageLayout):
    """One copy of KV every worker holds alike (MLA's latent at TP > 1): rank 0
    writes it, every rank reads it. The namespace is ``replicated``, whose
    digest says ``tp=replicated`` instead of a rank: every TP size of the
    model finds these pages (vLLM's file tier shares them so too), and no
    per-rank namespace ever does."""

    name = "replicated"

    def page_bytes(self, block: int, canonical: tuple[int, ...], chunk: int, world: int) -> int:
        return block * chunk

    def parallel(self, parallel: OffloadingParallelConfig) -> dict[str, Any]:
        # vLLM sets replicated_layout for TP alone (no PP, no CP, world == TP)
        return dict(tp_size=parallel.tp_size, replicated=True)

    def writers(self, world: int) -> frozenset[int]:
        return frozenset({0})


class Canonical(PageLayout):
    """vLLM's canonical pages (``canonical_mapping.py``): a layer's page as it
    would be without parallelism, each worker's bytes at the places vLLM's
    mapping gives them. A page of a group holds, for each layer in the
    group's order, ``chunk`` canonical pages one after another (as vLLM's own
    CPU tier lays a chunk out, tensor by tensor). The bytes are the same at
    any TP size, so the namespace has no parallel coordinates, and its layout
    names vLLM's canonical format (``canonical_format_id``: its version and
    the KV layout family), which no other layout's name matches."""

    name = "canonical"

    def page_bytes(self, block: int, canonical: tuple[int, ...], chunk: int, world: int) -> int:
        return sum(canonical) * chunk

    def parallel(self, parallel: OffloadingParallelConfig) -> dict[str, Any]:
        return {}  # tp=0/1, cp=0/1, pp=0/1, one shard: the same for every TP size

    def layout(self, config: OffloadingConfig) -> str:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )

        if config.kv_cache_layout is None:
            raise ValueError(
                "canonical_layout: vLLM resolved no KV cache layout, which names the "
                "canonical format: unset canonical_layout"
            )
        family = canonical_format_id(config.kv_cache_layout)  # "v1-nhd": version, family
        return "vllm_canon_" + re.sub(r"[^a-z0-9_]", "_", family)

    @staticmethod
    def check(config: OffloadingConfig, kv_config: Any, vllm_config: Any) -> None:
        """Raise ValueError, saying why, where hicached does not take
        ``canonical_layout``: outside a connector (no specs), under PP or CP
        (vLLM's canonical pages are then bound to the topology, or not derived
        at all: the direct layout serves those engines), for a layer that has
        no canonical page in vLLM (it would keep an opaque per-rank page),
        and where vLLM does not find the canonical bytes parallelism-agnostic."""
        if kv_config is None or vllm_config is None:
            raise ValueError(
                "canonical_layout needs the KV cache groups' specs, which only vLLM's "
                "OffloadingConnector hands on: load HicachedOffloadingSpec through it"
            )
        p = config.parallel
        if p.pp_size > 1 or p.pcp_size > 1 or p.dcp_size > 1 or p.world_size != p.tp_size:
            raise ValueError(
                "hicached takes canonical_layout under tensor parallelism alone: with "
                f"PP {p.pp_size}, PCP {p.pcp_size}, DCP {p.dcp_size} (world {p.world_size}, "
                f"TP {p.tp_size}) vLLM's canonical pages are bound to the topology or not "
                "derived at all; unset canonical_layout (the default layout serves it)"
            )
        total = vllm_config.model_config.get_total_num_kv_heads()
        for group in config.groups:
            specs = layer_specs(kv_config.kv_cache_groups[group.group_id])
            for name, spec in specs:
                found = _canonical_page(spec, p.tp_size, total)
                if isinstance(found, str):
                    raise ValueError(
                        f"canonical_layout: layer {name} has no canonical page in vLLM "
                        f"({found}); vLLM would keep it as an opaque page of each rank, "
                        "which hicached does not take: unset canonical_layout"
                    )
        if not p.is_parallelism_agnostic:
            raise ValueError(
                "canonical_layout: vLLM does not find this model's canonical pages "
                "parallelism-agnostic (OffloadingParallelConfig.is_parallelism_agnostic), "
                "and hicached takes canonical pages only where they serve every TP size: "
                "unset canonical_layout"
            )


DIRECT = Direct()
REPLICATED = Replicated()
CANONICAL = Canonical()


def page_layout(config: OffloadingConfig, kv_config: Any, vllm_config: Any) -> PageLayout:
    """The engine's layout, as vLLM's OffloadingConfig asks for it (canonical
    before replicated: vLLM sets ``replicated_layout`` under ``canonical_layout``
    for MLA too, where its canonical mapping already writes one copy)."""
    if config.canonical_layout:
        Canonical.check(config, kv_config, vllm_config)
        return CANONICAL
    if config.replicated_layout:
        return REPLICATED
    return DIRECT


def layer_specs(group: Any) -> list[tuple[str, Any]]:
    """(layer name, KV cache spec) of each layer of a vLLM KV cache group, in order."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
    return [(name, per_layer.get(name, spec)) for name in group.layer_names]


def canonical_pages(group: Any, tp: int, total_heads: int) -> tuple[int, ...]:
    """The bytes of each layer's canonical page (of one block) of a vLLM KV cache
    group (``Canonical.check`` passed)."""
    pages = [_canonical_page(spec, tp, total_heads) for _, spec in layer_specs(group)]
    assert all(isinstance(p, int) for p in pages), "a layer without a canonical page"
    return tuple(int(p) for p in pages)


def _canonical_page(spec: Any, tp: int, total_heads: int) -> int | str:
    """The bytes of vLLM's canonical page of one block of a layer (TP alone), or
    why vLLM certifies none for it: what ``_layer_mapping`` in vLLM's
    ``canonical_mapping.py`` decides from the spec (the worker checks vLLM's
    own mappings against these figures: copies.py)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    kind = type(spec).__name__
    if not isinstance(spec, AttentionSpec):
        return f"a {kind} layer: vLLM derives canonical pages for attention layers only"
    if spec.kv_quant_mode.is_per_token_head:
        return f"a {kind} layer quantized per token and head"
    page = int(spec.real_page_size_bytes)
    if isinstance(spec, MLAAttentionSpec):
        if spec.tokens_per_state != 1 or page % spec.block_size:
            return f"a {kind} layer whose state is not one row a token"
        return page  # the latent, the same on every TP rank
    heads = int(spec.num_kv_heads)
    if (total_heads % tp and tp % total_heads) or heads != max(1, total_heads // tp):
        return f"{total_heads} KV heads, {heads} a rank, do not split evenly over TP {tp}"
    return page * min(tp, total_heads)  # every head once (heads TP replicates, once)
