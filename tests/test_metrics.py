"""Prometheus metrics of a real daemon, scraped over HTTP."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import trustme

from hicached.config import parse_config
from hicached.errors import ConfigError
from hicached.testing import scrape
from tests.l3util import FILE_STORE, evict_everything, settle_writes, storage
from tests.support import (
    NS,
    PAGE_TOKENS,
    Daemon,
    free_tcp_port,
    metrics_token,
    page_bytes_for,
)

ROOT = Path(__file__).resolve().parents[1]


def seq(start: int, pages: int) -> np.ndarray:
    return np.arange(start, start + pages * PAGE_TOKENS, dtype=np.uint32)


def test_scrape_reports_requests_hits_per_tier_pool_and_l3(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(size_mib=1, slab_mib=1, storage=storage("file"), tail=FILE_STORE)
    with d.client() as c:
        ns = c.register(**NS)
        url = c.stats().metrics_endpoint
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        stored = seq(10**6, 6)
        c.store(ns, stored, page_bytes_for(stored))
        settle_writes(c)
        for _ in range(3):  # 6 L2 hits each
            c.release(c.match(ns, stored))
        c.release(c.match(ns, seq(5 * 10**6, 4)))  # 4 misses
        evict_everything(c, ns)
        c.match(ns, stored, lease=False)  # now 6 pages known to L3 only
        stats = c.stats()
        m = scrape(url)

    def value(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    assert value("hicached_match_pages_total", tier="asked") == 3 * 6 + 4 + 6
    assert value("hicached_match_pages_total", tier="l2") == 3 * 6
    assert value("hicached_match_pages_total", tier="l3") == 6
    assert value("hicached_requests_total", op="match") == stats.requests["match"]
    # the scrape's own stats request is not counted in the histogram before it
    assert value("hicached_request_seconds_count", op="match") == 5
    assert value("hicached_request_seconds_count", op="commit") == stats.requests["commit"]
    assert value("hicached_pool_capacity_bytes") == stats.pool_bytes
    assert value("hicached_pool_bytes", state="used") == stats.pool_used_bytes
    assert value("hicached_pages", state="indexed") == stats.pages
    assert value("hicached_evicted_pages_total") == stats.evicted_pages > 0
    assert value("hicached_l3_up", backend="file") == 1
    assert value("hicached_l3_total", what="pages_written") == stats.l3["pages_written"] > 0
    assert value("hicached_l3_state", what="queued") == 0
    assert value("hicached_l3_call_seconds_count", op="put") >= 1


def test_metrics_can_be_off_and_status_says_where_they_are(
    daemon_factory: Callable[..., Daemon],
) -> None:
    off = daemon_factory(metrics="enabled = false")
    with off.client() as c:
        assert c.stats().metrics_endpoint == ""
    on = daemon_factory()
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "status", "--endpoint", on.endpoint],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    with on.client() as c:
        url = c.stats().metrics_endpoint
    assert f"metrics:    {url}" in out


def test_a_taken_port_fails_startup_with_the_key_named(
    daemon_factory: Callable[..., Daemon],
) -> None:
    first = daemon_factory()
    with first.client() as c:
        port = int(c.stats().metrics_endpoint.rsplit(":", 1)[1].split("/")[0])
    second = Daemon(metrics=f"port = {port}")
    with pytest.raises(RuntimeError, match=r"metrics\.port: cannot listen"):
        second.start(timeout=20)
    second.cleanup()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('host = "0.0.0.0"', "off loopback only over HTTPS to scrapers that authenticate"),
        ('host = "example.org"', "give an IP address or localhost"),
        ('tls_cert = "/c.pem"', "tls_cert and tls_key go together"),
        ('client_ca = "/ca.pem"', "client_ca needs tls_cert"),
        ("port = 70000", "metrics.port"),
        ("scrape_timeout_s = 0", "metrics.scrape_timeout_s"),
    ],
)
def test_bad_metrics_config_is_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(f"[metrics]\n{text}\n")


def test_off_loopback_is_accepted_with_client_certificates() -> None:
    config = parse_config(
        '[metrics]\nhost = "0.0.0.0"\ntls_cert = "/c.pem"\ntls_key = "/k.pem"\n'
        f'client_ca = "/ca.pem"\nport = {free_tcp_port()}\n'
    )
    assert config.metrics.client_ca == "/ca.pem"


def test_with_client_ca_only_scrapers_holding_a_certificate_get_metrics(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    ca, stranger = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    server.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    d = daemon_factory(
        metrics=f'port = 0\ntls_cert = "{tmp_path / "server.pem"}"\n'
        f'tls_key = "{tmp_path / "server.key"}"\nclient_ca = "{tmp_path / "ca.pem"}"'
    )
    with d.client() as c:
        url = c.stats().metrics_endpoint
    assert url.startswith("https://127.0.0.1:")

    def context(cert_from: trustme.CA | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        if cert_from is not None:
            cert_from.issue_cert("scraper.example").configure_cert(ctx)
        return ctx

    assert ("hicached_clients", ()) in scrape(url, context=context(ca))
    for who in (None, stranger):  # no certificate, or one the daemon does not trust
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            scrape(url, context=context(who))
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # and no plain HTTP
        scrape(url.replace("https://", "http://"))
    assert ("hicached_clients", ()) in scrape(url, context=context(ca))  # still serving


def test_loop_histogram_reports_cumulative_buckets() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from hicached.metrics import LoopHistogram

    histogram = LoopHistogram("t_seconds", "A test.", "op", (0.001, 0.01))
    for seconds in (0.0005, 0.001, 0.005, 0.5):
        histogram.observe("match", seconds)
    histogram.observe("commit", 0.02)
    registry = CollectorRegistry()
    registry.register(histogram)
    text = generate_latest(registry).decode()
    assert 't_seconds_bucket{le="0.001",op="match"} 2.0' in text  # le: 0.001 counts
    assert 't_seconds_bucket{le="0.01",op="match"} 3.0' in text
    assert 't_seconds_bucket{le="+Inf",op="match"} 4.0' in text
    assert 't_seconds_count{op="match"} 4.0' in text
    assert 't_seconds_sum{op="match"} 0.5065' in text
    assert 't_seconds_bucket{le="0.01",op="commit"} 0.0' in text


def test_the_file_stores_live_readers_are_a_gauge(daemon_factory: Callable[..., Daemon]) -> None:
    """Readers alive goes down when one dies: as a counter, Prometheus would take
    the drop for a reset (rate() and increase() turn it into a rise)."""
    d = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("file"), tail=FILE_STORE + "read_processes = 1\n"
    )
    with d.client() as c:
        endpoint = c.stats().metrics_endpoint
    metrics = scrape(endpoint)
    alive = (("what", "store_readers_alive"),)
    assert metrics[("hicached_l3_state", alive)] == 1
    assert ("hicached_l3_total", alive) not in metrics
    assert ("hicached_l3_total", (("what", "store_readers_lost"),)) in metrics


def _documented_metrics() -> dict[str, tuple[str, set[str]]]:
    """docs/operations.md's metric tables: name -> (type, label names)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for line in (ROOT / "docs" / "operations.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`hicached_"):
            continue
        labels = set(re.findall(r"`([a-z_]+)`", cells[2]))
        for name in re.findall(r"`(hicached_[a-z0-9_]+)`", cells[0]):
            out[name] = (cells[1], labels)
    return out


