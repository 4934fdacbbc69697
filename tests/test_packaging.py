"""`make install-service` for real, into a scratch root: a venv with the wheel
and the runtime dependencies only, whose daemon serves; the unit, sysusers,
tmpfiles and config agree with the paths it installed; systemd-analyze
accepts the unit and scores its exposure.

The venv is built at PREFIX under /tmp and the other files are staged under
DESTDIR, so nothing on the host changes. pip takes the dependencies from its
cache, local wheel directories or the package index.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicached.config import load_config
from tests.test_service import one, unit_entries

ROOT = Path(__file__).resolve().parents[1]
SERVICE_PYTHON = "/usr/bin/python3"


def _can_make_venvs() -> bool:
    if not Path(SERVICE_PYTHON).exists() or not shutil.which("make"):
        return False
    probe = [SERVICE_PYTHON, "-c", "import ensurepip, venv"]
    return subprocess.run(probe, capture_output=True).returncode == 0


pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the first test builds the venv: pip may download
    pytest.mark.skipif(
        not _can_make_venvs(),
        reason=f"needs make and {SERVICE_PYTHON} with venv and ensurepip (python3-venv)",
    ),
]


@dataclass
class Installed:
    base: Path
    prefix: Path
    destdir: Path
    log: str

    @property
    def unit(self) -> Path:
        return self.destdir / "etc/systemd/system/hicached.service"

    @property
    def config(self) -> Path:
        return self.destdir / "etc/hicached/hicached.toml"

    @property
    def dropin(self) -> Path:
        return self.destdir / "etc/systemd/system/hicached.service.d/50-paths.conf"


def make_install(prefix: Path, destdir: Path) -> str:
    out = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "install-service",
            f"PREFIX={prefix}",
            f"DESTDIR={destdir}",
            f"SERVICE_PYTHON={SERVICE_PYTHON}",
            f"WHEEL_DIR={prefix.parent}/dist",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    base = Path(tempfile.mkdtemp(prefix="hc-pkg-", dir="/tmp"))
    prefix, destdir = base / "opt" / "hicached", base / "root"
    try:
        log = make_install(prefix, destdir)
        yield Installed(base, prefix, destdir, log)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def pip_names(prefix: Path) -> set[str]:
    out = subprocess.run(
        [str(prefix / "bin/python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {line.split("==")[0].lower().replace("_", "-") for line in out.stdout.split()}


def test_the_venv_holds_the_wheel_and_runtime_dependencies_only(installed: Installed) -> None:
    names = pip_names(installed.prefix)
    assert "hicached" in names
    assert {"pyzmq", "msgspec", "numpy", "xxhash", "prometheus-client", "uvloop"} <= names
    for unwanted in ("torch", "pytest", "ruff", "mypy", "moto", "boto3", "hypothesis"):
        assert unwanted not in names, unwanted
    assert not any(name.startswith("mooncake") for name in names)
    check = subprocess.run(
        [str(installed.prefix / "bin/python"), "-m", "pip", "check"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout
    # the installed package, not this checkout: an editable install would point here
    where = subprocess.run(
        [str(installed.prefix / "bin/python"), "-c", "import hicached; print(hicached.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout
    assert where.startswith(str(installed.prefix)), where


def test_installed_paths_agree_with_the_unit(installed: Installed) -> None:
    unit = unit_entries(installed.unit.read_text())
    hicached = installed.prefix / "bin" / "hicached"
    start = one(unit, "Service.ExecStart").split()
    assert start[:2] == [str(hicached), "serve"] and "Service.ExecStartPre" not in unit
    assert os.access(hicached, os.X_OK)
    config_path = start[start.index("--config") + 1]
    assert config_path == "/etc/hicached/hicached.toml"
    assert installed.config == installed.destdir / config_path.lstrip("/")
    doc = one(unit, "Unit.Documentation").removeprefix("file://")
    assert Path(doc).is_file() and doc.startswith(str(installed.prefix))

    config = load_config(installed.config)
    assert config.server.client_group == one(unit, "Service.Group") == "hicached-clients"
    assert oct(installed.config.stat().st_mode & 0o777) == "0o640"  # engines cannot read it
    sysusers = installed.destdir / "etc/sysusers.d/hicached.conf"
    tmpfiles = installed.destdir / "etc/tmpfiles.d/hicached.conf"
    assert sysusers.read_text() == (ROOT / "systemd/hicached.sysusers").read_text()
    assert tmpfiles.read_text() == (ROOT / "systemd/hicached.tmpfiles").read_text()
    assert not installed.dropin.exists()  # the default config needs no extra path

    # the shipped unit names the paths the install uses by default
    shipped = unit_entries((ROOT / "systemd/hicached.service").read_text())
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "install-service", "DESTDIR=/nonexistent"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    default_bin = one(shipped, "Service.ExecStart").split()[0]
    default_prefix = str(Path(default_bin).parent.parent)
    assert f"-m venv {default_prefix}\n" in dry and default_bin == "/opt/hicached/bin/hicached"
    assert "/nonexistent/etc/systemd/system/hicached.service" in dry
    assert "/nonexistent/etc/sysusers.d/hicached.conf" in dry
    assert "apt-get" not in dry


def test_the_installed_daemon_serves_and_its_own_client_connects(installed: Installed) -> None:
    base = installed.base / "serve"
    base.mkdir()
    runtime = base / "run"
    endpoint = f"ipc://{runtime}/hicached.sock"
    config = base / "hicached.toml"
    config.write_text(
        f'[server]\nruntime_dir = "{runtime}"\n[pool]\nsize_mib = 16\nslab_mib = 1\n'
        "max_page_bytes = 262144\n[metrics]\nport = 0\n"
        f'[storage]\nbackend = "file"\ndata_dir = "{base / "data"}"\n'
        "[storage.file]\ncapacity_mib = 8\nsegment_mib = 2\n"
    )
    bin_dir = installed.prefix / "bin"
    check = subprocess.run(
        [str(bin_dir / "hicached"), "check-config", str(config)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    log = base / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(bin_dir / "hicached"), "serve", "--config", str(config)],
            stdout=out,
            stderr=out,
            cwd="/",
        )
    script = (
        "import sys, numpy as np, hicached\n"
        "with hicached.Client(sys.argv[1], timeout=5) as c:\n"
        "    ns = c.register(model='m', kv_dtype='bfloat16', layout='layer_first',\n"
        "                    page_tokens=16, page_bytes=4096)\n"
        "    toks = np.arange(64, dtype=np.uint32)\n"
        "    pages = np.random.default_rng(1).integers(0, 256, (4, 4096), dtype=np.uint8)\n"
        "    c.store(ns, toks, pages)\n"
        "    hit = c.match(ns, toks)\n"
        "    assert np.array_equal(c.read_pages(hit), pages)\n"
        "    c.release(hit)\n"
        "print('ok')\n"
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            status = subprocess.run(
                [str(bin_dir / "hicached"), "status", "--endpoint", endpoint, "--timeout", "0.5"],
                capture_output=True,
                text=True,
            )
            if status.returncode == 0:
                break
            assert time.monotonic() < deadline, status.stderr + log.read_text()
            time.sleep(0.1)
        assert "L3:         file" in status.stdout, status.stdout
        client = subprocess.run(
            [str(bin_dir / "python"), "-c", script, endpoint],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        assert client.stdout.strip() == "ok", client.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert "stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_store_elsewhere_gets_a_dropin_and_the_config_is_kept(installed: Installed) -> None:
    """Install again over a config that moved the store: the config stays, the
    drop-in names the new path; back to the default, the drop-in goes."""
    original = installed.config.read_text()
    moved = original.replace('data_dir = ""', 'data_dir = "/srv/hicached-l3"', 1)
    assert moved != original
    installed.config.write_text(moved)
    try:
        log = make_install(installed.prefix, installed.destdir)
        assert "keeping" in log
        assert installed.config.read_text() == moved
        dropin = installed.dropin.read_text()
        assert re.search(r"^ReadWritePaths=/srv/hicached-l3$", dropin, re.MULTILINE), dropin
        if shutil.which("systemd-analyze"):
            verify = analyze("verify", "hicached.service", unit_path=installed.unit.parent)
            assert verify.returncode == 0, verify.stderr
        paths = [str(installed.prefix / "bin/python"), str(ROOT / "systemd/hicached-paths.py")]
        installed.config.write_text(original)
        out = subprocess.run([*paths, str(installed.config), str(installed.dropin)], cwd=ROOT)
        assert out.returncode == 0 and not installed.dropin.exists()
        hidden = original.replace('data_dir = ""', 'data_dir = "/home/kv"', 1)
        installed.config.write_text(hidden)
        out = subprocess.run(
            [*paths, str(installed.config), str(installed.dropin)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2 and "hidden from the service" in out.stderr
    finally:
        installed.config.write_text(original)
        installed.dropin.unlink(missing_ok=True)


def analyze(*args: str, unit_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_COLORS": "0"}
    if unit_path is not None:
        env["SYSTEMD_UNIT_PATH"] = f"{unit_path}:"  # the trailing colon keeps the built-in path
    return subprocess.run(
        ["systemd-analyze", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_analyze_verifies_the_installed_unit(installed: Installed) -> None:
    out = analyze("verify", str(installed.unit))
    assert out.returncode == 0, out.stderr
    assert "hicached.service" not in out.stderr, out.stderr  # no warning about the unit


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_analyze_security_exposure(
    installed: Installed, capsys: pytest.CaptureFixture[str]
) -> None:
    out = analyze("security", "--offline=true", "--no-pager", str(installed.unit))
    found = re.search(r"Overall exposure level for hicached\.service: (\d+\.\d+) (\w+)", out.stdout)
    if out.returncode != 0 or not found:
        pytest.skip(f"systemd-analyze security --offline is not supported here: {out.stderr}")
    score = float(found.group(1))
    with capsys.disabled():
        print(f"\nsystemd-analyze security: exposure {score} {found.group(2)} (0 best, 10 worst)")
    assert score <= 2.0, out.stdout
