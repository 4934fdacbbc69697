"""Write policies: when a page goes from L2 to L3 (``storage.write_policy``).

Each is an object chosen once by name (at start and on a reload), asked at the
few moments a policy decides something, instead of comparisons of the name
wherever one matters:

- ``committed``: pages a client just committed into L2;
- ``matched``: the leading pages a match found in L2;
- ``writes_back``: whether a page that leaves L2 unwritten is written then
  (and at a graceful stop, whatever L3 lacks);
- ``rewrites``: whether a page L3 lets go of while it stays in L2 is written
  again (bounded in cache/tiering.py's ``forget_l3``);
- ``writes_all``: whether every page in L2 belongs in L3: the pages adopted
  from the daemon before (docs/restarts.md) that L3 lacks are written once
  L3's listing ended (their writes were queued or under way when that daemon
  stopped), and pages whose writes were missed (the store down, the queue
  full, a failed write) once the store is up (daemon/backfill.py).

A new policy is a class here and its name in config.WRITE_POLICIES.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from hicached.cache.sessions import NamespaceState
    from hicached.cache.tiering import Tiering


class WritePolicy:
    """What a policy decides; the base writes nothing."""

    name: ClassVar[str]
    writes_back: ClassVar[bool] = False
    rewrites: ClassVar[bool] = False
    writes_all: ClassVar[bool] = False

    def committed(
        self, tiering: Tiering, ns: NamespaceState, keys: list[bytes], slots: list[int]
    ) -> None:
        """Pages ``keys`` (in ``slots``) were committed into L2 by a client."""

    def matched(
        self, tiering: Tiering, ns: NamespaceState, keys: list[bytes], slots: list[int]
    ) -> None:
        """A match found the leading pages ``keys`` (in ``slots``) in L2."""


class WriteThrough(WritePolicy):
    """Every committed page goes to L3 at once."""

    name = "write_through"
    rewrites = True
    writes_all = True  # every committed page goes to L3: missed ones, the daemon before's too

    def committed(
        self, tiering: Tiering, ns: NamespaceState, keys: list[bytes], slots: list[int]
    ) -> None:
        tiering.write_pages(ns, keys, slots)


class WriteThroughSelective(WritePolicy):
    """A prefix goes to L3 once it was matched ``storage.selective_hits`` times."""

    name = "write_through_selective"
    rewrites = True

    def matched(
        self, tiering: Tiering, ns: NamespaceState, keys: list[bytes], slots: list[int]
    ) -> None:
        tiering.count_hit(ns, keys, slots)


class WriteBack(WritePolicy):
    """A page goes to L3 when it leaves L2 (and at a graceful stop)."""

    name = "write_back"
    writes_back = True


POLICIES: dict[str, type[WritePolicy]] = {
    cls.name: cls for cls in (WriteThrough, WriteThroughSelective, WriteBack)
}


def write_policy(name: str) -> WritePolicy:
    """The policy named ``name`` (config checked it is one of POLICIES)."""
    return POLICIES[name]()
