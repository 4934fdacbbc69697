"""hicached as vLLM's host KV tier, end to end: a real daemon and real vLLM
engine processes (CPU, a tiny Llama with random weights) joined by vLLM's
OffloadingConnector and hicached.integrations.vllm.

One daemon (file L3, write-through) serves the file. A first engine stores a
prompt's pages; then, each in a new engine process:

- the prefix is cached through hicached, and the tokens and logprobs are those
  of an engine without hicached;
- a page whose bytes change in the pool changes the output (what the engine
  attends to really comes from the pool);
- after a daemon restart the pages come back from L3, same output;
- with the daemon stopped, the engine recomputes, same output; and one whose
  daemon is killed between two requests answers the second by recomputing;
- with a daemon that takes two pages a request, a prompt of nine blocks is
  stored and loaded whole, in parts.

The engines run in the vLLM venv (tests/engines/venv.py), hicached on their
path. Besides the tests, a measurement of time to first token:

    .venv/bin/python -m tests.test_vllm_e2e     # 2,000 tokens: full hit vs recompute, and the limit
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicached import Client, NamespaceSpec
from hicached.arena import arena_path
from tests.engines import tinyllama
from tests.engines.vllm_engine import engine_python, model_dir, run_engine, same_answer
from tests.l3util import FILE_STORE, settle_writes, storage, wait_for
from tests.support import Daemon

# The first test may wait for the venv build (minutes, once per pin and machine).
pytestmark = pytest.mark.timeout(1200)

BLOCK = 32  # tokens a block (vllm_run.py)
PROMPT = np.random.default_rng(2024).integers(3, tinyllama.VOCAB, 300).tolist()
OTHER = np.random.default_rng(2025).integers(3, tinyllama.VOCAB, 300).tolist()
CACHED = len(PROMPT) // BLOCK * BLOCK  # the full blocks: 288 tokens
ANSWER_TOKENS = 8
KV_BYTES_PER_TOKEN = 2 * 2 * 4 * 32 * 4  # K and V, 2 layers, 4 heads of 32 floats


def ask(prompt: list[int] = PROMPT, max_tokens: int = ANSWER_TOKENS) -> list[dict[str, Any]]:
    return [{"prompt": prompt, "max_tokens": max_tokens}]


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def python() -> Path:
    return engine_python()


@pytest.fixture(scope="module")
def model(python: Path) -> Path:
    return model_dir(python)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon(storage=storage("file"), tail=FILE_STORE)
    try:
        yield d.start()
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def baselines(python: Path, model: Path) -> list[dict[str, Any]]:
    """The answers of an engine without hicached, to PROMPT and to OTHER."""
    results: list[dict[str, Any]] = run_engine(python, model, [*ask(), *ask(OTHER)])["results"]
    assert [r["num_cached_tokens"] for r in results] == [0, 0]
    return results


@pytest.fixture(scope="module")
def alone(baselines: list[dict[str, Any]]) -> dict[str, Any]:
    return baselines[0]


@pytest.fixture(scope="module")
def stored(python: Path, model: Path, daemon: Daemon, alone: dict[str, Any]) -> dict[str, Any]:
    """A first engine stores the prompt's full blocks; they reach L3 too. Its
    answer, with the namespace it registered and the prompt's keys."""
    first = run_engine(python, model, ask(), hicached=daemon.endpoint)
    (result,) = first["results"]
    assert result["num_cached_tokens"] == 0
    assert same_answer(result, alone)
    with daemon.client() as c:
        settle_writes(c)
        stats = c.stats()
        assert stats.pages == CACHED // BLOCK
        assert stats.l3.get("written", 0) >= CACHED // BLOCK, stats.l3
    return {**result, "namespace": first["namespace"]}


def namespace_of(c: Client, stored: dict[str, Any]) -> Any:
    return c.register(NamespaceSpec(**stored["namespace"]))


# -- the tests ------------------------------------------------------------------------


