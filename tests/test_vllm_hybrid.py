"""hicached as vLLM's host KV tier for hybrid models, end to end: a real daemon
and real vLLM engine processes (CPU, tiny random-weight models that vLLM puts
in more than one KV cache group, tests/engines/tinyhybrid.py) joined by vLLM's
OffloadingConnector and hicached.integrations.vllm.

Per model, a first engine stores two prompts (X and Z). A second engine
process, with its model in a worker process of its own, then answers X
followed by other tokens, five times, while the test changes the daemon's
pool between the requests:

1. as it was: the prefix every group restores is cached through hicached,
   and the tokens and logprobs are those of an engine without hicached;
2. the window group's page at the hit's end (a sliding window's chunk, a GDN
   state) replaced by Z's: the output changes (the pages are really used);
3. the same for a full-attention page;
4. the window group's pages of X evicted (full attention's kept): a miss, not
   a partial hit, and the output of an engine without hicached;
5. the daemon stopped: the engine recomputes, same output.

vLLM asks window groups backward from a hit's end, so a window page is found
only where a request ended: X was stored by a request of exactly X.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicached import Client, NamespaceSpec
from hicached.arena import arena_path
from tests.engines import tinyhybrid
from tests.engines.vllm_engine import engine_python, hybrid_model_dir, run_engine, same_answer
from tests.support import Daemon

# The first test may wait for the venv build (minutes, once per pin and machine).
pytestmark = pytest.mark.timeout(1200)

ANSWER_TOKENS = 6
POOL_MIB = 16


@dataclass(frozen=True)
class Case:
    """One hybrid model: its engine's options and the prompts it answers."""

    kind: str
    stored: int  # tokens of X, the prefix a first engine stores
    cached: int  # tokens of X every group restores: up to X's last full chunk
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(11))

    @property
    def engine(self) -> dict[str, Any]:
        return tinyhybrid.ENGINE[self.kind]

    @property
    def block(self) -> int:
        return int(self.engine["block_size"])

    def options(self) -> list[str]:
        return ["--block-size", str(self.block), "--dtype", str(self.engine["dtype"])]


CASES = {
    # sliding window of 64 tokens (2 chunks of 32) + full attention; X ends
    # mid-chunk, so its window is chunks 5 and 6 and a hit ends at 192
    "gemma3": Case("gemma3", stored=200, cached=192),
    # a GDN state (vLLM's align mode: a state page at each 64-token boundary a
    # request's prefill reached; X's is at 256) + full attention
    "qwen3next": Case("qwen3next", stored=257, cached=256),
}


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, tinyhybrid.VOCAB, n).tolist()


def ask(tokens: list[int], reset: bool = False) -> dict[str, Any]:
    return {"prompt": tokens, "max_tokens": ANSWER_TOKENS, **({"reset": True} if reset else {})}


@dataclass
class Model:
    """A case's prompts: X and Z of the same length, and X with five endings."""

    case: Case
    x: list[int] = field(init=False)
    z: list[int] = field(init=False)
    probes: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.x = prompt(1, self.case.stored)
        self.z = prompt(2, self.case.stored)
        self.probes = [self.x + prompt(10 + i, 100) for i in range(5)]


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def python() -> Path:
    return engine_python()


@pytest.fixture(scope="module", params=sorted(CASES))
def model(request: pytest.FixtureRequest) -> Model:
    return Model(CASES[request.param])


@pytest.fixture(scope="module")
def model_path(python: Path, model: Model) -> Path:
    return hybrid_model_dir(python, model.case.kind)


@pytest.fixture(scope="module")
def daemon(model: Model) -> Iterator[Daemon]:
    """A daemon without L3, so a page evicted from L2 is gone."""
    d = Daemon(size_mib=POOL_MIB)
    try:
        yield d.start()
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def baselines(python: Path, model: Model, model_path: Path) -> list[dict[str, Any]]:
    """An engine without hicached answers the five probes, each from scratch."""
    asked = [ask(p, reset=True) for p in model.probes]
    results: list[dict[str, Any]] = run_engine(
        python, model_path, asked, extra=model.case.options()
    )["results"]
    assert [r["num_cached_tokens"] for r in results] == [0] * 5
    return results


