"""The worker side of hicached's vLLM tier: copies between vLLM's KV tensors and
pool slots, by the handles the scheduler hands over, without stalling the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
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

from hicached.client import Client, PendingCopy
from hicached.client.handles import Hit, PortableHandle, Reservation
from hicached.errors import HicachedError, StaleHandle
from hicached.integrations.vllm.copies import Copy, worker_copies
from hicached.integrations.vllm.groups import KVGroup
from hicached.integrations.vllm.settings import UNREACHABLE, Settings
from hicached.integrations.vllm.specs import Ack, Handles, HicachedLoadSpec, HicachedStoreSpec

log = logging.getLogger(__name__)

# How often wait() and shutdown() look at copies on a GPU (their events).
_POLL_S = 0.0005

_NO_SLOTS = np.empty(0, dtype=np.int64)


def _slots(handles: list[Reservation | Hit]) -> np.ndarray:
    """The pool slot of each page of a group's handles, one after another: the
    same on every worker."""
    if not handles:
        return _NO_SLOTS
    offsets = np.concatenate([np.asarray(h.offsets, dtype=np.int64) for h in handles])
    return offsets // handles[0].ns.page_bytes


def _through(
    handles: list[Reservation | Hit], pages: list[int], blocks: np.ndarray
) -> Iterator[tuple[Reservation | Hit, list[int], np.ndarray]]:
    """A copy's pages (their places among a group's handles' pages, one handle's
    after another's) and their blocks, by the handle each page is in: (handle,
    places in it, blocks)."""
    if len(handles) == 1:
        yield handles[0], pages, blocks
        return
    places = np.asarray(pages, dtype=np.int64)
    first = 0
    for handle in handles:
        mine = (places >= first) & (places < first + len(handle.offsets))
        if mine.any():
            yield handle, (places[mine] - first).tolist(), blocks[mine]
        first += len(handle.offsets)


def _start_copy(
    client: Client, handle: Reservation | Hit, some: list[int], rows: np.ndarray, copy: Copy
) -> PendingCopy:
    """Start the copy of pages ``some`` of ``handle`` (to or from ``rows``)."""
    view = handle.select(some) if len(some) != len(handle.offsets) else handle
    if isinstance(view, Reservation):
        return client.start_write(view, copy.segments, rows=rows, at=copy.at)
    return client.start_read(view, out=copy.segments, rows=rows, at=copy.at)


# -- the worker side --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Job:
    job_id: int
    store: bool
    gpu: GPULoadStoreSpec
    handles: Handles  # per KV cache group
    acks: str
    ready: Any = None  # KV on a GPU: an event after the engine's work queued at submit
    expedited: bool = False  # a load vLLM waits for within the step (vLLM 0.33)


@dataclass(frozen=True, slots=True)
class _Transfer:
    """A job whose copies were started (all of them, or some before one failed)."""

    job: _Job
    copies: list[PendingCopy]
    started: bool  # every copy of the job was started

    def done(self) -> bool:
        """Every copy started has moved its bytes (never waits)."""
        return all(copy.done() for copy in self.copies)


class HicachedWorker(OffloadingWorker):
    """Worker side: copies between this worker's KV tensors and pool slots, each
    block's bytes where the engine's offload layout puts this worker's (by
    default its part of the wide page; copies.py), each KV cache group's
    pages through its own handle.

    ``submit_store``/``submit_load`` return at once: the job is started on a
    thread of its own or in the submit call (``Settings.copy_thread``). KV on
    a GPU is copied on a CUDA stream of the worker's own, after the work the
    engine had queued on its stream at submit (an event), and nothing waits
    for it; KV in host memory is copied when the job starts. An *expedited*
    load (vLLM 0.33's synchronous load, which vLLM waits for with ``wait``
    before the step's forward pass) is started ahead of the jobs queued for
    the thread, and on a GPU on a stream of its own, so it never waits behind
    regular transfers; its submission returns at once too. ``get_finished``
    reports the jobs whose copies are done, each once the fence after its
    copies held: a load whose slots changed owner since its copy began is
    reported failed, never loaded, and a store tells the scheduler which slots
    it wrote before it is reported. Only ``wait`` (vLLM asks it to) and
    ``shutdown`` wait, each with a deadline; the engine's thread never
    synchronizes a stream. A load that ``wait`` finds unfinished at its
    deadline raises: vLLM would go on to compute on (or reuse) blocks that
    the copy still writes.

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
        self._copies = worker_copies(kv_caches, groups, self.rank, config.cache.blocks_per_chunk)
        self._on_gpu = bool(kv_caches.tensors) and bool(kv_caches.tensors[0].tensor.is_cuda)
        device = kv_caches.tensors[0].tensor.device if self._on_gpu else None
        # the copies' own stream: beside the engine's, never holding it up
        self._stream = torch.cuda.Stream(device) if self._on_gpu else None
        # expedited loads' own: never behind the regular copies queued on the other
        self._expedited_stream = torch.cuda.Stream(device) if self._on_gpu else None
        self._client: Client | None = None  # the copying thread's alone
        self._pushers: dict[str, zmq.Socket[Any]] = {}  # the engine's thread's alone
        self._zmq = zmq.Context()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._urgent: deque[_Job] = deque()  # expedited loads, started before _jobs
        self._lock = threading.Condition()
        self._started: list[_Transfer] = []  # started, not yet reported
        self._finished: list[TransferResult] = []
        self._running: set[int] = set()  # submitted, not finished
        self._loads: set[int] = set()  # the loads among them
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
        job = _Job(job_id, True, src_spec, dst_spec.handles, dst_spec.acks, self._ready())
        self._submit(job)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """``expedited`` (vLLM 0.33, whose ``sync_load_budget_bytes`` makes some
        loads synchronous: it calls ``wait`` for them before the forward pass):
        started ahead of every job queued for the copy thread, on a CUDA stream
        of its own. Submission returns at once either way, as vLLM asks."""
        assert isinstance(src_spec, HicachedLoadSpec)
        job = _Job(job_id, False, dst_spec, src_spec.handles, "", self._ready(), expedited)
        self._submit(job)
        return True

    def _ready(self) -> Any:
        """KV on a GPU: an event after the work queued so far on the engine's
        stream (a store reads the blocks that work wrote; a load's blocks may
        still be written by it), for the copies' stream to wait on."""
        if self._stream is None:
            return None
        return torch.cuda.current_stream(self._stream.device).record_event()

    def _submit(self, job: _Job) -> None:
        with self._lock:
            self._running.add(job.job_id)
            if not job.store:
                self._loads.add(job.job_id)
        if self._thread is None:
            self._add(self._start(job))
            return
        if job.expedited:
            self._urgent.append(job)  # before the put: the thread takes it out first
        self._jobs.put(job)

    def get_finished(self) -> list[TransferResult]:
        self._reap()
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Until these jobs are done. Past the deadline a store still copying stops
        counting (its pages are not published): vLLM reuses its blocks now. A
        load still copying raises instead: vLLM would compute on its blocks (a
        synchronous load) or hand them to another request (a flush) while the
        copy still writes them, and it takes no failed load."""
        deadline = time.monotonic() + 4 * self.settings.timeout_s
        while True:
            self._reap()
            with self._lock:
                late = job_ids & self._running
                if not late:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    loads = late & self._loads
                    if loads:
                        raise TimeoutError(
                            f"hicached: loads {sorted(loads)} did not finish within "
                            f"{4 * self.settings.timeout_s:.1f}s (4 x timeout_s); vLLM would "
                            "use blocks they have not filled"
                        )
                    self._abandoned |= late
                    break
                # woken when the thread starts a job; copies on a GPU are looked at again
                self._lock.wait(min(left, _POLL_S) if self._started else left)
        log.error("hicached: transfers %s outlived their wait; their stores do not count", late)

    def shutdown(self) -> None:
        deadline = time.monotonic() + 4 * self.settings.timeout_s
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(max(0.0, deadline - time.monotonic()))
        while True:  # the copies in flight end before their client unmaps the pool
            self._reap()
            with self._lock:
                if not self._started or time.monotonic() >= deadline:
                    break
            time.sleep(_POLL_S)
        if self._client is not None:
            self._client.close()
        for sock in self._pushers.values():
            sock.close(linger=0)
        self._zmq.term()

    # -- copies -------------------------------------------------------------------------

    def _run(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self._stream.device)
        while (job := self._jobs.get()) is not None:
            while self._urgent:  # expedited loads go ahead of the jobs queued before them
                self._add(self._start(self._urgent.popleft()))
            if not job.expedited:  # an expedited one was started above
                self._add(self._start(job))

    def _add(self, transfer: _Transfer) -> None:
        with self._lock:
            self._started.append(transfer)
            self._lock.notify_all()

    @contextlib.contextmanager
    def _on_stream(self, job: _Job) -> Iterator[None]:
        """KV on a GPU: copies go on the worker's stream (an expedited load's on
        its own), after ``job.ready``."""
        stream = self._expedited_stream if job.expedited else self._stream
        if stream is None:
            yield
            return
        if job.ready is not None:
            stream.wait_event(job.ready)
        with torch.cuda.stream(stream):
            yield

    def _start(self, job: _Job) -> _Transfer:
        """Start one transfer's copies (no waiting for them)."""
        copies: list[PendingCopy] = []
        if not any(job.handles):
            return _Transfer(job, copies, True)
        try:
            handles = [[self._adopt(h) for h in mine] for mine in job.handles]
            client = self._session()
            slots = [_slots(mine) for mine in handles]
            with self._on_stream(job):
                for copy in self._copies.plan(job.gpu, slots, job.store):
                    mine = handles[copy.group]
                    assert mine, "blocks of a group without a handle"
                    for handle, some, rows in _through(mine, copy.pages, copy.blocks):
                        copies.append(_start_copy(client, handle, some, rows, copy))
            return _Transfer(job, copies, True)
        except (HicachedError, *UNREACHABLE) as exc:
            log.warning("hicached: transfer %d failed: %s", job.job_id, exc)
        except Exception:  # a bug must not stop the copy thread: later jobs would hang
            log.exception("hicached: transfer %d failed", job.job_id)
        return _Transfer(job, copies, False)

    def _reap(self) -> None:
        """Report the transfers whose copies are done (the engine's thread)."""
        with self._lock:
            done: list[_Transfer] = []
            going: list[_Transfer] = []
            for transfer in self._started:
                (done if transfer.done() else going).append(transfer)
            self._started = going
        if not done:
            return
        results = [self._finish(transfer) for transfer in done]
        with self._lock:
            for result in results:
                self._running.discard(result.job_id)
                self._loads.discard(result.job_id)
                self._abandoned.discard(result.job_id)
            self._finished.extend(results)
            self._lock.notify_all()

    def _finish(self, transfer: _Transfer) -> TransferResult:
        """One transfer's result, once its copies are done: the fence after each
        copy (a slot that changed owner since it began fails it, and with it the
        whole transfer, every group), and a store says which slots of each
        group's handle it wrote before it counts as done."""
        job = transfer.job
        ok = transfer.started
        for copy in transfer.copies:
            try:
                copy.finish()
            except StaleHandle as exc:
                log.warning("hicached: transfer %d failed: %s", job.job_id, exc)
                ok = False
        if job.store and any(job.handles) and self._copies.says:
            with self._lock:
                ok = ok and job.job_id not in self._abandoned
            for mine in job.handles:
                for wire in mine:
                    self._say(wire, job.acks, ok)
        return TransferResult(
            job.job_id,
            ok or job.store,  # vLLM takes no failed store: the scheduler heard it from us
            transfer_size=self._copies.size(job.gpu) if ok else 0,
            transfer_time=sum(copy.seconds() for copy in transfer.copies),
        )

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
