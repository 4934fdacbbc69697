"""Control path: round trip of a match against the daemon vs a raw ZeroMQ echo.

Both run over the same transport, with the same request size (a 4,096-token
sequence, 64-token pages), with 1 and with 4 client processes. The echo
server is a plain blocking ROUTER loop in its own process: the floor any
request/response over pyzmq pays. An ``exists_keys`` of 128 engine keys (a
key-addressed namespace, vLLM's 36-byte keys, all in L2) is paired with an
echo of its own request size.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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
KEYED = {**NS, "model": "bench/control-keys", "key_scheme": "vllm-sha256"}
KEYS = 128
WARMUP = 200


def _tokens() -> bytes:
    return pack_tokens(np.arange(TOKENS, dtype=np.uint32) * 7 + 11)


def _engine_keys() -> list[bytes]:
    """128 chained 32-byte hashes with a 4-byte group index, as vLLM's offload keys."""
    out, parent = [], bytes(32)
    for i in range(KEYS):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        out.append(parent + bytes(4))
    return out


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


def _worker(
    endpoint: str, echo: str, n: int, size: int, keys_size: int, start: Any, out: Any
) -> None:
    """Interleave echo, match (leased) + release, match (no lease), and exists_keys
    with its own echo: paired samples."""
    tokens = _tokens()
    keys = _engine_keys()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(echo)
    payload = os.urandom(size)
    keys_payload = os.urandom(keys_size)
    with Client(endpoint, timeout=10.0, name="bench") as client:
        ns = client.register(**NS)  # type: ignore[arg-type]
        keyed = client.register(**KEYED)  # type: ignore[arg-type]
        for _ in range(WARMUP):
            client.release(client.match(ns, tokens))
            client.exists_keys(keyed, keys)
            sock.send(payload)
            sock.recv()
        start.wait()
        # echo, match, release, match without lease, exists_keys, echo of its size
        lat = np.empty((6, n), dtype=np.int64)
        clock = time.perf_counter_ns
        # the units run in a random order each round, so none always follows
        # an idle gap (a daemon that just went to sleep answers slower)
        units = np.tile([0, 1, 2, 3, 4], (n, 1))
        orders = np.random.default_rng(os.getpid()).permuted(units, axis=1)
        t_begin = time.perf_counter()
        for i in range(n):
            for unit in orders[i]:
                if unit == 0:
                    t0 = clock()
                    sock.send(payload)
                    sock.recv()
                    lat[0, i] = clock() - t0
                elif unit == 1:
                    t0 = clock()
                    hit = client.match(ns, tokens)
                    t1 = clock()
                    client.release(hit)
                    lat[1, i] = t1 - t0
                    lat[2, i] = clock() - t1
                elif unit == 2:
                    t0 = clock()
                    client.match(ns, tokens, lease=False)
                    lat[3, i] = clock() - t0
                elif unit == 3:
                    t0 = clock()
                    found = client.exists_keys(keyed, keys)
                    lat[4, i] = clock() - t0
                else:
                    t0 = clock()
                    sock.send(keys_payload)
                    sock.recv()
                    lat[5, i] = clock() - t0
        t_end = time.perf_counter()
        assert hit.hits == TOKENS // PAGE_TOKENS, "the bench sequence must hit in full"
        assert found.l2 == KEYS, "the bench keys must all be in L2"
    sock.close()
    ctx.term()
    out.put((lat.tobytes(), t_begin, t_end))


def _run_clients(args: tuple[Any, ...], clients: int) -> tuple[np.ndarray, float]:
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(*args, start, out)) for _ in range(clients)]
    for proc in procs:
        proc.start()
    time.sleep(0.5)
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(30)
    lat = np.concatenate(
        [np.frombuffer(r[0], dtype=np.int64).reshape(6, -1) for r in results], axis=1
    )
    span = max(r[2] for r in results) - min(r[1] for r in results)
    return lat, span


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
            keyed = client.register(**KEYED)  # type: ignore[arg-type]
            keys = _engine_keys()
            res = client.reserve_keys(keyed, keys)
            client.write_pages(res, np.zeros((len(res.offsets), PAGE_BYTES), dtype=np.uint8))
            client.commit(res)
            keys_size = len(
                p.encode(p.ExistsKeys(id=1 << 40, deadline_ms=1 << 41, ns=keyed.id, keys=keys))
            )

        echo = _echo_endpoint(endpoint, Path(tmp))
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        server = ctx.Process(target=_echo_server, args=(echo, ready), daemon=True)
        server.start()
        ready.wait(30)

        figures: dict[str, float] = {}
        for clients, suffix in ((1, ""), (4, "_4c")):
            per_client = n if clients == 1 else max(n // 2, 100)
            lat, span = _run_clients((endpoint, echo, per_client, request_size, keys_size), clients)
            echo_ns, match_ns, release_ns, peek_ns, exists_ns, echo_keys_ns = lat
            tag = suffix or "_1c"
            figures[f"echo_p50_us{suffix}"] = _us(echo_ns, 50)
            figures[f"echo_p99_us{suffix}"] = _us(echo_ns, 99)
            figures[f"match_p50_us{suffix}"] = _us(match_ns, 50)
            figures[f"match_p99_us{suffix}"] = _us(match_ns, 99)
            figures[f"release_p50_us{suffix}"] = _us(release_ns, 50)
            figures[f"match_nolease_p50_us{suffix}"] = _us(peek_ns, 50)
            figures[f"match_nolease_p99_us{suffix}"] = _us(peek_ns, 99)
            # daemon requests per second: three per iteration, over the whole run
            busy = (match_ns + release_ns + peek_ns).sum() / 1e9 / clients
            figures[f"match_rps{tag}"] = round(3 * match_ns.size / busy)
            figures[f"match_vs_echo_p50{tag}"] = round(
                figures[f"match_p50_us{suffix}"] / figures[f"echo_p50_us{suffix}"], 3
            )
            figures[f"match_nolease_vs_echo_p50{tag}"] = round(
                figures[f"match_nolease_p50_us{suffix}"] / figures[f"echo_p50_us{suffix}"], 3
            )
            figures[f"exists_keys_p50_us{suffix}"] = _us(exists_ns, 50)
            figures[f"exists_keys_p99_us{suffix}"] = _us(exists_ns, 99)
            figures[f"echo_keys_p50_us{suffix}"] = _us(echo_keys_ns, 50)
            figures[f"exists_keys_vs_echo_p50{tag}"] = round(
                figures[f"exists_keys_p50_us{suffix}"] / figures[f"echo_keys_p50_us{suffix}"], 3
            )
            figures[f"span_s{tag}"] = round(span, 2)

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
            "exists_keys": KEYS,
            "exists_request_bytes": keys_size,
            "requests_per_client": n,
            "note": (
                "each client interleaves, in a random order each round, a raw echo, a match "
                "with a read lease and its release, and a match without a lease; match_rps "
                "counts daemon requests per second of client time"
            ),
        },
        "targets": {"match_vs_echo_p50_1c": "<= 1.3"},
    }
