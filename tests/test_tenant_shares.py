"""Each tenant's share of the bounds every client shares (cache/shares.py):
sessions, leases and namespaces, on the daemon's state in-process, exact
order; the config keys and their reload. Real daemons: test_tenant_shares_daemon.py."""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec
import pytest

from hicached import protocol as p
from hicached.cache import Cache, Lease
from hicached.cache.shares import NO_TENANT, Bounds, Shares, equal_share
from hicached.config import (
    Config,
    LeaseConfig,
    PoolConfig,
    ServerConfig,
    TenantConfig,
    parse_config,
)
from hicached.daemon.reload import reload_plan
from hicached.errors import ConfigError, ResourceExhausted, SessionLost
from hicached.hashing import pack_tokens

PAGE = 4096
SPEC = p.NamespaceSpec(model="m", kv_dtype="bf16", layout="l", page_tokens=1, page_bytes=PAGE)
HELLO = p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)
NOBODY = "!uid 7, gid 7, pid 1"  # a peer no tenant lists


def _cache(
    clients: int = 1024, leases: int = 65536, namespaces: int = 256, **tenants: object
) -> Cache:
    config = Config(
        server=ServerConfig(max_clients=clients),
        leases=LeaseConfig(max_leases=leases),
        pool=PoolConfig(size_mib=1, slab_mib=1, max_page_bytes=PAGE, max_namespaces=namespaces),
        tenants={name: msgspec.convert(t, TenantConfig) for name, t in tenants.items()},
    )
    return Cache(config, pool_path="x")


def _call(cache: Cache, rid: bytes, peer: str | None, request: p.Request) -> p.AnyReply:
    return cache.handle(rid, p.request_decoder.decode(p.encode(request)), peer)


def _hello(cache: Cache, rid: bytes, peer: str | None) -> p.AnyReply:
    return _call(cache, rid, peer, HELLO)


def _refused(reply: p.AnyReply, key: str) -> str:
    assert isinstance(reply, p.Error), reply
    assert reply.code == ResourceExhausted.code and key in reply.message, reply
    return reply.message


def _register(cache: Cache, rid: bytes, peer: str, model: str = "m") -> p.AnyReply:
    spec = msgspec.structs.replace(SPEC, model=model)
    return _call(cache, rid, peer, p.RegisterNamespace(id=2, spec=spec))


def _ns(cache: Cache, rid: bytes, peer: str, model: str = "m") -> int:
    ok = _register(cache, rid, peer, model)
    assert isinstance(ok, p.NamespaceOk), ok
    return ok.ns


def _reserve(cache: Cache, rid: bytes, peer: str, ns: int, first: int) -> p.AnyReply:
    return _call(cache, rid, peer, p.Reserve(id=3, ns=ns, tokens=pack_tokens([first, first + 1])))


def _lease(cache: Cache, rid: bytes, peer: str, first: int) -> int:
    """A session of ``peer`` holding a write lease (hello, register, reserve)."""
    assert isinstance(_hello(cache, rid, peer), p.HelloOk)
    ok = _reserve(cache, rid, peer, _ns(cache, rid, peer), first)
    assert isinstance(ok, p.ReserveOk) and ok.lease, ok
    return ok.lease


def test_shares_are_equal_parts_rounded_up_unless_a_tenant_names_its_own() -> None:
    assert [equal_share(1024, n) for n in (1, 2, 3, 1024, 2000)] == [1024, 512, 342, 1, 1]
    config = parse_config(
        "[server]\nmax_clients = 10\n[leases]\nmax_leases = 100\n[pool]\nmax_namespaces = 5\n"
        "[tenants.a]\nuids = [1]\nmax_clients = 7\nmax_namespaces = 5\n"
        "[tenants.b]\nuids = [2]\n[tenants.c]\nuids = [3]\nmax_leases = 1\n"
    )
    shares = Shares(config)
    assert shares.of("a") == Bounds(7, 34, 5)
    assert shares.of("b") == Bounds(4, 34, 2)
    assert shares.of("c") == Bounds(4, 1, 2)
    assert shares.of(NO_TENANT) == Bounds(4, 0, 0)  # peers of no tenant: sessions only
    assert shares.of("gone") is None  # a tenant the config does not list: no share
    assert Shares(Config()).bounds == {}  # without tenants nothing is bounded per tenant


def test_a_tenant_at_its_clients_bound_makes_room_from_its_own_idle_sessions_only() -> None:
    cache = _cache(clients=8, alpha={"max_clients": 3}, beta={})
    assert isinstance(_hello(cache, b"b-idle", "beta"), p.HelloOk)  # the longest idle of all
    _lease(cache, b"a1", "alpha", 100)
    _lease(cache, b"a2", "alpha", 200)
    assert isinstance(_hello(cache, b"a-idle", "alpha"), p.HelloOk)
    assert isinstance(_hello(cache, b"a-new", "alpha"), p.HelloOk)  # alpha's own idle goes
    assert list(cache.sessions) == [b"b-idle", b"a1", b"a2", b"a-new"]
    gone = _call(cache, b"a-idle", "alpha", p.Renew(id=4, lease=1))
    assert isinstance(gone, p.Error) and gone.code == SessionLost.code
    _reserve(cache, b"a-new", "alpha", _ns(cache, b"a-new", "alpha"), 300)
    message = _refused(_hello(cache, b"a-more", "alpha"), "tenants.alpha.max_clients")
    assert message.startswith("tenant 'alpha' holds 3 clients, its limit")
    assert b"b-idle" in cache.sessions  # never another tenant's
    for rid in (b"b2", b"b3", b"b4"):  # beta's own share (4) is untouched by alpha's
        assert isinstance(_hello(cache, rid, "beta"), p.HelloOk)
    assert (cache.clients.held["alpha"], cache.clients.held["beta"]) == (3, 4)
    assert cache.stats("alpha").tenant == _tenant(cache, "alpha")
    assert (cache.stats("alpha").tenant.clients, cache.stats("beta").tenant.clients) == (3, 4)


