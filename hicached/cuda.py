"""The CUDA path of the engine side: the pool as pinned memory, copies by DMA.

A client registers its own mapping of the pool with ``cudaHostRegister``, so
CUDA sees the slots as page-locked host memory: a copy between a GPU tensor
and pool slots is one DMA transfer per run of adjacent slots, with no
staging buffer. The mapping is unregistered before it is unmapped. torch is
imported here only; nothing else in the daemon or the client needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hicached.errors import HicachedError


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise HicachedError("the CUDA path needs torch: pip install 'hicached[torch]'") from None
    if not torch.cuda.is_available():
        raise HicachedError("CUDA is not available to this process")
    return torch


def register(array: np.ndarray) -> None:
    """Page-lock ``array``'s memory for CUDA (it must stay mapped until unregister)."""
    rt = _torch().cuda.cudart()
    err = rt.cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    if int(err) != 0:
        raise HicachedError(
            f"cudaHostRegister of the pool ({array.nbytes} bytes) failed with CUDA error "
            f"{int(err)}; is the memlock limit (ulimit -l) high enough?"
        )


def unregister(array: np.ndarray) -> None:
    err = _torch().cuda.cudart().cudaHostUnregister(array.ctypes.data)
    if int(err) != 0:
        raise HicachedError(f"cudaHostUnregister of the pool failed with CUDA error {int(err)}")


def runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(first row, first index, length) of each run of consecutive rows."""
    if not len(rows):
        return []
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(rows)]))
    return [(int(rows[s]), int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def copy(pool_rows: np.ndarray, rows: np.ndarray, gpu: Any, *, to_pool: bool) -> None:
    """Copy between pool rows ``rows`` and the GPU tensor's pages, and wait for it.

    ``gpu`` holds one page per row of ``rows`` in order, contiguous, any dtype
    (viewed as bytes). Copies go on the current stream, one per run of rows.
    """
    torch = _torch()
    page_bytes = pool_rows.shape[1]
    if not gpu.is_contiguous():
        raise ValueError("the GPU tensor must be contiguous")
    pages = gpu.view(torch.uint8).reshape(len(rows), -1) if len(rows) else gpu
    if len(rows) and pages.shape[1] != page_bytes:
        raise ValueError(f"each page must be {page_bytes} bytes, got {pages.shape[1]}")
    host = torch.from_numpy(pool_rows)
    stream = torch.cuda.current_stream(gpu.device)
    for row, at, n in runs(rows):
        if to_pool:
            host[row : row + n].copy_(pages[at : at + n], non_blocking=True)
        else:
            pages[at : at + n].copy_(host[row : row + n], non_blocking=True)
    stream.synchronize()
