"""The wire: tagged msgspec Structs over ZeroMQ, one payload frame per message.

A client's DEALER sends ``[payload]``; the daemon's ROUTER sees
``[routing_id, payload]`` and answers ``[routing_id, payload]``. Payloads are
msgpack maps whose ``op`` field names the message. Page bytes never travel
here: only control messages and slot offsets into the shared pool. See
docs/protocol.md.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from hicached.errors import HicachedError, error_from_code
from hicached.wire.namespace import EventMeta, NamespaceSpec

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 11
# the first minor version whose clients map a tenant's arena (HelloOk.pool_base)
ARENAS_MINOR = 4
# the first minor version whose daemons take a client's gather report
GATHER_MINOR = 5
# the first minor version whose daemons take a namespace's event metadata
EVENT_META_MINOR = 6
# the first minor version whose daemons report their garbage collector in stats
COLLECTOR_MINOR = 7
# the first minor version whose daemons report the asking peer's own tenant in stats
TENANT_STATS_MINOR = 8
# the first minor version whose daemons report a tenant's sessions, leases and
# namespaces against its share of the shared bounds (TenantStats.clients and after)
TENANT_BOUNDS_MINOR = 9
# the first minor version whose daemons keep their totals from tenants' peers
# (DaemonStats.scope "tenant": only the asking peer's own tenant's figures)
TENANT_VIEW_MINOR = 10
# the first minor version whose daemons take the key before a prefetch's keys
# (PrefetchKeys.parent)
PREFETCH_PARENT_MINOR = 11

# The largest reply a client takes by default (its socket's ZMQ_MAXMSGSIZE): a
# larger message, from a broken or hostile endpoint, is refused by libzmq from
# its length header, before any of it is buffered, and the connection is
# dropped. The largest replies grow with a daemon's limits: a reserve_keys
# reply takes an offset (9 bytes of msgpack), an index (5) and a flag (1) per
# page, REPLY_BYTES_PER_PAGE x server.max_pages_per_request in all (256 KiB
# at the default 16,384); stats carries each session's gather report, about
# 400 bytes x server.max_clients (400 KiB at the default 1,024). 64 MiB holds
# the replies of a daemon configured for 4 million pages per request.
MAX_REPLY_BYTES = 64 << 20
# The least a client may set: a stats reply with many sessions still fits.
MIN_REPLY_BYTES = 1 << 20
REPLY_BYTES_PER_PAGE = 16
# What a reply takes beside its pages' bytes, at most (stats with its sessions)
REPLY_BYTES_BESIDE_PAGES = 512 << 10
# What a request of pages takes beside them, at most (its other fields: about
# 160 bytes with a parent key of 64), and what each of its keys takes beside
# its own bytes (msgpack's bin header, for a key of up to 255 bytes)
REQUEST_BYTES_BESIDE_PAGES = 512
KEY_FRAMING_BYTES = 2


class Request(msgspec.Struct, tag_field="op", kw_only=True, forbid_unknown_fields=True):
    """Fields every request carries.

    ``id`` is the client's request id, echoed in the reply. ``deadline_ms`` is
    an absolute wall-clock time (Unix ms) after which the client no longer
    waits; the daemon drops such requests unanswered. 0 means none.
    """

    id: int
    deadline_ms: int = 0


class Hello(Request, tag="hello"):
    major: int
    minor: int
    client: str = ""
    pid: int = 0


class RegisterNamespace(Request, tag="register", omit_defaults=True):
    """``events`` (1.6): what the namespace's KV events say of its pages beyond
    their keys (EventMeta), kept from the first registration that gives it; a
    later one that gives other metadata is refused. Left out of the message
    when None (``omit_defaults``), and sent only to a daemon of 1.6 or later:
    an older one refuses fields it does not know."""

    spec: NamespaceSpec
    events: EventMeta | None = None


class Reserve(Request, tag="reserve"):
    """Ask for slots for the pages of ``tokens`` (packed uint32 LE) not yet in L2."""

    ns: int
    tokens: bytes


class Commit(Request, tag="commit"):
    """Publish the first ``pages`` reserved slots (-1: all of them); free the rest.

    ``mask`` (key-addressed reservations): one byte per reserved slot, nonzero
    for each page the client wrote; only those are published. Empty: all.
    """

    lease: int
    pages: int = -1
    mask: bytes = b""


class Match(Request, tag="match"):
    """How many leading pages of ``tokens`` are in L2; with ``lease``, pin them."""

    ns: int
    tokens: bytes
    lease: bool = True


class Prefetch(Request, tag="prefetch"):
    """Load from L3 the pages of ``tokens`` that follow its L2 hit, in the background.

    The reply's ``lease`` names the prefetch: poll it with ``progress``, then
    ``commit`` the number of pages to keep (at most ``completed``), or
    ``release`` it to cancel. ``max_pages`` (-1: no limit) caps the pages read.
    """

    ns: int
    tokens: bytes
    max_pages: int = -1


class ExistsKeys(Request, tag="exists_keys"):
    """Which of ``keys`` (a key-addressed namespace's own keys) are in L2 and L3;
    nothing is pinned and recency is left as it is."""

    ns: int
    keys: list[bytes]


class MatchKeys(Request, tag="match_keys"):
    """How many leading ``keys`` are in L2; with ``lease``, pin them (reply: MatchOk)."""

    ns: int
    keys: list[bytes]
    lease: bool = True


class ReserveKeys(Request, tag="reserve_keys"):
    """Slots for those of ``keys`` not in L2; those in L2 are pinned until the commit.

    ``keys`` follow one another in their sequence; ``parent`` is the key
    before ``keys[0]`` (empty: none or unknown). Parents keep prefix order
    for eviction: a page is not evicted before the pages stored after it.
    """

    ns: int
    keys: list[bytes]
    parent: bytes = b""


class PrefetchKeys(Request, tag="prefetch_keys", omit_defaults=True):
    """``prefetch`` by key: load from L3 the keys that follow the leading L2 run.

    ``parent`` (1.11): the key before ``keys[0]`` in its sequence (empty: none
    or unknown), the parent of the first page read where none of ``keys`` is
    in L2 (else the last page of the L2 run is). A client that asks about a
    sequence in parts names the last key of the part before. Left out of the
    message when empty (``omit_defaults``), and sent only to a daemon of 1.11
    or later: an older one refuses fields it does not know."""

    ns: int
    keys: list[bytes]
    max_pages: int = -1
    parent: bytes = b""


class Progress(Request, tag="progress"):
    lease: int


class Release(Request, tag="release"):
    """End a lease: unpin a match, or abort a reservation (its slots are freed)."""

    lease: int


class Renew(Request, tag="renew"):
    """Push a lease's deadline ``leases.ttl_s`` into the future (long copies)."""

    lease: int


class Goodbye(Request, tag="goodbye"):
    """The client is closing: end its session and every lease it holds."""


class Stats(Request, tag="stats"):
    pass


# What a gather report may say (client/gather.py makes it): kernel and way
# names are checked against these by the daemon, which answers a name it does
# not know with the names it does; a name is short, so that no error echoes a
# long one back.
GATHER_KERNELS = ("numpy", "torch")
# "measured": both kernels timed both ways; "forced": HICACHED_GATHER named one;
# "no_torch": torch is not loaded in the process, so numpy copies, unmeasured
GATHER_HOWS = ("measured", "forced", "no_torch")
MAX_GATHER_GBPS = 10_000.0  # far above any host's memory; a rate past it is garbage
Name = Annotated[str, msgspec.Meta(max_length=16)]
Gbps = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_GATHER_GBPS)]  # NaN fails it too


