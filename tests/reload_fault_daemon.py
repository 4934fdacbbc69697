"""``python -m tests.reload_fault_daemon serve ...``: the daemon, with faults
injected for tests of reloads:

- a reload whose file sets ``log.level = "error"`` fails inside its plan with
  an error no config check raises (a RuntimeError), as a bug in a reload step
  would;
- while a file ``<config>.hang`` exists, reading the config blocks (for 120 s
  at most), as a read on a hung filesystem (NFS) would."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from hicached.daemon import reread, server
from hicached.daemon.reload import reload_plan

_load_config = reread.load_config


def faulty_plan(running: Any, wanted: Any) -> Any:
    if wanted.log.level == "error":
        raise RuntimeError("reload step failed (fault injected)")
    return reload_plan(running, wanted)


def hanging_load(path: Any) -> Any:
    deadline = time.monotonic() + 120
    while os.path.exists(f"{path}.hang") and time.monotonic() < deadline:
        time.sleep(0.05)  # fault injected: a read that does not return
    return _load_config(path)


server.reload_plan = faulty_plan  # type: ignore[assignment]
reread.load_config = hanging_load

from hicached.cli import main  # noqa: E402  (after the faults are in place)

sys.exit(main())
