"""The client's one DEALER socket and what goes over it beside the exchanges
(client/core.py): each request stamped with an id and a deadline, and
refused in a forked child or once the client is closed; the socket's
options, a dial again after the connection was lost, the goodbye at close;
replies no call waits for (a lease one grants is released at once) and the
gather report. ``_Core`` is one."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from hicached.client.copies import PageCopies
from hicached.client.poolview import PoolView
from hicached.client.report import GatherReporter
from hicached.errors import BadRequest, DaemonUnavailable, HicachedError, TooLarge
from hicached.wire import protocol as p

__all__ = ["CurveKeys", "Dealer"]

log = logging.getLogger(__name__)


def _python_scalar(value: Any) -> Any:
    """A numpy integer or bool in a request (a page count, a flag an engine
    computed with numpy) as Python's; anything else msgpack does not carry is
    refused (``Dealer._stamped``)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"a {type(value).__name__} is not sent to the daemon")


# the wire's encoder (protocol.py), which calls the hook only for what it does not know
_encode = msgspec.msgpack.Encoder(enc_hook=_python_scalar).encode
_NOBLOCK = int(zmq.NOBLOCK)  # pyzmq converts its enum flags on every call
# replies that grant a lease (0: none granted)
_LEASING = (p.MatchOk, p.ReserveOk, p.ReserveKeysOk, p.PrefetchOk)


class _Process:
    """How many forks lie between the first process and this one. A forked
    child has copies of its parent's sockets that libzmq will not serve (a
    receive there spins on EINTR forever): a client made before the fork
    refuses every call in the child instead."""

    forks = 0


def _count_fork() -> None:
    _Process.forks += 1


os.register_at_fork(after_in_child=_count_fork)


class CurveKeys(NamedTuple):
    """CURVE keys for a tcp:// daemon that requires them (Z85 text, as bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_key_file: str, client_secret_file: str) -> CurveKeys:
        """From certificate files as `hicached keygen` writes them: the daemon's
        public one (``.key``) and this client's secret one (``.key_secret``)."""
        import zmq.auth

        try:
            server_public, _ = zmq.auth.load_certificate(server_key_file)
            public, secret = zmq.auth.load_certificate(client_secret_file)
        except (OSError, ValueError) as exc:
            raise BadRequest(f"cannot read CURVE keys: {exc}") from None
        if not secret:
            raise BadRequest(f"{client_secret_file} holds no secret key: give the .key_secret file")
        return cls(server_public, public, secret)


