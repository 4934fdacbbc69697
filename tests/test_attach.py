"""Clients map the pool without faulting it in, can prefault it on a thread of
their own, and the pool can live on huge pages (madvise, or a hugetlbfs mount)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hicached import Client
from hicached.arena import Arena, hugetlbfs_page_bytes
from hicached.errors import ConfigError
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon


def mapped_rss_kib(path: str) -> int:
    """Resident KiB of this process's mapping of ``path`` (from /proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                rss += int(head[1])
    return rss


def test_a_client_maps_without_faulting_and_prefaults_on_its_own_thread(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(size_mib=256, slab_mib=16)
    with Client(d.endpoint) as c:
        path = c.mapping.arena.path
        # one page copied in and out: only what copies touch is mapped in
        ns = c.register(**NS)
        tokens = np.arange(PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, tokens, np.ones((1, PAGE_BYTES), np.uint8))
        assert mapped_rss_kib(str(path)) < 16 << 10, "the connect faulted the pool in"
    with Client(d.endpoint, prefault=True) as c:
        path = c.mapping.arena.path
        deadline = time.monotonic() + 30
        while mapped_rss_kib(str(path)) < 250 << 10:
            assert time.monotonic() < deadline, "the prefault thread did not map the pool in"
            time.sleep(0.05)
        ns = c.register(**NS)
        hit = c.match(ns, tokens)  # the client works while and after it prefaults
        assert hit.hits == 1
        c.release(hit)


def test_madvise_huge_pages_serve(daemon_factory: Callable[..., Daemon]) -> None:
    """Huge pages asked for by madvise: the daemon and its clients run the same,
    whether or not this kernel gives tmpfs huge pages."""
    d = daemon_factory()
    d.stop()
    d.config.write_text(
        d.config.read_text().replace("[pool]\n", '[pool]\nhuge_pages = "madvise"\n')
    )
    d.start()
    with Client(d.endpoint) as c:
        assert c._hello is not None and c._hello.huge_pages == "madvise"
        ns = c.register(**NS)
        tokens = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
        pages = np.random.default_rng(1).integers(0, 256, (2, PAGE_BYTES), dtype=np.uint8)
        c.store(ns, tokens, pages)
        assert np.array_equal(c.load(ns, tokens), pages)


def test_hugetlbfs_needs_a_hugetlbfs_mount(tmp_path: Path) -> None:
    assert hugetlbfs_page_bytes(str(tmp_path)) is None
    with pytest.raises(ConfigError, match="hugetlbfs"):
        Arena.create(tmp_path / "pool", 4 << 20, huge_pages="hugetlbfs")
    assert not (tmp_path / "pool").exists()


@contextlib.contextmanager
def hugetlbfs_mount(pages: int) -> Iterator[str]:
    """A private hugetlbfs mount with ``pages`` more huge pages reserved (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting hugetlbfs needs root")
    knob = Path("/proc/sys/vm/nr_hugepages")
    before = int(knob.read_text())
    where = tempfile.mkdtemp(prefix="hc-huge-")
    try:
        knob.write_text(str(before + pages))
        if int(knob.read_text()) < before + pages:
            pytest.skip("the kernel could not reserve the huge pages")
        mount = subprocess.run(
            ["mount", "-t", "hugetlbfs", "-o", "mode=0700", "none", where],
            capture_output=True,
            text=True,
        )
        if mount.returncode:
            pytest.skip(f"cannot mount hugetlbfs here: {mount.stderr.strip()}")
        try:
            yield where
        finally:
            subprocess.run(["umount", where], check=False)
    finally:
        with contextlib.suppress(OSError):
            knob.write_text(str(before))
        os.rmdir(where)


def test_a_pool_on_hugetlbfs(daemon_factory: Callable[..., Daemon]) -> None:
    with hugetlbfs_mount(pages=16) as where:  # a 16 MiB pool and its header: 9 pages
        d = daemon_factory(size_mib=16, slab_mib=1)
        d.stop()
        text = d.config.read_text().replace(
            "[pool]\n", f'[pool]\nhuge_pages = "hugetlbfs"\nshm_dir = "{where}"\n'
        )
        d.config.write_text(text)
        d.start()
        with Client(d.endpoint) as c:
            path = c.mapping.arena.path
            assert str(path).startswith(where)
            assert os.stat(path).st_size % (2 << 20) == 0
            ns = c.register(**NS)
            tokens = np.arange(3 * PAGE_TOKENS, dtype=np.uint32)
            pages = np.random.default_rng(2).integers(0, 256, (3, PAGE_BYTES), dtype=np.uint8)
            c.store(ns, tokens, pages)
            assert np.array_equal(c.load(ns, tokens), pages)
        d.stop()
