"""Rank agreement over real torch.distributed ranks (gloo on loopback)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hicached.ranks import RankError, launch
from tests import cudaonly, rankfns
from tests.support import LAYOUTS


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_every_rank_agrees_on_the_global_min_and_max(layout: str) -> None:
    shape = LAYOUTS[layout]
    world = shape.get("tp", 1) * shape.get("cp", 1) * shape.get("pp", 1)
    results = launch(rankfns.agree_steps, 4, **shape, timeout=15)
    want = {"pages": 10, "acks": 100 - (world - 1), "busy": 1 if world > 1 else 0, "done": 1}
    for step in range(4):
        views = [r["seen"][step] for r in results]
        assert all(v == views[0] for v in views), f"ranks disagree at step {step}: {views}"
    for r in results:
        # with PP, stage 0 hears the other stages one step late: step 1 holds back
        assert r["seen"][-1] == want
        assert r["collectives"] == (4 if world // shape.get("pp", 1) > 1 else 0)
    if shape.get("pp", 1) > 1:
        assert results[0]["seen"][0]["pages"] == 0 and results[0]["seen"][0]["busy"] == 1


@pytest.mark.parametrize("layout", ["tp2", "tp2xpp2"])
def test_a_rank_that_skips_a_sync_point_makes_every_rank_raise(layout: str) -> None:
    with pytest.raises(RankError) as info:
        launch(rankfns.skip_a_sync, 1, **LAYOUTS[layout], timeout=10, deadline=60)
    errors = info.value.errors
    world = 2 if layout == "tp2" else 4
    assert set(errors) == set(range(world)), f"some ranks did not raise: {errors.keys()}"
    mismatches = [e for e in errors.values() if "RankMismatch" in e]
    assert mismatches and all("RankMismatch" in e or "RankFailure" in e for e in errors.values())
    assert any("sync.second" in e and "sync.third" in e for e in mismatches)


@pytest.mark.parametrize("layout", ["tp2", "tp2xpp2"])
def test_agreements_of_different_widths_out_of_order_are_a_mismatch(layout: str) -> None:
    """Every agreement sends the same number of words, so ranks of a stage that
    run two agreements in different orders meet in one collective and see the
    mismatch (different sizes would abort the process inside the collective).
    Along PP each agreement's messages travel under its own tag."""
    with pytest.raises(RankError) as info:
        launch(rankfns.two_agreements_out_of_order, **LAYOUTS[layout], timeout=10, deadline=60)
    errors = info.value.errors
    assert set(errors) == set(range(2 if layout == "tp2" else 4)), errors
    assert any("RankMismatch" in e for e in errors.values()), errors


def test_two_agreements_of_one_topology_never_take_each_others_relay() -> None:
    """PP folds of two agreements travel apart: the prefetch agreement never
    decides on the backups' values (1000, not busy), only on its own stages'."""
    results = launch(rankfns.two_agreements_interleaved, pp=2, timeout=10, deadline=60)
    for seen in results:
        assert all(step["pages"] == 0 and step["busy"] == 1 for step in seen), seen


def test_interleaved_instances_close_their_own_relay_ring() -> None:
    """Data-parallel instances of PP laid out pp outermost: with the ring's ends
    given, each instance agrees on its own stages' values (the first step holds
    back, then the MIN); without them the layout is refused, never relayed to
    another instance's stage 0."""
    given = launch(rankfns.interleaved_instances, "given", tp=2, pp=2, timeout=10, deadline=60)
    assert given == [[0, 50, 50], [0, 200, 200], [0, 50, 50], [0, 200, 200]], given
    refused = launch(rankfns.interleaved_instances, "none", tp=2, pp=2, timeout=10, deadline=60)
    assert all("pass pp_first and pp_last" in r[0] for r in refused), refused
    # ranks within the PP group instead of global ones: refused by every rank at
    # an end they do not match (rank 0 matches by chance, and then has no peer)
    with pytest.raises(RankError) as info:
        launch(rankfns.interleaved_instances, "local", tp=2, pp=2, timeout=10, deadline=60)
    refused_here = info.value.results
    assert sorted(refused_here) == [1, 2, 3], info.value
    assert all("they are global ranks" in r[0] for r in refused_here.values())


