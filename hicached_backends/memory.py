"""In-process dict backend: the reference oracle for the conformance tests.

Stores whole records (header + payload) so reads go through the same
verification as every other backend.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from hicached_backends.base import Backend, BackendEnv, PageRef
from hicached_backends.options import MemoryOptions
from hicached_backends.record import HEADER_BYTES, pack_header, verify


class MemoryBackend(Backend):
    options_type = MemoryOptions
    lists = True

    def __init__(self, options: MemoryOptions, env: BackendEnv) -> None:
        super().__init__(options, env)
        self.records: dict[tuple[bytes, bytes], bytes] = {}

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if (ns, key) not in self.records:
                break
            n += 1
        return n

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        out = []
        for key, buf in pages:
            record = self.records.get((ns, key))
            if record is None or len(record) - HEADER_BYTES != len(buf):
                out.append(False)  # absent, or asked with the wrong page size
                continue
            ok = verify(record[:HEADER_BYTES], record[HEADER_BYTES:], ns, key)
            if ok:
                buf[:] = record[HEADER_BYTES:]
            else:
                del self.records[(ns, key)]  # a bad record is dropped
                self.forgot(ns, [key])
            out.append(ok)
        return out

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        evicted: dict[tuple[bytes, bytes], None] = {}
        for key, buf in pages:
            self.records.pop((ns, key), None)
            self.records[(ns, key)] = pack_header(ns, key, buf) + bytes(buf)
            evicted.pop((ns, key), None)
            limit = self.options.max_pages
            while limit and len(self.records) > limit:
                old = next(iter(self.records))
                del self.records[old]
                evicted[old] = None
        # The daemon is told what the store let go of, as the file store tells it of
        # a recycled segment (else it reports them as L3 hits no prefetch can read),
        # and a page of this call pushed out by a later one is not stored.
        by_ns: dict[bytes, list[bytes]] = {}
        for old_ns, old_key in evicted:
            by_ns.setdefault(old_ns, []).append(old_key)
        for old_ns, keys in by_ns.items():
            self.forgot(old_ns, keys)
        return [(ns, key) in self.records for key, _ in pages]

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.records.pop((ns, key), None)

    async def scan(self) -> AsyncIterator[tuple[bytes, bytes]]:
        for ns, key in list(self.records):
            yield ns, key

    def stats(self) -> dict[str, int]:
        return {"pages": len(self.records)}
