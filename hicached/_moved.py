"""Old module names, kept for one release: ``import hicached.protocol`` (and
every other module that moved into a layer folder) gives the module at its new
place, the same object under both names, so a patch through one is seen through
the other. New code imports the new paths."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MOVED = {
    "hicached.protocol": "hicached.wire.protocol",
    "hicached.namespace": "hicached.wire.namespace",
    "hicached.hashing": "hicached.wire.hashing",
    "hicached.arena": "hicached.wire.arena",
    "hicached.pool": "hicached.state.pool",
    "hicached.index": "hicached.state.index",
    "hicached.keyindex": "hicached.state.keyindex",
    "hicached.l2": "hicached.state.l2",
    "hicached.l3state": "hicached.state.l3state",
    "hicached.sessions": "hicached.cache.sessions",
    "hicached.chainorder": "hicached.cache.chainorder",
    "hicached.server": "hicached.daemon.server",
    "hicached.storage": "hicached.daemon.tier",
    "hicached.dispatcher": "hicached.daemon.dispatcher",
    "hicached.notify": "hicached.daemon.notify",
    "hicached.metrics": "hicached.daemon.metrics",
    "hicached.tenants": "hicached.daemon.tenants",
    "hicached.handles": "hicached.client.handles",
    "hicached.mapping": "hicached.client.mapping",
    "hicached.cuda": "hicached.client.cuda",
    "hicached.dist": "hicached.ranks.agreement",
    "hicached.coordinator": "hicached.ranks.coordination",
    "hicached.simulator": "hicached.ranks.simulator",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the module at its new place."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module ran under its new name already."""


def install() -> None:
    if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Moved())  # ahead of path finders: only its own names


install()
