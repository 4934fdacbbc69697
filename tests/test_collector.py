"""The daemon's garbage collector (daemon/collector.py): the freeze once the
start's work ends, its figures in stats, metrics and status, and why freezing
the cache's objects keeps nothing for good: the cache makes no cyclic garbage,
and index entries evicted after a freeze are freed all the same."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hicached.cache import Cache
from hicached.client import Client
from hicached.config import Config, PoolConfig
from hicached.daemon import collector as collector_module
from hicached.daemon.collector import Collector
from hicached.errors import UnknownLease
from hicached.testing import scrape
from hicached.wire import protocol as p
from hicached.wire.hashing import pack_tokens
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for

PB = 4096
ROOT = Path(__file__).resolve().parents[1]


def _stats(endpoint: str) -> p.DaemonStats:
    with Client(endpoint, timeout=5.0, map_pool=False) as c:
        return c.stats()


def _status(endpoint: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "status", "--endpoint", endpoint],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Tests that freeze in this process give it back as it was."""
    gc.unfreeze()
    yield
    gc.unfreeze()


# -- a real daemon -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_daemon_freezes_once_its_start_ends_and_reports_its_collector(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """With an L3 store whose scan runs in the background: a freeze before
    READY (what the start made) and one when the scan ends; stats, metrics and
    status show what is frozen and the collections' pauses per generation."""
    d = daemon_factory(storage='backend = "file"')
    deadline = time.monotonic() + 30
    while (stats := _stats(d.endpoint)).l3_state == "scanning":
        assert time.monotonic() < deadline, "the startup scan did not end"
        time.sleep(0.1)
    c = stats.collector
    assert c is not None and c.freeze
    assert c.freezes >= 2, c  # the start's, and the scan's end
    assert c.frozen_objects > 10_000, c  # the daemon's modules and state at least
    assert len(c.collections) == len(c.pause_s) == len(c.longest_s) == 3
    assert c.collections[2] >= 2 and c.pause_s[2] >= c.longest_s[2] > 0, c  # its own two

    with d.client() as client:
        ns = client.register(**NS)
        toks = np.arange(0, 3 * PAGE_TOKENS, dtype=np.uint32)
        client.store(ns, toks, page_bytes_for(toks))
    metrics = scrape(stats.metrics_endpoint)
    assert metrics[("hicached_gc_frozen_objects", ())] > 10_000
    assert metrics[("hicached_gc_freezes_total", ())] >= 2
    # the settling collections ran with the metrics up: observed as full ones
    assert metrics[("hicached_gc_pause_seconds_count", (("generation", "2"),))] >= 2
    assert metrics[("hicached_gc_pause_seconds_sum", (("generation", "2"),))] > 0
    assert ("hicached_gc_collected_objects_total", (("generation", "0"),)) in metrics
    documented = (ROOT / "docs" / "operations.md").read_text()
    names = {name.removesuffix("_count") for name, _ in metrics if name.startswith("hicached_gc_")}
    for name in names - {"hicached_gc_pause_seconds_bucket", "hicached_gc_pause_seconds_sum"}:
        assert f"`{name}`" in documented, f"{name} is not in docs/operations.md"

    out = _status(d.endpoint)
    line = next(line for line in out.splitlines() if line.startswith("collector:"))
    assert " full collections, " in line and " young, " in line, line
    assert "objects frozen (" in line and "freezes)" in line, line


