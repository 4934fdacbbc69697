"""hicached's vLLM tier against vLLM 0.33's interfaces, read from the source of
the released 0.33.0 wheel (tests/engines/vllm_source.py fetches it once).

The engine tests run vLLM 0.32, so hicached's classes import 0.32 there; here
their source is compared with 0.33's without importing either vLLM:

- every abstract method of 0.33's ``OffloadingSpec``, ``OffloadingManager``
  and ``OffloadingWorker`` is defined by ``HicachedOffloadingSpec``,
  ``HicachedManager`` and ``HicachedWorker``;
- every method they define that 0.33's classes define too takes the same
  parameters (names, kinds, order, defaults) and is the same kind of
  attribute (a property, a classmethod), and they define no public method
  0.33 does not know (a misspelt override);
- 0.33's additions are all there: ``submit_load(..., expedited=False)``,
  ``lock``, ``on_reset_flushed``, ``config_info`` and ``config_info_keys``;
- every call 0.33's offloading connector makes on the manager, the worker and
  the spec binds to those signatures (positional count and keywords);
- what hicached takes of 0.33's offload layouts is there: the config fields,
  the connector's rule that only rank 0 stores replicated pages, the
  canonical page sizes and writer turns hicached mirrors;
- hicached's event structs are 0.33's, field for field, and 0.33's own
  classes (built from its source) decode what hicached sends and encode it
  again to the very same bytes.

An expedited load through the worker itself: tests/test_vllm_worker.py.
"""

from __future__ import annotations

import ast
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hicached.config import EventsConfig
from hicached.wire import events as ours
from tests.engines import vllm_source

# The first test may wait for the wheel's download (once per pin and machine).
pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parent.parent
VLLM_DIR = ROOT / "hicached" / "integrations" / "vllm"
BASE = "vllm/v1/kv_offload/base.py"
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/offloading"
# (vLLM's class, hicached's class, the file that defines it)
PAIRS = (
    ("OffloadingSpec", "HicachedOffloadingSpec", VLLM_DIR / "__init__.py"),
    ("OffloadingManager", "HicachedManager", VLLM_DIR / "manager.py"),
    ("OffloadingWorker", "HicachedWorker", VLLM_DIR / "worker.py"),
)
# What 0.33 added that hicached must implement, not inherit as no-ops.
ADDED = {
    "HicachedOffloadingSpec": {"config_info_keys"},
    "HicachedManager": {"lock", "on_reset_flushed", "config_info"},
    "HicachedWorker": {"submit_load"},
}
# Public names of hicached's own beside vLLM's interface.
OWN = {"HicachedManager": {"namespace"}}


@dataclass(frozen=True)
class Method:
    """A method as its source declares it."""

    name: str
    kind: str  # "method", "property", "classmethod" or "staticmethod"
    abstract: bool
    positional: tuple[str, ...]  # without self/cls, in order
    defaults: tuple[str, ...]  # the last len(defaults) positional ones', as source
    keyword_only: tuple[tuple[str, str | None], ...]  # (name, default as source)
    varargs: bool
    varkw: bool

    def accepts(self, positional: int, keywords: set[str]) -> str | None:
        """Why a call with ``positional`` arguments and ``keywords`` would not bind."""
        if positional > len(self.positional) and not self.varargs:
            return f"{positional} positional arguments, {len(self.positional)} taken"
        names = set(self.positional[positional:]) | {n for n, _ in self.keyword_only}
        unknown = keywords - names
        if unknown and not self.varkw:
            return f"keywords {sorted(unknown)} not taken"
        required = len(self.positional) - len(self.defaults)
        missing = [n for n in self.positional[positional:required] if n not in keywords] + [
            n for n, default in self.keyword_only if default is None and n not in keywords
        ]
        return f"{missing} missing" if missing else None