def test_pp_stages_with_different_ack_timings_apply_the_same_counts() -> None:
    results = launch(rankfns.many_steps, 1000, 2, tp=2, pp=2, timeout=20, deadline=180)
    assert len({(r["last"], r["sum"]) for r in results}) == 1, results
    assert all(r["worst_pending"] <= 64 for r in results)
    assert results[0]["last"] >= (1000 - 2) // 2 - 1  # the slow stage bounds the count


def test_a_killed_rank_makes_the_others_raise_within_the_timeout() -> None:
    with pytest.raises(RankError) as info:
        launch(rankfns.sleep_then_agree, tp=2, pp=2, timeout=5, deadline=60, kill={3: 2.0})
    errors = info.value.errors
    assert errors[3] == "killed by the harness"
    for rank in (0, 1, 2):
        assert "RankFailure" in errors[rank], errors[rank]


def test_an_engines_own_tp_and_cp_groups_are_both_reduced() -> None:
    results = launch(rankfns.engine_groups, tp=2, cp=2, timeout=15)
    # rank 0 holds the minimum, rank 3 the flag: only reducing over TP *and* CP reaches both
    assert all(r == {"pages": 10, "busy": 1, "collectives": 2} for r in results), results


def test_an_attention_group_that_is_not_tp_x_cp_is_refused() -> None:
    results = launch(rankfns.inconsistent_attn_group, tp=2, timeout=15)
    assert all("attn_group has 2 ranks, but tp x cp = 1 x 1" in r for r in results), results


# No GPU here, so no NCCL group can be made: tests/cudaonly.py registers a backend
# that declares CUDA as its only device, as NCCL does, which is all the check reads.

REFUSED = "has backend 'cuda:cudaonly', which cannot reduce CPU tensors"


def test_a_cuda_only_engine_group_is_refused_up_front_and_a_mixed_one_works() -> None:
    results = launch(cudaonly.engine_groups, tp=2, timeout=15)
    for r in results:
        assert r["attn"].startswith("the stage (attention) group " + REFUSED), r["attn"]
        assert r["tp"].startswith("a TP or CP group " + REFUSED), r["tp"]
        assert "backend='gloo'" in r["attn"]  # says what to pass instead
        assert r["mixed"] == {"pages": 10, "busy": 1}  # cpu:gloo,cuda:... carries CPU tensors


def test_under_a_cuda_only_default_group_the_relay_goes_over_gloo() -> None:
    results = launch(
        cudaonly.cuda_only_default, tp=2, pp=2, timeout=15, deadline=90, backend=cudaonly.NAME
    )
    for r in results:
        assert r["default_backend"] == "cuda:cudaonly"
        # Topology.create made its own gloo groups, and a gloo relay group for PP
        assert r["has_relay_group"] and r["created"] == {"pages": 10, "busy": 1}
        assert r["stage_group"].startswith("the stage (attention) group " + REFUSED)
        assert r["no_relay_group"].startswith("the default group (it carries the PP relay) ")
        assert r["with_relay_group"] == {"pages": 10, "busy": 1}


