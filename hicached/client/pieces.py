"""A copy as a table of pieces: (source address, destination address, length).

Every copy between engine memory and pool slots, whole pages or per-layer
blocks picked by id into wide pages, moves a set of byte ranges from one
address to another. Written down as one table, the whole copy runs as one
kernel launch (client/kernel.py) instead of a DMA call per run of slots or a
gather and a scatter per layer, and the same table runs on host memory
(``run_on_host``), which is how the tests check it.

The builder is pure: addresses and geometry in, a table out. It checks every
bound it is given (no piece leaves its slot's page or its tensor's rows),
merges pieces adjacent on both sides, and ``split`` cuts long ones so that
many programs share them. No torch here: the CUDA path turns tensors into
``Segment`` s.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Columns of a table: one row per piece, int64.
SRC, DST, LEN = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Segment:
    """One engine tensor as a table sees it: ``rows`` rows of which the first
    ``width`` bytes are copied, row r at ``address + r * stride``."""

    address: int
    stride: int
    width: int
    rows: int


@dataclass(frozen=True, slots=True)
class Pool:
    """The pool's slots of one page size: slot s at ``address + s * page_bytes``."""

    address: int
    page_bytes: int
    slots: int


def empty() -> np.ndarray:
    return np.empty((0, 3), dtype=np.int64)


def build(
    pool: Pool,
    slots: np.ndarray,
    segments: Sequence[Segment],
    picks: np.ndarray | None,
    at: int,
    *,
    to_pool: bool,
) -> np.ndarray:
    """The table of one copy, pieces adjacent on both sides merged.

    Page j lives in slot ``slots[j]``; its bytes from ``at`` on are row
    ``picks[j]`` (or row j, without ``picks``) of each segment, in order.
    ``to_pool``: the engine's rows are the sources, else the destinations.
    Raises ``ValueError`` for any piece that would fall outside its slot's
    page or its segment's rows, and for segments whose rows overlap.
    """
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    n = len(slots)
    widths = np.array([seg.width for seg in segments], dtype=np.int64)
    if pool.page_bytes <= 0 or pool.slots < 0:
        raise ValueError(f"a pool of {pool.slots} slots of {pool.page_bytes} bytes")
    if at < 0 or at + int(widths.sum()) > pool.page_bytes:
        raise ValueError(
            f"segments of {int(widths.sum())} bytes a page at byte {at} do not fit pages of "
            f"{pool.page_bytes} bytes"
        )
    for seg in segments:
        if seg.width < 0 or seg.rows < 0 or (seg.rows > 1 and seg.stride < seg.width):
            raise ValueError(f"a segment whose rows overlap or are negative: {seg}")
    if n and (int(slots.min()) < 0 or int(slots.max()) >= pool.slots):
        raise ValueError(f"slots must be in 0..{pool.slots - 1}")
    if picks is None:
        rows = np.arange(n, dtype=np.int64)
    else:
        rows = np.asarray(picks, dtype=np.int64).reshape(-1)
        if len(rows) != n:
            raise ValueError(f"{len(rows)} rows for {n} pages: one row per page")
    if not n or not len(segments):
        return empty()
    height = min(seg.rows for seg in segments)
    if int(rows.min()) < 0 or int(rows.max()) >= height:
        raise ValueError(f"rows must be in 0..{height - 1}, the rows every segment has")
    starts = at + np.concatenate(([0], np.cumsum(widths)[:-1]))
    addresses = np.array([seg.address for seg in segments], dtype=np.int64)
    strides = np.array([seg.stride for seg in segments], dtype=np.int64)
    in_pool = pool.address + slots[:, None] * pool.page_bytes + starts[None, :]
    in_engine = addresses[None, :] + rows[:, None] * strides[None, :]
    table = np.empty((n * len(segments), 3), dtype=np.int64)
    table[:, SRC if to_pool else DST] = in_engine.reshape(-1)
    table[:, DST if to_pool else SRC] = in_pool.reshape(-1)
    table[:, LEN] = np.broadcast_to(widths, (n, len(segments))).reshape(-1)
    return coalesce(table[table[:, LEN] > 0], DST if to_pool else SRC)


def coalesce(table: np.ndarray, by: int = SRC) -> np.ndarray:
    """``table`` ordered by column ``by`` (the pool's side: one sweep through
    it), each run of pieces that follow one another on both sides one piece."""
    if len(table) < 2:
        return table.copy()
    table = table[np.argsort(table[:, by], kind="stable")]
    ends = table[:-1, :2] + table[:-1, LEN : LEN + 1]
    joined = (table[1:, SRC] == ends[:, SRC]) & (table[1:, DST] == ends[:, DST])
    heads = np.flatnonzero(np.concatenate(([True], ~joined)))
    out = table[heads]
    out[:, LEN] = np.add.reduceat(table[:, LEN], heads)
    return out


def split(table: np.ndarray, most: int) -> np.ndarray:
    """``table`` with every piece longer than ``most`` bytes cut into pieces of
    ``most`` (the last one shorter), in place of it."""
    if most <= 0:
        raise ValueError(f"pieces of at most {most} bytes")
    parts = -(-table[:, LEN] // most)
    if not len(table) or int(parts.max()) <= 1:
        return table
    owner = np.repeat(np.arange(len(table)), parts)
    first = np.repeat(np.cumsum(parts) - parts, parts)
    skip = (np.arange(len(owner)) - first) * most
    out = table[owner]
    out[:, SRC] += skip
    out[:, DST] += skip
    out[:, LEN] = np.minimum(most, out[:, LEN] - skip)
    return out


def aligned(table: np.ndarray, base: int, to: int = 16) -> bool:
    """Every address (as an offset from ``base``) and length a multiple of ``to``."""
    if not len(table):
        return base % to == 0
    bits = np.bitwise_or.reduce(table[:, :2] - base, axis=None) | np.bitwise_or.reduce(
        table[:, LEN]
    )
    return int(bits) % to == 0 and base % to == 0


def disjoint(table: np.ndarray) -> bool:
    """No two pieces write the same byte (a write of two pages into one slot
    would leave whichever ran last: the kernel gives no order)."""
    if len(table) < 2:
        return True
    ordered = table[np.argsort(table[:, DST], kind="stable")]
    return bool((ordered[1:, DST] >= ordered[:-1, DST] + ordered[:-1, LEN]).all())


def nbytes(table: np.ndarray) -> int:
    return int(table[:, LEN].sum()) if len(table) else 0


def run_on_host(table: np.ndarray) -> None:
    """Copy every piece with memmove: the table's meaning, on host memory (the
    addresses must be those of live host buffers)."""
    for src, dst, length in table.tolist():
        ctypes.memmove(dst, src, length)
