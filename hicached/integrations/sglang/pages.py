"""SGLang's host pools as hicached copies them: where the bytes of one page
are, how they go to and from the daemon's slots, and the namespace that
names such pages.

A page of a host pool is the bytes SGLang's ``get_data_page(flat=True)``
gives for it: for the KV pool K and V of every layer for one page of tokens,
for a Mamba pool one state (temporal, then each conv state), for DeepSeek's
compressed pools one page of their own rows. A pool is copied one of two
ways, chosen once when it is registered:

- ``RowPages``: the page is a few regions of the pool's own tensors, each a
  row of a whole-pool view (K and V; K and V of each layer for
  ``layer_first``; Mamba's temporal and conv states). One gather or scatter
  moves every page of a call, with no copy in between. Each view is checked
  against the pool's ``get_page_buffer_meta``, the addresses SGLang's
  zero-copy backends move for a page.
- ``FlatPages``: every other pool, through its own ``get_data_page`` and
  ``set_from_flat_data_page``, a staging copy per page (what SGLang's file
  backend does for every pool).

Both lay out a page's bytes in the same order, the flat data page's, so the
page size and the bytes do not depend on the way a pool was copied.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from hicached.errors import BadRequest, StaleHandle
from hicached.integrations.common import default_revision, safe_model

if TYPE_CHECKING:
    from hicached.client import Client
    from hicached.client.handles import Hit, Reservation
    from hicached.integrations.sglang.storage import Settings

KEY_SCHEME = "sglang-sha256"
KV = str(PoolName.KV)
_PAGE_HASH = re.compile(r"[0-9a-f]{64}")


# -- keys and host indices -------------------------------------------------------------


def page_keys(keys: Sequence[Any]) -> list[bytes]:
    """SGLang's page hashes as the daemon's keys: the leading ones that are
    64 lower-case hex digits (what ``get_hash_str`` makes), 32 bytes each."""
    out = []
    for key in keys:
        if not isinstance(key, str) or not _PAGE_HASH.fullmatch(key):
            break
        out.append(bytes.fromhex(key))
    return out


class Once(NamedTuple):
    """A call's page hashes as the daemon takes them in one reservation or
    prefetch: each key once (``once``)."""

    keys: list[bytes]  # the keys sent, each once, in the call's order
    at: list[int]  # per page of the call, the index of its key in ``keys`` (-1: not sent)
    first: list[int]  # per key sent, the index of its first page in the call


def once(keys: list[bytes]) -> Once:
    """Each of ``keys`` once: the daemon refuses a key twice in one reservation
    or prefetch, whose keys follow one another in one sequence (each the
    parent of the next). A key given again is sent once and its answer goes
    to every page that names it; a new key is sent only while the page before
    it names the last key sent (its parent), so none is linked under a page it
    does not follow: [A, B, A] sends A, B (both A pages get A's answer),
    [A, A, B] sends A, B, and [A, B, A, C] sends A, B and leaves C out (it
    follows A, not B): a miss in this call."""
    sent: list[bytes] = []
    index: dict[bytes, int] = {}
    at: list[int] = []
    first: list[int] = []
    closed = False  # a new key was left out: every new key after it follows it
    for i, key in enumerate(keys):
        j = index.get(key)
        if j is None and not closed:
            if sent and keys[i - 1] != sent[-1]:
                closed = True
            else:
                j = index[key] = len(sent)
                sent.append(key)
                first.append(i)
        at.append(-1 if j is None else j)
    return Once(sent, at, first)


def host_rows(host_indices: torch.Tensor | None, pages: int, page_size: int) -> list[int]:
    """The host pool rows of ``pages`` pages whose token slots SGLang gives,
    ``page_size`` per page, each page's in order from a page boundary."""
    flat = _count(host_indices, pages, page_size)
    if not pages:
        return []
    slots = flat.view(pages, page_size)
    starts = slots[:, 0]
    if bool((starts % page_size).any()) or not torch.equal(
        slots - starts[:, None], torch.arange(page_size).expand(pages, page_size)
    ):
        raise ValueError("host indices must cover whole host pages, each from its first slot")
    return (starts // page_size).tolist()


def _count(host_indices: torch.Tensor | None, pages: int, page_size: int) -> torch.Tensor:
    if host_indices is None:
        raise ValueError(f"{pages} keys need {pages * page_size} host indices, got none")
    dtype = host_indices.dtype
    integral = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    if not integral and host_indices.numel():  # torch.empty(0), a float, names no slot
        # the cast to int64 below would truncate 3.7 to 3: pages copied to or
        # from slots SGLang never named
        raise BadRequest(f"host indices must be an integer tensor, got {dtype}")
    flat = host_indices.reshape(-1).to("cpu", torch.int64)
    if flat.numel() != pages * page_size:
        raise ValueError(
            f"{pages} keys need {pages * page_size} host indices ({page_size} a page), "
            f"got {flat.numel()}"
        )
    return flat


def check_flat_pages(
    pages: Sequence[Any], page_bytes: int, what: str, contiguous: bool = False
) -> None:
    """SGLang's flat pages (``batch_get``'s targets, ``batch_set``'s values):
    each a tensor of one page, ``page_bytes`` bytes (and ``contiguous``, for a
    target the bytes are copied into). BadRequest before any page is copied,
    rather than torch's error about shapes after some pages were."""
    for i, page in enumerate(pages):
        if not isinstance(page, torch.Tensor):
            raise BadRequest(f"{what} {i} is a {type(page).__name__}, not a tensor")
        if page.nbytes != page_bytes:
            raise BadRequest(
                f"{what} {i} holds {page.nbytes} bytes ({tuple(page.shape)} of {page.dtype}); "
                f"a page of this pool is {page_bytes} bytes"
            )
        if contiguous and not page.is_contiguous():
            raise BadRequest(f"{what} {i} is not contiguous: the page is copied into it whole")


# -- the two ways to copy a pool's pages -------------------------------------------------


class PoolPages:
    """One host pool's pages as the daemon stores them: ``page_bytes`` each,
    one per ``page_size`` host slots. ``places`` turns SGLang's host indices
    into this variant's place of each page, which ``write`` and ``read``
    take; both raise ``StaleHandle`` for a handle that went stale."""

    def __init__(self, pool: Any, page_bytes: int) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.page_bytes = page_bytes

    def places(self, host_indices: torch.Tensor | None, pages: int) -> list[int]:
        raise NotImplementedError

    def write(self, c: Client, res: Reservation, places: list[int]) -> None:
        """Copy the pages at ``places``, one per fresh slot of ``res``."""
        raise NotImplementedError

    def read(self, c: Client, hit: Hit, places: list[int]) -> None:
        """Copy the pages of ``hit`` to ``places``, one per page."""
        raise NotImplementedError


class RowPages(PoolPages):
    """Pages as rows of whole-pool tensors (``segments``): one copy each way."""

    def __init__(self, pool: Any, segments: list[torch.Tensor]) -> None:
        super().__init__(pool, sum(seg[0].nbytes for seg in segments))
        self.segments = segments

    def places(self, host_indices: torch.Tensor | None, pages: int) -> list[int]:
        return host_rows(host_indices, pages, self.page_size)

    def write(self, c: Client, res: Reservation, places: list[int]) -> None:
        c.write_pages(res, self.segments, rows=places)

    def read(self, c: Client, hit: Hit, places: list[int]) -> None:
        c.read_pages(hit, self.segments, rows=places)


class FlatPages(PoolPages):
    """Pages through the pool's own flat data pages: a staging copy each way.
    A place is the host index of a page's first slot, as SGLang's file backend
    passes it to ``get_data_page``."""

    def places(self, host_indices: torch.Tensor | None, pages: int) -> list[int]:
        flat = _count(host_indices, pages, self.page_size)
        return flat[:: self.page_size].tolist()

    def write(self, c: Client, res: Reservation, places: list[int]) -> None:
        data = [_bytes(self.pool.get_data_page(place, flat=True)) for place in places]
        c.write_pages(res, torch.stack(data))

    def read(self, c: Client, hit: Hit, places: list[int]) -> None:
        try:
            got = c.read_pages(hit)
        except StaleHandle as exc:  # the pages went to an array lost with the raise
            raise StaleHandle(str(exc), 0) from exc
        for page, place in zip(got, places, strict=True):
            target = self.pool.get_dummy_flat_data_page()
            _bytes(target).copy_(torch.from_numpy(page))
            self.pool.set_from_flat_data_page(place, target)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def pool_pages(pool: Any, is_mla: bool) -> PoolPages:
    """How hicached copies the pages of a sidecar host pool (see the module
    docstring): rows where the pool's regions check out, else flat pages.
    Raises ValueError for a pool that holds no bytes."""
    for segments_of in (lambda p: page_segments(p, is_mla), mamba_segments):
        try:
            return RowPages(pool, segments_of(pool))
        except (ValueError, TypeError, AttributeError, NotImplementedError):
            continue  # not a pool of this shape: the flat pages copy any pool
    page_bytes = _bytes(pool.get_dummy_flat_data_page()).numel()
    if not page_bytes:
        raise ValueError(f"a page of {type(pool).__name__} holds no bytes: nothing to store")
    return FlatPages(pool, page_bytes)


def is_logical(pool: Any) -> bool:
    """A host pool that only hands out indices and holds no KV (DeepSeek V4's
    ``LogicalHostPool`` anchor): its pages live in the sidecar pools."""
    return getattr(pool, "kv_buffer", None) is None and not int(getattr(pool, "size_per_token", 1))


# -- where a pool's page is --------------------------------------------------------------


def page_segments(pool: Any, is_mla: bool) -> list[torch.Tensor]:
    """The regions of one host page of a KV pool (MHA or MLA), each as a
    whole-pool view with one row per host page (row r holds tokens
    ``r * page_size ..``), in the byte order of SGLang's flat data page.
    Raises ValueError for pools hicached cannot copy this way."""
    kv = getattr(pool, "kv_buffer", None)
    layout = getattr(pool, "layout", None)
    if not isinstance(kv, torch.Tensor) or not kv.is_contiguous():
        raise ValueError(
            f"hicached copies MHA and MLA host pools with one KV buffer; "
            f"{type(pool).__name__} has none"
        )
    if getattr(pool, "dcp_size", 1) != 1:
        raise ValueError("hicached does not take decode context parallel host pools")
    pages = int(pool.page_num)
    if layout in ("page_first", "page_first_direct", "page_head"):
        tensors = [kv] if is_mla else [kv[0], kv[1]]
        if is_mla and layout == "page_head":
            raise ValueError("an MLA host pool has no page_head layout")
    elif layout == "layer_first":
        tensors = (
            list(kv) if is_mla else [kv[c, layer] for c in (0, 1) for layer in range(len(kv[0]))]
        )
    else:
        raise ValueError(
            f"hicached copies host pools laid out page_first, page_first_direct, page_head or "
            f"layer_first, not {layout!r}"
        )
    segments = [t.reshape(pages, -1) for t in tensors]
    _check_against_meta(pool, segments)
    return segments


def mamba_segments(pool: Any) -> list[torch.Tensor]:
    """A Mamba host pool's state regions (temporal, then each conv state; one
    state a page), as whole-pool views with one row per state, in the order of
    its flat data page. Raises ValueError where the states are not rows of
    their buffers (``layer_first``) or carry side states SGLang's zero-copy
    addresses leave out."""
    if pool.layout not in ("page_first", "page_first_direct") or pool.slot_state_buffers:
        raise ValueError(f"{type(pool).__name__}: states are not rows of page_first buffers")
    tensors = [pool.temporal_buffer] if pool.temporal_state_elem_size > 0 else []
    tensors += list(pool.conv_buffer)
    segments = [t.reshape(t.shape[0], -1) for t in tensors]
    _check_against_meta(pool, segments)
    return segments


def _check_against_meta(pool: Any, segments: list[torch.Tensor]) -> None:
    """The segments' rows must be exactly the regions SGLang's zero-copy backends
    move for a page (``get_page_buffer_meta``) and hold its flat data page."""
    page = int(pool.page_size)
    for row in (0, 1):
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(row * page, (row + 1) * page))
        ours = sorted(
            (seg.data_ptr() + row * seg.stride(0) * seg.element_size(), seg[0].nbytes)
            for seg in segments
        )
        if ours != sorted(zip(ptrs, sizes, strict=True)):
            raise ValueError(
                f"the {pool.layout} page regions of {type(pool).__name__} are not where "
                "get_page_buffer_meta puts them: this SGLang lays pages out differently"
            )
    flat = pool.get_data_page(0, flat=True)
    if flat.numel() * flat.element_size() != sum(seg[0].nbytes for seg in segments):
        raise ValueError(f"a flat data page of {type(pool).__name__} is not one host page")


# -- namespaces ---------------------------------------------------------------------------

# What SGLang adds to the model path it gives storage backends, for a host pool
# with a page format of its own (cache_controller.storage_model_name: "{path}-{tag}")
FORMAT_TAGS = ("-unified-token-major",)


def base_fields(config: HiCacheStorageConfig, settings: Settings) -> dict[str, Any]:
    """What every namespace of this rank shares: the model, the tenant, the
    key scheme and the ranks."""
    name = config.model_name or ""
    if not (settings.model or name):
        raise ValueError('SGLang gave no model name: set "model" in the extra config')
    return dict(
        model=settings.model or safe_model(name),
        revision=settings.revision or default_revision(name, FORMAT_TAGS),
        tenant=settings.tenant,
        key_scheme=KEY_SCHEME,
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        cp_rank=config.attn_cp_rank,
        cp_size=config.attn_cp_size,
        pp_stage=config.pp_rank,
        pp_size=config.pp_size,
    )


def namespace_fields(
    config: HiCacheStorageConfig, pool: Any, page_bytes: int, settings: Settings
) -> dict[str, Any]:
    """The namespace of this rank's KV pages (``Client.register`` fields)."""
    return dict(
        base_fields(config, settings),
        kv_dtype=_dtype(pool.dtype),
        layout=pool.layout,
        page_tokens=int(pool.page_size),
        page_bytes=page_bytes,
        replicated=config.is_mla_model,
    )


def pool_fields(
    base: dict[str, Any], name: str, pool: Any, page_tokens: int, page_bytes: int, shared: bool
) -> dict[str, Any]:
    """The namespace of a sidecar pool's pages: the pool's name before its
    layout, its dtypes (a Mamba pool's conv and temporal), the tokens a key
    covers (the KV page's) and its own page bytes."""
    dtypes = dict.fromkeys(
        _dtype(d) for d in (pool.dtype, getattr(pool, "temporal_dtype", pool.dtype))
    )
    return dict(
        base,
        kv_dtype="_".join(dtypes),
        layout=f"{name}_{pool.layout}",
        page_tokens=page_tokens,
        page_bytes=page_bytes,
        replicated=shared,
    )


def replicated(config: HiCacheStorageConfig, name: str, pool: Any) -> bool:
    """Whether a pool's pages are the same on every TP rank (one namespace,
    written by SGLang's storage writer alone). With MLA KV every pool is,
    but Mamba state, which TP shards whatever the KV, and an MHA draft model's
    KV (SGLang's Mooncake backend keys both per rank as well)."""
    if not config.is_mla_model or name == PoolName.MAMBA:
        return False
    return not (
        name in (PoolName.DRAFT, PoolName.DRAFT_SWA) and isinstance(pool, MHATokenToKVPoolHost)
    )


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
