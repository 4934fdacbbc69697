"""Each tenant's share of the shared bounds on real daemons: tenants told
apart by CURVE key over tcp (one test process, a key per tenant), and by uid
over ipc (client processes as other users, as root: tests/test_tenants.py's
``users``). In-process exact-order tests: test_tenant_shares.py."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from hicached import Client, CurveKeys
from hicached import protocol as p
from hicached.errors import ResourceExhausted
from hicached.namespace import NamespaceSpec, namespace_digest
from hicached.testing import scrape
from tests.l3util import settle_writes, storage, wait_for, wait_prefetch
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon, metrics_token
from tests.test_client_group import as_user
from tests.test_tenants import Users, users

_ = (users,)  # a fixture, used by name


def _keygen(directory: Path, name: str) -> tuple[Path, Path]:
    import zmq.auth

    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    return Path(public), Path(secret)


class Tenants:
    """A daemon over tcp with CURVE whose tenants are named by key: alpha's
    clients use key a, beta's key b; key n is authorized but no tenant lists
    it (a peer of no tenant, which the harness connects as). ``storage``: TOML
    inside ``[storage]``, and ``tables`` its own tables (``[storage.extra]``);
    a ``faulty`` backend is allowed."""

    def __init__(
        self, tmp: Path, server: str, tenants: str, storage: str = "", tables: str = ""
    ) -> None:
        server_public, server_secret = _keygen(tmp / "server", "daemon")
        authorized = tmp / "authorized"
        authorized.mkdir()
        self.keys = {}
        for name in ("a", "b", "n"):
            public, secret = _keygen(tmp / "clients", name)
            shutil.copy(public, authorized / f"{name}.key")
            self.keys[name] = CurveKeys.load(str(server_public), str(secret))
        metrics, self.token = metrics_token(tmp)
        self.daemon = Daemon(
            tcp=True,
            curve=self.keys["n"],
            extra=server,
            metrics=metrics,
            storage=storage,
            allow_faults="faulty" in storage,
            tail=(
                f'{tables}[curve]\nsecret_key_file = "{server_secret}"\n'
                f'authorized_keys_dir = "{authorized}"\n'
                f'[tenants.alpha]\ncurve_keys = ["a.key"]\n{tenants}\n'
                '[tenants.beta]\ncurve_keys = ["b.key"]\n'
            ),
        )

    def client(self, key: str) -> Client:
        c = Client(self.daemon.endpoint, timeout=5.0, curve=self.keys[key], map_pool=False)
        try:
            return c.connect()
        except BaseException:
            c.close()
            raise

    def figures(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with self.client("n") as c:
            endpoint = c.stats().metrics_endpoint
        return scrape(endpoint, token=self.token)


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[Callable[..., Tenants]]:
    made: list[Tenants] = []

    def make(server: str, alpha: str, storage: str = "", tables: str = "") -> Tenants:
        t = Tenants(tmp_path / str(len(made)), server, alpha, storage, tables)
        made.append(t)
        t.daemon.start()
        return t

    try:
        yield make
    finally:
        for t in made:
            t.daemon.cleanup()


def _toks(i: int, pages: int = 2) -> np.ndarray:
    return np.arange(i * 1000, i * 1000 + pages * PAGE_TOKENS, dtype=np.uint32)


def _clients(stats: p.DaemonStats) -> int:
    assert stats.tenant is not None
    return stats.tenant.clients


def test_one_tenant_at_its_clients_share_neither_refuses_nor_ends_anothers_sessions(
    tenants: Callable[[str, str], Tenants],
) -> None:
    """server.max_clients = 6, alpha's share 3, beta's and the peers of no
    tenant an equal 3. alpha at its share takes the place of its own idle
    session, not of beta's idle one; with its three holding leases, its next
    hello is refused naming its key while beta's are served. With the table
    full, beta (its sessions holding leases, below its share) takes the place
    of a peer of no tenant's idle session (status only); such a peer never
    takes a tenant's, and is refused."""
    t = tenants("max_clients = 6", "max_clients = 3")
    with ExitStack() as stack:
        b_idle = stack.enter_context(t.client("b"))  # idle longest of all
        holders = [stack.enter_context(t.client("a")) for _ in range(2)]
        for i, c in enumerate(holders):
            c.reserve(c.register(**NS), _toks(i))
        a_idle = stack.enter_context(t.client("a"))
        assert _clients(a_idle.stats()) == 3
        a_new = stack.enter_context(t.client("a"))  # alpha's own idle session goes
        stats = a_new.stats()
        assert (_clients(stats), stats.clients, stats.scope) == (3, 0, "tenant")  # no totals
        assert _clients(b_idle.stats()) == 1  # beta's is still there
        a_new.reserve(a_new.register(**NS), _toks(3))
        with pytest.raises(ResourceExhausted, match=r"tenants\.alpha\.max_clients") as info:
            stack.enter_context(t.client("a"))
        assert "tenant 'alpha' holds 3 clients, its limit" in str(info.value)
        b2 = stack.enter_context(t.client("b"))
        assert _clients(b2.stats()) == 2 and _clients(b_idle.stats()) == 2

        # the table full: 3 of alpha (leases), 2 of beta, 1 peer of no tenant
        n1 = stack.enter_context(t.client("n"))
        assert n1.stats().clients == 6
        b_idle.reserve(b_idle.register(**NS), _toks(4))
        b2.reserve(b2.register(**NS), _toks(5))
        b3 = stack.enter_context(t.client("b"))  # n1, of no tenant, makes way
        stats = b3.stats()
        assert (_clients(stats), stats.scope) == (3, "tenant")  # the totals: from the metrics
        with pytest.raises(ResourceExhausted, match=r"server\.max_clients") as info:
            stack.enter_context(t.client("n"))  # a tenant's session never makes way for it
        assert "none of peers of no tenant is idle without a lease" in str(info.value)
        figures = scrape(stats.metrics_endpoint, token=t.token)  # t.figures() connects as n
    assert figures[("hicached_clients", ())] == 6  # the table stayed full
    # alpha's figures in the metrics: what it holds and its shares
    held = {
        (tenant, of): figures[("hicached_tenant_held", (("of", of), ("tenant", tenant)))]
        for tenant in ("alpha", "beta")
        for of in ("clients", "leases", "namespaces")
    }
    assert held == {
        ("alpha", "clients"): 3,
        ("alpha", "leases"): 3,
        ("alpha", "namespaces"): 1,
        ("beta", "clients"): 3,
        ("beta", "leases"): 2,
        ("beta", "namespaces"): 1,
    }
    assert figures[("hicached_tenant_share", (("of", "clients"), ("tenant", "alpha")))] == 3
    assert figures[("hicached_tenant_share", (("of", "leases"), ("tenant", "beta")))] == 32768


