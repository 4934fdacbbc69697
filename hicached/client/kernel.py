"""One Triton kernel that copies every piece of a table (client/pieces.py) in
one launch: program p copies piece p with 16-byte loads and stores.

A copy between per-layer GPU tensors and wide pages of the mapped pool is a
few thousand pieces of 16-64 KiB; a gather and a scatter per layer, or a DMA
call per piece, spend their time launching. One launch over a table moves
them all, reading or writing the pinned pool over the bus from the SMs, with
no temporary. Triton ships with every CUDA build of torch; a compiled
extension would make installs harder.

The table goes to the kernel as offsets from one base pointer, in 16-byte
units, so the compiler can prove every access 16-byte aligned and use wide
loads (a pointer loaded from memory carries no alignment it could prove).
Pieces that are not 16-byte aligned, or hosts where the kernel cannot run
(no Triton, ROCm, a compile that fails), take the CUDA path's other ways:
``launch`` answers False, once said in the log.

``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors (the tests do).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import numpy as np

from hicached.client import pieces

log = logging.getLogger(__name__)

_MISSING = ""  # why Triton is not here, if it is not
try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # the CUDA path copies the other ways
    triton, _MISSING = None, "Triton is not installed"
except Exception as exc:  # a broken install must not break the CUDA path
    triton, _MISSING = None, f"Triton did not import: {type(exc).__name__}: {exc}"

# A program copies one piece of at most this many bytes: longer runs are split
# so that every SM gets a share of them.
PIECE_BYTES = 64 << 10
# int64 words a program moves per step (8 KiB), and its warps: 4 x 32 threads,
# each with four 16-byte loads in flight per step.
_BLOCK = 1024
_WARPS = 4


def _define() -> Any:
    """The kernel, jitted (a Triton too old or too new for it fails here, at
    import, and the CUDA path copies the other ways)."""

    @triton.jit(do_not_specialize=["count"])
    def copy_pieces(table, count, base, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        # table: (3, count) int64, sources, destinations and lengths in 16-byte
        # units, the addresses as offsets from base (an int64 pointer, 16-byte
        # aligned). Units times 2 words: the compiler sees even word offsets.
        piece = tl.program_id(0).to(tl.int64)
        src = base + tl.load(table + piece) * 2
        dst = base + tl.load(table + count + piece) * 2
        words = tl.load(table + 2 * count + piece) * 2
        lanes = tl.arange(0, BLOCK)
        for start in range(0, words, BLOCK):
            at = start + lanes
            keep = at < words
            tl.store(dst + at, tl.load(src + at, mask=keep), mask=keep)

    return copy_pieces


_copy_pieces: Any = None
if triton is not None:
    try:
        _copy_pieces = _define()
    except Exception as exc:
        triton, _MISSING = None, f"the kernel does not build here: {type(exc).__name__}: {exc}"


class _State:
    """Whether the kernel may run here: unknown until first asked, then fixed."""

    reason: str | None = None  # why not; None while it may


def unusable() -> str | None:
    """Why the kernel cannot run in this process, or None when it may."""
    if _State.reason is None:
        if triton is None:
            _give_up(_MISSING)
        elif os.environ.get("TRITON_INTERPRET") != "1":
            torch = sys.modules.get("torch")
            if torch is not None and getattr(torch.version, "hip", None):
                _give_up("host memory mapped for ROCm is not addressed this way")
    return _State.reason


def _give_up(reason: str) -> None:
    """Say once why copies take the other ways from now on."""
    if _State.reason is None:
        _State.reason = reason
        log.warning(
            "hicached: copies by the table kernel are off (%s); using the other ways", reason
        )


def reset() -> None:
    """Forget a decision (tests: another try after a failure was injected)."""
    _State.reason = None


def qualifies(table: np.ndarray, base: int) -> bool:
    """The kernel can copy ``table`` with ``base`` as its base address (checked
    on the table; the CUDA path checks the copy's geometry instead, cheaper)."""
    return unusable() is None and pieces.aligned(table, base) and pieces.disjoint(table)


def launch(table: np.ndarray, base: Any) -> bool:
    """Copy every piece of ``table`` with one launch on the current stream (it
    does not wait); False, with nothing launched, where the kernel cannot run
    here (then it never tries again in this process).

    ``base`` is a tensor the addresses are taken relative to (the pool's CUDA
    view; any 16-byte aligned tensor on the device works, since kernels
    address the whole unified space); ``qualifies`` must hold for the table.
    """
    count = table.shape[1]
    if unusable() is not None or not count:
        return unusable() is None
    torch = sys.modules["torch"]
    origin = base.data_ptr()
    units = np.empty((3, count), dtype=np.int64)  # C order, whatever the table's
    np.subtract(table[: pieces.LEN], origin, out=units[: pieces.LEN])
    units[pieces.LEN] = table[pieces.LEN]
    np.right_shift(units, 4, out=units)
    rows = torch.from_numpy(units)
    words = base.view(torch.uint8)[: base.numel() * base.element_size() // 8 * 8]
    if base.is_cuda:
        # from pinned memory the upload is ordered on the stream and does not
        # wait for it; torch keeps the pinned block until the upload is done
        rows = rows.pin_memory().to(base.device, non_blocking=True)
    try:
        _copy_pieces[(count,)](rows, count, words.view(torch.int64), BLOCK=_BLOCK, num_warps=_WARPS)
    except Exception as exc:  # a compile that fails here fails every time
        _give_up(f"the kernel did not launch: {type(exc).__name__}: {exc}")
        return False
    return True


def warm(device: Any) -> None:
    """Compile the kernel now (once per process, cached on disk by Triton), on
    a copy between two scratch tensors, so that the first copy through the
    pool does not wait for the compiler and a failure is known up front."""
    if unusable() is not None:
        return
    torch = sys.modules["torch"]
    scratch = torch.zeros(64, dtype=torch.uint8, device=device)
    table = np.array([[scratch.data_ptr()], [scratch.data_ptr() + 32], [32]], dtype=np.int64)
    launch(table, scratch)