def _tenant(cache: Cache, name: str) -> p.TenantStats:
    (figures,) = [t for t in cache.tenant_figures() if t.tenant == name]
    return figures


def test_a_full_table_takes_only_the_newcomers_own_tenants_idle_session() -> None:
    """The daemon-wide table is full while alpha is below its share: a newcomer
    of alpha takes the place of alpha's own longest idle session, not beta's
    (idle longer); a newcomer whose tenant has none takes that of an idle peer
    of no tenant (status only), and with none of those either is refused,
    naming server.max_clients, though other tenants' sessions are idle; peers
    of no tenant make room among themselves."""
    cache = _cache(clients=6, alpha={"max_clients": 5}, beta={})
    assert isinstance(_hello(cache, b"b-idle", "beta"), p.HelloOk)
    for rid in (b"a1", b"a2", b"a3"):
        assert isinstance(_hello(cache, rid, "alpha"), p.HelloOk)
    assert isinstance(_hello(cache, b"n1", NOBODY), p.HelloOk)
    assert isinstance(_hello(cache, b"n2", "!uid 8, gid 8, pid 2"), p.HelloOk)
    assert len(cache.sessions) == 6
    assert isinstance(_hello(cache, b"a4", "alpha"), p.HelloOk)
    assert list(cache.sessions) == [b"b-idle", b"a2", b"a3", b"n1", b"n2", b"a4"]
    _reserve(cache, b"b-idle", "beta", _ns(cache, b"b-idle", "beta"), 100)  # now it holds a lease
    assert isinstance(_hello(cache, b"b2", "beta"), p.HelloOk)  # n1, of no tenant, made way
    assert list(cache.sessions) == [b"a2", b"a3", b"n2", b"a4", b"b-idle", b"b2"]
    _reserve(cache, b"b2", "beta", _ns(cache, b"b2", "beta"), 200)
    assert isinstance(_hello(cache, b"n3", "!uid 9, gid 9, pid 3"), p.HelloOk)
    assert list(cache.sessions) == [b"a2", b"a3", b"a4", b"b-idle", b"b2", b"n3"]
    _call(cache, b"n3", "!uid 9, gid 9, pid 3", p.Goodbye(id=1))
    assert isinstance(_hello(cache, b"a5", "alpha"), p.HelloOk)
    message = _refused(_hello(cache, b"b3", "beta"), "server.max_clients")
    assert "none of tenant 'beta' is idle without a lease" in message
    assert list(cache.sessions) == [b"a2", b"a3", b"a4", b"b-idle", b"b2", b"a5"]


def test_peers_of_no_tenant_cannot_lock_a_tenant_out_of_a_full_table() -> None:
    """The shares add up to more than the table (each tenant's equal share,
    rounded up, and one more for the peers of no tenant): with alpha at its
    share, any local user that belongs to no tenant could fill the rest of
    the table with idle sessions (a hello, nothing else), and beta, holding
    no session at all, was refused every one for good. Their sessions are
    status only: one makes way for a tenant's newcomer below its share."""
    cache = _cache(clients=4, alpha={}, beta={})  # shares of 2 each, and 2 of no tenant
    _lease(cache, b"a1", "alpha", 100)
    _lease(cache, b"a2", "alpha", 200)
    for i in range(2):
        assert isinstance(_hello(cache, bytes([i]), f"!uid {i}, gid {i}, pid {i}"), p.HelloOk)
    assert len(cache.sessions) == 4
    assert isinstance(_hello(cache, b"b1", "beta"), p.HelloOk)
    assert isinstance(_hello(cache, b"b2", "beta"), p.HelloOk)
    assert list(cache.sessions) == [b"a1", b"a2", b"b1", b"b2"]
    assert cache.clients.held == {"alpha": 2, NO_TENANT: 0, "beta": 2}
    message = _refused(_hello(cache, b"n", "!uid 9, gid 9, pid 9"), "server.max_clients")
    assert "none of peers of no tenant is idle" in message  # and never a tenant's session


def test_peers_of_no_tenant_share_one_equal_part_of_the_sessions() -> None:
    cache = _cache(clients=8, alpha={}, beta={})  # a share is 4
    assert isinstance(_hello(cache, b"a", "alpha"), p.HelloOk)  # idle longest of all
    for i in range(5):
        assert isinstance(_hello(cache, bytes([i]), f"!uid {i}, gid {i}, pid {i}"), p.HelloOk)
    assert cache.clients.held[NO_TENANT] == 4 and b"a" in cache.sessions
    assert list(cache.sessions)[1:] == [bytes([i]) for i in range(1, 5)]  # the first made way


def test_without_tenants_a_full_table_takes_anyones_idle_session_as_before() -> None:
    cache = _cache(clients=2)
    for rid in (b"x", b"y", b"z"):
        assert isinstance(_hello(cache, rid, None), p.HelloOk)
    assert list(cache.sessions) == [b"y", b"z"] and cache.clients.held == {}


