"""Tenants that are boundaries: a connection's tenant comes from who it is (its
uid over ipc, its CURVE key over tcp), never from what it says; a tenant's quota
evicts its own pages only.

The exact-order tests run on the daemon's state in-process. The real-uid tests
run client processes as other users (``subprocess.Popen(user=, group=)``), so
they need root: they create users with useradd (removed afterwards) and are
skipped, saying why, elsewhere.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from hicached import Client, CurveKeys
from hicached import protocol as p
from hicached.cache import Cache
from hicached.config import Config, PoolConfig, TenantConfig, parse_config
from hicached.daemon.arenas import check_memberships
from hicached.errors import (
    ConfigError,
    DaemonUnavailable,
    DeadlineExceeded,
    ForeignTenant,
    HicachedError,
)
from hicached.hashing import pack_tokens
from hicached.namespace import NamespaceSpec, namespace_digest
from hicached.tenants import Memberships, TenantMap, listed_members, user_groups
from hicached.testing import scrape
from tests.support import NS, PAGE_TOKENS, Daemon, metrics_token, page_bytes_for
from tests.test_client_group import as_user

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4096
SPEC = p.NamespaceSpec(model="m", kv_dtype="bf16", layout="l", page_tokens=1, page_bytes=PAGE)
HELLO = p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)


# -- on the daemon's state ------------------------------------------------------------


def _cache(**tenants: TenantConfig) -> Cache:
    config = Config(pool=PoolConfig(size_mib=1, slab_mib=1, max_page_bytes=PAGE), tenants=tenants)
    return Cache(config, pool_path="x")


def _call(cache: Cache, rid: bytes, peer: str | None, request: p.Request) -> p.AnyReply:
    return cache.handle(rid, p.request_decoder.decode(p.encode(request)), peer)


def _register(cache: Cache, rid: bytes, peer: str | None, spec: NamespaceSpec = SPEC) -> int:
    assert isinstance(_call(cache, rid, peer, HELLO), p.HelloOk)
    ok = _call(cache, rid, peer, p.RegisterNamespace(id=2, spec=spec))
    assert isinstance(ok, p.NamespaceOk), ok
    return ok.ns


def _store(cache: Cache, rid: bytes, peer: str, ns: int, tokens: list[int]) -> int:
    res = _call(cache, rid, peer, p.Reserve(id=3, ns=ns, tokens=pack_tokens(tokens)))
    assert isinstance(res, p.ReserveOk)
    ok = _call(cache, rid, peer, p.Commit(id=4, lease=res.lease))
    assert isinstance(ok, p.CommitOk)
    return ok.published


def _hits(cache: Cache, rid: bytes, peer: str, ns: int, tokens: list[int]) -> int:
    ok = _call(cache, rid, peer, p.Match(id=5, ns=ns, tokens=pack_tokens(tokens), lease=False))
    assert isinstance(ok, p.MatchOk)
    return ok.hits


def test_a_namespace_takes_the_connections_tenant_and_another_is_refused() -> None:
    cache = _cache(alpha=TenantConfig(), beta=TenantConfig())
    ns = _register(cache, b"a", "alpha")  # tenant left at its default: filled in
    assert cache.namespaces[ns].digest == namespace_digest(
        msgspec.structs.replace(SPEC, tenant="alpha")
    )
    own = msgspec.structs.replace(SPEC, tenant="alpha")
    assert _call(cache, b"a", "alpha", p.RegisterNamespace(id=3, spec=own)) == p.NamespaceOk(
        id=3, ns=ns, digest=cache.namespaces[ns].digest
    )
    other = msgspec.structs.replace(SPEC, tenant="beta")
    refused = _call(cache, b"a", "alpha", p.RegisterNamespace(id=4, spec=other))
    assert isinstance(refused, p.Error) and refused.code == ForeignTenant.code
    assert "belongs to tenant 'alpha'" in refused.message
    # a peer no tenant lists: status, but no namespace
    probe = _call(cache, b"n", "!uid 7, gid 7, pid 1", p.Stats(id=1))  # no session needed
    assert isinstance(probe, p.StatsOk) and b"n" not in cache.sessions
    _call(cache, b"n", "!uid 7, gid 7, pid 1", HELLO)
    assert isinstance(_call(cache, b"n", "!uid 7, gid 7, pid 1", p.Stats(id=2)), p.StatsOk)
    nobody = _call(cache, b"n", "!uid 7, gid 7, pid 1", p.RegisterNamespace(id=3, spec=SPEC))
    assert isinstance(nobody, p.Error) and nobody.code == ForeignTenant.code
    assert "uid 7, gid 7" in nobody.message and "belongs to no tenant" in nobody.message
    # another peer that takes over alpha's routing id is not served as alpha
    stolen = _call(cache, b"a", "beta", p.Match(id=6, ns=ns, tokens=pack_tokens([1])))
    assert isinstance(stolen, p.Error) and stolen.code == ForeignTenant.code
    assert cache.sessions[b"a"].peer == "alpha"
    assert cache.errors["foreign_tenant"] == 3


def test_status_names_a_tenant_only_its_own_clients() -> None:
    """A gather report names its client and pid (``hicached status``): with
    tenants on, a peer's stats list its own tenant's sessions only, whether it
    asks with a session or as a probe; a peer no tenant lists sees none; the
    counts stay daemon-wide, and without tenants every report is listed."""
    report = p.GatherReport(
        id=9,
        how="measured",
        read="numpy",
        write="numpy",
        read_numpy_gbps=1.0,
        read_torch_gbps=1.0,
        write_numpy_gbps=1.0,
        write_torch_gbps=1.0,
        page_bytes=PAGE,
        sample_pages=8,
        rounds=1,
        seconds=0.01,
    )

    def listed(cache: Cache, rid: bytes, peer: str | None) -> set[str]:
        ok = _call(cache, rid, peer, p.Stats(id=1))
        assert isinstance(ok, p.StatsOk)
        return {c.client for c in ok.stats.gather_clients}

    for tenants in (True, False):
        cache = _cache(alpha=TenantConfig(), beta=TenantConfig()) if tenants else _cache()
        peers = {b"a1": "alpha", b"a2": "alpha", b"b1": "beta"}
        for rid, peer in peers.items():
            hello = msgspec.structs.replace(HELLO, client=f"engine-{peer}-{rid.decode()}")
            assert isinstance(_call(cache, rid, peer if tenants else None, hello), p.HelloOk)
            ok = _call(cache, rid, peer if tenants else None, report)
            assert not isinstance(ok, p.Error), ok
        everyone = {"engine-alpha-a1", "engine-alpha-a2", "engine-beta-b1"}
        if not tenants:
            assert listed(cache, b"a1", None) == listed(cache, b"x", None) == everyone
            assert cache.stats(None).tenant is None
            continue
        # its own tenant's figures, never another's; none for a peer of no tenant
        for peer in ("alpha", "beta"):
            own = cache.stats(peer).tenant
            assert own is not None and own.tenant == peer
        assert cache.stats("!uid 7, gid 7, pid 1").tenant is None
        assert cache.stats().tenant is None  # the metrics' snapshot: tenants are its labels
        assert listed(cache, b"a1", "alpha") == {"engine-alpha-a1", "engine-alpha-a2"}
        assert listed(cache, b"b1", "beta") == {"engine-beta-b1"}
        assert listed(cache, b"probe", "beta") == {"engine-beta-b1"}  # without a session
        assert listed(cache, b"n", "!uid 7, gid 7, pid 1") == set()
        ok = _call(cache, b"b1", "beta", p.Stats(id=1))  # a tenant's peer: no totals
        assert isinstance(ok, p.StatsOk) and ok.stats.scope == "tenant"
        assert ok.stats.clients == 0 and ok.stats.requests == {} and ok.stats.pages == 0
        assert ok.stats.tenant is not None and ok.stats.tenant.clients == 1
        ok = cache.handle(b"b1", p.Stats(id=2), "beta", operator=True)  # root, the daemon's user
        assert isinstance(ok, p.StatsOk) and ok.stats.scope == "daemon" and ok.stats.clients == 3
        ok = _call(cache, b"n", "!uid 7, gid 7, pid 1", p.Stats(id=3))  # a peer of no tenant
        assert isinstance(ok, p.StatsOk) and ok.stats.scope == "daemon" and ok.stats.clients == 3
        assert {c.client for c in cache.stats().gather_clients} == everyone  # the metrics'


def test_without_tenants_a_namespace_names_its_own_tenant() -> None:
    cache = _cache()
    spec = msgspec.structs.replace(SPEC, tenant="anything")
    ns = _register(cache, b"a", None, spec)
    assert cache.namespaces[ns].digest == namespace_digest(spec)
    assert cache.namespaces[ns].book.name == "default"


def test_a_quota_evicts_the_tenants_own_lru_pages_never_a_leased_one() -> None:
    cache = _cache(alpha=TenantConfig(max_pages=6), beta=TenantConfig(max_pages=4))
    a, b = _register(cache, b"a", "alpha"), _register(cache, b"b", "beta")
    assert _store(cache, b"b", "beta", b, [1, 2, 3, 4]) == 4  # beta at its quota
    assert _store(cache, b"a", "alpha", a, [1, 2, 3]) == 3
    assert _store(cache, b"a", "alpha", a, [7, 8, 9]) == 3  # alpha at its quota
    leased = _call(cache, b"a", "alpha", p.Match(id=9, ns=a, tokens=pack_tokens([1, 2, 3])))
    assert isinstance(leased, p.MatchOk) and leased.lease
    _hits(cache, b"a", "alpha", a, [7, 8, 9])  # [1,2,3] is older, but leased
    assert _store(cache, b"a", "alpha", a, [5, 6]) == 2  # past its quota: [8, 9] make way
    assert _hits(cache, b"a", "alpha", a, [1, 2, 3]) == 3
    assert _hits(cache, b"a", "alpha", a, [7, 8, 9]) == 1
    assert _hits(cache, b"a", "alpha", a, [5, 6]) == 2
    assert _hits(cache, b"b", "beta", b, [1, 2, 3, 4]) == 4  # beta untouched
    # only leased pages left to give: alpha gets what fits, and the pool has room
    leased2 = _call(cache, b"a", "alpha", p.Match(id=10, ns=a, tokens=pack_tokens([5, 6])))
    leased3 = _call(cache, b"a", "alpha", p.Match(id=11, ns=a, tokens=pack_tokens([7])))
    assert isinstance(leased2, p.MatchOk) and isinstance(leased3, p.MatchOk)
    res = _call(cache, b"a", "alpha", p.Reserve(id=12, ns=a, tokens=pack_tokens([20, 21])))
    assert isinstance(res, p.ReserveOk) and res.pool_full and not res.offsets
    figures = {f.tenant: f for f in cache.tenant_figures()}
    assert (figures["alpha"].slots, figures["alpha"].quota_evicted) == (6, 2)
    assert (figures["beta"].slots, figures["beta"].evicted) == (4, 0)
    assert figures["alpha"].bytes == 6 * PAGE


def test_a_quota_in_mib_and_one_lowered_at_run_time() -> None:
    cache = _cache(alpha=TenantConfig(max_mib=1), beta=TenantConfig())  # 256 pages, the pool
    a, b = _register(cache, b"a", "alpha"), _register(cache, b"b", "beta")
    for i in range(70):  # 280 pages: past 256, alpha's oldest make way
        assert _store(cache, b"a", "alpha", a, [1000 * i + j for j in range(4)]) == 4
    alpha, beta = cache.l2.book("alpha"), cache.l2.book("beta")
    assert (alpha.pages, alpha.quota_evicted) == (256, 24)
    assert _hits(cache, b"a", "alpha", a, [0, 1, 2, 3]) == 0
    # a full pool (not a quota) is shared by recency: beta, with no quota, takes
    # alpha's least recently used pages; quotas that add up to the pool prevent it
    assert _store(cache, b"b", "beta", b, list(range(50))) == 50
    assert (alpha.pages, alpha.quota_evicted, alpha.evicted) == (206, 24, 74)
    lowered = Config(
        pool=cache.config.pool,
        tenants={"alpha": TenantConfig(max_pages=10), "beta": TenantConfig()},
    )
    assert cache.reconfigure(lowered) == {"alpha": 196}
    assert (alpha.pages, alpha.slots, beta.pages) == (10, 10, 50)
    assert _hits(cache, b"a", "alpha", a, [69000 + j for j in range(4)]) == 4  # the newest
    assert _hits(cache, b"a", "alpha", a, [67000 + j for j in range(4)]) == 2
    assert _hits(cache, b"b", "beta", b, list(range(50))) == 50


@pytest.mark.parametrize("seed", range(4))
def test_the_books_balance_and_quotas_hold_under_random_work(seed: int) -> None:
    """Two tenants whose quotas add up to less than the pool: every slot is
    charged to one tenant, no tenant passes its quota, and no page is ever
    evicted but by its own tenant's quota."""
    quotas = {"alpha": 100, "beta": 120}  # pages; the pool holds 256
    cache = _cache(**{t: TenantConfig(max_pages=n) for t, n in quotas.items()})
    rng = np.random.default_rng(seed)
    ns = {t: _register(cache, t.encode(), t) for t in quotas}
    leases: dict[str, list[int]] = {t: [] for t in quotas}
    for _ in range(1500):
        t = str(rng.choice(list(quotas)))
        rid, what = t.encode(), rng.random()
        tokens = pack_tokens([int(x) for x in rng.integers(0, 6, int(rng.integers(1, 12)))])
        if what < 0.5:
            res = _call(cache, rid, t, p.Reserve(id=1, ns=ns[t], tokens=tokens))
            assert isinstance(res, p.ReserveOk)
            if res.lease and rng.random() < 0.8:
                ok = _call(cache, rid, t, p.Commit(id=2, lease=res.lease, pages=len(res.offsets)))
                assert isinstance(ok, p.CommitOk)
            elif res.lease:
                leases[t].append(res.lease)
        elif what < 0.8:
            hit = _call(cache, rid, t, p.Match(id=3, ns=ns[t], tokens=tokens))
            assert isinstance(hit, p.MatchOk)
            if hit.lease:
                leases[t].append(hit.lease)
        elif leases[t]:
            lease = leases[t].pop(int(rng.integers(len(leases[t]))))
            assert isinstance(_call(cache, rid, t, p.Release(id=4, lease=lease)), p.Ok)
        books = [cache.l2.book(t) for t in quotas]
        assert sum(b.slots for b in books) == len(cache.pool.allocated)
        assert sum(b.bytes for b in books) == cache.pool.used_bytes
        for b in books:
            fresh = sum(len(x.fresh) for x in cache.leases if x.ns.book is b)
            held = sum(1 for _, slot, _ in cache.l2._quarantine if cache.l2.holder(slot) is b)
            assert b.slots == b.pages + fresh + held <= quotas[b.name]
            assert b.evicted == b.quota_evicted  # only its own quota evicts its pages
    assert all(cache.l2.book(t).quota_evicted for t in quotas)


