"""server.client_group with real users: an engine in the group connects, maps
the pool and reads pages back; a user outside it is refused.

Needs root, to make the users (removed afterwards) and to become them. The
processes that play the engine, the other user and (in one case) the daemon
are forks of this one that switch uid with setuid(2) before they act, so they
need no interpreter of their own that the other users could run.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import logging
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import hicached.cli
import hicached.server  # imported before a fork drops root: the daemon's code
from hicached.arena import arena_path
from hicached.client import Client
from hicached.errors import DaemonUnavailable
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd"),
    reason="needs root and useradd/groupadd: it creates users and runs processes as them",
)

_ = (hicached.server, hicached.cli)


@dataclass
class Accounts:
    group: str  # the clients' group
    gid: int
    daemon: pwd.struct_passwd  # a member, as the service user is
    engine: pwd.struct_passwd  # a member
    other: pwd.struct_passwd  # not a member


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def accounts() -> Iterator[Accounts]:
    tag = f"hc{os.getpid() % 100000}"
    group = f"{tag}-clients"
    names = {"daemon": f"{tag}-daemon", "engine": f"{tag}-engine", "other": f"{tag}-other"}
    made_users: list[str] = []
    made_group = False
    try:
        _run("groupadd", "--system", group)
        made_group = True
        for role, name in names.items():
            extra = ["-G", group] if role != "other" else []
            _run(
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--user-group",
                *extra,
                name,
            )
            made_users.append(name)
        yield Accounts(
            group=group,
            gid=grp.getgrnam(group).gr_gid,
            daemon=pwd.getpwnam(names["daemon"]),
            engine=pwd.getpwnam(names["engine"]),
            other=pwd.getpwnam(names["other"]),
        )
    finally:
        for name in made_users:
            subprocess.run(["userdel", name], capture_output=True)
        if made_group:
            subprocess.run(["groupdel", group], capture_output=True)


def become(user: pwd.struct_passwd, primary: int | None = None) -> None:
    """Drop root for ``user``, with its groups; ``primary`` replaces its own group."""
    groups = os.getgrouplist(user.pw_name, user.pw_gid)
    os.setgroups(groups)
    os.setgid(user.pw_gid if primary is None else primary)
    os.setuid(user.pw_uid)
    assert os.geteuid() == user.pw_uid and os.getegid() in (primary, user.pw_gid)


def as_user(
    user: pwd.struct_passwd,
    work: Callable[[], dict[str, object]],
    timeout: float = 30.0,
    primary: int | None = None,
) -> dict[str, object]:
    """Run ``work`` in a fork of this process as ``user`` (``primary``: its
    current gid instead of its own group); its result as a dict."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only os._exit
        code = 0
        try:
            os.close(read)
            become(user, primary)
            result = work()
        except BaseException as exc:
            result, code = {"crash": f"{type(exc).__name__}: {exc}"}, 1
        try:
            os.write(write, json.dumps(result).encode())
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    deadline = time.monotonic() + timeout
    with os.fdopen(read, "rb") as pipe:
        chunks.append(pipe.read())
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the process as {user.pw_name} did not finish")
        time.sleep(0.01)
    return dict(json.loads(b"".join(chunks) or b"{}"))


def engine_work(endpoint: str) -> Callable[[], dict[str, object]]:
    """Store pages, read them back through the mapped pool, say what happened."""

    def work() -> dict[str, object]:
        toks = np.arange(0, 4 * PAGE_TOKENS, dtype=np.uint32) + os.getuid()
        want = page_bytes_for(toks)
        with Client(endpoint, timeout=5.0) as c:
            ns = c.register(**NS)
            c.store(ns, toks, want)
            hit = c.match(ns, toks)
            try:
                got = c.read_pages(hit)
            finally:
                c.release(hit)
        return {"pages": len(got), "same": bool(np.array_equal(got, want)), "uid": os.getuid()}

    return work


def outsider_work(endpoint: str, pool: str) -> Callable[[], dict[str, object]]:
    """Try the socket, the socket's path and the pool file; say what each did."""

    def work() -> dict[str, object]:
        result: dict[str, object] = {"uid": os.getuid()}
        sock_path = endpoint[len("ipc://") :]
        try:
            os.stat(sock_path)
            result["stat"] = "ok"
        except OSError as exc:
            result["stat"] = errno.errorcode[exc.errno or 0]
        try:
            os.close(os.open(pool, os.O_RDWR))
            result["pool"] = "ok"
        except OSError as exc:
            result["pool"] = errno.errorcode[exc.errno or 0]
        try:
            with Client(endpoint, timeout=2.0, connect_timeout=0.5) as c:
                c.stats()
            result["connect"] = "ok"
        except DaemonUnavailable as exc:
            result["connect"] = f"unavailable: {exc}"
        return result

    return work


