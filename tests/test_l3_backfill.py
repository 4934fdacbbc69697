"""Under write_through every committed page belongs in L3. A page whose write
was missed (the store down, the write queue full, a failed write) used to
stay in L2 alone: L3 never got it unless a restart adopted it, so an outage
or a burst left L3 short of every page committed meanwhile, and those pages
were lost to the cache once L2 let go of them. Now the daemon writes what L2
holds and L3 lacks once the store can take it (daemon/backfill.py), through
real daemons; the store's faults are injected (the ``faulty`` backend's
``down_file`` and ``write_delay_s``) or a real S3 server's (the fault proxy)."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hicached import Client, Namespace
from hicached.config import StorageConfig
from hicached.daemon.backfill import Backfill
from hicached.state.pool import GEN_GRANULE
from hicached.testing import scrape
from tests.l3rig import Harness
from tests.l3util import evict_everything, l3_count, storage, wait_for, wait_prefetch
from tests.services import S3Server
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for
from tests.test_reload import _sighup
from tests.test_s3_l3break import quick_breaker_daemon

_buckets = itertools.count()


def seq(start: int, pages: int) -> np.ndarray:
    return np.arange(start, start + pages * PAGE_TOKENS, dtype=np.uint32)


def faulty(d_dir: Path, policy: str = "write_through", more: str = "") -> dict[str, object]:
    """A daemon over the faulty backend (a memory store inside) that is down
    while ``d_dir/down`` exists."""
    return {
        "size_mib": 1,
        "slab_mib": 1,
        "allow_faults": True,
        "storage": storage(
            "faulty",
            policy,
            "breaker_failures = 1\nbreaker_cooldown_s = 0.2\nretries = 0\n" + more,
        ),
        "tail": f'[storage.extra]\ninner = "memory"\ndown_file = "{d_dir / "down"}"\n',
    }


def store_one_by_one(c: Client, ns: Namespace, sequences: int, pages: int) -> None:
    """Store ``sequences`` sequences of ``pages`` pages, each once the writes
    of the one before left the queue."""
    for k in range(sequences):
        toks = seq(k * 10**5, pages)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: c.stats().l3.get("queued", 0) == 0)


def all_read_back_from_l3(c: Client, ns: Namespace, seqs: list[np.ndarray]) -> None:
    """Every page of ``seqs`` is read back whole from L3 once L2 let go of it."""
    evict_everything(c, ns)
    for toks in seqs:
        assert c.match(ns, toks, lease=False).hits == 0, "still in L2"
        pf = c.prefetch(ns, toks)
        assert wait_prefetch(c, pf).completed == len(toks) // PAGE_TOKENS, "not in L3"
        c.commit(pf)
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))


def test_pages_committed_while_the_store_was_down_are_written_once_it_is_back(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Writes fail, the breaker marks the store down, and more pages are
    committed meanwhile (their writes skipped). Before, once the store was
    back, none of them was ever written: L3 lacked all 8, and they were gone
    from the cache once evicted. Now they are written once it is up, and read
    back from L3."""
    down = tmp_path / "down"
    d = daemon_factory(**faulty(tmp_path))
    with d.client() as c:
        ns = c.register(**NS)
        before = seq(0, 4)
        c.store(ns, before, page_bytes_for(before))
        wait_for(lambda: l3_count(c, "pages_written") == 4)
        down.touch()
        failed = seq(10**5, 4)
        c.store(ns, failed, page_bytes_for(failed))
        wait_for(lambda: c.stats().l3_state == "down")
        skipped = seq(2 * 10**5, 4)
        c.store(ns, skipped, page_bytes_for(skipped))
        stats = c.stats().l3
        assert stats.get("write_failed", 0) + stats.get("write_skipped_down", 0) >= 8
        assert stats["backfill_pending"] == 8  # what L3 will be given once it is back
        metrics = scrape(c.stats().metrics_endpoint)
        assert metrics[("hicached_l3_state", (("what", "backfill_pending"),))] == 8
        down.unlink()
        wait_for(lambda: c.stats().l3_pages_known == 12)
        assert c.stats().l3["backfill_pending"] == 0
        assert l3_count(c, "backfill_runs") >= 1
        assert l3_count(c, "backfill_queued") >= 8
        all_read_back_from_l3(c, ns, [before, failed, skipped])


