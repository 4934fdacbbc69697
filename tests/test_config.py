"""Config: the example file is the defaults, and every bad config names its key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from hicached.config import Config, load_config, parse_config
from hicached.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config" / "hicached.toml"


def test_example_decodes_to_the_defaults() -> None:
    assert load_config(EXAMPLE) == Config()


def test_example_lists_every_key() -> None:
    from hicached.config import tomllib

    def same_keys(listed: dict[str, object], defaults: dict[str, object], where: str) -> None:
        assert set(listed) == set(defaults), where or "(top level)"
        for key, value in defaults.items():
            if isinstance(value, dict) and value:
                sub = listed[key]
                assert isinstance(sub, dict)
                same_keys(sub, value, f"{where}.{key}".lstrip("."))

    same_keys(tomllib.loads(EXAMPLE.read_text()), msgspec.to_builtins(Config()), "")


def test_example_comments_every_key() -> None:
    """Each key has a comment right above it; only the second of a pair that
    goes together may share the first one's."""
    pairs = {
        "retry_backoff_s": "retries",
        "breaker_cooldown_s": "breaker_failures",
        "secret_access_key": "access_key_id",
        "read_timeout_s": "connect_timeout_s",
        "tls_key": "tls_cert",
    }
    lines = EXAMPLE.read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        if not line or line.startswith(("#", "[")):
            continue
        key, above = line.split("=")[0].strip(), lines[i - 1]
        first = pairs.get(key)
        shared = first is not None and above.startswith(f"{first} =")
        if not (above.startswith("#") or (shared and lines[i - 2].startswith("#"))):
            uncommented.append(key)
    assert not uncommented, f"keys without a comment in {EXAMPLE.name}: {uncommented}"


def test_example_tenant_table_lists_every_key_with_its_default() -> None:
    """[tenants] has no entries by default, so the example shows one, commented
    out: it names every key of a tenant's table, each at its default."""
    from hicached.access_config import TenantConfig
    from hicached.config import tomllib

    text = EXAMPLE.read_text().split("\n[tenants]\n", 1)[1]
    start = text.index("# [tenants.")
    table = "\n".join(
        line.removeprefix("# ")
        for line in text[start:].splitlines()
        if not line.startswith("# # ") and line != "#"
    )
    (example,) = tomllib.loads(table)["tenants"].values()
    assert set(example) == {f.name for f in msgspec.structs.fields(TenantConfig)}
    assert msgspec.convert(example, TenantConfig) == TenantConfig()


def _defaults() -> dict[str, object]:
    """Every key by its dotted name, with its default; a tenant's keys as
    ``tenants.NAME.KEY``."""
    from hicached.access_config import TenantConfig

    def walk(struct: msgspec.Struct, where: str) -> dict[str, object]:
        out: dict[str, object] = {}
        for field in msgspec.structs.fields(struct):
            value = getattr(struct, field.name)
            if isinstance(value, msgspec.Struct):
                out.update(walk(value, f"{where}{field.name}."))
            elif field.name != "tenants":
                out[f"{where}{field.name}"] = msgspec.to_builtins(value)
        return out

    return walk(Config(), "") | walk(TenantConfig(), "tenants.NAME.")


def test_docs_list_every_key_with_its_default() -> None:
    """docs/operations.md, storage.md and events.md each end with a table of
    their keys, ``| `key` | `default` | meaning |``: every key is in one of them,
    at the code's default, and none that the code lacks."""
    from hicached.config import tomllib

    documented: dict[str, object] = {}
    for name in ("operations.md", "storage.md", "events.md"):
        for line in (ROOT / "docs" / name).read_text().splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) != 3 or not cells[0].startswith("`") or not cells[1].startswith("`"):
                continue
            key = cells[0].strip("`")
            if "." in key and " " not in key:
                documented[key] = tomllib.loads(f"v = {cells[1].strip('`')}")["v"]
    defaults = _defaults()
    assert sorted(set(defaults) - set(documented)) == [], "keys the docs do not list"
    assert sorted(set(documented) - set(defaults)) == [], "listed keys the code lacks"
    wrong = {k: (documented[k], v) for k, v in defaults.items() if documented[k] != v}
    assert not wrong, f"docs' default != the code's: {wrong}"