def test_a_new_engine_loads_the_prefix_from_hicached(
    python: Path, model: Path, daemon: Daemon, alone: dict[str, Any], stored: dict[str, Any]
) -> None:
    """The second engine runs its model in a worker process of its own, which
    copies on a thread: handles and the workers' word on their stores cross
    processes. After the prompt, a longer one stores its two new blocks."""
    with daemon.client() as c:
        before = c.stats().match_pages.get("l2", 0)
    longer = PROMPT + np.random.default_rng(1).integers(3, tinyllama.VOCAB, 64).tolist()
    second = run_engine(
        python,
        model,
        [*ask(), *ask(longer)],
        hicached=daemon.endpoint,
        executor="mp",
        copy_thread=True,
    )
    result = second["results"][0]
    assert result["num_cached_tokens"] == CACHED
    assert same_answer(result, alone), (result, alone)
    with daemon.client() as c:
        stats = c.stats()
        assert stats.match_pages.get("l2", 0) - before >= CACHED // BLOCK
        assert stats.pages == len(longer) // BLOCK
        keys = [bytes.fromhex(k) for k in second["results"][1]["keys"]]
        found = c.exists_keys(namespace_of(c, stored), keys)
        assert found.l2 == len(longer) // BLOCK  # the daemon holds vLLM's own keys
    print(
        f"\nprefill tokens computed by the second engine: {len(PROMPT) - CACHED} with "
        f"hicached, {len(PROMPT)} without"
    )


def test_a_changed_page_changes_the_output(
    python: Path, model: Path, daemon: Daemon, alone: dict[str, Any], stored: dict[str, Any]
) -> None:
    with daemon.client() as c:
        ns = namespace_of(c, stored)
        hit = c.match_keys(ns, [bytes.fromhex(k) for k in stored["keys"]])
        assert hit.hits == CACHED // BLOCK
        pool = np.memmap(arena_path("/dev/shm", daemon.runtime), dtype=np.uint8, mode="r+")
        slots = pool[: hit.offsets[-1] + ns.page_bytes]
        page = slots[hit.offsets[4] : hit.offsets[4] + ns.page_bytes]
        kept = page.copy()
        page[:] = slots[hit.offsets[2] : hit.offsets[2] + ns.page_bytes]  # another page's KV
        c.release(hit)
        try:
            (result,) = run_engine(python, model, ask(), hicached=daemon.endpoint)["results"]
        finally:
            page[:] = kept
            pool.flush()
            del pool
    assert result["num_cached_tokens"] == CACHED
    assert not same_answer(result, alone), "the engine did not use the pool's bytes"


def test_pages_come_back_from_l3_after_a_restart(
    python: Path, model: Path, daemon: Daemon, alone: dict[str, Any], stored: dict[str, Any]
) -> None:
    daemon.stop()
    daemon.start()
    with daemon.client() as c:
        wait_for(lambda: c.stats().l3_state == "up", timeout=30)
        assert c.stats().pages == 0
    (result,) = run_engine(python, model, ask(), hicached=daemon.endpoint)["results"]
    assert result["num_cached_tokens"] == CACHED
    assert same_answer(result, alone), (result, alone)
    with daemon.client() as c:
        assert c.stats().match_pages.get("l3", 0) >= CACHED // BLOCK


def test_without_the_daemon_the_engine_recomputes(
    python: Path, model: Path, daemon: Daemon, alone: dict[str, Any], stored: dict[str, Any]
) -> None:
    daemon.stop()
    try:
        (result,) = run_engine(python, model, ask(), hicached=daemon.endpoint)["results"]
    finally:
        daemon.start()
    assert result["num_cached_tokens"] == 0
    assert same_answer(result, alone), (result, alone)


def test_an_engine_whose_daemon_dies_recomputes(
    python: Path,
    model: Path,
    daemon: Daemon,
    baselines: list[dict[str, Any]],
    stored: dict[str, Any],
) -> None:
    """Killed between two requests: the session breaks under a running engine."""
    try:
        first, second = run_engine(
            python, model, [*ask(), *ask(OTHER)], hicached=daemon.endpoint, between=daemon.kill
        )["results"]
    finally:
        daemon.start()
    assert first["num_cached_tokens"] == CACHED
    assert same_answer(first, baselines[0]), (first, baselines[0])
    assert second["num_cached_tokens"] == 0
    assert same_answer(second, baselines[1]), (second, baselines[1])


def test_a_prompt_of_more_chunks_than_the_daemon_takes_a_request_is_stored_and_loaded_whole(
    python: Path, model: Path, alone: dict[str, Any]
) -> None:
    """A daemon that takes two pages a request (``server.max_pages_per_request``)
    and a prompt of nine full blocks: the first engine stores every block (a
    reservation of two keys at a time), and a new engine loads all of them
    through leases of two pages each (before, a store or a lookup stopped at
    the daemon's limit: two blocks), with the answer of an engine without
    hicached."""
    with Daemon(size_mib=16, extra="max_pages_per_request = 2") as d:
        (first,) = run_engine(python, model, ask(), hicached=d.endpoint)["results"]
        assert first["num_cached_tokens"] == 0
        with d.client() as c:
            assert c.stats().pages == CACHED // BLOCK
        (second,) = run_engine(python, model, ask(), hicached=d.endpoint)["results"]
        assert second["num_cached_tokens"] == CACHED
        assert same_answer(second, alone), (second, alone)
        with d.client() as c:
            assert c.stats().match_pages.get("l2", 0) >= CACHED // BLOCK


