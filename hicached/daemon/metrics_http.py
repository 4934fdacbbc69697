"""The metrics endpoint over HTTP(S): the listener, its TLS, and who may scrape.

A loopback port is open to every local user. With ``[tenants]`` that includes
every tenant's users, and the metrics name every tenant with its pages, hits
and bytes; tenants are not to see each other. So a scrape proves who it is:
a bearer token (``metrics.token_file``, the header Prometheus sends from
``authorization.credentials_file``) or a client certificate
(``metrics.client_ca``). With tenants and neither configured, every scrape is
refused: the daemon still serves its clients, and the scrape's 401 (with the
warning logged at start) says what is missing. Without tenants a token is
optional, and required once set. A refused scrape gets 401 with an empty body,
whatever was wrong, and is counted (``hicached_metrics_refused_total``).

The token is read at start and again at each reload (daemon/reread.py), and
compared in constant time (digests of the same length, ``hmac.compare_digest``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import selectors
import socket
import ssl
import stat
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from hicached.config import MetricsConfig
from hicached.errors import ConfigError

__all__ = ["MAX_SCRAPES", "MIN_TOKEN_CHARS", "Gate", "Listener", "read_token"]

log = logging.getLogger("hicached.metrics")

# A token shorter than this is guessable by a local user who tries; `openssl
# rand -hex 32` gives 64.
MIN_TOKEN_CHARS = 16
# A token file larger than this is not a token (a wrong path, a certificate).
MAX_TOKEN_BYTES = 4096
# Visible ASCII, no spaces: what an Authorization header carries unchanged.
_TOKEN = re.compile(rb"[\x21-\x7e]+")
# Seconds a scraper may take to finish its TLS handshake and send its request:
# past it, its connection is closed and its thread freed.
REQUEST_TIMEOUT_S = 10.0
# Scrapes served at once, a thread each: a connection past them takes the place
# of the one that has waited longest for its request (closed unanswered and
# counted), or, where every one of them is being answered, is closed at once
# (and counted). So connections that send nothing, or a byte now and then,
# hold at most this many threads, each for REQUEST_TIMEOUT_S, and never keep
# a scraper that sends its request at once from being served. Prometheus
# scrapes one at a time.
MAX_SCRAPES = 8
# Seconds a connection past MAX_SCRAPES waits for the thread of the one whose
# place it takes to end (that thread's read ends at once when its connection
# is cut).
ROOM_WAIT_S = 1.0

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def read_token(path: str, *, check_owner: bool = True) -> bytes:
    """The bearer token in ``path``, without surrounding whitespace (Prometheus
    trims its credentials file the same way). ConfigError, naming the key,
    unless the file is a regular file of this process's user (``check_owner``)
    that no one else may read or change, holding one token of at least
    MIN_TOKEN_CHARS visible ASCII characters."""
    where = f"metrics.token_file: {path}"
    fd, st = _open_regular(path, where)
    try:
        if check_owner and st.st_uid != os.geteuid():
            raise ConfigError(
                f"{where}: owned by uid {st.st_uid}, not by the daemon's user (uid "
                f"{os.geteuid()}); chown it to that user"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"{where}: mode {mode:04o} lets its group or others read or change it; "
                "make it 0600 (or 0400)"
            )
        chunks, size = [], 0
        while size <= MAX_TOKEN_BYTES:
            chunk = os.read(fd, MAX_TOKEN_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > MAX_TOKEN_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_TOKEN_BYTES} bytes; it holds one token")
    token = b"".join(chunks).strip()
    if not _TOKEN.fullmatch(token):
        raise ConfigError(
            f"{where}: must hold one token of visible ASCII characters (no spaces), "
            "e.g. what `openssl rand -hex 32` prints"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{where}: the token has {len(token)} characters, fewer than "
            f"{MIN_TOKEN_CHARS}; make a longer one (`openssl rand -hex 32`)"
        )
    return token


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class Gate:
    """WSGI middleware in front of the exposition app: a scrape gets through
    when it shows the token (or when no token is wanted), else 401.

    ``token`` None and ``locked``: nothing gets through (tenants, and no
    credential configured). ``token`` None, not locked: everything does (no
    tenants and no token, or client certificates did the checking). Runs on
    the server's request threads; the token is replaced by one assignment."""

    def __init__(self, app: WSGIApp, token: bytes | None, *, locked: bool = False) -> None:
        self.app = app
        self.locked = locked
        self._digest = _digest(token) if token is not None else None
        self._lock = threading.Lock()
        self.refused = 0

    def use(self, token: bytes) -> bool:
        """Take ``token`` from now on; True when it differs from the one before."""
        new = _digest(token)
        changed = self._digest is None or not hmac.compare_digest(new, self._digest)
        self._digest = new
        return changed

    def allows(self, header: str | None) -> bool:
        """Whether an Authorization header value lets a scrape through."""
        digest = self._digest
        if digest is None:
            return not self.locked
        scheme, _, credentials = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        # digests: equal lengths, so the comparison time says nothing of the token
        presented = _digest(credentials.strip().encode("latin-1", "replace"))
        return hmac.compare_digest(presented, digest)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if self.allows(environ.get("HTTP_AUTHORIZATION")):
            return self.app(environ, start_response)
        with self._lock:
            self.refused += 1
        start_response(
            "401 Unauthorized",
            [("WWW-Authenticate", 'Bearer realm="hicached"'), ("Content-Length", "0")],
        )
        return [b""]


