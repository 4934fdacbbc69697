"""Adoption against what a restart may find: a journal header this daemon
cannot read, records past what any pool holds, a pool file whose readers
changed across the restart.

Real daemons. What must hold (docs/restarts.md): a pool that cannot be
adopted is replaced and the log says why; the start is never stopped by
what the journal holds; no page is read with bytes not stored under its key.
"""

from __future__ import annotations

import contextlib
import grp
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import xxhash

from hicached.daemon.journal import journal_path
from hicached.wire.arena import arena_path
from hicached.wire.journal import (
    _FRAME,
    JOURNAL_MAGIC,
    PageRecord,
    frame,
    header_bytes,
    read_header,
)
from tests import adoption_review_worker as w
from tests.adoption_worker import PAGES, SPEC, pattern, tokens
from tests.support import Daemon
from tests.test_arenas_review import two_uids
from tests.test_tenants import Users, users


def adopting(**kwargs: object) -> Daemon:
    """A daemon whose every start adopts the pool of the stop before."""
    made: dict[str, object] = {"size_mib": 16, "max_page_bytes": 1 << 20, **kwargs}
    return Daemon(fresh=False, **made)  # type: ignore[arg-type]


_ = (two_uids, users)  # fixtures, used by name


def journal_of(d: Daemon) -> Path:
    return journal_path(arena_path("/dev/shm", d.runtime))


def _framed(body: bytes) -> bytes:
    return _FRAME.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


@pytest.mark.parametrize(
    "body",
    [msgspec.msgpack.encode([4, 1 << 30, 1 << 20]), b"\xc1"],
    ids=["header_as_array", "header_not_msgpack"],
)
def test_a_journal_header_with_no_version_to_read_makes_a_new_pool(body: bytes) -> None:
    """A header frame that verifies but holds no map to find a version in (a
    layout that writes its header otherwise, or damage) is a journal of another
    version: the start makes a new pool and says why, it does not stop."""
    d = adopting()
    d.start()
    try:
        with d.client() as c:
            c.store(c.register(**SPEC), tokens(1), pattern(1))
        d.kill()
        journal_of(d).write_bytes(JOURNAL_MAGIC + _framed(body))
        d.start()
        with d.client() as c:
            ns = c.register(**SPEC)
            assert c.match(ns, tokens(1), lease=False).hits == 0
            assert c.stats().adopted_pages == 0
            assert c.store(ns, tokens(2), pattern(2)).published == PAGES
        log = d.log.read_text()
        assert "not one this daemon reads" in log and "making a new one" in log
    finally:
        d.cleanup()


@pytest.mark.parametrize(
    ("slot", "gen", "reason"),
    [((1 << 64) - 4096, 0, "geometry"), (8 << 20, (1 << 64) - 1, "stale")],
    ids=["slot_past_int64", "gen_past_int64"],
)
def test_records_past_what_any_pool_holds_are_dropped_not_obeyed(
    slot: int, gen: int, reason: str
) -> None:
    """A page record that verifies but names a slot or a generation no 64-bit
    integer holds (a journal made by hand) neither stops the start nor hides
    the pages the journal holds besides."""
    d = adopting()
    d.start()
    try:
        with d.client() as c:
            ns = c.register(**SPEC)
            c.store(ns, tokens(1), pattern(1))
            ns_id = ns.id
        d.kill()
        journal = journal_of(d)
        bogus = PageRecord(ns_id, bytes(range(16)), b"", slot, gen)
        journal.write_bytes(journal.read_bytes() + frame(bogus))
        d.start()
        with d.client() as c:
            ns = c.register(**SPEC)
            hit = c.match(ns, tokens(1))
            try:
                assert hit.hits == PAGES
                assert np.array_equal(c.read_pages(hit), pattern(1))
            finally:
                c.release(hit)
            assert c.stats().adoption_dropped == {reason: 1}
    finally:
        d.cleanup()


def _two_groups() -> tuple[str, str]:
    """Two groups of this host other than root's."""
    names = [g.gr_name for g in grp.getgrall() if g.gr_gid != 0]
    return names[0], names[1]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the pool file to groups: needs root")
