"""One stateful conformance suite, run against every backend.

The memory backend is the oracle. Random puts, gets, exists and deletes over
a small key space (so keys repeat) must give the oracle's answers; a page a
backend returns must hold exactly the oracle's bytes. Backends here are given
room for every page, so none may forget anything.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from hicached_backends.base import Backend, BackendEnv, PageRef
from hicached_backends.file import FileBackend
from hicached_backends.memory import MemoryBackend
from hicached_backends.options import FileOptions, MemoryOptions, S3Options
from tests.faults import FaultProxy
from tests.mooncake_pair import here_and_other, mooncake_backend
from tests.services import CREDENTIALS, MooncakeMaster, S3Server

PAGE = 512
NAMESPACES = [bytes([0xA0 + i]) * 16 for i in range(2)]
KEYS = [bytes([i]) * 16 for i in range(12)]
_prefixes = itertools.count()


def payload(ns: bytes, key: bytes, version: int) -> bytes:
    rng = np.random.default_rng([ns[0], key[0], version])
    return rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes()


def conformance_machine(make: Callable[[Path], Backend]) -> type[RuleBasedStateMachine]:
    class Conformance(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.tmp = tempfile.TemporaryDirectory(prefix="hc-conf-")
            self.backend = make(Path(self.tmp.name))
            self.oracle = MemoryBackend(MemoryOptions(), BackendEnv(Path(self.tmp.name)))
            self.run(self.backend.open())
            self.run(self.oracle.open())
            self.versions: dict[tuple[bytes, bytes], set[bytes]] = {}

        def run(self, coro):  # type: ignore[no-untyped-def]
            return self.loop.run_until_complete(coro)

        @rule(
            ns=st.sampled_from(NAMESPACES),
            keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True),
            version=st.integers(0, 1),
        )
        def put(self, ns: bytes, keys: list[bytes], version: int) -> None:
            pages = [PageRef(k, memoryview(bytearray(payload(ns, k, version)))) for k in keys]
            assert self.run(self.backend.put(ns, pages)) == [True] * len(keys)
            self.run(self.oracle.put(ns, pages))
            for k in keys:  # a re-put may keep either version: both were stored under k
                self.versions.setdefault((ns, k), set()).add(payload(ns, k, version))

        @rule(
            ns=st.sampled_from(NAMESPACES),
            keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6),
        )
        def get(self, ns: bytes, keys: list[bytes]) -> None:
            got = [bytearray(PAGE) for _ in keys]
            want = [bytearray(PAGE) for _ in keys]
            ok = self.run(
                self.backend.get(
                    ns, [PageRef(k, memoryview(b)) for k, b in zip(keys, got, strict=True)]
                )
            )
            ok_oracle = self.run(
                self.oracle.get(
                    ns, [PageRef(k, memoryview(b)) for k, b in zip(keys, want, strict=True)]
                )
            )
            assert ok == ok_oracle
            for k, hit, g in zip(keys, ok, got, strict=True):
                if hit:
                    assert bytes(g) in self.versions[(ns, k)], "bytes never stored under that key"

        @rule(
            ns=st.sampled_from(NAMESPACES),
            keys=st.lists(st.sampled_from(KEYS), min_size=0, max_size=8),
        )
        def exists(self, ns: bytes, keys: list[bytes]) -> None:
            got = self.run(self.backend.exists(ns, keys))
            want = self.run(self.oracle.exists(ns, keys))
            held = [self.run(self.oracle.exists(ns, [k])) == 1 for k in keys]
            if self.backend.exact_exists or not any(held[want:]):
                assert got == want  # a run followed by misses is counted exactly
            else:
                assert want <= got <= len(keys)  # a hole may be counted past, never short

        @rule(
            ns=st.sampled_from(NAMESPACES),
            keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
        )
        def delete(self, ns: bytes, keys: list[bytes]) -> None:
            self.run(self.backend.delete(ns, keys))
            self.run(self.oracle.delete(ns, keys))
            for k in keys:
                self.versions.pop((ns, k), None)

        @rule(ns=st.sampled_from(NAMESPACES), key=st.sampled_from(KEYS))
        def wrong_size_is_a_miss(self, ns: bytes, key: bytes) -> None:
            buf = bytearray(PAGE // 2)
            assert self.run(self.backend.get(ns, [PageRef(key, memoryview(buf))])) == [False]

        def teardown(self) -> None:
            self.run(self.backend.close())
            self.run(self.backend.close())  # idempotent
            self.loop.close()
            self.tmp.cleanup()

    return Conformance


def run_machine(machine: type[RuleBasedStateMachine], examples: int) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        machine, settings=settings(max_examples=examples, stateful_step_count=25, deadline=None)
    )


def test_memory_backend() -> None:
    run_machine(conformance_machine(lambda d: MemoryBackend(MemoryOptions(), BackendEnv(d))), 60)


def test_file_backend() -> None:
    options = FileOptions(capacity_mib=2, segment_mib=1, io_threads=2)
    run_machine(conformance_machine(lambda d: FileBackend(options, BackendEnv(d))), 40)


def test_s3_backend(s3: S3Server) -> None:
    from hicached_backends.s3 import S3Backend

    bucket = s3.make_bucket("conformance")

    def make(_: Path) -> Backend:
        # a fresh prefix per example: every example starts from an empty store
        options = S3Options(
            bucket=bucket,
            prefix=f"run{next(_prefixes)}",
            endpoint_url=s3.endpoint,
            threads=4,
            **CREDENTIALS,
        )
        return S3Backend(options, BackendEnv(Path("/nonexistent")))

    run_machine(conformance_machine(make), 15)


def test_s3_exists_is_a_bisection(s3: S3Server) -> None:
    """The leading run of 1,000 keys in O(log n) HEADs, exact for a run."""
    from hicached_backends.s3 import S3Backend

    options = S3Options(
        bucket=s3.make_bucket("bisection"), endpoint_url=s3.endpoint, threads=8, **CREDENTIALS
    )
    backend = S3Backend(options, BackendEnv(Path("/nonexistent")))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(backend.open())
        ns = NAMESPACES[0]
        keys = [i.to_bytes(16, "big") for i in range(1000)]
        held = 617
        pages = [PageRef(k, memoryview(bytearray(16))) for k in keys[:held]]
        assert loop.run_until_complete(backend.put(ns, pages)) == [True] * held
        for n in (0, 1, held - 1, held, held + 1, 1000):
            before = backend.counters["requests"]
            assert loop.run_until_complete(backend.exists(ns, keys[:n])) == min(n, held)
            assert backend.counters["requests"] - before <= 8 * 6, "not O(log n) requests"
    finally:
        loop.run_until_complete(backend.close())
        loop.close()


def run_behind_proxy(
    s3: S3Server, bucket: str, run: Callable[[Backend, FaultProxy], Awaitable[None]]
) -> None:
    """``run`` an S3 backend, open on a bucket of its own, that reaches the
    store through a fault proxy (two write threads), on a loop of its own."""
    from hicached_backends.s3 import S3Backend

    proxy = FaultProxy(s3.endpoint)
    options = S3Options(
        bucket=s3.make_bucket(bucket), endpoint_url=proxy.endpoint, threads=2, **CREDENTIALS
    )
    backend = S3Backend(options, BackendEnv(Path("/nonexistent")))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(backend.open())
        loop.run_until_complete(run(backend, proxy))
    finally:
        loop.run_until_complete(backend.close())
        loop.close()
        proxy.stop()


def test_s3_reads_never_queue_behind_writes(s3: S3Server) -> None:
    """Writes slowed to 0.3 s each by the fault proxy fill the write threads
    three times over; a read (a bisection and a GET) started after them is
    answered while they are still running, not after them."""
    ns, page = NAMESPACES[0], bytes(range(256)) * 2

    async def run(backend: Backend, proxy: FaultProxy) -> None:
        held = PageRef(KEYS[0], memoryview(bytearray(page)))
        assert await backend.put(ns, [held]) == [True]
        proxy.delay["PUT"] = 0.3
        writes = asyncio.ensure_future(
            backend.put(ns, [PageRef(k, memoryview(bytearray(page))) for k in KEYS[1:7]])
        )
        await asyncio.sleep(0.05)  # the six PUTs hold both write threads
        assert await backend.exists(ns, KEYS[:1]) == 1
        got = bytearray(len(page))
        assert await backend.get(ns, [PageRef(KEYS[0], memoryview(got))]) == [True]
        assert got == page
        assert not writes.done(), "the read waited for the writes"
        assert await writes == [True] * 6

    run_behind_proxy(s3, "reads-first", run)


def test_s3_a_put_answered_not_found_is_not_stored(s3: S3Server) -> None:
    """Fault injection: the store answers a PUT 404 NoSuchKey (a gateway in
    front of it, say). That write failed: it is not reported stored."""
    ns, page = NAMESPACES[0], bytes(range(256)) * 2

    async def run(backend: Backend, proxy: FaultProxy) -> None:
        proxy.answer["PUT"] = (404, "NoSuchKey")
        assert await backend.put(ns, [PageRef(KEYS[0], memoryview(bytearray(page)))]) == [False]
        assert proxy.injected["answer"] == 1
        del proxy.answer["PUT"]
        assert await backend.exists(ns, KEYS[:1]) == 0
        assert await backend.put(ns, [PageRef(KEYS[0], memoryview(bytearray(page)))]) == [True]
        assert await backend.exists(ns, KEYS[:1]) == 1

    run_behind_proxy(s3, "put-404", run)


def test_s3_missing_bucket_is_an_error_not_a_healthy_store(s3: S3Server) -> None:
    """A store whose bucket does not exist would fail every write: opening it
    fails, and its health probe fails (retriable) if the bucket goes away."""
    from hicached_backends.base import BackendError
    from hicached_backends.s3 import S3Backend

    def backend(bucket: str) -> S3Backend:
        options = S3Options(bucket=bucket, endpoint_url=s3.endpoint, threads=2, **CREDENTIALS)
        return S3Backend(options, BackendEnv(Path("/nonexistent")))

    loop = asyncio.new_event_loop()
    missing, present = backend("no-such-bucket"), backend(s3.make_bucket("goes-away"))
    try:
        with pytest.raises(BackendError, match="does not exist") as refused:
            loop.run_until_complete(missing.open())
        assert not refused.value.retriable
        loop.run_until_complete(present.open())
        loop.run_until_complete(present.health())
        s3.client().delete_bucket(Bucket=present.options.bucket)  # type: ignore[attr-defined]
        with pytest.raises(BackendError, match="does not exist") as down:
            loop.run_until_complete(present.health())
        assert down.value.retriable
    finally:
        for b in (missing, present):
            loop.run_until_complete(b.close())
        loop.close()


def test_mooncake_backend(mooncake: MooncakeMaster) -> None:
    def make(_: Path) -> Backend:
        return mooncake_backend(mooncake)

    # every example starts from an empty store: delete what the last one left
    machine = conformance_machine(make)
    original_init = machine.__init__

    def init(self: RuleBasedStateMachine) -> None:
        original_init(self)
        for ns in NAMESPACES:
            self.run(self.backend.delete(ns, KEYS))  # type: ignore[attr-defined]

    machine.__init__ = init  # type: ignore[method-assign]
    run_machine(machine, 8)


def test_mooncake_existence_checks_do_not_wait_for_busy_threads(mooncake: MooncakeMaster) -> None:
    """Every store thread is held by a call that hangs (fault injection: the
    test parks them, as batch reads of a slow store would): an existence check,
    which an engine's L3 lookup waits on, still answers at once."""
    import threading

    backend = mooncake_backend(mooncake, threads=2)
    loop = asyncio.new_event_loop()
    release = threading.Event()
    try:
        loop.run_until_complete(backend.open())
        parked = [
            loop.run_in_executor(backend._pool, release.wait, 30.0)
            for _ in range(backend.options.threads + 2)
        ]
        found = loop.run_until_complete(
            asyncio.wait_for(backend.exists(NAMESPACES[0], KEYS[:3]), 10.0)
        )
        assert found == 0
        loop.run_until_complete(asyncio.wait_for(backend.health(), 10.0))
        release.set()
        loop.run_until_complete(asyncio.gather(*parked))
    finally:
        release.set()
        loop.run_until_complete(backend.close())
        loop.close()


