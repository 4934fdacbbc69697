"""Telling the daemon which scattered-copy kernels this process picked (protocol 1.5).

client/gather.py picks numpy's or torch's kernels once per process; each
client of the process reports the pick to its daemon session, so that
``hicached status`` shows every engine process's kernels and the rates that
decided. The report must never cost a copy or fail a call:

- it goes after a call (the clients' ``_do``, and ``connect``), never inside a
  copy, and only when this session lacks the process's current pick: one
  comparison a call otherwise;
- it is sent without waiting for its answer; the answer, which no call waits
  for, comes back through ``answered``, and a refusal is logged at debug;
- a daemon older than 1.5 (its hello says) is sent none, and a report that
  cannot be sent is logged at debug and not sent again to that session;
- a session hears of the pick again only when it changes: a process without
  torch reports numpy's, unmeasured, and if it loads torch later, what its
  next scattered copy measures.
"""

from __future__ import annotations

import logging
import sys

from hicached.client.gather import GatherChoice, gather_choice
from hicached.wire import protocol as p

__all__ = ["GatherReporter", "report"]

log = logging.getLogger(__name__)
_UNSENT = object()  # nothing said to this session yet, not even "no pick yet"


class GatherReporter:
    """What one client's current session has heard of this process's pick."""

    __slots__ = ("_id", "_sent")

    def __init__(self) -> None:
        self._sent: object = _UNSENT  # a GatherChoice, None (no pick), or _UNSENT
        self._id = -1  # the request id of the report last sent

    def new_session(self) -> None:
        """After a hello: the session (a restarted daemon's, maybe) has heard nothing."""
        self._sent = _UNSENT

    def due(self, hello: p.HelloOk | None) -> p.GatherReport | None:
        """The report to send now, if this session lacks the current pick; asked
        after each call, so the common answer is one comparison."""
        choice = gather_choice()
        if self._sent is choice or hello is None:
            return None
        self._sent = choice
        if hello.minor < p.GATHER_MINOR:  # an older daemon, which has no use for it
            return None
        return report(choice)

    def sent(self, request_id: int) -> None:
        self._id = request_id

    def answered(self, reply: p.AnyReply, endpoint: str) -> None:
        """A reply no call waited for: if it is the report's and refuses it, say so."""
        if reply.id == self._id and isinstance(reply, p.Error):
            log.debug("the daemon at %s refused the gather report: %s", endpoint, reply.message)


def report(choice: GatherChoice | None) -> p.GatherReport | None:
    """What a client tells its daemon of ``choice`` (this process's, or None
    before one): None while torch is loaded and nothing was measured yet (the
    next scattered copy measures)."""
    if choice is None:
        if "torch" in sys.modules:
            return None
        return p.GatherReport(id=0, how="no_torch", read="numpy", write="numpy")
    if choice.how != "measured":
        return p.GatherReport(id=0, how="forced", read=choice.read.pick, write=choice.write.pick)
    top = p.MAX_GATHER_GBPS  # a round timed at the clock's resolution rates absurdly

    def rate(gbps: float) -> float:
        return min(max(gbps, 0.0), top)

    return p.GatherReport(
        id=0,
        how="measured",
        read=choice.read.pick,
        write=choice.write.pick,
        read_numpy_gbps=rate(choice.read.numpy_gbps),
        read_torch_gbps=rate(choice.read.torch_gbps),
        write_numpy_gbps=rate(choice.write.numpy_gbps),
        write_torch_gbps=rate(choice.write.torch_gbps),
        page_bytes=choice.page_bytes,
        sample_pages=choice.sample_pages,
        rounds=choice.rounds,
        seconds=min(choice.seconds, 3600.0),
    )
