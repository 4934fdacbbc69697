"""L2 across restarts: a daemon adopts the pool of the one before it.

Real daemons, real client processes. Whatever the timing of a kill -9, no page
is ever read with bytes that were not stored under its key, every page whose
commit was acknowledged before the kill is matched again after the restart,
and clients go on without restarting (docs/operations.md, cache/adopt.py).
"""

from __future__ import annotations

import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from hicached import protocol as p
from hicached.cache import Cache
from hicached.cache.journal import Recorder
from hicached.config import Config, PoolConfig
from hicached.daemon.journal import journal_path, rewrite_path
from hicached.daemon.publisher import END_SEQ
from hicached.errors import StaleHandle
from hicached.wire.arena import Arena, arena_path
from hicached.wire.events import BlockStored, batch_decoder, block_hash
from hicached.wire.hashing import pack_tokens, page_keys
from hicached.wire.journal import JOURNAL_VERSION, header_bytes, read_header, read_journal
from hicached.wire.namespace import EventMeta
from tests.adoption_worker import PAGE_BYTES, PAGES, SPEC, pattern, tokens
from tests.l3util import FILE_STORE
from tests.support import Daemon

ROOT = Path(__file__).resolve().parent.parent
CYCLES = int(os.environ.get("HICACHED_ADOPTION_CYCLES", "4"))


def adopting(**kwargs: object) -> Daemon:
    """A daemon whose every start adopts the pool of the stop before."""
    made: dict[str, object] = {"size_mib": 96, "max_page_bytes": 1 << 20, **kwargs}
    return Daemon(fresh=False, **made)  # type: ignore[arg-type]


def acked(logs: list[Path]) -> list[int]:
    out = []
    for log in logs:
        for line in log.read_text().splitlines():
            assert not line.startswith("LIE"), f"a page was read with another key's bytes: {line}"
            if line.startswith("ACK"):
                out.append(int(line.split()[1]))
    return out


def check_all_matched(d: Daemon, sequences: list[int]) -> None:
    """Every sequence is matched whole in L2, with its own bytes."""
    with d.client() as c:
        ns = c.register(**SPEC)
        for s in sequences:
            hit = c.match(ns, tokens(s))
            try:
                assert hit.hits == PAGES, f"sequence {s}: {hit.hits} of {PAGES} pages after restart"
                assert np.array_equal(c.read_pages(hit), pattern(s))
            finally:
                c.release(hit)


def test_kill9_and_sigterm_cycles_lose_no_acknowledged_page(tmp_path: Path) -> None:
    """Three client processes store, read back (every byte compared) and
    prefetch while the daemon is killed (-9, and once SIGTERM) at random
    moments; after each restart every sequence acknowledged before the stop is
    matched whole, and the clients carry on with the client objects they had."""
    d = adopting(storage='backend = "file"\nwrite_policy = "write_through"\n', tail=FILE_STORE)
    d.start()
    rng = random.Random(7)
    logs = [tmp_path / f"worker{w}.log" for w in range(3)]
    for log in logs:
        log.touch()
    errs = [open(f"{log}.err", "wb") for log in logs]  # noqa: SIM115 - closed below
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.adoption_worker", d.endpoint, str(log), str(w), "400"],
            cwd=ROOT,
            stderr=errs[w],
        )
        for w, log in enumerate(logs)
    ]
    matched = committed = 0
    try:
        for cycle in range(CYCLES):
            time.sleep(rng.uniform(0.2, 1.2))
            sigterm = cycle == CYCLES - 1
            if sigterm:
                assert d.stop() == 0
            else:
                d.kill()
            before = acked(logs)
            d.start()
            check_all_matched(d, before)
            with d.client() as c:
                stats = c.stats()
            assert stats.adopted_pages >= PAGES * len(before)
            matched += len(before)
            committed += len(before)
        for worker, log in zip(workers, logs, strict=True):
            assert worker.wait(120) == 0, Path(f"{log}.err").read_text()
        assert all(log.read_text().endswith("DONE\n") for log in logs)
        acked(logs)  # and no LIE in any
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        for err in errs:
            err.close()
        d.cleanup()
    assert matched == committed > 0


