"""Scattered slot copies pick numpy's or torch's kernels by measuring, once per
process (client/gather.py): both kernels move the same bytes both ways, the
pick is one of the two, and nothing measures twice. Each client runs in a
process of its own against a real daemon, since the pick is the process's."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hicached.client import gather
from tests.support import Daemon

PAGE = 65536
CLIENT = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    if sys.argv[2] != "no-torch":
        import torch  # as every engine has it
    from hicached.client import Client, gather_choice
    from hicached.errors import BadRequest

    def pages(seed, n, size):
        return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)

    def shuffled_round_trip(c, model, size, start):
        ns = c.register(model=model, kv_dtype="bfloat16", layout="layer_first",
                        page_tokens=16, page_bytes=size)
        base = start + int(sys.argv[3])  # new keys, the same bytes
        tokens = np.arange(base, base + 8 * 16, dtype=np.uint32)
        data = pages(start, 8, size)
        order = [5, 2, 7, 0, 3, 6, 1, 4]
        res = c.reserve(ns, tokens)
        assert len(res.offsets) == 8, res
        c.write_pages(res.select(order), data)  # page order[j] gets data[j]
        c.commit(res)
        hit = c.match(ns, tokens)
        try:
            back = c.read_pages(hit.select(order))
            whole = c.read_pages(hit)
        finally:
            c.release(hit)
        ok = np.array_equal(back, data) and np.array_equal(whole[order], data)
        return ok, hashlib.sha256(whole.tobytes()).hexdigest()

    out = {"torch_before": "torch" in sys.modules}
    with Client(sys.argv[1], timeout=10.0) as c:
        out["before"] = gather_choice()
        try:
            out["bytes_ok"], out["digest"] = shuffled_round_trip(c, "t/a", 65536, 0)
        except BadRequest as exc:
            out["refused"] = str(exc)
            print(json.dumps(out))
            sys.exit(0)
        first = gather_choice()
        out["first"] = first and first.as_dict()
        # more copies, of another page size too: the same choice, not a new one
        out["more_ok"] = shuffled_round_trip(c, "t/b", 16384, 1000)[0]
        out["same"] = gather_choice() is first
    out["torch_after"] = "torch" in sys.modules
    print(json.dumps(out))
    """
)


def run_client(
    endpoint: str, mode: str = "", env: dict[str, str] | None = None, tokens_at: int = 0
) -> dict[str, Any]:
    environ = {k: v for k, v in os.environ.items() if k != gather.ENV}
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, endpoint, mode, str(tokens_at)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.fixture
def small_daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(size_mib=8, populate=False)


def test_the_first_scattered_copy_measures_once_and_picks_one_of_the_two(
    small_daemon: Daemon,
) -> None:
    got = run_client(small_daemon.endpoint)
    assert got["before"] is None  # nothing measured before a copy needs it
    assert got["bytes_ok"] and got["more_ok"]
    first = got["first"]
    assert first["how"] == "measured"
    for way in ("read", "write"):
        assert first[way]["pick"] in gather.KERNELS
        rates = (first[way]["numpy_gbps"], first[way]["torch_gbps"])
        assert min(rates) > 0
        faster = "torch" if rates[1] > gather.TORCH_MARGIN * rates[0] else "numpy"
        assert first[way]["pick"] == faster
    # bounded: a sample of at most SAMPLE_BYTES, at most ROUNDS rounds, of the first page size
    assert first["page_bytes"] == PAGE
    assert first["sample_pages"] >= 1 and first["sample_pages"] * PAGE <= gather.SAMPLE_BYTES
    assert 1 <= first["rounds"] <= gather.ROUNDS
    # and once: later copies, of another page size too, keep the same choice
    assert got["same"]


def test_either_kernel_named_moves_the_same_bytes_both_ways(small_daemon: Daemon) -> None:
    digests = set()
    for at, kernel in enumerate(gather.KERNELS):
        got = run_client(small_daemon.endpoint, env={gather.ENV: kernel}, tokens_at=at * 5000)
        assert got["bytes_ok"] and got["more_ok"] and got["same"]
        assert got["first"]["how"] == gather.ENV
        assert got["first"]["read"]["pick"] == got["first"]["write"]["pick"] == kernel
        assert got["first"]["seconds"] == 0.0  # named: nothing measured
        digests.add(got["digest"])  # of the slots as one in-order read saw them
    assert len(digests) == 1


def test_without_torch_numpy_copies_and_torch_is_never_imported(small_daemon: Daemon) -> None:
    got = run_client(small_daemon.endpoint, "no-torch")
    assert got["bytes_ok"] and got["more_ok"]
    assert got["first"] is None  # nothing to choose between
    assert not got["torch_before"] and not got["torch_after"]


def test_an_unknown_kernel_named_is_refused_with_the_choices(small_daemon: Daemon) -> None:
    got = run_client(small_daemon.endpoint, env={gather.ENV: "cupy"})
    assert "HICACHED_GATHER='cupy'" in got["refused"] and "numpy, torch" in got["refused"]


def _placed(nbytes: int, offset: int) -> tuple[np.ndarray, Any]:
    """A buffer of ``nbytes`` at ``offset`` past a 4 KiB boundary, in shared memory."""
    shared = mmap.mmap(-1, nbytes + 8192)
    raw = np.frombuffer(shared, dtype=np.uint8)
    return raw[offset : offset + nbytes], shared


@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "16-past-a-line"])
def test_both_kernels_move_identical_bytes_both_ways(offset: int) -> None:
    pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    rows_n, n, size = 64, 24, 4096 + 64  # a page size that is no multiple of 4 KiB too
    flat, _keep = _placed(rows_n * size, 0)
    pool = flat.reshape(rows_n, size)
    pool[:] = rng.integers(0, 256, pool.shape, dtype=np.uint8)
    idx = rng.permutation(rows_n)[:n].astype(np.int64)
    outs = {}
    for name, kernel in gather.GATHERS.items():
        buf, _held = _placed(n * size, offset)
        out = buf.reshape(n, size)
        kernel(pool, idx, out)
        outs[name] = out.copy()
    assert np.array_equal(outs["numpy"], np.stack([pool[r] for r in idx]))
    assert np.array_equal(outs["torch"], outs["numpy"])
    src = rng.integers(0, 256, (n, size), dtype=np.uint8)
    written = {}
    for name, kernel in gather.SCATTERS.items():
        target = pool.copy()
        kernel(target, idx, src)
        written[name] = target
    expected = pool.copy()
    for j, r in enumerate(idx):
        expected[r] = src[j]
    assert np.array_equal(written["numpy"], expected)
    assert np.array_equal(written["torch"], expected)
    untouched = np.setdiff1d(np.arange(rows_n), idx)
    assert np.array_equal(written["torch"][untouched], pool[untouched])
