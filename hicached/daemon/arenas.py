"""Tenant arenas: which tenants get a pool file of their own, how large, and
who may open it.

Tenants bound what the daemon answers; arenas bound what a client can read.
With ``[tenants]`` and an ipc endpoint, every tenant that ipc peers can belong
to (it lists ``uids`` or ``gids``, or takes the ``others``) keeps its pages in
an arena of its own (wire/arenas.py), a file that only its identities may
open, and its clients map that file alone. A tenant of CURVE keys only has no
ipc peers and gets no arena; over a tcp endpoint no client maps the pool, so
the pool stays one arena, as without tenants.

Who may open a tenant's file: the daemon's user, and by a POSIX ACL (the
daemon owns the file, so it needs no privilege to set one) each of the
tenant's ``uids`` and ``gids``; the ``others`` tenant's file also its peers,
the members of ``server.client_group`` (without one, only the daemon's own
user reaches the socket at all): the ``others`` tenant's pages are private
from no client, a tenant whose pages must be lists its uids or gids. Where
``pool.shm_dir`` has no ACLs, a tenant of exactly one gid gets the file as its
group (0660: the daemon's user must be in that group or be root); any other
tenant is refused at start.

Sizes: ``tenants.NAME.arena_mib``, or an equal share of what ``pool.size_mib``
leaves, in whole units of a slab and of 4 MiB (one page of generation
counters); the arenas lie in the pool in name order. A tenant's arena is its
bound in L2 beside its quota: a full arena evicts its own pages only.
"""

from __future__ import annotations

import errno
import grp
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from hicached.config import Config, TenantConfig
from hicached.daemon.tenants import listed_members
from hicached.errors import ConfigError
from hicached.wire.arenas import SPAN, TenantArena, tenant_arena_path

log = logging.getLogger("hicached")

MIB = 1 << 20

__all__ = [
    "Grant",
    "arena_layout",
    "check_memberships",
    "checked_layout",
    "grant",
    "has_arena",
]


def has_arena(tenant: TenantConfig) -> bool:
    """Whether ipc peers can belong to ``tenant`` (so it needs an arena)."""
    return bool(tenant.uids or tenant.gids or tenant.others)


def arena_layout(config: Config, endpoint: str, runtime_dir: Path) -> list[TenantArena]:
    """Each tenant's arena, in name order; none without tenants or over tcp."""
    if not config.tenants or not endpoint.startswith("ipc://"):
        return []
    pool = config.pool
    if pool.huge_pages == "hugetlbfs":
        raise ConfigError(
            "pool.huge_pages = hugetlbfs: tenant arenas are mapped one after another into "
            "the daemon's pool, which hugetlbfs pages cannot be; use madvise"
        )
    names = sorted(name for name, tenant in config.tenants.items() if has_arena(tenant))
    if not names:
        return []
    unit = math.lcm(pool.slab_mib * MIB, SPAN)
    total = pool.size_mib * MIB
    sized = {name: config.tenants[name].arena_mib * MIB for name in names}
    for name, size in sized.items():
        if size and size % unit:
            raise ConfigError(
                f"tenants.{name}.arena_mib: {size // MIB} MiB is not a whole number of "
                f"{unit // MIB} MiB (pool.slab_mib and 4 MiB)"
            )
    left = total - sum(sized.values())
    shared = [name for name, size in sized.items() if not size]
    share = left // len(shared) // unit * unit if shared else 0
    if left < 0 or (shared and share < unit):
        raise ConfigError(
            f"pool.size_mib ({pool.size_mib}) does not hold an arena for each of the tenants "
            f"{', '.join(names)}: sized ones take {(total - left) // MIB} MiB, and "
            f"{len(shared)} more need at least {unit // MIB} MiB each (raise pool.size_mib, "
            "or lower tenants.NAME.arena_mib)"
        )
    out, start = [], 0
    for name in names:
        size = sized[name] or share
        out.append(
            TenantArena(name, tenant_arena_path(pool.shm_dir, runtime_dir, name), start, size)
        )
        start += size
    return out


# POSIX ACL as the kernel takes it (system.posix_acl_access): a version, then
# (tag, permissions, id) entries, sorted by tag and id
_ACL_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_RW, _NONE, _NO_ID = 6, 0, 0xFFFFFFFF


def acl(uids: list[int], gids: list[int]) -> bytes:
    """The ACL that lets the owner, ``uids`` and ``gids`` read and write, no one else."""
    entries = [(_USER_OBJ, _RW, _NO_ID)]
    entries += [(_USER, _RW, uid) for uid in sorted(set(uids))]
    entries.append((_GROUP_OBJ, _NONE, _NO_ID))
    entries += [(_GROUP, _RW, gid) for gid in sorted(set(gids))]
    entries += [(_MASK, _RW, _NO_ID), (_OTHER, _NONE, _NO_ID)]
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


