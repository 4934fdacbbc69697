"""Clients: the sessions of connected clients, from hello to goodbye.

A session is one client's connection (a ZeroMQ routing id) and, with tenants
on, the peer it is (cache/sessions.py). The table is bounded
(``server.max_clients``): a newcomer to a full table takes the place of the
longest idle session that holds no lease, or is refused. With tenants, a
tenant's sessions are bounded too (its share, cache/shares.py), and a
newcomer takes the place of its own tenant's sessions only (or of an idle
peer of no tenant, which holds status only), never another tenant's: one
tenant cannot lock out or churn another's clients. A session
that ends takes its leases with it (their fresh slots go to quarantine) and
its namespaces lose a user.

A session also holds what its client's process reported of its scattered-copy
kernels (``gather``, protocol 1.5; client/gather.py): facts about the client,
kept for ``stats`` and forgotten with the session.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from typing import TYPE_CHECKING

from hicached.cache.sessions import Handlers, Session
from hicached.cache.shares import NO_TENANT, over, share_of
from hicached.errors import (
    BadRequest,
    ForeignTenant,
    ResourceExhausted,
    SessionLost,
    VersionMismatch,
)
from hicached.state.pool import GEN_GRANULE
from hicached.wire import protocol as p
from hicached.wire.arenas import TenantArena

if TYPE_CHECKING:
    from hicached.cache.desk import Cache

__all__ = ["Clients"]


class Clients:
    """Sessions by routing id, least recently seen first."""

    def __init__(self, desk: Cache) -> None:
        self.desk = desk
        self.sessions: OrderedDict[bytes, Session] = OrderedDict()
        # sessions by share (Session.share), with tenants on: counted at hello and end
        self.held: dict[str, int] = {}
        self._next = 1  # sessions in the order they came (Session.seq)
        self.ids: set[int] = set()  # the sessions' ids
        # tenant arenas (daemon/arenas.py): each tenant's file, the only one its clients map
        self.arenas: dict[str, TenantArena] | None = None

    def use_arenas(self, arenas: list[TenantArena]) -> None:
        """Clients map their tenant's arena (of ``arenas``), not one pool file."""
        self.arenas = {arena.tenant: arena for arena in arenas}

    def hello(self, routing_id: bytes, msg: p.Hello, peer: str | None = None) -> p.HelloOk:
        if msg.major != p.PROTOCOL_MAJOR:
            raise VersionMismatch(
                f"client speaks protocol {msg.major}.{msg.minor}, this daemon speaks "
                f"{p.PROTOCOL_MAJOR}.{p.PROTOCOL_MINOR}: install matching hicached versions"
            )
        desk = self.desk
        config = desk.config
        path, size, base = desk.pool_path, desk.pool.arena_bytes, 0
        if self.arenas is not None:
            if msg.minor < p.ARENAS_MINOR:
                raise VersionMismatch(
                    f"client speaks protocol {msg.major}.{msg.minor}; this daemon keeps tenants' "
                    f"pages in arenas of their own, which clients of {p.PROTOCOL_MAJOR}."
                    f"{p.ARENAS_MINOR} and later map: upgrade the client"
                )
            arena = self.arenas.get(peer or "")
            path, size, base = (str(arena.path), arena.size, arena.start) if arena else ("", 0, 0)
        session = self.sessions.get(routing_id)
        if session is not None:
            _same_peer(session, peer)
        else:
            share = None if peer is None else share_of(peer)
            if share is not None:
                bounds = desk.shares.of(share)
                held = self.held.get(share, 0)
                if bounds is not None and held >= bounds.clients:
                    self._make_room(share, f"{over(share, 'clients', held)}, each with a lease")
            if len(self.sessions) >= config.server.max_clients:
                # status-only peers of no tenant make way for a tenant below its
                # share too: their share and the tenants' add up to more than the
                # table, and any local user could else lock a tenant out
                self._make_room(
                    share, _full(len(self.sessions), config.server.max_clients, share), NO_TENANT
                )
            session_id = self._new_id()
            session = Session(session_id, routing_id, msg.client[:64], msg.pid, desk.clock(), peer)
            session.seq = self._next
            self.ids.add(session_id)
            session.share = share
            self._next += 1
            self.sessions[routing_id] = session
            if share is not None:
                self.held[share] = self.held.get(share, 0) + 1
        return p.HelloOk(
            id=msg.id,
            major=p.PROTOCOL_MAJOR,
            minor=p.PROTOCOL_MINOR,
            instance=desk.instance,
            session=session.id,
            pool_path=path,
            pool_bytes=size,
            lease_ttl_s=config.leases.ttl_s,
            max_message_bytes=config.server.max_message_bytes,
            max_pages_per_request=config.server.max_pages_per_request,
            gen_granule=GEN_GRANULE,
            huge_pages=config.pool.huge_pages,
            pool_id=desk.pool_id,
            pool_base=base,
        )

    def handlers(self) -> Handlers:
        return {p.GatherReport: self.gather}

    def gather(self, session: Session, msg: p.GatherReport) -> p.Ok:
        """Keep the client process's gather report (the last one) for stats."""
        _check_gather(msg)
        session.gather = msg
        return p.Ok(id=msg.id)

    def gather_clients(self, viewer: str | None = None) -> list[p.GatherClient]:
        """The sessions' gather reports, in session order (for stats); with
        tenants on (``viewer`` not None: the asking peer), those of the viewer's
        own sessions only: a report names its client and pid, which another
        tenant is not to see."""
        out = []
        for session in sorted(self.sessions.values(), key=_session_seq):
            g = session.gather
            if g is not None and (viewer is None or session.peer == viewer):
                out.append(
                    p.GatherClient(
                        session=session.id,
                        client=session.client,
                        pid=session.pid,
                        how=g.how,
                        read=g.read,
                        write=g.write,
                        read_numpy_gbps=g.read_numpy_gbps,
                        read_torch_gbps=g.read_torch_gbps,
                        write_numpy_gbps=g.write_numpy_gbps,
                        write_torch_gbps=g.write_torch_gbps,
                        page_bytes=g.page_bytes,
                        sample_pages=g.sample_pages,
                        rounds=g.rounds,
                        seconds=g.seconds,
                    )
                )
        return out

    def _make_room(self, share: str | None, full: str, also: str | None = None) -> None:
        """A bound is reached: the longest idle session without a lease (one
        without namespaces first) makes way; with tenants (``share`` not None)
        only one of the newcomer's own share (or of ``also``: the peers of no
        tenant, at the daemon-wide bound), never another tenant's. With none,
        the newcomer is refused: ``full`` says why.

        Walks the table in order (at most ``server.max_clients`` sessions), on
        a hello at a bound only."""
        fallback = None
        for session in self.sessions.values():  # least recently seen first
            if session.leases or (share is not None and session.share not in (share, also)):
                continue
            if not session.namespaces:
                self.end(session)
                return
            if fallback is None:
                fallback = session
        if fallback is None:
            raise ResourceExhausted(f"{full}: close idle clients or raise the limit")
        self.end(fallback)

    def _new_id(self) -> int:
        """A random id no session has. Not one counted up: the id a tenant's
        client got at hello told it how many clients every tenant had opened
        (since the start, and between two of its own), the activity its stats
        keep from it."""
        session_id = secrets.randbits(31) or 1
        while session_id in self.ids:
            session_id = secrets.randbits(31) or 1
        return session_id

    def session(self, routing_id: bytes, peer: str | None = None) -> Session:
        session = self.sessions.get(routing_id)
        if session is None:
            raise SessionLost("this daemon does not know the client (restarted?): send hello first")
        _same_peer(session, peer)
        session.last_seen = self.desk.clock()
        self.sessions.move_to_end(routing_id)
        return session

    def goodbye(self, routing_id: bytes, peer: str | None = None) -> None:
        session = self.sessions.get(routing_id)
        if session is not None and session.peer == peer:
            self.end(session)

    def end(self, session: Session) -> None:
        """Forget a client: its leases end (write slots to quarantine), its
        namespaces lose a user."""
        del self.sessions[session.routing_id]
        self.ids.discard(session.id)
        if session.share is not None:
            self.held[session.share] -= 1
        desk = self.desk
        for lease_id in list(session.leases):
            lease = desk.leases.get(lease_id)
            if lease is not None:
                desk.leases.pop(lease)
                desk.leasing.end(lease)
        desk.names.left(session)

    def end_idle(self, since: float) -> None:
        """End the sessions without a lease not seen since ``since``."""
        stale = []
        for session in self.sessions.values():  # least recently seen first
            if session.last_seen >= since:
                break
            if not session.leases:
                stale.append(session)
        for session in stale:
            self.end(session)


