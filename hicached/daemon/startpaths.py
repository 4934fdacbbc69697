"""What a start needs of the file system beside the directories it makes
(daemon/access.py makes the private ones): the pool's directory, and where
a file store keeps its segments. The start and ``hicached check-config``
check them alike, naming the key, before anything is made."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hicached.config import Config, data_dir
from hicached.errors import ConfigError


def existing_directory(path: Path, key: str) -> None:
    """``path`` is a directory (a link to one is fine: /dev/shm may be one)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"{key}: {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{key}: {path} is not a directory")


def makeable_directory(path: Path, key: str) -> None:
    """``path`` is a directory, or can be made one: the nearest part of it
    that exists is a directory (the start makes the rest)."""
    for part in (path, *path.parents):
        if os.path.lexists(part):
            existing_directory(part, key)
            return


def check_paths(config: Config) -> None:
    """``pool.shm_dir``, and with the file store the directory of its
    segments (``storage.file.path``, by default under ``storage.data_dir``)."""
    existing_directory(Path(config.pool.shm_dir), "pool.shm_dir")
    if config.storage.backend == "file":
        path = config.storage.file.path
        where = Path(path) if path else data_dir(config) / "pages"
        makeable_directory(where, "storage.file.path" if path else "storage.data_dir")