def test_a_mooncake_read_that_finds_a_page_gone_tells_the_daemon(mooncake: MooncakeMaster) -> None:
    """Another host removes a page from the shared store (or the store evicts
    it) after this host learned it held it: the read is a miss and the daemon
    is told (``on_forget``), so it stops counting the page as an L3 hit no read
    can serve and writes it again when it is stored; the pages read are told
    of nothing."""
    ns, keys = NAMESPACES[1], KEYS[:4]
    told: list[tuple[bytes, list[bytes]]] = []
    with here_and_other(mooncake, ns, keys) as (loop, here, other):
        here.on_forget = lambda n, k: told.append((n, k))
        pages = [PageRef(k, memoryview(bytearray(payload(ns, k, 0)))) for k in keys]
        assert loop.run_until_complete(here.put(ns, pages)) == [True] * 4
        loop.run_until_complete(other.delete(ns, [keys[1]]))
        got = [bytearray(PAGE) for _ in keys]
        read = [PageRef(k, memoryview(b)) for k, b in zip(keys, got, strict=True)]
        assert loop.run_until_complete(here.get(ns, read)) == [True, False, True, True]
        assert told == [(ns, [keys[1]])]
        assert [bytes(got[i]) for i in (0, 2, 3)] == [payload(ns, keys[i], 0) for i in (0, 2, 3)]


def test_registry_names_and_errors() -> None:
    from hicached.errors import ConfigError
    from hicached_backends import available, load_backend_class

    assert {"memory", "file", "s3", "mooncake"} <= set(available())
    assert load_backend_class("file") is FileBackend
    with pytest.raises(ConfigError, match="unknown backend 'nosuch'"):
        load_backend_class("nosuch")