def _decorators(node: ast.FunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _method(node: ast.FunctionDef) -> Method:
    decorators = _decorators(node)
    kind = next(
        (k for k in ("property", "classmethod", "staticmethod") if k in decorators), "method"
    )
    args = node.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    if kind != "staticmethod":
        positional = positional[1:]
    return Method(
        name=node.name,
        kind=kind,
        abstract="abstractmethod" in decorators,
        positional=tuple(positional),
        defaults=tuple(ast.unparse(d) for d in args.defaults),
        keyword_only=tuple(
            (a.arg, None if d is None else ast.unparse(d))
            for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
        ),
        varargs=args.vararg is not None,
        varkw=args.kwarg is not None,
    )


def methods(path: Path, cls: str) -> dict[str, Method]:
    """The methods class ``cls`` of ``path`` defines itself."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                m.name: _method(m)
                for m in node.body
                if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    raise AssertionError(f"no class {cls} in {path}")


@pytest.fixture(scope="module")
def source() -> Path:
    return vllm_source.fetch()


@pytest.mark.parametrize(("theirs", "mine", "path"), PAIRS, ids=[p[1] for p in PAIRS])
def test_every_abstract_method_of_0_33_is_implemented(
    source: Path, theirs: str, mine: str, path: Path
) -> None:
    base = methods(source / BASE, theirs)
    abstract = {name for name, m in base.items() if m.abstract}
    assert abstract, f"0.33's {theirs} declares no abstract method: not the source expected"
    missing = abstract - methods(path, mine).keys()
    assert not missing, f"{mine} lacks 0.33's abstract {sorted(missing)}"


@pytest.mark.parametrize(("theirs", "mine", "path"), PAIRS, ids=[p[1] for p in PAIRS])
def test_overrides_take_0_33s_parameters(source: Path, theirs: str, mine: str, path: Path) -> None:
    base = methods(source / BASE, theirs)
    own = methods(path, mine)
    for name, m in own.items():
        if name.startswith("_"):
            continue  # constructors: vLLM builds only the spec, with one argument (below)
        if name not in base:
            assert name in OWN.get(mine, set()), f"{mine}.{name} overrides nothing in 0.33"
            continue
        want = base[name]
        assert m.kind == want.kind, f"{mine}.{name} is a {m.kind}, 0.33's a {want.kind}"
        assert m.positional == want.positional, (
            f"{mine}.{name}{m.positional}: 0.33 takes {want.positional}"
        )
        assert m.defaults == want.defaults, f"{mine}.{name} defaults {m.defaults}: {want.defaults}"
        assert m.keyword_only == want.keyword_only, f"{mine}.{name} keyword-only differ"
        assert (m.varargs, m.varkw) == (want.varargs, want.varkw), f"{mine}.{name} */** differ"
    if mine == "HicachedOffloadingSpec":
        assert own["__init__"].positional == base["__init__"].positional == ("config",)


@pytest.mark.parametrize(("theirs", "mine", "path"), PAIRS, ids=[p[1] for p in PAIRS])
def test_what_0_33_added_is_implemented(source: Path, theirs: str, mine: str, path: Path) -> None:
    base = methods(source / BASE, theirs)
    own = methods(path, mine)
    for name in ADDED[mine]:
        assert name in base, f"0.33's {theirs} has no {name}: not the source expected"
        assert name in own, f"{mine} inherits 0.33's default {name}"
    if mine == "HicachedWorker":
        assert own["submit_load"].positional[-1] == "expedited"
        assert own["submit_load"].defaults[-1] == "False"


def _calls(path: Path, owner: str) -> list[tuple[int, str, int, set[str]]]:
    """Calls ``self.<owner>.name(...)`` in ``path``: (line, name, positional, keywords)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        target = node.func.value
        if (
            isinstance(target, ast.Attribute)
            and target.attr == owner
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        ):
            assert not any(isinstance(a, ast.Starred) for a in node.args), "a *args call"
            keywords = {k.arg for k in node.keywords if k.arg is not None}
            found.append((node.lineno, node.func.attr, len(node.args), keywords))
    return found


@pytest.mark.parametrize(
    ("file", "owner", "theirs", "mine", "path"),
    [
        ("scheduler.py", "manager", *PAIRS[1]),
        ("worker.py", "worker", *PAIRS[2]),
        ("worker.py", "spec", *PAIRS[0]),
    ],
    ids=["scheduler-manager", "worker-worker", "worker-spec"],
)
def test_the_connectors_calls_bind_to_our_methods(
    source: Path, file: str, owner: str, theirs: str, mine: str, path: Path
) -> None:
    base = methods(source / BASE, theirs)
    own = methods(path, mine)
    calls = _calls(source / CONNECTOR / file, owner)
    assert calls, f"0.33's {file} makes no call on self.{owner}: not the source expected"
    for line, name, positional, keywords in calls:
        m = own.get(name) or base.get(name)
        assert m is not None, f"{file}:{line} calls {owner}.{name}, which nobody defines"
        why = m.accepts(positional, keywords)
        assert why is None, f"{file}:{line} {owner}.{name}(...) does not bind: {why}"
    if owner == "worker":  # the one 0.33 call that 0.32's signature refused
        assert ("submit_load", {"expedited"}) in [(n, k) for _, n, _, k in calls]


def test_the_manager_lock_is_a_property_the_scheduler_enters(source: Path) -> None:
    """0.33's scheduler enters ``self.manager.lock`` (an attribute, not a call)."""
    text = (source / CONNECTOR / "scheduler.py").read_text()
    assert "enter_context(self.manager.lock)" in text and "with self.manager.lock" in text
    assert methods(VLLM_DIR / "manager.py", "HicachedManager")["lock"].kind == "property"


def test_what_groups_py_reads_of_the_connector_is_there_in_0_33(source: Path) -> None:
    """groups.py finds each KV cache group's kind with vLLM's own
    ``get_sliding_window_size_in_chunks`` (0.33 moved it to the connector's
    config module; groups.py imports it from there first) and its specs in
    the ``kv_cache_config`` of ``OffloadingConnector.__init__``'s frame."""
    config = ast.parse((source / CONNECTOR / "config.py").read_text())
    found = [
        [a.arg for a in n.args.args]
        for n in config.body
        if isinstance(n, ast.FunctionDef) and n.name == "get_sliding_window_size_in_chunks"
    ]
    assert found == [["kv_cache_spec", "tokens_per_chunk"]]  # kind_of passes these two
    groups = (VLLM_DIR / "groups.py").read_text()
    assert "kv_connector.v1.offloading.config import (" in groups
    connector = methods(source / f"{CONNECTOR}_connector.py", "OffloadingConnector")
    assert "kv_cache_config" in connector["__init__"].positional


def _declared(tree: ast.Module, cls: str) -> set[str]:
    """The annotated fields a dataclass of ``tree`` declares."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {ast.unparse(n.target) for n in node.body if isinstance(n, ast.AnnAssign)}
    raise AssertionError(f"no class {cls}")


def test_the_layouts_hicached_takes_are_those_0_33_hands_a_spec(source: Path) -> None:
    """groups.py and layouts.py read ``replicated_layout``, ``canonical_layout``,
    ``kv_cache_layout`` and ``is_parallelism_agnostic`` of vLLM's
    OffloadingConfig, and the ``vllm_config`` beside ``kv_cache_config`` in
    ``OffloadingConnector.__init__``'s frame; and hicached's replicated pages
    take one writer because 0.33's connector still submits stores under
    ``replicated_layout`` to rank 0 alone (every rank under canonical_layout)."""
    config = ast.parse((source / "vllm/v1/kv_offload/config.py").read_text())
    assert {"replicated_layout", "canonical_layout", "kv_cache_layout"} <= _declared(
        config, "OffloadingConfig"
    )
    assert "is_parallelism_agnostic" in _declared(config, "OffloadingParallelConfig")
    connector = methods(source / f"{CONNECTOR}_connector.py", "OffloadingConnector")
    assert {"vllm_config", "kv_cache_config"} <= set(connector["__init__"].positional)
    worker = ast.parse((source / CONNECTOR / "worker.py").read_text())
    gates = [
        ast.unparse(n.value)
        for n in ast.walk(worker)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "self._is_store_writer"
    ]
    assert gates == [
        "not self.spec.replicated_layout or self.spec.config.canonical_layout "
        "or self.spec.config.parallel.rank == 0"
    ]


def test_0_33s_canonical_pages_are_those_hicached_sizes_and_turns(source: Path) -> None:
    """layouts.py sizes a canonical page from the KV cache spec as 0.33's
    ``canonical_mapping._layer_mapping`` does (every head once; the MLA latent
    once), names it by ``canonical_format_id``, and copies.py takes turns at
    bytes several ranks hold as vLLM's ``CanonicalPageMapping.is_writer``
    does, reading the mapping's fields by these names. (Each worker also
    checks vLLM's own mappings against the sizes at its start.)"""
    mapping = vllm_source.wheel_text(f"{CONNECTOR}/canonical_mapping.py")
    assert "def canonical_format_id(kv_cache_layout: str) -> str:" in mapping
    assert "canonical_page_size_bytes=ctx.cp_size * page," in mapping  # MLA
    assert "canonical_page_size_bytes=ctx.cp_size * num_head_shards * page," in mapping
    assert "num_head_shards, replication = tp, 1" in mapping  # heads >= TP
    assert "num_head_shards, replication = total, tp // total" in mapping  # TP > heads
    base = ast.parse((source / BASE).read_text())
    assert {
        "canonical_page_size_bytes",
        "runs",
        "num_writers",
        "writer_index",
        "parallelism_agnostic",
    } <= _declared(base, "CanonicalPageMapping")
    assert {
        "local_offset",
        "canonical_offset",
        "fragment_size",
        "num_fragments",
        "local_stride",
        "canonical_stride",
    } <= _declared(base, "CopyRun")
    assert "return block_id % self.num_writers == self.writer_index" in (source / BASE).read_text()
    gpu_worker = vllm_source.wheel_text("vllm/v1/kv_offload/cpu/gpu_worker.py")
    # vLLM's canonical page id, whose turn copies.py takes by slot: chunk * blocks + place
    assert "block_ids[:, np.newaxis] * blocks_per_chunk + np.arange(blocks_per_chunk)" in (
        gpu_worker
    )


# -- events -----------------------------------------------------------------------------

STRUCTS = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared")


def vllm_events(source: Path) -> types.ModuleType:
    """0.33's event structs, built from their source (the rest of its module
    imports vLLM): the classes as they are, in a module of their own."""
    hash_alias = None
    for node in ast.parse((source / "vllm/v1/core/kv_cache_utils.py").read_text()).body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "ExternalBlockHash":
            assert node.value is not None
            hash_alias = ast.unparse(node.value)
    assert hash_alias is not None, "0.33 defines no ExternalBlockHash"
    tree = ast.parse((source / "vllm/distributed/kv_events.py").read_text())
    classes = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in (*STRUCTS, "KVEventBatch")
    ]
    assert {c.name for c in classes} == {*STRUCTS, "KVEventBatch"}
    module = types.ModuleType("vllm_0_33_kv_events")
    sys.modules[module.__name__] = module
    header = f"import msgspec\nfrom typing import Any\nExternalBlockHash = {hash_alias}\n"
    exec(header, module.__dict__)
    where = str(source / "vllm/distributed/kv_events.py")
    exec(compile(ast.Module(body=classes, type_ignores=[]), where, "exec"), module.__dict__)
    return module