def test_a_tenants_leases_past_its_share_are_refused_and_nothing_is_left_half_made() -> None:
    cache = _cache(alpha={"max_leases": 2}, beta={})
    assert isinstance(_hello(cache, b"a", "alpha"), p.HelloOk)
    ns = _ns(cache, b"a", "alpha")
    keyed = _ns_of(cache, b"a", "alpha", msgspec.structs.replace(SPEC, key_scheme="engine"))
    stored = _reserve(cache, b"a", "alpha", ns, 100)
    assert isinstance(stored, p.ReserveOk)
    assert isinstance(_call(cache, b"a", "alpha", p.Commit(id=4, lease=stored.lease)), p.CommitOk)
    for first in (200, 300):
        assert isinstance(_reserve(cache, b"a", "alpha", ns, first), p.ReserveOk)
    before = (cache.pool.used_bytes, _tenant(cache, "alpha"), len(cache.leases))
    assert before[1].slots == 6 and before[1].leases == 2 and before[1].max_leases == 2
    message = _refused(_reserve(cache, b"a", "alpha", ns, 400), "tenants.alpha.max_leases")
    assert message.startswith("tenant 'alpha' holds 2 leases, its limit")
    assert (cache.pool.used_bytes, _tenant(cache, "alpha"), len(cache.leases)) == before
    keys = p.ReserveKeys(id=5, ns=keyed, keys=[b"k1", b"k2"])
    _refused(_call(cache, b"a", "alpha", keys), "tenants.alpha.max_leases")
    assert (cache.pool.used_bytes, _tenant(cache, "alpha"), len(cache.leases)) == before
    # a match that would lease what it found is refused; one without a lease is not
    toks = pack_tokens([100, 101])
    match = p.Match(id=6, ns=ns, tokens=toks)
    _refused(_call(cache, b"a", "alpha", match), "tenants.alpha.max_leases")
    hit = _call(cache, b"a", "alpha", p.Match(id=6, ns=ns, tokens=toks, lease=False))
    assert isinstance(hit, p.MatchOk) and hit.hits == 2
    prefetch = p.Prefetch(id=7, ns=ns, tokens=toks)  # no L3: it leases its L2 hit
    _refused(_call(cache, b"a", "alpha", prefetch), "tenants.alpha.max_leases")
    for i in range(3):  # beta leases on: its share (32768) is its own
        _lease(cache, f"b{i}".encode(), "beta", 1000 * i)
    assert cache.leases.held == {"alpha": 2, "beta": 3}
    lease = min(cache.sessions[b"a"].leases)
    assert isinstance(_call(cache, b"a", "alpha", p.Release(id=7, lease=lease)), p.Ok)
    assert isinstance(_call(cache, b"a", "alpha", match), p.MatchOk)  # room again
    assert isinstance(_call(cache, b"a", "alpha", p.Goodbye(id=8)), p.Ok)
    assert cache.leases.held == {"alpha": 0, "beta": 3}


def _ns_of(cache: Cache, rid: bytes, peer: str, spec: p.NamespaceSpec) -> int:
    ok = _call(cache, rid, peer, p.RegisterNamespace(id=2, spec=spec))
    assert isinstance(ok, p.NamespaceOk), ok
    return ok.ns


def test_a_tenants_namespaces_past_its_share_drop_its_unused_one_or_are_refused() -> None:
    cache = _cache(alpha={"max_namespaces": 2}, beta={})
    assert isinstance(_hello(cache, b"old", "alpha"), p.HelloOk)
    old = _ns(cache, b"old", "alpha", "old")
    ok = _reserve(cache, b"old", "alpha", old, 1)
    assert isinstance(ok, p.ReserveOk)
    assert isinstance(_call(cache, b"old", "alpha", p.Commit(id=4, lease=ok.lease)), p.CommitOk)
    assert isinstance(_call(cache, b"old", "alpha", p.Goodbye(id=5)), p.Ok)
    assert cache.namespaces[old].pages == 2  # unused but for its pages: it lives on
    assert isinstance(_hello(cache, b"a", "alpha"), p.HelloOk)
    first = _ns(cache, b"a", "alpha", "first")
    for i in range(4):  # beta registers and its namespaces stay, whatever alpha does
        assert isinstance(_hello(cache, b"b", "beta"), p.HelloOk)
        _ns(cache, b"b", "beta", f"beta-{i}")
    second = _ns(cache, b"a", "alpha", "second")  # alpha's unused one makes way
    assert old not in cache.namespaces and {first, second} <= set(cache.namespaces)
    assert cache.l2.books["alpha"].pages == 0
    message = _refused(_register(cache, b"a", "alpha", "third"), "tenants.alpha.max_namespaces")
    assert message.startswith("tenant 'alpha' holds 2 namespaces, its limit")
    assert cache.names.held == {"alpha": 2, "beta": 4}
    assert (_tenant(cache, "alpha").namespaces, _tenant(cache, "beta").namespaces) == (2, 4)
    assert isinstance(_call(cache, b"a", "alpha", p.Goodbye(id=6)), p.Ok)  # both go
    assert cache.names.held == {"beta": 4}
    assert isinstance(_hello(cache, b"a", "alpha"), p.HelloOk)
    _ns(cache, b"a", "alpha", "third")


def test_a_reload_moves_the_shares() -> None:
    cache = _cache(clients=8, alpha={"max_clients": 1}, beta={})
    _lease(cache, b"a1", "alpha", 1)
    _refused(_hello(cache, b"a2", "alpha"), "tenants.alpha.max_clients")
    config = cache.config
    tenants = {
        **config.tenants,
        "alpha": msgspec.structs.replace(config.tenants["alpha"], max_clients=2),
    }
    cache.reconfigure(msgspec.structs.replace(config, tenants=tenants))
    assert isinstance(_hello(cache, b"a2", "alpha"), p.HelloOk)
    assert _tenant(cache, "beta").max_clients == 4
    server = msgspec.structs.replace(config.server, max_clients=16)
    cache.reconfigure(msgspec.structs.replace(cache.config, server=server))
    assert _tenant(cache, "beta").max_clients == 8  # an equal share follows its bound


