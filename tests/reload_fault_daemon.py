"""``python -m tests.reload_fault_daemon serve ...``: the daemon, with one fault
injected for tests of reloads: a reload whose file sets ``log.level =
"error"`` fails inside its plan with an error no config check raises (a
RuntimeError), as a bug in a reload step would."""

from __future__ import annotations

import sys
from typing import Any

from hicached.daemon import server
from hicached.daemon.reload import reload_plan


def faulty_plan(running: Any, wanted: Any) -> Any:
    if wanted.log.level == "error":
        raise RuntimeError("reload step failed (fault injected)")
    return reload_plan(running, wanted)


server.reload_plan = faulty_plan  # type: ignore[assignment]

from hicached.cli import main  # noqa: E402  (after the fault is in place)

sys.exit(main())