def test_a_client_keeps_its_mapping_and_its_read_handles(tmp_path: Path) -> None:
    """Across a restart that adopts the pool: the client goes on with its mapping
    (no remap), a hit granted by the daemon before reads the original bytes,
    and once the new daemon evicts that page the same hit is a miss."""
    d = adopting(size_mib=16)
    d.start()
    try:
        with d.client() as c:
            ns = c.register(**SPEC)
            c.store(ns, tokens(1), pattern(1))
            hit = c.match(ns, tokens(1))
            mapping = c.mapping
            d.stop()
            d.start()
            c.stats()  # catches up with the new instance
            assert c.mapping is mapping, "the same pool file is not mapped again"
            assert np.array_equal(c.read_pages(hit), pattern(1)), "adopted: the bytes stand"
            # the new daemon gives the page's slot to others: the old hit is stale
            with d.client() as other:
                ons = other.register(**{**SPEC, "model": "test/other"})
                for s in range(2, 400):
                    other.store(ons, tokens(s), pattern(s))
            assert c.match(ns, tokens(1), lease=False).hits == 0, "the page was evicted"
            with pytest.raises(StaleHandle):
                c.read_pages(hit)
    finally:
        d.cleanup()


def test_a_write_handle_from_before_the_restart_lands_in_no_other_page() -> None:
    """A client holds a reservation across a kill -9; the new daemon quarantines
    its slots, so even bytes written straight into them (fault injection: a copy
    that began before the restart and ends after it) reach no page another
    client stores meanwhile; the client's own library refuses the old handle."""
    d = adopting()
    d.start()
    try:
        with d.client() as late:
            ns = late.register(**SPEC)
            res = late.reserve(ns, tokens(1))
            offsets = list(res.offsets)
            assert len(offsets) == PAGES
            d.kill()
            d.start()
            late.stats()
            with pytest.raises(StaleHandle):
                late.write_pages(res, pattern(1))
            with d.client() as other:
                ons = other.register(**{**SPEC, "model": "test/other"})
                stored = []
                for s in range(2, 200):
                    ok = other.store(ons, tokens(s), pattern(s))
                    if ok.published:
                        stored.append(s)
                # the late copy lands now, straight through the mapping
                rows = late.mapping.arena.array
                for offset in offsets:
                    rows[offset : offset + SPEC["page_bytes"]] = 0xEE
                for s in stored:
                    hit = other.match(ons, tokens(s))
                    try:
                        got = other.read_pages(hit)
                        assert np.array_equal(got, pattern(s)[: len(got)]), s
                    finally:
                        other.release(hit)
                stats = other.stats()
                assert stats.quarantined_pages == PAGES
    finally:
        d.cleanup()


def test_the_oldest_unused_namespace_still_makes_way_first_after_a_restart() -> None:
    """Namespace ids are random: the adopting daemon brings the namespaces back
    in the order they were registered (the journal's), not in their ids'. A
    full table then drops the oldest unused one first, as before the restart;
    each adopted namespace keeps its id."""
    n = 6
    d = adopting()
    d.config.write_text(d.config.read_text().replace("[pool]\n", f"[pool]\nmax_namespaces = {n}\n"))
    d.start()
    try:
        specs = [{**SPEC, "model": f"test/ns-{i}"} for i in range(n)]
        with d.client() as c:
            ids = []
            for i, spec in enumerate(specs):
                ns = c.register(**spec)
                assert c.store(ns, tokens(i), pattern(i)).published == PAGES
                ids.append(ns.id)
        assert d.stop() == 0
        d.start()
        with d.client() as c:
            assert c.stats().namespaces == n
            c.register(**{**SPEC, "model": "test/new"})  # the table is full: ns-0 makes way
            newest = c.register(**specs[-1])
            assert newest.id == ids[-1], "an adopted namespace keeps its id"
            assert c.match(newest, tokens(n - 1), lease=False).hits == PAGES
            for i in range(n - 2):  # each comes anew, and the oldest left, ns-(i+1), makes way
                ns = c.register(**specs[i])
                assert ns.id not in ids, (i, ns.id, ids)
                assert c.match(ns, tokens(i), lease=False).hits == 0, f"ns-{i} was kept"
    finally:
        d.cleanup()


