"""On a GPU host: DMA and table-kernel rates by the kind of host memory (a torch
pinned buffer; anonymous, /dev/shm and transparent-huge-page mappings
registered with CUDA as the pool is) and by piece size, block size and warps,
the kernel alone on a 64 MiB table of shuffled pieces. One JSON object.

    PYTHONPATH=. python3 bench/checks/cuda_probe.py
"""

import json
import mmap
import os
import time

import numpy as np
import torch

from hicached.client import cuda as hc
from hicached.client import kernel

dev = torch.device("cuda")
N = 64 << 20
res = {}


def bw(fn, nbytes, reps=10):
    fn()
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = max(best, nbytes * reps / (time.perf_counter() - t) / 1e9)
    return round(best, 2)


gpu = torch.randint(0, 256, (N,), dtype=torch.uint8, device=dev)
pin = torch.empty(N, dtype=torch.uint8, pin_memory=True)
res["torch_pinned_h2d"] = bw(lambda: gpu.copy_(pin, non_blocking=True), N)
res["torch_pinned_d2h"] = bw(lambda: pin.copy_(gpu, non_blocking=True), N)
rt = torch.cuda.cudart()


def table_for(host_ptr, piece, shuffle, to_host):
    n = N // piece
    order = np.random.default_rng(0).permutation(n) if shuffle else np.arange(n)
    g = gpu.data_ptr() + np.arange(n, dtype=np.int64) * piece
    h = host_ptr + order.astype(np.int64) * piece
    src, dst = (g, h) if to_host else (h, g)
    return np.stack([src, dst, np.full(n, piece, dtype=np.int64)])


def kernel_rate(table, block, warps):
    base = gpu
    units = np.empty_like(table)
    np.subtract(table[:2], base.data_ptr(), out=units[:2])
    units[2] = table[2]
    units >>= 4
    rows = torch.from_numpy(units).to(dev)
    words = base.view(torch.int64)
    count = table.shape[1]
    return bw(
        lambda: kernel._copy_pieces[(count,)](rows, count, words, BLOCK=block, num_warps=warps), N
    )


def variant(name, mm):
    arr = np.frombuffer(mm, dtype=np.uint8)
    arr[:] = 1
    err = rt.cudaHostRegister(arr.ctypes.data, arr.nbytes, 3)
    if int(err):
        res[name + "_err"] = int(err)
        return
    host = torch.from_numpy(arr)
    res[name + "_dma_h2d"] = bw(lambda: gpu.copy_(host, non_blocking=True), N)
    res[name + "_dma_d2h"] = bw(lambda: host.copy_(gpu, non_blocking=True), N)
    view = torch.as_tensor(hc._Interface(arr), device="cuda")
    res[name + "_dev_d2d_like_h2d"] = bw(lambda: gpu.copy_(view), N)
    res[name + "_dev_d2d_like_d2h"] = bw(lambda: view.copy_(gpu), N)
    idx = torch.from_numpy(np.random.default_rng(0).permutation(N // 65536)).to(dev)
    rows = view.view(-1, 65536)
    g2 = gpu.view(-1, 65536)
    res[name + "_index_select_64k"] = bw(lambda: torch.index_select(rows, 0, idx, out=g2), N)
    res[name + "_index_copy_64k"] = bw(lambda: rows.index_copy_(0, idx, g2), N)
    for piece in (16384, 65536):
        for block, warps in ((1024, 4), (1024, 8), (2048, 8), (4096, 16)):
            for to_host in (True, False):
                t = table_for(arr.ctypes.data, piece, True, to_host)
                way = "d2h" if to_host else "h2d"
                k = f"{name}_kernel_{piece // 1024}k_b{block}_w{warps}_{way}"
                try:
                    res[k] = kernel_rate(t, block, warps)
                except Exception as exc:
                    res[k] = f"{type(exc).__name__}: {exc}"[:200]
    torch.cuda.synchronize()
    rt.cudaHostUnregister(arr.ctypes.data)


variant("anon", mmap.mmap(-1, N, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS))
fd = os.open("/dev/shm/hicached-probe", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, N)
variant("shm", mmap.mmap(fd, N, flags=mmap.MAP_SHARED))
a2 = mmap.mmap(-1, N, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
try:
    a2.madvise(mmap.MADV_HUGEPAGE)
except Exception as exc:
    res["thp_err"] = str(exc)
variant("anon_thp", a2)
try:
    variant("hugetlb", mmap.mmap(-1, N, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000))
except Exception as exc:
    res["hugetlb_err"] = str(exc)
print(json.dumps(res))
