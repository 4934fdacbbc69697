"""Who may scrape the metrics: with [tenants], only a scraper that shows the
bearer token (metrics.token_file) or a client certificate, since the metrics
name every tenant and the loopback port is open to every local user; without
tenants, anyone, as before, unless a token is set. Real daemons over real
HTTP; the users of tests/test_tenants.py (root only) for a tenant's own view."""

from __future__ import annotations

import contextlib
import ctypes
import encodings.idna  # noqa: F401  (loaded here: the forks as other users may not read it)
import io
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from hicached import Client
from hicached.cli import main
from hicached.config import parse_config
from hicached.daemon.metrics_http import MAX_SCRAPES, MIN_TOKEN_CHARS, read_token
from hicached.daemon.tenants import OPERATOR
from hicached.errors import ConfigError
from hicached.testing import scrape
from hicached.wire import protocol as p
from tests.support import NS, PAGE_TOKENS, Daemon, free_tcp_port, metrics_token, page_bytes_for
from tests.test_client_group import as_user
from tests.test_tenants import Users, users

_ = (users,)  # a fixture, used by name

REFUSED = ("hicached_metrics_refused_total", ())
CLONE_NEWUSER = 0x10000000  # sched.h
PR_SET_DUMPABLE = 4  # linux/prctl.h


def _get(url: str, authorization: str | None = None) -> tuple[int, bytes, dict[str, str]]:
    """One GET: (status, body, headers), a refusal included."""
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(), dict(exc.headers)


def _endpoint(d: Daemon) -> str:
    with d.client() as c:
        url = c.stats().metrics_endpoint
    assert url.startswith("http://127.0.0.1:")
    return url


def _up(environ: dict[str, object], start_response: Callable[..., object]) -> list[bytes]:
    """An app that answers every scrape ``up 1``."""
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"up 1\n"]


@contextlib.contextmanager
def _in_process(app: Callable[..., list[bytes]] = _up) -> Iterator[tuple[Any, int]]:
    """The metrics listener in this process on a real socket, serving ``app``
    without a token: (listener, its port); stopped after."""
    from hicached.daemon import metrics_http
    from hicached.metrics_config import MetricsConfig

    listener = metrics_http.Listener(
        MetricsConfig(port=free_tcp_port()), metrics_http.Gate(app, None)
    )
    listener.start()
    try:
        yield listener, int(listener.endpoint.rsplit(":", 1)[1].split("/")[0])
    finally:
        listener.stop()


def _tenants(uid: int = os.getuid()) -> str:
    return f"[tenants.alpha]\nuids = [{uid}]\n[tenants.beta]\nuids = [65001]\n"


def _store(d: Daemon, pages: int = 2) -> None:
    with d.client() as c:
        ns = c.register(**NS)
        tokens = np.arange(pages * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, tokens, page_bytes_for(tokens))


def _refused(status: int, body: bytes, headers: dict[str, str]) -> bool:
    """A refusal as the endpoint gives it, whatever was wrong: 401, no body."""
    challenge = headers.get("WWW-Authenticate", "")
    return status == 401 and body == b"" and challenge.startswith("Bearer")


# -- a real daemon over HTTP ---------------------------------------------------------


def test_without_tenants_metrics_are_served_to_anyone_as_before(daemon: Daemon) -> None:
    status, body, _ = _get(_endpoint(daemon))
    assert status == 200 and b"hicached_uptime_seconds" in body
    # a header that means nothing here changes nothing either
    assert _get(_endpoint(daemon), "Bearer whatever")[0] == 200


