"""The table kernel (hicached/client/kernel.py), run where Triton is installed
(tests/test_copy_kernel.py runs this in such a python). Prints one JSON object.

    copy_kernel_check.py run   # with TRITON_INTERPRET=1: the kernel on CPU tensors
    copy_kernel_check.py ptx   # without it: compiled for sm_90, its loads and stores

``run`` copies through ``cuda._by_table`` (the CUDA path's table launch) with
a CPU tensor standing for the pool's CUDA view: whole pages in order and
shuffled, per-layer tensors with rows and ``at``, both directions, pieces
split, bytes compared with numpy's copy; pieces that are not 16-byte aligned
and a write of two pages into one slot go the other ways; a kernel that
fails to launch (fault injection: a stand-in that raises) turns the kernel
off once, said once in the log.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

import numpy as np


def _case(
    name: str,
    pool: np.ndarray,
    slots: np.ndarray,
    layers: list[Any],
    picks: np.ndarray | None,
    at: int,
    to_pool: bool,
) -> dict[str, Any]:
    """One copy by the kernel; its bytes against numpy's."""
    import torch

    from hicached.client import cuda

    want_pool = pool.copy()
    want_layers = [t.clone() for t in layers]
    rows = np.arange(len(slots)) if picks is None else picks
    for slot, row in zip(slots, rows, strict=True):
        place = at
        for mine, t in zip(want_layers, layers, strict=True):
            width = t[0].numel() * t.element_size()
            raw = mine.view(torch.uint8).reshape(t.shape[0], -1)
            if to_pool:
                want_pool[slot, place : place + width] = raw[row].numpy()
            else:
                raw[row] = torch.from_numpy(pool[slot, place : place + width].copy())
            place += width
    mapped = torch.from_numpy(pool.reshape(-1))
    segs = [cuda.segment(t) for t in layers]
    ran = cuda._by_table(pool, slots, segs, picks, at, to_pool, mapped)
    same = np.array_equal(pool, want_pool) and all(  # as bytes: NaN is not NaN
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(layers, want_layers, strict=True)
    )
    return {"name": name, "kernel": ran, "bytes_equal": same}


def run() -> dict[str, Any]:
    import torch

    from hicached.client import cuda, kernel, pieces

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hicached.client.kernel").addHandler(handler)
    kernel.PIECE_BYTES = 1024  # pieces split into several programs each
    rng = np.random.default_rng(7)
    page = 4096
    out: list[dict[str, Any]] = []
    for to_pool in (True, False):
        d = "write" if to_pool else "read"
        pool = rng.integers(0, 256, (24, page), dtype=np.uint8)
        pages = torch.randint(0, 256, (8, page), dtype=torch.uint8)
        out.append(_case(f"{d}_in_order", pool, np.arange(3, 11), [pages], None, 0, to_pool))
        shuffled = rng.permutation(24)[:8]
        out.append(_case(f"{d}_shuffled", pool, shuffled, [pages], None, 0, to_pool))
        bf16 = torch.randn((8, page // 2), dtype=torch.float32).to(torch.bfloat16)
        out.append(_case(f"{d}_bf16", pool, shuffled, [bf16], None, 0, to_pool))
        # vLLM's shape: 4 layers of 32 blocks, 256 bytes a block, blocks by id,
        # worker 1 of 2 of a wide page (at = half a page)
        layers = [torch.randint(0, 256, (32, 2, 128), dtype=torch.uint8) for _ in range(4)]
        blocks = rng.permutation(32)[:8]
        out.append(_case(f"{d}_layers_rows_at", pool, shuffled, layers, blocks, page // 2, to_pool))
        adjacent = np.arange(5, 13)
        out.append(
            _case(f"{d}_layers_adjacent", pool, adjacent, layers, np.arange(8) + 9, 0, to_pool)
        )
        # rows 48 bytes apart, 32 of them copied: a slice of a wider tensor
        wide = torch.randint(0, 256, (32, 48), dtype=torch.uint8)
        out.append(_case(f"{d}_strided_rows", pool, shuffled, [wide[:, :32]], blocks, 64, to_pool))
    # a table laid out in Fortran order (as numpy's fancy indexing can leave
    # one): the launch hands the kernel a C-ordered copy
    pool = rng.integers(0, 256, (24, page), dtype=np.uint8)
    want = pool.copy()
    src = torch.randint(0, 256, (4, page), dtype=torch.uint8)
    slots = rng.permutation(24)[:4]
    for j, slot in enumerate(slots):
        want[slot] = src[j].numpy()
    table = pieces.build(
        pieces.Pool(pool.ctypes.data, page, 24), slots, [cuda.segment(src)], None, 0, to_pool=True
    )
    launched = kernel.launch(np.asfortranarray(table), torch.from_numpy(pool.reshape(-1)))
    fortran = {"kernel": launched, "bytes_equal": bool(np.array_equal(pool, want))}
    # not the kernel's: pieces 8 bytes off 16 (the other ways copy them)
    pool = rng.integers(0, 256, (24, page), dtype=np.uint8)
    odd = [torch.randint(0, 256, (32, 24), dtype=torch.uint8)]
    unaligned = _case("unaligned", pool, np.arange(4), odd, np.arange(4), 8, True)
    twice = _case(
        "one_slot_twice", pool, np.array([2, 2]), [torch.zeros((2, page), dtype=torch.uint8)],
        None, 0, True,
    )  # fmt: skip
    still_on = kernel.unusable() is None
    # a launch that fails (fault injection): the kernel is off from then on, said once
    real = kernel._copy_pieces

    class Broken:
        def __getitem__(self, grid: object) -> Any:
            def fail(*args: object, **kwargs: object) -> None:
                raise RuntimeError("injected compile failure")

            return fail

    kernel._copy_pieces = Broken()
    try:
        after_fault = [
            _case("after_fault", pool, np.arange(2), [pages[:2]], None, 0, True) for _ in range(2)
        ]
    finally:
        kernel._copy_pieces = real
    return {
        "cases": out,
        "fortran_table": fortran,
        "unaligned": unaligned,
        "one_slot_twice": twice,
        "on_after_refusals": still_on,
        "after_fault": after_fault,
        "off_reason": kernel.unusable(),
        "log": records,
    }


def ptx() -> dict[str, Any]:
    """The kernel compiled for an H100/H200 (sm_90) without a GPU: its global
    loads and stores."""
    import triton
    from triton.backends.compiler import GPUTarget

    from hicached.client import kernel

    sig = {"table": "*i64", "count": "i64", "base": "*i64", "BLOCK": "constexpr"}
    attrs = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    try:
        src = triton.compiler.ASTSource(
            fn=kernel._copy_pieces, signature=sig, constexprs={"BLOCK": kernel._BLOCK}, attrs=attrs
        )
        compiled = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": kernel._WARPS}
        )
    except Exception as exc:  # the kernel's source, or a Triton that cannot compile for CUDA here
        from triton.compiler.errors import CompilationError

        why = f"{type(exc).__name__}: {exc}"[:500]
        return {"compiled": False, "why": why, "source": isinstance(exc, CompilationError)}
    text = compiled.asm["ptx"]
    ops = sorted(set(re.findall(r"\b((?:ld|st)\.global[\w.]*)", text)))
    return {"compiled": True, "ops": ops, "triton": triton.__version__}


if __name__ == "__main__":
    print(json.dumps(run() if sys.argv[1] == "run" else ptx()))
