"""After a restart, L3 pages are found at once: unknown is not absent.

While the daemon does not know every key the store holds (its startup scan
runs, or keys were forgotten to stay within ``storage.known_keys``), a match
or exists_keys that stops at a key it does not know asks the backend first.
Real daemons, a real S3 server (moto) and real file stores. Fault injection
only to make the startup scan slow and deterministic: the faulty backend
wraps the real store and sleeps ``scan_delay_s`` per page it lists, so a few
hundred pages take seconds to list, as tens of thousands do in production.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import zmq

from hicached import Client, Namespace
from hicached import protocol as p
from hicached.cache import Cache, L3Lookup
from hicached.config import Config, PoolConfig
from hicached.daemon.requests import RequestLoop
from hicached.daemon.tier import Tier
from hicached.errors import DeadlineExceeded
from hicached.hashing import engine_page_keys, pack_tokens, page_keys
from hicached.namespace import NamespaceSpec, namespace_digest
from hicached.testing import scrape
from tests.l3util import l3_count, record_offset, settle_writes, storage, wait_for, wait_prefetch
from tests.services import S3Server
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon, page_bytes_for

SEQS = 24  # sequences of each kind (tokens, keys)
SEQ_PAGES = 8  # at most storage.s3.threads: S3's bisecting exists asks each key, so counts exactly
PAGES = 2 * SEQS * SEQ_PAGES
KEYED = dict(NS, model="test/keyed", key_scheme="vllm-sha256")
# lookups wait long enough for a loaded test machine: these tests want every page
LOOKUPS = "lookup_timeout_s = 10.0\n"
_buckets = itertools.count()


def token_seqs() -> list[np.ndarray]:
    return [
        np.arange(k * 10**6, k * 10**6 + SEQ_PAGES * PAGE_TOKENS, dtype=np.uint32)
        for k in range(SEQS)
    ]


def key_seqs() -> list[list[bytes]]:
    out = []
    for k in range(SEQS):
        parent, keys = bytes(32), []
        for i in range(SEQ_PAGES):
            parent = hashlib.sha256(parent + bytes([k, i])).digest()
            keys.append(parent)
        out.append(keys)
    return out


def fill(c: Client) -> None:
    """Store every sequence of both kinds (written through to L3)."""
    ns, kns = c.register(**NS), c.register(**KEYED)
    data = np.full((SEQ_PAGES, PAGE_BYTES), 7, np.uint8)
    for toks in token_seqs():
        c.store(ns, toks, data)
    for keys in key_seqs():
        res = c.reserve_keys(kns, keys)
        c.write_pages(res, data[res.indices])
        c.commit(res)


def expected(ns: Namespace, kns: Namespace, held: set[bytes] | None) -> tuple[list[int], list[int]]:
    """Per sequence, the leading pages L3 holds: all of them, or the run of ``held``
    (the daemon's keys the store holds)."""

    def run(keys: list[bytes]) -> int:
        return next((i for i, key in enumerate(keys) if key not in held), len(keys))  # type: ignore[operator]

    if held is None:
        return [SEQ_PAGES] * SEQS, [SEQ_PAGES] * SEQS
    tokens = [run(page_keys(ns.digest, pack_tokens(t), PAGE_TOKENS)) for t in token_seqs()]
    keyed = [run(engine_page_keys(kns.digest, keys)) for keys in key_seqs()]
    return tokens, keyed


def restart_and_look(d: Daemon, held: Callable[[], set[bytes] | None], sig: int) -> Client:
    """Stop ``d`` with ``sig``, start it again and check, before its scan ends,
    that match and exists_keys find every page the store holds; returns a
    connected client (close it)."""
    assert d.stop(sig) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    d.start()
    c = d.client(timeout=30.0)
    try:
        ns, kns = c.register(**NS), c.register(**KEYED)
        s = c.stats()
        assert s.l3["scanning"] == 1 and s.l3["index_complete"] == 0
        assert s.l3_pages_known < PAGES
        want_tokens, want_keyed = expected(ns, kns, held())
        assert sum(want_tokens) + sum(want_keyed) > 0
        found = [c.match(ns, toks, lease=False).l3_hits for toks in token_seqs()]
        assert found == want_tokens
        leading = [c.exists_keys(kns, keys).leading for keys in key_seqs()]
        assert leading == want_keyed
        assert [c.match_keys(kns, keys, lease=False).l3_hits for keys in key_seqs()] == want_keyed
        s = c.stats()  # found by asking the store, not by its listing: it still runs
        assert s.l3["scanning"] == 1 and s.l3["scan_pages"] < PAGES
        assert s.l3["lookups"] > 0 and s.l3["lookups_late"] == 0 and s.l3["lookup_pages"] > 0
        return c
    except BaseException:
        c.close()
        raise


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill9"])
def test_s3_pages_are_found_while_the_scan_runs(
    daemon_factory: Callable[..., Daemon], s3: S3Server, sig: int
) -> None:
    """After a SIGTERM, every page acknowledged before it; after kill -9 in the
    middle of writes, every page the bucket holds (listed with boto3)."""
    bucket = s3.make_bucket(f"lookup-{next(_buckets)}")
    d = daemon_factory(
        size_mib=16,
        allow_faults=True,
        storage=storage("faulty", more=LOOKUPS),
        # the checks below ask S3 about every key they meet (moto: ms a request),
        # and must finish while the scan still runs, on a loaded machine too
        tail='[storage.extra]\ninner = "s3"\nscan_delay_s = 0.05\n'
        f"write_delay_s = {0.0 if sig == signal.SIGTERM else 0.2}\n"
        "[storage.extra.inner_options]\n"
        f'bucket = "{bucket}"\nendpoint_url = "{s3.endpoint}"\naccess_key_id = "testing"\n'
        'secret_access_key = "testing"\nregion = "us-east-1"\nthreads = 8\n',
    )
    with d.client() as c:
        fill(c)
        # SIGTERM once every page is acknowledged; kill -9 with writes still under way
        done = PAGES if sig == signal.SIGTERM else PAGES // 3
        wait_for(lambda: l3_count(c, "written") >= done, timeout=60)

    def held() -> set[bytes] | None:
        if sig == signal.SIGTERM:
            return None  # every page was acknowledged
        listed = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)  # type: ignore[attr-defined]
        return {
            bytes.fromhex(o["Key"].rsplit("/", 1)[1])
            for page in listed
            for o in page.get("Contents", [])
        }

    with restart_and_look(d, held, sig):
        pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill9"])
