"""Who may connect, as the config says it: CURVE keys for tcp:// sockets and
tenants (``[curve]``, ``[tenants.NAME]``; docs/operations.md). Sections of
hicached.config, which names them as its own."""

from __future__ import annotations

import re

import msgspec

_Section = {"kw_only": True, "forbid_unknown_fields": True}


class CurveConfig(msgspec.Struct, **_Section):
    """CURVE authentication and encryption of every tcp:// socket (docs/operations.md)."""

    # The daemon's secret certificate, as `hicached keygen` writes it; "" = no
    # CURVE, and tcp:// endpoints on loopback only.
    secret_key_file: str = ""
    # Directory of the public certificates (*.key) of the clients and event
    # subscribers allowed to connect; required with secret_key_file.
    authorized_keys_dir: str = ""

    def __post_init__(self) -> None:
        if bool(self.secret_key_file) != bool(self.authorized_keys_dir):
            raise ValueError("secret_key_file and authorized_keys_dir go together")
        for name in ("secret_key_file", "authorized_keys_dir"):
            value = getattr(self, name)
            if value and not value.startswith("/"):
                raise ValueError(f"{name} must be an absolute path")


# A tenant's part of each bound all clients share: its key in [tenants.NAME] ->
# the daemon-wide key it is a part of.
SHARED_BOUNDS = {
    "max_clients": "server.max_clients",
    "max_leases": "leases.max_leases",
    "max_namespaces": "pool.max_namespaces",
}

# Local user and group ids are below this (32 bits, and (uid_t)-1 means none).
MAX_ID = (1 << 32) - 1

# A tenant's name, as in the namespace field it fills (wire/namespace.py checks the same).
TENANT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class TenantConfig(msgspec.Struct, **_Section):
    """One tenant, ``[tenants.NAME]``: which peers belong to it and how much of
    L2 it may hold (docs/operations.md, Tenants)."""

    # Local user ids whose ipc connections belong to this tenant (the peer's
    # credentials as the kernel reports them when it connects).
    uids: list[int] = msgspec.field(default_factory=list)
    # Local group ids: an ipc peer whose uid no tenant lists belongs to the
    # tenant that lists its current (effective) group id, else to the tenant that
    # lists a group its user is a member of (primary or supplementary, as passwd
    # and group say; of several tenants' groups, the first tenant by name).
    gids: list[int] = msgspec.field(default_factory=list)
    # CURVE public certificates (NAME.key, as `hicached keygen` writes them) of the
    # tcp clients that belong to this tenant; a relative name is looked up in
    # curve.authorized_keys_dir. A key must be authorized there as well.
    curve_keys: list[str] = msgspec.field(default_factory=list)
    # Peers that no tenant lists belong to this one; at most one tenant says so.
    # With none, such peers get status only: every namespace is refused them.
    others: bool = False
    # Most L2 slots the tenant's pages may take (stored, being filled, or on their
    # way back); 0 = no limit. Past it, its own least recently used pages make
    # way, never another tenant's and never a leased one. Changes on SIGHUP.
    max_pages: int = 0
    # The same bound in MiB of slots; 0 = no limit. Changes on SIGHUP.
    max_mib: int = 0
    # Over an ipc endpoint each tenant with uids, gids or others has an arena of its
    # own: a pool file only its identities may open. Its size in MiB (whole slabs and
    # a multiple of 4 MiB); 0 = an equal share of what pool.size_mib leaves after the
    # arenas sized here. Its pages never leave it and no other tenant's enter it.
    # Only a restart changes it.
    arena_mib: int = 0
    # The tenant's part of the daemon's shared bounds (cache/shares.py): client
    # sessions, open leases and live namespaces its peers may hold at once, so
    # that one tenant's clients cannot take them all. 0 = an equal share: the
    # daemon-wide bound (server.max_clients, leases.max_leases,
    # pool.max_namespaces) divided by the number of tenants, rounded up; at most
    # that bound. Change on SIGHUP.
    max_clients: int = 0
    max_leases: int = 0
    max_namespaces: int = 0

    def problem(self) -> str:
        """What is wrong with this table on its own ("" when nothing), as
        "key: why"; Config names the tenant (msgspec cannot name a dict's key)."""
        for name in ("max_pages", "max_mib", "arena_mib"):
            if getattr(self, name) < 0:
                return f"{name}: must be 0 (no limit) or positive"
        for name in SHARED_BOUNDS:
            if getattr(self, name) < 0:
                return f"{name}: must be 0 (an equal share) or positive"
        for name in ("uids", "gids"):
            # the kernel's ids are 32 bits, and (uid_t)-1 is no id: one past them never matches
            if any(not 0 <= i < MAX_ID for i in getattr(self, name)):
                return f"{name}: ids are 0 to {MAX_ID - 1}"
        for key in self.curve_keys:
            if not key or ".." in key.split("/"):
                return f"curve_keys: {key!r} is not a certificate file name"
        return ""
