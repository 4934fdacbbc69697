"""Fault injection, for tests only: a backend that wraps another one and
slows or fails reads for chosen namespaces.

Options (in ``[storage.extra]``): ``inner`` names the real backend (its own
options are the defaults); ``read_delay_s`` maps a namespace digest (hex) to
seconds added to every read of it; ``readable_pages`` maps a namespace digest
to how many pages of it may be read in total before every further read fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import msgspec

from hicached_backends.base import Backend, BackendEnv, PageRef


class FaultyOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    inner: str = "memory"
    read_delay_s: dict[str, float] = {}
    readable_pages: dict[str, int] = {}


class FaultyBackend(Backend):
    options_type = FaultyOptions

    def __init__(self, options: FaultyOptions, env: BackendEnv) -> None:
        super().__init__(options, env)
        from hicached_backends import load_backend_class

        cls = load_backend_class(options.inner)
        self.inner = cls(cls.options_type(), env)
        self.read_left = dict(options.readable_pages)

    async def open(self) -> None:
        self.inner.on_forget = self.on_forget
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def health(self) -> None:
        await self.inner.health()

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        return await self.inner.exists(ns, keys)

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
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
        return await self.inner.put(ns, pages)

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> None:
        await self.inner.delete(ns, keys)

    async def scan(self) -> AsyncIterator[tuple[bytes, bytes]]:
        async for item in self.inner.scan():
            yield item
