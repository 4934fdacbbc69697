"""The scheduler's one session with the daemon, on a private event loop thread,
and the socket the workers' words on their stores arrive on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from hicached.client import AsyncClient
from hicached.client.deadline import within
from hicached.client.handles import Hit, Namespace, Reservation
from hicached.errors import HicachedError
from hicached.integrations.vllm.settings import UNREACHABLE, Settings
from hicached.integrations.vllm.specs import Ack
from hicached.wire.namespace import EventMeta, NamespaceSpec

__all__ = ["Link"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Link:
    """The manager's one session with the daemon, on a private event loop thread.

    Lookups run there while the scheduler goes on; every lease the manager
    holds belongs to this one session, so any of its calls can end any of
    them. The workers' words on their stores arrive there too.
    """

    def __init__(
        self,
        settings: Settings,
        specs: list[tuple[NamespaceSpec, EventMeta | None]],
        writers: frozenset[int],
    ) -> None:
        self.settings = settings
        self.specs = specs  # one namespace per KV cache group, with its event metadata
        self.writers = writers  # the workers whose word a store waits for
        self.down_until = 0.0  # monotonic; calls wait until then after a failure
        self._dir = Path(tempfile.mkdtemp(prefix="hicached-vllm-"))  # 0700: only us
        # gone at close, or at exit for an engine that never closes its connector
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        self.acks = f"ipc://{self._dir}/acks.sock"
        self._acks: dict[tuple[int, int], tuple[float, dict[int, bytes]]] = {}
        self._ack_event: asyncio.Event | None = None
        self._client: AsyncClient | None = None
        self._ns: list[Namespace] | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hicached-vllm")
        self._thread.daemon = True
        self._thread.start()
        self.call(self._start(), settings.timeout_s)

    # -- running things on the loop -----------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it, at most ``timeout`` seconds."""
        return self.submit(coro).result(timeout)

    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def instance(self) -> int:
        """The daemon instance this session last spoke to (0: none yet)."""
        try:
            return self._client.mapping.instance if self._client is not None else 0
        except HicachedError:
            return 0

    def close(self) -> None:
        """Say goodbye (the daemon ends every lease of this session), stop the loop."""
        try:
            self.call(self._stop(), self.settings.timeout_s)
        except Exception as exc:  # shutting down: nothing left to tell
            log.debug("hicached: closing the session: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.settings.timeout_s)
        self._remove_dir()

    async def _start(self) -> None:
        self._ack_event = asyncio.Event()
        # The pool is mapped here too, though only the workers copy: handles carry
        # the slots' generations as they were granted, which the copies check.
        self._client = AsyncClient(
            self.settings.endpoint or None,
            timeout=self.settings.timeout_s,
            name=f"vllm-scheduler-{os.getpid()}",
            connect_timeout=min(0.2, self.settings.timeout_s),
        )
        self._zmq = zmq.asyncio.Context()
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.acks)
        self._reader = self._loop.create_task(self._read_acks(self._pull))

    async def _stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._pull is not None and self._zmq is not None:
            self._pull.close()
            self._zmq.term()
        if self._client is not None:
            await self._client.close()

    async def session(self) -> tuple[AsyncClient, list[Namespace]]:
        """The client and the groups' namespaces, registered on first use; marks
        the daemon down for ``retry_s`` when it cannot be reached."""
        assert self._client is not None, "the link is not started"
        try:
            if self._ns is None:
                self._ns = [
                    await self._client.register(spec, events=events) for spec, events in self.specs
                ]
            return self._client, self._ns
        except UNREACHABLE:
            self.failed()
            raise

    def failed(self) -> None:
        self.down_until = time.monotonic() + self.settings.retry_s

    async def guarded(
        self, op: Callable[[AsyncClient, list[Namespace]], Coroutine[Any, Any, T]]
    ) -> T:
        client, ns = await self.session()
        try:
            return await op(client, ns)
        except UNREACHABLE:
            self.failed()
            raise

    # -- the workers' words on their stores ---------------------------------------------

    async def _read_acks(self, sock: zmq.asyncio.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(Ack)
        assert self._ack_event is not None
        while True:
            payload = await sock.recv()
            try:
                ack = decoder.decode(payload)
            except msgspec.MsgspecError:
                continue
            now = time.monotonic()
            _, ranks = self._acks.setdefault((ack.instance, ack.lease), (now, {}))
            ranks[ack.rank] = ack.written
            self._ack_event.set()
            self._ack_event = asyncio.Event()
            stale = now - 4 * (self.settings.ack_timeout_s + self.settings.timeout_s)
            for lease in [k for k, (t, _) in self._acks.items() if t < stale]:
                del self._acks[lease]  # of a store nobody finished (reset, abort)

    async def written(self, res: Reservation, n: int) -> list[bool] | None:
        """Which of the ``n`` slots of ``res`` the workers were handed every
        writing worker wrote (``writers``: every worker, or rank 0 alone for
        replicated pages; a word from another is not taken); None if some
        writer never said."""
        deadline = time.monotonic() + self.settings.ack_timeout_s
        key = (res.instance, res.lease)
        while not self.writers <= self._acks.get(key, (0.0, {}))[1].keys():
            left = deadline - time.monotonic()
            event = self._ack_event
            assert event is not None
            try:
                await within(event.wait(), left)
            except asyncio.TimeoutError:
                self._acks.pop(key, None)
                return None
        _, ranks = self._acks.pop(key)
        words = [ranks[rank] for rank in self.writers]
        return [all(len(w) == n and w[i] for w in words) for i in range(n)]

    # -- leases ---------------------------------------------------------------------------

    def release(self, handles: Iterable[Hit | Reservation]) -> None:
        """End leases in the background (from any thread); a daemon that is gone
        ended them already."""
        for handle in handles:
            self.submit(self._release_now(handle))

    async def _release_now(self, handle: Hit | Reservation) -> None:
        try:
            await self.guarded(lambda c, ns: c.release(handle))
        except (HicachedError, *UNREACHABLE) as exc:
            log.debug("hicached: release: %s", exc)