@pytest.mark.parametrize("seed", range(3))
def test_the_counts_match_the_tables_under_random_work(seed: int) -> None:
    """Counted one step at each open and close, never by walking a table: after
    any mix of hellos, goodbyes, registrations, leases, releases, commits and
    expiries, each tenant's counts are what its sessions, leases and
    namespaces are, and within its share."""
    now = [0.0]
    config = Config(
        server=ServerConfig(max_clients=12, session_idle_s=50.0),
        leases=LeaseConfig(max_leases=20, ttl_s=5.0),
        pool=PoolConfig(size_mib=1, slab_mib=1, max_page_bytes=PAGE, max_namespaces=8),
        tenants={
            "a": TenantConfig(max_clients=5),
            "b": TenantConfig(max_leases=4),
            "c": TenantConfig(),
        },
    )
    cache = Cache(config, pool_path="x", clock=lambda: now[0])
    rng = random.Random(seed)
    peers = ["a", "b", "c", NOBODY]
    for _ in range(3000):
        peer = rng.choice(peers)
        rid = f"{peer}{rng.randrange(8)}".encode()
        op = rng.randrange(8)
        if op == 0:
            _hello(cache, rid, peer)
        elif op == 1:
            _call(cache, rid, peer, p.Goodbye(id=1))
        elif op in (2, 3):
            _register(cache, rid, peer, f"m{rng.randrange(4)}")
        elif op == 4 and rid in cache.sessions and cache.sessions[rid].namespaces:
            ns = rng.choice(sorted(cache.sessions[rid].namespaces))
            _reserve(cache, rid, peer, ns, rng.randrange(50))
        elif op == 5 and rid in cache.sessions and cache.sessions[rid].leases:
            lease = rng.choice(sorted(cache.sessions[rid].leases))
            _call(cache, rid, peer, rng.choice([p.Release, p.Commit])(id=1, lease=lease))
        elif op == 6:
            now[0] += rng.random() * 3
            cache.expire()
        shares = {s.share for s in cache.sessions.values()}
        counted = {
            share: sum(s.share == share for s in cache.sessions.values()) for share in shares
        }
        assert {k: v for k, v in cache.clients.held.items() if v} == counted
        leases: dict[str, int] = {}
        for lease in cache.leases:
            share = lease.session.share
            assert share is not None
            leases[share] = leases.get(share, 0) + 1
        assert {k: v for k, v in cache.leases.held.items() if v} == leases
        spaces: dict[str, int] = {}
        for ns in cache.namespaces.values():
            spaces[ns.book.name] = spaces.get(ns.book.name, 0) + 1
        assert cache.names.held == spaces
        for share, n in counted.items():
            bounds = cache.shares.of(share)
            assert bounds is not None and n <= bounds.clients
        for name, n in leases.items():
            assert n <= cache.shares.of(name).leases  # type: ignore[union-attr]
        for name, n in spaces.items():
            assert n <= cache.shares.of(name).namespaces  # type: ignore[union-attr]


# -- the config -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[tenants.a]\nmax_clients = 1025\n",
            "tenants.a.max_clients: 1025 is more than server.max_clients (1024)",
        ),
        (
            "[leases]\nmax_leases = 10\n[tenants.a]\nmax_leases = 11\n",
            "tenants.a.max_leases: 11 is more than leases.max_leases (10)",
        ),
        (
            "[tenants.a]\nmax_namespaces = 257\n",
            "tenants.a.max_namespaces: 257 is more than pool.max_namespaces (256)",
        ),
        ("[tenants.a]\nmax_clients = -1\n", "tenants.a.max_clients: must be 0 (an equal share)"),
        ("[tenants.a]\nmax_leases = -2\n", "tenants.a.max_leases: must be 0 (an equal share)"),
        ("[tenants.a]\nmax_namespaces = -3\n", "tenants.a.max_namespaces: must be 0"),
    ],
)
def test_bad_shares_name_their_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"^x\.toml: ") as info:
        parse_config(text, "x.toml")
    assert message in str(info.value)


def test_a_reload_takes_the_shares_and_refuses_one_past_its_bound() -> None:
    running = parse_config("[server]\nmax_clients = 8\n[tenants.a]\nuids = [1]\nmax_clients = 4\n")
    wanted = parse_config(
        "[server]\nmax_clients = 8\n[tenants.a]\nuids = [1]\nmax_clients = 6\n"
        "max_leases = 9\nmax_namespaces = 3\n"
    )
    config, applied, refused = reload_plan(running, wanted)
    assert applied == {
        "tenants.a.max_clients": 6,
        "tenants.a.max_leases": 9,
        "tenants.a.max_namespaces": 3,
    }
    assert refused == [] and config.tenants["a"].max_clients == 6


# -- the wire ---------------------------------------------------------------------------


class _TenantStats18(msgspec.Struct, kw_only=True):
    """stats.tenant as a 1.8 client decodes it."""

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


def test_older_clients_decode_the_figures_and_an_older_daemons_read_as_none() -> None:
    from hicached.cli import _tenant_line

    cache = _cache(clients=8, alpha={}, beta={})
    _lease(cache, b"a", "alpha", 1)
    figures = cache.stats("alpha").tenant
    assert figures is not None
    assert (figures.clients, figures.leases, figures.namespaces) == (1, 1, 1)
    assert (figures.max_clients, figures.max_leases, figures.max_namespaces) == (4, 32768, 128)
    wire = msgspec.msgpack.encode(figures)
    old = msgspec.msgpack.decode(wire, type=_TenantStats18)  # the new fields are ignored
    assert old.tenant == "alpha" and old.slots == 2
    from_old = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=p.TenantStats)
    assert (from_old.clients, from_old.max_clients) == (0, 0)
    assert _tenant_line(figures).endswith("; clients 1/4 leases 1/32768 namespaces 1/128")
    assert _tenant_line(from_old).endswith("(0 for its quota)")  # an older daemon's: no shares
    assert p.PROTOCOL_MINOR >= p.TENANT_BOUNDS_MINOR == 9


