"""Tenant arenas: a pool file per tenant, which the daemon maps as one pool.

Where tenants are a boundary for bytes (daemon/arenas.py), each tenant's pages
live in a file of its own that only its identities may open; a client maps
its own tenant's file alone (wire/arena.py ``Arena.attach``: each file has the
layout of a pool of its size, slots then generation counters).

The daemon keeps one pool: it reserves one range of addresses for the slots
and one for the generation counters, and maps each tenant's file into them at
consecutive addresses (``MAP_FIXED`` over an anonymous reservation), its slots
at its ``start`` and its counters at ``start // GEN_GRANULE``. So ``array``
and ``gens`` are one view each, as ``Arena``'s are, and slot offsets stay
global: the allocator, the index, the L3 backends and the tier read and write
the files through them unchanged. A client learns its file, its size and its
``start`` at hello and reads slot ``offset`` at ``offset - start`` of its file.

Counters map in whole memory pages, each covering ``SPAN`` bytes of slots
(4 MiB), so every tenant's arena starts and ends on a multiple of it. The
reservations are anonymous and lazily backed: addresses no arena covers (the
pool's tail) cost nothing and hold zeros.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hicached.errors import HicachedError
from hicached.wire.arena import (
    GEN_DTYPE,
    GEN_GRANULE,
    STILL_MAPPED,
    arena_path,
    file_bytes,
    gen_count,
)

# bytes of slots whose generation counters fill one memory page
SPAN = mmap.PAGESIZE // GEN_DTYPE.itemsize * GEN_GRANULE

_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # Linux, every architecture
_MAP_NORESERVE = 0x4000
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_STEP = 256 << 20


@dataclass(frozen=True, slots=True)
class TenantArena:
    """One tenant's arena: its file, and where its slots lie in the daemon's pool."""

    tenant: str
    path: Path
    start: int  # its first slot's offset in the pool (a multiple of SPAN and of a slab)
    size: int  # bytes of slots (a multiple of SPAN and of a slab)


def tenant_arena_path(shm_dir: str, runtime_dir: Path, tenant: str) -> Path:
    """The file of ``tenant``'s arena: beside the pool file a daemon without
    tenants would make, with the tenant's name in it."""
    base = arena_path(shm_dir, runtime_dir)
    return base.with_name(f"{base.stem}.{tenant}.pool")


def stale_tenant_files(shm_dir: str, runtime_dir: Path) -> list[Path]:
    """Tenant arena files a daemon of this runtime directory left (a crash)."""
    base = arena_path(shm_dir, runtime_dir)
    return sorted(base.parent.glob(f"{base.stem}.*.pool"))


