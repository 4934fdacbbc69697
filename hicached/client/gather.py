"""Scattered slot copies: numpy's or torch's, whichever runs faster on this host.

A copy between shuffled pool slots and one contiguous array of pages is a
gather (a read) or a scatter (a write) of whole rows. Which library does it
faster is a fact of the host and of where the pages' buffer lies, not of the
code: on the 2-core machines torch's ``index_select`` gathers out of the
shared pool at memcpy speed wherever the buffer starts, while ``numpy.take``
(glibc's memcpy a page) keeps up only into a buffer aligned to a cache line
and runs at less than half of it into one 16 bytes past (as large numpy
arrays from malloc are); torch's ``index_copy_`` scatters at a fifth of
numpy's speed. On the 16-core GPU host numpy's gather is the faster one
(0.92 of memcpy against torch's 0.60-0.66; docs/perf.md). So it is measured,
not assumed:

- once per process, at the first scattered copy made while torch is loaded:
  both kernels both ways, turn about, ``ROUNDS`` timed rounds each after one
  that warms up (one only, past ``BUDGET_S``), on at most ``SAMPLE_BYTES`` a
  round; each direction keeps the kernel with the higher median rate (torch's
  by ``TORCH_MARGIN`` at least: its thread pool waits on a busy host);
- every round copies rows no round touched before (rows read again come from
  the CPU's cache and flatter the kernel that loses on memory): the gather
  reads fresh rows of the pool mapping itself (a read changes no slot), the
  scatter writes fresh rows of a private shared-memory buffer of the same
  page size, never the pool (its slots hold other keys' bytes); the pages'
  side is a private buffer placed as the first copy's own buffer is (its
  address modulo 4 KiB);
- without torch in the process there is nothing to choose: numpy copies, and
  torch is never imported for it (heavy imports stay with the engines that
  load them anyway);
- ``HICACHED_GATHER=numpy`` or ``=torch`` skips the measurement and takes
  that library both ways (torch once the process has loaded it); unset or
  ``measure``, the default, measures.

The pick and both rates are this process's figures (``gather_choice()``,
``hicached bench data --json``); each client of the process tells its daemon
(client/report.py), so that ``hicached status`` shows every engine process's.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import numpy as np

from hicached.errors import BadRequest

Kernel = Literal["numpy", "torch"]
KERNELS: tuple[Kernel, ...] = ("numpy", "torch")
ENV = "HICACHED_GATHER"
# The measurement's bounds: bytes one kernel moves a round, timed rounds a kernel.
SAMPLE_BYTES = 2 << 20
SAMPLE_PAGES = 256
ROUNDS = 5
# Past this many seconds from its start the measurement ends each race after
# its first timed round: on a host whose cores are busy, torch's parallel
# kernels can wait a core for most of a second a call (0.01 GB/s was seen).
BUDGET_S = 0.2
# torch's kernel wins only by this factor: it runs on a thread pool that other
# work on the host can hold up, numpy's on the calling thread alone
TORCH_MARGIN = 1.1
_PAGE = 4096  # placement of buffers is compared modulo this


class Rates(NamedTuple):
    """One direction's pick and what each kernel reached, in GB/s (0.0: not measured)."""

    pick: Kernel
    numpy_gbps: float
    torch_gbps: float


class GatherChoice(NamedTuple):
    """This process's kernels for scattered copies, made once (``gather_choice()``)."""

    read: Rates  # the gather: slots -> pages
    write: Rates  # the scatter: pages -> slots
    how: str  # "measured", or "HICACHED_GATHER" when the environment named one
    page_bytes: int  # of the sample (the page size of the first scattered copy)
    sample_pages: int  # pages a kernel moved a round
    rounds: int  # timed rounds a kernel: ROUNDS, or fewer (one at least) past BUDGET_S
    seconds: float  # what the measurement took, once (0.0 when named)
    offset: int  # of the sample's page buffer in a 4 KiB page (the first copy's buffer's)

    def as_dict(self) -> dict[str, Any]:
        """For JSON figures: plain values only."""
        out: dict[str, Any] = self._asdict()
        out["read"], out["write"] = self.read._asdict(), self.write._asdict()
        return out


