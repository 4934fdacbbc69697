"""The page record: every changed byte of a header or payload is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from hicached_backends import checksums
from hicached_backends.record import (
    HEADER_BYTES,
    pack_header,
    pack_headers,
    parse_header,
    verify,
    verify_many,
)

NS = bytes(range(16))


def _records(n: int, size: int, generation: int = 7) -> tuple[np.ndarray, list[bytes], list[bytes]]:
    keys = [os.urandom(16) for _ in range(n)]
    payloads = [os.urandom(size) for _ in range(n)]
    headers = np.stack(
        [
            np.frombuffer(pack_header(NS, k, p, generation), np.uint8)
            for k, p in zip(keys, payloads, strict=True)
        ]
    )
    return headers, payloads, keys


def test_intact_records_verify_one_by_one_and_together() -> None:
    headers, payloads, keys = _records(5, 4096)
    assert verify_many(headers, payloads, NS, keys, [7] * 5) == [True] * 5
    for i in range(5):
        assert verify(headers[i].tobytes(), payloads[i], NS, keys[i], 7)
        assert parse_header(headers[i].tobytes()) is not None


@given(st.integers(0, HEADER_BYTES - 1), st.integers(1, 255))
def test_any_changed_header_byte_is_refused(offset: int, delta: int) -> None:
    headers, payloads, keys = _records(3, 256)
    headers[1, offset] ^= delta
    assert verify_many(headers, payloads, NS, keys, [7] * 3) == [True, False, True]
    assert not verify(headers[1].tobytes(), payloads[1], NS, keys[1], 7)


@given(st.integers(0, 255), st.integers(1, 255))
def test_any_changed_payload_byte_is_refused(offset: int, delta: int) -> None:
    headers, payloads, keys = _records(3, 256)
    damaged = bytearray(payloads[2])
    damaged[offset] ^= delta
    payloads[2] = bytes(damaged)
    assert verify_many(headers, payloads, NS, keys) == [True, True, False]
    # checksums the caller took as it read (a reader process) are what is compared
    sums = [xxhash.xxh3_64_intdigest(payload) for payload in payloads]
    assert verify_many(headers, payloads, NS, keys, payload_sums=sums) == [True, True, False]
    sums[0] ^= 1
    assert verify_many(headers, payloads, NS, keys, payload_sums=sums) == [False, True, False]


def test_another_page_namespace_length_or_generation_is_refused() -> None:
    headers, payloads, keys = _records(2, 512)
    assert verify_many(headers, payloads, NS, keys[::-1]) == [False, False]
    assert verify_many(headers, payloads, bytes(16), keys) == [False, False]
    assert verify_many(headers, [p[:-1] for p in payloads], NS, keys) == [False, False]
    assert verify_many(headers, payloads, NS, keys, [8, 7]) == [False, True]
    assert not verify(headers[0].tobytes()[:-1], payloads[0], NS, keys[0])


def test_mismatched_batch_shapes_are_an_error_not_an_answer() -> None:
    headers, payloads, keys = _records(2, 64)
    with pytest.raises(ValueError):
        verify_many(headers[:1], payloads, NS, keys)


def test_verifying_in_parallel_slices_gives_the_same_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    headers, payloads, keys = _records(37, 1024)
    monkeypatch.setattr(checksums, "SLICE_BYTES", 1024)
    damaged = [3, 17, 36]
    for i in damaged:
        payloads[i] = payloads[i][:-1] + bytes([payloads[i][-1] ^ 1])
    expect = [i not in damaged for i in range(37)]
    with ThreadPoolExecutor(3) as pool:
        for parts in (1, 2, 4, 16):
            assert verify_many(headers, payloads, NS, keys, pool=pool, parts=parts) == expect


def test_the_native_checksum_is_found_and_agrees() -> None:
    """Payload checksums of pool memory run in the C function without the GIL;
    they must equal the package's own, for every length and alignment."""
    import mmap

    assert checksums._XXH3 is not None, "XXH3_64bits not found in xxhash's extension module"
    import ctypes

    import xxhash._xxhash

    if hasattr(ctypes.CDLL(xxhash._xxhash.__file__), "XXH3_64bits_dispatch"):
        assert checksums._XXH3.__name__ == "XXH3_64bits_dispatch"  # the CPU's widest code
    region = mmap.mmap(-1, 1 << 16)
    view = memoryview(region)
    view[:] = np.random.default_rng(9).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    for start, end in ((0, 1 << 16), (1, 4097), (7, 8), (100, 100)):
        with view[start:end] as part:
            assert checksums.checksum(part) == xxhash.xxh3_64_intdigest(bytes(part))
    view.release()
    region.close()