def test_with_tenants_and_no_credential_every_scrape_is_refused(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """The daemon serves its clients; the endpoint refuses everyone, and the
    log says why and what to set."""
    d = daemon_factory(tail=_tenants())
    _store(d)  # alpha's pages: what a scrape would show
    url = _endpoint(d)
    for authorization in (None, "Bearer " + "x" * 64, "Basic YTpi"):
        assert _refused(*_get(url, authorization)), authorization
    log = d.log.read_text()
    assert "with [tenants] every scrape is refused (401)" in log
    assert "metrics.token_file" in log


def test_with_tenants_only_the_token_gets_the_metrics(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    metrics, token = metrics_token(tmp_path)
    d = daemon_factory(tail=_tenants(), metrics=metrics)
    _store(d, pages=3)
    url = _endpoint(d)
    wrong = [
        None,  # no header
        f"Bearer {token[:-1]}",  # one character short
        f"Bearer {token}x",  # one too many
        f"Bearer {token[:-1]}{'0' if token[-1] != '0' else '1'}",  # the last one differs
        f"Basic {token}",  # another scheme
        token,  # no scheme
    ]
    for authorization in wrong:
        assert _refused(*_get(url, authorization)), authorization
    for authorization in (f"Bearer {token}", f"bearer  {token} "):  # the scheme in any case
        status, body, _ = _get(url, authorization)
        assert status == 200 and b"hicached_tenant_pages" in body, authorization
    figures = scrape(url, token=token)
    assert figures[("hicached_tenant_pages", (("tenant", "alpha"),))] == 3
    assert ("hicached_tenant_pages", (("tenant", "beta"),)) in figures
    assert figures[REFUSED] == len(wrong)


def test_without_tenants_a_token_once_set_is_required(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    metrics, token = metrics_token(tmp_path)
    d = daemon_factory(metrics=metrics)
    url = _endpoint(d)
    assert _refused(*_get(url))
    assert scrape(url, token=token)[REFUSED] == 1


def test_a_reload_reads_the_token_again_and_a_bad_file_keeps_the_old_one(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    metrics, old = metrics_token(tmp_path)
    d = daemon_factory(tail=_tenants(), metrics=metrics)
    url = _endpoint(d)
    _, new = metrics_token(tmp_path)  # the same file, a new token
    lines = _sighup(d)
    assert "metrics.token_file = '(a new token)'" in lines and new not in lines
    assert _refused(*_get(url, f"Bearer {old}"))
    assert scrape(url, token=new)[("hicached_reloads_total", (("result", "applied"),))] == 1

    os.chmod(tmp_path / "metrics.token", 0o640)  # the group may read it now
    lines = _sighup(d)
    assert "mode 0640 lets its group or others read or change it" in lines
    assert "keeps running with its config as it was" in lines
    figures = scrape(url, token=new)  # the token before it still opens, nothing else
    assert figures[("hicached_reloads_total", (("result", "invalid"),))] == 1
    assert _refused(*_get(url, f"Bearer {old}"))


def _sighup(d: Daemon) -> str:
    """Send SIGHUP; the log lines of the reload."""
    assert d.proc is not None
    before = len(d.log.read_text())
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = d.log.read_text()[before:]
        if "reload of" in lines or "keeps running" in lines:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"no reload in the daemon's log:\n{d.log.read_text()}")


def test_a_bad_token_file_fails_the_start_naming_the_key(tmp_path: Path) -> None:
    metrics, _ = metrics_token(tmp_path)
    os.chmod(tmp_path / "metrics.token", 0o644)
    d = Daemon(metrics=metrics)
    try:
        with pytest.raises(RuntimeError, match=r"metrics\.token_file: .*mode 0644"):
            d.start(timeout=20)
        assert d.proc is not None and d.proc.wait(timeout=10) == 2
    finally:
        d.cleanup()


def test_check_config_reads_the_token_file_and_warns_of_a_locked_endpoint(
    tmp_path: Path,
) -> None:
    metrics, _ = metrics_token(tmp_path)
    config = tmp_path / "hicached.toml"

    def check(text: str) -> subprocess.CompletedProcess[str]:
        config.write_text(text)
        return subprocess.run(
            [sys.executable, "-m", "hicached", "check-config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = check(f"[metrics]\n{metrics}\n" + _tenants())
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    locked = check(_tenants())
    assert locked.returncode == 0
    assert "warning: metrics: with [tenants] every scrape is refused" in locked.stderr
    os.chmod(tmp_path / "metrics.token", 0o604)
    bad = check(f"[metrics]\n{metrics}\n")
    assert bad.returncode == 2 and "mode 0604" in bad.stderr


# -- the token file ------------------------------------------------------------------


def _write(path: Path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_the_token_is_read_trimmed_as_prometheus_trims_it(tmp_path: Path) -> None:
    token = b"a" * MIN_TOKEN_CHARS
    assert read_token(_write(tmp_path / "t", b"  " + token + b"\r\n")) == token
    assert read_token(_write(tmp_path / "t", token, 0o400)) == token


@pytest.mark.parametrize(
    ("data", "mode", "message"),
    [
        (b"a" * 32, 0o640, "mode 0640 lets its group or others"),
        (b"a" * 32, 0o604, "mode 0604"),
        (b"a" * 32, 0o620, "mode 0620"),  # the group could replace it
        (b"", 0o600, "one token of visible ASCII"),
        (b"two words-long-enough-anyway", 0o600, "no spaces"),
        (b"\xff" * 32, 0o600, "visible ASCII"),
        (b"a" * (MIN_TOKEN_CHARS - 1), 0o600, f"fewer than {MIN_TOKEN_CHARS}"),
        (b"a" * 5000, 0o600, "larger than 4096 bytes"),
    ],
)
def test_a_bad_token_file_is_a_config_error(
    tmp_path: Path, data: bytes, mode: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=r"^metrics\.token_file: .*" + message):
        read_token(_write(tmp_path / "t", data, mode))


def test_a_token_file_of_another_user_or_not_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot open it"):
        read_token(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="not a regular file"):
        read_token(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):  # and no hang
        read_token(str(fifo))
    if os.geteuid() != 0:
        return  # a file of another user's needs root to make
    path = _write(tmp_path / "t", b"a" * 32)
    os.chown(path, 65001, -1)
    with pytest.raises(ConfigError, match="owned by uid 65001, not by the daemon's user"):
        read_token(path)
    assert read_token(path, check_owner=False) == b"a" * 32  # check-config as root


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('token_file = "metrics.token"', "metrics.token_file: token_file must be an absolute"),
        ('host = "0.0.0.0"\ntoken_file = "/t"', "off loopback only over HTTPS"),
    ],
)
def test_bad_token_settings_are_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(f"[metrics]\n{text}\n")


def test_off_loopback_a_token_over_https_will_do() -> None:
    config = parse_config(
        '[metrics]\nhost = "0.0.0.0"\ntls_cert = "/c.pem"\ntls_key = "/k.pem"\n'
        f'token_file = "/t"\nport = {free_tcp_port()}\n'
    )
    assert config.metrics.authenticated


# -- what a tenant's users see --------------------------------------------------------


@pytest.fixture
def two_tenants(users: Users, tmp_path: Path) -> Iterator[tuple[Daemon, str]]:
    """A daemon (as root) whose clients are the users of tests/test_tenants.py:
    alpha the first one's uid, beta the second's; the third belongs to none.
    Its metrics need the token, in a file of root's."""
    (alpha_uid, _), (beta_uid, _), _ = users.ids
    metrics, token = metrics_token(tmp_path)
    d = Daemon(
        size_mib=16,
        extra=f'client_group = "{users.group}"',
        metrics=metrics,
        tail=f"[tenants.alpha]\nuids = [{alpha_uid}]\n[tenants.beta]\nuids = [{beta_uid}]\n",
    )
    os.chmod(d.dir, 0o711)  # the users pass through to the runtime directory
    try:
        yield d.start(), token
    finally:
        d.cleanup()


def _as(uid: int, work: Callable[[], dict[str, object]]) -> dict[str, object]:
    result = as_user(pwd.getpwuid(uid), work, timeout=60)
    assert "crash" not in result, result
    return result


def test_a_tenants_user_scrapes_nothing_and_its_status_shows_its_own_tenant_alone(
    two_tenants: tuple[Daemon, str], users: Users, tmp_path: Path
) -> None:
    """alpha and beta each store pages as their own users; then each user,
    and a user of no tenant, asks for the daemon's status over the client
    socket (the stats request, and `hicached status`) and scrapes the metrics
    port: the status is the daemon's totals (counts, no names) and the user's
    own tenant's figures, never the other's, and the scrape is refused (the
    token file is root's: no user reads it)."""
    d, token = two_tenants
    (alpha, _), (beta, _), (nobody, _) = users.ids
    url = _endpoint(d)
    token_file = str(tmp_path / "metrics.token")

    def tenant(pages: int) -> Callable[[], dict[str, object]]:
        def work() -> dict[str, object]:
            with Client(d.endpoint, timeout=10.0, name=f"engine-{os.getuid()}") as c:
                if pages:
                    ns = c.register(**NS)
                    tokens = np.arange(pages * PAGE_TOKENS, dtype=np.uint32) + os.getuid()
                    c.store(ns, tokens, page_bytes_for(tokens))
                    c.release(c.match(ns, tokens))
                stats = msgspec.to_builtins(c.stats())
            status = io.StringIO()
            with contextlib.redirect_stdout(status):
                assert main(["status", "--endpoint", d.endpoint]) == 0
            try:
                with open(token_file, "rb"):
                    readable = True
            except PermissionError:
                readable = False
            code, body, _ = _get(url)
            return {
                "stats": stats,
                "status": status.getvalue(),
                "scrape": [code, body.decode()],
                "readable": readable,
            }

        return work

    seen = {"alpha": _as(alpha, tenant(3)), "beta": _as(beta, tenant(5))}
    seen["nobody"] = _as(nobody, tenant(0))
    # the daemon's totals, as they stood when each asked: for a peer of no tenant;
    # a tenant's peer sees none of them (the others' activity), only its own figures
    pages = {"alpha": 0, "beta": 0, "nobody": 8}
    own = {"alpha": 3, "beta": 5}
    for who, out in seen.items():
        assert out["scrape"] == [401, ""], (who, out["scrape"])
        assert out["readable"] is False, who
        stats, status = out["stats"], out["status"]
        assert isinstance(stats, dict) and isinstance(status, str)
        others = {"alpha", "beta"} - {who}
        for text in (json.dumps(stats), status):
            assert not any(name in text for name in others), (who, text)
        assert stats["pages"] == pages[who], who
        if who == "nobody":  # a peer of no tenant: no tenant's figures at all
            assert stats["tenant"] is None and "tenant:" not in status
            assert stats["scope"] == "daemon" and "pages:      8 indexed" in status, status
            continue
        assert stats["scope"] == "tenant" and stats["requests"] == {} and stats["clients"] == 0
        assert "indexed" not in status and "its totals are not shown" in status, status
        mine = stats["tenant"]
        assert isinstance(mine, dict)
        assert (mine["tenant"], mine["pages"], mine["slots"]) == (who, own[who], own[who])
        assert (mine["asked"], mine["hits"], mine["max_slots"]) == (own[who], own[who], 0)
        assert f"tenant:     {who}: {own[who]} pages, {own[who]} slots" in status, status
    # the operator's scrape, with the token, has each tenant by name
    figures = scrape(url, token=token)
    assert figures[("hicached_tenant_pages", (("tenant", "alpha"),))] == 3
    assert figures[("hicached_tenant_pages", (("tenant", "beta"),))] == 5
    assert figures[REFUSED] == 3


def _raw_stats(endpoint: str, metadata: bytes = b"") -> dict[str, object]:
    """One stats request on a bare DEALER, its handshake carrying ``metadata``
    (ZMQ_METADATA, "Name:value"), as any peer may send it; its reply as builtins."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if metadata:
            sock.setsockopt(zmq.METADATA, metadata)
        sock.connect(endpoint)
        sock.send(p.encode(p.Stats(id=1)))
        assert sock.poll(10_000), "no reply to stats"
        reply = p.reply_decoder.decode(sock.recv())
        sock.close()
    finally:
        ctx.term()
    assert isinstance(reply, p.StatsOk), reply
    return {"scope": reply.stats.scope, "pages": reply.stats.pages}


def test_a_tenants_peer_that_claims_the_operator_property_still_gets_its_tenants_view(
    two_tenants: tuple[Daemon, str], users: Users
) -> None:
    """The operator mark is a connection property; a peer may send properties of
    its own in its handshake (ZMQ_METADATA). alpha's user sending
    X-Hicached-Operator:1 still gets its tenant's view: the ZAP handler's value
    is the one the daemon reads. Root (the daemon's user) gets the totals."""
    d, _ = two_tenants
    (alpha, _), (beta, _), _ = users.ids

    def store() -> dict[str, object]:
        _store(d, pages=2)  # beta's pages: a total alpha is not to see
        return {}

    _as(beta, store)
    claim = OPERATOR.encode() + b":1"
    spoof = _as(alpha, lambda: _raw_stats(d.endpoint, claim))
    assert spoof == {"scope": "tenant", "pages": 0}, spoof
    assert _raw_stats(d.endpoint, claim) == {"scope": "daemon", "pages": 2}

    def root_in_a_user_namespace() -> dict[str, object]:
        """alpha's user, root in a user namespace of its own: the kernel reports
        the uid it maps to (alpha's) to the daemon, not 0."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 1)  # lost at setuid: /proc/self would stay root's
        gid = os.getgid()
        if libc.unshare(CLONE_NEWUSER) != 0:
            return {"skip": os.strerror(ctypes.get_errno())}
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {alpha} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
        assert os.getuid() == 0
        return _raw_stats(d.endpoint)

    nested = _as(alpha, root_in_a_user_namespace)
    if "skip" not in nested:  # user namespaces may be off for users here
        assert nested == {"scope": "tenant", "pages": 0}, nested


def test_a_scrape_past_idle_connections_takes_the_oldest_ones_place(daemon: Daemon) -> None:
    """Connections that send nothing held the endpoint's MAX_SCRAPES threads, and
    every scrape that came meanwhile was closed unserved for REQUEST_TIMEOUT_S.
    A connection past them now takes the place of the one that has waited
    longest for its request: that one is closed unanswered (and counted), and
    the scrape is served at once."""
    url = _endpoint(daemon)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_SCRAPES)]
    try:
        time.sleep(0.5)  # accepted, each on a thread that waits for a request line
        seen = scrape(url)  # served, not closed
        assert seen[("hicached_metrics_turned_away_total", ())] == 1
        first = idle[0].recv(64)  # closed unanswered, the one that waited longest
        assert first == b"", first
        for later in idle[1:]:  # the others still wait for their requests
            later.setblocking(False)
            with pytest.raises(BlockingIOError):
                later.recv(64)
    finally:
        for s in idle:
            s.close()


def test_a_connection_cut_before_its_request_was_in_is_not_answered(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A connection cut while its request was still coming (half a request
    line, or a line and no end of headers) had what it had sent taken for a
    request once its reads ended: the gate ran for it, and with a token set it
    counted as a refused scrape (the daemon's metrics gathered for no one where
    no token is set). A cut connection now gets nothing."""
    metrics, token = metrics_token(tmp_path)
    d = daemon_factory(metrics=metrics)
    url = _endpoint(d)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    halves = [b"GET /metrics", b"GET /metrics HTTP/1.0\r\n"]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_SCRAPES)]
    try:
        for i, s in enumerate(idle):
            s.sendall(halves[i % 2])
        time.sleep(0.5)  # accepted, each on a thread that waits for the rest of its request
        # each scrape takes the place of the oldest, and is served once that one's
        # thread has ended (its slot is the one the scrape gets)
        for cut in range(1, 3):
            if cut > 1:  # the slot the scrape before had, taken again
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            seen = scrape(url, token=token)
            assert seen[("hicached_metrics_turned_away_total", ())] == cut
            assert seen[REFUSED] == 0, cut
            assert idle[cut - 1].recv(64) == b""  # closed unanswered
    finally:
        for s in idle:
            s.close()


def test_a_scrape_right_after_idle_connections_takes_a_place_their_threads_have_not_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection counted as waiting for its request only once its thread ran:
    a scrape that came right after MAX_SCRAPES idle connections, before their
    threads did, found none waiting and was closed unserved. Each counts from
    its accept now. Fault injection, the only fake: each handler's thread
    starts its work 0.5 s late (as on a busy host). The listener runs
    in-process on a real socket."""
    from hicached.daemon import metrics_http

    setup = metrics_http._Handler.setup

    def late(self: metrics_http._Handler) -> None:
        time.sleep(0.5)
        setup(self)

    monkeypatch.setattr(metrics_http._Handler, "setup", late)
    with _in_process() as (listener, port):
        idle = [
            socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_SCRAPES)
        ]
        try:
            status, body, _ = _get(listener.endpoint)  # at once: no idle thread has run yet
            assert (status, body) == (200, b"up 1\n")
            assert listener.turned_away == 1
        finally:
            for s in idle:
                s.close()


def test_a_connection_past_scrapes_all_being_answered_is_closed_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where every one of MAX_SCRAPES connections is being answered, none is cut
    for a newcomer: it is closed at once, unanswered, and counted. The listener
    runs in-process on a real socket; its app holds each answer until told."""
    import threading

    from hicached.daemon import metrics_http

    monkeypatch.setattr(metrics_http, "ROOM_WAIT_S", 0.2)
    go = threading.Event()
    inside = threading.Semaphore(0)

    def app(environ: dict[str, object], start_response: Callable[..., object]) -> list[bytes]:
        inside.release()
        go.wait(10)
        return _up(environ, start_response)

    with _in_process(app) as (listener, port):
        busy = [
            socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_SCRAPES)
        ]
        try:
            for s in busy:
                s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            for _ in busy:
                assert inside.acquire(timeout=10), "a request never reached the app"
            with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
                extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                try:
                    answer = extra.recv(64)
                except ConnectionResetError:
                    answer = b""
            assert answer == b"", answer  # closed, not answered
            assert listener.turned_away == 1
            go.set()
            for s in busy:  # every request being answered was answered
                got = b""
                while chunk := s.recv(4096):
                    got += chunk
                assert got.startswith(b"HTTP/1.0 200") and got.endswith(b"up 1\n"), got
        finally:
            go.set()
            for s in busy:
                s.close()


def test_a_scraper_that_trickles_its_request_is_cut_off_and_frees_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """REQUEST_TIMEOUT_S bounded each read, not the request: a local user who
    sends a byte of a request now and then, each within the timeout, held a
    scrape's slot for as long as it liked, and MAX_SCRAPES of them turned
    every scrape away for good. The whole request now has REQUEST_TIMEOUT_S.
    The listener runs in-process on a real socket, its timeout shortened."""
    import threading

    from hicached.daemon import metrics_http

    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(metrics_http._Handler, "timeout", 0.5)
    stop = threading.Event()
    with _in_process() as (listener, port):

        def trickle() -> None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"GET /metrics HTTP/1.0\r\n")
                while not stop.wait(0.2):  # a header byte at a time, each within the timeout
                    s.sendall(b"X")

        slow = [threading.Thread(target=trickle, daemon=True) for _ in range(MAX_SCRAPES)]
        try:
            for t in slow:
                t.start()
            time.sleep(1.5)  # each is past its whole-request time, still sending
            status, body, _ = _get(listener.endpoint)
            assert (status, body) == (200, b"up 1\n")
        finally:
            stop.set()
            for t in slow:
                t.join(5)
