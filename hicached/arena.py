"""The shared-memory arena: one tmpfs file mapped by the daemon and every client.

The daemon creates it (mode 0600, or 0660 for the clients' group when
``server.client_group`` is set; prefaulted) and unlinks it
at shutdown; clients map the same file by path. Its name is derived from the
daemon's runtime directory, so a restarted daemon replaces the file of a
crashed predecessor instead of leaking it.

Layout: ``size`` bytes of page slots, then the header: one generation counter
per ``GEN_GRANULE`` bytes of slots (pool.py), which the daemon bumps and
clients read to tell whether a slot changed owner during a copy.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from hicached.errors import ConfigError, DaemonUnavailable, HicachedError
from hicached.pool import GEN_DTYPE, gen_count

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it with EINVAL
_POPULATE_STEP = 256 << 20


def arena_path(shm_dir: str, runtime_dir: Path) -> Path:
    tag = xxhash.xxh3_64_hexdigest(str(runtime_dir.resolve()).encode())
    return Path(shm_dir) / f"hicached-{os.getuid()}-{tag}.pool"


def file_bytes(size: int) -> int:
    """Bytes of the pool file for ``size`` bytes of slots: slots, then the header."""
    header = gen_count(size) * GEN_DTYPE.itemsize
    return size + -(-header // mmap.PAGESIZE) * mmap.PAGESIZE


class Arena:
    """A mapping of the pool file; ``array`` is a zero-copy uint8 view of the
    slots, ``gens`` of the generation counters after them."""

    def __init__(self, path: Path, size: int, mapping: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.size = size
        self._mmap = mapping
        self.owner = owner
        self.array = np.frombuffer(mapping, dtype=np.uint8, count=size)
        self.gens = np.frombuffer(mapping, dtype=GEN_DTYPE, count=gen_count(size), offset=size)

    @classmethod
    def create(
        cls,
        path: Path,
        size: int,
        populate: bool = True,
        group: int | None = None,
        on_populate: Callable[[int], None] | None = None,
    ) -> Arena:
        """Create (replacing any stale file) and map the arena; daemon side.
        With ``group``, the file is mode 0660 and belongs to that group.
        ``on_populate`` hears the bytes prefaulted so far, step by step."""
        try:
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise HicachedError(f"cannot create the pool file {path}: {exc.strerror}") from None
        try:
            if group is not None:
                try:
                    if os.fstat(fd).st_gid != group:
                        os.fchown(fd, -1, group)
                    os.fchmod(fd, 0o660)  # the unit's UMask=0077 left it 0600
                except OSError as exc:
                    path.unlink(missing_ok=True)
                    raise ConfigError(
                        f"server.client_group: cannot give the pool file {path} to group "
                        f"{group}: {exc.strerror} (the daemon's user must be in that group)"
                    ) from None
            try:
                os.posix_fallocate(fd, 0, file_bytes(size))
            except OSError as exc:
                path.unlink(missing_ok=True)
                raise HicachedError(
                    f"cannot reserve {size} bytes for the pool in {path.parent}: {exc.strerror} "
                    "(lower pool.size_mib or enlarge the tmpfs)"
                ) from None
            mapping = mmap.mmap(fd, file_bytes(size), flags=mmap.MAP_SHARED)
            if populate and not _populate_in_steps(mapping, on_populate):
                mapping.close()  # an older kernel: all at once, as clients do
                mapping = mmap.mmap(fd, file_bytes(size), flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        return cls(path, size, mapping, owner=True)

    @classmethod
    def attach(cls, path: str, size: int, populate: bool = True) -> Arena:
        """Map an existing arena; client side."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise DaemonUnavailable(f"cannot open the pool file {path}: {exc.strerror}") from None
        try:
            actual, want = os.fstat(fd).st_size, file_bytes(size)
            if actual < want:
                raise DaemonUnavailable(f"pool file {path} has {actual} bytes, expected {want}")
            flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
            mapping = mmap.mmap(fd, want, flags=flags)
        finally:
            os.close(fd)
        return cls(Path(path), size, mapping, owner=False)

    def rows(self, page_bytes: int) -> np.ndarray:
        """The arena as rows of ``page_bytes``: slot ``offset`` is row ``offset // page_bytes``."""
        n = self.size // page_bytes
        return self.array[: n * page_bytes].reshape(n, page_bytes)

    def close(self) -> None:
        """Drop the mapping (views must be gone) and, for the owner, the file."""
        self.array = np.empty(0, dtype=np.uint8)
        self.gens = np.empty(0, dtype=GEN_DTYPE)
        with contextlib.suppress(BufferError):  # a view still exists: it ends with the process
            self._mmap.close()
        if self.owner:
            self.path.unlink(missing_ok=True)


def _populate_in_steps(mapping: mmap.mmap, on_populate: Callable[[int], None] | None) -> bool:
    """Prefault a fresh mapping for writing, a step at a time: one MAP_POPULATE
    call holds the interpreter for the whole pool, while between steps other
    threads run (the one that tells systemd the start goes on). False where
    the kernel lacks MADV_POPULATE_WRITE."""
    total = len(mapping)
    for start in range(0, total, _POPULATE_STEP):
        try:
            mapping.madvise(_MADV_POPULATE_WRITE, start, min(_POPULATE_STEP, total - start))
        except OSError as exc:
            if exc.errno == errno.EINVAL and start == 0:
                return False
            raise HicachedError(f"cannot prefault the pool: {exc.strerror}") from None
        if on_populate is not None:
            on_populate(min(start + _POPULATE_STEP, total))
    return True
