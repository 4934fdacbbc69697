"""Fault injection, for tests only: a backend that wraps another one and
slows, hangs or fails its calls.

Options (in ``[storage.extra]``): ``inner`` names the real backend and
``inner_options`` its options table (its defaults when empty);
``read_delay_s`` maps a namespace digest (hex) to seconds added to every read
of it; ``readable_pages`` maps a namespace digest to how many pages of it may
be read in total before every further read fails; ``read_gate`` maps a
namespace digest to a file: every read of it waits until that file exists
(checked every 10 ms: a store that answers when a test says so); ``read_hold_s`` holds
every read's answer that long after the inner store gave it (what it read may
be let go of meanwhile); ``write_delay_s`` is added
to every write (a backend that hangs past ``storage.op_timeout_s``);
``scan_delay_s`` is added per page the startup scan lists (a slow listing);
``open_delay_s`` is added to the store's opening (a store slow to answer at
the start);
``exists_delay_s`` is added to every existence check (a slow L3 lookup), and
every one waits until the file ``exists_gate`` names exists, if it names one;
the first ``scan_failures`` listings fail after their first page, if any (a
store that breaks off a listing), the later ones run whole; while the file
``down_file`` names exists, every write and every health probe fails (a
store that goes down, and comes back once the file is removed).

Its stats add ``calls_running`` and ``peak_calls``: the backend calls inside
it at once, now and at most, so a test can see the dispatcher's bound hold.

It is registered like every backend, so a config can name it; it refuses to
start (and ``hicached check-config`` refuses it) unless the daemon's
environment has ``HICACHED_ALLOW_FAULTS=1``, which the test harness sets for
the daemons that use it (docs/storage.md): a production daemon never slows or
fails its own L3 calls because of a typo or a copied test config.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from hicached_backends.base import Backend, BackendEnv, BackendError, PageRef

ALLOW_FAULTS = "HICACHED_ALLOW_FAULTS"


def _require_allowed() -> None:
    from hicached.errors import ConfigError

    if os.environ.get(ALLOW_FAULTS) != "1":
        raise ConfigError(
            "storage.backend: 'faulty' injects faults (slow, hung and failed L3 calls) "
            f"and is for tests only; a test that means it sets {ALLOW_FAULTS}=1 in the "
            "daemon's environment. In production, name the real backend (file, s3, "
            "mooncake, memory)"
        )


class FaultyOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    inner: str = "memory"
    inner_options: dict[str, Any] = {}
    read_delay_s: dict[str, float] = {}
    read_hold_s: float = 0.0
    readable_pages: dict[str, int] = {}
    read_gate: dict[str, str] = {}
    write_delay_s: float = 0.0
    scan_delay_s: float = 0.0
    open_delay_s: float = 0.0
    exists_delay_s: float = 0.0
    exists_gate: str = ""
    scan_failures: int = 0
    down_file: str = ""


def _inner_options(options: FaultyOptions) -> tuple[type[Backend], Any]:
    from hicached.errors import ConfigError
    from hicached_backends import load_backend_class

    try:
        cls = load_backend_class(options.inner)
    except ConfigError as exc:
        raise ValueError(f"inner names no usable backend: {exc.message}") from None
    try:
        inner = msgspec.convert(options.inner_options, cls.options_type)
        cls.check_options(inner)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"inner_options of {options.inner!r}: {exc}") from None
    return cls, inner


async def _gate(path: str) -> None:
    """Wait until the file ``path`` exists ("": at once)."""
    while path:
        if await asyncio.to_thread(os.path.exists, path):
            return
        await asyncio.sleep(0.01)


class FaultyBackend(Backend):
    options_type = FaultyOptions

    @classmethod
    def check_options(cls, options: FaultyOptions) -> None:
        _require_allowed()
        _inner_options(options)

    def __init__(self, options: FaultyOptions, env: BackendEnv) -> None:
        _require_allowed()
        super().__init__(options, env)
        cls, inner_options = _inner_options(options)
        self.inner = cls(inner_options, env)
        self.lists = self.inner.lists
        self.read_left = dict(options.readable_pages)
        self.scans_to_fail = options.scan_failures
        self.calls = 0
        self.peak_calls = 0

    def _enter(self) -> None:
        self.calls += 1
        self.peak_calls = max(self.peak_calls, self.calls)

    async def open(self) -> None:
        self.inner.on_forget = self.on_forget
        if self.options.open_delay_s:
            await asyncio.sleep(self.options.open_delay_s)
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def _down(self) -> None:
        """Fail while the file ``down_file`` names exists."""
        path = self.options.down_file
        if path and await asyncio.to_thread(os.path.exists, path):
            raise BackendError("the store is down (fault injected)", retriable=True)

    async def health(self) -> None:
        await self._down()
        await self.inner.health()

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        self._enter()
        try:
            if self.options.exists_delay_s:
                await asyncio.sleep(self.options.exists_delay_s)
            await _gate(self.options.exists_gate)
            return await self.inner.exists(ns, keys)
        finally:
            self.calls -= 1

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        self._enter()
        try:
            got = await self._get(ns, pages)
            if self.options.read_hold_s:
                await asyncio.sleep(self.options.read_hold_s)
            return got
        finally:
            self.calls -= 1

    async def _get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        await _gate(self.options.read_gate.get(ns.hex(), ""))
        delay = self.options.read_delay_s.get(ns.hex(), 0.0)
        if delay:
            await asyncio.sleep(delay)
        left = self.read_left.get(ns.hex())
        if left is None:
            return await self.inner.get(ns, pages)
        allowed = list(pages[:left])
        self.read_left[ns.hex()] = left - len(allowed)
        got = await self.inner.get(ns, allowed) if allowed else []
        return got + [False] * (len(pages) - len(allowed))

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        self._enter()
        try:
            if self.options.write_delay_s:
                await asyncio.sleep(self.options.write_delay_s)
            await self._down()
            return await self.inner.put(ns, pages)
        finally:
            self.calls -= 1

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> None:
        self._enter()
        try:
            await self.inner.delete(ns, keys)
        finally:
            self.calls -= 1

    async def scan(self) -> AsyncIterator[tuple[bytes, bytes]]:
        fail, self.scans_to_fail = self.scans_to_fail > 0, self.scans_to_fail - 1
        async for item in self.inner.scan():
            if self.options.scan_delay_s:
                await asyncio.sleep(self.options.scan_delay_s)
            yield item
            if fail:
                break
        if fail:
            raise BackendError("the listing broke off (fault injected)", retriable=True)

    def stats(self) -> dict[str, int]:
        return {
            **self.inner.stats(),
            "calls_running": self.calls,
            "peak_calls": self.peak_calls,
        }
