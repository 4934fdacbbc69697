"""Adversarial checks of hicached's vLLM scheduler side (HicachedManager),
driven in the vLLM 0.32 venv against a real daemon, with vLLM's own lookup
loop (``OffloadingConnectorScheduler._maximal_prefix_lookup``) deciding the
hit from the manager's answers, as vLLM's scheduler does. Prints one JSON
object of what it saw; tests/test_vllm_manager_review.py checks it.

    vllm_manager_review_check.py ENDPOINT [DAEMON_PID]

Fault injection, where a scenario says so: the manager's clock jumps past
its answer's ``until`` in the middle of a lookup pass (as time passing
does), and the link is marked down (as the loop thread marks it when
another request finds the daemon unreachable).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext

import hicached.integrations.vllm.manager as manager_module
from hicached import Client
from hicached.integrations.vllm import Settings, engine_groups
from hicached.integrations.vllm.manager import HicachedManager
from hicached.integrations.vllm.specs import HicachedLoadSpec
from tests.engines.vllm_worker_check import config


def context(req_id: str, keys: list[bytes], tokens: int) -> ReqContext:
    ctx = ReqContext(req_id)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * tokens)
    return ctx


class _Clock:
    """The manager's clock (fault injection): the real one, plus ``skew``."""

    def __init__(self) -> None:
        self.skew = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skew

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def prefix_lookup(manager: HicachedManager, keys: list[bytes], ctx: ReqContext) -> int | None:
    """vLLM's own full-attention lookup over ``keys`` (None: deferred)."""
    scheduler = SimpleNamespace(
        manager=manager, _events_tracker=SimpleNamespace(record_lookup=lambda *a: None)
    )
    group = SimpleNamespace()
    return OffloadingConnectorScheduler._maximal_prefix_lookup(
        scheduler,  # type: ignore[arg-type]
        keys,
        ctx,
        SimpleNamespace(),  # type: ignore[arg-type]
        group,  # type: ignore[arg-type]
        0,
    )


def stale_mid_pass(endpoint: str) -> dict[str, Any]:
    """The answer's ``until`` passes between two lookups of one pass while the
    link is down: vLLM counts the HITs it already got and loads them."""
    facts: dict[str, Any] = {}
    cfg = config()
    settings = Settings(endpoint=endpoint, timeout_s=5.0, lookup_wait_s=1.0)
    groups = engine_groups(cfg, settings)
    spec = groups[0].spec
    keys = [hashlib.sha256(b"stale %d" % i).digest() + bytes(4) for i in range(4)]
    with Client(endpoint, timeout=5.0) as client:
        ns = client.register(spec)
        res = client.reserve_keys(ns, keys)
        client.write_pages(res, np.ones((len(keys), spec.page_bytes), np.uint8))
        client.commit(res)
    clock = _Clock()
    real_time = manager_module.time
    manager_module.time = clock  # type: ignore[assignment]
    manager = HicachedManager(settings, groups, cfg.parallel.world_size)
    try:
        ctx = context("stale", keys, spec.page_tokens)
        with manager.lock:
            facts["first"] = prefix_lookup(manager, keys, ctx)
            manager.on_schedule_end(None)
        lookup = manager.lookup
        seen: list[str] = []

        def timed(key: bytes, req_context: ReqContext) -> LookupResult:
            if len(seen) == 2:  # fault injection: time passes, the daemon seems down
                clock.skew = 3600.0
                manager._link.failed()
            result = lookup(key, req_context)
            seen.append(result.name)
            return result

        manager.lookup = timed  # type: ignore[method-assign]
        with manager.lock:
            hit = prefix_lookup(manager, keys, ctx)
            facts["second"] = hit
            facts["seen"] = seen
            if hit:
                try:
                    load = manager.prepare_load(keys[:hit], ctx)
                    assert isinstance(load, HicachedLoadSpec)
                    (handle,) = load.handles
                    facts["load"] = 0 if handle is None else len(handle.offsets)
                except AssertionError as exc:
                    facts["load"] = f"AssertionError: {exc}"
                else:
                    manager.complete_load(keys[:hit], ctx)
            manager.on_schedule_end(None)
    finally:
        manager_module.time = real_time  # type: ignore[assignment]
        manager.shutdown()
    return facts


def main(endpoint: str, daemon_pid: int = 0) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for name, scenario in (("stale_mid_pass", stale_mid_pass),):
        try:
            facts[name] = scenario(endpoint)
        except Exception:
            facts[name] = {"error": traceback.format_exc()}
    return facts


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)))
