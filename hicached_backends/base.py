"""The backend contract: a small async base class with batched operations.

Every operation names pages by (namespace digest, page key), both 16 bytes.
Data moves between the backend and pool slots in place (``PageRef.buf`` is a
writable view of the slot). A backend must verify what it returns: ``get``
reports a page as read only if its record's namespace, key, length and
checksum all match (see record.py); anything else is a miss.

Backends are opened once, used from the daemon's event loop, and closed at
shutdown. Blocking work goes to the backend's own bounded executor.
Failures raise BackendError; ``retriable`` says whether the dispatcher may
try again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import msgspec

from hicached.errors import HicachedError


def let_go(*pools: Executor | None) -> None:
    """Shut thread pools down at a backend's close without waiting for calls still
    running (past the stop deadline, a hung store's): each ends on its own, and
    the daemon exits without them (hicached/daemon/server.py); queued calls are dropped."""
    for pool in pools:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class BackendError(HicachedError):
    """A storage operation failed; ``retriable`` for transient faults."""

    code = "backend"

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class PageRef(NamedTuple):
    """One page: its key and the pool slot it is read into or written from."""

    key: bytes
    buf: memoryview


@dataclass(frozen=True)
class BackendEnv:
    """What the daemon gives a backend: where to keep files, and the pool."""

    data_dir: Path
    pool: memoryview | None = None  # the whole arena, for backends that register it
    pool_path: str = ""  # the arena's file, for backends whose helper processes map it
    pool_huge_pages: str = "off"  # pool.huge_pages: how a helper process maps it


class NoOptions(msgspec.Struct, forbid_unknown_fields=True):
    """For backends without options."""


class Backend(ABC):
    """Base class of every L3 backend."""

    #: the typed options table this backend reads from the config
    options_type: ClassVar[type[msgspec.Struct]] = NoOptions
    #: ``exists`` counts exactly; False: it may count past a hole inside the run
    #: (never short of the run), when asking about every key would cost too much
    exact_exists: ClassVar[bool] = True
    #: ``scan`` yields every page the store holds. False (the default, as ``scan``
    #: yields nothing): an ended scan proves nothing, and the daemon asks the store
    #: about every key it does not know (docs/storage.md, Unknown is not absent)
    lists: bool = False

    @classmethod
    def check_options(cls, options: Any) -> None:
        """Refuse options that a start would refuse, before anything is opened.

        ``hicached check-config`` and the daemon's start both run this on the
        decoded ``options_type`` table (whose own ``__post_init__`` has already
        checked each value): override it for what a default cannot give, such
        as a required name, or for options that only make sense together.
        Raise ValueError whose message starts with the option's name; it is
        reported as ``storage.<backend>.<name>: ...``.
        """
        return None

    def __init__(self, options: Any, env: BackendEnv) -> None:
        self.options = options
        self.env = env
        #: set by the daemon: called with (namespace, keys) the store dropped on its own
        self.on_forget: Callable[[bytes, list[bytes]], None] | None = None

    def forgot(self, ns: bytes, keys: list[bytes]) -> None:
        """Tell the daemon these pages are gone (evicted, found corrupt)."""
        if self.on_forget is not None and keys:
            self.on_forget(ns, keys)

    async def open(self) -> None:
        """Connect, create files, start pools; raise BackendError if it cannot.
        A retriable one says the store does not answer now: the daemon starts
        with it down (L2 serves) and calls ``health`` after each cooldown, which
        then connects what ``open`` could not, until it passes."""
        return None

    async def close(self) -> None:
        """Flush and release everything; idempotent."""
        return None

    async def health(self) -> None:
        """Raise BackendError if the backend cannot serve now (connecting first
        where ``open`` found the store unreachable)."""
        return None

    @abstractmethod
    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the store holds (see ``exact_exists``)."""

    @abstractmethod
    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        """Read each page into its buffer; True where the page was found and verified."""

    @abstractmethod
    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        """Store each page durably; True where it is stored. Idempotent per key."""

    @abstractmethod
    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> None:
        """Forget these pages (missing ones are fine)."""

    async def scan(self) -> AsyncIterator[tuple[bytes, bytes]]:
        """(namespace, key) of every page the store holds, for the startup index.

        Backends that cannot list cheaply yield nothing and leave ``lists``
        False; prefetch and the daemon's lookups ask ``exists`` instead. One
        that sets ``lists`` must yield every page, or raise if it cannot.
        """
        return
        yield  # pragma: no cover

    def stats(self) -> dict[str, int]:
        """Backend-specific counters for status and metrics."""
        return {}