class GatherReport(Request, tag="gather"):
    """The kernels the client's process picked for scattered slot copies
    (client/gather.py) and the rates that decided, for ``hicached status``.
    A client sends it once its process has a pick, after the call that follows
    its hello, and again only if the pick changes (a process that loads torch
    after its hello measures at its next scattered copy), without waiting for
    the answer (``ok``); a daemon older than 1.5 is sent none. The daemon keeps
    the last one per session and forgets it with the session. Rates are GB/s
    of the sample (0.0: not measured); ``page_bytes`` x ``sample_pages`` is
    the bytes a kernel moved a round."""

    how: Name  # one of GATHER_HOWS
    read: Name  # the gather's kernel (slots -> pages), one of GATHER_KERNELS
    write: Name  # the scatter's (pages -> slots)
    read_numpy_gbps: Gbps = 0.0
    read_torch_gbps: Gbps = 0.0
    write_numpy_gbps: Gbps = 0.0
    write_torch_gbps: Gbps = 0.0
    page_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 32)] = 0
    sample_pages: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    rounds: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0
    seconds: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.0  # the measurement took


AnyRequest = (
    Hello
    | RegisterNamespace
    | Reserve
    | Commit
    | Match
    | Prefetch
    | ExistsKeys
    | MatchKeys
    | ReserveKeys
    | PrefetchKeys
    | Progress
    | Release
    | Renew
    | Goodbye
    | Stats
    | GatherReport
)


