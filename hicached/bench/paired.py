"""Paired rounds: a figure and its baseline timed turn about, who goes first
alternating from pair to pair, so drift and noise fall on both alike.

Reports medians, the median of the per-pair ratios, and the lowest and
highest of those ratios (the spread).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


class Paired:
    """Figures in GB/s, each timed in ``pairs`` pairs of rounds with a baseline.

    ``sync`` runs after each timed call before the clock stops (a device
    synchronize); ``against`` names the baseline in the ratio figures
    (``{name}_vs_{against}``).
    """

    def __init__(
        self,
        nbytes: int,
        *,
        pairs: int = 15,
        against: str = "raw",
        sync: Callable[[], object] | None = None,
    ) -> None:
        self.nbytes, self.pairs, self.against = nbytes, pairs, against
        self.sync = sync
        self.baselines: dict[str, list[float]] = {}  # baseline name -> its round times
        self.figures: dict[str, float] = {}

    def _timed(self, fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        if self.sync is not None:
            self.sync()
        return time.perf_counter() - t0

    def measure(
        self, name: str, fn: Callable[[], object], baseline: Callable[[], object], base: str
    ) -> None:
        """Time ``fn`` against ``baseline`` (whose rounds are kept under ``base``)."""
        self._timed(fn)  # warm both up
        self._timed(baseline)
        mine: list[float] = []
        theirs: list[float] = []
        for r in range(self.pairs):
            pair = [(fn, mine), (baseline, theirs)]
            for run, into in pair if r % 2 == 0 else pair[::-1]:
                into.append(self._timed(run))
        self.baselines.setdefault(base, []).extend(theirs)
        ratios = [b / m for m, b in zip(mine, theirs, strict=True)]
        f, vs = self.figures, f"{name}_vs_{self.against}"
        f[f"{name}_gbps"] = self.gbps(mine)
        f[vs] = round(statistics.median(ratios), 3)
        f[f"{vs}_min"] = round(min(ratios), 3)
        f[f"{vs}_max"] = round(max(ratios), 3)

    def gbps(self, times: list[float]) -> float:
        return round(self.nbytes / statistics.median(times) / 1e9, 2)

    def result(self) -> dict[str, float]:
        """Each baseline's GB/s over all its rounds, then the figures."""
        out = {f"{base}_gbps": self.gbps(times) for base, times in self.baselines.items()}
        return {**out, **self.figures}