def _fields(cls: type) -> list[tuple[str, Any]]:
    return [
        (f.name, msgspec.NODEFAULT if f.required else f.default)
        for f in msgspec.structs.fields(cls)
    ]


@pytest.fixture(scope="module")
def v33(source: Path) -> types.ModuleType:
    return vllm_events(source)


@pytest.mark.parametrize(
    "name", ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"]
)
def test_event_structs_are_0_33s_field_for_field(v33: types.ModuleType, name: str) -> None:
    theirs, mine = getattr(v33, name), getattr(ours, name)
    assert _fields(mine) == _fields(theirs)
    for option in ("array_like", "omit_defaults", "tag_field", "tag"):
        assert getattr(mine.__struct_config__, option) == getattr(theirs.__struct_config__, option)


@pytest.mark.parametrize("name", ["BlockStored", "BlockRemoved", "AllBlocksCleared"])
def test_the_array_layout_keeps_0_33s_required_fields_only(
    v33: types.ModuleType, name: str
) -> None:
    """msgspec writes every field of an array, defaults too: the older layout
    stays as it was, and a decoder with more trailing fields still reads it."""
    theirs = [f for f, d in _fields(getattr(v33, name)) if d is msgspec.NODEFAULT]
    assert [f for f, _ in _fields(getattr(ours, f"Array{name}"))] == theirs