def test_no_file_means_defaults() -> None:
    assert load_config(None) == Config()
    assert parse_config("") == Config()


@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        ("[pool]\nsize_mb = 3\n", "pool.size_mb", "unknown key"),
        ("[nosuch]\n", "nosuch", "unknown key"),
        ("[leases]\nttl_s = 'soon'\n", "leases.ttl_s", "Expected `float`"),
        ("[pool]\nsize_mib = 0\n", "pool.size_mib", "positive"),
        ("[pool]\nsize_mib = 32\nslab_mib = 64\n", "pool.size_mib", "not even one page fits"),
        ("[pool]\nslab_mib = 1\n", "pool.max_page_bytes", "larger than one slab"),
        ("[server]\nendpoint = 'tcp://10.1.2.3:5555'\n", "server.endpoint", "loopback only"),
        ("[server]\nendpoint = 'tcp://127.0.0.1'\n", "server.endpoint", "explicit port"),
        ("[server]\nendpoint = 'ipc://@abstract'\n", "server.endpoint", "private directory"),
        ("[server]\nendpoint = 'udp://x'\n", "server.endpoint", "ipc:///absolute/path"),
        ("[server]\nmax_message_bytes = 10\n", "server.max_message_bytes", "at least 4096"),
        ("[log]\nlevel = 'loud'\n", "log.level", "one of"),
        ("[storage]\ndata_dir = 'relative'\n", "storage.data_dir", "absolute"),
        ("[storage]\nwrite_policy = 'sometimes'\n", "storage.write_policy", "one of"),
        (
            "[storage.file]\ncapacity_mib = 100\nsegment_mib = 64\n",
            "storage.file.capacity_mib",
            "two segments",
        ),
        ("[storage.s3]\nthreds = 2\n", "storage.s3.threds", "unknown key"),
        ("[storage.file]\nread_processes = 'many'\n", "storage.file.read_processes", "'many'"),
        ("[storage.file]\nread_processes = 65\n", "storage.file.read_processes", "or 'auto'"),
        ("[storage.mooncake]\nprotocol = 'udp'\n", "storage.mooncake.protocol", "'tcp' or 'rdma'"),
        ("[leases]\nquarantine_s = nan\n", "leases.quarantine_s", "finite"),
        ("[leases]\nttl_s = inf\n", "leases.ttl_s", "finite"),
        ("[server]\nsession_idle_s = nan\n", "server.session_idle_s", "finite"),
        ("[storage]\nflush_deadline_s = -inf\n", "storage.flush_deadline_s", "finite"),
        # a topic with more than {host} and {model} as they are: {model[0]} passed
        # check-config and failed the daemon's start with a KeyError; a width made a
        # string that wide at every check
        ("[events]\ntopic = 'kv@{model[0]}'\n", "events.topic", "not {model[0]}"),
        ("[events]\ntopic = '{host:>999999999}'\n", "events.topic", "as they are"),
        ("[events]\ntopic = '{model.__class__}'\n", "events.topic", "as they are"),
        ("[events]\ntopic = '{host!r}@{model}'\n", "events.topic", "not {host!r}"),
        # a tenant's table named by its tenant: msgspec said tenants[...], not which
        (
            "[tenants.alpha]\nuids = [1]\n[tenants.beta]\nuids = [2]\nmax_page = 1\n",
            "tenants.beta.max_page",
            "unknown key",
        ),
        ("[tenants.alpha]\nuids = ['x']\n", "tenants.alpha.uids[0]", "Expected `int`"),
        ("[tenants]\nalpha = 3\n", "tenants.alpha", "Expected `object`"),
        # a uid past the kernel's 32 bits never matches a peer
        ("[tenants.alpha]\nuids = [4294967296]\n", "tenants.alpha.uids", "0 to 4294967294"),
        ("[tenants.alpha]\ngids = [-1]\n", "tenants.alpha.gids", "0 to 4294967294"),
        # a check that names its field before a colon: the key was "events", not its own
        ("[events]\nendpoint = 'ipc://'\n", "events.endpoint", "must be absolute"),
        (
            "[events]\nendpoint = 'ipc:///tmp/e'\nreplay_endpoint = 'udp://x'\n",
            "events.replay_endpoint",
            "ipc:///",
        ),
        # past ZeroMQ's C int of milliseconds: a stop failed with a traceback
        ("[events]\nclose_linger_s = 3e6\n", "events.close_linger_s", "an hour at most"),
        ("[events]\nclose_linger_s = -1.0\n", "events.close_linger_s", "not be negative"),
        # past what a wait takes (1e300): every scrape failed with a 500
        ("[metrics]\nscrape_timeout_s = 1e300\n", "metrics.scrape_timeout_s", "an hour at most"),
        ("[metrics]\nscrape_timeout_s = 0.0\n", "metrics.scrape_timeout_s", "positive"),
        (
            "[leases]\nttl_s = 1.0\nsweep_interval_s = 2.0\n",
            "leases.sweep_interval_s",
            "at least once a TTL",
        ),
    ],
)
def test_bad_config_names_its_key(text: str, key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "x.toml")
    message = str(info.value)
    assert message.startswith(f"x.toml: {key}: "), message
    assert hint in message


