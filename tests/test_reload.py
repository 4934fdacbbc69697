"""SIGHUP: a live daemon takes what may change at run time from its config
file again (quotas, limits, policies, the log level), refuses the rest with a
log line, and drops no session, lease or page."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from hicached.config import Config, parse_config
from hicached.config import leaves as _leaves
from hicached.daemon.reload import RELOADABLE, reload_plan
from hicached.errors import HicachedError
from hicached.testing import scrape
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for


@pytest.mark.parametrize("name", ["alpha", "al.pha"])
def test_the_plan_takes_what_may_change_and_refuses_the_rest(name: str) -> None:
    """A tenant's name may hold dots: its quotas reload all the same (they were
    refused as a change of tenant "al")."""
    running = parse_config(
        f'[tenants."{name}"]\nuids = [1]\nmax_pages = 64\n[log]\nlevel = "info"\n'
        "[pool]\nsize_mib = 64\n"
    )
    wanted = parse_config(
        f'[tenants."{name}"]\nuids = [2]'
        "\nmax_pages = 256\nmax_mib = 8\n"
        '[tenants.beta]\nuids = [3]\n[log]\nlevel = "debug"\n[pool]\nsize_mib = 128\n'
        'max_namespaces = 9\n[storage]\nwrite_policy = "write_back"\n[server]\nhwm = 5\n'
    )
    config, applied, refused = reload_plan(running, wanted)
    assert applied == {
        "log.level": "debug",
        "pool.max_namespaces": 9,
        "storage.write_policy": "write_back",
        f"tenants.{name}.max_mib": 8,
        f"tenants.{name}.max_pages": 256,
    }
    assert refused == ["pool.size_mib", "server.hwm", f"tenants.{name}.uids", "tenants.beta"]
    assert config.log.level == "debug" and config.tenants[name].max_pages == 256
    assert config.pool.size_mib == 64 and config.server.hwm == running.server.hwm
    assert config.tenants[name].uids == [1] and set(config.tenants) == {name}
    assert reload_plan(running, running)[1:] == ({}, [])


def test_every_reloadable_key_exists() -> None:
    keys = set(_leaves(msgspec.to_builtins(Config())))
    assert keys >= RELOADABLE


def test_keys_that_belong_together_stay_as_they_run() -> None:
    running = parse_config("[pool]\nmax_page_bytes = 65536\nslab_mib = 1\nsize_mib = 8\n")
    wanted = parse_config("[pool]\nmax_page_bytes = 4194304\nslab_mib = 4\nsize_mib = 8\n")
    config, applied, refused = reload_plan(running, wanted)  # neither may change
    assert config == running and not applied
    assert refused == ["pool.max_page_bytes", "pool.slab_mib"]


def test_a_mix_that_fails_names_the_running_values_it_kept() -> None:
    """A file valid alone whose reloadable values do not fit the running values
    of the keys only a restart changes: the error names those, where it said
    ttl_s (30.0) of a file that says 100 and no more."""
    wanted = parse_config("[leases]\nttl_s = 100.0\nsweep_interval_s = 50.0\n")
    with pytest.raises(HicachedError) as info:
        reload_plan(parse_config(""), wanted)
    message = str(info.value)
    assert message.startswith("leases.sweep_interval_s: "), message
    assert "(with the running value of leases.ttl_s: only a restart changes it)" in message


def _wait_for(daemon: Daemon, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = daemon.log.read_text()
        if text in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the daemon's log:\n{daemon.log.read_text()}")


def _sighup(daemon: Daemon, config: str) -> str:
    """Write ``config`` as the daemon's file, send SIGHUP, and return the log
    lines of the reload (its last line says what it applied, or why nothing)."""
    assert daemon.proc is not None
    before = len(daemon.log.read_text())
    daemon.config.write_text(config)
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = daemon.log.read_text()[before:]
        if "reload of" in lines or "keeps running" in lines:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"no reload in the daemon's log:\n{daemon.log.read_text()}")


def _seq(i: int) -> np.ndarray:
    return np.arange(i * 1000, i * 1000 + 4 * PAGE_TOKENS, dtype=np.uint32)  # 4 pages


def test_sighup_changes_a_quota_and_the_log_level_without_losing_a_page(
    daemon_factory: Callable[..., Daemon],
) -> None:
    quota = f"[tenants.alpha]\nuids = [{os.getuid()}]\nmax_pages = {{pages}}\n"
    d = daemon_factory(tail=quota.format(pages=64))
    base = d.config.read_text()
    with d.client() as c:
        ns = c.register(**NS)
        for i in range(17):  # 68 pages: past the quota, the oldest sequence goes
            assert c.store(ns, _seq(i), page_bytes_for(_seq(i))).published == 4
        before = c.stats()
        assert (before.pages, before.evicted_pages) == (64, 4)
        assert c.match(ns, _seq(0), lease=False).hits == 0
        held = c.match(ns, _seq(1))  # a lease across the reload
        assert held.hits == 4
        assert "DEBUG" not in d.log.read_text()

        raised = base.replace("max_pages = 64", "max_pages = 256").replace(
            "size_mib = 16", "size_mib = 32"
        )
        lines = _sighup(d, raised + '[log]\nlevel = "debug"\n')
        assert "log.level = 'debug'" in lines and "tenants.alpha.max_pages = 256" in lines
        assert "pool.size_mib changed" in lines and "only a restart applies it" in lines

        after = c.stats()  # the same session: no new hello
        assert after.instance == before.instance
        assert after.requests.get("hello") == before.requests.get("hello")
        assert after.pages == 64 and after.evicted_pages == 4 and after.pool_bytes == 16 << 20
        assert np.array_equal(c.read_pages(held), page_bytes_for(_seq(1)))  # still leased
        for i in range(1, 17):  # not a page lost
            assert c.match(ns, _seq(i), lease=False).hits == 4, i
        for i in range(17, 57):  # 160 pages more fit the new quota: nothing evicted
            assert c.store(ns, _seq(i), page_bytes_for(_seq(i))).published == 4
        assert (c.stats().pages, c.stats().evicted_pages) == (224, 4)
        with d.client():  # a new connection: the handler logs it at debug level now
            pass
        _wait_for(d, "DEBUG hicached.auth: peer")

        # down to 100: the least recently used pages go, but not the leased ones
        lowered = base.replace("max_pages = 64", "max_pages = 100") + '[log]\nlevel = "debug"\n'
        lines = _sighup(d, lowered)
        assert "tenant alpha is past its new quota: 124 of its pages evicted" in lines
        assert "changed" not in lines  # nothing refused
        stats = c.stats()
        assert (stats.pages, stats.evicted_pages) == (100, 128)
        assert c.match(ns, _seq(1), lease=False).hits == 4  # the oldest, but leased
        for i in (2, 16, 32):
            assert c.match(ns, _seq(i), lease=False).hits == 0, i
        for i in (33, 56):
            assert c.match(ns, _seq(i), lease=False).hits == 4, i
        c.release(held)


def test_a_bad_config_on_sighup_changes_nothing(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory()
    good = d.config.read_text()
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, _seq(1), page_bytes_for(_seq(1)))
        lines = _sighup(d, good + "[pool\n")
        assert "reload:" in lines and "not valid TOML" in lines and "keeps running" in lines
        lines = _sighup(d, good + "[storage.extra]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
        assert "values nested deeper" in lines and "keeps running" in lines
        assert "Traceback" not in lines
        lines = _sighup(d, good.replace("size_mib = 16", "size_mib = 0"))
        assert "pool.size_mib" in lines and "keeps running" in lines
        assert c.match(ns, _seq(1), lease=False).hits == 4
        assert d.proc is not None and d.proc.poll() is None
        lines = _sighup(d, good)
        assert "nothing to change" in lines


def test_a_reload_that_fails_unexpectedly_is_logged_counted_and_the_next_one_applies(
    daemon_factory: Callable[..., Daemon],
) -> None:
    # Fault injection (tests/reload_fault_daemon.py): a reload whose file sets
    # log.level = "error" fails in its plan with an error that is not a
    # ConfigError, as a bug in a reload step would.
    d = daemon_factory(module="tests.reload_fault_daemon")
    good = d.config.read_text()
    failing = '[log]\nlevel = "error"\n'
    with d.client() as c:
        url = c.stats().metrics_endpoint
        before = scrape(url)

        def reloads(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], result: str) -> float:
            return m[("hicached_reloads_total", (("result", result),))]

        assert [reloads(before, r) for r in ("applied", "invalid", "failed")] == [0, 0, 0]
        lines = _sighup(d, good + failing)
        assert "failed; the daemon keeps running" in lines
        assert "Traceback" in lines and "fault injected" in lines
        assert reloads(scrape(url), "failed") == 1
        assert d.proc is not None and d.proc.poll() is None

        ns = c.register(**NS)
        assert c.store(ns, _seq(1), page_bytes_for(_seq(1))).published == 4  # in use
        fewer = good.replace("[pool]\n", "[pool]\nmax_namespaces = 1\n")
        lines = _sighup(d, fewer)  # taken as ever
        assert "pool.max_namespaces = 1" in lines
        with pytest.raises(HicachedError, match="max_namespaces"):
            c.register(**{**NS, "model": "test/one-too-many"})
        lines = _sighup(d, fewer + "[pool\n")
        assert "not valid TOML" in lines
        after = scrape(url)
        assert [reloads(after, r) for r in ("applied", "invalid", "failed")] == [1, 1, 1]


def test_a_config_path_that_became_a_fifo_is_refused_and_the_next_reload_applies(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Reading a FIFO blocks until someone writes to it: a reload would hold a
    thread for good (and a stop waits for it). The reload is refused at once
    with a clear line; once the path is a file again, the next reload applies."""
    d = daemon_factory()
    good = d.config.read_text()
    assert d.proc is not None
    d.config.unlink()
    os.mkfifo(d.config)
    before = len(d.log.read_text())
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "not a regular file" not in d.log.read_text()[before:]:
        assert time.monotonic() < deadline, d.log.read_text()
        time.sleep(0.05)
    d.config.unlink()
    lines = _sighup(d, good.replace("[pool]\n", "[pool]\nmax_namespaces = 3\n"))
    assert "pool.max_namespaces = 3" in lines
    assert d.stop() == 0


