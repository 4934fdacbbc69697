"""events.group: the members of a group subscribe to the KV events over ipc, with
or without tenants; others stay out.

The tests with users of their own run subscribers as other users (forks of
this one that switch uid, as tests/test_tenants_review.py does) against a
daemon run as root; they need root and useradd, and are skipped, saying why,
elsewhere. The rest run as whoever runs the tests, with events.group set to
that user's own group.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicached.config import parse_config
from hicached.errors import ConfigError
from tests.support import NS, PAGE_TOKENS, Daemon
from tests.test_client_group import as_user
from tests.test_reload import _sighup
from tests.test_tenants import USERADD, Users, users
from tests.test_tenants_review import _Forked, _listen, _pw, _store, _tokens

_ = (users,)  # a fixture, used by name
ALL = {"live": 4 * PAGE_TOKENS, "replay": 4 * PAGE_TOKENS}  # every token id of the store
NONE = {"live": 0, "replay": 0}


@dataclass
class Routers:
    group: str  # events.group
    gid: int
    router: pwd.struct_passwd  # in events.group only
    both: pwd.struct_passwd  # in events.group and in the clients' group (users.group)


@pytest.fixture(scope="module")
def routers(users: Users) -> Iterator[Routers]:
    """A routers' group and two of its users, made for this module and removed after."""
    tag = f"hc{os.getpid() % 100000}"
    group, router, both = f"{tag}e", f"{tag}r", f"{tag}b"
    made: list[str] = []
    try:
        subprocess.run(["groupadd", group], check=True, capture_output=True)
        for name, groups in ((router, group), (both, f"{group},{users.group}")):
            subprocess.run(
                [*USERADD, "--groups", groups, name],
                check=True,
                capture_output=True,
            )
            made.append(name)
        yield Routers(group, grp.getgrnam(group).gr_gid, pwd.getpwnam(router), pwd.getpwnam(both))
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def _daemon(users: Users | None, group: str, *, where: str, tenants: bool = False) -> Daemon:
    """A daemon with KV events over ipc and events.group = ``group``, its sockets in
    the runtime directory (``where`` = "runtime") or in a directory of their own
    ("own"); with ``tenants``, the tenants of tests/test_tenants.py (alpha: the
    first user's uid, beta: the second's gid) and their clients' group."""
    extra, tail = "", "[events]\nflush_interval_s = 0.05\n"
    if tenants:
        assert users is not None
        (alpha_uid, _), (_, beta_gid), _ = users.ids
        extra = f'client_group = "{users.group}"'
        tail = (
            f"[tenants.alpha]\nuids = [{alpha_uid}]\n[tenants.beta]\ngids = [{beta_gid}]\n" + tail
        )
    d = Daemon(size_mib=16, extra=extra, tail=tail)
    sockets = d.runtime if where == "runtime" else d.dir / "events"
    d.config.write_text(
        d.config.read_text().replace(
            "[events]\n",
            f'[events]\nendpoint = "ipc://{sockets}/events.sock"\n'
            f'replay_endpoint = "ipc://{sockets}/replay.sock"\ngroup = "{group}"\n',
        )
    )
    os.chmod(d.dir, 0o711)  # the users here may pass the test's directory
    return d


def _sockets(d: Daemon) -> tuple[Path, Path]:
    events = parse_config(d.config.read_text()).events
    return Path(events.endpoint[len("ipc://") :]), Path(events.replay_endpoint[len("ipc://") :])


def _mode(path: Path) -> tuple[int, int]:
    st = path.stat()
    return stat.S_IMODE(st.st_mode), st.st_gid


def _subscribe(
    d: Daemon, who: list[pwd.struct_passwd], store: Callable[[], object]
) -> list[object]:
    """Each of ``who`` subscribes to the events and asks for a replay from 0
    while ``store`` stores _tokens(): how many of their token ids each saw."""
    events, replay = (f"ipc://{p}" for p in _sockets(d))
    listening = [_Forked(user, _listen(events, replay, 4.0)) for user in who]
    time.sleep(1.0)  # the subscriptions reach the daemon
    store()
    return [f.result() for f in listening]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tenants", [True, False], ids=["tenants", "no-tenants"])
