"""A Mooncake client's setup tried in a process of its own, before the
daemon's own: ``python -m hicached_backends.mooncake_trial DAEMON_PID HOSTNAME
METADATA PROTOCOL DEVICE MASTER`` exits 0 if the setup succeeded.

Mooncake's setup holds the interpreter's lock for as long as it takes, and
it retries a master that does not answer for minutes (a hung master, another
service on its port). Run in the daemon, nothing else of it would run
meanwhile: no request answered, no SIGTERM. In a process of its own it can
be given up on and killed. The trial contributes no memory to the store
(segment and buffer of 0 bytes), so no object is ever placed with it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """Be killed when the daemon dies (SIGKILL, OOM) instead of trying on."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the daemon's kill at 15 s is all
        return
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def main(argv: list[str]) -> int:
    parent, hostname, metadata, protocol, device, master = argv
    _die_with(int(parent))
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup(hostname, metadata, 0, 0, protocol, device, master) != 0:
        return 1
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