def test_a_new_namespace_takes_no_id_adopted_or_still_named_by_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random id may come out equal to one in use. The daemon never gives it:
    not the id of a namespace adopted from the daemon before, nor that of a
    forgotten namespace whose record the journal file still holds (replayed
    after a restart, it would describe the new one), nor 0 (a client's
    "none"). Once a snapshot of the journal left the forgotten one out, its
    id may be drawn again. On the daemon's state in-process (the random
    source forced)."""
    arena = Arena.create(tmp_path / "pool", 4 << 20, populate=False)
    config = Config(pool=PoolConfig(size_mib=4, slab_mib=1, max_page_bytes=PAGE_BYTES))

    def daemon() -> Cache:
        return Cache(config, pool_path=str(arena.path), gens=arena.gens, journal=Recorder())

    def call(cache: Cache, rid: bytes, request: p.Request) -> p.AnyReply:
        return cache.handle(rid, p.request_decoder.decode(p.encode(request)))

    def register(cache: Cache, rid: bytes, model: str) -> int:
        spec = msgspec.convert({**SPEC, "model": model}, p.NamespaceSpec)
        ok = call(cache, rid, p.RegisterNamespace(id=2, spec=spec))
        assert isinstance(ok, p.NamespaceOk), ok
        return ok.ns

    hello = p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)
    try:
        before = daemon()
        assert isinstance(call(before, b"c", hello), p.HelloOk)
        kept = register(before, b"c", "kept")
        ok = call(before, b"c", p.Reserve(id=3, ns=kept, tokens=pack_tokens(tokens(1))))
        assert isinstance(ok, p.ReserveOk) and len(ok.offsets) == PAGES
        assert isinstance(call(before, b"c", p.Commit(id=4, lease=ok.lease)), p.CommitOk)
        records, torn = read_journal(memoryview(before.journal.snapshot()), 0)
        assert records and not torn
        after = daemon()  # the restart: same pool file, the journal's records
        assert after.adopt(records).pages == PAGES and kept in after.namespaces
        assert isinstance(call(after, b"c", hello), p.HelloOk)
        assert register(after, b"c", "kept") == kept  # adopted: the same id
        gone = register(after, b"c", "gone")
        assert isinstance(call(after, b"c", p.Goodbye(id=5)), p.Ok)
        assert gone not in after.namespaces and kept in after.namespaces  # kept by its pages
        assert isinstance(call(after, b"d", hello), p.HelloOk)
        real = secrets.randbits
        draws = iter([kept, gone, 0, kept, gone])
        monkeypatch.setattr(secrets, "randbits", lambda k: next(draws) if k == 63 else real(k))
        assert register(after, b"d", "new") == 1  # not kept's, not gone's, not 0
        after.journal.snapshot()  # the journal compacted: gone's record is no more
        assert register(after, b"d", "newer") == gone
    finally:
        arena.close()


def test_a_pool_of_another_layout_version_is_replaced(tmp_path: Path) -> None:
    """A pool whose journal says another layout version (an older or newer
    daemon's) is never read: the start says why and makes a new pool."""
    d = adopting()
    d.start()
    try:
        with d.client() as c:
            ns = c.register(**SPEC)
            c.store(ns, tokens(1), pattern(1))
        assert d.stop() == 0
        journal = journal_path(arena_path("/dev/shm", d.runtime))
        data = journal.read_bytes()
        header, start = read_header(memoryview(data))
        bumped = msgspec.structs.replace(header, version=JOURNAL_VERSION + 1)
        # written as a newer daemon would: its header, the same records
        journal.write_bytes(header_bytes(bumped) + data[start:])
        d.start()
        with d.client() as c:
            ns = c.register(**SPEC)
            assert c.match(ns, tokens(1), lease=False).hits == 0
            assert c.stats().adopted_pages == 0
        log = d.log.read_text()
        assert (
            f"pool layout version {JOURNAL_VERSION + 1}, this daemon reads {JOURNAL_VERSION}" in log
        )
        assert "making a new one" in log
    finally:
        d.cleanup()


def test_a_fresh_start_and_adopt_off_forget_l2() -> None:
    """`serve --fresh` makes a new pool once; pool.adopt = false never keeps one,
    nor a rewrite of the journal that a crash left."""
    d = adopting()
    d.start()
    try:
        with d.client() as c:
            ns = c.register(**SPEC)
            c.store(ns, tokens(1), pattern(1))
        d.stop()
        d.fresh = True
        d.start()
        with d.client() as c:
            assert c.match(c.register(**SPEC), tokens(1), lease=False).hits == 0
    finally:
        d.cleanup()
    off = Daemon(fresh=False, adopt=False)
    off.start()
    try:
        with off.client() as c:
            ns = c.register(**SPEC)
            c.store(ns, tokens(1), pattern(1))
        pool = arena_path("/dev/shm", off.runtime)
        assert off.stop() == 0
        assert not pool.exists() and not journal_path(pool).exists()
        # what a crash in a compaction leaves (written here): gone at the start
        left = rewrite_path(journal_path(pool))
        left.write_bytes(b"\0" * 4096)
        off.start()
        assert not left.exists()
        with off.client() as c:
            assert c.match(c.register(**SPEC), tokens(1), lease=False).hits == 0
    finally:
        off.cleanup()


def test_pages_smaller_than_a_generation_granule_are_not_adopted() -> None:
    """Pages of less than 4 KiB share a generation counter with their neighbours,
    which then cannot fence each other: they are dropped (and counted), and a
    hit on one granted before the restart is a miss once its slot is reused."""
    small = {**SPEC, "model": "test/small", "page_bytes": 1024}
    d = adopting(size_mib=4)
    d.start()
    try:
        with d.client() as c:
            ns = c.register(**SPEC)
            sns = c.register(**small)
            c.store(ns, tokens(1), pattern(1))
            rows = np.stack([pattern(2)[i, :1024] for i in range(PAGES)])
            c.store(sns, tokens(2), rows)
            hit = c.match(sns, tokens(2))
            d.kill()
            d.start()
            stats = c.stats()
            assert stats.adopted_pages == PAGES
            assert stats.adoption_dropped == {"small_page": PAGES}
            assert c.match(ns, tokens(1), lease=False).hits == PAGES
            assert c.match(sns, tokens(2), lease=False).hits == 0
            for s in range(3, 40):  # small pages of other keys take the free slots
                c.store(sns, tokens(s), np.stack([pattern(s)[i, :1024] for i in range(PAGES)]))
            with pytest.raises(StaleHandle):
                c.read_pages(hit)
    finally:
        d.cleanup()


def test_adopted_pages_are_announced_after_all_blocks_cleared(tmp_path: Path) -> None:
    """Routers learn the adopted pages again: the new daemon's events begin with
    AllBlocksCleared, then BlockStored (CPU) for each adopted sequence, with its
    parent and token ids as first published."""
    events = tmp_path / "ev"
    events.mkdir(mode=0o700)
    tail = (
        f'[events]\nendpoint = "ipc://{events}/events.sock"\n'
        f'replay_endpoint = "ipc://{events}/replay.sock"\n'
    )
    d = adopting(tail=tail)
    d.start()
    ctx = zmq.Context()
    try:
        with d.client() as c:
            ns = c.register(**SPEC)
            for s in (1, 2):
                c.store(ns, tokens(s), pattern(s))
            keys = {
                s: page_keys(ns.digest, pack_tokens(tokens(s)), SPEC["page_tokens"]) for s in (1, 2)
            }
        d.kill()
        d.start()
        got = _replayed(ctx, events, stored=2)
        assert type(got[0]).__name__ == "AllBlocksCleared"
        stored = [e for e in got[1:] if isinstance(e, BlockStored)]
        assert all(e.medium == "CPU" for e in stored)
        announced = {tuple(e.block_hashes): e for e in stored}
        for s in (1, 2):
            e = announced[tuple(block_hash(k) for k in keys[s])]
            assert e.parent_block_hash is None
            assert e.token_ids == tokens(s) and e.block_size == SPEC["page_tokens"]
    finally:
        ctx.destroy(linger=0)
        d.cleanup()


@pytest.mark.parametrize("damage", ["garbage", "torn", "foreign"])
def test_a_damaged_or_foreign_journal_is_never_trusted(damage: str) -> None:
    """A journal that does not verify is read up to its first bad frame (a torn
    tail loses only what follows it); one that is garbage from the start, or
    not this user's own and private (in /dev/shm anyone may make a file), is
    never read: the start makes a new pool and says why."""
    d = adopting()
    d.start()
    try:
        with d.client() as c:
            ns = c.register(**SPEC)
            for s in (1, 2):
                c.store(ns, tokens(s), pattern(s))
        assert d.stop() == 0
        journal = journal_path(arena_path("/dev/shm", d.runtime))
        data = journal.read_bytes()
        if damage == "garbage":
            journal.write_bytes(bytes(len(data)))
        elif damage == "torn":
            journal.write_bytes(data[:-7])  # the last commit's record cut short
        else:
            os.chown(journal, 65534, -1)  # another user's file (the test runs as root)
        d.start()
        with d.client() as c:
            ns = c.register(**SPEC)
            hits = [c.match(ns, tokens(s), lease=False).hits for s in (1, 2)]
            adopted = c.stats().adopted_pages
        log = d.log.read_text()
        if damage == "torn":
            # the last commit is gone whole (one record); the one before stays
            assert hits == [PAGES, 0] and adopted == PAGES
        else:
            assert hits == [0, 0] and adopted == 0
            why = "not a hicached pool journal" if damage == "garbage" else "not this daemon's own"
            assert why in log and "making a new one" in log
    finally:
        d.cleanup()


def test_adopted_key_addressed_pages_keep_their_group_and_spec_kind(tmp_path: Path) -> None:
    """A vLLM-keyed page's KV cache group and its namespace's event metadata
    are journaled: the adopting daemon's BlockStored says both again."""
    events = tmp_path / "ev"
    events.mkdir(mode=0o700)
    tail = (
        f'[events]\nendpoint = "ipc://{events}/events.sock"\n'
        f'replay_endpoint = "ipc://{events}/replay.sock"\n'
    )
    d = adopting(tail=tail)
    d.start()
    ctx = zmq.Context()
    spec = {**SPEC, "key_scheme": "vllm-sha256", "layout": "vllm_g3"}
    block = [bytes([i]) * 32 for i in (5, 6)]
    try:
        with d.client() as c:
            meta = EventMeta(kind="sliding_window", sliding_window=48)
            ns = c.register(**spec, events=meta)
            res = c.reserve_keys(ns, [h + (3).to_bytes(4, "big") for h in block])
            c.write_pages(res, np.stack([pattern(1)[0], pattern(2)[0]]))
            c.commit(res)
        d.kill()
        d.start()
        got = _replayed(ctx, events, stored=1)
        (event,) = [e for e in got if isinstance(e, BlockStored)]
        assert event.block_hashes == [block_hash(h) for h in block]
        assert event.group_idx == 3
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (
            "sliding_window",
            48,
        )
    finally:
        ctx.destroy(linger=0)
        d.cleanup()


def _replayed(ctx: zmq.Context[Any], events: Path, stored: int) -> list[Any]:
    """Every event the daemon's replay socket (in ``events``) keeps, from the
    start, once it holds ``stored`` BlockStored events: the publisher sends what
    the daemon logged every ``events.flush_interval_s``, so right after READY
    the adopted pages' events may not be out yet (asked again, for 10 s)."""
    deadline = time.monotonic() + 10.0
    while True:
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(f"ipc://{events}/replay.sock")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        got: list[Any] = []
        while True:
            assert replay.poll(5000), "no replay"
            _, _topic, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                break
            got.extend(batch_decoder.decode(payload).events)
        replay.close()
        if sum(isinstance(e, BlockStored) for e in got) >= stored or time.monotonic() > deadline:
            return got
        time.sleep(0.05)
