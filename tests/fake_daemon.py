"""Fault injection for client tests: a ZeroMQ ROUTER that answers as a
misbehaving daemon would (garbage, another request's id, the wrong reply, a
flood). It is a fake only to inject faults a real daemon never makes; every
other client test talks to a real daemon (tests/support.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import zmq

from hicached.wire import protocol as p

Behave = Callable[["FakeDaemon", bytes, p.Request], None]


def hello_ok(request: p.Request, **fields: Any) -> p.HelloOk:
    """A HelloOk as a daemon without a pool to map would give (map_pool=False clients)."""
    reply: dict[str, Any] = dict(
        id=request.id,
        major=p.PROTOCOL_MAJOR,
        minor=p.PROTOCOL_MINOR,
        instance=1,
        session=1,
        pool_path="",
        pool_bytes=0,
        lease_ttl_s=10.0,
        max_message_bytes=1 << 20,
        max_pages_per_request=1024,
    )
    reply.update(fields)
    return p.HelloOk(**reply)


class FakeDaemon:
    """A ROUTER on a loopback port whose ``behave(fake, peer, request)`` answers
    each request (or not) on the fake's own thread; ``stop`` ends it."""

    def __init__(self, behave: Behave) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.behave = behave
        self.stopping = threading.Event()
        self.requests: list[p.Request] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            if not self.sock.poll(20):
                continue
            frames = self.sock.recv_multipart()
            request = p.request_decoder.decode(frames[-1])
            self.requests.append(request)
            self.behave(self, frames[0], request)

    def send(self, peer: bytes, reply: p.Reply | bytes) -> None:
        payload = reply if isinstance(reply, bytes) else p.encode(reply)
        self.sock.send_multipart([peer, payload])

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(10)
        self.sock.close()
        self.ctx.term()

    def __enter__(self) -> FakeDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
