"""Page keys: xxh3_128 chained over the parent key (docs/keys.md).

``key[0] = xxh3_128(namespace_digest || tokens[0:P])`` and
``key[i] = xxh3_128(key[i-1] || tokens[i*P:(i+1)*P])`` where tokens are packed
as little-endian uint32 and P is the namespace's page_tokens. Only full
pages have keys. Routers and engines can compute the same keys from the
same token ids with any xxh3 implementation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import xxhash

TOKEN_BYTES = 4
Tag = tuple[bytes, int, bytes]  # what names a cached chain: seed, length and digest

_digest = xxhash.xxh3_128_digest
# what a kept key costs: a 16-byte bytes object (49 bytes) and its slot in a list
KEPT_KEY_BYTES = 57


def pack_tokens(tokens: bytes | bytearray | memoryview | Iterable[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes, the form used on the wire and in
    keys. Bytes of any kind (bytes, bytearray, memoryview) are ids already packed."""
    if isinstance(tokens, bytes | bytearray | memoryview):
        packed = tokens if type(tokens) is bytes else bytes(tokens)
        if len(packed) % TOKEN_BYTES:
            raise ValueError("packed tokens must be a whole number of uint32 values")
        return packed
    arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
    if arr.size == 0:
        return b""
    kind, size = arr.dtype.kind, arr.dtype.itemsize
    if arr.ndim != 1 or kind not in "iu":
        raise ValueError("token ids must be a flat sequence of integers")
    # the dtype bounds the range: unsigned ids of 4 bytes or less need no check,
    # signed ones only their least, wider ones both ends
    low = kind == "i" and int(arr.min()) < 0
    if low or (size > 4 and int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must lie in 0..2**32-1")
    return arr.astype("<u4", copy=False).tobytes()


class KeyCache:
    """Recently computed key chains, by namespace and token-buffer digest.

    Schedulers look up the same waiting request step after step, and a store
    hashes what its match just hashed. Bounded by the total number of keys
    held; least recently used chains go first. A 128-bit digest names each
    buffer, the same strength as the keys themselves.

    A sequence that extends or shares a prefix with one seen lately (a
    conversation's next turn, a scheduler's sequence that grew by a page)
    hashes only the pages after the prefix they share: the token ids of the
    latest sequence to start with each first page are kept with its keys
    (``prefix_bytes`` of both at most, least recently kept go first; 0 = off;
    ``KEPT_KEY_BYTES`` counted a key, so pages of few tokens stay bounded
    too), and a chain is
    reused only as far as its tokens compare equal, byte for byte, to the new
    sequence's. Where the two part, hashing goes on from the last shared key,
    so the keys are exactly ``page_keys``'s.
    """

    def __init__(self, max_keys: int, prefix_bytes: int = 0) -> None:
        self.max_keys = max_keys
        self.size = 0
        self.hits = 0
        self._chains: OrderedDict[Tag, list[bytes]] = OrderedDict()
        self.prefix_bytes = prefix_bytes
        self.prefix_held = 0  # bytes kept for prefix reuse (token ids and keys)
        self.prefix_pages = 0  # pages whose keys were taken from a kept prefix
        # first page's key -> (seed, token ids, their chain): the latest sequence
        # that started there; a dict in the order entries were kept
        self._prefixes: dict[bytes, tuple[bytes, bytes, list[bytes]]] = {}

    def keys(self, seed: bytes, tokens: bytes, page_tokens: int) -> list[bytes]:
        """``page_keys(seed, tokens, page_tokens)``, from the cache when it can; do not mutate."""
        tag, chain = self.cached(seed, tokens)
        return chain if chain is not None else self.compute(tag, seed, tokens, page_tokens)

    def cached(self, seed: bytes, tokens: bytes) -> tuple[Tag | None, list[bytes] | None]:
        """The chain of ``tokens`` if it is held (do not mutate), and its tag for
        ``compute`` (None when the cache is off)."""
        if self.max_keys <= 0:
            return None, None
        tag = (seed, len(tokens), _digest(tokens))
        chain = self._chains.get(tag)
        if chain is not None:
            self._chains.move_to_end(tag)
            self.hits += 1
        return tag, chain

    def compute(
        self,
        tag: Tag | None,
        seed: bytes,
        tokens: bytes,
        page_tokens: int,
        first: list[bytes] | None = None,
    ) -> list[bytes]:
        """``page_keys(seed, tokens, page_tokens)``, kept under ``tag`` (``cached``'s).
        ``first``: the first page's key (``page_keys(..., max_pages=1)``), when the
        caller has it already."""
        if tag is None or self.prefix_bytes <= 0:
            chain = page_keys(seed, tokens, page_tokens)
        else:
            chain = self._extend(seed, tokens, page_tokens, first)
        if tag is not None:
            self._keep(tag, chain)
        return chain

    def _extend(
        self, seed: bytes, tokens: bytes, page_tokens: int, first: list[bytes] | None
    ) -> list[bytes]:
        """The chain of ``tokens``, hashed from the end of the prefix it shares
        with the latest kept sequence that starts with the same page; keeps it."""
        step = page_tokens * TOKEN_BYTES
        if len(tokens) < step:
            return []
        if first is None:
            first = page_keys(seed, tokens, page_tokens, max_pages=1)
        prefixes = self._prefixes
        held = prefixes.pop(first[0], None)
        shared = 0
        if held is not None:
            self.prefix_held -= _kept_bytes(held)
            if held[0] == seed:
                shared = _shared_pages(tokens, held[1], step)
        if shared:
            chain = held[2][:shared]  # type: ignore[index]
            chain += page_keys(chain[-1], tokens[shared * step :], page_tokens)
            self.prefix_pages += shared
        else:
            chain = first + page_keys(first[0], tokens[step:], page_tokens)
        kept = (seed, tokens, chain)
        cost = _kept_bytes(kept)
        if cost <= self.prefix_bytes:
            prefixes[first[0]] = kept
            self.prefix_held += cost
            while self.prefix_held > self.prefix_bytes:
                self.prefix_held -= _kept_bytes(prefixes.pop(next(iter(prefixes))))
        return chain

    def engine_keys(self, seed: bytes, keys: list[bytes], sizes: bytes) -> list[bytes]:
        """``engine_page_keys(seed, keys)`` from the cache when it can (``sizes``:
        each key's length, one byte each, so the joined keys name one list)."""
        if self.max_keys <= 0:
            return engine_page_keys(seed, keys)
        tag = (seed, len(keys), _digest(b"".join(keys) + sizes))
        chain = self._chains.get(tag)
        if chain is not None:
            self._chains.move_to_end(tag)
            self.hits += 1
            return chain
        chain = engine_page_keys(seed, keys)
        self._keep(tag, chain)
        return chain

    def _keep(self, tag: Tag, chain: list[bytes]) -> None:
        if len(chain) <= self.max_keys:
            self._chains[tag] = chain
            self.size += len(chain)
            while self.size > self.max_keys:
                _, old = self._chains.popitem(last=False)
                self.size -= len(old)


def _kept_bytes(kept: tuple[bytes, bytes, list[bytes]]) -> int:
    """What a kept sequence counts against ``KeyCache.prefix_bytes``."""
    return len(kept[1]) + KEPT_KEY_BYTES * len(kept[2])


def _shared_pages(tokens: bytes, kept: bytes, step: int) -> int:
    """How many leading pages of ``step`` bytes ``tokens`` and ``kept`` share, byte
    for byte (memcmp through ``startswith`` over views: nothing is copied)."""
    pages = min(len(tokens), len(kept)) // step
    view = memoryview(kept)
    if tokens.startswith(view[: pages * step]):
        return pages
    if pages > 1 and tokens.startswith(view[: (pages - 1) * step]):
        return pages - 1  # the last page other (a partial page filled since)
    low, high = 0, pages - 2  # low pages are shared for sure, at most high are
    while low < high:
        mid = (low + high + 1) // 2
        if tokens.startswith(view[: mid * step]):
            low = mid
        else:
            high = mid - 1
    return low


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


def engine_page_keys(seed: bytes, keys: Iterable[bytes]) -> list[bytes]:
    """The daemon's keys for the pages of a key-addressed namespace: each engine
    key hashed under the namespace digest, ``xxh3_128(seed || key)``, so that
    namespaces never share a key (docs/keys.md)."""
    return [_digest(seed + key) for key in keys]