def test_pages_refused_by_a_full_write_queue_are_written_as_it_drains(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A burst past ``queue_pages``: the writes beyond the bound are refused
    (L2 never waits on L3), and written later as the queue drains, within the
    same bound."""
    d = daemon_factory(
        **faulty(
            tmp_path,
            more="queue_pages = 8\nbatch_pages = 2\nconcurrency = 2\n",
        )
        | {"tail": '[storage.extra]\ninner = "memory"\nwrite_delay_s = 0.05\n'}
    )
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 40)
        c.store(ns, toks, page_bytes_for(toks))
        assert l3_count(c, "write_dropped_full") >= 24

        def all_known() -> bool:
            s = c.stats()
            assert s.l3["queued_pages"] + s.l3["in_flight_pages"] <= 8
            return s.l3_pages_known == 40

        wait_for(all_known, timeout=30)
        all_read_back_from_l3(c, ns, [toks])


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_only_a_policy_that_writes_every_page_writes_missed_ones(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, policy: str
) -> None:
    """Under write_through_selective a page goes to L3 once matched often
    enough, and under write_back when it leaves L2: what L2 holds and L3
    lacks is no missed write there, and nothing is written of it once the
    store is back."""
    down = tmp_path / "down"
    d = daemon_factory(**faulty(tmp_path, policy, "selective_hits = 1\n"))
    with d.client() as c:
        ns = c.register(**NS)
        down.touch()
        toks = seq(0, 4)
        c.store(ns, toks, page_bytes_for(toks))
        for _ in range(3):  # selective: matched, so written (and failing)
            c.match(ns, toks, lease=False)
        evict_everything(c, ns)  # write_back: written as they leave (and failing)
        wait_for(lambda: c.stats().l3_state == "down")
        down.unlink()
        wait_for(lambda: c.stats().l3_state == "up")
        kept = seq(10**6, 4)
        c.store(ns, kept, page_bytes_for(kept))
        assert c.match(ns, kept, lease=False).hits == 4
        time.sleep(2.0)  # past the first backfill's wait
        assert l3_count(c, "backfill_runs") == 0


def test_a_page_l3_let_go_of_in_this_stay_is_not_written_again_by_the_backfill() -> None:
    """L3 let go of a page while L2 holds it, and L3 proved smaller than L2:
    the page is not written again in this stay, by any path (cache/tiering.py).
    The backfill's listing of what L3 lacks leaves it out, and a write of it
    from an older listing is not queued."""
    h = Harness()
    h.hello()
    ns = h.register()
    keys = h.store(ns, [1, 2])
    for key in keys:
        h.tier.finish(key)
    tiering = h.cache.tiering
    h.cache.forget_l3([keys[0]], ns.digest)
    assert keys[0] in tiering.let_go, "the harness no longer makes L3 undersized"
    assert [key for _, key, _, _ in tiering.unwritten_pages()] == []
    state = h.cache.names.by_digest[ns.digest]
    slots = state.index.slots()
    [(slot, gen)] = [
        (slot, int(h.cache.pool.gens[slot // GEN_GRANULE]))
        for key, slot, _ in state.index.pages_at(slots)
        if key == keys[0]
    ]
    assert tiering.write_back([(state, keys[0], slot, gen)]) == 0
    assert keys[0] not in h.tier.pending


def test_pages_committed_while_s3_fails_are_written_once_it_answers(
    daemon_factory: Callable[..., Daemon], s3: S3Server
) -> None:
    """A real S3 server behind the fault proxy answers every request with 500
    for a while: the pages committed meanwhile are in the bucket once it
    answers again, and read back from it."""
    from tests.faults import FaultProxy

    bucket = s3.make_bucket(f"backfill-{next(_buckets)}")
    proxy = FaultProxy(s3.endpoint, seed=7)
    try:
        d = quick_breaker_daemon(daemon_factory, proxy.endpoint, bucket, 0.3)
        with d.client() as c:
            ns = c.register(**NS)
            before = seq(0, 4)
            c.store(ns, before, page_bytes_for(before))
            wait_for(lambda: l3_count(c, "pages_written") == 4)
            proxy.rates = {"error": 1.0}
            during = [seq((k + 1) * 10**5, 2) for k in range(4)]
            for toks in during:
                c.store(ns, toks, page_bytes_for(toks))
            wait_for(lambda: c.stats().l3_state == "down")
            proxy.rates = {}
            wait_for(lambda: c.stats().l3_pages_known == 12, timeout=30)
            all_read_back_from_l3(c, ns, [before, *during])
    finally:
        proxy.stop()


def exists_calls(c: Client) -> float:
    """Existence checks the daemon asked of its store so far (its metrics)."""
    metrics = scrape(c.stats().metrics_endpoint)
    return sum(
        value
        for (name, labels), value in metrics.items()
        if name == "hicached_l3_call_seconds_count" and ("op", "exists") in labels
    )


def test_a_bursty_load_on_a_healthy_store_loses_no_page_to_the_backfill_s_wait(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Bursts of 32 pages against a queue of 8 on a store that never fails a
    write: the pages past the bound are written by the backfill, a second
    after they were missed every time. The first version doubled its wait
    after every run, failing writes or not (1, 2, 4, 8 s...), so L2 (256
    pages, 2.4 s of this load) let go of pages before a run listed them:
    they never reached L3."""
    d = daemon_factory(
        **faulty(tmp_path, more="queue_pages = 8\nbatch_pages = 2\nconcurrency = 2\n")
        | {"tail": '[storage.extra]\ninner = "memory"\nwrite_delay_s = 0.005\n'}
    )
    with d.client() as c:
        ns = c.register(**NS)
        end = time.monotonic() + 11.0  # into the 8 s wait after runs at 1, 3 and 7 s
        i = 0
        while time.monotonic() < end:
            toks = seq(i * 1000, 32)
            c.store(ns, toks, page_bytes_for(toks))
            i += 1
            time.sleep(0.3)
        assert l3_count(c, "write_dropped_full") > 0
        wait_for(lambda: (s := c.stats()).l3_pages_known == s.committed_pages, timeout=10)
        assert l3_count(c, "write_failed") == 0


def test_a_backfill_leaves_half_the_queue_to_pages_committed_meanwhile(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """200 pages missed while the store was down are written as the queue has
    room, but only into half of it: pages committed meanwhile find room and
    are written at once. The first version filled the whole queue, so every
    page committed during a backfill was refused, and waited for the next."""
    down = tmp_path / "down"
    d = daemon_factory(
        **faulty(tmp_path, more="queue_pages = 16\nbatch_pages = 2\nconcurrency = 2\n")
        | {
            "tail": f'[storage.extra]\ninner = "memory"\nwrite_delay_s = 0.05\n'
            f'down_file = "{down}"\n'
        }
    )
    with d.client() as c:
        ns = c.register(**NS)
        down.touch()
        for k in range(4):
            toks = seq(k * 10**5, 50)
            c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: c.stats().l3_state == "down")
        down.unlink()
        wait_for(lambda: l3_count(c, "backfill_runs") >= 1)
        dropped = l3_count(c, "write_dropped_full")
        for k in range(8):
            toks = seq(10**8 + k * 10**5, 2)
            c.store(ns, toks, page_bytes_for(toks))
            time.sleep(0.2)
        assert l3_count(c, "write_dropped_full") == dropped
        wait_for(lambda: c.stats().l3_pages_known == 216, timeout=30)


def test_a_missed_page_is_written_without_asking_the_store_about_l2(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """With the store holding more keys than ``known_keys``, the daemon's
    record of L3 is incomplete. The first version listed every page L2 holds
    and L3 was not known to hold, and asked the store of each: one missed page
    cost an existence check per page of L2 (about 1,000 here; 16,000 for a
    64 MiB pool), slowed the requests' own lookups, and came last. Now the
    missed pages are written by key, and nothing is asked."""
    down = tmp_path / "down"
    d = daemon_factory(**faulty(tmp_path, more="known_keys = 64\n") | {"size_mib": 4})
    with d.client() as c:
        ns = c.register(**NS)
        store_one_by_one(c, ns, 16, 60)
        assert c.stats().l3["index_complete"] == 0
        asked = exists_calls(c)
        down.touch()
        missed = seq(10**9, 2)
        c.store(ns, missed, page_bytes_for(missed))
        wait_for(lambda: c.stats().l3_state == "down")
        written = l3_count(c, "pages_written")
        down.unlink()
        wait_for(lambda: l3_count(c, "pages_written") == written + 2)
        assert l3_count(c, "backfill_queued") == 2
        assert exists_calls(c) == asked


def test_after_a_reload_to_write_back_the_stop_flushes_what_l3_let_go_of(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Under write_through a store smaller than L2 lets go of pages L2 holds,
    which are then not written again in this stay. After a reload to
    write_back, a page leaves L2 written all the same, and so the stop's
    flush writes such pages too: the first version of the backfill's filter
    left them out of it (the flush found 0 pages L3 lacked, not 48)."""
    d = daemon_factory(
        **faulty(tmp_path)
        | {
            "tail": '[storage.extra]\ninner = "memory"\n'
            "[storage.extra.inner_options]\nmax_pages = 16\n"
        }
    )
    with d.client() as c:
        ns = c.register(**NS)
        store_one_by_one(c, ns, 8, 8)
        stats = c.stats()
        assert stats.l3_undersized and stats.l3.get("rewrite_skipped", 0) > 0
        lines = _sighup(d, d.config.read_text().replace('"write_through"', '"write_back"'))
        assert "write_policy" in lines, lines
    assert d.stop() == 0
    [flushed] = re.findall(r"write-back flush: (\d+) pages L3 lacked", d.log.read_text())
    assert int(flushed) == stats.l3["rewrite_skipped"], d.log.read_text()


def test_the_wait_doubles_only_while_writes_fail_and_none_succeeds() -> None:
    """The policy of the wait before a run of missed pages (a model: no loop
    runs). Writes that fail while others succeed are a store that flaps, or
    a write caught by an outage the breaker waits out: the wait stays a
    second. The first version doubled it after every run with a failed
    write, so after a long flapping every later miss, on a healthy store
    too, waited up to ten minutes, and L2 could let go of the page first."""
    backfill = Backfill(None, None, StorageConfig(backend="memory"))  # type: ignore[arg-type]

    def run(failed: bool, written: bool) -> float:
        backfill._failed, backfill._written = failed, written
        wait = backfill._next_wait()
        backfill._last_run = time.monotonic()
        return wait

    assert [run(True, False) for _ in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert run(True, True) == 1.0  # flapping: some writes got through
    assert [run(True, False) for _ in range(2)] == [2.0, 4.0]
    assert run(False, False) == 1.0  # misses of a full queue alone
    backfill._wait = 600.0
    backfill._last_run = time.monotonic() - 3600.0  # a new outage, long after
    assert run(True, False) == 1.0


def test_a_reload_to_write_through_writes_what_l2_holds_and_l3_lacks(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Pages committed under write_back are in L2 alone. After a reload to
    write_through nothing would ever write them (write_through writes at a
    commit, not at an eviction): they left the cache with L2. Now the reload
    has them written, and they are read back from L3."""
    d = daemon_factory(**faulty(tmp_path, "write_back"))
    with d.client() as c:
        ns = c.register(**NS)
        seqs = [seq(k * 10**5, 4) for k in range(3)]
        for toks in seqs:
            c.store(ns, toks, page_bytes_for(toks))
        assert c.stats().l3_pages_known == 0
        lines = _sighup(d, d.config.read_text().replace('"write_back"', '"write_through"'))
        assert "write_policy" in lines, lines
        wait_for(lambda: c.stats().l3_pages_known == 12)
        all_read_back_from_l3(c, ns, seqs)