def test_tables_nested_past_any_knob_are_a_clear_error() -> None:
    """Valid TOML two thousand tables deep (the walk over its keys ran out of
    stack: a RecursionError, not a ConfigError, so a start or reload failed
    with a traceback); a third-party backend's options 20 deep still pass."""
    deep = "[storage.extra." + ".".join(["t"] * 2000) + "]\nx = 1\n"
    # Python 3.10's reader (tomli) refuses keys of over 1,000 parts itself
    where = r"storage\.extra\.t\.t.*" if sys.version_info >= (3, 11) else r"values "
    with pytest.raises(ConfigError, match=rf"^x\.toml: {where}nested (more than 32|deeper)"):
        parse_config(deep, "x.toml")
    fine = "[storage.extra." + ".".join(["t"] * 20) + "]\nx = 1\n"
    assert parse_config(fine, "x.toml").storage.extra["t"]["t"]


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "{a=" * 5000 + "1" + "}" * 5000])
def test_values_nested_past_the_readers_stack_are_a_clear_error(value: str) -> None:
    """Arrays or inline tables thousands deep: the TOML reader itself ran out of
    stack (a RecursionError: a start failed with a traceback)."""
    with pytest.raises(ConfigError, match=r"^x\.toml: values nested deeper than the TOML reader"):
        parse_config(f"[storage.extra]\nx = {value}\n", "x.toml")


def test_not_toml_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config("[pool\n")


