"""Namespaces: everything that makes two caches' bytes incompatible.

A namespace names one KV shard of one model build for one tenant. Its
canonical text (see docs/keys.md) is hashed with xxh3_128 into a 16-byte
digest that seeds the page-key chain, so two namespaces never share a key.
"""

from __future__ import annotations

import re

import msgspec
import xxhash

from hicached.errors import InvalidNamespace

# Model ids look like "org/name"; every part must be safe in a path and a metric label.
_MODEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9][A-Za-z0-9._-]{0,127})?")
MAX_MODEL_CHARS = 257  # the longest model id _MODEL_RE takes: two parts of 128 and the slash
_TOKEN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_LOWER_RE = re.compile(r"[a-z0-9][a-z0-9_]{0,63}")
_SCHEME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")

TOKENS = "tokens"  # the key scheme of namespaces whose keys the daemon chains over token ids
MAX_KEY_BYTES = 64  # longest engine key of a key-addressed namespace
MAX_SHARDS = 1024

MAX_PAGE_TOKENS = 1 << 16
MAX_SLIDING_WINDOW = 1 << 31  # tokens; vLLM's windows are far smaller
_KIND_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")


class NamespaceSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a client registers before it stores or matches pages.

    ``replicated`` marks KV that is identical on every TP rank (MLA-style):
    all TP ranks then share one namespace and the TP coordinates are left out
    of the digest.

    ``key_scheme`` says who names the pages: ``tokens`` (the daemon chains
    keys over token ids, docs/keys.md) or an engine's scheme (``vllm-sha256``,
    ``sglang-sha256``, ...) whose own opaque keys the engine sends; the
    operations of one scheme are refused on a namespace of the other.

    ``shards`` > 1 makes pages *wide*: each page holds ``shards`` equal parts,
    one per worker (worker ``r`` copies at ``r * page_bytes // shards``), and
    ``page_bytes`` is the whole page.

    ``tenant`` salts the digest. A daemon with ``[tenants]`` sets it to the
    tenant of the connection that registers the namespace (when left at
    ``default``) and refuses any other (cache/desk.py, docs/keys.md).
    """

    model: str
    revision: str = "main"
    kv_dtype: str
    layout: str
    page_tokens: int
    page_bytes: int
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    pp_stage: int = 0
    pp_size: int = 1
    replicated: bool = False
    tenant: str = "default"
    key_scheme: str = TOKENS
    shards: int = 1

    @property
    def keyed(self) -> bool:
        """Pages are named by the engine's keys, not by token ids."""
        return self.key_scheme != TOKENS


class EventMeta(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a namespace's KV events say of its pages beyond their keys: vLLM's
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` of the KV cache
    group the namespace holds (``get_kv_cache_spec_kind(spec).value``, e.g.
    ``full_attention``, ``sliding_window``, ``mamba``, and
    ``get_kv_cache_spec_sliding_window(spec)``: the window in tokens, or None).

    Registered beside the spec, not in it: it describes the pages to routers
    and makes no two caches' bytes incompatible, so it stays out of the digest
    (``canonical_text``), and the pages a namespace stored before keep their
    keys. Only for namespaces of vLLM's key schemes (``vllm-*``), whose events
    name each page's KV cache group (docs/events.md)."""

    kind: str
    sliding_window: int | None = None


def quoted(value: str, most: int = 80) -> str:
    """A value a client sent, as an error quotes it: at most ``most`` characters
    (a refused name may be as long as a message), marked where cut."""
    return repr(value[:most]) + ("..." if len(value) > most else "")


def validate_event_meta(spec: NamespaceSpec, meta: EventMeta) -> None:
    """Raise InvalidNamespace with an actionable sentence if ``meta`` is unusable
    for a namespace of ``spec``."""
    if not spec.key_scheme.startswith("vllm-"):
        raise InvalidNamespace(
            f"event metadata (kv_cache_spec_kind) describes a vLLM KV cache group, but "
            f"the namespace's key_scheme is {quoted(spec.key_scheme)}: register it without "
            "event metadata, or with a vllm-* key_scheme"
        )
    if not _KIND_RE.fullmatch(meta.kind):
        raise InvalidNamespace(
            f"event metadata kind {quoted(meta.kind)} is not allowed: use 1-32 lower-case "
            "letters, digits or '_', starting with a letter (vLLM's KVCacheSpecKind "
            "values, such as full_attention or sliding_window)"
        )
    window = meta.sliding_window
    if window is not None and not 1 <= window <= MAX_SLIDING_WINDOW:
        raise InvalidNamespace(
            f"event metadata sliding_window must be in 1..{MAX_SLIDING_WINDOW} tokens "
            f"or null, got {window}"
        )


def validate_spec(spec: NamespaceSpec, max_page_bytes: int) -> None:
    """Raise InvalidNamespace with an actionable sentence if ``spec`` is unusable."""
    if not _MODEL_RE.fullmatch(spec.model) or ".." in spec.model:
        raise InvalidNamespace(
            f"model {quoted(spec.model)} is not allowed: use letters, digits, '.', '_', '-' "
            "and at most one '/' (like 'org/name'), 128 characters a part"
        )
    for name in ("revision", "tenant"):
        value = getattr(spec, name)
        if not _TOKEN_RE.fullmatch(value) or ".." in value:
            raise InvalidNamespace(
                f"{name} {quoted(value)} is not allowed: use 1-64 letters, digits, '.', '_' "
                "or '-', starting with a letter or digit"
            )
    for name in ("kv_dtype", "layout"):
        value = getattr(spec, name)
        if not _LOWER_RE.fullmatch(value):
            raise InvalidNamespace(
                f"{name} {quoted(value)} is not allowed: use 1-64 lower-case letters, digits or '_'"
            )
    if not 1 <= spec.page_tokens <= MAX_PAGE_TOKENS:
        raise InvalidNamespace(
            f"page_tokens must be in 1..{MAX_PAGE_TOKENS}, got {spec.page_tokens}"
        )
    if not 1 <= spec.page_bytes <= max_page_bytes:
        raise InvalidNamespace(
            f"page_bytes must be in 1..{max_page_bytes} (the daemon's pool.max_page_bytes), "
            f"got {spec.page_bytes}"
        )
    if not _SCHEME_RE.fullmatch(spec.key_scheme):
        raise InvalidNamespace(
            f"key_scheme {quoted(spec.key_scheme)} is not allowed: use 1-64 lower-case letters, "
            "digits, '_' or '-' (tokens, or the engine's scheme such as vllm-sha256)"
        )
    if not 1 <= spec.shards <= MAX_SHARDS or spec.page_bytes % spec.shards:
        raise InvalidNamespace(
            f"shards must be in 1..{MAX_SHARDS} and divide page_bytes ({spec.page_bytes}), "
            f"got {spec.shards}"
        )
    for rank_name, size_name in (
        ("tp_rank", "tp_size"),
        ("cp_rank", "cp_size"),
        ("pp_stage", "pp_size"),
    ):
        rank, size = getattr(spec, rank_name), getattr(spec, size_name)
        if not (size >= 1 and 0 <= rank < size):
            raise InvalidNamespace(
                f"{rank_name}={rank} must be in 0..{size_name}-1 ({size_name}={size})"
            )


def canonical_text(spec: NamespaceSpec) -> str:
    """The exact text whose xxh3_128 digest seeds the key chain (docs/keys.md)."""
    tp = "replicated" if spec.replicated else f"{spec.tp_rank}/{spec.tp_size}"
    # lines that a default leaves out, so the digests of older namespaces stay as they were
    extra = f"keys={spec.key_scheme}\n" if spec.keyed else ""
    if spec.shards > 1:
        extra += f"shards={spec.shards}\n"
    return (
        "hicached-namespace-v1\n"
        f"model={spec.model}\n"
        f"revision={spec.revision}\n"
        f"kv_dtype={spec.kv_dtype}\n"
        f"layout={spec.layout}\n"
        f"page_tokens={spec.page_tokens}\n"
        f"page_bytes={spec.page_bytes}\n"
        f"tp={tp}\n"
        f"cp={spec.cp_rank}/{spec.cp_size}\n"
        f"pp={spec.pp_stage}/{spec.pp_size}\n"
        f"{extra}"
        f"tenant={spec.tenant}\n"
    )


def namespace_digest(spec: NamespaceSpec) -> bytes:
    """16-byte digest of the namespace: the parent of its first page key."""
    return xxhash.xxh3_128_digest(canonical_text(spec).encode())
