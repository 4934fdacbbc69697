"""Hybrid models through hicached, per model: what a second vLLM engine computes
of a prompt with and without hicached, its time to first token with a full hit
against recompute (same run, ratios), and the bytes per cached token of each
KV cache group kind.

    PYTHONPATH=. .venv/bin/python bench/checks/hybrid_ttft.py [TOKENS] [PROMPTS] [ROUNDS]

The models are tests/engines/tinyhybrid.py's (a Gemma3 with a sliding window,
a Qwen3Next with a GDN state; random weights, CPU), in real vLLM engine
processes (the venv of tests/engines/venv.py, built on first use). Per model,
a first engine stores PROMPTS prompts of TOKENS tokens (default 5 of 2,000).
Then ROUNDS times (default 2), one after the other:

- an engine with hicached answers each stored prompt with one token (a full
  hit: every group's pages from hicached), each followed by a new prompt of
  the same length (a miss: recomputed with hicached attached, so its time
  also holds the lookup's round and the stores of its pages, which
  ``LLM.generate`` waits for before it returns), so hits and misses share
  the engine process and the moment;
- an engine without hicached answers the stored prompts (recompute), and
  prompts as short as what a hit leaves to compute (the floor a hit's TTFT
  can reach on that engine).

Every engine is warmed up by a short prompt first; a TTFT is the median over
all rounds' prompts (and the best of them: on a machine whose cores other
work shares, the least disturbed), and the ratios are of those medians (and
of the bests). Bytes per cached token: what a hit of one prompt reads from each
group (the pages ``hicached.integrations.hybrid.lookup`` leases for it on the
same daemon), over the tokens it restores, next to a page's bytes over its
tokens.

Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import hicached
from hicached import NamespaceSpec
from hicached.integrations.hybrid import Group, Kind, Prefix, Window, lookup
from tests.engines import tinyhybrid
from tests.engines.vllm_engine import engine_python, hybrid_model_dir, run_engine
from tests.support import Daemon

MODELS = ("gemma3", "qwen3next")
STORE_TOKENS = 8  # decode steps of the storing engine: vLLM submits a prefill's stores later


def prompts(seed: int, tokens: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, tinyhybrid.VOCAB, tokens).tolist() for _ in range(count)]


def ask(prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens}


def computed(asked: list[list[int]], results: list[dict[str, Any]]) -> list[int]:
    """Prompt tokens each answer computed (the rest came from a cache)."""
    return [len(p) - r["num_cached_tokens"] for p, r in zip(asked, results, strict=True)]


def median_s(results: list[dict[str, Any]]) -> float:
    return statistics.median(r["elapsed_s"] for r in results)


def kind_of(group: dict[str, Any]) -> Kind:
    """The group's kind as the engine's manager built it (vllm_run.py says)."""
    window = group["window_tokens"]
    return Prefix() if window is None else Window(int(window), group["kind"])


async def read_per_group(
    endpoint: str, groups: list[dict[str, Any]], keys: list[bytes], block: int
) -> dict[str, Any]:
    """The pages a hit of one prompt reads from each group, as the manager's
    lookup leases them, and the end it restores."""
    async with hicached.AsyncClient(endpoint, timeout=10.0) as c:
        asked = []
        for g in groups:
            ns = await c.register(NamespaceSpec(**g["spec"]))
            mine = [k[:-4] + int(g["group"]).to_bytes(4, "big") for k in keys]
            ends = [(i + 1) * block for i in range(len(keys))]
            asked.append(Group(ns, kind_of(g), mine, ends))
        answer = await lookup(c, asked, prefetch_timeout_s=10.0)
        try:
            pages = [0] * len(groups)
            for n, _ in answer.hits.values():
                pages[n] += 1
            return {"end": answer.end, "pages": pages}
        finally:
            for hit in answer.leases:
                await c.release(hit)


def group_figures(stored: dict[str, Any], read: dict[str, Any]) -> list[dict[str, Any]]:
    cached = read["end"]
    out = []
    for g, pages in zip(stored["groups"], read["pages"], strict=True):
        spec = g["spec"]
        out.append(
            {
                "kind": g["kind"],
                "window_tokens": g["window_tokens"],
                "page_tokens": spec["page_tokens"],
                "page_bytes": spec["page_bytes"],
                "page_bytes_per_token": spec["page_bytes"] / spec["page_tokens"],
                "pages_read_by_a_hit": pages,
                "bytes_per_cached_token": pages * spec["page_bytes"] / cached if cached else None,
            }
        )
    return out


def bench_model(python: Path, kind: str, tokens: int, count: int, rounds: int) -> dict[str, Any]:
    engine = tinyhybrid.ENGINE[kind]
    block = int(str(engine["block_size"]))
    options = ["--block-size", str(block), "--dtype", str(engine["dtype"])]
    model = hybrid_model_dir(python, kind)
    length = tokens + 256
    stored_prompts = prompts(1, tokens, count)
    warmup = ask(prompts(99, 64, 1)[0])
    tail = tokens - (tokens - 1) // block * block  # what a full hit leaves to compute
    shorts = [ask(p) for p in prompts(5, tail, count)]
    hits: list[dict[str, Any]] = []
    misses: list[dict[str, Any]] = []
    colds: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    startup: dict[str, list[float]] = {"store": [], "hicached": [], "without": []}
    with Daemon(size_mib=64 + ((rounds + 1) * count * tokens * 4096 >> 20)) as d:
        stored = run_engine(
            python,
            model,
            [ask(p, STORE_TOKENS) for p in stored_prompts],
            hicached=d.endpoint,
            max_model_len=length,
            extra=options,
            timeout=900,
        )
        startup["store"].append(stored["startup_s"])
        with d.client() as c:
            pages_stored = c.stats().pages
        keys = [bytes.fromhex(k) for k in stored["results"][0]["keys"]]
        read = asyncio.run(read_per_group(d.endpoint, stored["groups"], keys, block))
        for r in range(rounds):
            fresh = prompts(100 + r, tokens, count)  # never stored: misses
            pairs = [
                ask(p)
                for hit_and_miss in zip(stored_prompts, fresh, strict=True)
                for p in hit_and_miss
            ]
            with_ = run_engine(
                python,
                model,
                [warmup, *pairs],
                hicached=d.endpoint,
                max_model_len=length,
                extra=options,
                timeout=900,
            )
            hits += with_["results"][1::2]
            misses += with_["results"][2::2]
            startup["hicached"].append(with_["startup_s"])
            without = run_engine(
                python,
                model,
                [warmup, *(ask(p) for p in stored_prompts), *shorts],
                max_model_len=length,
                extra=options,
                timeout=900,
            )
            colds += without["results"][1 : 1 + count]
            floors += without["results"][1 + count :]
            startup["without"].append(without["startup_s"])
    hit_s, miss_s, cold_s = median_s(hits), median_s(misses), median_s(colds)
    groups = group_figures(stored, read)
    cached = read["end"]
    return {
        "model": kind,
        "vllm_groups": stored["kv_groups"],
        "block_tokens": block,
        "prompt_tokens": tokens,
        "prompts": count,
        "rounds": rounds,
        "pages_stored": pages_stored,
        "computed_tokens": {
            "with_hicached": computed(stored_prompts * rounds, hits),
            "without": computed(stored_prompts * rounds, colds),
        },
        "ttft_s_median": {
            "full_hit": hit_s,
            "miss_same_engine": miss_s,
            "recompute_without_hicached": cold_s,
            f"recompute_of_{tail}_tokens_alone": median_s(floors),
        },
        "ttft_s": {
            "full_hit": [round(r["elapsed_s"], 4) for r in hits],
            "miss_same_engine": [round(r["elapsed_s"], 4) for r in misses],
            "recompute_without_hicached": [round(r["elapsed_s"], 4) for r in colds],
        },
        "ttft_s_min": {
            "full_hit": min(r["elapsed_s"] for r in hits),
            "miss_same_engine": min(r["elapsed_s"] for r in misses),
            "recompute_without_hicached": min(r["elapsed_s"] for r in colds),
        },
        "recompute_vs_hit": {
            "same_engine": miss_s / hit_s,
            "engine_without_hicached": cold_s / hit_s,
            "engine_without_hicached_best_of_each": (
                min(r["elapsed_s"] for r in colds) / min(r["elapsed_s"] for r in hits)
            ),
        },
        "same_first_tokens": [r["token_ids"] for r in hits] == [r["token_ids"] for r in colds],
        "cached_tokens_of_a_hit": cached,
        "groups": groups,
        "bytes_per_cached_token": (
            sum(g["pages_read_by_a_hit"] * g["page_bytes"] for g in groups) / cached
            if cached
            else None
        ),
        "engine_startup_s": startup,
    }


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    started = time.monotonic()
    python = engine_python()
    out: dict[str, Any] = {
        "check": "hybrid_ttft",
        "models": [bench_model(python, kind, tokens, count, rounds) for kind in MODELS],
    }
    out["wall_s"] = time.monotonic() - started
    print(json.dumps(out))


if __name__ == "__main__":
    main()
