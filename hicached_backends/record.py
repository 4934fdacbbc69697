"""The self-describing page record every backend stores.

A record is a 64-byte header followed by the page bytes::

    magic "HCR1" | version u16 | flags u16 | generation u64 |
    namespace digest 16B | page key 16B | length u32 | payload xxh3_64 u64 |
    header xxh32 u32 (of the 60 bytes before it)

All integers little-endian. The header checksum detects torn headers; the
payload checksum is verified on every read. ``generation`` lets a file
segment tell its current records from leftovers of an earlier use.
"""

from __future__ import annotations

import ctypes
import operator
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import NamedTuple

import numpy as np
import xxhash

MAGIC = b"HCR1"
VERSION = 1
_BODY = struct.Struct("<4sHHQ16s16sIQ")
_CHECK = struct.Struct("<I")
HEADER_BYTES = _BODY.size + _CHECK.size
assert HEADER_BYTES == 64


class Header(NamedTuple):
    generation: int
    ns: bytes
    key: bytes
    length: int
    checksum: int


def _native_xxh3() -> Callable[[int, int], int] | None:
    """XXH3_64bits of the xxhash extension module itself, called through ctypes.

    The package's Python functions hold the GIL while they hash, so checksums
    on I/O threads would take turns; a foreign call through ctypes releases
    it, so verification overlaps other threads' reads and copies. The C
    functions are exported by the extension module (dynamic symbols). Where
    the module was built with xxHash's x86 dispatcher, ``XXH3_64bits_dispatch``
    picks the widest vector code the CPU has at run time (AVX2: 1.5x the plain
    symbol on 64 KiB and 1.8x on 1 MiB in cache, docs/perf.md); elsewhere the
    plain ``XXH3_64bits`` is used. Either must agree with the Python function
    on a probe, or None is returned and the Python function is used.
    """
    try:
        import importlib

        library = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
    except (ImportError, OSError, TypeError, AttributeError):  # no module, no file
        return None
    probe = bytearray(np.random.default_rng(0).bytes(4096))  # past the vector threshold
    at = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
        fn = getattr(library, name, None)
        if fn is None:
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint64
        if all(fn(at, n) == xxhash.xxh3_64_intdigest(probe[:n]) for n in (0, 8, 200, 4096)):
            return fn
    return None


_XXH3 = _native_xxh3()


def native_checksum() -> bool:
    """Whether payload checksums run in the native XXH3, without the GIL."""
    return _XXH3 is not None


def address_of(payload: bytes | memoryview) -> int | None:
    """Where a writable, contiguous, non-empty buffer's bytes are (for the
    native checksum), or None when they must be hashed by the Python function."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(payload))
    except (TypeError, ValueError, BufferError):  # read-only, not contiguous, or empty
        return None


def all_within(base: int, size: int, addresses: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether every buffer (``address_of`` and length) lies in ``[base, base + size)``,
    as pool slots lie in the pool; True for none."""
    if not addresses:
        return True
    return min(addresses) >= base and max(map(operator.add, addresses, lengths)) <= base + size


def nbytes(payload: bytes | memoryview) -> int:
    """A payload's size in bytes (a view's ``len`` counts its items, not bytes)."""
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


def checksum(payload: bytes | memoryview) -> int:
    """xxh3_64 of ``payload``; without the GIL when the buffer is writable memory
    (pool slots, read buffers) and the native function was found."""
    address = address_of(payload)
    if address is not None and _XXH3 is not None:
        return int(_XXH3(address, nbytes(payload)))
    return xxhash.xxh3_64_intdigest(payload)


def pack_header(ns: bytes, key: bytes, payload: bytes | memoryview, generation: int = 0) -> bytes:
    size = nbytes(payload)
    body = _BODY.pack(MAGIC, VERSION, 0, generation, ns, key, size, checksum(payload))
    return body + _CHECK.pack(xxhash.xxh32_intdigest(body))


def parse_header(header: bytes | bytearray | memoryview) -> Header | None:
    """The header's fields, or None if it is not an intact record header."""
    if len(header) < HEADER_BYTES:
        return None
    body = bytes(header[: _BODY.size])
    magic, version, _flags, generation, ns, key, length, csum = _BODY.unpack(body)
    if magic != MAGIC or version != VERSION:
        return None
    if _CHECK.unpack_from(header, _BODY.size)[0] != xxhash.xxh32_intdigest(body):
        return None
    return Header(generation, ns, key, length, csum)