def test_with_arenas_a_tenant_fills_its_own_arena_and_evicts_only_its_own_pages() -> None:
    """Tenant arenas (as the daemon makes them over ipc): each tenant's slots
    come from its own run of slabs; a full arena evicts its own tenant's least
    recently used pages, never another's, quota or not."""
    config = Config(
        pool=PoolConfig(size_mib=3, slab_mib=1, max_page_bytes=PAGE),
        tenants={"alpha": TenantConfig(), "beta": TenantConfig()},
    )
    cache = Cache(config, pool_path="x")
    cache.l2.use_arenas({"alpha": (0, 1 << 20), "beta": (1 << 20, 2 << 20)})
    a, b = _register(cache, b"a", "alpha"), _register(cache, b"b", "beta")
    assert _store(cache, b"b", "beta", b, list(range(100))) == 100
    for i in range(100):  # 400 pages into an arena of 256
        assert _store(cache, b"a", "alpha", a, [1000 * i + j for j in range(4)]) == 4
    alpha, beta = cache.l2.book("alpha"), cache.l2.book("beta")
    assert (alpha.pages, alpha.evicted, alpha.quota_evicted) == (256, 144, 0)
    assert (beta.pages, beta.evicted) == (100, 0)
    assert _hits(cache, b"b", "beta", b, list(range(100))) == 100
    assert all(slot < 1 << 20 for slot, book in cache.l2._holder.items() if book is alpha)
    assert all(slot >= 1 << 20 for slot, book in cache.l2._holder.items() if book is beta)
    # a tenant without an arena (none was given) gets no slot, and says pool_full
    nobody = cache.l2.book("gamma")
    assert cache.l2.alloc(nobody, PAGE, 3) == []


