"""systemd's service notification protocol (READY, WATCHDOG, STATUS, STOPPING,
EXTEND_TIMEOUT_USEC), and a startup reporter that keeps a long start alive."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType


def sd_notify(state: str) -> bool:
    """Send ``state`` to $NOTIFY_SOCKET; False when not run under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True


def watchdog_interval() -> float | None:
    """Half the watchdog period systemd asked for, in seconds, or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2e6, 0.05)
    except ValueError:
        return None


class StartupProgress:
    """Tells systemd what a start is doing and asks it to wait while it advances.

    Populating a large pool and scanning an L3 store before READY can outlast
    the unit's ``TimeoutStartSec``. Each ``phase`` sends ``STATUS=`` and
    ``EXTEND_TIMEOUT_USEC=`` at once, then a thread repeats both every
    ``every_s`` (the pool is populated by one blocking call, so the event loop
    cannot). A phase with a ``progress`` counter and ``stall_s`` gets
    extensions only while the counter moved within ``stall_s``: a start that
    hangs still times out.
    Without $NOTIFY_SOCKET nothing is sent and no thread runs.
    """

    def __init__(
        self,
        *,
        every_s: float = 5.0,
        extend_s: float = 30.0,
        notify: Callable[[str], bool] = sd_notify,
    ) -> None:
        assert extend_s > every_s > 0, "each extension must outlast the wait for the next"
        self.every_s = every_s
        self.extend_usec = int(extend_s * 1e6)
        self._notify = notify
        self._active = bool(os.environ.get("NOTIFY_SOCKET"))
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._text = ""
        self._progress: Callable[[], int] | None = None
        self._stall_s: float | None = None
        self._unit = ""
        self._started = self._moved = time.monotonic()
        self._last = 0

    def phase(
        self,
        text: str,
        progress: Callable[[], int] | None = None,
        stall_s: float | None = 60.0,
        unit: str = "",
    ) -> None:
        """Start a phase: ``text`` for STATUS, and optionally a counter of work
        done (in ``unit``s); ``stall_s`` None: extend however long it stands."""
        if not self._active:
            return
        with self._lock:
            self._text, self._progress, self._stall_s = text, progress, stall_s
            self._unit = unit
            self._started = self._moved = time.monotonic()
            self._last = progress() if progress else 0
        self._send()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="hicached-startup-notify", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop reporting (before READY, so the last STATUS is the daemon's own)."""
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> StartupProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _run(self) -> None:
        while not self._wake.wait(self.every_s):
            self._send()

    def _send(self) -> None:
        with self._lock:
            if self._closed:
                return
            now = time.monotonic()
            status = f"{self._text} ({now - self._started:.0f}s"
            extend = True
            if self._progress is not None:
                done = self._progress()
                if done != self._last:
                    self._last, self._moved = done, now
                status += f", {done}{self._unit} so far"
                if self._stall_s is not None and now - self._moved > self._stall_s:
                    extend = False  # no progress: let TimeoutStartSec apply
                    status += f", none in the last {now - self._moved:.0f}s"
            status += ")"
            message = f"STATUS={status}"
            if extend:
                message = f"EXTEND_TIMEOUT_USEC={self.extend_usec}\n{message}"
            self._notify(message)