def test_file_pages_are_found_while_the_scan_runs(
    daemon_factory: Callable[..., Daemon], sig: int
) -> None:
    """Every page acknowledged before the stop (SIGTERM or kill -9); status and
    metrics show the scan, the incomplete index and the lookups."""
    d = daemon_factory(
        size_mib=16,
        allow_faults=True,
        storage=storage("faulty", more=LOOKUPS),
        tail='[storage.extra]\ninner = "file"\nscan_delay_s = 0.02\n'
        "[storage.extra.inner_options]\ncapacity_mib = 32\nsegment_mib = 4\nio_threads = 2\n",
    )
    with d.client() as c:
        fill(c)
        wait_for(lambda: l3_count(c, "written") == PAGES)
    with restart_and_look(d, lambda: None, sig) as c:
        status = subprocess.run(
            [sys.executable, "-m", "hicached", "status", "--endpoint", d.endpoint],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "faulty scanning" in status and "index_complete=0" in status
        assert "scanning=1" in status and "lookups=" in status and "lookup_pages=" in status
        metrics = scrape(c.stats().metrics_endpoint)
        assert metrics[("hicached_l3_state", (("what", "scanning"),))] == 1
        assert metrics[("hicached_l3_state", (("what", "index_complete"),))] == 0
        assert metrics[("hicached_l3_total", (("what", "lookups"),))] > 0


def test_a_page_the_store_drops_during_the_scan_is_not_learned_from_its_listing(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """The file store lists a snapshot of its keys, slowly here. A page whose
    record turns out damaged is dropped by the store while the scan runs, before
    the listing reaches it: once the scan has ended (the index complete, unknown
    is absent), the page must not be said to be in L3 because the listing named
    it, and the pages after it are no hit either."""
    d = daemon_factory(
        size_mib=16,
        allow_faults=True,
        storage=storage("faulty", more=LOOKUPS),
        tail='[storage.extra]\ninner = "file"\nscan_delay_s = 0.03\n'
        "[storage.extra.inner_options]\ncapacity_mib = 32\nsegment_mib = 8\nio_threads = 2\n",
    )
    seqs = [np.arange(k * 1000, k * 1000 + 2 * PAGE_TOKENS, dtype=np.uint32) for k in range(60)]
    target = seqs[-1]  # written last: the listing names it last
    with d.client() as c:
        ns = c.register(**NS)
        for toks in seqs:
            c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 2 * len(seqs))
        settle_writes(c)
    assert d.stop() == 0
    segment, header = record_offset(d.dir / "data" / "pages", ns.digest, target, 0)
    with open(segment, "r+b") as f:  # flip one byte of the target's first page
        f.seek(header + 64 + 100)
        byte = f.read(1)
        f.seek(header + 64 + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    d.start()
    with d.client(timeout=30.0) as c:
        ns = c.register(**NS)
        assert c.stats().l3["scanning"] == 1
        pf = c.prefetch(ns, target)  # reads the damaged record: the store drops it
        done = wait_prefetch(c, pf)
        assert done.completed == 0 and done.failed
        c.cancel(pf)
        s = c.stats()
        assert s.l3["store_bad_records"] == 1
        assert s.l3["scanning"] == 1 and s.l3["scan_pages"] < 2 * len(seqs) - 2
        wait_for(lambda: c.stats().l3["scanning"] == 0, timeout=60.0)
        s = c.stats()
        assert s.l3["index_complete"] == 1 and s.l3["scan_pages"] == 2 * len(seqs)
        assert c.match(ns, target, lease=False).l3_hits == 0  # the listing named it: not held
        assert c.match(ns, seqs[0], lease=False).l3_hits == 2  # the others are


def test_pages_forgotten_by_the_bound_are_found(daemon_factory: Callable[..., Daemon]) -> None:
    """known_keys remembers 64 of 384 pages: the scan has ended, yet every page
    is found, by asking the store about those the daemon forgot."""
    d = daemon_factory(
        size_mib=16,
        storage=storage("file", more="known_keys = 64\n" + LOOKUPS),
        tail="[storage.file]\ncapacity_mib = 32\nsegment_mib = 4\nio_threads = 2\n",
    )
    with d.client() as c:
        fill(c)
        wait_for(lambda: l3_count(c, "written") == PAGES)
        settle_writes(c)
    d.stop()
    d.start()
    with d.client(timeout=30.0) as c:
        ns, kns = c.register(**NS), c.register(**KEYED)
        wait_for(lambda: c.stats().l3["scanning"] == 0)
        s = c.stats()
        assert s.l3["known_forgotten"] > 0 and s.l3["index_complete"] == 0
        assert s.l3_pages_known <= 64
        assert [c.match(ns, t, lease=False).l3_hits for t in token_seqs()] == [SEQ_PAGES] * SEQS
        assert [c.exists_keys(kns, k).leading for k in key_seqs()] == [SEQ_PAGES] * SEQS
        s = c.stats()
        assert s.l3["known_forgotten"] > 0 and s.l3["lookup_pages"] >= PAGES - 64


def test_lookups_are_bounded(daemon_factory: Callable[..., Daemon]) -> None:
    """lookups_in_flight = 0: while the scan runs, what the daemon does not know
    is a miss (always legal), and counted as a lookup skipped."""
    d = daemon_factory(
        size_mib=16,
        allow_faults=True,
        storage=storage("faulty", more="lookups_in_flight = 0\n"),
        tail='[storage.extra]\ninner = "file"\nscan_delay_s = 0.02\n'
        "[storage.extra.inner_options]\ncapacity_mib = 32\nsegment_mib = 4\nio_threads = 2\n",
    )
    with d.client() as c:
        fill(c)
        wait_for(lambda: l3_count(c, "written") == PAGES)
    d.stop()
    d.start()
    with d.client() as c:
        ns = c.register(**NS)
        found = sum(c.match(ns, t, lease=False).l3_hits for t in token_seqs())
        s = c.stats()
        assert s.l3["scanning"] == 1 and found < SEQS * SEQ_PAGES
        assert s.l3["lookups"] == 0 and s.l3["lookups_skipped"] > 0


def test_the_cache_asks_only_what_it_does_not_know() -> None:
    """The cache alone (synchronous; its tier takes no writes here): a complete
    record answers at once; an incomplete one returns an L3Lookup for the keys
    past what it knows, whose reply carries the L2 hit's lease, and whose lease
    ends if that reply cannot be sent."""
    from hicached import protocol as p
    from hicached.cache import Cache, L3Lookup
    from hicached.config import Config, PoolConfig, StorageConfig

    class NoTier:
        down = False  # the store is up

        def write(self, *args: object) -> bool:
            return False

        def prefetch(self, lease: object) -> None:  # pragma: no cover - not used here
            raise AssertionError

    config = Config(
        pool=PoolConfig(size_mib=1, slab_mib=1, max_page_bytes=PAGE_BYTES),
        storage=StorageConfig(backend="x"),
    )
    cache = Cache(config, pool_path="x")
    cache.tier = NoTier()
    cache.handle(b"a", p.Hello(id=0, major=p.PROTOCOL_MAJOR, minor=0))
    reg = cache.handle(b"a", p.RegisterNamespace(id=0, spec=p.NamespaceSpec(**NS)))
    assert isinstance(reg, p.NamespaceOk)
    toks = pack_tokens(token_seqs()[0])
    keys = page_keys(reg.digest, toks, PAGE_TOKENS)
    res = cache.handle(b"a", p.Reserve(id=1, ns=reg.ns, tokens=toks[: 2 * PAGE_TOKENS * 4]))
    assert isinstance(res, p.ReserveOk) and len(res.offsets) == 2
    assert isinstance(cache.handle(b"a", p.Commit(id=2, lease=res.lease)), p.CommitOk)
    cache.l3.update(keys[2:4])  # pages 0-1 in L2, 2-3 known in L3, 4-7 unknown

    hit = cache.handle(b"a", p.Match(id=3, ns=reg.ns, tokens=toks, lease=True))
    assert isinstance(hit, p.MatchOk) and (hit.hits, hit.l3_hits) == (2, 2)  # complete: at once
    cache.handle(b"a", p.Release(id=4, lease=hit.lease))

    cache.l3.listed(False)  # a scan runs
    ask = cache.handle(b"a", p.Match(id=5, ns=reg.ns, tokens=toks, lease=True))
    assert isinstance(ask, L3Lookup) and ask.keys == keys[4:] and ask.ns == reg.digest
    assert ask.lease in {lease.id for lease in cache.leases}  # the L2 hit is held meanwhile
    cache.l3.update(keys[4:5])  # the scan found page 4; the store holds two more
    assert cache.learn_l3(ask.ns, ask.keys[:3]) == 2  # as the tier does with the answer
    reply = ask.finish(3)
    assert isinstance(reply, p.MatchOk) and (reply.hits, reply.l3_hits, reply.lease) == (
        2,
        5,
        ask.lease,
    )
    cache.undelivered(b"a", ask)  # the reply could not be sent: its lease ends
    assert not cache.leases
    cache.l3.listed(True)  # the scan ended: what the record does not know is absent
    hit = cache.handle(b"a", p.Match(id=6, ns=reg.ns, tokens=toks, lease=False))
    assert isinstance(hit, p.MatchOk) and (hit.hits, hit.l3_hits) == (2, 5)


def test_a_lookup_that_ends_past_the_clients_deadline_leaves_no_lease(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A leased match that waits on an L3 lookup longer than its client waits:
    the client gives up (DeadlineExceeded) and would drop the late reply, so
    the lease that reply carries ends when the lookup does, instead of pinning
    the L2 pages until the lease's TTL. Fault injection: the faulty backend
    sleeps ``exists_delay_s`` in every existence check, and no startup scan
    lists the store, so the key after the L2 pages is asked of it."""
    d = daemon_factory(
        size_mib=16,
        slab_mib=1,
        allow_faults=True,
        storage=storage("faulty", more="scan_on_start = false\n" + LOOKUPS),
        tail='[storage.extra]\ninner = "file"\nexists_delay_s = 1.5\n'
        "[storage.extra.inner_options]\ncapacity_mib = 32\nsegment_mib = 4\nio_threads = 2\n",
    )
    toks = token_seqs()[0]
    with d.client(timeout=30.0) as c:
        ns = c.register(**NS)
        c.store(ns, toks[: 4 * PAGE_TOKENS], np.full((4, PAGE_BYTES), 7, np.uint8))
        settle_writes(c)
        with d.client(timeout=0.3) as quick:
            qns = quick.register(**NS)
            with pytest.raises(DeadlineExceeded):
                quick.match(qns, toks)  # 4 pages in L2; the 5th is asked of the store
            assert c.stats().leases == 1  # granted, the reply waits on the lookup
            wait_for(lambda: c.stats().dropped.get("past_deadline", 0) == 1, timeout=10)
            s = c.stats()
            assert s.leases == 0 and s.pinned_pages == 0
        # a client that waits gets its answer and its lease, as before
        hit = c.match(ns, toks)
        try:
            assert hit.hits == 4 and len(hit.offsets) == 4
        finally:
            c.release(hit)


def test_a_store_that_cannot_tell_fails_a_prefetch_and_forgets_nothing(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A prefetch first asks the store how many of its pages it holds; a store
    that cannot tell in time (down, or too slow) is not a store that holds
    none: the prefetch fails, and the pages L3 is known to hold stay known (no
    BlockRemoved for pages still there, no lost hits until a restart). Fault
    injection: the faulty backend sleeps ``exists_delay_s`` past
    ``op_timeout_s`` in every existence check."""
    d = daemon_factory(
        size_mib=16,
        slab_mib=1,
        allow_faults=True,
        storage=storage("faulty", more="op_timeout_s = 0.3\nretries = 0\n"),
        tail='[storage.extra]\ninner = "file"\nexists_delay_s = 1.0\n'
        "[storage.extra.inner_options]\ncapacity_mib = 32\nsegment_mib = 4\nio_threads = 2\n",
    )
    toks = token_seqs()[0]
    with d.client(timeout=30.0) as c:
        c.store(c.register(**NS), toks, np.full((SEQ_PAGES, PAGE_BYTES), 7, np.uint8))
        settle_writes(c)
    assert d.stop() == 0
    d.start()  # a new pool: the pages are in L3 alone, known from the scan
    with d.client(timeout=30.0) as c:
        ns = c.register(**NS)
        wait_for(lambda: c.stats().l3_state == "up")
        assert c.match(ns, toks, lease=False).l3_hits == SEQ_PAGES
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert done.failed and done.completed == 0
        c.release(pf)
        assert l3_count(c, "prefetch_store_silent") == 1
        assert c.match(ns, toks, lease=False).l3_hits == SEQ_PAGES  # still known


def test_the_scan_remembers_what_the_store_let_go_of_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cache alone: while a scan runs, keys the store let go of are not
    learned from the listing; past the bound on what it remembers, nothing more
    is (the tier then stops the scan and leaves the index incomplete, so the
    store is asked); after the scan, what it lets go of is not remembered."""
    from hicached.cache import Cache, tiering
    from hicached.config import Config, PoolConfig, StorageConfig

    monkeypatch.setattr(tiering, "SCAN_FORGOTTEN_MAX", 3)
    config = Config(
        pool=PoolConfig(size_mib=1, slab_mib=1, max_page_bytes=PAGE_BYTES),
        storage=StorageConfig(backend="x"),
    )
    t = Cache(config, pool_path="x").tiering
    keys = [bytes([i]) * 16 for i in range(8)]
    assert t.scan_may_learn(keys[0])  # no scan runs
    t.scan_begins()
    t.forget_l3(keys[:2])
    assert not t.scan_may_learn(keys[0]) and not t.scan_may_learn(keys[1])
    assert t.scan_may_learn(keys[2]) and not t.scan_overflow
    t.forget_l3(keys[2:4])  # 4 > 3 remembered
    assert t.scan_overflow and not t.scan_may_learn(keys[5])
    t.scan_ends()
    t.scan_begins()  # a scan starts afresh
    assert not t.scan_overflow and t.scan_may_learn(keys[0])
    t.scan_ends()
    t.forget_l3(keys[4:6])
    assert t.scan_may_learn(keys[4])


def test_a_lookup_is_answered_while_slow_prefetch_reads_queue(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Prefetch reads hold the store's call slots and more wait behind them,
    each taking seconds: a match that asks the store about pages the daemon
    does not know still gets every page in its answer, not a miss at
    ``lookup_timeout_s``, since existence checks take a slot before reads,
    and one beyond the reads' and writes' is kept for them. Fault injection:
    the faulty backend sleeps ``read_delay_s`` in every read of the namespace,
    and no startup scan lists the store, so the matched pages are asked of it."""
    digest = namespace_digest(NamespaceSpec(**NS)).hex()
    d = daemon_factory(
        size_mib=16,
        slab_mib=1,
        allow_faults=True,
        storage=storage(
            "faulty",
            more="scan_on_start = false\nconcurrency = 3\nprefetch_batch_pages = 1\n"
            "lookup_timeout_s = 2.0\n",
        ),
        tail='[storage.extra]\ninner = "file"\n'
        f'[storage.extra.read_delay_s]\n"{digest}" = 3.0\n'
        "[storage.extra.inner_options]\ncapacity_mib = 32\nsegment_mib = 4\nio_threads = 2\n",
    )
    seqs = token_seqs()[:5]
    with d.client(timeout=30.0) as c:
        ns = c.register(**NS)
        for toks in seqs:
            c.store(ns, toks, np.full((SEQ_PAGES, PAGE_BYTES), 7, np.uint8))
        settle_writes(c)
    assert d.stop() == 0
    d.start()  # a new pool: the pages are in L3 alone, and the daemon knows none
    with d.client(timeout=30.0) as c:
        ns = c.register(**NS)
        fetches = [c.prefetch(ns, toks, max_pages=1) for toks in seqs[:4]]
        # three reads hold the three call slots, one waits; the slot kept for checks is free
        wait_for(lambda: c.stats().l3["store_calls_running"] >= 3, timeout=30)
        assert c.match(ns, seqs[4], lease=False).l3_hits == SEQ_PAGES
        s = c.stats()
        assert s.l3["lookups"] == 1 and s.l3["lookups_late"] == 0
        assert s.l3["lookup_pages"] == SEQ_PAGES
        for pf in fetches:  # and the reads all went through
            done = wait_prefetch(c, pf, timeout=60)
            assert done.completed == 1 and not done.failed
            c.release(pf)


def test_a_request_that_came_while_a_lookup_was_answered_is_served(tmp_path: Path) -> None:
    """A reply that waited on L3 goes out from the tier's callback, outside the
    drain. Its send may read the socket's pending commands, among them the one
    that announced another client's request, and so take the descriptor's
    wake-up: the loop then re-reads the socket itself, or that request would
    wait for the next wake-up (none, if no client writes again). In-process
    with real sockets; the tier is a stand-in (fault injection) that keeps the
    lookup's callback for the test to call."""
    config = Config(pool=PoolConfig(size_mib=2, slab_mib=1, max_page_bytes=PAGE_BYTES))
    cache = Cache(config, pool_path="/nonexistent")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, asker, other = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    asker.setsockopt(zmq.ROUTING_ID, b"asker")
    endpoint = f"ipc://{tmp_path}/s"
    router.bind(endpoint)
    asker.connect(endpoint)
    callbacks: list[Callable[[int], None]] = []

    class HeldTier:
        def lookup(self, ns: bytes, keys: list[bytes], answer: Callable[[int], None]) -> None:
            callbacks.append(answer)

    async def run() -> p.AnyReply | None:
        tier = cast(Tier, HeldTier())
        loop = RequestLoop(router, cache, config.server, tenants=False, metrics=None, tier=tier)
        loop.start()
        asker.send(b"")  # connected and known to the router, before the lookup
        await asyncio.sleep(0.2)
        hello = p.Hello(id=3, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)
        reply = p.Error(id=1, code="bad_request", message="what the lookup answers")
        loop._lookup(b"asker", L3Lookup(b"n", [b"k"], lambda _: reply, 1), 0)
        other.connect(endpoint)
        other.send(p.encode(hello))
        # the event loop is held (no await): the request comes in, its command pending
        time.sleep(0.3)  # noqa: ASYNC251
        callbacks.pop()(0)  # the reply goes out, now, before the loop looks again
        for _ in range(200):
            if other.poll(0):
                return p.reply_decoder.decode(other.recv())
            await asyncio.sleep(0.01)
        return None

    try:
        answered = asyncio.run(run())
        assert isinstance(answered, p.HelloOk) and answered.id == 3
        assert asker.poll(2000)  # and the reply that waited went out
    finally:
        for sock in (router, asker, other):
            sock.close(0)
        ctx.term()
