"""Prefetch coordination across real ranks and a real daemon, with per-rank faults
injected by the test-only ``faulty`` backend (slow or failing reads)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hicached.namespace import NamespaceSpec, namespace_digest
from hicached.ranks import launch
from tests import rankfns
from tests.support import Daemon


def digest(rank_coords: tuple[int, int, int, int], pool: str) -> str:
    return namespace_digest(NamespaceSpec(**rankfns.spec_fields(rank_coords, pool))).hex()


def faulty_daemon(
    factory: Callable[..., Daemon],
    delays: dict[str, float] | None = None,
    readable: dict[str, int] | None = None,
) -> Daemon:
    tail = '[storage.extra]\ninner = "memory"\n'
    tail += "[storage.extra.read_delay_s]\n" + "".join(
        f'"{k}" = {v}\n' for k, v in (delays or {}).items()
    )
    tail += "[storage.extra.readable_pages]\n" + "".join(
        f'"{k}" = {v}\n' for k, v in (readable or {}).items()
    )
    return factory(
        size_mib=1,  # 256 pages: the filler evicts everything
        slab_mib=1,
        storage='backend = "faulty"\nprefetch_batch_pages = 2\n',
        tail=tail,
    )


TP2 = [(0, 2, 0, 1), (1, 2, 0, 1)]


def run(d: Daemon, policy: dict[str, object], **layout: int) -> list[dict[str, object]]:
    return launch(
        rankfns.coordinated_prefetch, d.endpoint, policy, **layout, timeout=20, deadline=120
    )


def test_slow_and_failing_ranks_commit_the_same_length(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = faulty_daemon(
        daemon_factory,
        delays={digest(TP2[0], "kv"): 0.05},  # rank 0 reads slowly
        readable={digest(TP2[1], "kv"): 5},  # rank 1's storage fails after 5 pages
    )
    results = run(d, {"kind": "wait_complete"}, tp=2)
    assert [r["kv"] for r in results] == [5, 5]
    assert all(r["sidecars"] == {"swa": True, "state": True} for r in results)


def test_a_partial_window_is_released_on_every_rank(daemon_factory: Callable[..., Daemon]) -> None:
    d = faulty_daemon(daemon_factory, readable={digest(TP2[1], "swa"): 1})  # 1 of 2 window pages
    results = run(d, {"kind": "wait_complete"}, tp=2)
    assert [r["kv"] for r in results] == [rankfns.PAGES] * 2
    for r in results:
        assert r["sidecars"] == {"swa": False, "state": True}
        assert r["in_l2"]["swa"] == 0, "a partial window was committed"
        assert r["in_l2"]["state"] == 1


def test_pending_state_transfer_holds_termination_then_ends_everywhere(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Report 004: KV done, a Mamba-state transfer still running: no one ends,
    no one hangs; when it finishes, every rank ends on the same step."""
    d = faulty_daemon(daemon_factory, delays={digest(TP2[0], "state"): 1.0})
    results = run(d, {"kind": "best_effort"}, tp=2)
    steps = {r["steps"] for r in results}
    assert len(steps) == 1 and steps.pop() > 5, "ended before the state transfer finished"
    assert all(r["waited"] >= 0.9 for r in results)
    assert all(r["sidecars"]["state"] and r["in_l2"]["state"] == 1 for r in results)


def test_stop_policies(daemon_factory: Callable[..., Daemon]) -> None:
    slow = {digest(c, "kv"): 0.15 for c in TP2}  # 2 pages per read: ~1 s for 12 pages
    d = faulty_daemon(daemon_factory, delays=slow)
    best = run(d, {"kind": "best_effort"}, tp=2)
    assert len({r["kv"] for r in best}) == 1 and best[0]["kv"] < rankfns.PAGES  # what is there now
    d2 = faulty_daemon(daemon_factory, delays=slow)
    full = run(d2, {"kind": "wait_complete"}, tp=2)
    assert [r["kv"] for r in full] == [rankfns.PAGES] * 2
    d3 = faulty_daemon(daemon_factory, delays=slow)
    capped = run(
        d3, {"kind": "timeout", "base_s": 10.0, "per_1k_tokens_s": 10.0, "cap_s": 0.4}, tp=2
    )
    lengths = {r["kv"] for r in capped}
    assert len(lengths) == 1 and 0 < lengths.pop() < rankfns.PAGES  # stopped at the cap
    assert all(0.4 <= r["waited"] < 5.0 for r in capped)


@pytest.mark.parametrize("layout", [dict(pp=2), dict(tp=2, pp=2)], ids=["pp2", "tp2xpp2"])
def test_pipeline_stages_commit_the_same_length(
    daemon_factory: Callable[..., Daemon], layout: dict[str, int]
) -> None:
    tp = layout.get("tp", 1)
    last = (tp - 1, tp, 1, 2)  # a rank of the last stage fails after 7 pages
    d = faulty_daemon(daemon_factory, readable={digest(last, "kv"): 7})
    results = run(d, {"kind": "wait_complete"}, **layout)
    assert {r["kv"] for r in results} == {7}


def test_a_rank_killed_mid_prefetch_makes_the_others_raise(
    daemon_factory: Callable[..., Daemon],
) -> None:
    from hicached.ranks import RankError

    d = faulty_daemon(daemon_factory, delays={digest(c, "kv"): 0.3 for c in TP2})  # a slow prefetch
    with pytest.raises(RankError) as info:
        launch(
            rankfns.coordinated_prefetch,
            d.endpoint,
            {"kind": "wait_complete"},
            (1, 3),
            tp=2,
            timeout=5,
            deadline=60,
        )
    errors = info.value.errors
    assert errors[1].startswith("died"), errors[1]
    assert "RankFailure" in errors[0], errors[0]