@pytest.mark.parametrize("layout", ["tp2", "tp2xcp2", "tp2xpp2"])
def test_a_value_that_does_not_fit_int64_on_one_rank_fails_every_rank_at_once(
    layout: str,
) -> None:
    """The bad rank still takes part in the collective, with a marker in the
    fingerprint's place: every rank raises the same RankBadValue, none waits
    for the bad rank to leave or for the group timeout (30 s here). Every rank
    stays up 5 s after its error, as an engine that goes on would."""
    shape = LAYOUTS[layout]
    world = shape.get("tp", 1) * shape.get("cp", 1) * shape.get("pp", 1)
    bad = world - 1  # with PP, on the last stage: stage 0 hears of it a step later
    results = launch(rankfns.one_bad_value, bad, 1 << 63, 5.0, **shape, timeout=30, deadline=120)
    said = f"RankBadValue: rank {bad} gave field 'pages' a value that is not an integer"
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["error"].startswith(said), (rank, r)
        assert "every rank stops at this agreement" in r["error"]
        assert r["seconds"] < 4, (rank, r)  # not held until the bad rank left or timed out
        stage_before = shape.get("pp", 1) > 1 and rank < world // shape["pp"]
        assert r["step"] == (3 if stage_before else 2), (rank, r)


def test_values_that_are_not_int64_are_found_before_they_are_packed() -> None:
    from hicached.dist import Fields

    fields = Fields(min=("pages",), max=("busy",))
    assert fields.unfit({"pages": (1 << 63) - 1, "busy": -((1 << 63) - 1)}) is None
    assert fields.unfit({"pages": 1 << 63, "busy": 0}) == 0
    assert fields.unfit({"pages": -(1 << 63), "busy": -(1 << 63)}) == 1  # negated: 2**63
    assert fields.unfit({"pages": float("nan"), "busy": 0}) == 0
    assert fields.unfit({"pages": 0, "busy": None}) == 1  # type: ignore[dict-item]
    import numpy as np
    import torch

    whole = {"pages": 2.0, "busy": np.int64(1)}  # integers whatever their type
    assert fields.unfit(whole) is None  # type: ignore[arg-type]
    assert fields.unfit({"pages": torch.tensor(3), "busy": True}) is None  # type: ignore[dict-item]
    assert fields.unfit({"pages": 0, "busy": 0.5}) == 1  # not "not busy", as int() had it


@pytest.mark.parametrize(
    ("layout", "how"),
    [("tp2", "missing"), ("tp2xcp2", "unknown"), ("tp2xpp2", "missing"), ("tp2", "site")],
)
def test_wrong_field_names_on_one_rank_fail_every_rank_at_once(layout: str, how: str) -> None:
    """A rank that leaves out a field or names one the agreement lacks (a
    programming error on that rank alone) still takes part in the collective,
    with a marker: every rank raises RankBadValue naming it, none waits for its
    timeout (30 s here) while the bad rank has already raised alone."""
    shape = LAYOUTS[layout]
    world = shape.get("tp", 1) * shape.get("cp", 1) * shape.get("pp", 1)
    bad = world - 1  # with PP, on the last stage: stage 0 hears of it a step later
    results = launch(rankfns.one_wrong_call, bad, how, 5.0, **shape, timeout=30, deadline=120)
    said = f"RankBadValue: rank {bad} called agree() with field names that are not the agreement's"
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["error"].startswith(said), (rank, r)
        assert r["seconds"] < 4, (rank, r)  # not held until the bad rank left or timed out
        stage_before = shape.get("pp", 1) > 1 and rank < world // shape["pp"]
        assert r["step"] == (3 if stage_before else 2), (rank, r)
    detail = "missing fields ['acks']" if how != "unknown" else "unknown fields ['pagez']"
    assert detail in results[bad]["error"], results[bad]  # the rank at fault says which


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_ranks_whose_fields_differ_are_a_mismatch_not_a_mix(layout: str) -> None:
    """Same names in another order on one rank: the words of one rank's 'pages'
    met another's 'acks' in the MIN, and both took 10 acks where every rank had
    100. The fields are part of the fingerprint: every rank raises RankMismatch
    (stage 0 of PP at close(), the one step it hears late), at once: along PP
    the relay's messages travel under a tag of the declared sites, not of the
    fields, or the later stage would wait for a message under another tag until
    its timeout (15 s here)."""
    results = launch(rankfns.other_field_order, 1, **LAYOUTS[layout], timeout=15, deadline=60)
    for rank, r in enumerate(results):
        assert "agreed" not in r, (rank, r)
        assert r["error"].startswith("RankMismatch: "), (rank, r)
        assert "other fields" in r["error"], (rank, r)
        assert r["seconds"] < 6, (rank, r)


