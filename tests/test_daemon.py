"""A real daemon and real clients on real ipc and tcp sockets."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import hicached
from hicached.errors import (
    DaemonUnavailable,
    ResourceExhausted,
    StaleHandle,
    UnknownLease,
    UnknownNamespace,
)
from hicached.testing import scrape
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon, page_bytes_for

WRITER = textwrap.dedent(
    """
    import sys, numpy as np, hicached
    from tests.support import NS, page_bytes_for
    endpoint, start, pages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tokens = np.arange(start, start + pages * NS["page_tokens"], dtype=np.uint32)
    with hicached.Client(endpoint) as c:
        ns = c.register(**NS)
        ok = c.store(ns, tokens, page_bytes_for(tokens))
        print(ok.published)
    """
)


def run_writer(endpoint: str, start: int, pages: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", WRITER, endpoint, str(start), str(pages)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.parametrize("tcp", [False, True], ids=["ipc", "tcp"])
def test_two_processes_share_pages(daemon_factory: Callable[..., Daemon], tcp: bool) -> None:
    d = daemon_factory(tcp=tcp)
    assert run_writer(d.endpoint, 100, 12) == 12
    tokens = np.arange(100, 100 + 12 * PAGE_TOKENS + 5, dtype=np.uint32)  # a partial page too
    with d.client() as c:
        ns = c.register(**NS)
        hit = c.match(ns, tokens)
        assert hit.hits == 12 and hit.lease
        assert np.array_equal(c.read_pages(hit), page_bytes_for(tokens))
        c.release(hit)
        # a sequence sharing a prefix of 5 pages
        other = tokens.copy()
        other[5 * PAGE_TOKENS] += 1
        assert c.match(ns, other, lease=False).hits == 5
        stats = c.stats()
        assert stats.pages == 12 and stats.pinned_pages == 0 and stats.leases == 0


def test_copies_in_numpy_and_torch_see_the_same_memory(daemon: Daemon) -> None:
    torch = pytest.importorskip("torch")
    with daemon.client() as a, daemon.client() as b:
        ns_a, ns_b = a.register(**NS), b.register(**NS)
        tokens = np.arange(0, 2 * PAGE_TOKENS, dtype=np.uint32)
        res = a.reserve(ns_a, tokens)
        pages = torch.zeros((2, PAGE_BYTES // 2), dtype=torch.bfloat16)  # any dtype, as bytes
        pages.view(torch.uint8)[0] = 7
        pages.view(torch.uint8)[1] = 9
        a.write_pages(res, pages)
        a.commit(res)
        hit = b.match(ns_b, tokens)
        got = b.read_pages(hit)
        assert (got[0] == 7).all() and (got[1] == 9).all()
        out = torch.empty((2, PAGE_BYTES), dtype=torch.uint8)
        b.read_pages(hit.select([1, 0]), out)  # into a CPU tensor, in another order
        assert int(out[0, 0]) == 9 and int(out[1, -1]) == 7
        b.release(hit)


def test_overlapping_reserves_publish_each_page_once(daemon: Daemon) -> None:
    tokens_a = np.arange(0, 6 * PAGE_TOKENS, dtype=np.uint32)
    tokens_b = np.concatenate(
        [tokens_a[: 4 * PAGE_TOKENS], np.arange(9000, 9000 + 4 * PAGE_TOKENS)]
    ).astype(np.uint32)
    with daemon.client() as a, daemon.client() as b:
        ns_a, ns_b = a.register(**NS), b.register(**NS)
        ra = a.reserve(ns_a, tokens_a)
        rb = b.reserve(ns_b, tokens_b)
        assert ra.present == 0 and rb.present == 0
        assert not set(ra.offsets) & set(rb.offsets), "a slot was handed out twice"
        a.write_pages(ra, page_bytes_for(tokens_a))
        # B writes different bytes for the shared pages: the first commit wins
        b.write_pages(rb, page_bytes_for(tokens_b, salt=1))
        assert a.commit(ra).published == 6
        done = b.commit(rb)
        assert (done.published, done.duplicates) == (4, 4)
        hit = a.match(ns_a, tokens_b)
        got = a.read_pages(hit)
        assert hit.hits == 8
        assert np.array_equal(got[:4], page_bytes_for(tokens_a)[:4])
        assert np.array_equal(got[4:], page_bytes_for(tokens_b, salt=1)[4:])
        a.release(hit)
        stats = a.stats()
        # B's 4 duplicates wait out their quarantine (B may have been copying still)
        assert (stats.pages, stats.quarantined_pages) == (10, 4)
        assert stats.pool_used_bytes == 14 * PAGE_BYTES


def test_concurrent_stores_from_threads_stay_consistent(daemon: Daemon) -> None:
    """Many clients store overlapping sequences at once; every page reads back right."""
    rng = np.random.default_rng(5)
    prefixes = [rng.integers(0, 50_000, 4 * PAGE_TOKENS).astype(np.uint32) for _ in range(3)]
    sequences = [
        np.concatenate(
            [prefixes[i % 3], rng.integers(0, 50_000, (1 + i % 4) * PAGE_TOKENS)]
        ).astype(np.uint32)
        for i in range(24)
    ]
    failures: list[BaseException] = []

    def worker(chunk: list[np.ndarray]) -> None:
        try:
            with daemon.client() as c:
                ns = c.register(**NS)
                for toks in chunk:
                    c.store(ns, toks, page_bytes_for(toks))
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(sequences[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    with daemon.client() as c:
        ns = c.register(**NS)
        for toks in sequences:
            hit = c.match(ns, toks)
            assert hit.hits == len(toks) // PAGE_TOKENS
            assert np.array_equal(c.read_pages(hit), page_bytes_for(toks))
            c.release(hit)
        stats = c.stats()
        distinct = {
            tuple(int(x) for x in toks[: (i + 1) * PAGE_TOKENS])
            for toks in sequences
            for i in range(len(toks) // PAGE_TOKENS)
        }
        assert stats.pages == len(distinct)
        # no slot leaked: the slots of duplicates wait out their quarantine
        held = len(distinct) + stats.quarantined_pages
        assert stats.pool_used_bytes == held * PAGE_BYTES


HOLDER = textwrap.dedent(
    """
    import sys, time, numpy as np, hicached
    from tests.support import NS
    with hicached.Client(sys.argv[1]) as c:
        ns = c.register(**NS)
        toks = np.arange(0, 4 * NS["page_tokens"], dtype=np.uint32)
        hit = c.match(ns, toks)                      # pins 4 pages
        res = c.reserve(ns, np.arange(7, 7 + 3 * NS["page_tokens"], dtype=np.uint32))
        print(hit.hits, len(res.offsets), flush=True)
        time.sleep(600)
    """
)


def test_leases_of_a_killed_client_expire(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(extra="[leases]\nttl_s = 1.0\nsweep_interval_s = 0.1\n")
    with d.client() as c:
        ns = c.register(**NS)
        toks = np.arange(0, 4 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, d.endpoint], stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().split() == ["4", "3"]
            stats = c.stats()
            assert (stats.pinned_pages, stats.reserved_pages, stats.leases) == (4, 3, 2)
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait(10)
            if holder.stdout is not None:
                holder.stdout.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = c.stats()
            if stats.leases == 0:
                break
            time.sleep(0.1)
        assert (stats.pinned_pages, stats.reserved_pages, stats.leases) == (0, 0, 2 - 2)
        assert stats.expired_leases == 2
        # the reserved slots wait in quarantine: the dead client may have been copying
        assert stats.quarantined_pages == 3
        assert stats.pool_used_bytes == (4 + 3) * PAGE_BYTES


def test_pool_full_is_a_clear_result_and_unleased_pages_are_evicted(
    daemon_factory: Callable[..., Daemon],
) -> None:
    # 1 MiB pool, 1 MiB slab: 256 pages of 4 KiB
    d = daemon_factory(size_mib=1, slab_mib=1)
    with d.client() as c:
        ns = c.register(**NS)
        old = np.arange(0, 200 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, old, page_bytes_for(old))
        pinned = np.arange(10**6, 10**6 + 56 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, pinned, page_bytes_for(pinned))
        hold = c.match(ns, pinned)
        assert hold.hits == 56
        # a new sequence needs room: the unpinned old pages are evicted, LRU tail first
        new = np.arange(5 * 10**6, 5 * 10**6 + 100 * PAGE_TOKENS, dtype=np.uint32)
        assert c.store(ns, new, page_bytes_for(new)).published == 100
        assert c.match(ns, old, lease=False).hits == 100
        # everything else is pinned or reserved: the pool says so, nothing crashes
        res1 = c.reserve(ns, np.arange(7 * 10**6, 7 * 10**6 + 200 * PAGE_TOKENS, dtype=np.uint32))
        assert len(res1.offsets) == 200 and not res1.pool_full
        res2 = c.reserve(ns, np.arange(8 * 10**6, 8 * 10**6 + 10 * PAGE_TOKENS, dtype=np.uint32))
        assert res2.pool_full and res2.offsets == [] and res2.lease == 0
        hit = c.match(ns, pinned)
        assert hit.hits == 56 and np.array_equal(c.read_pages(hit), page_bytes_for(pinned))
        c.release(hit)
        c.release(hold)
        c.abort(res1)
        assert c.stats().evicted_pages == 100 + 200  # then res1 took the rest of old and all of new


def test_daemon_restart_and_client_reconnect(daemon: Daemon) -> None:
    c = daemon.client(timeout=2.0)
    try:
        ns = c.register(**NS)
        toks = np.arange(0, 3 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
        stale = c.match(ns, toks)
        first = c.stats().instance
        assert daemon.stop() == 0
        with pytest.raises(DaemonUnavailable):  # at once, not after the timeout
            c.stats()
        daemon.start()
        # the client says hello again, re-registers its namespace and remaps the pool
        assert c.stats().instance != first
        assert c.match(ns, toks).hits == 0  # L2 is memory: a restart forgets
        # a read lease of the old daemon is read from its pool, kept mapped for the
        # lease's life: the key's own bytes, never the new pool's
        assert np.array_equal(c.read_pages(stale), page_bytes_for(toks))
        c.release(stale)  # a lease of the old daemon is gone with it; no error
        assert c.store(ns, toks, page_bytes_for(toks)).published == 3
        hit = c.match(ns, toks)
        assert np.array_equal(c.read_pages(hit), page_bytes_for(toks))
        c.release(hit)
    finally:
        c.close()


def test_a_step_call_after_a_restart_says_hello_and_asks_again_under_the_new_ids(
    daemon: Daemon,
) -> None:
    """match, exists_keys and prefetch skip the exchange machinery (Client._call):
    the first of them to reach a restarted daemon is told the session is lost,
    says hello (which registers its namespaces anew) and asks again, with the
    namespace id the new daemon gave, not the old one."""
    keyed = {**NS, "model": "test/keyed", "key_scheme": "vllm-sha256"}
    c = daemon.client(timeout=2.0)
    try:
        ns, kns = c.register(**NS), c.register(**keyed)
        toks = np.arange(0, 3 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
        old = (ns.id, kns.id)
        assert daemon.stop() == 0
        daemon.start()
        with daemon.client() as other:  # takes the first ids of the new daemon
            other.register(**{**NS, "model": "test/first"})
            other.register(**{**NS, "model": "test/second"})
        assert c.match(ns, toks).hits == 0  # no stats() first: match finds the restart
        assert (ns.id, kns.id) != old
        res = c.reserve(ns, toks)
        c.write_pages(res, page_bytes_for(toks))
        c.commit(res)
        hit = c.match(ns, toks)
        assert hit.hits == 3
        assert np.array_equal(c.read_pages(hit), page_bytes_for(toks))
        c.release(hit)
        assert c.exists_keys(kns, [bytes(36)]).l2 == 0
    finally:
        c.close()


def test_a_hello_again_opens_the_session_only_with_every_namespace_renumbered(
    daemon: Daemon,
) -> None:
    """An AsyncClient's other tasks wait while a hello re-registers namespaces:
    the moment the session counts as open again, every namespace already has
    the new daemon's id, and ids never carry over from the daemon before."""

    async def run() -> None:
        async with hicached.AsyncClient(daemon.endpoint, timeout=3.0) as c:
            a = await c.register(**{**NS, "model": "test/a"})
            b = await c.register(**{**NS, "model": "test/b"})
            old = {a.id, b.id}
            assert daemon.stop() == 0
            daemon.start()
            other = daemon.client()  # holds the namespaces, and so their ids, meanwhile
            try:
                other.register(**{**NS, "model": "test/decoy"})
                now = {
                    other.register(**{**NS, "model": "test/a"}).id,
                    other.register(**{**NS, "model": "test/b"}).id,
                }
                assert not now & old  # a stale id names nothing on the new daemon
                toks = np.arange(0, 2 * PAGE_TOKENS, dtype=np.uint32)
                first = asyncio.get_running_loop().create_task(c.match(a, toks))
                lost = False  # until the new daemon says the session is lost, then hello
                while not lost or c._hello is None:
                    lost = lost or c._hello is None
                    await asyncio.sleep(0)
                assert {a.id, b.id} == now  # open again: with every id renumbered
                assert (await first).hits == 0 and (await c.match(b, toks)).hits == 0
            finally:
                other.close()

    asyncio.run(run())


