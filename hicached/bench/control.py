"""Control path: round trip of a match against the daemon vs a raw ZeroMQ echo.

Both run over the same transport, with the same request size (a 4,096-token
sequence, 64-token pages), with 1 and with 4 client processes. The echo
server is a plain blocking ROUTER loop in its own process: the floor any
request/response over pyzmq pays; each echo request says how long its reply
is, so every echo carries the bytes of the daemon exchange it is paired with,
both ways. A second echo server answers the match's sizes from a uvloop
reader on the socket, as the daemon does (``echo_loop``): the floor of the
daemon's own design. An ``exists_keys`` of 128 engine keys (a key-addressed namespace,
vLLM's 36-byte keys, all in L2) is paired with an echo of its own sizes.

Warm and cold: the warm match asks for a sequence the daemon has hashed and
holds; each cold match carries a sequence it has never seen, so its keys
are computed for that request (the key cache cannot help) and it misses:
the daemon hashes its first page, finds it in neither tier, and answers.
Every other round the cold match is a cold-prefix one: the warm sequence
with a last page never seen, a new buffer, so every one of its keys is
computed for that request, and all but the last page hit (a conversation's
next turn). It takes the cold match's turn, so each round runs the same
number of exchanges as before it was added.
``requests_per_s_4c`` counts every daemon request the four clients made over
the run's span (first start to last end), not a figure derived from latency.
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
from typing import Any, NamedTuple

import numpy as np
import zmq

from hicached.client import Client
from hicached.config import default_endpoint
from hicached.wire import protocol as p
from hicached.wire.hashing import pack_tokens

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
    """Answer each request with as many bytes as its first four say (little-endian)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    reply = os.urandom(1 << 20)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            break
        size = int.from_bytes(frames[1][:4], "little")
        sock.send_multipart([frames[0], reply[:size]])
    sock.close()
    ctx.term()


