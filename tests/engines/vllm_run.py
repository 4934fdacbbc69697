"""Runs in the vLLM venv (tests/engines/venv.py): one vLLM engine process that
answers some prompts and prints what it did as JSON.

    python vllm_run.py MODEL_DIR REQUESTS_JSON OUT_JSON [--hicached ENDPOINT]
                       [--executor uni|mp] [--hash-algo ALGO] [--max-model-len N]
                       [--blocks-per-chunk N] [--copy-thread] [--tensor-parallel-size N]
                       [--block-size N] [--dtype DTYPE]

REQUESTS_JSON is a file holding a list of requests, answered one after
another: ``{"prompt": [token ids], "max_tokens": N}``, and ``"wait_for":
PATH`` to have the engine stop before that request until PATH exists (it
writes PATH.ready first: the caller may then change the world around it),
``"reset": true`` to empty the engine's own prefix cache before it. Greedy sampling, the
chosen token's logprob, no tokenizer (token ids in and out). With
``--hicached`` the engine's host KV tier is hicached through vLLM's
OffloadingConnector (hicached.integrations.vllm), at that endpoint; without
it, the engine runs alone. The answer, in OUT_JSON (the engine logs to stdout)::

    {"vllm": version, "startup_s": s, "results": [
        {"token_ids": [...], "logprobs": [...], "num_cached_tokens": n,
         "prompt_tokens": n, "elapsed_s": s}, ...]}

``elapsed_s`` is the wall time of that request alone: with ``max_tokens`` 1,
its time to first token. ``keys`` are the offload keys of the prompt's full
chunks, hex, as vLLM's own block hashing makes them (KV cache group 0's; the
last four bytes are the group index); with ``--hicached``, ``namespace`` is the
namespace the engine registered for its first group and ``groups`` every
group's (index, kind, window in tokens, bytes a block, namespace), and
``kv_groups`` the kinds of vLLM's own KV cache groups (``uni`` only: read from the scheduler in this
process). ``--executor uni`` runs the scheduler and the model
in this one process (quick to start); ``mp`` runs the model in a worker
process of its own, as vLLM does by default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tests.engines import leave

BLOCK_TOKENS = 32  # the CPU backend takes multiples of 32 (the default --block-size)
KV_CACHE_BYTES = 64 << 20


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("requests")
    ap.add_argument("out")
    ap.add_argument("--hicached", metavar="ENDPOINT", default="")
    ap.add_argument("--executor", choices=("uni", "mp"), default="uni")
    ap.add_argument("--hash-algo", default="sha256")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--blocks-per-chunk", type=int, default=1)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--copy-thread", action="store_true", help="worker copies on a thread")
    ap.add_argument("--lookup-wait-s", type=float, default=None, help="hicached's lookup_wait_s")
    ap.add_argument("--block-size", type=int, default=BLOCK_TOKENS)
    ap.add_argument("--dtype", default="float32")
    return ap.parse_args(argv)


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(args.max_model_len, 2048),
        enforce_eager=True,
        block_size=args.block_size,
        enable_prefix_caching=True,
        prefix_caching_hash_algo=args.hash_algo,
        max_num_seqs=4,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if args.executor == "uni":
        kwargs["distributed_executor_backend"] = "uni"
    if args.hicached:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "HicachedOffloadingSpec",
                "spec_module_path": "hicached.integrations.vllm",
                "endpoint": args.hicached,
                "hash_algo": args.hash_algo,
                "blocks_per_chunk": args.blocks_per_chunk,
                **({"copy_thread": True} if args.copy_thread else {}),
                **({} if args.lookup_wait_s is None else {"lookup_wait_s": args.lookup_wait_s}),
            },
        }
    return kwargs


def offload_keys(prompt: list[int], args: argparse.Namespace) -> list[str]:
    """The keys the OffloadingConnector gives the prompt's full chunks: the hash of
    each chunk's last block and the group index (0), by vLLM's own functions."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kv

    hash_fn = get_hash_fn_by_name(args.hash_algo)
    kv.init_none_hash(hash_fn)
    parent = None
    keys = []
    size = args.block_size
    for block, start in enumerate(range(0, len(prompt) - size + 1, size)):
        parent = kv.hash_block_tokens(hash_fn, parent, prompt[start : start + size])
        if (block + 1) % args.blocks_per_chunk == 0:
            keys.append((bytes(parent) + (0).to_bytes(4, "big")).hex())
    return keys


def scheduler(llm: Any) -> Any:
    """The engine's scheduler, when it runs in this process (``uni``)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return None if core is None else core.scheduler


def namespaces(llm: Any) -> dict[str, Any]:
    """What hicached's manager registered, per KV cache group, from the scheduler."""
    import msgspec

    found = scheduler(llm)
    if found is None:  # the scheduler runs in a process of its own
        return {"namespace": None, "groups": None}
    manager = found.connector.connector_scheduler.manager
    groups = [
        {
            "group": g.group_id,
            "kind": g.kind.name,
            "window_tokens": getattr(g.kind, "tokens", None),  # None: the whole prefix
            "block_bytes": g.block_bytes,
            "spec": msgspec.to_builtins(g.spec),
        }
        for g in manager.groups
    ]
    return {"namespace": msgspec.to_builtins(manager.namespace), "groups": groups}


def kv_groups(llm: Any) -> list[str] | None:
    """The kinds (spec class names) of vLLM's own KV cache groups (``uni``)."""
    found = scheduler(llm)
    if found is None:
        return None
    return [type(g.kv_cache_spec).__name__ for g in found.kv_cache_config.kv_cache_groups]


def wait_for(path: str, timeout: float = 120.0) -> None:
    """Say this engine is ready for ``path``, then wait (bounded) until it exists."""
    with open(path + ".ready", "w"):
        pass
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {timeout:.0f}s")
        time.sleep(0.05)


def answer(llm: Any, request: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    if "wait_for" in request:
        wait_for(request["wait_for"])
    if request.get("reset"):
        assert llm.reset_prefix_cache(), "the engine's prefix cache was not emptied"
    params = SamplingParams(
        max_tokens=request["max_tokens"],
        temperature=0.0,
        logprobs=0,  # the chosen token's own logprob only
        detokenize=False,
        ignore_eos=True,
    )
    started = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": request["prompt"]}], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    completion = out.outputs[0]
    steps = completion.logprobs or []
    chosen = [step[token].logprob for token, step in zip(completion.token_ids, steps, strict=True)]
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": chosen,
        "num_cached_tokens": out.num_cached_tokens,
        "prompt_tokens": len(request["prompt"]),
        "elapsed_s": elapsed,
        "keys": offload_keys(request["prompt"], args),
    }


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.executor == "uni":
        # the engine core in this process too: no process of its own to start
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with open(args.requests) as f:
        requests = json.load(f)
    import vllm

    started = time.perf_counter()
    llm = vllm.LLM(**engine_args(args))
    startup = time.perf_counter() - started
    results = [answer(llm, request, args) for request in requests]
    out = {
        "vllm": vllm.__version__,
        "startup_s": startup,
        "results": results,
        "kv_groups": kv_groups(llm),
        **(namespaces(llm) if args.hicached else {"namespace": None, "groups": None}),
    }
    del llm  # shut the engine down before the answer goes out
    with open(args.out, "w") as f:
        json.dump(out, f)
    leave()  # the engine is down and its answer written


if __name__ == "__main__":
    main(sys.argv[1:])
