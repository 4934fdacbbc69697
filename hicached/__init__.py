"""hicached: a per-host hierarchical KV-cache daemon and its engine-side client."""

from hicached import _moved  # noqa: F401 (old module names, before anything imports one)
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
from hicached.wire.namespace import NamespaceSpec

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