def test_check_config_command(tmp_path: Path) -> None:
    good = subprocess.run(
        [sys.executable, "-m", "hicached", "check-config", str(EXAMPLE)],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0 and "ok" in good.stdout
    bad_file = tmp_path / "bad.toml"
    bad_file.write_text("[pool]\nsize_mib = -1\n")
    bad = subprocess.run(
        [sys.executable, "-m", "hicached", "check-config", str(bad_file)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "pool.size_mib" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "hicached", "check-config", str(tmp_path / "none.toml")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "cannot read config" in missing.stderr


def test_check_config_knows_the_backends(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[storage]\nbackend = "tape"\n')
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "check-config", str(cfg)], capture_output=True, text=True
    )
    assert out.returncode == 2 and "unknown backend 'tape'" in out.stderr and "file" in out.stderr
    cfg.write_text('[storage]\nbackend = "file"\n[storage.file]\nio_threads = 0\n')
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "check-config", str(cfg)], capture_output=True, text=True
    )
    assert out.returncode == 2 and "storage.file.io_threads" in out.stderr
    cfg.write_text('[storage]\nbackend = "s3"\n[storage.s3]\nbucket = "b"\n')
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "check-config", str(cfg)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (
            "[events]\nendpoint = 'ipc:///run/h/ev.sock'\nreplay_endpoint = 'ipc:///run/h/ev.sock'\n",
            "events.replay_endpoint",
        ),
        (
            "[server]\nendpoint = 'ipc:///run/h/h.sock'\n"
            "[events]\nendpoint = 'ipc:///run/h//h.sock'\n",
            "events.endpoint",
        ),
        (
            "[server]\nruntime_dir = '/run/h'\n[events]\nendpoint = 'ipc:///run/h/hicached.sock'\n",
            "events.endpoint",
        ),
        (
            "[server]\nendpoint = 'tcp://127.0.0.1:5555'\n"
            "[events]\nendpoint = 'tcp://127.0.0.1:5555'\n",
            "events.endpoint",
        ),
    ],
)
def test_two_sockets_on_one_address_are_refused(text: str, key: str) -> None:
    """A second ipc bind takes the path from the first without an error (ZeroMQ
    replaces the socket file): two of the daemon's sockets on one address would
    leave one of them unreachable, and the daemon would start all the same."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, "x.toml")
    assert str(info.value).startswith(f"x.toml: {key}: "), str(info.value)
    assert "same address" in str(info.value)


def test_a_daemon_refuses_its_events_and_replay_on_one_path(tmp_path: Path) -> None:
    from tests.l3util import refused_start
    from tests.support import Daemon

    endpoint = f"ipc://{tmp_path}/events.sock"
    d = Daemon(
        size_mib=1, tail=f'[events]\nendpoint = "{endpoint}"\nreplay_endpoint = "{endpoint}"\n'
    )
    refused_start(d, "events.replay_endpoint")


@pytest.mark.parametrize(
    ("tenants", "hint"),
    [
        ("[tenants.a]\nuids = [1001]\narena_mib = 6\n", "tenants.a.arena_mib"),
        ("[tenants.a]\nuids = [1001]\narena_mib = 64\n", "does not hold an arena"),
    ],
)
def test_check_config_refuses_what_serve_refuses_of_tenant_arenas(
    tmp_path: Path, tenants: str, hint: str
) -> None:
    """Tenant arenas are sized from the config alone: a layout the daemon refuses
    at start, check-config refuses too."""
    from tests.l3util import refused_start
    from tests.support import Daemon

    d = Daemon(size_mib=16, tail=tenants)
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "check-config", str(d.config)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and hint in out.stderr, (out.stdout, out.stderr)
    refused_start(d, hint)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[events]\nhwm = 2147483648\n", "events.hwm"),
        ("[events]\nreplay_batches = 2147483647\n", "events.replay_batches"),
        ("[server]\nhwm = 2147483648\n", "server.hwm"),
    ],
)
def test_high_water_marks_fit_zeromq(text: str, key: str) -> None:
    """ZeroMQ takes a high-water mark as a C int."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, "x.toml")
    assert str(info.value).startswith(f"x.toml: {key}: "), str(info.value)
    assert "at most 214748364" in str(info.value)


def test_an_events_hwm_zeromq_cannot_take_is_a_config_error_not_a_hung_start(
    tmp_path: Path,
) -> None:
    from tests.l3util import refused_start
    from tests.support import Daemon

    events = f'[events]\nendpoint = "ipc://{tmp_path}/events.sock"\nhwm = 3000000000\n'
    refused_start(Daemon(size_mib=1, tail=events), "events.hwm")


def test_auto_readers_follow_the_io_threads_and_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """read_processes = "auto": twice io_threads, at most half the CPUs, at least 2."""
    import os

    from hicached_backends.options import FileOptions

    for cpus, io_threads, readers in ((2, 4, 2), (16, 4, 8), (8, 4, 4), (64, 4, 8), (16, 1, 2)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert FileOptions(io_threads=io_threads).readers() == readers
    assert FileOptions(read_processes=3).readers() == 3
    assert FileOptions(read_processes=0).readers() == 0


def test_mooncake_hashes_in_no_more_slices_than_cpus_per_store_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from hicached_backends.options import MooncakeOptions

    for cpus, threads, verify_threads, parts in ((2, 4, 4, 1), (16, 4, 4, 4), (64, 4, 4, 5)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        options = MooncakeOptions(threads=threads, verify_threads=verify_threads)
        assert options.hash_parts() == parts
    assert MooncakeOptions(verify_threads=0).hash_parts() == 1
