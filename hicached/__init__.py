"""hicached: a per-host hierarchical KV-cache daemon and its engine-side client."""

from hicached.client import (
    AsyncClient,
    Client,
    CurveKeys,
    Hit,
    Namespace,
    Prefetch,
    Progress,
    Reservation,
)
from hicached.errors import HicachedError
from hicached.namespace import NamespaceSpec

__all__ = [
    "AsyncClient",
    "Client",
    "CurveKeys",
    "HicachedError",
    "Hit",
    "Namespace",
    "NamespaceSpec",
    "Prefetch",
    "Progress",
    "Reservation",
]
__version__ = "0.1.0"
