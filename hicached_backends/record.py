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

import itertools
import operator
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from typing import NamedTuple

import numpy as np
import xxhash

from hicached_backends.checksums import (
    address_of,
    all_within,
    checksum,
    checksums,
    native_checksum,
    nbytes,
)

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "Header",
    "address_of",
    "all_within",
    "checksum",
    "checksums",
    "native_checksum",
    "nbytes",
    "other_version",
    "pack_header",
    "pack_headers",
    "parse_header",
    "verify",
    "verify_many",
]

MAGIC = b"HCR1"
VERSION = 1
_BODY = struct.Struct("<4sHHQ16s16sIQ")
_CHECK = struct.Struct("<I")
HEADER_BYTES = _BODY.size + _CHECK.size
assert HEADER_BYTES == 64


# magic, version and flags (0) as the header's first little-endian word
_LEAD_WORD = int.from_bytes(MAGIC + VERSION.to_bytes(2, "little") + bytes(2), "little")


class Header(NamedTuple):
    generation: int
    ns: bytes
    key: bytes
    length: int
    checksum: int


def pack_header(ns: bytes, key: bytes, payload: bytes | memoryview, generation: int = 0) -> bytes:
    """The header of one record (``pack_headers`` of one)."""
    return pack_headers(ns, [key], [nbytes(payload)], [checksum(payload)], generation)[0]


def pack_headers(
    ns: bytes | Sequence[bytes],
    keys: Sequence[bytes],
    lengths: Sequence[int],
    sums: Sequence[int],
    generation: int | Sequence[int] = 0,
) -> list[bytes]:
    """The 64-byte headers of a batch of records, each byte for byte what
    ``pack_header`` gives; the payload checksums ``sums`` come from the caller
    (``checksums``); ``ns`` and ``generation`` are one for all or one a record. The
    loops run in C (``map`` over struct packing and the header checksum):
    about 0.4 us a record and nothing fixed, where array operations cost
    about 20 us a batch."""
    n = len(keys)
    if len(lengths) != n or len(sums) != n:
        raise ValueError(f"{len(lengths)} lengths and {len(sums)} checksums for {n} keys")
    # struct's "16s" would pad or cut a digest of another size without a word
    spaces: Iterable[bytes]
    if isinstance(ns, bytes):
        good_ns, spaces = len(ns) == 16, itertools.repeat(ns, n)
    else:
        good_ns, spaces = len(ns) == n and all(len(one) == 16 for one in ns), ns
    if not good_ns:
        raise ValueError("namespace digests must be 16 bytes, one for all or one a record")
    if n and set(map(len, keys)) != {16}:
        raise ValueError("every key must be 16 bytes")
    r = itertools.repeat
    gens = r(generation, n) if isinstance(generation, int) else generation
    bodies = list(
        map(_BODY.pack, r(MAGIC, n), r(VERSION, n), r(0, n), gens, spaces, keys, lengths, sums)
    )
    return list(map(operator.add, bodies, map(_CHECK.pack, map(xxhash.xxh32_intdigest, bodies))))


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


def other_version(record: bytes | bytearray | memoryview | np.ndarray) -> bool:
    """Whether ``record`` begins as a record of another format version: another
    writer's (a host running an older or newer hicached on a shared store),
    which a reader of this version can neither read nor judge bad, so it must
    never remove it."""
    lead = bytes(record[:6])
    return lead[:4] == MAGIC and len(lead) == 6 and lead[4:6] != VERSION.to_bytes(2, "little")


def verify_many(
    headers: np.ndarray,
    payloads: Sequence[bytes | memoryview],
    ns: bytes,
    keys: Sequence[bytes],
    generations: Sequence[int] | None = None,
    *,
    addresses: Sequence[int | None] | None = None,
    lengths: Sequence[int] | None = None,
    pool: Executor | None = None,
    parts: int = 1,
    payload_sums: Sequence[int] | None = None,
) -> list[bool]:
    """For each (header row, payload, key): True only if the header is the intact
    record header of exactly (ns, key) and the payload's checksum matches.

    ``headers`` is a C-contiguous (n, 64) uint8 array. Every header field is
    compared with what it must be, for all headers in a few array operations;
    the header checksums are one call a header, and the payload checksums one
    batched ``checksums`` (native, without the GIL, in ``parts`` slices on
    ``pool``). Every payload is hashed, whatever its header says: the work does
    not depend on the data. ``addresses`` and ``lengths``: the payloads'
    ``address_of`` and ``nbytes``, when the caller has them.
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
    sizes = list(map(nbytes, payloads)) if lengths is None else lengths
    if len(sizes) != n:
        raise ValueError(f"{len(sizes)} lengths for {n} payloads")
    # the header's first 48 bytes as six little-endian words: magic, version and
    # flags; generation; namespace (2); key (2); all compared in one operation
    words = headers.view("<u8")[:, :6]
    expected = np.empty((n, 6), np.uint64)
    expected[:, 0] = _LEAD_WORD
    expected[:, 1] = words[:, 1] if generations is None else generations
    expected[:, 2:4] = np.frombuffer(ns, "<u8")
    expected[:, 4:6] = np.frombuffer(b"".join(keys), "<u8").reshape(n, 2)
    ok = (words == expected).all(axis=1) & (headers.view("<u4")[:, 12] == sizes)
    # the header checksum of each 60-byte body
    raw, body, xxh32 = headers.tobytes(), _BODY.size, xxhash.xxh32_intdigest
    heads = [xxh32(raw[at : at + body]) for at in range(0, n * HEADER_BYTES, HEADER_BYTES)]
    ok &= headers.view("<u4")[:, 15] == np.asarray(heads, np.uint32)
    if payload_sums is None:
        payload_sums = checksums(
            payloads, addresses=addresses, lengths=sizes, pool=pool, parts=parts
        )
    elif len(payload_sums) != n:
        raise ValueError(f"{len(payload_sums)} checksums for {n} payloads")
    want = headers[:, 52:60].copy().view("<u8")[:, 0]
    ok &= np.asarray(payload_sums, np.uint64) == want
    return ok.tolist()


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
