"""The operator commands against bad flags and publishers that are not a
daemon's: a message that says what is wrong, never a traceback or a wait
without an end. A hostile publisher is a fake one (fault injection: a bare
ZeroMQ PUB socket sending what no daemon sends)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
