"""Real vLLM engine processes for tests: the engine venv's python with hicached's
client dependencies, the tiny models written once, and one engine process
answering requests (tests/engines/vllm_run.py), with pauses in which a test
changes the world around it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.engines import tinyhybrid, tinyllama, venv
from tests.l3util import wait_for

ROOT = Path(__file__).resolve().parent.parent.parent
RUNNER = ROOT / "tests" / "engines" / "vllm_run.py"


def engine_python() -> Path:
    """The vLLM venv's python, built if need be, with hicached's client dependencies."""
    return venv.with_client()


def model_dir(python: Path) -> Path:
    """The tiny model, written once next to the venvs and reused."""
    where = venv.root() / "models" / "tinyllama"
    if not tinyllama.ready(where):
        runner = str(ROOT / "tests" / "engines" / "tinyllama.py")
        subprocess.run([str(python), runner, str(where)], check=True, timeout=300)
    return where


def hybrid_model_dir(python: Path, kind: str) -> Path:
    """A tiny hybrid model (tinyhybrid.py), written once next to the venvs and reused."""
    where = venv.root() / "models" / f"tiny-{kind}"
    if not tinyhybrid.ready(kind, where):
        runner = str(ROOT / "tests" / "engines" / "tinyhybrid.py")
        subprocess.run([str(python), runner, kind, str(where)], check=True, timeout=300)
    return where


def run_engine(
    python: Path,
    model: Path,
    requests: list[dict[str, Any]],
    *,
    hicached: str = "",
    executor: str = "uni",
    copy_thread: bool = False,
    max_model_len: int = 1024,
    between: Callable[[], None] | None = None,
    pauses: Mapping[int, Callable[[], None]] | None = None,
    extra: Sequence[str] = (),
    timeout: float = 300,
) -> dict[str, Any]:
    """One engine process answering ``requests`` in turn; its JSON answer.
    ``pauses``: run ``pauses[i]`` before request i, while the engine waits;
    ``between``: one before the last request. ``extra``: more runner options."""
    steps = dict(pauses or {})
    if between is not None:
        steps[len(requests) - 1] = between
    with tempfile.TemporaryDirectory(prefix="hc-vllm-") as where:
        asked, answered, log = (Path(where) / name for name in ("in.json", "out.json", "log"))
        gates = {i: Path(where) / f"go{i}" for i in steps}
        requests = [
            {**r, "wait_for": str(gates[i])} if i in gates else r for i, r in enumerate(requests)
        ]
        asked.write_text(json.dumps(requests))
        cmd = [str(python), str(RUNNER), str(model), str(asked), str(answered)]
        cmd += ["--executor", executor, "--max-model-len", str(max_model_len), *extra]
        if hicached:
            cmd += ["--hicached", hicached, *(["--copy-thread"] if copy_thread else [])]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with log.open("wb") as out:
            engine = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            try:
                for i in sorted(steps):
                    ready = Path(f"{gates[i]}.ready")
                    wait_for(lambda r=ready: r.exists() or engine.poll() is not None, timeout)
                    if engine.poll() is not None:
                        break
                    steps[i]()
                    gates[i].touch()
                engine.wait(timeout)
            finally:
                if engine.poll() is None:
                    engine.kill()
                    engine.wait()
        assert engine.returncode == 0, f"the engine failed:\n{log.read_text()[-6000:]}"
        result: dict[str, Any] = json.loads(answered.read_text())
    assert result["vllm"] == venv.VLLM.split("==")[1]
    return result


def same_answer(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """The same tokens, and logprobs equal but for float rounding."""
    return got["token_ids"] == want["token_ids"] and np.allclose(
        got["logprobs"], want["logprobs"], rtol=0, atol=1e-4
    )


def check_facts(check: Path, size_mib: int = 1, max_pages: int = 0) -> dict[str, Any]:
    """Run a check script in the vLLM venv against a daemon of its own (a pool of
    ``size_mib`` slabs of 1 MiB) and return the facts its last line prints as JSON.
    ``max_pages``: a second daemon, whose ``server.max_pages_per_request`` it is,
    its endpoint the script's third argument."""
    from tests.support import Daemon

    python = venv.with_client()
    d = Daemon(size_mib=size_mib, slab_mib=1)
    small = (
        Daemon(size_mib=size_mib, slab_mib=1, extra=f"max_pages_per_request = {max_pages}")
        if max_pages
        else None
    )
    try:
        d.start()
        args = [d.endpoint, str(d.proc.pid if d.proc else 0)]
        if small is not None:
            small.start()
            args.append(small.endpoint)
        done = subprocess.run(
            [str(python), str(check), *args],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=300,
        )
    finally:
        d.cleanup()
        if small is not None:
            small.cleanup()
    assert done.returncode == 0, done.stderr[-4000:]
    facts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return facts
