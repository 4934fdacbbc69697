"""Writes of L2 pages that L3 lacks, in the background: the tier's second path
to the store beside the writes the cache asks for as pages are committed.

- **Adopted pages** (docs/restarts.md): where the write policy writes every
  page, those the daemon before left unwritten (their writes were queued or
  under way when it stopped), once L3's listing ended; asked of the store
  first where no listing ends.
- **Missed pages**: where the write policy writes every page
  (``write_through``), a page whose write could not be queued (the store
  down, the write queue full) or failed is in L2 only. Its key and slot are
  noted (at most ``_MAX_MISSED``; past that, every page L2 holds and L3
  lacks is listed instead), and once the store is up those still in L2 are
  written (``backfill`` counters): an outage, or a burst past the queue's
  bound, leaves L3 whole again rather than short of every page committed
  meanwhile. A run starts ``_FIRST_WAIT_S`` after the first miss (the misses
  meanwhile go with it); while writes fail and none succeeds, each wait is
  twice the last, up to ten minutes.

Both queue their writes as the write queue has room beyond half its bound
(the other half is kept for the writes of pages committed meanwhile), never
dropping one for lack of it, and let requests in between two batches.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hicached.cache import Cache, NamespaceState
from hicached.config import StorageConfig
from hicached.daemon.dispatcher import Dispatcher

log = logging.getLogger("hicached.storage")

# pages of L2 listed at once (about 3 ms)
_LIST_BATCH_PAGES = 4096
# calls in flight asking the store about pages when no listing ended
_ASK_AT_ONCE = 32
# a missed write is written again this long after it was missed (more missed
# meanwhile go with it); while writes fail, twice as long as the last time,
# up to _MAX_WAIT_S
_FIRST_WAIT_S = 1.0
_MAX_WAIT_S = 600.0
# missed pages noted by key (about 200 bytes each); past it, L2 is listed
_MAX_MISSED = 65536

Page = tuple[NamespaceState, bytes, int, int]  # Cache.unwritten_pages's


@dataclass(slots=True)
class FlushCounts:
    """What one run of queued writes did (the write-back flush logs it at the stop)."""

    pages: int = 0  # L2 pages L3 lacked when it began
    queued: int = 0
    written: int = 0
    failed: int = 0  # queued, but the backend refused or failed them
    skipped: int = 0  # written meanwhile by another path, or gone from L2

    @property
    def left(self) -> int:
        """Pages not written by the deadline (never queued, or still queued or in flight)."""
        return self.pages - self.written - self.failed - self.skipped


class Backfill:
    """The background writes of adopted and missed pages L3 lacks."""

    def __init__(self, cache: Cache, dispatcher: Dispatcher, config: StorageConfig) -> None:
        self.cache = cache
        self.dispatcher = dispatcher
        self.config = config
        self._adopted: asyncio.Task[None] | None = None
        self._missed_task: asyncio.Task[None] | None = None
        # pages that belong in L3 whose writes were missed since the last run:
        # key -> (namespace digest, slot); past _MAX_MISSED, ``_overflow``
        self._missed: dict[bytes, tuple[bytes, int]] = {}
        self._overflow = False
        self._failed = False  # a write failed since the last wait began
        self._written = False  # a write succeeded since the last wait began
        self._wait = _FIRST_WAIT_S  # the last wait before a run of missed pages
        self._last_run = -math.inf  # when the last run ended (monotonic)
        self._stopping = False
        self._counts = {"backfill_runs": 0, "backfill_queued": 0}

    @property
    def counters(self) -> dict[str, int]:
        """Runs and writes queued (counters), and the missed pages waiting for
        the next run (a gauge: ``backfill_pending``)."""
        return {**self._counts, "backfill_pending": len(self._missed)}

    # -- adopted pages -------------------------------------------------------------

    def adopted_listed(self) -> None:
        """L3's listing ended: write the adopted pages it lacks (unless pages
        are being asked of the store already)."""
        if self._stopping or (self._adopted is not None and not self._adopted.done()):
            return
        batches = self.cache.adopted_unwritten(_LIST_BATCH_PAGES)
        if batches is not None:
            self._adopted = asyncio.get_running_loop().create_task(
                self._write(batches, "adopted pages L3 lacked")
            )

    def adopted_unlisted(self, why: str) -> None:
        """Adopted pages wait for L3's listing to say which it lacks; a store that
        cannot be listed (a bucket without the list permission, a scan turned
        off) would leave them unwritten for good, lost to L3 when they leave L2.
        Without a listing each is asked of the store (``exists``) and written
        where it does not hold it. Once: a listing that ends later finds the
        pages written by then in L3 and writes any other."""
        if self._adopted is not None or self._stopping:
            return
        batches = self.cache.adopted_unwritten(_LIST_BATCH_PAGES)
        if batches is None:
            return
        log.info("%s: adopted pages are asked of the store and written where it lacks them", why)
        loop = asyncio.get_running_loop()
        self._adopted = loop.create_task(self._write(batches, "adopted pages L3 lacked", ask=True))

    # -- missed pages --------------------------------------------------------------

    def watch(
        self, ns: NamespaceState, key: bytes, slot: int, done: Callable[[bool], None]
    ) -> Callable[[bool], None]:
        """``done`` of the write of page ``key`` in ``slot``, noting a failure
        where the policy writes every page."""
        if not self.cache.policy.writes_all:
            return done

        def watched(ok: bool) -> None:
            if ok:
                self._written = True
            else:
                self._failed = True
                self.missed(ns, key, slot)
            done(ok)

        return watched

    def missed(self, ns: NamespaceState, key: bytes, slot: int) -> None:
        """Page ``key`` in ``slot`` belongs in L3 and was not written (not
        queued, or failed)."""
        if self._stopping or not self.cache.policy.writes_all:
            return
        if len(self._missed) < _MAX_MISSED or key in self._missed:
            self._missed[key] = (ns.digest, slot)
        else:
            self._overflow = True
        self._run_soon()

    def write_all(self) -> None:
        """Write every page L2 holds and L3 lacks, as a run past the notes'
        bound does (the write policy now writes every page: a reload)."""
        if self._stopping:
            return
        log.info("the write policy now writes every page: those L2 holds and L3 lacks are written")
        self._overflow = True
        self._run_soon()

    def _run_soon(self) -> None:
        """A run of missed pages, unless one is on its way."""
        if self._missed_task is None or self._missed_task.done():
            self._missed_task = asyncio.get_running_loop().create_task(self._write_missed())

    def _next_wait(self) -> float:
        """``_FIRST_WAIT_S``, or twice the last wait while writes fail: since the
        last wait began writes failed and none succeeded, and the last run
        ended moments ago. A store that flaps (its outages are waited out on
        the breaker) writes between them, and keeps the first wait."""
        recent = time.monotonic() - self._last_run <= self._wait + 2 * self.config.op_timeout_s
        failing = self._failed and not self._written and recent
        self._failed = self._written = False
        self._wait = min(2 * self._wait, _MAX_WAIT_S) if failing else _FIRST_WAIT_S
        return self._wait

    async def _write_missed(self) -> None:
        """Once the store is up, write the missed pages still in L2 that L3
        lacks, until a run leaves none missed (or the policy no longer writes
        every page)."""
        cache = self.cache
        while self._missed or self._overflow:
            await asyncio.sleep(self._next_wait())
            await self.dispatcher.breaker.up.wait()  # its prober brings it up
            missed, self._missed = self._missed, {}
            overflow, self._overflow = self._overflow, False
            if not cache.policy.writes_all:  # reloaded
                return
            self._counts["backfill_runs"] += 1
            what = "pages whose writes were missed"
            if overflow:  # too many to note: every page L2 holds and L3 lacks
                batches = cache.tiering.unwritten_batches(_LIST_BATCH_PAGES)
                # without a listing, "not known in L3" proves nothing: each is asked
                await self._write(batches, what, ask=not cache.l3.complete, level=logging.DEBUG)
            else:
                await self._write(self._still_held(missed), what, level=logging.DEBUG)
            self._last_run = time.monotonic()

    def _still_held(self, missed: dict[bytes, tuple[bytes, int]]) -> Iterator[list[Page]]:
        """The missed pages, in batches of the listing's size; a page gone from
        its slot since (evicted, the slot reused) is left out when its write
        would be queued (``Cache.write_back``: a generation of -1 matches none,
        so the slot's index says whether it still holds the key)."""
        names = self.cache.names.by_digest
        batch: list[Page] = []
        for key, (digest, slot) in missed.items():
            ns = names.get(digest)
            if ns is not None:
                batch.append((ns, key, slot, -1))
            if len(batch) == _LIST_BATCH_PAGES:
                yield batch
                batch = []
        if batch:
            yield batch

    # -- both ----------------------------------------------------------------------

    async def _lacking(self, pages: list[Page]) -> list[Page]:
        """Of ``pages``, those the store does not say it holds (asked one key a
        call, at most _ASK_AT_ONCE calls at once); those it holds are learned.
        A page it cannot tell of now (down, late) is written: a write is
        idempotent, a page left unwritten may be lost."""
        lacking = []
        for start in range(0, len(pages), _ASK_AT_ONCE):
            part = pages[start : start + _ASK_AT_ONCE]
            held = await asyncio.gather(
                *(self.dispatcher.exists(ns.digest, [key]) for ns, key, _, _ in part)
            )
            for page, count in zip(part, held, strict=True):
                if count:
                    self.cache.learn_l3(page[0].digest, [page[1]])
                else:
                    lacking.append(page)
        return lacking

    async def _write(
        self,
        batches: Iterator[list[Page]],
        what: str,
        *,
        ask: bool = False,
        level: int = logging.INFO,
    ) -> None:
        """Queue writes of ``batches`` as the write queue has room (none is
        dropped for lack of it), until all are queued or the daemon stops;
        requests are served between two batches. ``ask``: no listing ended,
        so each page is asked of the store first."""
        counts = FlushCounts()
        try:
            for pages in batches:
                if ask:
                    pages = await self._lacking(pages)
                counts.pages += len(pages)
                # half the queue stays for the writes of pages committed meanwhile
                await self.queue_writes(pages, math.inf, counts, self.config.queue_pages // 2)
                await asyncio.sleep(0)  # a batch L3 has whole queues nothing: yield all the same
        except Exception:  # a bug here must not stop the daemon's stop
            log.exception("writing %s failed after %d", what, counts.queued)
            return
        self._counts["backfill_queued"] += counts.queued
        if counts.pages:  # a run of missed pages a second under load: counted, not logged
            log.log(level, "%s: %d, %d writes queued", what, counts.pages, counts.queued)

    async def queue_writes(
        self, pages: list[Page], end: float, counts: FlushCounts, keep: int = 0
    ) -> None:
        """Queue writes of ``pages`` (``Cache.unwritten_pages``'s) as many at a time
        as the write queue has room for beyond ``keep`` pages, and more as it
        drains, until all are queued or ``end``; ``counts`` counts them. No
        page is dropped for lack of room; one written meanwhile, or gone from
        L2, is skipped."""
        dispatcher = self.dispatcher
        i = 0
        while i < len(pages) and (now := time.monotonic()) < end:
            room = dispatcher.room - keep
            if room <= 0 or dispatcher.state == "down":  # its probe brings it up
                await dispatcher.wait_room(min(0.05, end - now))
                continue
            step = pages[i : i + room]
            i += len(step)
            queued = self.cache.write_back(step)
            counts.queued += queued
            counts.skipped += len(step) - queued
            await asyncio.sleep(0)  # let the writers take what was queued

    def stop(self) -> list[asyncio.Task[Any]]:
        """No run starts from now; the runs under way, for the stop to end."""
        self._stopping = True
        tasks = [task for task in (self._adopted, self._missed_task) if task is not None]
        self._adopted = self._missed_task = None
        return tasks