class Dealer(PageCopies):
    """The socket side of both clients; the exchange logic sets the state."""

    endpoint: str
    timeout: float
    curve: CurveKeys | None
    max_reply_bytes: int
    _forks: int
    _ids: Any  # itertools.count
    _hello: p.HelloOk | None
    _pool: PoolView
    _reporter: GatherReporter

    def _stamp(self, request: p.Request, budget: float | None = None) -> bytes:
        """``request`` with a fresh id and its deadline (``budget``, by default
        ``timeout``, from now), encoded; refused in a process forked after
        this client was made (``_Process``), or once it is closed."""
        self._check_process()
        if self._closing:
            raise BadRequest("this client is closed: make a new one")
        return self._stamped(request, budget)

    def _forked(self) -> bool:
        """Whether this process was forked after this client was made."""
        return self._forks != _Process.forks

    def _check_process(self) -> None:
        """Refuse a call in a process forked after this client was made."""
        if self._forked():
            raise BadRequest(
                "this client was made in another process (this one was forked from it): "
                "its connection is that process's; make a new client here"
            )

    def _stamped(self, request: p.Request, budget: float | None = None) -> bytes:
        request.id = next(self._ids)
        request.deadline_ms = int((time.time() + (budget or self.timeout)) * 1000)
        try:
            raw = _encode(request)
        except OverflowError:  # msgpack carries integers in -2**63..2**64-1
            raise BadRequest(
                f"a number in this {type(request).__name__} request is too large to send "
                "(a page count, size or id past 2**64)"
            ) from None
        except TypeError as exc:  # a value of a type the wire does not carry
            raise BadRequest(f"a value in this {type(request).__name__} request: {exc}") from None
        hello = self._hello
        if hello is not None and len(raw) > hello.max_message_bytes:
            # the daemon would refuse it, or past twice the limit drop the
            # connection, and with it this client's session and leases
            raise TooLarge(
                f"a {type(request).__name__} request of {len(raw)} bytes is over the daemon's "
                f"max_message_bytes ({hello.max_message_bytes}): send fewer tokens or keys"
            )
        return raw

    def _report_gather(self, sock: zmq.Socket[Any]) -> None:
        """Tell the daemon this process's scattered-copy kernels if this session
        lacks them (client/report.py): after a call, without waiting."""
        report = self._reporter.due(self._hello) if self.map_pool else None
        if report is None:
            return
        try:
            zmq.Socket.send(sock, self._stamp(report), _NOBLOCK)  # the plain send, even on asyncio
        except (zmq.ZMQError, HicachedError) as exc:
            log.debug("gather report not sent to %s: %s", self.endpoint, exc)
            return
        self._reporter.sent(report.id)

    def _unclaimed(self, sock: zmq.Socket[Any], reply: p.AnyReply) -> None:
        """A reply no call waits for: the late one of a call that was cancelled
        or interrupted (or of a loop before), or the gather report's. A lease
        it grants reached no handle: it is released now, without waiting,
        rather than pin its pages (or hold its slots) until it expires."""
        lease = reply.lease if isinstance(reply, _LEASING) else 0
        if not lease:
            self._reporter.answered(reply, self.endpoint)
            return
        self._let_go(sock, lease)

    def _let_go(self, sock: zmq.Socket[Any], lease: int) -> None:
        """Release ``lease`` without waiting for the daemon's word: one that reached
        no handle, or whose call could not wait (it was cancelled, or its time
        ran out before the release went out or was answered). A lease released
        twice is refused the second time, harmlessly."""
        try:  # the plain send, even on asyncio; its Ok is another unclaimed reply
            zmq.Socket.send(sock, self._stamp(p.Release(id=0, lease=lease)), _NOBLOCK)
        except (zmq.ZMQError, HicachedError) as exc:
            log.debug(
                "lease %d of a call given up not released at %s: %s", lease, self.endpoint, exc
            )

    def _unavailable(self) -> DaemonUnavailable:
        what = "" if self._hello else " (is it running?)"
        return DaemonUnavailable(f"no connection to the daemon at {self.endpoint}{what}")

    def _redial(self, sock: zmq.Socket[Any]) -> None:
        """Dial the daemon again once a call found no connection (none came
        within ``connect_timeout``, or it went away while the call waited).
        libzmq reconnects by itself after a daemon restarts, but gives a
        connection up for good after a protocol error, such as a message over
        ``max_reply_bytes``: without a new dial, every later call would fail.
        Never while a connection is up: libzmq ends one asynchronously, and a
        request sent meanwhile could go into the connection being ended."""
        with contextlib.suppress(zmq.ZMQError):
            sock.disconnect(self.endpoint)
        with contextlib.suppress(zmq.ZMQError):
            sock.connect(self.endpoint)

    def _dropped(self) -> DaemonUnavailable:
        """The connection went away while a call waited for its reply."""
        return DaemonUnavailable(
            f"the connection to the daemon at {self.endpoint} went away during the call "
            f"(it stopped, or sent a message over this client's max_reply_bytes, "
            f"{self.max_reply_bytes})"
        )

    def _shut(self, sock: zmq.Socket[Any], ctx: zmq.Context[Any]) -> None:
        """Say goodbye if a session is open (the daemon ends it and its leases at
        once), close the socket and the context, unmap the pool."""
        linger = 0
        self._closing = True
        if self._forked():  # a forked child: the session is the parent's
            self._hello = None
        if sock.closed:  # closed before
            return
        if self._hello is not None:
            goodbye = self._stamped(p.Goodbye(id=0))
            self._hello = None
            with contextlib.suppress(zmq.ZMQError):
                zmq.Socket.send(sock, goodbye, zmq.NOBLOCK)  # the plain send, even on asyncio
                linger = 200
        sock.close(linger=linger)
        ctx.term()
        self._pool.close()

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        """Options of the one DEALER socket; CURVE keys when given."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a daemon that is not there
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 200)  # back within connect_timeout
        # Set before connect (libzmq copies a socket's options into each
        # connection it makes): a message over it is refused from its length
        # header, and the connection dropped, so an endpoint that sends gigabytes
        # cannot make this process buffer them; the call waiting ends at its timeout.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_reply_bytes)
        if self.curve is not None:
            sock.curve_serverkey = self.curve.server_public
            sock.curve_publickey = self.curve.public
            sock.curve_secretkey = self.curve.secret
        sock.connect(self.endpoint)
