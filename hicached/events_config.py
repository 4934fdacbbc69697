"""The ``[events]`` section: KV events for cache-aware routers, as the config
says them (docs/events.md). A section of hicached.config, which names it as
its own."""

from __future__ import annotations

import string

import msgspec

from hicached.endpoints import check_endpoint
from hicached_backends.options import positive

__all__ = ["BLOCK_HASHES", "EVENT_FORMATS", "MAX_HWM", "MIN_BATCH_KIB", "EventsConfig"]

_Section = {"kw_only": True, "forbid_unknown_fields": True}
# The largest high-water mark ZeroMQ takes (a C int).
MAX_HWM = (1 << 31) - 1
# events.batch_kib at least: a batch holds a page of 3,000 tokens or more.
MIN_BATCH_KIB = 16


EVENT_FORMATS = ("map", "array")
BLOCK_HASHES = ("int", "bytes")


class EventsConfig(msgspec.Struct, **_Section):
    """KV events for cache-aware routers (vLLM's format; docs/events.md)."""

    # PUB endpoint; "" = no events. ipc:// or tcp:// on loopback only. With
    # [tenants] the events are the daemon's user's over ipc, and need CURVE keys no
    # tenant lists over tcp (docs/events.md).
    endpoint: str = ""
    # ROUTER endpoint for replaying missed batches; "" = no replay.
    replay_endpoint: str = ""
    # Group (name or number) whose members may subscribe over ipc, with or without
    # [tenants]: both sockets become 0660 of that group, and a directory of their
    # own 2750 (docs/events.md). "" = as the line above endpoint says.
    group: str = ""
    # The topic frame of every message. {host} becomes this host's name,
    # {model} the model of the namespace the batch's events are in ("" where
    # no one namespace is known, e.g. the AllBlocksCleared at start); the
    # default is the kv@<pod>@<model> form routers filter on.
    topic: str = "kv@{host}@{model}"
    # "map": events as vLLM encodes them now (structs as maps); "array": the
    # older positional layout, for consumers that still decode it.
    format: str = "map"
    # "int": block hashes as vLLM's default 64-bit integers (the last 8 bytes
    # of hicached's 16-byte page key, big-endian); "bytes": the whole key.
    block_hashes: str = "int"
    # data_parallel_rank stamped on every batch.
    data_parallel_rank: int = 0
    # Events waiting to be sent, at most; more are dropped and counted.
    queue_events: int = 100000
    # Memory the events waiting to be sent may take, at most, in MiB, counted as
    # 40 bytes a token id and 64 a key (an L2 commit's event carries every token
    # id of its pages); more are dropped and counted, as past queue_events.
    queue_mib: int = 64
    # Events per published batch, at most.
    batch_events: int = 64
    # One batch's payload, at most, in KiB: events that would make a batch
    # larger go out in several, and an event of many pages is split between
    # pages (each piece names the page before it as its parent). Sized so
    # every queue below can be bounded in bytes (ZeroMQ counts messages):
    # 64 commits of 2,048-token prompts (about 550 KiB) go out as one batch,
    # and the largest page (65,536 tokens, 321 KiB) fits. A one-page event
    # larger than this is dropped and counted (events_oversized), a gap.
    batch_kib: int = 1024
    # How often pending events are published, in seconds.
    flush_interval_s: float = 0.01
    # Published batches kept for replay, at most.
    replay_batches: int = 10000
    # Memory the replay batches may take, at most, in MiB: the oldest go first
    # when the newest would take more (replay_batches of 1 MiB could take 10 GB).
    replay_mib: int = 256
    # Batches queued per subscriber on the events socket, at most: a batch that
    # finds any subscriber's queue full is dropped for all of them and counted.
    # buffer_mib lowers it to what fits in that memory.
    hwm: int = 100000
    # Memory the events socket may hold for subscribers that read too slowly,
    # in MiB, and as much again for replay readers: the socket queues at most
    # buffer_mib / batch_kib batches per subscriber (when that is below hwm;
    # the subscribers share one copy of each), the replay socket 1/32 of that
    # per reader (32 replays at most run at once; fewer, as many as it holds
    # batches, where buffer_mib / batch_kib is below 32).
    buffer_mib: int = 256
    # A replay whose reader reads nothing for this many seconds ends there: the
    # reader gets the batches sent so far, then the end marker.
    replay_timeout_s: float = 5.0
    # Seconds the live stream may stay refused (a subscriber that stays connected
    # but reads nothing keeps its queue full, and every batch is dropped for all)
    # before the events socket is bound anew: every subscriber's connection is
    # cut, they reconnect on their own and fill the gap from replay; 0 = never.
    stall_s: float = 30.0
    # Seconds a graceful stop lets queued events (and replays) leave before
    # the sockets close; an hour at most.
    close_linger_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value:
                try:
                    check_endpoint(value, remote=True)  # loopback unless CURVE: Config
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        if self.replay_endpoint and not self.endpoint:
            raise ValueError("replay_endpoint needs endpoint too")
        if self.group != self.group.strip() or ":" in self.group:
            raise ValueError(f"group {self.group!r}: give one group name or number")
        if self.group and not any(
            e.startswith("ipc://") for e in (self.endpoint, self.replay_endpoint)
        ):
            raise ValueError("group needs an ipc:// endpoint (over tcp:// CURVE keys decide)")
        self._check_topic()
        if self.format not in EVENT_FORMATS:
            raise ValueError(f"format must be one of {', '.join(EVENT_FORMATS)}")
        if self.block_hashes not in BLOCK_HASHES:
            raise ValueError(f"block_hashes must be one of {', '.join(BLOCK_HASHES)}")
        if self.data_parallel_rank < 0:
            raise ValueError("data_parallel_rank must not be negative")
        positive(
            self,
            "queue_events",
            "queue_mib",
            "batch_events",
            "flush_interval_s",
            "replay_batches",
            "hwm",
        )
        if self.batch_kib < MIN_BATCH_KIB:
            raise ValueError(
                f"batch_kib must be at least {MIN_BATCH_KIB} (a page of a few thousand tokens)"
            )
        for name in ("buffer_mib", "replay_mib"):
            if getattr(self, name) * 1024 < self.batch_kib:
                raise ValueError(f"{name} must hold one batch at least (batch_kib)")
        positive(self, "replay_timeout_s")
        if self.hwm > MAX_HWM:
            raise ValueError(f"hwm must be at most {MAX_HWM} (ZeroMQ's limit)")
        if self.replay_batches >= MAX_HWM:  # the replay socket queues them and an end marker
            raise ValueError(f"replay_batches must be at most {MAX_HWM - 1} (ZeroMQ's limit)")
        # ZeroMQ takes the linger in milliseconds as a C int: past 24 days a stop
        # failed with an OverflowError traceback, after the stop's other work
        if not 0 <= self.close_linger_s <= 3600:
            raise ValueError("close_linger_s must not be negative, an hour at most")
        if self.stall_s < 0:
            raise ValueError("stall_s must not be negative (0 = never)")

    def _check_topic(self) -> None:
        """Only {host} and {model} as they are: a format spec ({host:>999999999}
        made a string that wide at every check), an index or an attribute
        ({model[0]}: the daemon's start failed with a traceback, and check-config
        passed) or a conversion fails or surprises when the daemon publishes."""
        why = "only {host} and {model} may be filled in, as they are"
        try:
            parts = list(string.Formatter().parse(self.topic))
        except ValueError as exc:
            raise ValueError(f"topic {self.topic!r}: {why} ({exc})") from None
        for _, field, spec, conversion in parts:
            if field is None or (field in ("host", "model") and not spec and not conversion):
                continue
            given = field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(f"topic {self.topic!r}: {why}, not {{{given}}}")
