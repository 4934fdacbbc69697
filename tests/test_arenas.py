"""Tenant arenas: over ipc each tenant's pages live in a pool file of its own
that only its identities may open, and its clients map that file alone.

The layout and hello tests run in-process. The real-uid tests run client
processes as other users (forks of this one that switch uid, as in
tests/test_client_group.py), against a daemon whose tenants are one user's uid
and another user's primary gid (tests/test_tenants.py's ``tenant_daemon``):
they need root and useradd, and are skipped, saying why, elsewhere.
"""

from __future__ import annotations

import errno
import mmap
import os
import pwd
import stat
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from hicached import Client
from hicached import protocol as p
from hicached.cache import Cache
from hicached.client.handles import Hit
from hicached.config import Config, PoolConfig, TenantConfig
from hicached.daemon.arenas import acl, arena_layout, check_memberships, grant
from hicached.errors import ConfigError, DaemonUnavailable, ForeignTenant, HicachedError
from hicached.wire.arenas import TenantArena, TenantArenas, tenant_arena_path
from tests.support import NS, PAGE_TOKENS, Daemon
from tests.test_client_group import as_user
from tests.test_tenants import Users, tenant_daemon, users

_ = (users, tenant_daemon)  # fixtures, used by name
MIB = 1 << 20
RUN = Path("/tmp/hc-arenas-run")
IPC = f"ipc://{RUN}/hicached.sock"


def _config(size_mib: int = 64, slab_mib: int = 1, **tenants: TenantConfig) -> Config:
    pool = PoolConfig(size_mib=size_mib, slab_mib=slab_mib, max_page_bytes=MIB)
    return Config(pool=pool, tenants=tenants)


# -- which tenants get an arena, and how large -----------------------------------------