class HeldReads:
    """An L3 port whose prefetch reads run until the test moves them on, one
    step at a time, as daemon/tier.py's task would: the store is asked, its
    pages are read in batches, and the reader finishes (after a read that
    failed, a store that could not tell, or a stop alike)."""

    down = False  # the store is up

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.reading: dict[int, Lease] = {}  # by id(lease): prefetches whose reader runs
        self.slots: dict[int, int] = {}  # by id(lease): pages planned and not yet read

    def write(self, ns: object, key: bytes, slot: int, done: object) -> bool:
        return False  # nothing reaches L3 here

    def prefetch(self, lease: Lease) -> None:
        self.reading[id(lease)] = lease

    def lookup(self, ns: bytes, keys: list[bytes], answer: Callable[[int], None]) -> None:
        answer(0)

    def step(self, rng: random.Random) -> None:
        """Move one running reader on by one step."""
        if not self.reading:
            return
        key = rng.choice(sorted(self.reading))
        lease, cache = self.reading[key], self.cache
        pf = lease.prefetch
        assert pf is not None
        if key not in self.slots:  # the store is asked what it holds
            cache.prefetch_started(lease)
            available = rng.choice([None, 0, 1, 2, 3])
            self.slots[key] = len(cache.prefetch_planned(lease, available))
        elif self.slots[key] and not pf.ended and rng.random() < 0.7:
            n = min(self.slots[key], rng.choice([1, 2]))
            self.slots[key] -= n
            if not cache.prefetch_progress(lease, [rng.random() < 0.9 for _ in range(n)]):
                self.slots[key] = 0
        else:  # done, failed (the store raised, timed out) or stopped: the reader ends
            if self.slots[key] and rng.random() < 0.5:
                pf.failed = True
            self.finish(key)

    def finish(self, key: int) -> None:
        self.slots.pop(key, None)
        self.cache.prefetch_finished(self.reading.pop(key))

    def stop(self) -> None:
        """The daemon stops: every reader ends, wherever it was."""
        for key in sorted(self.reading):
            self.finish(key)


def _recount(cache: Cache, reads: HeldReads | None = None) -> None:
    """Each share's counts are what its sessions, leases and namespaces are,
    a prefetch lease that ended while its reader runs among its leases."""
    counted: dict[str, int] = {}
    for s in cache.sessions.values():
        assert s.share is not None
        counted[s.share] = counted.get(s.share, 0) + 1
    assert {k: v for k, v in cache.clients.held.items() if v} == counted
    assert all(v >= 0 for v in cache.clients.held.values())
    leases: dict[str, int] = {}
    for lease in cache.leases:
        share = lease.session.share
        assert share is not None
        leases[share] = leases.get(share, 0) + 1
    ended = 0
    for lease in reads.reading.values() if reads is not None else ():
        assert lease.prefetch is not None and lease.prefetch.running
        if lease.prefetch.ended:  # out of the table, still counted
            assert cache.leases.get(lease.id) is not lease
            share = lease.session.share
            assert share is not None
            leases[share] = leases.get(share, 0) + 1
            ended += 1
        else:
            assert cache.leases.get(lease.id) is lease
    assert cache.leases.reading == ended
    assert cache.leases.open == len(cache.leases) + ended
    assert {k: v for k, v in cache.leases.held.items() if v} == leases
    assert all(v >= 0 for v in cache.leases.held.values())
    spaces: dict[str, int] = {}
    for ns in cache.namespaces.values():
        spaces[ns.book.name] = spaces.get(ns.book.name, 0) + 1
        assert not ns.unused, f"namespace {ns.id} is unused yet counted live"
    assert cache.names.held == spaces


