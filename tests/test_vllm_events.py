"""hicached's KV events as vLLM reads them: decoded by vLLM's own classes
(``vllm.distributed.kv_events``, from a real vLLM 0.32 in its own venv) and
encoded again by them to the same values, under write_through, write_back,
eviction, restart and graceful stop; replayed by vLLM's replay protocol, and
framed as vLLM's own publisher frames them. The very bytes are 0.33's (its
BlockStored has a 16th field, lookahead_token_ids, so msgspec gives its maps
a 16-bit header where 0.32's get a one-byte one): tests/test_vllm_conformance.py
checks them with 0.33's classes; the older array layout is byte for byte here.

The venv is built once, outside the clone (tests/engines/venv.py); the first
test that needs it waits for the build.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from hicached import Namespace
from hicached.events import END_SEQ, block_hash, decode_batch
from hicached.hashing import pack_tokens, page_keys
from hicached.wire.namespace import EventMeta
from tests.engines import venv
from tests.l3util import FILE_STORE, evict_everything, l3_count, settle_writes, wait_for
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon

# The first test waits for the venv build (minutes, once per pin and machine).
pytestmark = pytest.mark.timeout(1200)

DECODER = Path(__file__).parent / "engines" / "vllm_events.py"
HOST = socket.gethostname()
MODEL = str(NS["model"])
Frames = list[tuple[bytes, bytes, bytes]]


class VllmDecoder:
    """tests/engines/vllm_events.py serving in the vLLM venv, one process for a
    test run: each command is a JSON line in and out (an import of vLLM takes
    seconds, and every test asks it once or more)."""

    def __init__(self, python: Path) -> None:
        self.python = python
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.proc: subprocess.Popen[str] | None = None

    def _started(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:  # it died: its pipes go with it
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.stdout.close()  # type: ignore[union-attr]
            self.proc = subprocess.Popen(
                [str(self.python), str(DECODER), "serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.errors,
                text=True,
            )
        return self.proc

    def ask(self, args: tuple[str, ...], timeout: float) -> dict[str, Any]:
        proc = self._started()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(list(args)) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            proc.kill()  # the next command starts another
            proc.wait()
            raise AssertionError(f"vLLM's decoder gave no answer to {args} in {timeout}s")
        line = proc.stdout.readline()
        if not line:
            self.errors.seek(0)
            raise AssertionError(f"vLLM's decoder died: {self.errors.read()[-4000:]!r}")
        out: dict[str, Any] = json.loads(line)
        assert "error" not in out, out["error"][-4000:]
        return out

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()  # type: ignore[union-attr]
        self.errors.close()


@pytest.fixture(scope="session")
def vllm_python() -> Iterator[VllmDecoder]:
    """vLLM's own classes, in the vLLM venv (built on first use)."""
    decoder = VllmDecoder(venv.build())
    yield decoder
    decoder.close()


def vllm(decoder: VllmDecoder, *args: str, timeout: float = 300) -> dict[str, Any]:
    """A command of the decoder in the vLLM venv; its JSON answer."""
    out = decoder.ask(args, timeout)
    assert out["vllm"] == venv.VLLM.split("==")[1]
    return out


def vllm_decode(python: VllmDecoder, frames: Frames, layout: str = "map") -> list[dict[str, Any]]:
    """Frames decoded by vLLM's classes; each batch must re-encode to its own values
    (and, in the array layout, its own bytes)."""
    with tempfile.NamedTemporaryFile(suffix=".msgpack") as capture:
        capture.write(msgspec.msgpack.encode({"layout": layout, "frames": frames}))
        capture.flush()
        batches: list[dict[str, Any]] = vllm(python, "decode", capture.name)["batches"]
    assert len(batches) == len(frames)
    for batch in batches:
        assert batch["same_values"], f"vLLM would not send these values: {batch}"
        if layout == "array":
            assert batch["same"], f"vLLM would not send these bytes: {batch}"
        assert batch["data_parallel_rank"] == 0
        if layout == "map":  # the array layout is read by positional copies of them
            assert set(batch["classes"]) <= {"vllm.distributed.kv_events"}
    return batches


@pytest.fixture
def events_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hc-vev-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def events_toml(where: Path, more: str = "") -> str:
    return (
        f'[events]\nendpoint = "ipc://{where}/events.sock"\n'
        f'replay_endpoint = "ipc://{where}/replay.sock"\n{more}'
    )


