"""``hicached bench ... --plot FILE.png``: each figure drawn beside its raw baseline.

A benchmark's JSON names its figures and their baselines by convention; this
module pairs them (hicached's figure, the baseline measured in the same run)
and draws one horizontal bar pair per figure, with the ratio written beside
it. matplotlib is an optional extra (``pip install 'hicached[plot]'``).
"""

from __future__ import annotations

from typing import Any

from hicached.errors import HicachedError

Pair = tuple[str, float, float, str]  # label, hicached's value, the baseline's, unit


def pairs(bench: str, figures: dict[str, Any]) -> list[Pair]:
    """(label, figure, baseline, unit) for each figure that has a baseline."""
    out: list[Pair] = []

    def add(label: str, ours: str, raw: str, unit: str) -> None:
        if isinstance(figures.get(ours), int | float) and isinstance(figures.get(raw), int | float):
            out.append((label, float(figures[ours]), float(figures[raw]), unit))

    if bench == "control":
        for suffix in ("", "_4c"):
            for name, echo in (
                ("match", "echo"),
                ("match_nolease", "echo"),
                ("match_cold", "echo_cold"),
                ("match_cold_prefix", "echo_cold_prefix"),
                ("exists_keys", "echo_keys"),
            ):
                label = f"{name} p50{suffix.replace('_', ' ')}"
                add(label, f"{name}_p50_us{suffix}", f"{echo}_p50_us{suffix}", "µs")
    elif bench == "data":
        for key in sorted(figures):
            if key.endswith("_gbps") and key != "memcpy_gbps":
                add(key.removesuffix("_gbps"), key, "memcpy_gbps", "GB/s")
    elif bench == "scale":
        for tag in ("1k", "100k", "1m"):
            add(f"match p50 {tag} pages", f"match_p50_us_{tag}", f"echo_p50_us_{tag}", "µs")
        for key in sorted(figures):
            if key.startswith("pte_kib_huge_"):
                gib = key.removeprefix("pte_kib_huge_")
                add(f"page tables, {gib} pool (huge / 4 KiB)", key, f"pte_kib_{gib}", "KiB")
    elif bench == "ranks":
        for key in sorted(figures):
            if key.startswith("agree_us_"):
                tag = key.removeprefix("agree_us_")
                add(f"agree {tag}", key, f"allreduce_same_us_{tag}", "µs")
    elif bench == "cuda":
        for key in sorted(figures):
            if key.endswith("_gbps") and not key.startswith("raw_"):
                raw = "raw_d2h_pinned_gbps" if "_write" in key else "raw_h2d_pinned_gbps"
                add(key.removesuffix("_gbps"), key, raw, "GB/s")
    for key in sorted(figures):  # any figure with a raw_ twin (bench l3, and others)
        if not key.startswith("raw_") and f"raw_{key}" in figures:
            add(key.replace("_gbps", ""), key, f"raw_{key}", "GB/s" if "gbps" in key else "")
    return out


def draw(result: dict[str, Any], path: str) -> int:
    """Draw ``result``'s figures beside their baselines into a PNG; returns the
    number of pairs drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HicachedError("--plot needs matplotlib: pip install 'hicached[plot]'") from None
    bench = str(result.get("bench", ""))
    found = pairs(bench, result.get("figures", {}))
    if not found:
        raise HicachedError(f"bench {bench} has no figure with a baseline to draw")
    height = 0.38
    fig, ax = plt.subplots(figsize=(9, 0.75 * len(found) + 1.6))
    for i, (_, ours, raw, unit) in enumerate(reversed(found)):
        ax.barh(i + height / 2, ours, height, color="#2b6cb0", label="hicached" if not i else None)
        ax.barh(i - height / 2, raw, height, color="#a0aec0", label="baseline" if not i else None)
        ratio = ours / raw if raw else float("nan")
        ax.text(max(ours, raw) * 1.01, i, f"{ours:g} / {raw:g} {unit}  ({ratio:.2f}x)", va="center")
    ax.set_yticks(range(len(found)), [label for label, *_ in reversed(found)])
    ax.set_xlim(0, max(max(o, r) for _, o, r, _ in found) * 1.6)
    host = result.get("host", {})
    ax.set_title(
        f"hicached bench {bench}: each figure beside its baseline ({host.get('cpus')} CPUs)"
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(found)