class TenantArenas:
    """The daemon's mapping of every tenant's arena file as one pool of
    ``pool_bytes``: ``array`` is a uint8 view of the slots, ``gens`` of the
    generation counters, both over all arenas."""

    def __init__(self, pool_bytes: int, arenas: list[TenantArena]) -> None:
        self.size = pool_bytes
        self.arenas = arenas
        self.owner = True
        libc = _libc()
        self._gen_bytes = -(-gen_count(pool_bytes) * GEN_DTYPE.itemsize // mmap.PAGESIZE)
        self._gen_bytes *= mmap.PAGESIZE
        self._slots = _reserve(libc, pool_bytes)
        self._gens = _reserve(libc, self._gen_bytes)
        slots = (ctypes.c_uint8 * pool_bytes).from_address(self._slots)
        gens = (ctypes.c_uint8 * self._gen_bytes).from_address(self._gens)
        self.array = np.ctypeslib.as_array(slots)
        self.gens = np.ctypeslib.as_array(gens).view(GEN_DTYPE)[: gen_count(pool_bytes)]

    @property
    def path(self) -> Path:
        """The directory of the arena files (for the log)."""
        return self.arenas[0].path.parent

    @classmethod
    def create(
        cls,
        pool_bytes: int,
        arenas: list[TenantArena],
        share: Callable[[int, TenantArena], None],
        populate: bool = True,
        on_populate: Callable[[int], None] | None = None,
        huge_pages: str = "off",
    ) -> TenantArenas:
        """Make every arena's file (replacing any stale one), let ``share`` give
        it to its tenant (its permissions: the file is 0600 until then), and map
        it into the pool; ``on_populate`` hears the bytes prefaulted so far."""
        for arena in arenas:
            assert arena.start % SPAN == 0 and arena.size % SPAN == 0 and arena.size > 0, (
                f"arena of {arena.tenant} is not whole spans of {SPAN} bytes"
            )
            assert arena.start + arena.size <= pool_bytes, f"arena of {arena.tenant} past the pool"
        pool = cls(pool_bytes, arenas)
        done = 0
        try:
            for arena in arenas:
                pool._map(arena, share, huge_pages, fresh=True)
                if populate:
                    done = pool._populate(arena, done, on_populate)
        except BaseException:
            pool.close()
            raise
        return pool

    @classmethod
    def reopen(
        cls,
        pool_bytes: int,
        arenas: list[TenantArena],
        share: Callable[[int, TenantArena], None],
        huge_pages: str = "off",
    ) -> TenantArenas:
        """Map the arena files a daemon before this one left, as they are (the
        next daemon adopts them: daemon/adoption.py); each is given to its
        tenant again."""
        pool = cls(pool_bytes, arenas)
        try:
            for arena in arenas:
                pool._map(arena, share, huge_pages, fresh=False)
        except BaseException:
            pool.close(keep=True)
            raise
        return pool

    def _map(
        self,
        arena: TenantArena,
        share: Callable[[int, TenantArena], None],
        huge: str,
        *,
        fresh: bool,
    ) -> None:
        path, size = arena.path, arena.size
        length = file_bytes(size)
        try:
            if fresh:
                path.unlink(missing_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            else:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise HicachedError(f"cannot open the arena file {path}: {exc.strerror}") from None
        try:
            if not fresh:
                st = os.fstat(fd)
                if st.st_size != length or st.st_uid != os.getuid():
                    raise HicachedError(
                        f"the arena file {path} has {st.st_size} bytes (uid {st.st_uid}), "
                        f"expected {length} (uid {os.getuid()})"
                    )
            share(fd, arena)
            try:
                if fresh:
                    os.posix_fallocate(fd, 0, length)
            except OSError as exc:
                raise HicachedError(
                    f"cannot reserve {size} bytes for tenant {arena.tenant}'s arena in "
                    f"{path.parent}: {exc.strerror} (lower pool.size_mib or enlarge the "
                    f"tmpfs; if a pool was there before, {STILL_MAPPED})"
                ) from None
            libc = _libc()
            counters = size // GEN_GRANULE * GEN_DTYPE.itemsize  # whole pages (SPAN)
            for where, length_, offset in (
                (self._slots + arena.start, size, 0),
                (self._gens + arena.start // GEN_GRANULE * GEN_DTYPE.itemsize, counters, size),
            ):
                got = libc.mmap(where, length_, _PROT_RW, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
                if got != where:
                    err = ctypes.get_errno()
                    raise HicachedError(f"cannot map the arena file {path}: {os.strerror(err)}")
            if huge == "madvise":  # no huge pages on tmpfs is no error
                libc.madvise(self._slots + arena.start, size, _MADV_HUGEPAGE)
        except BaseException:
            if fresh:
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def _populate(
        self, arena: TenantArena, done: int, on_populate: Callable[[int], None] | None
    ) -> int:
        """Prefault an arena's slots for writing, a step at a time (other threads
        run between steps); on a kernel without MADV_POPULATE_WRITE, by touching
        one byte a page. Returns the bytes done over all arenas."""
        libc = _libc()
        base = self._slots + arena.start
        for start in range(0, arena.size, _STEP):
            step = min(_STEP, arena.size - start)
            if libc.madvise(base + start, step, _MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() != errno.EINVAL:
                    raise HicachedError(
                        f"cannot prefault {arena.tenant}'s arena: {os.strerror(ctypes.get_errno())}"
                    )
                view = self.array[arena.start + start : arena.start + start + step]
                view[:: mmap.PAGESIZE] = view[:: mmap.PAGESIZE]  # a write fault a page
            done += step
            if on_populate is not None:
                on_populate(done)
        return done

    @property
    def file_bytes(self) -> int:
        """The arena files' lengths together."""
        return sum(file_bytes(arena.size) for arena in self.arenas)

    def close(self, keep: bool = False) -> None:
        """Let go of every file (and remove them, unless ``keep``: the next daemon
        adopts them). The address ranges are replaced by anonymous memory, not
        unmapped: a view some thread still holds (an L3 call past its deadline)
        reads zeros instead of faulting; the process's end frees them."""
        self.array = np.empty(0, dtype=np.uint8)
        self.gens = np.empty(0, dtype=GEN_DTYPE)
        libc = _libc()
        for where, length in ((self._slots, self.size), (self._gens, self._gen_bytes)):
            if where:
                libc.mmap(where, length, _PROT_RW, _ANON | _MAP_FIXED, -1, 0)
        self._slots = self._gens = 0
        for arena in self.arenas if not keep else ():
            with contextlib.suppress(OSError):
                arena.path.unlink()


_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE


def _reserve(libc: ctypes.CDLL, length: int) -> int:
    """A range of ``length`` bytes of addresses, anonymous and backed only where written."""
    got = libc.mmap(None, length, _PROT_RW, _ANON, -1, 0)
    if got is None or got == ctypes.c_void_p(-1).value:
        raise HicachedError(f"cannot reserve {length} bytes of addresses for the pool")
    return int(got)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mmap.restype = ctypes.c_void_p
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
