"""One worker's copies between vLLM's KV tensors and pool slots, in the
engine's offload layout (layouts.py): which bytes of which block go where in
which page, for a store and for a load. One object per worker, made once by
``worker_copies`` for the engine's layout.

vLLM hands a worker its KV as ``CanonicalKVCaches``: block-first tensors (one
row of bytes a block) and, per KV cache group, a reference per layer into
them, each with the layer's unpadded page size and, where vLLM derived one,
the layer's canonical mapping (``CanonicalPageMapping``: the strided runs of
bytes between this worker's page and the canonical page, and which of the
workers holding the same bytes writes them).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec

from hicached.integrations.vllm.groups import KVGroup
from hicached.integrations.vllm.layouts import CANONICAL, REPLICATED

__all__ = ["Copies", "Copy", "worker_copies"]


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy of a transfer: pages ``pages`` (their places in group
    ``group``'s handle), the engine's block of each, the tensors (or slices of
    their rows) that make one block, and where those lie in a page: from byte
    ``at`` on one after another, or (a list) each at a byte of its own."""

    group: int
    pages: list[int]
    blocks: np.ndarray
    segments: list[Any]
    at: int | list[int]


class Copies:
    """The copies one worker makes for a transfer, in one layout.

    ``says``: this worker tells the scheduler which slots of a store it wrote
    (a worker that writes no store says nothing, and the scheduler waits for
    no word of it: layouts.PageLayout.writers).
    """

    says = True

    def __init__(self, rank: int, chunk: int, block_bytes: list[int]) -> None:
        self.rank = rank
        self.chunk = chunk
        self.block_bytes = block_bytes  # this worker's bytes of one block, per group

    def size(self, gpu: GPULoadStoreSpec) -> int:
        """The bytes of this worker's blocks a transfer of these blocks moves."""
        return sum(n * b for n, b in zip(gpu.group_sizes, self.block_bytes, strict=True))

    def plan(self, gpu: GPULoadStoreSpec, slots: list[np.ndarray], store: bool) -> list[Copy]:
        """One transfer's copies. ``slots``: per group, the pool slot of each page
        of its handle (the same on every worker: whose turn it is to write a
        page several workers hold). A load may start mid-chunk."""
        plan = []
        for g, sub, pages, blocks in self._places(gpu, [len(s) for s in slots]):
            plan += self._copies(g, sub, pages, blocks, slots[g], store)
        return plan

    def _places(
        self, gpu: GPULoadStoreSpec, pages: list[int]
    ) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """(group, place of a block in its chunk, the pages, their blocks)."""
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
                    yield g, sub, page_of[mine], blocks[mine]

    def _copies(
        self,
        g: int,
        sub: int,
        pages: np.ndarray,
        blocks: np.ndarray,
        slots: np.ndarray,
        store: bool,
    ) -> list[Copy]:
        raise NotImplementedError


class DirectCopies(Copies):
    """vLLM's default layout: each block's bytes, every layer's in order, at this
    worker's part of the wide page (``(rank * chunk + sub) * block_bytes``).
    A model of one group copies every KV tensor's whole rows, as it always
    did; a hybrid model's group its layers' references, each cut to the
    layer's unpadded page."""

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
        block_bytes = [sum(_row_bytes(t) for t in segs) for segs in self.segments]
        for group, found in zip(groups, block_bytes, strict=True):
            if found != group.block_bytes:
                raise ValueError(
                    f"vLLM's KV tensors hold {found} bytes a block of group {group.group_id}, "
                    f"its KV cache specs {group.block_bytes}: a layout hicached's vLLM tier "
                    "cannot copy"
                )
        super().__init__(rank, chunk, block_bytes)

    def _at(self, g: int, sub: int) -> int:
        return (self.rank * self.chunk + sub) * self.block_bytes[g]

    def _copies(
        self,
        g: int,
        sub: int,
        pages: np.ndarray,
        blocks: np.ndarray,
        slots: np.ndarray,
        store: bool,
    ) -> list[Copy]:
        return [Copy(g, pages.tolist(), blocks, self.segments[g], self._at(g, sub))]


