"""Adversarial checks of the vLLM offload layouts (tests/engines/
vllm_layout_review_check.py, in the vLLM 0.32 venv against a real daemon,
vLLM's own connector classes at TP 1, 2 and 4 in rank processes; one rank's
copies fail by an injected fault where the test says so).

The packed-K/V test fails today: vLLM names both K/V arrangements of an NHD
cache ``v1-nhd`` (``canonical_format_id`` knows the layout family, not the
attention backend's packing), hicached's canonical namespace takes that
name, and an engine whose backend packs K and V per head loads another
engine's split K/V pages as its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engines import vllm_engine

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "engines" / "vllm_layout_review_check.py"


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    return vllm_engine.check_facts(CHECK, size_mib=8)


def test_packed_kv_engine_never_loads_split_kv_pages_as_its_own(facts: dict[str, Any]) -> None:
    got = facts["packed"]
    assert "error" not in got, got
    # vLLM certifies the packed cache under the split one's name: hicached's worker
    # refuses canonical pages there, at its start, rather than load them as its own
    assert got["same_namespace"], got
    assert str(got["packed_worker"]).startswith("refused: "), got
    assert "keep K and V packed per head" in got["packed_worker"], got


@pytest.mark.parametrize("way", ["2to4", "4to2"])
def test_canonical_pages_cross_tp_sizes(facts: dict[str, Any], way: str) -> None:
    got = facts["cross_tp"]
    assert "error" not in got, got
    assert got[way]["lookups"] == ["HIT"] * 3
    assert got[way]["each_rank_loaded_its_heads"] == [True] * int(way[-1])


def test_replicated_store_is_no_hit_before_rank_0_copied(facts: dict[str, Any]) -> None:
    rep = facts["replicated"]
    assert "error" not in rep, rep
    assert rep["slow_hit_before_rank0"] is False
    assert rep["slow_pages_in_pool"] == 3
    assert rep["slow_hit_after_rank0"] == ["HIT"] * 3


def test_replicated_store_rank_0_failed_is_never_a_hit(facts: dict[str, Any]) -> None:
    rep = facts["replicated"]
    assert rep["failed_any_hit"] is False
    assert rep["failed_pages_committed"] == 0
