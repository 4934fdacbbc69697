"""Where the daemon's sockets may listen, told from their addresses alone:
ipc paths (absolute, never abstract) and tcp on loopback unless CURVE guards
the socket; no two sockets on one address."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from urllib.parse import urlsplit


def check_endpoint(endpoint: str, *, remote: bool = False) -> None:
    """Accept ipc:// with an absolute path, or tcp:// on a loopback address
    (on any address with ``remote``, i.e. when CURVE guards it)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if path.startswith("@"):
            raise ValueError(
                f"endpoint {endpoint!r}: abstract ipc sockets accept any local user; "
                "use a path inside a private directory"
            )
        if not path.startswith("/"):
            raise ValueError(f"endpoint {endpoint!r}: the ipc path must be absolute")
        return
    if endpoint.startswith("tcp://"):
        parts = urlsplit(endpoint)
        host = parts.hostname or ""
        try:
            port = parts.port
        except ValueError:
            port = None
        if port is None or port == 0:
            raise ValueError(
                f"endpoint {endpoint!r}: give an explicit port, like tcp://127.0.0.1:5557"
            )
        if host != "localhost" and not remote:
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise ValueError(
                    f"endpoint {endpoint!r}: tcp is allowed on loopback only "
                    "(127.0.0.0/8, ::1 or localhost) unless [curve] keys are configured"
                )
        return
    raise ValueError(f"endpoint {endpoint!r}: use ipc:///absolute/path or tcp://127.0.0.1:PORT")


def check_distinct(endpoints: Sequence[tuple[str, str]]) -> None:
    """No two of the daemon's sockets (``(key, endpoint)``; empty: none) on one
    address. A second ipc bind takes the path from the first without an error
    (ZeroMQ replaces the socket file), so the first would be left unreachable
    while the daemon runs."""
    seen: dict[str, str] = {}
    for key, value in endpoints:
        if not value:
            continue
        address = value
        if value.startswith("ipc://"):
            address = "ipc://" + os.path.normpath(value[len("ipc://") :])
        first = seen.setdefault(address, key)
        if first != key:
            raise ValueError(
                f"{key}: {value!r} is the same address as {first}'s; give each "
                "socket an address of its own"
            )
