"""Copies as tables of pieces (client/pieces.py): exact tables for small
copies, coalescing, refused bounds, and, over random geometries, every piece
inside its slot's page and its tensor's rows and the bytes a table moves
(run with memmove on host buffers) those of the copy it stands for.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicached.client import kernel, pieces
from hicached.client.pieces import DST, LEN, SRC, Pool, Segment


def _pool(buf: np.ndarray) -> Pool:
    return Pool(buf.ctypes.data, buf.shape[1], buf.shape[0])


def _seg(buf: np.ndarray, width: int | None = None, skip: int = 0) -> Segment:
    """Rows of ``buf`` (2-D bytes), ``width`` bytes of each from byte ``skip``."""
    w = buf.shape[1] - skip if width is None else width
    return Segment(buf.ctypes.data + skip, buf.strides[0], w, buf.shape[0])


def test_whole_pages_in_order_are_one_piece() -> None:
    pool = np.zeros((8, 64), dtype=np.uint8)
    gpu = np.zeros((3, 64), dtype=np.uint8)
    table = pieces.build(_pool(pool), np.array([2, 3, 4]), [_seg(gpu)], None, 0, to_pool=True)
    assert table.T.tolist() == [[gpu.ctypes.data, pool.ctypes.data + 2 * 64, 3 * 64]]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(st.permutations(range(n)), st.integers(1, 4), st.booleans())
    )
)
def test_whole_pages_by_the_short_way_move_the_bytes_build_moves(
    case: tuple[list[int], int, bool],
) -> None:
    """The table of whole pages without sort or merge (the CUDA path's way for
    scattered pages) moves each page to or from its own slot, as ``build``'s."""
    order, spare, to_pool = case
    rng = np.random.default_rng(len(order))
    pool = rng.integers(0, 256, (len(order) + spare, 48), dtype=np.uint8)
    pages = rng.integers(0, 256, (len(order), 48), dtype=np.uint8)
    slots = np.array(order, dtype=np.int64) + spare
    short = pieces.whole_pages(_pool(pool), slots, pages.ctypes.data, to_pool=to_pool)
    assert short.shape == (3, len(order)) and (short[LEN] == 48).all()
    want_pool, want_pages = pool.copy(), pages.copy()
    if to_pool:
        want_pool[slots] = pages
    else:
        want_pages[:] = pool[slots]
    pieces.run_on_host(short)
    assert np.array_equal(pool, want_pool) and np.array_equal(pages, want_pages)
    with pytest.raises(ValueError, match="slots must be in"):
        pieces.whole_pages(_pool(pool), np.array([len(pool)]), pages.ctypes.data, to_pool=True)


def test_shuffled_pages_become_one_piece_per_run_in_pool_order() -> None:
    pool = np.zeros((8, 64), dtype=np.uint8)
    out = np.zeros((4, 64), dtype=np.uint8)
    p, o = pool.ctypes.data, out.ctypes.data
    table = pieces.build(_pool(pool), np.array([6, 1, 2, 0]), [_seg(out)], None, 0, to_pool=False)
    # slot 0 -> page 3; slots 1, 2 -> pages 1, 2 (one run); slot 6 -> page 0
    assert table.T.tolist() == [[p, o + 3 * 64, 64], [p + 64, o + 64, 128], [p + 6 * 64, o, 64]]


def test_whole_pages_merge_in_slot_order_whatever_order_they_came_in() -> None:
    """Slots 5, 3, 4 with rows 2, 0, 1: in page order no neighbours join, in
    slot order all three are one run of rows and of slots."""
    pool = np.zeros((8, 32), dtype=np.uint8)
    kv = np.zeros((4, 32), dtype=np.uint8)
    table = pieces.build(
        _pool(pool), np.array([5, 3, 4]), [_seg(kv)], np.array([2, 0, 1]), 0, to_pool=True
    )
    assert table.T.tolist() == [[kv.ctypes.data, pool.ctypes.data + 3 * 32, 96]]


