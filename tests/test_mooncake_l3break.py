"""The Mooncake backend under attack: what a daemon knows of a store it cannot list."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hicached.hashing import pack_tokens, page_keys
from hicached_backends.base import PageRef
from hicached_backends.record import pack_header
from tests.l3util import evict_everything, l3_count, settle_writes, storage, wait_for, wait_prefetch
from tests.mooncake_pair import here_and_other, mooncake_backend
from tests.services import MooncakeMaster, mooncake_master
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon, page_bytes_for


@pytest.fixture
def own_mooncake() -> Iterator[MooncakeMaster]:
    """A master of the test's own: in a shared one the segments of another
    test's stopped daemons linger until their lease ends, and writes placed
    there fail."""
    yield from mooncake_master()


def seq(start: int, pages: int) -> np.ndarray:
    return np.arange(start, start + pages * PAGE_TOKENS, dtype=np.uint32)


def test_a_store_that_cannot_list_never_counts_as_listed(
    daemon_factory: Callable[..., Daemon], mooncake: MooncakeMaster
) -> None:
    """Mooncake cannot list its keys: its startup "scan" ends at once with no
    page. Before, that empty listing marked what the daemon knows of L3 as all
    the store holds (index_complete=1), so a daemon started (or restarted)
    after pages were written answered every match from its empty record,
    l3_hits=0, without asking the store: the pages were never learned. An
    empty listing from a store that cannot list proves nothing; the daemon
    must ask the store about keys it does not know."""
    writer = daemon_factory(
        size_mib=1, slab_mib=1, storage=storage("mooncake"), tail=mooncake.toml()
    )
    toks = seq(0, 8)
    with writer.client() as cw:
        ns = cw.register(**NS)
        cw.store(ns, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(cw, "written") == 8)
        reader = daemon_factory(
            size_mib=1, slab_mib=1, storage=storage("mooncake"), tail=mooncake.toml()
        )
        with reader.client() as cr:
            wait_for(lambda: cr.stats().l3_state == "up")
            assert cr.stats().l3["index_complete"] == 0, "an empty listing passed for the store"
            ns_r = cr.register(**NS)
            assert cr.match(ns_r, toks, lease=False).l3_hits == 8
            pf = cr.prefetch(ns_r, toks)
            assert wait_prefetch(cr, pf).completed == 8
            cr.commit(pf)
            assert np.array_equal(cr.load(ns_r, toks), page_bytes_for(toks))


def test_a_bad_object_is_removed_so_the_page_can_be_written_again(
    daemon_factory: Callable[..., Daemon], own_mooncake: MooncakeMaster
) -> None:
    """Mooncake answers a put of a key it holds with success and keeps the
    bytes it had. An object under a page's name whose bytes are not the page's
    record (here put there first by a raw store client: another writer, a
    damaged write) was only forgotten at its read: every later store of the
    page was acknowledged, learned as held, counted as an L3 hit, and read as
    the same bad object, for ever. The read removes such an object, so the
    next store of the page really writes it. A master of its own: in a shared
    one the segments of another test's stopped daemons linger until their
    lease ends, and writes placed there fail."""
    from mooncake.store import MooncakeDistributedStore

    other = MooncakeDistributedStore()
    try:
        d = daemon_factory(
            size_mib=1, slab_mib=1, storage=storage("mooncake"), tail=own_mooncake.toml()
        )
        toks = seq(0, 8)
        setup = (16 << 20, 16 << 20, "tcp", "", own_mooncake.master)
        assert other.setup("127.0.0.1", own_mooncake.metadata, *setup) == 0
        with d.client() as c:
            ns = c.register(**NS)
            key = page_keys(ns.digest, pack_tokens(toks), PAGE_TOKENS)[2]
            assert other.put(f"hc/{ns.digest.hex()}/{key.hex()}", b"x" * (64 + PAGE_BYTES)) == 0
            c.store(ns, toks, page_bytes_for(toks))
            wait_for(lambda: l3_count(c, "written") == 8)
            evict_everything(c, ns)
            pf = c.prefetch(ns, toks)
            done = wait_prefetch(c, pf)
            assert (done.completed, done.failed) == (2, True)
            c.commit(pf)
            assert c.stats().l3["store_bad_objects"] == 1
            c.store(ns, toks, page_bytes_for(toks))  # page 2 goes to the store again
            settle_writes(c)
            evict_everything(c, ns, salt=8)
            pf = c.prefetch(ns, toks)
            done = wait_prefetch(c, pf)
            assert (done.completed, done.failed) == (8, False), (
                "the bad object outlived its rewrite"
            )
            c.commit(pf)
            assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))
    finally:
        other.close()


def test_a_record_of_another_format_version_is_not_removed(own_mooncake: MooncakeMaster) -> None:
    """A record of another format version under a page's name is another
    writer's (a host running a newer hicached on the same store, mid-upgrade):
    a miss here, and left alone, as S3 leaves it. Mooncake's read removed every
    object it read whole that failed verification, so two versions sharing a
    store removed each other's pages. The backend alone, on a real master of
    its own (a shared one may place the records on a stopped daemon's segment,
    and the put fails), the records put there by a second backend's store client."""
    from hicached_backends.mooncake import MooncakeBackend

    ns, keys = bytes(range(16)), [bytes([k]) * 16 for k in (101, 102)]
    page = 4096
    newer = bytearray(pack_header(ns, keys[0], bytes(page)) + bytes(page))
    newer[4:6] = (2).to_bytes(2, "little")
    damaged = bytearray(pack_header(ns, keys[1], bytes(page)) + bytes(page))
    damaged[-1] ^= 0xFF
    names = MooncakeBackend.names(ns, keys)
    with here_and_other(own_mooncake, ns, keys) as (loop, here, other):
        assert other._store.put(names[0], bytes(newer)) == 0
        assert other._store.put(names[1], bytes(damaged)) == 0
        bufs = [bytearray(page) for _ in keys]
        read = [PageRef(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
        assert loop.run_until_complete(here.get(ns, read)) == [False, False]
        assert here.counters["bad_objects"] == 2
        assert here.counters["bad_removed"] == 1  # the damaged record of this version
        assert other._store.is_exist(names[1]) != 1
        assert other._store.is_exist(names[0]) == 1, "another format version's record was removed"


def test_an_object_of_another_size_is_judged_by_its_own_bytes(own_mooncake: MooncakeMaster) -> None:
    """An object under a page's name of another size than the page's record
    cannot be read into the page's buffers: Mooncake answers a size mismatch
    (-600) for a larger one and a failed transfer (-800) for a shorter one. The
    read neither removed such an object nor, for a shorter one, forgot it: the
    daemon kept the page as held (a match counted it as an L3 hit no read could
    serve, for good), and each later put of the page was acknowledged while the
    store kept the object. Read whole, it is judged as S3 judges it: a record of
    another format version, or the page's own intact record of another size,
    stays; anything else is removed, so the next put stores the page. Either
    way the page is forgotten. The backend alone, on a real master of its own,
    the objects put there by a second backend's store client."""
    from hicached_backends.mooncake import MooncakeBackend

    ns, page = bytes(range(16)), 4096
    keys = [bytes([k]) * 16 for k in (111, 112, 113, 114)]
    newer = bytearray(pack_header(ns, keys[2], bytes(2 * page)) + bytes(2 * page))
    newer[4:6] = (2).to_bytes(2, "little")
    objects = [
        b"y" * (64 + 100),  # cut short: no record
        b"z" * (64 + 2 * page),  # larger, no record
        bytes(newer),  # another format version's record, larger
        pack_header(ns, keys[3], bytes(2 * page)) + bytes(2 * page),  # the page's, larger
    ]
    names = MooncakeBackend.names(ns, keys)
    forgot: list[bytes] = []
    with here_and_other(own_mooncake, ns, keys) as (loop, here, other):
        here.on_forget = lambda _ns, gone: forgot.extend(gone)
        for name, body in zip(names, objects, strict=True):
            assert other._store.put(name, body) == 0
        bufs = [bytearray(page) for _ in keys]
        read = [PageRef(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
        assert loop.run_until_complete(here.get(ns, read)) == [False] * 4
        assert sorted(forgot) == sorted(keys), "a page no read can serve stayed known"
        assert here.counters["bad_removed"] == 2
        kept = [other._store.is_exist(name) == 1 for name in names]
        assert kept == [False, False, True, True]
        pages = [bytearray(bytes([k]) * page) for k in range(4)]
        puts = [PageRef(k, memoryview(b)) for k, b in zip(keys, pages, strict=True)]
        assert loop.run_until_complete(here.put(ns, puts[:2])) == [True, True]
        assert loop.run_until_complete(here.get(ns, read[:2])) == [True, True]
        assert bufs[:2] == pages[:2], "the put after the removal was not stored"


def test_a_transfer_that_fails_for_a_whole_batch_asks_no_size_per_page(
    own_mooncake: MooncakeMaster,
) -> None:
    """Mooncake answers a read of an object shorter than the page's record as
    a failed transfer (-800), as it answers a transfer a network fault broke.
    The read asked the master each such object's size, one call at a time on
    a store thread: a network fault that failed a batch of N pages made N more
    master calls before the batch was taken as failed, each paid again at
    every retry. Once one object of a failed transfer has its record's size
    (the transfer, not the object, failed), the rest of that call's failed
    transfers are not asked about: the call fails as before. The backend
    alone on a real master of its own; the fault is injected in the store's
    batch read."""
    from hicached_backends.base import BackendError

    b = mooncake_backend(own_mooncake)
    ns, page = bytes(range(16)), 4096
    keys = [bytes([k, 7]) * 8 for k in range(32)]
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(b.open())
        store = b._store
        puts = [PageRef(k, memoryview(bytearray([i]) * page)) for i, k in enumerate(keys)]
        assert loop.run_until_complete(b.put(ns, puts)) == [True] * len(keys)
        asked: list[str] = []

        class BrokenTransfers:
            """The store, its batch reads failing on the way (-800)."""

            def __getattr__(self, name: str) -> object:
                return getattr(store, name)

            def batch_get_into_multi_buffers(self, names: list[str], *_: object) -> list[int]:
                return [-800] * len(names)

            def get_size(self, name: str) -> int:
                asked.append(name)
                return int(store.get_size(name))

        b._store = BrokenTransfers()
        read = [PageRef(k, memoryview(bytearray(page))) for k in keys]
        try:
            loop.run_until_complete(b.get(ns, read))
        except BackendError:
            pass
        else:
            raise AssertionError("a batch whose every transfer failed was not a failed call")
        assert len(asked) <= 1, f"{len(asked)} size calls for one failed batch"
        b._store = store
    finally:
        loop.run_until_complete(b.close())
        loop.close()


def test_an_object_over_twice_the_record_is_removed_unread(own_mooncake: MooncakeMaster) -> None:
    """An object under a page's name more than twice the page's record is not
    read (it cannot be the page's record, and read whole it would be taken
    into the daemon's memory). It was left in place: Mooncake keeps what it
    holds on a put, so every later put of the page was acknowledged and every
    read of it missed, for ever. The read removes it unread, so the next put
    stores the page. The backend alone, on a real master of its own, the
    object put there by a second backend's store client."""
    ns, page = bytes(range(16)), 4096
    keys = [bytes([121]) * 16]
    names = _names(ns, keys)
    with here_and_other(own_mooncake, ns, keys) as (loop, here, other):
        assert other._store.put(names[0], b"w" * (3 * (64 + page))) == 0
        store, bodies = here._store, []

        class Watched:
            """The store, its whole-object reads seen."""

            def __getattr__(self, name: str) -> object:
                return getattr(store, name)

            def get(self, name: str) -> bytes:
                bodies.append(name)
                return bytes(store.get(name))

        here._store = Watched()
        buf = bytearray(page)
        read = [PageRef(keys[0], memoryview(buf))]
        assert loop.run_until_complete(here.get(ns, read)) == [False]
        assert bodies == [], "an object over twice the record was read whole"
        assert (here.counters["bad_objects"], here.counters["bad_removed"]) == (1, 1)
        assert here.counters["bad_remove_failed"] == 0
        assert other._store.is_exist(names[0]) != 1, "the oversized object was left in place"
        data = bytearray(b"\x5a" * page)
        assert loop.run_until_complete(here.put(ns, [PageRef(keys[0], memoryview(data))])) == [True]
        assert loop.run_until_complete(here.get(ns, read)) == [True]
        assert buf == data, "the put after the removal was not stored"
        here._store = store


def test_a_bad_object_that_cannot_be_removed_is_a_miss_counted(
    own_mooncake: MooncakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    """A removal of a bad object that fails (an error code, or the store's
    call raising) is logged and counted (``bad_remove_failed``), and the read
    answers a miss as it would have: never an error of the read. The fault
    is injected in the store's batch removal."""
    ns, page = bytes(range(16)), 4096
    keys = [bytes([131]) * 16, bytes([132]) * 16]
    names = _names(ns, keys)
    with here_and_other(own_mooncake, ns, keys) as (loop, here, other):
        store = here._store
        answers: list[object] = [[-1], RuntimeError("master gone")]

        class NoRemoval:
            """The store, its removals failing."""

            def __getattr__(self, name: str) -> object:
                return getattr(store, name)

            def batch_remove(self, names: list[str], force: bool) -> list[int]:
                answer = answers.pop(0)
                if isinstance(answer, Exception):
                    raise answer
                assert isinstance(answer, list)
                return answer

        here._store = NoRemoval()
        for name, key in zip(names, keys, strict=True):
            assert other._store.put(name, b"v" * (3 * (64 + page))) == 0
            read = [PageRef(key, memoryview(bytearray(page)))]
            with caplog.at_level("WARNING", logger="hicached.mooncake"):
                assert loop.run_until_complete(here.get(ns, read)) == [False]
            assert other._store.is_exist(name) == 1
        here._store = store
        assert here.counters["bad_remove_failed"] == 2
        assert here.counters["bad_removed"] == 0
        said = [r.getMessage() for r in caplog.records if "not removed" in r.getMessage()]
        assert len(said) == 2 and "-1" in said[0] and "master gone" in said[1], said


def _names(ns: bytes, keys: list[bytes]) -> list[str]:
    from hicached_backends.mooncake import MooncakeBackend

    return MooncakeBackend.names(ns, keys)
