"""The hicached command and the daemon's lifecycle, as an operator sees them."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hicached.arena import arena_path
from hicached.config import Config, load_config
from hicached.daemon.journal import journal_path
from hicached.errors import ResourceExhausted
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for

ROOT = Path(__file__).resolve().parents[1]
FAULTS_ALLOWED = {"HICACHED_ALLOW_FAULTS": "1"}  # the faulty backend's configs (fault injection)


def hicached(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicached", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_status_human_and_json(daemon: Daemon) -> None:
    with daemon.client() as c:
        ns = c.register(**NS)
        toks = np.arange(0, 3 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
    out = hicached("status", "--endpoint", daemon.endpoint)
    assert out.returncode == 0, out.stderr
    assert "pool:" in out.stdout and "3 indexed" in out.stdout and "namespaces: 1" in out.stdout
    js = hicached("status", "--json", env={"HICACHED_ENDPOINT": daemon.endpoint})
    data = json.loads(js.stdout)
    assert data["pages"] == 3 and data["pool_used_bytes"] == 3 * NS["page_bytes"]  # type: ignore[operator]
    assert data["requests"]["commit"] == 1 and data["pool_bytes"] == 16 << 20


def test_status_answers_while_every_client_slot_holds_leases(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Two clients (the limit) hold leases, as crashed engines' would until their
    TTL: a third client is refused, but `hicached status` takes no slot."""
    d = daemon_factory(extra="max_clients = 2\n")
    holders = [d.client(name=f"engine-{i}") for i in range(2)]
    try:
        for i, c in enumerate(holders):
            ns = c.register(**NS)
            c.reserve(ns, np.arange(i * 1000, i * 1000 + 2 * PAGE_TOKENS, dtype=np.uint32))
        with pytest.raises(ResourceExhausted), d.client():
            pass
        out = hicached("status", "--json", "--endpoint", d.endpoint, "--timeout", "2")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["leases"] == 2
    finally:
        for c in holders:
            c.close()


def test_status_without_a_daemon_says_so(tmp_path: Path) -> None:
    out = hicached("status", "--endpoint", f"ipc://{tmp_path}/none.sock", "--timeout", "0.3")
    assert out.returncode == 2
    assert "is it running?" in out.stderr


def test_a_sigterm_while_the_store_opens_ends_the_start(tmp_path: Path) -> None:
    """A start waiting on its store (here one that takes a minute to open:
    fault injection) ends at SIGTERM: it waited for the store, and systemd
    killed the daemon at TimeoutStopSec. Exit 0, the socket and the lock
    released: a daemon starts at once on the same runtime directory."""
    tmp_path.chmod(0o700)
    config = tmp_path / "c.toml"
    config.write_text(
        f'[server]\nendpoint = "ipc://{tmp_path}/hicached.sock"\n'
        f'runtime_dir = "{tmp_path / "run"}"\n'
        f"[pool]\nsize_mib = 8\nslab_mib = 4\npopulate = false\nadopt = false\n"
        f'shm_dir = "{tmp_path}"\n[metrics]\nenabled = false\n'
        f'[storage]\nbackend = "faulty"\n[storage.extra]\ninner = "memory"\nopen_delay_s = 60.0\n'
    )
    serve = [sys.executable, "-m", "hicached", "serve", "--config", str(config)]
    env = {**os.environ, **FAULTS_ALLOWED}

    def stopped(after: str) -> tuple[int, str]:
        """Exit status and log of a daemon sent SIGTERM once it logs ``after``."""
        with subprocess.Popen(serve, env=env, stderr=subprocess.PIPE, text=True) as proc:
            try:
                assert proc.stderr is not None
                for line in proc.stderr:
                    if after in line:
                        break
                time.sleep(0.5)
                proc.send_signal(signal.SIGTERM)
                return proc.wait(20), proc.stderr.read()
            finally:
                if proc.poll() is None:
                    proc.kill()

    code, log = stopped("pool:")  # past the pool: the store opens
    assert code == 0 and "stopped before the start ended" in log, log
    assert "Traceback" not in log, log
    assert not (tmp_path / "hicached.sock").exists()
    config.write_text(config.read_text().replace("open_delay_s = 60.0", "open_delay_s = 0.0"))
    code, log = stopped("listening on")
    assert code == 0 and "stopped before the start ended" not in log, log


