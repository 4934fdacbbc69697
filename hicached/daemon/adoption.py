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

from hicached.config import Config
from hicached.daemon.arenas import Grant
from hicached.daemon.journal import JournalDamage, check, journal_path, load
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
    slab = pool.slab_mib << 20
    journal = journal_path(path)
    _remove(_tenant_files(path))  # tenant arenas of a daemon before: not this pool
    if pool.adopt and not fresh and path.exists():
        why = ""
        try:
            header, records, torn = load(journal)
            dev, ino = _identity(path)
            why = check(
                header,
                JournalHeader(
                    version=JOURNAL_VERSION,
                    pool_bytes=size,
                    slab_bytes=slab,
                    gen_granule=GEN_GRANULE,
                    file_bytes=header.file_bytes,
                    pool_id=header.pool_id,
                    pool_dev=dev,
                    pool_ino=ino,
                ),
            )
            if not why and header.file_bytes < file_bytes(size):
                why = f"its file has {header.file_bytes} bytes, less than a pool of {size} needs"
        except FileNotFoundError:
            why = "it has no journal"
        except (OSError, JournalDamage) as exc:
            why = f"its journal cannot be read: {exc}"
        if not why:
            try:
                arena = Arena.reopen(path, size, header.file_bytes, group, pool.huge_pages)
            except HicachedError as exc:
                why = str(exc)
            else:
                log.info("pool: adopting %s (%d journal records)", path, len(records))
                return OpenedPool(arena, header, records, torn)
        log.warning("pool: not adopting the pool at %s: %s; making a new one", path, why)
    try:
        journal.unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot remove the old pool journal {journal}: {exc.strerror} (it is not "
            "this daemon's: remove it, or set pool.shm_dir to a directory of its own)"
        ) from None
    arena = Arena.create(path, size, pool.populate, group, on_populate, pool.huge_pages)
    dev, ino = _identity(path)
    header = JournalHeader(
        version=JOURNAL_VERSION,
        pool_bytes=size,
        slab_bytes=slab,
        gen_granule=GEN_GRANULE,
        file_bytes=arena.file_bytes,
        pool_id=secrets.randbits(63),
        pool_dev=dev,
        pool_ino=ino,
    )
    return OpenedPool(arena, header, None)


def _identity(path: Path) -> tuple[int, int]:
    """The pool file at ``path`` as the journal names it: (device, inode)."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


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
    keep = {arena.path for arena in layout}
    if pool.adopt and not fresh and all(arena.path.exists() for arena in layout):
        why = ""
        try:
            header, records, torn = load(journal)
            expected = _header(config, layout, header.pool_id, _identities(layout), share)
            why = check(header, expected)
        except FileNotFoundError:
            why = "they have no journal"
        except (OSError, JournalDamage) as exc:
            why = f"their journal cannot be read: {exc}"
        if not why:
            try:
                arenas = TenantArenas.reopen(size, layout, share, pool.huge_pages)
            except HicachedError as exc:
                why = str(exc)
            else:
                _remove(f for f in _tenant_files(path) if f not in keep)
                log.info(
                    "pool: adopting %d tenant arenas (%d journal records)",
                    len(layout),
                    len(records),
                )
                return OpenedPool(arenas, header, records, torn)
        log.warning("pool: not adopting the tenant arenas of %s: %s; making new ones", path, why)
    _remove([path, journal, *_tenant_files(path)])
    arenas = TenantArenas.create(size, layout, share, pool.populate, on_populate, pool.huge_pages)
    header = _header(config, layout, secrets.randbits(63), _identities(layout), share)
    return OpenedPool(arenas, header, None)


def _header(
    config: Config,
    layout: list[TenantArena],
    pool_id: int,
    ids: list[tuple[int, int]],
    share: Grant,
) -> JournalHeader:
    return JournalHeader(
        version=JOURNAL_VERSION,
        pool_bytes=config.pool.size_mib << 20,
        slab_bytes=config.pool.slab_mib << 20,
        gen_granule=GEN_GRANULE,
        file_bytes=sum(file_bytes(arena.size) for arena in layout),
        pool_id=pool_id,
        pool_dev=0,
        pool_ino=0,
        arenas=[
            (arena.tenant, arena.start, arena.size, dev, ino)
            for arena, (dev, ino) in zip(layout, ids, strict=True)
        ],
        readers=[share.readers(arena.tenant) for arena in layout],
    )


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
