"""Payload checksums of many pages at once, with as little Python a page as can be.

A record's payload checksum is XXH3-64 (record.py). The ``xxhash`` package's
Python functions hold the GIL while they hash, so checksums on several threads
would take turns. The C functions of its extension module are exported as
dynamic symbols; called through ctypes, a foreign call gives the GIL up for
the hash and takes it back after.

What a page costs the GIL is then the call itself: converting the address and
length, the call's handoff, and the result. With 64 KiB pages a thread makes a
call every few microseconds, so every bit of Python around it is multiplied by
the threads that queue for the GIL: a loop that looks up a buffer's address,
tests a flag and stores into a list for each page held the GIL about four
times as long as the call and stopped scaling at two threads (docs/perf.md).
``checksums`` takes the addresses and lengths of a whole batch and maps the C
function over them (``map`` runs the loop in C), in contiguous slices that run
side by side on an executor: nothing else per page, no object made per page
but the result.

Without a compiled helper no single foreign call can cover a batch: a GIL
handoff per page stays. Where that is the bound, verification moves into
processes with interpreters of their own (the file store's readers).
"""

from __future__ import annotations

import ctypes
import operator
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np
import xxhash

Native = Callable[[int, int], int]


def _native_xxh3() -> Native | None:
    """XXH3_64bits of the xxhash extension module itself, called through ctypes.

    Where the module was built with xxHash's x86 dispatcher,
    ``XXH3_64bits_dispatch`` picks the widest vector code the CPU has at run
    time (AVX2: 1.5x the plain symbol on 64 KiB and 1.8x on 1 MiB in cache,
    docs/perf.md); elsewhere the plain ``XXH3_64bits`` is used. Either must
    agree with the Python function on a probe, or None is returned and the
    Python function is used.
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

#: payload bytes a parallel slice takes, at least: smaller slices cost more in
#: thread handoffs than they save
SLICE_BYTES = 8 << 20


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


def checksums(
    payloads: Sequence[bytes | memoryview],
    *,
    addresses: Sequence[int | None] | None = None,
    lengths: Sequence[int] | None = None,
    pool: Executor | None = None,
    parts: int = 1,
) -> list[int]:
    """xxh3_64 of every payload, in order.

    ``addresses`` and ``lengths``: the payloads' ``address_of`` and ``nbytes``,
    when the caller has them (a pool slot's address is its offset plus the
    pool's). A slice whose buffers all have an address is one ``map`` of the
    native function; one with a buffer that has none (read-only bytes) is
    hashed by the Python function. The batch is cut into ``parts`` contiguous
    slices of at least ``SLICE_BYTES``, all but the first on ``pool``, the
    first on this thread; contiguous, so each thread walks memory in order.
    """
    n = len(payloads)
    if n == 0:
        return []
    sizes = list(map(nbytes, payloads)) if lengths is None else lengths
    where = list(map(address_of, payloads)) if addresses is None else addresses
    if len(sizes) != n or len(where) != n:
        raise ValueError(f"{len(where)} addresses and {len(sizes)} lengths for {n} payloads")
    native = _XXH3

    def run(lo: int, hi: int) -> list[int]:
        at = where[lo:hi]
        if native is not None and None not in at:
            return list(map(native, typing.cast(Sequence[int], at), sizes[lo:hi]))
        return [
            native(a, size) if a is not None and native is not None else xxhash.xxh3_64_intdigest(p)
            for a, size, p in zip(at, sizes[lo:hi], payloads[lo:hi], strict=True)
        ]

    parts = min(parts, n, sum(sizes) // SLICE_BYTES)
    if pool is None or parts < 2:
        return run(0, n)
    cuts = [n * k // parts for k in range(parts + 1)]
    helpers = [pool.submit(run, cuts[k], cuts[k + 1]) for k in range(1, parts)]
    out = run(cuts[0], cuts[1])  # this thread takes the first slice
    for done in helpers:
        out += done.result()
    return out