def _echo_loop_server(endpoint: str, ready: Any) -> None:
    """The same echo served as the daemon serves: a uvloop reader on the
    socket's descriptor, receiving frame by frame with integer flags until
    ``EVENTS`` shows no more. The floor of any request/response served from
    an event loop; what lies between it and the daemon is the daemon's work."""
    import asyncio

    import uvloop

    nowait, more, events, pollin = (
        int(zmq.NOBLOCK),
        int(zmq.SNDMORE | zmq.NOBLOCK),
        int(zmq.EVENTS),
        int(zmq.POLLIN),
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    reply = os.urandom(1 << 20)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def drain() -> None:
            while True:
                try:
                    routing_id = sock.recv(nowait)
                except zmq.Again:
                    return
                payload = sock.recv(nowait)
                if payload == b"stop":
                    done.set_result(None)
                    return
                sock.send(routing_id, more)
                sock.send(reply[: int.from_bytes(payload[:4], "little")], nowait)
                if not int(sock.getsockopt(events)) & pollin:
                    return

        loop.add_reader(sock.fileno(), drain)
        loop.call_soon(drain)
        ready.set()
        await done

    uvloop.run(serve())
    sock.close()
    ctx.term()


def _echo_request(size: int, reply: int) -> bytes:
    """An echo request of ``size`` bytes asking for a reply of ``reply`` bytes."""
    return reply.to_bytes(4, "little") + os.urandom(max(0, size - 4))


class Sizes(NamedTuple):
    """Request and reply bytes of each daemon exchange an echo stands in for."""

    match: tuple[int, int]
    exists: tuple[int, int]
    cold: tuple[int, int]
    cold_prefix: tuple[int, int]


# rows of the latency table: what each unit of a round measures
ROWS = (
    "echo",
    "match",
    "release",
    "nolease",
    "exists",
    "echo_keys",
    "cold",
    "echo_cold",
    "echo_loop",
    "cold_prefix",
    "echo_cold_prefix",
)
# match, release, match without lease, exists, cold (or cold-prefix) match
DAEMON_REQUESTS_PER_ROUND = 5


def _worker(
    endpoint: str, echo: str, echo_loop: str, n: int, sizes: Sizes, start: Any, out: Any
) -> None:
    """Interleave, in a random order each round: echo + match (leased) + release
    + match (no lease); exists_keys + its echo; a cold match + its echo; the
    match's echo served from an event loop. The cold match and its echo are a
    cold-prefix match and its echo in odd rounds."""
    tokens = _tokens()
    keys = _engine_keys()
    rng = np.random.default_rng(os.getpid())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(echo)
    looped = ctx.socket(zmq.DEALER)
    looped.setsockopt(zmq.LINGER, 0)
    looped.connect(echo_loop)
    echoes = [
        _echo_request(*sizes.match),
        _echo_request(*sizes.exists),
        _echo_request(*sizes.cold),
        _echo_request(*sizes.cold_prefix),
    ]
    with Client(endpoint, timeout=10.0, name="bench") as client:
        ns = client.register(**NS)  # type: ignore[arg-type]
        keyed = client.register(**KEYED)  # type: ignore[arg-type]
        for _ in range(WARMUP):
            client.release(client.match(ns, tokens))
            client.exists_keys(keyed, keys)
            for payload in echoes:
                sock.send(payload)
                sock.recv()
            looped.send(echoes[0])
            looped.recv()
        start.wait()
        lat = np.full((len(ROWS), n), -1, dtype=np.int64)  # -1: not measured this round
        clock = time.perf_counter_ns
        # the units run in a random order each round, so none always follows
        # an idle gap (a daemon that just went to sleep answers slower)
        orders = rng.permuted(np.tile(np.arange(8), (n, 1)), axis=1)
        t_begin = time.perf_counter()
        last = (TOKENS - PAGE_TOKENS) * 4  # bytes before the last page
        for i in range(n):
            cold = pack_tokens(rng.integers(0, 1 << 31, TOKENS, dtype=np.uint32))
            # the cold unit and its echo take turns: a cold match in even rounds,
            # a cold-prefix one in odd rounds (as many units each round)
            near_round = i % 2 == 1
            if near_round:
                cold = tokens[:last] + cold[last:]
            for unit in orders[i]:
                if unit == 1:
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
                elif unit == 5:
                    t0 = clock()
                    got = client.match(ns, cold, lease=False)
                    lat[9 if near_round else 6, i] = clock() - t0
                    if near_round:
                        near = got
                    else:
                        miss = got
                elif unit == 7:
                    t0 = clock()
                    looped.send(echoes[0])
                    looped.recv()
                    lat[8, i] = clock() - t0
                else:  # 0, 4, 6: the echo of the match, exists or cold (-prefix) match
                    which = {0: 0, 4: 1, 6: 3 if near_round else 2}[unit]
                    t0 = clock()
                    sock.send(echoes[which])
                    sock.recv()
                    lat[(0, 5, 7, 10)[which], i] = clock() - t0
        t_end = time.perf_counter()
        assert hit.hits == TOKENS // PAGE_TOKENS, "the bench sequence must hit in full"
        assert found.l2 == KEYS, "the bench keys must all be in L2"
        assert miss.hits == 0, "a cold sequence must miss"
        assert near.hits == TOKENS // PAGE_TOKENS - 1, "a cold prefix must hit but its last page"
    sock.close()
    looped.close()
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
        [np.frombuffer(r[0], dtype=np.int64).reshape(len(ROWS), -1) for r in results], axis=1
    )
    span = max(r[2] for r in results) - min(r[1] for r in results)
    return lat, span


@contextlib.contextmanager
def _daemon(endpoint: str | None, size_mib: int = 256) -> Iterator[str]:
    """The given daemon, the one at the default endpoint, or one started here
    (with a pool of ``size_mib``)."""
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

    with DaemonProcess(size_mib=size_mib, slab_mib=64, max_page_bytes=4 << 20) as daemon:
        yield daemon.endpoint


def _echo_endpoint(daemon_endpoint: str, tmp: Path, name: str) -> str:
    if daemon_endpoint.startswith("tcp://"):
        from hicached.testing import free_tcp_port

        return f"tcp://127.0.0.1:{free_tcp_port()}"
    return f"ipc://{tmp}/{name}.sock"


