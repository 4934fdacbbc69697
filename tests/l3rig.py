"""A Cache with events on and an L3 tier whose writes wait until the test
completes or fails them (fault injection, as tests/test_cache_model.py's
HeldTier), driven through Cache.handle as the server drives it."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hicached import protocol as p
from hicached.cache import Cache, L3Lookup, Lease, NamespaceState
from hicached.config import Config, EventsConfig, LeaseConfig, PoolConfig, StorageConfig
from hicached.events import Removed, Stored
from hicached.hashing import pack_tokens, page_keys

PAGE = 256 * 1024  # 8 slots in a 2 MiB pool
SPEC = p.NamespaceSpec(model="m", kv_dtype="bfloat16", layout="l", page_tokens=1, page_bytes=PAGE)
KEYED = p.NamespaceSpec(
    model="m",
    kv_dtype="bfloat16",
    layout="l",
    page_tokens=1,
    page_bytes=PAGE,
    key_scheme="vllm-sha256",
)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class HeldTier:
    down = False  # the store is up

    def __init__(self, limit: int = 1000) -> None:
        self.pending: dict[bytes, tuple[NamespaceState, int, Callable[[bool], None]]] = {}
        self.limit = limit
        self.written: list[bytes] = []
        self.asked: list[list[bytes]] = []

    def write(
        self, ns: NamespaceState, key: bytes, slot: int, done: Callable[[bool], None]
    ) -> bool:
        if len(self.pending) >= self.limit:
            return False
        assert key not in self.pending, "two writes of one key in flight"
        self.pending[key] = (ns, slot, done)
        return True

    def finish(self, key: bytes, ok: bool = True) -> None:
        _, _, done = self.pending.pop(key)
        if ok:
            self.written.append(key)
        done(ok)

    def prefetch(self, lease: Lease) -> None:  # pragma: no cover
        raise AssertionError("not used")

    def lookup(self, ns: bytes, keys: list[bytes], answer: Callable[[int], None]) -> None:
        """The store is the test's: asked (after a write acknowledged once the store
        told of letting its key go), it holds none."""
        self.asked.append(keys)
        answer(0)


class Harness:
    def __init__(
        self,
        policy: str = "write_through",
        queue_events: int = 1000,
        events: bool = True,
        size_mib: int = 2,
        tier_limit: int = 1000,
    ) -> None:
        self.clock = Clock()
        self.config = Config(
            pool=PoolConfig(size_mib=size_mib, slab_mib=1, max_page_bytes=PAGE),
            leases=LeaseConfig(ttl_s=10.0, quarantine_s=5.0),
            storage=StorageConfig(backend="memory", write_policy=policy),
            events=EventsConfig(
                endpoint="ipc:///tmp/hicached-review-never-bound.sock" if events else "",
                queue_events=queue_events,
            ),
        )
        self.cache = Cache(self.config, pool_path="/nonexistent", clock=self.clock)
        self.tier = HeldTier(tier_limit)
        self.cache.tier = self.tier  # type: ignore[assignment]
        self.ids = itertools.count(1)
        self.events()

    def call(self, rid: bytes, request: p.Request) -> p.AnyReply | L3Lookup:
        request.id = next(self.ids)
        return self.cache.handle(rid, request)

    def hello(self, rid: bytes = b"A") -> None:
        assert isinstance(
            self.call(rid, p.Hello(id=0, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)),
            p.HelloOk,
        )

    def register(self, spec: p.NamespaceSpec = SPEC, rid: bytes = b"A") -> p.NamespaceOk:
        reg = self.call(rid, p.RegisterNamespace(id=0, spec=spec))
        assert isinstance(reg, p.NamespaceOk), reg
        return reg

    def store(self, ns: p.NamespaceOk, tokens: list[int], rid: bytes = b"A") -> list[bytes]:
        packed = pack_tokens(tokens)
        res = self.call(rid, p.Reserve(id=0, ns=ns.ns, tokens=packed))
        assert isinstance(res, p.ReserveOk), res
        if res.lease:
            ok = self.call(rid, p.Commit(id=0, lease=res.lease))
            assert isinstance(ok, p.CommitOk), ok
        return page_keys(ns.digest, packed, 1)

    def events(self) -> list[Stored | Removed]:
        log, out = self.cache.events, []
        while log.pending:  # past every gap
            out += log.take(len(log.pending))[0]
        return out  # type: ignore[return-value]


def l3_order_faults(events: list[object], medium: str = "MEMORY") -> list[str]:
    """BlockStored events in ``medium`` whose parent was not stored there before."""
    seen: set[bytes] = set()
    faults = []
    for e in events:
        if isinstance(e, Stored) and e.medium == medium:
            parent = e.parent
            for k in e.keys:
                if parent is not None and parent not in seen:
                    faults.append(f"{k.hex()[:8]} before its parent {parent.hex()[:8]}")
                seen.add(k)
                parent = k
        elif isinstance(e, Removed) and e.medium == medium:
            seen.difference_update(e.keys)
    return faults


def l3_view(events: list[object], medium: str = "MEMORY") -> set[bytes]:
    """What a subscriber believes L3 holds after ``events``."""
    held: set[bytes] = set()
    for e in events:
        if isinstance(e, Stored) and e.medium == medium:
            held.update(e.keys)
        elif isinstance(e, Removed) and e.medium == medium:
            held.difference_update(e.keys)
    return held
