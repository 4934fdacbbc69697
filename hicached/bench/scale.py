"""Scale: how match latency, index memory, start-up and the L3 scan grow with pages.

- match latency through real daemons with 1K, 100K and 1M pages in their
  indexes (three daemons, up side by side; each matches a 64-page sequence
  that hits, ``--requests`` times in all, in ROUNDS rounds in which the
  daemons take turns), beside a raw echo of the same request and reply sizes
  after each match; ratios to 1K are medians of the rounds' ratios;
- index bytes per page: a page index (the daemon's own class) of 1M pages in
  chains of 1,024, measured with tracemalloc;
- start-to-ready with 1M pages in the file store (written here with the
  store's own class), and the rate of the startup scan that runs after READY.

Pages are small (256 bytes) so that a million fit a modest pool; the figures
are about counts, not bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import multiprocessing as mp
import os
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from hicached.bench.control import _echo_request, _echo_server
from hicached.client import Client
from hicached.state.index import PageIndex
from hicached.testing import DaemonProcess
from hicached.wire import protocol as p
from hicached.wire.hashing import pack_tokens, page_keys

PAGE_BYTES = 256
CHAIN = 1024  # pages a stored sequence has
MATCH_PAGES = 64
ROUNDS = 8  # rounds of the match figures, each daemon in turn in every round
# whole sequences: 1K, 100K and 1M pages, give or take a few percent
STEPS = {"1k": CHAIN, "100k": 100 * CHAIN, "1m": CHAIN * CHAIN}
NS = dict(
    model="bench/scale", kv_dtype="bfloat16", layout="l", page_tokens=1, page_bytes=PAGE_BYTES
)


def _sequence(i: int) -> np.ndarray:
    """Token ids of stored sequence ``i``: distinct from every other one."""
    return (np.arange(CHAIN, dtype=np.uint32) + np.uint32(i) * np.uint32(CHAIN)) | np.uint32(
        1 << 31
    )


def _fill(client: Client, ns: Any, pages: int) -> None:
    """Store whole sequences until the index holds ``pages``."""
    for i in range(-(-pages // CHAIN)):
        res = client.reserve(ns, _sequence(i))
        assert not res.pool_full, "the bench pool is too small"
        client.commit(res)  # the bytes are whatever the slots held: only counts matter here


def _match_latency(
    client: Client, ns: Any, echo: Any, sizes: tuple[int, int], n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Round trips (us) of ``n`` leased matches of 64 pages that hit (each then
    released), and of as many echoes, one after each match."""
    tokens = pack_tokens(_sequence(0)[:MATCH_PAGES])
    request = _echo_request(*sizes)
    match = np.empty(n, np.int64)
    raw = np.empty(n, np.int64)
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        hit = client.match(ns, tokens)
        match[i] = clock() - t0
        client.release(hit)
        assert hit.hits == MATCH_PAGES
        t0 = clock()
        echo.send(request)
        echo.recv()
        raw[i] = clock() - t0
    return match / 1e3, raw / 1e3


