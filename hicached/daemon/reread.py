"""Reading the config file for a reload (SIGHUP), and the metrics token file
with it: off the event loop, on a thread of its own, under a deadline
(``server.reload_timeout_s``), since a file on a hung filesystem blocks
whoever reads it. What the reload then changes is daemon/reload.py's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
from typing import NamedTuple

from hicached.config import Config, load_config
from hicached.daemon.access import events_group_id
from hicached.daemon.metrics_http import read_token
from hicached.daemon.waits import bounded
from hicached.errors import ConfigError

__all__ = ["ConfigReader", "NotRegular", "ReadTimeout", "Reread"]


class Reread(NamedTuple):
    """What a reload read: the config, and the metrics token (None when none was asked)."""

    config: Config
    token: bytes | None


class NotRegular(ConfigError):
    """The config path names something other than a regular file (a FIFO would
    hold the reading thread until someone writes to it)."""


class ReadTimeout(ConfigError):
    """The config file was not read within ``server.reload_timeout_s``."""


class ConfigReader:
    """Reads the config file for a reload off the event loop, under a deadline.

    On a filesystem that hangs (an NFS server gone away) a stat or a read of the
    file blocks in the kernel, and no Python code can interrupt it. The read
    runs on a daemon thread of its own, which never holds up the daemon's
    stop, and the reload waits for it at most ``timeout`` seconds: then it
    fails (``ReadTimeout``) and the daemon keeps its config. At most one read
    runs at a time: a reload while the one before still hangs fails at once,
    so SIGHUPs against a hung file cannot pile up threads."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    async def read(self, path: str, timeout: float, token_file: str = "") -> Reread:
        """The config at ``path`` and, with ``token_file`` (the running daemon's
        metrics.token_file: a new path needs a restart), the token in it."""
        hung = self._thread
        if hung is not None and hung.is_alive():
            raise ReadTimeout(
                f"the read of {path} for a reload before has still not returned "
                "(a hung filesystem?)"
            )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Reread] = loop.create_future()

        def work() -> None:
            try:
                outcome: Reread | BaseException = _read(path, token_file)
            except BaseException as exc:  # handed to the loop, which raises it
                outcome = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, done, outcome)

        self._thread = threading.Thread(target=work, name="hicached-reload-read", daemon=True)
        self._thread.start()
        try:
            return await bounded(done, timeout)
        except TimeoutError:
            raise ReadTimeout(
                f"{path} was not read within server.reload_timeout_s ({timeout:g}s; a hung "
                "filesystem?)"
            ) from None


def _settle(done: asyncio.Future[Reread], outcome: Reread | BaseException) -> None:
    if done.done():  # the reload gave up waiting
        return
    if isinstance(outcome, BaseException):
        done.set_exception(outcome)
    else:
        done.set_result(outcome)


def _read(path: str, token_file: str) -> Reread:
    """The config at ``path`` (and the token in ``token_file``), on the reader's
    thread: the stat may hang too. A bad token file fails the reload as a bad
    config does: nothing changes, the token before it stays."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        regular = True  # names nothing: load_config says so
    if not regular:
        raise NotRegular(f"{path} is not a regular file")
    config = load_config(path)
    # the group events.group names, looked up here: a restart applies it, and
    # one that names no group would fail it (the lookup may ask a directory service)
    events_group_id(config)
    return Reread(config, read_token(token_file) if token_file else None)