def test_a_tenants_leases_and_namespaces_past_its_share_are_refused_not_anothers(
    tenants: Callable[[str, str], Tenants],
) -> None:
    t = tenants("", "max_leases = 2\nmax_namespaces = 2")
    with t.client("a") as a:
        old = a.register(**{**NS, "model": "test/old"})
        a.commit(a.reserve(old, _toks(0)))  # pages of a namespace soon unused
    with t.client("a") as a, t.client("b") as b:
        ns = a.register(**NS)
        a.commit(a.reserve(ns, _toks(5)))
        first = a.reserve(ns, _toks(1))
        a.reserve(ns, _toks(2))
        before = a.stats()
        assert before.tenant is not None and before.tenant.leases == 2
        with pytest.raises(ResourceExhausted, match=r"tenants\.alpha\.max_leases"):
            a.reserve(ns, _toks(3))
        with pytest.raises(ResourceExhausted, match=r"tenants\.alpha\.max_leases"):
            a.match(ns, _toks(5))  # a leased match of pages it holds
        after = a.stats()
        assert (after.pool_used_bytes, after.reserved_pages, after.leases) == (
            before.pool_used_bytes,
            before.reserved_pages,
            before.leases,
        )
        assert before.tenant.slots == after.tenant.slots == 8  # type: ignore[union-attr]
        bns = b.register(**NS)
        assert all(b.reserve(bns, _toks(i)).lease for i in range(4))  # beta's share is its own
        a.release(first)
        assert a.reserve(ns, _toks(3)).lease  # room again
        # namespaces: "old" (unused, with pages) makes way for a second; a third is refused
        a.register(**{**NS, "model": "test/second"})
        stats = a.stats()
        assert stats.tenant is not None and stats.tenant.namespaces == 2
        # old's 2 pages went with it: 2 stored, 2 leases of 2, and the 2 slots of the
        # released one, which wait out their quarantine
        assert stats.tenant.slots == 8
        with pytest.raises(ResourceExhausted, match=r"tenants\.alpha\.max_namespaces"):
            a.register(**{**NS, "model": "test/third"})
        for i in range(3):
            b.register(**{**NS, "model": f"test/beta-{i}"})
        stats = b.stats()
        assert stats.tenant is not None and stats.tenant.namespaces == 4