def test_a_pool_opened_to_another_client_group_is_not_adopted() -> None:
    """server.client_group changed across a restart: a process of the old group
    that opened or mapped the pool file keeps reading it, whatever its group is
    now; so the new daemon's pages go to a new file (not adopted, and the log
    says why). The same group again adopts it."""
    before, after = _two_groups()
    d = adopting(extra=f'client_group = "{before}"')
    d.start()
    try:
        with d.client() as c:
            c.store(c.register(**SPEC), tokens(1), pattern(1))
        pool = arena_path("/dev/shm", d.runtime)
        assert d.stop() == 0
        d.start()  # the same group: adopted
        with d.client() as c:
            assert c.match(c.register(**SPEC), tokens(1), lease=False).hits == PAGES
        assert d.stop() == 0
        old = os.stat(pool).st_ino
        d.config.write_text(
            d.config.read_text().replace(f'client_group = "{before}"', f'client_group = "{after}"')
        )
        d.start()
        with d.client() as c:
            ns = c.register(**SPEC)
            assert c.match(ns, tokens(1), lease=False).hits == 0
            assert c.stats().adopted_pages == 0
        st = os.stat(pool)
        assert st.st_ino != old, "the new group's pages went into the old group's file"
        assert st.st_gid == grp.getgrnam(after).gr_gid
        log = d.log.read_text()
        assert f"was open to group {grp.getgrnam(before).gr_gid}" in log
        assert "making a new one" in log
    finally:
        d.cleanup()


def test_a_commit_of_small_records_does_not_rewrite_the_journal_at_every_reply() -> None:
    """The journal is compacted once it is a few times what it describes, which
    is estimated from the last commit's records. Key-addressed pages (no token
    ids: small records) committed beside many token pages of long pages (large
    records) made that estimate a fraction of the truth, and every reply
    rewrote the whole journal. A compaction now waits until the file is a few
    times the last one's size: a series of small commits rewrites it once at
    most. The pages of both kinds are adopted after it."""
    long_spec = {**SPEC, "model": "test/long-pages", "page_tokens": 1024, "page_bytes": 4096}
    d = adopting(size_mib=96, extra="max_pages_per_request = 4096")
    d.start()
    try:
        journal = journal_of(d)
        rows = np.zeros((64, 4096), np.uint8)
        with d.client(timeout=30) as c:
            ns = c.register(**long_spec)
            for s in range(200):  # 12,800 records of 4 KiB of token ids: 50 MiB of journal
                run = list(range(s * 10**7, s * 10**7 + 64 * 1024))
                assert c.store(ns, run, rows).published == 64
            kns = c.register(**w.KEYED_SPEC)
            files = set()
            for s in range(10):
                res = c.reserve_keys(kns, w.keys(s))
                c.write_pages(res, w.pattern(s, "k"))
                assert c.commit(res).published == PAGES
                files.add(journal.stat().st_ino)  # a compaction is a new file
            assert len(files) == 1, f"{len(files)} compactions in 10 small commits"
        d.kill()
        d.start()
        with d.client() as c:
            stats = c.stats()
            assert stats.adopted_pages == 200 * 64 + 10 * PAGES, stats.adoption_dropped
    finally:
        d.cleanup()


def test_long_pages_are_adopted_again_by_the_start_after_next() -> None:
    """A start writes its journal anew (a snapshot of what it adopted), 4,096
    pages a record. Pages of 1,024 tokens carry 4 KiB of token ids each: such a
    record was past the longest frame a reader takes, so the next start read
    the journal as torn there and adopted none of them. Records are split to
    fit, and two restarts in a row keep every page."""
    long_spec = {**SPEC, "model": "test/long-pages", "page_tokens": 1024, "page_bytes": 4096}
    d = adopting(size_mib=32, extra="max_pages_per_request = 4096")
    d.start()
    try:
        rows = np.zeros((64, 4096), np.uint8)
        with d.client(timeout=30) as c:
            ns = c.register(**long_spec)
            for s in range(70):  # 4,480 pages
                run = list(range(s * 10**7, s * 10**7 + 64 * 1024))
                assert c.store(ns, run, rows).published == 64
        for _ in range(2):
            d.kill()
            d.start()
            with d.client() as c:
                stats = c.stats()
                assert stats.adopted_pages == 70 * 64, stats.adoption_dropped
    finally:
        d.cleanup()