def test_serve_on_defaults_and_stop_cleanly_on_sigterm(tmp_path: Path) -> None:
    """No config file at all: defaults, a private runtime dir, a clean ordered exit."""
    runtime_base = Path("/tmp") / f"hc-xdg-{os.getpid()}"
    runtime_base.mkdir(mode=0o700, exist_ok=True)
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime_base),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "HICACHED_ENDPOINT": f"ipc://{runtime_base}/hicached/hicached.sock",
    }
    env.pop("RUNTIME_DIRECTORY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicached", "serve"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            status = subprocess.run(
                [sys.executable, "-m", "hicached", "status", "--json", "--timeout", "0.5"],
                env=env,
                capture_output=True,
                text=True,
            )
            if status.returncode == 0 or proc.poll() is not None:
                break
            time.sleep(0.2)
        if proc.poll() is not None:  # it stopped (the default metrics port taken?): say why
            assert proc.stderr is not None
            pytest.fail(f"the daemon exited with {proc.returncode}: {proc.stderr.read()}")
        assert status is not None and status.returncode == 0, status.stderr if status else ""
        assert json.loads(status.stdout)["pool_bytes"] == 1024 << 20
        runtime = runtime_base / "hicached"
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
        pool_file = arena_path("/dev/shm", runtime)
        assert pool_file.exists() and stat.S_IMODE(pool_file.stat().st_mode) == 0o600
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        log = proc.stderr.read()
        assert "shutting down" in log and "stopped" in log
        assert not (runtime / "hicached.sock").exists()
        # the pool and its journal stay for the next start to adopt (pool.adopt)
        journal = journal_path(pool_file)
        assert pool_file.exists() and journal.exists()
        assert stat.S_IMODE(journal.stat().st_mode) == 0o600
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        subprocess.run(["rm", "-rf", str(runtime_base)], check=False)
        pool_file = arena_path("/dev/shm", runtime_base / "hicached")
        pool_file.unlink(missing_ok=True)
        journal_path(pool_file).unlink(missing_ok=True)


def test_second_daemon_on_the_same_runtime_dir_is_refused(daemon: Daemon) -> None:
    out = hicached("serve", "--config", str(daemon.config))
    assert out.returncode == 2
    assert "another hicached daemon" in out.stderr
    with daemon.client() as c:  # the first one is untouched
        assert c.stats().clients >= 1


def _events_at(where: Path) -> str:
    return (
        f'[events]\nendpoint = "ipc://{where}/events.sock"\n'
        f'replay_endpoint = "ipc://{where}/replay.sock"\n'
    )


@pytest.mark.parametrize("knob", ["server.endpoint", "events.endpoint"])
def test_an_ipc_endpoint_another_daemon_listens_on_is_refused(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, knob: str
) -> None:
    """A second daemon of another runtime directory configured with the first
    one's ipc endpoint stops with exit 2, naming the knob; binding would have
    removed the first one's socket file and taken its clients. The first one
    keeps serving; its socket file, once it stopped, is taken over."""
    first = daemon_factory(tail=_events_at(tmp_path / "first"))
    second = Daemon(size_mib=16, tail=_events_at(tmp_path / "second"))
    try:
        if knob == "server.endpoint":
            second.endpoint = first.endpoint
            taken = Path(first.endpoint[len("ipc://") :])
            text = re.sub(
                r'(?m)^endpoint = "ipc://[^"]*hicached.sock"',
                f'endpoint = "{first.endpoint}"',
                second.config.read_text(),
            )
        else:
            taken = tmp_path / "first" / "events.sock"
            text = second.config.read_text().replace(
                str(tmp_path / "second" / "events.sock"), str(taken)
            )
        second.config.write_text(text)
        out = hicached("serve", "--config", str(second.config))
        assert out.returncode == 2, out.stderr
        assert f"{knob}: another process listens on {taken}" in out.stderr
        with first.client() as c:  # untouched
            assert c.stats().clients >= 1
        assert taken.is_socket()
        assert first.proc is not None
        first.proc.kill()  # its socket files stay behind, with nobody listening
        first.proc.wait()
        second.start()
        with second.client() as c:
            assert c.stats().clients >= 1
    finally:
        second.cleanup()


def test_a_file_that_is_no_socket_at_an_ipc_endpoint_is_kept(tmp_path: Path) -> None:
    """A regular file where the ipc endpoint would be is nobody's to remove: exit 2."""
    taken = tmp_path / "hicached.sock"
    taken.write_text("mine")
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[server]\nendpoint = "ipc://{taken}"\nruntime_dir = "{tmp_path}/run"\n'
        f'[pool]\nsize_mib = 64\nshm_dir = "{tmp_path}"\n'
    )
    out = hicached("serve", "--config", str(cfg))
    assert out.returncode == 2, out.stderr
    assert "exists and is not a socket" in out.stderr
    assert taken.read_text() == "mine"