@pytest.mark.parametrize("value", [2.5, "7"], ids=["fraction", "text"])
def test_a_value_that_is_not_an_integer_fails_every_rank_alike(value: object) -> None:
    """int() takes 2.5 and "7" (2 and 7): the bad rank's value was truncated or
    parsed where the contract says every rank raises RankBadValue."""
    results = launch(rankfns.one_bad_value, 1, value, 0.5, tp=2, timeout=15, deadline=60)
    said = "RankBadValue: rank 1 gave field 'pages' a value that is not an integer"
    assert all(r["error"] and r["error"].startswith(said) for r in results), results
    assert all(r["step"] == 2 for r in results), results


@pytest.mark.parametrize("how", ["site", "value"])
def test_a_later_stage_wrong_on_the_last_step_is_raised_by_stage_0_at_close(how: str) -> None:
    """Stage 0 hears of a later stage's mismatch or bad value a step late; on the
    last step before close() there is no later step, and close() took the ring's
    last message without looking: stage 0 kept the step's decision as agreed
    while the last stage raised. Now close() raises what the last stage saw."""
    results = launch(rankfns.wrong_on_the_last_step, how, pp=2, timeout=15, deadline=60)
    kind = "RankMismatch" if how == "site" else "RankBadValue"
    assert results[1]["where"] == "agree" and results[1]["error"].startswith(kind), results
    assert results[0]["where"] == "close", results
    assert results[0]["error"].startswith(kind), results


_FORKED_LAUNCH = """
import os
from hicached.ranks import launch
from tests import rankfns

if __name__ == "__main__":
    launch(rankfns.agree_steps, 2, tp=2, timeout=15)
    child = os.fork()
    if child == 0:
        try:
            launch(rankfns.agree_steps, 2, tp=2, timeout=15)
        except BaseException as exc:
            print(f"child: {type(exc).__name__}: {exc}", flush=True)
            os._exit(1)
        os._exit(0)
    raise SystemExit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


def test_a_process_forked_after_a_launch_launches_ranks_too(tmp_path: Path) -> None:
    """A process forked from one that had launched ranks inherits the record
    of its parent's fork server; the stdlib's check of that server (waitpid on
    another's child) failed there with ChildProcessError and nothing started.
    Such a process now spawns its ranks. In a process of its own, not this
    test runner's, which holds threads a fork would copy."""
    import subprocess
    import sys

    script = tmp_path / "forked_launch.py"
    script.write_text(_FORKED_LAUNCH)
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        check=False,
    )
    assert done.returncode == 0, (done.stdout, done.stderr[-2000:])


def test_a_rank_that_fails_to_start_ends_the_ranks_started_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection: the second rank's start raises (as a fork that finds no
    memory would). The first rank, waiting for its peers, was left running
    and the result queue open; now the error comes out and nothing runs on."""
    import importlib

    launcher = importlib.import_module("hicached.ranks.launch")  # the module, not the function
    real = launcher._context()
    made: list[Any] = []

    class NoStart:
        pid = None

        def start(self) -> None:
            raise OSError("no memory for another rank")

    class Failing:
        def Queue(self) -> Any:
            return real.Queue()

        def Process(self, **kwargs: Any) -> Any:
            if made:
                return NoStart()
            made.append(real.Process(**kwargs))
            return made[-1]

    monkeypatch.setattr(launcher, "_context", Failing)
    with pytest.raises(OSError, match="no memory"):
        launch(rankfns.agree_steps, 1, tp=2, timeout=10, deadline=30)
    assert len(made) == 1 and made[0].pid is not None and not made[0].is_alive()