@pytest.mark.parametrize("l3", [False, True], ids=["l2", "l3"])
@pytest.mark.parametrize("seed", range(3))
def test_the_counts_match_the_tables_under_every_kind_of_lease(seed: int, l3: bool) -> None:
    """The paths the mix above lacks: key-addressed namespaces (reserve_keys,
    a commit with a mask, match_keys), leased matches, prefetches (with no
    L3: their L2 part), renewals, a hello from a routing id another peer
    holds, a goodbye of the wrong peer, undelivered replies, evictions for a
    full pool, and reloads that move the shares under held counts. With
    ``l3``, prefetches read from a store whose reads run until the test
    moves them on: leases released, committed, expired, undelivered or of
    sessions gone while their reads run count until the reader ends (after
    its reads, a failed one, or at a stop); at the end, with every session
    gone and every reader ended, nothing is counted."""
    now = [0.0]
    config = Config(
        server=ServerConfig(max_clients=12, session_idle_s=50.0),
        leases=LeaseConfig(max_leases=20, ttl_s=5.0, quarantine_s=1.0),
        pool=PoolConfig(size_mib=1, slab_mib=1, max_page_bytes=PAGE, max_namespaces=8),
        tenants={
            "a": TenantConfig(max_clients=5),
            "b": TenantConfig(max_leases=4),
            "c": TenantConfig(),
        },
    )
    cache = Cache(config, pool_path="x", clock=lambda: now[0])
    reads = HeldReads(cache) if l3 else None
    if reads is not None:
        cache.use_tier(reads)
    rng = random.Random(seed)
    peers = ["a", "b", "c", NOBODY]
    keyed = msgspec.structs.replace(SPEC, key_scheme="vllm-sha256")

    def keys(n: int) -> list[bytes]:
        first = rng.randrange(40)
        return [(first + i).to_bytes(32, "little") for i in range(n)]

    kept = 0  # the most leases counted at once after they ended, while their reads ran
    for _ in range(4000):
        peer = rng.choice(peers)
        owner = peer if rng.random() < 0.9 else rng.choice(peers)  # at times another's id
        rid = f"{owner}{rng.randrange(6)}".encode()
        session = cache.sessions.get(rid)
        spaces = sorted(session.namespaces) if session is not None else []
        held = sorted(session.leases) if session is not None else []
        op = rng.choices(range(15), [2, 0.5, 1, 1, 3, 3, 2, 2, 3, 3, 1, 1, 0.5, 4, 0.05])[0]
        if op == 0:
            _hello(cache, rid, peer)
        elif op == 1:
            _call(cache, rid, peer, p.Goodbye(id=1))
        elif op == 2:
            _register(cache, rid, peer, f"m{rng.randrange(3)}")
        elif op == 3:
            spec = msgspec.structs.replace(keyed, model=f"k{rng.randrange(3)}")
            _call(cache, rid, peer, p.RegisterNamespace(id=2, spec=spec))
        elif op in (4, 5) and spaces:
            ns = rng.choice(spaces)
            if cache.namespaces[ns].spec.keyed:
                _call(cache, rid, peer, p.ReserveKeys(id=3, ns=ns, keys=keys(3)))
            else:
                _reserve(cache, rid, peer, ns, rng.randrange(40))
        elif op == 6 and spaces:
            ns = rng.choice(spaces)
            if cache.namespaces[ns].spec.keyed:
                _call(cache, rid, peer, p.MatchKeys(id=4, ns=ns, keys=keys(3)))
            else:
                tokens = pack_tokens(list(range(rng.randrange(40), 45)))
                _call(cache, rid, peer, p.Match(id=4, ns=ns, tokens=tokens))
        elif op == 7 and spaces:
            ns = rng.choice(spaces)
            if cache.namespaces[ns].spec.keyed:
                _call(cache, rid, peer, p.PrefetchKeys(id=5, ns=ns, keys=keys(3)))
            else:
                tokens = pack_tokens(list(range(rng.randrange(40), 45)))
                _call(cache, rid, peer, p.Prefetch(id=5, ns=ns, tokens=tokens))
        elif op in (8, 9) and held:
            lease = rng.choice(held)
            mask = bytes(rng.randrange(2) for _ in range(3))
            msg = rng.choice(
                [
                    p.Release(id=1, lease=lease),
                    p.Commit(id=1, lease=lease),
                    p.Commit(id=1, lease=lease, pages=1),
                    p.Commit(id=1, lease=lease, mask=mask),
                    p.Renew(id=1, lease=lease),
                ]
            )
            _call(cache, rid, peer, msg)
        elif op == 10:
            now[0] += rng.random() * 3
            cache.expire()
        elif op == 11:
            tenants = {
                name: msgspec.structs.replace(
                    t,
                    max_clients=rng.choice([0, 1, 3, 6]),
                    max_leases=rng.choice([0, 1, 4, 9]),
                    max_namespaces=rng.choice([0, 1, 2, 5]),
                )
                for name, t in cache.config.tenants.items()
            }
            cache.reconfigure(msgspec.structs.replace(cache.config, tenants=tenants))
        elif op == 12 and held:
            cache.undelivered(rid, p.ReserveOk(id=1, lease=rng.choice(held), present=0, offsets=[]))
        elif op == 13 and reads is not None:
            reads.step(rng)
        elif op == 14 and reads is not None:
            reads.stop()
        _recount(cache, reads)
        kept = max(kept, cache.leases.reading)
    assert cache.leases.held and cache.names.held  # the mix reached them
    if reads is None:
        return
    assert kept  # and leases ended while their reads ran
    for rid, session in list(cache.sessions.items()):
        _call(cache, rid, session.peer, p.Goodbye(id=1))
    _recount(cache, reads)
    reads.stop()
    _recount(cache, reads)
    assert (cache.leases.open, cache.leases.reading) == (0, 0)
    assert not any(cache.leases.held.values())


