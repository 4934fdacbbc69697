"""The service as shipped: the unit, sysusers.d and tmpfiles.d agree; config
errors exit 2 (which the unit does not restart); a start reports progress."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hicached.config import load_config
from hicached.notify import StartupProgress
from tests.l3util import FILE_STORE, settle_writes, storage
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "systemd"


def unit_entries(text: str) -> dict[str, list[str]]:
    """Key -> every value assigned to it (``Section.Key``), in order."""
    entries: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return entries


def one(entries: dict[str, list[str]], key: str) -> str:
    values = entries.get(key)
    assert values and len(values) == 1, f"{key}: {values}"
    return values[0]


def sysusers_lines(text: str) -> list[list[str]]:
    """The sysusers.d lines, split like the shell would (quoted GECOS kept whole)."""
    import shlex

    return [shlex.split(line) for line in text.splitlines() if line and not line.startswith("#")]


UNIT = unit_entries((SYSTEMD / "hicached.service").read_text())


def test_the_unit_hardens_the_service_and_stops_restarting_on_config_errors() -> None:
    s = "Service."
    assert one(UNIT, s + "Type") == "notify"
    assert one(UNIT, s + "RestartPreventExitStatus") == "2"
    assert one(UNIT, s + "Restart") == "on-failure"
    # a control process's exit status escapes RestartPreventExitStatus=
    assert s + "ExecStartPre" not in UNIT and s + "ExecCondition" not in UNIT
    assert int(one(UNIT, "Unit.StartLimitBurst")) <= 10
    assert int(one(UNIT, s + "TimeoutStartSec")) >= 30
    assert one(UNIT, s + "UMask") == "0077"
    assert one(UNIT, s + "CapabilityBoundingSet") == ""  # no capability at all
    for key in (
        "NoNewPrivileges",
        "RestrictSUIDSGID",
        "ProtectClock",
        "ProtectHostname",
        "ProtectKernelLogs",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectControlGroups",
        "PrivateTmp",
        "PrivateDevices",
        "MemoryDenyWriteExecute",
        "LockPersonality",
        "RestrictRealtime",
    ):
        assert one(UNIT, s + key) == "yes", key
    assert one(UNIT, s + "ProtectSystem") == "strict"
    assert UNIT[s + "SystemCallFilter"][0] == "@system-service"
    # ZeroMQ's I/O threads call sched_setscheduler (in @resources) and abort on EPERM
    assert not any("@resources" in f for f in UNIT[s + "SystemCallFilter"] if f.startswith("~"))
    assert "/dev/shm" in one(UNIT, s + "ReadWritePaths").split()


def test_sysusers_tmpfiles_and_the_unit_name_the_same_user_group_and_directory() -> None:
    user, group = one(UNIT, "Service.User"), one(UNIT, "Service.Group")
    lines = sysusers_lines((SYSTEMD / "hicached.sysusers").read_text())
    users = {line[1] for line in lines if line[0] == "u"}
    groups = {line[1] for line in lines if line[0] == "g"} | users  # `u` makes a same-named group
    members = {(line[1], line[2]) for line in lines if line[0] == "m"}
    assert user in users and group in groups and (user, group) in members
    assert set(one(UNIT, "Service.SupplementaryGroups").split()) <= groups
    assert group == "hicached-clients" and user == "hicached"

    (tmp_line,) = [
        line.split()
        for line in (SYSTEMD / "hicached.tmpfiles").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    kind, path, mode, owner, owner_group = tmp_line[:5]
    assert kind == "d" and path == "/run/" + one(UNIT, "Service.RuntimeDirectory")
    assert mode == one(UNIT, "Service.RuntimeDirectoryMode") == "0750"
    assert (owner, owner_group) == (user, group)
    assert one(UNIT, "Service.RuntimeDirectoryPreserve") == "yes"

    # the Makefile's install step and the config's key name the same group
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^CLIENT_GROUP\s*:=\s*{group}$", makefile, re.MULTILINE)
    assert re.search(rf"^SERVICE_USER\s*:=\s*{user}$", makefile, re.MULTILINE)
    example = (ROOT / "config" / "hicached.toml").read_text()
    assert re.search(r'^client_group = ""$', example, re.MULTILINE)  # what the install fills in


@pytest.mark.skipif(not shutil.which("systemd-sysusers"), reason="systemd-sysusers not installed")
def test_sysusers_and_tmpfiles_create_them_in_a_scratch_root(tmp_path: Path) -> None:
    """The real tools, on an empty root: the user, the group, the directory."""
    (tmp_path / "etc").mkdir()
    out = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "hicached.sysusers")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc" / "passwd").read_text().splitlines()
    }
    group = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc" / "group").read_text().splitlines()
    }
    assert "hicached" in passwd and passwd["hicached"][6].endswith("nologin")
    assert "hicached" in group["hicached-clients"][3].split(",")
    out = subprocess.run(
        ["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(SYSTEMD / "hicached.tmpfiles")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    st = (tmp_path / "run" / "hicached").stat()
    assert oct(st.st_mode & 0o7777) == "0o750"
    assert st.st_uid == int(passwd["hicached"][2]) and st.st_gid == int(
        group["hicached-clients"][2]
    )


def hicached(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicached", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[pool]\nsize_mb = 3\n", "pool.size_mb: unknown key"),
        ("[server]\nclient_group = 'no-such-group-hc'\n", "no group named 'no-such-group-hc'"),
        ("[server]\nclient_group = 'a:b'\n", "server.client_group"),
    ],
)
def test_config_errors_exit_2_which_the_unit_does_not_restart(
    tmp_path: Path, toml: str, message: str
) -> None:
    runtime = Path("/tmp") / f"hc-cfg-{os.getpid()}"
    cfg = tmp_path / "c.toml"
    head = f'[server]\nruntime_dir = "{runtime}"\n'
    cfg.write_text(head + toml.removeprefix("[server]\n"))
    try:
        for command in ("check-config", "serve"):
            args = [str(cfg)] if command == "check-config" else ["--config", str(cfg)]
            out = hicached(command, *args)
            if command == "check-config" and "client_group = 'no" in toml:
                continue  # the group is looked up at start, on the host that serves
            assert out.returncode == 2, (command, out.stderr)
            assert message in out.stderr
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    assert one(UNIT, "Service.RestartPreventExitStatus") == "2"


# -- startup progress (sd_notify) --------------------------------------------------


class NotifySocket:
    """A datagram socket standing in for systemd's; what arrives is collected."""

    def __init__(self) -> None:
        self.path = str(Path("/tmp") / f"hc-notify-{os.getpid()}-{time.monotonic_ns()}.sock")
        self.messages: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.05)
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self._sock.recv(4096).decode())
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._reader.join()
        self._sock.close()
        Path(self.path).unlink(missing_ok=True)


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    sock = NotifySocket()
    yield sock
    sock.close()