# magic, version and flags (0) as the header's first little-endian word
_LEAD_WORD = int.from_bytes(MAGIC + VERSION.to_bytes(2, "little") + bytes(2), "little")
SLICE_BYTES = 8 << 20  # payload bytes a parallel checksum slice takes, at least


def verify_many(
    headers: np.ndarray,
    payloads: Sequence[bytes | memoryview],
    ns: bytes,
    keys: Sequence[bytes],
    generations: Sequence[int] | None = None,
    *,
    addresses: Sequence[int | None] | None = None,
    pool: Executor | None = None,
    parts: int = 1,
    payload_sums: Sequence[int] | None = None,
) -> list[bool]:
    """For each (header row, payload, key): True only if the header is the intact
    record header of exactly (ns, key) and the payload's checksum matches.

    ``headers`` is a C-contiguous (n, 64) uint8 array. Every header field is
    compared with what it must be, for all headers in a few array operations;
    only the two checksums are computed page by page. The payload hashes run
    without the GIL (``checksum``), in ``parts`` slices, all but the first on
    ``pool`` when given, so the slices run in parallel, and so do the reads
    of other threads; the Python work per page is one call and one compare.
    ``addresses``: the payloads' ``address_of``, when the caller has them.
    ``payload_sums``: the payloads' xxh3_64, when the caller hashed them already
    (as each was read, while in cache); then nothing is hashed here but headers.
    """
    n = len(keys)
    if n == 0:
        return []
    if headers.shape != (n, HEADER_BYTES) or len(payloads) != n:
        raise ValueError(f"{headers.shape} headers for {len(payloads)} payloads and {n} keys")
    if len(ns) != 16 or set(map(len, keys)) != {16}:
        raise ValueError("the namespace digest and every key must be 16 bytes")
    # the header's first 48 bytes as six little-endian words: magic, version and
    # flags; generation; namespace (2); key (2); all compared in one operation
    words = headers.view("<u8")[:, :6]
    expected = np.empty((n, 6), np.uint64)
    expected[:, 0] = _LEAD_WORD
    expected[:, 1] = words[:, 1] if generations is None else generations
    expected[:, 2:4] = np.frombuffer(ns, "<u8")
    expected[:, 4:6] = np.frombuffer(b"".join(keys), "<u8").reshape(n, 2)
    lengths = list(map(nbytes, payloads))
    fields = (words == expected).all(axis=1) & (headers.view("<u4")[:, 12] == lengths)
    # the header checksum of each 60-byte body; then each payload's, below
    raw, body, xxh32 = headers.tobytes(), _BODY.size, xxhash.xxh32_intdigest
    out = [
        ok and xxh32(raw[start : start + body]) == head_sum
        for ok, start, head_sum in zip(
            fields.tolist(),
            range(0, n * HEADER_BYTES, HEADER_BYTES),
            headers.view("<u4")[:, 15].tolist(),
            strict=True,
        )
    ]
    sums = headers[:, 52:60].copy().view("<u8")[:, 0].tolist()
    if payload_sums is not None:
        return [ok and got == want for ok, got, want in zip(out, payload_sums, sums, strict=True)]
    where = list(map(address_of, payloads)) if addresses is None else addresses

    def check(lo: int, hi: int) -> None:  # each slice writes its own items of out
        native = _XXH3
        for i in range(lo, hi):
            if out[i]:
                at = where[i]
                if at is not None and native is not None:
                    out[i] = native(at, lengths[i]) == sums[i]
                else:
                    out[i] = xxhash.xxh3_64_intdigest(payloads[i]) == sums[i]

    # slices smaller than this cost more in thread handoffs than they save
    parts = min(parts, n, sum(lengths) // SLICE_BYTES)
    if pool is None or parts < 2:
        check(0, n)
    else:
        cuts = [n * k // parts for k in range(parts + 1)]
        helpers = [pool.submit(check, cuts[k], cuts[k + 1]) for k in range(1, parts)]
        check(cuts[0], cuts[1])  # this thread takes the first slice
        for done in helpers:
            done.result()
    return out


def verify(
    header: bytes | bytearray | memoryview,
    payload: bytes | memoryview,
    ns: bytes,
    key: bytes,
    generation: int | None = None,
) -> bool:
    """True only if this is the record of exactly (ns, key) and its bytes are intact."""
    if len(header) != HEADER_BYTES or len(key) != 16 or len(ns) != 16:
        return False
    rows = np.frombuffer(header, np.uint8).reshape(1, HEADER_BYTES)
    gens = None if generation is None else [generation]
    return verify_many(rows, [payload], ns, [key], gens)[0]
