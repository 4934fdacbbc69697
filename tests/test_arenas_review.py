"""Tenant arenas under attack: what an outsider tries to reach another
tenant's KV bytes through restarts, adoption and tcp.

Real daemons and real users (tests/test_tenants.py's ``users``: root and
useradd, skipped elsewhere); client processes are forks that switch uid
(tests/test_client_group.py ``as_user``).
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hicached import Client, CurveKeys
from hicached.wire.arena import arena_path
from hicached.wire.arenas import tenant_arena_path
from tests.support import NS, Daemon
from tests.test_arenas import _errno, _open, _pages, _pw, _toks, store_work
from tests.test_client_group import as_user
from tests.test_tenants import Users, _keygen, users

_ = users  # fixture, used by name
MIB = 1 << 20


def _tenants(alpha: str, beta: str) -> str:
    return f"[tenants.alpha]\n{alpha}\n[tenants.beta]\n{beta}\n"


@pytest.fixture
def two_uids(users: Users) -> Iterator[Daemon]:
    """A daemon (as root) whose tenants alpha and beta are the first and the
    second user's uids, adopting its pool across restarts."""
    (a_uid, _), (b_uid, _), _ = users.ids
    d = Daemon(
        size_mib=16,
        extra=f'client_group = "{users.group}"',
        tail=_tenants(f"uids = [{a_uid}]", f"uids = [{b_uid}]"),
    )
    os.chmod(d.dir, 0o711)
    try:
        yield d.start()
    finally:
        d.cleanup()


def _restart_as(d: Daemon, tail: str) -> None:
    """kill -9, then a start that adopts, with the tenants of ``tail``."""
    text = d.config.read_text()
    head = text[: text.index("[tenants.alpha]")]
    d.config.write_text(head + tail)
    d.fresh = False
    d.kill()
    d.start()


def peek_work(endpoint: str, seed: int) -> Callable[[], dict[str, object]]:
    """Match ``seed``'s tokens in this peer's own namespace; say whether the
    bytes read are ``seed``'s."""

    def work() -> dict[str, object]:
        with Client(endpoint, timeout=5.0) as c:
            ns = c.register(**NS)
            hit = c.match(ns, _toks(seed))
            got = c.read_pages(hit) if hit.hits else np.empty((0, 4096), np.uint8)
            return {
                "hits": hit.hits,
                "theirs": bool(hit.hits) and bool(np.array_equal(got, _pages(seed)[: hit.hits])),
            }

    return work


