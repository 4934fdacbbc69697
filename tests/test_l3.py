"""The L3 tier through a real daemon: write policies, prefetch, faults, restarts."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hicached.errors import BadRequest
from tests.l3util import (
    FILE_STORE,
    evict_everything,
    l3_count,
    record_offset,
    refused_start,
    settle_writes,
    storage,
    wait_for,
    wait_prefetch,
)
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for


def seq(start: int, pages: int) -> np.ndarray:
    return np.arange(start, start + pages * PAGE_TOKENS, dtype=np.uint32)


@pytest.fixture
def file_daemon(daemon_factory: Callable[..., Daemon]) -> Callable[..., Daemon]:
    def make(policy: str = "write_through", more: str = "", tail: str = FILE_STORE) -> Daemon:
        return daemon_factory(
            size_mib=1, slab_mib=1, storage=storage("file", policy, more), tail=tail
        )

    return make


def test_write_through_reaches_l3_on_commit_and_comes_back(
    file_daemon: Callable[..., Daemon],
) -> None:
    d = file_daemon()
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 20)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 20)
        assert c.stats().l3_pages_known == 20 and c.stats().l3_backend == "file"
        evict_everything(c, ns)
        hit = c.match(ns, toks, lease=False)
        assert (hit.hits, hit.l3_hits) == (0, 20)
        pf = c.prefetch(ns, toks)
        assert pf.l2_hits == 0
        done = wait_prefetch(c, pf)
        assert (done.planned, done.completed, done.failed) == (20, 20, False)
        assert c.commit(pf).published == 20
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))
        # read by the store's reader processes, straight into the daemon's pool
        assert l3_count(c, "store_readers_alive") == 2
        assert l3_count(c, "store_reader_pages") == 20
        # already in L3: nothing is written twice
        assert l3_count(c, "written") == 20 + 256


def test_write_through_selective_waits_for_hits(file_daemon: Callable[..., Daemon]) -> None:
    d = file_daemon("write_through_selective", "selective_hits = 2\n")
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 6)
        c.store(ns, toks, page_bytes_for(toks))
        c.match(ns, toks, lease=False)
        time.sleep(0.3)
        assert l3_count(c, "written") == 0
        c.match(ns, toks[: 4 * PAGE_TOKENS], lease=False)  # another page is the deepest hit
        time.sleep(0.3)
        assert l3_count(c, "written") == 0
        c.match(ns, toks, lease=False)  # the 2nd hit of page 6: the whole prefix goes
        wait_for(lambda: l3_count(c, "written") == 6)


def test_write_back_writes_on_eviction_and_flushes_at_stop(
    file_daemon: Callable[..., Daemon],
) -> None:
    d = file_daemon("write_back")
    a, b = seq(0, 10), seq(10**6, 10)
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, a, page_bytes_for(a))
        time.sleep(0.3)
        assert l3_count(c, "written") == 0  # not on commit
        filler = seq(5 * 10**6, 256)
        c.store(ns, filler, np.zeros((256, 4096), np.uint8))  # evicts a: written back first
        wait_for(lambda: l3_count(c, "written") >= 10)
        settle_writes(c)
        c.store(ns, b, page_bytes_for(b))  # b stays in L2 until the stop
        assert c.match(ns, b, lease=False).hits == 10
    assert d.stop() == 0  # graceful: flushes b (and what is left of filler) within the deadline
    d.start()
    with d.client() as c:
        ns = c.register(**NS)
        wait_for(lambda: c.stats().l3_state == "up")  # the startup scan is done
        for toks in (a, b):
            assert c.match(ns, toks, lease=False).l3_hits == 10  # learned from the store at start
            pf = c.prefetch(ns, toks)
            assert wait_prefetch(c, pf).completed == 10
            c.commit(pf)
            assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))


def test_prefetch_commit_shorter_than_completed_and_cancel(
    file_daemon: Callable[..., Daemon],
) -> None:
    d = file_daemon()
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 12)
        c.store(ns, toks, page_bytes_for(toks))
        evict_everything(c, ns)
        pf = c.prefetch(ns, toks)
        assert wait_prefetch(c, pf).completed == 12
        with pytest.raises(BadRequest, match="has read 12"):
            c.commit(pf, pages=13)
        pf = c.prefetch(ns, toks)
        wait_prefetch(c, pf)
        assert c.commit(pf, pages=5).published == 5  # e.g. the minimum over ranks
        assert c.match(ns, toks, lease=False).hits == 5
        stats = c.stats()
        assert stats.reserved_pages == 0 and stats.leases == 0
        # the L2 part is kept; the rest is prefetched after it, then cancelled
        pf = c.prefetch(ns, toks)
        assert pf.l2_hits == 5
        wait_prefetch(c, pf)
        used = c.stats().pool_used_bytes
        c.cancel(pf)
        assert c.stats().pool_used_bytes == used - 7 * 4096
        assert c.match(ns, toks, lease=False).hits == 5
        # max_pages caps the read
        pf = c.prefetch(ns, toks, max_pages=3)
        assert wait_prefetch(c, pf).completed == 3
        assert c.commit(pf).published == 3
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks)[:8])


@pytest.mark.parametrize("tier", [False, True], ids=["no_l3", "file_l3"])
def test_a_prefetch_with_nothing_to_read_still_holds_its_l2_hit(
    daemon_factory: Callable[..., Daemon], tier: bool
) -> None:
    """Ranks agree on a prefetch's L2 hit plus what it read: the hit must stay
    until the commit even when there is nothing to read (all in L2, or no L3),
    or a rank could agree on pages evicted meanwhile."""
    more = {"storage": storage("file"), "tail": FILE_STORE} if tier else {}
    d = daemon_factory(size_mib=1, slab_mib=1, **more)
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 8)
        c.store(ns, toks, page_bytes_for(toks))
        pf = c.prefetch(ns, toks)
        assert pf.lease and pf.l2_hits == 8
        progress = c.progress(pf)
        assert progress.done and progress.completed == 0
        filler = seq(10**6, 256)  # a pool's worth of other pages
        c.store(ns, filler, page_bytes_for(filler))
        assert c.match(ns, toks, lease=False).hits == 8, "the hit was not held"
        c.commit(pf, pages=0)
        assert c.stats().leases == 0
        evict_everything(c, ns, salt=9)
        assert c.match(ns, toks, lease=False).hits == 0  # no longer held


def test_prefetch_declines_cleanly_when_the_pool_is_full(
    file_daemon: Callable[..., Daemon],
) -> None:
    d = file_daemon()
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 10)
        c.store(ns, toks, page_bytes_for(toks))
        evict_everything(c, ns)
        held = seq(9 * 10**6, 250)
        c.store(ns, held, np.zeros((250, 4096), np.uint8))
        settle_writes(c)
        hold = c.match(ns, held)  # 250 of 256 slots pinned
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.planned, done.completed) == (6, 6)  # what fits, in order
        assert c.commit(pf).published == 6
        c.release(hold)
        assert c.stats().l3.get("prefetch_pool_short") == 1


def test_corrupt_page_mid_sequence_truncates_the_prefetch(
    file_daemon: Callable[..., Daemon],
) -> None:
    d = file_daemon()
    store = d.dir / "data" / "pages"
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 10)
        c.store(ns, toks, page_bytes_for(toks))
        evict_everything(c, ns)
        segment, header = record_offset(store, ns.digest, toks, 6)
        with open(segment, "r+b") as f:  # flip one byte of page 6's payload
            f.seek(header + 64 + 100)
            byte = f.read(1)
            f.seek(header + 64 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (6, True)
        assert c.commit(pf).published == 6  # nothing after the gap, ever
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks)[:6])
        stats = c.stats()
        assert stats.l3["store_bad_records"] == 1 and stats.l3["prefetch_truncated"] == 1
        # the bad record was dropped: L3 now ends before it
        assert c.match(ns, toks, lease=False).l3_hits == 0  # 6 in L2, page 6 unknown
        pf = c.prefetch(ns, toks)
        assert wait_prefetch(c, pf).completed == 0
        c.cancel(pf)


def test_truncated_record_is_a_miss(file_daemon: Callable[..., Daemon]) -> None:
    d = file_daemon()
    store = d.dir / "data" / "pages"
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 4)
        c.store(ns, toks, page_bytes_for(toks))
        evict_everything(c, ns)
    assert d.stop() == 0
    segment, header = record_offset(store, ns.digest, toks, 3)
    with open(segment, "r+b") as f:  # zero the second half of page 3: a torn write
        f.seek(header + 64 + 2048)
        f.write(bytes(2048))
    d.start()
    with d.client() as c:
        ns = c.register(**NS)
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert done.completed == 3 and (done.failed or done.planned == 3)
        c.commit(pf)
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks)[:3])


WRITER = textwrap.dedent(
    """
    import sys, numpy as np, hicached
    from tests.support import NS, page_bytes_for
    endpoint, log, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
    try:
        with hicached.Client(endpoint, timeout=2.0) as c, open(log, "a") as out:
            ns = c.register(**NS)
            for i in range(first, first + 100000):
                toks = np.arange(8 * NS["page_tokens"], dtype=np.uint32) + np.uint32(i * 1000)
                c.store(ns, toks, page_bytes_for(toks))
                out.write(f"{i}\\n")
                out.flush()
    except hicached.HicachedError:
        pass  # the daemon was killed
    """
)


def test_sigkill_during_heavy_writes_never_serves_wrong_bytes(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Kill the daemon at random points while pages stream to the file store;
    after every restart each page read back is exact or a miss."""
    d = daemon_factory(
        size_mib=4,
        slab_mib=1,
        storage=storage("file", more="batch_pages = 16\n"),
        tail="[storage.file]\ncapacity_mib = 16\nsegment_mib = 2\nio_threads = 2\n",
    )
    log = d.dir / "written.log"
    rng = random.Random(42)
    first = 0
    discarded = 0
    verified: list[int] = []  # pages read back and compared, per cycle
    for cycle in range(6):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, d.endpoint, str(log), str(first)],
            cwd=Path(__file__).parents[1],
        )
        if cycle == 0:  # a loaded machine may take a while to start the writer
            wait_for(lambda: log.exists() and bool(log.read_text().split()), timeout=60)
        time.sleep(rng.uniform(0.3, 1.2))
        d.stop(signal.SIGKILL)
        writer.wait(30)
        first += 100000
        d.start()
        with d.client() as c:
            ns = c.register(**NS)
            stats = c.stats()
            discarded += stats.l3.get("store_discarded_on_start", 0)
            done = [int(x) for x in log.read_text().split()] if log.exists() else []
            assert cycle > 0 or done, "the writer wrote nothing before the kill"
            checked = 0
            for i in done[-40:] + done[:5]:
                toks = (np.arange(8 * PAGE_TOKENS, dtype=np.uint32) + i * 1000).astype(np.uint32)
                pf = c.prefetch(ns, toks)
                progress = wait_prefetch(c, pf)
                if progress.completed:
                    c.commit(pf)
                    got = c.load(ns, toks)
                    assert np.array_equal(got, page_bytes_for(toks)[: len(got)]), (
                        f"wrong bytes after cycle {cycle}"
                    )
                    checked += len(got)
                else:
                    c.cancel(pf)
            verified.append(checked)
    # most cycles read back pages written before their kill, and compared every byte
    assert sum(1 for n in verified if n) >= 3, f"pages verified per cycle: {verified}"
    # a second restart finds nothing left to discard: torn records were wiped
    d.stop()
    d.start()
    with d.client() as c:
        assert c.stats().l3.get("store_discarded_on_start", 0) == 0


@pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting a tmpfs needs root; the capacity test covers the rest"
)
def test_full_disk_l2_keeps_serving(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    mnt = Path(f"/tmp/hc-full-{os.getpid()}")
    mnt.mkdir(exist_ok=True)
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(mnt)]).returncode
        != 0
    ):
        pytest.skip("this machine does not allow mounting a tmpfs")
    try:
        d = daemon_factory(
            size_mib=1,
            slab_mib=1,
            storage=storage("file"),
            tail=f'[storage.file]\npath = "{mnt}"\ncapacity_mib = 8\nsegment_mib = 1\n',
        )
        with d.client() as c:
            ns = c.register(**NS)
            assert "disk full after 2 of 8 segments" in d.log.read_text()
            for k in range(6):  # far more than 2 MiB: the two segments recycle
                toks = seq(k * 10**6, 200)
                # the last store's pages are pinned until written: with those
                # writes settled, this one takes all the slots it asks for
                settle_writes(c)
                c.store(ns, toks, page_bytes_for(toks))
                assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))  # L2 serves
            settle_writes(c)
            stats = c.stats()
            assert stats.l3["store_recycled_segments"] >= 3 and stats.l3.get("write_failed", 0) == 0
            toks = seq(5 * 10**6, 200)
            evict_everything(c, ns, salt=99)
            pf = c.prefetch(ns, toks)
            done = wait_prefetch(c, pf)
            c.commit(pf)
            got = c.load(ns, toks)
            assert len(got) == done.completed and np.array_equal(
                got, page_bytes_for(toks)[: len(got)]
            )
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()


