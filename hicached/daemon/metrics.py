"""Prometheus metrics: the daemon's counters and gauges, plus latency histograms.

The HTTP server (daemon/metrics_http.py, in its own thread, which also decides
who may scrape) answers a scrape with a snapshot that the event loop takes
(``Cache.stats``), so every figure of one scrape comes from one moment; the
scrape waits for it at most ``metrics.scrape_timeout_s``. Histograms are
observed on the loop and copied by the scrape in one step (``LoopHistogram``).
Names and labels: docs/operations.md.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from hicached.config import MetricsConfig
from hicached.daemon.metrics_http import MAX_SCRAPES, Gate, Listener, read_token
from hicached.wire import protocol as p

log = logging.getLogger("hicached.metrics")

# Request handling runs in microseconds; L3 calls in milliseconds to seconds.
_REQUEST_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3)
_L3_BUCKETS = (1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0, 5.0, 30.0)
# A young collection takes microseconds; a full one of a large index 0.1 s.
_GC_BUCKETS = (100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0)


class LoopHistogram(Collector):
    """A labelled histogram with one writer at a time, read by scrapes: the
    event loop, or the garbage collector's callbacks (the interpreter runs one
    collection at a time, whichever thread runs it).

    One observation is a bisection and two list updates, a fraction of what
    the library's histogram costs (a lock, a walk over the buckets): it sits
    on every request's path. A series is one list, its buckets and then its
    sum; a scrape copies it in one step (under the GIL), so what it reports
    is consistent.
    """

    def __init__(self, name: str, doc: str, label: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.label = name, doc, label
        self.bounds = buckets
        self._series: dict[str, list[float]] = {}

    def observe(self, key: str, seconds: float) -> None:
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = [0] * (len(self.bounds) + 1) + [0.0]
        series[bisect.bisect_left(self.bounds, seconds)] += 1  # buckets count le-bound
        series[-1] += seconds

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=[self.label])
        for key, series in sorted(list(self._series.items())):
            snap = list(series)
            total, buckets = 0.0, []
            for bound, count in zip((*self.bounds, float("inf")), snap[:-1], strict=True):
                total += count
                buckets.append((floatToGoString(bound), total))
            family.add_metric([key], buckets, snap[-1])
        yield family


class LoopCounter(Collector):
    """A labelled counter written by the event loop alone, read by scrapes; its
    known labels show from the start, at 0, so a rate over them is defined
    before the first event."""

    def __init__(self, name: str, doc: str, label: str, known: tuple[str, ...]) -> None:
        self.name, self.doc, self.label = name, doc, label
        self._counts = dict.fromkeys(known, 0)

    def add(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        yield _counter(self.name, self.doc, self.label, dict(self._counts))


class _Snapshot(Collector):
    """Turns one DaemonStats, taken on the loop, into metric families."""

    def __init__(self, take: Callable[[], p.DaemonStats], timeout_s: float) -> None:
        self.take = take
        self.timeout_s = timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tenants: Callable[[], list[p.TenantStats]] | None = None

    def snapshot(self) -> tuple[p.DaemonStats, list[p.TenantStats]]:
        loop = self.loop
        if loop is None:
            raise RuntimeError("the daemon is not running")
        result: concurrent.futures.Future[tuple[p.DaemonStats, list[p.TenantStats]]]
        result = concurrent.futures.Future()

        def take() -> None:
            try:
                tenants = self.tenants
                result.set_result((self.take(), tenants() if tenants is not None else []))
            except BaseException as exc:  # handed to the scraping thread
                result.set_exception(exc)

        loop.call_soon_threadsafe(take)
        return result.result(timeout=self.timeout_s)

    def collect(self) -> Iterator[Metric]:
        s, tenants = self.snapshot()
        yield _gauge("hicached_uptime_seconds", "Seconds since the daemon started.", s.uptime_s)
        pool = GaugeMetricFamily("hicached_pool_bytes", "L2 pool bytes by state.", labels=["state"])
        pool.add_metric(["used"], s.pool_used_bytes)
        pool.add_metric(["free"], s.pool_free_bytes)
        yield pool
        yield _gauge("hicached_pool_capacity_bytes", "Size of the L2 pool.", s.pool_bytes)
        pages = GaugeMetricFamily("hicached_pages", "L2 pages by state.", labels=["state"])
        pages.add_metric(["indexed"], s.pages)
        pages.add_metric(["pinned"], s.pinned_pages)
        pages.add_metric(["reserved"], s.reserved_pages)
        pages.add_metric(["quarantined"], s.quarantined_pages)
        pages.add_metric(["writeback"], s.writeback_pages)
        yield pages
        yield _gauge("hicached_namespaces", "Namespaces in use.", s.namespaces)
        yield _gauge("hicached_clients", "Connected client sessions.", s.clients)
        yield _gauge("hicached_leases", "Open leases.", s.leases)
        yield _gauge(
            "hicached_events_pending", "KV events waiting to be published.", s.events_pending
        )
        yield _counter("hicached_requests", "Requests by operation.", "op", s.requests)
        yield _counter("hicached_errors", "Error replies by code.", "code", s.errors)
        yield _counter(
            "hicached_dropped", "Messages and events dropped, by reason.", "reason", s.dropped
        )
        yield _counter(
            "hicached_match_pages",
            "Pages asked for by match requests, and how many L2 and L3 held.",
            "tier",
            s.match_pages,
        )
        yield _total("hicached_evicted_pages", "Pages evicted from L2.", s.evicted_pages)
        yield _gauge(
            "hicached_adopted_pages",
            "Pages adopted at start from the pool of the daemon before this one.",
            s.adopted_pages,
        )
        yield _counter(
            "hicached_adoption_dropped",
            "Pages of the pool before a restart not adopted, by reason.",
            "reason",
            s.adoption_dropped,
        )
        yield _total(
            "hicached_reclaimed_slabs",
            "Pool slabs one page size gave up for another.",
            s.reclaimed_slabs,
        )
        yield _total("hicached_expired_leases", "Leases that expired.", s.expired_leases)
        yield _total(
            "hicached_committed_pages",
            "Pages clients committed into L2 (prefetched pages aside).",
            s.committed_pages,
        )
        gather = GaugeMetricFamily(
            "hicached_gather_clients",
            "Client sessions by the scattered-copy kernels their process reported, each "
            "way, and how it picked them (measured, forced by HICACHED_GATHER, no_torch).",
            labels=["read", "write", "how"],
        )
        picks: dict[tuple[str, str, str], int] = {}
        for c in s.gather_clients:  # labels of checked names only: a few series at most
            key = (c.read, c.write, c.how)
            picks[key] = picks.get(key, 0) + 1
        for key, n in sorted(picks.items()):
            gather.add_metric(list(key), n)
        yield gather
        if s.l3_backend:
            up = GaugeMetricFamily(
                "hicached_l3_up",
                "1 while the L3 backend serves, 0 while marked down.",
                labels=["backend"],
            )
            up.add_metric([s.l3_backend], 0 if s.l3_state == "down" else 1)  # or scanning
            yield up
            yield _gauge(
                "hicached_l3_pages_known", "Pages the index knows L3 holds.", s.l3_pages_known
            )
            yield _gauge(
                "hicached_l3_undersized",
                "1 while L3 lets go of pages sooner than L2 does (it keeps the pages "
                "written last; none is written again).",
                int(s.l3_undersized),
            )
            yield _gauge(
                "hicached_l3_write_amplification",
                "Pages written to L3, rewrites included, per page committed into L2.",
                s.l3_write_amplification,
            )
            gauges = {k: v for k, v in s.l3.items() if k in _L3_GAUGES}
            counters = {k: v for k, v in s.l3.items() if k not in _L3_GAUGES}
            yield _counter("hicached_l3", "L3 pages and calls by outcome.", "what", counters)
            state = GaugeMetricFamily(
                "hicached_l3_state", "L3 queue and store sizes.", labels=["what"]
            )
            for what, value in sorted(gauges.items()):
                state.add_metric([what], value)
            yield state
        if s.collector is not None:
            yield from _collector_families(s.collector)
        if tenants:
            yield from _tenant_families(tenants)


def _collector_families(c: p.CollectorStats) -> Iterator[Metric]:
    """The garbage collector's figures beside its pause histogram (daemon/collector.py)."""
    yield _gauge(
        "hicached_gc_frozen_objects",
        "Objects frozen out of the garbage collector's reach (server.gc_freeze).",
        c.frozen_objects,
    )
    yield _total("hicached_gc_freezes", "Times long-lived objects were frozen.", c.freezes)
    yield _counter(
        "hicached_gc_collected_objects",
        "Unreachable objects the garbage collector found, by generation.",
        "generation",
        {str(g): n for g, n in enumerate(c.collected)},
    )