def test_a_namespace_the_new_daemon_refuses_is_never_asked_for_under_another_id(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A restarted daemon with room for one namespace less: the hello that
    re-registers fails for one, which keeps id 0 and is refused by name, while
    the other goes on; no request ever carries the refused one's old id."""
    d = daemon_factory()
    d.stop()
    d.config.write_text(d.config.read_text().replace("[pool]\n", "[pool]\nmax_namespaces = 2\n"))
    d.start()
    toks = np.arange(0, 2 * PAGE_TOKENS, dtype=np.uint32)
    with d.client(timeout=2.0) as c:
        a = c.register(**{**NS, "model": "test/a"})
        b = c.register(**{**NS, "model": "test/b"})
        assert d.stop() == 0
        d.start()
        with d.client() as other:
            other.register(**{**NS, "model": "test/decoy"})
            with pytest.raises(ResourceExhausted):  # the hello of this call: b has no room
                c.match(a, toks)
            assert b.id == 0 and a.id != 0
            c.store(a, toks, page_bytes_for(toks))
            with pytest.raises(UnknownNamespace):
                c.match(b, toks)
            assert c.match(a, toks, lease=False).hits == 2


def test_handles_from_before_a_restart_never_touch_the_new_pool(daemon: Daemon) -> None:
    """A read lease and a reservation granted by a daemon that has since restarted:
    the read is served from the old pool (the key's own bytes), the write is
    refused, and another client's pages in the new pool stay intact."""
    x = np.arange(0, 4 * PAGE_TOKENS, dtype=np.uint32)
    y = np.arange(50_000, 50_000 + 4 * PAGE_TOKENS, dtype=np.uint32)
    with daemon.client(timeout=2.0) as a:
        ns = a.register(**NS)
        a.store(ns, x, np.full((4, PAGE_BYTES), 0xAA, dtype=np.uint8))
        hit = a.match(ns, x)
        res = a.reserve(ns, np.arange(90_000, 90_000 + 4 * PAGE_TOKENS, dtype=np.uint32))
        assert hit.hits == 4 and len(res.offsets) == 4
        daemon.stop()
        daemon.start()
        with daemon.client(timeout=2.0) as b:
            ns_b = b.register(**NS)
            b.store(ns_b, y, np.full((4, PAGE_BYTES), 0x55, dtype=np.uint8))
            a.stats()  # any call: a says hello again and maps the new pool
            assert (a.read_pages(hit) == 0xAA).all()  # from the old pool, still mapped
            with pytest.raises(StaleHandle):
                a.write_pages(res, np.full((4, PAGE_BYTES), 0x11, dtype=np.uint8))
            with pytest.raises(UnknownLease):
                a.commit(res)
            assert (b.load(ns_b, y) == 0x55).all()


async def test_async_client_runs_requests_concurrently(daemon: Daemon) -> None:
    import asyncio

    async with hicached.AsyncClient(daemon.endpoint) as c:
        ns = await c.register(**NS)
        seqs = [
            np.arange(i * 10_000, i * 10_000 + 3 * PAGE_TOKENS, dtype=np.uint32) for i in range(16)
        ]
        await asyncio.gather(*(c.store(ns, s, page_bytes_for(s)) for s in seqs))
        loaded = await asyncio.gather(*(c.load(ns, s) for s in seqs))
        for s, got in zip(seqs, loaded, strict=True):
            assert np.array_equal(got, page_bytes_for(s))
        stats = await c.stats()
        assert stats.pages == 48 and stats.leases == 0


def test_page_sizes_share_the_pool_by_recency(daemon_factory: Callable[..., Daemon]) -> None:
    """A page size that holds every slab gives one back to another size whose
    pages are more recent, and takes one back the same way; pinned pages stay."""
    d = daemon_factory(size_mib=2, slab_mib=1)  # two slabs
    big_ns = dict(NS, model="test/big", page_bytes=2 * PAGE_BYTES)
    with d.client() as c:
        small, big = c.register(**NS), c.register(**big_ns)

        def seqs(base: int, n: int, pages: int) -> list[np.ndarray]:
            return [
                np.arange(PAGE_TOKENS * pages, dtype=np.uint32) + base + i * 10**6 for i in range(n)
            ]

        small_seqs = seqs(10**8, 4, 128)  # 4 x 128 pages of 4 KiB: both slabs
        for toks in small_seqs:
            assert c.store(small, toks, page_bytes_for(toks)).published == 128
        assert c.stats().pool_free_bytes == 0
        big_toks = seqs(2 * 10**8, 1, 64)[0]  # 64 pages of 8 KiB: half a slab
        big_pages = page_bytes_for(big_toks, 2 * PAGE_BYTES)
        assert c.store(big, big_toks, big_pages).published == 64  # no longer pool-full
        stats = c.stats()
        assert stats.reclaimed_slabs == 1
        assert scrape(stats.metrics_endpoint)[("hicached_reclaimed_slabs_total", ())] == 1
        # the least recently used small pages went; the newest are all there
        assert c.match(small, small_seqs[0], lease=False).hits == 0
        assert c.match(small, small_seqs[3], lease=False).hits == 128
        assert np.array_equal(c.load(big, big_toks), big_pages)

        # now the small pages are the more recent: the big size gives its slab back
        for toks in small_seqs[2:]:
            c.match(small, toks, lease=False)
        more = seqs(3 * 10**8, 1, 200)[0]
        assert c.store(small, more, page_bytes_for(more)).published == 200
        assert c.stats().reclaimed_slabs == 2
        assert c.match(big, big_toks, lease=False).hits == 0
        assert c.match(small, small_seqs[3], lease=False).hits == 128

        # a size whose every page is leased keeps its slabs: the other gets pool_full
        held = [(toks, c.match(small, toks)) for toks in (small_seqs[2], small_seqs[3], more)]
        held = [(toks, hit) for toks, hit in held if hit.hits]
        assert held, "the small pages must be there to lease"
        leases = [hit for _, hit in held]
        leased = sum(hit.hits for hit in leases)
        res = c.reserve(big, big_toks)
        assert res.pool_full
        c.abort(res)
        for toks, hit in held:
            assert np.array_equal(c.read_pages(hit), page_bytes_for(toks)[: hit.hits])
        for hit in leases:
            c.release(hit)
        assert leased == c.stats().pages


def test_a_lease_past_its_deadline_refuses_copies_unless_renewed(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(extra="[leases]\nttl_s = 1.0\nsweep_interval_s = 0.1\n")
    toks = np.arange(0, 2 * PAGE_TOKENS, dtype=np.uint32)
    with d.client() as c:
        ns = c.register(**NS)
        late = c.reserve(ns, toks)
        kept = c.reserve(ns, np.arange(500, 500 + 2 * PAGE_TOKENS, dtype=np.uint32))
        for _ in range(4):  # renewed every 0.4 s: alive after 1.6 s
            time.sleep(0.4)
            c.renew(kept)
        with pytest.raises(StaleHandle, match="deadline"):
            c.write_pages(late, page_bytes_for(toks))
        with pytest.raises(UnknownLease):
            c.renew(late)  # the daemon let it go too
        c.write_pages(kept, np.zeros((2, PAGE_BYTES), dtype=np.uint8))
        assert c.commit(kept).published == 2


def test_views_copy_but_only_their_handle_ends_the_lease(daemon: Daemon) -> None:
    toks = np.arange(0, 4 * PAGE_TOKENS, dtype=np.uint32)
    with daemon.client() as c:
        ns = c.register(**NS)
        res = c.reserve(ns, toks)
        part = res.select([3, 1])
        c.write_pages(part, page_bytes_for(toks)[[3, 1]])
        c.write_pages(res.select([0, 2]), page_bytes_for(toks)[[0, 2]])
        with pytest.raises(hicached.HicachedError, match="not a view"):
            c.commit(part)
        assert c.commit(res).published == 4
        with pytest.raises(StaleHandle, match="closed"):
            c.write_pages(part, page_bytes_for(toks)[[3, 1]])  # the view ended with it
        hit = c.match(ns, toks)
        assert np.array_equal(c.read_pages(hit.select([1])), page_bytes_for(toks)[[1]])
        view = hit.select([0])
        with pytest.raises(hicached.HicachedError, match="not a view"):
            c.release(view)  # refused before anything: the lease stays open
        assert np.array_equal(c.read_pages(view), page_bytes_for(toks)[[0]])
        c.release(hit)
        with pytest.raises(StaleHandle, match="closed"):
            c.read_pages(hit.select([0]))


def test_a_read_lease_holds_its_whole_prefix_under_eviction(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A token lease pins only the last page of its prefix; eviction still
    cannot take any page of it, in its own node or in the nodes before it
    (here split by a second sequence), while every unleased page goes."""
    d = daemon_factory(size_mib=1, slab_mib=1)  # 256 slots of 4 KiB
    with d.client() as c:
        ns = c.register(**NS)
        toks = np.arange(8 * PAGE_TOKENS, dtype=np.uint32)
        other = toks.copy()
        other[3 * PAGE_TOKENS :] += 100_000  # shares 3 pages: splits the node there
        c.store(ns, toks, page_bytes_for(toks))
        c.store(ns, other, page_bytes_for(other))
        held = c.match(ns, toks[: 6 * PAGE_TOKENS])  # 6 pages over two nodes
        assert held.hits == 6
        inner = c.match(ns, toks[: 2 * PAGE_TOKENS])  # a shorter lease on the same path
        shared = c.match(ns, other[: 5 * PAGE_TOKENS])  # another branch after the split
        assert c.stats().pinned_pages == 8  # every held page once: 6 + 2 of the branch
        c.release(shared)
        c.release(inner)
        assert c.stats().pinned_pages == 6
        for start in range(1_000_000, 1_000_000 + 40 * 8 * PAGE_TOKENS, 8 * PAGE_TOKENS):
            flood = np.arange(start, start + 8 * PAGE_TOKENS, dtype=np.uint32)
            c.store(ns, flood, page_bytes_for(flood))  # 320 pages through 256 slots
        assert c.match(ns, other, lease=False).hits == 3  # its own pages went
        again = c.match(ns, toks, lease=False)
        assert again.hits == 6 and again.offsets == held.offsets
        assert np.array_equal(c.read_pages(held), page_bytes_for(toks)[:6])
        c.release(held)
        for start in range(2_000_000, 2_000_000 + 40 * 8 * PAGE_TOKENS, 8 * PAGE_TOKENS):
            flood = np.arange(start, start + 8 * PAGE_TOKENS, dtype=np.uint32)
            c.store(ns, flood, page_bytes_for(flood))
        assert c.match(ns, toks, lease=False).hits == 0  # released: evictable again
