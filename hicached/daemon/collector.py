"""The interpreter's cyclic garbage collector in a daemon that holds a large index.

Why the daemon tunes it. A collection walks every reference of every object
it looks at, and a daemon's are many: a million indexed pages are a million
key-index entries (and their heap entries), or a page index whose slot map and
runs hold a million references. A full collection of such a heap held the
event loop for 0.1 s on a quiet machine and 0.3-1.3 s on a busy one, and the
interpreter runs one each time what survived into the oldest generation grew
by a quarter: a dozen while a million pages are stored, three more while
they are listed (bench/checks/gc_pauses.py).

What it does (``server.gc_freeze``, on by default):
- after the start's work that makes long-lived objects (the pool adopted, the
  foreground L3 scan) and when a background startup scan ends, one full
  collection and then ``gc.freeze()``: what survives it moves to the
  permanent generation, which no collection traverses again;
- after a full collection that held the loop longer than ``FREEZE_AFTER_S``,
  its survivors are frozen at once (from the collector's own callback: they
  were just found alive, so no garbage is frozen, and no second pass is paid);
- after a young collection that long, the same, but through a full collection
  the loop runs next (``schedule``): a young collection proves nothing about
  the older generations, whose cyclic garbage a freeze would keep for good.
  Young collections get that long because the interpreter counts objects made
  less objects freed: a pool that turns over (a page stored, a page evicted)
  makes and frees as many, so its new index entries pile up in the youngest
  generation uncollected, until some growth (a listing of a million pages)
  sets off a young collection that walks all of them, and then walks them
  again in each older generation.
- every ``REFREEZE_PAGES`` pages committed (the sweep reports ``stored``), the
  same settling: entries of a pool that turns over never pile up unseen
  (prefetched pages are not counted; the collections they set off are).
A pool that fills or turns over thus pays for each long-lived object in at
most one or two long collections, and every collection stays near
``FREEZE_AFTER_S`` after that.

Measured with a million-entry key index on 2 busy cores (gc_pauses.py,
medians of 3 alternating runs, untuned / raised thresholds / frozen): the
longest hold while it fills 382 / 226 / 28 ms, while it is listed 933 / 262
/ 36 ms; all holds of the turnover and the listing together 2.43 / 0.70 /
0.61 s. Thresholds stay the interpreter's: raised ones (50000, 20, 100) make
full collections rare, but each young collection then walks 70 times as many
objects and more (the longest holds above are young ones), and the full
collection they put off walks everything when it comes; with freezing,
larger ones (7000, 10, 10) only lengthened the longest hold. Freezing is what
bounds a collection.

What freezing costs, and why it is safe here. A frozen object is never freed
by the cyclic collector; reference counting still frees it. The index's
objects are freed by reference counting alone: a radix-tree node is unlinked
from its parent both ways as it is removed (state/index.py ``_remove``,
``drop_owner``), key-index entries point to their parent only
(state/keyindex.py), and the cache's operations make no cyclic garbage at all
(tests/test_collector.py checks both). What a freeze can keep for good is a
transient object in a reference cycle that happened to be alive at that
moment (a task, a future of a call in flight): a few of them for each freeze,
if any: a daemon that stored and matched 12,000 pages written through to a
file store made none (its collections found no unreachable object).
After the start a freeze happens only after a collection long enough to need
one or ``REFREEZE_PAGES`` pages stored, so what it can keep is bounded by the
pages stored, a few objects in tens of thousands of pages. Garbage is never
frozen: a settling collects everything first, and the callback's freeze
follows a full collection. ``hicached_gc_frozen_objects`` shows what is frozen; it
follows the index.

Pauses are measured through ``gc.callbacks`` for every generation (count,
seconds in all, longest, objects found unreachable). The interpreter runs no
collection while a callback runs, whichever thread triggered it, so the
figures have one writer at a time.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

from hicached.wire import protocol as p

log = logging.getLogger("hicached.collector")

GENERATIONS = 3
# A full collection that held the loop longer than this freezes what survived it.
FREEZE_AFTER_S = 0.01
# Pages stored since the last freeze that make the next: one settling then walks
# about this many index entries (10-30 ms), where a pile of a pool's turnover
# walked in one young collection took 0.1 s and more (bench/checks/gc_pauses.py).
REFREEZE_PAGES = 65536


class Collector:
    """The collector's figures (``figures``) and, with ``freeze``, its tuning.

    ``start()`` hooks ``gc.callbacks`` (once; ``stop()`` unhooks). ``settle(why)``
    is called when work that made long-lived objects ends. ``schedule`` runs a
    function on the loop soon, from any thread (``call_soon_threadsafe``): the
    settling after a long young collection; without it there is none.
    ``on_pause``, when set, hears every collection's (generation, seconds): the
    metrics' histogram.
    """

    def __init__(self, freeze: bool) -> None:
        self.freeze = freeze
        self.schedule: Callable[[Callable[[], None]], object] | None = None
        self.on_pause: Callable[[int, float], None] | None = None
        self.collections = [0] * GENERATIONS
        self.pause_s = [0.0] * GENERATIONS
        self.longest_s = [0.0] * GENERATIONS
        self.collected = [0] * GENERATIONS  # unreachable objects found
        self.freezes = 0
        self._began = 0.0
        self._hooked = False
        self._settling = False  # settle's own collection: settle freezes after it
        self._due = False  # a settling is scheduled
        self._stored = 0  # pages stored, as of the last freeze
        self._stored_now = 0

    def start(self) -> None:
        if not self._hooked:
            gc.callbacks.append(self._callback)
            self._hooked = True

    def stop(self) -> None:
        if self._hooked:
            gc.callbacks.remove(self._callback)
            self._hooked = False

    def settle(self, why: str) -> None:
        """Work that made long-lived objects has ended (``why``, for the log):
        collect what is garbage now, then freeze the rest. The one full
        collection is paid once here, instead of in every later one."""
        if self.freeze:
            took = self._collect_and_freeze()
            log.info("collector: %s: %d objects frozen (%.3fs)", why, gc.get_freeze_count(), took)

    def stored(self, pages: int) -> None:
        """``pages`` stored so far (the cache's count); past ``REFREEZE_PAGES``
        more than at the last freeze, settle: on the loop, between requests."""
        self._stored_now = pages
        if self.freeze and pages - self._stored >= REFREEZE_PAGES:
            took = self._collect_and_freeze()
            log.debug("collector: %d pages stored since the last freeze: %.3fs", pages, took)

    def _collect_and_freeze(self) -> float:
        self._due = False
        self._stored = self._stored_now
        started = time.perf_counter()
        self._settling = True
        try:
            gc.collect()
        finally:
            self._settling = False
        gc.freeze()
        self.freezes += 1
        return time.perf_counter() - started

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
            return
        generation = info["generation"]
        took = now - self._began
        self.collections[generation] += 1
        self.pause_s[generation] += took
        self.collected[generation] += info["collected"]
        if took > self.longest_s[generation]:
            self.longest_s[generation] = took
        if self.freeze and took > FREEZE_AFTER_S and not self._settling:
            if generation == GENERATIONS - 1:
                # what this collection found alive is frozen before anything else
                # runs: no garbage goes with it, and it is not traversed again
                gc.freeze()
                self.freezes += 1
            elif not self._due and self.schedule is not None:
                self._due = True
                self.schedule(self._after_young)
        if self.on_pause is not None:
            self.on_pause(generation, took)

    def _after_young(self) -> None:
        if self._due:
            took = self._collect_and_freeze()
            log.debug("collector: after a long young collection, frozen in %.3fs", took)

    def figures(self) -> p.CollectorStats:
        return p.CollectorStats(
            freeze=self.freeze,
            frozen_objects=gc.get_freeze_count(),
            freezes=self.freezes,
            collections=list(self.collections),
            pause_s=[round(s, 6) for s in self.pause_s],
            longest_s=[round(s, 6) for s in self.longest_s],
            collected=list(self.collected),
        )
