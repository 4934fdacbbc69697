"""A Mooncake backend alone on a real master, for tests that drive one
without a daemon, and a second one beside it on the same store: another
host's, or a raw writer that puts objects under the first one's names."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicached_backends.base import BackendEnv
from hicached_backends.options import MooncakeOptions
from tests.services import MooncakeMaster

if TYPE_CHECKING:
    from hicached_backends.mooncake import MooncakeBackend


def mooncake_options(master: MooncakeMaster, **more: Any) -> MooncakeOptions:
    """Options for a backend on ``master``: a 32 MiB segment, a 16 MiB buffer,
    and ``more``."""
    return MooncakeOptions(
        master=master.master,
        metadata_server=master.metadata,
        global_segment_mib=32,
        local_buffer_mib=16,
        **more,
    )


def mooncake_backend(master: MooncakeMaster, **more: Any) -> MooncakeBackend:
    from hicached_backends.mooncake import MooncakeBackend

    return MooncakeBackend(mooncake_options(master, **more), BackendEnv(Path("/nonexistent")))


@contextmanager
def here_and_other(
    master: MooncakeMaster, ns: bytes, keys: list[bytes]
) -> Iterator[tuple[asyncio.AbstractEventLoop, MooncakeBackend, MooncakeBackend]]:
    """Two backends on ``master``, open on a loop of their own: ``here``, the
    one under test, and ``other`` beside it. ``keys`` of ``ns`` are deleted
    first (an earlier test may have left them); both are closed after."""
    here, other = mooncake_backend(master), mooncake_backend(master)
    loop = asyncio.new_event_loop()
    try:
        for b in (here, other):
            loop.run_until_complete(b.open())
        loop.run_until_complete(here.delete(ns, keys))
        yield loop, here, other
    finally:
        for b in (here, other):
            loop.run_until_complete(b.close())
        loop.close()