def _gated_reads(tmp: Path, digest: str) -> tuple[str, str]:
    """``[storage]`` and its tables for a faulty store over a file store whose
    reads of namespace ``digest`` wait until the file ``tmp/open`` exists."""
    return (
        storage("faulty", more="concurrency = 4\nop_timeout_s = 60.0\nprefetch_batch_pages = 1\n"),
        '[storage.extra]\ninner = "file"\n'
        "[storage.extra.inner_options]\ncapacity_mib = 8\nsegment_mib = 2\nio_threads = 2\n"
        f'[storage.extra.read_gate]\n"{digest}" = "{tmp / "open"}"\n',
    )


def _in_l3_alone(d: Daemon, write: Callable[[], None], operator: Callable[[], Client]) -> None:
    """``write`` commits pages (written through to L3); a restart with a new
    pool leaves them in L3 alone."""
    write()
    with operator() as n:
        settle_writes(n)
    assert d.stop() == 0
    d.start()


def test_a_prefetch_released_while_it_reads_counts_against_its_tenants_share_until_the_read_ends(
    tenants: Callable[..., Tenants], tmp_path: Path
) -> None:
    """alpha's share is 2 leases. Two prefetches whose reads wait in the store
    (fault injection: the faulty backend holds every read of alpha's namespace
    until the test opens it) are released: both still count, so a third
    prefetch or a reservation is refused naming tenants.alpha.max_leases
    while the reads run (else a tenant could release and prefetch again and
    keep any number of store reads running, up to every call slot). Its
    held leases say 2 (stats and metrics). beta prefetches and reserves as
    ever. Once the reads return the count drops and alpha prefetches again."""
    alpha = namespace_digest(NamespaceSpec(**{**NS, "tenant": "alpha"})).hex()
    store, tables = _gated_reads(tmp_path, alpha)
    t = tenants("", "max_leases = 2", store, tables)
    gate = tmp_path / "open"

    def write() -> None:
        with t.client("a") as a, t.client("b") as b:
            for c, first in ((a, 0), (b, 5)):
                ns = c.register(**NS)
                for i in range(first, first + 3):
                    c.commit(c.reserve(ns, _toks(i)))

    _in_l3_alone(t.daemon, write, lambda: t.client("n"))
    with t.client("a") as a, t.client("b") as b, t.client("n") as n:
        ns = a.register(**NS)
        fetches = [a.prefetch(ns, _toks(i)) for i in range(2)]
        wait_for(lambda: n.stats().l3["store_calls_running"] == 2)  # both at the gate
        for pf in fetches:
            a.release(pf)
        with pytest.raises(ResourceExhausted, match=r"tenants\.alpha\.max_leases") as info:
            a.prefetch(ns, _toks(2))
        assert str(info.value).startswith("tenant 'alpha' holds 2 leases, its limit")
        with pytest.raises(ResourceExhausted, match=r"tenants\.alpha\.max_leases"):
            a.reserve(ns, _toks(9))
        held = a.stats().tenant
        assert held is not None and (held.leases, held.max_leases) == (2, 2)
        figures = scrape(a.stats().metrics_endpoint, token=t.token)
        assert figures[("hicached_tenant_held", (("of", "leases"), ("tenant", "alpha")))] == 2
        assert figures[("hicached_leases", ())] == 2  # out of the table, counted all the same
        # beta's share is its own, and its reads are served beside alpha's waiting ones
        bns = b.register(**NS)
        bpf = b.prefetch(bns, _toks(5))
        done = wait_prefetch(b, bpf)
        assert (done.completed, done.failed) == (2, False)
        assert b.commit(bpf).duplicates == 0
        assert all(b.reserve(bns, _toks(i)).lease for i in range(10, 14))
        # nothing above raced alpha's reads: they still wait, and still count
        assert n.stats().l3["store_calls_running"] == 2
        gate.touch()
        wait_for(lambda: n.stats().l3["store_calls_running"] == 0)
        wait_for(lambda: a.stats().tenant.leases == 0)  # type: ignore[union-attr]
        pf = a.prefetch(ns, _toks(2))
        done = wait_prefetch(a, pf)
        assert (done.completed, done.failed) == (2, False)
        a.commit(pf)
        assert a.stats().tenant.leases == 0  # type: ignore[union-attr]