def _payloads() -> list[bytes]:
    keys = [bytes(range(i, i + 16)) for i in range(3)]
    records: list[ours.AnyEvent] = [
        ours.Cleared(),
        ours.Stored(keys, None, list(range(32)), 16, ours.MEDIUM_L2, "m"),
        ours.Stored(keys[1:], keys[0], [], 0, "FILE", "m"),
        ours.Removed(keys[:1], ours.MEDIUM_L2, "m"),
    ]
    return [
        ours.WireFormat(EventsConfig(block_hashes=form, data_parallel_rank=rank)).encode(records)
        for form in ("int", "bytes")
        for rank in (0, 3)
    ]


def test_0_33s_classes_decode_what_hicached_sends_and_encode_the_same_bytes(
    v33: types.ModuleType,
) -> None:
    decoder = msgspec.msgpack.Decoder(v33.KVEventBatch)
    for payload in _payloads():
        batch = decoder.decode(payload)
        assert [type(e).__name__ for e in batch.events] == [
            "AllBlocksCleared",
            "BlockStored",
            "BlockStored",
            "BlockRemoved",
        ]
        stored = batch.events[1]
        assert stored.lookahead_token_ids is None  # no lookahead in hicached's keys
        assert stored.token_ids == list(range(32)) and stored.medium == "CPU"
        assert msgspec.msgpack.encode(batch) == payload


def test_0_33s_lookahead_reaches_hicacheds_decoder(v33: types.ModuleType) -> None:
    """A 0.33 engine's event with lookahead tokens, read by hicached's tools."""
    event = v33.BlockStored(
        block_hashes=[7],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        lookahead_token_ids=[[3, 4]],
    )
    payload = msgspec.msgpack.encode(v33.KVEventBatch(ts=1.0, events=[event]))
    batch = ours.decode_batch(payload)
    got = batch.events[0]
    assert isinstance(got, ours.BlockStored)
    assert got.lookahead_token_ids == [[3, 4]]
    assert msgspec.msgpack.encode(batch) == payload
