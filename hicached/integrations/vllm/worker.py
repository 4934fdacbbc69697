"""The worker side of hicached's vLLM tier: copies between vLLM's KV tensors and
pool slots, by the handles the scheduler hands over.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from hicached.client import Client
from hicached.client.handles import Hit, PortableHandle, Reservation
from hicached.errors import HicachedError, StaleHandle
from hicached.integrations.vllm.groups import KVGroup, Layout
from hicached.integrations.vllm.settings import UNREACHABLE, Settings
from hicached.integrations.vllm.specs import Ack, Handles, HicachedLoadSpec, HicachedStoreSpec

log = logging.getLogger(__name__)

# -- the worker side --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Job:
    job_id: int
    store: bool
    gpu: GPULoadStoreSpec
    handles: Handles  # per KV cache group
    acks: str


class HicachedWorker(OffloadingWorker):
    """Worker side: copies between this worker's KV tensors and pool slots, each
    page at this worker's part of the wide page, each KV cache group's pages
    through its own handle (groups.Layout), on a thread of its own or at once
    (``Settings.copy_thread``).

    Jobs queue for the thread without a bound of their own: vLLM holds the
    blocks of every job it submits, so its KV cache bounds them.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        settings: Settings,
        config: OffloadingConfig,
        groups: list[KVGroup],
    ) -> None:
        self.settings = settings
        self.rank = config.parallel.rank
        self._layout = Layout(kv_caches, groups, self.rank, config.cache.blocks_per_chunk)
        self._on_gpu = bool(kv_caches.tensors) and bool(kv_caches.tensors[0].tensor.is_cuda)
        self._client: Client | None = None  # the copying thread's alone
        self._pushers: dict[str, zmq.Socket[Any]] = {}
        self._zmq = zmq.Context()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._finished: list[TransferResult] = []
        self._running: set[int] = set()  # submitted, not finished
        self._abandoned: set[int] = set()  # wait() gave up on them: their stores do not count
        self._thread: threading.Thread | None = None
        threaded = settings.copy_thread
        if threaded or (threaded is None and self._on_gpu):
            self._thread = threading.Thread(target=self._run, name=f"hicached-copy-{self.rank}")
            self._thread.daemon = True
            self._thread.start()

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, HicachedStoreSpec)
        self._submit(_Job(job_id, True, src_spec, dst_spec.handles, dst_spec.acks))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, HicachedLoadSpec)
        self._submit(_Job(job_id, False, dst_spec, src_spec.handles, ""))
        return True

    def _submit(self, job: _Job) -> None:
        with self._lock:
            self._running.add(job.job_id)
        if self._thread is None:
            self._execute(job)
        else:
            self._jobs.put(job)

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Until these jobs are done. Past the deadline a store still copying stops
        counting (its pages are not published): vLLM reuses its blocks now."""
        deadline = time.monotonic() + 4 * self.settings.timeout_s
        with self._lock:
            if self._lock.wait_for(
                lambda: not job_ids & self._running, max(0.0, deadline - time.monotonic())
            ):
                return
            late = job_ids & self._running
            self._abandoned |= late
        log.error("hicached: transfers %s outlived their wait; their stores do not count", late)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(4 * self.settings.timeout_s)
        if self._client is not None:
            self._client.close()
        for sock in self._pushers.values():
            sock.close(linger=0)
        self._zmq.term()

    # -- copies -------------------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._execute(job)

    def _execute(self, job: _Job) -> None:
        started = time.perf_counter()
        ok = self._copy(job)
        result = TransferResult(
            job.job_id,
            ok or job.store,  # vLLM takes no failed store: the scheduler heard it from us
            transfer_size=self._layout.size(job.gpu) if ok else 0,
            transfer_time=time.perf_counter() - started,
        )
        with self._lock:
            self._running.discard(job.job_id)
            self._abandoned.discard(job.job_id)
            self._finished.append(result)
            self._lock.notify_all()

    def _copy(self, job: _Job) -> bool:
        """One transfer; a store says which slots it wrote before it counts as done."""
        if not any(job.handles):
            return True
        copied = False
        try:
            handles = [None if h is None else self._adopt(h) for h in job.handles]
            client = self._session()
            pages = [0 if h is None else len(h.offsets) for h in handles]
            for g, some, rows, at in self._layout.plan(job.gpu, pages):
                handle = handles[g]
                assert handle is not None, "blocks of a group without a handle"
                view = handle.select(some) if len(some) != len(handle.offsets) else handle
                segments = self._layout.segments[g]
                if isinstance(view, Reservation):
                    client.write_pages(view, segments, rows=rows, at=at)
                else:
                    client.read_pages(view, out=segments, rows=rows, at=at)
            copied = True
        except (HicachedError, *UNREACHABLE) as exc:
            log.warning("hicached: transfer %d failed: %s", job.job_id, exc)
        except Exception:  # a bug must not stop the copy thread: later jobs would hang
            log.exception("hicached: transfer %d failed", job.job_id)
        if job.store:
            with self._lock:
                copied = copied and job.job_id not in self._abandoned
            for wire in job.handles:
                if wire is not None:
                    self._say(wire, job.acks, copied)
        return copied

    def _session(self) -> Client:
        if self._client is None:
            self._client = Client(
                self.settings.endpoint or None,
                timeout=self.settings.timeout_s,
                name=f"vllm-worker-{self.rank}-{os.getpid()}",
                connect_timeout=min(0.2, self.settings.timeout_s),
            )
            if self._on_gpu:
                self._client.pin_memory()  # copies straight between GPU and the pool
        return self._client.connect()

    def _adopt(self, wire: PortableHandle) -> Reservation | Hit:
        """The scheduler's handle for copies here; a daemon that restarted since this
        client last spoke to it is greeted first."""
        client = self._session()
        try:
            return client.adopt(wire)
        except StaleHandle:
            client.stats()  # hello again, to the new daemon if there is one
            return client.adopt(wire)

    def _say(self, handle: PortableHandle, acks: str, written: bool) -> None:
        """Tell the scheduler whether this worker wrote the slots of ``handle``."""
        sock = self._pushers.get(acks)
        if sock is None:
            sock = self._pushers[acks] = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(acks)
        flags = bytes([written]) * len(handle.offsets)
        ack = Ack(handle.instance, handle.lease, self.rank, flags)
        try:
            sock.send(msgspec.msgpack.encode(ack), zmq.NOBLOCK)
        except zmq.Again:  # the scheduler is not reading: it will publish nothing
            log.warning("hicached: the scheduler did not take a store's word")
