"""The copy fences and the allocator's bounds, each from a reproduction that
broke them: stale handles, write-back eviction, double frees, empty copies.

In-process: the daemon's state (Cache) and the client's copy code
(PoolMapping) over one real pool file, with a settable clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hicached import protocol as p
from hicached.arena import Arena
from hicached.cache import Cache, Lease, NamespaceState
from hicached.config import Config, LeaseConfig, PoolConfig, StorageConfig
from hicached.errors import BadRequest, StaleHandle
from hicached.handles import Hit, LeaseState, Reservation
from hicached.handles import Namespace as ClientNamespace
from hicached.hashing import pack_tokens
from hicached.mapping import PoolMapping, lease_margin
from hicached.pool import GEN_GRANULE, SlotPool, SlotStateError

PAGE = 64 * 1024
SPEC = p.NamespaceSpec(model="m", kv_dtype="bf16", layout="l", page_tokens=1, page_bytes=PAGE)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowTier:
    """Holds every write (a backend that has not answered yet); fault injection."""

    down = False  # the store is up

    def __init__(self) -> None:
        self.pending: list[Callable[[bool], None]] = []

    def write(
        self, ns: NamespaceState, key: bytes, slot: int, done: Callable[[bool], None]
    ) -> bool:
        self.pending.append(done)
        return True

    def prefetch(self, lease: Lease) -> None:  # pragma: no cover
        raise AssertionError("not used")


class Rig:
    """One daemon state and one client's view of the same pool file."""

    def __init__(self, tmp: Path, *, size_mib: int = 1, policy: str = "") -> None:
        self.clock = Clock()
        self.arena = Arena.create(tmp / "pool", size_mib << 20, populate=False)
        storage = StorageConfig(backend="memory", write_policy=policy) if policy else None
        config = Config(
            pool=PoolConfig(size_mib=size_mib, slab_mib=1, max_page_bytes=PAGE),
            leases=LeaseConfig(ttl_s=10.0, quarantine_s=5.0),
            **({"storage": storage} if storage else {}),
        )
        self.cache = Cache(config, pool_path="", gens=self.arena.gens, clock=self.clock)
        if policy:
            self.tier = SlowTier()
            self.cache.tier = self.tier
        self.mapping = PoolMapping(self.arena, self.cache.instance, GEN_GRANULE, self.clock)
        self.ids = iter(range(1, 10**9))
        self.call(p.Hello(id=0, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR))
        ok = self.call(p.RegisterNamespace(id=0, spec=SPEC))
        assert isinstance(ok, p.NamespaceOk)
        self.ns = ClientNamespace(SPEC, ok.ns, ok.digest)

    def call(self, request: p.Request, rid: bytes = b"A") -> p.AnyReply:
        request.id = next(self.ids)
        return self.cache.handle(rid, request)

    def deadline(self) -> float:
        return self.clock.now + 10.0 - lease_margin(10.0)

    def reserve(self, tokens: list[int]) -> Reservation:
        ok = self.call(p.Reserve(id=0, ns=self.ns.id, tokens=pack_tokens(tokens)))
        assert isinstance(ok, p.ReserveOk), ok
        gens = self.mapping.snapshot(ok.offsets)
        return Reservation(
            self.ns, ok.lease, ok.present, ok.offsets, ok.pool_full, self.cache.instance,
            LeaseState(self.deadline()), gens,
        )  # fmt: skip

    def store(self, tokens: list[int], fill: int) -> None:
        res = self.reserve(tokens)
        self.mapping.write(res, np.full((len(res.offsets), PAGE), fill, dtype=np.uint8))
        assert isinstance(self.call(p.Commit(id=0, lease=res.lease)), p.CommitOk)

    def match(self, tokens: list[int]) -> Hit:
        ok = self.call(p.Match(id=0, ns=self.ns.id, tokens=pack_tokens(tokens)))
        assert isinstance(ok, p.MatchOk)
        gens = self.mapping.snapshot(ok.offsets)
        return Hit(
            self.ns, ok.hits, ok.offsets, ok.lease, self.cache.instance, ok.l3_hits,
            LeaseState(self.deadline()), gens,
        )  # fmt: skip

    def expire(self, seconds: float) -> None:
        self.clock.now += seconds
        self.cache.expire()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.arena.close()


def test_a_read_that_raced_a_reuse_is_a_miss(rig: Rig) -> None:
    x = list(range(16))  # the whole pool: 16 pages of 64 KiB
    rig.store(x, 0xAA)
    hit = rig.match(x)
    assert hit.hits == 16
    rig.expire(11.0)  # the read lease ends; its pages may be evicted now
    rig.store(list(range(100, 116)), 0x55)  # another key takes every slot
    with pytest.raises(StaleHandle, match="deadline"):
        rig.mapping.read(hit)
    # a copy that passed the deadline check before the reuse and ended after it
    with pytest.raises(StaleHandle) as stale:
        rig.mapping.read(replace(hit, state=LeaseState()))
    assert stale.value.valid == 0