def test_open_runtime_dir_is_refused(tmp_path: Path) -> None:
    open_dir = Path("/tmp") / f"hc-open-{os.getpid()}"
    open_dir.mkdir(mode=0o755, exist_ok=True)
    os.chmod(open_dir, 0o755)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nruntime_dir = "{open_dir}"\n[pool]\nsize_mib = 64\n')
    try:
        out = hicached("serve", "--config", str(cfg))
        assert out.returncode == 2
        assert "open to other users" in out.stderr and "chmod 700" in out.stderr
    finally:
        subprocess.run(["rm", "-rf", str(open_dir)], check=False)


def test_quickstart_example_passes_against_a_real_daemon(daemon: Daemon) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HICACHED_ENDPOINT": daemon.endpoint},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bytes match" in out.stdout


def test_bench_commands_print_json_figures(daemon_factory: object) -> None:
    d = Daemon(size_mib=64, slab_mib=16, max_page_bytes=1 << 20).start()
    try:
        data = hicached("bench", "data", "--json", "--endpoint", d.endpoint, "--pages", "32")
        assert data.returncode == 0, data.stderr
        figures = json.loads(data.stdout)["figures"]
        for key in ("slot_write_gbps", "slot_read_gbps", "memcpy_gbps"):
            assert figures[key] > 0
        control = hicached(
            "bench", "control", "--json", "--endpoint", d.endpoint, "--requests", "50"
        )
        assert control.returncode == 0, control.stderr
        figures = json.loads(control.stdout)["figures"]
        for key in (
            "match_p50_us",
            "match_p99_us",
            "echo_p50_us",
            "echo_p99_us",
            "match_p50_us_4c",
            "match_cold_p50_us",
            "echo_cold_p50_us",
            "match_cold_prefix_p50_us",
            "echo_cold_prefix_p50_us",
            "exists_keys_p50_us",
            "echo_keys_p50_us",
            "echo_loop_p50_us",
        ):
            assert figures[key] > 0
        assert figures["echo_p50_us_4c"] > 0 and figures["requests_per_s_4c"] > 0
    finally:
        d.cleanup()


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('backend = "s3"\n', "storage.s3.bucket"),
        (
            'backend = "s3"\n[storage.s3]\nbucket = "b"\nendpoint_url = "127.0.0.1:9000"\n',
            "storage.s3.endpoint_url",
        ),
        (
            'backend = "s3"\n[storage.s3]\nbucket = "b"\naccess_key_id = "AK"\n',
            "storage.s3.access_key_id",
        ),
        ('backend = "mooncake"\n[storage.mooncake]\nmaster = ""\n', "storage.mooncake.master"),
        (
            'backend = "mooncake"\n[storage.mooncake]\nmaster = "h:99999"\n',
            "storage.mooncake.master",
        ),
        (
            'backend = "mooncake"\n[storage.mooncake]\nmetadata_server = "http://:80/m"\n',
            "storage.mooncake.metadata_server",
        ),
        (
            'backend = "mooncake"\n[storage.mooncake]\nmetadata_server = "http://h:99999/m"\n',
            "storage.mooncake.metadata_server",
        ),
        (
            'backend = "mooncake"\n[storage.mooncake]\nmetadata_server = "http://h:0/m"\n',
            "storage.mooncake.metadata_server",
        ),
        (
            'backend = "mooncake"\n[storage.mooncake]\nmetadata_server = ""\n',
            "storage.mooncake.metadata_server",
        ),
        (
            'backend = "mooncake"\n[storage.mooncake]\nlocal_hostname = ""\n',
            "storage.mooncake.local_hostname",
        ),
        ('backend = "faulty"\n[storage.extra]\ninner = "s3"\n', "storage.extra.inner_options"),
        ('backend = "faulty"\n[storage.extra]\ninner = "nosuch"\n', "storage.extra.inner"),
        ('backend = "nosuch"\n', "storage.backend"),
    ],
)
def test_check_config_checks_the_backend_options_whole(tmp_path: Path, toml: str, key: str) -> None:
    """What the backend would refuse at start (a missing bucket, ...) fails here."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[storage]\n{toml}")
    out = hicached("check-config", str(cfg), env=FAULTS_ALLOWED)
    assert out.returncode == 2, out.stdout
    assert f"{key}: " in out.stderr, out.stderr


@pytest.mark.parametrize(
    "toml",
    [
        'backend = "memory"\n',
        'backend = "file"\n',
        'backend = "s3"\n[storage.s3]\nbucket = "pages"\nendpoint_url = "http://127.0.0.1:9"\n',
        'backend = "mooncake"\n',
        'backend = "faulty"\n[storage.extra]\ninner = "s3"\ninner_options = { bucket = "b" }\n',
    ],
)
def test_check_config_passes_every_built_in_backend_with_its_required_options(
    tmp_path: Path, toml: str
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[storage]\n{toml}")
    out = hicached("check-config", str(cfg), env=FAULTS_ALLOWED)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{cfg}: ok"


FAULTY = 'backend = "faulty"\n[storage.extra]\ninner = "memory"\n'
FAULTS_REFUSED = "storage.backend: 'faulty' injects faults"


def test_the_faulty_backend_refuses_to_start_unless_faults_are_allowed(tmp_path: Path) -> None:
    """The test-only backend is registered like any other, so a config can name
    it: without HICACHED_ALLOW_FAULTS=1 in its environment a daemon exits with
    an error that says what it is, and check-config refuses it too."""
    refused = Daemon(storage=FAULTY)  # its environment never has the variable
    try:
        with pytest.raises(RuntimeError, match="daemon exited with 2") as info:
            refused.start()
        said = str(info.value)
        assert FAULTS_REFUSED in said and "is for tests only" in said, said
        assert "HICACHED_ALLOW_FAULTS=1" in said, said
    finally:
        refused.cleanup()
    allowed = Daemon(storage=FAULTY, allow_faults=True).start()
    try:
        with allowed.client() as c:
            assert c.stats().l3_backend == "faulty"
    finally:
        allowed.cleanup()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[storage]\n{FAULTY}")
    out = hicached("check-config", str(cfg), env={"HICACHED_ALLOW_FAULTS": ""})
    assert out.returncode == 2 and FAULTS_REFUSED in out.stderr, out.stderr
    assert hicached("check-config", str(cfg), env=FAULTS_ALLOWED).returncode == 0


def test_s3_without_a_bucket_fails_at_start_with_the_same_message(tmp_path: Path) -> None:
    runtime = Path("/tmp") / f"hc-nob-{os.getpid()}"
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[server]\nruntime_dir = "{runtime}"\n[pool]\nsize_mib = 1\nslab_mib = 1\n'
        f'max_page_bytes = 65536\n[metrics]\nenabled = false\n[storage]\nbackend = "s3"\n'
    )
    try:
        out = hicached("serve", "--config", str(cfg))
        assert out.returncode == 2
        assert "storage.s3.bucket: bucket is empty" in out.stderr
    finally:
        subprocess.run(["rm", "-rf", str(runtime)], check=False)


def test_the_stop_deadline_fits_in_the_units_stop_timeout() -> None:
    """The write-back flush must end before systemd's SIGKILL, with room for
    the rest of the shutdown."""
    unit = (ROOT / "systemd" / "hicached.service").read_text()
    found = re.search(r"^TimeoutStopSec=(\d+)$", unit, re.MULTILINE)
    assert found, "the unit sets TimeoutStopSec"
    stop_timeout = float(found.group(1))
    for config in (Config(), load_config(ROOT / "config" / "hicached.toml")):
        assert config.storage.flush_deadline_s + 10 <= stop_timeout


def test_bench_l3_pairs_rounds_against_a_raw_baseline(tmp_path: Path) -> None:
    """The file bench runs on its own: writes and reads in paired rounds, each
    with the raw baseline's figure and the spread of the per-pair ratios; --plot
    draws them beside their baselines. With more readers than I/O threads, hot
    reads are also paired with a raw read on as many threads as readers."""
    png = tmp_path / "l3.png"
    out = hicached(
        "bench", "l3", "--json", "--backend", "file", "--mib", "4", "--rounds", "2",
        "--read-processes", "5", "--plot", str(png),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.stdout)
    figures, params = result["figures"], result["params"]
    assert (params["read_processes"], params["io_threads"]) == (5, 4)
    for tag in ("64k", "1m"):
        for what in ("write", "read", "read_hot", "read_hot_wide"):
            low, mid, high = (
                figures[f"{what}_vs_raw_min_{tag}"],
                figures[f"{what}_vs_raw_{tag}"],
                figures[f"{what}_vs_raw_max_{tag}"],
            )
            assert 0 < low <= mid <= high
            assert figures[f"raw_{what}_gbps_{tag}"] > 0
        for kind in ("checksum", "checksums"):  # a call a page, and batched
            assert all(figures[f"{kind}_gbps_{tag}_t{n}"] > 0 for n in (1, 2, 4))
            assert all(figures[f"{kind}_scaling_{tag}_t{n}"] > 0 for n in (2, 4))


def test_plot_pairs_each_figure_with_its_baseline() -> None:
    from hicached.bench.plot import pairs

    figures = {"match_p50_us": 30.0, "echo_p50_us": 25.0, "match_cold_p50_us": 40.0}
    assert pairs("control", figures) == [("match p50", 30.0, 25.0, "µs")]
    figures = {"read_gbps_64k": 4.0, "raw_read_gbps_64k": 5.0}
    assert pairs("l3", figures) == [("read_64k", 4.0, 5.0, "GB/s")]


def test_docs_name_every_operator_flag_and_no_other() -> None:
    """Each flag of the operator's commands is in README.md or docs/, and every
    flag the docs give a command (``hicached status --json``) is one it has."""
    import argparse

    from hicached.cli import build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {
        name: {o for a in cmd._actions for o in a.option_strings if o.startswith("--")}
        for name, cmd in sub.choices.items()
    }
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    for name in ("serve", "status", "events", "keygen", "check-config"):
        missing = sorted(f for f in flags[name] - {"--help"} if f not in docs)
        assert not missing, f"hicached {name}: {missing} not in the docs"
    for name, given in re.findall(r"hicached (serve|status|events|bench)((?: [^`|\n]*)?)", docs):
        unknown = set(re.findall(r"--[a-z][a-z-]*", given)) - flags[name]
        assert not unknown, f"hicached {name}{given}: {sorted(unknown)}"
