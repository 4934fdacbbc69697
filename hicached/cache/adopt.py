"""Adoption: a restarted daemon takes over the pool of the one before it.

Synchronous and free of I/O: the daemon reads the pool journal
(daemon/journal.py) and hands its records here, on a fresh ``Cache`` whose
pool is the old pool file, before any request is served. What is adopted:

- every page whose last record is a ``PageRecord`` and whose slot keeps the
  generation recorded with it (a slot freed since has a newer one, whether or
  not its ``FreeRecord`` was written), of a namespace the journal names, with
  a page of at least one generation granule (smaller pages share a counter
  with their neighbours, which then cannot fence each other), in a slot that
  fits the pool's geometry;
- in a token namespace, only pages whose whole chain back to the first page
  is adopted too (the index is prefix-closed);
- a page whose key is adopted in another slot already is dropped.

Slots of write leases open at the stop (an ``AllocRecord`` and nothing after
it) are quarantined for a write lease's life plus ``leases.quarantine_s``:
the client that holds such a lease may still copy into them. Every other
slot's generation moves on, so a handle of the old daemon to anything not
adopted is stale; an adopted page keeps its generation, and read handles to
it stay good. The adopted pages are announced (BlockStored, in L2) after the
start's AllBlocksCleared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicached.cache.sessions import KeyedPage, NamespaceState
from hicached.state.index import PageIndex
from hicached.state.keyindex import KeyIndex
from hicached.wire.arena import GEN_GRANULE
from hicached.wire.events import MEDIUM_L2, name_of
from hicached.wire.journal import (
    AllocRecord,
    FreeRecord,
    NsRecord,
    PageRecord,
    PagesRecord,
    Record,
)
from hicached.wire.namespace import namespace_digest

if TYPE_CHECKING:
    from hicached.cache.desk import Cache

__all__ = ["Adopted", "adopt"]


@dataclass(slots=True)
class Adopted:
    """What an adoption kept and dropped (logged, and in stats)."""

    pages: int = 0  # pages adopted into L2
    namespaces: int = 0
    quarantined: int = 0  # slots of write leases open at the stop
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> pages

    def drop(self, reason: str, n: int = 1) -> None:
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n


_BEYOND = 1 << 63  # the first slot or generation a journal record cannot name
Alloc = tuple[int, str, float]  # page size, tenant, quarantined until (0: the lease was open)


def replay(
    records: list[Record],
) -> tuple[dict[int, NsRecord], dict[int, PageRecord], dict[int, Alloc]]:
    """The journal's last word on each namespace and slot: namespaces, pages by
    slot, and slots under write leases (slot -> page size)."""
    namespaces: dict[int, NsRecord] = {}
    pages: dict[int, PageRecord] = {}
    allocs: dict[int, Alloc] = {}
    for record in records:
        if isinstance(record, PagesRecord | PageRecord):
            for page in record.pages if isinstance(record, PagesRecord) else [record]:
                allocs.pop(page.slot, None)
                pages.pop(page.slot, None)  # a slot reused: the newest record goes last
                pages[page.slot] = page
        elif isinstance(record, FreeRecord):
            for slot in record.slots:
                pages.pop(slot, None)
                allocs.pop(slot, None)
        elif isinstance(record, AllocRecord):
            what = (record.page_bytes, record.tenant, record.until)
            for slot in record.slots:
                pages.pop(slot, None)
                allocs[slot] = what
        else:
            namespaces[record.ns] = record
    return namespaces, pages, allocs


def adopt(desk: Cache, records: list[Record], quarantine_until: float) -> Adopted:
    """Rebuild ``desk`` (fresh, serving nothing yet) from the journal's records
    over the pool it maps; returns what was kept and dropped."""
    out = Adopted()
    namespaces, pages, allocs = replay(records)
    _drop_unwritable(pages, allocs, out)
    gens = desk.pool.gens
    # 1. what each record claims, checked against the pool as it is
    where = np.fromiter(pages, dtype=np.int64, count=len(pages))
    recorded = np.fromiter((page.gen for page in pages.values()), np.int64, len(pages))
    at = where // GEN_GRANULE
    inside = at < len(gens)
    now = np.full(len(pages), -1, dtype=np.int64)
    now[inside] = gens[at[inside]]
    stale = set(where[now != recorded].tolist())
    size_of = {ns: record.spec.page_bytes for ns, record in namespaces.items()}
    sizes: dict[int, int] = {}
    for slot, page in list(pages.items()):
        size = size_of.get(page.ns)
        if size is None:
            reason = "no_namespace"
        elif size < GEN_GRANULE:
            reason = "small_page"
        elif slot in stale:
            reason = "stale"
        else:
            sizes[slot] = size
            continue
        del pages[slot]
        out.drop(reason)
    for slot, (size, _, _) in allocs.items():
        if slot not in sizes:
            sizes[slot] = size
    refused = desk.pool.adopt(sizes)
    for slot in refused:
        if pages.pop(slot, None) is not None:
            out.drop("geometry")
        allocs.pop(slot, None)
    # 2. the namespaces, as they were registered and in that order (the journal's,
    # not their ids', which are random): the oldest unused one still makes way first
    states: dict[int, NamespaceState] = {}
    used = {page.ns for page in pages.values()}
    for ns_id, record in namespaces.items():
        if ns_id not in used:
            continue
        spec = record.spec
        book = desk.l2.book(record.tenant)
        index = desk.l2.index(spec.page_bytes, book.name, spec.keyed)
        kind = desk.keyed if spec.keyed else desk.tokens
        digest = namespace_digest(spec)
        if digest in desk.names.by_digest:  # two ids for one spec: only the first
            continue
        ns = NamespaceState(ns_id, spec, digest, index, book, kind, events=record.events)
        desk.names.add(ns)
        states[ns_id] = ns
    # 3. the pages into their indexes
    by_ns: dict[int, list[PageRecord]] = {}
    for page in pages.values():
        by_ns.setdefault(page.ns, []).append(page)
    kept: list[PageRecord] = []
    for ns_id, ns_pages in by_ns.items():
        state = states.get(ns_id)
        if state is None:
            out.drop("no_namespace", len(ns_pages))
            continue
        keyed = state.spec.keyed
        got = _keyed(desk, state, ns_pages) if keyed else _chains(desk, state, ns_pages)
        out.drop("duplicate" if keyed else "orphan", len(ns_pages) - len(got))
        desk.l2.charge(state.book, [page.slot for page in got], state.spec.page_bytes)
        state.pages += len(got)
        kept.extend(got)
    out.pages = len(kept)
    out.namespaces = sum(1 for state in states.values() if state.pages)
    adopted = {page.slot for page in kept}
    for slot in set(sizes) - adopted - set(allocs) - refused:
        desk.pool.free(slot)  # dropped after the pool took it
    for state in states.values():
        desk.names.forget_if_unused(state)
    # 4. slots of write leases open at the stop wait out their writers, for a
    # lease's life and its quarantine; slots already quarantined, until then
    groups: dict[Alloc, list[int]] = {}
    for slot, (size, tenant, until) in allocs.items():
        if slot not in adopted:
            end = min(until, quarantine_until) if until > 0 else quarantine_until
            groups.setdefault((size, tenant, end), []).append(slot)
    for (size, tenant, end), slots in groups.items():
        desk.l2.charge(desk.l2.book(tenant), slots, size)
        desk.l2.quarantine(slots, end)
    out.quarantined = sum(len(slots) for slots in groups.values())
    # 5. every generation moves on but those of the adopted pages
    gens += 1
    if kept:
        at = np.fromiter((page.slot // GEN_GRANULE for page in kept), dtype=np.int64)
        gens[at] = np.fromiter((page.gen for page in kept), dtype=gens.dtype)
    # 6. the journal of this daemon starts from what it adopted
    journal = desk.journal
    for record in namespaces.values():
        if record.ns in states and states[record.ns].pages:
            journal.namespace(record.ns, record.tenant, record.spec, record.events)
    journal.adopted(kept)
    for (size, tenant, end), slots in groups.items():
        journal.alloc(slots, size, tenant, end)
    # 7. last (its evictions free slots as any would): quotas lowered across the restart
    for book in list(desk.l2.books.values()):
        if book.max_slots or book.max_bytes:
            evicted = desk.l2.enforce(book)
            out.drop("quota", evicted)
            out.pages -= evicted
    return out


def _drop_unwritable(pages: dict[int, PageRecord], allocs: dict[int, Alloc], out: Adopted) -> None:
    """Drop the records no daemon writes, which verify all the same (a journal
    made by hand): a negative slot (numpy would count it from the end of the
    generations, the allocator from its last slab), a slot or a generation
    past what a 64-bit integer holds (numpy cannot take it), or a page size of
    zero or less (the allocator divides by it). None reaches the pool."""
    for slot in [slot for slot in pages if not 0 <= slot < _BEYOND]:
        del pages[slot]
        out.drop("geometry")
    for slot in [slot for slot, page in pages.items() if not 0 <= page.gen < _BEYOND]:
        del pages[slot]
        out.drop("stale")  # no pool holds that generation
    for slot in [slot for slot, (size, _, _) in allocs.items() if slot < 0 or size <= 0]:
        del allocs[slot]
        out.drop("geometry")


def _chains(desk: Cache, ns: NamespaceState, pages: list[PageRecord]) -> list[PageRecord]:
    """Insert a token namespace's pages, chain by chain from each first page;
    returns those in the index (a page whose chain breaks is left out)."""
    tree = ns.index
    assert isinstance(tree, PageIndex)
    children: dict[bytes, list[PageRecord]] = {}
    for page in pages:
        children.setdefault(page.parent, []).append(page)
    spec = ns.spec
    kept: list[PageRecord] = []
    path: list[PageRecord] = []
    stack: list[tuple[int, PageRecord]] = [(0, page) for page in children.get(b"", [])]
    seen: set[bytes] = set()
    while stack:
        depth, page = stack.pop()
        del path[depth:]
        if page.key in seen:
            continue  # the same key twice (a slot held for a write-back): the first stays
        seen.add(page.key)
        path.append(page)
        below = children.get(page.key, [])
        if below:
            stack.extend((depth + 1, child) for child in below)
            continue
        keys = [p.key for p in path]
        slots = [p.slot for p in path]
        published, _ = tree.insert(keys, slots, ns.id)
        fresh = path[len(path) - published :]
        kept.extend(fresh)
        if published:
            new = len(path) - published
            parent = keys[new - 1] if new else None
            tokens = b"".join(p.tokens for p in fresh)
            desk.events.stored(
                keys[new:],
                parent,
                np.frombuffer(tokens, dtype="<u4").tolist(),
                spec.page_tokens,
                MEDIUM_L2,
                spec.model,
            )
            if desk.events.enabled and desk.config.storage.backend:
                whole = b"".join(p.tokens for p in path)
                desk.tiering.token_origins(keys, slots, new, whole, spec.page_tokens)
    return kept


def _keyed(desk: Cache, ns: NamespaceState, pages: list[PageRecord]) -> list[PageRecord]:
    """Insert a key-addressed namespace's pages in the order they were stored."""
    table = ns.index
    assert isinstance(table, KeyIndex)
    kept: list[PageRecord] = []
    stored: list[KeyedPage] = []
    for page in pages:
        if table.insert(page.key, page.slot, ns.id, page.parent):
            kept.append(page)
            group = None if page.egroup < 0 else page.egroup
            eparent = name_of(page.eparent, group) if page.eparent else b""
            stored.append(KeyedPage(page.key, page.parent, name_of(page.ekey, group), eparent))
    if stored:
        desk.keyed.remember(stored)
        desk.keyed.stored(ns, stored, MEDIUM_L2)
        desk.tiering.keyed_origins(stored, [page.slot for page in kept])
    return kept
