"""The daemon's own work on the control path's hot requests, old code against
new, in one process per run and in turns: what a change to the request path
saves, without the sockets, the client or the other side's noise.

    PYTHONPATH=. .venv/bin/python bench/checks/control_handler.py BASE_DIR NEW_DIR [ROUNDS]

BASE_DIR and NEW_DIR are checkouts (``git worktree add --detach /tmp/base COMMIT``);
each run imports hicached from its own, and the two sides take turns going
first. A run times what the request loop does for each request
(daemon/requests.py), with metrics on and the pool journal's recorder:
decode the request's bytes, check its deadline, ``Cache.handle`` it, time it
into the request histogram, take the journal's records and encode the reply.
The requests, as ``hicached bench control`` makes them (4,096 tokens, 64-token
pages of 4 KiB):

- ``leased_us``: a match of 64 pages with a read lease, then its release;
- ``cold_prefix_us``: the warm sequence with a last page never seen (a new
  buffer each time): every key computed for it, all pages but the last hit;
- ``exists_us``: an ``exists_keys`` of 128 engine keys, all in L2;
- ``keyed_leased_us``: a ``match_keys`` of 64 engine keys with a read lease
  (a pin on every page), then its release.

With ``HICACHED_BENCH_TENANTS=1`` the cache runs with one tenant and every
request comes from its peer (what a daemon with ``[tenants]`` does: the
tenant's shares are counted on every session, lease and namespace).

Prints one JSON object: per figure, each side's median over the rounds (a
round's figure is the median of 5 batches), the lowest and highest, new/base,
and the median of each round's new/base (``paired``).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

FIGURES = ("leased_us", "cold_prefix_us", "exists_us", "keyed_leased_us")
BATCH = 2000  # requests (or match + release pairs) a batch
BATCHES = 5


def measure() -> dict[str, float]:
    """This checkout's figures (run in a process of its own)."""
    import numpy as np

    from hicached.cache import OP_NAMES, Cache
    from hicached.cache.journal import Recorder
    from hicached.config import Config, PoolConfig, TenantConfig
    from hicached.daemon.metrics import Metrics
    from hicached.wire import protocol as p
    from hicached.wire.hashing import pack_tokens

    tenants = os.environ.get("HICACHED_BENCH_TENANTS") == "1"
    config = Config(
        pool=PoolConfig(size_mib=256, slab_mib=64, max_page_bytes=4 << 20),
        tenants={"alpha": TenantConfig(uids=[0])} if tenants else {},
    )
    peer = "alpha" if tenants else None
    journal = Recorder()
    cache = Cache(config, pool_path="/unused", journal=journal)
    metrics = Metrics(config.metrics, cache.stats)
    decode, encode, handle = p.request_decoder.decode, p.encode, cache.handle
    observe, clock = metrics.observe_request, time.perf_counter
    rid = b"bench"

    def serve(payload: bytes) -> p.AnyReply:
        """What the request loop does for one request, but the socket's part."""
        request = decode(payload)
        if request.deadline_ms and request.deadline_ms < time.time() * 1000:
            raise AssertionError("past its deadline")
        started = clock()
        reply = handle(rid, request, peer)
        observe(OP_NAMES[type(request)], clock() - started)
        if journal.waiting:  # as the journal file's flush, before each reply
            journal.take()
        encode(reply)
        return reply  # type: ignore[return-value]

    far = int((time.time() + 3600) * 1000)
    serve(encode(p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)))
    spec = p.NamespaceSpec(
        model="bench/control", kv_dtype="bfloat16", layout="layer_first", page_tokens=64,
        page_bytes=4096,
    )  # fmt: skip
    ns = serve(encode(p.RegisterNamespace(id=2, spec=spec))).ns  # type: ignore[attr-defined]
    tokens = pack_tokens(np.arange(4096, dtype=np.uint32) * 7 + 11)
    res = serve(encode(p.Reserve(id=3, ns=ns, tokens=tokens)))
    serve(encode(p.Commit(id=4, lease=res.lease, pages=-1)))  # type: ignore[attr-defined]
    keyed_spec = p.NamespaceSpec(
        model="bench/control-keys", kv_dtype="bfloat16", layout="layer_first", page_tokens=64,
        page_bytes=4096, key_scheme="vllm-sha256",
    )  # fmt: skip
    keyed = serve(encode(p.RegisterNamespace(id=5, spec=keyed_spec))).ns  # type: ignore[attr-defined]
    keys, parent = [], bytes(32)
    for i in range(128):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        keys.append(parent + bytes(4))
    res = serve(encode(p.ReserveKeys(id=6, ns=keyed, keys=keys)))
    serve(encode(p.Commit(id=7, lease=res.lease, pages=-1)))  # type: ignore[attr-defined]

    match = encode(p.Match(id=8, deadline_ms=far, ns=ns, tokens=tokens))
    match_keys = encode(p.MatchKeys(id=9, deadline_ms=far, ns=keyed, keys=keys[:64]))
    exists = encode(p.ExistsKeys(id=10, deadline_ms=far, ns=keyed, keys=keys))
    rng = np.random.default_rng(7)
    head = tokens[: (4096 - 64) * 4]

    def leased(payload: bytes, pages: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(BATCH):
                hit = serve(payload)
                assert hit.hits == pages, hit  # type: ignore[attr-defined]
                serve(encode(p.Release(id=11, deadline_ms=far, lease=hit.lease)))  # type: ignore[attr-defined]

        return run

    def cold_prefix() -> Callable[[], None]:
        cold = [
            encode(
                p.Match(
                    id=12,
                    deadline_ms=far,
                    ns=ns,
                    tokens=head + pack_tokens(rng.integers(0, 1 << 31, 64, dtype=np.uint32)),
                    lease=False,
                )
            )
            for _ in range(BATCH)
        ]

        def run() -> None:
            for payload in cold:
                assert serve(payload).hits == 63  # type: ignore[attr-defined]

        return run

    def exists_run() -> None:
        for _ in range(BATCH):
            assert serve(exists).l2 == 128  # type: ignore[attr-defined]

    def timed(make: Callable[[], Callable[[], None]]) -> float:
        batches = []
        for _ in range(BATCHES + 1):  # the first warms up
            run = make()
            started = clock()
            run()
            batches.append((clock() - started) / BATCH * 1e6)
        return round(statistics.median(batches[1:]), 2)

    return {
        "leased_us": timed(lambda: leased(match, 64)),
        "cold_prefix_us": timed(cold_prefix),
        "exists_us": timed(lambda: exists_run),
        "keyed_leased_us": timed(lambda: leased(match_keys, 64)),
    }


def run(checkout: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run(
        [sys.executable, __file__, "--child"],
        cwd=checkout,
        env=env,
        capture_output=True,
        check=True,
        timeout=600,
    ).stdout
    figures: dict[str, float] = json.loads(out)
    return figures


def main() -> None:
    base, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for i in range(rounds):
        sides = [("base", base), ("new", new)]
        for side, checkout in sides if i % 2 == 0 else sides[::-1]:
            runs[side].append(run(checkout))
    out: dict[str, object] = {
        "rounds": rounds,
        "tenants": os.environ.get("HICACHED_BENCH_TENANTS") == "1",
    }
    for key in FIGURES:
        b = [r[key] for r in runs["base"]]
        n = [r[key] for r in runs["new"]]
        out[key] = {
            "base": statistics.median(b),
            "base_range": [min(b), max(b)],
            "new": statistics.median(n),
            "new_range": [min(n), max(n)],
            "new_vs_base": round(statistics.median(n) / statistics.median(b), 3),
            # each round's new/base: the two runs of a round share the machine's mood
            "paired": round(statistics.median(x / y for x, y in zip(n, b, strict=True)), 3),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(measure()))
    else:
        main()
