"""Adversarial checks of hicached's vLLM scheduler side (tests/engines/
vllm_manager_review_check.py, in the vLLM 0.32 venv against a real daemon,
vLLM's own lookup loop deciding each hit from the manager's answers; the
faults it injects are named there). One check runs vLLM's scheduler side
whole, from a token budget's lookup to the load its worker runs.
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
    # a second daemon takes 1 page a request (the limit scenario)
    return vllm_engine.check_facts(CHECK, size_mib=2, max_pages=1)


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


def test_a_budget_that_ends_a_hybrid_hit_inside_a_chunk_loads_the_window_it_needs(
    facts: dict[str, Any],
) -> None:
    """A token budget ends vLLM's hit at token 129, inside chunk 9 of 16 tokens;
    the 32-token sliding window that ends there reaches into chunk 7, so vLLM
    asks the window group for three chunks (``load_window_size_in_chunks``),
    one more than the window's two at a chunk's end. The manager leases and
    answers HIT for that chunk too (the window's ``lead``, from vLLM's spec),
    so the hit is the budget's end, not a miss, and the load vLLM plans reads
    the bytes stored from each block it fills."""
    got = facts["budget"]
    assert "error" not in got, got["error"]
    assert got["window_chunks"] == 2 and got["load_window_chunks"] == 3
    a = got["A"]
    assert a["hit"] == 129, a  # a miss (0) when the chunk before the window is not answered
    assert a["window_lookups"] == ["HIT"] * 3
    assert a["loaded"] == [list(range(9)), [6, 7, 8]], a
    assert a["finished"] and a["same"], a
    assert got["kinds"] == [["full", 0], ["sliding32", 16]]  # groups.kind_of's lead


def test_a_budget_hit_whose_chunk_before_the_window_is_gone_falls_back(
    facts: dict[str, Any],
) -> None:
    """Prompt B lacks the window's chunk 7: with the budget, vLLM's backward scan
    meets a MISS there and, the answer naming no window at an earlier end, finds
    no hit at all (a miss, never a load of a chunk that is not there); without
    a budget the hit ends at the last whole chunk, whose window does not need
    that chunk, and loads what was stored."""
    got = facts["budget"]
    assert "error" not in got, got["error"]
    b = got["B"]
    assert b["hit"] == 0 and "loaded" not in b, b
    assert b["window_lookups"][:3] == ["HIT", "HIT", "MISS"], b
    whole = got["B_whole"]
    assert whole["hit"] == 192, whole
    assert whole["loaded"] == [list(range(12)), [10, 11]], whole
    assert whole["finished"] and whole["same"], whole


def test_an_mtp_window_hit_one_token_before_a_chunk_end_loads_the_window_it_needs(
    facts: dict[str, Any],
) -> None:
    """A sliding window of 32 tokens with one extra retained token (vLLM's
    engine sets it for multi-module MTP of two speculative tokens), a prompt
    of twelve whole 16-token chunks, every chunk of both groups stored, no
    token budget: vLLM ends the hit at 191, one token before the last chunk's
    end, and the window that ends there with the extra token reaches into
    chunk 10 (index 9), so vLLM asks the window group for three chunks
    (``load_window_size_in_chunks``), one more than its two at a chunk's end.
    The window's ``lead`` answers that chunk too, so the hit is restored and
    each block loaded holds the bytes stored from it."""
    got = facts["mtp"]
    assert "error" not in got, got["error"]
    assert got["extra_retained"] == 1
    assert got["window_chunks"] == 2 and got["load_window_chunks"] == 3
    a = got["A"]
    assert a["hit"] == 191, a  # a miss (0) without the window's lead
    assert a["window_lookups"] == ["HIT"] * 3
    assert a["loaded"] == [list(range(12)), [9, 10, 11]], a
    assert a["finished"] and a["same"], a
    assert got["kinds"] == [["full", 0], ["sliding32", 16]]  # groups.kind_of's lead


def test_vllms_window_widening_never_needs_more_than_the_windows_lead(
    facts: dict[str, Any],
) -> None:
    """vLLM widens a sliding window at a hit end ``right_padding`` tokens before
    a chunk's end to ``cdiv(sliding_window - 1 + extra_retained_tokens +
    right_padding, chunk)`` chunks, at most one chunk beyond the window it
    asks for at a chunk's end (right_padding < chunk), whatever the extra
    retained tokens: the lead of one chunk that kind_of gives every sliding
    window covers every widening, over windows, extra retained tokens, chunk
    sizes and hit ends, and is never more than vLLM's widening can use."""
    got = facts["widening"]
    assert "error" not in got, got["error"]
    assert got["short"] == 0, got
    assert got["most"] == 1 and got["leads"] == [1], got