def test_a_late_write_never_lands_in_another_keys_page(rig: Rig) -> None:
    res = rig.reserve(list(range(16)))
    assert len(res.offsets) == 16
    rig.expire(11.0)  # the write lease expires: its slots go to quarantine
    assert rig.cache.stats().quarantined_pages == 16
    y = rig.reserve(list(range(100, 104)))
    assert y.offsets == [] and y.pool_full  # nothing is reused during the quarantine
    late = replace(res, state=LeaseState())  # a copy still running
    rig.mapping.write(late, np.full((16, PAGE), 0x11, dtype=np.uint8))  # lands in quarantine
    with pytest.raises(StaleHandle):
        rig.mapping.write(res, np.zeros((16, PAGE), dtype=np.uint8))  # past its deadline
    rig.expire(6.0)  # the quarantine ends: the slots are free, with new generations
    assert rig.cache.stats().quarantined_pages == 0
    rig.store(list(range(100, 116)), 0x55)
    with pytest.raises(StaleHandle, match="changed owner"):
        rig.mapping.write(late, np.full((16, PAGE), 0x11, dtype=np.uint8))
    assert (rig.mapping.read(rig.match(list(range(100, 116)))) == 0x55).all()


def test_closed_handles_are_refused_and_empty_copies_are_noops(rig: Rig) -> None:
    res = rig.reserve(list(range(4)))
    rig.mapping.write(res, np.ones((4, PAGE), dtype=np.uint8))
    rig.call(p.Commit(id=0, lease=res.lease))
    res.state.closed = True  # as Client.commit leaves it
    with pytest.raises(StaleHandle, match="closed"):
        rig.mapping.write(res, np.ones((4, PAGE), dtype=np.uint8))
    again = rig.reserve(list(range(4)))  # every page present: nothing to write
    assert again.offsets == [] and again.lease == 0
    rig.mapping.write(again, np.empty((0, PAGE), dtype=np.uint8))
    empty = rig.match([999])
    assert rig.mapping.read(empty).shape == (0, PAGE)


def test_write_back_eviction_stops_at_what_it_needs(tmp_path: Path) -> None:
    """A full pool under write_back with a slow tier: a reservation evicts only as
    many pages as it asks for (held for their write-back), gets pool_full, and
    the rest of the index stays; a slow tier never starves later requests."""
    rig = Rig(tmp_path, policy="write_back")
    for i in range(8):
        rig.store([1000 * i, 1000 * i + 1], i)  # 16 pages fill the pool
    assert rig.tier.pending == []  # write_back: nothing written yet
    first = rig.reserve([7_000_000])
    assert len(first.offsets) == 0 and first.pool_full  # the victim is on its way to L3
    stats = rig.cache.stats()
    assert stats.pages == 15 and stats.writeback_pages == 1
    three = rig.reserve([7_100_000, 7_100_001, 7_100_002])
    assert three.pool_full and rig.cache.stats().pages == 12  # three more, no more
    for done in rig.tier.pending:  # the write-backs end: their slots are free
        done(True)
    got = rig.reserve([7_200_000, 7_200_001, 7_200_002, 7_200_003])
    assert len(got.offsets) == 4 and rig.cache.stats().pages == 12  # no eviction needed
    rig.arena.close()


def test_quarantined_slots_do_not_starve_allocation(rig: Rig) -> None:
    rig.store(list(range(8)), 1)  # 8 pages indexed
    res = rig.reserve(list(range(100, 108)))  # the other 8 slots, then abandoned
    assert len(res.offsets) == 8
    rig.expire(11.0)  # lease expired: its 8 slots sit in quarantine for 5 s
    got = rig.reserve(list(range(200, 204)))
    assert len(got.offsets) == 4 and not got.pool_full  # LRU pages make room meanwhile
    assert rig.cache.stats().quarantined_pages == 8


