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

import msgspec
import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext

import hicached.integrations.vllm.manager as manager_module
from hicached import Client
from hicached.integrations.hybrid import Window
from hicached.integrations.vllm import KVGroup, Settings, engine_groups
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


def window_lookup(manager: HicachedManager, keys: list[bytes], ctx: ReqContext) -> int | None:
    """vLLM's own sliding-window lookup over ``keys`` (a window of two chunks)."""
    scheduler = SimpleNamespace(manager=manager)
    return OffloadingConnectorScheduler._sliding_window_lookup(
        scheduler,  # type: ignore[arg-type]
        keys,
        2,
        ctx,
        2,
    )


def hybrid(endpoint: str) -> dict[str, Any]:
    """A full-attention group and a sliding window of two chunks (groups 0 and
    1, each a namespace of its own): full attention holds chunks 1-6 of each
    prompt; the window holds chunks 5 and 6 of prompt A (as vLLM stores a
    window), only chunk 5 of prompt B (chunk 6's page never stored). vLLM's
    own lookups decide each hit, and a hit's load is prepared."""
    facts: dict[str, Any] = {}
    cfg = config()
    settings = Settings(endpoint=endpoint, timeout_s=5.0, lookup_wait_s=1.0)
    (full,) = engine_groups(cfg, settings)
    window_spec = msgspec.structs.replace(full.spec, layout=full.spec.layout + "_g1_sliding")
    window = KVGroup(
        1, 1, Window(2 * full.spec.page_tokens, "sliding"), full.block_bytes, window_spec
    )
    groups = [full, window]
    tokens = full.spec.page_tokens
    chunks = {
        p: [hashlib.sha256(b"%s %d" % (p.encode(), i)).digest() for i in range(6)]
        for p in ("A", "B")
    }
    with Client(endpoint, timeout=5.0) as client:
        for group, spec, stored in ((0, full.spec, range(6)), (1, window_spec, None)):
            ns = client.register(spec)
            for p, hashes in chunks.items():
                mine = stored or ([4, 5] if p == "A" else [4])
                keys = [hashes[i] + group.to_bytes(4, "big") for i in mine]
                res = client.reserve_keys(ns, keys)
                client.write_pages(res, np.ones((len(keys), spec.page_bytes), np.uint8))
                client.commit(res)
    manager = HicachedManager(settings, groups, cfg.parallel.world_size)
    try:
        for p, hashes in chunks.items():
            full_keys = [h + bytes(4) for h in hashes]
            window_keys = [h + (1).to_bytes(4, "big") for h in hashes]
            ctx = context(p, full_keys, tokens)
            for i, key in enumerate(window_keys):
                ctx.set_offload_key_position(key, (i + 1) * tokens)
            got: dict[str, Any] = {}
            for step in ("first", "second"):
                with manager.lock:
                    f = prefix_lookup(manager, full_keys, ctx)
                    w = window_lookup(manager, window_keys[: f or 6], ctx)
                    got[step] = [f, w]
                    if step == "second" and f and w:
                        n = min(f, w)
                        load = manager.prepare_load(full_keys[:n] + window_keys[n - 2 : n], ctx)
                        assert isinstance(load, HicachedLoadSpec)
                        got["load"] = [0 if h is None else len(h.offsets) for h in load.handles]
                        manager.complete_load(full_keys[:n] + window_keys[n - 2 : n], ctx)
                    manager.on_schedule_end(None)
            facts[p] = got
    finally:
        manager.shutdown()
    return facts


def main(endpoint: str, daemon_pid: int = 0) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for name, scenario in (("stale_mid_pass", stale_mid_pass), ("hybrid", hybrid)):
        try:
            facts[name] = scenario(endpoint)
        except Exception:
            facts[name] = {"error": traceback.format_exc()}
    return facts


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)))