def test_startup_reports_progress_and_extends_the_timeout_until_ready(
    notify_socket: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool phase and the L3 scan before READY each send STATUS= with
    EXTEND_TIMEOUT_USEC=, then READY=1 comes, and no extension after it."""
    more = "scan_in_background = false\n"
    daemon = Daemon(storage=storage("file", more=more), tail=FILE_STORE)
    try:
        daemon.start()  # fills the store
        toks = np.arange(0, 8 * PAGE_TOKENS, dtype=np.uint32)
        with daemon.client() as c:
            ns = c.register(**NS)
            c.store(ns, toks, page_bytes_for(toks))
            settle_writes(c)
        assert daemon.stop() == 0
        monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.path)
        daemon.start()  # the same config and store: the scan finds the 8 pages
        got = notify_socket.messages
        deadline = time.monotonic() + 10
        while not any(m.startswith("READY=1") for m in got):
            assert time.monotonic() < deadline, got
            time.sleep(0.02)
        ready = next(i for i, m in enumerate(got) if m.startswith("READY=1"))
        before = got[:ready]
        assert any(
            "EXTEND_TIMEOUT_USEC=" in m and "STATUS=opening the 16 MiB pool" in m for m in before
        ), before
        assert any(
            "EXTEND_TIMEOUT_USEC=" in m and "STATUS=L3: opening the file store, scanning" in m
            for m in before
        ), before
        assert "STATUS=serving on" in got[ready]
        time.sleep(0.3)
        assert not any("EXTEND_TIMEOUT_USEC" in m for m in got[ready:])
        with daemon.client() as c:
            assert c.stats().l3_pages_known == 8
    finally:
        daemon.cleanup()


def test_progress_extends_only_while_the_counter_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify")
    sent: list[str] = []
    done = [0]
    progress = StartupProgress(every_s=0.02, extend_s=1.0, notify=lambda m: sent.append(m) or True)
    with progress:
        progress.phase("scanning", lambda: done[0], stall_s=0.15)
        for _ in range(10):
            done[0] += 1
            time.sleep(0.02)
        moving = len(sent)
        time.sleep(0.4)  # stalled
    assert sent[0].startswith("EXTEND_TIMEOUT_USEC=1000000\nSTATUS=scanning (0s, 0 so far)")
    assert all(m.startswith("EXTEND_TIMEOUT_USEC=") for m in sent[:moving])
    assert not sent[-1].startswith("EXTEND") and "none in the last" in sent[-1]
    count = len(sent)
    time.sleep(0.1)
    assert len(sent) == count  # closed: nothing more


def test_without_notify_socket_nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    sent: list[str] = []
    with StartupProgress(notify=lambda m: sent.append(m) or True) as progress:
        progress.phase("populating")
        assert progress._thread is None
    assert sent == []


def test_example_config_leaves_client_group_to_the_install() -> None:
    assert load_config(ROOT / "config" / "hicached.toml").server.client_group == ""


# -- the unit's limits, applied by hand --------------------------------------------


def _deny_write_execute() -> None:
    """In the child before exec: what MemoryDenyWriteExecute= enforces, through
    prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN), kept across exec; and UMask."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(65, 1, 0, 0, 0) != 0:
        os._exit(77)  # this kernel has no MDWE: the test skips
    os.umask(0o077)