class ReplicatedCopies(DirectCopies):
    """One copy of the bytes every worker holds alike: at the start of the page
    (``sub * block_bytes``), written by rank 0 and read by every rank. vLLM's
    connector submits stores to rank 0 alone under ``replicated_layout``; a
    store another rank is handed all the same writes nothing and says
    nothing, so a page never waits for, or takes, a second writer."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, groups: list[KVGroup], rank: int, chunk: int
    ) -> None:
        super().__init__(kv_caches, groups, rank, chunk)
        self.says = rank == 0

    def _at(self, g: int, sub: int) -> int:
        return sub * self.block_bytes[g]

    def _copies(
        self,
        g: int,
        sub: int,
        pages: np.ndarray,
        blocks: np.ndarray,
        slots: np.ndarray,
        store: bool,
    ) -> list[Copy]:
        if store and not self.says:
            return []
        return super()._copies(g, sub, pages, blocks, slots, store)


@dataclass(frozen=True, slots=True)
class _Layer:
    """One layer's bytes as vLLM's canonical mapping places them: slices of its
    tensor's rows (``segments``), each at ``start + sub * page`` of a page for
    the block at place ``sub`` of its chunk; ``writers`` workers hold these
    bytes, and this one writes the pages whose turn ``writer`` is."""

    segments: list[Any]
    starts: np.ndarray  # where each segment lies for a chunk's first block
    page: int  # one canonical page of the layer
    writers: int
    writer: int


class CanonicalCopies(Copies):
    """vLLM's canonical pages: each layer's fragments (vLLM's mapping, unrolled as
    its CPU worker unrolls it) at their places in the layer's canonical page;
    a page of a group holds, layer by layer, ``chunk`` canonical pages. A load
    reads every fragment of this worker; a store writes them, but bytes that
    ``writers`` workers hold alike (MLA's latent, KV heads TP replicates) are
    written by one of them a page, in turn: the worker whose ``writer`` index
    is the page's ``(slot * chunk + sub) % writers``, as vLLM's CPU worker
    turns by its canonical page id.

    vLLM derives the mappings on the worker, from its KV tensors; the
    scheduler sized the pages from the KV cache specs (layouts.py). A layer
    without a mapping, or whose mapping is not the portable canonical page
    the namespace was made for (vLLM fell back to an opaque page of its
    rank: a physical KV layout it could not certify), is refused here, at
    the worker's start, never stored under the canonical name. So is a worker
    whose attention keeps K and V packed per head (a 4-D cache, as HPC
    attention's): vLLM names its canonical pages as it names split K/V ones
    (``v1-nhd``), but their bytes are arranged otherwise, so two engines of
    the two kinds would share a namespace and load each other's bytes as
    their own. hicached's canonical pages are the split arrangement's.
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, groups: list[KVGroup], rank: int, chunk: int
    ) -> None:
        self.layers: list[list[_Layer]] = []
        block_bytes = []
        for group, refs in zip(groups, kv_caches.group_data_refs, strict=True):
            if len(refs) != len(group.canonical):
                raise ValueError(
                    f"canonical_layout: vLLM gave {len(refs)} KV references for group "
                    f"{group.group_id}, whose specs name {len(group.canonical)} layers "
                    "(packed or cross-layer KV layouts have no canonical pages)"
                )
            area, layers = 0, []
            for i, (ref, page) in enumerate(zip(refs, group.canonical, strict=True)):
                tensor = kv_caches.tensors[ref.tensor_idx].tensor
                layers.append(_layer(ref, page, area, tensor, f"{i} of group {group.group_id}"))
                area += page * chunk
            if area != group.spec.page_bytes:
                raise ValueError(
                    f"canonical_layout: group {group.group_id}'s canonical pages come to "
                    f"{area} bytes a chunk, its namespace's pages to {group.spec.page_bytes}"
                )
            self.layers.append(layers)
            block_bytes.append(sum(ref.page_size_bytes for ref in refs))
        # certified by vLLM, all of them: but not alike where K and V are packed
        packed = sorted(name for name, shape in _kv_shapes().items() if len(shape) == 4)
        if packed:
            raise ValueError(
                f"canonical_layout: layers {packed[:3]} keep K and V packed per head (a "
                "4-D KV cache), whose canonical pages vLLM names as it names split K/V "
                "ones while their bytes are arranged otherwise: engines of the two kinds "
                "would load each other's pages as their own. hicached takes canonical "
                "pages of split K/V caches only: unset canonical_layout, or use an "
                "attention backend that keeps K and V apart"
            )
        super().__init__(rank, chunk, block_bytes)

    def _copies(
        self,
        g: int,
        sub: int,
        pages: np.ndarray,
        blocks: np.ndarray,
        slots: np.ndarray,
        store: bool,
    ) -> list[Copy]:
        if not store:
            return [_join(g, pages, blocks, self.layers[g], sub)]
        turns: dict[tuple[int, int], list[_Layer]] = defaultdict(list)
        for layer in self.layers[g]:
            turns[(layer.writers, layer.writer)].append(layer)
        plan = []
        page_ids = slots[pages] * self.chunk + sub  # the same on every worker
        for (writers, writer), layers in turns.items():
            mine = page_ids % writers == writer
            if mine.any():
                plan.append(_join(g, pages[mine], blocks[mine], layers, sub))
        return plan


def _kv_shapes() -> dict[str, tuple[int, ...]]:
    """The shapes of the KV tensors vLLM's offloading worker is registering
    (``register_kv_caches(kv_caches)``, a caller of this spec's ``get_worker``:
    the canonical caches it hands on have lost them); {} when not called so."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        found = frame.f_locals.get("kv_caches")
        if frame.f_code.co_name == "register_kv_caches" and isinstance(found, dict):
            return {
                str(name): tuple(tensor.shape)
                for name, tensor in found.items()
                if hasattr(tensor, "shape")
            }
        frame = frame.f_back
    return {}


def _layer(ref: Any, page: int, area: int, tensor: Any, name: str) -> _Layer:
    """One layer's fragments, from vLLM's mapping of it (checked against the
    canonical page the scheduler sized)."""
    mapping = ref.mapping
    if mapping is None:
        raise ValueError(
            f"canonical_layout: vLLM could not certify layer {name} for canonical offload "
            "(the offload workers must be exactly the TP group; packed or cross-layer KV "
            "layouts have no canonical pages): unset canonical_layout"
        )
    if mapping.canonical_page_size_bytes != page or not mapping.parallelism_agnostic:
        raise ValueError(
            f"canonical_layout: vLLM mapped layer {name} to a canonical page of "
            f"{mapping.canonical_page_size_bytes} bytes (parallelism-agnostic: "
            f"{mapping.parallelism_agnostic}), not the portable page of {page} bytes its "
            "KV cache spec gives: vLLM could not certify this worker's physical KV layout "
            "and fell back to an opaque page of its rank; unset canonical_layout"
        )
    segments, starts = [], []
    for run in mapping.runs:
        for i in range(run.num_fragments):
            local = run.local_offset + i * run.local_stride
            segments.append(_slice(tensor, local, run.fragment_size))
            starts.append(area + run.canonical_offset + i * run.canonical_stride)
    starts_at = np.asarray(starts, dtype=np.int64)
    return _Layer(segments, starts_at, page, mapping.num_writers, mapping.writer_index)


def _join(g: int, pages: np.ndarray, blocks: np.ndarray, layers: list[_Layer], sub: int) -> Copy:
    segments = [seg for layer in layers for seg in layer.segments]
    at = np.concatenate([layer.starts + sub * layer.page for layer in layers]).tolist()
    return Copy(g, pages.tolist(), blocks, segments, at)


def worker_copies(
    kv_caches: CanonicalKVCaches, groups: list[KVGroup], rank: int, chunk: int
) -> Copies:
    """The copies of the engine's layout (every group has the engine's)."""
    layout = groups[0].layout
    if layout is CANONICAL:
        return CanonicalCopies(kv_caches, groups, rank, chunk)
    if layout is REPLICATED:
        return ReplicatedCopies(kv_caches, groups, rank, chunk)
    return DirectCopies(kv_caches, groups, rank, chunk)


def _slice(tensor: Any, start: int, nbytes: int) -> Any:
    """Bytes ``start .. start + nbytes`` of each row of a (blocks, bytes) tensor:
    a strided view."""
    per = tensor.element_size()
    assert tensor.dim() == 2 and start % per == 0 and nbytes % per == 0, (
        "vLLM's block tensors are (blocks, bytes)"
    )
    return tensor[:, start // per : (start + nbytes) // per]


def _cut(tensor: Any, nbytes: int) -> Any:
    """The first ``nbytes`` of each row of a (blocks, bytes) tensor: a strided view."""
    return tensor if nbytes == _row_bytes(tensor) else _slice(tensor, 0, nbytes)


def _row_bytes(tensor: Any) -> int:
    return int(tensor.shape[1]) * int(tensor.element_size())
