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
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# A table is a (3, n) int64 array in C order, one column per piece: its rows
# are the sources, the destinations and the lengths (each row contiguous: the
# builder's passes run over whole rows, and the kernel reads it as it lies).
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
    return np.empty((3, 0), dtype=np.int64)


def build(
    pool: Pool,
    slots: np.ndarray,
    segments: Sequence[Segment],
    picks: np.ndarray | None,
    at: int | Sequence[int],
    *,
    to_pool: bool,
) -> np.ndarray:
    """The table of one copy, pieces that follow one another on both sides merged.

    Page j lives in slot ``slots[j]``; its bytes from ``at`` on are row
    ``picks[j]`` (or row j, without ``picks``) of each segment, in order; or,
    with ``at`` a byte for each segment (``starts``), segment i's row lies at
    ``at[i]`` of the page. ``to_pool``: the engine's rows are the sources,
    else the destinations. Raises ``ValueError`` for any piece that would fall
    outside its slot's page or its segment's rows, for segments whose rows
    overlap, and for segments placed over one another in a page.

    Pieces come page by page, each page's segments in order; whole pages (one
    segment) come in slot order, so that runs of adjacent slots and rows
    merge whatever order the pages were given in. Costs a few numpy passes
    over the pieces and no sort of them: it runs before every copy.
    """
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    n = len(slots)
    widths = np.array([seg.width for seg in segments], dtype=np.int64)
    if pool.page_bytes <= 0 or pool.slots < 0:
        raise ValueError(f"a pool of {pool.slots} slots of {pool.page_bytes} bytes")
    starts = np.asarray(starts_of(at, widths.tolist(), pool.page_bytes), dtype=np.int64)
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
    if len(segments) == 1 and n > 1:
        order = np.argsort(slots, kind="stable")
        slots, rows = slots[order], rows[order]
    addresses = np.array([seg.address for seg in segments], dtype=np.int64)
    strides = np.array([seg.stride for seg in segments], dtype=np.int64)
    cube = np.empty((3, n, len(segments)), dtype=np.int64)
    cube[SRC if to_pool else DST] = addresses[None, :] + rows[:, None] * strides[None, :]
    cube[DST if to_pool else SRC] = (slots * pool.page_bytes + pool.address)[:, None] + starts
    cube[LEN] = widths
    table = cube.reshape(3, -1)
    if (widths == 0).any():
        table = table.take(np.flatnonzero(table[LEN]), axis=1)
    return merge(table)


def starts_of(at: int | Sequence[int], widths: Sequence[int], page_bytes: int) -> list[int]:
    """Where each segment's bytes start in a page: one after another from byte
    ``at``, or at ``at[i]`` for segment i when ``at`` names a byte for each
    (segments with gaps between them: a worker's heads in vLLM's canonical
    pages). Raises ``ValueError`` for a segment outside the page and, with
    one byte each, for two segments placed over one another, and for a place
    that is not an integer (bools, numpy integers and ints are)."""
    if isinstance(at, int | np.integer):
        # a Python int: a numpy one's sum wraps (np.uint64(2**64 - 8) + 16 is 8)
        first, total = int(at), int(sum(widths))
        if first < 0 or first + total > page_bytes:
            raise ValueError(
                f"segments of {total} bytes a page at byte {first} do not fit pages of "
                f"{page_bytes} bytes"
            )
        return list(itertools.accumulate(widths[:-1], initial=first))
    try:  # integers only: a float or a string is never rounded into a byte of the page
        starts = [operator.index(s) for s in at]
    except TypeError:
        raise ValueError(
            f"at must be an integer byte or a list of integer bytes, one a segment: {at!r}"
        ) from None
    if len(starts) != len(widths):
        raise ValueError(f"{len(starts)} start bytes for {len(widths)} segments: one each")
    spans = sorted((s, s + int(w)) for s, w in zip(starts, widths, strict=True) if w)
    if spans and (spans[0][0] < 0 or max(end for _, end in spans) > page_bytes):
        raise ValueError(f"segments placed at {starts} do not fit pages of {page_bytes} bytes")
    if any(end > nxt for (_, end), (nxt, _) in itertools.pairwise(spans)):
        raise ValueError("segments placed over one another in a page: each byte has one source")
    return starts