def test_a_prefetch_released_while_it_reads_counts_against_the_daemons_bound_until_it_ends(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Without tenants, leases.max_leases = 2 bounds the leases of every client
    alike: two prefetches released while their reads wait in the store still
    count, and a third lease is refused naming the bound until they return."""
    digest = namespace_digest(NamespaceSpec(**NS)).hex()
    store, tables = _gated_reads(tmp_path, digest)
    d = daemon_factory(allow_faults=True, storage=store, tail=f"{tables}[leases]\nmax_leases = 2\n")

    def write() -> None:
        with d.client() as c:
            ns = c.register(**NS)
            for i in range(3):
                c.store(ns, _toks(i), np.zeros((2, PAGE_BYTES), np.uint8))

    _in_l3_alone(d, write, d.client)
    with d.client() as c, d.client() as other:
        ns = c.register(**NS)
        fetches = [c.prefetch(ns, _toks(i)) for i in range(2)]
        wait_for(lambda: c.stats().l3["store_calls_running"] == 2)  # both at the gate
        for pf in fetches:
            c.release(pf)
        assert c.stats().leases == 2
        ons = other.register(**NS)
        with pytest.raises(ResourceExhausted, match=r"leases\.max_leases = 2") as info:
            other.prefetch(ons, _toks(2))
        assert "2 leases are open, the limit" in str(info.value)
        assert c.stats().l3["store_calls_running"] == 2  # the reads still wait
        (tmp_path / "open").touch()
        wait_for(lambda: c.stats().leases == 0)
        pf = other.prefetch(ons, _toks(2))
        assert wait_prefetch(other, pf).completed == 2
        other.commit(pf)


def test_a_prefetch_released_while_it_reads_shows_its_slots_as_reserved_until_it_ends(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A prefetch whose reads wait in the store (fault injection: the gate)
    is released: it still counts as an open lease, and the slots its reader
    fills still take pool bytes, so they show as reserved (stats and
    hicached_pages{state="reserved"}) as while the lease was open, not
    nowhere; once the reads return the slots are free and nothing shows."""
    digest = namespace_digest(NamespaceSpec(**NS)).hex()
    store, tables = _gated_reads(tmp_path, digest)
    d = daemon_factory(allow_faults=True, storage=store, tail=tables)

    def write() -> None:
        with d.client() as c:
            ns = c.register(**NS)
            c.store(ns, _toks(0, pages=3), np.zeros((3, PAGE_BYTES), np.uint8))

    _in_l3_alone(d, write, d.client)
    with d.client() as c:
        ns = c.register(**NS)
        pf = c.prefetch(ns, _toks(0, pages=3))
        wait_for(lambda: c.stats().l3["store_calls_running"] == 1)  # at the gate
        stats = c.stats()
        assert (stats.leases, stats.reserved_pages, stats.pool_used_bytes) == (1, 3, 3 * PAGE_BYTES)
        c.release(pf)
        stats = c.stats()
        assert (stats.leases, stats.reserved_pages, stats.pool_used_bytes) == (1, 3, 3 * PAGE_BYTES)
        figures = scrape(stats.metrics_endpoint)
        assert figures[("hicached_pages", (("state", "reserved"),))] == 3
        assert figures[("hicached_leases", ())] == 1
        (tmp_path / "open").touch()
        wait_for(lambda: c.stats().leases == 0)
        stats = c.stats()
        assert (stats.reserved_pages, stats.pool_used_bytes) == (0, 0)


def test_a_prefetch_whose_store_check_ran_past_its_timeout_counts_until_the_check_ends(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A prefetch's first step asks the store which pages it holds; a check
    past storage.op_timeout_s fails the prefetch (done, failed), but the
    call still runs and holds its call slot (fault injection: every check
    waits until the test opens the gate), so the lease counts until it ends,
    released or not: leases.max_leases = 1 refuses a reservation meanwhile."""
    gate = tmp_path / "open"
    d = daemon_factory(
        allow_faults=True,
        storage=storage("faulty", more="op_timeout_s = 0.2\nscan_on_start = false\n"),
        tail=f'[storage.extra]\nexists_gate = "{gate}"\n[leases]\nmax_leases = 1\n',
    )
    with d.client() as c:
        ns = c.register(**NS)
        pf = c.prefetch(ns, _toks(0))
        done = wait_prefetch(c, pf)
        assert (done.failed, done.completed) == (True, 0)
        c.release(pf)
        with pytest.raises(ResourceExhausted, match=r"leases\.max_leases = 1"):
            c.reserve(ns, _toks(1))
        stats = c.stats()
        assert (stats.leases, stats.l3["store_calls_running"], stats.l3["timeouts"]) == (1, 1, 1)
        gate.touch()
        wait_for(lambda: c.stats().leases == 0)
        c.commit(c.reserve(ns, _toks(1)))


def _sighup(d: Daemon, config: str) -> str:
    assert d.proc is not None
    seen = len(d.log.read_text())
    d.config.write_text(config)
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = d.log.read_text()[seen:]
        if "reload of" in lines or "keeps running" in lines:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"no reload in the daemon's log:\n{d.log.read_text()}")


def test_a_reload_changes_the_shares_and_a_share_past_its_bound_changes_nothing(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(tail=f"[tenants.alpha]\nuids = [{os.getuid()}]\nmax_leases = 1\n")
    base = d.config.read_text()
    with d.client() as c:
        ns = c.register(**NS)
        c.reserve(ns, _toks(0))
        with pytest.raises(ResourceExhausted, match=r"tenants\.alpha\.max_leases"):
            c.reserve(ns, _toks(1))
        lines = _sighup(d, base.replace("max_leases = 1", "max_leases = 2"))
        assert "tenants.alpha.max_leases = 2" in lines
        c.reserve(ns, _toks(1))
        stats = c.stats()
        assert stats.tenant is not None
        assert (stats.tenant.leases, stats.tenant.max_leases, stats.tenant.max_clients) == (
            2,
            2,
            1024,
        )
        # server.max_clients moves the equal share; a share past its bound is refused whole
        lines = _sighup(d, base.replace("max_leases = 1", "max_leases = 2\nmax_clients = 8"))
        assert "tenants.alpha.max_clients = 8" in lines
        raised = base.replace("[pool]\n", "[pool]\nmax_namespaces = 7\n").replace(
            "max_leases = 1", "max_leases = 2\nmax_clients = 2000"
        )
        lines = _sighup(d, raised)
        assert "tenants.alpha.max_clients: 2000 is more than server.max_clients (1024)" in lines
        assert "keeps running" in lines
        stats = c.stats()
        assert stats.tenant is not None and stats.tenant.max_clients == 8
        assert stats.tenant.max_namespaces == 256


# -- over ipc, by uid ------------------------------------------------------------------


def _hold(endpoint: str, sessions: int) -> Callable[[], dict[str, object]]:
    """Open ``sessions`` sessions holding a lease each, then one more; leave
    them open (no goodbye: the process ends at once, as a crashed engine's)."""

    def work() -> dict[str, object]:
        out: dict[str, object] = {}
        held = []
        for i in range(sessions):
            c = Client(endpoint, timeout=5.0).connect()
            c.reserve(c.register(**NS), _toks(i))
            held.append(c)
        try:
            held.append(Client(endpoint, timeout=5.0).connect())
            out["more"] = "served"
        except ResourceExhausted as exc:
            out["more"] = exc.message
        stats = held[0].stats()
        assert stats.tenant is not None
        out["clients"] = stats.tenant.clients
        return out

    return work


def test_users_of_a_tenant_at_its_share_lock_out_no_other_tenants_user(
    users: Users, tmp_path: Path
) -> None:
    """server.max_clients = 4, two tenants by uid: each an equal share of 2.
    beta's user leaves an idle session; alpha's user holds 2 sessions with
    leases and its third hello is refused naming tenants.alpha.max_clients
    (before shares it took the fourth place of the table); beta's user's next
    hello is served and its idle session is still there."""
    import pwd

    (alpha_uid, _), (beta_uid, _), _ = users.ids
    metrics, token = metrics_token(tmp_path)
    d = Daemon(
        size_mib=16,
        extra=f'client_group = "{users.group}"\nmax_clients = 4',
        metrics=metrics,
        tail=f"[tenants.alpha]\nuids = [{alpha_uid}]\n[tenants.beta]\nuids = [{beta_uid}]\n",
    )
    os.chmod(d.dir, 0o711)  # the users pass through to the runtime directory
    try:
        d.start()
        endpoint = d.endpoint

        def idle() -> dict[str, object]:
            Client(endpoint, timeout=5.0).connect()  # no goodbye: an idle session stays
            return {}

        assert as_user(pwd.getpwuid(beta_uid), idle) == {}
        alpha = as_user(pwd.getpwuid(alpha_uid), _hold(endpoint, 2))
        assert alpha["clients"] == 2
        assert str(alpha["more"]).startswith("tenant 'alpha' holds 2 clients, its limit"), alpha

        def beta() -> dict[str, object]:
            with Client(endpoint, timeout=5.0) as c:
                stats = c.stats()
                assert stats.tenant is not None
                return {"clients": stats.tenant.clients, "all": stats.clients}

        # its own figures; the daemon's totals (4 clients) are not a tenant's to see
        assert as_user(pwd.getpwuid(beta_uid), beta) == {"clients": 2, "all": 0}
        with d.client() as c:  # the operator (root, the daemon's user) sees them
            assert c.stats().clients == 4  # alpha's two, beta's idle one, and this one
        with d.client() as c:
            endpoint = c.stats().metrics_endpoint
        figures = scrape(endpoint, token=token)
        clients = {
            name: figures[("hicached_tenant_held", (("of", "clients"), ("tenant", name)))]
            for name in ("alpha", "beta")
        }
        assert clients == {"alpha": 2, "beta": 1}  # beta's idle session, after its goodbye
    finally:
        d.cleanup()
