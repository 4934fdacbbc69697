"""Namespaces and page keys: the documented function, isolation, safe names."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from hicached.errors import InvalidNamespace
from hicached.hashing import pack_tokens, page_keys
from hicached.namespace import NamespaceSpec, canonical_text, namespace_digest, validate_spec

SPEC = NamespaceSpec(
    model="org/model", kv_dtype="bfloat16", layout="layer_first", page_tokens=4, page_bytes=64
)


def test_keys_follow_the_documented_chain() -> None:
    tokens = list(range(10))  # two full pages of 4, two tokens left over
    seed = namespace_digest(SPEC)
    assert seed == xxhash.xxh3_128_digest(canonical_text(SPEC).encode())
    packed = pack_tokens(tokens)
    assert packed == np.arange(10, dtype="<u4").tobytes()
    k0 = xxhash.xxh3_128_digest(seed + packed[0:16])
    k1 = xxhash.xxh3_128_digest(k0 + packed[16:32])
    assert page_keys(seed, packed, 4) == [k0, k1]
    assert page_keys(seed, packed, 4, max_pages=1) == [k0]


def test_canonical_text_is_stable() -> None:
    assert canonical_text(SPEC) == (
        "hicached-namespace-v1\nmodel=org/model\nrevision=main\nkv_dtype=bfloat16\n"
        "layout=layer_first\npage_tokens=4\npage_bytes=64\ntp=0/1\ncp=0/1\npp=0/1\ntenant=default\n"
    )


def test_every_field_separates_namespaces() -> None:
    variants = [
        {"model": "org/other"},
        {"revision": "v2"},
        {"kv_dtype": "float16"},
        {"layout": "page_first"},
        {"page_tokens": 8},
        {"page_bytes": 128},
        {"tp_rank": 1, "tp_size": 2},
        {"cp_rank": 1, "cp_size": 2},
        {"pp_stage": 1, "pp_size": 2},
        {"tenant": "team-b"},
    ]
    fields = {f: getattr(SPEC, f) for f in SPEC.__struct_fields__}
    digests = {namespace_digest(SPEC)}
    for change in variants:
        digests.add(namespace_digest(NamespaceSpec(**{**fields, **change})))
    assert len(digests) == len(variants) + 1


def test_replicated_kv_is_shared_by_all_tp_ranks() -> None:
    fields = {f: getattr(SPEC, f) for f in SPEC.__struct_fields__}
    a = NamespaceSpec(**{**fields, "tp_rank": 0, "tp_size": 4, "replicated": True})
    b = NamespaceSpec(**{**fields, "tp_rank": 3, "tp_size": 4, "replicated": True})
    assert namespace_digest(a) == namespace_digest(b)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "../etc/passwd"},
        {"model": "/abs"},
        {"model": "a/b/c"},
        {"model": 'm"}\n'},
        {"tenant": "a/b"},
        {"tenant": "x y"},
        {"tenant": ""},
        {"revision": ".."},
        {"kv_dtype": "BF16"},
        {"page_tokens": 0},
        {"page_bytes": 0},
        {"page_bytes": 1 << 30},
        {"tp_rank": 2, "tp_size": 2},
        {"pp_size": 0},
    ],
)
def test_unsafe_or_inconsistent_namespaces_are_rejected(change: dict[str, object]) -> None:
    fields = {f: getattr(SPEC, f) for f in SPEC.__struct_fields__}
    with pytest.raises(InvalidNamespace):
        validate_spec(NamespaceSpec(**{**fields, **change}), max_page_bytes=1 << 20)


def test_pack_tokens_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        pack_tokens([-1])
    with pytest.raises(ValueError):
        pack_tokens([1 << 32])
    with pytest.raises(ValueError):
        pack_tokens(b"abc")
    assert pack_tokens([]) == b""
    # every integer dtype: in range packs the same bytes, out of range is refused
    ids = [0, 7, 127]
    for dtype in ("u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8"):
        assert pack_tokens(np.array(ids, dtype=dtype)) == np.array(ids, "<u4").tobytes()
    for dtype in ("i1", "i2", "i4", "i8"):
        with pytest.raises(ValueError):
            pack_tokens(np.array([3, -1], dtype=dtype))
    for big in (1 << 32, (1 << 63) - 1):
        with pytest.raises(ValueError):
            pack_tokens(np.array([1, big], dtype=np.int64))
    with pytest.raises(ValueError):
        pack_tokens(np.array([1, 1 << 40], dtype=np.uint64))
    assert pack_tokens(np.array([0xFFFFFFFF], np.uint64)) == b"\xff\xff\xff\xff"
    # bytes of any kind are ids already packed, never one id per byte
    packed = np.array([1, 70000], "<u4").tobytes()
    for form in (packed, bytearray(packed), memoryview(packed)):
        assert pack_tokens(form) == packed
    with pytest.raises(ValueError):
        pack_tokens(bytearray(b"abc"))


def test_key_cache_returns_the_same_chains_and_stays_bounded() -> None:
    from hicached.hashing import KeyCache

    cache = KeyCache(max_keys=10)
    seed = namespace_digest(SPEC)
    a = pack_tokens(range(16))  # 4 pages
    b = pack_tokens(range(100, 124))  # 6 pages
    assert cache.keys(seed, a, 4) == page_keys(seed, a, 4)
    assert cache.keys(seed, a, 4) is cache.keys(seed, a, 4)
    assert cache.hits == 2
    assert cache.keys(seed, b, 4) == page_keys(seed, b, 4)
    assert cache.size == 10
    c = pack_tokens(range(200, 204))  # 1 page: the oldest chain (a) must go
    cache.keys(seed, c, 4)
    assert cache.size == 7
    hits = cache.hits
    cache.keys(seed, a, 4)
    assert cache.hits == hits  # recomputed, not served
    other = namespace_digest(
        NamespaceSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__struct_fields__}, "tenant": "b"})
    )
    assert cache.keys(other, a, 4) == page_keys(other, a, 4) != page_keys(seed, a, 4)
    assert KeyCache(0).keys(seed, a, 4) == page_keys(seed, a, 4)


def test_key_cache_reuses_a_shared_prefix_only_as_far_as_the_tokens_agree() -> None:
    from hicached.hashing import KEPT_KEY_BYTES, KeyCache

    cache = KeyCache(max_keys=1000, prefix_bytes=1 << 20)
    seed = namespace_digest(SPEC)
    base = list(range(64))  # 16 pages of 4 tokens
    first = pack_tokens(base)
    assert cache.keys(seed, first, 4) == page_keys(seed, first, 4)
    assert cache.prefix_pages == 0
    # the next turn: the same 16 pages and 4 more
    longer = pack_tokens([*base, *range(500, 516)])
    assert cache.keys(seed, longer, 4) == page_keys(seed, longer, 4)
    assert cache.prefix_pages == 16
    # the same length, its last page other: 19 pages shared, the last hashed
    near = pack_tokens([*base, *range(500, 512), 7, 7, 7, 7])
    assert cache.keys(seed, near, 4) == page_keys(seed, near, 4)
    assert cache.prefix_pages == 16 + 19
    # parted inside page 5 (a token of page 5 differs): 5 pages shared, no more
    parted = pack_tokens([*base[:21], 999, *base[22:]])
    assert cache.keys(seed, parted, 4) == page_keys(seed, parted, 4)
    assert cache.prefix_pages == 16 + 19 + 5
    # shorter than the kept one, and a tail that is not a whole page
    short = pack_tokens([*base[:29], 1])
    assert cache.keys(seed, short, 4) == page_keys(seed, short, 4)
    assert cache.prefix_pages == 16 + 19 + 5 + 5
    # another namespace with the same tokens shares nothing
    other = namespace_digest(
        NamespaceSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__struct_fields__}, "tenant": "b"})
    )
    assert cache.keys(other, longer, 4) == page_keys(other, longer, 4)
    assert cache.prefix_pages == 16 + 19 + 5 + 5
    # the kept token ids stay within their bound, the oldest going first
    kept = 64 + 4 * KEPT_KEY_BYTES  # 16 token ids and their 4 keys
    small = KeyCache(max_keys=1000, prefix_bytes=3 * kept)
    for start in range(0, 5000, 1000):
        small.keys(seed, pack_tokens(range(start, start + 16)), 4)
    assert small.prefix_held == 3 * kept
    small.keys(seed, pack_tokens([*range(0, 16), 1, 2, 3, 4]), 4)
    assert small.prefix_pages == 0  # its prefix (start 0) went first
    small.keys(seed, pack_tokens([*range(4000, 4016), 1, 2, 3, 4]), 4)
    assert small.prefix_pages == 4
    assert KeyCache(1000, 0).keys(seed, longer, 4) == page_keys(seed, longer, 4)


def test_key_cache_agrees_with_page_keys_for_any_sequence_of_requests() -> None:
    """Random requests (two namespaces, sequences that grow, shrink, part inside or
    after the first page, are empty or shorter than a page) against ``page_keys``,
    through both entries (``keys``, and ``cached`` then ``compute`` with the first
    key, as a match calls them) and under tight bounds, so kept prefixes and chains
    are evicted all the time; the bookkeeping must equal what is held."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hicached.hashing import TOKEN_BYTES, KeyCache, _kept_bytes

    seeds = [namespace_digest(SPEC), bytes(16)]

    def grow(history: list[list[int]], base: int, cut: int, tail: list[int]) -> list[int]:
        old = history[base % len(history)] if history else []
        return [*old[: cut % (len(old) + 1)], *tail]

    request = st.tuples(
        st.integers(0, 1),  # namespace
        st.integers(0, 7),  # which earlier sequence to start from
        st.integers(0, 200),  # where to cut it
        st.lists(st.integers(0, 3), max_size=24),  # what follows (few ids: pages repeat)
        st.booleans(),  # through cached+compute with the first key
    )

    @settings(max_examples=300, deadline=None, database=None)
    @given(
        page_tokens=st.integers(1, 4),
        max_keys=st.integers(0, 40),
        prefix_bytes=st.integers(0, 600),
        requests=st.lists(request, max_size=30),
    )
    def check(page_tokens: int, max_keys: int, prefix_bytes: int, requests: list) -> None:
        cache = KeyCache(max_keys, prefix_bytes)
        history: list[list[int]] = []
        for ns, base, cut, tail, split in requests:
            ids = grow(history, base, cut, tail)
            history.append(ids)
            seed, tokens = seeds[ns], pack_tokens(ids)
            want = page_keys(seed, tokens, page_tokens)
            if split:
                tag, got = cache.cached(seed, tokens)
                if got is None:
                    first = page_keys(seed, tokens, page_tokens, max_pages=1)
                    got = cache.compute(tag, seed, tokens, page_tokens, first)
            else:
                got = cache.keys(seed, tokens, page_tokens)
            assert got == want, (ids, ns)
            assert cache.size == sum(map(len, cache._chains.values())) <= max(max_keys, 0)
            kept = cache._prefixes.values()
            assert cache.prefix_held == sum(map(_kept_bytes, kept)) <= max(prefix_bytes, 0)
            for first_key, (s, held, chain) in cache._prefixes.items():
                assert chain == page_keys(s, held, page_tokens) and chain[0] == first_key
                assert len(held) >= page_tokens * TOKEN_BYTES

    check()
