"""``python -m tests.gc_probe_daemon serve ...``: the daemon, freezing every 256
pages stored instead of every 65,536 (so a short test makes many freezes),
and on SIGUSR1 writing to ``$HICACHED_TEST_GC_PROBE`` how many objects freezing
kept that are garbage now: what a full collection finds once the permanent
generation is given back to the collector."""

from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from hicached.daemon import collector

collector.REFREEZE_PAGES = 256


def probe(_sig: int, _frame: FrameType | None) -> None:
    gc.collect()  # what is garbage outside the permanent generation
    gc.unfreeze()
    kept = gc.collect()  # what the freezes kept, now unreachable
    gc.freeze()
    Path(os.environ["HICACHED_TEST_GC_PROBE"]).write_text(str(kept))


signal.signal(signal.SIGUSR1, probe)

from hicached.cli import main  # noqa: E402  (after the probe is in place)

sys.exit(main())