def test_a_reload_whose_read_hangs_times_out_while_the_daemon_serves(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Fault injection (tests/reload_fault_daemon.py): while ``<config>.hang``
    exists, reading the config blocks, as on a hung NFS mount. The daemon
    answers requests meanwhile; the reload fails after server.reload_timeout_s,
    counted as a timeout, and keeps the config as it was; a reload while that
    read still hangs fails at once; a stop does not wait for the stuck read."""
    d = daemon_factory(module="tests.reload_fault_daemon", extra="reload_timeout_s = 1.0\n")
    good = d.config.read_text()
    hang = d.config.with_name(d.config.name + ".hang")
    hang.touch()
    with d.client() as c:
        url = c.stats().metrics_endpoint
        ns = c.register(**NS)
        assert d.proc is not None
        before = len(d.log.read_text())
        d.config.write_text(good.replace("[pool]\n", "[pool]\nmax_namespaces = 1\n"))
        d.proc.send_signal(signal.SIGHUP)
        c.store(ns, _seq(1), page_bytes_for(_seq(1)))  # served while the read hangs
        assert c.match(ns, _seq(1), lease=False).hits == 4
        deadline = time.monotonic() + 10
        while "was not read within" not in d.log.read_text()[before:]:
            assert time.monotonic() < deadline, d.log.read_text()[before:]
            assert c.stats().pages == 4  # and all along
            time.sleep(0.05)
        assert "server.reload_timeout_s" in d.log.read_text()[before:]
        c.register(**{**NS, "model": "test/second"})  # max_namespaces as it was
        lines = _sighup(d, d.config.read_text())  # the first read still hangs
        assert "still not returned" in lines
        assert scrape(url)[("hicached_reloads_total", (("result", "timeout"),))] == 2
    assert d.stop() == 0  # with the read still stuck on its thread
    hang.unlink()