@dataclass(frozen=True, slots=True)
class Grant:
    """What gives each arena's file (open as ``fd``, 0600) to its tenant, and
    to whom: ``readers`` goes into the journal, since a restart that would give
    an arena to other identities must not adopt its file (descriptors and
    mappings opened before outlive any new ACL)."""

    config: Config
    client_gid: int | None

    def readers(self, tenant: str) -> tuple[list[int], list[int]]:
        """The uids and gids (sorted) that ``tenant``'s file opens to."""
        config = self.config.tenants[tenant]
        gids = set(config.gids)
        if config.others and self.client_gid is not None:
            gids.add(self.client_gid)  # its peers: whoever reaches the socket
        return sorted(set(config.uids)), sorted(gids)

    def __call__(self, fd: int, arena: TenantArena) -> None:
        uids, gids = self.readers(arena.tenant)
        try:
            os.setxattr(fd, "system.posix_acl_access", acl(uids, gids))
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP):
                raise ConfigError(
                    f"tenants.{arena.tenant}: cannot give its arena {arena.path} to its "
                    f"uids and gids: {exc.strerror}"
                ) from None
        if not uids and len(gids) <= 1:  # no ACLs here: its one group, or the daemon alone
            try:
                if gids:
                    os.fchown(fd, -1, gids[0])
                    os.fchmod(fd, 0o660)
                else:
                    os.fchmod(fd, 0o600)  # an adopted file may have been a group's
                return
            except OSError as exc:
                raise ConfigError(
                    f"tenants.{arena.tenant}: cannot give its arena {arena.path} to group "
                    f"{gids[0] if gids else os.getgid()}: {exc.strerror} (the daemon's user "
                    "must be in that group)"
                ) from None
        raise ConfigError(
            f"tenants.{arena.tenant}: pool.shm_dir ({arena.path.parent}) has no POSIX ACLs, "
            "so its arena can be given to one group only: list a single gid (and no uids) "
            "for this tenant, or put pool.shm_dir on a tmpfs with ACLs"
        )


def grant(config: Config, client_gid: int | None) -> Grant:
    """What gives each arena's file to its tenant (``client_gid``: the clients'
    group, which the ``others`` tenant's file opens to)."""
    return Grant(config, client_gid)


def checked_layout(config: Config, endpoint: str, runtime_dir: Path) -> list[TenantArena]:
    """Each tenant's arena (``arena_layout``), once the accounts that could
    open them are checked (``check_memberships``): what the start refuses of
    tenant arenas before it makes a file. ``hicached check-config`` calls it
    too, so the two refuse the same configs with the same messages."""
    layout = arena_layout(config, endpoint, runtime_dir)
    if layout:
        check_memberships(config)
    return layout


def check_memberships(config: Config) -> None:
    """Refuse tenants whose files another tenant's accounts could open: a local
    account that belongs to one tenant (by its uid, else its primary group, else
    a listed group it is in, as daemon/tenants.py decides) but is in a group
    another tenant's arena is given to, or that is in groups of several tenants.
    Accounts as passwd and group list them, read in one pass for the groups the
    tenants list (``listed_members``); root and the daemon's own user open every
    file anyway."""
    by_uid = {uid: name for name, t in config.tenants.items() for uid in t.uids}
    by_gid = {gid: name for name, t in config.tenants.items() for gid in t.gids}
    others = next((name for name, t in config.tenants.items() if t.others), "")
    # group -> the tenant whose arena it opens. The client group, which opens the
    # others tenant's, is not one of them: every peer that reaches the socket is
    # in it, and may be one of the others tenant's (documented)
    granted: dict[int, str] = dict(by_gid)
    if not granted:
        return
    me = os.getuid()
    for user, member in listed_members(granted):
        if user.pw_uid in (0, me):
            continue
        groups = sorted(member)
        listed = sorted({granted[gid] for gid in groups})
        tenant = by_uid.get(user.pw_uid) or by_gid.get(user.pw_gid)
        if not tenant and len(listed) > 1:
            named = ", ".join(f"{_group_name(gid)} of {granted[gid]!r}" for gid in groups)
            raise ConfigError(
                f"tenants: user {user.pw_name} (uid {user.pw_uid}) is in groups of tenants "
                f"{' and '.join(map(repr, listed))} ({named}), whose arenas it could open "
                "all: take it out of all but one tenant's groups"
            )
        tenant = tenant or (listed[0] if listed else others)
        if not tenant:
            continue
        for gid in groups:
            owner = granted[gid]
            if owner != tenant:
                raise ConfigError(
                    f"tenants: user {user.pw_name} (uid {user.pw_uid}) belongs to tenant "
                    f"{tenant!r} but is in group {_group_name(gid)}, which opens the arena of "
                    f"tenant {owner!r}: take it out of that group, or list it with {owner!r}"
                )


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} ({gid})"
    except KeyError:
        return str(gid)