def test_tenant_map_reads_ipc_credentials_and_curve_keys() -> None:
    tenants = {
        "alpha": TenantConfig(uids=[1001]),
        "beta": TenantConfig(gids=[2000]),
        "rest": TenantConfig(others=True),
    }
    m = TenantMap(tenants, {b"K" * 40: "alpha"}, ipc=True)
    assert m.of_address("localhost:1001:2000:77") == "alpha"  # the uid first
    assert m.of_address("localhost:1002:2000:77") == "beta"
    assert m.of_address("localhost:1003:3000:77") == "rest"
    assert m.of_key(b"K" * 40) == "alpha"
    strict = TenantMap({"alpha": TenantConfig(uids=[1001])}, {}, ipc=True)
    assert strict.of_address("localhost:5:6:7") == "!uid 5, gid 6, pid 7"
    assert strict.of_address("") == "!an ipc peer without credentials"
    assert strict.of_key(b"Z" * 40).startswith("!CURVE key ZZZ")
    tcp = TenantMap({"alpha": TenantConfig(uids=[1001])}, {}, ipc=False)
    assert tcp.of_address("1:1001:1:1") == "!tcp 1:1001:1:1 without CURVE"  # not credentials


class _Groups:
    """A user and group database of a few users (uid -> its groups), which
    counts its lookups; a uid it does not list has no passwd entry."""

    def __init__(self, groups: dict[int, list[int]]) -> None:
        self.groups = groups
        self.asked: list[int] = []

    def __call__(self, uid: int) -> list[int]:
        self.asked.append(uid)
        return list(self.groups.get(uid, []))


