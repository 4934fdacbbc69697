"""What the client hands back to its caller: namespaces, handles and results.

No I/O here. A *handle* (``Reservation``, ``Hit``) is the only way to copy
bytes into or out of the pool: it carries the daemon instance that granted
it, the lease's deadline on this client's monotonic clock, and the slots'
generations as they were when the daemon handed them out (state/pool.py). The
copies (client/mapping.py) refuse a handle that is closed, from another daemon
instance or past its deadline, and a read whose slots changed generation
while it copied is reported as a miss (``StaleHandle``), never as bytes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from hicached.errors import BadRequest
from hicached.wire.namespace import EventMeta, NamespaceSpec

if TYPE_CHECKING:  # typing.Self is 3.11 on; engines run 3.10 too
    from typing_extensions import Self

# over an immutable buffer: it cannot be made writeable again, or resized
_NO_GENS = np.frombuffer(b"", dtype=np.uint32)


TOKEN_WRITE = (
    "only reservations of key-addressed namespaces can be handed to other processes: "
    "a token reservation's slots are not fenced against writes after its commit"
)


def check_kind(handle: object, kinds: type | tuple[type, ...], call: str, want: str) -> None:
    """BadRequest unless ``handle`` is one of ``kinds``: a call given another
    object (a Fetch where a Hit goes, None) says what it takes."""
    if not isinstance(handle, kinds):
        got = "None" if handle is None else f"a {type(handle).__name__}"
        raise BadRequest(f"{call} takes {want}, not {got}")


def _no_gens() -> np.ndarray:
    """Handles without slots, or without a lease, share one empty, read-only array."""
    return _NO_GENS


@dataclass(slots=True, eq=False)
class Namespace:
    """A registered namespace; ``id`` is updated if the daemon restarts.
    ``events``: its event metadata, registered again with it."""

    spec: NamespaceSpec
    id: int
    digest: bytes
    events: EventMeta | None = None

    @property
    def page_tokens(self) -> int:
        return self.spec.page_tokens

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes


@dataclass(slots=True, eq=False)
class LeaseState:
    """What every handle on one lease shares: its deadline on this client's
    monotonic clock (copies stop there; ``renew`` moves it) and whether it has
    ended here (committed, aborted, released)."""

    deadline: float = float("inf")
    closed: bool = False


class _Leased:
    """What both handles offer: their lease's deadline and end, and views."""

    __slots__ = ()
    state: LeaseState
    offsets: list[int]
    gens: np.ndarray

    @property
    def deadline(self) -> float:
        return self.state.deadline

    @property
    def closed(self) -> bool:
        return self.state.closed

    def portable(self) -> PortableHandle:
        """This handle in plain fields, for a worker process on the same host that
        copies through it (``Client.adopt``); the lease stays this handle's.
        Reservations of key-addressed namespaces only: their commit moves each
        published slot's generation and their release quarantines the rest, so
        a worker's late write can never land in a published or reused page."""
        if isinstance(self, Reservation) and not self.ns.spec.keyed:
            raise BadRequest(TOKEN_WRITE)
        return PortableHandle(
            kind="write" if isinstance(self, Reservation) else "read",
            spec=self.ns.spec,  # type: ignore[attr-defined]
            instance=self.instance,  # type: ignore[attr-defined]
            lease=self.lease,  # type: ignore[attr-defined]
            deadline=self.state.deadline,
            offsets=list(self.offsets),
            gens=np.ascontiguousarray(self.gens, dtype=np.uint32).tobytes(),
        )

    def select(self, pages: Sequence[int]) -> Self:
        """A view on some of this handle's slots, in the given order, for copies;
        it shares the lease (its deadline, its end) with this handle."""
        try:  # numbers, one way for both lists: numpy takes bools as a mask
            idx = [operator.index(i) for i in pages]
        except TypeError:
            raise IndexError("pages are page numbers (integers)") from None
        offsets = self.offsets
        if any(not 0 <= i < len(offsets) for i in idx):
            raise IndexError(f"pages must be in 0..{len(offsets) - 1}")
        gens = self.gens[np.asarray(idx, dtype=np.intp)] if len(self.gens) else self.gens
        view = replace(self, offsets=[offsets[i] for i in idx], gens=gens, view=True)  # type: ignore[type-var]
        return view


@dataclass(slots=True, eq=False)
class Reservation(_Leased):
    """Slots to fill for pages ``present .. present + len(offsets)`` of a sequence.

    Write with ``Client.write_pages(res, pages)`` before its deadline (renew
    the lease for long copies), then ``commit``.
    """

    ns: Namespace
    lease: int
    present: int
    offsets: list[int]
    pool_full: bool
    instance: int
    state: LeaseState = field(default_factory=LeaseState)
    gens: np.ndarray = field(default_factory=_no_gens, repr=False)
    view: bool = False  # made by select() or adopt(): copies only, the lease is another's
    # key-addressed reservations: offsets[j] is the slot of keys[indices[j]], and
    # present_mask[i] says keys[i] was in L2 already (token ones: the pages after present)
    indices: list[int] = field(default_factory=list)
    present_mask: list[bool] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Hit(_Leased):
    """The leading ``hits`` pages of a sequence, in ``offsets``, under ``lease``;
    ``l3_hits`` more pages are known to be in L3.

    Read with ``Client.read_pages(hit)`` before its deadline, then ``release``.
    A hit without a lease (``match(..., lease=False)``) only counts pages.
    """

    ns: Namespace
    hits: int
    offsets: list[int]
    lease: int
    instance: int
    l3_hits: int = 0
    state: LeaseState = field(default_factory=LeaseState)
    gens: np.ndarray = field(default_factory=_no_gens, repr=False)
    view: bool = False


class PortableHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A handle in plain fields (``portable()``), to hand to a worker process of
    the same host: the deadline is on the host's monotonic clock, which every
    process shares. Copies through it keep every fence; a daemon restart or
    a moved slot makes them a miss."""

    kind: str  # "write" (a Reservation's) or "read" (a Hit's)
    spec: NamespaceSpec
    instance: int
    lease: int
    deadline: float
    offsets: list[int]
    gens: bytes  # uint32 generations, one per offset


class KeysFound(msgspec.Struct, frozen=True):
    """Where the pages of some keys are: ``l2`` leading keys are in L2,
    ``leading`` (>= l2) leading keys in L2 or L3; per key, ``in_l2`` and ``in_l3``."""

    l2: int
    leading: int
    in_l2: list[bool]
    in_l3: list[bool]


@dataclass(slots=True, eq=False)
class Fetch:
    """A background load from L3 of the pages after the first ``l2_hits``.

    ``lease`` 0 means there was nothing to load (no L3, or all in L2).
    """

    ns: Namespace
    lease: int
    l2_hits: int
    instance: int


class FetchProgress(msgspec.Struct, frozen=True):
    """``completed`` leading pages are in L2; see protocol.ProgressOk."""

    planned: int
    completed: int
    done: bool
    failed: bool
