"""Benchmarks behind ``hicached bench``: each returns one JSON-able dict.

Every benchmark measures its raw baseline (a plain ZeroMQ echo, a plain
memcpy) in the same run and reports raw figures and ratios side by side.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any


def run_bench(which: str, args: argparse.Namespace) -> dict[str, Any]:
    if which == "control":
        from hicached.bench.control import run
    elif which == "data":
        from hicached.bench.data import run
    elif which == "l3":
        from hicached.bench.l3 import run
    elif which == "ranks":
        from hicached.bench.ranks import run
    elif which == "cuda":
        from hicached.bench.cuda import run
    elif which == "scale":
        from hicached.bench.scale import run
    elif which == "adopt":
        from hicached.bench.adopt import run
    else:  # pragma: no cover - argparse restricts the choice
        raise ValueError(which)
    started = time.time()
    result = run(args)
    result.update(
        bench=which,
        started_unix=round(started, 3),
        seconds=round(time.time() - started, 2),
        host={
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
    )
    return result
