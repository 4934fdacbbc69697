"""The CUDA path: the pool pinned for CUDA, GPU <-> slot copies by DMA.

The copy planner runs everywhere; the tests that move bytes need a CUDA
device and run on one (the CPU-only suite skips them, saying so).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hicached import cuda
from hicached.client import kernel
from hicached.errors import HicachedError, StaleHandle
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_runs_split_rows_into_adjacent_stretches() -> None:
    assert cuda.runs(np.array([], dtype=np.int64)) == []
    assert cuda.runs(np.array([4, 5, 6, 9, 2, 3, 10])) == [
        (4, 0, 3),
        (9, 3, 1),
        (2, 4, 2),
        (10, 6, 1),
    ]


def test_a_tensor_is_a_segment_when_the_bytes_of_a_row_are_contiguous() -> None:
    t = torch.empty((10, 2, 16), dtype=torch.bfloat16)
    seg = cuda.segment(t)
    assert seg is not None
    assert (seg.address, seg.stride, seg.width, seg.rows) == (t.data_ptr(), 64, 64, 10)
    sliced = torch.empty((10, 48), dtype=torch.uint8)[:, :32]  # rows 48 apart, 32 copied
    seg = cuda.segment(sliced)
    assert seg is not None
    assert (seg.stride, seg.width, seg.rows) == (48, 32, 10)
    assert cuda.segment(torch.empty((4, 3, 8)).transpose(1, 2)) is None


def test_without_cuda_pinning_fails_clearly(daemon: Daemon) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with daemon.client() as c, pytest.raises(HicachedError, match="CUDA is not available"):
        c.pin_memory()


def _pinned(c: object) -> bool:
    """CUDA sees this client's mapping of the pool as page-locked memory."""
    return bool(torch.from_numpy(c.mapping.arena.array).is_pinned())  # type: ignore[attr-defined]


