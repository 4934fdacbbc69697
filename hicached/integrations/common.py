"""What the engine integrations share: their settings, read from the engine's
extra config, namespace names made from the engine's model name, and requests
cut to the daemon's page limit.

Engines pass a backend one dict of extra config, their own keys beside ours;
each integration takes the keys its ``Settings`` knows, typed and checked.
Engines name a model by a hub id (``org/name``) or by a local path; a
namespace's model must be safe in a path and a metric label (docs/keys.md).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)

_MODEL_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def safe_model(name: str) -> str:
    """An engine's model name as a namespace model: a hub id as it is, a path by
    its last two parts, each made of letters, digits, '.', '_' and '-' only."""
    parts = [p for p in name.split("/") if p not in ("", ".", "..")][-2:]
    safe = [re.sub(r"[^A-Za-z0-9._-]", "_", p).lstrip("._-")[:128] for p in parts]
    return "/".join(p for p in safe if _MODEL_PART.fullmatch(p)) or "model"


def default_revision(name: str, tags: Sequence[str] = ()) -> str:
    """A local directory's path, digested: two directories never share pages
    because their last parts have the same names. ``tags``: suffixes an engine
    may have added to the path it was given (SGLang's ``-{page format}``), with
    which a relative directory's name names no directory."""
    local = name
    for tag in tags:
        if name.endswith(tag) and os.path.isdir(name[: -len(tag)]):
            local = name[: -len(tag)]
    if not (name.startswith(("/", ".", "~")) or os.path.isdir(local)):
        return "main"
    path = os.path.realpath(os.path.expanduser(name))
    return "path-" + hashlib.sha256(path.encode()).hexdigest()[:16]


# Seconds an engine's extra config may set: finite (JSON configs parse NaN and
# Infinity, which no wait or deadline survives), never negative, at most a day.
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)]
# A timeout, which a zero would turn into an instant failure of every call.
Timeout = Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)]


def settings_from(cls: type[S], extra: Mapping[str, Any] | None) -> S:
    """``cls`` from the keys of an engine's extra config that it names (the
    engine's own keys are left to the engine); a bad value raises msgspec's
    ValidationError, naming the key."""
    ours = {f.name for f in msgspec.structs.fields(cls)}
    return msgspec.convert({k: v for k, v in (extra or {}).items() if k in ours}, cls)


def parts(count: int, limit: int) -> list[range]:
    """``range(count)`` in runs of ``limit`` at most, in order: the keys one
    request covers, where the daemon takes ``limit`` a request (the client's
    ``keys_per_request``: its ``server.max_pages_per_request``, or fewer where
    its ``server.max_message_bytes`` holds fewer; 0, not known yet: all in
    one)."""
    step = limit if 0 < limit < count else max(count, 1)
    return [range(i, min(i + step, count)) for i in range(0, count, step)]
