"""The L3 tier: carries out what the cache decides, through a Dispatcher.

The cache (synchronous) decides which pages to write and which to prefetch;
this module turns those decisions into backend calls and feeds the results
back into the cache on the event loop. It also loads the configured backend,
learns what the store holds (a scan at start, in the background by default,
so the daemon serves meanwhile), asks the backend about keys the cache does
not know while what it knows is incomplete (``lookup``: under a deadline and
a bound on lookups in flight), writes in the background what L3 lacks
(adopted pages, and missed writes under write_through: daemon/backfill.py),
and flushes at a graceful stop: under one deadline, in steps as the write
queue drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from hicached.cache import Cache, Lease, NamespaceState
from hicached.cache.tiering import SCAN_FORGOTTEN_MAX
from hicached.config import Config, StorageConfig, data_dir
from hicached.daemon.backfill import Backfill, FlushCounts
from hicached.daemon.dispatcher import Dispatcher, WriteJob
from hicached.daemon.waits import end_tasks
from hicached.errors import ConfigError
from hicached.wire.arena import Arena
from hicached.wire.arenas import TenantArenas
from hicached_backends import Backend, BackendEnv, BackendError, PageRef, load_backend_class

log = logging.getLogger("hicached.storage")

_SCAN_YIELD_PAGES = 4096  # the startup scan lets requests in after this many pages
# a failed scan is tried again after storage.scan_retry_s, doubled each time up to this
_SCAN_RETRY_MAX_S = 600.0


def backend_options(config: Config, cls: type[Backend]) -> Any:
    """The backend's typed options, [storage.<name>] or [storage.extra], checked
    whole (``Backend.check_options``): what a start would refuse fails here."""
    name = config.storage.backend
    table = getattr(config.storage, name, None)
    if isinstance(table, cls.options_type):
        options: Any = table
        where = f"storage.{name}"
        if config.storage.extra:  # taken for this backend's, it would be ignored
            raise ConfigError(
                f"storage.extra: backend {name!r} takes its options from [storage.{name}]; "
                "[storage.extra] is for a backend of another package"
            )
    else:
        where = "storage.extra"
        try:
            options = msgspec.convert(config.storage.extra, cls.options_type)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{where} (options of backend {name!r}): {exc}") from None
    try:
        cls.check_options(options)
    except ValueError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0].rstrip(":")  # checks start with the option's name
        where = f"{where}.{field}" if field.isidentifier() else where
        raise ConfigError(f"{where}: {message}") from None
    return options


def make_backend(config: Config, pool: memoryview | None, pool_path: str = "") -> Backend:
    cls = load_backend_class(config.storage.backend)
    env = BackendEnv(
        data_dir=data_dir(config),
        pool=pool,
        pool_path=pool_path,
        pool_huge_pages=config.pool.huge_pages,
    )
    return cls(backend_options(config, cls), env)


class Tier:
    """The cache's port to L3 (cache/tiering.py's TierPort): its I/O side."""

    def __init__(self, cache: Cache, backend: Backend, arena: Arena | TenantArenas) -> None:
        self.cache = cache
        self.arena = arena
        self.config = cache.config.storage
        self.backend = backend
        self.dispatcher = Dispatcher(backend, self.config, f"backend {self.config.backend!r}")
        self._prefetches: set[asyncio.Task[None]] = set()
        self._lookups: set[asyncio.Future[int | None]] = set()  # backend calls of lookups in flight
        self._lookup_counts = {"lookups": 0, "lookups_skipped": 0, "lookups_late": 0}
        self._stopping = False
        self.lookup_pages = 0  # pages lookups found that the cache did not know
        self._scan: asyncio.Task[None] | None = None
        self.backfill = Backfill(cache, self.dispatcher, self.config)  # pages L3 lacks
        self.scanning = False
        self.scan_pages = 0  # pages the startup scan has found so far
        # hears the startup scan's end, once every page it found is known
        # (daemon/collector.py freezes what the scan made)
        self.on_scanned: Callable[[], None] | None = None
        self._flush: FlushCounts | None = None  # while a write-back flush counts its pages
        self._undersized_told = False
        backend.on_forget = self._forget

    def _forget(self, ns: bytes, keys: list[bytes]) -> None:
        """The store let go of ``keys``; the first time it proves smaller than L2,
        say so (once: status and metrics show it from then on)."""
        cache = self.cache
        cache.forget_l3(keys, ns)
        if cache.l3_undersized and not self._undersized_told:
            self._undersized_told = True
            log.warning(
                "L3 (%s) lets go of pages sooner than L2 does: it cannot hold L2's working "
                "set, so it keeps the pages written last and none is written again "
                "(hicached status shows 'undersized' while this lasts); a larger store "
                "keeps more",
                self.config.backend,
            )

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Open the backend; learn what the store holds, in the background
        (storage.scan_in_background) or before returning."""
        await self.dispatcher.start()
        # Unknown is not absent until a listing has ended: a key the cache does
        # not know is asked of the backend meanwhile (and ever, without a scan).
        self.cache.l3.listed(False)
        if not self.config.scan_on_start:
            self.backfill.adopted_unlisted("storage.scan_on_start is off")
            return
        down = self.dispatcher.state == "down"  # it did not answer: listed later, once up
        self.scanning = not down
        if down or self.config.scan_in_background or not await self._scan_store():
            self._scan = asyncio.get_running_loop().create_task(
                self._scan_until_listed(tried=down or not self.config.scan_in_background)
            )

    async def _scan_until_listed(self, *, tried: bool) -> None:
        """Scan, and scan again after a failure (or a scan cut short) every
        ``storage.scan_retry_s``, doubled each time up to ten minutes, until a
        listing ends (0: never again): a store that failed one listing (a
        network error, a throttled bucket) is not left unknown for good, with
        every unknown key asked of it and adopted pages L3 lacks never written.
        ``tried``: the first scan ran already (before READY) and failed."""
        wait = self.config.scan_retry_s
        if not tried and await self._scan_store():
            return
        self.backfill.adopted_unlisted("the listing of L3 failed")
        while wait > 0:
            log.info("L3 scan again in %.1fs", wait)
            await asyncio.sleep(wait)
            self.scanning = True
            if await self._scan_store():
                return
            wait = min(2 * wait, _SCAN_RETRY_MAX_S)

    async def _scan_store(self) -> bool:
        """Add every key the store lists to the cache's L3 set as it is found, so
        matches see it at once, and announce it (BlockStored, per namespace, after
        the start's AllBlocksCleared); yields to requests every few thousand pages.
        Whether the listing ended (False: it failed or was cut short)."""
        started = time.monotonic()
        self.scan_pages = 0  # of this listing: one tried again counts anew
        cache = self.cache
        l3, tiering = cache.l3, cache.tiering
        found: dict[bytes, list[bytes]] = {}  # namespace -> keys not yet announced

        def announce() -> None:
            for ns, keys in found.items():
                # a key forgotten meanwhile had its BlockRemoved already: not announced
                cache.announce_l3(ns, [key for key in keys if key in l3])
            found.clear()

        tiering.scan_begins()
        listed = False
        try:
            async for ns, key in self.backend.scan():
                # not written (and announced) since the start, nor let go of since the
                # first try began: a listing may name a page dropped after it was
                # listed, or one the store keeps listing (S3 leaves a bad object)
                if key not in l3 and tiering.scan_may_learn(key):
                    l3.add(key)
                    found.setdefault(ns, []).append(key)
                elif tiering.scan_overflow:
                    break  # what it names can no longer be told from what was let go of
                self.scan_pages += 1
                if self.scan_pages % _SCAN_YIELD_PAGES == 0:
                    announce()
                    await asyncio.sleep(0)
                    if self.scan_pages % 1_000_000 == 0:
                        log.info("L3 scan: %d pages so far", self.scan_pages)
        except asyncio.CancelledError:
            log.info("L3 scan stopped after %d pages", self.scan_pages)
            raise
        except Exception as exc:
            self.dispatcher.counters["scan_failed"] += 1
            if isinstance(exc, BackendError):  # the store's fault: said, not traced
                log.warning("L3 scan failed after %d pages: %s", self.scan_pages, exc.message)
            else:
                log.exception("L3 scan failed after %d pages", self.scan_pages)
            return False
        else:
            if tiering.scan_overflow:  # as a failed scan: what L3 lacks stays unknown
                self.dispatcher.counters["scan_cut"] += 1
                log.warning(
                    "L3 scan stopped after %d pages: the store let go of more than %d pages "
                    "while it was listed; keys not learned are asked of the store",
                    self.scan_pages,
                    SCAN_FORGOTTEN_MAX,
                )
                return False
            listed = True
            # a store that cannot list ends its scan at once with nothing: that
            # proves nothing, so unknown keys are asked of it from now on as well
            l3.listed(self.backend.lists)
            if self.backend.lists:
                log.info(
                    "L3 holds %d pages (scanned in %.2fs)",
                    self.scan_pages,
                    time.monotonic() - started,
                )
            else:
                log.info("L3 cannot be listed: keys not known are asked of the store")
            if self.on_scanned is not None:
                self.on_scanned()
            self.backfill.adopted_listed()
            return True
        finally:
            if listed or not self.config.scan_retry_s or self._stopping:
                tiering.scan_ends()  # else a page let go of is not learned from the next try
            announce()  # what was found before a stop or a failure is in L3 all the same
            self.scanning = False

    def reconfigure(self, config: StorageConfig, *, wrote_all: bool) -> None:
        """A reload's storage config. A write policy that now writes every page
        where the one before did not (to write_through) has the pages L2
        holds and L3 lacks written: committed before, nothing else would write
        them, and they would leave the cache with L2."""
        self.config = self.backfill.config = config
        if self.cache.policy.writes_all and not wrote_all:
            self.backfill.write_all()

    async def stop(self) -> None:
        """Stop within storage.flush_deadline_s, all steps together: end the scan
        and prefetches, under write_back write what L3 lacks (in steps as the
        queue drains), finish queued writes, close the backend."""
        end = time.monotonic() + self.config.flush_deadline_s
        self._stopping = True  # no lookup starts from now: none would be waited for
        self.dispatcher.stop_by = end
        started = [*self.backfill.stop(), *([self._scan] if self._scan is not None else [])]
        await end_tasks(started, end - time.monotonic(), "the L3 scan and background writes")
        self._scan = None
        running: set[asyncio.Future[Any]] = {*self._prefetches, *self._lookups}
        for task in running:
            task.cancel()  # a lookup cancelled is answered from the index at once
        if running:
            await asyncio.wait(running, timeout=max(0.0, end - time.monotonic()))
        counts = None
        if self.cache.policy.writes_back:
            counts = await self._flush_write_back(end)
        await self.dispatcher.stop(end)
        if counts is not None:
            log_at = logging.WARNING if counts.left or counts.failed else logging.INFO
            log.log(
                log_at,
                "write-back flush: %d pages L3 lacked; %d queued, %d written, %d failed, "
                "%d left (not written by the deadline)",
                counts.pages,
                counts.queued,
                counts.written,
                counts.failed,
                counts.left,
            )

    async def _flush_write_back(self, end: float) -> FlushCounts:
        """Write every L2 page L3 lacks, queueing as many as the write queue has
        room for and more as it drains, until done or ``end``; then wait for
        them until ``end``. No page is dropped for lack of queue room."""
        dispatcher = self.dispatcher
        pages = self.cache.unwritten_pages()
        counts = self._flush = FlushCounts(pages=len(pages))
        try:
            await self.backfill.queue_writes(pages, end, counts)
            while counts.written + counts.failed < counts.queued and (
                (now := time.monotonic()) < end
            ):
                await dispatcher.wait_room(min(0.05, end - now))
        finally:
            self._flush = None  # writes dropped at the deadline are "left", not "failed"
        return counts

    @property
    def state(self) -> str:
        """up, down (breaker open), or scanning (up, startup scan still running)."""
        state = self.dispatcher.state
        return "scanning" if state == "up" and self.scanning else state

    @property
    def counters(self) -> dict[str, int]:
        d = self.dispatcher
        return {
            **d.counters,
            "queued": d.queued,
            "queued_pages": d.queued,
            "in_flight_pages": d.writing,
            "hung_calls": d.hung_calls,
            "scan_pages": self.scan_pages,
            "scan_failed": d.counters["scan_failed"],  # 0 until one fails, shown all the same
            "scan_cut": d.counters["scan_cut"],
            "scanning": int(self.scanning),
            "index_complete": int(self.cache.l3.complete),
            "known_forgotten": self.cache.l3.forgotten,
            **self._lookup_counts,
            **self.backfill.counters,
            "lookups_in_flight": len(self._lookups),
            "lookup_pages": self.lookup_pages,
            **{f"store_{k}": v for k, v in self.backend.stats().items()},
        }

    # -- the cache's port --------------------------------------------------------------

    def _view(self, ns: NamespaceState, slot: int) -> memoryview:
        return self.arena.array.data[slot : slot + ns.spec.page_bytes]

    def write(
        self, ns: NamespaceState, key: bytes, slot: int, done: Callable[[bool], None]
    ) -> bool:
        counts = self._flush
        if counts is not None:  # a write-back flush: count how it ends
            inner = done

            def done(ok: bool) -> None:
                if self._flush is counts:
                    if ok:
                        counts.written += 1
                    else:
                        counts.failed += 1
                inner(ok)

        job = WriteJob(
            ns.digest, key, self._view(ns, slot), self.backfill.watch(ns, key, slot, done)
        )
        if self.dispatcher.submit_write(job):
            return True
        self.backfill.missed(ns, key, slot)
        return False

    def lookup(self, ns: bytes, keys: list[bytes], answer: Callable[[int], None]) -> None:
        """Ask the backend how many leading ``keys`` (of namespace ``ns``) it
        holds, for a request the cache could not answer from what it knows;
        ``answer(found)`` runs once: with the count when the backend tells it
        within ``storage.lookup_timeout_s``, else with 0 at that deadline (and
        at once past ``storage.lookups_in_flight`` lookups, while the backend
        is down, or once the tier is stopping). A lookup past its deadline still
        runs to its end, and counts in flight until then: what it finds the cache
        knows from then on, unless the store told of pages it let go of meanwhile
        (the answer may predate it)."""
        counts = self._lookup_counts
        if (
            self._stopping
            or len(self._lookups) >= self.config.lookups_in_flight
            or self.dispatcher.cooling
        ):
            counts["lookups_skipped"] += 1
            answer(0)
            return
        counts["lookups"] += 1
        loop = asyncio.get_running_loop()
        drops = self.cache.l3_drops  # what the store let go of meanwhile is not learned
        answered = False

        def reply(found: int) -> None:
            nonlocal answered
            if not answered:
                answered = True
                answer(found)

        call = loop.create_task(self._ask(ns, keys, reply))
        self._lookups.add(call)

        def late() -> None:
            if not answered:
                counts["lookups_late"] += 1
                reply(0)

        timer = loop.call_later(self.config.lookup_timeout_s, late)

        def ended(call: asyncio.Future[int | None]) -> None:
            self._lookups.discard(call)
            timer.cancel()
            found = 0
            if not call.cancelled():
                exc = call.exception()
                if exc is not None:
                    log.error("L3 lookup failed", exc_info=exc)
                else:
                    found = min(call.result() or 0, len(keys))  # could not tell: a miss
            if found and self.cache.l3_drops == drops:
                self.lookup_pages += self.cache.learn_l3(ns, keys[:found])
            reply(found)

        call.add_done_callback(ended)

    async def _ask(self, ns: bytes, keys: list[bytes], reply: Callable[[int], None]) -> int | None:
        """A lookup's existence check; one past ``storage.op_timeout_s`` is a
        miss at once (``reply``), and its call, which still holds a call slot,
        counts in flight until it ends."""
        found, late = await self.dispatcher.exists_late(ns, keys)
        if late is not None:
            reply(0)
            await asyncio.wait({late})
        return found

    @property
    def down(self) -> bool:
        return self.dispatcher.state == "down"

    def prefetch(self, lease: Lease) -> None:
        task = asyncio.get_running_loop().create_task(self._prefetch(lease))
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)

    async def _prefetch(self, lease: Lease) -> None:
        """Ask the store, read what it holds, and tell the cache; the cache hears
        ``finished`` only once no store call of the prefetch runs, since the
        lease counts against its bounds until then (cache/prefetch.py): a
        check past its timeout is waited for (the prefetch has failed, and
        says so, meanwhile), as ``Dispatcher.get`` waits for its reads."""
        cache, pf, ns = self.cache, lease.prefetch, lease.ns
        assert pf is not None
        try:
            # What the cache learned may be stale, and another host may have written
            # more: ask; what the answer means is the cache's (cache/prefetch.py).
            cache.prefetch_started(lease)
            available, late = await self.dispatcher.exists_late(ns.digest, pf.keys)
            slots = cache.prefetch_planned(lease, available)
            if late is not None:
                await asyncio.wait({late})
            step = self.config.prefetch_batch_pages
            for start in range(0, len(slots), step):
                if pf.ended:
                    break
                batch = [
                    PageRef(pf.keys[i], self._view(ns, slots[i]))
                    for i in range(start, min(start + step, len(slots)))
                ]
                drops = cache.l3_drops  # a page let go of during the read is not learned
                results = await self.dispatcher.get(ns.digest, batch)
                if not cache.prefetch_progress(lease, results, learn=cache.l3_drops == drops):
                    break
        except asyncio.CancelledError:
            pass  # stopping; dispatcher.get returns only once its reads are finished
        except Exception:
            log.exception("prefetch failed")
            pf.failed = True
        finally:
            cache.prefetch_finished(lease)