def _match_rounds(
    clients: dict[str, tuple[Client, Any]], echo: Any, sizes: tuple[int, int], requests: int
) -> dict[str, float]:
    """Match latency of each daemon (one an index size) in ROUNDS rounds, the
    daemons taking turns and who goes first rotating, so that the machine's
    drift falls on every size alike; each ratio to 1K is the median of its
    rounds' ratios, with the lowest and highest."""
    tags = list(clients)
    per = max(1, requests // ROUNDS)
    matches: dict[str, list[np.ndarray]] = {tag: [] for tag in tags}
    echoes: dict[str, list[np.ndarray]] = {tag: [] for tag in tags}
    for client, ns in clients.values():  # warm up, untimed
        _match_latency(client, ns, echo, sizes, min(per, 100))
    for r in range(ROUNDS):
        for tag in tags[r % len(tags) :] + tags[: r % len(tags)]:
            match, raw = _match_latency(*clients[tag], echo, sizes, per)
            matches[tag].append(match)
            echoes[tag].append(raw)
    figures: dict[str, float] = {}
    for tag in tags:
        figures[f"match_p50_us_{tag}"] = round(float(np.median(np.concatenate(matches[tag]))), 1)
        figures[f"echo_p50_us_{tag}"] = round(float(np.median(np.concatenate(echoes[tag]))), 1)
    first = tags[0]
    for tag in tags[1:]:
        ratios = [
            float(np.median(m) / np.median(b))
            for m, b in zip(matches[tag], matches[first], strict=True)
        ]
        name = f"match_{tag}_vs_{first}"
        figures[name] = round(float(np.median(ratios)), 3)
        figures[f"{name}_min"] = round(min(ratios), 3)
        figures[f"{name}_max"] = round(max(ratios), 3)
    return figures


def _index_bytes_per_page(pages: int) -> float:
    """Bytes a page index holds per page, 1M pages in chains of 1,024."""
    gc.collect()
    tracemalloc.start()
    index = PageIndex()
    base = tracemalloc.get_traced_memory()[0]
    seed = bytes(16)
    slot = 0
    for i in range(pages // CHAIN):
        keys = page_keys(seed, pack_tokens(_sequence(i)), 1)
        index.insert(keys, range(slot, slot + CHAIN), owner=1)
        slot += CHAIN
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert index.pages == pages
    return used / pages


def _write_store(path: Path, pages: int, capacity_mib: int, segment_mib: int) -> None:
    """``pages`` records in a file store, with the store's own class."""
    from hicached_backends.base import BackendEnv, PageRef
    from hicached_backends.file import FileBackend
    from hicached_backends.options import FileOptions

    options = FileOptions(path=str(path), capacity_mib=capacity_mib, segment_mib=segment_mib)
    backend = FileBackend(options, BackendEnv(path.parent))
    payload = memoryview(bytearray(os.urandom(PAGE_BYTES)))
    ns = bytes(range(16))

    async def write() -> None:
        await backend.open()
        try:
            step = 16384
            for start in range(0, pages, step):
                refs = [
                    PageRef(i.to_bytes(16, "big"), payload)
                    for i in range(start, min(start + step, pages))
                ]
                assert all(await backend.put(ns, refs))
        finally:
            await backend.close()

    asyncio.run(write())


def _ready_and_scan(pages: int) -> tuple[float, float]:
    """Seconds from start to READY with ``pages`` in the file store; scan pages/s."""
    segment_mib = 64
    capacity_mib = max(segment_mib * 2, (pages * (PAGE_BYTES + 64) >> 20) * 2)
    options = f"[storage.file]\ncapacity_mib = {capacity_mib}\nsegment_mib = {segment_mib}\n"
    daemon = DaemonProcess(size_mib=64, populate=False, storage='backend = "file"\n', tail=options)
    try:
        _write_store(daemon.dir / "data" / "pages", pages, capacity_mib, segment_mib)
        t0 = time.perf_counter()
        daemon.start(timeout=120)
        ready = time.perf_counter() - t0
        with daemon.client(timeout=10) as client:
            deadline = time.monotonic() + 300
            while True:
                stats = client.stats()
                if stats.l3_state == "up" and stats.l3_pages_known >= min(
                    pages, stats.l3_known_max
                ):
                    break
                assert time.monotonic() < deadline, "the scan did not finish"
                time.sleep(0.01)
        scanned = time.perf_counter() - t0
        return ready, pages / max(scanned - ready, 1e-9)
    finally:
        daemon.cleanup()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import zmq

    figures: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="hc-echo-", dir="/tmp"))
        # one daemon a size, all up at once: their rounds alternate
        daemons = {
            tag: stack.enter_context(
                DaemonProcess(
                    size_mib=(pages * PAGE_BYTES >> 20) + 64,
                    slab_mib=4,
                    populate=False,
                    extra="max_pages_per_request = 16384",
                )
            )
            for tag, pages in STEPS.items()
        }
        os.chmod(tmp, 0o700)
        echo_endpoint = f"ipc://{tmp}/echo.sock"
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        server = ctx.Process(target=_echo_server, args=(echo_endpoint, ready), daemon=True)
        server.start()
        ready.wait(30)
        zctx = zmq.Context()
        echo = zctx.socket(zmq.DEALER)
        echo.setsockopt(zmq.LINGER, 0)
        echo.connect(echo_endpoint)
        try:
            clients: dict[str, tuple[Client, Any]] = {}
            for tag, pages in STEPS.items():
                client = stack.enter_context(daemons[tag].client(timeout=30))
                ns = client.register(**NS)  # type: ignore[arg-type]
                _fill(client, ns, pages)
                assert client.stats().pages >= pages
                clients[tag] = (client, ns)
            client, ns = clients["1k"]
            hit = client.match(ns, _sequence(0)[:MATCH_PAGES])
            client.release(hit)
            big = 1 << 40
            request = p.Match(
                id=big,
                deadline_ms=big,
                ns=ns.id,
                tokens=pack_tokens(_sequence(0)[:MATCH_PAGES]),
            )
            reply = p.MatchOk(id=big, hits=hit.hits, offsets=hit.offsets, lease=1 << 62)
            sizes = (len(p.encode(request)), len(p.encode(reply)))
            figures.update(_match_rounds(clients, echo, sizes, args.requests))
        finally:
            echo.send(b"stop")
            server.join(5)
            if server.is_alive():
                server.kill()
            echo.close()
            zctx.term()
    pool = {
        f"{k}_{args.pool_gib}g": v for k, v in attach_figures(args.pool_gib, args.hugetlbfs).items()
    }
    figures.update(pool)
    figures["index_bytes_per_page"] = round(_index_bytes_per_page(STEPS["1m"]), 1)
    ready_s, scan_rate = _ready_and_scan(STEPS["1m"])
    figures["ready_s_1m"] = round(ready_s, 2)
    figures["scan_pages_per_s"] = round(scan_rate)
    return {
        "figures": figures,
        "params": {
            "page_bytes": PAGE_BYTES,
            "sequence_pages": CHAIN,
            "match_pages": MATCH_PAGES,
            "requests": args.requests,
            "pool_gib": args.pool_gib,
            "hugetlbfs": args.hugetlbfs,
            "note": (
                "match: a leased match of 64 pages that hit, p50, at each index size (one "
                "daemon a size, in 8 rounds in which the daemons take turns; match_X_vs_1k: "
                "median of the rounds' ratios, with their lowest and highest), beside a raw "
                "echo of the same request and reply sizes; index bytes: tracemalloc of the "
                "daemon's page index with 1M pages; ready: start to READY with 1M pages in the "
                "file store; the scan runs after READY; attach: a client process maps a pool "
                "of pool_gib (tmpfs, and hugetlbfs when given), then touches every 4 KiB: "
                "attach time, touch time and its page-table growth (VmPTE)"
            ),
        },
        "targets": {
            "match_1m_vs_1k": "<= 1.2",
            "index_bytes_per_page": "<= 200",
            "ready_s_1m": "<= 10",
        },
    }