class Reply(msgspec.Struct, tag_field="op", kw_only=True):
    """Replies ignore fields they do not know: a daemon of a newer minor
    version may add fields without breaking older clients."""

    id: int


class HelloOk(Reply, tag="hello_ok"):
    major: int
    minor: int
    instance: int
    session: int
    pool_path: str
    pool_bytes: int
    lease_ttl_s: float
    max_message_bytes: int
    max_pages_per_request: int
    # bytes of arena per generation counter in the pool file's header (0: none)
    gen_granule: int = 0
    # "madvise": clients ask for transparent huge pages on their mapping too
    huge_pages: str = ""
    # the pool file's id (0: none): a daemon that adopted the pool of the one
    # before it says the same id, and a client keeps its mapping of that file
    pool_id: int = 0
    # tenant arenas (1.4): the offset in the daemon's pool of the first slot of
    # ``pool_path``, the client's tenant's arena; slot ``offset`` is at
    # ``offset - pool_base`` of that file. With ``pool_bytes`` 0 there is no pool
    # to map: the connection's tenant has no arena.
    pool_base: int = 0


class NamespaceOk(Reply, tag="namespace_ok"):
    ns: int
    digest: bytes


class ReserveOk(Reply, tag="reserve_ok"):
    """``present`` leading pages are already in L2 (skip them); ``offsets`` are
    arena byte offsets for the next ``len(offsets)`` pages. ``pool_full`` says the
    pool could not give a slot for every missing page."""

    lease: int
    present: int
    offsets: list[int]
    pool_full: bool = False


class ReserveKeysOk(Reply, tag="reserve_keys_ok"):
    """``present``: one byte per key, 1 where the page is in L2 already (pinned
    until the commit; skip it). ``offsets[j]`` is a fresh slot for
    ``keys[indices[j]]``. ``pool_full``: some missing keys got no slot."""

    lease: int
    present: bytes
    indices: list[int]
    offsets: list[int]
    pool_full: bool = False


class ExistsKeysOk(Reply, tag="exists_keys_ok"):
    """``where``: one byte per key, bit 0 set when it is in L2 and bit 1 when L3
    holds it (as far as this daemon has learned). ``l2`` leading keys are in
    L2; ``leading`` (>= l2) leading keys are in L2 or L3."""

    l2: int
    leading: int
    where: bytes


class CommitOk(Reply, tag="commit_ok"):
    """``published`` pages entered the index; ``duplicates`` were already there."""

    published: int
    duplicates: int


class MatchOk(Reply, tag="match_ok"):
    """``hits`` leading pages are in L2 (at ``offsets``); ``l3_hits`` more are
    known to be in L3, as far as this daemon has learned."""

    hits: int
    offsets: list[int]
    lease: int = 0
    l3_hits: int = 0


class PrefetchOk(Reply, tag="prefetch_ok"):
    """``l2_hits`` leading pages are in L2 already (held until the commit)."""

    lease: int
    l2_hits: int


class ProgressOk(Reply, tag="progress_ok"):
    """``planned`` pages are being read (-1: not known yet); the first
    ``completed`` of them are verified in L2. ``done``: nothing more will come;
    ``failed``: a read failed or a page was corrupt, truncating at that page."""

    planned: int
    completed: int
    done: bool
    failed: bool = False


class RenewOk(Reply, tag="renew_ok"):
    """The lease now ends ``ttl_s`` seconds after the daemon received the renewal."""

    ttl_s: float


class Ok(Reply, tag="ok"):
    pass


class GatherClient(msgspec.Struct, kw_only=True):
    """One client session's gather report (GatherReport), in stats."""

    session: int
    client: str
    pid: int
    how: str
    read: str
    write: str
    read_numpy_gbps: float = 0.0
    read_torch_gbps: float = 0.0
    write_numpy_gbps: float = 0.0
    write_torch_gbps: float = 0.0
    page_bytes: int = 0
    sample_pages: int = 0
    rounds: int = 0
    seconds: float = 0.0


class CollectorStats(msgspec.Struct, kw_only=True):
    """The daemon process's cyclic garbage collector (1.7; daemon/collector.py).

    The lists have one figure per generation, youngest first: collections run,
    seconds they held the process in all and the longest, and unreachable
    objects they found. ``freeze``: whether the daemon freezes long-lived
    objects (server.gc_freeze); ``frozen_objects`` are out of every
    collection's reach now, put there by ``freezes`` freezes."""

    freeze: bool
    frozen_objects: int
    freezes: int
    collections: list[int]
    pause_s: list[float]
    longest_s: list[float]
    collected: list[int]


