"""hicached's vLLM manager (HicachedManager) under vLLM 0.33's rules for the
scheduler side, driven directly in this venv's python (vLLM 0.32) against a
real daemon. Prints one JSON object of what it saw;
tests/test_vllm_manager.py checks it.

    vllm_manager_check.py ENDPOINT [DAEMON_PID]

The check plays vLLM 0.33's connector: it holds ``manager.lock`` for each
step, from the first lookup to ``on_schedule_end``, and calls
``on_reset_flushed`` after a reset (``manager.REPORTS_FLUSH`` is set as 0.33
would set it). Fault injection: an answer that says "nothing" is handed over
from the manager's loop thread between a lookup's HIT and its
``prepare_load``, as a lookup that failed at the worst moment would; and
the daemon stopped (SIGSTOP, given its pid) while a step's end waits for an
answer (``lookup_wait_s``), then let go on (SIGCONT).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import ReqContext

import hicached.integrations.vllm.manager as manager_module
from hicached import Client
from hicached.integrations.hybrid import Answer
from hicached.integrations.vllm import HicachedOffloadingSpec, Settings, engine_groups
from hicached.integrations.vllm.manager import HicachedManager, _Answer
from hicached.integrations.vllm.specs import HicachedLoadSpec
from tests.engines import answer_and_exit
from tests.engines.vllm_worker_check import config


def leases(client: Client, want: int, seconds: float = 5.0) -> int:
    """The daemon's open leases, once they are ``want`` (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while (n := client.stats().leases) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def context(req_id: str, keys: list[bytes], tokens: int) -> ReqContext:
    """A request's context as vLLM's connector fills it: where each key's chunk
    ends (the manager asks about whole chunks only)."""
    ctx = ReqContext(req_id)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * tokens)
    return ctx


def waits(endpoint: str, daemon_pid: int, keys: list[bytes]) -> dict[str, Any]:
    """A step's end waits for the answer to the lookups it asked (``lookup_wait_s``),
    so the next step's lookups know it; a daemon that does not answer holds it
    no longer than that bound, and its late answer is still taken."""
    facts: dict[str, Any] = {}
    cfg = config()
    for name, wait_s in (("wait", 30.0), ("stopped", 0.3)):
        settings = Settings(endpoint=endpoint, timeout_s=10.0, lookup_wait_s=wait_s)
        groups = engine_groups(cfg, settings)
        manager = HicachedManager(settings, groups, cfg.parallel.world_size)
        try:
            ctx = context(name, keys, groups[0].spec.page_tokens)
            stopped = name == "stopped" and daemon_pid > 0
            if stopped:
                # the link's session first (hello, namespaces), with the daemon up: a
                # daemon that cannot be reached at all is a miss, not a wait
                warm = context("warm", keys, groups[0].spec.page_tokens)
                with manager.lock:
                    for k in keys:
                        manager.lookup(k, warm)
                    manager.on_schedule_end(None)
                    manager.on_request_finished(warm)  # its answer's lease ends
                os.kill(daemon_pid, signal.SIGSTOP)  # fault injection: a daemon that hangs
            try:
                with manager.lock:
                    first = [manager.lookup(k, ctx).name for k in keys]
                    started = time.monotonic()
                    manager.on_schedule_end(None)
                    facts[f"{name}_step_end_s"] = time.monotonic() - started
                with manager.lock:  # at once: no sleep, no other step in between
                    second = [manager.lookup(k, ctx).name for k in keys]
                    manager.on_schedule_end(None)
            finally:
                if stopped:
                    os.kill(daemon_pid, signal.SIGCONT)
            later: list[str] = []
            deadline = time.monotonic() + 10
            while "HIT" not in later and time.monotonic() < deadline:
                time.sleep(0.01)
                with manager.lock:
                    later = [manager.lookup(k, ctx).name for k in keys]
                    manager.on_schedule_end(None)
            facts[name] = {"first": first, "second": second, "later": later}
        finally:
            manager.shutdown()
    return facts


def main(endpoint: str, daemon_pid: int = 0) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    cfg = config()
    settings = Settings(endpoint=endpoint, timeout_s=5.0)
    groups = engine_groups(cfg, settings)  # one full-attention group
    spec = groups[0].spec
    keys = [hashlib.sha256(b"page %d" % i).digest() + bytes(4) for i in range(4)]
    others = [hashlib.sha256(b"other %d" % i).digest() + bytes(4) for i in range(2)]
    with Client(endpoint, timeout=5.0) as client:
        ns = client.register(spec)
        res = client.reserve_keys(ns, keys)
        client.write_pages(res, np.ones((len(keys), spec.page_bytes), np.uint8))
        client.commit(res)
        manager = HicachedManager(settings, groups, cfg.parallel.world_size)
        try:
            facts["config_info"] = [dict(m) for m in manager.config_info()]
            facts["config_info_keys"] = list(HicachedOffloadingSpec.config_info_keys({}))
            lock = manager.lock
            facts["lock_taken"] = lock.acquire(blocking=False)
            facts["lock_taken_again"] = lock.acquire(blocking=False)
            lock.release()

            a, b = context("a", keys, spec.page_tokens), context("b", others, spec.page_tokens)
            # step 1: the lookups are asked for at the step's end
            with manager.lock:
                facts["step1"] = [manager.lookup(k, a).name for k in keys]
                manager.on_schedule_end(None)
            # step 2: the answer (a read lease) comes while the step holds the lock;
            # a store in the same step still gets its slots from the loop thread
            with manager.lock:
                facts["answer_leased"] = leases(client, 1) == 1
                time.sleep(0.1)
                out = manager.prepare_store(others, b)
                facts["stored_in_locked_step"] = len(out.keys_to_store)
                facts["step2"] = [manager.lookup(k, a).name for k in keys]
                # fault injection: a "nothing" answer between the HIT and prepare_load
                req = manager._requests["a"]

                async def nothing() -> None:
                    later = time.monotonic() + 10
                    manager._offer(req, _Answer(Answer(), frozenset(keys), later))

                manager._link.submit(nothing()).result(5)
                load = manager.prepare_load(keys, a)
                assert isinstance(load, HicachedLoadSpec)
                ((handle,),) = load.handles
                facts["loaded_pages"] = len(handle.offsets)
                manager.on_schedule_end(None)
            # a reset with the load and the store still in flight (vLLM 0.33 would
            # report them flushed later): their leases outlive it until then
            manager_module.REPORTS_FLUSH = True
            facts["leases_before_reset"] = leases(client, 2)
            with manager.lock:
                manager.reset_cache()
            time.sleep(0.3)  # releases would have reached the daemon by now
            facts["leases_after_reset"] = client.stats().leases
            with manager.lock:
                manager.on_reset_flushed()
            facts["leases_after_flushed"] = leases(client, 0)
        finally:
            manager.shutdown()
        facts.update(waits(endpoint, daemon_pid, keys))
    return facts


if __name__ == "__main__":
    answer_and_exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