def test_a_member_of_events_group_subscribes_and_others_do_not(
    users: Users, routers: Routers, tenants: bool
) -> None:
    """A router's user in events.group alone gets every batch, live and by
    replay, from sockets in a directory of their own; a client's user outside
    the group (beta's, with tenants: it reaches the request socket) gets none."""
    (a_uid, _), (b_uid, _), _ = users.ids
    d = _daemon(users, routers.group, where="own", tenants=tenants)
    try:
        d.start()
        events, replay = _sockets(d)
        assert _mode(events.parent) == (0o2750, routers.gid)
        assert _mode(events) == _mode(replay) == (0o660, routers.gid)
        if tenants:
            store = lambda: as_user(_pw(a_uid), _store(d.endpoint))  # noqa: E731
        else:
            store = _store(d.endpoint)  # this process: the request socket is its user's
        router, beta = _subscribe(d, [routers.router, _pw(b_uid)], store)
        assert router == ALL, router
        assert beta == NONE, beta
        if not tenants:
            return
        # Connecting takes write permission on the socket: at 0640 the group's
        # members are refused (their replay from 0 would hold every batch).
        events.chmod(0o640)
        replay.chmod(0o640)
        (refused,) = _subscribe(d, [routers.router], lambda: None)
        assert refused == NONE, refused
    finally:
        d.cleanup()


@pytest.mark.timeout(120)
def test_a_tenants_user_in_events_group_is_refused_and_a_router_is_not(
    users: Users, routers: Routers
) -> None:
    """A member of events.group that belongs to a tenant (alpha's user, by its
    uid) is refused by both sockets, with a warning: it read every tenant's
    pages and token ids, beta's too, live and by replay, where a tenant's CURVE
    key over tcp is refused. A router's user there that no tenant lists still
    gets every batch."""
    (a_uid, _), (b_uid, _), _ = users.ids
    alpha = _pw(a_uid)
    d = _daemon(users, routers.group, where="own", tenants=True)
    subprocess.run(["usermod", "-aG", routers.group, alpha.pw_name], check=True)
    try:
        d.start()
        seen_by_alpha, router = _subscribe(
            d, [alpha, routers.router], lambda: as_user(_pw(b_uid), _store(d.endpoint))
        )
        assert seen_by_alpha == NONE, seen_by_alpha
        assert router == ALL, router
        assert "belongs to tenant alpha" in d.log.read_text()
    finally:
        subprocess.run(["gpasswd", "-d", alpha.pw_name, routers.group], capture_output=True)
        d.cleanup()


@pytest.mark.timeout(120)
def test_in_the_runtime_directory_a_member_needs_the_clients_group_too(
    users: Users, routers: Routers
) -> None:
    """The runtime directory stays the clients' group's (0750): a router's user
    in both groups subscribes, one in events.group alone cannot pass it, and a
    tenant's user (clients' group alone) is refused by the socket; the log says
    what the members need."""
    (a_uid, _), (b_uid, _), _ = users.ids
    d = _daemon(users, routers.group, where="runtime", tenants=True)
    try:
        d.start()
        events, replay = _sockets(d)
        assert _mode(events.parent) == (0o750, users.gid)
        assert _mode(events) == _mode(replay) == (0o660, routers.gid)
        both, router, beta = _subscribe(
            d,
            [routers.both, routers.router, _pw(b_uid)],
            lambda: as_user(_pw(a_uid), _store(d.endpoint)),
        )
        assert (both, router, beta) == (ALL, NONE, NONE)
        assert f"only if they are in group {users.gid} too" in d.log.read_text()
    finally:
        d.cleanup()


# -- as whoever runs the tests ---------------------------------------------------------


def _own_group_daemon(**kwargs: object) -> Daemon:
    return _daemon(None, str(os.getgid()), **kwargs)  # type: ignore[arg-type]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicached", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.timeout(120)
def test_the_daemons_user_keeps_events_status_and_a_reload_refuses_the_change() -> None:
    """With events.group set, ``hicached events`` and ``hicached status`` work as
    the daemon's user; a reload that names no group changes nothing (a restart
    would fail), and one that changes the group is refused until a restart."""
    d = _own_group_daemon(where="own")
    try:
        d.start()
        events, replay = _sockets(d)
        assert _mode(events) == _mode(replay) == (0o660, os.getgid())
        assert _mode(events.parent) == (0o2750, os.getgid())
        _store(d.endpoint)()
        out = _cli("events", "--config", str(d.config), "--from", "0", "--json", "--count", "2")
        assert out.returncode == 0, out.stderr
        batches = [json.loads(line) for line in out.stdout.splitlines()]
        assert [b["seq"] for b in batches] == [0, 1]
        assert batches[1]["events"][0]["token_ids"] == _tokens().tolist()
        status = _cli("status", "--json", "--endpoint", d.endpoint)
        assert status.returncode == 0 and json.loads(status.stdout)["pages"] == 4

        base = d.config.read_text()
        group_line = f'group = "{os.getgid()}"'
        missing = base.replace(group_line, 'group = "hc-no-such-group"')
        lines = _sighup(d, missing.replace("[server]\n", "[log]\nlevel = 'debug'\n[server]\n", 1))
        assert "events.group: no group named 'hc-no-such-group' on this host" in lines, lines
        assert "keeps running with its config as it was" in lines, lines
        lines = _sighup(d, base.replace(group_line, 'group = ""'))
        assert "reload: events.group changed" in lines and "only a restart" in lines, lines
        assert _mode(events) == (0o660, os.getgid())
        with d.client() as c:  # still serving, pages and all
            assert c.match(c.register(**NS), _tokens(), lease=False).hits == 4
    finally:
        d.cleanup()