@pytest.mark.parametrize("boot", ["another", ""], ids=["another_boot", "no_boot_named"])
def test_a_pool_of_another_boot_is_not_adopted(boot: str) -> None:
    """A pool file outlives a boot only where pool.shm_dir is not a tmpfs, and
    a crash of the host may leave on that disk pages its journal does not
    describe: a journal made in another boot (its header says so; here written
    by hand) is never replayed. A journal that names no boot (a daemon's before
    this field) is adopted as before."""
    d = adopting()
    d.start()
    try:
        with d.client() as c:
            c.store(c.register(**SPEC), tokens(1), pattern(1))
        assert d.stop() == 0
        journal = journal_of(d)
        data = journal.read_bytes()
        header, start = read_header(memoryview(data))
        assert header.boot, "a journal names the boot its pool was made in"
        journal.write_bytes(header_bytes(msgspec.structs.replace(header, boot=boot)) + data[start:])
        d.start()
        with d.client() as c:
            hits = c.match(c.register(**SPEC), tokens(1), lease=False).hits
        log = d.log.read_text()
        if boot:
            assert hits == 0
            assert "made before the host restarted" in log and "making a new one" in log
        else:
            assert hits == PAGES
    finally:
        d.cleanup()


def test_tenant_arenas_made_anew_because_one_is_new_say_why(two_uids: Daemon, users: Users) -> None:
    """A tenant added across a restart changes the arenas: they are made anew,
    empty, and the log says why, as for any other change (docs/restarts.md),
    though the added tenant's file was not there to be opened."""
    d = two_uids
    (a_uid, _), (b_uid, _), (c_uid, _) = users.ids
    text = d.config.read_text()
    head = text[: text.index("[tenants.alpha]")]
    tail = f"[tenants.alpha]\nuids = [{a_uid}]\n[tenants.beta]\nuids = [{b_uid}]\n"
    d.config.write_text(head + tail + f"[tenants.gamma]\nuids = [{c_uid}]\n")
    d.fresh = False
    d.kill()
    d.start()
    log = d.log.read_text()
    assert "not adopting the tenant arenas" in log, log[-2000:]
    assert "gamma" in log.split("not adopting the tenant arenas", 1)[1].splitlines()[0]


@contextlib.contextmanager
def small_tmpfs(mib: int) -> Iterator[str]:
    """A private tmpfs of ``mib`` MiB (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tempfile.mkdtemp(prefix="hc-shm-")
    try:
        mount = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", where],
            capture_output=True,
            text=True,
        )
        if mount.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
        try:
            yield where
        finally:
            subprocess.run(["umount", where], check=False)
    finally:
        os.rmdir(where)


def test_a_start_that_cannot_make_a_second_pool_beside_a_mapped_one_says_so() -> None:
    """A start that does not adopt the pool (here: a journal it does not read)
    makes a new one while clients still map the one before, whose memory the
    tmpfs keeps until they reach a daemon again: with no room for two the
    start fails, and the error says that, not only "lower pool.size_mib". Once
    the client let go of the old pool, the same start succeeds."""
    with small_tmpfs(40) as shm:
        d = adopting(size_mib=24)
        d.config.write_text(
            d.config.read_text().replace("[pool]\n", f'[pool]\nshm_dir = "{shm}"\n')
        )
        d.start()
        try:
            c = d.client()
            try:
                c.store(c.register(**SPEC), tokens(1), pattern(1))
                assert d.stop() == 0
                journal_path(arena_path(shm, d.runtime)).write_bytes(b"not a journal")
                with pytest.raises(RuntimeError, match="needs room for two"):
                    d.start(timeout=10)
            finally:
                c.close()
            d.start()
            with d.client() as c:
                ns = c.register(**SPEC)
                assert c.match(ns, tokens(1), lease=False).hits == 0
                assert c.store(ns, tokens(2), pattern(2)).published == PAGES
        finally:
            d.cleanup()
