"""Namespaces: what clients register, and how a request names pages in one.

A namespace is found by the digest of its spec and named on the wire by an
id drawn at random (``next_id``), not counted up: with tenants, the ids a
tenant's client got would tell it how many namespaces the other tenants
registered in between. An id is none that a live namespace has (an adopted
one's included) nor one the pool journal still names. It lives while a
session has it registered, a page of it is in L2, or a lease or L3 write of
it is open (``NamespaceState.unused``); ``pool.max_namespaces`` bounds the
live ones, and with tenants each tenant's share of it bounds the tenant's
(cache/shares.py). A newcomer to a full table, or past its tenant's share,
pushes out the oldest namespace no client has registered (only its own
tenant's, with tenants on): oldest by when it came, which ``by_id`` keeps in
its order, never by its id.

Its kind (cache/kinds.py) is chosen here, once; so are the checks every
request makes of the pages it names (``token_keys``, ``engine_keys``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from hicached.cache.sessions import Handlers, NamespaceState, Session
from hicached.cache.shares import over
from hicached.errors import (
    BadRequest,
    ForeignTenant,
    InvalidNamespace,
    ResourceExhausted,
    TooLarge,
    UnknownNamespace,
)
from hicached.state.l2 import DEFAULT_TENANT, TenantBook
from hicached.wire import protocol as p
from hicached.wire.hashing import TOKEN_BYTES
from hicached.wire.namespace import (
    MAX_KEY_BYTES,
    NamespaceSpec,
    namespace_digest,
    validate_event_meta,
    validate_spec,
)

if TYPE_CHECKING:
    from hicached.cache.desk import Cache

__all__ = ["MAX_SLOTS_PER_SLAB", "Namespaces"]

# the key lengths allowed, for bytes.translate to delete
_KEY_SIZES = bytes(range(1, MAX_KEY_BYTES + 1))

MAX_SLOTS_PER_SLAB = 1 << 16  # so a page size's slots a slab are listed in bounded memory


class Namespaces:
    """The live namespaces, by id and by digest, oldest first (in the order they
    came: registered, or adopted at start in the order the daemon before
    registered them)."""

    def __init__(self, desk: Cache) -> None:
        self.desk = desk
        self.by_id: dict[int, NamespaceState] = {}
        self.by_digest: dict[bytes, NamespaceState] = {}
        # the live namespaces of each tenant (by its book's name), counted as they come and go
        self.held: dict[str, int] = {}

    def handlers(self) -> Handlers:
        return {p.RegisterNamespace: self.register}

    def register(self, session: Session, msg: p.RegisterNamespace) -> p.NamespaceOk:
        desk = self.desk
        config = desk.config
        spec = msg.spec
        validate_spec(spec, config.pool.max_page_bytes)
        slab = config.pool.slab_mib << 20
        if slab // spec.page_bytes > MAX_SLOTS_PER_SLAB:
            # a slab's free slots are listed when it is carved: bound that list
            raise InvalidNamespace(
                f"page_bytes {spec.page_bytes} is too small for slabs of "
                f"{config.pool.slab_mib} MiB: at least {-(-slab // MAX_SLOTS_PER_SLAB)} "
                f"(at most {MAX_SLOTS_PER_SLAB} pages a slab)"
            )
        spec = _own_spec(session, spec)
        meta = msg.events
        if meta is not None:
            validate_event_meta(spec, meta)
        digest = namespace_digest(spec)
        ns = self.by_digest.get(digest)
        if ns is not None and meta is not None and meta != ns.events:
            if ns.events is not None:
                raise InvalidNamespace(
                    f"namespace {ns.id} is registered with event metadata kind="
                    f"{ns.events.kind!r} sliding_window={ns.events.sliding_window}, not "
                    f"kind={meta.kind!r} sliding_window={meta.sliding_window}: the same "
                    "namespace describes one KV cache group (register it without event "
                    "metadata, or with the same)"
                )
            ns.events = meta  # the first registration that gives it
            desk.journal.namespace(ns.id, ns.book.name, spec, meta)
        if ns is None:
            book = desk.l2.book(spec.tenant if session.peer is not None else DEFAULT_TENANT)
            self._make_room(book)
            index = desk.l2.index(spec.page_bytes, book.name, spec.keyed)
            kind = desk.keyed if spec.keyed else desk.tokens
            ns = NamespaceState(self.next_id(), spec, digest, index, book, kind, events=meta)
            self.add(ns)
            desk.journal.namespace(ns.id, book.name, spec, meta)
        if ns.id not in session.namespaces:
            session.namespaces.add(ns.id)
            ns.sessions += 1
        return p.NamespaceOk(id=msg.id, ns=ns.id, digest=digest)

    def next_id(self) -> int:
        """A random id, 1 to 2**63 - 1 (a positive msgpack int64, as lease ids),
        that no live namespace has (one adopted from the daemon before
        included) and no record of the pool journal names (a forgotten
        namespace's stay there until the journal is compacted: replayed, they
        would describe the new one). Not one counted up: the ids a tenant's
        client got would tell it how many namespaces every tenant registered
        in between, the activity its stats keep from it; from the OS's random
        source, since a seeded generator's next outputs follow from enough of
        its past ones. A stale id names nothing a request can reach: a
        request names only the namespaces its own session registered."""
        taken, named = self.by_id, self.desk.journal.named
        ns_id = secrets.randbits(63) or 1
        while ns_id in taken or ns_id in named:  # 2**-63 an id each: all but never
            ns_id = secrets.randbits(63) or 1
        return ns_id

    def add(self, ns: NamespaceState) -> None:
        """A new live namespace (registered, or adopted at start)."""
        self.by_id[ns.id] = ns
        self.by_digest[ns.digest] = ns
        name = ns.book.name
        self.held[name] = self.held.get(name, 0) + 1

    def _make_room(self, book: TenantBook) -> None:
        """Room for one more namespace of ``book``'s tenant, within its share
        (with tenants) and the daemon's bound: an unused one of the same
        tenant is dropped to make it, else ResourceExhausted."""
        name = book.name
        bounds = self.desk.shares.of(name)
        if bounds is not None:
            self._drop_until(
                book,
                lambda: self.held.get(name, 0),
                bounds.namespaces,
                lambda held: f"{over(name, 'namespaces', held)}, all in use",
            )
        config = self.desk.config
        limit = config.pool.max_namespaces
        self._drop_until(
            book,
            lambda: len(self.by_id),
            limit,
            lambda n: _all_in_use(n, limit, bool(config.tenants)),
        )

    def _drop_until(
        self, book: TenantBook, count: Callable[[], int], limit: int, full: Callable[[int], str]
    ) -> None:
        """Drop unused namespaces of ``book``'s tenant until ``count()`` is below
        ``limit``, else ResourceExhausted saying ``full``. As many as it takes: a
        bound lowered by a reload (or adopted past) may be several behind, and
        one dropped at a time lost its pages with the request refused all the same."""
        held = count()
        while held >= limit:
            self._drop_an_unused_namespace(book)
            if count() == held:
                raise ResourceExhausted(full(held))
            held = count()

    def _drop_an_unused_namespace(self, book: TenantBook) -> None:
        """Make room for a new namespace: the oldest one no client has registered
        loses its pages (written back first under write_back) and is forgotten.
        With tenants, only one of ``book``'s tenant: never another tenant's pages."""
        desk = self.desk
        tenants = bool(desk.config.tenants)
        for ns in list(self.by_id.values()):  # oldest first (the order they came, not by id)
            if ns.sessions or ns.open or not ns.pages or (tenants and ns.book is not book):
                continue
            victims = ns.index.drop_owner(ns.id, desk.pool.pins)
            if victims:
                desk.l2.evicted_pages += len(victims)
                desk.evicted(victims)
            if ns.id not in self.by_id:
                return

    def left(self, session: Session) -> None:
        """``session`` ended: its namespaces lose a user."""
        for ns_id in session.namespaces:
            ns = self.by_id.get(ns_id)
            if ns is not None:
                ns.sessions -= 1
                self.forget_if_unused(ns)
        session.namespaces.clear()

    def forget_if_unused(self, ns: NamespaceState) -> None:
        """A namespace nobody uses (no session, page, lease or L3 write) is forgotten."""
        if ns.unused and self.by_id.get(ns.id) is ns:
            del self.by_id[ns.id]
            del self.by_digest[ns.digest]
            name = ns.book.name
            if self.held[name] > 1:
                self.held[name] -= 1
            else:
                del self.held[name]  # salts of tenants off: not one entry kept per name ever used
            self.desk.journal.forget_namespace(ns.id)

    def of(self, session: Session, ns_id: int) -> NamespaceState:
        """Namespace ``ns_id``, which ``session`` must have registered."""
        if ns_id not in session.namespaces:
            raise UnknownNamespace(
                f"namespace {ns_id} is not registered by this client: register it first"
            )
        return self.by_id[ns_id]

    def model_of(self, digest: bytes) -> str:
        ns = self.by_digest.get(digest)
        return ns.spec.model if ns is not None else ""

    def token_pages(self, ns: NamespaceState, tokens: bytes) -> int:
        """The full pages of ``tokens`` in a token namespace, after checking them."""
        ns.kind.by_tokens(ns)
        if len(tokens) % TOKEN_BYTES:
            raise BadRequest("tokens must be packed little-endian uint32 values")
        limit = self.desk.config.server.max_pages_per_request
        pages = len(tokens) // (ns.spec.page_tokens * TOKEN_BYTES)
        if pages > limit:
            raise TooLarge(
                f"the sequence covers more than {limit} pages (server.max_pages_per_request)"
            )
        return pages

    def token_keys(self, ns: NamespaceState, tokens: bytes) -> list[bytes]:
        """The daemon's keys of the full pages of ``tokens``."""
        self.token_pages(ns, tokens)
        return self.desk.key_cache.keys(ns.digest, tokens, ns.spec.page_tokens)

    def engine_keys(self, ns: NamespaceState, keys: list[bytes]) -> list[bytes]:
        """The daemon's keys for a key-addressed namespace's own ``keys``."""
        ns.kind.by_keys(ns)
        limit = self.desk.config.server.max_pages_per_request
        if len(keys) > limit:
            raise TooLarge(f"{len(keys)} keys, more than {limit} (server.max_pages_per_request)")
        if not keys:
            return []
        try:
            sizes = bytes(map(len, keys))  # a byte per key, at C speed
        except ValueError:  # a length past 255
            sizes = b"\x00"
        if sizes.translate(None, _KEY_SIZES):  # a length outside 1..MAX_KEY_BYTES is left
            lengths = list(map(len, keys))
            shortest, longest = min(lengths), max(lengths)
            bad = shortest if shortest < 1 else longest
            raise BadRequest(f"keys must be 1-{MAX_KEY_BYTES} bytes, got one of {bad}")
        # the joined keys name the list (lengths included): a scheduler asks again and again
        return self.desk.key_cache.engine_keys(ns.digest, keys, sizes)


