"""hicached's vLLM scheduler side under vLLM 0.33's rules, with a real daemon
(tests/engines/vllm_manager_check.py, run in the vLLM venv, plays 0.33's
connector): ``lock`` is a real lock; a step that holds it, as 0.33 holds it
from the first lookup to ``on_schedule_end``, still gets a store's slots
while an answer arrives (the manager's loop thread never waits for the lock);
an answer handed over between a lookup's HIT and its ``prepare_load`` does not
change what is loaded (fault injection); after ``reset_cache`` the leases of
transfers in flight are held until ``on_reset_flushed``; ``config_info``
fills the labels the spec declares; a step's end waits for the answer to the
lookups it asked (``lookup_wait_s``), so the next step's lookups hit, and a
daemon that hangs (fault injection: SIGSTOP) holds it no longer than that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engines import vllm_engine

# The first test may wait for the venv build (minutes, once per pin and machine).
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "engines" / "vllm_manager_check.py"


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    return vllm_engine.check_facts(CHECK)


def test_the_lock_is_a_real_lock(facts: dict[str, Any]) -> None:
    assert facts["lock_taken"] is True
    assert facts["lock_taken_again"] is False  # held: not a no-op


def test_a_step_holding_the_lock_gets_a_stores_slots_while_an_answer_arrives(
    facts: dict[str, Any],
) -> None:
    assert facts["step1"] == ["RETRY"] * 4
    assert facts["answer_leased"]
    assert facts["stored_in_locked_step"] == 2
    assert facts["step2"] == ["HIT"] * 4


def test_an_answer_handed_over_after_a_hit_does_not_change_the_load(
    facts: dict[str, Any],
) -> None:
    assert facts["loaded_pages"] == 4


def test_leases_of_transfers_in_flight_at_a_reset_end_when_flushed(
    facts: dict[str, Any],
) -> None:
    assert facts["leases_before_reset"] == 2  # the load's read lease, the store's slots
    assert facts["leases_after_reset"] == 2
    assert facts["leases_after_flushed"] == 0


def test_config_info_fills_the_labels_the_spec_declares(facts: dict[str, Any]) -> None:
    (labels,) = facts["config_info"]
    assert list(labels) == facts["config_info_keys"]
    assert labels["hicached_key_scheme"] == "vllm-sha256"
    assert labels["hicached_model"] == "check/model"
    assert labels["hicached_page_tokens"] == 16
    assert labels["hicached_page_bytes"] == 2 * 1024


def test_a_steps_end_waits_for_the_answer_so_the_next_step_hits(facts: dict[str, Any]) -> None:
    got = facts["wait"]
    assert got["first"] == ["RETRY"] * 4
    assert got["second"] == ["HIT"] * 4  # the step right after: no time between
    assert facts["wait_step_end_s"] < 10  # the answer came, not the 30 s bound


def test_a_hung_daemon_holds_a_steps_end_no_longer_than_lookup_wait_s(
    facts: dict[str, Any],
) -> None:
    got = facts["stopped"]
    assert got["first"] == ["RETRY"] * 4
    assert got["second"] == ["RETRY"] * 4  # no answer yet: asked again later, not a miss
    assert 0.25 <= facts["stopped_step_end_s"] < 5  # the 0.3 s bound, not timeout_s (10)
    assert got["later"] == ["HIT"] * 4  # the answer after SIGCONT is taken


def test_lookup_wait_s_is_a_bounded_number_of_seconds() -> None:
    """``lookup_wait_s`` holds vLLM's scheduler at a step's end: NaN (which
    JSON configs parse) would make that wait spin until an answer comes, for
    ever with a hung daemon; infinity or a huge value would raise in the step
    (OverflowError from the wait). They are refused where the connector reads
    its settings, naming the key; 0 still turns the wait off."""
    import json
    import os
    import subprocess

    from tests.engines import venv

    probe = (
        "import json, sys, msgspec\n"
        "from hicached.integrations.common import settings_from\n"
        "from hicached.integrations.vllm.settings import Settings\n"
        "out = {}\n"
        "for arg in sys.argv[1:]:\n"
        "    key, _, text = arg.rpartition('=')\n"
        "    key = key or 'lookup_wait_s'\n"
        "    try:\n"
        "        got = settings_from(Settings, {key: float(text)})\n"
        "        out[arg] = getattr(got, key)\n"
        "    except msgspec.ValidationError as exc:\n"
        "        out[arg] = str(exc)\n"
        "print(json.dumps(out))\n"
    )
    # every other time setting too: finite, never negative, timeouts above 0
    others = ["timeout_s=nan", "timeout_s=0", "answer_ttl_s=inf", "retry_s=-1", "retry_s=0"]
    values = ["nan", "inf", "1e10", "-1", "0", "0.005", "1", *others]
    done = subprocess.run(
        [str(venv.with_client()), "-c", probe, *values],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for refused in ("nan", "inf", "1e10", "-1"):
        assert isinstance(got[refused], str) and "lookup_wait_s" in got[refused], got
    assert (got["0"], got["0.005"], got["1"]) == (0.0, 0.005, 1.0)
    for refused in others[:4]:
        key = refused.split("=")[0]
        assert isinstance(got[refused], str) and key in got[refused], got
    assert got["retry_s=0"] == 0.0