# -- time to first token ----------------------------------------------------------------


def bench(tokens: int = 2000, prompts: int = 5) -> dict[str, Any]:
    """Time to first token of ``tokens``-token prompts in a new engine: every full
    block from hicached vs all recomputed (the medians over ``prompts`` prompts;
    each engine warmed up first by a prompt as long), and the limit of a hit
    beside them: the prompt's KV bytes at this host's memcpy speed plus the
    time to first token of the same prompt asked again of the engine without
    hicached, whose own prefix cache then holds every full block (what a hit
    leaves to compute, over the whole context: a decode step's worth). The
    engine with hicached runs twice: with the default ``lookup_wait_s`` and
    with 0 (the scheduler never waits for an answer), the raw baseline of what
    that wait is for."""
    python = engine_python()
    model = model_dir(python)
    rng = np.random.default_rng(7)
    asked = [rng.integers(3, tinyllama.VOCAB, tokens).tolist() for _ in range(prompts)]
    warmup = ask(rng.integers(3, tinyllama.VOCAB, tokens).tolist(), 1)
    first = [r for prompt in asked for r in ask(prompt, 1)]
    tail = tokens % BLOCK or BLOCK  # what a full hit leaves to compute (vLLM keeps one)
    length = tokens + 256
    runs: dict[str, list[dict[str, Any]]] = {}
    with Daemon(size_mib=16 + (prompts * tokens * KV_BYTES_PER_TOKEN >> 20)) as d:
        # a few decode steps each: vLLM submits a prefill's stores at the next step
        stores = [r for prompt in asked for r in ask(prompt, 16)]
        run_engine(python, model, stores, hicached=d.endpoint, max_model_len=length)
        with d.client() as c:
            stored = c.stats().pages
        for name, wait in (("hit", None), ("hit_without_wait", 0.0)):
            extra = [] if wait is None else ["--lookup-wait-s", str(wait)]
            got = run_engine(
                python,
                model,
                [*warmup, *first],
                hicached=d.endpoint,
                max_model_len=length,
                extra=extra,
            )
            runs[name] = got["results"][1:]
    cold = run_engine(python, model, [*warmup, *first, *first], max_model_len=length)
    runs["recompute"] = cold["results"][1 : 1 + prompts]
    runs["rest"] = cold["results"][1 + prompts :]
    median = {name: float(np.median([r["elapsed_s"] for r in rs])) for name, rs in runs.items()}
    kv_bytes = (tokens - tail) * KV_BYTES_PER_TOKEN
    copy_s = _memcpy_s(kv_bytes)
    limit_s = copy_s + median["rest"]

    def run(name: str) -> dict[str, Any]:
        return {
            "prefill_tokens": [
                len(p) - r["num_cached_tokens"] for p, r in zip(asked, runs[name], strict=True)
            ],
            "ttft_s_median": median[name],
            "ttft_s": [r["elapsed_s"] for r in runs[name]],
        }

    hits = runs["hit"]
    return {
        "prompt_tokens": tokens,
        "prompts": prompts,
        "pages_stored": stored,
        "hit": run("hit"),
        "hit_without_wait": run("hit_without_wait"),
        "recompute": run("recompute"),
        "limit": {
            "kv_bytes": kv_bytes,
            "memcpy_s": copy_s,
            "computed_tokens": [
                len(p) - r["num_cached_tokens"] for p, r in zip(asked, runs["rest"], strict=True)
            ],
            "engine_hit_ttft_s_median": median["rest"],
            "ttft_s": limit_s,
        },
        "speedup": median["recompute"] / median["hit"],
        "speedup_without_wait": median["recompute"] / median["hit_without_wait"],
        "speedup_limit": median["recompute"] / limit_s,
        "same_first_tokens": [r["token_ids"] for r in hits]
        == [r["token_ids"] for r in runs["recompute"]],
    }


def _memcpy_s(nbytes: int, rounds: int = 20) -> float:
    """Seconds one copy of ``nbytes`` between two buffers takes here (median; each
    round into a buffer not touched since, as a load's blocks are)."""
    src = np.ones(nbytes, np.uint8)
    times = []
    for _ in range(rounds):
        dst = np.empty(nbytes, np.uint8)
        dst[::4096] = 0  # its pages are mapped: the copy is timed, not the faults
        started = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


if __name__ == "__main__":
    started = time.monotonic()
    out = bench(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
    out["wall_s"] = time.monotonic() - started
    print(json.dumps(out, indent=2))
