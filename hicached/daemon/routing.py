"""Routing ids a peer cannot foresee, so that no peer can make the daemon abort.

A ROUTER socket names each connection by a routing id: the one the peer
sets (``ZMQ_ROUTING_ID``), or, for a peer that sets none (every hicached
client), one libzmq makes: a zero byte and a 32-bit counter that goes up by
one a connection. libzmq refuses a peer that sets an id already in use, but
checks none it makes itself: when the id it makes next is one a peer set
before, it fails an assertion and aborts the process (libzmq 4.3.5,
``socket_base.cpp``). libzmq starts each ROUTER's counter with the C
library's ``rand()``, which nothing seeds, so in every daemon it started at
the same value: a peer that connected with the next few ids set by hand
stopped the daemon at the next connection of any client.

``unpredictable_routing_ids`` seeds ``rand()`` from the operating system's
randomness before the daemon makes its sockets, so a peer no longer knows
where the counters start. A peer must then find a live id by trial, one
connection per guess among 2^32 (docs/operations.md, Access).
"""

from __future__ import annotations

import ctypes
import logging
import secrets

log = logging.getLogger("hicached")


def unpredictable_routing_ids() -> bool:
    """Seed the C library's ``rand()``, from which libzmq starts the routing ids
    of each ROUTER socket made after this; call it before the first socket.
    False (logged) where the C library cannot be reached: the daemon runs on,
    with the counters where libzmq puts them."""
    try:
        libc = ctypes.CDLL(None)
        srand = libc.srand
    except (OSError, AttributeError) as exc:  # pragma: no cover - no C library to seed
        log.warning(
            "cannot seed the C library's rand() (%s): a peer that can connect may foresee "
            "the routing ids libzmq gives and make the daemon abort",
            exc,
        )
        return False
    srand.argtypes = [ctypes.c_uint]
    srand.restype = None
    srand(secrets.randbits(32))
    return True
