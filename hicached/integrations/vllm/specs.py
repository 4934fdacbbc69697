"""What travels from vLLM's scheduler to its workers: the pages to load or to
store (as portable handles, per KV cache group one a part of its keys), and
the workers' word on each store.
"""

from __future__ import annotations

import msgspec
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
)

from hicached.client.handles import PortableHandle

# -- what travels from the scheduler to the workers -----------------------------------


# Per KV cache group (in the transfer's group order), the handles of its pages in
# the order of its keys: one, or one a part where the daemon took the group's
# keys in parts (its server.max_pages_per_request a request); none for a group
# with nothing to move.
Handles = list[list[PortableHandle]]


def _pages(handles: Handles) -> list[int]:
    return [sum(len(h.offsets) for h in mine) for mine in handles]


class HicachedLoadSpec(LoadStoreSpec):
    """Pages to load: per KV cache group, read leases' slots, one per key of that
    group, in the keys' order (``Handles``)."""

    def __init__(self, handles: Handles) -> None:
        self.handles = handles

    def __repr__(self) -> str:
        return f"HicachedLoadSpec(pages={_pages(self.handles)})"


class HicachedStoreSpec(LoadStoreSpec):
    """Slots to fill, per KV cache group one per key of it to store, in the keys'
    order (``Handles``), and where to say how the copy went."""

    def __init__(self, handles: Handles, acks: str) -> None:
        self.handles = handles
        self.acks = acks

    def __repr__(self) -> str:
        return f"HicachedStoreSpec(pages={_pages(self.handles)})"


class Ack(msgspec.Struct, array_like=True, frozen=True):
    """A worker's word on one store's handle (one per group): which of its slots
    it wrote (one byte each)."""

    instance: int
    lease: int
    rank: int
    written: bytes
