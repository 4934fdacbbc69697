"""The queue of KV events the cache records, for the publisher to send.

Synchronous and free of I/O: the cache appends, the daemon's publisher
(daemon/publisher.py) takes batches. Bounded in events (``events.queue_events``)
and in bytes (``events.queue_mib``): one event may carry the token ids and keys
of a whole request (a commit of thousands of pages), so a count alone would
let the queue hold gigabytes. Events that find it full are dropped and
counted, and leave a gap in the sequence numbers.
"""

from __future__ import annotations

import collections

from hicached.wire.events import AnyEvent, Removed, Stored, split_name
from hicached.wire.namespace import EventMeta

# Reason under which events the full queue refused are counted in ``dropped``.
QUEUE_DROPS = "events_queue"
# What a queued event takes, as the byte bound counts it: the event and its
# lists, each token id (a Python int, 28 to 32 bytes, and its list entry) and
# each key (a bytes object of 16 and its entry; keys are often shared with
# the index, so this is the most they take).
EVENT_BYTES = 256
TOKEN_BYTES = 40
KEY_BYTES = 64


def event_bytes(event: AnyEvent) -> int:
    """What ``event`` takes in the queue, as its byte bound counts it."""
    if isinstance(event, Stored):
        return EVENT_BYTES + KEY_BYTES * len(event.keys) + TOKEN_BYTES * len(event.tokens)
    if isinstance(event, Removed):
        return EVENT_BYTES + KEY_BYTES * len(event.keys)
    return EVENT_BYTES


class EventLog:
    """Events waiting to be published; bounded, and a no-op when disabled.

    At most ``max_events`` events and ``max_bytes`` bytes (``event_bytes``
    each). Events that find the queue full, and an event larger than
    ``max_bytes`` alone, are dropped and counted (``dropped``, and
    under ``events_queue`` in the counters given to ``count_drops_in``); the
    place where they would have been is remembered, and ``take`` stops there
    so the publisher can leave a gap in the sequence numbers.
    """

    def __init__(self, max_events: int, enabled: bool, max_bytes: int = 64 << 20) -> None:
        self.enabled = enabled
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.bytes = 0  # what the pending events take (event_bytes)
        self.pending: collections.deque[tuple[AnyEvent, int]] = collections.deque()
        self.dropped = 0
        self._counters: dict[str, int] | None = None
        self._queued = 0  # events ever queued
        self._taken = 0  # events ever taken
        # Positions (counted in queued events) after which events were dropped.
        self._gaps: collections.deque[int] = collections.deque()

    def count_drops_in(self, counters: dict[str, int]) -> None:
        """Count drops (those so far, and every later one) in ``counters``."""
        if self.dropped:
            counters[QUEUE_DROPS] = counters.get(QUEUE_DROPS, 0) + self.dropped
        self._counters = counters

    def add(self, event: AnyEvent) -> None:
        if not self.enabled:
            return
        size = event_bytes(event)
        if len(self.pending) >= self.max_events or self.bytes + size > self.max_bytes:
            self.dropped += 1
            if self._counters is not None:
                self._counters[QUEUE_DROPS] = self._counters.get(QUEUE_DROPS, 0) + 1
            if not self._gaps or self._gaps[-1] != self._queued:
                self._gaps.append(self._queued)  # one gap per run of drops
            return
        self.pending.append((event, size))
        self.bytes += size
        self._queued += 1

    def stored(
        self,
        keys: list[bytes],
        parent: bytes | None,
        tokens: list[int],
        page_tokens: int,
        medium: str,
        model: str = "",
    ) -> None:
        if self.enabled and keys:
            self.add(Stored(list(keys), parent, tokens, page_tokens, medium, model))

    def removed(self, keys: list[bytes], medium: str, model: str = "") -> None:
        if self.enabled and keys:
            self.add(Removed(list(keys), medium, model))

    def stored_named(
        self,
        names: list[bytes],
        parent: bytes | None,
        page_tokens: int,
        medium: str,
        model: str,
        meta: EventMeta | None,
    ) -> None:
        """BlockStored of consecutive key-addressed pages given by event names
        (wire/events.py: key || group), ``parent`` the name of the page before
        the first: one event per run of one group, each with its group, and
        the group's kind and window where ``meta`` gives them."""
        if not (self.enabled and names):
            return
        kind, window = (meta.kind, meta.sliding_window) if meta is not None else (None, None)
        up = split_name(parent)[0] if parent else None
        for keys, group in _runs(names):
            self.add(Stored(keys, up, [], page_tokens, medium, model, group, kind, window))
            up = keys[-1]

    def removed_named(self, names: list[bytes], medium: str, model: str = "") -> None:
        """BlockRemoved of key-addressed pages given by event names: one event per
        run of one group."""
        if self.enabled and names:
            for keys, group in _runs(names):
                self.add(Removed(keys, medium, model, group))

    def take(self, n: int) -> tuple[list[AnyEvent], bool]:
        """Up to ``n`` events, oldest first, never across a gap; the flag says
        that events were dropped right after these (the gap is then consumed)."""
        limit = min(n, len(self.pending))
        gaps = self._gaps
        if gaps:
            limit = min(limit, gaps[0] - self._taken)
        pop = self.pending.popleft
        taken = [pop() for _ in range(limit)]
        self.bytes -= sum(size for _, size in taken)
        out = [event for event, _ in taken]
        self._taken += limit
        if gaps and gaps[0] == self._taken:
            gaps.popleft()
            return out, True
        return out, False

    @property
    def gaps(self) -> int:
        """Runs of dropped events not yet passed to the publisher."""
        return len(self._gaps)


def _runs(names: list[bytes]) -> list[tuple[list[bytes], int | None]]:
    """Event names as runs of one group, in order: (event keys, group)."""
    runs: list[tuple[list[bytes], int | None]] = []
    keys: list[bytes] = []
    group: int | None = None
    for name in names:
        key, g = split_name(name)
        if keys and g != group:
            runs.append((keys, group))
            keys = []
        group = g
        keys.append(key)
    if keys:
        runs.append((keys, group))
    return runs