# -- attaching a large pool ------------------------------------------------------------


def _vm_pte_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmPTE:"):
                return int(line.split()[1])
    return 0


def _client_attach(path: str, size: int, out: Any) -> None:
    """In a fresh process: map the pool as a client does, then touch every page."""
    from hicached.wire.arena import Arena

    before = _vm_pte_kib()
    t0 = time.perf_counter()
    arena = Arena.attach(path, size)
    attach = time.perf_counter() - t0
    t0 = time.perf_counter()
    touched = int(arena.array[::4096].sum())  # one read per 4 KiB: every page-table entry
    touch = time.perf_counter() - t0
    out.put((attach, touch, _vm_pte_kib() - before, touched >= 0))
    arena.close()


def _attach_figures(directory: str, size: int, huge: str) -> tuple[float, float, int]:
    """(attach ms, touch-all s, page-table KiB) of one client process."""
    from hicached.wire.arena import Arena

    path = Path(directory) / f"hicached-bench-attach-{os.getpid()}.pool"
    arena = Arena.create(path, size, populate=True, huge_pages=huge)
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_client_attach, args=(str(path), size, out))
        proc.start()
        attach, touch, pte, _ = out.get(timeout=600)
        proc.join(30)
        return attach * 1e3, touch, pte
    finally:
        arena.close()


def attach_figures(pool_gib: int, hugetlbfs: str) -> dict[str, float]:
    """Attach time and page-table memory per client for a ``pool_gib`` pool, with
    4 KiB pages (tmpfs) and, given a hugetlbfs mount, with huge pages."""
    size = pool_gib << 30
    figures: dict[str, float] = {}
    attach_ms, touch_s, pte = _attach_figures("/dev/shm", size, "off")
    figures.update(attach_ms=round(attach_ms, 2), touch_all_s=round(touch_s, 2), pte_kib=pte)
    if hugetlbfs:
        attach_ms, touch_s, pte = _attach_figures(hugetlbfs, size, "hugetlbfs")
        figures.update(
            attach_ms_huge=round(attach_ms, 2), touch_all_s_huge=round(touch_s, 2), pte_kib_huge=pte
        )
    return figures
