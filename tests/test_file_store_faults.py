"""The file store under faults, through real daemons: kill -9 of the daemon
while its reader processes work, and a store whose disk fails at the stop.

Faults are injected by hand and said so where they are: a reader stopped by
SIGSTOP stands for one stuck on a slow disk."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.l3util import (
    FILE_STORE,
    evict_everything,
    l3_count,
    storage,
    wait_for,
    wait_prefetch,
)
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for

pytestmark = pytest.mark.timeout(180)


def seq(start: int, pages: int) -> np.ndarray:
    return np.arange(start, start + pages * PAGE_TOKENS, dtype=np.uint32)


def readers_of(pid: int) -> list[int]:
    """The daemon's file reader processes (its children running file_readers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"hicached_backends.file_readers" in cmdline:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_reader_does_not_outlive_its_daemon_into_the_adopted_pool(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A reader still working when its daemon is killed (-9) would write its
    request's pages into pool slots after the daemon's death; the next daemon
    adopts that pool and hands those slots (a prefetch's, never journaled as
    pages) to new pages, which the reader then overwrites: L2 would serve
    another page's bytes. A reader dies with its daemon.

    Fault injection: the reader is stopped (SIGSTOP) while it holds the
    prefetch's request, as one stuck on a slow disk would be, and continued
    (SIGCONT) once the next daemon has reused every slot."""
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        fresh=False,  # the next start adopts the pool
        storage=storage("file"),
        tail=FILE_STORE + "read_processes = 1\nreader_deadline_s = 60.0\n",
    )
    assert d.proc is not None
    toks = seq(0, 8)
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 8)
        evict_everything(c, ns)
        assert c.match(ns, toks, lease=False).l3_hits == 8
        (reader,) = wait_for(lambda: readers_of(d.proc.pid))  # type: ignore[union-attr,misc]
        os.kill(reader, signal.SIGSTOP)
        try:
            pf = c.prefetch(ns, toks)
            time.sleep(0.5)  # the request is in the reader's pipe
            assert not c.progress(pf).done
            d.kill()
            deadline = time.monotonic() + 5
            while alive(reader) and time.monotonic() < deadline:
                time.sleep(0.05)
            orphan = alive(reader)
            d.start()
            with d.client() as c2:
                ns = c2.register(**NS)
                new = seq(10**6, 256)  # every slot of the 1 MiB pool, the prefetch's too
                written = page_bytes_for(new, salt=3)
                c2.store(ns, new, written)
                if orphan:
                    os.kill(reader, signal.SIGCONT)
                    wait_for(lambda: not alive(reader), timeout=30)
                got = c2.load(ns, new)
                assert len(got) == 256
                wrong = [i for i in range(256) if not np.array_equal(got[i], written[i])]
                assert not wrong, f"pages {wrong} hold bytes a dead daemon's reader wrote"
            assert not orphan, "a reader outlived its daemon by 5 s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(reader, signal.SIGKILL)


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 2.6 MiB tmpfs: room for two 1 MiB segments and little more."""
    mnt = Path(f"/tmp/hc-faults-{os.getpid()}")
    mnt.mkdir(exist_ok=True)
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(mnt)]
        ).returncode
    ):
        mnt.rmdir()
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()


def fill(path: Path) -> None:
    """Write to ``path`` until the disk is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, bytes(4096))
    finally:
        os.close(fd)


def test_a_disk_that_fails_at_the_stop_still_stops_cleanly(
    daemon_factory: Callable[..., Daemon], small_disk: Path
) -> None:
    """The store's close writes each segment's superblock and fsyncs it; one
    that fails (ENOSPC on a copy-on-write disk, EIO) is logged, and the rest
    of the stop runs: the other segments are closed, the daemon exits 0.

    Fault injection: the active segment's superblock is punched out of the
    file (fallocate --punch-hole), as a copy-on-write file system gives an
    overwrite a new block, and the disk is then filled."""
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        storage=storage("file"),
        tail=f'[storage.file]\npath = "{small_disk}"\ncapacity_mib = 8\nsegment_mib = 1\n',
    )
    toks = seq(0, 4)
    with d.client() as c:
        ns = c.register(**NS)
        c.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(c, "written") == 4)
    segment = small_disk / "segment-00000.hcs"
    subprocess.run(["fallocate", "--punch-hole", "-o", "0", "-l", "4096", str(segment)], check=True)
    fill(small_disk / "filler")
    assert d.stop() == 0, d.log.read_text()
    log = d.log.read_text()
    assert "stopped" in log.splitlines()[-1], log
    assert "segment-00000.hcs" in log and "No space left" in log, log
    (small_disk / "filler").unlink()
    d.start()  # the store opens again (the punched segment holds nothing now)
    with d.client() as c:
        ns = c.register(**NS)
        pf = c.prefetch(ns, toks)
        done = wait_prefetch(c, pf)
        c.commit(pf)
        got = c.load(ns, toks)
        assert len(got) == done.completed
        assert np.array_equal(got, page_bytes_for(toks)[: len(got)])