_lock = threading.Lock()  # the first copies of two threads measure once between them
_choice: GatherChoice | None = None


def gather_choice() -> GatherChoice | None:
    """The kernels this process picked for scattered copies, with the rates that
    decided; None before its first scattered copy with torch loaded (until then,
    and always without torch, numpy copies)."""
    return _choice


def gather(rows: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[j] = rows[idx[j]]``: pool rows ``idx`` (checked in range) into ``out``."""
    if "torch" in sys.modules and _chosen(rows, out).read.pick == "torch":
        _gather_torch(rows, idx, out)
    else:
        _gather_numpy(rows, idx, out)


def scatter(rows: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
    """``rows[idx[j]] = src[j]``: ``src`` into pool rows ``idx`` (checked in range;
    of rows given twice, one of their pages lands)."""
    # a read-only source stays with numpy: torch views only writable arrays
    if "torch" in sys.modules and src.flags.writeable and _chosen(rows, src).write.pick == "torch":
        _scatter_torch(rows, idx, src)
    else:
        _scatter_numpy(rows, idx, src)


def _gather_numpy(rows: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    # indices are checked by the caller; "clip" lets numpy gather straight into out
    np.take(rows, idx, axis=0, out=out, mode="clip")


def _gather_torch(rows: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    torch = sys.modules["torch"]
    torch.index_select(torch.from_numpy(rows), 0, torch.from_numpy(idx), out=torch.from_numpy(out))


def _scatter_numpy(rows: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
    rows[idx] = src


def _scatter_torch(rows: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
    torch = sys.modules["torch"]
    torch.from_numpy(rows).index_copy_(0, torch.from_numpy(idx), torch.from_numpy(src))


GATHERS: dict[Kernel, Callable[[np.ndarray, np.ndarray, np.ndarray], None]] = {
    "numpy": _gather_numpy,
    "torch": _gather_torch,
}
SCATTERS: dict[Kernel, Callable[[np.ndarray, np.ndarray, np.ndarray], None]] = {
    "numpy": _scatter_numpy,
    "torch": _scatter_torch,
}


def _chosen(rows: np.ndarray, pages: np.ndarray) -> GatherChoice:
    """This process's choice; made at the first call (once, under the lock),
    sampling ``rows`` with a buffer placed as ``pages`` is."""
    global _choice
    choice = _choice
    if choice is None:
        with _lock:
            if _choice is None:
                _choice = _named(rows.shape[1]) or measure(rows, pages)
            choice = _choice
    return choice


def _named(page_bytes: int) -> GatherChoice | None:
    """The kernel HICACHED_GATHER names, if it names one."""
    wanted = os.environ.get(ENV, "measure").strip().lower() or "measure"
    if wanted == "measure":
        return None
    if wanted not in KERNELS:
        raise BadRequest(f"{ENV}={wanted!r}: use numpy, torch or measure (the default)")
    rates = Rates(wanted, 0.0, 0.0)
    return GatherChoice(rates, rates, ENV, page_bytes, 0, 0, 0.0, 0)


def measure(rows: np.ndarray, like: np.ndarray | None = None) -> GatherChoice:
    """Time both kernels both ways, ``pages`` pages a round (at most
    ``SAMPLE_BYTES``), on rows no round has touched before: the same rows again
    would be read from the CPU's cache and flatter the kernel that loses on
    memory (numpy's gather ran 35 GB/s on 16 pages read again, 5 on fresh
    ones). The gather reads fresh rows of ``rows`` (the pool: only read); the
    scatter writes fresh rows of a private shared buffer of the same page size,
    prefaulted. The pages' side is a private buffer at the same place in a
    4 KiB page as ``like`` (the first copy's own buffer): numpy's copies out
    of the pool ran 7 GB/s into a buffer 16 bytes past a cache line and 16
    into an aligned one, torch's 15 either way. Needs torch loaded."""
    started = time.perf_counter()
    page_bytes = rows.shape[1]
    pages = max(1, min(SAMPLE_PAGES, SAMPLE_BYTES // page_bytes))
    need = (ROUNDS + 1) * len(KERNELS) * pages  # rows, each used once
    rng = np.random.default_rng()
    if len(rows) >= need:
        fresh = rng.choice(len(rows), need, replace=False)
    else:  # a small pool: rows come again (it fits in a cache anyway)
        fresh = rng.integers(0, len(rows), need)
    # map the sampled rows in (a byte each 4 KiB): the rates are of copies, not of
    # first touches, which a long-running client's mapping is long past
    rows[fresh[:, None], np.arange(0, page_bytes, _PAGE)].sum()
    at = 0 if like is None else _address(like) % _PAGE
    raw = np.zeros(pages * page_bytes + _PAGE, dtype=np.uint8)
    start = (at - _address(raw)) % _PAGE
    pages_buf = raw[start : start + pages * page_bytes].reshape(pages, page_bytes)
    deadline = started + BUDGET_S
    read, rounds = _race(
        GATHERS, rows, fresh.astype(np.int64).reshape(ROUNDS + 1, -1, pages), pages_buf, deadline
    )
    # anonymous and shared memory is tmpfs, as the pool is; populated, as the pool is
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    try:
        shared = mmap.mmap(-1, need * page_bytes, flags=flags)
    except OSError:  # no memory to spare for the sample: the scatter stays numpy's
        write, timed = Rates("numpy", 0.0, 0.0), rounds
    else:
        try:
            slots = np.frombuffer(shared, dtype=np.uint8).reshape(need, page_bytes)
            # written in (a byte each 4 KiB): MAP_POPULATE is a hint some kernels
            # skip, and a scatter into pages it faults in times the faults (on a
            # 16-core host numpy's scatter measured 3.7 GB/s so, 14 into the pool)
            slots[:, ::_PAGE] = 0
            order = rng.permutation(need).astype(np.int64).reshape(ROUNDS + 1, -1, pages)
            write, timed = _race(SCATTERS, slots, order, pages_buf, deadline)
            del slots
        finally:
            with contextlib.suppress(BufferError):  # a view outlived the race: freed with it
                shared.close()
    seconds = round(time.perf_counter() - started, 4)
    rounds = min(rounds, timed)
    return GatherChoice(read, write, "measured", page_bytes, pages, rounds, seconds, at)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _race(
    kernels: dict[Kernel, Callable[[np.ndarray, np.ndarray, np.ndarray], None]],
    rows: np.ndarray,
    order: np.ndarray,
    pages: np.ndarray,
    deadline: float,
) -> tuple[Rates, int]:
    """Each kernel's median GB/s over ``ROUNDS`` rounds after one that warms up,
    who goes first alternating (fewer rounds, at least one, past ``deadline``),
    and the rounds timed; round r of kernel k copies between ``pages`` and
    ``rows[order[r, k]]``."""
    times: dict[Kernel, list[float]] = {name: [] for name in kernels}
    ranked = list(enumerate(kernels.items()))
    for r in range(ROUNDS + 1):
        for k, (name, kernel) in ranked if r % 2 == 0 else ranked[::-1]:
            started = time.perf_counter()
            kernel(rows, order[r, k], pages)
            if r:  # round 0 faults the buffers in and loads the code
                times[name].append(time.perf_counter() - started)
        if r and time.perf_counter() >= deadline:
            break
    gbps = {
        name: round(pages.nbytes / max(statistics.median(t), 1e-9) / 1e9, 2)
        for name, t in times.items()
    }
    pick: Kernel = "torch" if gbps["torch"] > TORCH_MARGIN * gbps["numpy"] else "numpy"
    return Rates(pick, gbps["numpy"], gbps["torch"]), len(times["numpy"])
