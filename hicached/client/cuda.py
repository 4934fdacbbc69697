"""The CUDA path of the engine side: the pool as pinned memory, copies by DMA
or by kernels that address it.

A client registers its own mapping of the pool with ``cudaHostRegister``
(portable and mapped), so CUDA sees the slots as page-locked host memory
that kernels can address too. A copy between GPU tensors and pool slots
takes one of these ways, with no staging buffer:

- ``kernel``: one launch over a table of (source, destination, length)
  pieces (client/pieces.py, client/kernel.py): scattered slots, and every
  segmented copy (per-layer tensors, rows by block id, into wide pages);
- ``dma``: long runs of adjacent slots, one DMA transfer per run (copy
  engines);
- the ways from before the table kernel, where it cannot run (no Triton,
  pieces not 16-byte aligned, a write of two pages into one slot):
  ``index``, one gather/scatter kernel over a CUDA view of the pool for
  scattered whole pages; ``layers``, a gather and a scatter per segment;
  ``host``, through host copies when the pool is not registered.

Work goes on the current stream and is not waited for: the caller records
an event after it (client/mapping.py). The mapping is unregistered before it
is unmapped. torch is imported here only; nothing else in the daemon or the
client needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hicached.client import kernel, pieces
from hicached.errors import HicachedError


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise HicachedError("the CUDA path needs torch: pip install 'hicached[torch]'") from None
    if not torch.cuda.is_available():
        raise HicachedError("CUDA is not available to this process")
    return torch


# cudaHostRegisterPortable | cudaHostRegisterMapped: every context, and kernels
# may address it (with unified addressing, at the same pointer).
_REGISTER_FLAGS = 1 | 2
# Below this many bytes per run of adjacent slots on average, one kernel beats
# a DMA call per run (measured on an H100: docs/perf.md).
KERNEL_BELOW_RUN_BYTES = 1 << 20
# Copies by the table kernel where it can run; False: the ways from before it
# (benchmarks compare the two).
TABLE_KERNEL = True


class _Interface:
    """Exposes host memory that CUDA can address as a CUDA array."""

    def __init__(self, array: np.ndarray) -> None:
        self.__cuda_array_interface__ = {
            "shape": (array.nbytes,),
            "typestr": "|u1",
            "data": (array.ctypes.data, False),
            "version": 3,
            "strides": None,
        }


def register(array: np.ndarray) -> Any:
    """Page-lock ``array``'s memory for CUDA (it must stay mapped until unregister);
    returns a CUDA tensor viewing the same bytes, for kernels. The table kernel
    is compiled now, if it can run here."""
    torch = _torch()
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(array.ctypes.data, array.nbytes, _REGISTER_FLAGS)
    if int(err) != 0:
        raise HicachedError(
            f"cudaHostRegister of the pool ({array.nbytes} bytes) failed with CUDA error "
            f"{int(err)}; is the memlock limit (ulimit -l) high enough?"
        )
    mapped = torch.as_tensor(_Interface(array), device="cuda")
    if TABLE_KERNEL:
        kernel.warm(mapped.device)
    return mapped


def unregister(array: np.ndarray) -> None:
    err = _torch().cuda.cudart().cudaHostUnregister(array.ctypes.data)
    if int(err) != 0:
        raise HicachedError(f"cudaHostUnregister of the pool failed with CUDA error {int(err)}")


def mark(device: Any, timing: bool = False) -> Any:
    """An event recorded on ``device``'s current stream, after the work queued so far."""
    torch = _torch()
    event = torch.cuda.Event(enable_timing=timing)
    event.record(torch.cuda.current_stream(device))
    return event


def _cuts(rows: np.ndarray) -> np.ndarray:
    """Indices where a run of consecutive rows ends and the next begins."""
    return np.flatnonzero(np.diff(rows) != 1) + 1