def test_segments_with_rows_and_at_fill_their_part_of_each_page() -> None:
    """vLLM's shape: two layers, blocks by id, this worker's half of a wide page."""
    pool = np.zeros((4, 64), dtype=np.uint8)
    k = np.zeros((10, 8), dtype=np.uint8)
    v = np.zeros((10, 16), dtype=np.uint8)
    p = pool.ctypes.data
    table = pieces.build(
        _pool(pool), np.array([1, 2]), [_seg(k), _seg(v)], np.array([7, 3]), 32, to_pool=True
    )
    kk, vv = k.ctypes.data, v.ctypes.data
    assert table.T.tolist() == [
        [kk + 7 * 8, p + 64 + 32, 8],
        [vv + 7 * 16, p + 64 + 40, 16],
        [kk + 3 * 8, p + 128 + 32, 8],
        [vv + 3 * 16, p + 128 + 40, 16],
    ]


def test_segments_adjacent_in_memory_join_within_a_page() -> None:
    """Two views of one tensor's rows, side by side: one piece a page."""
    pool = np.zeros((4, 64), dtype=np.uint8)
    kv = np.zeros((6, 48), dtype=np.uint8)
    segs = [_seg(kv, 16), _seg(kv, 32, skip=16)]
    table = pieces.build(_pool(pool), np.array([0, 2]), segs, np.array([1, 4]), 0, to_pool=False)
    p = pool.ctypes.data
    assert table.T.tolist() == [
        [p, kv.ctypes.data + 48, 48],
        [p + 128, kv.ctypes.data + 4 * 48, 48],
    ]


def test_empty_copies_and_empty_segments_make_no_pieces() -> None:
    pool = np.zeros((4, 64), dtype=np.uint8)
    kv = np.zeros((4, 16), dtype=np.uint8)
    none = np.array([], dtype=np.int64)
    assert pieces.build(_pool(pool), none, [_seg(kv)], None, 0, to_pool=True).shape == (3, 0)
    zero = Segment(kv.ctypes.data, 16, 0, 4)
    table = pieces.build(_pool(pool), np.array([1]), [zero, _seg(kv)], None, 0, to_pool=True)
    assert table.T.tolist() == [[kv.ctypes.data, pool.ctypes.data + 64, 16]]


@pytest.mark.parametrize(
    ("slots", "rows", "at", "match"),
    [
        ([4], None, 0, "slots must be in 0..3"),
        ([-1], None, 0, "slots must be in 0..3"),
        ([0], [6], 0, r"rows must be in 0..5"),
        ([0], [-1], 0, r"rows must be in 0..5"),
        ([0, 1], [1], 0, "one row per page"),
        ([0], None, 49, "do not fit pages of 64 bytes"),
        ([0], None, -1, "do not fit"),
    ],
)
def test_pieces_outside_a_page_or_a_tensor_are_refused(
    slots: list[int], rows: list[int] | None, at: int, match: str
) -> None:
    pool = np.zeros((4, 64), dtype=np.uint8)
    kv = np.zeros((6, 16), dtype=np.uint8)
    picks = None if rows is None else np.array(rows)
    with pytest.raises(ValueError, match=match):
        pieces.build(_pool(pool), np.array(slots), [_seg(kv)], picks, at, to_pool=True)


def test_rows_must_be_in_every_segment() -> None:
    pool = np.zeros((4, 64), dtype=np.uint8)
    tall, short = np.zeros((6, 16), dtype=np.uint8), np.zeros((3, 16), dtype=np.uint8)
    segs = [_seg(tall), _seg(short)]
    with pytest.raises(ValueError, match=r"rows must be in 0..2"):
        pieces.build(_pool(pool), np.array([0]), segs, np.array([4]), 0, to_pool=True)
    assert len(pieces.build(_pool(pool), np.array([0]), segs, np.array([2]), 0, to_pool=True))


def test_segments_whose_rows_overlap_are_refused() -> None:
    pool = np.zeros((4, 64), dtype=np.uint8)
    kv = np.zeros((6, 16), dtype=np.uint8)
    wide = Segment(kv.ctypes.data, 16, 32, 3)  # 32 bytes a row, rows 16 apart
    with pytest.raises(ValueError, match="overlap"):
        pieces.build(_pool(pool), np.array([0]), [wide], None, 0, to_pool=True)


def test_split_cuts_long_pieces_and_keeps_their_bytes() -> None:
    table = np.array([[1000, 5000, 100], [3000, 9000, 16]], dtype=np.int64).T
    assert pieces.split(table, 32).T.tolist() == [
        [1000, 5000, 32],
        [1032, 5032, 32],
        [1064, 5064, 32],
        [1096, 5096, 4],
        [3000, 9000, 16],
    ]
    assert pieces.split(table, 100) is table
    with pytest.raises(ValueError):
        pieces.split(table, 0)


