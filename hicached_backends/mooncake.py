"""Mooncake Store backend: pages in a Mooncake distributed store.

Each page is one object named ``hc/<namespace hex>/<key hex>`` whose value is
a full record (record.py), moved zero-copy: the daemon's whole pool is
registered with the store once, and every object is written from (and read
into) two buffers, its 64-byte header in a small registered header area and
its payload in the pool slot itself. After a read the header's checksum is
verified against the slot, so a wrong or damaged object is a miss.

Mooncake cannot list its keys cheaply, so the startup scan learns nothing;
prefetch asks ``exists``. Calls block, so they run in a small thread pool.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from mooncake.store import MooncakeDistributedStore

from hicached_backends.base import Backend, BackendEnv, BackendError, PageRef, let_go
from hicached_backends.options import MooncakeOptions
from hicached_backends.record import (
    HEADER_BYTES,
    address_of,
    all_within,
    checksums,
    nbytes,
    other_version,
    pack_headers,
    verify,
    verify_many,
)

log = logging.getLogger("hicached.mooncake")

MIB = 1 << 20
HEADER_SLOTS = 8192
# Codes that mean "no such page here", not "the store is failing".
OBJECT_NOT_FOUND = -704
BUFFER_SIZE_MISMATCH = -600
_MISSES = {OBJECT_NOT_FOUND, BUFFER_SIZE_MISMATCH}
# A read of an object shorter than its buffers fails as a transfer does (a
# network fault gives it too): the object's size tells them apart.
TRANSFER_FAIL = -800
# An object of another size than the page's record is read whole to be judged
# (``_judge_other_size``) up to this many times that record's size; a larger one
# is removed unread.
_JUDGED_UP_TO = 2


def _address(buf: memoryview) -> int:
    found = address_of(buf)
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if found is None else found


_PROBE = "hc/health-probe"  # an object name no page has (pages: hc/<ns hex>/<key hex>)


# seconds the master and an HTTP metadata server each have to accept a
# connection before the store's setup is called (_reachable)
_REACH_S = 3.0

# seconds a trial setup in a process of its own may take (_trial):
# one that answers takes well under a second
_TRIAL_S = 15.0

# threads of existence checks (L3 lookups): short calls, two so one seldom waits for another
_CHECK_THREADS = 2


async def _reachable(options: MooncakeOptions) -> None:
    """Mooncake's setup holds the GIL while it retries an address that does
    not answer (some 90 s), and nothing else of the daemon runs meanwhile,
    not even a SIGTERM's stop: each address is first asked on the loop."""
    for what, host, port in options.addresses():
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _REACH_S)
        except (OSError, asyncio.TimeoutError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "no answer"
            raise BackendError(
                f"Mooncake {what} at {host}:{port} does not answer ({why})", retriable=True
            ) from None
        writer.close()


async def _trial(options: MooncakeOptions) -> None:
    """A setup in a process of its own first (hicached_backends/mooncake_trial.py):
    a master that accepts connections but does not answer (hung, or another
    service on its port) would hold the daemon's own setup, and with it
    every request and the stop, for minutes."""
    o = options
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hicached_backends.mooncake_trial",
        str(os.getpid()),
        o.local_hostname,
        o.metadata_server,
        o.protocol,
        o.device,
        o.master,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        code = await asyncio.wait_for(proc.wait(), _TRIAL_S)
    except asyncio.TimeoutError:
        raise BackendError(
            f"Mooncake master at {o.master} accepts connections but a client's setup "
            f"did not end within {_TRIAL_S:.0f}s",
            retriable=True,
        ) from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if code != 0:
        raise BackendError(
            f"Mooncake setup failed with the master at {o.master} and the metadata "
            f"server at {o.metadata_server} answering (tried in a process of its own, "
            f"exit {code}): are they Mooncake's, and the protocol and device right?",
            retriable=True,
        )


class MooncakeBackend(Backend):
    options_type = MooncakeOptions

    @classmethod
    def check_options(cls, options: MooncakeOptions) -> None:
        options.check_required()

    def __init__(self, options: MooncakeOptions, env: BackendEnv) -> None:
        super().__init__(options, env)
        self._store: Any = None
        self._pool: ThreadPoolExecutor | None = None
        # existence checks (L3 lookups) and the health probe: never queued behind
        # the batch reads and writes that hold every thread of ``_pool``
        self._checks: ThreadPoolExecutor | None = None
        self._hashers: ThreadPoolExecutor | None = None
        self._parts = 1  # slices of one put batch's checksums (MooncakeOptions.hash_parts)
        self._headers = np.zeros((HEADER_SLOTS, HEADER_BYTES), dtype=np.uint8)
        self._free_headers: collections.deque[int] = collections.deque(range(HEADER_SLOTS))
        self._header_wait = asyncio.Condition()
        self._arena: tuple[int, int] | None = None  # registered pool: (address, size)
        self._setup: asyncio.Future[None] | None = None  # the store's setup (_connect)
        self._refused: BackendError | None = None  # a setup failed with the store answering
        self.counters = {"errors": 0, "bad_objects": 0, "bad_removed": 0, "bad_remove_failed": 0}

    # -- lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        o = self.options
        self._pool = ThreadPoolExecutor(o.threads, thread_name_prefix="hicached-mooncake")
        self._checks = ThreadPoolExecutor(
            _CHECK_THREADS, thread_name_prefix="hicached-mooncake-exists"
        )
        self._parts = o.hash_parts()
        if o.verify_threads:
            self._hashers = ThreadPoolExecutor(
                o.verify_threads, thread_name_prefix="hicached-verify"
            )
        try:
            await self._connect()
        except BackendError as exc:
            if not exc.retriable:
                await self.close()  # the start fails: no thread stays behind
            # else unreachable now: the daemon serves from L2 and its probe
            # (health) connects once the store answers
            raise

    async def _connect(self) -> None:
        """Set the store up, once its master and metadata server accept a
        connection. A failed setup with both answering is not retriable. One
        setup at a time: a caller cancelled (a probe past its timeout) leaves
        it running, and the next caller waits for that one."""
        if self._store is not None:
            return
        if self._refused is not None:
            raise self._refused
        if self._setup is None or self._setup.done():
            self._setup = asyncio.ensure_future(self._set_up())
            self._setup.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(self._setup)

    async def _set_up(self) -> None:
        await _reachable(self.options)
        await _trial(self.options)
        o = self.options
        store = MooncakeDistributedStore()
        rc = await self._blocking(
            store.setup,
            o.local_hostname,
            o.metadata_server,
            o.global_segment_mib * MIB,
            o.local_buffer_mib * MIB,
            o.protocol,
            o.device,
            o.master,
        )
        if rc != 0:
            # Not tried again: each try leaks Mooncake's memory and threads in
            # this process, and what the trial's setup passed is the config's
            self._refused = BackendError(
                f"Mooncake setup failed (code {rc}) with the master at {o.master} and the "
                f"metadata server at {o.metadata_server} answering: global_segment_mib, "
                "local_buffer_mib, protocol or device cannot be given on this host; "
                "L3 stays down until the daemon restarts"
            )
            raise self._refused
        try:
            await self._register(store, int(self._headers.ctypes.data), self._headers.nbytes)
            if self.env.pool is not None:
                base = _address(self.env.pool)
                await self._register(store, base, len(self.env.pool))
                self._arena = (base, len(self.env.pool))
        except BaseException:
            await self._blocking(store.close)
            raise
        self._store = store

    async def close(self) -> None:
        if self._setup is not None:
            self._setup.cancel()  # a setup still running on its thread is not waited for
        if self._store is not None:
            store, self._store = self._store, None
            await self._blocking(store.close)
        let_go(self._pool, self._checks, self._hashers)
        self._pool = self._checks = self._hashers = None

    async def health(self) -> None:
        await self._connect()  # not reachable at start: set up once it is
        rc = await self._blocking(self._store.health_check, checks=True)
        if rc != 0:
            raise BackendError(f"Mooncake health check failed (code {rc})", retriable=True)
        # the client's own check passes with the master gone: ask the master
        found = await self._blocking(self._store.batch_is_exist, [_PROBE], checks=True)
        if all(code < 0 for code in found):
            raise BackendError(
                f"Mooncake master at {self.options.master} does not answer (codes {found})",
                retriable=True,
            )

    # -- helpers -------------------------------------------------------------------

    async def _blocking(self, fn: Any, *args: Any, checks: bool = False) -> Any:
        """``fn(*args)`` on a thread: of ``_checks`` for existence checks, else ``_pool``."""
        pool = self._checks if checks else self._pool
        if pool is None:
            raise BackendError("Mooncake backend is closed", retriable=True)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _register(self, store: Any, address: int, size: int) -> None:
        rc = await self._blocking(store.register_buffer, address, size)
        if rc != 0:
            raise BackendError(f"Mooncake could not register {size} bytes (code {rc})")

    def _in_arena(self, address: int, length: int) -> bool:
        if self._arena is None:
            return False
        base, size = self._arena
        return base <= address and address + length <= base + size

    def _all_in_arena(self, addresses: list[int], lengths: list[int]) -> bool:
        """Whether every buffer lies in the registered pool (as pool slots do)."""
        if self._arena is None:
            return not addresses
        return all_within(*self._arena, addresses, lengths)

    async def _take_headers(self, n: int) -> list[int]:
        async with self._header_wait:
            await self._header_wait.wait_for(lambda: len(self._free_headers) >= n)
            return [self._free_headers.popleft() for _ in range(n)]

    async def _give_headers(self, slots: list[int]) -> None:
        async with self._header_wait:
            self._free_headers.extend(slots)
            self._header_wait.notify_all()

    async def _with_buffers(self, pages: Sequence[PageRef], call: Any) -> Any:
        """Run ``call(chunk, addresses, header_slots)`` with headers taken, and any
        buffer outside the registered pool registered for the call."""
        if self._store is None:
            raise BackendError("Mooncake store is not open", retriable=True)
        out: list[Any] = []
        step = HEADER_SLOTS // 4
        for start in range(0, len(pages), step):
            chunk = pages[start : start + step]
            addresses = [_address(p.buf) for p in chunk]
            lengths = [nbytes(p.buf) for p in chunk]
            foreign = (
                []
                if self._all_in_arena(addresses, lengths)
                else [
                    (address, length)
                    for address, length in zip(addresses, lengths, strict=True)
                    if not self._in_arena(address, length)
                ]
            )
            for address, size in foreign:
                await self._register(self._store, address, size)
            headers = await self._take_headers(len(chunk))
            try:
                out.extend(await call(chunk, addresses, headers))
            finally:
                await self._give_headers(headers)
                for address, _ in foreign:
                    await self._blocking(self._store.unregister_buffer, address)
        return out

    def _ptrs(
        self, pages: Sequence[PageRef], addresses: list[int], headers: list[int]
    ) -> tuple[list[list[int]], list[list[int]]]:
        base = int(self._headers.ctypes.data)
        ptrs = [[base + h * HEADER_BYTES, a] for a, h in zip(addresses, headers, strict=True)]
        sizes = [[HEADER_BYTES, nbytes(p.buf)] for p in pages]
        return ptrs, sizes

    @staticmethod
    def names(ns: bytes, keys: Sequence[bytes]) -> list[str]:
        """The object names of ``keys``: ``hc/<namespace hex>/<key hex>``."""
        prefix = f"hc/{ns.hex()}/"
        return [prefix + key.hex() for key in keys]

    def _failed(self, codes: list[int], what: str) -> None:
        """Every call failed, and not because a page is absent: the store is failing."""
        if codes and all(c < 0 and c not in _MISSES for c in codes):
            self.counters["errors"] += 1
            raise BackendError(
                f"Mooncake {what} failed (codes {sorted(set(codes))})", retriable=True
            )

    # -- operations ------------------------------------------------------------------

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        if self._store is None:
            raise BackendError("Mooncake store is not open", retriable=True)
        found = await self._blocking(self._store.batch_is_exist, self.names(ns, keys), checks=True)
        if all(f < 0 for f in found):
            raise BackendError("Mooncake exists failed", retriable=True)
        n = 0
        for f in found:
            if f != 1:
                break
            n += 1
        return n

    async def put(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        async def call(
            chunk: Sequence[PageRef], addresses: list[int], headers: list[int]
        ) -> list[bool]:
            def blocking() -> list[int]:  # headers, checksums and the store call, off the loop
                bufs = [page.buf for page in chunk]
                lengths = list(map(nbytes, bufs))
                sums = checksums(
                    bufs,
                    addresses=addresses,
                    lengths=lengths,
                    pool=self._hashers,
                    parts=self._parts,
                )
                packed = b"".join(pack_headers(ns, [page.key for page in chunk], lengths, sums))
                self._headers[headers] = np.frombuffer(packed, np.uint8).reshape(-1, HEADER_BYTES)
                ptrs, sizes = self._ptrs(chunk, addresses, headers)
                names = self.names(ns, [p.key for p in chunk])
                return list(self._store.batch_put_from_multi_buffers(names, ptrs, sizes))

            codes = await self._blocking(blocking)
            self._failed(codes, "put")
            return [c == 0 for c in codes]

        return list(await self._with_buffers(pages, call))

    async def get(self, ns: bytes, pages: Sequence[PageRef]) -> list[bool]:
        # The store refuses a key twice in one batch: read each once, copy to the rest.
        keys = [page.key for page in pages]
        first: dict[bytes, int] = {}
        unique: Sequence[PageRef] = pages
        if len(set(keys)) < len(keys):
            unique = []
            for page in pages:
                if page.key not in first:
                    first[page.key] = len(unique)
                    unique.append(page)

        async def call(
            chunk: Sequence[PageRef], addresses: list[int], headers: list[int]
        ) -> list[bool]:
            def blocking() -> tuple[
                list[int], list[bool], list[bool], list[bool | None]
            ]:  # the store call and the checks, off the loop
                ptrs, sizes = self._ptrs(chunk, addresses, headers)
                chunk_keys = [p.key for p in chunk]
                names = self.names(ns, chunk_keys)
                codes = list(self._store.batch_get_into_multi_buffers(names, ptrs, sizes))
                verified = verify_many(
                    self._headers[headers],
                    [p.buf for p in chunk],
                    ns,
                    chunk_keys,
                    addresses=addresses,
                    lengths=[size for _, size in sizes],
                    pool=self._hashers,
                    parts=self.options.verify_threads + 1,
                )
                oks = [
                    code == HEADER_BYTES + len(page.buf) and good
                    for page, code, good in zip(chunk, codes, verified, strict=True)
                ]
                # another format version's record: another writer's, never removed
                theirs = [
                    code >= HEADER_BYTES and other_version(self._headers[h])
                    for code, h in zip(codes, headers, strict=True)
                ]
                # objects of another size: None where the object is not (or may not be)
                resized: list[bool | None] = []
                transfers_fail = False  # a failed transfer here was the transfer's fault
                for name, page, code in zip(names, chunk, codes, strict=True):
                    kept = None
                    if code == BUFFER_SIZE_MISMATCH or (
                        code == TRANSFER_FAIL and not transfers_fail
                    ):
                        kept = self._judge_other_size(name, ns, page)
                        # an object of its record's size, or none: a network fault
                        # fails this call's transfers, the rest are not asked about
                        transfers_fail |= code == TRANSFER_FAIL and kept is None
                    resized.append(kept)
                return codes, oks, theirs, resized

            codes, oks, theirs, resized = await self._blocking(blocking)
            # an object of another size is an answer about the page, not a failed call
            codes = [
                BUFFER_SIZE_MISMATCH if kept is not None else code
                for code, kept in zip(codes, resized, strict=True)
            ]
            self._failed(codes, "get")
            bad = [
                (page.key, other if kept is None else kept)
                for page, code, ok, other, kept in zip(
                    chunk, codes, oks, theirs, resized, strict=True
                )
                if (code > 0 and not ok) or kept is not None
            ]
            self.counters["bad_objects"] += len(bad)
            doomed = [key for key, other in bad if not other]
            if doomed:
                await self._remove_bad(ns, doomed)
            # A page gone (removed by another host, evicted by the store) or bad is
            # forgotten, as S3 does: else it stays known, a match counts it as an L3
            # hit no read can serve, and it is never written again. A failed call
            # (any other code) tells nothing of the page.
            self.forgot(
                ns,
                [
                    page.key
                    for page, code, ok in zip(chunk, codes, oks, strict=True)
                    if not ok and (code > 0 or code in _MISSES)
                ],
            )
            return oks

        got = list(await self._with_buffers(unique, call))
        if unique is pages:
            return got
        out = []
        for page in pages:
            source = unique[first[page.key]]
            ok = got[first[page.key]] and len(source.buf) == len(page.buf)
            if ok and source is not page:
                page.buf[:] = source.buf
            out.append(ok)
        return out

    def _judge_other_size(self, name: str, ns: bytes, page: PageRef) -> bool | None:
        """Of an object that a read could not take into the page's buffers: None
        unless it has another size than the page's record (gone, or the read
        failed on the way); else whether it stays. It is read whole and judged
        as S3 judges an object: a record of another format version (another
        writer's) or an intact record of the page of its own size (the
        reader's mismatch) stays, anything else goes (``_remove_bad``), or
        every later put of the page would be acknowledged and keep it. One
        larger than ``_JUDGED_UP_TO`` times the page's record goes unread: it
        cannot be the page's record, of this format version or another (its
        namespace fixes the page's size), and read whole it would be taken
        into the daemon's memory. A failed transfer (-800) of an
        object of the record's size is the network's: ``get`` asks about no
        later failed transfer of that call, so a fault that fails a whole
        batch costs one size call, not one a page."""
        want = HEADER_BYTES + nbytes(page.buf)
        size = int(self._store.get_size(name))
        if size < 0 or size == want:
            return None
        if size > _JUDGED_UP_TO * want:
            return False
        body = bytes(self._store.get(name))
        if len(body) != size:  # changed since: judged at its next read
            return True
        return other_version(body) or verify(body[:HEADER_BYTES], body[HEADER_BYTES:], ns, page.key)

    async def _remove_bad(self, ns: bytes, keys: list[bytes]) -> None:
        """Remove objects under these pages' names whose bytes are not the pages'
        records (damaged, another page's, no record; a record of another format
        version is another writer's and stays, ``get``). Mooncake answers a
        put of a key it holds with success and keeps what it had: left in place,
        every later store of the page would be acknowledged, learned as held,
        counted as an L3 hit and read as the same bad object, for ever. An
        object is never changed in place, so the one removed is the one read
        (or one put after its removal by another host: a page forgotten, no
        more). A removal that fails leaves it, forgotten all the same: logged
        and counted (``bad_remove_failed``), never an error of the read; the
        next read of the page judges it again. One found gone already (removed
        by another host's read) is neither."""
        names = self.names(ns, keys)
        try:
            codes = list(await self._blocking(self._store.batch_remove, names, True))
            why = f"codes {sorted(set(codes) - {0, OBJECT_NOT_FOUND})}"
        except Exception as exc:  # the store's own error types: the read's answer stands
            codes, why = [], f"{type(exc).__name__}: {exc}"
        failed = [
            name
            for name, code in zip(names, codes, strict=False)
            if code not in (0, OBJECT_NOT_FOUND)
        ] + names[len(codes) :]
        self.counters["bad_removed"] += codes.count(0)
        self.counters["bad_remove_failed"] += len(failed)
        if failed:
            log.warning(
                "%d bad objects not removed (%s); a put of their pages keeps them: %s",
                len(failed),
                why,
                ", ".join(failed[:3]) + (", ..." if len(failed) > 3 else ""),
            )

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> None:
        if self._store is not None and keys:
            await self._blocking(self._store.batch_remove, self.names(ns, keys), True)

    def stats(self) -> dict[str, int]:
        return dict(self.counters)