def test_a_group_no_member_may_reach_or_the_host_lacks_fails_the_start() -> None:
    """Exit 2 with a message: events.group for sockets in a runtime directory
    only the daemon's user may pass (no server.client_group), or a group the host
    does not have (check-config says so too)."""
    d = _own_group_daemon(where="runtime")
    try:
        with pytest.raises(RuntimeError, match="exited with 2") as info:
            d.start()
        assert "events.group: only its owner may pass" in str(info.value)
    finally:
        d.cleanup()
    d = _own_group_daemon(where="own")
    d.config.write_text(d.config.read_text().replace(f'"{os.getgid()}"', '"hc-no-such-group"'))
    try:
        with pytest.raises(RuntimeError, match="exited with 2") as info:
            d.start()
        message = "events.group: no group named 'hc-no-such-group' on this host"
        assert message in str(info.value)
        checked = _cli("check-config", str(d.config))
        assert checked.returncode == 2 and message in checked.stderr, checked.stderr
    finally:
        d.cleanup()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[server]\nclient_group = "cg"\n[tenants.a]\nuids = [1001]\n'
            '[events]\nendpoint = "ipc:///tmp/e.sock"\ngroup = "cg"\n',
            "events.group: with [tenants] it must not be server.client_group",
        ),
        (
            '[events]\nendpoint = "tcp://127.0.0.1:5560"\ngroup = "routers"\n',
            "events.group: group needs an ipc:// endpoint",
        ),
        ('[events]\ngroup = "routers"\n', "events.group: group needs an ipc:// endpoint"),
        (
            '[events]\nendpoint = "ipc:///tmp/e.sock"\ngroup = "a:b"\n',
            "events.group: group 'a:b': give one group name or number",
        ),
    ],
)
def test_events_group_config_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        parse_config(text)


def test_a_group_the_clients_group_may_be_without_tenants() -> None:
    text = (
        '[server]\nclient_group = "cg"\n'
        '[events]\nendpoint = "ipc:///tmp/e.sock"\nreplay_endpoint = "ipc:///tmp/r.sock"\n'
        'group = "cg"\n'
    )
    assert parse_config(text).events.group == "cg"


def test_the_clients_group_by_its_number_is_refused_with_tenants(users: Users) -> None:
    """With [tenants], events.group may not be server.client_group, whose members
    are every tenant's users. The config compared the two strings only: the
    clients' group by name in one and by number in the other passed, and every
    tenant's users read every tenant's token ids from the events. The start
    compares the groups themselves: exit 2, and check-config says so too."""
    d = _daemon(users, str(users.gid), where="own", tenants=True)
    try:
        message = "events.group: with [tenants] it must not be server.client_group"
        with pytest.raises(RuntimeError, match="exited with 2") as info:
            d.start()
        assert message in str(info.value)
        checked = _cli("check-config", str(d.config))
        assert checked.returncode == 2 and message in checked.stderr, checked.stderr
    finally:
        d.cleanup()


@pytest.mark.parametrize(
    ("group", "message"),
    [
        # (gid_t)-1: chown's "leave the group as it is", so the sockets stayed
        # 0660 of the daemon's own group
        ("4294967295", "events.group: no group numbered 4294967295 on this host"),
        ("3999999999", "events.group: no group numbered 3999999999 on this host"),
        ("99999999999999999999", "events.group: no group numbered 99999999999999999999"),
        ("\u00b2", "events.group: no group named '\u00b2' on this host"),  # isdigit, not int
    ],
)
def test_a_group_number_the_host_lacks_fails_the_start(group: str, message: str) -> None:
    """A group given by a number the host has no group for is refused as a name
    the host lacks is (docs/events.md): it was taken as is, and a root daemon
    gave its sockets to no one's group, or, for 4294967295, left them 0660 of
    its own group; a number past 32 bits, or a digit that is not 0-9, ended the
    start with a traceback."""
    d = _own_group_daemon(where="own")
    d.config.write_text(d.config.read_text().replace(f'"{os.getgid()}"', json.dumps(group)))
    try:
        with pytest.raises(RuntimeError, match="exited with 2") as info:
            d.start()
        assert message in str(info.value)
        checked = _cli("check-config", str(d.config))
        assert checked.returncode == 2 and message in checked.stderr, checked.stderr
    finally:
        d.cleanup()