def test_an_ipc_peer_belongs_to_the_tenant_of_a_group_its_user_is_in_whatever_its_gid() -> None:
    """The order: the uid listed, the current gid listed, a listed group the
    user is a member of (primary or supplementary), the others tenant."""
    tenants = {
        "alpha": TenantConfig(uids=[1001]),
        "beta": TenantConfig(gids=[2000]),
        "gamma": TenantConfig(gids=[3000]),
        "rest": TenantConfig(others=True),
    }
    db = _Groups({1001: [1001, 3000], 1002: [1002, 3000], 1003: [1003]})
    m = TenantMap(tenants, {}, ipc=True, lookup=db)
    assert m.of_address("localhost:1001:2000:7") == "alpha"  # the uid, before any group
    assert m.of_address("localhost:1002:2000:7") == "beta"  # the current gid, before membership
    assert db.asked == []  # decided without a lookup
    # 1002 runs with its own group (or any other, as after sg or newgrp) current:
    # still gamma's, whose group it is in, not the others'
    assert m.of_address("localhost:1002:1002:7") == "gamma"
    assert m.of_address("localhost:1002:4000:8") == "gamma"
    assert m.of_address("localhost:1003:1003:7") == "rest"
    strict = TenantMap({"gamma": TenantConfig(gids=[3000])}, {}, ipc=True, lookup=db)
    assert strict.of_address("localhost:1002:1002:7") == "gamma"  # not a peer of no tenant
    assert strict.of_address("localhost:1003:1003:7") == "!uid 1003, gid 1003, pid 7"
    # with no tenant listing gids, nobody's groups are looked up
    by_uid = TenantMap({"alpha": TenantConfig(uids=[1001])}, {}, ipc=True, lookup=db)
    asked = len(db.asked)
    assert by_uid.of_address("localhost:1002:1002:7") == "!uid 1002, gid 1002, pid 7"
    assert len(db.asked) == asked


def test_root_and_the_daemons_user_are_no_tenants_by_their_groups() -> None:
    me = os.getuid()
    db = _Groups({0: [0, 3000], me: [me, 3000]})
    m = TenantMap({"gamma": TenantConfig(gids=[3000])}, {}, ipc=True, lookup=db)
    assert m.of_address(f"localhost:{me}:{me}:7").startswith("!uid ")
    assert m.of_address("localhost:0:0:7").startswith("!uid 0")
    assert m.of_address("localhost:0:3000:7") == "gamma"  # its current gid still counts
    assert db.asked == []


def test_a_user_in_several_tenants_groups_gets_the_first_by_name_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    tenants = {"zeta": TenantConfig(gids=[2000]), "eta": TenantConfig(gids=[3000])}
    db = _Groups({1002: [1002, 2000, 3000]})
    m = TenantMap(tenants, {}, ipc=True, lookup=db, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="hicached.auth"):
        assert m.of_address("localhost:1002:1002:7") == "eta"
        now[0] += 3600.0  # looked up again, warned of no more
        assert m.of_address("localhost:1002:1002:8") == "eta"
        assert m.of_address("localhost:1002:2000:9") == "zeta"  # its current gid picks
    assert len(db.asked) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "uid 1002 is a member of groups of tenants eta, zeta: its connections whose "
        "current gid no tenant lists belong to eta, the first by name; take it out "
        "of all but one tenant's groups"
    ]


