"""The operator commands against bad flags and publishers that are not a
daemon's: a message that says what is wrong, never a traceback or a wait
without an end. A hostile publisher is a fake one (fault injection: a bare
ZeroMQ PUB socket sending what no daemon sends)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from tests.support import free_tcp_port

PUB = f"tcp://127.0.0.1:{free_tcp_port()}"  # nothing listens: flags are checked first


def _events(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicached", "events", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--replay-endpoint", PUB, "--from", "-1"],
        ["--replay-endpoint", PUB, "--from", str(1 << 64)],
        ["--replay-endpoint", PUB, "--from", "0", "--replay-timeout", "-1"],
        ["--replay-endpoint", PUB, "--from", "0", "--replay-timeout", "nan"],
        ["--idle-exit", "nan"],
        ["--idle-exit", "-1"],
        ["--count", "-1"],
        ["--endpoint", "garbage"],
        ["--replay-endpoint", "nonsense://x", "--from", "0"],
    ],
    ids=[
        "from-negative",
        "from-past-64-bits",
        "replay-timeout-negative",
        "replay-timeout-nan",
        "idle-exit-nan",
        "idle-exit-negative",
        "count-negative",
        "endpoint",
        "replay-endpoint",
    ],
)
def test_events_refuses_bad_flags_with_a_message(args: list[str]) -> None:
    """Each ran into a traceback (OverflowError, ZMQError), waited for ever (a
    negative replay timeout is an endless poll, a NaN idle time never passes)
    or printed nothing and ended."""
    full = ["--endpoint", PUB, "--idle-exit", "0.2", *args]
    done = _events(*full)
    assert done.returncode != 0, done
    assert done.stderr.startswith("hicached events: "), done.stderr
    assert "Traceback" not in done.stderr


def _batch(medium: str) -> bytes:
    from hicached.wire.events import BlockRemoved, KVEventBatch

    return msgspec.msgpack.encode(
        KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[7], medium=medium)])
    )


@pytest.fixture
def hostile_publisher() -> Iterator[str]:
    """A PUB socket that is not a daemon's (fault injection): messages of one
    frame, payloads that are not msgpack, and batches whose topic and medium
    hold a newline and terminal escapes, over and over."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()

    def feed() -> None:
        seq = 0
        while not done.wait(0.02):
            seq += 2
            pub.send_multipart([b"kv"])
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
            evil = _batch("GPU\n\x1b[2Jfake line")
            pub.send_multipart([b"kv\n\x1b[31mred", (seq + 1).to_bytes(8, "big"), evil])

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    yield f"tcp://127.0.0.1:{port}"
    done.set()
    t.join(10)
    pub.close()
    ctx.term()


def test_events_skips_what_is_not_a_batch_and_escapes_what_a_publisher_names(
    hostile_publisher: str,
) -> None:
    """A message of the wrong shape, or a payload that does not decode, was a
    traceback (ValueError, msgspec.DecodeError) that ended the command; a topic
    or medium with a newline or escapes went to the terminal as it was."""
    done = _events("--endpoint", hostile_publisher, "--count", "2", "--idle-exit", "10")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "not an event batch" in done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4, lines  # two batches: a header and one event each
    assert "\x1b" not in done.stdout
    assert lines[0].startswith("#") and "\\n\\x1b[31mred" in lines[0]
    assert lines[1].startswith("  BlockRemoved GPU\\n\\x1b[2Jfake line 1 blocks")


def test_events_dials_again_after_a_message_over_its_bound() -> None:
    """A message over the command's bound makes libzmq drop the connection as
    a protocol error, and it never dials such a publisher again: the command
    waited in silence for ever. Now it says so and dials again. The publisher
    is a bare PUB socket (fault injection): after every other batch it sends
    one message past the bound."""
    from hicached.cli import EVENTS_MESSAGE_BYTES

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()
    huge = b"x" * (EVENTS_MESSAGE_BYTES + 1)

    def feed() -> None:
        seq = 0
        while not done.wait(0.2):
            seq += 1
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), _batch("GPU")])
            if seq % 2 == 0:
                pub.send_multipart([b"kv", b"\0" * 8, huge])

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        done_cli = _events(
            "--endpoint", f"tcp://127.0.0.1:{port}", "--count", "3", "--idle-exit", "8"
        )
    finally:
        done.set()
        t.join(10)
        pub.close()
        ctx.term()
    assert done_cli.returncode == 0, done_cli.stderr
    assert "Traceback" not in done_cli.stderr
    assert done_cli.stdout.count("BlockRemoved") == 3, (done_cli.stdout, done_cli.stderr)
    assert "dropped" in done_cli.stderr and "dialing again" in done_cli.stderr


def test_events_paces_its_dials_to_a_publisher_that_drops_every_connection() -> None:
    """Each dropped connection was dialed again at once: an endpoint that
    accepts and closes every connection (fault injection: a bare TCP socket,
    no ZeroMQ) was dialed as fast as TCP connects, a line on stderr each
    (tens of thousands a second's worth), and --idle-exit went unseen while
    the drops kept the command busy. Now the dials back off, doubling from
    0.1 s, and the command leaves when it is idle for --idle-exit."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)  # a close from another thread does not end a blocked accept
    port = server.getsockname()[1]
    accepted = [0]
    over = threading.Event()

    def accept() -> None:
        while not over.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted[0] += 1
            conn.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        done = _events("--endpoint", f"tcp://127.0.0.1:{port}", "--idle-exit", "2")
    finally:
        over.set()
        t.join(10)
        server.close()
    assert done.returncode == 0, done.stderr
    assert "dialing again in 0.1 s" in done.stderr and "dialing again in 0.2 s" in done.stderr
    lines = done.stderr.splitlines()
    # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s of pauses fill the 2 s: a handful of dials
    assert 2 <= len(lines) <= 10 and accepted[0] <= 10, (len(lines), accepted[0])