@pytest.mark.timeout(120)
def test_gc_freeze_false_leaves_the_collector_as_it_was(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(extra="gc_freeze = false")
    c = _stats(d.endpoint).collector
    assert c is not None and not c.freeze
    assert c.freezes == 0 and c.frozen_objects == 0, c
    assert "freezing off (server.gc_freeze), 0 objects frozen" in _status(d.endpoint)


@pytest.mark.timeout(120)
def test_status_of_a_daemon_older_than_1_7_says_it_reports_no_collector(
    daemon_factory: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/old_daemon.py as 1.6: no collector in its stats, which status
    tells apart from a collector that did nothing."""
    monkeypatch.setenv("HICACHED_TEST_DAEMON_MINOR", "6")
    d = daemon_factory(size_mib=8, populate=False, module="tests.old_daemon")
    assert _stats(d.endpoint).collector is None
    assert "collector:  not reported by this daemon (protocol 1.6;" in _status(d.endpoint)


# -- the collector's tuning, in this process ---------------------------------------


def test_a_long_full_collection_freezes_what_it_found_alive(
    unfrozen: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(collector_module, "FREEZE_AFTER_S", 0.0)  # every one is long
    for freeze in (False, True):
        c = Collector(freeze)
        c.start()
        try:
            gc.collect()
        finally:
            c.stop()
        assert c.collections[2] == 1 and c.longest_s[2] > 0
        assert (c.freezes, gc.get_freeze_count() > 0) == ((1, True) if freeze else (0, False))


def test_a_long_young_collection_settles_on_the_loop_next(
    unfrozen: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A young collection proves nothing of the older generations: nothing is
    frozen from its callback; a full collection and a freeze are scheduled,
    once however many follow before it runs."""
    monkeypatch.setattr(collector_module, "FREEZE_AFTER_S", 0.0)
    due: list[Callable[[], None]] = []
    c = Collector(True)
    c.schedule = due.append
    c.start()
    try:
        gc.collect(0)
        gc.collect(1)
        assert len(due) == 1 and c.freezes == 0 and gc.get_freeze_count() == 0
        full = c.collections[2]
        due.pop()()
        assert c.freezes == 1 and gc.get_freeze_count() > 0
        assert c.collections[2] == full + 1  # its own full collection, then the freeze
    finally:
        c.stop()


def test_pages_stored_past_the_bound_settle(unfrozen: None) -> None:
    c = Collector(True)
    c.stored(collector_module.REFREEZE_PAGES - 1)
    assert c.freezes == 0
    c.stored(collector_module.REFREEZE_PAGES)
    assert c.freezes == 1 and gc.get_freeze_count() > 0
    c.stored(collector_module.REFREEZE_PAGES + 1)  # counted from that freeze
    assert c.freezes == 1
    off = Collector(False)
    off.stored(10 * collector_module.REFREEZE_PAGES)
    assert off.freezes == 0


# -- why freezing the cache's objects keeps none for good ---------------------------


def _cache(size_mib: int = 4) -> Cache:
    config = Config(pool=PoolConfig(size_mib=size_mib, slab_mib=1, max_page_bytes=PB))
    return Cache(config, pool_path="/unused", gens=np.zeros(size_mib * 256 + 1, np.uint32))


def _spec(keyed: bool) -> p.NamespaceSpec:
    scheme = {"key_scheme": "vllm-sha256"} if keyed else {}
    return p.NamespaceSpec(
        model="k" if keyed else "t",
        kv_dtype="bf16",
        layout="l",
        page_tokens=1,
        page_bytes=PB,
        **scheme,  # type: ignore[arg-type]
    )


def _churn(cache: Cache, round_: int) -> None:
    """Three clients store and match token and key-addressed sequences past the
    pool's size (evictions), then say goodbye (their namespaces go)."""
    for client in range(3):
        rid = b"c%d" % client
        cache.handle(rid, p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR))
        tok = cache.handle(rid, p.RegisterNamespace(id=2, spec=_spec(False)))
        key = cache.handle(rid, p.RegisterNamespace(id=2, spec=_spec(True)))
        assert isinstance(tok, p.NamespaceOk) and isinstance(key, p.NamespaceOk)
        for s in range(40):
            base = (round_ * 1000 + client * 100 + s) * 64
            toks = pack_tokens(np.arange(base, base + 64, dtype=np.uint32))
            r = cache.handle(rid, p.Reserve(id=3, ns=tok.ns, tokens=toks))
            assert isinstance(r, p.ReserveOk)
            cache.handle(rid, p.Commit(id=4, lease=r.lease))
            m = cache.handle(rid, p.Match(id=5, ns=tok.ns, tokens=toks))
            assert isinstance(m, p.MatchOk) and m.hits == 64
            cache.handle(rid, p.Release(id=6, lease=m.lease))
            keys = [b"%d-%d" % (base, i) for i in range(32)]
            rk = cache.handle(rid, p.ReserveKeys(id=7, ns=key.ns, keys=keys))
            assert isinstance(rk, p.ReserveKeysOk)
            cache.handle(rid, p.Commit(id=8, lease=rk.lease))
            mk = cache.handle(rid, p.MatchKeys(id=9, ns=key.ns, keys=keys, lease=False))
            assert isinstance(mk, p.MatchOk) and mk.hits == 32
        cache.handle(rid, p.Goodbye(id=10))


def test_the_cache_makes_no_cyclic_garbage() -> None:
    """What the cache lets go of (evicted pages' index nodes and entries,
    dropped namespaces, ended sessions and leases) reference counting frees:
    with the collector off, a collection afterwards finds nothing."""
    cache = _cache()
    _churn(cache, 0)  # first use: lazily made tables
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for r in range(1, 4):
            _churn(cache, r)
        evicted = cache.stats().evicted_pages
        found = gc.collect()
    finally:
        if was:
            gc.enable()
    assert evicted > 3 * 40 * 96, evicted  # every round ran past the pool
    assert found == 0, f"{found} objects in reference cycles: a freeze would keep them"


def test_index_entries_evicted_after_a_freeze_are_freed(unfrozen: None) -> None:
    """Frozen index entries leave the permanent generation as eviction frees
    them (reference counting): once unfrozen, the collector finds nothing
    that was let go of and kept."""
    cache = _cache(size_mib=2)  # 512 slots
    rid = b"a"
    cache.handle(rid, p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR))
    key = cache.handle(rid, p.RegisterNamespace(id=2, spec=_spec(True)))
    assert isinstance(key, p.NamespaceOk)

    def store(first: int) -> None:
        keys = [b"%d" % i for i in range(first, first + 256)]
        r = cache.handle(rid, p.ReserveKeys(id=3, ns=key.ns, keys=keys))
        assert isinstance(r, p.ReserveKeysOk) and not r.pool_full
        cache.handle(rid, p.Commit(id=4, lease=r.lease))

    store(0)
    store(256)
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    store(512)  # evicts the 256 pages stored first
    store(768)  # and the next 256
    assert cache.stats().evicted_pages == 512
    assert gc.get_freeze_count() <= frozen - 512, (frozen, gc.get_freeze_count())
    # nothing frozen and let go of since waits for the cyclic collector
    gc.unfreeze()
    assert gc.collect() == 0


