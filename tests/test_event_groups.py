"""KV cache groups in hicached's KV events: a real daemon, a real ZeroMQ
subscriber.

A vLLM offload key is the block hash followed by a 4-byte KV cache group
index; a hybrid model registers one namespace per group, so two groups store
pages under the same block hash. Their events must say the group
(``group_idx``), in L2 and in L3, on BlockStored and BlockRemoved, and each
BlockStored the group's KV cache spec kind and window, as the namespace's
event metadata gives them (protocol 1.6). Token namespaces and the older
positional layout stay as they were.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from hicached import Client
from hicached.errors import InvalidNamespace
from hicached.events import BlockRemoved, BlockStored, block_hash, decode_batch
from hicached.hashing import pack_tokens, page_keys
from hicached.wire import protocol as p
from hicached.wire.events import ArrayBlockStored
from hicached.wire.namespace import EventMeta, NamespaceSpec, canonical_text
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon

pytestmark = pytest.mark.timeout(120)

PAGE = 16384  # 64 pages in a 1 MiB pool
SPEC = dict(
    model="org/hybrid",
    kv_dtype="bfloat16",
    page_tokens=32,
    page_bytes=PAGE,
    key_scheme="vllm-sha256",
)
FULL = EventMeta(kind="full_attention")
SLIDING = EventMeta(kind="sliding_window", sliding_window=128)


def hashes_of(n: int, salt: int) -> list[bytes]:
    """Chained 32-byte block hashes, as vLLM's sha256 prefix caching makes them."""
    out, parent = [], bytes(32)
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([salt, i % 256, i // 256])).digest()
        out.append(parent)
    return out


def offload_keys(hashes: list[bytes], group: int) -> list[bytes]:
    """vLLM's offload keys of ``hashes`` in KV cache group ``group``."""
    return [h + group.to_bytes(4, "big") for h in hashes]


def ints(hashes: list[bytes]) -> list[int]:
    return [int(block_hash(h)) for h in hashes]


@pytest.fixture
def events_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hc-evg-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(factory: Callable[..., Daemon], where: Path, more: str = "", storage: str = "") -> Daemon:
    tail = f'[events]\nendpoint = "ipc://{where}/events.sock"\n{more}'
    if storage:
        return factory(size_mib=1, storage=storage, tail=tail)
    return factory(size_mib=1, tail=tail)


class Subscriber:
    """A SUB socket on the events endpoint keeping every payload and event."""

    def __init__(self, where: Path, layout: str = "map") -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(f"ipc://{where}/events.sock")
        self.layout = layout
        self.payloads: list[bytes] = []
        self.events: list[Any] = []
        time.sleep(0.5)  # the subscription reaches the publisher

    def until(self, done: Callable[[list[Any]], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.events):
            assert time.monotonic() < deadline, f"events did not arrive: {self.events}"
            if self.sub.poll(100):
                _, _, payload = self.sub.recv_multipart()
                self.payloads.append(payload)
                self.events += decode_batch(payload, self.layout).events

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


def stored_of(events: list[Any], medium: str) -> list[Any]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def removed_of(events: list[Any], medium: str) -> list[Any]:
    return [e for e in events if isinstance(e, BlockRemoved) and e.medium == medium]


def covers(kind: type, medium: str, want: list[int], group: int | None) -> Callable[..., bool]:
    def done(events: list[Any]) -> bool:
        seen = {
            h
            for e in events
            if isinstance(e, kind) and e.medium == medium and e.group_idx == group
            for h in e.block_hashes
        }
        return set(want) <= seen

    return done


def store(c: Client, ns: Any, keys: list[bytes], parent: bytes | None = None) -> p.CommitOk:
    res = c.reserve_keys(ns, keys, parent=parent)
    c.write_pages(res, np.zeros((len(res.indices), PAGE), np.uint8))
    return c.commit(res)


def evict(c: Client, ns: Any, salt: int = 99) -> None:
    """Fill the 1 MiB pool with other pages of ``ns``, so the earlier ones go."""
    filler = offload_keys(hashes_of(70, salt), 0)
    for i in range(0, 70, 10):
        store(c, ns, filler[i : i + 10])


# -- the tests -------------------------------------------------------------------------


def test_two_groups_under_one_block_hash_say_their_group_in_l2_and_l3(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    storage = 'backend = "memory"\nwrite_policy = "write_through"\n'
    d = start(daemon_factory, events_dir, storage=storage)
    sub = Subscriber(events_dir)
    hashes = hashes_of(3, salt=1)
    try:
        with d.client() as c:
            full = c.register(**SPEC, layout="vllm_b32_g0", events=FULL)
            window = c.register(**SPEC, layout="vllm_b32_g1", events=SLIDING)
            store(c, full, offload_keys(hashes, 0))
            store(c, window, offload_keys(hashes, 1))
            for group in (0, 1):
                sub.until(covers(BlockStored, "CPU", ints(hashes), group))
                sub.until(covers(BlockStored, "MEMORY", ints(hashes), group))
            evict(c, full)
            for group in (0, 1):
                sub.until(covers(BlockRemoved, "CPU", ints(hashes), group))
    finally:
        sub.close()
    l2 = {e.group_idx: e for e in stored_of(sub.events, "CPU") if e.block_hashes == ints(hashes)}
    assert l2[0].kv_cache_spec_kind == "full_attention"
    assert l2[0].kv_cache_spec_sliding_window is None
    assert l2[1].kv_cache_spec_kind == "sliding_window"
    assert l2[1].kv_cache_spec_sliding_window == 128
    assert l2[0].parent_block_hash is None and l2[1].parent_block_hash is None
    l3 = [e for e in stored_of(sub.events, "MEMORY") if e.block_hashes[0] in ints(hashes)]
    assert {(e.group_idx, e.kv_cache_spec_kind) for e in l3} == {
        (0, "full_attention"),
        (1, "sliding_window"),
    }
    # an L3 page's parent is the page before it, named by its hash alone
    by = {(e.group_idx, e.block_hashes[0]): e.parent_block_hash for e in l3}
    assert by[(1, ints(hashes)[2])] == ints(hashes)[1]
    # every event names one group: a removal of the window's page says so
    for e in removed_of(sub.events, "CPU"):
        assert e.group_idx in (0, 1)
    window_gone = {
        h for e in removed_of(sub.events, "CPU") if e.group_idx == 1 for h in e.block_hashes
    }
    assert window_gone == set(ints(hashes))


def test_a_run_that_changes_group_is_split_and_a_later_registration_keeps_the_metadata(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    d = start(daemon_factory, events_dir)
    sub = Subscriber(events_dir)
    hashes = hashes_of(4, salt=2)
    keys = offload_keys(hashes[:2], 3) + offload_keys(hashes[2:], 5)
    try:
        with d.client() as c:
            ns = c.register(**SPEC, layout="vllm_b32_mixed", events=FULL)
            with d.client() as other:  # without metadata: the namespace keeps its own
                other.register(**SPEC, layout="vllm_b32_mixed")
            store(c, ns, keys)
            sub.until(covers(BlockStored, "CPU", ints(hashes[2:]), 5))
    finally:
        sub.close()
    runs = [e for e in stored_of(sub.events, "CPU")]
    assert [(e.block_hashes, e.parent_block_hash, e.group_idx) for e in runs] == [
        (ints(hashes[:2]), None, 3),
        (ints(hashes[2:]), ints(hashes)[1], 5),
    ]
    assert {e.kv_cache_spec_kind for e in runs} == {"full_attention"}


def test_token_namespaces_and_the_array_layout_stay_as_they_were(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    d = start(daemon_factory, events_dir, 'format = "array"\n')
    sub = Subscriber(events_dir, layout="array")
    hashes = hashes_of(2, salt=3)
    try:
        with d.client() as c:
            tokens = c.register(**NS)
            toks = np.arange(2 * PAGE_TOKENS, dtype=np.uint32)
            c.store(tokens, toks, np.zeros((2, PAGE_BYTES), np.uint8))
            tkeys = page_keys(tokens.digest, pack_tokens(toks), PAGE_TOKENS)
            keyed = c.register(**SPEC, layout="vllm_b32_g1", events=SLIDING)
            store(c, keyed, offload_keys(hashes, 1))
            sub.until(lambda events: sum(isinstance(e, ArrayBlockStored) for e in events) >= 2)
    finally:
        sub.close()
    raw = [e for payload in sub.payloads for e in msgspec.msgpack.decode(payload)[1]]
    stored = [e for e in raw if e[0] == "BlockStored"]
    # [tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name]
    assert stored == [
        ["BlockStored", ints(tkeys), None, toks.tolist(), PAGE_TOKENS, None, "CPU", None],
        ["BlockStored", ints(hashes), None, [], 32, None, "CPU", None],
    ]


def test_a_token_namespace_in_the_map_layout_names_no_group(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    d = start(daemon_factory, events_dir)
    sub = Subscriber(events_dir)
    try:
        with d.client() as c:
            ns = c.register(**NS)
            toks = np.arange(PAGE_TOKENS, dtype=np.uint32) + 5
            c.store(ns, toks, np.zeros((1, PAGE_BYTES), np.uint8))
            sglang = c.register(**{**SPEC, "key_scheme": "sglang-sha256"}, layout="sg")
            store(c, sglang, [b"\x01" * 32])
            sub.until(lambda events: len(stored_of(events, "CPU")) >= 2)
    finally:
        sub.close()
    raw = [e for payload in sub.payloads for e in msgspec.msgpack.decode(payload)[1]]
    stored = [e for e in raw if e["type"] == "BlockStored"]
    assert len(stored) == 2
    for event in stored:  # a null field is left out of the map, as vLLM leaves it
        assert not {"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"} & set(event)
    assert stored[1]["block_hashes"] == [int(block_hash(b"\x01" * 32))]  # the key as it is


@pytest.mark.parametrize(
    ("spec", "meta", "says"),
    [
        (SPEC, EventMeta(kind="Full Attention"), "kind"),
        (SPEC, EventMeta(kind="x" * 33), "kind"),
        (SPEC, EventMeta(kind="sliding_window", sliding_window=0), "sliding_window"),
        (SPEC, EventMeta(kind="sliding_window", sliding_window=1 << 40), "sliding_window"),
        ({**SPEC, "key_scheme": "tokens"}, FULL, r"vllm-\* key_scheme"),
        ({**SPEC, "key_scheme": "sglang-sha256"}, FULL, r"vllm-\* key_scheme"),
    ],
)
def test_bad_event_metadata_is_refused_at_registration(
    daemon: Daemon, spec: dict[str, Any], meta: EventMeta, says: str
) -> None:
    with daemon.client() as c:
        with pytest.raises(InvalidNamespace, match=says):
            c.register(**spec, layout="vllm_b32_bad", events=meta)
        c.register(**spec, layout="vllm_b32_bad")  # the same without: fine
        assert c.stats().namespaces >= 1


def test_other_metadata_for_a_registered_namespace_is_refused(daemon: Daemon) -> None:
    with daemon.client() as c:
        first = c.register(**SPEC, layout="vllm_b32_g0", events=FULL)
        again = c.register(**SPEC, layout="vllm_b32_g0", events=FULL)  # the same: fine
        assert again.id == first.id
        with daemon.client() as other:
            with pytest.raises(InvalidNamespace, match="kind='full_attention'"):
                other.register(**SPEC, layout="vllm_b32_g0", events=SLIDING)
            assert other.register(**SPEC, layout="vllm_b32_g0").id == first.id


def test_the_metadata_stays_out_of_the_digest_and_of_an_older_daemons_requests() -> None:
    spec = NamespaceSpec(**SPEC, layout="vllm_b32_g0")  # type: ignore[arg-type]
    text = canonical_text(spec)
    assert "full_attention" not in text and "window" not in text
    bare = msgspec.msgpack.decode(msgspec.msgpack.encode(p.RegisterNamespace(id=1, spec=spec)))
    assert "events" not in bare  # a registration without metadata is one a 1.5 daemon reads

    class Register15(msgspec.Struct, tag="register", tag_field="op", forbid_unknown_fields=True):
        id: int
        spec: NamespaceSpec
        deadline_ms: int = 0

    old = msgspec.msgpack.Decoder(Register15)
    assert old.decode(msgspec.msgpack.encode(p.RegisterNamespace(id=1, spec=spec))).id == 1
    with pytest.raises(msgspec.ValidationError, match="events"):  # why 1.5 gets none
        old.decode(msgspec.msgpack.encode(p.RegisterNamespace(id=1, spec=spec, events=FULL)))


def test_a_client_sends_no_metadata_to_a_daemon_older_than_1_6(
    daemon_factory: Callable[..., Daemon], events_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/old_daemon.py answers hellos as 1.5; it would take the field (it is
    today's decoder), so events without a kind show the client left it out."""
    monkeypatch.setenv("HICACHED_TEST_DAEMON_MINOR", "5")
    tail = f'[events]\nendpoint = "ipc://{events_dir}/events.sock"\n'
    d = daemon_factory(size_mib=1, tail=tail, module="tests.old_daemon")
    sub = Subscriber(events_dir)
    hashes = hashes_of(1, salt=4)
    try:
        with d.client() as c:
            ns = c.register(**SPEC, layout="vllm_b32_g2", events=SLIDING)
            store(c, ns, offload_keys(hashes, 2))
            sub.until(covers(BlockStored, "CPU", ints(hashes), 2))
    finally:
        sub.close()
    (event,) = stored_of(sub.events, "CPU")
    assert event.group_idx == 2  # from the key: the daemon's own doing
    assert event.kv_cache_spec_kind is None and event.kv_cache_spec_sliding_window is None
