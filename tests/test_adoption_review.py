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

import shutil
from pathlib import Path

import numpy as np
import pytest

from hicached.daemon.journal import journal_path
from hicached.wire.arena import arena_path
from hicached.wire.journal import AllocRecord, frame
from tests.adoption_worker import PAGES, SPEC, pattern, tokens
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