def runs(rows: np.ndarray, cuts: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """(first row, first index, length) of each run of consecutive rows."""
    if not len(rows):
        return []
    cuts = _cuts(rows) if cuts is None else cuts
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(rows)]))
    return [(int(rows[s]), int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def segment(tensor: Any) -> pieces.Segment | None:
    """A tensor (rows first) as a table segment, or None when the bytes of
    one row are not contiguous (the table kernel does not take it). Runs for
    every layer of every copy: a contiguous tensor takes four attribute reads."""
    rows = int(tensor.shape[0]) if tensor.dim() else 1
    if tensor.is_contiguous():
        width = int(tensor.nbytes) // rows if rows else 0
        return pieces.Segment(tensor.data_ptr(), width, width, rows)
    if not rows or not tensor[0].is_contiguous():
        return None
    size = tensor.element_size()
    return pieces.Segment(
        tensor.data_ptr(), int(tensor.stride(0)) * size, int(tensor[0].nbytes), rows
    )


def _by_table(
    pool_rows: np.ndarray,
    rows: np.ndarray,
    segments: list[pieces.Segment | None],
    picks: np.ndarray | None,
    at: int | Sequence[int],
    to_pool: bool,
    mapped: Any,
) -> bool:
    """The copy as one launch of the table kernel; False where it cannot go so.
    ``at``: where the segments start in a page (``pieces.build``)."""
    if not TABLE_KERNEL or mapped is None or kernel.unusable() is not None:
        return False
    if any(seg is None for seg in segments):
        return False
    base = mapped.data_ptr()
    if base != pool_rows.ctypes.data:  # the pool's CUDA view addresses it at its own pointer
        return False
    pool = pieces.Pool(base, pool_rows.shape[1], pool_rows.shape[0])
    segs: list[pieces.Segment] = segments  # type: ignore[assignment]
    if not pieces.aligned_copy(pool, segs, at, base):
        return False
    only = segs[0]
    whole = only.width == only.stride == pool.page_bytes
    if len(segs) == 1 and picks is None and at in (0, [0]) and whole:
        table = pieces.whole_pages(pool, rows, only.address, to_pool=to_pool)  # no sort, no merge
    else:
        table = pieces.build(pool, rows, segs, picks, at, to_pool=to_pool)
    if not pieces.disjoint_copy(rows, segs, picks, to_pool=to_pool) and not pieces.disjoint(table):
        return False  # a write of two pages into one slot: the ways from before keep an order
    return kernel.launch(pieces.split(table, kernel.PIECE_BYTES), mapped)


def copy(
    pool_rows: np.ndarray, rows: np.ndarray, gpu: Any, *, to_pool: bool, mapped: Any = None
) -> str:
    """Copy between pool rows ``rows`` and the GPU tensor's pages, on the current
    stream, without waiting; returns the way it went (the module's docstring).

    ``gpu`` holds one page per row of ``rows`` in order, contiguous, any dtype
    (viewed as bytes). ``mapped`` is the pool's CUDA view from register(), or
    None when the pool is not registered.
    """
    torch = _torch()
    page_bytes = pool_rows.shape[1]
    if not gpu.is_contiguous():
        raise ValueError("the GPU tensor must be contiguous")
    nbytes = gpu.numel() * gpu.element_size()
    if nbytes != len(rows) * page_bytes:
        raise ValueError(
            f"the GPU tensor must hold {len(rows)} pages of {page_bytes} bytes, not {nbytes} bytes"
        )
    pages = gpu.view(torch.uint8).reshape(len(rows), page_bytes) if len(rows) else gpu
    cuts = _cuts(rows)
    n_runs = len(cuts) + 1 if len(rows) else 0
    if mapped is not None and n_runs and len(rows) * page_bytes < KERNEL_BELOW_RUN_BYTES * n_runs:
        whole = [pieces.Segment(pages.data_ptr(), page_bytes, page_bytes, len(rows))]
        if _by_table(pool_rows, rows, whole, None, 0, to_pool, mapped):  # type: ignore[arg-type]
            return "kernel"
        device_rows = mapped[: pool_rows.size].view(pool_rows.shape)
        index = torch.from_numpy(rows).to(gpu.device, non_blocking=True)
        if to_pool:
            device_rows.index_copy_(0, index, pages)
        else:
            torch.index_select(device_rows, 0, index, out=pages)
        return "index"
    host = torch.from_numpy(pool_rows)
    for row, at, n in runs(rows, cuts):
        if to_pool:
            host[row : row + n].copy_(pages[at : at + n], non_blocking=True)
        else:
            pages[at : at + n].copy_(host[row : row + n], non_blocking=True)
    return "dma"


def copy_segments(
    pool_rows: np.ndarray,
    rows: np.ndarray,
    segments: list[Any],
    engine_rows: np.ndarray | None,
    at: int | Sequence[int],
    *,
    to_pool: bool,
    mapped: Any = None,
) -> str:
    """Segmented copies between pool rows ``rows`` and GPU tensors, on the
    current stream, without waiting; returns the way it went.

    Page j's bytes ``at ..`` are the concatenation of row ``engine_rows[j]``
    (or row j, without ``engine_rows``) of each segment, each viewed as bytes;
    with ``at`` one byte per segment, segment i's row lies at ``at[i]``
    (``pieces.starts_of``). A segment's rows may be strided (a slice of each
    block: vLLM's canonical fragments) where each row's bytes are contiguous.
    With the pool registered (``mapped``), one table kernel for all segments
    (or, where it cannot run, a gather or scatter kernel per segment) reads
    or writes the pool over the bus; without, each segment goes through a
    host copy.
    """
    torch = _torch()
    for seg in segments:
        if not (seg.is_contiguous() or (seg.dim() == 2 and seg.stride(1) == 1)):
            raise ValueError("segments must be contiguous tensors, or (rows, bytes) slices")
    widths = [int(seg.nbytes) // max(1, int(seg.shape[0])) for seg in segments]
    starts = pieces.starts_of(at, widths, pool_rows.shape[1])
    if _by_table(
        pool_rows, rows, [segment(s) for s in segments], engine_rows, starts, to_pool, mapped
    ):
        return "kernel"
    device = segments[0].device
    index = torch.from_numpy(rows).to(device, non_blocking=True)
    picks = None if engine_rows is None else torch.from_numpy(engine_rows).to(device)
    device_rows = None if mapped is None else mapped[: pool_rows.size].view(pool_rows.shape)
    for seg, start in zip(segments, starts, strict=True):
        flat = seg.view(torch.uint8).reshape(seg.shape[0], -1)
        end = start + flat.shape[1]
        if to_pool:
            src = flat if picks is None else flat.index_select(0, picks)
            if device_rows is not None:
                device_rows[index, start:end] = src
            else:
                pool_rows[rows, start:end] = src.cpu().numpy()
        else:
            if device_rows is not None:
                got = device_rows[index, start:end]
            else:
                got = torch.from_numpy(pool_rows[rows, start:end]).to(device)
            if picks is None:
                flat.copy_(got)
            else:
                flat.index_copy_(0, picks, got)
    return "layers" if device_rows is not None else "host"
