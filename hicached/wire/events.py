"""KV events in vLLM's wire format: what the cache records, and how it is sent.

The cache records events with hicached's 16-byte page keys (docs/keys.md) and
the namespace's model (``Stored``, ``Removed``, ``Cleared``); on the wire they
are vLLM's structs (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``)
in a msgpack ``KVEventBatch``, encoded as vLLM encodes them now (events as
maps; ``events.format = "array"`` gives the older positional layout), and a
block hash is, by default, vLLM's 64-bit integer form of the key
(``block_hash``). A BlockStored's parent is the key of the page before its
first block, or None at the start of a sequence (and where it is not known).

Media: ``CPU`` for L2 (the shared host pool), the backend's name in capitals
(``FILE``, ``S3``, ``MOONCAKE``, ...) for L3. How batches are queued, sent
and replayed: cache/eventlog.py and daemon/publisher.py.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from hicached.config import EventsConfig

MEDIUM_L2 = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_LOW64 = (1 << 64) - 1


# -- what the cache records: hicached's keys, and the namespace's model ----------------


class Stored(msgspec.Struct, gc=False):
    """Pages became available in ``medium``; ``keys`` are consecutive pages of one
    sequence, ``parent`` the key before the first (None at the start, or unknown)."""

    keys: list[bytes]
    parent: bytes | None
    tokens: list[int]  # the pages' token ids; [] where not known
    block_size: int  # the namespace's page_tokens; 0 where not known
    medium: str
    model: str = ""  # the namespace's model ("" where not known): the topic's {model}
    # vLLM's KV cache group of every page (from vLLM keys' 4-byte suffix), and the
    # group's spec kind and sliding window (the namespace's EventMeta); None: not known
    group: int | None = None
    kind: str | None = None
    window: int | None = None


class Removed(msgspec.Struct, gc=False):
    """Pages left ``medium``."""

    keys: list[bytes]
    medium: str
    model: str = ""
    group: int | None = None


class Cleared(msgspec.Struct, gc=False):
    """Everything this daemon announced before is gone (sent once, at start)."""

    model: str = ""


AnyEvent = Stored | Removed | Cleared


# -- the wire: vLLM's structs (vllm/distributed/kv_events.py), field for field --------

BlockHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event as vLLM encodes it now: a map tagged ``type``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # vLLM's optional fields (0.32, then 0.33's lookahead_token_ids). hicached
    # fills group_idx and the KV cache spec's kind and window for vLLM-keyed
    # namespaces (docs/events.md) and leaves the rest at None, which a map omits:
    # vLLM 0.32 and 0.33 both decode these bytes.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    # Tokens past each block that its hash covers; None: no lookahead (hicached's
    # keys hash a page's own tokens, and a key-addressed page's are not known).
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event in the older positional layout: ``[tag, field, ...]``, vLLM's
    required fields only. msgspec writes every field of an array (defaults
    too), and a decoder reads an array with fewer trailing fields (they take
    their defaults) or more (it ignores them): so the optional fields stay
    out, and decoders that know more of them read these arrays unchanged."""


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


WireBatch = KVEventBatch | ArrayKVEventBatch

batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(ArrayKVEventBatch)


def decode_batch(payload: bytes, layout: str = "map") -> WireBatch:
    """A payload as hicached's own subscriber tools read it (``events.format``)."""
    return _array_decoder.decode(payload) if layout == "array" else batch_decoder.decode(payload)


def event_key(scheme: str, key: bytes) -> bytes:
    """What an engine's own events name a page of a key-addressed namespace by:
    vLLM's offload keys end in a 4-byte KV group index after the block hash,
    which vLLM's events carry alone; other schemes' keys are the page hash."""
    if scheme.startswith("vllm-") and len(key) > 4:
        return key[:-4]
    return key


# A key-addressed page's *event name*, as the cache keeps it: the key its events
# carry (event_key) followed by its KV cache group index, 4 bytes big-endian, or
# NO_GROUP. A vLLM offload key is its own event name (block hash || group index),
# so naming it costs nothing; other schemes' keys get NO_GROUP appended. The name
# says its group wherever it travels (L2, L3 writes and drops, prefetches,
# adoption), and no event mixes two groups (EventLog splits runs).
NO_GROUP = b"\xff\xff\xff\xff"
GROUP_BYTES = 4


def event_name(scheme: str, key: bytes) -> bytes:
    """The event name of engine key ``key`` of a namespace of ``scheme``."""
    if scheme.startswith("vllm-") and len(key) > GROUP_BYTES:
        return key
    return key + NO_GROUP


def name_of(ekey: bytes, group: int | None) -> bytes:
    """The event name of the event key ``ekey`` of a page of KV group ``group``."""
    return ekey + (NO_GROUP if group is None else group.to_bytes(GROUP_BYTES, "big"))


def split_name(name: bytes) -> tuple[bytes, int | None]:
    """An event name's event key and group index (None: no group)."""
    suffix = name[-GROUP_BYTES:]
    return name[:-GROUP_BYTES], None if suffix == NO_GROUP else int.from_bytes(suffix, "big")


