"""``hicached bench control`` of two checkouts in alternating runs: what a change
costs the control path, measured where both sides share the machine's noise.

    PYTHONPATH=. .venv/bin/python bench/checks/control_ab.py BASE_DIR NEW_DIR [PAIRS]

BASE_DIR and NEW_DIR are checkouts (``git worktree add /tmp/base COMMIT``);
each run imports hicached from its own. Prints one JSON object: the median of
each figure per side, new/base, and each side's lowest and highest.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

FIGURES = (
    "echo_p50_us",
    "match_p50_us",
    "release_p50_us",
    "match_vs_echo_p50_1c",
    "match_vs_echo_p50_4c",
    "match_cold_prefix_vs_echo_p50_1c",
    "match_cold_prefix_vs_echo_p50_4c",
    "exists_keys_vs_echo_p50_1c",
    "exists_keys_vs_echo_p50_4c",
    "requests_per_s_4c",
)


def run(checkout: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "bench", "control", "--json"],
        cwd=checkout,
        env=env,
        capture_output=True,
        check=True,
        timeout=300,
    ).stdout
    figures: dict[str, float] = json.loads(out)["figures"]
    return {k: figures[k] for k in FIGURES}


def main() -> None:
    base, new = sys.argv[1], sys.argv[2]
    pairs = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for _ in range(pairs):
        runs["base"].append(run(base))
        runs["new"].append(run(new))
    out: dict[str, object] = {"pairs": pairs}
    for key in FIGURES:
        bs = [r[key] for r in runs["base"]]
        ns = [r[key] for r in runs["new"]]
        b, n = statistics.median(bs), statistics.median(ns)
        out[key] = {
            "base": round(b, 3),
            "new": round(n, 3),
            "new_vs_base": round(n / b, 3),
            "base_range": [min(bs), max(bs)],
            "new_range": [min(ns), max(ns)],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