def test_a_prefetch_ended_while_it_reads_counts_until_its_reader_ends() -> None:
    """Released, expired, or its session gone while the store reads its pages,
    a prefetch lease counts against its tenant's share and leases.max_leases
    until its reader ends (its reads returned, failed, or the daemon
    stopped): past either a lease is refused meanwhile, as ever naming the
    key; then the count drops."""
    now = [0.0]
    config = Config(
        leases=LeaseConfig(max_leases=3, ttl_s=5.0),
        pool=PoolConfig(size_mib=1, slab_mib=1, max_page_bytes=PAGE),
        tenants={"alpha": TenantConfig(max_leases=2), "beta": TenantConfig()},
    )
    cache = Cache(config, pool_path="x", clock=lambda: now[0])
    reads = HeldReads(cache)
    cache.use_tier(reads)
    assert isinstance(_hello(cache, b"a", "alpha"), p.HelloOk)
    ns = _ns(cache, b"a", "alpha")
    fetches = []
    for first in (100, 200):
        ok = _call(cache, b"a", "alpha", p.Prefetch(id=5, ns=ns, tokens=pack_tokens([first])))
        assert isinstance(ok, p.PrefetchOk) and ok.lease, ok
        fetches.append(ok.lease)
    reader = {lease.id: key for key, lease in reads.reading.items()}
    assert isinstance(_call(cache, b"a", "alpha", p.Release(id=6, lease=fetches[0])), p.Ok)
    now[0] += 6.0
    assert cache.expire() == 1  # the second, at its deadline
    assert (len(cache.leases), cache.leases.reading, cache.leases.open) == (0, 2, 2)
    assert _tenant(cache, "alpha").leases == 2  # what it holds: both reads run
    message = _refused(_reserve(cache, b"a", "alpha", ns, 300), "tenants.alpha.max_leases")
    assert message.startswith("tenant 'alpha' holds 2 leases, its limit")
    beta = _lease(cache, b"b", "beta", 1000)  # beta's share (2) is its own...
    assert beta
    message = _refused(_reserve(cache, b"b", "beta", _ns(cache, b"b", "beta"), 2000), "max_leases")
    assert "leases.max_leases = 3" in message  # ...within the daemon's bound, alpha's reads in it
    reads.finish(reader[fetches[0]])  # the first one's reads returned
    assert _tenant(cache, "alpha").leases == 1 and cache.leases.open == 2
    assert isinstance(_reserve(cache, b"a", "alpha", ns, 300), p.ReserveOk)
    assert isinstance(_call(cache, b"a", "alpha", p.Goodbye(id=8)), p.Ok)
    assert _tenant(cache, "alpha").leases == 1  # the reservation went with the session
    reads.stop()  # the daemon stops: the last reader ends
    assert cache.leases.held == {"alpha": 0, "beta": 1} and cache.leases.open == 1
    assert cache.leases.reading == 0


def test_a_share_of_namespaces_lowered_under_what_is_held_drops_as_many_unused_as_it_takes() -> (
    None
):
    """A reload lowered alpha's share of namespaces below the unused ones it
    holds (kept for their pages): each registration dropped one unused
    namespace, its pages gone, and was refused all the same, until as many
    registrations as the tenant was over had each lost pages for nothing.
    Now one registration drops as many unused ones as it takes."""
    cache = _cache(alpha={"max_namespaces": 4}, beta={})
    assert isinstance(_hello(cache, b"old", "alpha"), p.HelloOk)
    for i in range(4):
        ns = _ns(cache, b"old", "alpha", f"old-{i}")
        ok = _reserve(cache, b"old", "alpha", ns, 10 * i)
        assert isinstance(ok, p.ReserveOk)
        assert isinstance(_call(cache, b"old", "alpha", p.Commit(id=4, lease=ok.lease)), p.CommitOk)
    assert isinstance(_call(cache, b"old", "alpha", p.Goodbye(id=5)), p.Ok)
    assert cache.names.held["alpha"] == 4 and cache.l2.books["alpha"].pages == 8
    tenants = dict(cache.config.tenants)
    tenants["alpha"] = msgspec.structs.replace(tenants["alpha"], max_namespaces=2)
    cache.reconfigure(msgspec.structs.replace(cache.config, tenants=tenants))
    assert isinstance(_hello(cache, b"a", "alpha"), p.HelloOk)
    assert isinstance(_register(cache, b"a", "alpha", "new"), p.NamespaceOk)
    assert cache.names.held["alpha"] == 2  # the oldest three made way, one unused is kept
    assert cache.l2.books["alpha"].pages == 2
    # the daemon-wide bound alike, tenants off
    cache = _cache(namespaces=4)
    assert isinstance(_hello(cache, b"old", None), p.HelloOk)
    for i in range(4):
        ns = _ns(cache, b"old", None, f"old-{i}")  # type: ignore[arg-type]
        ok = _reserve(cache, b"old", None, ns, 10 * i)  # type: ignore[arg-type]
        assert isinstance(ok, p.ReserveOk)
        assert isinstance(_call(cache, b"old", None, p.Commit(id=4, lease=ok.lease)), p.CommitOk)
    assert isinstance(_call(cache, b"old", None, p.Goodbye(id=5)), p.Ok)
    pool = msgspec.structs.replace(cache.config.pool, max_namespaces=2)
    cache.reconfigure(msgspec.structs.replace(cache.config, pool=pool))
    assert isinstance(_hello(cache, b"a", None), p.HelloOk)
    assert isinstance(_register(cache, b"a", None, "new"), p.NamespaceOk)  # type: ignore[arg-type]
    assert len(cache.namespaces) == 2


def test_a_refusal_at_a_daemon_wide_bound_tells_a_tenant_no_other_tenants_counts() -> None:
    """The daemon's tables (sessions, leases, namespaces) hold every tenant's;
    their counts are the others' activity, which a tenant's stats no longer
    show. A refusal at a daemon-wide bound said the count all the same ("9
    clients are connected"), past the bound after a reload lowered it. Now it
    names the bound, as the config sets it, and no count; without tenants
    the count stays."""
    mine = {"max_clients": 100, "max_leases": 100, "max_namespaces": 100}
    cache = _cache(alpha=mine, beta=mine, gamma=mine)
    assert isinstance(_hello(cache, b"a", "alpha"), p.HelloOk)
    ns = _ns(cache, b"a", "alpha", "alpha")
    _lease(cache, b"a2", "alpha", 1000)
    for i in range(7):  # beta: 7 sessions, each with a namespace of its own and a lease
        rid = b"b%d" % i
        assert isinstance(_hello(cache, rid, "beta"), p.HelloOk)
        assert isinstance(
            _reserve(cache, rid, "beta", _ns(cache, rid, "beta", f"b{i}"), i), p.ReserveOk
        )
    assert (len(cache.sessions), len(cache.leases), len(cache.namespaces)) == (9, 8, 9)
    # a reload lowers every daemon-wide bound below what is held (and the
    # tenants' shares to fit; alpha's and gamma's are still above what they hold)
    config = cache.config
    four = {"max_clients": 4, "max_leases": 4, "max_namespaces": 4}
    cache.reconfigure(
        msgspec.structs.replace(
            config,
            tenants={k: msgspec.structs.replace(t, **four) for k, t in config.tenants.items()},
            server=msgspec.structs.replace(config.server, max_clients=4),
            leases=msgspec.structs.replace(config.leases, max_leases=4),
            pool=msgspec.structs.replace(config.pool, max_namespaces=4),
        )
    )
    refusals = [
        _refused(_register(cache, b"a", "alpha", "another"), "pool.max_namespaces = 4"),
        _refused(_reserve(cache, b"a", "alpha", ns, 500), "leases.max_leases = 4"),
        _refused(_hello(cache, b"g", "gamma"), "server.max_clients = 4"),
    ]
    for message in refusals:
        assert not any(str(n) in message for n in (8, 9)), message
        assert "every tenant's together" in message, message
    # without tenants, the count (all the operator's) stays in the message
    cache = _cache(leases=1)
    _lease(cache, b"x", None, 1)  # type: ignore[arg-type]
    refused = _reserve(cache, b"x", None, _ns(cache, b"x", None), 50)  # type: ignore[arg-type]
    assert "1 leases are open, the limit" in _refused(refused, "leases.max_leases = 1")