def test_alignment_and_overlapping_destinations_are_told() -> None:
    table = np.array([[1024, 2048, 64], [4096, 2112, 32]], dtype=np.int64).T
    assert pieces.aligned(table, 0)
    assert pieces.aligned(table, 512)
    assert not pieces.aligned(table, 8)  # offsets from 8 are not multiples of 16
    assert not pieces.aligned(np.array([[0], [16], [24]], dtype=np.int64), 0)
    assert pieces.disjoint(table)
    assert not pieces.disjoint(np.array([[0, 64], [100, 120], [32, 8]], dtype=np.int64))
    assert pieces.nbytes(table) == 96


def test_a_write_of_two_pages_into_one_slot_is_not_a_kernel_table() -> None:
    pool = np.zeros((4, 64), dtype=np.uint8)
    gpu = np.zeros((2, 64), dtype=np.uint8)
    slots = np.array([1, 1])
    table = pieces.build(_pool(pool), slots, [_seg(gpu)], None, 0, to_pool=True)
    assert not pieces.disjoint(table)
    assert not pieces.disjoint_copy(slots, [_seg(gpu)], None, to_pool=True)
    # a read from one slot into two pages writes each once
    assert pieces.disjoint_copy(slots, [_seg(gpu)], None, to_pool=False)


def test_segments_interleaved_in_memory_are_checked_on_the_table() -> None:
    """K and V as two views of one tensor's rows (k then v in each row): their
    spans overlap, their bytes do not; two views of the same bytes do."""
    kv = np.zeros((6, 32), dtype=np.uint8)
    k, v = _seg(kv, 16), _seg(kv, 16, skip=16)
    picks = np.array([0, 3])
    assert not pieces.disjoint_copy(picks, [k, v], picks, to_pool=False)
    pool = np.zeros((4, 64), dtype=np.uint8)
    table = pieces.build(_pool(pool), np.array([0, 1]), [k, v], picks, 0, to_pool=False)
    assert pieces.disjoint(table)
    twice = pieces.build(_pool(pool), np.array([0, 1]), [k, k], picks, 0, to_pool=False)
    assert not pieces.disjoint(twice)


def test_alignment_is_told_from_the_geometry() -> None:
    pool = Pool(4096, 1024, 8)
    seg = Segment(8192, 256, 128, 10)
    assert pieces.aligned_copy(pool, [seg], 512, 0)
    assert not pieces.aligned_copy(pool, [seg], 520, 0)  # at 8 bytes off
    assert not pieces.aligned_copy(pool, [Segment(8192, 264, 128, 10)], 0, 0)  # rows 8 off
    assert not pieces.aligned_copy(pool, [Segment(8200, 256, 128, 10)], 0, 0)
    assert not pieces.aligned_copy(pool, [seg], 0, 8)  # the base itself


# -- random geometries, run on host memory --------------------------------------------


@st.composite
def copies(draw: st.DrawFn) -> dict[str, object]:
    """A pool, per-layer tensors (some rows wider than the copied part), pages
    to copy with or without engine rows, a place in the page, a direction."""
    n_slots = draw(st.integers(1, 12))
    layers = draw(st.integers(1, 4))
    widths = draw(st.lists(st.integers(0, 24), min_size=layers, max_size=layers))
    pads = draw(st.lists(st.integers(0, 8), min_size=layers, max_size=layers))
    spare = draw(st.integers(0, 20))
    at = draw(st.integers(0, spare))
    page_bytes = sum(widths) + spare
    page_bytes = max(page_bytes, 1)
    n = draw(st.integers(0, n_slots))
    slots = draw(st.permutations(range(n_slots)))[:n]
    to_pool = draw(st.booleans())
    height = draw(st.integers(max(n, 1), n + 6))
    rows = None
    if draw(st.booleans()):
        rows = draw(st.permutations(range(height)))[:n]
    return dict(
        n_slots=n_slots,
        page_bytes=page_bytes,
        widths=widths,
        pads=pads,
        at=at,
        slots=slots,
        rows=rows,
        height=height if rows is not None else n,
        to_pool=to_pool,
        most=draw(st.integers(1, 40)),
    )


