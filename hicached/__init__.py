"""hicached: a per-host hierarchical KV-cache daemon and its engine-side client."""

from hicached.client import (
    AsyncClient,
    Client,
    CurveKeys,
    Fetch,
    FetchProgress,
    Hit,
    Namespace,
    Reservation,
)
from hicached.errors import DaemonUnavailable, HicachedError, StaleHandle
from hicached.namespace import NamespaceSpec

__all__ = [
    "AsyncClient",
    "Client",
    "CurveKeys",
    "DaemonUnavailable",
    "Fetch",
    "FetchProgress",
    "HicachedError",
    "Hit",
    "Namespace",
    "NamespaceSpec",
    "Reservation",
    "StaleHandle",
]
__version__ = "0.1.0"
