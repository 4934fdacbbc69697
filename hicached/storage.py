"""The L3 tier: carries out what the cache decides, through a Dispatcher.

The cache (synchronous) decides which pages to write and which to prefetch;
this module turns those decisions into backend calls and feeds the results
back into the cache on the event loop. It also loads the configured backend,
learns at startup what the store holds, and flushes at a graceful stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from hicached.arena import Arena
from hicached.cache import Cache, Lease, Namespace
from hicached.config import Config, data_dir
from hicached.dispatcher import Dispatcher, WriteJob
from hicached.errors import ConfigError
from hicached_backends import Backend, BackendEnv, PageRef, load_backend_class

log = logging.getLogger("hicached.storage")


def backend_options(config: Config, cls: type[Backend]) -> Any:
    """The backend's typed options: its [storage.<name>] table, or [storage.extra]."""
    name = config.storage.backend
    table = getattr(config.storage, name, None)
    if isinstance(table, cls.options_type):
        return table
    try:
        return msgspec.convert(config.storage.extra, cls.options_type)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"storage.extra (options of backend {name!r}): {exc}") from None


def make_backend(config: Config, pool: memoryview | None) -> Backend:
    cls = load_backend_class(config.storage.backend)
    env = BackendEnv(data_dir=data_dir(config), pool=pool)
    return cls(backend_options(config, cls), env)


class Tier:
    """The cache's port to L3 (see cache.Tier)."""

    def __init__(self, cache: Cache, backend: Backend, arena: Arena) -> None:
        self.cache = cache
        self.arena = arena
        self.config = cache.config.storage
        self.backend = backend
        self.dispatcher = Dispatcher(backend, self.config, f"backend {self.config.backend!r}")
        self._prefetches: set[asyncio.Task[None]] = set()
        backend.on_forget = lambda _ns, keys: cache.forget_l3(keys)

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        await self.dispatcher.start()
        if self.config.scan_on_start:
            started = time.monotonic()
            n = 0
            async for _ns, key in self.backend.scan():
                self.cache.l3.add(key)
                n += 1
                if n % 1_000_000 == 0:
                    log.info("L3 scan: %d pages so far", n)
            log.info("L3 holds %d pages (scanned in %.2fs)", n, time.monotonic() - started)

    async def stop(self) -> None:
        """Under write_back, write what L3 lacks; then finish queued writes, all
        within storage.flush_deadline_s, and close the backend."""
        deadline = self.config.flush_deadline_s
        if self.config.write_policy == "write_back":
            queued = self.cache.flush()
            log.info("write-back flush: %d pages queued", queued)
        for task in list(self._prefetches):
            task.cancel()
        if self._prefetches:
            await asyncio.wait(self._prefetches, timeout=deadline)
        await self.dispatcher.stop(deadline)

    @property
    def state(self) -> str:
        return self.dispatcher.state

    @property
    def counters(self) -> dict[str, int]:
        return {
            **self.dispatcher.counters,
            "queued": self.dispatcher.queued,
            **{f"store_{k}": v for k, v in self.backend.stats().items()},
        }

    # -- the cache's port --------------------------------------------------------------

    def _view(self, ns: Namespace, slot: int) -> memoryview:
        return self.arena.array.data[slot : slot + ns.spec.page_bytes]

    def write(self, ns: Namespace, key: bytes, slot: int, done: Callable[[bool], None]) -> bool:
        return self.dispatcher.submit_write(WriteJob(ns.digest, key, self._view(ns, slot), done))

    def prefetch(self, lease: Lease) -> None:
        task = asyncio.get_running_loop().create_task(self._prefetch(lease))
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)

    async def _prefetch(self, lease: Lease) -> None:
        cache, pf, ns = self.cache, lease.prefetch, lease.ns
        assert pf is not None
        try:
            known = 0
            for key in pf.keys:
                if key not in cache.l3:
                    break
                known += 1
            # What we learned may be stale, and another host may have written more: ask.
            available = await self.dispatcher.exists(ns.digest, pf.keys)
            if available < known:
                cache.forget_l3(pf.keys[available:known])
            slots = cache.prefetch_planned(lease, available)
            step = self.config.prefetch_batch_pages
            for start in range(0, len(slots), step):
                if pf.ended:
                    break
                batch = [
                    PageRef(pf.keys[i], self._view(ns, slots[i]))
                    for i in range(start, min(start + step, len(slots)))
                ]
                results = await self.dispatcher.get(ns.digest, batch)
                if not cache.prefetch_progress(lease, results):
                    break
        except asyncio.CancelledError:
            pass  # stopping; dispatcher.get returns only once its reads are finished
        except Exception:
            log.exception("prefetch failed")
            pf.failed = True
        finally:
            cache.prefetch_finished(lease)
