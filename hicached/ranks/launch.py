"""Launch the ranks of one model instance as processes (gloo on CPU).

A test and benchmark harness: ``launch(fn, tp=, cp=, pp=)`` starts
tp x cp x pp processes, initializes torch.distributed over loopback,
builds each rank's Topology and calls ``fn(topology, *args)`` there; it
returns every rank's result in rank order, or raises if any rank failed or
the whole run outlived its deadline (stragglers are killed). ``backend``
names the default group's backend (gloo unless a test asks for another that
the module of ``fn`` registers when it is imported).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# Imported once by the fork server, before it forks any rank: a rank forked
# from it starts in milliseconds, where one spawned imports torch anew (seconds
# of CPU each, for every rank of every launch). The server imports, computes
# nothing and starts no thread pool, so the forks inherit no lock held.
_PRELOAD = ["torch", "torch.distributed", "hicached.ranks.agreement"]
# The process whose launches use the fork server (0: none yet). A process
# forked from it (os.fork, a "fork" Process) inherits multiprocessing's record
# of that server, its parent's child, and the stdlib's check of it fails there
# (ChildProcessError from waitpid): such a process spawns its ranks.
_server_of = 0


def _context() -> Any:
    """Ranks are forked from a fork server (one per launching process, started
    at the first launch) that imported torch; spawned where there is none, or
    where the one known is a parent's."""
    global _server_of
    if "forkserver" not in mp.get_all_start_methods() or _server_of not in (0, os.getpid()):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    _server_of = os.getpid()
    return ctx


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    layout: tuple[int, int, int],
    port: int,
    timeout: float,
    out: Any,
    backend: str = "gloo",
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from hicached.ranks.agreement import Topology

    torch.set_num_threads(1)
    tp, cp, pp = layout
    world = tp * cp * pp
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout)
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        topo = Topology.create(tp, cp, pp, timeout=timeout)
        out.put((rank, "ready", None))
        result = fn(topo, *args)
        out.put((rank, "ok", result))
    except BaseException as exc:  # reported to the parent, which raises
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer already died: nothing to tear down
                dist.destroy_process_group()


class RankError(Exception):
    """One or more ranks failed; ``errors`` maps rank to its error text."""

    def __init__(self, errors: dict[int, str], results: dict[int, Any]) -> None:
        super().__init__(
            "; ".join(f"rank {r}: {e.splitlines()[0]}" for r, e in sorted(errors.items()))
        )
        self.errors = errors
        self.results = results


def launch(
    fn: Callable[..., Any],
    *args: Any,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    timeout: float = 20.0,
    deadline: float = 120.0,
    kill: dict[int, float] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(topology, *args)`` on every rank; results in rank order.

    ``kill`` maps ranks to seconds after every rank is ready at which the
    harness SIGKILLs them (fault injection: a rank dying mid-run). ``backend``
    is the default group's backend.
    """
    import torch.distributed as dist

    world = tp * cp * pp
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    ctx = _context()
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, args, r, (tp, cp, pp), store.port, timeout, out, backend),
            daemon=True,
        )
        for r in range(world)
    ]
    started = time.monotonic()
    try:
        for proc in procs:
            proc.start()
    except BaseException:  # one failed to start (no memory, no fork server): none runs on
        for proc in procs:
            if proc.pid is not None:
                proc.kill()
                proc.join(5)
        out.close()
        raise
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    ready: set[int] = set()
    all_ready = 0.0
    pending_kills = dict(kill or {})
    try:
        while len(results) + len(errors) < world:
            now = time.monotonic() - started
            for rank, at in list(pending_kills.items()):
                if len(ready) == world and now - all_ready >= at:
                    procs[rank].kill()
                    errors[rank] = "killed by the harness"
                    del pending_kills[rank]
            if now > deadline:
                for r in range(world):
                    if r not in results and r not in errors:
                        errors[r] = f"no result within {deadline}s"
                break
            try:
                rank, status, value = out.get(timeout=0.05)
            except queue.Empty:
                for r, proc in enumerate(procs):  # a rank that died without a word
                    dead = proc.exitcode is not None and out.empty()
                    if dead and r not in results and r not in errors:
                        errors[r] = f"died (exit code {proc.exitcode})"
                continue
            if status == "ready":
                ready.add(rank)
                all_ready = time.monotonic() - started
                continue
            if rank in errors:
                continue
            (results if status == "ok" else errors)[rank] = value
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        out.close()
        del store
    if errors:
        raise RankError(errors, results)
    return [results[r] for r in range(world)]
