"""hicached's vLLM worker side against vLLM 0.32's OffloadingWorker contract,
with a real daemon: ``submit_*`` return while the copy is still under way,
``get_finished`` reports a transfer only once its copy is done and the fence
after it held, ``wait`` returns once the job is done, and a load whose slots
change owner after its bytes moved but before it is reported is reported
failed. And vLLM 0.33's expedited load (``submit_load(..., expedited=True)``,
then ``wait``, as its connector makes a synchronous load): submission returns
at once, the load goes ahead of one queued before it, and it is in place,
its fence checked, when ``wait`` returns; a load ``wait`` finds unfinished at
its deadline raises. KV in host memory, the copy thread on (off for one
expedited load, which is then in place when submitted); fault injection holds each
copy at a gate (tests/engines/vllm_worker_check.py, which runs in the vLLM
venv, built on first use by tests/engines/venv.py). The same worker with KV
on a GPU copies on a CUDA stream of its own (tests/test_cuda.py covers the
copies; this host kind has no GPU for vLLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engines import vllm_engine

# The first test may wait for the venv build (minutes, once per pin and machine).
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "engines" / "vllm_worker_check.py"


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    return vllm_engine.check_facts(CHECK)  # a daemon of 1 MiB: 512 slots of 2 KiB pages


def test_a_store_is_reported_only_after_its_copy(facts: dict[str, Any]) -> None:
    assert facts["store_submitted"] is True
    assert facts["store_copy_began"]
    assert facts["store_reported_while_held"] == [], "reported before the copy was done"
    assert not facts["store_word_while_held"], "the scheduler heard of a store not yet copied"
    assert facts["store_result"] is True
    assert facts["store_word"] == [1, 1, 1, 1]
    assert facts["stored_bytes_equal"]


def test_a_load_is_reported_only_after_its_copy(facts: dict[str, Any]) -> None:
    assert facts["load_submitted"] is True
    assert facts["load_copy_began"]
    assert facts["load_reported_while_held"] == [], "reported before the copy was done"
    assert facts["load_result"] is True
    assert facts["loaded_bytes_equal"]


def test_wait_returns_once_the_job_is_done(facts: dict[str, Any]) -> None:
    assert facts["gate_open_when_wait_returned"], "wait returned while the copy was held"
    assert facts["reported_after_wait"] == [[3, True]]


def test_a_load_whose_slots_moved_before_it_was_reported_fails(facts: dict[str, Any]) -> None:
    assert facts["stale_copied"]  # its bytes had moved
    assert facts["slots_taken"] >= 4  # the pool's slots went to other pages
    assert facts["stale_result"] is False


def test_an_expedited_load_goes_ahead_and_is_done_when_wait_returns(
    facts: dict[str, Any],
) -> None:
    assert facts["regular_held"]  # the thread holds a regular load at the gate
    assert facts["expedited_submitted"] is True
    assert facts["expedited_returned_while_held"], "submitting an expedited load waited"
    assert facts["expedited_loaded_when_wait_returned"]
    # started (and so reported) before the load submitted ahead of it
    assert facts["reported_in_order"] == [[10, True], [12, True], [11, True]]


def test_an_expedited_load_copied_in_the_submit_call_is_there_at_once(
    facts: dict[str, Any],
) -> None:
    assert facts["inline_loaded_at_return"]
    assert facts["inline_reported"] == [[13, True]]


def test_a_load_unfinished_at_the_wait_deadline_raises(facts: dict[str, Any]) -> None:
    assert "did not finish" in facts["late_load_wait"], facts["late_load_wait"]
    assert not facts["gate_open_when_it_raised"]  # it raised while the copy was held
    assert facts["late_load_result"] is True  # reported once its copy is done
