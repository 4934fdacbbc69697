"""The CUDA path: the pool pinned for CUDA, GPU <-> slot copies by DMA.

The copy planner runs everywhere; the tests that move bytes need a CUDA
device and run on one (the CPU-only suite skips them, saying so).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hicached import cuda
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