@pytest.mark.timeout(180)
def test_a_daemon_under_churn_keeps_no_garbage_frozen(
    daemon_factory: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """tests/gc_probe_daemon.py freezes every 256 pages stored. Clients come and
    go (some vanish without a goodbye and their sessions expire), leases
    expire, errors are replied, prefetches read from L3 and SIGHUP reloads run
    between the freezes; once unfrozen, a collection finds nothing that the
    freezes kept: none of it was in a reference cycle."""
    out = tmp_path / "kept"
    monkeypatch.setenv("HICACHED_TEST_GC_PROBE", str(out))
    d = daemon_factory(
        size_mib=2,  # 512 pages: the churn evicts, and prefetches read L3
        module="tests.gc_probe_daemon",
        extra="session_idle_s = 0.5\n[leases]\nttl_s = 0.3\nsweep_interval_s = 0.05",
        storage='backend = "memory"\n[storage.memory]\nmax_pages = 1024\n',
    )
    assert d.proc is not None
    stored: list[np.ndarray] = []
    errors = leased = 0
    for r in range(12):
        for k in range(4):
            c = d.client()
            ns = c.register(**NS)
            base = (r * 4 + k) * 32 * PAGE_TOKENS
            toks = np.arange(base, base + 32 * PAGE_TOKENS, dtype=np.uint32)
            c.store(ns, toks, page_bytes_for(toks))
            stored.append(toks)
            hit = c.match(ns, toks)
            c.reserve(ns, toks + 10**6)  # never committed: its lease expires
            c.release(hit)
            try:
                c.release(hit)  # an error reply (where the hit had a lease)
            except UnknownLease:
                errors += 1
            leased += hit.hits > 0  # a full pool (pages pinned by leases) may store none
            pf = c.prefetch(ns, stored[max(0, len(stored) - 30)])  # evicted from L2 by now
            time.sleep(0.02)
            c.progress(pf)
            if k % 2:
                c._hello = None  # no goodbye: the session ends after session_idle_s
            c.close()
        if r % 4 == 3:
            d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
    assert errors == leased > 24, (errors, leased)
    frozen = _stats(d.endpoint).collector
    assert frozen is not None and frozen.freezes >= 6, frozen  # 1,536 pages stored
    d.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not out.exists():
        assert time.monotonic() < deadline, "the probe did not answer"
        time.sleep(0.1)
    assert out.read_text() == "0", f"{out.read_text()} objects kept frozen as garbage"
