"""The daemon as SGLang's storage threads reach it: a client per thread, the
namespaces it registered, and a pause after the daemon was found away.

SGLang calls a backend from three threads (existence queries, prefetch
reads, write-backs); each gets a client of its own, and registers a pool's
namespace the first time a call of that thread names the pool (pools may be
registered after the others, SGLang's dynamic sidecars). A daemon that is
down costs hits, never a request or a thread: a call answers None, and the
thread does not try the daemon again for ``retry_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import zmq

from hicached.client import Client
from hicached.client.handles import Namespace
from hicached.errors import DaemonUnavailable, DeadlineExceeded, HicachedError

log = logging.getLogger("hicached.integrations.sglang")
T = TypeVar("T")

# "The daemon is not there now": try again after retry_s. OSError and ZMQError come
# from connecting again after a restart (a pool file not readable yet, a socket).
UNREACHABLE = (DaemonUnavailable, DeadlineExceeded, OSError, zmq.ZMQError)


class Session:
    """One thread's client and the namespaces it registered, by pool name."""

    __slots__ = ("client", "down_until", "fields", "spaces")

    def __init__(self, fields: dict[str, dict[str, Any]]) -> None:
        self.fields = fields
        self.client: Client | None = None
        self.spaces: dict[str, Namespace] = {}
        self.down_until = 0.0  # monotonic: calls are misses until then

    def ns(self, pool: str) -> Namespace:
        """The namespace of ``pool``'s pages, registered on first use."""
        space = self.spaces.get(pool)
        if space is None:
            assert self.client is not None, "a session's namespace before its client"
            space = self.spaces[pool] = self.client.register(**self.fields[pool])
        return space


class Link:
    """Per-thread sessions with one daemon; ``fields`` holds the namespace of
    every pool registered so far (pool name -> ``Client.register`` fields)."""

    def __init__(self, endpoint: str, timeout_s: float, retry_s: float, name: str) -> None:
        self.endpoint = endpoint or None
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.name = name
        self.fields: dict[str, dict[str, Any]] = {}
        self._local = threading.local()
        self._clients: list[Client] = []
        self._lock = threading.Lock()  # guards _clients

    def check(self, pools: Iterable[str]) -> None:
        """Register the namespaces of ``pools`` once, so that a page the daemon
        refuses fails at startup (``HicachedError``); a daemon that is down is
        not an error."""
        try:
            with Client(self.endpoint, timeout=self.timeout_s) as c:
                for pool in pools:
                    c.register(**self.fields[pool])
        except UNREACHABLE as exc:
            log.warning("hicached: no daemon yet (%s); pages are misses until there is one", exc)

    def call(self, fn: Callable[[Client, Session], T]) -> T | None:
        """``fn`` with this thread's client and session; None when the daemon is
        down (then it is not asked again for ``retry_s``) or refuses the request."""
        session: Session | None = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = Session(self.fields)
        if time.monotonic() < session.down_until:
            return None
        try:
            if session.client is None:
                self._connect(session)
            assert session.client is not None
            return fn(session.client, session)
        except UNREACHABLE as exc:
            session.down_until = time.monotonic() + self.retry_s
            log.warning("hicached: daemon unreachable (%s); misses for %gs", exc, self.retry_s)
        except HicachedError as exc:
            log.warning("hicached: %s: %s", type(exc).__name__, exc)
        return None

    def close(self) -> None:
        """Close every thread's client (the daemon ends their leases)."""
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception as exc:  # shutting down: nothing left to tell
                log.debug("hicached: closing a client: %s", exc)

    def _connect(self, session: Session) -> None:
        name = f"{self.name}-{threading.current_thread().name}"
        client = Client(self.endpoint, timeout=self.timeout_s, name=name)
        try:
            client.connect()
        except BaseException:
            client.close()
            raise
        session.client, session.spaces = client, {}
        with self._lock:
            self._clients.append(client)