class _Handler(WSGIRequestHandler):
    """Logs nothing per request; a scraper that has not finished its TLS
    handshake and request REQUEST_TIMEOUT_S after it connected is cut off.
    The socket's timeout bounds each read only: a request trickled a byte at
    a time, each within it, would hold a scrape's slot for as long as its
    sender liked, so a timer shuts the connection at the request's deadline."""

    timeout = REQUEST_TIMEOUT_S
    server: _Server

    def setup(self) -> None:
        # (the server counts the connection as waiting for its request from its accept)
        self._cutoff = threading.Timer(REQUEST_TIMEOUT_S, self.server.cut, (self.request,))
        self._cutoff.daemon = True
        self._cutoff.start()
        try:
            super().setup()
        except BaseException:  # no finish() follows a failed setup()
            self.server.answering(self.request)
            self._cutoff.cancel()
            raise

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers
        self._cutoff.cancel()  # the request is in: its answer is written under the timeout
        if not self.server.answering(self.request):
            # cut meanwhile: what it read before its reads ended (half a request
            # line, a line and no end of headers) is no request, and gets nothing
            self.close_connection = True
            return False
        return ok

    def finish(self) -> None:
        self.server.answering(self.request)
        self._cutoff.cancel()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _cut(connection: Any) -> None:
    """End a connection's reads at once (from any thread)."""
    # the plain socket's shutdown (an SSLSocket's drops its TLS object under the
    # reading thread): the read its thread waits in ends at once
    with contextlib.suppress(OSError):
        socket.socket.shutdown(connection, socket.SHUT_RDWR)


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per scrape, at most MAX_SCRAPES at once."""

    daemon_threads = True  # a scrape in flight never holds up the daemon's exit
    slots: threading.BoundedSemaphore
    turned_away = 0  # connections closed unserved, MAX_SCRAPES being open
    _stopping = False
    timeout = 1.0  # handle_request's wait, should a ready connection be gone at accept

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # ``serve`` waits on one end, ``stop`` writes to the other; made first:
        # a failed bind closes the server (``server_close``) inside __init__
        self._wake = socket.socketpair()
        # the connections whose request is not in yet, oldest first (from their
        # accept, before their thread runs)
        self._waiting: dict[Any, None] = {}
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def answering(self, request: Any) -> bool:
        """The request of connection ``request`` is in, or the connection ends
        (its thread's): False where it was cut before (it is not to be answered)."""
        with self._lock:
            return self._waiting.pop(request, True) is None

    def cut(self, request: Any) -> None:
        """Cut connection ``request`` at its request's deadline (its timer's),
        unless its request is in: its answer is not cut short."""
        with self._lock:
            if self._waiting.pop(request, True) is not None:
                return
        _cut(request)

    def _make_room(self) -> bool:
        """Every slot taken: cut the connection that has waited longest for its
        request, and wait ROOM_WAIT_S at most for its slot; False where every
        connection is being answered (or its slot did not come)."""
        with self._lock:
            oldest = next(iter(self._waiting), None)
            if oldest is None:
                return False
            del self._waiting[oldest]  # from now on, answering(oldest) is False
        _cut(oldest)
        self.turned_away += 1  # that one: closed unanswered
        return self.slots.acquire(timeout=ROOM_WAIT_S)

    def serve(self) -> None:
        """Accept scrapes until ``stop``. socketserver's ``serve_forever`` looks
        for its stop every ``poll_interval`` (half a second) and its ``shutdown``
        waits for that look: a stop here is seen at once."""
        with selectors.DefaultSelector() as selector:
            selector.register(self, selectors.EVENT_READ)
            selector.register(self._wake[0], selectors.EVENT_READ)
            while not self._stopping:
                for key, _ in selector.select():
                    if key.fileobj is self and not self._stopping:
                        self.handle_request()

    def stop(self) -> None:
        """Make ``serve`` return, from another thread."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake[1].send(b"\0")

    def server_close(self) -> None:
        super().server_close()
        for end in self._wake:
            end.close()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not (self.slots.acquire(blocking=False) or self._make_room()):
            self.turned_away += 1  # the accept thread alone counts
            self.shutdown_request(request)
            return
        with self._lock:  # waiting for its request from now on: its place may be taken
            self._waiting[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.answering(request)
            self.slots.release()  # no thread started: its slot is free again
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.answering(request)  # however its handler ended
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a failed handshake (no or a wrong client certificate, plain HTTP to the
        # HTTPS port) or a scraper that went away: its connection ends, no traceback
        log.debug("metrics: a scrape from %s failed", client_address, exc_info=True)


# A key or certificate file larger than this is not one (a wrong path, a device).
MAX_KEY_FILE_BYTES = 1 << 20


def _open_regular(path: str | os.PathLike[str], where: str) -> tuple[int, os.stat_result]:
    """``path`` opened for reading, and its status; ConfigError (``where``
    first) unless it opens and is a regular file. O_NONBLOCK: a FIFO put there
    would hold the open until someone writes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot open it: {exc.strerror}") from None
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(f"{where}: cannot open it: {exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{where}: not a regular file")
    return fd, st


def regular_file(path: str | os.PathLike[str], key: str) -> None:
    """ConfigError (naming ``key``) unless ``path`` is a regular file of at most
    MAX_KEY_FILE_BYTES: what a key or certificate is. Checked before a library
    opens it for reading, where a FIFO would block the start and a device
    (/dev/zero) would be read without end."""
    where = f"{key}: {path}"
    fd, st = _open_regular(path, where)
    os.close(fd)
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_KEY_FILE_BYTES} bytes")