def test_each_ipc_tenant_gets_an_arena_in_name_order_sized_or_an_equal_share() -> None:
    config = _config(
        64,
        beta=TenantConfig(gids=[7], arena_mib=8),
        alpha=TenantConfig(uids=[5]),
        rest=TenantConfig(others=True),
        keys=TenantConfig(),  # no uid, gid or others: no ipc peer, no arena
    )
    layout = arena_layout(config, IPC, RUN)
    assert [(a.tenant, a.start // MIB, a.size // MIB) for a in layout] == [
        ("alpha", 0, 28),
        ("beta", 28, 8),
        ("rest", 36, 28),
    ]
    assert layout[0].path == tenant_arena_path("/dev/shm", RUN, "alpha")
    assert layout[0].path.name.endswith(".alpha.pool")
    # over tcp no client maps the pool, and without tenants it stays one file
    assert arena_layout(config, "tcp://127.0.0.1:5555", RUN) == []
    assert arena_layout(_config(64), IPC, RUN) == []


def test_shares_are_whole_slabs_and_4_mib() -> None:
    layout = arena_layout(
        _config(100, 6, a=TenantConfig(uids=[1]), b=TenantConfig(uids=[2])), IPC, RUN
    )
    assert [a.size // MIB for a in layout] == [48, 48]  # whole 12 MiB units (lcm of 6 and 4)
    assert [a.start // MIB for a in layout] == [0, 48]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_config(64, a=TenantConfig(uids=[1], arena_mib=6)), "tenants.a.arena_mib: 6 MiB is not"),
        (
            _config(16, a=TenantConfig(uids=[1], arena_mib=16), b=TenantConfig(uids=[2])),
            "does not hold an arena for each",
        ),
        (_config(16, a=TenantConfig(uids=[1], arena_mib=20)), "does not hold an arena"),
        (
            Config(pool=PoolConfig(huge_pages="hugetlbfs"), tenants={"a": TenantConfig(uids=[1])}),
            "hugetlbfs",
        ),
    ],
)
def test_layouts_that_do_not_fit_are_refused(config: Config, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        arena_layout(config, IPC, RUN)


def test_a_negative_arena_size_names_its_key() -> None:
    from hicached.config import parse_config

    with pytest.raises(ConfigError, match=r"tenants\.a\.arena_mib: must be 0"):
        parse_config("[tenants.a]\narena_mib = -4\n", "x.toml")


# -- what a client is told at hello -------------------------------------------------------


def test_hello_names_the_tenants_arena_and_refuses_clients_older_than_arenas() -> None:
    config = _config(16, alpha=TenantConfig(uids=[5]), beta=TenantConfig(uids=[6]))
    layout = arena_layout(config, IPC, RUN)
    cache = Cache(config, pool_path="")
    cache.l2.use_arenas({a.tenant: (a.start, a.size) for a in layout})
    cache.clients.use_arenas(layout)
    hello = p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)
    ok = cache.handle(b"b", hello, "beta")
    assert isinstance(ok, p.HelloOk)
    assert (ok.pool_path, ok.pool_bytes, ok.pool_base) == (str(layout[1].path), 8 * MIB, 8 * MIB)
    nobody = cache.handle(b"n", hello, "!uid 7, gid 7, pid 1")
    assert isinstance(nobody, p.HelloOk) and (nobody.pool_path, nobody.pool_bytes) == ("", 0)
    old = cache.handle(b"o", msgspec.structs.replace(hello, minor=p.ARENAS_MINOR - 1), "alpha")
    assert isinstance(old, p.Error) and old.code == "version_mismatch"
    assert "upgrade the client" in old.message


# -- the daemon's one view over every tenant's file --------------------------------------


def test_the_daemons_view_and_each_tenants_file_are_the_same_bytes(tmp_path: Path) -> None:
    arenas = [
        TenantArena("a", tmp_path / "a.pool", 0, 4 * MIB),
        TenantArena("b", tmp_path / "b.pool", 8 * MIB, 4 * MIB),  # 4..8 MiB: no arena's
    ]
    shared: list[str] = []
    pool = TenantArenas.create(16 * MIB, arenas, lambda fd, arena: shared.append(arena.tenant))
    try:
        assert shared == ["a", "b"] and len(pool.array) == 16 * MIB
        pool.array[8 * MIB + 5] = 7  # b's slot bytes, as a backend writes them
        pool.gens[(8 * MIB + 3 * 4096) // 4096] = 9  # b's 4th granule's generation
        with open(arenas[1].path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            assert m[5] == 7
            assert np.frombuffer(m, np.uint32, count=4, offset=4 * MIB)[3] == 9
            m[100] = 3  # a client's write lands in the daemon's view
            assert pool.array[8 * MIB + 100] == 3
        assert pool.array[4 * MIB] == 0  # between arenas: anonymous, zero
        assert stat.S_IMODE(arenas[0].path.stat().st_mode) == 0o600
    finally:
        pool.close()
    assert not arenas[0].path.exists() and not arenas[1].path.exists()


def test_an_arena_file_opens_to_its_uids_and_gids_only_by_acl() -> None:
    config = _config(16, alpha=TenantConfig(uids=[4001, 4002], gids=[5001]))
    path = Path("/dev/shm") / f"hc-acl-test-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        grant(config, None)(fd, TenantArena("alpha", path, 0, 4 * MIB))
        assert os.getxattr(fd, "system.posix_acl_access") == acl([4001, 4002], [5001])
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o660  # group bits: the ACL's mask
    except OSError as exc:  # pragma: no cover - a /dev/shm without ACLs
        pytest.skip(f"/dev/shm has no POSIX ACLs here: {exc}")
    finally:
        os.close(fd)
        path.unlink()


# -- two real uids as two tenants ------------------------------------------------------


def _pw(uid: int) -> pwd.struct_passwd:
    return pwd.getpwuid(uid)


def _errno(call: Callable[[], object]) -> str:
    try:
        call()
    except OSError as exc:
        return errno.errorcode[exc.errno or 0]
    return "ok"


def _toks(i: int) -> np.ndarray:
    return np.arange(i * 1000, i * 1000 + 4 * PAGE_TOKENS, dtype=np.uint32)


def _pages(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (4, 4096), dtype=np.uint8)


def store_work(endpoint: str, seed: int) -> Callable[[], dict[str, object]]:
    """Store 4 pages of ``seed``'s bytes and read them back; say where they are."""

    def work() -> dict[str, object]:
        with Client(endpoint, timeout=5.0) as c:
            ns = c.register(**NS)
            c.store(ns, _toks(seed), _pages(seed))
            hit = c.match(ns, _toks(seed))
            same = bool(np.array_equal(c.read_pages(hit), _pages(seed)))
            handle = msgspec.json.encode(hit.portable()).decode()
            # the lease stays: the other tenant tries it while the pages are held
            return {
                "same": same,
                "offsets": list(hit.offsets),
                "arena": str(c.mapping.arena.path),
                "base": c.mapping.base,
                "handle": handle,
            }

    return work


def probe_work(
    endpoint: str, mine: str, theirs: str, stolen: dict[str, object], seed: int
) -> Callable[[], dict[str, object]]:
    """As the other tenant: open and map the first tenant's arena, ask the
    daemon for its pages every way a client can, and look for its bytes."""

    def work() -> dict[str, object]:
        from hicached.client.handles import PortableHandle
        from hicached.wire.arena import Arena

        out: dict[str, object] = {
            "open_rw": _errno(lambda: os.close(os.open(theirs, os.O_RDWR))),
            "open_ro": _errno(lambda: os.close(os.open(theirs, os.O_RDONLY))),
            "open_own": _errno(lambda: os.close(os.open(mine, os.O_RDWR))),
        }
        try:
            Arena.attach(theirs, 4 * MIB).close()
            out["attach"] = "ok"
        except DaemonUnavailable as exc:
            out["attach"] = str(exc)
        want = _pages(seed)
        with Client(endpoint, timeout=5.0) as c:
            ns = c.register(**NS)
            out["own_arena"] = str(c.mapping.arena.path)
            try:
                c.register(**NS, tenant=str(stolen["tenant"]))
                out["register"] = "ok"
            except ForeignTenant:
                out["register"] = "foreign_tenant"
            out["match_hits"] = c.match(ns, _toks(seed), lease=False).hits  # its tokens, my ns
            handle = msgspec.json.decode(str(stolen["handle"]), type=PortableHandle)
            try:
                hit = c.adopt(handle)
                assert isinstance(hit, Hit)
                got = c.read_pages(hit)
                out["handle"] = "same bytes" if np.array_equal(got, want) else "other bytes"
            except (HicachedError, ValueError) as exc:
                out["handle"] = type(exc).__name__
            # its whole mapping: none of the other tenant's pages is in it
            rows = c.mapping.arena.rows(4096)
            out["found"] = sum(int((rows == page).all(axis=1).any()) for page in want)
        return out

    return work


def test_two_uids_cannot_open_map_or_read_each_others_arena(
    tenant_daemon: Daemon, users: Users
) -> None:
    (a_uid, _), (b_uid, _), (n_uid, _) = users.ids
    endpoint = tenant_daemon.endpoint
    arena = {
        t: str(tenant_arena_path("/dev/shm", tenant_daemon.runtime, t)) for t in ("alpha", "beta")
    }
    for path in arena.values():
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode) & 0o007, st.st_uid) == (0, os.getuid()), path
    alpha = as_user(_pw(a_uid), store_work(endpoint, 11))
    beta = as_user(_pw(b_uid), store_work(endpoint, 12))
    assert alpha["same"] and beta["same"], (alpha, beta)
    assert (alpha["arena"], alpha["base"]) == (arena["alpha"], 0)
    assert (beta["arena"], beta["base"]) == (arena["beta"], 8 * MIB)  # 16 MiB, two arenas
    assert isinstance(alpha["offsets"], list) and isinstance(beta["offsets"], list)
    assert alpha["offsets"] and all(o < 8 * MIB for o in alpha["offsets"])
    assert beta["offsets"] and all(o >= 8 * MIB for o in beta["offsets"])
    for me, other, mine, theirs, seed in (
        (b_uid, alpha, "beta", "alpha", 11),
        (a_uid, beta, "alpha", "beta", 12),
    ):
        stolen = {**other, "tenant": theirs}
        got = as_user(_pw(me), probe_work(endpoint, arena[mine], arena[theirs], stolen, seed))
        assert got["open_rw"] == got["open_ro"] == "EACCES", got
        assert "Permission denied" in str(got["attach"]), got
        assert got["open_own"] == "ok" and got["own_arena"] == arena[mine], got
        assert got["register"] == "foreign_tenant" and got["match_hits"] == 0, got
        assert got["handle"] in ("ValueError", "StaleHandle"), got
        assert got["found"] == 0, got
    # a user in the client group that no tenant lists opens neither, maps nothing
    nobody = as_user(_pw(n_uid), lambda: _nobody(endpoint, arena))
    assert nobody == {"alpha": "EACCES", "beta": "EACCES", "mapping": "ForeignTenant"}, nobody


def _open(path: str, flags: int = os.O_RDONLY) -> None:
    os.close(os.open(path, flags))


def _nobody(endpoint: str, arena: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {
        t: _errno(lambda p=p: os.close(os.open(p, os.O_RDONLY))) for t, p in arena.items()
    }
    with Client(endpoint, timeout=5.0) as c:
        c.stats()
        try:
            _ = c.mapping
            out["mapping"] = "mapped"
        except ForeignTenant:
            out["mapping"] = "ForeignTenant"
    return out


def test_a_user_in_another_tenants_group_is_refused_at_start(users: Users) -> None:
    """alpha lists a user by uid; beta lists the client group, which that user
    is in: the user could open beta's arena, so the daemon refuses to start."""
    (a_uid, _), _, _ = users.ids
    config = _config(16, alpha=TenantConfig(uids=[a_uid]), beta=TenantConfig(gids=[users.gid]))
    with pytest.raises(ConfigError, match=f"uid {a_uid}.*opens the arena of tenant 'beta'"):
        check_memberships(config)
    d = Daemon(
        extra=f'client_group = "{users.group}"',
        tail=f"[tenants.alpha]\nuids = [{a_uid}]\n[tenants.beta]\ngids = [{users.gid}]\n",
    )
    try:
        with pytest.raises(RuntimeError, match="opens the arena of tenant 'beta'"):
            d.start()
    finally:
        d.cleanup()


# -- L3 through tenant arenas ------------------------------------------------------------


def test_l3_writes_and_prefetches_go_through_the_tenants_arena(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """This process is tenant zeta, whose arena is the second (pool bytes 4..8
    MiB): pages written to a file L3 come from its file, and a prefetch lands
    in it again, byte for byte (the store reads on threads: no helper process
    maps tenant arenas)."""
    from tests.l3util import FILE_STORE, l3_count, settle_writes, storage, wait_for, wait_prefetch

    d = daemon_factory(
        size_mib=8,
        slab_mib=1,
        storage=storage("file", "write_through", ""),
        tail=FILE_STORE
        + f"\n[tenants.alpha]\ngids = [65533]\n[tenants.zeta]\nuids = [{os.getuid()}]\n",
    )
    toks = np.arange(20 * PAGE_TOKENS, dtype=np.uint32)
    want = np.random.default_rng(3).integers(0, 256, (20, 4096), dtype=np.uint8)
    with d.client() as c:
        assert (c.mapping.base, c.mapping.arena.size) == (4 * MIB, 4 * MIB)
        ns = c.register(**NS)
        c.store(ns, toks, want)
        wait_for(lambda: l3_count(c, "written") == 20)
        settle_writes(c)
        filler = np.arange(1024 * PAGE_TOKENS, dtype=np.uint32) + 10**7  # the whole arena
        c.store(ns, filler, np.zeros((1024, 4096), np.uint8))
        settle_writes(c)
        hit = c.match(ns, toks, lease=False)
        assert (hit.hits, hit.l3_hits) == (0, 20)
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        assert (done.completed, done.failed) == (20, False)
        assert c.commit(pf).published == 20
        hit = c.match(ns, toks)
        assert all(4 * MIB <= o < 8 * MIB for o in hit.offsets)
        assert np.array_equal(c.read_pages(hit), want)
        c.release(hit)
        assert l3_count(c, "store_reader_pages") == 0


def test_an_arena_size_changes_only_with_a_restart() -> None:
    from hicached.daemon.reload import reload_plan

    running = _config(16, a=TenantConfig(uids=[1], arena_mib=8, max_pages=10))
    wanted = _config(16, a=TenantConfig(uids=[1], arena_mib=4, max_pages=20))
    config, applied, refused = reload_plan(running, wanted)
    assert applied == {"tenants.a.max_pages": 20} and refused == ["tenants.a.arena_mib"]
    assert config.tenants["a"].arena_mib == 8


def match_work(endpoint: str, seed: int) -> Callable[[], dict[str, object]]:
    """Match ``seed``'s pages and read them back; say from which file."""

    def work() -> dict[str, object]:
        with Client(endpoint, timeout=5.0) as c:
            ns = c.register(**NS)
            hit = c.match(ns, _toks(seed))
            got = c.read_pages(hit)
            return {
                "hits": hit.hits,
                "same": bool(np.array_equal(got, _pages(seed)[: hit.hits])),
                "arena": str(c.mapping.arena.path),
                "scope": c.stats().scope,  # a tenant's peer sees no daemon totals
            }

    return work


def test_tenant_arenas_are_adopted_across_a_kill(tenant_daemon: Daemon, users: Users) -> None:
    """kill -9 and a new start: each tenant's pages are matched again from its own
    arena file, with their bytes, and the files keep opening to their tenant only."""
    (a_uid, _), (b_uid, _), _ = users.ids
    d = tenant_daemon
    endpoint = d.endpoint
    arena = {t: str(tenant_arena_path("/dev/shm", d.runtime, t)) for t in ("alpha", "beta")}
    assert as_user(_pw(a_uid), store_work(endpoint, 21))["same"]
    assert as_user(_pw(b_uid), store_work(endpoint, 22))["same"]
    d.fresh = False
    d.kill()
    d.start()
    alpha = as_user(_pw(a_uid), match_work(endpoint, 21))
    beta = as_user(_pw(b_uid), match_work(endpoint, 22))
    assert alpha == {"hits": 4, "same": True, "arena": arena["alpha"], "scope": "tenant"}, alpha
    assert beta == {"hits": 4, "same": True, "arena": arena["beta"], "scope": "tenant"}, beta
    with d.client() as c:  # the operator (root) sees the daemon's totals
        assert c.stats().adopted_pages == 8
    # beta's tokens in alpha's namespace: nothing (the namespaces are per tenant)
    assert as_user(_pw(a_uid), match_work(endpoint, 22))["hits"] == 0
    other = as_user(_pw(b_uid), lambda: {"open": _errno(lambda: _open(arena["alpha"]))})
    assert other == {"open": "EACCES"}
    assert "adopting 2 tenant arenas" in d.log.read_text()
