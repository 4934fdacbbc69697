"""What a real daemon holds for a KV event subscriber that connects and never
reads, in bytes: its queue on the events socket stays within events.buffer_mib
and the replay ring within events.replay_mib, however much is published; the
batches its full queue refuses are counted. Measured as the daemon process's
resident memory (/proc/PID/status), not by asking the daemon: how much it grows
once its pool has filled (what it keeps per L2 page, such as each page's
tokens for its L3 events, is then all there) while far more event bytes than
the bounds are published."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from hicached.events import SUBSCRIBER_DROPS
from tests.l3util import wait_for
from tests.support import Daemon

pytestmark = pytest.mark.timeout(180)

BATCH_KIB = 64
BUFFER_MIB = 8
REPLAY_MIB = 16
# A namespace whose pages carry many tokens for few bytes: each page's event
# (4,096 tokens of 5 bytes) is about 20 KB for 4 KiB of pool.
PAGE_TOKENS = 4096
PAGE_BYTES = 4096
# a namespace of long pages: each commit's event carries many token ids
SPEC = dict(
    model="test/many-tokens",
    kv_dtype="bfloat16",
    layout="layer_first",
    page_tokens=PAGE_TOKENS,
    page_bytes=PAGE_BYTES,
)
PAGES_PER_STORE = 32  # one commit, one event of about 650 KB (cut into 64 KiB batches)
POOL_MIB = 4  # 1,024 pages
WARM_UP = 40  # stores that fill the pool (and the bounded queues) first
STORES = 320  # about 210 MB of events, 8 times what the bounds allow
# Resident memory the daemon may grow by beyond the bounds: its transient work
# (a commit's tokens as Python ints, encoding) and what the allocator keeps
# (about 30 MiB at most here). Without the bounds it grew by 440 MiB.
MARGIN_MIB = 48


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


@pytest.fixture
def events_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hc-evm-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_subscriber_that_never_reads_costs_the_daemon_at_most_buffer_mib(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    pub = f"ipc://{events_dir}/events.sock"
    d = daemon_factory(
        size_mib=POOL_MIB,  # the stores evict each other (BlockRemoved too)
        tail=(
            f'[events]\nendpoint = "{pub}"\nreplay_endpoint = "ipc://{events_dir}/replay.sock"\n'
            f"batch_kib = {BATCH_KIB}\nbuffer_mib = {BUFFER_MIB}\nreplay_mib = {REPLAY_MIB}\n"
            "stall_s = 0\n"  # never cut: the subscriber stays stuck all along
        ),
    )
    assert d.proc is not None
    pid = d.proc.pid
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)
    try:
        stuck.setsockopt(zmq.LINGER, 0)
        stuck.setsockopt(zmq.RCVHWM, 1)  # its own process holds next to nothing
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(pub)
        time.sleep(0.5)  # let the subscription reach the daemon
        rng = np.random.default_rng(0)
        pages = np.zeros((PAGES_PER_STORE, PAGE_BYTES), np.uint8)
        with d.client() as c:
            ns = c.register(**SPEC)

            def store() -> None:
                toks = rng.integers(65536, 150_000, PAGES_PER_STORE * PAGE_TOKENS, np.uint32)
                c.store(ns, toks, pages)

            for _ in range(WARM_UP):  # the daemon's own working set
                store()
            wait_for(lambda: c.stats().events_pending == 0)
            base = rss_kib(pid)
            peak = base
            for _ in range(STORES):
                store()
                peak = max(peak, rss_kib(pid))
            wait_for(lambda: c.stats().events_pending == 0)
            time.sleep(0.2)  # the last flush
            peak = max(peak, rss_kib(pid))
            refused = c.stats().dropped.get(SUBSCRIBER_DROPS, 0)
        published_mib = STORES * PAGES_PER_STORE * PAGE_TOKENS * 5 / (1 << 20)
        bound_mib = BUFFER_MIB + REPLAY_MIB
        assert published_mib > 8 * bound_mib  # far more than the bounds let it keep
        grew_mib = (peak - base) / 1024
        assert grew_mib < bound_mib + MARGIN_MIB, (
            f"the daemon grew by {grew_mib:.0f} MiB (VmRSS {base} -> {peak} KiB, RssAnon "
            f"{rss_kib(pid, 'RssAnon')} KiB) with a subscriber that never reads; "
            f"bounds {bound_mib} MiB + margin {MARGIN_MIB}"
        )
        # Its queue filled: every batch after that was refused, and counted.
        assert refused > STORES, refused
    finally:
        stuck.close()
        ctx.term()


def test_replay_readers_that_never_read_cost_the_daemon_at_most_buffer_mib(
    daemon_factory: Callable[..., Daemon], events_dir: Path
) -> None:
    """32 replay readers ask for a replay and read nothing. buffer_mib (1) holds
    less than one batch of batch_kib (1024) per reader: the daemon serves as
    many replays at once as the buffer holds batches (one), and refuses the
    others at once (replay_busy, an end marker), instead of queueing one batch
    of its own for each reader (32 MiB: 32 times the bound)."""
    d = daemon_factory(
        size_mib=POOL_MIB,
        tail=(
            f'[events]\nendpoint = "ipc://{events_dir}/events.sock"\n'
            f'replay_endpoint = "ipc://{events_dir}/replay.sock"\n'
            "batch_kib = 1024\nbuffer_mib = 1\nreplay_mib = 64\nreplay_timeout_s = 60\n"
        ),
    )
    assert d.proc is not None
    pid = d.proc.pid
    ctx = zmq.Context()
    readers: list[zmq.Socket[bytes]] = []
    try:
        rng = np.random.default_rng(0)
        pages = np.zeros((PAGES_PER_STORE, PAGE_BYTES), np.uint8)
        with d.client() as c:
            ns = c.register(**SPEC)
            for _ in range(60):  # about 40 MB of events: batches of up to 1 MiB in the ring
                toks = rng.integers(65536, 150_000, PAGES_PER_STORE * PAGE_TOKENS, np.uint32)
                c.store(ns, toks, pages)
            wait_for(lambda: c.stats().events_pending == 0)
            time.sleep(0.5)  # the last flush
            base = peak = rss_kib(pid)
            for _ in range(32):
                reader = ctx.socket(zmq.DEALER)
                readers.append(reader)
                reader.setsockopt(zmq.LINGER, 0)
                reader.setsockopt(zmq.RCVHWM, 1)  # its own process holds next to nothing
                reader.connect(f"ipc://{events_dir}/replay.sock")
                reader.send((0).to_bytes(8, "big"))
            end = time.monotonic() + 3.0  # the replays fill every queue on the way
            while time.monotonic() < end:
                peak = max(peak, rss_kib(pid))
                time.sleep(0.05)
            busy = c.stats().dropped.get("replay_busy", 0)
        grew_mib = (peak - base) / 1024
        assert grew_mib < 1 + 12, (
            f"the daemon grew by {grew_mib:.0f} MiB (VmRSS {base} -> {peak} KiB) with 32 "
            "replay readers that never read; bound buffer_mib = 1 MiB + margin 12"
        )
        assert busy == 31, busy
    finally:
        for reader in readers:
            reader.close()
        ctx.term()
