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
    extra: str = "",
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
        allow_faults=True,
        storage='backend = "faulty"\nprefetch_batch_pages = 2\n',
        tail=tail,
        extra=extra,
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


# A daemon's limit on a request, the pages the ranks ask for, and the most a
# request of them holds: a page limit of 8 (a token namespace then holds 8
# pages of a sequence at most), and a message bound of 4,096 bytes with 70
# pages of 16 tokens asked (4,480 bytes of tokens; 56 pages hold 3,584, the
# rest left for the request's other fields).
LIMITS = {
    "pages": ("max_pages_per_request = 8", rankfns.PAGES, 8),
    "bytes": ("max_message_bytes = 4096", 70, (4096 - 512) // (4 * rankfns.PAGE_TOKENS)),
}


@pytest.mark.parametrize("limit", list(LIMITS))
def test_a_prompt_over_the_daemons_request_limits_loads_as_many_pages_as_a_request_holds(
    daemon_factory: Callable[..., Daemon], limit: str
) -> None:
    """A prefetch of more pages than one request to the daemon holds was refused
    whole, a miss on every rank. The ranks now load and commit as many
    leading pages as a request holds, with the window that ends there and
    the state."""
    extra, asked, most = LIMITS[limit]
    d = faulty_daemon(daemon_factory, extra=extra)
    results = launch(
        rankfns.coordinated_prefetch,
        d.endpoint,
        {"kind": "wait_complete"},
        None,  # no rank dies
        None,  # no rank ends it
        most,  # the pages stored
        asked,
        tp=2,
        timeout=20,
        deadline=120,
    )
    assert [r["kv"] for r in results] == [most, most]
    assert all(r["sidecars"] == {"swa": True, "state": True} for r in results)
    assert all(r["missing"] == 0 for r in results)


def test_a_partial_window_is_released_on_every_rank(daemon_factory: Callable[..., Daemon]) -> None:
    d = faulty_daemon(daemon_factory, readable={digest(TP2[1], "swa"): 1})  # rank 1 reads 1 page
    results = run(d, {"kind": "wait_complete"}, tp=2)
    assert [r["kv"] for r in results] == [rankfns.PAGES] * 2
    for r in results:
        assert r["sidecars"] == {"swa": False, "state": True}
        assert r["in_l2"]["swa"] == 0, "a partial window was committed"
        assert r["in_l2"]["state"] == 1


def test_pending_state_transfer_holds_termination_then_ends_everywhere(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """KV done, a Mamba-state transfer still running: no one ends,
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
    assert all(r["sidecars"]["swa"] and r["in_l2"]["swa"] == 7 for r in results)


@pytest.mark.parametrize("cut", [None, 7], ids=["whole", "cut_at_7"])
def test_a_window_pool_holds_the_window_that_ends_at_the_agreed_length(
    daemon_factory: Callable[..., Daemon], cut: int | None
) -> None:
    """The window is the ``WINDOW_PAGES`` pages that end at the agreed
    length (checked byte for byte on every rank), not the first pages after the
    pool's L2 hit; the pages before it come along, as the index keeps prefixes."""
    readable = {digest(TP2[1], "kv"): cut} if cut else {}  # rank 1's KV fails after `cut`
    d = faulty_daemon(daemon_factory, readable=readable)
    results = run(d, {"kind": "wait_complete"}, tp=2)
    length = cut or rankfns.PAGES
    for r in results:
        assert r["kv"] == length
        assert r["sidecars"] == {"swa": True, "state": True}
        assert r["in_l2"]["swa"] == length, "the window does not end at the agreed length"


def test_a_window_short_of_the_agreed_length_is_released_on_every_rank(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Rank 1 loads every window page but the last one before the agreed length:
    a partial window, released everywhere (the first two pages were all there)."""
    d = faulty_daemon(daemon_factory, readable={digest(TP2[1], "swa"): rankfns.PAGES - 1})
    results = run(d, {"kind": "wait_complete"}, tp=2)
    for r in results:
        assert r["kv"] == rankfns.PAGES
        assert r["sidecars"] == {"swa": False, "state": True}
        assert r["in_l2"]["swa"] == 0, "a partial window was committed"


def test_a_slow_window_holds_the_end_only_until_it_covers_the_kv(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """No rank ends while a pool lacks pages a decision needs, but a window pool
    that already holds every page up to the KV length does not keep everyone
    waiting for the rest of its read."""
    d = faulty_daemon(
        daemon_factory,
        delays={digest(c, "swa"): 0.5 for c in TP2},  # 2 pages per 0.5 s: 3 s for all 12
        readable={digest(c, "kv"): 4 for c in TP2},  # the KV stops at 4 pages, at once
    )
    results = run(d, {"kind": "wait_complete"}, tp=2)
    for r in results:
        assert r["kv"] == 4 and r["sidecars"]["swa"] and r["in_l2"]["swa"] == 4
        # the window's 4 pages take 1 s; the whole read 3 s: the margin between is
        # wide enough for a loaded machine
        assert 0.95 <= r["waited"] < 2.5, r["waited"]


@pytest.mark.parametrize("how", ["terminate", "cancel"])
@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, pp=2)], ids=["tp2", "tp2xpp2"])
def test_a_rank_that_ends_its_prefetch_ends_it_on_every_rank_in_the_same_step(
    daemon_factory: Callable[..., Daemon], layout: dict[str, int], how: str
) -> None:
    """The MAX of ``terminated``: the last rank (with PP, on the last
    stage) ends its prefetch once it has read 4 pages, while it is still
    loading and every other rank waits for it (wait_complete). Every rank ends
    in the same step, the next one (with PP one more: the last stage's word
    reaches stage 0 a step late), and commits the same length: what the ender
    held (``terminate``), or nothing when its daemon prefetch is gone
    (``cancel``)."""
    tp, pp = 2, layout.get("pp", 1)
    ender = tp * pp - 1
    slow = {digest((tp - 1, tp, pp - 1, pp), "kv"): 0.1}  # 2 pages per 0.1 s: 0.6 s for all
    d = faulty_daemon(daemon_factory, delays=slow)
    results = launch(
        rankfns.coordinated_prefetch,
        d.endpoint,
        {"kind": "wait_complete"},
        None,
        (ender, 4, how),
        **layout,
        timeout=20,
        deadline=120,
    )
    ended_after = results[ender]["ended_after"]
    assert ended_after is not None
    assert [r["steps"] for r in results] == [ended_after + pp] * (tp * pp)
    assert all(r["reason"] == "wait_complete: ended by a rank" for r in results)
    lengths = {r["kv"] for r in results}
    assert len(lengths) == 1, results
    length = lengths.pop()
    if how == "terminate":
        assert 4 <= length < rankfns.PAGES  # wait_complete alone would have loaded all 12
    else:
        assert length == 0  # the ender's pages went with its prefetch
        assert all(r["missing"] == (1 if i == ender else 0) for i, r in enumerate(results))


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
    # the surviving rank released its prefetches at once and may start another
    assert "[abandoned: run cleared True, released 3 of 3]" in errors[0], errors[0]


def test_a_second_prefetch_starts_from_nothing_the_first_agreed(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """PP: stage 0 decides on the last stage's values of one step before. Those
    of the first prefetch (which the last stage ended) must not decide the
    second one's first step."""
    d = faulty_daemon(daemon_factory)
    results = launch(rankfns.two_prefetches_in_a_row, d.endpoint, 1, pp=2, timeout=20, deadline=120)
    assert all(r["first"] == "wait_complete: ended by a rank" for r in results), results
    assert all(r["second"] == (rankfns.PAGES, "wait_complete: willing") for r in results), results
    assert all(r["in_l2"] == rankfns.PAGES for r in results)


def test_a_prefetch_lost_before_its_commit_is_an_error_on_that_rank_only(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A rank whose prefetch is gone between the agreement and the commit raises
    PrefetchLost (never a Decision for pages it does not hold) and releases its
    window's prefetch; the other rank commits what was agreed."""
    d = faulty_daemon(daemon_factory)
    results = launch(
        rankfns.lose_after_the_agreement, d.endpoint, 1, tp=2, timeout=20, deadline=120
    )
    assert results[0]["outcome"] == rankfns.PAGES
    assert str(results[1]["outcome"]).startswith("PrefetchLost: rank 1: the ranks agreed on 12")
    assert all(r["leases"] == 0 for r in results), "a prefetch lease was left open"


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, pp=2)], ids=["tp2", "tp2xpp2"])
def test_a_ranks_daemon_killed_mid_prefetch_is_a_clean_miss_on_every_rank(
    daemon_factory: Callable[..., Daemon], layout: dict[str, int]
) -> None:
    """Each rank has a daemon of its own; the last rank's daemon is SIGKILLed
    while its prefetch is still reading. Its prefetch is gone (progress cannot
    be read): every rank ends in the same step and commits nothing, none hangs,
    none loads pages the others do not hold, and no survivor keeps a lease."""
    world = layout.get("tp", 1) * layout.get("pp", 1)
    coords = [
        (r % layout["tp"], layout["tp"], r // layout["tp"], layout.get("pp", 1))
        for r in range(world)
    ]
    slow = {digest(c, "kv"): 0.2 for c in coords}  # 2 pages per 0.2 s: 1.2 s for all 12
    daemons = [faulty_daemon(daemon_factory, delays=slow) for _ in range(world)]
    victim = world - 1
    pid = daemons[victim].proc.pid  # type: ignore[union-attr]
    results = launch(
        rankfns.own_daemon_dies,
        [d.endpoint for d in daemons],
        (victim, pid),
        2,
        **layout,
        timeout=20,
        deadline=120,
    )
    outcomes = {r["outcome"] for r in results}
    assert len(outcomes) == 1, results
    pages, _, reason = outcomes.pop()
    assert pages == 0 and reason == "wait_complete: ended by a rank", results
    assert all(r["leases"] == 0 for i, r in enumerate(results) if i != victim), results


def test_a_release_that_breaks_leaves_the_agreements_failure_and_releases_the_rest(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A step whose agreement fails releases this rank's prefetches. A release
    that broke off with an error other than the client's own (a socket error)
    was raised in place of the agreement's failure (RankFailure, what an
    engine catches to set its ranks up again), and the prefetches after it
    were not released: their leases waited for their TTL. The failure raised
    is the agreement's; each prefetch is released that can be."""
    d = faulty_daemon(daemon_factory)
    (result,) = launch(
        rankfns.a_release_that_breaks_on_a_failed_agreement,
        d.endpoint,
        timeout=20,
        deadline=120,
    )
    assert result["raised"] == "RankFailure", result
    assert result["cleared"], result
    # the kv prefetch's release broke off: it waits for its lease's TTL
    assert result["known"] == {"kv": True, "swa": False, "state": False}, result