def test_a_drafters_window_group_loads_the_window_vllm_asks_one_chunk_past_the_hit(
    facts: dict[str, Any],
) -> None:
    """The sliding window group holds an EAGLE/MTP drafter's layers (vLLM's
    ``is_eagle_group``): vLLM asks it for one chunk past the hit's end and a
    window one chunk longer, then drops that chunk from the hit. A whole
    prompt of twelve chunks hits 176 tokens (eleven chunks), its window's
    three chunks answered (the window's two at the last chunk's end and its
    lead); a budget that ends the hit at 129, inside chunk 9, widens the
    window too, to four chunks ending at chunk 10: the drafter's lead of two
    chunks answers them, so that hit is restored too (a miss with a lead of
    one), each block loaded holding the bytes stored from it."""
    got = facts["eagle"]
    assert "error" not in got, got["error"]
    assert got["eagle"] == [False, True]
    a, b = got["A"], got["B"]
    assert a["hit"] == 176, a
    assert a["window_lookups"] == ["HIT"] * 3
    assert a["loaded"] == [list(range(11)), [9, 10]], a
    assert a["finished"] and a["same"], a
    assert b["hit"] == 129, b  # a miss (0) with a lead of one chunk
    assert b["window_lookups"] == ["HIT"] * 4
    assert b["loaded"] == [list(range(9)), [6, 7, 8]], b
    assert b["finished"] and b["same"], b
    assert got["kinds"] == [["full", 0], ["sliding32", 32]]  # groups.kind_of's lead


def test_a_daemon_that_takes_one_page_a_request_is_asked_and_stored_in_parts(
    facts: dict[str, Any],
) -> None:
    """A daemon whose server.max_pages_per_request is 1 and a prompt of ten whole
    chunks of both groups: the store vLLM prepares reserves every chunk of
    each group, a reservation a key, and vLLM is told it stores them all; the
    lookup asks about a key a request, and the hit is all ten chunks (the
    sliding window's last two), each group's read through a lease a chunk and
    every block loaded holding the bytes stored from it (before, a longer
    request was cut at the daemon's limit: four chunks with a limit of four)."""
    got = facts["limit"]
    assert "error" not in got, got["error"]
    every = list(range(10))
    assert got["stored"] == [every, every], got
    a = got["A"]
    assert a["hit"] == 10 * 16, a
    assert a["loaded"] == [every, [8, 9]], a
    assert a["finished"] and a["same"], a


def test_a_commit_whose_answer_never_comes_ends_every_reservation_of_its_store(
    facts: dict[str, Any],
) -> None:
    """A store of ten chunks of both groups to a daemon that takes one page a
    request: twenty reservations. The first one's commit got no answer in
    time (fault injection: TimeoutError from the manager's client). The parts
    after it publish nothing, and every reservation ends at once (before,
    the parts after it, and it, held their slots until their lease's end)."""
    got = facts["commit_timeout"]
    assert "error" not in got, got["error"]
    assert got["commits"] == 1, got  # no part after the failed one is committed
    assert got["leases"] and got["left"] == 0, got


def test_a_store_enters_each_run_of_chunks_under_the_chunk_before_it(
    facts: dict[str, Any],
) -> None:
    """Stores of chunks 0-2, 3-4, then 6, 8 and 9 of one request (vLLM's keys,
    both groups): a reservation a run of chunks that follow one another,
    under the chunk before the run where the manager knows it (chunk 3's
    under chunk 2, stored by the store before); chunk 6 and chunk 8 follow
    a hole, under none. Before, the third store was one reservation under
    chunk 4, entering chunk 6 under 4 and chunk 8 under 6 in L2 (their
    BlockStored parents)."""
    got = facts["parents"]
    assert "error" not in got, got["error"]
    stores = [[([0, 1, 2], None)], [([3, 4], 2)], [([6], None), ([8, 9], None)]]
    want = [[g, chunks, up] for runs in stores for g in (0, 1) for chunks, up in runs]
    assert got["reservations"] == want, got