def whole_pages(pool: Pool, slots: np.ndarray, address: int, *, to_pool: bool) -> np.ndarray:
    """The table of a copy of whole pages between slots ``slots`` and the
    contiguous pages at ``address`` (page j at ``address + j * page_bytes``),
    one piece a page, unmerged: what ``build`` makes of such a copy, less its
    sort and merge, which only pay where slots follow one another (those
    copies go by DMA, client/cuda.py). Raises ``ValueError`` for a slot
    outside the pool."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    n, page = len(slots), pool.page_bytes
    if n and (int(slots.min()) < 0 or int(slots.max()) >= pool.slots):
        raise ValueError(f"slots must be in 0..{pool.slots - 1}")
    table = np.empty((3, n), dtype=np.int64)
    np.multiply(np.arange(n, dtype=np.int64), page, out=table[SRC if to_pool else DST])
    table[SRC if to_pool else DST] += address
    np.multiply(slots, page, out=table[DST if to_pool else SRC])
    table[DST if to_pool else SRC] += pool.address
    table[LEN] = page
    return table


def merge(table: np.ndarray) -> np.ndarray:
    """``table`` with each run of pieces that follow one another on both sides
    (in the table's order) made one piece."""
    if table.shape[1] < 2:
        return table
    joined = (table[SRC, 1:] == table[SRC, :-1] + table[LEN, :-1]) & (
        table[DST, 1:] == table[DST, :-1] + table[LEN, :-1]
    )
    if not joined.any():
        return table
    heads = np.flatnonzero(np.concatenate(([True], ~joined)))
    out = table.take(heads, axis=1)
    out[LEN] = np.add.reduceat(table[LEN], heads)
    return out


def coalesce(table: np.ndarray, by: int = SRC) -> np.ndarray:
    """``table`` ordered by row ``by`` and merged: every two pieces that follow
    one another on both sides, wherever they were, made one."""
    if table.shape[1] < 2:
        return table.copy()
    return merge(table.take(np.argsort(table[by], kind="stable"), axis=1))


def split(table: np.ndarray, most: int) -> np.ndarray:
    """``table`` with every piece longer than ``most`` bytes cut into pieces of
    ``most`` (the last one shorter), in place of it."""
    if most <= 0:
        raise ValueError(f"pieces of at most {most} bytes")
    parts = -(-table[LEN] // most)
    if not table.shape[1] or int(parts.max()) <= 1:
        return table
    owner = np.repeat(np.arange(table.shape[1]), parts)
    first = np.repeat(np.cumsum(parts) - parts, parts)
    skip = (np.arange(len(owner)) - first) * most
    out = table.take(owner, axis=1)
    out[SRC] += skip
    out[DST] += skip
    out[LEN] = np.minimum(most, out[LEN] - skip)
    return out


def aligned_copy(
    pool: Pool, segments: Sequence[Segment], at: int | Sequence[int], base: int, to: int = 16
) -> bool:
    """Every piece ``build`` makes of such a copy (merged or split in multiples
    of ``to``) has addresses (as offsets from ``base``) and a length that are
    multiples of ``to``, told from the geometry alone. ``to``: a power of two;
    ``at`` as ``build`` takes it."""
    values = [pool.address - base, pool.page_bytes]
    values += [int(at)] if isinstance(at, int | np.integer) else [int(s) for s in at]
    for seg in segments:
        values += [seg.address - base, seg.stride, seg.width]
    bits = 0
    for value in values:
        bits |= value
    return bits % to == 0


def disjoint_copy(
    slots: np.ndarray, segments: Sequence[Segment], picks: np.ndarray | None, *, to_pool: bool
) -> bool:
    """No two pieces of such a copy write the same byte, told from its geometry
    alone where it can be (distinct slots for a write; for a read, distinct
    rows and segments apart from one another); else from its table."""
    if to_pool:
        return _distinct(slots)
    if picks is not None and not _distinct(picks):
        return False
    spans = sorted(
        (seg.address, seg.address + (seg.rows - 1) * seg.stride + seg.width)
        for seg in segments
        if seg.rows and seg.width
    )
    return all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))


def _distinct(values: np.ndarray) -> bool:
    """No value twice (a sort: cheaper than numpy's unique, which hashes)."""
    ordered = np.sort(np.asarray(values).reshape(-1))
    return bool((ordered[1:] != ordered[:-1]).all())


def aligned(table: np.ndarray, base: int, to: int = 16) -> bool:
    """Every address (as an offset from ``base``) and length a multiple of ``to``
    (a power of two)."""
    bits = base
    for row in (table[SRC] - base, table[DST] - base, table[LEN]):
        bits |= int(np.bitwise_or.reduce(row)) if len(row) else 0
    return bits % to == 0


def disjoint(table: np.ndarray) -> bool:
    """No two pieces write the same byte (a write of two pages into one slot
    would leave whichever ran last: the kernel gives no order)."""
    if table.shape[1] < 2:
        return True
    ordered = table.take(np.argsort(table[DST], kind="stable"), axis=1)
    return bool((ordered[DST, 1:] >= ordered[DST, :-1] + ordered[LEN, :-1]).all())


def nbytes(table: np.ndarray) -> int:
    return int(table[LEN].sum())


def run_on_host(table: np.ndarray) -> None:
    """Copy every piece with memmove: the table's meaning, on host memory (the
    addresses must be those of live host buffers)."""
    for src, dst, length in table.T.tolist():
        ctypes.memmove(dst, src, length)
