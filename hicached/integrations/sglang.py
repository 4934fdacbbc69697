"""hicached as SGLang's HiCache storage backend (the L3 tier of its host cache).

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicached",
        "module_path": "hicached.integrations.sglang", "class_name": "HicachedStorage",
        "interface_v1": 1, "endpoint": "ipc:///run/hicached/hicached.sock"}'

``interface_v1`` makes SGLang call the zero-copy methods: pages go straight
between SGLang's host KV pool and the daemon's slots, one copy each way.
Without it SGLang hands over flat page copies (``batch_get``/``batch_set``);
both store the same bytes.

SGLang names a page by a 64-hex SHA-256 chained over its token ids (and the
request's extra key and cache salt), with no rank, model or layout in it, so
the namespace carries those: scheme ``sglang-sha256``, the model, the host
pool's dtype and layout, the page geometry, and the TP, CP and PP ranks.
MLA KV is the same on every TP rank: one replicated namespace, which only
SGLang's storage writer (TP rank 0) writes.

A page of the host pool is several regions of it (K and V for page-major
layouts, K and V of every layer for ``layer_first``); their order is the one
``get_data_page(flat=True)`` gives, and ``register_mem_pool_host`` checks
them against the pool's own ``get_page_buffer_meta``.

SGLang calls a backend from three threads (existence queries, prefetch
reads, write-backs); each gets a client of its own. A daemon that is down
costs hits, never a request or a thread: queries answer 0, reads and writes
answer False per page, and the daemon is tried again after ``retry_s``.
Input that breaks SGLang's contract (host indices that do not cover the keys'
pages) raises ``ValueError``, which SGLang logs; a key that is not a page hash
is a miss, and so is every key after it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from hicached.client import Client
from hicached.client.handles import Hit, Namespace, Reservation
from hicached.errors import DaemonUnavailable, DeadlineExceeded, HicachedError, StaleHandle
from hicached.integrations.common import default_revision, safe_model, settings_from

__all__ = ["HicachedStorage", "Settings", "namespace_fields", "page_segments"]

log = logging.getLogger(__name__)

KEY_SCHEME = "sglang-sha256"
_PAGE_HASH = re.compile(r"[0-9a-f]{64}")
# Errors that mean "the daemon is not there now": try again after retry_s.
# "The daemon is not there now": try again after retry_s. OSError and ZMQError come
# from connecting again after a restart (a pool file not readable yet, a socket).
UNREACHABLE = (DaemonUnavailable, DeadlineExceeded, OSError, zmq.ZMQError)


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``--hicache-storage-backend-extra-config`` may set for hicached
    (beside SGLang's own keys, which are ignored here)."""

    # The daemon's socket; "" = $HICACHED_ENDPOINT, else the default one.
    endpoint: str = ""
    # Namespace model name; "" = SGLang's model name (a hub id, or a path made safe).
    model: str = ""
    # Namespace revision; "" = "main", or a digest of the path of a local model directory.
    revision: str = ""
    tenant: str = "default"
    # Seconds one request to the daemon may take.
    timeout_s: float = 5.0
    # Seconds after the daemon was found unreachable before a thread tries it again.
    retry_s: float = 2.0
    # Seconds a read waits for pages coming back from L3; those loaded by then are served.
    prefetch_timeout_s: float = 10.0


# -- the namespace ----------------------------------------------------------------------


def page_segments(pool: Any, is_mla: bool) -> list[torch.Tensor]:
    """The regions of one host page, each as a whole-pool view with one row per
    host page (row r holds tokens ``r * page_size ..``), in the byte order of
    SGLang's flat data page. Raises ValueError for pools hicached cannot copy."""
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


def namespace_fields(
    config: HiCacheStorageConfig, pool: Any, page_bytes: int, settings: Settings
) -> dict[str, Any]:
    """The namespace of this rank's pages (``Client.register`` fields)."""
    name = config.model_name or ""
    if not (settings.model or name):
        raise ValueError('SGLang gave no model name: set "model" in the extra config')
    return dict(
        model=settings.model or safe_model(name),
        revision=settings.revision or default_revision(name),
        tenant=settings.tenant,
        kv_dtype=str(pool.dtype).removeprefix("torch."),
        layout=pool.layout,
        page_tokens=int(pool.page_size),
        page_bytes=page_bytes,
        key_scheme=KEY_SCHEME,
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        cp_rank=config.attn_cp_rank,
        cp_size=config.attn_cp_size,
        pp_stage=config.pp_rank,
        pp_size=config.pp_size,
        replicated=config.is_mla_model,
    )


def page_keys(keys: Sequence[Any]) -> list[bytes]:
    """SGLang's page hashes as the daemon's keys: the leading ones that are
    64 lower-case hex digits (what ``get_hash_str`` makes), 32 bytes each."""
    out = []
    for key in keys:
        if not isinstance(key, str) or not _PAGE_HASH.fullmatch(key):
            break
        out.append(bytes.fromhex(key))
    return out


