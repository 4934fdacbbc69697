"""The folder tree is the architecture (DESIGN.md, section 3): each layer imports
only the layers below it, the daemon's state and request logic import no I/O
(not even through another module), and every request type has one handler.
Static: read from the package's own sources, since ``import hicached`` itself
loads the client."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from hicached.cache import Cache
from hicached.config import Config
from hicached.wire import protocol as p

PACKAGE = Path(__file__).resolve().parent.parent / "hicached"
BACKENDS = PACKAGE.parent / "hicached_backends"
# what each layer may import of the package, besides the rules every layer shares
SHARED = {"hicached.errors", "hicached.config"}
ALLOWED = {
    "wire": {"wire"},
    "state": {"wire", "state"},
    "cache": {"wire", "state", "cache"},
    "daemon": {"wire", "state", "cache", "daemon"},
    "client": {"wire", "client"},
    "ranks": {"wire", "client", "ranks"},
}
NO_IO = {"zmq", "asyncio", "socket", "threading", "torch", "uvloop"}
# One concept per module (STYLE.md): a class past this many lines, or a module
# past that many, holds more than one; split it along a seam.
MAX_CLASS_LINES = 450
MAX_MODULE_LINES = 700


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module ``path`` imports, at any depth of its code: the package's own
    by full name, others by their top-level name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    out.add(f"{node.module}.{alias.name}")
    return {name if name.startswith("hicached") else name.split(".")[0] for name in out}


def layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in ALLOWED else None


def test_each_layer_imports_only_the_layers_below_it() -> None:
    known = modules()
    wrong = []
    for name, path in sorted(known.items()):
        mine = layer(name)
        if mine is None:
            continue
        for imported in imports(path, known):
            if not imported.startswith("hicached.") or imported in SHARED:
                continue
            theirs = layer(imported)
            if theirs is None or theirs not in ALLOWED[mine]:
                wrong.append(f"{name} imports {imported}")
    assert wrong == []


def test_state_and_cache_import_no_io_even_through_other_modules() -> None:
    known = modules()
    graph = {name: imports(path, known) for name, path in known.items()}
    wrong = []
    for name in sorted(known):
        if layer(name) not in ("state", "cache", "wire"):
            continue
        seen, todo = {name}, [name]
        while todo:
            for imported in graph[todo.pop()]:
                if imported in NO_IO:
                    wrong.append(f"{name} reaches {imported}")
                elif imported in graph and imported not in seen and imported != "hicached":
                    seen.add(imported)
                    todo.append(imported)
    assert wrong == []


def test_every_request_type_has_exactly_one_handler() -> None:
    cache = Cache(Config(), pool_path="/nonexistent")
    handled = set(cache._handlers)
    before_a_session = {p.Hello, p.Goodbye, p.Stats}  # Cache.handle answers these itself
    assert not handled & before_a_session
    assert handled | before_a_session == set(get_args(p.AnyRequest))


def test_at_most_a_dozen_modules_sit_directly_in_the_package() -> None:
    flat = [path.name for path in PACKAGE.glob("*.py")]
    assert len(flat) <= 12, sorted(flat)


def test_every_write_policy_the_config_names_is_one_object() -> None:
    from hicached.cache.policy import POLICIES
    from hicached.config import WRITE_POLICIES

    assert set(POLICIES) == set(WRITE_POLICIES)
    assert all(POLICIES[name].name == name for name in POLICIES)


def oversized(path: Path) -> list[str]:
    """What in ``path`` is over the limits: the module, and each class."""
    text = path.read_text()
    name = path.relative_to(PACKAGE.parent).as_posix()
    lines = len(text.splitlines())
    out = [f"{name}: {lines} lines"] if lines > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            size = node.end_lineno - node.lineno + 1
            if size > MAX_CLASS_LINES:
                out.append(f"{name}: class {node.name}, {size} lines")
    return out


def test_no_class_over_450_lines_and_no_module_over_700() -> None:
    sources = [*PACKAGE.rglob("*.py"), *BACKENDS.rglob("*.py")]
    over = [found for path in sorted(sources) for found in oversized(path)]
    assert over == []