def hold_work(path: str, seed: int) -> Callable[[], dict[str, object]]:
    """Open the own arena file (allowed now), keep the descriptor over a
    restart that no longer lists this uid, and look for ``seed``'s pages in
    it after the new tenant of that arena wrote them."""

    def work() -> dict[str, object]:
        fd = os.open(path, os.O_RDONLY)
        flag = Path(path + ".test-restarted")
        deadline = time.monotonic() + 20
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        data = np.frombuffer(os.pread(fd, 8 * MIB, 0), dtype=np.uint8)
        rows = data[: len(data) // 4096 * 4096].reshape(-1, 4096)
        found = sum(int((rows == page).all(axis=1).any()) for page in _pages(seed))
        os.close(fd)
        return {"found": found}

    return work


def test_tenants_whose_uids_changed_across_a_kill_do_not_adopt_each_others_arena(
    two_uids: Daemon, users: Users
) -> None:
    """alpha's uid and beta's are swapped in the config, then kill -9 and a
    start that adopts: alpha's pages (written by the first user) must not be
    served to the second user, who is alpha now; the arena files are made anew."""
    (a_uid, _), (b_uid, _), _ = users.ids
    d = two_uids
    path = tenant_arena_path("/dev/shm", d.runtime, "alpha")
    assert as_user(_pw(a_uid), store_work(d.endpoint, 31))["same"]
    before = os.stat(path).st_ino
    _restart_as(d, _tenants(f"uids = [{b_uid}]", f"uids = [{a_uid}]"))
    got = as_user(_pw(b_uid), peek_work(d.endpoint, 31))
    assert got == {"hits": 0, "theirs": False}, got
    assert os.stat(path).st_ino != before  # a new file: old descriptors see nothing new
    assert "not adopting the tenant arenas" in d.log.read_text()


def test_a_tenant_that_becomes_the_others_tenant_is_not_adopted(
    two_uids: Daemon, users: Users
) -> None:
    """alpha's private pages must not become the others tenant's, whose arena
    every member of the client group opens."""
    (a_uid, _), (b_uid, _), (n_uid, _) = users.ids
    d = two_uids
    assert as_user(_pw(a_uid), store_work(d.endpoint, 32))["same"]
    _restart_as(d, _tenants("others = true", f"uids = [{b_uid}]"))
    got = as_user(_pw(n_uid), peek_work(d.endpoint, 32))  # no tenant lists it: others
    assert got == {"hits": 0, "theirs": False}, got


def test_a_descriptor_kept_over_a_restart_that_drops_its_uid_sees_nothing_new(
    two_uids: Daemon, users: Users
) -> None:
    """The first user keeps alpha's file open; a restart gives alpha to the
    second user only; what the second user stores must not appear in the
    first user's descriptor (the ACL is checked at open only)."""
    (a_uid, _), (b_uid, _), (n_uid, _) = users.ids
    d = two_uids
    path = str(tenant_arena_path("/dev/shm", d.runtime, "alpha"))
    flag = Path(path + ".test-restarted")
    flag.unlink(missing_ok=True)
    out: dict[str, object] = {}
    spy = threading.Thread(target=lambda: out.update(as_user(_pw(a_uid), hold_work(path, 33))))
    spy.start()
    try:
        time.sleep(1.0)  # the descriptor is open by now
        _restart_as(d, _tenants(f"uids = [{b_uid}]", f"uids = [{n_uid}]"))
        assert as_user(_pw(b_uid), store_work(d.endpoint, 33))["same"]
    finally:
        flag.touch()
        spy.join(30)
        flag.unlink(missing_ok=True)
    assert out == {"found": 0}, out


def test_arena_files_are_not_open_to_others_and_acl_names_only_the_tenant(
    two_uids: Daemon, users: Users
) -> None:
    """getfacl, by reading the xattr: owner rw, the tenant's uid rw, group-obj
    none, mask rw, other none; and nothing else."""
    (a_uid, _), (b_uid, _), _ = users.ids
    for tenant, uid in (("alpha", a_uid), ("beta", b_uid)):
        path = tenant_arena_path("/dev/shm", two_uids.runtime, tenant)
        raw = os.getxattr(path, "system.posix_acl_access")
        (version,) = struct.unpack_from("<I", raw)
        entries = [struct.unpack_from("<HHI", raw, 4 + 8 * i) for i in range((len(raw) - 4) // 8)]
        assert version == 2
        assert entries == [
            (0x01, 6, 0xFFFFFFFF),
            (0x02, 6, uid),
            (0x04, 0, 0xFFFFFFFF),
            (0x10, 6, 0xFFFFFFFF),
            (0x20, 0, 0xFFFFFFFF),
        ], (tenant, entries)
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o007 == 0


# -- tenants over tcp: one pool file ------------------------------------------------------


def test_curve_tenants_over_tcp_cannot_read_each_others_pages_in_the_pool(
    users: Users, tmp_path: Path
) -> None:
    """Two CURVE tenants of one host over tcp, both users in the clients'
    group: the pool would be one file, which the group opens (0660) and every
    tcp client of the host maps whole at hello, so beta would read alpha's
    pages out of its own mapping. Such a configuration is refused (exit 2),
    and without client_group the pool is the daemon's own: neither tenant's
    user can open it, and neither finds the other's pages."""
    (a_uid, _), (b_uid, _), _ = users.ids
    server_public, server_secret = _keygen(tmp_path / "server", "daemon")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    made = {name: _keygen(tmp_path / "clients", name) for name in ("a1", "b1")}
    for name, (public, _) in made.items():
        shutil.copy(public, authorized / f"{name}.key")
    keys = {name: CurveKeys.load(str(server_public), str(made[name][1])) for name in made}
    tail = (
        f'[curve]\nsecret_key_file = "{server_secret}"\n'
        f'authorized_keys_dir = "{authorized}"\n'
        '[tenants.alpha]\ncurve_keys = ["a1.key"]\n'
        '[tenants.beta]\ncurve_keys = ["b1.key"]\n'
    )
    shared = Daemon(tcp=True, curve=keys["a1"], extra=f'client_group = "{users.group}"', tail=tail)
    try:
        with pytest.raises(RuntimeError, match="exited with 2") as refused:
            shared.start()
        assert "with [tenants] over a tcp:// endpoint the pool is one file" in str(refused.value)
    finally:
        shared.cleanup()
    d = Daemon(tcp=True, curve=keys["a1"], tail=tail)
    try:
        d.start()
        pool = str(arena_path("/dev/shm", d.runtime))
        assert stat.S_IMODE(os.stat(pool).st_mode) == 0o600
        for uid in (a_uid, b_uid):
            got = as_user(_pw(uid), lambda: {"open": _errno(lambda: _open(pool))})
            assert got == {"open": "EACCES"}, got
    finally:
        d.cleanup()


def test_arenas_with_madvise_huge_pages_store_and_adopt(users: Users) -> None:
    """pool.huge_pages = madvise with arenas: each tenant stores and reads its
    pages, and after kill -9 finds them again in its own file."""
    (a_uid, _), (b_uid, _), _ = users.ids
    d = Daemon(
        size_mib=16,
        extra=f'client_group = "{users.group}"',
        tail=_tenants(f"uids = [{a_uid}]", f"uids = [{b_uid}]"),
    )
    d.config.write_text(
        d.config.read_text().replace("[pool]\n", '[pool]\nhuge_pages = "madvise"\n')
    )
    os.chmod(d.dir, 0o711)
    try:
        d.start()
        assert as_user(_pw(a_uid), store_work(d.endpoint, 51))["same"]
        assert as_user(_pw(b_uid), store_work(d.endpoint, 52))["same"]
        d.fresh = False
        d.kill()
        d.start()
        for uid, mine, theirs in ((a_uid, 51, 52), (b_uid, 52, 51)):
            assert as_user(_pw(uid), peek_work(d.endpoint, mine)) == {"hits": 4, "theirs": True}
            assert as_user(_pw(uid), peek_work(d.endpoint, theirs))["hits"] == 0
    finally:
        d.cleanup()
