"""What the pool journal must say: the records a restarted daemon replays.

Synchronous and free of I/O: the cache calls this as namespaces appear, write
leases get fresh slots, pages are published and slots freed; the records wait
in ``pending`` until the daemon writes them (daemon/journal.py), which it does
before any reply leaves, so whatever a client was told (a lease on fresh
slots, a commit) is in the file first. The format is wire/journal.py's.

The recorder also keeps what a compacted journal would hold (the namespaces,
each live page's record, the slots under write leases) so that the daemon can
replace a journal that grew long with one of that size (``snapshot``).
"""

from __future__ import annotations

from hicached.wire.journal import (
    MAX_FRAME,
    AllocRecord,
    FreeRecord,
    NsRecord,
    PageRecord,
    PagesRecord,
    frame,
)
from hicached.wire.namespace import EventMeta, NamespaceSpec

__all__ = ["NoRecorder", "Recorder"]

# A journal this many times larger than what it describes (plus a floor) is compacted.
COMPACT_RATIO = 4
COMPACT_FLOOR = 32 << 20
SNAPSHOT_BATCH = 4096  # pages a record of a compacted journal holds


class Recorder:
    """Records for the pool journal, and the live state a snapshot holds."""

    on = True  # the cache builds records only for a recorder that keeps them

    def __init__(self) -> None:
        self.pending: list[bytes] = []
        self._frees: list[int] = []  # slots freed since the last record (one record)
        self.namespaces: dict[int, bytes] = {}  # ns id -> its record
        # every ns id a record in the file names, a forgotten namespace's too,
        # until a snapshot leaves those out: no new namespace takes one
        # (cache/namespaces.py). Bounded as the file is: it is compacted once
        # it is past a few times what it describes (``should_compact``)
        self.named: set[int] = set()
        self.pages: dict[int, PageRecord] = {}  # slot -> the record of the page it holds
        # slot under a write lease -> (page size, tenant, quarantined until or 0)
        self.allocs: dict[int, tuple[int, str, float]] = {}
        # about the bytes a page's record takes (the last commit's average): what
        # ``pages`` would take in a compacted journal is ``len(pages)`` of them
        self.page_bytes = 64
        self.written = 0  # bytes the journal file holds since its last snapshot
        # bytes of the last snapshot: the next is not made before the file is
        # COMPACT_RATIO times that, whatever the estimate of ``should_compact``
        # says (the last commit's records may be far smaller than most live
        # pages' records: it would rewrite the whole file at every reply)
        self.snapshot_bytes = 0

    def namespace(
        self, ns: int, tenant: str, spec: NamespaceSpec, events: EventMeta | None = None
    ) -> None:
        record = frame(NsRecord(ns, tenant, spec, events))
        self.namespaces[ns] = record
        self.named.add(ns)
        self._add(record)

    def forget_namespace(self, ns: int) -> None:
        """A namespace with no page left: a snapshot leaves it out (until then
        its id stays in ``named``)."""
        self.namespaces.pop(ns, None)

    def alloc(self, slots: list[int], page_bytes: int, tenant: str, until: float = 0.0) -> None:
        """Fresh slots given to a client's write lease of ``tenant``; with ``until``,
        the same slots quarantined until then (the lease ended, its writer may not)."""
        if not slots:
            return
        allocs = self.allocs
        for slot in slots:
            allocs[slot] = (page_bytes, tenant, until)
        self._add(frame(AllocRecord(slots, page_bytes, tenant, until)))

    def publish(self, records: list[PageRecord]) -> None:
        """Pages published in L2 together (one commit): one record."""
        if not records:
            return
        allocs = self.allocs
        if allocs:
            for record in records:
                allocs.pop(record.slot, None)
        self.pages.update((record.slot, record) for record in records)
        made = _framed(records)
        self.page_bytes = sum(map(len, made)) // len(records)
        for part in made:
            self._add(part)

    def adopted(self, records: list[PageRecord]) -> None:
        """Pages adopted at start: live, with no record of their own (the journal
        this daemon starts with is a snapshot)."""
        self.pages.update((record.slot, record) for record in records)

    def freed(self, slot: int) -> None:
        """``slot`` holds nothing any record says any more."""
        self.pages.pop(slot, None)
        self.allocs.pop(slot, None)
        self._frees.append(slot)

    def _add(self, record: bytes) -> None:
        if self._frees:
            self.pending.append(frame(FreeRecord(self._frees)))
            self._frees = []
        self.pending.append(record)

    @property
    def waiting(self) -> bool:
        return bool(self.pending or self._frees)

    def take(self) -> bytes:
        """The records not yet written, in order; they count as written."""
        if self._frees:
            self.pending.append(frame(FreeRecord(self._frees)))
            self._frees = []
        data = b"".join(self.pending)
        self.pending.clear()
        self.written += len(data)
        return data

    def unfiled(self) -> None:
        """The records taken went to no file (a write failed and journaling
        ended): none names a forgotten namespace, so ``named`` holds only the
        live ones' ids, not one more for each namespace from then on."""
        self.named = set(self.namespaces)

    def should_compact(self) -> bool:
        """The file is past a few times what it describes, and past a few times
        what the last snapshot wrote: a compaction rewrites at most a third of
        what was appended since the one before."""
        written = self.written
        if written <= COMPACT_RATIO * self.snapshot_bytes:
            return False
        live = len(self.pages) * self.page_bytes + len(self.allocs) * 16
        return written > COMPACT_RATIO * live + COMPACT_FLOOR

    def snapshot(self) -> bytes:
        """Every record a new journal needs (after its header): the namespaces,
        the slots under write leases, the live pages. Pending records are
        folded in; the new file counts as written from here."""
        self._frees.clear()
        self.pending.clear()
        groups: dict[tuple[int, str, float], list[int]] = {}
        for slot, what in self.allocs.items():
            groups.setdefault(what, []).append(slot)
        allocs = [frame(AllocRecord(slots, *what)) for what, slots in groups.items()]
        live = list(self.pages.values())
        pages = [
            made
            for i in range(0, len(live), SNAPSHOT_BATCH)
            for made in _framed(live[i : i + SNAPSHOT_BATCH])
        ]
        data = b"".join([*self.namespaces.values(), *allocs, *pages])
        self.written = self.snapshot_bytes = len(data)
        self.named = set(self.namespaces)
        return data


def _framed(records: list[PageRecord]) -> list[bytes]:
    """Pages as one framed record, or as several where one would be longer than
    a reader takes (``MAX_FRAME``: it would end the journal there, and every
    page after it would be lost at the next start): long pages' token ids
    (page_tokens up to 65,536) make 4,096 records a gigabyte."""
    made = frame(PagesRecord(records))
    if len(made) <= MAX_FRAME or len(records) == 1:
        return [made]
    half = len(records) // 2
    return _framed(records[:half]) + _framed(records[half:])


class NoRecorder(Recorder):
    """No journal (``pool.adopt = false``, or a cache of its own in a test)."""

    on = False

    def namespace(
        self, ns: int, tenant: str, spec: NamespaceSpec, events: EventMeta | None = None
    ) -> None:
        pass

    def alloc(self, slots: list[int], page_bytes: int, tenant: str, until: float = 0.0) -> None:
        pass

    def publish(self, records: list[PageRecord]) -> None:
        pass

    def adopted(self, records: list[PageRecord]) -> None:
        pass

    def freed(self, slot: int) -> None:
        pass
