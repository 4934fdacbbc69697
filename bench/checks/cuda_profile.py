"""On a GPU host: where a client's CUDA copy of 512 pages of 64 KiB spends its
time beside the link: a call waited for, the CPU time to queue one, and a
profile of each, in order and shuffled, against a raw pinned copy.

    PYTHONPATH=. python3 bench/checks/cuda_profile.py
"""

import cProfile
import io
import pstats
import time

import numpy as np
import torch

from hicached.bench.data import reserve_slots
from hicached.client import Client
from hicached.testing import DaemonProcess

pages, page_bytes = 512, 65536
out = {}
with (
    DaemonProcess(size_mib=1024, slab_mib=64, max_page_bytes=4 << 20) as d,
    Client(d.endpoint, timeout=10.0) as c,
):
    ns, res, _ = reserve_slots(c, "prof", pages, page_bytes)
    gpu = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, device="cuda")
    c.pin_memory()
    order = np.random.default_rng(1).permutation(pages).tolist()
    shuffled = res.select(order)
    for name, h in (("inorder", res), ("shuffled", shuffled)):
        for _ in range(5):
            c.write_pages(h, gpu)
        torch.cuda.synchronize()
        t = time.perf_counter()
        n = 50
        for _ in range(n):
            c.write_pages(h, gpu)
        torch.cuda.synchronize()
        out[name + "_ms"] = (time.perf_counter() - t) / n * 1e3
        # CPU time to enqueue only (no wait): start_write then finish later
        t = time.perf_counter()
        pend = [c.start_write(h, gpu) for _ in range(n)]
        out[name + "_enqueue_ms"] = (time.perf_counter() - t) / n * 1e3
        for p_ in pend:
            p_.result()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            c.write_pages(h, gpu)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(25)
        out[name + "_profile"] = s.getvalue()[-6000:]
    link = torch.empty((pages, page_bytes), dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        link.copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    out["raw_ms"] = (time.perf_counter() - t) / 50 * 1e3
for k, v in out.items():
    print(f"== {k}\n{v}")
