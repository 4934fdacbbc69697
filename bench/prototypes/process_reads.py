"""Prototype, not part of hicached: verified hot reads of the file store by
worker processes, each with its own GIL.

Why: in one process, checksums of 64 KiB pages queue for the GIL that each
native call gives up and takes back, so verified hot reads stay near 0.2 of
a raw preadv (docs/perf.md, "A 16-core H100 host"). This measures what
reads and checksums in worker processes reach, before such a reader is built.

The parent fills a FileBackend store with 128 MiB of pages per size (64 KiB,
1 MiB) from a pool file in /dev/shm. Each worker maps that pool, opens the
segment files, and for each request (4 MiB of records) reads the records
with preadv (header to a local buffer, payload into its pool slot) and
verifies them with ``verify_many``, in runs of ``SUB_BYTES`` (default: the
whole request), answering one byte per page. The parent keeps one request in
flight per worker. In the same run, in rounds: the raw hot preadv on 4
threads and the store's own ``get()`` (threads), as ``bench l3`` drives it.

    PYTHONPATH=. WORKERS=8 python bench/prototypes/process_reads.py
"""

import asyncio
import mmap
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ITEM = np.dtype(
    [
        ("seg", "<u4"),
        ("length", "<u4"),
        ("foff", "<u8"),
        ("gen", "<u8"),
        ("poff", "<u8"),
        ("key", "S16"),
    ]
)
NS = bytes(range(16))


