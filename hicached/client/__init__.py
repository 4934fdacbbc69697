"""The engine side's client: the exchanges both transports drive, the pool
view that survives a daemon restart, the sync and asyncio clients, handles,
the fenced copies (mapping) and the CUDA path."""

from hicached.client.clients import (
    AsyncClient,
    Client,
    CurveKeys,
    Fetch,
    FetchProgress,
    Hit,
    KeysFound,
    Namespace,
    PortableHandle,
    Reservation,
    cuda_tensor,
)

__all__ = [
    "AsyncClient",
    "Client",
    "CurveKeys",
    "Fetch",
    "FetchProgress",
    "Hit",
    "KeysFound",
    "Namespace",
    "PortableHandle",
    "Reservation",
    "cuda_tensor",
]