def _count(table: np.ndarray, col: int, origin: int, size: int) -> np.ndarray:
    """How many pieces cover each byte of [origin, origin + size) on side ``col``."""
    hits = np.zeros(size + 1, dtype=np.int64)
    for start, length in zip(table[col] - origin, table[LEN], strict=True):
        assert start >= 0 and start + length <= size, "a piece outside its buffer"
        hits[start] += 1
        hits[start + length] -= 1
    return np.cumsum(hits)[:size]


@settings(max_examples=300, deadline=None)
@given(copies())
def test_a_table_moves_exactly_the_bytes_of_its_copy(c: dict[str, object]) -> None:
    rng = np.random.default_rng(0)
    n_slots, page_bytes, at = int(c["n_slots"]), int(c["page_bytes"]), int(c["at"])  # type: ignore[call-overload]
    widths, pads = list(c["widths"]), list(c["pads"])  # type: ignore[call-overload]
    slots = np.array(c["slots"], dtype=np.int64)
    picks = None if c["rows"] is None else np.array(c["rows"], dtype=np.int64)
    height, to_pool = int(c["height"]), bool(c["to_pool"])  # type: ignore[call-overload]
    pool = rng.integers(0, 256, (n_slots, page_bytes), dtype=np.uint8)
    # one buffer for all layers, each layer's rows padded: pieces can only stay
    # inside their own layer if the bounds hold
    layer_bytes = [height * (w + p) for w, p in zip(widths, pads, strict=True)]
    engine = rng.integers(0, 256, sum(layer_bytes), dtype=np.uint8)
    starts = np.concatenate(([0], np.cumsum(layer_bytes)[:-1])).astype(int)
    layers = [
        engine[s : s + b].reshape(height, w + p)
        for s, b, w, p in zip(starts, layer_bytes, widths, pads, strict=True)
    ]
    segs = [_seg(layer, w) for layer, w in zip(layers, widths, strict=True)]
    want_pool, want_engine = pool.copy(), engine.copy()
    want_layers = [want_engine[s : s + b].reshape(layer.shape) for s, b, layer in
                   zip(starts, layer_bytes, layers, strict=True)]  # fmt: skip
    rows = np.arange(len(slots)) if picks is None else picks
    for j, (slot, row) in enumerate(zip(slots, rows, strict=True)):
        place = at
        for want, w in zip(want_layers, widths, strict=True):
            if to_pool:
                want_pool[slot, place : place + w] = want[row, :w]
            else:
                want[row, :w] = pool[slot, place : place + w]
            place += w
        assert j < len(slots)
    table = pieces.build(_pool(pool), slots, segs, picks, at, to_pool=to_pool)
    # every piece inside the pool and the engine buffer, each byte moved once
    pool_side, engine_side = (DST, SRC) if to_pool else (SRC, DST)
    in_pool = _count(table, pool_side, pool.ctypes.data, pool.nbytes)
    in_engine = _count(table, engine_side, engine.ctypes.data, engine.nbytes)
    moved = np.zeros((n_slots, page_bytes), dtype=bool)
    for slot in slots:
        moved[slot, at : at + sum(widths)] = True
    assert np.array_equal(in_pool, moved.reshape(-1).astype(np.int64)), "pool bytes"
    allowed = np.zeros(engine.nbytes, dtype=np.int64)
    for s, layer, w in zip(starts, layers, widths, strict=True):
        for row in rows:
            allowed[s + row * layer.shape[1] : s + row * layer.shape[1] + w] = 1
    assert np.array_equal(in_engine, allowed), "engine bytes"
    assert pieces.nbytes(table) == len(slots) * sum(widths)
    assert pieces.disjoint(table)
    # merged: no piece follows the one before it on both sides (with one
    # segment, no two pieces anywhere in the table)
    ends = table[:2] + table[LEN]
    follows = (table[SRC][:, None] == ends[SRC][None, :]) & (
        table[DST][:, None] == ends[DST][None, :]
    )
    assert not np.diagonal(follows, -1).any(), "neighbours left unmerged"
    if len(segs) == 1:
        assert not follows.any(), "pieces left unmerged"
    # what the geometry tells holds for the table
    base = pool.ctypes.data
    for to in (1, 2, 4, 8, 16):
        if pieces.aligned_copy(_pool(pool), segs, at, base, to):
            assert pieces.aligned(table, base, to)
    assert pieces.disjoint_copy(slots, segs, picks, to_pool=to_pool)
    # split into short pieces, run on host memory: the bytes of the copy
    short = pieces.split(table, int(c["most"]))  # type: ignore[call-overload]
    assert pieces.nbytes(short) == pieces.nbytes(table)
    assert not short.shape[1] or int(short[LEN].max()) <= int(c["most"])
    assert table.flags.c_contiguous and short.flags.c_contiguous  # as the kernel reads it
    pieces.run_on_host(short)
    assert np.array_equal(pool, want_pool)
    assert np.array_equal(engine, want_engine)