def test_a_uids_groups_are_kept_a_while_for_a_bounded_number_of_uids() -> None:
    now = [100.0]
    db = _Groups({1: [7], 2: [7], 3: [8]})
    members = Memberships([7], db, ttl_s=60.0, limit=2, clock=lambda: now[0])
    assert members.of(1) == members.of(1) == {7}
    assert db.asked == [1]  # once, then kept
    now[0] += 59.0
    assert members.of(1) == {7} and db.asked == [1]
    now[0] += 1.0  # 60 s on: expired, looked up anew
    db.groups[1] = [9]  # taken out of the listed group meanwhile
    assert members.of(1) == frozenset() and db.asked == [1, 1]
    assert members.of(2) == {7} and members.of(3) == frozenset()  # 8 is listed by no tenant
    assert list(members.known) == [2, 3]  # at the bound, the oldest answer (1's) went
    assert members.of(2) == {7} and db.asked == [1, 1, 2, 3]
    assert members.of(1) == frozenset() and db.asked == [1, 1, 2, 3, 1]
    assert list(members.known) == [3, 1]


def test_the_user_database_lookup_gives_a_users_groups_and_none_to_a_uid_without_entry() -> None:
    me = pwd.getpwuid(os.getuid())
    mine = user_groups(me.pw_uid)
    assert set(mine) == set(os.getgrouplist(me.pw_name, me.pw_gid))
    assert me.pw_gid in mine
    assert Memberships([me.pw_gid, 2**31 - 2]).of(me.pw_uid) == {me.pw_gid}
    stranger = next(uid for uid in range(2**31 - 3, 2**31 - 1000, -1) if not _has_entry(uid))
    assert user_groups(stranger) == []
    m = TenantMap({"beta": TenantConfig(gids=[me.pw_gid])}, {}, ipc=True)
    assert m.of_address(f"localhost:{stranger}:{stranger}:7") == (
        f"!uid {stranger}, gid {stranger}, pid 7"
    )


def _has_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_the_start_reads_every_users_listed_groups_in_one_pass_as_getgrouplist_says() -> None:
    """The start's check of every account reads the group database once, not
    once per user: for every passwd entry on this host it finds the same listed
    groups as getgrouplist does (its primary group and each group naming it),
    with every group listed, with every other one, and with none."""
    users = pwd.getpwall()
    gids = sorted({g.gr_gid for g in grp.getgrall()} | {u.pw_gid for u in users})
    absent = next(gid for gid in range(2**31 - 3, 2**31 - 1000, -1) if gid not in gids)
    for listed in (set(gids), set(gids[::2]) | {absent}, set()):
        got = listed_members(listed)
        assert [user for user, _ in got] == users
        for user, groups in got:
            expected = listed.intersection(os.getgrouplist(user.pw_name, user.pw_gid))
            assert groups == expected, (user.pw_name, sorted(listed))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenants.a]\nuids = [1]\n[tenants.b]\nuids = [1]\n", "tenants.b.uids: 1 belongs to"),
        ("[tenants.a]\nothers = true\n[tenants.b]\nothers = true\n", "at most one may"),
        ('[tenants."a/b"]\n', "a tenant's name"),
        ("[tenants.a]\nmax_mib = -1\n", "tenants.a.max_mib: must be 0"),
        ('[tenants.a]\ncurve_keys = ["a.key"]\n', "CURVE keys name tenants only with"),
        ('[tenants.a]\ncurve_keys = ["../x.key"]\n', "not a certificate file name"),
    ],
)
def test_bad_tenants_name_their_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"^x\.toml: ") as info:
        parse_config(text, "x.toml")
    assert message in str(info.value)


# -- over tcp, by CURVE key -----------------------------------------------------------


def _keygen(directory: Path, name: str) -> tuple[Path, Path]:
    import zmq.auth

    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    return Path(public), Path(secret)


def test_curve_keys_name_tenants(tmp_path: Path) -> None:
    server_public, server_secret = _keygen(tmp_path / "server", "daemon")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    made = {name: _keygen(tmp_path / "clients", name) for name in ("a1", "b1", "other", "stray")}
    for name in ("a1", "b1", "other"):
        shutil.copy(made[name][0], authorized / f"{name}.key")
    d = Daemon(
        tcp=True,
        curve=CurveKeys.load(str(server_public), str(made["a1"][1])),
        tail=(
            f'[curve]\nsecret_key_file = "{server_secret}"\n'
            f'authorized_keys_dir = "{authorized}"\n'
            '[tenants.alpha]\ncurve_keys = ["a1.key"]\n'
            f'[tenants.beta]\ncurve_keys = ["{authorized / "b1.key"}"]\n'
        ),
    )
    try:
        d.start()

        def client(name: str) -> Client:
            keys = CurveKeys.load(str(server_public), str(made[name][1]))
            return Client(d.endpoint, timeout=2.0, curve=keys, map_pool=False)

        with client("a1") as a, client("b1") as b, client("other") as other:
            ns = a.register(**NS)
            assert ns.digest == namespace_digest(NamespaceSpec(**{**NS, "tenant": "alpha"}))
            with pytest.raises(ForeignTenant, match="belongs to tenant 'beta'"):
                b.register(**NS, tenant="alpha")
            assert b.register(**NS).digest != ns.digest
            with pytest.raises(ForeignTenant, match="belongs to no tenant"):
                other.register(**NS)  # authorized, but no tenant lists its key
            assert other.stats().clients >= 3
        with pytest.raises((DeadlineExceeded, DaemonUnavailable)), client("stray") as stray:
            stray.stats()  # not authorized: no answer, as without tenants
    finally:
        d.cleanup()


