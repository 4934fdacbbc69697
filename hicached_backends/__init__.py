"""Storage backends (L3) for hicached, found by name through entry points.

Built-in: memory (the reference oracle), file, s3, mooncake. A third-party
package adds one by declaring an entry point in the ``hicached.backends``
group: ``name = "package.module:BackendClass"``.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from hicached.errors import ConfigError
from hicached_backends.base import Backend, BackendEnv, BackendError, PageRef

__all__ = ["Backend", "BackendEnv", "BackendError", "PageRef", "available", "load_backend_class"]

GROUP = "hicached.backends"

# What to install when a built-in backend's optional dependency is missing.
_EXTRAS = {
    "s3": "pip install 'hicached[s3]' (boto3)",
    "mooncake": "pip install 'hicached[mooncake]' (mooncake-transfer-engine or, on CPU-only "
    "hosts, mooncake-transfer-engine-non-cuda, plus the libibverbs1 system package)",
}


def available() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_backend_class(name: str) -> type[Backend]:
    """The backend class registered as ``name``; unknown names fail loudly."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise ConfigError(
            f"storage.backend: unknown backend {name!r}; installed backends: "
            f"{', '.join(available()) or 'none'}"
        )
    try:
        cls = found[0].load()
    except ImportError as exc:
        hint = _EXTRAS.get(name, f"install the package that provides {found[0].value}")
        raise ConfigError(f"storage.backend {name!r} cannot be loaded ({exc}): {hint}") from None
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"storage.backend {name!r} ({found[0].value}) is not a hicached Backend")
    return cls
