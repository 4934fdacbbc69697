"""The table kernel (hicached/client/kernel.py) without a GPU: run by Triton's
interpreter on CPU tensors, and compiled for sm_90 to read its loads and
stores. Triton comes with vLLM, so where this interpreter lacks it the checks
run in the vLLM venv (tests/engines/venv.py, built on first use); the script
is tests/engines/copy_kernel_check.py. The GPU runs are in tests/test_cuda.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.engines import venv

# The venv build, the first time, takes minutes.
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "engines" / "copy_kernel_check.py"


def _python() -> str:
    if importlib.util.find_spec("triton") is not None:
        return sys.executable
    return str(venv.with_client())


def _check(mode: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    if mode == "run":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [_python(), str(CHECK), mode], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def ran() -> dict[str, Any]:
    return _check("run")


def test_the_kernel_copies_every_shape_byte_for_byte(ran: dict[str, Any]) -> None:
    names = [case["name"] for case in ran["cases"]]
    for way in ("write", "read"):
        for shape in ("in_order", "shuffled", "bf16", "layers_rows_at", "layers_adjacent"):
            assert f"{way}_{shape}" in names
    for case in ran["cases"]:
        assert case["kernel"], f"{case['name']} did not go by the kernel"
        assert case["bytes_equal"], f"{case['name']} moved other bytes"


def test_a_table_in_any_memory_order_is_read_as_its_columns(ran: dict[str, Any]) -> None:
    assert ran["fortran_table"] == {"kernel": True, "bytes_equal": True}


def test_tables_the_kernel_cannot_take_go_the_other_ways(ran: dict[str, Any]) -> None:
    assert not ran["unaligned"]["kernel"]  # pieces 8 bytes off 16
    assert not ran["one_slot_twice"]["kernel"]  # two pages into one slot
    assert ran["on_after_refusals"], "a table it refused turned the kernel off"


def test_a_kernel_that_fails_to_launch_is_turned_off_once(ran: dict[str, Any]) -> None:
    assert [case["kernel"] for case in ran["after_fault"]] == [False, False]
    assert "injected compile failure" in ran["off_reason"]
    said = [line for line in ran["log"] if "table kernel are off" in line]
    assert len(said) == 1, ran["log"]


def test_the_kernel_compiles_for_sm90_with_16_byte_loads_and_stores() -> None:
    got = _check("ptx")
    assert not got.get("source"), f"the kernel does not compile: {got['why']}"
    if not got["compiled"]:
        pytest.skip(f"this Triton cannot compile for CUDA here: {got['why']}")
    wide = {"ld.global.v2.b64", "ld.global.v4.b32", "st.global.v2.b64", "st.global.v4.b32"}
    ops = set(got["ops"])
    assert {op for op in ops if op.startswith("ld.global")} & wide, f"no 16-byte loads: {got}"
    stores = {op for op in ops if op.startswith("st.global")}
    assert stores and stores <= wide, f"stores narrower than 16 bytes: {sorted(stores)}"
