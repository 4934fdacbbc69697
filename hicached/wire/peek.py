"""The head of a request that could not be decoded: its op and id, read from
the msgpack map's first keys without decoding the rest, so an error reply can
name the request (a message nested too deep to decode, or a fault)."""

from __future__ import annotations

import struct

# msgpack head bytes of the scalars peek_request reads, with their payload sizes.
_UINT = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_INT = {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_OTHER = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8}  # nil, false, true, floats
_SIZED = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}  # str8-32, bin8-32


def peek_request(payload: bytes) -> tuple[str, int | None]:
    """The ``op`` and ``id`` of a request, read from the scalar fields at the head
    of its msgpack map without decoding any nested value (which may be nested
    too deep to decode). ``("", None)`` where they cannot be read."""
    op, request_id = "", None
    try:
        head, pos = payload[0], 1
        if 0x80 <= head <= 0x8F:
            count = head & 0x0F
        elif head == 0xDE:
            count, pos = struct.unpack_from(">H", payload, 1)[0], 3
        elif head == 0xDF:
            count, pos = struct.unpack_from(">I", payload, 1)[0], 5
        else:
            return op, request_id
        for _ in range(count):
            key, pos = _scalar(payload, pos)
            value, pos = _scalar(payload, pos)
            if key == b"op" and isinstance(value, bytes):
                op = value.decode()
            elif key == b"id" and isinstance(value, int):
                request_id = value
            if op and request_id is not None:
                break
    except (IndexError, ValueError, struct.error):  # a nested value, or cut short
        pass
    return op, request_id


def _scalar(buf: bytes, pos: int) -> tuple[bytes | int | None, int]:
    """The msgpack scalar at ``pos`` (strings and bins as bytes, ints as int,
    others as None) and the position after it; ValueError for anything nested."""
    head = buf[pos]
    if head <= 0x7F or head >= 0xE0:  # fixint
        return head if head <= 0x7F else head - 0x100, pos + 1
    if 0xA0 <= head <= 0xBF:  # fixstr
        start, size = pos + 1, head & 0x1F
    elif head in _SIZED:
        start = pos + 1 + _SIZED[head]
        size = int.from_bytes(buf[pos + 1 : start], "big")
    elif head in _UINT or head in _INT:
        start, size = pos + 1, _UINT.get(head) or _INT[head]
    elif head in _OTHER:
        return None, pos + 1 + _OTHER[head]
    else:
        raise ValueError("a nested value")
    end = start + size
    if end > len(buf):
        raise ValueError("cut short")
    if head in _UINT or head in _INT:
        return int.from_bytes(buf[start:end], "big", signed=head in _INT), end
    return buf[start:end], end