def test_no_room_for_one_segment_is_a_clear_error(tmp_path: Path) -> None:
    mnt = Path(f"/tmp/hc-none-{os.getpid()}")
    mnt.mkdir(exist_ok=True)
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)]).returncode
    ):
        mnt.rmdir()
        pytest.skip("mounting a tmpfs needs root")
    try:
        cfg = tmp_path / "c.toml"
        cfg.write_text(
            f'[server]\nruntime_dir = "/tmp/hc-rt-{os.getpid()}"\n'
            "[pool]\nsize_mib = 1\nslab_mib = 1\n"
            f'max_page_bytes = 65536\n[storage]\nbackend = "file"\n[storage.file]\npath = "{mnt}"\n'
            "capacity_mib = 4\nsegment_mib = 1\n"
        )
        out = subprocess.run(
            [sys.executable, "-m", "hicached", "serve", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2
        assert "no room for one segment" in out.stderr
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()
        subprocess.run(["rm", "-rf", f"/tmp/hc-rt-{os.getpid()}"], check=False)


def test_a_second_daemon_on_the_same_file_store_is_refused(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Two daemons would write the same segments at the same offsets: the second
    exits 2 and says why; the first keeps serving its pages."""
    tail = f'[storage.file]\npath = "{tmp_path / "store"}"\ncapacity_mib = 8\nsegment_mib = 2\n'
    first = daemon_factory(size_mib=1, slab_mib=1, storage=storage("file"), tail=tail)
    with first.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 4)
        c.store(ns, toks, page_bytes_for(toks))
        settle_writes(c)
    second = Daemon(size_mib=1, slab_mib=1, storage=storage("file"), tail=tail)
    refused_start(second, "in use by another daemon")
    with first.client() as c:
        ns = c.register(**NS)
        assert c.match(ns, seq(0, 4)).hits + c.match(ns, seq(0, 4)).l3_hits == 4


def test_write_back_of_a_page_evicted_for_another_namespace_keeps_its_own(
    file_daemon: Callable[..., Daemon],
) -> None:
    """Two namespaces of one page size share an index; a page evicted to make
    room for the other is written back under the namespace that stored it."""
    d = file_daemon("write_back")
    first, second = dict(NS, model="test/first"), dict(NS, model="test/second")
    a = seq(0, 10)
    with d.client() as c:
        ns_a, ns_b = c.register(**first), c.register(**second)
        c.store(ns_a, a, page_bytes_for(a))
        filler = seq(5 * 10**6, 256)
        c.store(ns_b, filler, np.zeros((256, 4096), np.uint8))  # evicts a, for ns_b
        wait_for(lambda: l3_count(c, "written") >= 10)
        settle_writes(c)
        assert c.match(ns_a, a, lease=False).hits == 0
        pf = c.prefetch(ns_a, a)
        assert wait_prefetch(c, pf).completed == 10  # found under ns_a's digest
        c.commit(pf)
        assert np.array_equal(c.load(ns_a, a), page_bytes_for(a))


def test_hung_backend_keeps_its_call_slots_and_the_queue_bound(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Fault injection: the faulty backend makes every write take 2 s, ten times
    op_timeout_s. Timed-out calls keep their slots, so no more than
    ``concurrency`` - 1 write calls reach the store (one slot stays for reads,
    and one beyond ``concurrency`` for existence checks), and pages queued plus
    in flight (pinned in L2) stay within ``queue_pages``; the rest is refused
    and counted."""
    d = daemon_factory(
        allow_faults=True,
        storage=storage(
            "faulty",
            more="queue_pages = 8\nbatch_pages = 2\nconcurrency = 3\nop_timeout_s = 0.2\n"
            "retries = 0\nbreaker_failures = 1000000\n",
        ),
        tail="[storage.extra]\nwrite_delay_s = 2.0\n",
    )
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 40)
        c.store(ns, toks, page_bytes_for(toks))
        assert l3_count(c, "write_dropped_full") == 32  # 8 taken: the bound
        hung = 0
        end = time.monotonic() + 1.5  # well inside the 2 s the store hangs
        while time.monotonic() < end:
            s = c.stats()
            assert s.l3["queued_pages"] + s.l3["in_flight_pages"] <= 8
            assert s.pinned_pages <= 8
            assert s.l3["hung_calls"] <= 2 and s.l3["store_peak_calls"] <= 2
            hung = max(hung, s.l3["hung_calls"])
            time.sleep(0.02)
        assert hung == 2 and l3_count(c, "timeouts") == 2
        assert l3_count(c, "slot_timeouts") >= 1  # writes that found every slot held

        # the store answers at last: the hung calls finish their pages, and the
        # pages refused are written as the queue drains (write_through's
        # backfill), within the same bounds
        def bounded_and_written(least: int) -> bool:
            s = c.stats()
            assert s.l3["queued_pages"] + s.l3["in_flight_pages"] <= 8
            assert s.pinned_pages <= 8 and s.l3["store_peak_calls"] <= 2
            return s.l3.get("pages_written", 0) >= least

        wait_for(lambda: bounded_and_written(4))
        assert l3_count(c, "backfill_runs") >= 1
        wait_for(lambda: bounded_and_written(8), timeout=30)
        s = c.stats()
        assert s.l3["store_peak_calls"] == 2
        assert s.l3_pages_known == s.l3["pages_written"]  # no page written twice


def test_stop_with_a_hung_backend_keeps_its_deadline(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Fault injection: writes hang for a minute. A graceful stop still ends
    within storage.flush_deadline_s (plus the rest of the shutdown), saying
    what it could not finish."""
    d = daemon_factory(
        allow_faults=True,
        storage=storage(
            "faulty",
            "write_back",
            "op_timeout_s = 0.2\nflush_deadline_s = 1.0\nbreaker_failures = 1000000\n",
        ),
        tail="[storage.extra]\nwrite_delay_s = 60.0\n",
    )
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 8)
        c.store(ns, toks, page_bytes_for(toks))
    started = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - started < 6.0
    log = d.log.read_text()
    assert "still running at the stop deadline" in log
    assert "write-back flush: 8 pages L3 lacked; 8 queued, 0 written, 0 failed, 8 left" in log


def test_stop_does_not_wait_for_a_hung_store_check(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Fault injection: every existence check waits for a gate that never
    opens, within op_timeout_s. A prefetch's first step and a match's lookup
    hang there; a graceful stop (write_through: nothing to flush) ends them
    at once, since a check writes into no pool slot, instead of waiting for
    them until storage.flush_deadline_s."""
    d = daemon_factory(
        allow_faults=True,
        storage=storage(
            "faulty", more="op_timeout_s = 60.0\nflush_deadline_s = 30.0\nscan_on_start = false\n"
        ),
        tail=f'[storage.extra]\nexists_gate = "{tmp_path / "never"}"\n',
    )
    with d.client() as c:
        ns = c.register(**NS)
        c.prefetch(ns, seq(0, 2))
        assert c.match(ns, seq(10**6, 2), lease=False).l3_hits == 0  # its lookup gave up
        wait_for(lambda: c.stats().l3["store_calls_running"] == 2)
    started = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - started < 6.0
    assert "2 backend calls (" in d.log.read_text()  # left to end on their own


def test_write_back_flush_queues_in_steps_and_loses_no_page(
    file_daemon: Callable[..., Daemon],
) -> None:
    """200 dirty pages, a queue of 8: the stop queues more as the queue drains,
    so every page reaches L3 (each under the namespace that stored it)."""
    d = file_daemon("write_back", "queue_pages = 8\nbatch_pages = 4\n")
    first, second = dict(NS, model="test/first"), dict(NS, model="test/second")
    a, b = seq(0, 100), seq(10**6, 100)
    with d.client() as c:
        ns_a, ns_b = c.register(**first), c.register(**second)
        c.store(ns_a, a, page_bytes_for(a))
        c.store(ns_b, b, page_bytes_for(b))
        assert l3_count(c, "written") == 0
    assert d.stop() == 0
    assert (
        "write-back flush: 200 pages L3 lacked; 200 queued, 200 written, 0 failed, 0 left"
        in d.log.read_text()
    )
    d.start()
    with d.client() as c:
        ns_a, ns_b = c.register(**first), c.register(**second)
        wait_for(lambda: c.stats().l3_state == "up")
        assert c.stats().l3_pages_known == 200
        for ns, toks in ((ns_a, a), (ns_b, b)):
            assert c.match(ns, toks, lease=False).l3_hits == 100
            pf = c.prefetch(ns, toks)
            assert wait_prefetch(c, pf).completed == 100
            c.commit(pf)
            assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))


def test_startup_scan_runs_in_the_background_while_serving(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Fault injection: the faulty backend wraps a file store and slows its
    listing (scan_delay_s per page), so the scan of 3000 pages takes seconds.
    The daemon answers before it ends, status shows it, matches find every
    page (those not listed yet by asking the store), and in the end every page
    is known."""
    d = daemon_factory(
        size_mib=16,
        slab_mib=1,
        allow_faults=True,
        storage=storage("faulty"),
        tail='[storage.extra]\ninner = "file"\nscan_delay_s = 0.002\n'
        "[storage.extra.inner_options]\ncapacity_mib = 32\nsegment_mib = 4\nio_threads = 2\n",
    )
    chunks = [seq(k * 10**6, 500) for k in range(6)]
    with d.client() as c:
        ns = c.register(**NS)
        for k, toks in enumerate(chunks):
            c.store(ns, toks, np.full((500, 4096), k, np.uint8))
        wait_for(lambda: l3_count(c, "written") == 3000)
    assert d.stop() == 0
    d.start()
    with d.client() as c:
        ns = c.register(**NS)
        s = c.stats()  # answered while the scan runs
        assert s.l3_state == "scanning" and s.l3["scanning"] == 1
        assert s.l3["scan_pages"] < 3000 and s.l3_pages_known < 3000
        status = subprocess.run(
            [sys.executable, "-m", "hicached", "status", "--endpoint", d.endpoint],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "faulty scanning" in status.stdout and "scan_pages=" in status.stdout
        known = c.stats().l3_pages_known
        wait_for(lambda: c.stats().l3_pages_known > known)  # found while serving
        # pages the scan has not listed yet are asked of the store (test_l3_lookup.py)
        assert [c.match(ns, toks, lease=False).l3_hits for toks in chunks] == [500] * 6
        wait_for(lambda: c.stats().l3_state == "up", timeout=60)
        s = c.stats()
        assert s.l3["scan_pages"] == 3000 and s.l3_pages_known == 3000
        assert s.l3["scanning"] == 0
        assert [c.match(ns, toks, lease=False).l3_hits for toks in chunks] == [500] * 6


@pytest.mark.parametrize("retry", ["0.2", "0"], ids=["tried-again", "never-again"])
def test_a_failed_scan_is_tried_again_until_a_listing_ends(
    daemon_factory: Callable[..., Daemon], retry: str
) -> None:
    """Fault injection: the faulty backend breaks off the first two listings
    after one page (``scan_failures``). With ``scan_in_background = false`` the
    first scan runs before READY and fails; the daemon serves all the same, and
    tries again in the background after ``scan_retry_s`` (then twice that) until
    a listing ends: every page stored before the restart is known and the index
    is complete. ``scan_retry_s = 0`` leaves it at the one failure: keys stay
    unknown, and are asked of the store."""
    d = daemon_factory(
        size_mib=16,
        slab_mib=1,
        allow_faults=True,
        storage=storage("faulty", more=f"scan_in_background = false\nscan_retry_s = {retry}\n"),
        tail='[storage.extra]\ninner = "file"\nscan_failures = 2\n'
        "[storage.extra.inner_options]\ncapacity_mib = 32\nsegment_mib = 4\nio_threads = 2\n",
    )
    chunks = [seq(k * 10**6, 50) for k in range(4)]
    with d.client() as c:
        ns = c.register(**NS)
        for k, toks in enumerate(chunks):
            c.store(ns, toks, np.full((50, 4096), k, np.uint8))
        wait_for(lambda: l3_count(c, "written") == 200)
    assert d.stop() == 0
    before = len(d.log.read_text())  # the first start's (empty) listings failed too
    d.start()
    with d.client() as c:
        if retry == "0":
            time.sleep(1.0)  # as long as the retries below take
            s = c.stats()
            assert s.l3["scan_failed"] == 1 and s.l3["index_complete"] == 0
            assert s.l3_pages_known <= 1  # the page the broken listing named
            return
        wait_for(lambda: c.stats().l3["index_complete"] == 1, timeout=30)
        s = c.stats()
        assert s.l3["scan_failed"] == 2 and s.l3["scan_pages"] == 200
        assert s.l3_pages_known == 200 and s.l3["lookups"] == 0
        ns = c.register(**NS)
        assert [c.match(ns, toks, lease=False).l3_hits for toks in chunks] == [50] * 4
    log = d.log.read_text()[before:]
    assert log.count("L3 scan failed after") == 2 and "L3 scan again in 0.4s" in log


def test_pages_the_memory_store_evicts_are_forgotten(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """The memory store beyond max_pages lets go of its oldest pages: the daemon
    is told, so match does not report as held in L3 pages no prefetch can read."""
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        storage=storage("memory"),
        tail="[storage.memory]\nmax_pages = 4\n",
    )
    with d.client() as c:
        ns = c.register(**NS)
        toks = seq(0, 8)
        c.store(ns, toks, page_bytes_for(toks))
        evict_everything(c, ns)  # its writes push every page of toks out of the store
        stats = c.stats()
        assert stats.l3["store_pages"] == 4 and stats.l3_pages_known <= 4
        held = c.match(ns, toks, lease=False).l3_hits
        assert held <= 4, "L3 hits beyond what the store can hold"
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (held, False)
        c.commit(pf)
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks)[:held])


def test_a_page_the_store_lets_go_of_while_a_prefetch_reads_it_is_not_learned(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Fault injection: the faulty backend around the file store holds every
    read's answer 3 s after the store gave it (``read_hold_s``). Meanwhile other
    pages fill the store's two segments, so it recycles the segment the read
    came from and tells the daemon it let go of those pages. The prefetch still
    completes (its bytes were read and verified before), but its answer must
    not make the pages known again: L3 no longer holds them, so a match that
    counted them would report L3 hits no read can serve, and under write_back
    their eviction would write nothing (L3 "held" them) and lose them."""
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        allow_faults=True,
        storage=storage("faulty"),
        tail='[storage.extra]\ninner = "file"\nread_hold_s = 3.0\n'
        "[storage.extra.inner_options]\ncapacity_mib = 2\nsegment_mib = 1\nio_threads = 2\n",
    )
    toks = seq(0, 8)
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, toks, page_bytes_for(toks))
        evict_everything(c, ns)  # 8 + 256 pages written: the first segment is full
        written = l3_count(c, "written")
        pf = c.prefetch(ns, toks)
        wait_for(lambda: c.stats().l3["store_calls_running"] == 1)  # read, and held
        for salt in (2, 3):  # 400 more pages: the ring wraps onto the first segment
            filler = seq(salt * 10**7, 200)
            c.store(ns, filler, np.zeros((200, 4096), np.uint8))
            written += 200
            wait_for(lambda w=written: l3_count(c, "written") == w)  # type: ignore[misc]
        assert l3_count(c, "store_recycled_segments") >= 1
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (8, False)
        assert c.match(ns, toks, lease=False).l3_hits == 0, "pages L3 let go of are L3 hits"
        c.cancel(pf)


