"""What hicached's vLLM tier may be told (``kv_connector_extra_config``), the
key scheme of an engine's namespaces (hicached/integrations/vllm/groups.py
makes them), and the labels vLLM 0.33 shows of each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import Annotated

import msgspec

from hicached.errors import DaemonUnavailable, DeadlineExceeded
from hicached.integrations.common import Seconds, Timeout
from hicached.wire.namespace import NamespaceSpec

# Hash algorithms whose keys are the same in every process, and those that are
# only with PYTHONHASHSEED set (vLLM seeds them at random otherwise).
REPRODUCIBLE = ("sha256", "sha256_cbor")
SEEDED = ("xxhash", "xxhash_cbor")
# Errors that mean "the daemon is not there now": try again after retry_s.
UNREACHABLE = (
    DaemonUnavailable,
    DeadlineExceeded,
    TimeoutError,
    asyncio.TimeoutError,
    concurrent.futures.TimeoutError,
)


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``kv_connector_extra_config`` may set for hicached (beside vLLM's own keys)."""

    # The daemon's socket; "" = $HICACHED_ENDPOINT, else the default one.
    endpoint: str = ""
    # Namespace model name; "" = vLLM's model name made safe.
    model: str = ""
    # Namespace revision; "" = "main", or a digest of the path of a local model directory.
    revision: str = ""
    # Namespace tenant (a daemon with [tenants] sets it from the connection).
    tenant: str = "default"
    # The engine's prefix_caching_hash_algo (vLLM's default: sha256).
    hash_algo: str = "sha256"
    # Seconds one request to the daemon may take (a store's reserve holds up the
    # scheduler that long at most).
    timeout_s: Timeout = 1.0
    # Seconds after the daemon was found unreachable before it is tried again.
    retry_s: Seconds = 10.0
    # Seconds a finished store waits for every worker's word before it gives up.
    ack_timeout_s: Timeout = 5.0
    # Seconds an L3 load may take; the pages loaded by then are served.
    prefetch_timeout_s: Seconds = 10.0
    # Seconds the scheduler waits, at the end of a step that asked the daemon
    # about new keys, for the answer (one round trip, under a millisecond on an
    # idle host): the next step's lookups then know them. 0: never wait, the
    # answer is taken whenever the link's thread has it (on a busy engine loop,
    # a few steps later: that thread must first win the GIL). A daemon slower
    # than this costs a step's wait, never a lookup's answer. 0 to 1 s: the
    # wait holds the scheduler's step (NaN, infinity or more are refused here,
    # not found as a step that spins or raises).
    lookup_wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.005
    # Seconds a lookup answer is reused before the keys are asked for again.
    answer_ttl_s: Timeout = 2.0
    # A hit whose lease ends sooner than this is asked for again, not loaded.
    lease_slack_s: Seconds = 5.0
    # Transfers start on a thread of their own (true) or in the submit call
    # (false); unset: a thread for KV on a GPU, so that adopting a handle (after
    # a daemon restart, a hello to the new one) stays off the engine's thread,
    # in the submit call for KV in host memory, where a copy is a memcpy on the
    # engine's own cores and a thread would first have to win the GIL from the
    # busy engine loop. KV on a GPU is copied on a CUDA stream of the worker's
    # own either way, and nothing waits for it.
    copy_thread: bool | None = None


# -- the key scheme ---------------------------------------------------------------------


def key_scheme(hash_algo: str) -> str:
    """The namespace key scheme of vLLM keys hashed with ``hash_algo``."""
    if hash_algo in REPRODUCIBLE:
        return f"vllm-{hash_algo}"
    if hash_algo in SEEDED:
        if os.environ.get("PYTHONHASHSEED") is None:
            raise ValueError(
                f"prefix_caching_hash_algo {hash_algo!r} gives every process its own random "
                "block hashes, so no other engine could use the pages this one stores: set "
                "PYTHONHASHSEED to the same value for every engine, or use sha256"
            )
        return f"vllm-{hash_algo}"
    raise ValueError(f"unknown prefix_caching_hash_algo {hash_algo!r}")


# -- what vLLM 0.33 shows of it -------------------------------------------------------

# The labels of vLLM 0.33's ``vllm:kv_offload_config_info`` that hicached fills:
# facts fixed for the engine's life (the pool is the daemon's, so its size is not).
INFO_KEYS = (
    "hicached_model",
    "hicached_revision",
    "hicached_key_scheme",
    "hicached_layout",
    "hicached_page_tokens",
    "hicached_page_bytes",
)


def info_labels(spec: NamespaceSpec) -> dict[str, str | int]:
    """The labels of ``INFO_KEYS`` for the namespace ``spec``: its model (the
    ``{model}`` of hicached's event topics) and revision, its key scheme (the
    engine's hash algorithm), its layout (which tells the namespaces of a
    hybrid model's KV cache groups apart: one series each), and one page's
    tokens and bytes (every worker's part). Not the tenant: a daemon with
    tenants sets it from the connection."""
    return {
        "hicached_model": spec.model,
        "hicached_revision": spec.revision,
        "hicached_key_scheme": spec.key_scheme,
        "hicached_layout": spec.layout,
        "hicached_page_tokens": spec.page_tokens,
        "hicached_page_bytes": spec.page_bytes,
    }