def _tenant_families(tenants: list[p.TenantStats]) -> Iterator[Metric]:
    """Per-tenant figures (docs/operations.md, Tenants)."""
    pages = GaugeMetricFamily("hicached_tenant_pages", "L2 pages by tenant.", labels=["tenant"])
    slots = GaugeMetricFamily(
        "hicached_tenant_slots",
        "L2 slots charged to each tenant: its pages, slots its leases fill, slots on "
        "their way back.",
        labels=["tenant"],
    )
    size = GaugeMetricFamily(
        "hicached_tenant_bytes", "Bytes of the slots charged to each tenant.", labels=["tenant"]
    )
    quota = GaugeMetricFamily(
        "hicached_tenant_quota",
        "Each tenant's L2 quota (0 = none), in pages and in bytes.",
        labels=["tenant", "unit"],
    )
    matched = CounterMetricFamily(
        "hicached_tenant_match_pages",
        "Pages each tenant's matches asked for, and how many L2 held.",
        labels=["tenant", "tier"],
    )
    evicted = CounterMetricFamily(
        "hicached_tenant_evicted_pages",
        "Each tenant's pages evicted from L2: to keep it within its quota, or otherwise.",
        labels=["tenant", "cause"],
    )
    held = GaugeMetricFamily(
        "hicached_tenant_held",
        "What each tenant's clients hold of the bounds every client shares: client "
        "sessions, open leases, live namespaces (with [tenants]).",
        labels=["tenant", "of"],
    )
    share = GaugeMetricFamily(
        "hicached_tenant_share",
        "Each tenant's bound on client sessions, open leases and live namespaces: "
        "tenants.NAME.max_clients and the like, or its equal share (with [tenants]).",
        labels=["tenant", "of"],
    )
    for t in tenants:
        if t.max_clients:  # a tenant of the config: it has a share of the shared bounds
            for of, n, bound in (
                ("clients", t.clients, t.max_clients),
                ("leases", t.leases, t.max_leases),
                ("namespaces", t.namespaces, t.max_namespaces),
            ):
                held.add_metric([t.tenant, of], n)
                share.add_metric([t.tenant, of], bound)
        pages.add_metric([t.tenant], t.pages)
        slots.add_metric([t.tenant], t.slots)
        size.add_metric([t.tenant], t.bytes)
        quota.add_metric([t.tenant, "pages"], t.max_slots)
        quota.add_metric([t.tenant, "bytes"], t.max_bytes)
        matched.add_metric([t.tenant, "asked"], t.asked)
        matched.add_metric([t.tenant, "l2"], t.hits)
        evicted.add_metric([t.tenant, "quota"], t.quota_evicted)
        evicted.add_metric([t.tenant, "other"], t.evicted - t.quota_evicted)
    yield from (pages, slots, size, quota, matched, evicted, held, share)


