"""hicached as vLLM's host KV tier, through vLLM's OffloadingConnector.

    LLM(..., kv_transfer_config={
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "HicachedOffloadingSpec",
            "spec_module_path": "hicached.integrations.vllm",
            "endpoint": "ipc:///run/hicached/hicached.sock",  # optional
        },
    })

vLLM names each offloaded chunk (``blocks_per_chunk`` blocks, 1 unless set)
of each KV cache group by an *offload key*: the block hash of its last block
and the 4-byte index of the group. Block hashes chain over the token ids (and
the LoRA, the multimodal inputs, the cache salt), so a key names the whole
prefix up to its chunk's end. They are what the daemon keys a namespace of
scheme ``vllm-<hash algo>`` by; no token id reaches this module. Keys are only
shared between processes when the engine's ``prefix_caching_hash_algo`` is
reproducible: sha256 and sha256_cbor always are, xxhash and xxhash_cbor only
with PYTHONHASHSEED set.

One page holds one chunk of every layer of a group of every worker ("wide
pages": worker r copies at byte ``r * page_bytes // world_size``), so one key
and one lease cover what all workers hold, and the scheduler decides for all.
vLLM's other offload layouts are taken too (layouts.py): ``replicated_layout``
(MLA at TP > 1: one copy of the KV every rank holds alike, rank 0 writes it,
every rank reads it) and ``canonical_layout`` (vLLM's canonical pages, every
head and no parallelism, shared by every TP size of the model where vLLM
finds them parallelism-agnostic, refused with the reason elsewhere).
Hybrid models have several groups (full attention, sliding window, chunked
local attention, Mamba / GDN state): each has a namespace of its own, with
its own page size (groups.py), and a lookup reports a hit only up to where
every group can restore the prefix (hicached/integrations/hybrid.py).

The scheduler side (``HicachedManager``) never waits for the daemon in a
lookup: the keys a lookup pass shows are asked for together on a private
event loop thread, and the lookup answers RETRY (ask again next step) until
the answer is there; the step's end waits for it, ``lookup_wait_s`` at most,
so that the next step knows it. Hits come under a read lease, so the slots a load reads
cannot be evicted or reused under it; keys only L3 holds are loaded into L2
first and answer HIT_PENDING meanwhile. A store reserves slots
(``reserve_keys``, per group) and hands their handles to the workers; when
every worker has copied and said so (a small ipc socket: vLLM tells the
scheduler that a job ended, not whether it worked), the pages are committed,
a chunk only with every page of it the store names, the ones some worker
could not write left out. The worker side (``HicachedWorker``) copies
between vLLM's KV tensors and pool slots, each group's pages through its own
handle, without stalling the engine: submitting a transfer returns at once;
KV on a GPU is copied on a CUDA stream of the worker's own (one kernel over
a table of pieces where it can run, hicached/client/kernel.py), started from
a thread of its own, and a transfer is reported finished once its copies'
events completed and the fences after them held (for every group); KV in
host memory is copied in the submit call (``copy_thread``).

A daemon that is down or restarting costs hits, never a request: lookups
answer MISS, stores store nothing, and the daemon is tried again after
``retry_s``. vLLM (0.32, 0.33) cannot take a failed load: a load whose pages
became unreadable after their lookup (the daemon restarted in between and
this worker already saw the new one) is reported failed, and vLLM stops.

It runs under vLLM 0.32 and 0.33; what 0.33 added (expedited loads, the
manager's ``lock``, ``on_reset_flushed``, ``config_info``) is in
docs/engines.md, "vLLM 0.33".
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from hicached.integrations.common import settings_from
from hicached.integrations.vllm.groups import KVGroup, engine_groups
from hicached.integrations.vllm.manager import HicachedManager
from hicached.integrations.vllm.settings import INFO_KEYS, Settings
from hicached.integrations.vllm.worker import HicachedWorker

__all__ = ["HicachedOffloadingSpec", "KVGroup", "Settings", "engine_groups"]


# -- the spec vLLM loads ----------------------------------------------------------------


class HicachedOffloadingSpec(OffloadingSpec):
    """vLLM's entry point: ``spec_name`` HicachedOffloadingSpec in
    ``spec_module_path`` hicached.integrations.vllm."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings = settings_from(Settings, self.extra_config)
        self._check_hash_algo()
        self.groups = engine_groups(config, self.settings)
        # vLLM's connector then submits stores to rank 0 alone (one copy of the
        # pages every rank holds alike); the daemon's pool is shared memory, so
        # the one copy is every rank's (vLLM's CPU tier asks that of its region)
        self.replicated_layout = config.replicated_layout
        self._manager: HicachedManager | None = None
        self._worker: HicachedWorker | None = None

    def _check_hash_algo(self) -> None:
        """The hash algorithm set here must be the engine's; workers can tell."""
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None:  # the scheduler builds its connector outside that context
            return
        engine = vllm_config.cache_config.prefix_caching_hash_algo
        if engine != self.settings.hash_algo:
            raise ValueError(
                f"the engine hashes blocks with {engine!r} but kv_connector_extra_config "
                f"says hash_algo {self.settings.hash_algo!r}: set it to {engine!r}"
            )

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33: the ``vllm:kv_offload_config_info`` labels the manager
        fills (``HicachedManager.config_info``, one series per KV cache
        group's namespace)."""
        return INFO_KEYS

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = HicachedManager(
                self.settings, self.groups, self.config.parallel.world_size
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HicachedWorker(kv_caches, self.settings, self.config, self.groups)
        return self._worker