# -- over ipc, by uid: client processes as other users ----------------------------------


USERADD = ("useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin")


@dataclass
class Users:
    group: str  # the daemon's client group (server.client_group); every user is in it
    gid: int
    ids: list[tuple[int, int]]  # (uid, primary gid) of each user


@pytest.fixture(scope="module")
def users() -> Iterator[Users]:
    """Three users in one client group, made for this module and removed after it."""
    if os.geteuid() != 0:
        pytest.skip("needs root: client processes run as other users (Popen user=, group=)")
    if not (shutil.which("useradd") and shutil.which("groupadd")):
        pytest.skip("needs useradd and groupadd to create the users the clients run as")
    tag = f"hc{os.getpid() % 100000}"
    group, names = f"{tag}c", [f"{tag}u{i}" for i in range(3)]
    made: list[str] = []
    try:
        subprocess.run(["groupadd", group], check=True, capture_output=True)
        for name in names:
            subprocess.run(
                [*USERADD, "--groups", group, name],
                check=True,
                capture_output=True,
            )
            made.append(name)
        ids = [(pwd.getpwnam(n).pw_uid, pwd.getpwnam(n).pw_gid) for n in names]
        yield Users(group, grp.getgrnam(group).gr_gid, ids)
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


# A client process. The interpreter may live where other users cannot run it
# (under /root, say), so it starts as root, loads all it needs, and gives up
# root for good (groups, gid, uid) before it makes a socket: from then on it is
# that user, and the kernel reports that uid as the connection's credentials.
CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import numpy.random
    sys.path.insert(0, ROOT)
    import hicached.arena, hicached.handles, hicached.mapping
    from hicached import Client
    from hicached.errors import HicachedError
    from tests.support import NS

    args = json.loads(sys.argv[1])
    uid, gid, group = args["user"]
    os.setgroups([group])
    os.setgid(gid)
    os.setuid(uid)
    assert os.getresuid() == (uid, uid, uid) and os.getresgid() == (gid, gid, gid)
    out = {}

    def toks(i):
        return np.arange(i * 1000, i * 1000 + 64, dtype=np.uint32)  # 4 pages of 16 tokens

    def pages(i):
        return np.random.default_rng(i).integers(0, 256, (4, 4096), dtype=np.uint8)

    with Client(args["endpoint"], timeout=10.0) as c:
        for claim in args.get("claims", []):
            fields = {"tenant": claim} if claim else {}
            try:
                out[claim or "unset"] = c.register(**NS, **fields).digest.hex()
            except HicachedError as exc:
                out[claim or "unset"] = exc.code + ": " + exc.message
        if "own" in args:
            ns = c.register(**NS)
            own = set(range(*args["own"]))
            for i in sorted(own):
                c.store(ns, toks(i), pages(i))
            fresh = iter(range(*args["pressure"]))
            rng = np.random.default_rng(args["seed"])
            cross = own_lookups = own_full = checked = 0
            for n in range(args["lookups"]):
                i = int(rng.integers(args["universe"]))
                if i in own:
                    own_lookups += 1
                    hit = c.match(ns, toks(i))
                    own_full += hit.hits == 4
                    if hit.hits and n % 25 == 0:  # the bytes too: never a wrong one
                        got = c.read_pages(hit)
                        assert np.array_equal(got, pages(i)[: hit.hits]), i
                        checked += 1
                    c.release(hit)
                else:
                    cross += c.match(ns, toks(i), lease=False).hits
                j = next(fresh, None)
                if j is not None:
                    c.store(ns, toks(j), pages(j))
            out.update(cross=cross, own_lookups=own_lookups, own_full=own_full, checked=checked)
            out.update(arena=str(c.mapping.arena.path), base=c.mapping.base)
    print(json.dumps(out))
    """
).replace("ROOT", repr(str(ROOT)))


def _as_user(uid: int, gid: int, group: int, args: dict[str, object]) -> subprocess.Popen[str]:
    """A client process that runs as ``uid`` (primary group ``gid``, in ``group``)."""
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps({**args, "user": [uid, gid, group]})],
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONDONTWRITEBYTECODE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, object]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert isinstance(result, dict)
    return result


@pytest.fixture
def tenant_daemon(users: Users, tmp_path: Path) -> Iterator[Daemon]:
    """A daemon (as root) whose client group holds the users; alpha is the first
    user's uid, beta the second user's primary gid, the third user no tenant.
    Its metrics take the token in ``tmp_path / "metrics.token"``."""
    (alpha_uid, _), (_, beta_gid), _ = users.ids
    d = Daemon(
        size_mib=16,
        extra=f'client_group = "{users.group}"',
        metrics=metrics_token(tmp_path)[0],
        tail=(
            f"[tenants.alpha]\nuids = [{alpha_uid}]\nmax_pages = 1024\n"
            f"[tenants.beta]\ngids = [{beta_gid}]\nmax_pages = 1024\n"
        ),
    )
    # The daemon's runtime directory, socket and pool are its client group's
    # (server.client_group); the test's temporary directory above them is made
    # passable for the users here.
    os.chmod(d.dir, 0o711)
    try:
        yield d.start()
    finally:
        d.cleanup()


def test_an_ipc_peers_tenant_comes_from_its_uid(tenant_daemon: Daemon, users: Users) -> None:
    (a_uid, a_gid), (b_uid, b_gid), (n_uid, n_gid) = users.ids
    claims = {"claims": ["", "alpha", "beta"], "endpoint": tenant_daemon.endpoint}
    alpha = _result(_as_user(a_uid, a_gid, users.gid, claims))
    beta = _result(_as_user(b_uid, b_gid, users.gid, claims))
    nobody = _result(_as_user(n_uid, n_gid, users.gid, claims))
    digest = {
        t: namespace_digest(NamespaceSpec(**{**NS, "tenant": t})).hex() for t in ("alpha", "beta")
    }
    assert alpha == {
        "unset": digest["alpha"],
        "alpha": digest["alpha"],
        "beta": alpha["beta"],
    }
    assert str(alpha["beta"]).startswith("foreign_tenant: namespace of tenant 'beta' refused")
    assert beta["unset"] == beta["beta"] == digest["beta"]  # by its primary gid
    assert str(beta["alpha"]).startswith("foreign_tenant:")
    for claim in ("unset", "alpha", "beta"):
        message = str(nobody[claim])
        assert message.startswith("foreign_tenant: this connection (uid ")
        assert f"uid {n_uid}, gid {n_gid}" in message
    with tenant_daemon.client() as c:  # root: no tenant lists it, status is served
        assert c.stats().errors["foreign_tenant"] == 5


def test_quota_pressure_from_one_tenant_never_evicts_anothers_pages(
    tenant_daemon: Daemon, users: Users, tmp_path: Path
) -> None:
    """alpha stores 3,500 sequences (14,000 pages) against a quota of 1,024
    pages, beta 200 (800 pages) within its own; meanwhile each looks up 5,000
    random sequences of all 1,100 the two store first (half of them the other's,
    100 of them stored by both): not one page of the other's is found, and beta
    finds every page of its own, every time. Each maps its own tenant's arena
    alone (tests/test_arenas.py), and reads back the bytes it stored."""
    (a_uid, a_gid), (b_uid, b_gid), _ = users.ids
    common = {"endpoint": tenant_daemon.endpoint, "universe": 1100, "lookups": 5000}
    alpha = _as_user(
        a_uid,
        a_gid,
        users.gid,
        {**common, "own": [100, 1100], "pressure": [2000, 4500], "seed": 1},
    )
    beta = _as_user(
        b_uid, b_gid, users.gid, {**common, "own": [0, 200], "pressure": [0, 0], "seed": 2}
    )
    a, b = _result(alpha, 300), _result(beta, 300)
    assert a["cross"] == 0 and b["cross"] == 0, (a, b)
    assert str(a["arena"]).endswith(".alpha.pool") and a["base"] == 0, a
    assert str(b["arena"]).endswith(".beta.pool") and b["base"] == 8 << 20, b
    assert b["own_full"] == b["own_lookups"] > 500, b
    assert int(a["own_lookups"]) + int(b["own_lookups"]) > 5000
    assert int(a["checked"]) > 0 and int(b["checked"]) > 0
    with tenant_daemon.client() as c:
        stats = c.stats()
    token = (tmp_path / "metrics.token").read_text().strip()
    figures = scrape(stats.metrics_endpoint, token=token)

    def value(name: str, **labels: str) -> float:
        return figures[(name, tuple(sorted(labels.items())))]

    evicted = "hicached_tenant_evicted_pages_total"
    assert value(evicted, tenant="beta", cause="quota") == 0
    assert value(evicted, tenant="beta", cause="other") == 0
    assert value(evicted, tenant="alpha", cause="quota") > 10000
    assert value("hicached_tenant_pages", tenant="beta") == 800
    assert value("hicached_tenant_slots", tenant="alpha") <= 1024
    assert value("hicached_tenant_quota", tenant="alpha", unit="pages") == 1024
    assert value("hicached_tenant_match_pages_total", tenant="beta", tier="l2") == 4 * int(
        b["own_full"]
    )


def test_the_tenant_metrics_exist_without_tenants(daemon: Daemon) -> None:
    with daemon.client() as c:
        ns = c.register(**NS)
        toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
        c.match(ns, toks, lease=False)
        endpoint = c.stats().metrics_endpoint
    figures = scrape(endpoint)
    assert figures[("hicached_tenant_pages", (("tenant", "default"),))] == 2
    assert figures[("hicached_tenant_quota", (("tenant", "default"), ("unit", "pages")))] == 0


def test_with_tenants_a_message_of_extra_frames_is_dropped_and_the_next_served(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(tail=f"[tenants.alpha]\nuids = [{os.getuid()}]\n")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    try:
        sock.send_multipart([b"one", b"two", b"three"])
        sock.send(p.encode(p.Hello(id=7, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)))
        assert sock.poll(5000), "no reply to hello"
        reply = p.reply_decoder.decode(sock.recv())
        assert isinstance(reply, p.HelloOk) and reply.id == 7
    finally:
        sock.close()
        ctx.term()
    with d.client() as c:
        assert c.stats().dropped["bad_frames"] == 1
        assert c.register(**NS).digest == namespace_digest(NamespaceSpec(**NS, tenant="alpha"))


@dataclass
class Member:
    """A user whom a tenant lists by a supplementary group alone."""

    user: pwd.struct_passwd
    gid: int  # the group, which no other user is in


@pytest.fixture
def member(users: Users) -> Iterator[Member]:
    """A user in the client group and in a group of its own beside its primary
    one, made for this test and removed after it."""
    tag = f"hc{os.getpid() % 100000}"
    group, name = f"{tag}g", f"{tag}m"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    try:
        subprocess.run(
            [*USERADD, "--groups", f"{users.group},{group}", name], check=True, capture_output=True
        )
        try:
            yield Member(pwd.getpwnam(name), grp.getgrnam(group).gr_gid)
        finally:
            subprocess.run(["userdel", name], capture_output=True)
    finally:
        subprocess.run(["groupdel", group], capture_output=True)


def _as_member(endpoint: str) -> Callable[[], dict[str, object]]:
    def work() -> dict[str, object]:
        out: dict[str, object] = {"gid": os.getegid()}
        with Client(endpoint, timeout=5.0) as c:
            try:
                ns = c.register(**NS)
                out["digest"] = ns.digest.hex()
                toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
                c.store(ns, toks, page_bytes_for(toks))
                out["hits"] = c.match(ns, toks, lease=False).hits
            except HicachedError as exc:
                out["register"] = exc.code
            stats = c.stats()
            out["scope"] = stats.scope
            out["tenant"] = stats.tenant.tenant if stats.tenant is not None else ""
        return out

    return work


def test_a_user_a_tenant_lists_by_a_supplementary_group_is_its_whatever_its_current_gid(
    users: Users, member: Member
) -> None:
    """beta lists a group that its user is in beside its own primary group: the
    user's clients are beta's with its primary group current, and with another
    of its groups current (as after sg or newgrp), never a peer of no tenant,
    which would see the daemon's totals."""
    (alpha_uid, _), _, _ = users.ids
    d = Daemon(
        size_mib=16,
        extra=f'client_group = "{users.group}"',
        tail=f"[tenants.alpha]\nuids = [{alpha_uid}]\n[tenants.beta]\ngids = [{member.gid}]\n",
    )
    os.chmod(d.dir, 0o711)
    try:
        d.start()
        beta = namespace_digest(NamespaceSpec(**{**NS, "tenant": "beta"})).hex()
        user = member.user
        for current in (user.pw_gid, users.gid):
            got = as_user(user, _as_member(d.endpoint), primary=current)
            assert got == {
                "gid": current,
                "digest": beta,
                "hits": 2,
                "scope": "tenant",
                "tenant": "beta",
            }, (current, got)
    finally:
        d.cleanup()