@contextlib.contextmanager
def daemon_as(user: pwd.struct_passwd, primary: int, config: Path, log: Path) -> Iterator[int]:
    """``hicached serve`` in a fork of this process running as ``user`` (group
    ``primary``, umask 0077 as the unit sets), like the service."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)  # noqa: SIM115
            logging.root.handlers.clear()  # the test runner's; serve sets its own
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            become(user, primary)
            os.umask(0o077)
            code = hicached.cli.main(["serve", "--config", str(config)])
        except BaseException as exc:
            print(f"crash: {type(exc).__name__}: {exc}", flush=True)
        finally:
            os._exit(code)
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(ChildProcessError):  # already reaped by the test
            deadline = time.monotonic() + 10
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.02)


def scratch_dir(owner: pwd.struct_passwd) -> Path:
    """A directory under /tmp that ``owner`` may create in and others may pass."""
    base = Path(tempfile.mkdtemp(prefix="hc-grp-", dir="/tmp"))
    os.chown(base, owner.pw_uid, owner.pw_gid)
    base.chmod(0o711)
    return base


def check_modes(runtime: Path, endpoint: str, pool: Path, gid: int) -> None:
    for path, mode in ((runtime, 0o750), (Path(endpoint[len("ipc://") :]), 0o660), (pool, 0o660)):
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, gid), path
    assert stat.S_IMODE((runtime / "hicached.lock").stat().st_mode) == 0o600


def check_engine_and_outsider(accounts: Accounts, endpoint: str, pool: Path) -> None:
    engine = as_user(accounts.engine, engine_work(endpoint))
    assert engine == {"pages": 4, "same": True, "uid": accounts.engine.pw_uid}, engine
    other = as_user(accounts.other, outsider_work(endpoint, str(pool)))
    assert other["uid"] == accounts.other.pw_uid, other
    assert other["stat"] == "EACCES" and other["pool"] == "EACCES", other
    assert str(other["connect"]).startswith("unavailable"), other
    again = as_user(accounts.engine, engine_work(endpoint))  # the daemon still serves
    assert again["same"] is True, again


def test_a_root_daemon_lets_the_group_in_and_keeps_others_out(accounts: Accounts) -> None:
    d = Daemon(extra=f'client_group = "{accounts.group}"', metrics="enabled = false")
    d.dir.chmod(0o711)  # others may pass through to the runtime directory, no further
    try:
        d.start()
        pool = arena_path("/dev/shm", d.runtime)
        check_modes(d.runtime, d.endpoint, pool, accounts.gid)
        check_engine_and_outsider(accounts, d.endpoint, pool)
    finally:
        d.cleanup()


@pytest.mark.parametrize("primary", ["clients", "own"])
def test_a_daemon_user_in_the_group_shares_with_engines(accounts: Accounts, primary: str) -> None:
    """The daemon as a user of its own: with the clients' group as its group
    (as the unit runs it: no chown needed), or as a member only (it gives the
    directory, socket and pool to the group itself)."""
    gid = accounts.gid if primary == "clients" else accounts.daemon.pw_gid
    base = scratch_dir(accounts.daemon)
    runtime = base / "run"
    endpoint = f"ipc://{runtime}/hicached.sock"
    config = base / "hicached.toml"
    config.write_text(
        f'[server]\nruntime_dir = "{runtime}"\nclient_group = "{accounts.group}"\n'
        "[pool]\nsize_mib = 16\nslab_mib = 1\nmax_page_bytes = 262144\n"
        "[metrics]\nenabled = false\n"
    )
    config.chmod(0o644)
    log = base / "daemon.log"
    pools = f"hicached-{accounts.daemon.pw_uid}-*.pool"
    try:
        with daemon_as(accounts.daemon, gid, config, log) as pid:
            deadline = time.monotonic() + 30
            while not (runtime / "hicached.sock").exists():
                assert os.waitpid(pid, os.WNOHANG) == (0, 0), log.read_text()
                assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
                time.sleep(0.05)
            (pool,) = Path("/dev/shm").glob(pools)
            st = runtime.stat()
            assert st.st_uid == accounts.daemon.pw_uid
            check_modes(runtime, endpoint, pool, accounts.gid)
            check_engine_and_outsider(accounts, endpoint, pool)
        journal = pool.with_name(pool.name + ".journal")
        assert pool.exists() and journal.exists(), "a stop leaves the pool for the next start"
        assert stat.S_IMODE(journal.stat().st_mode) == 0o600, "the journal is the daemon's alone"
        assert "stopped" in log.read_text(), log.read_text()
    finally:
        for stale in Path("/dev/shm").glob(pools + "*"):  # and its journal
            stale.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


def test_the_group_cannot_be_taken_by_a_non_member(accounts: Accounts) -> None:
    """A daemon whose user is not in server.client_group fails at start, exit 2."""
    base = scratch_dir(accounts.other)
    config = base / "hicached.toml"
    config.write_text(
        f'[server]\nruntime_dir = "{base}/run"\nclient_group = "{accounts.group}"\n'
        "[pool]\nsize_mib = 16\nslab_mib = 1\nmax_page_bytes = 262144\n[metrics]\nenabled = false\n"
    )
    config.chmod(0o644)
    log = base / "daemon.log"
    try:
        with daemon_as(accounts.other, accounts.other.pw_gid, config, log) as pid:
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 2, log.read_text()
        assert "server.client_group: cannot give" in log.read_text()
    finally:
        shutil.rmtree(base, ignore_errors=True)