def _own_spec(session: Session, spec: NamespaceSpec) -> NamespaceSpec:
    """The namespace as registered by this session's peer: with tenants on, its
    tenant is the connection's; one left at the default is filled from it, and
    another tenant's is refused."""
    peer = session.peer
    if peer is None or spec.tenant == peer:
        return spec  # tenants off: the tenant named is a salt like any other field
    if peer.startswith("!"):
        raise ForeignTenant(
            f"this connection ({peer[1:]}) belongs to no tenant, so it may register no "
            "namespace: list its uid, gid or CURVE key under [tenants] in the daemon's "
            "config, or mark one tenant others = true"
        )
    if spec.tenant == DEFAULT_TENANT:
        return msgspec.structs.replace(spec, tenant=peer)
    raise ForeignTenant(
        f"namespace of tenant {spec.tenant!r} refused: this connection belongs to tenant "
        f"{peer!r} (its credentials say so); leave tenant unset or set it to {peer!r}"
    )


def _all_in_use(held: int, limit: int, tenants: bool) -> str:
    """Why a registration past the daemon's bound of namespaces is refused. With
    tenants the count is not said: it adds up every tenant's namespaces, which a
    tenant's peer is not to learn (stats keep it from them too)."""
    if tenants:
        return (
            "the daemon's namespaces, every tenant's together, are all in use at the "
            f"limit (pool.max_namespaces = {limit})"
        )
    return f"{held} namespaces are in use, the limit (pool.max_namespaces = {limit})"
