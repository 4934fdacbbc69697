"""The engine simulator on every layout: same lengths on all ranks, every byte verified."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hicached.simulator import Workload, simulate
from tests.support import LAYOUTS, Daemon


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_workload_runs_with_identical_lengths_and_verified_bytes(
    daemon_factory: Callable[..., Daemon], layout: str
) -> None:
    d = daemon_factory(size_mib=1, slab_mib=1, storage='backend = "memory"\n')
    results = simulate(d.endpoint, **LAYOUTS[layout], workload=Workload(conversations=2, turns=3))
    lengths = [r["lengths"] for r in results]
    assert all(x == lengths[0] for x in lengths), f"ranks used different lengths: {lengths}"
    for r in results:
        assert r["verified_bytes"] == sum(r["lengths"]) * 4096
        assert r["pages_l2"] > 0, "nothing was reused from L2"
        assert r["pages_l3"] > 0, "nothing came back from L3"
    # the second conversation reuses the shared system prompt (4 pages) from L3 at least
    assert lengths[0][3] >= 4
