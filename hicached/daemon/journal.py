"""The pool journal's file: written before replies, read by the next daemon.

The file lives beside the pool file (``<pool>.journal``, mode 0600, the same
tmpfs and lifetime). The request loop writes the records the cache made
(cache/journal.py) before it sends any reply, in one ``write`` a turn, so a
lease or a commit a client heard of is in the file even if the daemon is
killed the next instant (tmpfs keeps what a write put there). A journal that
grew long is replaced by one that holds only what it describes (a new file,
then ``rename``: a crash in between leaves the old one whole).

A write that fails (a full tmpfs) ends journaling for this daemon's life:
the file is removed, so the next start makes a fresh pool rather than adopt
one whose journal misses records, and the error is logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from hicached.cache.journal import Recorder
from hicached.wire.journal import (
    JournalDamage,
    JournalHeader,
    Record,
    header_bytes,
    read_header,
    read_journal,
)

log = logging.getLogger("hicached")

__all__ = ["JournalFile", "journal_path", "load"]


def journal_path(pool: Path) -> Path:
    return pool.with_name(pool.name + ".journal")


def rewrite_path(journal: Path) -> Path:
    """Where a compaction writes the journal anew before it replaces it."""
    return journal.with_name(journal.name + ".new")


def journal_files(pool: Path) -> list[Path]:
    """The journal of the pool at ``pool``, and a rewrite of it that a crash
    in a compaction may have left: what goes when the pool is not kept."""
    journal = journal_path(pool)
    return [journal, rewrite_path(journal)]


def load(path: Path) -> tuple[JournalHeader, list[Record], int]:
    """The header, the records and the bytes of torn tail of the journal at
    ``path``; ``JournalDamage`` (or ``OSError``) when it cannot be adopted."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            # in a directory others may write (/dev/shm), a journal that is not
            # this user's own and private could name any slot: never read it
            raise JournalDamage(
                f"{path} is not this daemon's own (uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o}; expected uid {os.getuid()}, mode 600)"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    finally:
        os.close(fd)
    view = memoryview(data)
    header, start = read_header(view)
    records, torn = read_journal(view, start)
    return header, records, torn


class JournalFile:
    """The journal of this daemon's pool, open for appending."""

    def __init__(self, path: Path, header: JournalHeader, recorder: Recorder) -> None:
        self.path = path
        self.header = header
        self.recorder = recorder
        self._fd: int | None = None
        self.failed = False

    def start(self) -> None:
        """Write a new journal: the header and what the recorder holds now."""
        self._replace(header_bytes(self.header) + self.recorder.snapshot())

    def flush(self) -> None:
        """Write the records made since the last flush (before a reply goes out)."""
        recorder = self.recorder
        if not recorder.waiting:
            return
        data = recorder.take()
        if self._fd is None:
            recorder.unfiled()
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._fail(f"cannot write the pool journal {self.path}: {exc.strerror}")
            return
        if recorder.should_compact():
            self._replace(header_bytes(self.header) + recorder.snapshot())

    def _replace(self, data: bytes) -> None:
        tmp = rewrite_path(self.path)
        try:
            tmp.unlink(missing_ok=True)  # left by a crash mid-rewrite
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except BaseException:
                os.close(fd)
                raise
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._fail(f"cannot write the pool journal {self.path}: {exc.strerror}")
            return
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        os.lseek(fd, 0, os.SEEK_END)

    def _fail(self, why: str) -> None:
        self.failed = True
        log.error("%s: the pool will not be adopted by the next start", why)
        self.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check(header: JournalHeader, expected: JournalHeader) -> str:
    """Why a pool with ``header`` cannot be adopted by a daemon that would make
    one like ``expected`` ("" when it can)."""
    for name in ("pool_bytes", "slab_bytes", "gen_granule", "file_bytes"):
        have, want = getattr(header, name), getattr(expected, name)
        if have != want:
            return f"its {name} is {have}, this configuration makes {want}"
    if header.boot and expected.boot and header.boot != expected.boot:
        # only a pool.shm_dir that is not a tmpfs keeps a pool across a reboot,
        # and a crash of the host may have left on its disk pages that the
        # journal does not describe (or the other way round)
        return (
            f"it was made before the host restarted (boot {header.boot}, now "
            f"{expected.boot}); pool.shm_dir is meant to be a tmpfs"
        )
    if bool(header.arenas) != bool(expected.arenas):
        made = "tenant arenas" if header.arenas else "one file"
        return f"it is a pool of {made}, this configuration makes the other"
    if header.arenas:
        have = [tuple(a[:3]) for a in header.arenas]
        want = [tuple(a[:3]) for a in expected.arenas]
        if have != want:
            return f"its tenant arenas are {have}, this configuration makes {want}"
        if [tuple(a[3:]) for a in header.arenas] != [tuple(a[3:]) for a in expected.arenas]:
            return "it is the journal of other arena files"
        if _readers(header) != _readers(expected):
            return (
                f"its arena files open to {_readers(header)} (tenant: uids, gids), this "
                f"configuration gives them to {_readers(expected)}; a process that opened "
                "one before would keep reading it"
            )
        return ""
    if (header.pool_dev, header.pool_ino) != (expected.pool_dev, expected.pool_ino):
        return (
            f"it is the journal of another pool file (device {header.pool_dev}, inode "
            f"{header.pool_ino}; the file there is device {expected.pool_dev}, inode "
            f"{expected.pool_ino})"
        )
    return ""


__all__ += ["JournalDamage", "check"]


def _readers(header: JournalHeader) -> dict[str, tuple[list[int], list[int]]]:
    """Each tenant arena's uids and gids, by tenant (none recorded: an older journal)."""
    if len(header.readers) != len(header.arenas):
        return {}
    return {
        arena[0]: (list(uids), list(gids))
        for arena, (uids, gids) in zip(header.arenas, header.readers, strict=True)
    }