def host_rows(host_indices: torch.Tensor, pages: int, page_size: int) -> list[int]:
    """The host pool rows of ``pages`` pages whose token slots SGLang gives,
    ``page_size`` per page, each page's in order from a page boundary."""
    flat = host_indices.reshape(-1).to("cpu", torch.int64)
    if flat.numel() != pages * page_size:
        raise ValueError(
            f"{pages} keys need {pages * page_size} host indices ({page_size} a page), "
            f"got {flat.numel()}"
        )
    if not pages:
        return []
    slots = flat.view(pages, page_size)
    starts = slots[:, 0]
    if bool((starts % page_size).any()) or not torch.equal(
        slots - starts[:, None], torch.arange(page_size).expand(pages, page_size)
    ):
        raise ValueError("host indices must cover whole host pages, each from its first slot")
    return (starts // page_size).tolist()


# -- the backend --------------------------------------------------------------------------


@dataclass(slots=True)
class _Session:
    """One thread's client and its view of the namespace."""

    client: Client | None = None
    ns: Namespace | None = None
    down_until: float = 0.0  # monotonic: calls are misses until then


Copy = Callable[[Client, Any, int], None]  # (client, handle, index of its first page)


class HicachedStorage(HiCacheStorage):
    """SGLang's HiCache storage on a hicached daemon (see the module docstring)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if storage_config.dcp_size != 1:
            raise ValueError("hicached does not take decode context parallel KV (dcp_size > 1)")
        self.config = storage_config
        self.settings = settings_from(Settings, storage_config.extra_config)
        self.writer = bool(storage_config.is_storage_writer)
        self.fields: dict[str, Any] | None = None
        self.segments: list[torch.Tensor] = []
        self.page_size = 0
        self._local = threading.local()
        self._clients: list[Client] = []
        self._lock = threading.Lock()  # guards _clients

    # -- SGLang's setup ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page geometry, then register the namespace once to fail at
        startup on a page the daemon refuses (a daemon that is down is not an error)."""
        super().register_mem_pool_host(mem_pool_host)
        self.segments = page_segments(mem_pool_host, self.config.is_mla_model)
        self.page_size = int(mem_pool_host.page_size)
        page_bytes = sum(seg[0].nbytes for seg in self.segments)
        self.fields = namespace_fields(self.config, mem_pool_host, page_bytes, self.settings)
        try:
            with Client(self.settings.endpoint or None, timeout=self.settings.timeout_s) as c:
                c.register(**self.fields)
        except UNREACHABLE as exc:
            log.warning("hicached: no daemon yet (%s); pages are misses until there is one", exc)

    def close(self) -> None:
        """Close every thread's client (the daemon ends their leases)."""
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception as exc:  # shutting down: nothing left to tell
                log.debug("hicached: closing a client: %s", exc)

    # -- the zero-copy interface -------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages L2 or L3 holds."""
        wanted = page_keys(keys)
        if not wanted:
            return 0
        found = self._call(lambda c, ns: c.exists_keys(ns, wanted))
        return 0 if found is None else int(found.leading)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy the leading pages found into the host pool; True for each."""
        rows = host_rows(host_indices, len(keys), self.page_size)

        def copy(c: Client, hit: Hit, first: int) -> None:
            c.read_pages(hit, self.segments, rows=rows[first : first + len(hit.offsets)])

        read = self._load(page_keys(keys), copy)
        return [i < read for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages not stored yet; True for each page stored or present."""
        rows = host_rows(host_indices, len(keys), self.page_size)

        def copy(c: Client, res: Reservation, first: int) -> None:
            c.write_pages(res, self.segments, rows=[rows[first + i] for i in res.indices])

        return self._store(keys, copy, extra_info)

    # -- the flat-page interface (without interface_v1) ---------------------------------------

    def batch_get(
        self,
        keys: list[str],
        target_locations: list[torch.Tensor] | None = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Fill SGLang's flat page tensors; None from the first page not found."""
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys need as many target pages, got {len(targets)}")

        def copy(c: Client, hit: Hit, first: int) -> None:
            pages = c.read_pages(hit)
            for i, page in enumerate(pages):
                target = targets[first + i]
                target.view(-1).view(torch.uint8).copy_(torch.from_numpy(page))

        read = self._load(page_keys(keys), copy)
        return [t if i < read else None for i, t in enumerate(targets)]

    def batch_set(
        self,
        keys: list[str],
        values: list[torch.Tensor] | None = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store SGLang's flat page tensors; True when every page is stored."""
        pages = list(values or [])
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys need as many pages, got {len(pages)}")

        def copy(c: Client, res: Reservation, first: int) -> None:
            data = [pages[first + i].contiguous().view(-1).view(torch.uint8) for i in res.indices]
            c.write_pages(res, torch.stack(data))

        return all(self._store(keys, copy, None))

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the two directions -------------------------------------------------------------------

    def _load(self, keys: list[bytes], copy: Copy) -> int:
        """Copy out the leading pages of ``keys`` that L2 holds, then those that
        come back from L3 in time; how many were copied."""
        done = 0

        def run(c: Client, ns: Namespace) -> None:
            nonlocal done
            done, more = self._read(c, ns, keys, copy, 0)
            if more and self._prefetch(c, ns, keys[done:]):
                done += self._read(c, ns, keys[done:], copy, done)[0]

        if keys:
            self._call(run)
        return done

    def _read(
        self, c: Client, ns: Namespace, keys: list[bytes], copy: Copy, first: int
    ) -> tuple[int, bool]:
        """Copy the leading pages of ``keys`` that L2 holds: how many, and whether
        L3 holds the next ones."""
        hit = c.match_keys(ns, keys)
        try:
            if hit.hits:
                copy(c, hit, first)
        except StaleHandle as exc:
            log.info(
                "hicached: pages changed while they were read: %d of %d read", exc.valid, hit.hits
            )
            return exc.valid, False
        finally:
            c.release(hit)
        return hit.hits, hit.hits < len(keys) and hit.l3_hits > 0

    def _prefetch(self, c: Client, ns: Namespace, keys: list[bytes]) -> bool:
        """Bring the leading ``keys`` L3 holds into L2, waiting at most
        ``prefetch_timeout_s``; whether any came."""
        fetch = c.prefetch_keys(ns, keys)
        if not fetch.lease:
            return False
        deadline = time.monotonic() + self.settings.prefetch_timeout_s
        pause = 0.0005
        try:
            while not (progress := c.progress(fetch)).done and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
            if not progress.completed:
                c.release(fetch)
                return False
            c.commit(fetch, pages=progress.completed)
        except BaseException:  # the prefetch's lease ends now, not at its TTL
            with contextlib.suppress(HicachedError, *UNREACHABLE):
                c.release(fetch)
            raise
        return True

    def _store(
        self, keys: list[str], copy: Copy, extra_info: HiCacheStorageExtraInfo | None
    ) -> list[bool]:
        """Store the pages of ``keys`` that neither L2 nor L3 holds; per key, whether
        it is stored now. A rank that is not SGLang's storage writer stores
        nothing: the writer stores the same bytes in the same namespace."""
        if not self.writer:
            return [True] * len(keys)
        wanted = page_keys(keys)
        stored = [False] * len(keys)
        seen: set[bytes] = set()
        for i, key in enumerate(wanted):  # a page hash twice: store up to the repeat
            if key in seen:
                wanted = wanted[:i]
                break
            seen.add(key)
        if not wanted:
            return stored
        prefix = page_keys((extra_info.prefix_keys or [])[-1:]) if extra_info else []

        def run(c: Client, ns: Namespace) -> None:
            found = c.exists_keys(ns, wanted)
            have = [a or b for a, b in zip(found.in_l2, found.in_l3, strict=True)]
            first = have.index(False) if False in have else len(wanted)
            stored[:first] = [True] * first
            if first == len(wanted):
                return
            parent = wanted[first - 1] if first else (prefix[0] if prefix else None)
            res = c.reserve_keys(ns, wanted[first:], parent=parent)
            for i, present in enumerate(res.present_mask):
                stored[first + i] = present
            try:
                if res.offsets:
                    copy(c, res, first)
            except BaseException:
                c.release(res)
                raise
            c.commit(res)
            for i in res.indices:
                stored[first + i] = True

        self._call(run)
        return stored

    # -- sessions -------------------------------------------------------------------------

    def _call(self, fn: Callable[[Client, Namespace], Any]) -> Any:
        """``fn`` with this thread's client and namespace; None when the daemon is
        down (then it is not asked again for ``retry_s``) or refuses the request."""
        session: _Session = getattr(self._local, "session", None) or self._new_session()
        if time.monotonic() < session.down_until:
            return None
        try:
            if session.client is None or session.ns is None:
                self._connect(session)
            assert session.client is not None and session.ns is not None
            return fn(session.client, session.ns)
        except UNREACHABLE as exc:
            session.down_until = time.monotonic() + self.settings.retry_s
            log.warning(
                "hicached: daemon unreachable (%s); misses for %gs", exc, self.settings.retry_s
            )
        except HicachedError as exc:
            log.warning("hicached: %s: %s", type(exc).__name__, exc)
        return None

    def _new_session(self) -> _Session:
        session = _Session()
        self._local.session = session
        return session

    def _connect(self, session: _Session) -> None:
        if self.fields is None:
            raise HicachedError("no host pool registered yet")
        name = f"sglang-tp{self.config.tp_rank}-{threading.current_thread().name}"
        client = Client(self.settings.endpoint or None, timeout=self.settings.timeout_s, name=name)
        try:
            client.connect()
            session.ns = client.register(**self.fields)
        except BaseException:
            client.close()
            raise
        session.client = client
        with self._lock:
            self._clients.append(client)