def _same_peer(session: Session, peer: str | None) -> None:
    """A session's requests come from the peer that opened it; a connection of
    another tenant that reuses its routing id is refused, not served as it."""
    if session.peer != peer:
        raise ForeignTenant(
            "this client id belongs to a session of another peer: connect again "
            "without setting a routing id"
        )


def _full(clients: int, limit: int, share: str | None) -> str:
    """Why a newcomer to a full session table is refused. With tenants (``share``
    not None) the table's count is not said: it adds up every tenant's clients,
    which a tenant's peer is not to learn (stats keep it from them too); the
    bound is the config's."""
    if share is None:
        return f"{clients} clients hold leases, the limit (server.max_clients)"
    whose = "peers of no tenant" if share.startswith("!") else f"tenant {share!r}"
    return (
        f"the daemon's client sessions, every tenant's together, are at their limit "
        f"(server.max_clients = {limit}), and none of {whose} is idle without a lease "
        "(another tenant's never makes way)"
    )


def _session_seq(session: Session) -> int:
    return session.seq


def _check_gather(msg: p.GatherReport) -> None:
    """Names the daemon knows, and a report that agrees with itself: the
    decoder bounded every number and the names' lengths already."""
    if msg.how not in p.GATHER_HOWS:
        raise BadRequest(f"gather report: how {msg.how!r} is none of {', '.join(p.GATHER_HOWS)}")
    for way, kernel in (("read", msg.read), ("write", msg.write)):
        if kernel not in p.GATHER_KERNELS:
            raise BadRequest(
                f"gather report: {way} kernel {kernel!r} is none of {', '.join(p.GATHER_KERNELS)}"
            )
    rates = (msg.read_numpy_gbps, msg.read_torch_gbps, msg.write_numpy_gbps, msg.write_torch_gbps)
    if msg.how == "no_torch" and (msg.read != "numpy" or msg.write != "numpy" or any(rates)):
        raise BadRequest("gather report: without torch both ways are numpy's, unmeasured")
    if msg.how == "forced" and any(rates):
        raise BadRequest("gather report: kernels named by HICACHED_GATHER come with no rates")