class Capture:
    """A SUB socket that keeps every frame, and reads them with hicached's decoder
    to know when to stop (the assertions use vLLM's)."""

    def __init__(self, endpoint: str, layout: str = "map") -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # the prefix routers filter on
        self.sub.connect(endpoint)
        self.layout = layout
        self.frames: Frames = []
        self.events: list[Any] = []
        time.sleep(0.5)  # let the subscription reach the publisher

    def until(self, done: Callable[[list[Any]], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.events):
            assert time.monotonic() < deadline, f"events did not arrive: {len(self.frames)}"
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                self.frames.append((topic, seq, payload))
                self.events += decode_batch(payload, self.layout).events

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


def stored(batches: list[dict[str, Any]], medium: str) -> list[dict[str, Any]]:
    return [
        e
        for b in batches
        for e in b["events"]
        if e["type"] == "BlockStored" and e["medium"] == medium
    ]


def removed_hashes(batches: list[dict[str, Any]], medium: str) -> set[int]:
    return {
        h
        for b in batches
        for e in b["events"]
        if e["type"] == "BlockRemoved" and e["medium"] == medium
        for h in e["block_hashes"]
    }


def hashes(keys: list[bytes]) -> list[int]:
    return [int(block_hash(k)) for k in keys]


def has_hashes(medium: str, want: list[bytes], kind: str = "BlockStored") -> Callable[..., bool]:
    wanted = set(hashes(want))

    def check(events: list[Any]) -> bool:
        seen = {
            h
            for e in events
            if type(e).__name__.endswith(kind) and e.medium == medium
            for h in e.block_hashes
        }
        return wanted <= seen

    return check


def sequence(first: int, pages: int) -> np.ndarray:
    return np.arange(first * PAGE_TOKENS, (first + pages) * PAGE_TOKENS, dtype=np.uint32)


def keys_of(ns: Namespace, toks: np.ndarray) -> list[bytes]:
    return page_keys(ns.digest, pack_tokens(toks), PAGE_TOKENS)


def check_l3_chain(events: list[dict[str, Any]], keys: list[bytes], toks: np.ndarray) -> None:
    """One L3 BlockStored per page, each with its parent and its own tokens."""
    by_hash = {e["block_hashes"][0]: e for e in events if len(e["block_hashes"]) == 1}
    for i, key in enumerate(keys):
        event = by_hash[int(block_hash(key))]
        assert event["parent_block_hash"] == (int(block_hash(keys[i - 1])) if i else None)
        assert event["token_ids"] == toks[i * PAGE_TOKENS : (i + 1) * PAGE_TOKENS].tolist()
        assert event["block_size"] == PAGE_TOKENS
        assert event["lora_id"] is None and event["lora_name"] is None


# -- the tests -------------------------------------------------------------------------


def test_write_through_and_eviction_events_are_vllms_own(
    vllm_python: VllmDecoder, daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    d = daemon_factory(size_mib=1, storage='backend = "memory"\n', tail=events_toml(events_dir))
    cap = Capture(f"ipc://{events_dir}/events.sock")
    try:
        with d.client() as c:
            ns = c.register(**NS)
            toks = sequence(0, 3)
            c.store(ns, toks, np.zeros((3, PAGE_BYTES), np.uint8))
            keys = keys_of(ns, toks)
            wait_for(lambda: l3_count(c, "written") == 3)
            cap.until(has_hashes("MEMORY", keys))
            evict_everything(c, ns)
            cap.until(has_hashes("CPU", keys, "BlockRemoved"))
    finally:
        cap.close()
    batches = vllm_decode(vllm_python, cap.frames)
    # the AllBlocksCleared of the start (no one model) may have gone before we subscribed
    assert {b["topic"] for b in batches} <= {f"kv@{HOST}@{MODEL}", f"kv@{HOST}@"}
    seqs = [b["seq"] for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    l2 = stored(batches, "CPU")[0]
    assert l2 == {
        "type": "BlockStored",
        "block_hashes": hashes(keys),
        "parent_block_hash": None,
        "token_ids": toks.tolist(),
        "block_size": PAGE_TOKENS,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "extra_keys": None,
        "group_idx": None,
        "kv_cache_spec_kind": None,
        "kv_cache_spec_sliding_window": None,
        "locality": None,
        "ownership": None,
        "session_id": None,
    }
    check_l3_chain(stored(batches, "MEMORY"), keys, toks)
    assert set(hashes(keys)) <= removed_hashes(batches, "CPU")
    assert all(0 <= h < 1 << 64 for h in removed_hashes(batches, "CPU"))


def test_write_back_events_carry_tokens_and_parent(
    vllm_python: VllmDecoder, daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    d = daemon_factory(
        size_mib=1,
        storage='backend = "memory"\nwrite_policy = "write_back"\n',
        tail=events_toml(events_dir),
    )
    cap = Capture(f"ipc://{events_dir}/events.sock")
    try:
        with d.client() as c:
            ns = c.register(**NS)
            head = sequence(0, 4)
            c.store(ns, head, np.zeros((4, PAGE_BYTES), np.uint8))
            # a second sequence shares the first two pages: its new pages chain to them
            branch = np.concatenate([head[: 2 * PAGE_TOKENS], sequence(100, 2)])
            c.store(ns, branch, np.zeros((4, PAGE_BYTES), np.uint8))
            assert l3_count(c, "written") == 0  # write_back: nothing until eviction
            evict_everything(c, ns)
            settle_writes(c)
            keys, bkeys = keys_of(ns, head), keys_of(ns, branch)
            cap.until(has_hashes("MEMORY", keys + bkeys[2:]))
    finally:
        cap.close()
    batches = vllm_decode(vllm_python, cap.frames)
    l3 = stored(batches, "MEMORY")
    check_l3_chain(l3, keys, head)
    check_l3_chain(l3, bkeys, branch)
    assert set(hashes(keys + bkeys)) <= removed_hashes(batches, "CPU")


def test_a_restart_announces_what_the_l3_scan_found(
    vllm_python: VllmDecoder, daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    d = daemon_factory(
        size_mib=4,
        storage='backend = "file"\nwrite_policy = "write_through"\n',
        tail=FILE_STORE + events_toml(events_dir),
    )
    with d.client() as c:
        ns = c.register(**NS)
        toks = sequence(0, 40)
        c.store(ns, toks, np.zeros((40, PAGE_BYTES), np.uint8))
        wait_for(lambda: l3_count(c, "written") == 40)
        keys = keys_of(ns, toks)
    assert d.stop() == 0
    d.start()
    with d.client() as c:
        wait_for(lambda: c.stats().l3.get("scanning", 1) == 0)
        wait_for(lambda: c.stats().events_pending == 0)
    time.sleep(0.2)  # the last flush
    # a subscriber that joins now learns it all through replay, from 0
    got = vllm(vllm_python, "replay", f"ipc://{events_dir}/replay.sock", "0")
    batches = got["batches"]
    assert all(b["same_values"] for b in batches)
    assert [b["seq"] for b in batches] == list(range(len(batches)))
    assert batches[0]["events"][0] == {"type": "AllBlocksCleared"}  # first of all
    assert batches[0]["topic"] == f"kv@{HOST}@"  # no one model: the daemon just started
    announced = stored(batches, "FILE")
    assert sorted(h for e in announced for h in e["block_hashes"]) == sorted(hashes(keys))
    for e in announced:  # the store keeps neither tokens nor parents, nor page_tokens
        assert e["parent_block_hash"] is None and e["token_ids"] == [] and e["block_size"] == 0
    assert got["end"] == ["", "", END_SEQ.hex(), ""]


def test_a_graceful_stop_delivers_the_events_of_every_page_it_flushed(
    vllm_python: VllmDecoder, daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    # write_back with a slow store and a short write queue: the stop flushes in
    # steps; every page's L3 event must reach the subscriber before the sockets close.
    d = daemon_factory(
        size_mib=16,
        allow_faults=True,
        storage=(
            'backend = "faulty"\nwrite_policy = "write_back"\nqueue_pages = 16\n'
            'batch_pages = 4\n[storage.extra]\ninner = "memory"\nwrite_delay_s = 0.002\n'
        ),
        tail=events_toml(events_dir, "batch_events = 1\n"),
        metrics="enabled = false",
    )
    cap = Capture(f"ipc://{events_dir}/events.sock")
    try:
        toks = sequence(0, 600)
        with d.client() as c:
            ns = c.register(**NS)
            c.store(ns, toks, np.zeros((600, PAGE_BYTES), np.uint8))
            keys = keys_of(ns, toks)
            assert l3_count(c, "written") == 0
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        cap.until(has_hashes("FAULTY", keys))
        assert d.proc.wait(30) == 0
    finally:
        cap.close()
    batches = vllm_decode(vllm_python, cap.frames)
    check_l3_chain(stored(batches, "FAULTY"), keys, toks)
    seqs = [b["seq"] for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_a_replay_of_more_than_5000_batches_to_a_slow_vllm_reader_is_complete(
    vllm_python: VllmDecoder, daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    pages = 5200  # one event per page's L3 write: more than 5,000 batches
    d = daemon_factory(
        size_mib=48,
        storage='backend = "memory"\n',
        tail=events_toml(events_dir, "batch_events = 1\n"),
    )
    with d.client() as c:
        ns = c.register(**NS)
        toks = sequence(0, pages)
        c.store(ns, toks, np.zeros((pages, PAGE_BYTES), np.uint8))
        wait_for(lambda: l3_count(c, "written") == pages, timeout=60)
        wait_for(lambda: c.stats().events_pending == 0)
        time.sleep(0.2)
        keys = keys_of(ns, toks)
    got = vllm(vllm_python, "replay", f"ipc://{events_dir}/replay.sock", "0", "500", "0.1")
    batches = got["batches"]
    assert len(batches) >= pages + 2  # AllBlocksCleared, the L2 commit, every L3 write
    assert [b["seq"] for b in batches] == list(range(len(batches)))
    assert all(b["same_values"] for b in batches)
    check_l3_chain(stored(batches, "MEMORY"), keys, toks)
    with d.client() as c:
        assert not {k for k in c.stats().dropped if k.startswith("replay")}


def test_replay_and_live_frames_are_laid_out_as_vllms_publisher_lays_them_out(
    vllm_python: VllmDecoder, daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    ref = vllm(vllm_python, "reference", str(events_dir))
    d = daemon_factory(tail=events_toml(events_dir))
    cap = Capture(f"ipc://{events_dir}/events.sock")
    try:
        with d.client() as c:
            ns = c.register(**NS)
            c.store(ns, sequence(0, 1), np.zeros((1, PAGE_BYTES), np.uint8))
        cap.until(lambda events: any(type(e).__name__ == "BlockStored" for e in events))
    finally:
        cap.close()
    ours = vllm(vllm_python, "replay", f"ipc://{events_dir}/replay.sock", "0")
    # live: [topic, 8-byte seq, payload]; replay: [b"", topic, seq, payload]; end marker
    assert len(ref["live"]) == 3 and all(len(f) == 3 for f in cap.frames)
    assert {len(bytes.fromhex(f[1])) for f in [ref["live"]]} == {8}
    assert {len(seq) for _, seq, _ in cap.frames} == {8}
    assert {len(r) for r in ref["replay"]} == {4} and ref["replay"][0][0] == ""
    assert [f["topic"] for f in ours["batches"]][-1] == f"kv@{HOST}@{MODEL}"
    assert ours["end"] == ref["end"] == ["", "", END_SEQ.hex(), ""]


def test_the_older_array_layout_is_what_array_like_vllm_classes_read(
    vllm_python: VllmDecoder, daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    d = daemon_factory(
        size_mib=1,
        tail=events_toml(events_dir, 'format = "array"\ntopic = "kv@node-1@test/model"\n'),
    )
    cap = Capture(f"ipc://{events_dir}/events.sock", layout="array")
    try:
        with d.client() as c:
            ns = c.register(**NS)
            toks = sequence(0, 2)
            c.store(ns, toks, np.zeros((2, PAGE_BYTES), np.uint8))
            keys = keys_of(ns, toks)
            cap.until(has_hashes("CPU", keys))
            evict_everything(c, ns)
            cap.until(has_hashes("CPU", keys, "BlockRemoved"))
    finally:
        cap.close()
    # [tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name]
    raw = [e for _, _, payload in cap.frames for e in msgspec.msgpack.decode(payload)[1]]
    assert next(e for e in raw if e[0] == "BlockStored") == [
        "BlockStored",
        hashes(keys),
        None,
        toks.tolist(),
        PAGE_TOKENS,
        None,
        "CPU",
        None,
    ]
    batches = vllm_decode(vllm_python, cap.frames, layout="array")
    assert {b["topic"] for b in batches} == {"kv@node-1@test/model"}
    event = stored(batches, "CPU")[0]
    assert event["block_hashes"] == hashes(keys) and event["token_ids"] == toks.tolist()


def test_vllm_reads_each_pages_kv_cache_group_and_spec_kind(
    vllm_python: VllmDecoder, daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    """Two groups of a hybrid model under one block hash: vLLM's classes read
    group_idx (from the offload keys), kv_cache_spec_kind and the window (from
    the namespaces' event metadata) back, on BlockStored and BlockRemoved."""
    d = daemon_factory(size_mib=1, tail=events_toml(events_dir))
    cap = Capture(f"ipc://{events_dir}/events.sock")
    spec = dict(
        model=MODEL,
        kv_dtype="bfloat16",
        page_tokens=PAGE_TOKENS,
        page_bytes=PAGE_BYTES,
        key_scheme="vllm-sha256",
    )
    block = [bytes([i]) * 32 for i in (1, 2)]
    want = [int(block_hash(h)) for h in block]
    try:
        with d.client() as c:
            metas = [
                EventMeta(kind="full_attention"),
                EventMeta(kind="sliding_window", sliding_window=64),
            ]
            spaces = [
                c.register(**spec, layout=f"vllm_g{g}", events=meta) for g, meta in enumerate(metas)
            ]
            for g, ns in enumerate(spaces):
                res = c.reserve_keys(ns, [h + g.to_bytes(4, "big") for h in block])
                c.write_pages(res, np.zeros((2, PAGE_BYTES), np.uint8))
                c.commit(res)
            cap.until(lambda ev: sum(type(e).__name__ == "BlockStored" for e in ev) >= 2)
            filler = [bytes([9, i % 256, i // 256]) * 11 + b"\0\0\0\0" for i in range(300)]
            for i in range(0, 300, 50):
                res = c.reserve_keys(spaces[0], filler[i : i + 50])
                c.write_pages(res, np.zeros((len(res.indices), PAGE_BYTES), np.uint8))
                c.commit(res)
            gone = {1: set(want), 0: set(want)}
            cap.until(
                lambda ev: all(
                    gone[g]
                    <= {
                        h
                        for e in ev
                        if type(e).__name__ == "BlockRemoved" and e.group_idx == g
                        for h in e.block_hashes
                    }
                    for g in gone
                )
            )
    finally:
        cap.close()
    batches = vllm_decode(vllm_python, cap.frames)
    l2 = [e for e in stored(batches, "CPU") if e["block_hashes"] == want]
    assert [
        (e["group_idx"], e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"]) for e in l2
    ] == [
        (0, "full_attention", None),
        (1, "sliding_window", 64),
    ]
    removed = [
        e
        for b in batches
        for e in b["events"]
        if e["type"] == "BlockRemoved" and e["medium"] == "CPU"
    ]
    assert {e["group_idx"] for e in removed if set(want) & set(e["block_hashes"])} == {0, 1}


def test_a_batch_over_batch_kib_is_split_between_pages_and_vllm_reads_it_in_order(
    vllm_python: VllmDecoder, daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    """Three commits in one flush, the middle one's event (600 pages, about 54 KB)
    alone over events.batch_kib (16): it goes out as several batches of at most
    16 KiB, cut between pages, the commits before and after it whole around it.
    vLLM's decoder reads them in order, and together they say what the one event
    said: the same blocks and tokens, each piece's parent the last block of the
    piece before it."""
    d = daemon_factory(
        size_mib=8,
        tail=events_toml(events_dir, "batch_kib = 16\nflush_interval_s = 0.5\n"),
    )
    cap = Capture(f"ipc://{events_dir}/events.sock")
    # tokens of 5 bytes each (65,536 and more), so the big event is large
    runs = [sequence(10_000, 3), sequence(20_000, 600), sequence(30_000, 3)]
    try:
        with d.client() as c:
            ns = c.register(**NS)
            for toks in runs:
                c.store(ns, toks, np.zeros((len(toks) // PAGE_TOKENS, PAGE_BYTES), np.uint8))
            keys = [keys_of(ns, toks) for toks in runs]
            cap.until(has_hashes("CPU", keys[2]))
    finally:
        cap.close()
    assert all(len(payload) <= 16 * 1024 for _, _, payload in cap.frames)
    batches = vllm_decode(vllm_python, cap.frames)
    seqs = [b["seq"] for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events = stored(batches, "CPU")
    assert len(events) > 4  # the big one was split (3 pieces at least)
    assert [h for e in events for h in e["block_hashes"]] == hashes([k for ks in keys for k in ks])
    assert [t for e in events for t in e["token_ids"]] == [t for r in runs for t in r.tolist()]
    assert events[0]["parent_block_hash"] is None and events[-1]["parent_block_hash"] is None
    big = events[1:-1]
    assert big[0]["parent_block_hash"] is None
    for before, piece in itertools.pairwise(big):
        assert piece["parent_block_hash"] == before["block_hashes"][-1]
    for piece in big:
        assert len(piece["token_ids"]) == len(piece["block_hashes"]) * PAGE_TOKENS
        assert piece["block_size"] == PAGE_TOKENS and piece["medium"] == "CPU"
