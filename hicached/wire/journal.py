"""The pool journal's format: what a restarted daemon reads to adopt the pool.

The journal is a file beside the pool file (same tmpfs, same lifetime, mode
0600): a header, then framed records. Each frame is ``<u32 length><u64 xxh3
of the body><body>``, the body one msgpack-encoded record; a frame that is cut
short or does not verify ends the journal there (a daemon killed mid-write
leaves at most its last frame torn, and that frame was never acknowledged).

Records, in the order the daemon made them:

- ``NsRecord``: a namespace (its id on the wire, its tenant, its spec);
- ``AllocRecord``: fresh slots given to a client's write lease (bytes may
  land in them through that client's handle until the lease ends), and the
  same slots again when that lease ends with them quarantined (until when);
- ``PageRecord``: a page published in L2: namespace, key, parent, slot, the
  slot's generation when it was published, and what its events need (the
  pages of one commit travel in one ``PagesRecord``);
- ``FreeRecord``: slots that no longer hold what an earlier record says.

Replayed in order, the last record about a slot says what it is. A page is
adopted only if its slot's generation in the pool file still equals the one
recorded: a slot freed since (whether or not its ``FreeRecord`` reached the
file) has a newer generation, so a lost record can make the cache forget a
page, never serve another key's bytes.

``JournalHeader`` names what must match for a pool to be adopted: the
format version, the pool's byte size and slab size, the generation granule,
the pool file's length, the host's boot (a pool kept on a disk across a
reboot may hold pages its journal does not describe), the pool file itself
(its device and inode: a journal put beside another pool file of the same
geometry would otherwise name that file's bytes as its own pages wherever
the generations happen to agree, as they do in slots that neither pool ever
freed) and the pool's id (a random number made with the file, which clients
compare to keep their mapping across a restart).
"""

from __future__ import annotations

import struct

import msgspec
import xxhash

from hicached.wire.namespace import EventMeta, NamespaceSpec

__all__ = [
    "JOURNAL_VERSION",
    "MAX_FRAME",
    "AllocRecord",
    "FreeRecord",
    "JournalHeader",
    "NsRecord",
    "PageRecord",
    "PagesRecord",
    "Record",
    "frame",
    "read_journal",
]

JOURNAL_MAGIC = b"HICJRNL\x00"
JOURNAL_VERSION = 3  # bump when a record or the header changes meaning
_FRAME = struct.Struct("<IQ")
MAX_FRAME = 16 << 20  # a longer frame is damage, not a record


class JournalHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a pool must match to be adopted (``version`` first: an older or newer
    daemon reads no further than it)."""

    version: int
    pool_bytes: int
    slab_bytes: int
    gen_granule: int
    file_bytes: int
    pool_id: int
    # the pool file this journal describes: (st_dev, st_ino) when it was made
    pool_dev: int
    pool_ino: int
    # tenant arenas (wire/arenas.py): each file as (tenant, first byte in the pool,
    # bytes, st_dev, st_ino); empty for a pool of one file
    arenas: list[tuple[str, int, int, int, int]] = msgspec.field(default_factory=list)
    # who each arena's file opens to, in the order of ``arenas``: (uids, gids).
    # A start that would open a file to other identities makes it anew: what a
    # process opened or mapped before keeps reading it whatever the new ACL says
    readers: list[tuple[list[int], list[int]]] = msgspec.field(default_factory=list)
    # the host's boot id when the pool was made ("" in a journal of a daemon that
    # did not write it). A pool file outlives a boot only where pool.shm_dir is
    # not a tmpfs, and after a crash of the host what reached the disk of its
    # pages and of its journal need not agree: such a pool is never adopted
    boot: str = ""


class NsRecord(msgspec.Struct, tag="ns", array_like=True):
    """A namespace; ``events``: its event metadata (a trailing field, which a
    daemon that does not know it skips). A later record of the same ``ns``
    replaces an earlier one (metadata given after the first registration)."""

    ns: int
    tenant: str
    spec: NamespaceSpec
    events: EventMeta | None = None


class AllocRecord(msgspec.Struct, tag="alloc", array_like=True):
    """Fresh slots of a write lease of ``tenant``; ``until`` > 0: quarantined
    until then (the daemon's monotonic clock, the host's since boot)."""

    slots: list[int]
    page_bytes: int
    tenant: str = "default"
    until: float = 0.0


class PageRecord(msgspec.Struct, tag="page", array_like=True):
    """One published page. ``tokens`` (packed uint32 LE) are a token page's ids
    for its events; ``ekey``/``eparent`` the event keys of a key-addressed page
    (wire/events.py ``event_key``: vLLM's block hash without its group index),
    ``egroup`` its KV cache group (-1: none, or a record of a daemon that did
    not write it: its events then name no group). A trailing field, so daemons
    that do not know it read these records as before."""

    ns: int
    key: bytes
    parent: bytes
    slot: int
    gen: int
    tokens: bytes = b""
    ekey: bytes = b""
    eparent: bytes = b""
    egroup: int = -1


class PagesRecord(msgspec.Struct, tag="pages", array_like=True):
    """Pages published together (one commit), in order."""

    pages: list[PageRecord]


class FreeRecord(msgspec.Struct, tag="free", array_like=True):
    slots: list[int]


Record = NsRecord | AllocRecord | PageRecord | PagesRecord | FreeRecord

_encode = msgspec.msgpack.Encoder().encode
_decode_record = msgspec.msgpack.Decoder(Record).decode
_decode_header = msgspec.msgpack.Decoder(JournalHeader).decode


def frame(record: Record | JournalHeader) -> bytes:
    """One record (or the header), framed."""
    body = _encode(record)
    return _FRAME.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


def header_bytes(header: JournalHeader) -> bytes:
    return JOURNAL_MAGIC + frame(header)


class JournalDamage(ValueError):
    """The journal cannot be read as this version writes it."""


def read_header(data: memoryview) -> tuple[JournalHeader, int]:
    """The header and where the records start; ``JournalDamage`` when it is not
    a journal, or one of another version (said in the message)."""
    if bytes(data[: len(JOURNAL_MAGIC)]) != JOURNAL_MAGIC:
        raise JournalDamage("not a hicached pool journal")
    body, end = _unframe(data, len(JOURNAL_MAGIC))
    if body is None:
        raise JournalDamage("the journal's header is torn")
    try:
        version = msgspec.msgpack.decode(body, type=dict).get("version")
    except msgspec.MsgspecError:
        # a header this daemon cannot even find a version in: another layout's
        # (a newer one's), or damage; never a reason not to start
        raise JournalDamage("the journal's header is not one this daemon reads") from None
    if version != JOURNAL_VERSION:
        raise JournalDamage(f"pool layout version {version}, this daemon reads {JOURNAL_VERSION}")
    try:
        return _decode_header(body), end
    except msgspec.MsgspecError as exc:
        raise JournalDamage(f"the journal's header does not decode: {exc}") from None


def read_journal(data: memoryview, start: int) -> tuple[list[Record], int]:
    """The records from ``start`` on, up to the first that is torn or does not
    verify, and how many bytes were left unread from there (the torn tail)."""
    records: list[Record] = []
    pos = start
    while pos < len(data):
        body, end = _unframe(data, pos)
        if body is None:
            break
        try:
            records.append(_decode_record(body))
        except msgspec.MsgspecError:
            break
        pos = end
    return records, len(data) - pos


def _unframe(data: memoryview, pos: int) -> tuple[bytes | None, int]:
    if pos + _FRAME.size > len(data):
        return None, pos
    length, digest = _FRAME.unpack_from(data, pos)
    start = pos + _FRAME.size
    end = start + length
    if length > MAX_FRAME or end > len(data):
        return None, pos
    body = bytes(data[start:end])
    if xxhash.xxh3_64_intdigest(body) != digest:
        return None, pos
    return body, end