def test_copies_check_their_handle_kind_and_never_fill_a_copy_of_out(rig: Rig) -> None:
    rig.store(list(range(4)), 0x42)
    hit = rig.match(list(range(4)))
    res = rig.reserve(list(range(50, 54)))
    with pytest.raises(BadRequest, match="takes a Reservation"):
        rig.mapping.write(hit, np.zeros((4, PAGE), dtype=np.uint8))  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="takes a Hit"):
        rig.mapping.read(res)  # type: ignore[arg-type]
    transposed = np.zeros((PAGE, 4), dtype=np.uint8).T  # not contiguous: a copy would be filled
    with pytest.raises(ValueError, match="C-contiguous"):
        rig.mapping.read(hit, transposed)
    # arrays of Python objects hold pointers, not pages: numpy's TypeError before
    things = np.empty((4, PAGE // 8), dtype=object)
    with pytest.raises(ValueError, match="Python objects"):
        rig.mapping.read(hit, things)
    with pytest.raises(ValueError, match="Python objects"):
        rig.mapping.read(hit, [things[:, :1]], rows=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="Python objects"):
        rig.mapping.write(res, things)
    with pytest.raises(ValueError, match="Python objects"):
        rig.mapping.write(res, [things[:, :1]], rows=[0, 1, 2, 3])
    assert (rig.mapping.read(hit) == 0x42).all()


def test_the_source_is_ready_before_the_fences_are_checked(rig: Rig) -> None:
    """A source that is slow to hand over its bytes (here: it lets the lease run
    out) is converted before the fences, so the late copy is refused."""
    res = rig.reserve(list(range(4)))

    class Slow:
        def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
            rig.expire(11.0)  # the lease ends while the source is produced
            return np.zeros((4, PAGE), dtype=np.uint8)

    with pytest.raises(StaleHandle, match="deadline"):
        rig.mapping.write(res, Slow())


def test_views_made_by_select_share_their_lease(rig: Rig) -> None:
    res = rig.reserve(list(range(4)))
    part = res.select([2, 0])
    assert part.view and not res.view
    res.state.closed = True  # as Client.commit leaves it
    with pytest.raises(StaleHandle, match="closed"):
        rig.mapping.write(part, np.zeros((2, PAGE), dtype=np.uint8))
    res.state.deadline = -1.0  # a renewal (or its lapse) reaches every view
    assert part.deadline == -1.0


def test_double_free_and_wrong_size_free_are_caught() -> None:
    pool = SlotPool(1 << 20, 1 << 20)
    a, b = pool.alloc(PAGE), pool.alloc(PAGE)
    assert a is not None and b is not None
    gen = int(pool.gens[a // GEN_GRANULE])
    pool.free(a, PAGE)
    assert int(pool.gens[a // GEN_GRANULE]) == gen + 1  # a freed slot changes generation
    with pytest.raises(SlotStateError, match="double free"):
        pool.free(a)
    with pytest.raises(SlotStateError, match="as 4096 bytes"):
        pool.free(b, 4096)
    assert pool.used_slots(PAGE) == 1 and pool.free_slabs == 0  # books unchanged
    assert pool.alloc(PAGE) == a  # and b was never handed out again
    pool.free(b, PAGE)


def test_a_page_l3_dropped_is_written_again_once_a_stay_while_l3_outlasts_l2(
    tmp_path: Path,
) -> None:
    """A page L3 lets go of while it stays in L2 is written again: once in that
    stay, and only if L3 had taken more bytes since than L2 holds (else L3 is
    smaller than L2, and a rewrite would only push out other pages of L2)."""
    rig = Rig(tmp_path, policy="write_through")
    cache = rig.cache
    tokens = [1, 2, 3, 4]
    keys = cache._keys(cache.namespaces[rig.ns.id], pack_tokens(tokens))

    def land() -> None:
        for done in rig.tier.pending:
            done(True)
        rig.tier.pending.clear()

    def churn(first: int) -> None:
        """More than L2 holds goes to L3 while the sequence stays hot in L2."""
        for i in range(first, first + 20):
            rig.store([i], 9)
            land()
            rig.cache.release(rig.cache.sessions[b"A"], rig.match(tokens).lease)
        assert cache.namespaces[rig.ns.id].pages >= 4 and all(k in cache.l3 for k in keys[2:])

    rig.store(tokens, 1)
    land()
    assert all(key in cache.l3 for key in keys)
    cache.forget_l3(keys[:2])  # dropped right after L3 took it: L3 holds less than L2
    assert [key in cache.l3 for key in keys] == [False, False, True, True]
    assert rig.tier.pending == [] and cache.stats().l3_undersized
    churn(100)
    cache.forget_l3(keys[2:])  # L3 had taken more than L2 holds since: rewritten
    assert not cache.stats().l3_undersized
    assert len(rig.tier.pending) == 2
    land()
    assert [key in cache.l3 for key in keys] == [False, False, True, True]
    assert cache.stats().l3["rewritten"] == 2
    churn(200)
    cache.forget_l3(keys[2:])  # again in the same stay in L2: not rewritten
    assert rig.tier.pending == [] and cache.stats().l3["rewrite_skipped"] >= 2
    rig.arena.close()


def test_the_keys_known_in_l3_are_bounded() -> None:
    from hicached.l3state import KnownKeys

    known = KnownKeys(10)
    keys = [i.to_bytes(16, "little") for i in range(100)]
    known.update(keys)
    assert len(known) <= 10 and known.forgotten >= 90
    assert all(key in known for key in keys[-5:])  # the newest are kept
    assert keys[0] not in known
    assert known.leading(keys, 95) == 5 and known.leading(keys, 0) == 0


class _Event:
    """A CUDA event that has completed (fault injection: no GPU here)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: object) -> float:
        return 0.0


def _fake_cuda(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fault injection: CUDA's marks complete at once and its unregisters are
    recorded in the list returned; the rig's mapping is taken as pinned."""
    from hicached.client import cuda

    order: list[str] = []
    monkeypatch.setattr(cuda, "mark", lambda device, timing=False: _Event())
    monkeypatch.setattr(cuda, "unregister", lambda array: order.append("unregister"))
    rig.mapping._pinned, rig.mapping._mapped = True, "the pool's CUDA view"
    return order


def test_a_cuda_copy_being_queued_is_drained_before_the_pool_is_unregistered(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy on one thread passed its fence; close() on another (Client.close,
    a restart's remap) unregistered the pool while the copy was being queued
    with the pool's CUDA view: a kernel over memory CUDA no longer maps. Now
    the unregister waits for the copy being queued and drains it, and a copy
    that starts after close() began is refused. Fault injection: CUDA's
    calls are fakes that record their order (this host may have no GPU)."""
    import threading
    import time

    order = _fake_cuda(rig, monkeypatch)
    mapping = rig.mapping
    queuing = threading.Event()

    def launch() -> str:
        order.append("launch")
        queuing.set()
        time.sleep(0.3)  # the close on the other thread runs now, or waits
        order.append(f"queued with {mapping._mapped}")
        return "kernel"

    res = rig.reserve(list(range(4)))
    none = np.empty(0, dtype=np.int64)
    closer = threading.Thread(target=lambda: (queuing.wait(5), mapping.close()))
    closer.start()
    pending = mapping._on_gpu("cuda:0", launch, res, none, none, "stale")
    closer.join(10)
    assert order == ["launch", "queued with the pool's CUDA view", "unregister"]
    assert pending.done()
    with pytest.raises(StaleHandle, match="closed"):
        mapping._on_gpu("cuda:0", launch, res, none, none, "stale")
    assert order[-1] == "unregister"  # nothing launched after the close


def test_a_close_from_a_signal_handler_on_the_copying_thread_is_done_after_the_copy(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's shutdown closes the client in a signal handler, which runs on
    whichever thread the signal lands: that may be the thread queuing a CUDA
    copy, holding the launch lock, and the close waited for that lock for
    ever (a lock its own thread held). Now the close is left to the copy's
    thread and done as soon as the copy is queued: the copy is drained, then
    the pool unregistered and unmapped. Fault injection: CUDA's calls are
    fakes that record their order, and the signal handler's close is called
    from inside the launch, on its thread, where the signal would run it."""
    import threading

    order = _fake_cuda(rig, monkeypatch)
    mapping = rig.mapping

    def launch() -> str:
        order.append("launch")
        mapping.close()  # the signal handler, on this thread
        order.append(f"closed; queued with {mapping._mapped}")
        return "kernel"

    res = rig.reserve(list(range(4)))
    none = np.empty(0, dtype=np.int64)
    got: list[object] = []
    copier = threading.Thread(
        target=lambda: got.append(mapping._on_gpu("cuda:0", launch, res, none, none, "stale")),
        daemon=True,  # a regression waits for ever: the test fails, the process exits
    )
    copier.start()
    copier.join(10)
    assert not copier.is_alive(), "the close in the copy's thread waited for its own lock"
    assert order == ["launch", "closed; queued with the pool's CUDA view", "unregister"]
    assert got and got[0].done()  # type: ignore[attr-defined]
    assert not mapping.pinned and mapping.arena.array.size == 0  # unmapped after the copy
    with pytest.raises(StaleHandle, match="closed"):
        mapping._on_gpu("cuda:0", launch, res, none, none, "stale")
    assert order[-1] == "unregister"


def test_an_unpin_from_a_signal_handler_while_the_pool_drains_unregisters_once(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close whose unpin waits for copies in flight can itself be interrupted
    by a signal handler that closes the client again on the same thread: the
    pool is unregistered once, not twice (CUDA refuses an unregister of memory
    it does not have registered). Fault injection: fake CUDA calls; the
    handler's close is called from the wait for the copy in flight."""
    import threading

    order = _fake_cuda(rig, monkeypatch)

    class Copy:
        def done(self) -> bool:
            return False

        def wait(self, timeout: float) -> bool:
            order.append("drain")
            if order.count("drain") == 1:
                mapping.close()  # the signal handler, on this thread
            return True

    mapping = rig.mapping
    mapping._inflight.append(Copy())  # type: ignore[arg-type]
    closer = threading.Thread(target=mapping.close, daemon=True)  # a regression waits for ever
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "the nested close waited for its own thread's lock"
    assert order == ["drain", "unregister"]
    assert not mapping.pinned and mapping.arena.array.size == 0