def worker_main(pool_path: str, pool_bytes: int) -> None:
    from hicached_backends.record import HEADER_BYTES, verify_many

    fd = os.open(pool_path, os.O_RDWR)
    pool = mmap.mmap(fd, pool_bytes)
    view = memoryview(pool)
    seg_fds: dict[str, int] = {}
    rin, wout = sys.stdin.buffer, sys.stdout.buffer
    paths: list[str] = []
    sub_bytes = int(os.environ.get("SUB_BYTES", str(1 << 30)))
    while True:
        head = rin.read(4)
        if len(head) < 4:
            return
        (size,) = struct.unpack("<I", head)
        body = rin.read(size)
        if body[:1] == b"P":  # segment paths
            paths = body[1:].decode().split("\n")
            continue
        ns = body[:16]
        items = np.frombuffer(body, ITEM, offset=16)
        n = len(items)
        heads = memoryview(bytearray(HEADER_BYTES * n))
        segs = items["seg"].tolist()
        foffs = items["foff"].tolist()
        lens = items["length"].tolist()
        poffs = items["poff"].tolist()
        bufs = [view[p : p + ln] for p, ln in zip(poffs, lens, strict=True)]
        gens = items["gen"].tolist()
        sub = max(1, min(512, sub_bytes // max(1, lens[0])))
        ok = [False] * n
        kb = items["key"].tobytes()
        good: list[bool] = []
        i = 0
        while i < n:
            end = foffs[i] + HEADER_BYTES + lens[i]
            j = i + 1
            while j < n and j - i < sub and segs[j] == segs[i] and foffs[j] == end:
                end += HEADER_BYTES + lens[j]
                j += 1
            iov = []
            for k in range(i, j):
                iov += (heads[k * HEADER_BYTES : (k + 1) * HEADER_BYTES], bufs[k])
            path = paths[segs[i]]
            sfd = seg_fds.get(path)
            if sfd is None:
                sfd = seg_fds[path] = os.open(path, os.O_RDONLY)
            got = os.preadv(sfd, iov, foffs[i])
            ok[i:j] = [got == end - foffs[i]] * (j - i)
            # verify this run while its bytes are still in cache
            good += verify_many(
                np.frombuffer(heads, np.uint8)[i * HEADER_BYTES : j * HEADER_BYTES].reshape(
                    j - i, HEADER_BYTES
                ),
                bufs[i:j],
                ns,
                [kb[16 * k : 16 * k + 16] for k in range(i, j)],
                gens[i:j],
            )
            i = j
        out = bytes(a and b for a, b in zip(ok, good, strict=True))
        wout.write(struct.pack("<I", len(out)) + out)
        wout.flush()


class Worker:
    def __init__(self, pool_path: str, pool_bytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "worker", pool_path, str(pool_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )

    def send(self, payload: bytes) -> None:
        self.proc.stdin.write(struct.pack("<I", len(payload)) + payload)

    def call(self, payload: bytes) -> bytes:
        self.send(payload)
        (size,) = struct.unpack("<I", self._read(4))
        return self._read(size)

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.proc.stdout.read(n - len(out))
            if not chunk:
                raise RuntimeError("worker died")
            out += chunk
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(5)


def measure(size: int, nworkers: int) -> dict[str, float]:
    """Hot reads of 128 MiB of pages of ``size``: worker processes, raw, threads."""
    from hicached.bench.l3 import _drive, _RawFile
    from hicached.config import StorageConfig
    from hicached_backends.base import BackendEnv, PageRef
    from hicached_backends.file import FileBackend
    from hicached_backends.options import FileOptions

    pages = (128 << 20) // size
    pool_bytes = 2 * pages * size
    pool_path = f"/dev/shm/hc-proto-{os.getpid()}"
    pfd = os.open(pool_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(pfd, pool_bytes)
    pool = mmap.mmap(pfd, pool_bytes)
    arr = np.frombuffer(pool, np.uint8).reshape(2 * pages, size)
    buf = SimpleNamespace(src=arr[:pages], dst=arr[pages:], keys=[])
    buf.src[:] = np.random.default_rng(size).integers(0, 256, buf.src.shape, dtype=np.uint8)
    buf.keys = [os.urandom(16) for _ in range(pages)]
    config = StorageConfig()
    loop = asyncio.new_event_loop()
    try:
        with tempfile.TemporaryDirectory(prefix="hc-proto-") as tmp:
            backend = FileBackend(
                FileOptions(io_threads=4, capacity_mib=1024),
                BackendEnv(Path(tmp), pool=memoryview(pool)),
            )

            def refs(rows: np.ndarray) -> list[PageRef]:
                return [PageRef(k, rows[i].data) for i, k in enumerate(buf.keys)]

            async def setup() -> None:
                await backend.open()
                await _drive(backend, "put", refs(buf.src), config)

            loop.run_until_complete(setup())
            raw = _RawFile(buf, Path(tmp), 4)  # buf: the fields of bench l3's Buffers it reads
            raw.write()
            paths = "\n".join(str(seg.path) for seg in backend.segments).encode()
            workers = [Worker(pool_path, pool_bytes) for _ in range(nworkers)]
            for w in workers:
                w.send(b"P" + paths)
            items = np.zeros(pages, ITEM)
            for i, k in enumerate(buf.keys):
                loc = backend.index[(NS, k)]
                items[i] = (
                    loc.segment,
                    loc.length,
                    loc.offset,
                    loc.generation,
                    (pages + i) * size,
                    k,
                )
            order = np.lexsort((items["foff"], items["seg"]))
            per = max(1, (4 << 20) // size)  # requests of 4 MiB, in store order
            batches = [NS + items[order[b : b + per]].tobytes() for b in range(0, pages, per)]

            def proc_read() -> float:
                nxt = iter(range(len(batches)))
                lock = threading.Lock()
                bad: list[int] = []

                def run(w: Worker) -> None:
                    while True:
                        with lock:
                            b = next(nxt, None)
                        if b is None:
                            return
                        reply = w.call(batches[b])
                        if reply.count(1) != len(reply):
                            bad.append(b)

                ts = [threading.Thread(target=run, args=(w,)) for w in workers]
                t0 = time.perf_counter()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                took = time.perf_counter() - t0
                assert not bad, f"{len(bad)} requests failed verification"
                return took

            def raw_read() -> float:
                return raw.read(cold=False)

            def threads_read() -> float:
                return loop.run_until_complete(_drive(backend, "get", refs(buf.dst), config))

            got: dict[str, list[float]] = {"proc": [], "raw": [], "threads": []}
            for _ in range(7):
                for name, fn in (("proc", proc_read), ("raw", raw_read), ("threads", threads_read)):
                    buf.dst[:] = 0
                    got[name].append(fn())
                    assert np.array_equal(buf.src, buf.dst), name
            for w in workers:
                w.close()
            raw.close()
            loop.run_until_complete(backend.close())
    finally:
        loop.close()
        os.close(pfd)
        os.unlink(pool_path)
    med = {k: statistics.median(v) for k, v in got.items()}
    out = {f"{k}_gbps": round(pages * size / v / 1e9, 2) for k, v in med.items()}
    out["proc_vs_raw"] = round(med["raw"] / med["proc"], 3)
    out["threads_vs_raw"] = round(med["raw"] / med["threads"], 3)
    return out


def main() -> None:
    nworkers = int(os.environ.get("WORKERS", "4"))
    for size in (65536, 1 << 20):
        print(f"{size >> 10}k", f"workers={nworkers}", measure(size, nworkers), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker_main(sys.argv[2], int(sys.argv[3]))
    else:
        main()
