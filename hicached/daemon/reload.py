"""What a reload (SIGHUP) changes: the keys a running daemon takes again from
its config file, and the plan that mixes the running config with the new one.

Any other change is refused until a restart, each refused key named in the
log (docs/operations.md, Reloading).
"""

from __future__ import annotations

from typing import Any

import msgspec

from hicached.config import Config, leaves, with_dotted_path
from hicached.errors import ConfigError

__all__ = ["RELOADABLE", "reload_plan"]

# What a running daemon takes again from its config file on SIGHUP (docs/operations.md,
# Reloading); any other change needs a restart. The quotas of the tenants it runs
# with (tenants.NAME.max_pages and max_mib) and their shares of the shared bounds
# (max_clients, max_leases, max_namespaces) change too.
RELOADABLE = frozenset(
    {
        "server.max_clients",
        "server.session_idle_s",
        "server.drain_batch",
        "pool.max_namespaces",
        "leases.max_leases",
        "leases.sweep_interval_s",
        "leases.quarantine_s",
        "storage.write_policy",
        "storage.selective_hits",
        "storage.flush_deadline_s",
        "log.level",
    }
)
_RELOADABLE_TENANT_KEYS = ("max_pages", "max_mib", "max_clients", "max_leases", "max_namespaces")


def reload_plan(running: Config, wanted: Config) -> tuple[Config, dict[str, Any], list[str]]:
    """What a reload does: the config to run with (``wanted``'s value of every key
    that may change at run time, ``running``'s of the others), the keys that
    change with their new values, and the keys whose change is refused until a
    restart. ConfigError when that mix is not a valid config."""
    now = leaves(msgspec.to_builtins(running))
    new = leaves(msgspec.to_builtins(wanted))
    merged = msgspec.to_builtins(running)
    applied: dict[str, Any] = {}
    refused: list[str] = []
    for key in sorted(set(now) | set(new)):
        if now.get(key, _ABSENT) == new.get(key, _ABSENT):
            continue
        if key in now and key in new and _reloadable(key, running):
            applied[key] = new[key]
            _set(merged, _parts(key, running, wanted), new[key])
            continue
        parts = _parts(key, running, wanted)
        if (
            parts[0] == "tenants"
            and len(parts) > 1
            and not (parts[1] in running.tenants and parts[1] in wanted.tenants)
        ):
            key = f"tenants.{parts[1]}"  # a tenant added or removed, as a whole
        if key not in refused:
            refused.append(key)
    try:
        config = msgspec.convert(merged, Config)
    except msgspec.ValidationError as exc:
        why = with_dotted_path(str(exc))
        if refused:  # the file alone is valid: a value it names may not be the one checked
            why += f" (with the running value of {', '.join(refused)}: only a restart changes it)"
        raise ConfigError(why) from None
    return config, applied, refused


_ABSENT = object()


def _parts(key: str, *configs: Config) -> list[str]:
    """A dotted key's parts; a tenant's name is one part, dots and all
    (``tenants.a.b.max_pages``: tenant ``a.b``, knob ``max_pages``)."""
    if not key.startswith("tenants."):
        return key.split(".")
    rest = key[len("tenants.") :]
    if any(rest in config.tenants for config in configs):  # a tenant's table, whole
        return ["tenants", rest]
    name, _, knob = rest.rpartition(".")
    return ["tenants", name, knob] if name else ["tenants", rest]


def _reloadable(key: str, running: Config) -> bool:
    if key in RELOADABLE:
        return True
    parts = _parts(key, running)
    return (
        len(parts) == 3
        and parts[0] == "tenants"
        and parts[1] in running.tenants
        and parts[2] in _RELOADABLE_TENANT_KEYS
    )


def _set(table: dict[str, Any], parts: list[str], value: Any) -> None:
    *parents, last = parts
    for part in parents:
        table = table[part]
    table[last] = value
