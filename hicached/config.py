"""Typed configuration: one schema, defaults in one place, errors with key paths.

``config/hicached.toml`` lists every key below with its default; a test keeps
the two in step. Unknown keys, wrong types and impossible values raise
ConfigError naming the key, e.g. ``pool.size_mib: ... - at `$.pool```.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import msgspec

from hicached.access_config import SHARED_BOUNDS, TENANT_NAME_RE, CurveConfig, TenantConfig
from hicached.endpoints import check_distinct, check_endpoint
from hicached.errors import ConfigError
from hicached.events_config import MAX_HWM, EventsConfig
from hicached.metrics_config import MetricsConfig
from hicached_backends.options import (
    FileOptions,
    MemoryOptions,
    MooncakeOptions,
    S3Options,
    positive,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MIB = 1 << 20

_Section = {"kw_only": True, "forbid_unknown_fields": True}


class ServerConfig(msgspec.Struct, **_Section):
    """The control socket and the bounds on what one message or client may ask."""

    # "" = ipc://<runtime_dir>/hicached.sock; tcp:// only on loopback.
    endpoint: str = ""
    # "" = $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/hicached, else /tmp/hicached-<uid>; made 0700.
    runtime_dir: str = ""
    # Group (name or number) whose members may connect over ipc and map the pool:
    # the runtime directory becomes 0750 and the socket and pool file 0660, all of
    # that group (the daemon's user must be a member). "" = the daemon's user only.
    client_group: str = ""
    # Larger messages get a too_large error reply and are counted.
    max_message_bytes: int = 1 * MIB
    # Most pages one reserve or match may cover; longer requests get too_large.
    max_pages_per_request: int = 16384
    # Distinct client sessions held at once; a newcomer beyond it takes the place of
    # the longest idle session that holds no lease (and is refused if all hold one).
    max_clients: int = 1024
    # A session with no request and no lease for this long is forgotten.
    session_idle_s: float = 600.0
    # ZeroMQ high-water mark (messages) for each direction of the socket.
    hwm: int = 10000
    # Request bytes queued per client before the daemon stops reading from it (the
    # client waits: backpressure, nothing lost); the receive high-water mark is this
    # over max_message_bytes (at least 4 messages), and never above hwm.
    queue_mib: int = 16
    # Messages handled per wake-up before yielding to other tasks.
    drain_batch: int = 256
    # Page keys remembered for recently seen token sequences (0 = off); ~100 bytes each.
    key_cache_pages: int = 262144
    # MiB of recent sequences' token ids and keys kept so that one which extends or shares
    # a prefix with them (a conversation's next turn) hashes only its other pages; 0 = off.
    key_cache_token_mib: int = 16
    # Freeze what outlives the start's work (an adopted pool, the startup L3 scan),
    # what a long full collection finds alive, and every 65,536 pages stored
    # (gc.freeze), so that the interpreter's collections stop walking a large
    # index (daemon/collector.py).
    gc_freeze: bool = True
    # Seconds a reload (SIGHUP) waits for its config file to be read: on a hung
    # filesystem (NFS) the read blocks; the reload then fails and the daemon
    # keeps serving with its config as it was.
    reload_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.endpoint:
            check_endpoint(self.endpoint, remote=True)  # loopback unless CURVE: Config
        if self.runtime_dir and not self.runtime_dir.startswith("/"):
            raise ValueError("runtime_dir must be an absolute path")
        if self.client_group != self.client_group.strip() or ":" in self.client_group:
            raise ValueError(f"client_group {self.client_group!r}: give one group name or number")
        if self.max_message_bytes < 4096:
            raise ValueError("max_message_bytes must be at least 4096")
        positive(self, "max_pages_per_request", "max_clients", "hwm", "drain_batch", "queue_mib")
        if self.hwm > MAX_HWM:
            raise ValueError(f"hwm must be at most {MAX_HWM} (ZeroMQ's limit)")
        if self.key_cache_pages < 0:
            raise ValueError("key_cache_pages must be 0 (off) or positive")
        if self.key_cache_token_mib < 0:
            raise ValueError("key_cache_token_mib must be 0 (off) or positive")
        if self.session_idle_s <= 0:
            raise ValueError("session_idle_s must be positive")
        if not 0 < self.reload_timeout_s <= 3600:
            raise ValueError("reload_timeout_s must be positive, an hour at most")


class PoolConfig(msgspec.Struct, **_Section):
    """The shared host-memory (L2) arena."""

    # Total arena size in MiB; the daemon prefaults all of it at start.
    size_mib: int = 1024
    # Each page size draws whole slabs of this many MiB from the arena.
    slab_mib: int = 64
    # Largest page a namespace may declare, in bytes (at most one slab).
    max_page_bytes: int = 4 * MIB
    # Directory (a tmpfs) holding the arena file; mode 0600 (0660 with server.client_group).
    shm_dir: str = "/dev/shm"
    # Prefault the arena (MAP_POPULATE) so first copies run at memcpy speed.
    populate: bool = True
    # Huge pages for the arena: "off"; "madvise" (MADV_HUGEPAGE on the tmpfs mapping of
    # the daemon and every client: used where /sys/kernel/mm/transparent_hugepage/
    # shmem_enabled is advise or within_size); "hugetlbfs" (shm_dir is a hugetlbfs mount
    # with enough huge pages reserved, vm.nr_hugepages). Fewer page-table entries per
    # client process and faster attaches for large pools.
    huge_pages: str = "off"
    # Namespaces registered at once; one more is refused.
    max_namespaces: int = 256
    # Keep L2 across restarts: a stop (or a crash) leaves the pool file and its
    # journal (<pool file>.journal) in shm_dir, and the next start with the same
    # runtime directory and pool geometry adopts every page committed before it
    # (docs/operations.md). The pool's memory stays in use while no daemon runs.
    # false: every start makes a new pool, and a stop removes it. `hicached
    # serve --fresh` makes a new pool once.
    adopt: bool = True

    def __post_init__(self) -> None:
        positive(self, "size_mib", "slab_mib", "max_page_bytes", "max_namespaces")
        if self.max_page_bytes > self.slab_mib * MIB:
            raise ValueError(
                f"max_page_bytes ({self.max_page_bytes}) is larger than one slab "
                f"({self.slab_mib} MiB): raise slab_mib or lower max_page_bytes"
            )
        if self.size_mib < self.slab_mib:
            raise ValueError(
                f"size_mib ({self.size_mib}) is smaller than one slab ({self.slab_mib} MiB), "
                "so not even one page fits: raise size_mib or lower slab_mib"
            )
        if not self.shm_dir.startswith("/"):
            raise ValueError("shm_dir must be an absolute path")
        if self.huge_pages not in ("off", "madvise", "hugetlbfs"):
            raise ValueError(
                f"huge_pages must be off, madvise or hugetlbfs, not {self.huge_pages!r}"
            )


class LeaseConfig(msgspec.Struct, **_Section):
    """Leases pin slots while a client reads or writes them."""

    # A lease not committed or released within this many seconds expires.
    ttl_s: float = 30.0
    # Open leases at once, over all clients; one more is refused.
    max_leases: int = 65536
    # How often expired leases are looked for, in seconds (at most ttl_s).
    sweep_interval_s: float = 0.25
    # Seconds the fresh slots a write lease left unpublished (expired, released,
    # committed in part) wait past its deadline before reuse, so a copy a client
    # started just before its lease ran out, or one of its threads has under way
    # as another ends the lease, cannot land in a page that someone else owns by
    # then. Clients stop copying through a handle a second (a tenth of ttl_s, if
    # less) before its lease's deadline.
    quarantine_s: float = 10.0

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or self.sweep_interval_s <= 0 or self.quarantine_s <= 0:
            raise ValueError("ttl_s, sweep_interval_s and quarantine_s must be positive")
        if self.sweep_interval_s > self.ttl_s:
            raise ValueError(
                f"sweep_interval_s ({self.sweep_interval_s}) must not exceed ttl_s "
                f"({self.ttl_s}): expired leases are looked for at least once a TTL"
            )
        positive(self, "max_leases")


WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class StorageConfig(msgspec.Struct, **_Section):
    """The L3 tier: which backend, when pages reach it, and the bounds on its work."""

    # "" = $STATE_DIRECTORY, else $XDG_STATE_HOME/hicached, else ~/.local/state/hicached.
    data_dir: str = ""
    # L3 backend by name (memory, file, s3, mooncake, or a plugin's); "" = L2 only.
    # faulty injects faults, for tests: it starts only with HICACHED_ALLOW_FAULTS=1.
    backend: str = ""
    # write_through (on commit), write_through_selective (after selective_hits
    # matches), or write_back (on eviction from L2, and at a graceful stop).
    write_policy: str = "write_through"
    # Matches a page needs before write_through_selective writes it (and its prefix).
    selective_hits: int = 2
    # Seconds a graceful stop may take in all: ending the scan and prefetches,
    # writing back pages L3 lacks (in steps as the queue drains) and finishing
    # queued writes. Keep it below the unit's TimeoutStopSec (60 s) with room
    # to spare, or systemd kills the daemon mid-flush.
    flush_deadline_s: float = 30.0
    # Pages queued or being written, at most (so at most this many L2 slots
    # wait on L3, even when calls hang); more are dropped and counted.
    queue_pages: int = 65536
    # Pages per backend call.
    batch_pages: int = 64
    # Backend calls of reads and writes in flight at once, plus one kept for
    # existence checks (L3 lookups, a prefetch's first step). Checks are served
    # first, then reads (prefetch), then writes; writes leave one of these free
    # for reads when there are two or more. At most 1024 (a writer task
    # each).
    concurrency: int = 4
    # Seconds one backend call may take before it counts as failed.
    op_timeout_s: float = 30.0
    # Extra attempts for a retriable failure, with exponential backoff from retry_backoff_s.
    retries: int = 3
    retry_backoff_s: float = 0.05
    # Consecutive failures that mark the backend down; it is probed again after the cooldown.
    # A store that does not answer at the start is down from the start (L2 serves).
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    # Pages per read while prefetching.
    prefetch_batch_pages: int = 64
    # Learn at start what the store holds (backends that can list it).
    scan_on_start: bool = True
    # Keys remembered as held by the store, about 85 bytes each; beyond it the
    # oldest half is forgotten (a forgotten key costs a repeated write or an
    # unreported L3 hit, never a wrong byte).
    known_keys: int = 2_000_000
    # Run that scan after READY, while serving (matches see L3 pages as they
    # are found; status shows state "scanning" and scan_pages); false = scan
    # before READY.
    scan_in_background: bool = True
    # Seconds before a failed scan (or one cut short) is tried again, doubled
    # each time up to 600 s, until one ends (0 = never again: unknown keys are
    # then asked of the store for good).
    scan_retry_s: float = 30.0
    # While the daemon does not know every key the store holds (the scan runs,
    # did not end, or keys were forgotten to stay within known_keys), a match
    # or exists_keys whose L3 part stops at a key it does not know asks the
    # backend (exists) before answering it as absent. At most this many such
    # lookups run at once; past it a request is answered from what the daemon
    # knows (0 = never ask).
    lookups_in_flight: int = 64
    # Seconds a request waits for its lookup; then it is answered from what the
    # daemon knows, and the lookup goes on: what it finds is known from then on.
    lookup_timeout_s: float = 0.5
    memory: MemoryOptions = msgspec.field(default_factory=MemoryOptions)
    file: FileOptions = msgspec.field(default_factory=FileOptions)
    s3: S3Options = msgspec.field(default_factory=S3Options)
    mooncake: MooncakeOptions = msgspec.field(default_factory=MooncakeOptions)
    # Options of a third-party backend, decoded by that backend's own schema.
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.data_dir and not self.data_dir.startswith("/"):
            raise ValueError("data_dir must be an absolute path")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}")
        positive(self, "selective_hits", "queue_pages", "batch_pages", "concurrency")
        if self.concurrency > MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be at most {MAX_CONCURRENCY}")
        if self.known_keys < 2:
            raise ValueError("known_keys must be at least 2")
        positive(
            self, "op_timeout_s", "breaker_failures", "breaker_cooldown_s", "prefetch_batch_pages"
        )
        if self.lookups_in_flight < 0:
            raise ValueError("lookups_in_flight must not be negative (0 = no lookups)")
        positive(self, "lookup_timeout_s")
        if self.retries < 0 or self.retry_backoff_s < 0 or self.flush_deadline_s < 0:
            raise ValueError("retries, retry_backoff_s and flush_deadline_s must not be negative")
        if self.scan_retry_s < 0:
            raise ValueError(
                "scan_retry_s must not be negative (0 = a failed scan is not tried again)"
            )


class LogConfig(msgspec.Struct, **_Section):
    """Logging to stderr (the journal under systemd)."""

    # One of debug, info, warning, error.
    level: str = "info"

    def __post_init__(self) -> None:
        if self.level not in ("debug", "info", "warning", "error"):
            raise ValueError("level must be one of debug, info, warning, error")


class Config(msgspec.Struct, **_Section):
    """The whole daemon configuration; every section is optional."""

    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    leases: LeaseConfig = msgspec.field(default_factory=LeaseConfig)
    storage: StorageConfig = msgspec.field(default_factory=StorageConfig)
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    curve: CurveConfig = msgspec.field(default_factory=CurveConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    # Tenants by name, ``[tenants.NAME]``; none = one tenant for every client, whose
    # namespaces carry the tenant they name (docs/operations.md, Tenants).
    tenants: dict[str, TenantConfig] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_tenants()
        if self.tenants:
            self._check_tenant_events()
        self._check_addresses()
        if self.curve.secret_key_file:
            return  # every tcp:// socket authenticates its peers
        for key, value in (
            ("server.endpoint", self.server.endpoint),
            ("events.endpoint", self.events.endpoint),
            ("events.replay_endpoint", self.events.replay_endpoint),
        ):
            if value:
                try:
                    check_endpoint(value)
                except ValueError as exc:
                    raise ValueError(f"{key}: {exc}") from None

    def _check_tenant_events(self) -> None:
        """With tenants, the KV events (every tenant's pages and token ids) reach
        no tenant's client: over ipc not the clients' group, whose members are
        every tenant's users; over tcp only CURVE keys no tenant lists subscribe
        (daemon/tenants.py), so tcp needs CURVE, and no others tenant may take
        the unlisted keys of a tcp request endpoint."""
        if self.events.group and self.events.group == self.server.client_group:
            raise ValueError(
                "events.group: with [tenants] it must not be server.client_group, whose "
                "members are every tenant's users: name a group of the routers' users"
            )
        for key, value in (
            ("events.endpoint", self.events.endpoint),
            ("events.replay_endpoint", self.events.replay_endpoint),
        ):
            if not value.startswith("tcp://"):
                continue
            if not self.curve.secret_key_file:
                raise ValueError(
                    f"{key}: with [tenants] the KV events name every tenant's pages, and a "
                    "tcp:// endpoint without [curve] keys is open to every local process: "
                    "use an ipc:// endpoint, or set [curve] secret_key_file"
                )
            others = next((name for name, t in self.tenants.items() if t.others), "")
            if others and self.server.endpoint.startswith("tcp://"):
                raise ValueError(
                    f"{key}: tenants.{others} takes every CURVE key no tenant lists, so "
                    "each subscriber would be one of its clients, and the KV events name "
                    "every tenant's pages: use an ipc:// events endpoint, or list the "
                    f"keys of tenants.{others} and drop its others = true"
                )

    def _check_addresses(self) -> None:
        server = self.server.endpoint
        if not server and self.server.runtime_dir:
            server = f"ipc://{self.server.runtime_dir}/hicached.sock"
        check_distinct(
            [
                ("server.endpoint", server),
                ("events.endpoint", self.events.endpoint),
                ("events.replay_endpoint", self.events.replay_endpoint),
            ]
        )

    def _check_tenants(self) -> None:
        seen: dict[tuple[str, object], str] = {}
        others = []
        for name, tenant in self.tenants.items():
            if not TENANT_NAME_RE.fullmatch(name) or ".." in name:
                raise ValueError(
                    f"tenants.{name}: a tenant's name is 1-64 letters, digits, '.', '_' "
                    "or '-', starting with a letter or digit"
                )
            problem = tenant.problem()
            if problem:
                raise ValueError(f"tenants.{name}.{problem}")
            self._check_shares(name, tenant)
            if tenant.curve_keys and not self.curve.secret_key_file:
                raise ValueError(
                    f"tenants.{name}.curve_keys: CURVE keys name tenants only with "
                    "[curve] secret_key_file and authorized_keys_dir set"
                )
            if tenant.others:
                others.append(name)
            for what, values in (
                ("uids", tenant.uids),
                ("gids", tenant.gids),
                ("curve_keys", tenant.curve_keys),
            ):
                for value in values:
                    first = seen.setdefault((what, value), name)
                    if first != name:
                        raise ValueError(
                            f"tenants.{name}.{what}: {value!r} belongs to tenant {first!r} "
                            "already; a peer has one tenant"
                        )
        if len(others) > 1:
            raise ValueError(
                f"tenants: {' and '.join(others)} both say others = true; at most one may"
            )
        if self.tenants and self.server.client_group and self.server.endpoint.startswith("tcp://"):
            # over tcp there are no tenant arenas: the pool is one file, and the group
            # that opens it would let every tenant's local client read every other's
            raise ValueError(
                "server.client_group: with [tenants] over a tcp:// endpoint the pool is one "
                "file, which the group would let every tenant's local clients map whole: "
                "use an ipc:// endpoint (each tenant gets an arena of its own) or leave "
                "client_group unset (the pool stays the daemon's own)"
            )

    def _check_shares(self, name: str, tenant: TenantConfig) -> None:
        """A tenant's part of a shared bound is within the bound (cache/shares.py)."""
        for key, whole in SHARED_BOUNDS.items():
            section, field = whole.split(".")
            bound = getattr(getattr(self, section), field)
            value = getattr(tenant, key)
            if value > bound:
                raise ValueError(
                    f"tenants.{name}.{key}: {value} is more than {whole} ({bound}), which "
                    "bounds every tenant together: lower it, or 0 for an equal share"
                )


def parse_config(text: str | bytes, source: str = "<config>") -> Config:
    """Decode TOML text into a Config or raise ConfigError naming the key."""
    raw = text.encode() if isinstance(text, str) else text
    try:
        tree = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # arrays or inline tables thousands deep; tomli's dotted keys
        raise ConfigError(
            f"{source}: values nested deeper than the TOML reader can go (no knob is)"
        ) from None
    try:
        flat = leaves(tree)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc.message}") from None
    for key, value in flat.items():
        if "\x00" in key:
            raise ConfigError(f"{source}: {key!r}: a key holds a NUL character")
        # TOML has nan and inf; no knob means either, and a comparison with NaN
        # is always false, so range checks alone would let it through
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"{source}: {key}: must be a finite number, got {item}")
            if isinstance(item, str) and "\x00" in item:
                raise ConfigError(f"{source}: {key}: holds a NUL character (no path or name can)")
            if isinstance(item, int) and not -MAX_INT <= item <= MAX_INT:
                # past this, sizes in MiB overflow the C calls they reach
                raise ConfigError(f"{source}: {key}: {item} is past any knob's range (2**43)")
    try:
        return msgspec.toml.decode(raw, type=Config)
    except msgspec.ValidationError as exc:
        message = with_dotted_path(_named_tenant(tree, str(exc)))
        raise ConfigError(f"{source}: {message}") from None


