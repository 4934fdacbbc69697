"""hicached as SGLang's HiCache storage backend (the L3 tier of its host cache).

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicached",
        "module_path": "hicached.integrations.sglang", "class_name": "HicachedStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
        "endpoint": "ipc:///run/hicached/hicached.sock"}'

``interface_v1`` makes SGLang call the zero-copy methods: pages go straight
between SGLang's host KV pool and the daemon's slots, one copy each way.
Without it SGLang hands over flat page copies (``batch_get``/``batch_set``);
both store the same bytes. ``hicache_storage_pass_prefix_keys`` makes SGLang
say which pages come before a store's (``extra_info.prefix_keys``): each
store is linked to the page before it, so L2 evicts a sequence from its tail.

SGLang names a page by a 64-hex SHA-256 chained over its token ids (and the
request's extra key and cache salt), with no rank, model or layout in it, so
the namespace carries those: scheme ``sglang-sha256``, the model, the host
pool's dtype and layout, the page geometry, and the TP, CP and PP ranks.
MLA KV is the same on every TP rank: one replicated namespace, which only
SGLang's storage writer (TP rank 0) writes.

Hybrid models (SGLang's v2 calls): beside the KV pool, SGLang registers a
host pool per kind of state (``PoolName``: Mamba state, sliding-window KV, a
draft model's KV, a sparse indexer, DeepSeek V4's compressed pools, ...).
Each pool's pages are a namespace of their own, its layout prefixed with the
pool's name, under the same page hashes: a page of a pool is what SGLang's
flat data page holds for one KV page's key (one Mamba state, one page of a
window). A prefix is a hit only if the KV pool and every pool of the query
can restore it by their hit policies (``hits.py``); a store publishes a page
in every pool of the call or in none (``moves.py``). Mamba state is TP
sharded even beside MLA KV, so each rank stores its own. DeepSeek V4's KV
pool is a logical anchor without bytes: its pages live in the sidecars.

A page of the KV pool is several regions of it (K and V for page-major
layouts, K and V of every layer for ``layer_first``); their order is the one
``get_data_page(flat=True)`` gives, and registration checks them against the
pool's own ``get_page_buffer_meta`` (``pages.py``).

SGLang calls a backend from three threads (existence queries, prefetch
reads, write-backs); each gets a client of its own (``link.py``). A daemon
that is down costs hits, never a request or a thread: queries answer 0,
reads and writes answer False per page, and the daemon is tried again after
``retry_s``. Input that breaks SGLang's contract (host indices that do not
cover the keys' KV pages, a pool never registered, a hit policy SGLang's
own backends do not answer) raises ``ValueError``, which SGLang logs; a
sidecar's indices that do not cover its pages make its pages misses, as in
SGLang's own backends. A key that is not a page hash is a miss, and so is
every key after it. A page hash given twice in one call goes to the daemon
once, which takes a key once in a reservation or a prefetch, and its answer
goes to every page that names it (``pages.once``).
"""

from hicached.integrations.sglang.pages import namespace_fields, page_segments
from hicached.integrations.sglang.storage import HicachedStorage, Settings

__all__ = ["HicachedStorage", "Settings", "namespace_fields", "page_segments"]
