"""Model-based test of the daemon's state and the client's fenced copies.

Random interleavings of reserve / write / commit / abort / match / read /
release / renew / lease expiry / L3 write completion and failure / daemon
restart, from two clients and two page sizes, on a pool of only two slabs,
so eviction, write-back and slabs passing between the sizes are constant.
A third namespace is key-addressed with wide pages (two shards a page): its
reservations have holes and parents, its copies are made shard by shard,
and its commits publish what a per-slot mask says.

Pages hold real bytes in a real pool file: a page's bytes are a pattern
derived from its key. Copies go through the client's own fenced copy code
(hicached/client/mapping.py) with handles built as the client builds them, including stale
ones: handles kept across expiry and across a restart are used again.

The L3 tier is a stand-in that holds writes until a rule completes or fails
them (fault injection: it lets the model decide when a backend answers).

Invariants:
- no byte is ever read back, or written to L3, that was not stored under
  that key (a cache may forget, never lie);
- no byte of the pool is owned twice, and every allocated slot is accounted
  for (indexed, fresh in a lease, held for a write-back, or quarantined);
- one request never empties the index to serve itself: a reservation evicts
  at most the pages it still needs (plus a bounded slab reclaim).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hicached import protocol as p
from hicached.arena import Arena
from hicached.cache import Cache, Lease, NamespaceState
from hicached.cache.journal import Recorder
from hicached.config import Config, LeaseConfig, PoolConfig, StorageConfig
from hicached.errors import StaleHandle
from hicached.handles import Hit, LeaseState, Reservation
from hicached.handles import Namespace as ClientNamespace
from hicached.hashing import engine_page_keys, pack_tokens, page_keys
from hicached.index import PageIndex
from hicached.keyindex import KeyIndex
from hicached.mapping import PoolMapping, lease_margin
from hicached.pool import GEN_GRANULE
from hicached.wire.journal import PagesRecord, Record, read_journal

PAGE = 256 * 1024  # 4 slots per 1 MiB slab, 2 slabs
SIZES = {"small": PAGE, "large": 2 * PAGE}  # 4 or 2 pages a slab
SPECS = {
    name: p.NamespaceSpec(
        model=f"m/{name}", kv_dtype="bfloat16", layout="l", page_tokens=1, page_bytes=size
    )
    for name, size in SIZES.items()
}
KEYED = p.NamespaceSpec(
    model="m/keyed",
    kv_dtype="bfloat16",
    layout="l",
    page_tokens=1,
    page_bytes=PAGE,
    key_scheme="vllm-sha256",
    shards=2,
)
SEQ = st.lists(st.integers(0, 2), min_size=1, max_size=5)
WHICH = st.sampled_from(sorted(SIZES))
RID = st.sampled_from([b"A", b"B"])
TTL = 10.0
QUARANTINE = 5.0


def pattern(key: bytes, size: int) -> np.ndarray:
    """The bytes of the page stored under ``key``."""
    return np.resize(np.frombuffer(key, dtype=np.uint8), size)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class HeldTier:
    """An L3 tier that holds every write until the model completes or fails it."""

    down = False  # the store is up

    def __init__(self) -> None:
        self.pending: list[tuple[NamespaceState, bytes, int, Callable[[bool], None]]] = []

    def write(
        self, ns: NamespaceState, key: bytes, slot: int, done: Callable[[bool], None]
    ) -> bool:
        if len(self.pending) >= 6:  # a bounded queue: more is refused
            return False
        self.pending.append((ns, key, slot, done))
        return True

    def prefetch(self, lease: Lease) -> None:  # pragma: no cover - not used by the model
        raise AssertionError("the model does not prefetch")

    def lookup(self, ns: bytes, keys: list[bytes], answer: Callable[[int], None]) -> None:
        """Asked after a write acknowledged once the store told of letting its key
        go: the model learns nothing from it (its store may be smaller than L2)."""
        answer(0)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.dir = tempfile.TemporaryDirectory()
        self.arena = Arena.create(Path(self.dir.name) / "pool", 2 << 20, populate=False)
        self.l3: dict[bytes, bytes] = {}  # what the store holds: key -> page bytes
        self.ids = itertools.count(1)

    @initialize(policy=st.sampled_from(["write_back", "write_through"]))
    def start(self, policy: str) -> None:
        self.config = Config(
            pool=PoolConfig(size_mib=2, slab_mib=1, max_page_bytes=2 * PAGE),
            leases=LeaseConfig(ttl_s=TTL, quarantine_s=QUARANTINE),
            storage=StorageConfig(backend="memory", write_policy=policy),
        )
        self.boot()

    def boot(self, journal: list[Record] | None = None) -> None:
        """A daemon (re)starts: new instance, new state, the same pool file and
        store; with ``journal``, it adopts the pool (the clients keep their
        mapping) from those records."""
        self.cache = Cache(
            self.config,
            pool_path=str(self.arena.path),
            gens=self.arena.gens,
            clock=self.clock,
            journal=Recorder(),
        )
        if journal is not None:
            self.cache.adopt(journal)
            self.mapping.adopted_by(self.cache.instance)
        else:
            self.mapping = PoolMapping(self.arena, self.cache.instance, GEN_GRANULE, self.clock)
        # the new daemon's journal starts from what it holds
        self.journal: list[bytes] = [self.cache.journal.snapshot()]
        self.tier = HeldTier()
        self.cache.tier = self.tier
        self.listing: Iterator[list[tuple[NamespaceState, bytes, int, int]]] | None = None
        self.cache.l3.update(self.l3)  # the startup scan
        self.ns: dict[tuple[bytes, str], ClientNamespace] = {}
        for rid in (b"A", b"B"):
            self.connect(rid)
        # handles survive a restart on purpose: using them again must be harmless
        if not hasattr(self, "writes"):
            self.writes: list[tuple[bytes, Reservation, list[bytes]]] = []
            self.reads: list[tuple[bytes, Hit, list[bytes]]] = []
            self.stalled: list[tuple[Reservation, list[bytes]]] = []

    def connect(self, rid: bytes) -> None:
        """A client says hello and registers every namespace."""
        ok = self.call(rid, p.Hello(id=0, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR))
        assert isinstance(ok, p.HelloOk)
        for name, spec in [*SPECS.items(), ("keyed", KEYED)]:
            reg = self.call(rid, p.RegisterNamespace(id=0, spec=spec))
            assert isinstance(reg, p.NamespaceOk)
            self.ns[rid, name] = ClientNamespace(spec, reg.ns, reg.digest)

    def teardown(self) -> None:
        self.arena.close()
        self.dir.cleanup()

    def call(self, rid: bytes, request: p.Request) -> p.AnyReply:
        request.id = next(self.ids)
        # through the wire encoding, as the server does
        decoded = p.request_decoder.decode(p.encode(request))
        reply = self.cache.handle(rid, decoded)
        self.journal.append(self.cache.journal.take())  # written before the reply goes
        return reply

    def keys(self, which: str, seq: list[int]) -> list[bytes]:
        return page_keys(self.ns[b"A", which].digest, pack_tokens(seq), 1)

    def index(self, which: str) -> PageIndex:
        index = self.cache.l2.index(SIZES[which])
        assert isinstance(index, PageIndex)
        return index

    def engine_keys(self, seq: list[int]) -> list[bytes]:
        """The engine's own keys of a sequence's pages (vLLM's: hash + group)."""
        return [hashlib.sha256(bytes(seq[: i + 1])).digest() + b"\0\0\0\0" for i in range(len(seq))]

    def our_keys(self, ekeys: list[bytes]) -> list[bytes]:
        return engine_page_keys(self.ns[b"A", "keyed"].digest, ekeys)

    def deadline(self) -> float:
        return self.clock.now + TTL - lease_margin(TTL)

    # -- rules -----------------------------------------------------------------

    @rule(rid=RID, which=WHICH, seq=SEQ)
    def reserve(self, rid: bytes, which: str, seq: list[int]) -> None:
        ns = self.ns[rid, which]
        l2 = self.cache.l2
        evicted, reclaimed = l2.evicted_pages, l2.reclaimed_slabs
        reply = self.call(rid, p.Reserve(id=0, ns=ns.id, tokens=pack_tokens(seq)))
        assert isinstance(reply, p.ReserveOk)
        keys = self.keys(which, seq)
        want = len(keys) - reply.present
        assert len(reply.offsets) <= want
        # one request never empties the index: it evicts only what it still needs
        # (plus, per slab taken from the other page size and for one failed try,
        # at most two slabs' worth of that size's pages)
        took = l2.evicted_pages - evicted
        bound = want + 2 * 4 * (l2.reclaimed_slabs - reclaimed + 1)
        assert took <= bound, f"evicted {took} pages to find {want} slots"
        for slot in reply.offsets:
            assert slot % SIZES[which] == 0, "a slot is not aligned to its page size"
        if reply.lease:
            res = Reservation(
                ns,
                reply.lease,
                reply.present,
                reply.offsets,
                reply.pool_full,
                self.cache.instance,
                LeaseState(self.deadline()),
                self.mapping.snapshot(reply.offsets),
            )
            self.writes.append((rid, res, keys))
        else:
            assert reply.offsets == []

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        _, res, keys = data.draw(st.sampled_from(self.writes))
        self.write_res(res, keys)  # refused, or flagged: either way the model goes on

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def write_late(self, data: st.DataObject) -> None:
        """A copy that began before its deadline and ran on for up to the
        quarantine (a stalled process): it must not land in another key's page."""
        _, res, keys = data.draw(st.sampled_from(self.writes))
        self.write_res(replace(res, state=LeaseState(res.deadline + QUARANTINE)), keys)

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.writes) - 1))
        rid, res, keys = self.writes.pop(i)
        self.returned(res, commit=True)
        pages = data.draw(st.integers(-1, len(res.offsets)))
        keyed = res.ns.spec.keyed
        mask = data.draw(
            st.lists(st.booleans(), min_size=len(res.offsets), max_size=len(res.offsets))
        )
        if res.instance != self.cache.instance:
            return  # the client refuses this itself (a restart ended the lease)
        # the engine writes its pages before it commits (late, if it was slow); a
        # write its fences refused ("do not commit") makes it abort instead
        if not self.write_res(res, keys):
            reply = self.call(rid, p.Release(id=0, lease=res.lease))
            assert isinstance(reply, p.Ok) or reply.code == "unknown_lease"
            return
        if keyed:
            request = p.Commit(id=0, lease=res.lease, mask=bytes(mask))
        else:
            request = p.Commit(id=0, lease=res.lease, pages=pages)
        reply = self.call(rid, request)
        if isinstance(reply, p.Error):
            assert reply.code == "unknown_lease"  # it expired
            return
        assert isinstance(reply, p.CommitOk), reply
        n = sum(mask) if keyed else len(res.offsets) if pages < 0 else pages
        assert reply.published + reply.duplicates == n
        if keyed:
            table = self.cache.l2.index(PAGE, keyed=True)
            published = [k for k, ok in zip(keys, mask, strict=True) if ok]
            assert all(table.present(published)), "a committed page is not in L2"

    def write_res(self, res: Reservation, keys: list[bytes]) -> bool:
        """Copy the pages' bytes in, as every worker of a wide page would, each
        its part; False if a fence refused any copy."""
        size = res.ns.page_bytes
        pages = [pattern(k, size) for k in keys[res.present :][: len(res.offsets)]]
        if not pages:
            return True
        shards = res.ns.spec.shards
        width = size // shards
        data = np.stack(pages)
        written = True
        for r in range(shards):
            try:
                if shards == 1:
                    self.mapping.write(res, data)
                else:
                    self.mapping.write(res, data[:, r * width : (r + 1) * width], None, r * width)
            except StaleHandle:
                written = False
        return written

    @rule(rid=RID, seq=SEQ, start=st.integers(0, 4), linked=st.booleans())
    def reserve_keys(self, rid: bytes, seq: list[int], start: int, linked: bool) -> None:
        """Reserve a sequence's keys from ``start``, naming the key before as
        their parent, or (``linked`` False) none: an engine that stores a
        run without its parent leaves an unlinked run in the index."""
        ns = self.ns[rid, "keyed"]
        ekeys = self.engine_keys(seq)
        start = min(start, len(ekeys) - 1)
        parent = ekeys[start - 1] if start and linked else b""
        ours = self.our_keys(ekeys)[start:]
        before = [self.cache.l2.index(PAGE, keyed=True).present([k])[0] for k in ours]
        reply = self.call(rid, p.ReserveKeys(id=0, ns=ns.id, keys=ekeys[start:], parent=parent))
        assert isinstance(reply, p.ReserveKeysOk), reply
        assert list(reply.present) == [int(b) for b in before]
        assert len(reply.indices) == len(reply.offsets)
        assert all(not reply.present[i] for i in reply.indices), "a present key got a slot"
        if reply.pool_full:
            assert len(reply.indices) < len(ours) - sum(before)
        else:
            assert len(reply.indices) == len(ours) - sum(before)
        if reply.lease:
            res = Reservation(
                ns,
                reply.lease,
                0,
                reply.offsets,
                reply.pool_full,
                self.cache.instance,
                LeaseState(self.deadline()),
                self.mapping.snapshot(reply.offsets),
                indices=reply.indices,
            )
            self.writes.append((rid, res, [ours[i] for i in reply.indices]))

    @rule(rid=RID, seq=SEQ, start=st.integers(0, 4), lease=st.booleans())
    def match_keys(self, rid: bytes, seq: list[int], start: int, lease: bool) -> None:
        ns = self.ns[rid, "keyed"]
        ekeys = self.engine_keys(seq)[min(start, len(seq) - 1) :]
        found = self.call(rid, p.ExistsKeys(id=0, ns=ns.id, keys=ekeys))
        assert isinstance(found, p.ExistsKeysOk)
        reply = self.call(rid, p.MatchKeys(id=0, ns=ns.id, keys=ekeys, lease=lease))
        assert isinstance(reply, p.MatchOk)
        assert reply.hits == found.l2 <= found.leading, "exists and match disagree"
        assert all(b & 1 for b in found.where[: found.l2])
        if reply.lease:
            hit = Hit(
                ns,
                reply.hits,
                reply.offsets,
                reply.lease,
                self.cache.instance,
                reply.l3_hits,
                LeaseState(self.deadline()),
                self.mapping.snapshot(reply.offsets),
            )
            keys = self.our_keys(ekeys)
            self.reads.append((rid, hit, keys[: reply.hits]))
            self.read_hit(hit, keys)

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid, res, _ = self.writes.pop(data.draw(st.integers(0, len(self.writes) - 1)))
        self.returned(res, commit=False)
        if res.instance == self.cache.instance:
            reply = self.call(rid, p.Release(id=0, lease=res.lease))
            assert isinstance(reply, p.Ok) or reply.code == "unknown_lease"

    @rule(rid=RID, which=WHICH, seq=SEQ, lease=st.booleans())
    def match(self, rid: bytes, which: str, seq: list[int], lease: bool) -> None:
        ns = self.ns[rid, which]
        reply = self.call(rid, p.Match(id=0, ns=ns.id, tokens=pack_tokens(seq), lease=lease))
        assert isinstance(reply, p.MatchOk)
        keys = self.keys(which, seq)
        assert reply.hits == len(reply.offsets) <= len(keys)
        if reply.lease:
            hit = Hit(
                ns,
                reply.hits,
                reply.offsets,
                reply.lease,
                self.cache.instance,
                reply.l3_hits,
                LeaseState(self.deadline()),
                self.mapping.snapshot(reply.offsets),
            )
            self.reads.append((rid, hit, keys[: reply.hits]))
            self.read_hit(hit, keys)

    def read_hit(self, hit: Hit, keys: list[bytes]) -> None:
        """Read through the fenced copy: bytes that come back are the keys' own."""
        try:
            got = self.mapping.read(hit)
        except StaleHandle as stale:
            assert 0 <= stale.valid <= len(hit.offsets)
            return
        for i, page in enumerate(got):
            assert np.array_equal(page, pattern(keys[i], hit.ns.page_bytes)), (
                f"page {i} of a hit holds another key's bytes"
            )

    @precondition(lambda self: self.reads)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        _, hit, keys = data.draw(st.sampled_from(self.reads))
        self.read_hit(hit, keys)

    @precondition(lambda self: self.reads)
    @rule(data=st.data())
    def read_late(self, data: st.DataObject) -> None:
        """A copy that began before its deadline and ended long after (a stalled
        process): the slots' generations must catch a page that moved meanwhile."""
        _, hit, keys = data.draw(st.sampled_from(self.reads))
        self.read_hit(replace(hit, state=LeaseState()), keys)

    @precondition(lambda self: self.reads)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid, hit, _ = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        if hit.instance == self.cache.instance:
            reply = self.call(rid, p.Release(id=0, lease=hit.lease))
            assert isinstance(reply, p.Ok) or reply.code == "unknown_lease"

    @precondition(lambda self: self.reads or self.writes)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        rid, handle, _ = data.draw(st.sampled_from(self.reads + self.writes))  # type: ignore[operator]
        if handle.instance != self.cache.instance:
            return
        sent = self.clock.now
        reply = self.call(rid, p.Renew(id=0, lease=handle.lease))
        if isinstance(reply, p.RenewOk):
            handle.state.deadline = sent + reply.ttl_s - lease_margin(TTL)
        else:
            assert reply.code == "unknown_lease"

    @precondition(lambda self: self.reads or self.writes)
    @rule()
    def foreign_release_is_refused(self) -> None:
        for rid, handle, _ in self.reads + self.writes:  # type: ignore[operator]
            if handle.instance == self.cache.instance and self.cache.leases.get(handle.lease):
                other = b"B" if rid == b"A" else b"A"
                reply = self.call(other, p.Release(id=0, lease=handle.lease))
                assert isinstance(reply, p.Error) and reply.code == "foreign_lease"
                return

    def returned(self, res: Reservation, *, commit: bool) -> None:
        """The owner of ``res`` commits or releases it, so its own copies have
        returned: only workers that adopted a key-addressed reservation may still
        copy after its release (docs/protocol.md)."""
        if commit or not res.ns.spec.keyed:
            self.stalled = [(r, k) for r, k in self.stalled if r is not res]

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def write_stalls(self, data: st.DataObject) -> None:
        """A copy passes its fences, then its process stops before the bytes land
        (``stalled_write_lands``)."""
        _, res, keys = data.draw(st.sampled_from(self.writes))
        if not res.offsets:
            return
        try:
            _, gens = self.mapping._fence(res, "reservation")
        except StaleHandle:
            return
        _, gidx = self.mapping._row_index(res.ns, res.offsets)
        if self.mapping._moved(gens, res, gidx) < 0:
            self.stalled.append((res, keys[res.present :][: len(res.offsets)]))

    @precondition(lambda self: self.stalled)
    @rule(data=st.data())
    def stalled_write_lands(self, data: st.DataObject) -> None:
        """The stalled copy's bytes land, up to the lease's deadline plus the
        quarantine (what the quarantine covers, docs/protocol.md): never in a slot
        that another key's page or another lease holds."""
        res, keys = self.stalled.pop(data.draw(st.integers(0, len(self.stalled) - 1)))
        if self.clock.now >= res.deadline + lease_margin(TTL) + QUARANTINE:
            return  # stopped for longer than the quarantine covers
        if res.instance != self.cache.instance and res.instance not in self.mapping.earlier:
            return  # the daemon restarted with a pool of its own (the model's stand-in)
        size = res.ns.page_bytes
        others: dict[int, str] = {}
        for index in self.cache.l2.indexes():
            for key, slot, _ in index.items():
                others[slot] = f"the page of another key ({key.hex()[:8]})"
        for lease in self.cache.leases:
            if lease.id != res.lease:
                for slot in lease.fresh:
                    others[slot] = f"a slot of lease {lease.id}"
        rows = self.arena.rows(size)
        for slot, key in zip(res.offsets, keys, strict=True):
            owner = others.get(slot)
            index = self.cache.l2.index(size, keyed=res.ns.spec.keyed)
            mine = any(k == key and s == slot for k, s, _ in index.items())
            assert owner is None or mine, f"a late write landed in {owner}"
            rows[slot // size] = pattern(key, size)

    @rule(rid=RID)
    def goodbye(self, rid: bytes) -> None:
        """The owner of reservations ends its session (close) while workers that
        adopted them may still copy: ``write`` and ``write_late`` go on using its
        handles, and no such copy may land in a page another key owns."""
        assert isinstance(self.call(rid, p.Goodbye(id=0)), p.Ok)
        self.connect(rid)

    @rule(seconds=st.sampled_from([0.5, 3.0, 6.0, 11.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        self.cache.expire()

    @precondition(lambda self: self.tier.pending)
    @rule(data=st.data(), ok=st.booleans())
    def l3_answers(self, data: st.DataObject, ok: bool) -> None:
        i = data.draw(st.integers(0, len(self.tier.pending) - 1))
        ns, key, slot, done = self.tier.pending.pop(i)
        if ok:
            page = self.arena.rows(ns.spec.page_bytes)[slot // ns.spec.page_bytes]
            assert np.array_equal(page, pattern(key, ns.spec.page_bytes)), (
                "a page went to L3 with another key's bytes"
            )
            self.l3[key] = page.tobytes()
        done(ok)

    @rule()
    def list_unwritten(self) -> None:
        """The L2 pages L3 lacks are listed a batch at a time, the other rules
        running between two batches (as requests do between the daemon's batches
        of adopted pages to write): every page a batch names is in its slot,
        which holds its own key's bytes, and its writes go out (``l3_answers``
        checks what reaches L3)."""
        if self.listing is None:
            self.listing = self.cache.tiering.unwritten_batches(2)
        batch = next(self.listing, None)
        if batch is None:
            self.listing = None
            return
        assert len(batch) <= 2
        for ns, key, slot, gen in batch:
            size = ns.spec.page_bytes
            assert ns.index.has(key, slot), "a page listed that is not in its slot"
            assert gen == int(self.cache.pool.gens[slot // GEN_GRANULE])
            assert key not in self.cache.l3
            page = self.arena.rows(size)[slot // size]
            assert np.array_equal(page, pattern(key, size)), "a page listed with another's bytes"
        self.cache.write_back(batch)

    @rule()
    def restart(self) -> None:
        """The daemon dies and a new one starts; writes in flight are lost."""
        self.boot()

    @rule(flushed=st.booleans(), torn=st.booleans())
    def restart_adopting(self, flushed: bool, torn: bool) -> None:
        """The daemon dies between two replies (what changed since the last one
        written or not: ``flushed``; the last write cut short: ``torn``) and a
        new one adopts the pool. Every page indexed before is indexed after, in
        its slot, but those whose record was in the torn write; no other page
        appears; handles from before are used again by the other rules."""
        pages = {(key, slot) for index in self.cache.l2.indexes() for key, slot, _ in index.items()}
        held = {(key, slot) for _, key, slot, _ in self.tier.pending}  # evicted, not yet free
        if flushed:
            self.journal.append(self.cache.journal.take())
        # only the last request's write can be cut short: its reply never went
        torn = torn and bool(self.journal[-1])
        writes = [data for data in self.journal if data]
        lost: set[tuple[bytes, int]] = set()
        if torn:
            last = writes.pop()
            records, _ = read_journal(memoryview(last), 0)
            lost = {
                (page.key, page.slot)
                for r in records
                if isinstance(r, PagesRecord)
                for page in r.pages
            }
            writes.append(last[: len(last) // 2])
        records, _ = read_journal(memoryview(b"".join(writes)), 0)
        self.boot(records)
        after = {(key, slot) for index in self.cache.l2.indexes() for key, slot, _ in index.items()}
        assert pages - lost <= after, "a page committed before the restart was not adopted"
        assert after <= pages | (held if torn else set()), "adoption made up a page"

    @rule()
    def journal_compacts(self) -> None:
        """The journal is replaced by one that holds only what it describes."""
        self.journal = [self.cache.journal.snapshot()]

    # -- invariants --------------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        pool = cache.pool
        owned: dict[int, int] = {}  # offset -> bytes, of every slot in use

        def own(slot: int, size: int, what: str) -> None:
            assert slot not in owned, f"slot {slot} is owned twice ({what})"
            owned[slot] = size

        for size in SIZES.values():
            index = cache.l2.index(size)
            indexed = [slot for _, slot, _ in index.items()]
            assert len(indexed) == index.pages
            for slot in indexed:
                own(slot, size, "indexed")
        for _, slot, _ in cache.l2.index(PAGE, keyed=True).items():
            own(slot, PAGE, "indexed by key")
        for lease in cache.leases:
            for slot in lease.fresh:
                own(slot, lease.ns.spec.page_bytes, "fresh")
        for ns, _, slot, _ in self.tier.pending:
            if slot not in owned:  # an evicted page held for its write-back
                own(slot, ns.spec.page_bytes, "write-back")
        for _, slot, size in cache.l2._quarantine:
            own(slot, size, "quarantine")
        assert owned == pool.allocated, "the pool's books and the state disagree"
        ordered = sorted(owned.items())
        for (a, size), (b, _) in itertools.pairwise(ordered):
            assert a + size <= b, f"slots at {a} and {b} share bytes"
        assert pool.used_bytes == sum(owned.values())
        assert set(pool.pins) <= set(owned)

    @invariant()
    def leased_pages_stay(self) -> None:
        """Every page an open lease holds is still indexed, in the slot it was
        given in, until the lease ends: nothing evicts or drops it meanwhile."""
        if not hasattr(self, "cache"):
            return
        for lease in self.cache.leases:
            index = lease.ns.index
            if isinstance(index, PageIndex):
                for slot in lease.pinned:
                    assert slot in index.node_of, f"leased slot {slot} left the index"
            else:
                held = {slot for _, slot, _ in index.items()}
                assert set(lease.pinned) <= held, "a leased key-addressed page left the index"

    @invariant()
    def key_table_links(self) -> None:
        """Each key-addressed page counts its children in L2 exactly, and a page
        with children is never evicted before them (a parent is never missing
        while a child it had stays)."""
        if not hasattr(self, "cache"):
            return
        table = self.cache.l2.index(PAGE, keyed=True)
        assert isinstance(table, KeyIndex)
        entries = table._entries
        children: dict[bytes, int] = {}
        for entry in entries.values():
            assert entry.alive and entry.owner in self.cache.namespaces
            if entry.parent is not None:
                assert entry.parent.alive, "a page points at an evicted parent"
                assert entries.get(entry.parent.key) is entry.parent
                children[entry.parent.key] = children.get(entry.parent.key, 0) + 1
        for key, entry in entries.items():
            assert entry.children == children.get(key, 0)
        # every page that could go (no child in L2, no pin) can be found by eviction
        queued = {(id(e), tick) for tick, _, e in table._heap}
        pins = self.cache.pool.pins
        for entry in entries.values():
            if not entry.children and entry.slot not in pins:
                assert (id(entry), entry.tick) in queued, "an evictable page is out of reach"

    @invariant()
    def tree_is_prefix_closed(self) -> None:
        if not hasattr(self, "cache"):
            return
        for which in SIZES:
            index = self.index(which)
            for node in index.nodes():
                assert node.owner in self.cache.namespaces
                assert node.keys, "an empty node was left in the tree"
                assert all(index.node_of[s] is node for s in node.slots)
                assert node.parent is not None
                if node.parent is not index.root:
                    assert node.parent.children[node.keys[0]] is node


CacheMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=40, deadline=None)
test_cache_model = CacheMachine.TestCase


class _Draw:
    """Stands in for hypothesis' data object: hands out the values given."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object) -> object:
        return self.values.pop(0)


@pytest.mark.parametrize("ends", ["goodbye", "release", "expiry"])
def test_a_copy_stalled_across_the_end_of_its_lease_lands_in_no_other_page(ends: str) -> None:
    """The model's steps that found an owner's goodbye freeing slots a worker
    could still write, as a fixed sequence, for each way a lease ends early: the
    copy passes its fences, its lease ends, time passes beyond the quarantine
    (before the deadline, or just after it for an expiry), another client
    reserves, and the copy lands."""
    machine = CacheMachine()
    try:
        machine.start("write_through")
        for seq in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
            machine.reserve_keys(b"A", seq, 0, True)
        rid, res, _ = machine.writes[0]
        machine.write_stalls(_Draw(machine.writes[0]))  # type: ignore[arg-type]
        if ends == "goodbye":
            machine.goodbye(rid)
        elif ends == "release":
            machine.abort(_Draw(0))  # type: ignore[arg-type]
        else:
            machine.time_passes(11.0)  # past its deadline: expired
        machine.time_passes(3.0 if ends == "expiry" else 6.0)  # < deadline + quarantine
        assert machine.clock.now < res.deadline + lease_margin(TTL) + QUARANTINE
        for seq in ([11, 12, 13], [14, 15, 16], [17, 18, 19], [20, 21, 22]):
            machine.reserve_keys(b"B", seq, 0, True)
        machine.stalled_write_lands(_Draw(0))  # type: ignore[arg-type]
    finally:
        machine.teardown()


@pytest.mark.parametrize("seed", range(6))
def test_pages_listed_a_batch_at_a_time_are_each_in_their_slot_with_their_bytes(
    seed: int,
) -> None:
    """The L2 pages L3 lacks, listed a batch at a time (the daemon lists adopted
    pages to write so, serving requests between two batches) while the pool
    changes between batches: nodes split by matches, pages evicted and their
    slots taken by other keys, writes answered, leases expiring. Every page a
    batch names is in its slot, with its own key's bytes (``list_unwritten``'s
    checks), and what reaches L3 is its own (``l3_answers``')."""
    rng = random.Random(seed)
    machine = CacheMachine()
    listed = 0
    try:
        machine.start("write_back")
        for _ in range(400):
            roll = rng.random()
            which = rng.choice(sorted(SIZES))
            seq = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            if roll < 0.35:
                machine.reserve(b"A", which, seq)
                if machine.writes:
                    i = len(machine.writes) - 1
                    machine.commit(_Draw(i, -1, [True] * len(machine.writes[i][1].offsets)))  # type: ignore[arg-type]
            elif roll < 0.5:
                machine.match(b"B", which, seq, rng.random() < 0.5)
            elif roll < 0.6 and machine.tier.pending:
                pick = rng.randrange(len(machine.tier.pending))
                machine.l3_answers(_Draw(pick), rng.random() < 0.8)  # type: ignore[arg-type]
            elif roll < 0.65:
                machine.time_passes(rng.choice([3.0, 11.0]))
            else:
                if machine.listing is not None:
                    listed += 1
                machine.list_unwritten()
            machine.books_balance()
    finally:
        machine.teardown()
    assert listed > 20  # the listing went on across changes, not only from a fresh start


def test_stats_encode() -> None:
    config = Config(pool=PoolConfig(size_mib=2, slab_mib=1, max_page_bytes=PAGE))
    cache = Cache(config, pool_path="/nonexistent")
    assert msgspec.msgpack.decode(p.encode(cache.stats()))["pool_bytes"] == 2 << 20


def test_a_sequence_missing_its_first_page_is_a_miss_without_more_hashing() -> None:
    """match hashes only the first page of a sequence that neither tier starts
    with; one that starts in L2 or in L3 is hashed whole and answered in full;
    every page asked for is counted either way."""
    config = Config(pool=PoolConfig(size_mib=2, slab_mib=1, max_page_bytes=PAGE))
    cache = Cache(config, pool_path="/nonexistent")
    rid, ids = b"A", itertools.count(1)

    def call(request: p.Request) -> p.AnyReply:
        request.id = next(ids)
        return cache.handle(rid, request)

    assert isinstance(
        call(p.Hello(id=0, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)), p.HelloOk
    )
    reg = call(p.RegisterNamespace(id=0, spec=SPECS["small"]))
    assert isinstance(reg, p.NamespaceOk)

    def match(tokens: list[int]) -> p.MatchOk:
        ok = call(p.Match(id=0, ns=reg.ns, tokens=pack_tokens(tokens), lease=False))
        assert isinstance(ok, p.MatchOk)
        return ok

    res = call(p.Reserve(id=0, ns=reg.ns, tokens=pack_tokens([1, 2, 3, 4])))
    assert isinstance(res, p.ReserveOk) and len(res.offsets) == 4
    assert isinstance(call(p.Commit(id=0, lease=res.lease)), p.CommitOk)
    hashed, asked = cache.key_cache.size, cache.match_pages["asked"]
    assert match([9, 2, 3, 4]).hits == 0  # another first page: nothing else is looked at
    assert cache.key_cache.size == hashed and cache.match_pages["asked"] == asked + 4
    assert match([1, 2, 9, 9]).hits == 2  # a shared start: hashed whole, matched in full
    assert cache.key_cache.size == hashed + 4
    # a sequence that only L3 starts with is hashed too: L3's leading pages count
    cache.l3.update(page_keys(reg.digest, pack_tokens([7, 8, 9]), 1)[:2])
    ok = match([7, 8, 9])
    assert (ok.hits, ok.l3_hits) == (0, 2)
    assert cache.match_pages["asked"] == asked + 4 + 4 + 3