def _named_tenant(tree: dict[str, Any], message: str) -> str:
    """msgspec says ``tenants[...]`` for a table under [tenants] (it names no
    dict key): put in the name of the first tenant whose table fails alone."""
    tenants = tree.get("tenants")
    if "`$.tenants[...]" not in message or not isinstance(tenants, dict):
        return message
    for name, table in tenants.items():
        try:
            msgspec.convert(table, TenantConfig)
        except msgspec.ValidationError:
            return message.replace("`$.tenants[...]", f"`$.tenants.{name}", 1)
    return message


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read a TOML file, or return the built-in defaults when ``path`` is None."""
    global _last_loaded
    if path is None:
        return Config()
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    config = parse_config(data, str(path))
    _last_loaded = (config, str(path))
    return config


_last_loaded: tuple[Config, str] | None = None


def config_source(config: Config) -> str | None:
    """The file ``config`` was read from, if ``load_config`` read it last: where
    a daemon started with it reads its config again on SIGHUP."""
    if _last_loaded is not None and _last_loaded[0] is config:
        return _last_loaded[1]
    return None


# Backend calls in flight at most (storage.concurrency): each has a writer task.
MAX_CONCURRENCY = 1024

# The largest integer any knob takes (in MiB: 8 EiB): a size past it would
# overflow the C calls it reaches (posix_fallocate, socket options).
MAX_INT = (1 << 43) - 1

# Tables nested deeper than this are refused: no knob is, and a walk over a
# thousand levels would run out of stack (TOML itself sets no bound).
MAX_DEPTH = 32


def leaves(table: dict[str, Any], where: str = "", depth: int = 0) -> dict[str, Any]:
    """Every value of a decoded config that is not a table, by its dotted key; an
    empty table counts as a value, so adding or removing one is a change."""
    if depth > MAX_DEPTH:
        raise ConfigError(f"{where.rstrip('.')[:80]}...: tables nested more than {MAX_DEPTH} deep")
    out: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{where}{key}"
        if isinstance(value, dict) and value:
            out.update(leaves(value, path + ".", depth + 1))
        else:
            out[path] = value
    return out


def with_dotted_path(message: str) -> str:
    """Turn msgspec's "... - at `$.pool`" into "pool.size_mib: ..." when it can.

    Checks in ``__post_init__`` start their message with the field name, which
    is folded into the path; msgspec's own unknown-field message names the key.
    """
    text, sep, where = message.rpartition(" - at `")
    path = where.rstrip("`").removeprefix("$").lstrip(".") if sep else ""
    if not sep:
        text = message
    unknown = re.fullmatch(r"Object contains unknown field `([^`]+)`", text)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return f"{key}: unknown key (check its spelling and section in config/hicached.toml)"
    named = re.match(r"([a-z_]+): ", text)  # "endpoint: why": the field, then why
    if named and path:
        return f"{path}.{named.group(1)}: {text[named.end() :]}"
    field = re.match(r"([a-z_]+) ", text)
    if field and path:
        return f"{path}.{field.group(1)}: {text}"
    return f"{path}: {text}" if path else text


def runtime_dir(config: Config) -> Path:
    """The private directory for the ipc socket (created by the daemon, mode 0700)."""
    if config.server.runtime_dir:
        return Path(config.server.runtime_dir)
    return default_runtime_dir()


def default_runtime_dir() -> Path:
    """$RUNTIME_DIRECTORY (made by systemd for us), else $XDG_RUNTIME_DIR/hicached, else /tmp."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "hicached"
    return Path(f"/tmp/hicached-{os.getuid()}")


def endpoint(config: Config) -> str:
    return config.server.endpoint or f"ipc://{runtime_dir(config)}/hicached.sock"


def default_endpoint() -> str:
    """What a client connects to: $HICACHED_ENDPOINT, else the default ipc socket."""
    return os.environ.get("HICACHED_ENDPOINT") or f"ipc://{default_runtime_dir()}/hicached.sock"


def data_dir(config: Config) -> Path:
    if config.storage.data_dir:
        return Path(config.storage.data_dir)
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "hicached"


def __getattr__(name: str) -> Any:
    """``reload_plan`` and ``RELOADABLE`` moved to hicached/daemon/reload.py; the
    old names keep working for one release."""
    if name in ("reload_plan", "RELOADABLE"):
        from hicached.daemon import reload

        return getattr(reload, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