def test_a_tenants_lease_ids_say_nothing_of_the_leases_others_opened_between() -> None:
    """Lease ids counted up from a random start: alpha's client, taking a lease
    before and after, read from the gap how many leases every other tenant
    opened between (the activity its stats keep from it). Now each id is
    random: the gap is no count."""
    cache = _cache(alpha={}, beta={})
    first = _lease(cache, b"a1", "alpha", 0)
    for i in range(5):  # beta's activity between alpha's two leases
        _lease(cache, b"b%d" % i, "beta", 10 * (i + 1))
    second = _lease(cache, b"a2", "alpha", 100)
    assert second - first != 6, (first, second)
    assert len({first, second, *(lease.id for lease in cache.leases)}) == 7  # unique all the same


def test_a_tenants_session_ids_say_nothing_of_the_clients_others_opened() -> None:
    """Session ids counted up from 1: the id alpha's client got at hello said
    how many clients every tenant had opened since the start, and the gap
    between two how many between. Now each is random, unique among the live
    sessions; the gather reports keep the sessions' order of coming."""
    cache = _cache(alpha={}, beta={})
    first = _hello(cache, b"a1", "alpha")
    for i in range(5):  # beta's clients between alpha's two
        assert isinstance(_hello(cache, b"b%d" % i, "beta"), p.HelloOk)
    second = _hello(cache, b"a2", "alpha")
    assert isinstance(first, p.HelloOk) and isinstance(second, p.HelloOk)
    assert (first.session, second.session) != (1, 7), (first.session, second.session)
    assert len({s.id for s in cache.sessions.values()}) == 7 == len(cache.clients.ids)
    report = p.GatherReport(id=9, how="no_torch", read="numpy", write="numpy")
    for rid in (b"a2", b"a1"):
        assert isinstance(_call(cache, rid, "alpha", report), p.Ok)
    shown = [c.session for c in cache.stats("alpha").gather_clients]
    assert shown == [first.session, second.session]  # the order they came in
    assert isinstance(_call(cache, b"a1", "alpha", p.Goodbye(id=10)), p.Ok)
    assert first.session not in cache.clients.ids


def test_a_tenants_namespace_ids_say_nothing_of_the_namespaces_others_registered() -> None:
    """Namespace ids counted up from a random start: alpha's client, registering
    a namespace before and after, read from the gap how many namespaces every
    other tenant registered between (the activity its stats keep from it). Now
    each id is random, 1 to 2**63 - 1: the gap is no count."""
    cache = _cache(alpha={}, beta={})
    assert isinstance(_hello(cache, b"a", "alpha"), p.HelloOk)
    assert isinstance(_hello(cache, b"b", "beta"), p.HelloOk)
    first = _ns(cache, b"a", "alpha", "first")
    for i in range(5):  # beta's namespaces between alpha's two
        _ns(cache, b"b", "beta", f"beta-{i}")
    second = _ns(cache, b"a", "alpha", "second")
    # counted up, the gap was 6; two random ids are this close once in 2**30
    assert abs(second - first) >= 1 << 32, (first, second)
    ids = list(cache.namespaces)
    assert len(set(ids)) == 7 and {first, second} <= set(ids)  # unique all the same
    assert all(0 < ns < 1 << 63 for ns in ids), ids  # a positive msgpack int64; never 0


def test_the_oldest_unused_namespace_makes_way_first_whatever_its_id() -> None:
    """A full table drops the namespaces no client has registered in the order
    they came, not in their ids' order (random now)."""
    cache = _cache(namespaces=6)
    assert isinstance(_hello(cache, b"old", None), p.HelloOk)
    came = []
    for i in range(6):
        ns = _ns(cache, b"old", None, f"old-{i}")  # type: ignore[arg-type]
        ok = _reserve(cache, b"old", None, ns, 10 * i)  # type: ignore[arg-type]
        assert isinstance(ok, p.ReserveOk)
        assert isinstance(_call(cache, b"old", None, p.Commit(id=4, lease=ok.lease)), p.CommitOk)
        came.append(ns)
    assert isinstance(_call(cache, b"old", None, p.Goodbye(id=5)), p.Ok)
    assert isinstance(_hello(cache, b"new", None), p.HelloOk)
    for i in range(6):
        _ns(cache, b"new", None, f"new-{i}")  # type: ignore[arg-type]
        assert [ns for ns in came if ns in cache.namespaces] == came[i + 1 :], (i, came)
