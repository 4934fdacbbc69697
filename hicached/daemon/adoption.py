"""The pool at start: the one the daemon before left (adopted), or a new one.

With ``pool.adopt`` (the default) a stopped or killed daemon leaves its pool
file and its journal (daemon/journal.py) in ``pool.shm_dir``, and the next
start with the same runtime directory maps that file again and rebuilds its
index from the journal (cache/adopt.py). A pool that cannot be adopted (no
journal, a journal of another layout version, another pool size or slab size,
a file of another length, a journal of another pool file) is replaced by a
new one, and the log says why.
``hicached serve --fresh`` replaces it whatever it is.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from hicached.config import Config
from hicached.daemon.arenas import Grant
from hicached.daemon.journal import JournalDamage, check, journal_files, journal_path, load
from hicached.errors import ConfigError, HicachedError
from hicached.wire.arena import GEN_GRANULE, Arena, file_bytes
from hicached.wire.arenas import TenantArena, TenantArenas
from hicached.wire.journal import JOURNAL_VERSION, JournalHeader, Record

log = logging.getLogger("hicached")

__all__ = ["OpenedPool", "open_arenas", "open_pool"]


@dataclass(slots=True)
class OpenedPool:
    arena: Arena | TenantArenas
    header: JournalHeader  # what the journal of this daemon starts with
    records: list[Record] | None  # the journal to adopt (None: a new pool)
    torn: int = 0  # bytes at the journal's end that did not verify


def open_pool(
    config: Config,
    path: Path,
    group: int | None,
    fresh: bool,
    on_populate: Callable[[int], None] | None = None,
) -> OpenedPool:
    """Adopt the pool at ``path`` when ``pool.adopt`` allows and it can be, else
    make a new one (removing any journal of the old)."""
    pool = config.pool
    size = pool.size_mib << 20
    _remove(_tenant_files(path))  # tenant arenas of a daemon before: not this pool
    if pool.adopt and not fresh and path.exists():

        def expected(found: JournalHeader) -> JournalHeader:
            return _header(config, found.pool_id, found.file_bytes, _identity(path))

        def reopen(found: JournalHeader) -> Arena:
            if found.file_bytes < file_bytes(size):
                raise HicachedError(
                    f"its file has {found.file_bytes} bytes, less than a pool of {size} needs"
                )
            return Arena.reopen(path, size, found.file_bytes, group, pool.huge_pages)

        adopted = _try(journal_path(path), expected, reopen)
        if isinstance(adopted, OpenedPool):
            log.info("pool: adopting %s (%d journal records)", path, len(adopted.records or ()))
            return adopted
        log.warning("pool: not adopting the pool at %s: %s; making a new one", path, adopted)
    _remove(journal_files(path))
    arena = Arena.create(path, size, pool.populate, group, on_populate, pool.huge_pages)
    header = _header(config, secrets.randbits(63), arena.file_bytes, _identity(path))
    return OpenedPool(arena, header, None)


def open_arenas(
    config: Config,
    layout: list[TenantArena],
    path: Path,
    share: Grant,
    fresh: bool,
    on_populate: Callable[[int], None] | None = None,
) -> OpenedPool:
    """Tenant arenas (daemon/arenas.py): adopt the arena files of the daemon
    before when ``pool.adopt`` allows and its journal (at ``path``'s journal
    name) describes exactly these arenas, opened to exactly the same uids and
    gids, else make them anew. Whatever else is there (a pool of one file,
    arenas of tenants no longer configured) is removed."""
    pool = config.pool
    size = pool.size_mib << 20
    journal = journal_path(path)
    missing = [arena.tenant for arena in layout if not arena.path.exists()]
    if pool.adopt and not fresh and missing and journal.exists():
        # arenas of a daemon before, but not these: say why, as for any change
        log.warning(
            "pool: not adopting the tenant arenas of %s: there is no arena file for "
            "tenant %s (a tenant added, or a pool of one file before); making new ones",
            path,
            ", ".join(missing),
        )
    if pool.adopt and not fresh and not missing:

        def expected(found: JournalHeader) -> JournalHeader:
            return _arenas_header(config, layout, found.pool_id, share)

        def reopen(found: JournalHeader) -> TenantArenas:
            return TenantArenas.reopen(size, layout, share, pool.huge_pages)

        adopted = _try(journal, expected, reopen)
        if isinstance(adopted, OpenedPool):
            keep = {arena.path for arena in layout}
            _remove(f for f in _tenant_files(path) if f not in keep)
            records = len(adopted.records or ())
            log.info("pool: adopting %d tenant arenas (%d journal records)", len(layout), records)
            return adopted
        log.warning(
            "pool: not adopting the tenant arenas of %s: %s; making new ones", path, adopted
        )
    _remove([path, *journal_files(path), *_tenant_files(path)])
    arenas = TenantArenas.create(size, layout, share, pool.populate, on_populate, pool.huge_pages)
    return OpenedPool(arenas, _arenas_header(config, layout, secrets.randbits(63), share), None)


def _try(
    journal: Path,
    expected: Callable[[JournalHeader], JournalHeader],
    reopen: Callable[[JournalHeader], Arena | TenantArenas],
) -> OpenedPool | str:
    """The pool the journal at ``journal`` describes, adopted: its header checked
    against what this configuration makes (``expected``, given the header
    found), then its files mapped again (``reopen``); else why not."""
    try:
        header, records, torn = load(journal)
        want = expected(header)
        why = check(header, want)
    except FileNotFoundError:
        return "there is no journal"
    except (OSError, JournalDamage) as exc:
        return f"the journal cannot be read: {exc}"
    if why:
        return why
    # this daemon's journal names this boot (a journal of a daemon before named none)
    header = msgspec.structs.replace(header, boot=want.boot)
    try:
        return OpenedPool(reopen(header), header, records, torn)
    except HicachedError as exc:
        return str(exc)


def _header(
    config: Config,
    pool_id: int,
    length: int,
    identity: tuple[int, int],
    arenas: list[tuple[str, int, int, int, int]] | None = None,
    readers: list[tuple[list[int], list[int]]] | None = None,
) -> JournalHeader:
    """The header of the journal of a pool this configuration makes: a file of
    ``length`` bytes (``identity``: its device and inode), or tenant arenas."""
    return JournalHeader(
        version=JOURNAL_VERSION,
        pool_bytes=config.pool.size_mib << 20,
        slab_bytes=config.pool.slab_mib << 20,
        gen_granule=GEN_GRANULE,
        file_bytes=length,
        pool_id=pool_id,
        pool_dev=identity[0],
        pool_ino=identity[1],
        arenas=arenas or [],
        readers=readers or [],
        boot=boot_id(),
    )


def boot_id() -> str:
    """The host's boot id ("" where the kernel says none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _arenas_header(
    config: Config, layout: list[TenantArena], pool_id: int, share: Grant
) -> JournalHeader:
    ids = _identities(layout)
    return _header(
        config,
        pool_id,
        sum(file_bytes(arena.size) for arena in layout),
        (0, 0),
        [
            (arena.tenant, arena.start, arena.size, dev, ino)
            for arena, (dev, ino) in zip(layout, ids, strict=True)
        ],
        [share.readers(arena.tenant) for arena in layout],
    )


def _identity(path: Path) -> tuple[int, int]:
    """The pool file at ``path`` as the journal names it: (device, inode)."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def _identities(layout: list[TenantArena]) -> list[tuple[int, int]]:
    out = []
    for arena in layout:
        try:
            out.append(_identity(arena.path))
        except FileNotFoundError:
            out.append((0, 0))
    return out


def _tenant_files(path: Path) -> list[Path]:
    """Tenant arena files beside the pool file ``path`` would be (wire/arenas.py)."""
    return sorted(path.parent.glob(f"{path.stem}.*.pool"))


def _remove(paths: Iterable[Path]) -> None:
    for stale in paths:
        try:
            stale.unlink(missing_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot remove {stale}: {exc.strerror} (it is not this daemon's: remove "
                "it, or set pool.shm_dir to a directory of its own)"
            ) from None