@needs_cuda
@pytest.mark.parametrize("way", ["dma", "kernel"])
def test_gpu_pages_round_trip_through_pinned_slots(
    daemon_factory: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    # dma: one copy-engine transfer per run of slots; kernel: one gather/scatter
    monkeypatch.setattr(cuda, "KERNEL_BELOW_RUN_BYTES", 0 if way == "dma" else 1 << 40)
    d = daemon_factory(size_mib=8, slab_mib=1)
    with d.client() as c:
        ns = c.register(**NS)
        c.pin_memory()
        assert _pinned(c)
        tokens = np.arange(40 * PAGE_TOKENS, dtype=np.uint32) + 123
        gpu = torch.randint(0, 256, (40, PAGE_BYTES), dtype=torch.uint8, device="cuda")
        res = c.reserve(ns, tokens)
        order = np.random.default_rng(0).permutation(40).tolist()
        c.write_pages(res.select(order), gpu)  # scattered slots
        c.commit(res)
        hit = c.match(ns, tokens)
        # the slots hold exactly the GPU's bytes, as any process sees them
        assert np.array_equal(c.read_pages(hit.select(order)), gpu.cpu().numpy())
        back = torch.zeros_like(gpu)
        c.read_pages(hit.select(order), back)
        assert torch.equal(back, gpu)
        bf16 = torch.empty((40, PAGE_BYTES // 2), dtype=torch.bfloat16, device="cuda")
        c.read_pages(hit.select(order), bf16)  # any dtype, viewed as bytes
        assert torch.equal(bf16.view(torch.uint8), gpu)
        c.release(hit)
        res = c.reserve(ns, tokens + 100_000)
        c.write_pages(res, gpu)  # in order: runs of adjacent slots
        with pytest.raises(ValueError, match="bytes"):
            c.write_pages(res.select([0, 1]), gpu[:2, :100].contiguous())
        c.abort(res)


@needs_cuda
def test_unpinned_pool_still_copies_to_and_from_the_gpu(daemon: Daemon) -> None:
    with daemon.client() as c:
        ns = c.register(**NS)
        assert not _pinned(c)
        gpu = torch.randint(0, 256, (5, PAGE_BYTES), dtype=torch.uint8, device="cuda")
        tokens = np.arange(5 * PAGE_TOKENS, dtype=np.uint32) + 9
        res = c.reserve(ns, tokens)
        c.write_pages(res.select([4, 3, 2, 1, 0]), gpu)
        c.commit(res)
        hit = c.match(ns, tokens)
        back = torch.zeros_like(gpu)
        c.read_pages(hit.select([4, 3, 2, 1, 0]), back)
        assert torch.equal(back, gpu)
        c.release(hit)


@needs_cuda
def test_a_stale_hit_never_fills_a_gpu_tensor(daemon: Daemon) -> None:
    with daemon.client() as c:
        ns = c.register(**NS)
        tokens = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, tokens, np.full((2, PAGE_BYTES), 7, dtype=np.uint8))
        hit = c.match(ns, tokens)
        c.release(hit)
        back = torch.zeros((2, PAGE_BYTES), dtype=torch.uint8, device="cuda")
        with pytest.raises(StaleHandle):
            c.read_pages(hit, back)
        assert int(back.sum()) == 0


@needs_cuda
def test_pinning_follows_a_daemon_restart(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(size_mib=4, slab_mib=1)
    with d.client() as c:
        ns = c.register(**NS)
        c.pin_memory()
        d.stop()
        d.start()
        c.stats()  # reconnects to the new daemon and its new pool
        assert _pinned(c)
        gpu = torch.randint(0, 256, (3, PAGE_BYTES), dtype=torch.uint8, device="cuda")
        tokens = np.arange(3 * PAGE_TOKENS, dtype=np.uint32)
        res = c.reserve(ns, tokens)
        c.write_pages(res, gpu)
        c.commit(res)
        assert np.array_equal(c.load(ns, tokens), gpu.cpu().numpy())


@needs_cuda
@pytest.mark.parametrize("pinned", [True, False])
def test_segmented_copies_between_gpu_layers_and_wide_pages(daemon: Daemon, pinned: bool) -> None:
    """vLLM's shape: per-layer GPU tensors, block rows picked by id, each worker's
    part of a wide page at its offset; read back into other blocks, same bytes."""
    import hashlib

    layers, blocks, width = 4, 24, PAGE_BYTES // 2 // 4
    keys = [hashlib.sha256(bytes([i])).digest() + bytes(4) for i in range(6)]
    spec = {**NS, "key_scheme": "vllm-sha256", "shards": 2}
    with daemon.client() as c:
        if pinned:
            c.pin_memory()
        ns = c.register(**spec)
        kv = [
            [
                torch.randint(0, 256, (blocks, width), dtype=torch.uint8, device="cuda")
                for _ in range(layers)
            ]
            for _ in range(2)
        ]
        rows = [3, 4, 5, 11, 0, 20]
        res = c.reserve_keys(ns, keys)
        for rank in range(2):
            c.write_pages(res, kv[rank], rows=rows, at=rank * PAGE_BYTES // 2)
        c.commit(res)
        hit = c.match_keys(ns, keys)
        targets = [7, 8, 9, 1, 2, 23]
        for rank in range(2):
            back = [torch.zeros_like(t) for t in kv[rank]]
            c.read_pages(hit, back, rows=targets, at=rank * PAGE_BYTES // 2)
            for got, want in zip(back, kv[rank], strict=True):
                assert torch.equal(got[targets], want[rows])
        c.release(hit)


# -- every shape, every way -------------------------------------------------------------

# The way each copy goes: with the table kernel, with the ways from before it,
# and with the pool not registered (pageable).
WAYS = {
    "table": {"pages": "kernel", "long_runs": "dma", "layers": "kernel"},
    "fallback": {"pages": "index", "long_runs": "dma", "layers": "layers"},
    "pageable": {"pages": "dma", "long_runs": "dma", "layers": "host"},
}


def _went(pending: object, want: str) -> None:
    path = pending.path  # type: ignore[attr-defined]
    assert path == want, f"went by {path}, not {want} (table kernel: {kernel.unusable() or 'on'})"
    pending.result()  # type: ignore[attr-defined]


@needs_cuda
@pytest.mark.parametrize("way", list(WAYS))
def test_every_copy_shape_moves_the_same_bytes_both_ways(
    daemon_factory: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """Whole pages in order and shuffled, long runs, per-layer tensors with block
    rows and each worker's offset in wide pages: GPU -> pool -> GPU, byte for
    byte, and the pool holds what any process reads."""
    import hashlib

    monkeypatch.setattr(cuda, "TABLE_KERNEL", way == "table")
    ways = WAYS[way]
    d = daemon_factory(size_mib=32, slab_mib=4)
    rng = np.random.default_rng(3)
    with d.client() as c:
        if way != "pageable":
            c.pin_memory()
        # whole pages of 4 KiB: in order (one run) and shuffled
        ns = c.register(**NS)
        n = 24
        gpu = torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8, device="cuda")
        order = rng.permutation(n).tolist()
        tokens = np.arange(n * PAGE_TOKENS, dtype=np.uint32) + 5
        res = c.reserve(ns, tokens)
        _went(c.start_write(res, gpu), ways["pages"])
        c.commit(res)
        shuffled_tokens = tokens + 50_000
        res = c.reserve(ns, shuffled_tokens)
        _went(c.start_write(res.select(order), gpu), ways["pages"])
        c.commit(res)
        hit, shuffled = c.match(ns, tokens), c.match(ns, shuffled_tokens)
        assert np.array_equal(c.read_pages(hit), gpu.cpu().numpy())
        assert np.array_equal(c.read_pages(shuffled.select(order)), gpu.cpu().numpy())
        for got, view, want in ((hit, hit, gpu), (shuffled, shuffled.select(order), gpu)):
            back = torch.zeros_like(want)
            _went(c.start_read(view, back), ways["pages"])
            assert torch.equal(back, want)
            picked = torch.zeros_like(want)
            _went(c.start_read(got.select(order), picked), ways["pages"])
            assert torch.equal(picked, c_pages(c, got.select(order)))
            c.release(got)
        # pages of 256 KiB in order: runs of 1 MiB and more go by DMA
        big = c.register(**{**NS, "page_bytes": 256 << 10, "model": "test/big"})
        pages = torch.randint(0, 256, (8, 256 << 10), dtype=torch.uint8, device="cuda")
        res = c.reserve(big, tokens[: 8 * PAGE_TOKENS])
        # fresh slots of a new slab are adjacent: one run of 2 MiB
        one_run = bool(np.all(np.diff(res.offsets) == 256 << 10))
        long_runs = ways["long_runs"] if one_run else ways["pages"]
        _went(c.start_write(res, pages), long_runs)
        c.commit(res)
        hit = c.match(big, tokens[: 8 * PAGE_TOKENS])
        back = torch.zeros_like(pages)
        _went(c.start_read(hit, back), long_runs)
        assert torch.equal(back, pages)
        c.release(hit)
        # vLLM's shape: 4 per-layer tensors, blocks by id, two workers' halves of a page
        wide = c.register(**{**NS, "key_scheme": "vllm-sha256", "shards": 2})
        layers, blocks, width = 4, 40, PAGE_BYTES // 2 // 4
        keys = [hashlib.sha256(bytes([i, 9])).digest() + bytes(4) for i in range(12)]
        kv = [
            [torch.randint(0, 256, (blocks, width), dtype=torch.uint8, device="cuda")
             for _ in range(layers)]
            for _ in range(2)
        ]  # fmt: skip
        rows = rng.choice(blocks, 12, replace=False).tolist()
        res = c.reserve_keys(wide, keys)
        for rank in range(2):
            at = rank * PAGE_BYTES // 2
            _went(c.start_write(res, kv[rank], rows=rows, at=at), ways["layers"])
        c.commit(res)
        hit = c.match_keys(wide, keys)
        host = c.read_pages(hit)
        for rank in range(2):
            at = rank * PAGE_BYTES // 2
            for layer in range(layers):
                want = kv[rank][layer][rows].cpu().numpy()
                got_bytes = host[:, at + layer * width : at + (layer + 1) * width]
                assert np.array_equal(got_bytes, want), (rank, layer)
        targets = rng.choice(blocks, 12, replace=False).tolist()
        for rank in range(2):
            back = [torch.zeros_like(t) for t in kv[rank]]
            _went(c.start_read(hit, back, rows=targets, at=rank * PAGE_BYTES // 2), ways["layers"])
            for got_t, want_t in zip(back, kv[rank], strict=True):
                assert torch.equal(got_t[targets], want_t[rows])
                untouched = [b for b in range(blocks) if b not in targets]
                assert int(got_t[untouched].sum()) == 0
        c.release(hit)


def c_pages(c: object, view: object) -> object:
    """The pages of ``view`` as the pool holds them, on the GPU."""
    return torch.from_numpy(c.read_pages(view)).cuda()  # type: ignore[attr-defined]


@needs_cuda
@pytest.mark.parametrize("way", ["table", "fallback"])
def test_a_slot_reused_while_a_read_is_in_flight_makes_it_a_miss(
    daemon_factory: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """A read started on a stream held back by a long kernel (fault injection:
    torch.cuda._sleep slows the stream) is not done when its slots change
    owner; finishing it says it is a miss, whenever its bytes landed, and a
    read finished before the change was not."""
    monkeypatch.setattr(cuda, "TABLE_KERNEL", way == "table")
    d = daemon_factory(size_mib=1, slab_mib=1)
    with d.client() as c:
        c.pin_memory()
        ns = c.register(**NS)
        tokens = np.arange(4 * PAGE_TOKENS, dtype=np.uint32) + 77
        c.store(ns, tokens, np.full((4, PAGE_BYTES), 3, dtype=np.uint8))
        hit = c.match(ns, tokens)
        back = torch.zeros((4, PAGE_BYTES), dtype=torch.uint8, device="cuda")
        c.start_read(hit, back).result()  # intact: no miss
        assert int(back.float().mean()) == 3
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time ahead of the copy
        pending = c.start_read(hit, back)
        if way == "table":  # the other ways upload their index from pageable memory: that waits
            assert not pending.done(), "the copy finished behind a kernel that spins"
        c.release(hit)
        # every slot of the 1 MiB pool, taken by other pages: ours change owner
        other = np.arange(256 * PAGE_TOKENS, dtype=np.uint32) + 900_000
        taken = c.reserve(ns, other)
        assert len(taken.offsets) >= 200
        assert pending.wait(60.0)
        with pytest.raises(StaleHandle):
            pending.finish()
        c.abort(taken)
