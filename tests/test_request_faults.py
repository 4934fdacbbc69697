"""A bug while serving one request costs that request only: it gets an
``internal`` error reply (or is dropped and counted when its id cannot be
read), and the daemon goes on with the next message of the same batch.

These tests inject faults: they run a Server in this process and make its
request handling raise on purpose, as no request can make a correct daemon
fail.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from hicached import protocol as p
from hicached.server import Server
from tests.support import in_process_config

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    """A daemon on this test's event loop (pool not prefaulted, no metrics)."""
    where = Path(tempfile.mkdtemp(prefix="hc-", dir="/tmp"))
    daemon = Server(in_process_config(where))
    task = asyncio.create_task(daemon.run())
    try:
        await asyncio.wait_for(daemon.ready.wait(), 10)
        yield daemon
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 10)
        shutil.rmtree(where, ignore_errors=True)


class Peer:
    """A bare DEALER whose replies are awaited without blocking the loop."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, message: object) -> None:
        self.sock.send(msgspec.msgpack.encode(message))

    async def recv(self, timeout: float = 5.0) -> p.AnyReply:
        deadline = time.monotonic() + timeout
        while not self.sock.poll(0):
            assert time.monotonic() < deadline, "no reply"
            await asyncio.sleep(0.005)
        return p.reply_decoder.decode(self.sock.recv())

    async def call(self, message: object) -> p.AnyReply:
        self.send(message)
        return await self.recv()


@pytest.fixture
def peers() -> Iterator[Callable[[str], Peer]]:
    """Makes peers; closes them at the end."""
    ctx: zmq.Context[Any] = zmq.Context()
    made: list[Peer] = []

    def make(endpoint: str) -> Peer:
        made.append(Peer(ctx, endpoint))
        return made[-1]

    yield make
    for peer in made:
        peer.sock.close()
    ctx.term()


def queue_up() -> None:
    """Hold the loop (on purpose) until messages just sent reach the daemon's
    socket, so that it receives them in one drained batch."""
    time.sleep(0.3)


async def test_a_failing_handler_gets_an_internal_error_and_the_batch_goes_on(
    server: Server, peers: Callable[[str], Peer], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    a, b = peers(server.endpoint), peers(server.endpoint)
    for peer in (a, b):
        assert isinstance(
            await peer.call(p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=0)), p.HelloOk
        )
    cache = server.cache
    assert cache is not None
    handle = cache.handle
    loop = asyncio.get_running_loop()
    batch = {"open": False, "next_in_it": False}

    def faulty(
        routing_id: bytes, request: p.AnyRequest, *peer: str, **operator: bool
    ) -> p.AnyReply:
        if request.id == 666:  # the injected fault
            batch["open"] = True
            loop.call_soon(batch.update, {"open": False})  # runs once this drain returns
            raise KeyError("injected fault")
        if request.id == 667:
            batch["next_in_it"] = batch["open"]
        return handle(routing_id, request, *peer, **operator)

    monkeypatch.setattr(cache, "handle", faulty)
    a.send(p.Stats(id=666))
    a.send(p.Stats(id=667))
    b.send(p.Stats(id=668))
    queue_up()
    failed = await a.recv()
    assert isinstance(failed, p.Error) and failed.id == 666 and failed.code == "internal"
    assert not failed.retriable and "bug" in failed.message
    after = await a.recv()
    assert isinstance(after, p.StatsOk) and after.id == 667
    assert batch["next_in_it"], "667 was not in the failing request's batch"
    assert isinstance(other := await b.recv(), p.StatsOk) and other.id == 668
    stats = await b.call(p.Stats(id=669))
    assert isinstance(stats, p.StatsOk)
    assert stats.stats.errors == {"internal": 1} and "internal" not in stats.stats.dropped
    assert "internal error on stats request (id 666)" in caplog.text
    assert "injected fault" in caplog.text


async def test_a_fault_on_a_request_without_a_readable_id_is_dropped_and_counted(
    server: Server, peers: Callable[[str], Peer], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    a = peers(server.endpoint)
    assert isinstance(await a.call(p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=0)), p.HelloOk)
    decoder = p.request_decoder
    no_id = msgspec.msgpack.encode({"op": "stats"})

    class Faulty:
        def decode(self, payload: bytes) -> p.AnyRequest:
            if payload == no_id:  # the injected fault
                raise RuntimeError("injected fault")
            return decoder.decode(payload)

    monkeypatch.setattr(p, "request_decoder", Faulty())
    a.sock.send(no_id)
    a.send(p.Stats(id=2))
    queue_up()
    reply = await a.recv()
    assert isinstance(reply, p.StatsOk) and reply.id == 2
    assert reply.stats.errors == {"internal": 1} and reply.stats.dropped == {"internal": 1}
    assert "internal error on stats request (id None)" in caplog.text
