"""Control path: round trip of a match against the daemon vs a raw ZeroMQ echo.

Both run over the same transport, with the same request size (a 4,096-token
sequence, 64-token pages), with 1 and with 4 client processes. The echo
server is a plain blocking ROUTER loop in its own process: the floor any
request/response over pyzmq pays.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from hicached import protocol as p
from hicached.client import Client
from hicached.config import default_endpoint
from hicached.hashing import pack_tokens

TOKENS = 4096
PAGE_TOKENS = 64
PAGE_BYTES = 4096
NS = dict(
    model="bench/control",
    kv_dtype="bfloat16",
    layout="layer_first",
    page_tokens=PAGE_TOKENS,
    page_bytes=PAGE_BYTES,
)
WARMUP = 200


def _tokens() -> bytes:
    return pack_tokens(np.arange(TOKENS, dtype=np.uint32) * 7 + 11)


def _echo_server(endpoint: str, ready: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            break
        sock.send_multipart(frames)
    sock.close()
    ctx.term()


def _match_worker(endpoint: str, n: int, start: Any, out: Any) -> None:
    tokens = _tokens()
    with Client(endpoint, timeout=10.0, name="bench") as client:
        ns = client.register(**NS)  # type: ignore[arg-type]
        for _ in range(WARMUP):
            client.release(client.match(ns, tokens))
        start.wait()
        lat = np.empty(n, dtype=np.int64)
        rel = np.empty(n, dtype=np.int64)
        t_begin = time.perf_counter()
        for i in range(n):
            t0 = time.perf_counter_ns()
            hit = client.match(ns, tokens)
            t1 = time.perf_counter_ns()
            client.release(hit)
            rel[i] = time.perf_counter_ns() - t1
            lat[i] = t1 - t0
        t_end = time.perf_counter()
        assert hit.hits == TOKENS // PAGE_TOKENS, "the bench sequence must hit in full"
    out.put((lat.tobytes(), rel.tobytes(), t_begin, t_end))


def _echo_worker(endpoint: str, n: int, size: int, start: Any, out: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    payload = os.urandom(size)
    for _ in range(WARMUP):
        sock.send(payload)
        sock.recv()
    start.wait()
    lat = np.empty(n, dtype=np.int64)
    t_begin = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter_ns()
        sock.send(payload)
        sock.recv()
        lat[i] = time.perf_counter_ns() - t0
    t_end = time.perf_counter()
    sock.close()
    ctx.term()
    out.put((lat.tobytes(), b"", t_begin, t_end))


def _run_clients(
    target: Any, args: tuple[Any, ...], clients: int
) -> tuple[np.ndarray, np.ndarray, float]:
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, start, out)) for _ in range(clients)]
    for proc in procs:
        proc.start()
    time.sleep(0.2)
    start.set()
    results = [out.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(30)
    lat = np.concatenate([np.frombuffer(r[0], dtype=np.int64) for r in results])
    rel = np.concatenate([np.frombuffer(r[1], dtype=np.int64) for r in results])
    span = max(r[3] for r in results) - min(r[2] for r in results)
    return lat, rel, span


@contextlib.contextmanager
def _daemon(endpoint: str | None) -> Iterator[str]:
    """The given daemon, the one at the default endpoint, or one started here."""
    candidate = endpoint or default_endpoint()
    try:
        with Client(candidate, timeout=0.5) as client:
            client.stats()
        yield candidate
        return
    except Exception:
        if endpoint:
            raise
    from hicached.testing import DaemonProcess

    with DaemonProcess(size_mib=256, slab_mib=64, max_page_bytes=4 << 20) as daemon:
        yield daemon.endpoint


def _echo_endpoint(daemon_endpoint: str, tmp: Path) -> str:
    if daemon_endpoint.startswith("tcp://"):
        from hicached.testing import free_tcp_port

        return f"tcp://127.0.0.1:{free_tcp_port()}"
    return f"ipc://{tmp}/echo.sock"


def _us(ns: np.ndarray, q: float) -> float:
    return round(float(np.percentile(ns, q)) / 1000.0, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.requests
    with (
        _daemon(args.endpoint) as endpoint,
        tempfile.TemporaryDirectory(prefix="hc-echo-", dir="/tmp") as tmp,
    ):
        os.chmod(tmp, 0o700)
        with Client(endpoint, timeout=10.0) as client:
            ns = client.register(**NS)  # type: ignore[arg-type]
            tokens = _tokens()
            pages = np.zeros((TOKENS // PAGE_TOKENS, PAGE_BYTES), dtype=np.uint8)
            client.store(ns, tokens, pages)
            request_size = len(
                p.encode(p.Match(id=1 << 40, deadline_ms=1 << 41, ns=ns.id, tokens=tokens))
            )

        echo = _echo_endpoint(endpoint, Path(tmp))
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        server = ctx.Process(target=_echo_server, args=(echo, ready), daemon=True)
        server.start()
        ready.wait(30)

        figures: dict[str, float] = {}
        for clients, suffix in ((1, ""), (4, "_4c")):
            per_client = n if clients == 1 else max(n // 2, 200)
            m_lat, m_rel, m_span = _run_clients(_match_worker, (endpoint, per_client), clients)
            e_lat, _, e_span = _run_clients(_echo_worker, (echo, per_client, request_size), clients)
            figures[f"match_p50_us{suffix}"] = _us(m_lat, 50)
            figures[f"match_p99_us{suffix}"] = _us(m_lat, 99)
            figures[f"release_p50_us{suffix}"] = _us(m_rel, 50)
            figures[f"echo_p50_us{suffix}"] = _us(e_lat, 50)
            figures[f"echo_p99_us{suffix}"] = _us(e_lat, 99)
            figures[f"match_rps{suffix or '_1c'}"] = round(
                2 * len(m_lat) / m_span
            )  # match + release
            figures[f"echo_rps{suffix or '_1c'}"] = round(len(e_lat) / e_span)
            figures[f"match_vs_echo_p50{suffix or '_1c'}"] = round(
                figures[f"match_p50_us{suffix}"] / figures[f"echo_p50_us{suffix}"], 3
            )

        with zmq.Context() as zctx, zctx.socket(zmq.DEALER) as stopper:
            stopper.setsockopt(zmq.LINGER, 1000)
            stopper.connect(echo)
            stopper.send(b"stop")
            server.join(5)
        if server.is_alive():
            server.kill()

    return {
        "figures": figures,
        "params": {
            "transport": endpoint.split("://")[0],
            "tokens": TOKENS,
            "page_tokens": PAGE_TOKENS,
            "request_bytes": request_size,
            "requests_per_client": n,
            "note": "match holds a read lease; rps counts match and release requests",
        },
        "targets": {"match_vs_echo_p50_1c": "<= 1.3"},
    }
