"""L3 backends: write (durable) and read throughput vs the raw client, same run.

For each page size (64 KiB and 1 MiB) the same bytes go through the backend
the way the dispatcher drives it (batches of ``storage.batch_pages``,
``storage.concurrency`` calls at once) and through the backend's raw client:

- file: pwrite of every page into a preallocated file and one fsync; cold
  reads with preadv from as many threads as the backend uses (the page cache
  is dropped for both before reading);
- s3: boto3 put_object/get_object of the page bytes with the same number of
  threads (against a real S3 server on loopback unless --s3-endpoint is given);
- mooncake: the store's own batch put/get from the same registered buffer
  (against a master started here unless --mooncake-master is given).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from hicached.config import StorageConfig
from hicached.wire.arena import Arena
from hicached_backends.base import Backend, BackendEnv, PageRef
from hicached_backends.options import FileOptions, MooncakeOptions, S3Options

SIZES = {"64k": 64 << 10, "1m": 1 << 20}
NS = bytes(range(16))


class Buffers:
    """Source pages and a read target, in one pool file as the daemon maps it
    (the backend's 'pool', which its helper processes map too)."""

    def __init__(self, pages: int, size: int, directory: Path) -> None:
        self.arena = Arena.create(directory / f"bench-{size}.pool", 2 * pages * size)
        arr = self.arena.array.reshape(2 * pages, size)
        self.src, self.dst = arr[:pages], arr[pages:]
        self.src[:] = np.random.default_rng(size).integers(0, 256, self.src.shape, dtype=np.uint8)
        self.view = self.arena.array.data
        self.keys = [os.urandom(16) for _ in range(pages)]

    def env(self, data_dir: Path) -> BackendEnv:
        return BackendEnv(data_dir, pool=self.view, pool_path=str(self.arena.path))

    def close(self) -> None:
        del self.src, self.dst, self.view
        self.arena.close()

    def refs(self, which: np.ndarray) -> list[PageRef]:
        """The pages of ``which`` (src or dst) as the daemon hands them to a
        backend: slices of the pool's memoryview, made anew for each call."""
        size = which.shape[1]
        at = which.ctypes.data - self.src.ctypes.data  # where ``which`` starts in the pool
        view = self.view
        return [
            PageRef(k, view[at + i * size : at + (i + 1) * size]) for i, k in enumerate(self.keys)
        ]


CHECKSUM_THREADS = (1, 2, 4)


def checksum_gbps(rows: np.ndarray, threads: int, *, batched: bool, rounds: int = 5) -> float:
    """GB/s of the record checksum alone over ``rows`` on ``threads`` threads;
    the median of ``rounds`` after one untimed. Each round hashes at least
    256 MiB (the pages again as often as needed), so thread start-up does not
    make the figure; pages that fit in the CPU's cache (a small ``--mib``) are
    hashed from it. How far verification can scale on this host.

    ``batched``: each thread takes one contiguous part and hashes it with one
    ``checksums`` call (the backends' way: a ``map`` of the native function
    over the part's addresses); else each page is one ``checksum`` call in a
    Python loop, pages dealt to the threads in turn (the way before). Either
    way every page's hash is a foreign call that gives the GIL up and takes it
    back; what differs is the Python held around it."""
    from hicached_backends.record import checksum, checksums, native_checksum

    if not native_checksum():
        raise SystemExit("the native XXH3 of the xxhash module is not loadable here")
    views = [rows[i].data for i in range(len(rows))]
    repeat = -(-(256 << 20) // max(1, rows.nbytes))
    views *= repeat
    n = len(views)
    if batched:
        parts = [views[n * k // threads : n * (k + 1) // threads] for k in range(threads)]
    else:
        parts = [views[k::threads] for k in range(threads)]

    def run(part: list[memoryview]) -> None:
        if batched:
            checksums(part)
            return
        for view in part:
            checksum(view)

    took = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            list(pool.map(run, parts))
            took.append(time.perf_counter() - t0)
    return rows.nbytes * repeat / statistics.median(took[1:]) / 1e9


async def _drive(backend: Backend, op: str, refs: list[PageRef], config: StorageConfig) -> float:
    gate = asyncio.Semaphore(config.concurrency)
    step = config.batch_pages

    async def one(batch: list[PageRef]) -> None:
        async with gate:
            result = await getattr(backend, op)(NS, batch)
            assert all(result), f"{op} failed for {result.count(False)} pages"

    t0 = time.perf_counter()
    await asyncio.gather(*(one(refs[i : i + step]) for i in range(0, len(refs), step)))
    return time.perf_counter() - t0


def _drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- raw baselines -------------------------------------------------------------------
#
# Each baseline writes the same pages once (timed), then reads them back as often
# as the bench asks; the bench alternates its rounds with the backend's.


_IOV_MAX = 1024  # iovecs one pwritev/preadv call takes on Linux


class _RawFile:
    """The best plain technique with the backend's thread count: each thread
    writes (then reads) one contiguous part of a preallocated file with
    vectored calls of up to IOV_MAX pages; one fdatasync; cold reads."""

    def __init__(self, buf: Buffers, directory: Path, threads: int) -> None:
        self.buf, self.threads = buf, threads
        self.path = directory / "raw.bin"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        pages, size = buf.src.shape
        os.posix_fallocate(self.fd, 0, pages * size)

    def _each(self, fn: Any, threads: int | None = None) -> float:
        """Time ``fn`` over contiguous parts of the pages, one a thread."""
        threads = threads or self.threads
        pages = len(self.buf.src)
        parts = [range(pages * k // threads, pages * (k + 1) // threads) for k in range(threads)]
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(fn, parts))
            return time.perf_counter() - t0

    def write(self) -> float:
        size = self.buf.src.shape[1]

        def write(part: range) -> None:
            for start in range(part.start, part.stop, _IOV_MAX):
                rows = range(start, min(start + _IOV_MAX, part.stop))
                os.pwritev(self.fd, [self.buf.src[i].data for i in rows], start * size)

        took = self._each(write)
        t0 = time.perf_counter()
        os.fdatasync(self.fd)
        return took + time.perf_counter() - t0

    def read(self, cold: bool = True, threads: int | None = None) -> float:
        """Read every page back (``threads``: so many instead of the backend's)."""
        size = self.buf.src.shape[1]
        if cold:
            _drop_cache([self.path])

        def read(part: range) -> None:
            for start in range(part.start, part.stop, _IOV_MAX):
                rows = range(start, min(start + _IOV_MAX, part.stop))
                os.preadv(self.fd, [self.buf.dst[i].data for i in rows], start * size)

        return self._each(read, threads)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink()


class _RawS3:
    """boto3 put_object/get_object of the page bytes, as many threads as the backend."""

    def __init__(self, buf: Buffers, options: S3Options) -> None:
        import boto3
        import botocore.config

        self.buf, self.threads, self.bucket = buf, options.threads, options.bucket
        self.client = boto3.client(
            "s3",
            endpoint_url=options.endpoint_url or None,
            aws_access_key_id=options.access_key_id or None,
            aws_secret_access_key=options.secret_access_key or None,
            region_name=options.region or None,
            config=botocore.config.Config(
                retries={"mode": "standard", "max_attempts": options.max_attempts},
                max_pool_connections=options.threads,
            ),
        )
        self.names = [f"raw/{k.hex()}" for k in buf.keys]

    def _each(self, fn: Any) -> float:
        with ThreadPoolExecutor(self.threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(fn, range(len(self.names))))
            return time.perf_counter() - t0

    def write(self) -> float:
        def put(i: int) -> None:
            body = bytes(self.buf.src[i].data)
            self.client.put_object(Bucket=self.bucket, Key=self.names[i], Body=body)

        return self._each(put)

    def read(self) -> float:
        def get(i: int) -> None:
            body = self.client.get_object(Bucket=self.bucket, Key=self.names[i])["Body"].read()
            self.buf.dst[i] = np.frombuffer(body, np.uint8)

        return self._each(get)

    def close(self) -> None:
        self.client.close()


class _RawMooncake:
    """The store's own batch put/get, from the same registered buffers and client."""

    def __init__(self, buf: Buffers, backend: Any, config: StorageConfig) -> None:
        self.buf, self.config = buf, config
        self.store = backend._store  # the client and registered memory the backend uses
        self.names = [f"raw/{k.hex()}" for k in buf.keys]

    def _run(self, op: str, rows: np.ndarray) -> float:
        names, size, step = self.names, rows.shape[1], self.config.batch_pages
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.config.concurrency) as pool:
            calls = [
                pool.submit(
                    getattr(self.store, op),
                    names[i : i + step],
                    [int(rows[j].ctypes.data) for j in range(i, min(i + step, len(names)))],
                    [size] * len(names[i : i + step]),
                )
                for i in range(0, len(names), step)
            ]
            for call in calls:
                codes = call.result()
                assert all(c >= 0 for c in codes), codes
        return time.perf_counter() - t0

    def write(self) -> float:
        self.store.batch_remove(self.names, True)  # the last round's (untimed): a put is new
        return self._run("batch_put_from", self.buf.src)

    def read(self) -> float:
        return self._run("batch_get_into", self.buf.dst)

    def close(self) -> None:
        self.store.batch_remove(self.names, True)


# -- services -------------------------------------------------------------------------


@contextlib.contextmanager
def _backend_options(args: argparse.Namespace, tmp: Path) -> Iterator[Any]:
    if args.backend == "file":
        yield FileOptions(
            path=str(tmp / "store"),
            capacity_mib=max(4 * args.mib, 64),
            segment_mib=max(args.mib // 2, 16),
            read_processes="auto" if args.read_processes is None else args.read_processes,
        )
    elif args.backend == "s3":
        from hicached.testing import CREDENTIALS, S3Server

        if args.s3_endpoint:
            yield S3Options(bucket=args.s3_bucket, endpoint_url=args.s3_endpoint, threads=16)
            return
        server = S3Server()
        try:
            server.make_bucket("bench")
            yield S3Options(
                bucket="bench",
                endpoint_url=server.endpoint,
                threads=16,
                access_key_id=CREDENTIALS["access_key_id"],
                secret_access_key=CREDENTIALS["secret_access_key"],
                region=CREDENTIALS["region"],
            )
        finally:
            server.stop()
    elif args.backend == "mooncake":
        from hicached.testing import MooncakeMaster

        segment = 4 * args.mib + 64
        if args.mooncake_master:
            yield MooncakeOptions(
                master=args.mooncake_master,
                metadata_server=args.mooncake_metadata,
                global_segment_mib=segment,
            )
            return
        master = MooncakeMaster()
        try:
            yield MooncakeOptions(
                master=master.master, metadata_server=master.metadata, global_segment_mib=segment
            )
        finally:
            master.stop()
    else:
        raise SystemExit(f"unknown backend {args.backend!r}: file, s3 or mooncake")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hicached_backends import load_backend_class

    cls = load_backend_class(args.backend)
    config = StorageConfig()
    figures: dict[str, float] = {}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with (
        tempfile.TemporaryDirectory(prefix="hc-bench-l3-") as tmp_name,
        tempfile.TemporaryDirectory(prefix="hc-bench-l3-", dir=shm) as pool_dir,
        _backend_options(args, Path(tmp_name)) as options,
    ):
        tmp = Path(tmp_name)
        readers = options.readers() if isinstance(options, FileOptions) else 0
        for tag, size in SIZES.items():
            pages = max(8, (args.mib << 20) // size)
            buf = Buffers(pages, size, Path(pool_dir))
            backend = cls(options, buf.env(tmp))

            async def measure(
                backend: Backend = backend, buf: Buffers = buf
            ) -> tuple[list[float], list[float], dict[str, tuple[list[float], list[float]]]]:
                await backend.open()
                raw: _RawFile | _RawS3 | _RawMooncake
                if args.backend == "file":
                    raw = _RawFile(buf, tmp, options.io_threads)
                elif args.backend == "s3":
                    raw = _RawS3(buf, options)
                else:
                    raw = _RawMooncake(buf, backend, config)
                try:

                    async def ours_put() -> float:
                        # new pages each round; the last round's go first (untimed),
                        # so rounds never need more room than one
                        await backend.delete(NS, buf.keys)
                        buf.keys = [os.urandom(16) for _ in buf.keys]
                        return await _drive(backend, "put", buf.refs(buf.src), config)

                    async def raw_put() -> float:
                        return raw.write()

                    async def ours(cold: bool = True) -> float:
                        if args.backend == "file" and cold:
                            _drop_cache(sorted((tmp / "store").glob("segment-*.hcs")))
                        return await _drive(backend, "get", buf.refs(buf.dst), config)

                    async def theirs(cold: bool = True) -> float:
                        return raw.read(cold) if isinstance(raw, _RawFile) else raw.read()

                    async def ours_hot() -> float:
                        return await ours(cold=False)

                    async def theirs_hot() -> float:
                        return await theirs(cold=False)

                    async def theirs_hot_wide() -> float:  # as many threads as readers
                        assert isinstance(raw, _RawFile)
                        return raw.read(cold=False, threads=readers)

                    writes: list[float] = []
                    raw_writes: list[float] = []
                    for r in range(args.rounds):  # paired rounds; who goes first alternates
                        pair = [(ours_put, writes), (raw_put, raw_writes)]
                        for fn, into in pair if r % 2 == 0 else pair[::-1]:
                            into.append(await fn())
                    # file reads, cold (page cache dropped) and then hot (pages
                    # cached by the round before); the other stores read one way
                    Timed = Callable[[], Coroutine[Any, Any, float]]
                    kinds: list[tuple[str, Timed, Timed]] = [("", ours, theirs)]
                    if args.backend == "file":
                        kinds.append(("_hot", ours_hot, theirs_hot))
                        if readers > options.io_threads:  # and against raw with as many
                            kinds.append(("_hot_wide", ours_hot, theirs_hot_wide))
                    reads: dict[str, tuple[list[float], list[float]]] = {}
                    for kind, mine, base in kinds:
                        got: tuple[list[float], list[float]] = ([], [])
                        for r in range(args.rounds):
                            pair = [(mine, got[0]), (base, got[1])]
                            for fn, into in pair if r % 2 == 0 else pair[::-1]:
                                into.append(await fn())
                                same = np.array_equal(buf.src, buf.dst)
                                assert same, "a read returned other bytes"
                                buf.dst[:] = 0
                        reads[kind] = got
                    return writes, raw_writes, reads
                finally:
                    raw.close()
                    await backend.close()

            writes, raw_writes, reads = asyncio.run(measure())
            nbytes = pages * size
            rows = [("write", writes, raw_writes)]
            rows += [(f"read{kind}", *got) for kind, got in reads.items()]
            for what, ours_, raws_ in rows:
                mine, base = statistics.median(ours_), statistics.median(raws_)
                figures[f"{what}_gbps_{tag}"] = round(nbytes / mine / 1e9, 3)
                figures[f"raw_{what}_gbps_{tag}"] = round(nbytes / base / 1e9, 3)
                figures[f"{what}_pages_s_{tag}"] = round(pages / mine)
                ratios = [b / m for m, b in zip(ours_, raws_, strict=True)]
                figures[f"{what}_vs_raw_{tag}"] = round(statistics.median(ratios), 3)
                # the spread: the lowest and highest ratio of one pair of rounds
                figures[f"{what}_vs_raw_min_{tag}"] = round(min(ratios), 3)
                figures[f"{what}_vs_raw_max_{tag}"] = round(max(ratios), 3)
            for kind, batched in (("checksum", False), ("checksums", True)):
                for threads in CHECKSUM_THREADS:
                    gbps = checksum_gbps(buf.src, threads, batched=batched)
                    figures[f"{kind}_gbps_{tag}_t{threads}"] = round(gbps, 3)
                for threads in CHECKSUM_THREADS[1:]:  # what more threads add
                    one, more = (
                        figures[f"{kind}_gbps_{tag}_t1"],
                        figures[f"{kind}_gbps_{tag}_t{threads}"],
                    )
                    figures[f"{kind}_scaling_{tag}_t{threads}"] = round(more / one, 3)
            if args.backend == "file":
                for seg in (tmp / "store").glob("segment-*.hcs"):
                    seg.unlink()
            buf.close()
    return {
        "figures": figures,
        "params": {
            "backend": args.backend,
            "mib_per_size": args.mib,
            "batch_pages": config.batch_pages,
            "concurrency": config.concurrency,
            "rounds": args.rounds,
            "read_processes": readers if isinstance(options, FileOptions) else None,
            "io_threads": getattr(options, "io_threads", None),
            "note": "raw: the backend's own client, same bytes (file: contiguous per-thread "
            "parts, vectored calls, the backend's thread count, one fdatasync); writes (new "
            "pages each round) and reads: medians of paired rounds that alternate who goes "
            "first, ratios per pair with their lowest and highest; file reads: cold (page "
            "cache dropped) and read_hot (pages cached), by read_processes reader processes "
            "against raw on io_threads threads; read_hot_wide: the same hot reads against raw "
            "on read_processes threads, where there are more readers than I/O threads; "
            "checksum_gbps_SIZE_tN: the record checksum "
            "alone over the same pages on N threads, one call a page in a Python loop; "
            "checksums_gbps_SIZE_tN: the same with each thread's part in one batched call, "
            "as the backends hash; *_scaling_SIZE_tN: tN over t1",
        },
        "targets": {"file": ">= 0.8 of raw", "mooncake": ">= 0.8 of raw", "s3": ">= 0.9 of raw"},
    }
