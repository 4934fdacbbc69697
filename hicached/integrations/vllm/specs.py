"""What travels from vLLM's scheduler to its workers: the pages to load or to
store (as portable handles), and the workers' word on each store.
"""

from __future__ import annotations

import msgspec
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
)

from hicached.client.handles import PortableHandle

# -- what travels from the scheduler to the workers -----------------------------------


class HicachedLoadSpec(LoadStoreSpec):
    """Pages to load: a read lease's slots, one per key, in the keys' order."""

    def __init__(self, handle: PortableHandle) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return f"HicachedLoadSpec(lease={self.handle.lease}, pages={len(self.handle.offsets)})"


class HicachedStoreSpec(LoadStoreSpec):
    """Slots to fill, one per key to store, and where to say how the copy went."""

    def __init__(self, handle: PortableHandle | None, acks: str) -> None:
        self.handle = handle
        self.acks = acks

    def __repr__(self) -> str:
        pages = len(self.handle.offsets) if self.handle else 0
        return f"HicachedStoreSpec(pages={pages})"


class Ack(msgspec.Struct, array_like=True, frozen=True):
    """A worker's word on one store: which of the slots it wrote (one byte each)."""

    instance: int
    lease: int
    rank: int
    written: bytes
