"""Paired rounds: figure and baseline turn about, and each ratio comes with its spread."""

from __future__ import annotations

from hicached.bench.paired import Paired


def test_rounds_alternate_who_goes_first_and_baselines_pool_their_rounds() -> None:
    calls: list[str] = []
    synced: list[int] = []
    paired = Paired(1 << 20, pairs=4, against="memcpy", sync=lambda: synced.append(1))
    paired.measure("copy", lambda: calls.append("ours"), lambda: calls.append("base"), "memcpy")
    paired.measure("other", lambda: calls.append("ours"), lambda: calls.append("base"), "memcpy")
    # a warm-up of each, then pairs whose order flips every time
    pairs = ["ours", "base", "base", "ours", "ours", "base", "base", "ours"]
    assert calls == ["ours", "base", *pairs, "ours", "base", *pairs]
    assert len(synced) == len(calls)  # every timed call is synchronized before the clock stops
    assert len(paired.baselines["memcpy"]) == 8  # both figures' baseline rounds
    figures = paired.result()
    for name in ("copy", "other"):
        low, mid, high = (figures[f"{name}_vs_memcpy{s}"] for s in ("_min", "", "_max"))
        assert 0 < low <= mid <= high
        assert figures[f"{name}_gbps"] > 0
    assert figures["memcpy_gbps"] > 0
