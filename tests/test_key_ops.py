"""Key-addressed namespaces on a real daemon: the engine's own keys, holes,
parents, commit masks, L2 and L3 counted apart, wide pages written by several
worker processes through one lease, segmented copies, events that carry the
engine's keys, and the bad input these operations can meet."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from threading import Event, Thread

import msgspec
import numpy as np
import pytest
import zmq

from hicached import Client
from hicached import protocol as p
from hicached.errors import BadRequest, InvalidNamespace, StaleHandle, TooLarge
from hicached.events import batch_decoder, block_hash
from hicached.handles import Hit, PortableHandle, Reservation
from hicached.keyindex import KeyIndex
from tests.l3util import wait_for
from tests.support import Daemon

PAGE = 8192
SHARDS = 2
SPEC = dict(
    model="org/keyed",
    kv_dtype="bfloat16",
    layout="layer_first",
    page_tokens=32,
    page_bytes=PAGE,
    key_scheme="vllm-sha256",
)
FILE_L3 = 'backend = "file"\nwrite_policy = "write_through"\n'
FILE_OPTIONS = "[storage.file]\ncapacity_mib = 64\nsegment_mib = 16\n"


def engine_keys(n: int, salt: int = 0) -> list[bytes]:
    """vLLM-style offload keys: a chained 32-byte block hash plus a 4-byte group index."""
    out, parent = [], bytes(32)
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([salt, i])).digest()
        out.append(parent + (0).to_bytes(4, "big"))
    return out


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def store(c: Client, ns: object, keys: list[bytes], data: np.ndarray) -> p.CommitOk:
    res = c.reserve_keys(ns, keys)  # type: ignore[arg-type]
    c.write_pages(res, data[res.indices])
    return c.commit(res)


def test_holes_parents_masks_and_tiers(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(storage=FILE_L3, tail=FILE_OPTIONS)
    keys = engine_keys(8)
    data = pages(8, 1)
    with d.client() as c:
        ns = c.register(**SPEC)
        found = c.exists_keys(ns, keys)
        assert (found.l2, found.leading) == (0, 0) and not any(found.in_l2 + found.in_l3)
        # pages 0-2 and, after a hole at 3, page 4 (its parent named)
        assert store(c, ns, keys[:3], data).published == 3
        res = c.reserve_keys(ns, [keys[4]], parent=keys[3])
        c.write_pages(res, data[4:5])
        assert c.commit(res).published == 1
        found = c.exists_keys(ns, keys)
        assert found.l2 == 3 and found.in_l2 == [True] * 3 + [False, True] + [False] * 3
        # a reservation over the hole: present keys are skipped, the rest get slots
        res = c.reserve_keys(ns, keys[2:7], parent=keys[1])
        assert res.present_mask == [True, False, True, False, False]
        assert res.indices == [1, 3, 4] and len(res.offsets) == 3
        c.write_pages(res, data[[3, 5, 6]])
        # only what was written is published: the mask leaves page 6 out
        assert c.commit(res, ok=[True, True, False]).published == 2
        found = c.exists_keys(ns, keys)
        assert found.l2 == 6 and found.in_l2 == [True] * 6 + [False] * 2
        # L3 holds them once write-through is done; L2 and L3 are counted apart
        wait_for(lambda: c.exists_keys(ns, keys).in_l3 == [True] * 6 + [False] * 2)
        hit = c.match_keys(ns, keys)
        assert hit.hits == 6
        assert np.array_equal(c.read_pages(hit), data[:6])
        c.release(hit)
        # a match that starts mid-sequence
        hit = c.match_keys(ns, keys[4:])
        assert hit.hits == 2 and np.array_equal(c.read_pages(hit), data[4:6])
        c.release(hit)
        assert c.stats().match_pages["l2"] == 8


def test_pages_come_back_from_l3_by_key(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(storage=FILE_L3, tail=FILE_OPTIONS)
    keys = engine_keys(5, salt=2)
    data = pages(5, 2)
    with d.client() as c:
        ns = c.register(**SPEC)
        store(c, ns, keys, data)
        wait_for(lambda: all(c.exists_keys(ns, keys).in_l3))
    d.stop()
    d.start()
    with d.client() as c:
        ns = c.register(**SPEC)
        wait_for(lambda: c.exists_keys(ns, keys).leading == 5)
        assert c.exists_keys(ns, keys).l2 == 0
        fetch = c.prefetch_keys(ns, keys)
        deadline = time.monotonic() + 10
        while not (progress := c.progress(fetch)).done:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert progress.completed == 5 and not progress.failed
        assert c.commit(fetch).published == 5
        hit = c.match_keys(ns, keys)
        assert hit.hits == 5 and np.array_equal(c.read_pages(hit), data)
        c.release(hit)


def test_a_token_reservation_is_never_handed_to_another_process(daemon: Daemon) -> None:
    """A token namespace's commit does not move its slots' generations, so a
    worker's write through an adopted handle after the commit would land in
    the published page unseen: such a handle is refused at both ends, and the
    published page keeps the bytes committed."""
    from tests.support import NS, PAGE_TOKENS, page_bytes_for

    tokens = np.arange(4 * PAGE_TOKENS, dtype=np.uint32)
    data = page_bytes_for(tokens)
    with daemon.client() as owner, daemon.client() as worker:
        ns = owner.register(**NS)
        res = owner.reserve(ns, tokens)
        with pytest.raises(BadRequest, match="key-addressed"):
            res.portable()
        forged = PortableHandle(
            kind="write",
            spec=ns.spec,
            instance=res.instance,
            lease=res.lease,
            deadline=res.deadline,
            offsets=list(res.offsets),
            gens=np.asarray(res.gens, np.uint32).tobytes(),
        )
        with pytest.raises(BadRequest, match="key-addressed"):
            worker.adopt(forged)
        owner.write_pages(res, data)
        assert owner.commit(res).published == 4
        hit = owner.match(ns, tokens)
        assert np.array_equal(owner.read_pages(hit), data)
        owner.release(hit)
        view = worker.adopt(owner.match(ns, tokens).portable())  # reads stay portable
        assert isinstance(view, Hit) and np.array_equal(worker.read_pages(view), data)
        late = Client(daemon.endpoint)  # never connected: adopt says hello first
        try:
            view = late.adopt(owner.match(ns, tokens).portable())
            assert np.array_equal(late.read_pages(view), data)
        finally:
            late.close()


def test_wide_pages_written_by_workers_through_one_lease(daemon: Daemon) -> None:
    """The scheduler's client takes the lease; two worker clients (other
    connections, as other processes would be) each copy their shard, gathered
    from per-layer tensors by block id, through the handle it hands them."""
    layers, width = 4, PAGE // SHARDS // 4  # each worker: 4 layers of `width` bytes a page
    blocks = 16
    rng = np.random.default_rng(3)
    kv = [[rng.integers(0, 256, (blocks, width), dtype=np.uint8) for _ in range(layers)]]
    kv.append([rng.integers(0, 256, (blocks, width), dtype=np.uint8) for _ in range(layers)])
    block_ids = [5, 2, 9]
    keys = engine_keys(3, salt=3)
    with daemon.client() as owner, daemon.client() as w0, daemon.client() as w1:
        ns = owner.register(**SPEC, shards=SHARDS)
        res = owner.reserve_keys(ns, keys)
        wire = msgspec.msgpack.encode(res.portable())  # what crosses to the workers
        for rank, worker in enumerate((w0, w1)):
            handle = worker.adopt(msgspec.msgpack.decode(wire, type=type(res.portable())))
            assert isinstance(handle, Reservation) and handle.view
            worker.write_pages(handle, kv[rank], rows=block_ids, at=rank * PAGE // SHARDS)
            with pytest.raises(BadRequest):
                worker.commit(handle)  # only the lease's owner commits
        assert owner.commit(res).published == 3
        # read back on "another instance": scatter into other blocks of new tensors
        hit = owner.match_keys(ns, keys)
        back = [[np.zeros((blocks, width), np.uint8) for _ in range(layers)] for _ in range(2)]
        targets = [0, 7, 3]
        for rank, worker in enumerate((w0, w1)):
            view = worker.adopt(hit.portable())
            assert isinstance(view, Hit)
            worker.read_pages(view, back[rank], rows=targets, at=rank * PAGE // SHARDS)
        owner.release(hit)
        for rank in range(2):
            for layer in range(layers):
                assert np.array_equal(back[rank][layer][targets], kv[rank][layer][block_ids])
        # the whole page is the workers' shards side by side, layer by layer
        whole = owner.match_keys(ns, keys[:1])
        page = owner.read_pages(whole)[0]
        owner.release(whole)
        expect = np.concatenate([kv[r][layer][5] for r in range(2) for layer in range(layers)])
        assert np.array_equal(page, expect)


def test_workers_place_their_fragments_apart_in_one_page(daemon: Daemon) -> None:
    """A byte in the page for each segment (vLLM's canonical pages: each token's
    row holds every worker's heads): two workers' strided slices of their
    blocks interleave in one page, and each reads its own back; segments
    placed over one another are refused before anything is copied."""
    tokens, head = 4, PAGE // 8  # a page: 4 tokens x 2 workers' heads
    rng = np.random.default_rng(9)
    kv = [rng.integers(0, 256, (8, tokens * head), dtype=np.uint8) for _ in range(2)]
    keys = engine_keys(2, salt=21)
    block_ids = [6, 1]

    def fragments(blocks: np.ndarray) -> list[np.ndarray]:
        return [blocks[:, t * head : (t + 1) * head] for t in range(tokens)]

    def places(rank: int) -> list[int]:
        return [(2 * t + rank) * head for t in range(tokens)]

    with daemon.client() as owner, daemon.client() as w0, daemon.client() as w1:
        ns = owner.register(**SPEC)
        res = owner.reserve_keys(ns, keys)
        for rank, worker in enumerate((w0, w1)):
            handle = worker.adopt(res.portable())
            assert isinstance(handle, Reservation)
            worker.write_pages(handle, fragments(kv[rank]), rows=block_ids, at=places(rank))
        with pytest.raises(ValueError, match="over one another"):  # and the page kept
            w1.write_pages(handle, fragments(kv[0]), rows=block_ids, at=[0, 8, 16, 24])
        assert owner.commit(res).published == 2
        hit = owner.match_keys(ns, keys)
        pages = owner.read_pages(hit)
        for j, block in enumerate(block_ids):
            rows = [kv[r][block].reshape(tokens, head) for r in range(2)]
            assert np.array_equal(pages[j], np.stack(rows, axis=1).reshape(-1))
        back = [np.zeros_like(kv[0]) for _ in range(2)]
        for rank, worker in enumerate((w0, w1)):
            view = worker.adopt(hit.portable())
            assert isinstance(view, Hit)
            worker.read_pages(view, fragments(back[rank]), rows=[2, 5], at=places(rank))
            assert np.array_equal(back[rank][[2, 5]], kv[rank][block_ids])
        owner.release(hit)


def test_portable_handles_go_stale(daemon: Daemon) -> None:
    keys = engine_keys(2, salt=4)
    with daemon.client() as owner, daemon.client() as worker:
        ns = owner.register(**SPEC)
        store(owner, ns, keys, pages(2, 4))
        hit = owner.match_keys(ns, keys)
        wire = hit.portable()
        # the daemon restarts: a handle from the old one is refused, never copied
        # through, and a worker catches up with a handle from the new one
        daemon.stop()
        daemon.start()
        with daemon.client() as late, pytest.raises(StaleHandle):
            late.adopt(wire)
        ns = owner.register(**SPEC)
        store(owner, ns, keys, pages(2, 4))
        fresh = owner.match_keys(ns, keys)
        assert worker.instance != fresh.instance  # it has not spoken to the new daemon
        view = worker.adopt(fresh.portable())
        assert worker.instance == fresh.instance
        assert np.array_equal(worker.read_pages(view), pages(2, 4))  # type: ignore[arg-type]
        owner.release(fresh)


def test_a_read_handle_outlives_its_daemon_in_a_worker(daemon: Daemon) -> None:
    """A worker that adopted a read handle learns of a daemon restart before it
    copies: the old pool stays mapped for the lease's life, so the read is
    served, with the key's bytes, rather than failed (vLLM takes no failed load)."""
    keys = engine_keys(3, salt=14)
    data = pages(3, 14)
    with daemon.client() as owner, daemon.client() as worker:
        ns = owner.register(**SPEC)
        store(owner, ns, keys, data)
        wire = owner.match_keys(ns, keys).portable()
        view = worker.adopt(wire)
        daemon.stop()
        daemon.start()
        worker.stats()  # the worker meets the new daemon first
        assert worker.instance != wire.instance
        assert np.array_equal(worker.read_pages(view), data)  # type: ignore[arg-type]
        again = worker.adopt(wire)  # adopted only now: served the same way
        assert np.array_equal(worker.read_pages(again), data)  # type: ignore[arg-type]
        res = owner.reserve_keys(owner.register(**SPEC), engine_keys(1, salt=15))
        old_write = msgspec.structs.replace(res.portable(), instance=wire.instance)
        with pytest.raises(StaleHandle):
            worker.adopt(old_write)  # never a write into the old pool


def test_commit_mask_and_released_reservation(daemon: Daemon) -> None:
    keys = engine_keys(3, salt=5)
    with daemon.client() as c:
        ns = c.register(**SPEC)
        res = c.reserve_keys(ns, keys)
        with pytest.raises(BadRequest):
            c.commit(res, ok=[True])  # one flag per fresh slot, checked here first
        res = c.reserve_keys(ns, keys)
        c.release(res)  # abort: nothing published, the slots are quarantined
        assert c.exists_keys(ns, keys).l2 == 0
        assert c.stats().quarantined_pages >= 3


def test_schemes_never_mix_and_bad_keys_are_refused(daemon: Daemon) -> None:
    with daemon.client() as c:
        keyed = c.register(**SPEC)
        tokens = c.register(**{**SPEC, "key_scheme": "tokens"})
        assert keyed.digest != tokens.digest
        with pytest.raises(BadRequest, match="names its pages by key"):
            c.match(keyed, list(range(64)))
        with pytest.raises(BadRequest, match="token ids"):
            c.exists_keys(tokens, engine_keys(1))
        with pytest.raises(BadRequest, match="1-64 bytes"):
            c.reserve_keys(keyed, [b"x" * 65])
        with pytest.raises(BadRequest, match="1-64 bytes"):
            c.match_keys(keyed, [b""])
        with pytest.raises(BadRequest, match="keys are bytes"):
            c.exists_keys(keyed, ["ab" * 32])  # type: ignore[list-item]
        # keys of any iterable, a one-shot one too, are checked and sent whole
        with pytest.raises(BadRequest, match="keys are bytes"):
            c.exists_keys(keyed, (k for k in [engine_keys(1)[0], "ab"]))  # type: ignore[arg-type]
        found = c.exists_keys(keyed, (k for k in engine_keys(2)))  # type: ignore[arg-type]
        assert found.in_l2 == [False, False]  # both asked about, not none
        limit = c._hello.max_pages_per_request if c._hello else 0
        with pytest.raises(TooLarge):
            c.exists_keys(keyed, [b"k%d" % i for i in range(limit + 1)])
        with pytest.raises(InvalidNamespace, match="key_scheme"):
            c.register(**{**SPEC, "key_scheme": "Bad Scheme"})
        with pytest.raises(InvalidNamespace, match="shards"):
            c.register(**{**SPEC, "shards": 3})  # does not divide page_bytes
        assert c.stats().pages == 0  # still serving


def test_a_raw_mask_of_the_wrong_length_ends_the_lease(daemon: Daemon) -> None:
    """A client that sends a mask of the wrong length (not this client library,
    which checks first) gets a clear error; its lease ends, its slots are not lost."""
    with daemon.client() as c:
        ns = c.register(**SPEC)
        res = c.reserve_keys(ns, engine_keys(2, salt=6))
        reply = c._roundtrip(p.Commit(id=0, lease=res.lease, mask=b"\x01"))
        assert isinstance(reply, p.Error) and reply.code == "bad_request"
        assert "mask" in reply.message
        assert c.stats().leases == 0


def test_events_carry_the_engines_keys(daemon: Daemon) -> None:
    daemon.stop()
    text = daemon.config.read_text()
    daemon.config.write_text(text + f'[events]\nendpoint = "ipc://{daemon.runtime}/events.sock"\n')
    daemon.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{daemon.runtime}/events.sock")
    keys = engine_keys(3, salt=7)
    try:
        time.sleep(0.2)  # the subscription reaches the daemon
        with daemon.client() as c:
            ns = c.register(**SPEC)
            store(c, ns, keys, pages(3, 7))
        stored: list[object] = []
        deadline = time.monotonic() + 10
        while not stored:
            assert time.monotonic() < deadline, "no BlockStored event"
            if sub.poll(100):
                _, _, payload = sub.recv_multipart()
                batch = batch_decoder.decode(payload)
                stored += [e for e in batch.events if type(e).__name__ == "BlockStored"]
        event = stored[0]
        # vLLM's own events name a block by its hash, without the group index
        assert event.block_hashes == [block_hash(k[:-4]) for k in keys]  # type: ignore[attr-defined]
        assert event.parent_block_hash is None  # type: ignore[attr-defined]
    finally:
        sub.close()
        ctx.term()


# -- what an outside review broke, each kept as a regression test ---------------------


def test_a_match_leaves_unlinked_pages_evictable() -> None:
    """Pages of a run need not be linked (holes, unknown parents): a match that
    marks them all used must leave every one of them evictable."""
    table = KeyIndex()
    for i in range(4):
        assert table.insert(bytes([i]), i * PAGE, owner=1)
    assert table.match([bytes([i]) for i in range(4)]) == [i * PAGE for i in range(4)]
    assert len(table.evict(4, {})) == 4 and table.pages == 0


def test_an_unpinned_page_is_evictable_again_whether_or_not_eviction_found_it_pinned() -> None:
    """An unpin pushes a page into the eviction heap only when eviction dropped
    its entry: a page unpinned after eviction passed it over, and one unpinned
    before eviction looked, are both taken, in least recently used order."""
    table = KeyIndex()
    for i in range(4):
        assert table.insert(bytes([i]), i * PAGE, owner=1)
    pins = {0: 1, PAGE: 1}
    assert [slot for _, slot, _ in table.evict(4, pins)] == [2 * PAGE, 3 * PAGE]
    del pins[0]  # dropped after eviction passed it over: it must be pushed again
    table.unpinned([0])
    assert [slot for _, slot, _ in table.evict(4, pins)] == [0]
    for i in range(2, 4):
        assert table.insert(bytes([i]), i * PAGE, owner=1)
    pins = {2 * PAGE: 1}
    del pins[2 * PAGE]  # dropped before eviction looked: its entry is still there
    table.unpinned([2 * PAGE])
    assert [slot for _, slot, _ in table.evict(4, {})] == [2 * PAGE, 3 * PAGE]
    # pinned again and passed over twice, then unpinned: still taken
    assert table.insert(bytes([5]), 5 * PAGE, owner=1)
    assert table.evict(4, {5 * PAGE: 1}) == [] and table.evict(4, {5 * PAGE: 1}) == []
    table.unpinned([5 * PAGE])
    assert [slot for _, slot, _ in table.evict(4, {})] == [5 * PAGE]
    table.unpinned([PAGE])  # the first page passed over, its pin dropped last
    assert table.evict(4, {}) == [(bytes([1]), PAGE, 1)] and table.pages == 0


def test_a_chain_is_evicted_tail_first_and_whole() -> None:
    """Each page evicted makes its parent evictable: a chain goes, tail first, all of it."""
    table = KeyIndex()
    for i in range(8):
        parent = bytes([i - 1]) if i else b""
        assert table.insert(bytes([i]), i, owner=1, parent=parent)
    gone = table.evict(8, {})
    assert [slot for _, slot, _ in gone] == list(range(7, -1, -1))
    assert table.pages == 0 and table.oldest() is None


def test_a_deep_chain_is_dropped_leaves_first() -> None:
    table = KeyIndex()
    depth = 5000
    for i in range(depth):
        parent = i.to_bytes(4, "big") if i else b""
        assert table.insert((i + 1).to_bytes(4, "big"), i, owner=7, parent=parent)
    gone = table.drop_owner(7, {})
    assert [slot for _, slot, _ in gone] == list(range(depth - 1, -1, -1))
    assert table.pages == 0


def test_a_published_page_refuses_late_adopted_writes(daemon: Daemon) -> None:
    keys = engine_keys(1, salt=8)
    data = pages(1, 8)
    with daemon.client() as owner, daemon.client() as worker:
        ns = owner.register(**SPEC)
        res = owner.reserve_keys(ns, keys)
        handle = worker.adopt(res.portable())
        worker.write_pages(handle, data)  # type: ignore[arg-type]
        assert owner.commit(res).published == 1
        with pytest.raises(StaleHandle):
            worker.write_pages(handle, np.zeros((1, PAGE), np.uint8))  # type: ignore[arg-type]
        hit = owner.match_keys(ns, keys)
        assert np.array_equal(owner.read_pages(hit), data)
        owner.release(hit)


def test_a_released_reservation_is_quarantined_past_its_deadline(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Workers may copy through an adopted handle until the lease's deadline,
    whatever its owner does: its slots are reused only a quarantine after it."""
    d = daemon_factory(extra="[leases]\nttl_s = 3.0\nquarantine_s = 0.2\n")
    with d.client() as owner:
        ns = owner.register(**SPEC)
        res = owner.reserve_keys(ns, engine_keys(2, salt=9))
        owner.release(res)
        time.sleep(1.0)  # past the quarantine, not past the lease's deadline
        assert owner.stats().quarantined_pages == 2
        wait_for(lambda: owner.stats().quarantined_pages == 0, timeout=10)


def _stalled_copy(worker: Client, handle: Reservation, data: np.ndarray, stall: float) -> Thread:
    """A worker's copy through ``handle`` whose process stops for ``stall``
    seconds after its fences passed and before its bytes land (fault injection:
    the copy's first generation check sleeps); runs in a thread, started once
    the fences passed."""
    mapping = worker.mapping
    check = mapping._moved
    checked = Event()

    def moved_then_stall(gens: np.ndarray, handle: Reservation | Hit, gidx: np.ndarray) -> int:
        moved = check(gens, handle, gidx)
        if not checked.is_set():
            checked.set()
            time.sleep(stall)
        return moved

    def copy() -> None:
        with contextlib.suppress(StaleHandle):  # the worker learns it after the copy
            worker.write_pages(handle, data)

    mapping._moved = moved_then_stall  # type: ignore[method-assign]
    thread = Thread(target=copy)
    thread.start()
    assert checked.wait(5)
    return thread


@pytest.mark.parametrize("ends", ["goodbye", "expiry"])
def test_an_owner_leaving_does_not_free_slots_an_adopted_copy_may_write(
    daemon_factory: Callable[..., Daemon], ends: str
) -> None:
    """The vLLM shape: a scheduler process owns a reservation, a worker copies
    through the adopted handle. The owner ends its session (goodbye), or lets the
    lease expire and is then dropped as idle, while the worker's copy is stalled
    between its fences and its bytes; a third client churns the whole pool
    meanwhile. Its pages must read back byte for byte: the slots stay out of
    reuse until the lease's deadline plus the quarantine."""
    ttl = 20.0 if ends == "goodbye" else 2.5
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        extra=(
            "session_idle_s = 0.3\n"
            f"[leases]\nttl_s = {ttl}\nquarantine_s = 0.3\nsweep_interval_s = 0.05\n"
        ),
    )
    slots = (1 << 20) // PAGE
    owner, worker, churn = d.client(), d.client(), d.client()
    try:
        ns = owner.register(**SPEC)
        res = owner.reserve_keys(ns, engine_keys(8, salt=40))
        handle = worker.adopt(res.portable())
        stall = 0.8 if ends == "goodbye" else 0.6
        copying = _stalled_copy(worker, handle, pages(8, 40), stall)  # type: ignore[arg-type]
        if ends == "goodbye":
            owner.close()
        else:
            time.sleep(ttl - 1.2)  # the copy began before the worker's deadline
        time.sleep(0.45)  # past the quarantine counted from the session's end
        mine = churn.register(**{**SPEC, "model": "org/churn"})
        keys = engine_keys(slots, salt=41)
        data = pages(slots, 41)
        for start in range(0, slots, 16):
            store(churn, mine, keys[start : start + 16], data[start : start + 16])
        copying.join(5)
        wrong = held = 0
        for start in range(0, slots, 16):
            hit = churn.match_keys(mine, keys[start : start + 16])
            got = churn.read_pages(hit)
            held += hit.hits
            wrong += sum(not np.array_equal(got[i], data[start + i]) for i in range(hit.hits))
            churn.release(hit)
        assert held >= slots - 16, held  # the churn's pages are in L2 (some gave way)
        assert wrong == 0, f"{wrong} pages of another client hold the worker's bytes"
    finally:
        for c in (owner, worker, churn):
            c.close()


def test_keys_of_one_reservation_differ(daemon: Daemon) -> None:
    keys = engine_keys(2, salt=10)
    with daemon.client() as c:
        ns = c.register(**SPEC)
        with pytest.raises(BadRequest, match="differ"):
            c.reserve_keys(ns, [keys[0]], parent=keys[0])  # its own parent
        with pytest.raises(BadRequest, match="differ"):
            c.reserve_keys(ns, [keys[0], keys[1], keys[0]])
        res = c.reserve_keys(ns, keys)
        reply = c._roundtrip(p.Commit(id=0, lease=res.lease, mask=b"\x01\x01", pages=1))
        assert isinstance(reply, p.Error) and "no pages" in reply.message


def test_rows_are_block_numbers(daemon: Daemon) -> None:
    keys = engine_keys(2, salt=11)
    with daemon.client() as c:
        ns = c.register(**SPEC)
        res = c.reserve_keys(ns, keys)
        table = np.zeros((4, PAGE), np.uint8)
        with pytest.raises(ValueError, match="integers"):
            c.write_pages(res, [table], rows=[0.9, 1.9])
        with pytest.raises(ValueError, match="integers"):
            c.write_pages(res, [table], rows=np.array([True, False]))
        c.write_pages(res, [table], rows=[1, 2])
        c.commit(res)
        hit = c.match_keys(ns, keys)
        with pytest.raises(ValueError, match="differ"):
            c.read_pages(hit, [table], rows=[3, 3])
        c.release(hit)


def test_one_array_of_the_wrong_size_is_refused_not_copied_as_part_pages(
    daemon: Daemon,
) -> None:
    """Only a list, ``rows`` or ``at`` asks for part of each page: one array of
    another size is an error, never a write of each slot's first bytes (the
    rest would keep an earlier owner's bytes) or a read into part of it."""
    torch = pytest.importorskip("torch")
    keys = engine_keys(2, salt=14)
    half = np.full((2, PAGE // 2), 5, np.uint8)
    with daemon.client() as c:
        ns = c.register(**SPEC)
        res = c.reserve_keys(ns, keys)
        for wrong in (half, torch.from_numpy(half), np.zeros((3, PAGE), np.uint8)):
            with pytest.raises(ValueError, match="bytes"):
                c.write_pages(res, wrong)
        whole = np.full((2, PAGE), 9, np.uint8)
        c.write_pages(res, whole)
        c.write_pages(res, [half])  # asked for: the first half of each page
        c.write_pages(res, half, at=0)  # so is worker 0's part of a wide page
        c.commit(res)
        hit = c.match_keys(ns, keys)
        with pytest.raises(ValueError, match="bytes"):
            c.read_pages(hit, np.zeros((2, PAGE // 2), np.uint8))
        got = c.read_pages(hit)
        front, back = np.zeros_like(half), np.zeros_like(half)
        c.read_pages(hit, front, at=0)
        c.read_pages(hit, back, at=PAGE // 2)
        c.release(hit)
        assert np.array_equal(got, np.concatenate([half, whole[:, PAGE // 2 :]], axis=1))
        assert np.array_equal(front, half) and np.array_equal(back, whole[:, PAGE // 2 :])


def test_a_handle_without_pages_takes_and_fills_no_data(daemon: Daemon) -> None:
    """A reservation of keys all in L2 and a hit of none have no slots: data for
    pages is refused there too, never taken as written or returned as filled."""
    torch = pytest.importorskip("torch")
    keys = engine_keys(2, salt=15)
    pages = np.full((2, PAGE), 3, np.uint8)
    with daemon.client() as c:
        ns = c.register(**SPEC)
        res = c.reserve_keys(ns, keys)
        c.write_pages(res, pages)
        c.commit(res)
        again = c.reserve_keys(ns, keys)  # both in L2: no slots
        assert not again.offsets
        for wrong in (pages, torch.from_numpy(pages), pages[:1]):
            with pytest.raises(ValueError, match="no pages"):
                c.write_pages(again, wrong)
        c.write_pages(again, np.empty((0, PAGE), np.uint8))  # nothing, as asked
        c.write_pages(again, [pages], rows=[])  # a segmented copy of no rows
        c.abort(again)
        miss = c.match_keys(ns, engine_keys(2, salt=16))
        assert miss.hits == 0
        with pytest.raises(ValueError, match="no pages"):
            c.read_pages(miss, np.zeros((2, PAGE), np.uint8))
        assert c.read_pages(miss).shape == (0, PAGE)


def test_segmented_copies_by_runs_and_scattered_agree(daemon: Daemon) -> None:
    """Rows adjacent on both sides are copied as slices, others gathered: the
    same bytes either way."""
    keys = engine_keys(8, salt=12)
    rng = np.random.default_rng(12)
    layers = [rng.integers(0, 256, (32, PAGE // 4), dtype=np.uint8) for _ in range(4)]
    runs = [10, 11, 12, 13, 2, 3, 4, 5]  # two runs of four blocks
    scattered = [7, 1, 30, 4, 19, 0, 22, 9]
    with daemon.client() as c:
        ns = c.register(**SPEC)
        for rows in (runs, scattered):
            res = c.reserve_keys(ns, keys)
            c.write_pages(res, layers, rows=rows)
            c.commit(res)
            hit = c.match_keys(ns, keys)
            whole = c.read_pages(hit)
            back = [np.zeros_like(layer) for layer in layers]
            c.read_pages(hit, back, rows=rows)
            c.release(hit)
            expect = np.concatenate([layer[rows] for layer in layers], axis=1)
            assert np.array_equal(whole, expect)
            for layer, got in zip(layers, back, strict=True):
                assert np.array_equal(got[rows], layer[rows])
            keys = engine_keys(8, salt=13)


def test_a_lease_on_unlinked_keyed_pages_holds_every_one_under_eviction(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Keys reserved without their parent are unlinked pages, each evictable
    alone: a lease on a run of them must hold every page, not one."""
    d = daemon_factory(size_mib=2, slab_mib=1)  # 256 slots of 8 KiB
    with d.client() as c:
        ns = c.register(**SPEC)
        keys = engine_keys(6, salt=30)
        for key in keys:  # each alone: no parent link between them
            res = c.reserve_keys(ns, [key])
            c.write_pages(res, np.full((1, PAGE), key[0], np.uint8))
            c.commit(res)
        held = c.match_keys(ns, keys)
        assert held.hits == 6
        for salt in range(31, 31 + 5):
            flood = engine_keys(64, salt=salt)  # 320 pages through 256 slots
            res = c.reserve_keys(ns, flood)
            c.write_pages(res, np.zeros((len(res.offsets), PAGE), np.uint8))
            c.commit(res)
        assert c.match_keys(ns, keys, lease=False).offsets == held.offsets
        expect = np.stack([np.full(PAGE, key[0], np.uint8) for key in keys])
        assert np.array_equal(c.read_pages(held), expect)
        c.release(held)


def test_keys_in_a_numpy_bytes_array_keep_their_trailing_nul_bytes(daemon: Daemon) -> None:
    """vLLM's keys end in NUL bytes (a 4-byte group index of 0); numpy's
    fixed-size bytes drop trailing NULs from each item, so an "S" array is
    read by rows: its keys find the pages stored under the same keys."""
    nul = [bytes([i]) * 32 + bytes(4) for i in (1, 2, 3)]
    with daemon.client() as c:
        ns = c.register(**SPEC)
        res = c.reserve_keys(ns, nul)
        c.write_pages(res, np.full((3, PAGE), 7, np.uint8))
        c.commit(res)
        rows = np.array(nul, dtype="S36")
        assert c.exists_keys(ns, rows).in_l2 == [True, True, True]  # type: ignore[arg-type]
        hit = c.match_keys(ns, rows)  # type: ignore[arg-type]
        assert hit.hits == 3 and (c.read_pages(hit) == 7).all()
        c.release(hit)


def _keys_shaped(shape: str) -> object:
    """Distinct keys as an engine may hand them over, more than a request holds."""
    if shape == "longest":  # 64 bytes, the longest a key may be
        return [hashlib.sha256(bytes([i % 256, i // 256])).digest() * 2 for i in range(400)]
    if shape == "short":
        return [i.to_bytes(2, "big") for i in range(1, 1001)]
    vllm = engine_keys(200, salt=41)  # each ends in 4 NUL bytes (group 0)
    if shape == "vllm_rows":
        return np.array(vllm, dtype="S36")
    # 64-byte rows of a 2-byte id and NUL padding: numpy's items are 2 bytes long
    return np.array([i.to_bytes(2, "big") + bytes(62) for i in range(1, 401)], dtype="S64")


@pytest.mark.parametrize("shape", ["longest", "short", "vllm_rows", "padded_rows"])
def test_as_many_keys_as_keys_per_request_says_go_in_one_request(
    daemon_factory: Callable[..., Daemon], shape: str
) -> None:
    """A daemon whose requests hold 4,096 bytes at most: every operation on as
    many keys as ``keys_per_request`` says, with a parent of 64 bytes, is
    taken, whatever the keys' lengths. An "S" array's keys go on the wire as
    whole rows, NULs and all, but its items drop their trailing NULs: their
    lengths said more keys fit than do (vLLM's 36-byte keys ending in a group
    index of 0 counted as 32 bytes; 64-byte padded rows as 2), and a request
    of that many was refused as TooLarge."""
    d = daemon_factory(extra="max_message_bytes = 4096")
    keys = _keys_shaped(shape)
    parent = b"\xff" * 64
    with d.client() as c:
        ns = c.register(**SPEC)
        n = c.keys_per_request(keys)  # type: ignore[arg-type]
        assert 1 < n < len(keys)  # type: ignore[arg-type]
        some = keys[:n]  # type: ignore[index]
        assert c.exists_keys(ns, some).in_l2 == [False] * n
        c.release(c.match_keys(ns, some))
        c.abort(c.reserve_keys(ns, some, parent=parent))
        c.cancel(c.prefetch_keys(ns, some, parent=parent))


@pytest.mark.parametrize("at", [[0.9, 8.7], [16.0, 40.0], ["8", "16"], 3.0, "8"])
def test_segment_places_that_are_not_integers_are_refused(daemon: Daemon, at: object) -> None:
    """A place that is not an integer byte (a float, a string) is refused before
    anything is copied, never rounded to a byte of the page: [0.9, 8.7] put
    the segments at bytes 0 and 8, over the bytes the caller meant to keep."""
    keys = engine_keys(1, salt=33)
    segments = [np.full((1, 8), 1, np.uint8), np.full((1, 8), 2, np.uint8)]
    with daemon.client() as c:
        ns = c.register(**SPEC)
        res = c.reserve_keys(ns, keys)
        c.write_pages(res, np.full((1, PAGE), 7, np.uint8))
        with pytest.raises(ValueError, match="integer byte"):
            c.write_pages(res, segments, at=at)  # type: ignore[arg-type]
        assert c.commit(res).published == 1
        hit = c.match_keys(ns, keys)
        assert np.array_equal(c.read_pages(hit)[0], np.full(PAGE, 7, np.uint8))  # untouched
        c.release(hit)


@pytest.mark.parametrize("number", [32, np.int64(32), np.array(32, np.uint64), True])
def test_a_number_is_refused_as_a_key_never_taken_as_zero_bytes(
    daemon: Daemon, number: object
) -> None:
    """``bytes(n)`` is n zero bytes: a number passed as a key (a 64-bit block hash
    as an int, a numpy integer) found the page stored under 32 zero bytes and
    read its bytes as its own; a large one made the client allocate that many
    bytes before the daemon refused it. A number is refused, and the daemon
    serves on."""
    zeros = bytes(32)
    with daemon.client() as c:
        ns = c.register(**SPEC)
        store(c, ns, [zeros], np.full((1, PAGE), 9, np.uint8))
        with pytest.raises(BadRequest, match="not numbers"):
            c.match_keys(ns, [number])  # type: ignore[list-item]
        with pytest.raises(BadRequest, match="not numbers"):
            c.exists_keys(ns, [zeros, number])  # type: ignore[list-item]
        with pytest.raises(BadRequest, match="not numbers"):
            c.reserve_keys(ns, [number])  # type: ignore[list-item]
        with pytest.raises(BadRequest, match="not a number"):
            c.reserve_keys(ns, engine_keys(1, salt=40), parent=number)  # type: ignore[arg-type]
        # bytes-like keys are taken as their bytes, as before
        assert c.exists_keys(ns, [bytearray(zeros), memoryview(zeros)]).in_l2 == [True, True]
        assert c.stats().pages == 1
