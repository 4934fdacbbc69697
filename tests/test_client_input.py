"""Bad input to the client's copies and handles gets a clear error before
anything is copied: data, ``out``, segments and start bytes that are not what
a copy takes are refused with a message that says what it takes (ValueError,
as ``write_pages`` documents), portable handles that no ``portable()`` made
with BadRequest, never an error of numpy or torch from deep inside the copy;
and the pages keep the bytes last committed. All against a real daemon."""

from __future__ import annotations

import hashlib
import math
import threading
import time

import msgspec
import numpy as np
import pytest

from hicached import Client
from hicached.client.handles import Namespace
from hicached.client.mapping import PendingCopy
from hicached.errors import BadRequest
from tests.support import Daemon

PAGE = 8192
SPEC = dict(
    model="org/input",
    kv_dtype="bfloat16",
    layout="layer_first",
    page_tokens=32,
    page_bytes=PAGE,
    key_scheme="vllm-sha256",
)


def engine_keys(n: int, salt: int) -> list[bytes]:
    out, parent = [], bytes(32)
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([salt, i])).digest()
        out.append(parent + bytes(4))
    return out


def stored(c: Client, salt: int) -> tuple[Namespace, list[bytes], np.ndarray]:
    """Two pages committed under fresh keys: the namespace, the keys, the bytes."""
    ns = c.register(**SPEC)
    keys = engine_keys(2, salt)
    data = np.random.default_rng(salt).integers(0, 256, (2, PAGE), dtype=np.uint8)
    res = c.reserve_keys(ns, keys)
    c.write_pages(res, data)
    c.commit(res)
    return ns, keys, data


def test_data_of_the_wrong_size_says_how_many_bytes_it_must_hold(daemon: Daemon) -> None:
    """Data that is not an array of pages (bytes, a scalar, text) or holds
    another number of bytes is refused with the size it must have."""
    with daemon.client() as c:
        ns = c.register(**SPEC)
        res = c.reserve_keys(ns, engine_keys(2, 1))
        for wrong in (b"x" * 100, np.uint8(3), "text", np.zeros((1, PAGE), np.uint8)):
            with pytest.raises(ValueError, match=f"2 pages of {PAGE} bytes"):
                c.write_pages(res, wrong)
        c.abort(res)


def test_tensors_outside_host_memory_are_refused(daemon: Daemon) -> None:
    """A meta or sparse tensor has no bytes numpy can view: a clear error for
    the data, ``out`` and a segment, not torch's TypeError or RuntimeError."""
    torch = pytest.importorskip("torch")
    with daemon.client() as c:
        ns, keys, data = stored(c, 2)
        res = c.reserve_keys(ns, engine_keys(2, 3))
        meta = torch.zeros((2, PAGE), dtype=torch.uint8, device="meta")
        sparse = torch.zeros((2, PAGE), dtype=torch.uint8).to_sparse()
        for wrong in (meta, sparse):
            with pytest.raises(ValueError, match="CPU tensor or a CUDA tensor"):
                c.write_pages(res, wrong)
            with pytest.raises(ValueError, match="CPU tensor or a CUDA tensor"):
                c.write_pages(res, [wrong])
        c.abort(res)
        hit = c.match_keys(ns, keys)
        for wrong in (meta, sparse):
            with pytest.raises(ValueError, match="CPU tensor or a CUDA tensor"):
                c.read_pages(hit, wrong)
            with pytest.raises(ValueError, match="CPU tensor or a CUDA tensor"):
                c.read_pages(hit, [wrong])
        assert np.array_equal(c.read_pages(hit), data)
        c.release(hit)


