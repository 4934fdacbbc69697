"""Shares: each tenant's part of the bounds every client shares.

``server.max_clients``, ``leases.max_leases`` and ``pool.max_namespaces``
bound what all clients hold together. With ``[tenants]`` each tenant has a
bound of its own within each of them (``tenants.NAME.max_clients``,
``max_leases``, ``max_namespaces``; 0 = an equal share, the daemon-wide bound
divided by the number of tenants, rounded up), so that one tenant's clients
cannot take every session, lease or namespace and leave the others refused.
Peers that no tenant lists (``Session.peer`` "!...", which get status only)
share one bound on sessions, a tenant's equal share of ``server.max_clients``;
they hold no lease and no namespace.

The bounds are worked out once per config (start, reload); the counts held
against them are kept by the rooms that open and close what they count
(cache/clients.py, the lease table, cache/namespaces.py), one step on each
open and close: a request never counts by walking a table.
"""

from __future__ import annotations

from typing import NamedTuple

from hicached.config import Config

__all__ = ["NO_TENANT", "Bounds", "Shares", "equal_share", "over", "share_of"]

# The share of every peer no tenant lists ("!..." in Session.peer).
NO_TENANT = "!"


def share_of(peer: str) -> str:
    """The share a peer counts against: its tenant's, or that of the peers of no tenant."""
    return NO_TENANT if peer.startswith("!") else peer


def equal_share(bound: int, tenants: int) -> int:
    """A tenant's equal share of ``bound`` among ``tenants``: rounded up, at least 1."""
    return max(1, -(-bound // max(1, tenants)))


class Bounds(NamedTuple):
    """One share's bounds: sessions, open leases and live namespaces at once."""

    clients: int
    leases: int
    namespaces: int


class Shares:
    """Each share's bounds under one config; none without ``[tenants]``."""

    def __init__(self, config: Config) -> None:
        self.bounds: dict[str, Bounds] = {}
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Work the bounds out again (at start, and on a reload)."""
        n = len(config.tenants)
        clients = equal_share(config.server.max_clients, n)
        leases = equal_share(config.leases.max_leases, n)
        namespaces = equal_share(config.pool.max_namespaces, n)
        bounds = {
            name: Bounds(
                tenant.max_clients or clients,
                tenant.max_leases or leases,
                tenant.max_namespaces or namespaces,
            )
            for name, tenant in config.tenants.items()
        }
        if bounds:
            bounds[NO_TENANT] = Bounds(clients, 0, 0)
        self.bounds = bounds

    def of(self, share: str) -> Bounds | None:
        """``share``'s bounds; None for a name no configured tenant has (a
        namespace of a tenant the config no longer lists, adopted at start)."""
        return self.bounds.get(share)


def over(share: str, what: str, held: int) -> str:
    """Why a request of ``share`` is refused at its bound of ``what``."""
    if share == NO_TENANT:
        return (
            f"peers that belong to no tenant hold {held} {what}, their limit (a tenant's "
            "equal share of server.max_clients)"
        )
    return f"tenant {share!r} holds {held} {what}, its limit (tenants.{share}.max_{what})"