_GENERATION = ("0", "1", "2")  # label values, made once: observed on every collection

# L3 figures that go up and down; every other L3 figure only grows.
_L3_GAUGES = {
    "backfill_pending",
    "queued",
    "queued_pages",
    "in_flight_pages",
    "hung_calls",
    "scanning",
    "index_complete",
    "lookups_in_flight",
    "store_pages",
    "store_bytes_used",
    "store_readers_alive",  # the file store's reader processes (read_processes)
}


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _total(name: str, doc: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


class _Refused(Collector):
    """Scrapes the endpoint refused (no token or a wrong one), counted by its
    request threads, and connections it closed unserved while MAX_SCRAPES
    were open: probes by local users show here."""

    def __init__(self, gate: Gate, listener: Listener) -> None:
        self.gate = gate
        self.listener = listener

    def collect(self) -> Iterator[Metric]:
        yield _total(
            "hicached_metrics_refused",
            "Scrapes refused for a missing or wrong bearer token (401).",
            self.gate.refused,
        )
        yield _total(
            "hicached_metrics_turned_away",
            f"Connections to the metrics endpoint closed unserved, {MAX_SCRAPES} being "
            "open: the one that had waited longest for its request, or a newcomer "
            "where all were being answered.",
            self.listener.turned_away,
        )


class Metrics:
    """The daemon's registry and its HTTP endpoint."""

    def __init__(
        self, config: MetricsConfig, take: Callable[[], p.DaemonStats], *, tenants: bool = False
    ) -> None:
        """``tenants``: the daemon runs with [tenants], so scrapes must authenticate."""
        self.config = config
        self.registry = CollectorRegistry(auto_describe=False)
        self._snapshot = _Snapshot(take, config.scrape_timeout_s)
        self.registry.register(self._snapshot)
        self.request_seconds = LoopHistogram(
            "hicached_request_seconds",
            "Time to handle one request on the daemon, by operation.",
            "op",
            _REQUEST_BUCKETS,
        )
        self.l3_seconds = LoopHistogram(
            "hicached_l3_call_seconds",
            "Time of one L3 backend call attempt, by operation.",
            "op",
            _L3_BUCKETS,
        )
        self.gc_seconds = LoopHistogram(
            "hicached_gc_pause_seconds",
            "Time the interpreter's garbage collector held the daemon, per collection, "
            "by generation (2: full collections).",
            "generation",
            _GC_BUCKETS,
        )
        self.reloads = LoopCounter(
            "hicached_reloads",
            "Config reloads (SIGHUP) by result: applied, invalid (the file did not "
            "parse or validate; nothing changed), timeout (the file was not read within "
            "server.reload_timeout_s; nothing changed), failed (an unexpected error, "
            "logged with its traceback).",
            "result",
            ("applied", "invalid", "timeout", "failed"),
        )
        self.registry.register(self.request_seconds)
        self.registry.register(self.l3_seconds)
        self.registry.register(self.gc_seconds)
        self.registry.register(self.reloads)
        # with tenants, a scrape without a credential is refused (daemon/metrics_http.py)
        self.gate = Gate(
            make_wsgi_app(self.registry), None, locked=tenants and not config.authenticated
        )
        self._listener = Listener(config, self.gate)
        self.registry.register(_Refused(self.gate, self._listener))
        self.endpoint = ""

    @property
    def tenants(self) -> Callable[[], list[p.TenantStats]] | None:
        """Where a scrape takes per-tenant figures from (on the loop, with the rest)."""
        return self._snapshot.tenants

    @tenants.setter
    def tenants(self, take: Callable[[], list[p.TenantStats]] | None) -> None:
        self._snapshot.tenants = take

    def observe_request(self, op: str, seconds: float) -> None:
        """Time of one handled request."""
        self.request_seconds.observe(op, seconds)

    def observe_l3(self, op: str, seconds: float) -> None:
        """Time of one L3 backend call attempt."""
        self.l3_seconds.observe(op, seconds)

    def observe_gc(self, generation: int, seconds: float) -> None:
        """Time of one garbage collection (from gc.callbacks, daemon/collector.py:
        one collection at a time, whichever thread ran it)."""
        self.gc_seconds.observe(_GENERATION[generation], seconds)

    def count_reload(self, result: str) -> None:
        """One reload's result (applied, invalid, timeout, failed)."""
        self.reloads.add(result)

    def start(self) -> None:
        """Read the token, listen; the scrapes ask the running loop for snapshots."""
        c = self.config
        if c.token_file:
            self.gate.use(read_token(c.token_file))
        elif self.gate.locked:
            log.warning(
                "metrics: with [tenants] every scrape is refused (401) until scrapers "
                "authenticate: the metrics name every tenant, and %s:%d is open to every "
                "local user; set metrics.token_file (or client_ca), or enabled = false "
                "(docs/operations.md, Metrics)",
                c.host,
                c.port,
            )
        self._snapshot.loop = asyncio.get_running_loop()
        self._listener.start()
        self.endpoint = self._listener.endpoint
        log.info(
            "metrics on %s%s",
            self.endpoint,
            " (bearer token required)" if c.token_file else "",
        )

    def use_token(self, token: bytes) -> bool:
        """Take a token read again at a reload; True when it changed."""
        return self.gate.use(token)

    def stop(self) -> None:
        self._snapshot.loop = None
        self._listener.stop()
