"""hicached's vLLM tier under vLLM's offload layouts beside the default one,
``replicated_layout`` and ``canonical_layout``, with vLLM 0.32's own classes
against a real daemon (tests/engines/vllm_layout_check.py, run in the vLLM
venv): vLLM's connector in the scheduler role in one process and in the
worker role in one process per rank, at TP 2 (and 1 and 4), configured by
vLLM's ``EngineArgs`` and ``get_kv_cache_configs`` for a tiny MLA model and
a tiny GQA one. (vLLM's CPU build runs no model at TP > 1 on this host kind,
so no engine generates tokens here.)

- replicated (MLA at TP 2): vLLM sets ``replicated_layout``; rank 0 alone
  stores, one copy of each page (pages of one worker's bytes), which both
  ranks load byte for byte; the replicated namespace and the per-rank one
  never find each other's keys.
- canonical (GQA at TP 2): both ranks write their heads into one page that
  holds every head, as a TP 1 engine holds its blocks; a TP 1 engine finds
  those pages (the same namespace) and loads its whole blocks from them;
  the direct namespace never finds them. MLA at TP 2: the latent is written
  once a page, by the rank whose turn the page is. 2 KV heads at TP 4: each
  head once in the page, every rank loads its head back.
- refused, with the reason: canonical under PP, with KV quantized per token
  and head, and on a worker whose KV layout vLLM cannot certify.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engines import vllm_engine

# The first test may wait for the venv build (minutes, once per pin and machine).
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "engines" / "vllm_layout_check.py"


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    return vllm_engine.check_facts(CHECK, size_mib=8)  # a slab for each page size


def test_replicated_pages_are_one_copy_rank_0_writes(facts: dict[str, Any]) -> None:
    rep = facts["replicated"]
    assert rep["vllm_replicated_layout"] is True  # vLLM's own choice for MLA at TP 2
    assert rep["spec"] == {"replicated": True, "shards": 1}
    assert rep["page_bytes"] == rep["block_bytes"]  # one worker's bytes, not two
    assert rep["direct_spec"] == {"replicated": False, "shards": 2}
    # vLLM's connector submits the store to rank 0 alone; both report it done
    assert rep["stores"] == [
        {"completed": True, "submitted": True},
        {"completed": True, "submitted": False},
    ]
    assert rep["pages_committed"] == 4
    assert rep["pool_bytes_used"] == 4 * rep["block_bytes"]
    assert rep["pages_are_rank0s_blocks"]


def test_every_rank_loads_the_one_copy_byte_for_byte(facts: dict[str, Any]) -> None:
    rep = facts["replicated"]
    assert rep["lookups"] == ["HIT"] * 4
    assert rep["loads_finished"] == [True, True]
    assert rep["ranks_loaded_the_same_bytes"]
    assert rep["loaded_rank0s_blocks"]  # rank 1 held other bytes: it read rank 0's copy


def test_replicated_and_per_rank_namespaces_never_share_keys(facts: dict[str, Any]) -> None:
    rep = facts["replicated"]
    assert rep["digests_differ"]
    assert rep["direct_hits_of_replicated_keys"] == 0
    assert rep["direct_hits_of_direct_keys"] == 2  # they are there, in their own namespace
    assert rep["replicated_hits_of_direct_keys"] == 0


def test_canonical_pages_hold_every_head_in_vllms_order(facts: dict[str, Any]) -> None:
    can = facts["canonical"]
    assert can["vllm"] == {"canonical_layout": True, "is_parallelism_agnostic": True}
    assert can["spec"] == {
        "layout": "vllm_canon_v1_nhd_b16",  # vLLM's canonical format, version 1, NHD
        "tp": [0, 1],  # no TP coordinates: the same for every TP size
        "shards": 1,
        "page_bytes": 2 * 8192,  # two layers of 4 heads x 16 tokens x 32 x K, V in bf16
    }
    assert [s["submitted"] for s in can["stores"]] == [True, True]  # both write their heads
    assert can["pages_are_every_head_in_order"]


def test_an_engine_at_tp_1_loads_what_tp_2_stored(facts: dict[str, Any]) -> None:
    can = facts["canonical"]
    assert can["tp1_same_namespace"]
    assert can["tp1_lookups"] == ["HIT"] * 4
    assert can["tp1_loaded_whole_blocks"]


def test_canonical_and_direct_namespaces_never_share_keys(facts: dict[str, Any]) -> None:
    can = facts["canonical"]
    assert can["direct_layout"] == "vllm_lbnhc_b16"
    assert can["digests_differ"]
    assert can["direct_hits_of_canonical_keys"] == 0


def test_bytes_several_ranks_hold_are_written_once_in_turn(facts: dict[str, Any]) -> None:
    turns = facts["turns"]
    assert turns["vllm_replicated_layout"] is True
    assert turns["page_bytes"] == 2 * 2560  # the latent of two layers, once
    assert [s["submitted"] for s in turns["stores"]] == [True, True]
    assert turns["writer_of_each_page"] == [[p] for p in turns["slot_parity"]]
    assert set(turns["slot_parity"]) == {0, 1}  # both ranks took turns


def test_heads_tp_replicates_are_stored_once_and_loaded_by_all(facts: dict[str, Any]) -> None:
    tp4 = facts["tp4"]
    assert tp4["page_bytes"] == 2 * 4096  # two layers of 2 heads, each once
    assert tp4["pages_are_every_head_once"]
    assert tp4["lookups"] == ["HIT"] * 4
    assert tp4["each_rank_loaded_its_head"] == [True] * 4


def test_canonical_layout_is_refused_where_it_would_not_be_portable(
    facts: dict[str, Any],
) -> None:
    refused = facts["refused"]
    assert "tensor parallelism alone" in refused["pp"] and "PP 2" in refused["pp"]
    assert "quantized per token and head" in refused["per_token_head"]
    assert "could not certify this worker's physical KV layout" in refused["uncertified_worker"]
