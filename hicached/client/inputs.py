"""What a copy takes: numpy arrays and CPU torch tensors as the bytes of
whole pages (``source_bytes``, ``destination_bytes``) or as segments of rows
(``segment_bytes``), checked so that what a copy cannot take is a clear
ValueError, never an error from deep inside numpy or torch; CUDA tensors go
to client/cuda.py.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

# Where a segmented copy's data lies in each slot: from one byte on, or at one
# byte for each segment (pieces.starts_of); None: whole pages.
At = int | Sequence[int] | None


def cuda_tensor(obj: object) -> bool:
    """A torch tensor on a GPU (checked without importing torch)."""
    return type(obj).__module__.startswith("torch") and bool(getattr(obj, "is_cuda", False))


def source_bytes(data: Any, pages: int, page_bytes: int) -> np.ndarray:
    """``data`` (a numpy array or a CPU torch tensor of any dtype) as (pages,
    page_bytes) bytes; a copy if it is not contiguous."""
    if type(data).__module__.startswith("torch"):
        data = _on_host(data, "the data", writable=False)
        data = data.contiguous().view(-1).view(sys.modules["torch"].uint8).numpy()
    array = np.ascontiguousarray(data)
    _plain(array, "the data")
    if array.nbytes != pages * page_bytes:
        raise ValueError(
            f"the data must hold {pages} pages of {page_bytes} bytes, not {array.nbytes} bytes"
        )
    return array.reshape(-1).view(np.uint8).reshape(pages, page_bytes)


def _on_host(tensor: Any, what: str, *, writable: bool) -> Any:
    """A torch tensor that is not a CUDA one, detached, whose bytes are its
    values in host memory, where numpy can view them. ValueError for a meta,
    sparse or other device's tensor (no bytes there) and for a conjugate or
    negated view to copy into (its bytes are not its values); such a view to
    copy from is resolved (a copy)."""
    torch = sys.modules["torch"]
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        raise ValueError(
            f"{what} must be an array, a CPU tensor or a CUDA tensor, not a {tensor.layout} "
            f"tensor on {tensor.device}"
        )
    tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        if writable:
            raise ValueError(f"{what} is a conjugate or negated view: its bytes are not its values")
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor


def _plain(array: np.ndarray, what: str) -> None:
    """ValueError unless ``array`` holds its values as bytes: pages are bytes,
    and an array of Python objects holds pointers (numpy refuses its view as
    bytes with a TypeError)."""
    if array.dtype.hasobject:
        raise ValueError(f"{what} must hold numbers, not Python objects (dtype {array.dtype})")


def segment_bytes(seg: Any, writable: bool) -> np.ndarray:
    """A segment (numpy array or CPU tensor, rows first) as (rows, bytes) sharing
    its memory. Rows may be strided (a slice of a wider array), the bytes of
    one row may not: such a source is copied, such a destination refused."""
    if type(seg).__module__.startswith("torch") and seg.dim() >= 1:
        seg = _on_host(seg, "a segment", writable=writable)
        torch = sys.modules["torch"]
        shape = (seg.shape[0], math.prod(seg.shape[1:]))  # no -1: a segment may have no rows
        try:
            seg = seg.view(shape).view(torch.uint8).numpy()
        except RuntimeError:
            if writable:
                raise ValueError("each row of a segment to read into must be contiguous") from None
            seg = seg.contiguous().view(shape).view(torch.uint8).numpy()
    if not isinstance(seg, np.ndarray) or seg.ndim < 1:
        raise ValueError("segments must be arrays or tensors with one row per page or block")
    _plain(seg, "a segment")
    if writable and not seg.flags.writeable:
        raise ValueError("segments to read into must be writable")
    flat = seg.reshape(seg.shape[0], math.prod(seg.shape[1:]))
    if flat.size and (flat.strides[1] != flat.itemsize or not np.shares_memory(flat, seg)):
        if writable:
            raise ValueError("each row of a segment to read into must be contiguous")
        flat = np.ascontiguousarray(flat)
    return flat.view(np.uint8)


def check_empty(data: Any, rows: Any, at: At, what: str) -> None:
    """A copy through a handle without slots: one array or tensor (not a
    segmented copy) must hold no bytes either, never be taken as written or
    filled."""
    if data is None or segmented(data, rows, at):
        return
    size = data.numel() if type(data).__module__.startswith("torch") else np.asarray(data).size
    if size:
        raise ValueError(f"this handle has no pages: {what} must hold none, not {size} elements")


def segmented(data: Any, rows: Any, at: At) -> bool:
    """A copy that is not of whole pages from one array or tensor: a list of
    segments, engine ``rows`` or a byte offset ``at`` (0 too: worker 0 of a
    wide page) say so. One array or tensor of any other size without them is
    refused, never taken as part of each page (the rest of each slot would
    keep its last owner's bytes)."""
    return isinstance(data, list | tuple) or rows is not None or at is not None


def destination_bytes(out: Any, pages: int, page_bytes: int) -> np.ndarray:
    """``out`` as (pages, page_bytes) bytes sharing its memory, never a copy (a
    copy would leave ``out`` as it was)."""
    if type(out).__module__.startswith("torch"):
        out = _on_host(out, "out", writable=True)
        if not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor")
        out = out.view(-1).view(sys.modules["torch"].uint8).numpy()
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be a writable, C-contiguous array")
    _plain(out, "out")
    if out.nbytes != pages * page_bytes:
        raise ValueError(f"out must hold {pages} pages of {page_bytes} bytes, not {out.nbytes}")
    return out.reshape(-1).view(np.uint8).reshape(pages, page_bytes)
