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

import struct
from typing import NamedTuple

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


def checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack_header(ns: bytes, key: bytes, payload: bytes | memoryview, generation: int = 0) -> bytes:
    body = _BODY.pack(MAGIC, VERSION, 0, generation, ns, key, len(payload), checksum(payload))
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


def verify(
    header: bytes | bytearray | memoryview,
    payload: bytes | memoryview,
    ns: bytes,
    key: bytes,
    generation: int | None = None,
) -> bool:
    """True only if this is the record of exactly (ns, key) and its bytes are intact."""
    h = parse_header(header)
    return (
        h is not None
        and h.ns == ns
        and h.key == key
        and h.length == len(payload)
        and (generation is None or h.generation == generation)
        and h.checksum == checksum(payload)
    )
