"""Tenants: who a connection is, from what the kernel or its CURVE key says.

With ``[tenants]`` configured, the request socket asks the context's ZAP
handler (``PeerAuthenticator``) about every connection: libzmq hands it an ipc
peer's credentials as the kernel reports them (SO_PEERCRED, in the address
``<host>:<uid>:<gid>:<pid>``) and a tcp peer's CURVE public key. It answers the
tenant's name as the connection's User-Id, which libzmq attaches to every
message of that connection (``user_id``), and the cache checks each request
against it. An ipc peer that runs as root or as the daemon's own user (who
can read the daemon's memory anyway) is marked the operator as well, in a
property of the connection (``is_operator``): its stats carry the daemon's
totals even where a tenant lists it.

An ipc peer's tenant: the one that lists its uid, else the one that lists its
current (effective) gid, else the one that lists a group its user is a member
of, else the others tenant. The kernel reports one gid, the current one, which
a user changes at will among its groups (``sg``, ``newgrp``); without the
membership rule a user whom a tenant lists by a group would connect with
another current gid as a peer of no tenant, which sees the daemon's totals.
Membership is what the user and group databases say (``os.getgrouplist``), not
the groups of the connecting process, which the kernel does not report; the
lookups may be slow (NSS, LDAP) and run on the ZAP handler's thread, which
every new connection waits on, so each uid's answer is kept a while
(``Memberships``). The start's check of every account (daemon/arenas.py) reads
the same answer for all users at once (``listed_members``): one lookup per
user would ask the group database tens of thousands of times on a host with
that many users.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import time
from collections.abc import Callable, Iterable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from hicached.config import TenantConfig

TENANT_DOMAIN = b"hicached-tenants"
# ZAP domain of the KV events' tcp sockets with tenants: a key that a tenant lists
# is refused there, since the events name every tenant's pages and token ids
EVENTS_DOMAIN = b"hicached-events"
UNIDENTIFIED = "!a peer the daemon could not identify"
# The connection property (ZAP metadata) that marks the operator's connections.
OPERATOR = "X-Hicached-Operator"
# How long a uid's group membership is kept, and for how many uids at most.
MEMBERSHIP_TTL_S = 60.0
MEMBERSHIP_MAX_UIDS = 4096

log = logging.getLogger("hicached.auth")


def ipc_credentials(address: str) -> tuple[int, int, int] | None:
    """(uid, gid, pid) from the address libzmq reports for an ipc peer,
    "<host>:<uid>:<gid>:<pid>" (the kernel's peer credentials); None for another."""
    parts = address.rsplit(":", 3)
    if len(parts) == 4 and all(part.isascii() and part.isdigit() for part in parts[1:]):
        uid, gid, pid = (int(part) for part in parts[1:])
        return uid, gid, pid
    return None


def user_groups(uid: int) -> list[int]:
    """The groups ``uid``'s user is a member of as passwd and group list them
    now: its primary group and its supplementary ones; none for a uid without a
    passwd entry (a process may run as any uid)."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return []
    try:
        return os.getgrouplist(user.pw_name, user.pw_gid)
    except OSError:
        return [user.pw_gid]


def listed_members(listed: Iterable[int]) -> list[tuple[pwd.struct_passwd, frozenset[int]]]:
    """Each passwd entry with the groups of ``listed`` its user is a member of,
    by ``user_groups``'s rule (its primary group, and each group whose member
    list names the user), from one pass over each database rather than one
    group lookup per user. The group entries: every source's (``grp.getgrall``;
    a gid that two sources list has the members of both, as getgrouplist
    merges them), and each listed gid asked by number as well, which a source
    that does not enumerate its groups (sssd by default) still answers."""
    wanted = frozenset(listed)
    named: dict[str, set[int]] = {}  # user name -> listed groups whose member list names it
    if wanted:
        entries = [group for group in grp.getgrall() if group.gr_gid in wanted]
        for gid in sorted(wanted):
            with contextlib.suppress(KeyError, OverflowError):  # no such group: no members
                entries.append(grp.getgrgid(gid))
        for group in entries:
            for name in group.gr_mem:
                named.setdefault(name, set()).add(group.gr_gid)
    out = []
    for user in pwd.getpwall():
        groups = named.get(user.pw_name, set())
        if user.pw_gid in wanted:
            groups = groups | {user.pw_gid}
        out.append((user, frozenset(groups)))
    return out


class Memberships:
    """Which of the listed groups each uid's user is a member of, by ``lookup``
    (``user_groups``), kept ``ttl_s`` seconds for at most ``limit`` uids: a
    group added or taken away counts for new connections within ``ttl_s``.
    Owned by the ZAP handler's thread."""

    def __init__(
        self,
        listed: Iterable[int],
        lookup: Callable[[int], Iterable[int]] = user_groups,
        *,
        ttl_s: float = MEMBERSHIP_TTL_S,
        limit: int = MEMBERSHIP_MAX_UIDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert limit > 0, f"a bound of {limit} uids"
        self.listed = frozenset(listed)
        self.lookup = lookup
        self.ttl_s = ttl_s
        self.limit = limit
        self.clock = clock
        # uid -> (when the answer expires, the listed groups it is in), oldest first
        self.known: dict[int, tuple[float, frozenset[int]]] = {}

    def of(self, uid: int) -> frozenset[int]:
        """The listed groups ``uid``'s user is a member of."""
        now = self.clock()
        kept = self.known.get(uid)
        if kept is not None and now < kept[0]:
            return kept[1]
        groups = self.listed.intersection(self.lookup(uid)) if self.listed else frozenset()
        self.known.pop(uid, None)
        if len(self.known) >= self.limit:
            del self.known[next(iter(self.known))]  # the oldest answer expires first
        self.known[uid] = (now + self.ttl_s, groups)
        return groups


class TenantMap:
    """Who a peer is: its tenant's name, or "!<what it is>" when no tenant lists
    it and none takes the others. ``lookup``: the groups of a uid's user
    (``user_groups``; tests give their own)."""

    def __init__(
        self,
        tenants: dict[str, TenantConfig],
        keys: dict[bytes, str],
        *,
        ipc: bool,
        lookup: Callable[[int], Iterable[int]] = user_groups,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.by_uid = {uid: name for name, t in tenants.items() for uid in t.uids}
        self.by_gid = {gid: name for name, t in tenants.items() for gid in t.gids}
        self.by_key = keys  # Z85 public key -> tenant
        self.others = next((name for name, t in tenants.items() if t.others), "")
        self.ipc = ipc
        self.members = Memberships(self.by_gid, lookup, clock=clock)
        # (uid, its tenants) already warned of: a user in several tenants' groups
        self.warned: set[tuple[int, tuple[str, ...]]] = set()

    def of_address(self, address: str) -> str:
        """A peer without CURVE, by the address libzmq reports: over ipc
        "<host>:<uid>:<gid>:<pid>" from the kernel's peer credentials; over
        tcp an IP address, which says nothing of who the peer is."""
        credentials = ipc_credentials(address) if self.ipc else None
        if credentials is not None:
            uid, gid, pid = credentials
            return self.listed(uid, gid) or self.others or f"!uid {uid}, gid {gid}, pid {pid}"
        what = "an ipc peer without credentials" if self.ipc else f"tcp {address} without CURVE"
        return self.others or f"!{what}"

    def listed(self, uid: int, gid: int) -> str:
        """The tenant that lists ``uid``, else its current ``gid``, else a group its
        user is a member of ("" when none; the others tenant is not counted)."""
        return self.by_uid.get(uid) or self.by_gid.get(gid) or self._member(uid)

    def _member(self, uid: int) -> str:
        """The tenant of a listed group that ``uid``'s user is a member of; of
        several tenants' groups, the first tenant by name ("" when none). Root
        and the daemon's own user are the operator, whatever their groups: only
        their uid and current gid name a tenant of theirs."""
        if not self.by_gid or uid in (0, os.getuid()):
            return ""
        tenants = tuple(sorted({self.by_gid[gid] for gid in self.members.of(uid)}))
        if len(tenants) > 1 and (uid, tenants) not in self.warned:
            if len(self.warned) >= self.members.limit:
                self.warned.clear()
            self.warned.add((uid, tenants))
            log.warning(
                "uid %d is a member of groups of tenants %s: its connections whose "
                "current gid no tenant lists belong to %s, the first by name; take it "
                "out of all but one tenant's groups",
                uid,
                ", ".join(tenants),
                tenants[0],
            )
        return tenants[0] if tenants else ""

    def operator(self, address: str) -> bool:
        """Whether an ipc peer (its address as ``of_address`` reads it) runs as
        root or as this daemon's user."""
        parts = address.rsplit(":", 3)
        if not (self.ipc and len(parts) == 4 and parts[1].isdigit()):
            return False
        return int(parts[1]) in (0, os.getuid())

    def of_key(self, key: bytes) -> str:
        """A peer whose (authorized) CURVE public key is ``key`` (Z85)."""
        return self.by_key.get(key) or self.others or f"!CURVE key {key.decode()}"


class PeerAuthenticator(ThreadAuthenticator):
    """The ZAP handler of the daemon's context. On the request socket with
    tenants (TENANT_DOMAIN) it admits every ipc peer and every tcp peer whose
    CURVE key is authorized, and answers the peer's tenant as the connection's
    User-Id; the cache refuses what that tenant may not do. On other sockets
    it checks CURVE keys as configured (``configure_curve``)."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        tenants: TenantMap | None,
        authorized: set[bytes],
    ) -> None:
        super().__init__(context, log=logging.getLogger("hicached.auth"))
        self.tenants = tenants
        self.authorized = authorized  # Z85 public keys of curve.authorized_keys_dir

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        tenants = self.tenants
        if tenants is None or len(msg) < 6 or msg[2] not in (TENANT_DOMAIN, EVENTS_DOMAIN):
            await super().handle_zap_message(msg)
            return
        version, request_id, domain, address, _identity, mechanism = msg[:6]
        credentials = msg[6:]
        where = address.decode("utf-8", "replace")
        if version != b"1.0":
            self._send_zap_reply(request_id, b"400", b"Invalid version")
            return
        if domain == EVENTS_DOMAIN:
            self._events_peer(request_id, where, mechanism, credentials)
            return
        operator = False
        if mechanism == b"NULL":
            peer = tenants.of_address(where)
            operator = tenants.operator(where)
        elif mechanism == b"CURVE" and len(credentials) == 1:
            key = z85.encode(credentials[0])
            if key not in self.authorized:
                self.log.debug("refused %s: CURVE key %s is not authorized", where, key.decode())
                self._send_zap_reply(request_id, b"400", b"Unknown key")
                return
            peer = tenants.of_key(key)
        else:
            self._send_zap_reply(request_id, b"400", b"Unsupported mechanism")
            return
        self.log.debug(
            "peer %s: %s", where, f"tenant {peer}" if peer[0] != "!" else f"no tenant ({peer[1:]})"
        )
        name, value = OPERATOR.encode(), b"1" if operator else b"0"
        metadata = bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value
        self.zap_socket.send_multipart(
            [b"1.0", request_id, b"200", b"OK", peer.encode("utf-8", "replace"), metadata]
        )

    def _events_peer(
        self, request_id: bytes, where: str, mechanism: bytes, credentials: list[bytes]
    ) -> None:
        """A subscriber of the KV events, with tenants: over tcp an authorized
        CURVE key that no tenant lists (a router's), over ipc a peer that no
        tenant lists by its uid, its current gid or a group its user is in (a
        router's user in events.group; root and the daemon's user always); a
        tenant's client reads its own pages through requests, never every
        tenant's through the events."""
        assert self.tenants is not None
        if mechanism == b"NULL":
            self._events_ipc_peer(request_id, where)
            return
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and len(credentials) == 1 else b""
        if not key or key not in self.authorized:
            self._send_zap_reply(request_id, b"400", b"Unknown key")
            return
        tenant = self.tenants.by_key.get(key)
        if tenant is not None:
            self.log.warning(
                "KV events: refused %s: its CURVE key %s is tenant %s's, and the events "
                "name every tenant's pages",
                where,
                key.decode(),
                tenant,
            )
            self._send_zap_reply(request_id, b"400", b"A tenant's key")
            return
        self._send_zap_reply(request_id, b"200", b"OK", "events")

    def _events_ipc_peer(self, request_id: bytes, where: str) -> None:
        assert self.tenants is not None
        credentials = ipc_credentials(where)
        if credentials is None:  # not an ipc peer: over tcp the events need CURVE
            self._send_zap_reply(request_id, b"400", b"Unknown peer")
            return
        uid, gid, pid = credentials
        tenant = "" if uid in (0, os.getuid()) else self.tenants.listed(uid, gid)
        if tenant:
            self.log.warning(
                "KV events: refused uid %d, gid %d, pid %d: it belongs to tenant %s, and the "
                "events name every tenant's pages; take its user out of events.group",
                uid,
                gid,
                pid,
                tenant,
            )
            self._send_zap_reply(request_id, b"400", b"A tenant's peer")
            return
        self._send_zap_reply(request_id, b"200", b"OK", "events")


def is_operator(frame: zmq.Frame) -> bool:
    """Whether the message's connection is the operator's (``OPERATOR``)."""
    try:
        return bool(frame.get(OPERATOR) == "1")
    except zmq.ZMQError:  # the connection did not pass the ZAP handler
        return False


def user_id(frame: zmq.Frame) -> str:
    """The User-Id libzmq attached to a message: the peer's tenant (PeerAuthenticator)."""
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError:  # the connection did not pass the ZAP handler
        return UNIDENTIFIED
    return value if isinstance(value, str) and value else UNIDENTIFIED