def tls_context(c: MetricsConfig) -> ssl.SSLContext:
    """The listener's TLS: its certificate and key, and the CA that signs its
    scrapers' certificates if one is set (ConfigError naming the key)."""
    regular_file(c.tls_cert, "metrics.tls_cert")
    regular_file(c.tls_key, "metrics.tls_key")
    if c.client_ca:
        regular_file(c.client_ca, "metrics.client_ca")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile=c.tls_cert, keyfile=c.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"metrics.tls_cert: cannot load {c.tls_cert} with its key {c.tls_key}: {exc}"
        ) from None
    if c.client_ca:
        try:
            context.load_verify_locations(cafile=c.client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"metrics.client_ca: cannot load {c.client_ca}: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class Listener:
    """The HTTP(S) server, on a thread of its own, serving ``app`` behind ``gate``."""

    def __init__(self, config: MetricsConfig, gate: Gate) -> None:
        self.config = config
        self.gate = gate
        self._server: _Server | None = None
        self._turned_away = 0  # of servers stopped before
        self._thread: threading.Thread | None = None
        self.endpoint = ""

    def start(self) -> None:
        c = self.config
        context = tls_context(c) if c.tls_cert else None
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(
                c.host, c.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            server_class = type(
                "MetricsServer",
                (_Server,),
                {"address_family": family, "slots": threading.BoundedSemaphore(MAX_SCRAPES)},
            )
            server = cast(
                _Server,
                make_server(
                    str(sockaddr[0]), c.port, self.gate, server_class, handler_class=_Handler
                ),
            )
        except OSError as exc:
            raise ConfigError(
                f"metrics.port: cannot listen on {c.host}:{c.port}: {exc.strerror or exc}"
            ) from None
        if context is not None:
            # the handshake runs on the request's thread, under its timeout, not
            # in accept(), where a peer that stalls it would stop every scrape
            server.socket = context.wrap_socket(
                server.socket, server_side=True, do_handshake_on_connect=False
            )
        self._server = server
        self._thread = threading.Thread(target=server.serve, name="hicached-metrics", daemon=True)
        self._thread.start()
        host, port = str(server.server_address[0]), server.server_address[1]
        scheme = "https" if c.tls_cert else "http"
        host = f"[{host}]" if ":" in host else host
        self.endpoint = f"{scheme}://{host}:{port}/metrics"

    @property
    def turned_away(self) -> int:
        """Connections closed unserved since start, MAX_SCRAPES being open."""
        server = self._server
        return self._turned_away + (server.turned_away if server is not None else 0)

    def stop(self) -> None:
        if self._server is not None:
            self._turned_away += self._server.turned_away
            self._server.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._server is not None:
            self._server.server_close()
            self._server = None
