"""The engine side's client: the exchanges both transports drive (core), the
socket they go over (dealer), the pool view that survives a daemon restart
(poolview), the sync and asyncio clients, handles, the fenced copies
(mapping), the measured pick of their scattered-copy kernels (gather) and the
CUDA path."""

from hicached.client.aio import AsyncClient
from hicached.client.core import CurveKeys
from hicached.client.gather import GatherChoice, gather_choice
from hicached.client.handles import (
    Fetch,
    FetchProgress,
    Hit,
    KeysFound,
    Namespace,
    PortableHandle,
    Reservation,
)
from hicached.client.mapping import PendingCopy, cuda_tensor
from hicached.client.sync import Client

__all__ = [
    "AsyncClient",
    "Client",
    "CurveKeys",
    "Fetch",
    "FetchProgress",
    "GatherChoice",
    "Hit",
    "KeysFound",
    "Namespace",
    "PendingCopy",
    "PortableHandle",
    "Reservation",
    "cuda_tensor",
    "gather_choice",
]
