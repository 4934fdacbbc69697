"""Adversarial checks of hicached's vLLM scheduler side (tests/engines/
vllm_manager_review_check.py, in the vLLM 0.32 venv against a real daemon,
vLLM's own lookup loop deciding each hit from the manager's answers; the
faults it injects are named there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engines import vllm_engine

# The first test may wait for the venv build (minutes, once per pin and machine).
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "engines" / "vllm_manager_review_check.py"


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    return vllm_engine.check_facts(CHECK, size_mib=2)


def test_an_answer_that_goes_stale_mid_pass_still_serves_the_load_its_hits_start(
    facts: dict[str, Any],
) -> None:
    """vLLM counts the HITs of a lookup pass up to the first MISS and then loads
    them; the answer those HITs came from must still be there for
    ``prepare_load``, even if it goes stale (its ``until`` passes) and the
    link is found down between two lookups of the pass."""
    got = facts["stale_mid_pass"]
    assert "error" not in got, got["error"]
    assert got["first"] is None  # asked at the first step's end
    # the pass reads one answer: every key a HIT, and the load takes them all
    # (it tripped "a load of keys never found" when the third lookup dropped it)
    assert got["seen"] == ["HIT"] * 4, got
    assert got["second"] == 4
    assert got["load"] == 4, got


def test_a_hybrid_hit_needs_the_windows_pages_at_its_end(facts: dict[str, Any]) -> None:
    """Full attention holds six chunks of both prompts; the sliding window
    (two chunks) holds A's chunks 5 and 6, but only B's chunk 5: A hits all
    six chunks and loads six full-attention pages and two window pages; B,
    whose window at chunk 6 was never stored (and at chunk 5 lacks chunk 4),
    is a miss in vLLM's own lookups, never a partial hit."""
    got = facts["hybrid"]
    assert "error" not in got, got["error"]
    assert got["A"]["first"] == [None, None]  # asked at the step's end
    assert got["A"]["second"] == [6, 6]
    assert got["A"]["load"] == [6, 2]
    assert got["B"]["second"] == [0, 0], got["B"]  # no group reports a hit
    assert "load" not in got["B"]