@pytest.fixture(scope="module")
def stored(python: Path, model: Model, model_path: Path, daemon: Daemon) -> dict[str, Any]:
    """A first engine stores X and Z: every group's pages of them, as vLLM stores
    each group (full attention every chunk, a window its last chunks, a state
    the one at the end)."""
    first = run_engine(
        python,
        model_path,
        [ask(model.x), ask(model.z)],
        hicached=daemon.endpoint,
        extra=model.case.options(),
    )
    assert [r["num_cached_tokens"] for r in first["results"]] == [0, 0]
    return first


class Pool:
    """The daemon's pool, for changing a group's pages under an engine."""

    def __init__(self, daemon: Daemon, stored: dict[str, Any], model: Model) -> None:
        self.daemon = daemon
        self.block = model.case.block
        self.groups = {g["kind"]: g for g in stored["groups"]}
        # X's and Z's keys of KV cache group 0, from vLLM's own hashing
        self.keys = {
            "x": [bytes.fromhex(k) for k in stored["results"][0]["keys"]],
            "z": [bytes.fromhex(k) for k in stored["results"][1]["keys"]],
        }
        self.kept: list[tuple[int, np.ndarray]] = []

    def key(self, prompt: str, kind: str, end: int) -> bytes:
        """``prompt``'s key of group ``kind`` for the chunk ending at token ``end``."""
        group = self.groups[kind]["group"]
        return self.keys[prompt][end // self.block - 1][:-4] + group.to_bytes(4, "big")

    def namespace(self, c: Client, kind: str) -> Any:
        return c.register(NamespaceSpec(**self.groups[kind]["spec"]))

    def slot(self, c: Client, kind: str, key: bytes) -> tuple[int, int]:
        ns = self.namespace(c, kind)
        hit = c.match_keys(ns, [key])
        assert hit.hits == 1, f"no page of {kind} under that key"
        c.release(hit)
        return hit.offsets[0], ns.page_bytes

    def swap(self, kind: str, end: int) -> None:
        """X's page of group ``kind`` ending at ``end`` takes Z's bytes (kept, to restore)."""
        with self.daemon.client() as c:
            at, size = self.slot(c, kind, self.key("x", kind, end))
            there, _ = self.slot(c, kind, self.key("z", kind, end))
        pool = np.memmap(arena_path("/dev/shm", self.daemon.runtime), dtype=np.uint8, mode="r+")
        self.kept.append((at, pool[at : at + size].copy()))
        pool[at : at + size] = pool[there : there + size]
        pool.flush()

    def restore(self) -> None:
        if not self.kept:
            return
        pool = np.memmap(arena_path("/dev/shm", self.daemon.runtime), dtype=np.uint8, mode="r+")
        for at, page in self.kept:
            pool[at : at + len(page)] = page
        pool.flush()
        self.kept.clear()

    def evict(self, kind: str, ends: list[int], keep: str, keep_ends: list[int]) -> dict[str, Any]:
        """Evict every unpinned page, X's pages of group ``keep`` pinned meanwhile;
        where X's pages of both groups are after it."""
        with self.daemon.client() as c:
            kept_ns = self.namespace(c, keep)
            pinned = c.match_keys(kept_ns, [self.key("x", keep, e) for e in keep_ends])
            assert pinned.hits == len(keep_ends)
            gone_ns = self.namespace(c, kind)
            filler = c.register(
                model="test/filler", kv_dtype="uint8", layout="filler", page_tokens=16,
                page_bytes=gone_ns.page_bytes,
            )  # fmt: skip
            pages = (POOL_MIB << 20) // gone_ns.page_bytes
            for salt in range(2):
                tokens = np.arange(pages * 16, dtype=np.uint32) + salt * 10**7
                c.store(filler, tokens, np.zeros((pages, gone_ns.page_bytes), np.uint8))
            c.release(pinned)
            return {
                kind: c.exists_keys(gone_ns, [self.key("x", kind, e) for e in ends]).in_l2,
                keep: c.exists_keys(kept_ns, [self.key("x", keep, e) for e in keep_ends]).in_l2,
            }


@pytest.fixture(scope="module")
def probed(
    python: Path, model: Model, model_path: Path, daemon: Daemon, stored: dict[str, Any]
) -> dict[str, Any]:
    """The second engine answers the five probes while the pool changes (module doc)."""
    pool = Pool(daemon, stored, model)
    window = next(k for k in pool.groups if k != "full")
    end = model.case.cached
    full_ends = list(range(model.case.block, end + 1, model.case.block))
    seen: dict[str, Any] = {"window": window}

    def evict() -> None:
        pool.restore()
        seen["evicted"] = pool.evict(window, [end], "full", full_ends)

    pauses: dict[int, Callable[[], None]] = {
        1: lambda: pool.swap(window, end),
        2: lambda: (pool.restore(), pool.swap("full", 2 * model.case.block)),
        3: evict,
        4: daemon.stop,
    }
    try:
        second = run_engine(
            python,
            model_path,
            [ask(p, reset=True) for p in model.probes],
            hicached=daemon.endpoint,
            executor="mp",
            pauses=pauses,
            extra=model.case.options(),
        )
    finally:
        pool.restore()
    return {**second, **seen, "groups": pool.groups}


# -- the tests --------------------------------------------------------------------------


def test_vllm_keeps_the_model_in_several_kv_cache_groups(
    model: Model, stored: dict[str, Any], daemon: Daemon
) -> None:
    """vLLM made more than one KV cache group, and hicached a namespace for each,
    which holds what vLLM stores of that group's pages: full attention every
    chunk of X, a window group only the chunks before X's end."""
    wanted = model.case.engine["groups"]
    assert len(stored["kv_groups"]) == len(wanted) > 1, stored["kv_groups"]
    assert [g["kind"] for g in stored["groups"]] == wanted
    specs = [NamespaceSpec(**g["spec"]) for g in stored["groups"]]
    assert len({s.layout for s in specs}) == len(specs)  # a namespace per group
    pool = Pool(daemon, stored, model)
    chunks = model.case.cached // model.case.block
    with daemon.client() as c:
        for g, spec in zip(stored["groups"], specs, strict=True):
            ends = [(i + 1) * model.case.block for i in range(chunks)]
            held = c.exists_keys(c.register(spec), [pool.key("x", g["kind"], e) for e in ends])
            pages = sum(held.in_l2)
            assert held.in_l2[-1] and (pages == chunks) == (g["kind"] == "full")
            print(
                f"\n{model.case.kind} {g['kind']}: pages of {spec.page_bytes} bytes for "
                f"{spec.page_tokens} tokens; a hit of {model.case.cached} tokens reads {pages}, "
                f"{pages * spec.page_bytes / model.case.cached:.0f} bytes a cached token"
            )


def test_a_second_engine_loads_the_prefix_every_group_restores(
    model: Model, baselines: list[dict[str, Any]], probed: dict[str, Any]
) -> None:
    first = probed["results"][0]
    assert first["num_cached_tokens"] == model.case.cached
    assert same_answer(first, baselines[0]), (first, baselines[0])
    tokens = len(model.probes[0])
    print(
        f"\n{model.case.kind}: prompt tokens computed by the second engine: "
        f"{tokens - first['num_cached_tokens']} with hicached, {tokens} without"
    )


def test_a_changed_page_of_each_group_changes_the_output(
    model: Model, baselines: list[dict[str, Any]], probed: dict[str, Any]
) -> None:
    """X's page replaced by Z's: of the window group (2), of full attention (3)."""
    for phase in (1, 2):
        result = probed["results"][phase]
        assert result["num_cached_tokens"] == model.case.cached
        assert not same_answer(result, baselines[phase]), f"phase {phase}: the pool was not read"


def test_a_group_whose_pages_left_makes_the_prefix_a_miss(
    model: Model, baselines: list[dict[str, Any]], probed: dict[str, Any]
) -> None:
    window = probed["window"]
    assert probed["evicted"][window] == [False]  # X's window page at the end is gone
    assert all(probed["evicted"]["full"])  # and every full-attention page of X is there
    result = probed["results"][3]
    assert result["num_cached_tokens"] == 0  # not a partial hit
    assert same_answer(result, baselines[3]), (result, baselines[3])


def test_without_the_daemon_the_engine_recomputes(
    model: Model, baselines: list[dict[str, Any]], probed: dict[str, Any]
) -> None:
    result = probed["results"][4]
    assert result["num_cached_tokens"] == 0
    assert same_answer(result, baselines[4]), (result, baselines[4])