def block_hash(key: bytes, form: str = "int") -> BlockHash:
    """The wire form of a page key: vLLM's 64-bit integer (the key's last 8 bytes,
    big-endian, unsigned; vLLM's ``int.from_bytes(h, "big") & (2**64 - 1)``), or
    the key itself (``events.block_hashes = "bytes"``)."""
    return int.from_bytes(key, "big") & _LOW64 if form == "int" else key


def split_event(event: AnyEvent, parts: int) -> list[AnyEvent] | None:
    """``event`` as up to ``parts`` events of consecutive pages, in order, that say
    together what it says; None for an event of one page (or none), which
    cannot be split. A BlockStored piece names the last page of the piece
    before it as its parent, as a sequence's next commit would, and keeps the
    tokens of its own pages."""
    if isinstance(event, Cleared) or len(event.keys) < 2:
        return None
    keys = event.keys
    step = -(-len(keys) // min(parts, len(keys)))  # pages per piece, rounded up
    cuts = range(0, len(keys), step)
    if isinstance(event, Removed):
        return [Removed(keys[i : i + step], event.medium, event.model, event.group) for i in cuts]
    tokens, per = event.tokens, len(event.tokens) // len(keys)
    if tokens and per * len(keys) != len(tokens):
        return None  # tokens that are not whole pages: where to cut them is not known
    return [
        Stored(
            keys[i : i + step],
            event.parent if i == 0 else keys[i - 1],
            tokens[i * per : (i + step) * per],
            event.block_size,
            event.medium,
            event.model,
            event.group,
            event.kind,
            event.window,
        )
        for i in cuts
    ]


# What a batch costs beside its events, at most: an array header (1 byte), the
# float64 timestamp (9), the events' array header (5) and data_parallel_rank (9).
BATCH_HEAD_BYTES = 24


class WireFormat:
    """Turns recorded events into one encoded ``KVEventBatch`` (``events.format``,
    ``events.block_hashes``, ``events.data_parallel_rank``), or into several no
    larger than a given size (``encode_within``)."""

    def __init__(self, config: EventsConfig) -> None:
        self._array = config.format == "array"
        self._cleared: Any = ArrayAllBlocksCleared() if self._array else AllBlocksCleared()
        self._batch = ArrayKVEventBatch if self._array else KVEventBatch
        self._ints = config.block_hashes == "int"
        self.rank = config.data_parallel_rank
        self._encode = msgspec.msgpack.Encoder().encode

    def _hashes(self, keys: list[bytes]) -> list[BlockHash]:
        if not self._ints:
            return list(keys)
        frombytes = int.from_bytes
        return [frombytes(k[-8:], "big") for k in keys]

    def wire(self, event: AnyEvent) -> Any:
        if isinstance(event, Stored):
            parent: BlockHash | None = event.parent
            if event.parent is not None and self._ints:
                parent = int.from_bytes(event.parent[-8:], "big")
            hashes = self._hashes(event.keys)
            if self._array:  # the positional layout: vLLM's required fields only
                return ArrayBlockStored(
                    hashes, parent, event.tokens, event.block_size, None, event.medium, None
                )
            return BlockStored(
                hashes,
                parent,
                event.tokens,
                event.block_size,
                None,
                event.medium,
                None,
                group_idx=event.group,
                kv_cache_spec_kind=event.kind,
                kv_cache_spec_sliding_window=event.window,
            )
        if isinstance(event, Removed):
            if self._array:
                return ArrayBlockRemoved(self._hashes(event.keys), event.medium)
            return BlockRemoved(self._hashes(event.keys), event.medium, group_idx=event.group)
        return self._cleared

    def encode(self, events: list[AnyEvent]) -> bytes:
        wire = self.wire
        batch = self._batch(time.time(), [wire(e) for e in events], self.rank)
        return self._encode(batch)

    def encode_within(self, events: list[AnyEvent], limit: int) -> list[bytes | None]:
        """``events`` as batches of at most ``limit`` bytes each, in order: as many
        whole events as fit go in one batch, and an event too large for a batch
        of its own is split between pages (``split_event``). None stands where an
        event of one page is larger than ``limit`` alone: it cannot be sent.

        Each event is encoded once on its own and its bytes placed in a batch
        as they are (msgpack encodes an element of an array as it encodes it
        alone, and ``EventBatch`` lays a batch out as both layouts' batches do);
        this is the slow path, for what ``encode`` made too large."""
        room = limit - BATCH_HEAD_BYTES
        assert room > 0, f"a batch of {limit} bytes holds no event"
        encode, wire, now, rank = self._encode, self.wire, time.time(), self.rank
        out: list[bytes | None] = []
        batch: list[msgspec.Raw] = []
        size = 0
        todo = list(reversed(events))
        while todo:
            event = todo.pop()
            raw = encode(wire(event))
            if len(raw) > room:
                pieces = split_event(event, -(-len(raw) // room))
                if pieces is None:
                    if batch:  # the events before it go first
                        out.append(encode(EventBatch(now, batch, rank)))
                        batch, size = [], 0
                    out.append(None)
                else:
                    todo.extend(reversed(pieces))  # each is checked again
                continue
            if size + len(raw) > room:
                out.append(encode(EventBatch(now, batch, rank)))
                batch, size = [], 0
            batch.append(msgspec.Raw(raw))
            size += len(raw)
        if batch:
            out.append(encode(EventBatch(now, batch, rank)))
        return out
