"""Page keys: xxh3_128 chained over the parent key (docs/keys.md).

``key[0] = xxh3_128(namespace_digest || tokens[0:P])`` and
``key[i] = xxh3_128(key[i-1] || tokens[i*P:(i+1)*P])`` where tokens are packed
as little-endian uint32 and P is the namespace's page_tokens. Only full
pages have keys. Routers and engines can compute the same keys from the
same token ids with any xxh3 implementation.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

TOKEN_BYTES = 4
KEY_BYTES = 16

_digest = xxhash.xxh3_128_digest


def pack_tokens(tokens: bytes | Iterable[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes, the form used on the wire and in keys."""
    if isinstance(tokens, bytes):
        if len(tokens) % TOKEN_BYTES:
            raise ValueError("packed tokens must be a whole number of uint32 values")
        return tokens
    arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError("token ids must be a flat sequence of integers")
    if int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
        raise ValueError("token ids must lie in 0..2**32-1")
    return arr.astype("<u4", copy=False).tobytes()


def page_keys(
    seed: bytes, tokens: bytes, page_tokens: int, max_pages: int | None = None
) -> list[bytes]:
    """Keys of the full pages of ``tokens`` (packed), chained from ``seed``."""
    step = page_tokens * TOKEN_BYTES
    count = len(tokens) // step
    if max_pages is not None:
        count = min(count, max_pages)
    keys: list[bytes] = []
    append = keys.append
    parent = seed
    for start in range(0, count * step, step):
        parent = _digest(parent + tokens[start : start + step])
        append(parent)
    return keys