def test_a_lookup_whose_check_outlasts_its_timeout_counts_in_flight_until_it_ends(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Fault injection: existence checks wait for a gate past op_timeout_s. A
    match's lookup is a miss at its deadline, and its check, which still holds
    a call slot, counts against lookups_in_flight until the store answers: the
    next lookup is skipped meanwhile, not started beside it."""
    gate = tmp_path / "gate"
    d = daemon_factory(
        allow_faults=True,
        storage=storage(
            "faulty",
            more="op_timeout_s = 0.2\nlookups_in_flight = 1\nscan_on_start = false\n",
        ),
        tail=f'[storage.extra]\nexists_gate = "{gate}"\n',
    )
    with d.client() as c:
        ns = c.register(**NS)
        assert c.match(ns, seq(0, 2), lease=False).l3_hits == 0
        wait_for(lambda: c.stats().l3["lookups"] == 1)
        wait_for(lambda: c.stats().l3.get("timeouts", 0) == 1)  # the check, past op_timeout_s
        s = c.stats().l3
        assert s["lookups_in_flight"] == 1 and s["hung_calls"] == 1  # it still runs
        assert c.match(ns, seq(10**6, 2), lease=False).l3_hits == 0
        s = c.stats().l3
        assert s["lookups"] == 1 and s["lookups_skipped"] == 1
        gate.touch()
        wait_for(lambda: c.stats().l3["lookups_in_flight"] == 0)
        c.match(ns, seq(2 * 10**6, 2), lease=False)
        wait_for(lambda: c.stats().l3["lookups"] == 2)


@pytest.mark.parametrize("first", ["lookup_timeout_s", "op_timeout_s"])
def test_a_lookup_answered_without_the_store_is_late_only_at_its_deadline(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, first: str
) -> None:
    """A request that waits out ``lookup_timeout_s`` while its check runs is
    answered without the store's answer: ``lookups_late``, and the check goes
    on, so what it finds is known from then on. A check that passes
    ``op_timeout_s`` first is a timed-out call (``timeouts``), and the lookup
    is answered then, not at its deadline: not late, and it learns nothing.
    Fault injection: existence checks wait for a gate, closed while the
    matches ask; the pages are in the file store, unknown to the restarted
    daemon (no startup scan)."""
    gate = tmp_path / "gate"
    gate.touch()
    short, long = "0.3", "60.0"
    timeouts = {first: short, ({"lookup_timeout_s", "op_timeout_s"} - {first}).pop(): long}
    d = daemon_factory(
        allow_faults=True,
        storage=storage(
            "faulty",
            more="scan_on_start = false\n" + "".join(f"{k} = {v}\n" for k, v in timeouts.items()),
        ),
        tail=f'[storage.extra]\ninner = "file"\nexists_gate = "{gate}"\n'
        "[storage.extra.inner_options]\ncapacity_mib = 8\nsegment_mib = 2\n",
    )
    toks = seq(0, 4)
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "pages_written") == 4)
    assert d.stop() == 0
    gate.unlink()
    d.start()  # a new pool: the pages are in L3 alone, and the daemon knows none
    with d.client() as c:
        ns = c.register(**NS)
        assert c.match(ns, toks, lease=False).l3_hits == 0
        s = c.stats().l3
        assert s["lookups"] == 1 and s["lookups_in_flight"] == 1  # the check still runs
        if first == "lookup_timeout_s":
            assert s["lookups_late"] == 1 and s.get("timeouts", 0) == 0
        else:
            assert s["lookups_late"] == 0 and s["timeouts"] == 1 and s["failures"] == 1
        gate.touch()
        wait_for(lambda: c.stats().l3["lookups_in_flight"] == 0)
        s = c.stats().l3
        if first == "lookup_timeout_s":  # it went on, and what it found is known
            assert s["lookup_pages"] == 4 and c.match(ns, toks, lease=False).l3_hits == 4
            assert c.stats().l3["lookups"] == 1
        else:  # it learned nothing: the next match asks again
            assert s["lookup_pages"] == 0 and c.match(ns, toks, lease=False).l3_hits == 4
            assert c.stats().l3["lookups"] == 2
        s = c.stats().l3
        assert s["lookups_late"] == (1 if first == "lookup_timeout_s" else 0)
        assert s.get("timeouts", 0) == (0 if first == "lookup_timeout_s" else 1)
    assert d.stop() == 0