def _us(ns: np.ndarray, q: float) -> float:
    return round(float(np.percentile(ns[ns >= 0], q)) / 1000.0, 1)


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
            hit = client.match(ns, tokens)
            client.release(hit)
            keyed = client.register(**KEYED)  # type: ignore[arg-type]
            keys = _engine_keys()
            res = client.reserve_keys(keyed, keys)
            client.write_pages(res, np.zeros((len(res.offsets), PAGE_BYTES), dtype=np.uint8))
            client.commit(res)
        big, lease = 1 << 40, 1 << 62  # ids and leases as large as they get
        match = p.Match(id=big, deadline_ms=big, ns=ns.id, tokens=tokens)
        hit_reply = p.MatchOk(id=big, hits=hit.hits, offsets=hit.offsets, lease=lease)
        exists = p.ExistsKeys(id=big, deadline_ms=big, ns=keyed.id, keys=keys)
        found = p.ExistsKeysOk(id=big, l2=KEYS, leading=KEYS, where=bytes(KEYS))
        miss_reply = p.MatchOk(id=big, hits=0, offsets=[], lease=0)
        near_reply = p.MatchOk(id=big, hits=hit.hits - 1, offsets=hit.offsets[:-1], lease=0)
        sizes = Sizes(
            (len(p.encode(match)), len(p.encode(hit_reply))),
            (len(p.encode(exists)), len(p.encode(found))),
            (len(p.encode(match)), len(p.encode(miss_reply))),
            (len(p.encode(match)), len(p.encode(near_reply))),
        )

        echo = _echo_endpoint(endpoint, Path(tmp), "echo")
        echo_loop = _echo_endpoint(endpoint, Path(tmp), "echo-loop")
        ctx = mp.get_context("spawn")
        servers = []
        for target, where in ((_echo_server, echo), (_echo_loop_server, echo_loop)):
            ready = ctx.Event()
            server = ctx.Process(target=target, args=(where, ready), daemon=True)
            server.start()
            ready.wait(30)
            servers.append((server, where))

        figures: dict[str, float] = {}
        for clients, suffix in ((1, ""), (4, "_4c")):
            per_client = n if clients == 1 else max(n // 2, 100)
            lat, span = _run_clients((endpoint, echo, echo_loop, per_client, sizes), clients)
            row = dict(zip(ROWS, lat, strict=True))
            tag = suffix or "_1c"
            for name, what in (
                ("echo", "echo"),
                ("match", "match"),
                ("release", "release"),
                ("match_nolease", "nolease"),
                ("exists_keys", "exists"),
                ("echo_keys", "echo_keys"),
                ("match_cold", "cold"),
                ("echo_cold", "echo_cold"),
                ("echo_loop", "echo_loop"),
                ("match_cold_prefix", "cold_prefix"),
                ("echo_cold_prefix", "echo_cold_prefix"),
            ):
                figures[f"{name}_p50_us{suffix}"] = _us(row[what], 50)
                figures[f"{name}_p99_us{suffix}"] = _us(row[what], 99)
                # spread: the middle half of the samples
                figures[f"{name}_iqr_us{suffix}"] = round(
                    _us(row[what], 75) - _us(row[what], 25), 1
                )
            for name, echo_of in (
                ("match", "echo"),
                ("match_nolease", "echo"),
                ("exists_keys", "echo_keys"),
                ("match_cold", "echo_cold"),
                ("match_cold_prefix", "echo_cold_prefix"),
            ):
                figures[f"{name}_vs_echo_p50{tag}"] = round(
                    figures[f"{name}_p50_us{suffix}"] / figures[f"{echo_of}_p50_us{suffix}"], 3
                )
            # the same echo served from an event loop, as the daemon serves: the
            # floor of the daemon's design, and the match's distance from it
            loop_echo = figures[f"echo_loop_p50_us{suffix}"]
            figures[f"echo_loop_vs_echo_p50{tag}"] = round(
                loop_echo / figures[f"echo_p50_us{suffix}"], 3
            )
            figures[f"match_vs_echo_loop_p50{tag}"] = round(
                figures[f"match_p50_us{suffix}"] / loop_echo, 3
            )
            # every daemon request the clients made, over the run's span
            total = DAEMON_REQUESTS_PER_ROUND * lat.shape[1]
            figures[f"requests_per_s{suffix}"] = round(total / span)
            figures[f"span_s{tag}"] = round(span, 2)

        for server, where in servers:
            with zmq.Context() as zctx, zctx.socket(zmq.DEALER) as stopper:
                stopper.setsockopt(zmq.LINGER, 1000)
                stopper.connect(where)
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
            "bytes": sizes._asdict(),
            "exists_keys": KEYS,
            "requests_per_client": n,
            "note": (
                "each client interleaves, in a random order each round, a match with a read "
                "lease and its release, a match without a lease, an exists_keys of 128 keys, a "
                "cold match (a sequence never seen: its first page is hashed, found in neither "
                "tier, and the rest is not hashed; in odd rounds a cold-prefix match instead, "
                "the warm sequence with a new last page: every key hashed, all pages but the "
                "last hit), and an echo of each exchange's request "
                "and reply sizes (a blocking loop), and the match's echo served from a uvloop "
                "reader as the daemon serves (echo_loop); requests_per_s counts daemon "
                "requests over the run's span; "
                "iqr is the spread of the middle half of the samples"
            ),
        },
        "targets": {"match_vs_echo_p50_1c": "<= 1.3", "match_cold_vs_echo_p50_1c": "<= 1.3"},
    }
