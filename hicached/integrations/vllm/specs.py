"""What travels from vLLM's scheduler to its workers: the pages to load or to
store (as portable handles, one per KV cache group), and the workers' word on
each store.
"""

from __future__ import annotations

import msgspec
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
)

from hicached.client.handles import PortableHandle

# -- what travels from the scheduler to the workers -----------------------------------


Handles = list[PortableHandle | None]


def _pages(handles: Handles) -> list[int]:
    return [len(h.offsets) if h is not None else 0 for h in handles]


class HicachedLoadSpec(LoadStoreSpec):
    """Pages to load: per KV cache group (in the transfer's group order), a read
    lease's slots, one per key of that group, in the keys' order; None for a
    group with nothing to load."""

    def __init__(self, handles: Handles) -> None:
        self.handles = handles

    def __repr__(self) -> str:
        return f"HicachedLoadSpec(pages={_pages(self.handles)})"


class HicachedStoreSpec(LoadStoreSpec):
    """Slots to fill, per KV cache group one per key of it to store (None: none),
    and where to say how the copy went."""

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
