"""Adoption across restarts, as an outsider would break it: journals that do
not belong to the pool beside them, journals whose records no daemon wrote,
and workloads of token and key-addressed namespaces (commit masks, reads,
prefetches from L3, write-back) while the daemon is killed at random moments.

Real daemons and real client processes. What must hold (cache/adopt.py): no
page is ever read with bytes not stored under its key, every commit
acknowledged before a kill -9 is matched after the restart (while nothing
evicts it), and the daemon keeps serving.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hicached.daemon.journal import journal_path
from hicached.wire.arena import arena_path
from hicached.wire.journal import AllocRecord, frame
from tests import adoption_review_worker as w
from tests.adoption_worker import PAGES, SPEC, pattern, tokens
from tests.l3util import FILE_STORE, l3_count, storage, wait_for, wait_prefetch
from tests.support import Daemon

ROOT = Path(__file__).resolve().parent.parent


def adopting(**kwargs: object) -> Daemon:
    """A daemon whose every start adopts the pool of the stop before."""
    made: dict[str, object] = {"size_mib": 16, "max_page_bytes": 1 << 20, **kwargs}
    return Daemon(fresh=False, **made)  # type: ignore[arg-type]


def journal_of(d: Daemon) -> Path:
    return journal_path(arena_path("/dev/shm", d.runtime))


def test_a_journal_of_another_pool_file_is_never_replayed_over_this_one() -> None:
    """Two daemons store other sequences in the same slots of pools of one
    geometry; the journal of the first, put beside the pool of the second
    (a restore, a copy by hand), must not make the second serve the first's
    keys with its own bytes: the pool is not adopted, and the log says why."""
    first, second = adopting(), adopting()
    try:
        first.start()
        second.start()
        with first.client() as c:
            c.store(c.register(**SPEC), tokens(1), pattern(1))
        with second.client() as c:
            c.store(c.register(**SPEC), tokens(2), pattern(2))
        assert first.stop() == 0 and second.stop() == 0
        shutil.copy(journal_of(first), journal_of(second))
        second.start()
        with second.client() as c:
            ns = c.register(**SPEC)
            hit = c.match(ns, tokens(1))
            try:
                if hit.hits:
                    got = c.read_pages(hit)
                    assert np.array_equal(got, pattern(1)[: len(got)]), "another key's bytes"
                assert hit.hits == 0, "a journal of another pool file was adopted"
            finally:
                c.release(hit)
            assert c.stats().adopted_pages == 0
        assert "journal of another pool file" in second.log.read_text()
    finally:
        first.cleanup()
        second.cleanup()


@pytest.mark.parametrize(
    "record",
    [AllocRecord([-16384], 16384), AllocRecord([1 << 20], 0), AllocRecord([1 << 20], -4096)],
    ids=["negative_slot", "zero_page_bytes", "negative_page_bytes"],
)
def test_records_no_daemon_writes_are_dropped_not_obeyed(record: AllocRecord) -> None:
    """A record that verifies but that no daemon writes (a negative slot, a page
    size of zero or less) neither stops the start nor reaches the allocator: the
    pages the journal holds besides are adopted, nothing is quarantined, and
    the daemon stores pages of other sizes after it."""
    d = adopting()
    d.start()
    try:
        with d.client() as c:
            c.store(c.register(**SPEC), tokens(1), pattern(1))
        d.kill()
        journal = journal_of(d)
        journal.write_bytes(journal.read_bytes() + frame(record))
        d.start()
        with d.client() as c:
            ns = c.register(**SPEC)
            hit = c.match(ns, tokens(1))
            try:
                assert hit.hits == PAGES
                assert np.array_equal(c.read_pages(hit), pattern(1))
            finally:
                c.release(hit)
            stats = c.stats()
            assert stats.quarantined_pages == 0
            assert stats.adoption_dropped == {"geometry": 1}
            wide = c.register(**{**SPEC, "model": "test/wide", "page_bytes": 65536})
            data = np.full((PAGES, 65536), 7, np.uint8)
            assert c.store(wide, tokens(5), data).published == PAGES
            assert np.array_equal(c.load(wide, tokens(5)), data)
    finally:
        d.cleanup()


def test_a_restart_does_not_prolong_a_quarantine_that_began_before_it() -> None:
    """A key-addressed commit that leaves pages out puts their slots in
    quarantine until the lease's deadline plus quarantine_s; a kill -9 and a
    start after the deadline must not hold them past that end."""
    d = adopting(extra="", tail="[leases]\nttl_s = 3.0\nquarantine_s = 1.0\n")
    d.start()
    try:
        with d.client() as c:
            ns = c.register(**w.KEYED_SPEC)
            res = c.reserve_keys(ns, w.keys(1))
            c.write_pages(res, w.pattern(1, "k"))
            ended = time.monotonic() + 3.0 + 1.0  # the lease's deadline, and quarantine_s
            assert c.commit(res, ok=[True, False, False, False]).published == 1
            assert c.stats().quarantined_pages == 3
        time.sleep(3.2)  # past the deadline, inside the quarantine
        d.kill()
        d.start()
        time.sleep(max(0.0, ended - time.monotonic()) + 1.0)  # its end, and a sweep or four
        with d.client() as c:
            assert c.stats().quarantined_pages == 0, "the restart prolonged the quarantine"
    finally:
        d.cleanup()


def _acked(logs: list[Path]) -> tuple[list[int], list[tuple[int, str]]]:
    """The token and key-addressed stores acknowledged so far; fails on a LIE."""
    token, keyed = [], []
    for log in logs:
        for line in log.read_text().splitlines():
            assert not line.startswith("LIE"), f"{log.name}: a page read with other bytes: {line}"
            fields = line.split()
            if line.startswith("ACK t ") and len(fields) == 3:
                token.append(int(fields[2]))
            elif line.startswith("ACK k ") and len(fields) == 4:
                keyed.append((int(fields[2]), fields[3]))
    return token, keyed


def test_kill9_under_keyed_masks_prefetches_and_write_back_loses_and_lies_about_nothing(
    tmp_path: Path,
) -> None:
    """Three client processes store token sequences and key-addressed ones
    (commits that leave pages out), read them back byte for byte, and
    prefetch them from a file L3 under write_back, while the daemon is killed
    at random moments; after each start every acknowledged page is matched
    with its own bytes (the pool is large enough that nothing is evicted)."""
    d = adopting(
        size_mib=256,
        populate=False,
        storage='backend = "file"\nwrite_policy = "write_back"\n',
        tail=FILE_STORE,
    )
    d.start()
    logs = [tmp_path / f"worker{n}.log" for n in range(3)]
    for log in logs:
        log.touch()
    errs = [open(f"{log}.err", "wb") for log in logs]  # noqa: SIM115 - closed below
    worker = [sys.executable, "-m", "tests.adoption_review_worker", d.endpoint]
    workers = [
        subprocess.Popen([*worker, str(log), str(n), "600"], cwd=ROOT, stderr=errs[n])
        for n, log in enumerate(logs)
    ]
    rng = random.Random(11)
    try:
        for _ in range(3):
            time.sleep(rng.uniform(0.5, 2.0))
            d.kill()
            token, keyed = _acked(logs)
            d.start()
            with d.client() as c:
                tns, kns = c.register(**w.TOKEN_SPEC), c.register(**w.KEYED_SPEC)
                for s in token:
                    hit = c.match(tns, w.tokens(s))
                    try:
                        assert hit.hits == w.PAGES, f"token sequence {s} lost"
                        assert np.array_equal(c.read_pages(hit), w.pattern(s, "t"))
                    finally:
                        c.release(hit)
                for s, mask in keyed:
                    hit = c.match_keys(kns, w.keys(s))
                    try:
                        assert hit.hits == (mask + "0").index("0"), f"keyed {s} ({mask})"
                        got = c.read_pages(hit)
                        assert np.array_equal(got, w.pattern(s, "k")[: len(got)])
                    finally:
                        c.release(hit)
        for proc, log in zip(workers, logs, strict=True):
            assert proc.wait(300) == 0, Path(f"{log}.err").read_text()
        _acked(logs)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for err in errs:
            err.close()
        d.cleanup()


@pytest.mark.parametrize(
    ("failed_scans", "scan"),
    [(0, True), (1, True), (1000, True), (0, False)],
    ids=["scan", "scan-failed-once", "scan-always-fails", "no-scan"],
)
def test_adopted_pages_whose_l3_writes_a_kill_cut_short_reach_l3_after_the_restart(
    failed_scans: int, scan: bool
) -> None:
    """Under write_through every committed page goes to L3. Fault injection: the
    faulty backend delays every write (``write_delay_s``), so a kill -9 right
    after the commits leaves their writes unfinished; with ``scan_failures``
    the restart's listings break off after one page. The restart adopts
    the pages and, once L3's listing has ended (a scan tried again after
    ``scan_retry_s`` where the first failed), writes those L3 lacks; where no
    listing ends (every one fails, or no scan runs), it asks the store of each
    and writes those it lacks (they waited for ever before). A start
    without the pool (L2 empty) then reads every page back from L3, byte for
    byte."""
    listed = scan and failed_scans < 1000
    d = adopting(
        allow_faults=True,
        storage=storage(
            "faulty", more=f"scan_retry_s = 0.5\nscan_on_start = {str(scan).lower()}\n"
        ),
        tail='[storage.extra]\ninner = "file"\nwrite_delay_s = 1.0\n'
        f"scan_failures = {failed_scans}\n"
        "[storage.extra.inner_options]\ncapacity_mib = 32\nsegment_mib = 4\nio_threads = 2\n",
    )
    seqs = range(3)
    try:
        d.start()
        with d.client() as c:
            ns = c.register(**SPEC)
            c.store(ns, tokens(9), pattern(9))  # in L3 before the kill: never written again
            wait_for(lambda: l3_count(c, "written") == PAGES, timeout=30)
            for s in seqs:
                c.store(ns, tokens(s), pattern(s))
            assert l3_count(c, "written") == PAGES  # every other write waits out its delay
        d.kill()
        d.start()
        with d.client() as c:
            c.register(**SPEC)
            assert c.stats().adopted_pages == (len(seqs) + 1) * PAGES
            wait_for(lambda: l3_count(c, "written") == len(seqs) * PAGES, timeout=60)
            time.sleep(1.5)  # a write of a page L3 held would have ended by now
            assert l3_count(c, "written") == len(seqs) * PAGES
            l3 = c.stats().l3
            assert l3["index_complete"] == int(listed)
            if listed:
                assert l3["scan_failed"] == failed_scans
            else:
                assert l3["scan_failed"] >= int(scan)
        assert d.stop() == 0
        d.fresh = True  # a new pool: whatever is read now comes from L3
        d.start()
        with d.client() as c:
            ns = c.register(**SPEC)
            for s in seqs:
                assert c.match(ns, tokens(s), lease=False).hits == 0
                pf = c.prefetch(ns, tokens(s))
                assert wait_prefetch(c, pf, timeout=60).completed == PAGES
                c.commit(pf)
                assert np.array_equal(c.load(ns, tokens(s)), pattern(s))
    finally:
        d.cleanup()
