"""The S3 backend through real daemons and a real S3 server (moto's server mode)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hicached.hashing import pack_tokens, page_keys
from hicached.testing import free_tcp_port, scrape
from tests.faults import FaultProxy
from tests.l3util import (
    down_and_l2_serves,
    evict_everything,
    l3_count,
    refused_start,
    settle_writes,
    storage,
    wait_for,
    wait_prefetch,
    written_and_read_back,
)
from tests.services import S3Server
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for

_buckets = itertools.count()


def seq(start: int, pages: int) -> np.ndarray:
    return np.arange(start, start + pages * PAGE_TOKENS, dtype=np.uint32)


def s3_tail(endpoint: str, bucket: str, **more: object) -> str:
    lines = [
        "[storage.s3]",
        f'bucket = "{bucket}"',
        f'endpoint_url = "{endpoint}"',
        'access_key_id = "testing"',
        'secret_access_key = "testing"',
        'region = "us-east-1"',
    ]
    more = {"threads": 8, **more}
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in more.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def bucket(s3: S3Server) -> str:
    return s3.make_bucket(f"pages-{next(_buckets)}")


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3.endpoint, seed=3)
    yield p
    p.stop()


def test_two_hosts_share_pages_through_one_bucket(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str
) -> None:
    a = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("s3"), tail=s3_tail(s3.endpoint, bucket)
    )
    b = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("s3"), tail=s3_tail(s3.endpoint, bucket)
    )
    toks = seq(0, 16)
    with a.client() as ca:
        ns = ca.register(**NS)
        ca.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(ca, "written") == 16)
    with b.client() as cb:
        ns = cb.register(**NS)
        assert cb.match(ns, toks, lease=False).hits == 0  # another host: not in this L2
        pf = cb.prefetch(ns, toks)
        done = wait_prefetch(cb, pf)
        assert (done.completed, done.failed) == (16, False)
        cb.commit(pf)
        assert np.array_equal(cb.load(ns, toks), page_bytes_for(toks))
    # objects are named from digests only, spread over 2-hex-digit prefixes
    names = [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]]  # type: ignore[attr-defined]
    assert len(names) == 16 and all(
        n.startswith("hicached/") and len(n.split("/")) == 4 for n in names
    )


def test_a_missing_bucket_stops_the_start(s3: S3Server) -> None:
    """A daemon whose bucket does not exist would fail every write: it exits 2."""
    d = Daemon(size_mib=1, slab_mib=1, storage=storage("s3"), tail=s3_tail(s3.endpoint, "absent"))
    refused_start(d, "S3 bucket 'absent' does not exist")


def test_a_store_that_comes_up_after_the_daemon_is_used_once_it_answers(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """No S3 server at the endpoint yet at the daemon's start: it serves from
    L2 with L3 down (not up with every call failing until the breaker opens),
    and its probe finds the store once it answers with the bucket."""
    port = free_tcp_port()
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        storage=storage("s3", more="breaker_cooldown_s = 0.3\n"),
        tail=s3_tail(f"http://127.0.0.1:{port}", "late", max_attempts=1),
    )
    server = None
    try:
        with d.client(timeout=10.0) as c:
            ns = down_and_l2_serves(d, c)
            server = S3Server(port=port)
            time.sleep(1.0)  # probes that find the server without the bucket keep it down
            assert c.stats().l3_state == "down"
            server.make_bucket("late")
            wait_for(lambda: c.stats().l3_state == "up", timeout=30)
            written_and_read_back(c, ns)
    finally:
        if server is not None:
            server.stop()


def test_s3_faults_never_give_wrong_bytes(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    proxy.rates = {"slowdown": 0.1, "error": 0.1, "reset": 0.1}
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        storage=storage(
            "s3", more="retries = 2\nretry_backoff_s = 0.01\nbreaker_failures = 1000\n"
        ),
        tail=s3_tail(proxy.endpoint, bucket, max_attempts=3, read_timeout_s=5.0),
    )
    sequences = [seq(k * 10**5, 12) for k in range(6)]
    with d.client() as c:
        ns = c.register(**NS)
        for toks in sequences:
            c.store(ns, toks, page_bytes_for(toks))
        settle_writes(c)
        stats = c.stats()
        written = stats.l3.get("written", 0)
        assert written + stats.l3.get("write_failed", 0) == 72
        assert written > 0
        evict_everything(c, ns)
        loaded = 0
        for toks in sequences:
            pf = c.prefetch(ns, toks)
            done = wait_prefetch(c, pf, timeout=60)
            c.commit(pf)
            got = c.load(ns, toks)
            assert len(got) == done.completed
            assert np.array_equal(got, page_bytes_for(toks)[: len(got)]), (
                "wrong bytes under S3 faults"
            )
            loaded += len(got)
        assert loaded > 0
    assert sum(proxy.injected.values()) > 10
    # the retry budget holds: botocore's 3 attempts, times 1 + 2 dispatcher retries
    assert max(proxy.seen.values()) <= 3 * 3 * 2  # a key is read and written at most once each
    uploads = s3.client().list_multipart_uploads(Bucket=bucket)  # type: ignore[attr-defined]
    assert not uploads.get("Uploads"), "a multipart upload was left behind"


def test_s3_outage_never_blocks_l2(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    d = daemon_factory(
        size_mib=4,
        slab_mib=1,
        storage=storage(
            "s3",
            more=(
                "op_timeout_s = 2.0\nbreaker_failures = 2\nbreaker_cooldown_s = 1.0\nretries = 0\n"
            ),
        ),
        tail=s3_tail(
            proxy.endpoint, bucket, max_attempts=1, read_timeout_s=1.0, connect_timeout_s=1.0
        ),
    )
    with d.client(timeout=2.0) as c:
        ns = c.register(**NS)
        proxy.hang.set()  # S3 stops answering
        for k in range(20):  # every L2 operation still answers within the client's 2 s
            toks = seq(k * 10**5, 8)
            c.store(ns, toks, page_bytes_for(toks))
            assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))
            pf = c.prefetch(ns, seq(9 * 10**6, 4))
            c.progress(pf)
            c.cancel(pf)
        wait_for(lambda: c.stats().l3_state == "down", timeout=20)
        assert c.stats().l3.get("breaker_opened", 0) >= 1
        metrics = c.stats().metrics_endpoint
        assert scrape(metrics)[("hicached_l3_up", (("backend", "s3"),))] == 0
        proxy.hang.clear()  # S3 is back: the breaker's probe lets writes through again
        time.sleep(1.5)
        toks = seq(7 * 10**6, 8)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: c.stats().l3_state == "up" and l3_count(c, "written") >= 8, timeout=20)
        assert scrape(metrics)[("hicached_l3_up", (("backend", "s3"),))] == 1


def test_a_stop_keeps_its_deadline_while_s3_hangs(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """S3 stops answering with writes in flight (each may take 3 x 10 s with
    retries): a graceful stop still ends near storage.flush_deadline_s, saying
    what it left, instead of waiting for the hung calls."""
    d = daemon_factory(
        size_mib=4,
        slab_mib=1,
        storage=storage("s3", more="flush_deadline_s = 1.0\nbreaker_failures = 1000\n"),
        tail=s3_tail(proxy.endpoint, bucket, max_attempts=3, read_timeout_s=10.0),
    )
    with d.client() as c:
        ns = c.register(**NS)
        proxy.hang.set()
        toks = seq(0, 16)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "in_flight_pages") > 0)
    started = time.monotonic()
    try:
        assert d.stop(timeout=20) == 0
        assert time.monotonic() - started < 8.0, "the stop waited for hung S3 calls"
    finally:
        proxy.hang.clear()
    assert "storage calls still running" in d.log.read_text()


def test_a_bad_object_is_forgotten_and_written_again(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str
) -> None:
    """An object whose bytes were replaced (here: by another page's record) is a
    miss, and the daemon forgets it: the next store of that page writes it
    again, so L3 serves the sequence whole once more instead of ending every
    prefetch at the bad object for good."""
    d = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("s3"), tail=s3_tail(s3.endpoint, bucket)
    )
    toks = seq(0, 8)
    client = s3.client()
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 8)
        keys = page_keys(ns.digest, pack_tokens(toks), PAGE_TOKENS)
        name = [f"hicached/{k.hex()[:2]}/{ns.digest.hex()}/{k.hex()}" for k in keys]
        other = client.get_object(Bucket=bucket, Key=name[4])["Body"].read()  # type: ignore[attr-defined]
        client.put_object(Bucket=bucket, Key=name[3], Body=other)  # type: ignore[attr-defined]
        evict_everything(c, ns)
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (3, True)
        assert c.commit(pf).published == 3
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks)[:3])
        assert c.stats().l3["store_bad_objects"] == 1
        # the engine computes the rest again and stores the sequence: page 3 goes
        # to S3 again, as L3 no longer holds it
        c.store(ns, toks, page_bytes_for(toks))
        settle_writes(c)
        evict_everything(c, ns, salt=8)
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (8, False), "the bad object was never written again"
        c.commit(pf)
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))


def test_a_store_down_at_the_start_leaves_the_index_incomplete(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """S3 fails the start (here every request answers 500 while the daemon
    starts): it is down from the start and not listed then, so the daemon does
    not take what it knows for all the store holds; once S3 answers again a
    match asks it about the keys it does not know and finds the pages another
    daemon wrote."""
    a = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("s3"), tail=s3_tail(s3.endpoint, bucket)
    )
    toks = seq(0, 8)
    with a.client() as ca:
        ns = ca.register(**NS)
        ca.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(ca, "written") == 8)
    proxy.rates = {"error": 1.0}
    b = daemon_factory(
        size_mib=1,
        slab_mib=1,
        storage=storage("s3", more="breaker_failures = 1000\nbreaker_cooldown_s = 0.3\n"),
        tail=s3_tail(proxy.endpoint, bucket, max_attempts=1),
    )
    with b.client() as cb:
        assert cb.stats().l3_state == "down"
        proxy.rates = {}
        wait_for(lambda: cb.stats().l3_state == "up")
        assert cb.stats().l3["index_complete"] == 0
        ns = cb.register(**NS)
        assert cb.match(ns, toks, lease=False).l3_hits == 8


def test_a_lookup_is_answered_while_prefetch_gets_queue(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """S3 answers every GET after 1.5 s (the proxy's delay: fault injection in
    front of the real server) and four prefetches queue 32 of them on two read
    threads: a match that asks S3 about pages the daemon does not know still
    gets every page within its lookup's 3 s, since existence checks (HEADs)
    run on threads of their own."""
    d = daemon_factory(
        size_mib=16,
        slab_mib=1,
        storage=storage("s3", more="scan_on_start = false\nlookup_timeout_s = 3.0\n"),
        tail=s3_tail(proxy.endpoint, bucket, threads=2),
    )
    seqs = [seq(k * 10**5, 8) for k in range(5)]
    with d.client(timeout=30.0) as c:
        ns = c.register(**NS)
        for toks in seqs:
            c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 40, timeout=30)
    assert d.stop() == 0
    d.start()  # a new pool: the pages are in S3 alone, and the daemon knows none
    proxy.delay = {"GET": 1.5}
    try:
        with d.client(timeout=30.0) as c:
            ns = c.register(**NS)
            fetches = [c.prefetch(ns, toks) for toks in seqs[:4]]
            wait_for(lambda: sum(n for k, n in proxy.seen.items() if k.startswith("GET")) >= 2)
            assert c.match(ns, seqs[4], lease=False).l3_hits == 8
            s = c.stats()
            assert s.l3["lookups"] == 1 and s.l3["lookups_late"] == 0
            for pf in fetches:
                c.cancel(pf)
    finally:
        proxy.delay = {}


def test_an_object_deleted_behind_the_daemons_back_is_forgotten_at_its_read(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str
) -> None:
    """Another host (or a bucket lifecycle rule) deletes one object of a stored
    sequence. ``exists`` bisects with 8 HEADs a round and does not probe it, so
    the prefetch plans the whole run and its read of the deleted object finds
    no such object: the prefetch ends there, and the daemon forgets the page.
    Before, it kept it: every match went on reporting the whole run as L3 hits
    that no read can serve, and the next store of the sequence skipped the page
    (L3 "held" it), so no prefetch got past it again."""
    d = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("s3"), tail=s3_tail(s3.endpoint, bucket)
    )
    toks = seq(0, 16)
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 16)
        keys = page_keys(ns.digest, pack_tokens(toks), PAGE_TOKENS)
        k = keys[5].hex()
        s3.client().delete_object(Bucket=bucket, Key=f"hicached/{k[:2]}/{ns.digest.hex()}/{k}")  # type: ignore[attr-defined]
        evict_everything(c, ns)
        assert c.match(ns, toks, lease=False).l3_hits == 16  # as far as the daemon knows
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.planned, done.completed, done.failed) == (16, 5, True)
        c.commit(pf)
        assert c.match(ns, toks, lease=False).l3_hits == 0, "a deleted object is still an L3 hit"
        evict_everything(c, ns, salt=8)
        assert c.match(ns, toks, lease=False).l3_hits == 5, "a deleted object is still an L3 hit"
        # the engine computes the rest again and stores the sequence: page 5 goes
        # to S3 again, and L3 serves the sequence whole
        c.store(ns, toks, page_bytes_for(toks))
        settle_writes(c)
        evict_everything(c, ns, salt=9)
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (16, False), "the deleted page was never written"
        c.commit(pf)
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))


def test_a_scan_tried_again_does_not_learn_an_object_a_read_let_go_of(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str
) -> None:
    """Fault injection: the faulty backend around the real S3 backend breaks off
    the restart's first listing after one page (``scan_failures``), so the scan
    is tried again after ``scan_retry_s``. Meanwhile a prefetch reads an object
    whose bytes were replaced (a record of another format version, which the
    read leaves in place as another writer's): a miss, and the daemon forgets
    the page. The object stays in the bucket, so the listing tried again names
    it: it must not make the page known again (L3 hits no read can
    serve, and the next store of the sequence skipping the page), as a page let
    go of while one listing runs is not learned from it."""
    toks = seq(0, 8)
    d = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("s3"), tail=s3_tail(s3.endpoint, bucket)
    )
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 8)
    assert d.stop() == 0
    client = s3.client()
    keys = page_keys(ns.digest, pack_tokens(toks), PAGE_TOKENS)
    name = [f"hicached/{k.hex()[:2]}/{ns.digest.hex()}/{k.hex()}" for k in keys]
    other = bytearray(client.get_object(Bucket=bucket, Key=name[3])["Body"].read())  # type: ignore[attr-defined]
    other[4:6] = (2).to_bytes(2, "little")  # the record format's version
    client.put_object(Bucket=bucket, Key=name[3], Body=bytes(other))  # type: ignore[attr-defined]
    inner = s3_tail(s3.endpoint, bucket).replace("[storage.s3]", "[storage.extra.inner_options]")
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        allow_faults=True,
        storage=storage("faulty", more="scan_retry_s = 3.0\n"),
        tail=f'[storage.extra]\ninner = "s3"\nscan_failures = 1\n{inner}',
    )
    with d.client() as c:
        wait_for(lambda: c.stats().l3["scan_failed"] == 1)
        ns = c.register(**NS)
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (3, True)
        c.cancel(pf)
        assert c.stats().l3["index_complete"] == 0, "the scan was tried again too soon"
        wait_for(lambda: c.stats().l3["index_complete"] == 1, timeout=30)
        assert c.stats().l3["scan_pages"] == 8
        assert c.match(ns, toks, lease=False).l3_hits == 3, "the bad object is known again"
        c.store(ns, toks, page_bytes_for(toks))  # page 3 goes to S3 again
        settle_writes(c)
        evict_everything(c, ns)
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (8, False)
        c.commit(pf)
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))