# -- the kernel where Triton is missing ---------------------------------------------------


def test_without_triton_the_kernel_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    if kernel.triton is not None:
        pytest.skip("Triton is installed here (tests/test_copy_kernel.py runs the kernel)")
    kernel.reset()
    table = np.array([[0], [64], [16]], dtype=np.int64)
    with caplog.at_level(logging.WARNING, logger="hicached.client.kernel"):
        assert kernel.unusable() == "Triton is not installed"
        assert not kernel.qualifies(table, 0)
        assert not kernel.launch(table, None)
    said = [r for r in caplog.records if "table kernel are off" in r.getMessage()]
    assert len(said) == 1, said


def test_segments_placed_apart_move_each_to_its_own_byte() -> None:
    """A byte for each segment (vLLM's canonical pages: a worker's heads lie
    apart in each token's row): each row lands at its own place, the gaps
    between them keep the page's other bytes, and the table moves what
    ``mapping._copy_rows`` moves on host memory."""
    from hicached.client.mapping import _copy_rows

    rng = np.random.default_rng(4)
    pool = rng.integers(0, 256, (4, 64), dtype=np.uint8)
    kv = rng.integers(0, 256, (6, 32), dtype=np.uint8)
    a, b = kv[:, 0:8], kv[:, 16:24]  # two fragments of each block, as strided views
    starts = [40, 8]  # placed out of order, with gaps
    slots, rows = np.array([3, 1]), np.array([5, 2])
    table = pieces.build(
        _pool(pool), slots, [_seg(kv, 8), _seg(kv, 8, skip=16)], rows, starts, to_pool=True
    )
    want = pool.copy()
    want[slots, 40:48] = a[rows]
    want[slots, 8:16] = b[rows]
    by_rows = pool.copy()
    _copy_rows(by_rows, slots, [a, b], rows, starts, True)
    pieces.run_on_host(table)
    assert np.array_equal(pool, want)
    assert np.array_equal(by_rows, want)
    back = np.zeros_like(kv)
    _copy_rows(pool, slots, [back[:, 0:8], back[:, 16:24]], rows, starts, False)
    assert np.array_equal(back[rows][:, 0:8], a[rows])
    assert np.array_equal(back[rows][:, 16:24], b[rows])


@pytest.mark.parametrize(
    ("starts", "match"),
    [
        ([0, 4], "over one another"),  # 8 bytes at 0 reach byte 4
        ([60, 0], "do not fit"),  # 8 bytes at 60 leave a page of 64
        ([-8, 16], "do not fit"),
        ([0], "one each"),
    ],
)
def test_segments_placed_over_one_another_or_outside_the_page_are_refused(
    starts: list[int], match: str
) -> None:
    pool = np.zeros((4, 64), dtype=np.uint8)
    kv = np.zeros((6, 16), dtype=np.uint8)
    segs = [_seg(kv, 8), _seg(kv, 8, skip=8)]
    with pytest.raises(ValueError, match=match):
        pieces.build(_pool(pool), np.array([0]), segs, None, starts, to_pool=True)


@pytest.mark.parametrize("at", [np.uint64(2**64 - 8), np.uint32(2**32 - 8), np.uint16(2**16 - 8)])
def test_a_numpy_start_byte_that_wraps_is_refused_not_placed_past_the_page(at: object) -> None:
    """A start byte of an unsigned numpy type near its top wraps back into the
    page when the check adds the segments' bytes to it; placed as the number
    it is, the piece would lie past the page."""
    with pytest.raises(ValueError, match="do not fit"):
        pieces.starts_of(at, [16], 64)  # type: ignore[arg-type]
    assert pieces.starts_of(np.uint64(48), [16], 64) == [48]  # one that fits
