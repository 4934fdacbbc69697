"""``HicachedStorage``: SGLang's HiCache storage backend on a hicached daemon
(see the package docstring for what it stores where)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from hicached.client import Client
from hicached.client.handles import Hit, Reservation
from hicached.errors import StaleHandle
from hicached.integrations.common import Seconds, Timeout, settings_from
from hicached.integrations.sglang import moves
from hicached.integrations.sglang.hits import check_policy, fold
from hicached.integrations.sglang.link import Link, Session
from hicached.integrations.sglang.moves import Move
from hicached.integrations.sglang.pages import (
    KV,
    PoolPages,
    RowPages,
    base_fields,
    check_flat_pages,
    is_logical,
    namespace_fields,
    once,
    page_keys,
    page_segments,
    pool_fields,
    pool_pages,
    replicated,
)

log = logging.getLogger("hicached.integrations.sglang")


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
    timeout_s: Timeout = 5.0
    # Seconds after the daemon was found unreachable before a thread tries it again.
    retry_s: Seconds = 2.0
    # Seconds a read waits for pages coming back from L3; those loaded by then are served.
    prefetch_timeout_s: Seconds = 10.0


@dataclass(slots=True)
class _Pool:
    """A registered host pool: how its pages are copied, and whether this rank
    stores them (False: SGLang's storage writer stores the same bytes)."""

    pages: PoolPages
    writes: bool


def _no_hit() -> PoolTransferResult:
    return PoolTransferResult(0, {}, [])  # a new one each time: SGLang keeps its parts


class HicachedStorage(HiCacheStorage):
    """SGLang's HiCache storage on a hicached daemon (see the package docstring)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if storage_config.dcp_size != 1:
            raise ValueError("hicached does not take decode context parallel KV (dcp_size > 1)")
        self.config = storage_config
        self.settings = settings_from(Settings, storage_config.extra_config)
        self.writer = bool(storage_config.is_storage_writer)
        self.link = Link(
            self.settings.endpoint,
            self.settings.timeout_s,
            self.settings.retry_s,
            f"sglang-tp{storage_config.tp_rank}",
        )
        self.fields: dict[str, Any] | None = None  # the KV namespace
        self.page_size = 0
        self.logical = False  # the KV pool is a logical anchor: its bytes are in sidecars
        self.pools: dict[str, _Pool] = {}
        self._base: dict[str, Any] | None = None
        self._burst_over = False

    # -- SGLang's setup ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the KV page geometry, then register the namespace once to fail at
        startup on a page the daemon refuses (a daemon that is down is not an error)."""
        super().register_mem_pool_host(mem_pool_host)
        self.page_size = int(mem_pool_host.page_size)
        self._base = base_fields(self.config, self.settings)
        if is_logical(mem_pool_host):
            self.logical = True
            return
        pages = RowPages(mem_pool_host, page_segments(mem_pool_host, self.config.is_mla_model))
        self.fields = namespace_fields(self.config, mem_pool_host, pages.page_bytes, self.settings)
        self.pools[KV] = _Pool(pages, self.writer)
        self.link.fields[KV] = self.fields
        self.link.check([KV])

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's sidecar pool (Mamba state, sliding window, ...): its
        own namespace. Pools of the registration burst are checked with the
        daemon when it ends; a pool registered later, at once."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == KV:
            return  # the anchor: register_mem_pool_host took it
        if self._base is None:
            raise ValueError("register_mem_pool_host must come before the sidecar pools")
        pages = pool_pages(host_pool, self.config.is_mla_model)
        shared = replicated(self.config, name, host_pool)
        self.link.fields[name] = pool_fields(
            self._base, name, host_pool, self.page_size, pages.page_bytes, shared
        )
        self.pools[name] = _Pool(pages, self.writer or not shared)
        if self._burst_over:
            self.link.check([name])

    def on_host_pools_registered(self) -> None:
        """Register every sidecar pool's namespace once: a page the daemon
        refuses (``pool.max_page_bytes``) fails the attach, as SGLang asks."""
        self._burst_over = True
        self.link.check([name for name in self.pools if name != KV])

    def close(self) -> None:
        """Close every thread's client (the daemon ends their leases)."""
        self.link.close()

    # -- the zero-copy interface (v1: the KV pool) ---------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages L2 or L3 holds (a logical anchor: none, as it
        restores nothing alone)."""
        wanted = page_keys(keys)
        if not wanted or self.logical:
            return 0
        found = self.link.call(lambda c, s: moves.found(c, s.ns(KV), wanted, whole=False))
        return 0 if found is None else int(found.leading)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy the leading pages found into the host pool; True for each."""
        if self.logical:
            return [True] * len(keys)  # no KV bytes: the sidecars' reads decide
        pool = self._pool(KV)
        move = self._reader(KV, pool.pages, page_keys(keys), host_indices, len(keys))
        return self._load([move], [len(keys)])[0]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages not stored yet; True for each page stored or present."""
        if self.logical:
            return [True] * len(keys)  # no KV bytes: the sidecars hold the pages
        pool = self._pool(KV)
        places = pool.pages.places(host_indices, len(keys))
        if not pool.writes:
            return [True] * len(keys)
        move = self._writer(KV, pool.pages, keys, places, extra_info)
        return self._store([move], [len(keys)])[0]

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
        if self.logical:
            return list(targets)
        check_flat_pages(targets, self._pool(KV).pages.page_bytes, "target", contiguous=True)

        def copy(c: Client, hit: Hit, first: int) -> None:
            try:
                got = c.read_pages(hit)
            except StaleHandle as exc:  # the pages went to an array lost with the raise
                raise StaleHandle(str(exc), 0) from exc
            for i, page in enumerate(got):
                target = targets[first + i]
                target.view(-1).view(torch.uint8).copy_(torch.from_numpy(page))

        read = self._load([Move(KV, page_keys(keys), copy)], [len(keys)])[0]
        return [t if ok else None for t, ok in zip(targets, read, strict=True)]

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
        if self.logical:
            return True
        check_flat_pages(pages, self._pool(KV).pages.page_bytes, "page")
        if not self.writer:
            return True

        sent = once(page_keys(keys))

        def copy(c: Client, res: Reservation, first: int) -> None:
            data = [
                pages[sent.first[first + i]].contiguous().view(-1).view(torch.uint8)
                for i in res.indices
            ]
            c.write_pages(res, torch.stack(data))

        move = Move(KV, sent.keys, copy, at=sent.at)
        return all(self._store([move], [len(keys)])[0])

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

    # -- hybrid pools (v2: the KV pool and its sidecars) ---------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The restorable prefixes of ``keys`` (KV page hashes): the leading KV
        pages L2 or L3 holds, cut to what every pool of ``pool_transfers`` can
        restore by its hit policy (``hits.fold``); a transfer's own keys only
        count, for a trailing window. Nothing when the daemon is down."""
        transfers = list(pool_transfers or [])
        for transfer in transfers:
            check_policy(transfer)
            self._pool(transfer.name)
        wanted = page_keys(keys)
        if not wanted or (self.logical and not transfers):
            return _no_hit()
        names = list(dict.fromkeys(str(t.name) for t in transfers))

        def run(c: Client, s: Session) -> tuple[int, dict[str, list[bool]]]:
            if self.logical:
                kv = len(wanted)
            else:
                kv = moves.found(c, s.ns(KV), wanted, whole=False).leading
            present = {}
            for name in names if kv else ():
                found = moves.found(c, s.ns(name), wanted[:kv])
                present[name] = [a or b for a, b in zip(found.in_l2, found.in_l3, strict=True)]
            return kv, present

        got = self.link.call(run)
        return _no_hit() if got is None else fold(got[0], transfers, got[1])

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Copy each pool's leading pages found into its host pool; per pool, True
        for each page read, and only where every pool of the call read it."""
        wanted = []
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool = self._pool(transfer.name)
            wanted.append(
                self._reader(
                    transfer.name, pool.pages, page_keys(keys), transfer.host_indices, len(keys)
                )
            )
        done = self._load(wanted, [len(t.keys or []) for t in transfers])
        return {t.name: ok for t, ok in zip(transfers, done, strict=True)}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each pool's pages not stored yet, under the last of
        ``extra_info.prefix_keys``; per pool, True for each page stored in
        every pool of the call (a page one pool cannot store is published in
        none). A pool SGLang's storage writer stores answers True."""
        out: dict[str, list[bool]] = {}
        wanted, counts, names = [], [], []
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool = self._pool(transfer.name)
            if not pool.writes:
                out[transfer.name] = [True] * len(keys)
                continue
            try:
                places = pool.pages.places(transfer.host_indices, len(keys))
            except ValueError as exc:
                log.warning("hicached: %s pages not stored: %s", transfer.name, exc)
                places = None
            wanted.append(self._writer(transfer.name, pool.pages, keys, places, extra_info))
            counts.append(len(keys))
            names.append(transfer.name)
        for name, ok in zip(names, self._store(wanted, counts), strict=True):
            out[name] = ok
        return out

    # -- the two directions -------------------------------------------------------------------

    def _pool(self, name: Any) -> _Pool:
        pool = self.pools.get(str(name))
        if pool is None:
            raise ValueError(
                f"pool {name} was never registered with this backend "
                f"(registered: {', '.join(self.pools) or 'none'})"
            )
        return pool

    def _reader(
        self, name: str, pages: PoolPages, keys: list[bytes], host_indices: Any, count: int
    ) -> Move:
        """A load of ``keys`` into the host pages ``host_indices`` names. Indices
        that do not cover the pages raise ValueError for the KV pool (v1, as
        SGLang's contract says) and make a sidecar's pages misses (v2, as
        SGLang's own backends answer)."""
        try:
            places = pages.places(host_indices, count)
        except ValueError as exc:
            if name == KV:
                raise
            log.warning("hicached: %s pages not read: %s", name, exc)
            return Move(name, keys, None)

        def copy(c: Client, hit: Hit, first: int) -> None:
            pages.read(c, hit, places[first : first + len(hit.offsets)])

        return Move(name, keys, copy)

    def _writer(
        self,
        name: str,
        pages: PoolPages,
        keys: list[str],
        places: list[int] | None,
        extra_info: HiCacheStorageExtraInfo | None,
    ) -> Move:
        """A store of the pages at ``places``, under the key before ``keys``
        (the last of ``extra_info.prefix_keys``) so that L2 evicts the sequence
        from its tail. A key given twice is stored once, from its first page,
        and answers for both (``once``)."""
        before = page_keys((extra_info.prefix_keys or [])[-1:]) if extra_info else []
        sent = once(page_keys(keys))
        if places is None:
            return Move(name, sent.keys, None, at=sent.at)
        rows = [places[i] for i in sent.first]

        def copy(c: Client, res: Reservation, first: int) -> None:
            pages.write(c, res, [rows[first + i] for i in res.indices])

        return Move(name, sent.keys, copy, before[0] if before else None, sent.at)

    def _load(self, wanted: list[Move], counts: list[int]) -> list[list[bool]]:
        if not any(move.keys for move in wanted):
            return [[False] * n for n in counts]
        wait_s = self.settings.prefetch_timeout_s
        ok = self.link.call(lambda c, s: moves.load(c, s, wanted, wait_s))
        return _results(wanted, counts, bool(ok))

    def _store(self, wanted: list[Move], counts: list[int]) -> list[list[bool]]:
        if not any(move.keys for move in wanted):
            return [[False] * n for n in counts]
        ok = self.link.call(lambda c, s: moves.store(c, s, wanted))
        return _results(wanted, counts, bool(ok))


def _results(wanted: list[Move], counts: list[int], ok: bool) -> list[list[bool]]:
    """Per move, one flag per key SGLang gave, its key's (keys past the leading
    page hashes, or left out by ``once``, are False); all False when the call
    failed."""
    out = []
    for m, n in zip(wanted, counts, strict=True):
        at = range(len(m.done)) if m.at is None else m.at
        out.append([ok and i < len(at) and at[i] >= 0 and m.done[at[i]] for i in range(n)])
    return out