def test_docs_list_every_metric_with_its_type_and_labels(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A daemon with everything on that adds metrics (an L3 store, KV events,
    tenants) exports exactly the metrics docs/operations.md lists, of the type
    and with the labels it says."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics, token = metrics_token(tmp_path)  # with tenants, scrapes need it
    d = daemon_factory(
        size_mib=8,
        slab_mib=1,
        metrics=metrics,
        storage=storage("file"),
        tail=FILE_STORE
        + f'[events]\nendpoint = "ipc://{tmp_path}/events.sock"\n'
        + f'replay_endpoint = "ipc://{tmp_path}/replay.sock"\n'
        + f"[tenants.alpha]\nuids = [{os.getuid()}]\nmax_pages = 100\n",
    )
    with d.client() as c:
        ns = c.register(**NS)
        stored = seq(10**6, 4)
        c.store(ns, stored, page_bytes_for(stored))
        settle_writes(c)
        c.release(c.match(ns, stored))
        url = c.stats().metrics_endpoint
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    exported: dict[str, tuple[str, set[str] | None]] = {}
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for sample in family.samples for k in sample.labels if k != "le"}
        exported[name] = (family.type, labels if family.samples else None)
    documented = _documented_metrics()
    assert sorted(set(exported) - set(documented)) == [], "exported, not in docs/operations.md"
    assert sorted(set(documented) - set(exported)) == [], "in docs/operations.md, not exported"
    for name, (kind, labels) in exported.items():
        assert documented[name][0] == kind, (name, documented[name][0], kind)
        if labels is not None:  # a family without samples shows no labels
            assert documented[name][1] == labels, (name, documented[name][1], labels)
