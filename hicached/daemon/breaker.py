"""The circuit breaker of one L3 backend (daemon/dispatcher.py).

``breaker_failures`` failed calls in a row mark the backend down, as does a
store that does not answer at the start. While down, calls fail at once
(writes are dropped, reads miss), so L2 keeps serving at full speed. After
each ``breaker_cooldown_s`` one probe runs (the backend's ``health``), on a
task of its own even without calls: it passes, and the backend is up again;
it fails, and another cooldown begins. One probe at a time, however long it
takes (a Mooncake setup is tried for up to 15 s): calls meanwhile fail at
once. The backend is reported down until a probe passes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

from hicached.config import StorageConfig
from hicached.daemon.waits import bounded

log = logging.getLogger("hicached.dispatcher")


class Breaker:
    """Up or down, and the probes that bring a backend that is down up again."""

    def __init__(
        self,
        config: StorageConfig,
        health: Callable[[], Awaitable[None]],
        name: str,
        counters: collections.Counter[str],
    ) -> None:
        self.config = config
        self._health = health
        self.name = name
        self.counters = counters  # the dispatcher's: failures, breaker_opened
        self.failures = 0  # in a row
        self.down = False  # open: down until a probe passes
        self.probes = False  # a prober may run (between the start and the stop)
        self._down_until = 0.0  # the end of the cooldown
        self._probing = False  # a probe runs
        self._prober: asyncio.Task[None] | None = None  # probes while down
        self.up = asyncio.Event()  # set while up, for what waits for the store
        self.up.set()

    @property
    def cooling(self) -> bool:
        """Down, and within the cooldown or probing: calls fail without a probe."""
        return self.down and (self._probing or time.monotonic() < self._down_until)

    def failed(self, why: str) -> None:
        self.failures += 1
        self.counters["failures"] += 1
        if self.failures >= self.config.breaker_failures and not self.down:
            self._open()
            log.warning(
                "%s marked down after %d failures (last: %s)", self.name, self.failures, why
            )

    def down_from_start(self, why: str) -> None:
        """The store did not answer at the start: down from the first request."""
        log.warning(
            "%s not reachable at start (%s): down, serving from L2, probed every %.1fs",
            self.name,
            why,
            self.config.breaker_cooldown_s,
        )
        self.failures = self.config.breaker_failures
        self._open()

    def _open(self) -> None:
        self.down = True
        self.up.clear()
        self._down_until = time.monotonic() + self.config.breaker_cooldown_s
        if self.probes and (self._prober is None or self._prober.done()):
            self._prober = asyncio.get_running_loop().create_task(self._recover())
        self.counters["breaker_opened"] += 1

    def stop(self) -> None:
        self.probes = False
        if self._prober is not None:
            self._prober.cancel()

    async def probe(self) -> bool:
        """Whether the backend is up again: False at once within the cooldown
        or while another probe runs."""
        if self._probing or time.monotonic() < self._down_until:
            return False
        self._probing = True
        try:
            await bounded(self._health(), self.config.op_timeout_s)
        except Exception as exc:  # any failure keeps it down for another cooldown
            self._down_until = time.monotonic() + self.config.breaker_cooldown_s
            why = str(exc) or f"no answer within {self.config.op_timeout_s}s"
            log.info("%s still down: %s", self.name, why)
            return False
        finally:
            self._probing = False
        self.failures = self.config.breaker_failures - 1  # one more failure: down again
        self.down = False
        self.up.set()
        self._down_until = 0.0
        log.info("%s is up again", self.name)
        return True

    async def _recover(self) -> None:
        """While down, probe after each cooldown even without calls, so a backend
        that came back is reported up on an idle daemon too."""
        while self.down:
            await asyncio.sleep(max(0.0, self._down_until - time.monotonic()))
            if not await self.probe() and self._probing:  # a call's probe runs: not a spin
                await asyncio.sleep(self.config.breaker_cooldown_s)