def test_a_user_in_two_tenants_groups_is_refused_at_start(users: Users, member: Member) -> None:
    """The member is in the client group and a group of its own: with each
    listed by a tenant it could open both arenas, and which tenant it is would
    rest on its current gid alone. Listed by one of them it is that tenant's,
    not the others tenant's, whose arena it cannot open."""
    both = Config(
        tenants={"alpha": TenantConfig(gids=[users.gid]), "beta": TenantConfig(gids=[member.gid])}
    )
    with pytest.raises(
        ConfigError, match=f"uid {member.user.pw_uid}\\) is in groups of tenants 'alpha' and 'beta'"
    ):
        check_memberships(both)
    one = {"beta": TenantConfig(gids=[member.gid]), "rest": TenantConfig(others=True)}
    check_memberships(Config(tenants=one))
    listed = {users.gid, member.gid, member.user.pw_gid}
    found = {user.pw_name: groups for user, groups in listed_members(listed)}
    assert found[member.user.pw_name] == listed  # its primary group, and both that name it


def _hicached(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicached", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_check_config_refuses_a_user_in_two_tenants_groups_as_the_start_does(
    users: Users, member: Member, tmp_path: Path
) -> None:
    """check-config runs the start's check of the accounts: the member, in the
    groups of alpha and beta, fails both with one message (exit 2); listed by
    beta alone beside an others tenant, check-config passes."""
    runtime = Path("/tmp") / f"hc-acct-{os.getpid()}"
    head = (
        f'[server]\nruntime_dir = "{runtime}"\n[pool]\nsize_mib = 16\nslab_mib = 1\n'
        "max_page_bytes = 65536\n[metrics]\nenabled = false\n"
    )
    config = tmp_path / "c.toml"
    config.write_text(
        head + f"[tenants.alpha]\ngids = [{users.gid}]\n[tenants.beta]\ngids = [{member.gid}]\n"
    )
    message = (
        f"tenants: user {member.user.pw_name} (uid {member.user.pw_uid}) is in groups of "
        "tenants 'alpha' and 'beta'"
    )
    try:
        served = _hicached("serve", "--config", str(config))
        checked = _hicached("check-config", str(config))
        assert served.returncode == 2 and checked.returncode == 2, (served, checked)
        said = served.stderr.strip().splitlines()[-1].removeprefix("hicached serve: ")
        assert said.startswith(message), served.stderr
        assert checked.stderr.strip() == f"hicached check-config: {said}", checked.stderr
        config.write_text(
            head + f"[tenants.beta]\ngids = [{member.gid}]\n[tenants.rest]\nothers = true\n"
        )
        checked = _hicached("check-config", str(config))
        assert checked.returncode == 0 and checked.stdout.strip() == f"{config}: ok", checked
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