class TenantStats(msgspec.Struct, kw_only=True):
    """One tenant's share of L2 (with [tenants] only): ``pages`` indexed,
    ``slots`` and ``bytes`` charged (indexed, under a lease, on their way
    back), its quota (0 = none), the pages its matches asked for and found in
    L2, and its pages evicted (``quota_evicted`` of them to keep it within its
    quota). A peer's stats carry its own tenant's (1.8), never another's; the
    metrics (daemon/metrics.py) every tenant's.

    From 1.9, what the tenant's peers hold of the bounds every client shares,
    and its share of each (cache/shares.py): client sessions, open leases and
    live namespaces; all 0 without [tenants] and from an older daemon."""

    tenant: str
    pages: int
    slots: int
    bytes: int
    max_slots: int
    max_bytes: int
    asked: int
    hits: int
    evicted: int
    quota_evicted: int
    clients: int = 0
    leases: int = 0
    namespaces: int = 0
    max_clients: int = 0
    max_leases: int = 0
    max_namespaces: int = 0


class DaemonStats(msgspec.Struct, kw_only=True):
    instance: int
    uptime_s: float
    pool_bytes: int
    pool_used_bytes: int
    pool_free_bytes: int
    slab_bytes: int
    pages: int
    pinned_pages: int
    reserved_pages: int
    namespaces: int
    clients: int
    leases: int
    requests: dict[str, int]
    errors: dict[str, int]
    dropped: dict[str, int]
    evicted_pages: int
    expired_leases: int
    l3_backend: str = ""
    # up, down (circuit open), scanning (up, startup scan running), "" without L3
    l3_state: str = ""
    l3_pages_known: int = 0
    l3: dict[str, int] = {}
    # pages asked for by match requests ("asked"), and found in L2 ("l2") and L3 ("l3")
    match_pages: dict[str, int] = {}
    events_pending: int = 0
    reclaimed_slabs: int = 0  # slabs one page size gave up for another
    # slots of expired write leases, held until no late copy can still reach them
    quarantined_pages: int = 0
    # evicted pages whose slot is held until their write-back to L3 ends
    writeback_pages: int = 0
    l3_known_max: int = 0  # the bound on keys remembered as held by L3
    committed_pages: int = 0  # pages clients committed into L2 (prefetched pages aside)
    # L3 lets go of pages sooner than L2 does: it keeps the pages written last
    l3_undersized: bool = False
    # pages written to L3 (rewrites included) per page committed
    l3_write_amplification: float = 0.0
    metrics_endpoint: str = ""  # "" when metrics are off
    # pages this daemon adopted at its start from the pool of the one before it,
    # and those it dropped, by reason (stale, orphan, geometry, ...; docs/operations.md)
    adopted_pages: int = 0
    adoption_dropped: dict[str, int] = {}
    # the scattered-copy kernels of the client sessions that reported theirs (1.5),
    # in session order; sessions of older clients, and of processes that made no
    # pick yet, are not there
    gather_clients: list[GatherClient] = []
    # the garbage collector's pauses and what is frozen (1.7); None from an older
    # daemon, or a cache no daemon runs
    collector: CollectorStats | None = None
    # the asking peer's own tenant (1.8): None without [tenants], for a peer that
    # belongs to no tenant, from an older daemon, and in the metrics' snapshot
    tenant: TenantStats | None = None
    # what the figures above cover (1.10): "daemon", its totals; "tenant", for a
    # peer of a tenant, which is not to see the others' activity: the totals are
    # zeros and empty, and ``tenant`` holds its own figures
    scope: str = "daemon"


class StatsOk(Reply, tag="stats_ok"):
    stats: DaemonStats


class Error(Reply, tag="error"):
    code: str
    message: str
    retriable: bool = False

    def to_exception(self) -> HicachedError:
        return error_from_code(self.code, self.message)

    @classmethod
    def of(cls, request_id: int, exc: HicachedError) -> Error:
        return cls(id=request_id, code=exc.code, message=exc.message, retriable=exc.retriable)


AnyReply = (
    HelloOk
    | NamespaceOk
    | ReserveOk
    | CommitOk
    | MatchOk
    | ReserveKeysOk
    | ExistsKeysOk
    | PrefetchOk
    | ProgressOk
    | RenewOk
    | Ok
    | StatsOk
    | Error
)


class Envelope(msgspec.Struct):
    """Lenient view of a payload: just enough to address an error reply."""

    id: int = 0


encode = msgspec.msgpack.Encoder().encode
request_decoder = msgspec.msgpack.Decoder(AnyRequest)
reply_decoder = msgspec.msgpack.Decoder(AnyReply)
envelope_decoder = msgspec.msgpack.Decoder(Envelope)