@pytest.mark.skipif(not shutil.which("setpriv"), reason="setpriv (util-linux) not installed")
def test_the_daemon_serves_under_the_units_memory_and_privilege_limits(tmp_path: Path) -> None:
    """No capabilities, no new privileges, no writable+executable memory,
    umask 0077: the daemon with the file store and metrics still serves."""
    import urllib.request

    daemon = Daemon(storage=storage("file"), tail=FILE_STORE)
    limits = ["setpriv", "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    cmd = [*limits, sys.executable, "-m", "hicached", "serve", "--config", str(daemon.config)]
    log = daemon.dir / "limited.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, preexec_fn=_deny_write_execute)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() == 77:
                pytest.skip("this kernel has no PR_SET_MDWE")
            assert proc.poll() is None, log.read_text()
            try:
                with daemon.client(timeout=0.5) as c:
                    c.stats()
                break
            except Exception:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert re.search(r"^CapBnd:\s+0+$", status, re.MULTILINE), status
        assert re.search(r"^NoNewPrivs:\s+1$", status, re.MULTILINE), status
        toks = np.arange(0, 6 * PAGE_TOKENS, dtype=np.uint32)
        with daemon.client() as c:
            ns = c.register(**NS)
            c.store(ns, toks, page_bytes_for(toks))
            settle_writes(c)
            stats = c.stats()
            hit = c.match(ns, toks)
            assert np.array_equal(c.read_pages(hit), page_bytes_for(toks))
            c.release(hit)
        assert stats.l3.get("written", 0) == 6, stats.l3
        with urllib.request.urlopen(f"{stats.metrics_endpoint}", timeout=5) as reply:
            assert b"hicached_pool_bytes" in reply.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        daemon.cleanup()
