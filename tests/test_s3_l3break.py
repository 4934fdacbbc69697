"""The S3 backend under attack, through real daemons and a real S3 server
(moto's server mode on loopback): damaged objects, a store that restarts."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from hicached.hashing import pack_tokens, page_keys
from tests.l3util import evict_everything, l3_count, storage, wait_for, wait_prefetch
from tests.services import S3Server
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for
from tests.test_s3_daemon import s3_tail

_buckets = itertools.count()


def seq(start: int, pages: int) -> np.ndarray:
    return np.arange(start, start + pages * PAGE_TOKENS, dtype=np.uint32)


@pytest.fixture
def bucket(s3: S3Server) -> str:
    return s3.make_bucket(f"l3break-{next(_buckets)}")


def names(ns_digest: bytes, toks: np.ndarray) -> list[str]:
    keys = page_keys(ns_digest, pack_tokens(toks), PAGE_TOKENS)
    return [f"hicached/{k.hex()[:2]}/{ns_digest.hex()}/{k.hex()}" for k in keys]


def listed(client: object, bucket: str) -> set[str]:
    pages = client.list_objects_v2(Bucket=bucket).get("Contents", [])  # type: ignore[attr-defined]
    return {item["Key"] for item in pages}


def test_an_object_that_fails_verification_is_deleted_not_relisted(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str
) -> None:
    """Objects under our names whose bytes are not the page's record: cut short,
    a payload byte flipped (bad checksum), another page's record, bytes of no
    record at all. A read finds each bad (a miss), and before, the daemon only
    forgot it: the object stayed, so every restart's listing learned it again,
    a match counted it as an L3 hit no read can serve, and under write_through
    the page was not written again (L3 "held" it) until a read failed once
    more. Now the read deletes such an object (only if the store's ETag says
    the bytes read are what it holds), so no later listing names it. An
    object of another record format version (another writer's) is a miss
    too, and is left alone."""
    d = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("s3"), tail=s3_tail(s3.endpoint, bucket)
    )
    seqs = [seq(k * 10**5, 4) for k in range(5)]
    with d.client() as c:
        ns = c.register(**NS)
        for toks in seqs:
            c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 20)
    assert d.stop() == 0
    client = s3.client()
    victims = [names(ns.digest, toks)[2] for toks in seqs]

    def body(name: str) -> bytes:
        return client.get_object(Bucket=bucket, Key=name)["Body"].read()  # type: ignore[attr-defined,no-any-return]

    def put(name: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=name, Body=data)  # type: ignore[attr-defined]

    good = body(victims[0])
    put(victims[0], good[: len(good) // 2])  # cut short
    flipped = bytearray(body(victims[1]))
    flipped[-1] ^= 0xFF
    put(victims[1], bytes(flipped))  # bad checksum
    put(victims[2], body(names(ns.digest, seqs[2])[3]))  # another page's record
    put(victims[3], b"not a record" * 100)  # no record at all
    other = bytearray(body(victims[4]))
    other[4:6] = (2).to_bytes(2, "little")  # a record of another format version
    put(victims[4], bytes(other))

    d.start()  # a new pool: the pages are in S3 alone
    with d.client() as c:
        wait_for(lambda: c.stats().l3["index_complete"] == 1)
        ns = c.register(**NS)
        for toks in seqs:
            assert c.match(ns, toks, lease=False).l3_hits == 4  # as the listing says
            pf = c.prefetch(ns, toks)
            done = wait_prefetch(c, pf)
            assert (done.completed, done.failed) == (2, True)
            c.commit(pf)
            assert np.array_equal(c.load(ns, toks), page_bytes_for(toks)[:2])
        assert c.stats().l3["store_bad_objects"] == 5
    left = listed(client, bucket)
    assert not left & set(victims[:4]), "a bad object stayed to be listed again"
    assert victims[4] in left, "another format version's record was deleted"
    assert d.stop() == 0
    d.start()
    with d.client() as c:
        wait_for(lambda: c.stats().l3["index_complete"] == 1)
        ns = c.register(**NS)
        for toks in seqs[:4]:
            assert c.match(ns, toks, lease=False).l3_hits == 2, "a bad object was listed again"


def quick_breaker_daemon(
    daemon_factory: Callable[..., Daemon], endpoint: str, bucket: str, cooldown_s: float
) -> Daemon:
    """A daemon over S3 at ``endpoint`` whose first failed call marks the store
    down (no retries), probed again after ``cooldown_s``."""
    more = f"breaker_failures = 1\nbreaker_cooldown_s = {cooldown_s}\nretries = 0\n"
    return daemon_factory(
        size_mib=1,
        slab_mib=1,
        storage=storage("s3", more=more),
        tail=s3_tail(endpoint, bucket, max_attempts=1),
    )


def test_no_l3_hit_is_reported_while_the_store_is_down(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str
) -> None:
    """S3 answers every request with 500 (the fault proxy in front of the real
    server) and the breaker marks the backend down. Before, a match went on
    counting the pages the daemon knows in L3 as hits, though no read could
    serve one (a prefetch fails at once while the store is down): an engine
    planned loads that could not happen, for as long as the outage lasted. A
    miss is always legal: while L3 is down a match reports no L3 hit, and once
    the breaker's probe finds the store back, the hits are reported again."""
    from tests.faults import FaultProxy

    proxy = FaultProxy(s3.endpoint, seed=5)
    try:
        d = quick_breaker_daemon(daemon_factory, proxy.endpoint, bucket, 0.5)
        toks = seq(0, 8)
        with d.client() as c:
            ns = c.register(**NS)
            c.store(ns, toks, page_bytes_for(toks))
            wait_for(lambda: l3_count(c, "written") == 8)
            evict_everything(c, ns)
            assert c.match(ns, toks, lease=False).l3_hits == 8
            proxy.rates = {"error": 1.0}
            failing = itertools.count(1)

            def down() -> bool:  # writes that fail open the breaker
                more_toks = seq(next(failing) * 10**6, 2)
                c.store(ns, more_toks, page_bytes_for(more_toks))
                return c.stats().l3_state == "down"

            wait_for(down, timeout=30, step=0.2)
            assert c.match(ns, toks, lease=False).l3_hits == 0, "an L3 hit while L3 is down"
            proxy.rates = {}
            wait_for(lambda: c.stats().l3_state == "up")
            assert c.match(ns, toks, lease=False).l3_hits == 8
    finally:
        proxy.stop()


def test_an_object_far_larger_than_its_page_is_not_read_whole(
    daemon_factory: Callable[..., Daemon], s3: S3Server, bucket: str
) -> None:
    """A read took an object's body whole whatever its size: an object under a
    page's name far larger than the page's record (an operator's copy, another
    program's object) was read into the daemon's memory, once for each of the
    read threads at once, to be found bad. A body more than twice the page's
    record is now not read (``store_bytes_read`` counts what reads took): a
    miss, the page forgotten, the object left where it is (it cannot be
    judged unread); one up to twice the record's size is read and judged as
    before."""
    d = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("s3"), tail=s3_tail(s3.endpoint, bucket)
    )
    toks = seq(0, 4)
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 4)
        victim = names(ns.digest, toks)[2]
        client = s3.client()
        huge = 16 << 20
        client.put_object(Bucket=bucket, Key=victim, Body=b"\0" * huge)  # type: ignore[attr-defined]
        evict_everything(c, ns)
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (2, True)
        c.cancel(pf)
        assert l3_count(c, "store_bad_objects") == 1
        assert 0 < l3_count(c, "store_bytes_read") < huge // 4, "the object was read whole"
        assert victim in listed(client, bucket)
        found = c.match(ns, toks, lease=False)
        assert found.hits + found.l3_hits == 2, "the page stayed known"
