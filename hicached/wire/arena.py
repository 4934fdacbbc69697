"""The shared-memory arena: one tmpfs file mapped by the daemon and every client.

(With tenant arenas each tenant has a file of this layout, which its clients
map as they map this one, and the daemon maps them all as one pool:
wire/arenas.py.)

The daemon creates it (mode 0600, or 0660 for the clients' group when
``server.client_group`` is set; prefaulted) and unlinks it
at shutdown; clients map the same file by path. Its name is derived from the
daemon's runtime directory, so a restarted daemon replaces the file of a
crashed predecessor instead of leaking it.

Layout: ``size`` bytes of page slots, then the header: one generation counter
per ``GEN_GRANULE`` bytes of slots (state/pool.py), which the daemon bumps and
clients read to tell whether a slot changed owner during a copy.

Huge pages (``pool.huge_pages``): ``madvise`` asks for transparent huge pages
on the tmpfs mapping, in the daemon and in every client; ``hugetlbfs`` puts
the file on a hugetlbfs mount, whose pages are huge by construction (the file
is then a whole number of them). Either way a client's page tables for a
large pool shrink by the ratio of the page sizes.

Clients map the file without faulting it in: a mapping of a large pool costs
one system call, and page-table entries are made as copies touch slots, or
ahead of time by ``prefault`` on a thread of its own.
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
from pathlib import Path

import numpy as np
import xxhash

from hicached.errors import ConfigError, DaemonUnavailable, HicachedError

GEN_GRANULE = 4096  # bytes of arena per generation counter
GEN_DTYPE = np.dtype("<u4")


def gen_count(arena_bytes: int) -> int:
    """Generation counters an arena of ``arena_bytes`` needs."""
    return -(-arena_bytes // GEN_GRANULE)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it with EINVAL
_MADV_HUGEPAGE = 14
_POPULATE_STEP = 256 << 20


def hugetlbfs_page_bytes(directory: str) -> int | None:
    """The huge page size of the hugetlbfs mount holding ``directory``, or None
    when it is not on one (the longest mount point that contains it counts)."""
    target = os.path.realpath(directory)
    best, size = "", None
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 4:
                    continue
                point = fields[1]
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if not inside or len(point) < len(best):
                    continue
                best, size = point, None
                if fields[2] == "hugetlbfs":
                    size = _page_size(fields[3])
    except OSError:
        return None
    return size


def _page_size(options: str) -> int:
    for option in options.split(","):
        if option.startswith("pagesize="):
            text = option.removeprefix("pagesize=").upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            return int(text.rstrip("KMG")) * scale
    return 2 << 20  # the default huge page size on x86-64 and arm64


def arena_path(shm_dir: str, runtime_dir: Path) -> Path:
    tag = xxhash.xxh3_64_hexdigest(str(runtime_dir.resolve()).encode())
    return Path(shm_dir) / f"hicached-{os.getuid()}-{tag}.pool"


def file_bytes(size: int, align: int = mmap.PAGESIZE) -> int:
    """Bytes of the pool file for ``size`` bytes of slots: slots, then the header,
    in whole pages of ``align`` bytes."""
    total = size + gen_count(size) * GEN_DTYPE.itemsize
    return -(-total // align) * align


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
        huge_pages: str = "off",
    ) -> Arena:
        """Create (replacing any stale file) and map the arena; daemon side.
        With ``group``, the file is mode 0660 and belongs to that group.
        ``on_populate`` hears the bytes prefaulted so far, step by step."""
        align = mmap.PAGESIZE
        if huge_pages == "hugetlbfs":
            page = hugetlbfs_page_bytes(str(path.parent))
            if page is None:
                raise ConfigError(
                    f"pool.huge_pages = hugetlbfs, but pool.shm_dir ({path.parent}) is not on a "
                    "hugetlbfs mount: mount one (mount -t hugetlbfs none DIR) or use madvise"
                )
            align = page
        length = file_bytes(size, align)
        replaced = path.exists()
        try:
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise HicachedError(f"cannot create the pool file {path}: {exc.strerror}") from None
        try:
            if group is not None:
                _share(fd, path, group)
            try:
                os.posix_fallocate(fd, 0, length)
            except OSError as exc:
                path.unlink(missing_ok=True)
                more = (
                    "reserve more huge pages (vm.nr_hugepages) or lower pool.size_mib"
                    if align > mmap.PAGESIZE
                    else "lower pool.size_mib or enlarge the tmpfs"
                )
                if replaced:
                    more += f"; {STILL_MAPPED}"
                raise HicachedError(
                    f"cannot reserve {size} bytes for the pool in {path.parent}: {exc.strerror} "
                    f"({more})"
                ) from None
            mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
            if huge_pages == "madvise":
                advise_huge(mapping)
            if populate and not _populate_in_steps(mapping, on_populate):
                mapping.close()  # an older kernel: all at once
                mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        return cls(path, size, mapping, owner=True)

    @classmethod
    def reopen(
        cls, path: Path, size: int, length: int, group: int | None = None, huge_pages: str = "off"
    ) -> Arena:
        """Map the pool file a daemon before this one left (``length`` bytes, as
        its journal says); daemon side, the file is kept as it is. With
        ``group`` it is given to that group again (0660)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise HicachedError(f"cannot open the pool file {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_size != length or st.st_uid != os.getuid():
                raise HicachedError(
                    f"the pool file {path} has {st.st_size} bytes (uid {st.st_uid}), "
                    f"its journal says {length} (uid {os.getuid()})"
                )
            opened = _opened_to(st)
            if opened and opened != f"group {group}":
                # a process that opened or mapped it before keeps reading it
                # whatever its mode says now: the new pages go to a new file
                given = "no group" if group is None else f"group {group}"
                raise HicachedError(
                    f"the pool file {path} was open to {opened}, this configuration "
                    f"gives it to {given} (server.client_group); a process that opened "
                    "it before would keep reading it"
                )
            if group is not None:
                _share(fd, path, group)
            else:
                os.fchmod(fd, 0o600)
            mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if huge_pages == "madvise":
            advise_huge(mapping)
        return cls(path, size, mapping, owner=True)

    @property
    def file_bytes(self) -> int:
        """The pool file's length (slots, header, alignment)."""
        return len(self._mmap)

    @classmethod
    def attach(cls, path: str, size: int, populate: bool = False, huge_pages: str = "") -> Arena:
        """Map an existing arena; client side. Nothing is faulted in unless
        ``populate`` (then on this thread; ``prefault`` does it on another)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise DaemonUnavailable(f"cannot open the pool file {path}: {exc.strerror}") from None
        try:
            actual, want = os.fstat(fd).st_size, file_bytes(size)
            if actual < want:
                raise DaemonUnavailable(f"pool file {path} has {actual} bytes, expected {want}")
            flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
            # the whole file: on hugetlbfs it is a whole number of huge pages
            mapping = mmap.mmap(fd, actual, flags=flags)
        finally:
            os.close(fd)
        if huge_pages == "madvise":
            advise_huge(mapping)
        return cls(Path(path), size, mapping, owner=False)

    def prefault(self, step: int = 64 << 20) -> int:
        """Make this process's page-table entries for the whole mapping, a step at a
        time (meant for a thread of its own); returns the bytes done. Stops early,
        quietly, if the mapping is closed meanwhile or the kernel cannot."""
        try:
            total = len(self._mmap)
            base = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        except (ValueError, TypeError):
            return 0  # closed already
        madvise = _libc().madvise
        done = 0
        for start in range(0, total, step):
            # through ctypes, which lets go of the GIL: the caller's loop runs meanwhile
            if madvise(base + start, min(step, total - start), _MADV_POPULATE_WRITE) != 0:
                break  # unmapped meanwhile, or a kernel without MADV_POPULATE_WRITE
            done = min(start + step, total)
        return done

    def rows(self, page_bytes: int, array: np.ndarray | None = None) -> np.ndarray:
        """The arena as rows of ``page_bytes``: slot ``offset`` is row ``offset //
        page_bytes``. ``array``: its bytes as a copy took them before (a view
        that keeps the mapping alive across a close on another thread)."""
        n = self.size // page_bytes
        data = self.array if array is None else array
        return data[: n * page_bytes].reshape(n, page_bytes)

    def close(self, keep: bool = False) -> None:
        """Drop the mapping (views must be gone) and, for the owner, the file
        (unless ``keep``: the next daemon adopts it)."""
        self.array = np.empty(0, dtype=np.uint8)
        self.gens = np.empty(0, dtype=GEN_DTYPE)
        with contextlib.suppress(BufferError):  # a view still exists: it ends with the process
            self._mmap.close()
        if self.owner and not keep:
            self.path.unlink(missing_ok=True)


# A pool file replaced by a start that does not adopt it keeps its memory while
# any client maps it, and clients let go of it only once they reach the new daemon
STILL_MAPPED = (
    "the pool before it is still held by the clients that map it until they reach "
    "a daemon again, so a start that does not adopt a pool needs room for two "
    "(or the clients stopped): docs/restarts.md"
)


def _opened_to(st: os.stat_result) -> str:
    """Who besides its owner may open the file of ``st``: "" (no one), a group
    (``group GID``), or everyone."""
    if st.st_mode & 0o007:
        return "every user"
    if st.st_mode & 0o070:
        return f"group {st.st_gid}"
    return ""


def _share(fd: int, path: Path, group: int) -> None:
    """Give the pool file to the clients' group, mode 0660."""
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


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def advise_huge(mapping: mmap.mmap) -> None:
    """Ask for transparent huge pages on a mapping; a kernel without them for
    tmpfs (shmem_enabled never) keeps small pages, which is no error."""
    with contextlib.suppress(OSError):
        mapping.madvise(_MADV_HUGEPAGE)


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
