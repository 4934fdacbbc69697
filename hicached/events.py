"""KV events for cache-aware routers, in vLLM's wire format.

The cache (synchronous) appends events to an ``EventLog``, a bounded queue
that drops and counts when full. The server's ``Publisher`` sends them in
batches on a ZeroMQ PUB socket as frames ``[topic, seq, payload]``: seq is
an 8-byte big-endian counter, payload a msgpack ``KVEventBatch``. It keeps
the last batches for a replay ROUTER: a client sends ``start_seq`` (8 bytes,
big-endian) and gets every kept batch from there as ``[seq, payload]``, then
``[-1, b""]``. The publisher never blocks the daemon: a full socket drops the
batch (counted) and a slow subscriber catches up through replay.

Media: ``CPU`` for L2 (the shared host pool), the backend's name in capitals
(``FILE``, ``S3``, ``MOONCAKE``, ...) for L3. Block hashes are hicached's
16-byte page keys (docs/keys.md); a BlockStored's parent is the key of the
page before its first block, or None at the start of a sequence.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import msgspec

MEDIUM_L2 = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encode = msgspec.msgpack.Encoder().encode


class EventLog:
    """Events waiting to be published; bounded, and a no-op when disabled."""

    def __init__(self, max_events: int, enabled: bool) -> None:
        self.enabled = enabled
        self.max_events = max_events
        self.pending: collections.deque[BlockStored | BlockRemoved | AllBlocksCleared] = (
            collections.deque()
        )
        self.dropped = 0

    def add(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if not self.enabled:
            return
        if len(self.pending) >= self.max_events:
            self.dropped += 1
            return
        self.pending.append(event)

    def stored(
        self,
        keys: list[bytes],
        parent: bytes | None,
        tokens: list[int],
        page_tokens: int,
        medium: str,
    ) -> None:
        if self.enabled and keys:
            self.add(BlockStored(list(keys), parent, tokens, page_tokens, medium=medium))

    def removed(self, keys: list[bytes], medium: str) -> None:
        if self.enabled and keys:
            self.add(BlockRemoved(list(keys), medium=medium))

    def take(self, n: int) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        while self.pending and len(out) < n:
            out.append(self.pending.popleft())
        return out


class Replay:
    """The last published batches, for the replay socket."""

    def __init__(self, keep: int) -> None:
        self.batches: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=keep)
        self.seq = -1

    def next(self, events: list[Any]) -> tuple[bytes, bytes]:
        """Number and encode a batch; returns (seq bytes, payload)."""
        self.seq += 1
        payload = _encode(KVEventBatch(ts=time.time(), events=events))
        self.batches.append((self.seq, payload))
        return self.seq.to_bytes(8, "big"), payload

    def since(self, start: int) -> list[tuple[int, bytes]]:
        return [(seq, payload) for seq, payload in self.batches if seq >= start]
