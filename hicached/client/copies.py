"""Page copies of a client: between the caller's arrays or tensors and the
slots of its handles, through this process's mapping of the pool
(client/mapping.py), or the mapping a daemon instance before a restart left
(client/poolview.py). ``_Core`` (client/core.py) is one."""

from __future__ import annotations

from typing import Any

import numpy as np

from hicached.client.handles import Hit, Reservation, check_kind
from hicached.client.mapping import At, PendingCopy, PoolMapping, check_empty
from hicached.client.poolview import PoolView
from hicached.errors import BadRequest, DaemonUnavailable, ForeignTenant

__all__ = ["PageCopies"]


class PageCopies:
    """The copy calls of both clients; the exchange logic sets the state."""

    map_pool: bool
    _pool: PoolView
    _instance: int
    _closing: bool

    @property
    def mapping(self) -> PoolMapping:
        if not self.map_pool:
            raise BadRequest("this client does not map the pool (map_pool=False)")
        if self._pool.current is None:
            if self._closing:
                raise BadRequest("this client is closed: make a new one")
            if self._pool.unmapped:
                raise ForeignTenant(self._pool.unmapped)
            raise DaemonUnavailable("not connected: call connect() first")
        return self._pool.current

    def pin_memory(self) -> None:
        """Register this client's mapping of the pool with CUDA as pinned memory,
        now and after every reconnect, so that copies between GPU tensors and
        slots need no staging buffer (hicached/client/cuda.py, docs/perf.md)."""
        self._pool.pin()

    def unpin_memory(self) -> None:
        """Undo ``pin_memory()``: copies go through pageable memory again."""
        self._pool.unpin()

    def write_pages(self, res: Reservation, data: Any, *, rows: Any = None, at: At = None) -> None:
        """Copy ``data`` (one page of page_bytes per slot of ``res``) into its slots.

        ``data`` is a numpy array or CPU tensor (one copy call), or a CUDA
        tensor (DMA per run of adjacent slots, or one copy kernel; finished
        on return). An empty reservation is a no-op. Raises ``StaleHandle``
        when the reservation is closed, from a restarted daemon or past its
        deadline: reserve again.

        Segmented copies, of part of each page: ``data`` may be a list of
        arrays or tensors whose rows, concatenated in order, make each page;
        with ``rows`` they are whole engine tensors and page j takes row
        ``rows[j]`` of each (one gather). ``at``: the byte in each slot where
        the data starts (worker r of a wide page: ``r * page_bytes //
        shards``, 0 included), or a list of one byte per segment where the
        segments lie apart in each slot (vLLM's canonical pages). Without a
        list, ``rows`` or ``at``, ``data`` is whole pages, and one of another
        size raises ``ValueError`` (for an empty reservation, one that holds
        any bytes).
        """
        check_kind(res, Reservation, "write_pages", "a Reservation (from reserve)")
        if not res.offsets:
            check_empty(data, rows, at, "the data")
            return
        self.mapping.write(res, data, rows, at)

    def read_pages(self, hit: Hit, out: Any = None, *, rows: Any = None, at: At = None) -> Any:
        """Copy the pages of ``hit`` into ``out`` (n, page_bytes), or a new array.

        ``out`` may be a CUDA tensor (DMA per run of adjacent slots, or one
        copy kernel; finished on return). Raises ``StaleHandle`` (a miss)
        when the hit is closed, from a restarted daemon, past its deadline, or
        a page left its slot while it was copied; its ``valid`` leading pages
        were intact. Use ``hit.select(range(n))`` to copy only some pages.

        Segmented copies, as ``write_pages``: ``out`` a list of arrays or
        tensors to scatter each page into (rows ``rows`` of each, when given),
        from byte ``at`` of each slot. After a ``StaleHandle`` their rows for
        this hit hold nothing to use. Without a list, ``rows`` or ``at``,
        ``out`` holds whole pages, and one of another size raises ``ValueError``.
        """
        check_kind(hit, Hit, "read_pages", "a Hit (from a leased match)")
        if hit.instance != self._instance:
            old = self._pool.retired(hit.instance)
            if old is not None:
                return old.read(hit, out, rows, at)
        return self.mapping.read(hit, out, rows, at)

    def start_write(
        self, res: Reservation, data: Any, *, rows: Any = None, at: At = None
    ) -> PendingCopy:
        """``write_pages``, started: a copy from CUDA tensors is queued on the
        current stream and this returns at once (from host memory the copy is
        done on return). The ``PendingCopy`` says when the bytes have moved
        (``done()``) and checks the fence after them (``finish()``, or
        ``result()`` to wait first): commit only after it finished without
        ``StaleHandle``. The source must stay as it is until then."""
        check_kind(res, Reservation, "write_pages", "a Reservation (from reserve)")
        return self.mapping.start_write(res, data, rows, at)

    def start_read(
        self, hit: Hit, out: Any = None, *, rows: Any = None, at: At = None
    ) -> PendingCopy:
        """``read_pages``, started (``start_write``): ``out`` holds the pages only
        once the ``PendingCopy`` finished without ``StaleHandle`` (a miss)."""
        check_kind(hit, Hit, "read_pages", "a Hit (from a leased match)")
        if hit.instance != self._instance:
            old = self._pool.retired(hit.instance)
            if old is not None:
                return old.start_read(hit, out, rows, at)
        return self.mapping.start_read(hit, out, rows, at)

    def _store_data(self, res: Reservation, pages: np.ndarray) -> None:
        if not res.offsets:
            return
        src = np.asarray(pages)
        self.write_pages(res, src[res.present : res.present + len(res.offsets)])