def test_conjugate_views_are_copied_as_their_values(daemon: Daemon) -> None:
    """A conjugate view's bytes are not its values (torch keeps a bit on the
    tensor): as a source it is written as its values, as a destination it is
    refused (torch's RuntimeError before, either way)."""
    torch = pytest.importorskip("torch")
    with daemon.client() as c:
        ns = c.register(**SPEC)
        keys = engine_keys(2, 16)
        values = torch.randn((2, PAGE // 8), dtype=torch.complex64)
        res = c.reserve_keys(ns, keys)
        c.write_pages(res, [values.conj()])  # a segment
        c.write_pages(res, values.conj())
        c.commit(res)
        hit = c.match_keys(ns, keys)
        out = torch.zeros((2, PAGE // 8), dtype=torch.complex64)
        c.read_pages(hit, out)
        assert torch.equal(out, values.conj().resolve_conj())
        segments = torch.zeros((2, PAGE // 8), dtype=torch.complex64)
        c.read_pages(hit, [segments])
        assert torch.equal(segments, out)
        for into in (out.conj(), [out.conj()]):
            with pytest.raises(ValueError, match="conjugate"):
                c.read_pages(hit, into)
        c.release(hit)


def test_segments_and_rows_a_copy_cannot_take_are_refused_clearly(daemon: Daemon) -> None:
    """A 0-d tensor is no segment, rows of a segment with none are out of
    range, and rows on a device or in a ragged list are no row numbers:
    ValueErrors that say so (an IndexError, a reshape error or torch's
    TypeError before)."""
    torch = pytest.importorskip("torch")
    with daemon.client() as c:
        ns, keys, data = stored(c, 4)
        res = c.reserve_keys(ns, engine_keys(2, 5))
        with pytest.raises(ValueError, match="one row per page"):
            c.write_pages(res, [torch.tensor(1, dtype=torch.uint8)])
        for empty in (np.zeros((0, 16), np.uint8), torch.zeros((0, 16), dtype=torch.uint8)):
            with pytest.raises(ValueError, match="no rows"):
                c.write_pages(res, [empty], rows=[0, 1])
        meta = torch.tensor([0, 1], device="meta")  # a device's, as a CUDA tensor's
        for rows in (meta, [0, [1]]):
            with pytest.raises(ValueError, match="rows must be a flat list"):
                c.write_pages(res, [np.zeros((2, 16), np.uint8)], rows=rows)
        c.abort(res)
        hit = c.match_keys(ns, keys)
        with pytest.raises(ValueError, match="no rows"):
            c.read_pages(hit, [np.zeros((0, 16), np.uint8)], rows=[0, 1])
        assert np.array_equal(c.read_pages(hit), data)
        c.release(hit)


def test_a_numpy_start_byte_past_the_page_is_refused(daemon: Daemon) -> None:
    """``at`` as an unsigned numpy integer near its top used to pass the check
    (the sum wrapped) and fail inside the copy with numpy's broadcast error."""
    with daemon.client() as c:
        ns, keys, data = stored(c, 6)
        res = c.reserve_keys(ns, engine_keys(2, 7))
        with pytest.raises(ValueError, match="do not fit"):
            c.write_pages(res, np.zeros((2, 16), np.uint8), at=np.uint64(2**64 - 8))
        c.abort(res)
        hit = c.match_keys(ns, keys)
        with pytest.raises(ValueError, match="do not fit"):
            c.read_pages(hit, np.zeros((2, 16), np.uint8), at=np.uint32(2**32 - 8))
        assert np.array_equal(c.read_pages(hit), data)
        c.release(hit)


def test_portable_handles_no_portable_call_made_are_refused(daemon: Daemon) -> None:
    """Fields a handle's ``portable()`` never gives (another kind, generations
    that are not one uint32 per offset, pages of no bytes, a deadline that is
    not a number) are a BadRequest at ``adopt``: before, the kind was taken as
    a read, numpy's error or a ZeroDivisionError came out of the copy, and a
    NaN deadline let copies go on past the lease's end forever. Offsets past
    any pool are refused by the copy, as those inside none of its slots."""
    with daemon.client() as owner, daemon.client() as worker:
        ns, keys, data = stored(owner, 8)
        hit = owner.match_keys(ns, keys)
        wire = hit.portable()
        spec = msgspec.structs.replace(wire.spec, page_bytes=0)
        for bad, match in (
            (dict(kind="copy"), "kind"),
            (dict(gens=wire.gens[:-1]), "one generation per offset"),
            (dict(spec=spec), "pages of 0 bytes"),
            (dict(deadline=math.nan), "not a number"),
        ):
            with pytest.raises(BadRequest, match=match):
                worker.adopt(msgspec.structs.replace(wire, **bad))  # type: ignore[arg-type]
        far = worker.adopt(msgspec.structs.replace(wire, offsets=[2**63, 2**64 - 1]))
        for out in (None, [np.zeros((2, 16), np.uint8)]):  # numpy's OverflowError before
            with pytest.raises(ValueError, match="inside the pool"):
                worker.read_pages(far, out)  # type: ignore[arg-type]
        assert np.array_equal(worker.read_pages(worker.adopt(wire)), data)  # type: ignore[arg-type]
        owner.release(hit)


def test_an_adopted_handle_stops_its_copies_within_a_lease_of_its_daemon(daemon: Daemon) -> None:
    """A portable handle whose deadline lies past any lease the daemon grants
    (never one ``portable()`` gives: the lease was granted before it was made)
    is adopted with a deadline within ``lease_ttl_s`` from now: a late write
    stops before the quarantine of its expired lease's slots ends."""
    with daemon.client() as owner, daemon.client() as worker:
        ns = owner.register(**SPEC)
        res = owner.reserve_keys(ns, engine_keys(2, 9))
        ttl = owner._hello.lease_ttl_s  # type: ignore[union-attr]
        for deadline in (math.inf, time.monotonic() + 1000 * ttl):
            wire = msgspec.structs.replace(res.portable(), deadline=deadline)
            view = worker.adopt(wire)
            assert view.deadline <= time.monotonic() + ttl
        same = worker.adopt(res.portable())  # as portable() gave it: as it was
        assert same.deadline == res.deadline
        owner.abort(res)


def test_numpy_numbers_in_a_call_are_sent_as_numbers(daemon: Daemon) -> None:
    """A page count or a flag an engine computed with numpy goes to the daemon
    as the number it is (before, msgspec's TypeError came out of the call); a
    value no request carries is a BadRequest."""
    with daemon.client() as c:
        ns, keys, data = stored(c, 10)
        fetch = c.prefetch_keys(ns, keys, max_pages=np.int32(1))
        c.cancel(fetch)
        hit = c.match_keys(ns, keys, lease=np.bool_(True))  # type: ignore[arg-type]
        assert hit.hits == 2 and np.array_equal(c.read_pages(hit), data)
        c.release(hit)
        more = engine_keys(3, 11)
        res = c.reserve_keys(ns, more)
        c.write_pages(res, np.zeros((3, PAGE), np.uint8))
        with pytest.raises(BadRequest, match="complex"):
            c.commit(res, complex(2))  # type: ignore[arg-type]
        assert c.commit(res, np.int64(2)).published == 2
        assert c.match_keys(ns, more).hits == 2


def test_a_handle_of_a_client_that_maps_no_pool_is_not_copied_through(daemon: Daemon) -> None:
    """A client with ``map_pool=False`` notes no generations for its handles:
    another client copying through one had no fence (one page was copied
    unchecked, two failed in numpy's broadcast). It is refused."""
    with daemon.client() as c, Client(daemon.endpoint, map_pool=False) as remote:
        ns, keys, data = stored(c, 12)
        hit = remote.match_keys(remote.register(**SPEC), keys)
        res = remote.reserve_keys(remote.register(**SPEC), engine_keys(1, 13))
        for view in (hit.select([0]), hit):
            with pytest.raises(BadRequest, match="does not map the pool"):
                c.read_pages(view)
        with pytest.raises(BadRequest, match="does not map the pool"):
            c.write_pages(res, np.zeros((1, PAGE), np.uint8))
        remote.release(hit)
        remote.abort(res)
        hit = c.match_keys(ns, keys)
        assert np.array_equal(c.read_pages(hit), data)
        c.release(hit)


def test_a_call_given_the_wrong_kind_of_handle_says_what_it_takes(daemon: Daemon) -> None:
    """A Fetch, a Hit or None where another handle goes is a BadRequest that
    names what the call takes (an AttributeError before, or a message naming
    another kind than the one given); nothing is copied or ended."""
    with daemon.client() as c:
        ns, keys, data = stored(c, 14)
        fetch = c.prefetch_keys(ns, keys)
        hit = c.match_keys(ns, keys)
        miss = c.match_keys(ns, engine_keys(1, 15))  # no slots: was taken as written
        calls = [
            (lambda: c.write_pages(fetch, data), "write_pages takes a Reservation"),  # type: ignore[arg-type]
            (lambda: c.write_pages(miss, data[:0]), "not a Hit"),  # type: ignore[arg-type]
            (lambda: c.start_write(None, data), "not None"),  # type: ignore[arg-type]
            (lambda: c.read_pages(fetch), "read_pages takes a Hit.*not a Fetch"),  # type: ignore[arg-type]
            (lambda: c.start_read(None), "not None"),  # type: ignore[arg-type]
            (lambda: c.renew(fetch), "renew takes"),  # type: ignore[arg-type]
            (lambda: c.progress(hit), "progress takes a Fetch"),  # type: ignore[arg-type]
            (lambda: c.commit(None), "commit takes"),  # type: ignore[arg-type]
            (lambda: c.release(None), "release takes"),  # type: ignore[arg-type]
            (lambda: c.adopt(hit), "adopt takes a PortableHandle"),  # type: ignore[arg-type]
        ]
        for call, match in calls:
            with pytest.raises(BadRequest, match=match):
                call()
        assert np.array_equal(c.read_pages(hit), data)
        c.release(hit)


class _Moving:
    """A CUDA event whose copy never ends (fault injection: a GPU that hangs)."""

    def query(self) -> bool:
        return False


def test_a_wait_for_a_copy_takes_no_nan_timeout() -> None:
    """A NaN timeout is no deadline a clock reaches: the wait for a copy that
    never ends polled forever. It is refused; a number still ends the wait."""
    none = np.empty(0, dtype=np.int64)
    pending = PendingCopy("kernel", none, none, none, "stale", end=_Moving())
    said: list[object] = []

    def wait() -> None:
        try:
            said.append(pending.wait(math.nan))
        except ValueError as exc:
            said.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)  # a hang must not hold the run
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), "the wait did not end"
    assert isinstance(said[0], ValueError) and "NaN" in str(said[0])
    assert not pending.wait(0.01)