def test_views_of_wider_items_are_checked_over_every_byte() -> None:
    """A payload viewed as uint32 or as rows counts its bytes, not its items:
    the header records them all and a change anywhere is refused."""
    page = bytearray(os.urandom(4096))
    for view in (memoryview(page).cast("I"), memoryview(page).cast("B", (2, 2048))):
        header = np.frombuffer(pack_header(NS, b"k" * 16, view), np.uint8).reshape(1, -1)
        assert parse_header(header.tobytes()).length == 4096  # type: ignore[union-attr]
        assert verify_many(header, [view], NS, [b"k" * 16]) == [True]
        page[3000] ^= 1
        assert verify_many(header, [view], NS, [b"k" * 16]) == [False]
        page[3000] ^= 1


def test_a_short_namespace_or_key_is_refused() -> None:
    headers, payloads, keys = _records(1, 64)
    with pytest.raises(ValueError):
        verify_many(headers, payloads, NS[:8], keys)
    with pytest.raises(ValueError):
        verify_many(headers, payloads, NS, [keys[0][:15]])


def test_batched_headers_are_the_single_headers_byte_for_byte() -> None:
    spaces = [NS, bytes(16), NS]
    keys = [os.urandom(16) for _ in spaces]
    payloads = [os.urandom(size) for size in (0, 100, 4096)]
    lengths = [len(p) for p in payloads]
    sums = [xxhash.xxh3_64_intdigest(p) for p in payloads]
    one = [pack_header(ns, k, p, 9) for ns, k, p in zip(spaces, keys, payloads, strict=True)]
    assert pack_headers(spaces, keys, lengths, sums, [9, 9, 9]) == one
    assert pack_headers(NS, keys[:1], lengths[:1], sums[:1], 9) == one[:1]
    assert pack_headers(NS, [], [], []) == []
    with pytest.raises(ValueError):
        pack_headers(NS, [keys[0][:15]], [0], [0])  # struct would pad the key
    with pytest.raises(ValueError):
        pack_headers([NS, NS[:8]], keys[:2], lengths[:2], sums[:2])
    with pytest.raises(ValueError):
        pack_headers(NS, keys, lengths[:2], sums)


def test_batched_checksums_agree_with_the_python_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Writable buffers go to the native function, read-only ones (no address)
    to the Python one; in one slice or many, the answers are the same."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(checksums, "SLICE_BYTES", 1024)
    rng = np.random.default_rng(5)
    payloads: list[bytes | memoryview] = []
    for i in range(40):
        data = rng.integers(0, 256, 1000 + 37 * i, dtype=np.uint8).tobytes()
        payloads.append(data if i % 7 == 3 else memoryview(bytearray(data)))
    payloads.append(memoryview(bytearray(8)).cast("I"))  # counted in bytes, not items
    want = [xxhash.xxh3_64_intdigest(bytes(p)) for p in payloads]
    assert checksums.checksums(payloads) == want
    with ThreadPoolExecutor(3) as pool:
        for parts in (1, 2, 3, 8):
            assert checksums.checksums(payloads, pool=pool, parts=parts) == want
    writable = [p for p in payloads if isinstance(p, memoryview)]
    addresses = [checksums.address_of(p) for p in writable]
    lengths = [p.nbytes for p in writable]
    assert checksums.checksums(writable, addresses=addresses, lengths=lengths) == [
        xxhash.xxh3_64_intdigest(bytes(p)) for p in writable
    ]
    assert checksums.checksums([]) == []
    with pytest.raises(ValueError):
        checksums.checksums(writable, lengths=lengths[:-1])
