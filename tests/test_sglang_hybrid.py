"""hicached's SGLang backend with a hybrid model's host pools (SGLang's v2
calls), driven by a real SGLang's own classes (``tests/engines/
sglang_hybrid_check.py`` in its own venv) against a real daemon: SGLang's
Mamba, sliding-window, draft and DeepSeek V4 host pools, grouped and
registered as SGLang's hybrid cache controller does, stores sent as it sends
them. One process writes, a second reads what the first wrote into pools of
its own, byte for byte; the rest runs in the first.

The venv is built once, outside the clone (tests/engines/sglang_venv.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicached.wire.hashing import engine_page_keys
from hicached_backends.record import HEADER_BYTES
from tests.engines import sglang_venv
from tests.l3util import record_at, settle_writes, storage
from tests.support import Daemon

# The first test waits for the venv build (minutes, once per pin and machine).
pytestmark = pytest.mark.timeout(1200)

CHECK = Path(__file__).parent / "engines" / "sglang_hybrid_check.py"
ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("rows", "flat", "logical")
Facts = dict[str, Any]


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The SGLang venv's python, built on first use."""
    return sglang_venv.build()


def run_check(python: Path, endpoint: str, *scenarios: str) -> dict[str, Facts]:
    done = subprocess.run(
        [str(python), str(CHECK), endpoint, *scenarios],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=sglang_venv.env(ROOT),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out: dict[str, Facts] = json.loads(done.stdout)
    return out


@pytest.fixture(scope="module")
def report(sglang_python: Path) -> Iterator[dict[str, Facts]]:
    """Every scenario's facts: the writer's process, then the reader's, against
    one daemon; ``parents`` on a small daemon of its own."""
    scratch = Path(tempfile.mkdtemp(prefix="hc-sgh-", dir="/tmp"))
    daemon = Daemon(size_mib=16, slab_mib=1).start()
    small = Daemon(size_mib=2, slab_mib=1).start()  # 128 pages of 16 KiB
    try:
        wrote = run_check(
            sglang_python,
            daemon.endpoint,
            "hybrid_write",
            "stops",
            "half",
            "mla_mamba",
            "bad",
            "stale",
            f"down:ipc://{scratch}/none.sock",
            f"parents:{small.endpoint}",
        )
        (scratch / "wrote.json").write_text(json.dumps(wrote))
        read = run_check(sglang_python, daemon.endpoint, f"hybrid_read:{scratch / 'wrote.json'}")
        yield {**wrote, **read}
    finally:
        daemon.cleanup()
        small.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="module")
def from_l3(sglang_python: Path) -> Iterator[Facts]:
    """The hybrid pages written by one process, then, the daemon restarted with
    an empty L2 (a new pool: ``serve --fresh``), read by another from L3 (a file
    store written through) alone; ``lost_*`` cases too, whose ``damaged``
    records are damaged while the daemon is down."""
    scratch = Path(tempfile.mkdtemp(prefix="hc-sgh3-", dir="/tmp"))
    daemon = Daemon(
        size_mib=16,
        slab_mib=1,
        storage=storage("file"),
        tail="[storage.file]\ncapacity_mib = 64\nsegment_mib = 16\nio_threads = 2\n",
    ).start()
    try:
        wrote = run_check(sglang_python, daemon.endpoint, "hybrid_write", "lost_write")
        (scratch / "wrote.json").write_text(json.dumps(wrote))
        with daemon.client() as c:
            settle_writes(c)
            l3 = c.stats().l3
        assert l3.get("store_recycled_segments", 0) == 0, l3  # every record is still there
        daemon.stop()
        if "error" not in wrote["lost_write"]:
            damage(daemon.dir / "data" / "pages", wrote["lost_write"])
        daemon.start()
        with daemon.client() as c:
            assert c.stats().pool_used_bytes == 0  # nothing in L2: every hit comes from L3
        read = run_check(
            sglang_python,
            daemon.endpoint,
            f"hybrid_read:{scratch / 'wrote.json'}",
            f"lost_read:{scratch / 'wrote.json'}",
        )
        yield {**wrote, **read, "stored": l3.get("written", 0)}
    finally:
        daemon.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)


# the ``lost_*`` cases (sglang_hybrid_check.LOST): pool, page, how it is lost
LOST = {
    "draft_unstored": ("draft", 3, "unstored"),
    "window_unstored": ("swa", 4, "unstored"),
    "first_state_unstored": ("mamba", 2, "unstored"),
    "kv_unstored": ("kv", 4, "unstored"),
    "draft_damaged": ("draft", 3, "damaged"),
    "state_damaged": ("mamba", 5, "damaged"),
    "kv_damaged": ("kv", 4, "damaged"),
}


def damage(store: Path, wrote: Facts) -> None:
    """Flip a byte of each ``damaged`` case's lost page in its record's payload:
    the record stays where it is, and no longer verifies."""
    for case, (pool, page, how) in LOST.items():
        if how != "damaged":
            continue
        ns = bytes.fromhex(wrote[case]["spaces"][pool])
        key = engine_page_keys(ns, [bytes.fromhex(wrote[case]["keys"][page])])[0]
        segment, header = record_at(store, ns, key)
        with open(segment, "r+b") as f:
            f.seek(header + HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(header + HEADER_BYTES + 100)
            f.write(bytes([byte[0] ^ 0xFF]))


def facts(report: dict[str, Facts], name: str, quiet: bool = True) -> Facts:
    """One scenario's facts; its traceback if it raised, what the backend
    logged if it logged anything in a scenario where nothing goes wrong."""
    got = report[name]
    assert "error" not in got, got["error"]
    assert not (quiet and got["log"]), "\n".join(got["log"])
    return got


def hit(pages: int, hits: dict[str, int], restorable: list[int]) -> Facts:
    """A PoolTransferResult: the hit (SGLang's ``kv_hit_pages``, the longest
    prefix every pool restores), each pool's own longest, and every prefix
    length every pool restores."""
    return {"kv": pages, "hits": hits, "restorable": restorable}


# -- two processes, byte for byte --------------------------------------------------------


def read_as_written(wrote: Facts, read: Facts, group: str) -> None:
    """What a second process read is what the first wrote, every pool byte for
    byte, and a key twice in one read fills every page that names it."""
    for node in wrote["set"]:
        assert all(all(ok) for ok in node.values()), node
    assert read["exists"] == wrote["exists"]
    assert set(wrote["written"]) == set(read["read"])
    for pool, pages in wrote["written"].items():
        assert read["read"][pool] == pages, f"{pool}: the pages read are not the pages written"
    assert read["kv"] == [True] * 6
    for name in ("draft", "deepseek_v4_c4"):
        if name in wrote["written"]:
            assert read[name] == [True] * 6
    if group != "logical":
        assert read["sidecars3"] == read["sidecars6"] == {"swa": [True, True], "mamba": [True]}
        keys, kv = wrote["keys"], wrote["written"]["kv"]
        assert read["kv_repeat"] == [True] * 5
        assert read["kv_repeat_read"] == [kv[keys[j]] for j in (0, 1, 0, 1, 2)]


@pytest.mark.parametrize("group", GROUPS)
def test_hybrid_pages_go_from_one_process_to_another(report: dict[str, Facts], group: str) -> None:
    read_as_written(
        facts(report, "hybrid_write")[group], facts(report, "hybrid_read")[group], group
    )


@pytest.mark.parametrize("group", GROUPS)
def test_hybrid_pages_come_back_from_l3_alone(from_l3: Facts, group: str) -> None:
    """After a restart that emptied L2, every pool's pages are read from L3,
    byte for byte, and a hit is still a prefix every pool restores."""
    assert from_l3["stored"] > 0
    read_as_written(
        facts(from_l3, "hybrid_write")[group], facts(from_l3, "hybrid_read")[group], group
    )


# Per case of LOST: the hit, then the sidecar reads that end the second node (the
# draft pool over both nodes, the window, the state) and the first (the window,
# the state), then the KV pages' read.
ALL6 = hit(6, {"kv": 6, "swa": 6, "mamba": 6, "draft": 6}, [3, 6])
T, F = True, False
LOST_ANSWERS = {
    # the draft pool lacks page 3: no prefix past 3, nothing past 3 read with it
    "draft": (
        hit(3, {"kv": 6, "swa": 6, "mamba": 6, "draft": 3}, [3]),
        {"draft": [T, T, T, F, F, F], "swa": [F, F], "mamba": [F]},
        {"swa": [T, T], "mamba": [T]},
        [T] * 6,
    ),
    # the window lacks page 4: the second node's end is not restorable
    "window": (
        hit(3, {"kv": 6, "swa": 3, "mamba": 6, "draft": 6}, [3]),
        {"draft": [T, T, T, T, F, F], "swa": [F, F], "mamba": [F]},
        {"swa": [T, T], "mamba": [T]},
        [T] * 6,
    ),
    # no state at the first node's end: only the whole sequence ends on a state
    "first_state": (
        hit(6, {"kv": 6, "swa": 6, "mamba": 6, "draft": 6}, [6]),
        {"draft": [T] * 6, "swa": [T, T], "mamba": [T]},
        {"swa": [T, F], "mamba": [F]},
        [T] * 6,
    ),
    # no state at the second node's end
    "state": (
        hit(3, {"kv": 6, "swa": 6, "mamba": 3, "draft": 6}, [3]),
        {"draft": [T, T, T, T, T, F], "swa": [T, F], "mamba": [F]},
        {"swa": [T, T], "mamba": [T]},
        [T] * 6,
    ),
    # the KV pool lacks page 4: its read stops there, the sidecars hold theirs
    "kv": (
        hit(3, {"kv": 4, "swa": 3, "mamba": 3, "draft": 4}, [3]),
        {"draft": [T] * 6, "swa": [T, T], "mamba": [T]},
        {"swa": [T, T], "mamba": [T]},
        [T, T, T, T, F, F],
    ),
}


@pytest.mark.parametrize("case", list(LOST))
def test_a_page_one_pool_lacks_in_l3_ends_the_hit_and_every_read_of_it(
    from_l3: Facts, case: str
) -> None:
    """After a restart that emptied L2, one pool's page is not in L3 (never
    stored, or its record does not verify) while the others' are: the hit ends
    before it in every pool, no read of a call reports a page past it in any
    pool of the call, and every page reported read holds the bytes stored."""
    how = LOST[case][2]
    wrote = facts(from_l3, "lost_write")[case]
    got = facts(from_l3, "lost_read", quiet=how == "unstored")[case]
    assert wrote["lost"] == list(LOST[case])
    assert all(all(ok) for ok in wrote["set"].values()), wrote["set"]
    exists, sidecars6, sidecars3, kv = LOST_ANSWERS[case.rpartition("_")[0]]
    if how == "unstored":
        assert got["exists"] == exists
    else:  # the store checks a record's bytes when it reads it: a first ask may be told more
        assert got["exists"] in (exists, ALL6)
    assert got["get6"] == sidecars6
    assert got["get3"] == sidecars3
    assert got["kv"] == kv
    assert got["exists_after"] == exists  # a record found bad is gone for good
    for name, pages in got["read"].items():
        for key, digest in pages.items():
            assert digest == wrote["written"][name][key], f"{name}: read, not the page stored"


def test_a_hit_is_a_prefix_every_pool_restores(report: dict[str, Facts]) -> None:
    rows = facts(report, "hybrid_write")["rows"]
    # Mamba states only at the ends of the two nodes (pages 3 and 6), the
    # window (2 pages) whole there too; the draft pool holds every page
    expected = hit(6, {"kv": 6, "swa": 6, "mamba": 6, "draft": 6}, [3, 6])
    assert rows["exists"] == expected
    assert facts(report, "hybrid_read")["rows"]["exists"] == expected
    assert facts(report, "hybrid_read")["logical"]["exists"] == hit(
        6, {"kv": 6, "deepseek_v4_c4": 6}, [1, 2, 3, 4, 5, 6]
    )


def test_each_pool_is_a_namespace_of_its_own(report: dict[str, Facts]) -> None:
    got = facts(report, "hybrid_write")
    rows, flat, logical = got["rows"], got["flat"], got["logical"]
    assert rows["layouts"] == {
        "kv": "page_first",
        "swa": "swa_page_first",
        "mamba": "mamba_page_first",
        "draft": "draft_page_first",
    }
    # Mamba: fp32 temporal 2 layers x 2 heads x 32 x 32, bf16 conv 2 layers x 8 x 3
    assert rows["page_bytes"]["mamba"] == 2 * 2 * 32 * 32 * 4 + 2 * 8 * 3 * 2
    assert flat["page_bytes"]["mamba"] == rows["page_bytes"]["mamba"] + 5 * 4  # a side state
    assert rows["copies"] == {k: "RowPages" for k in ("kv", "swa", "mamba", "draft")}
    # a side state is not in SGLang's zero-copy addresses: flat data pages
    assert flat["copies"] == {"kv": "RowPages", "swa": "RowPages", "mamba": "FlatPages"}
    assert logical["copies"] == {"deepseek_v4_c4": "FlatPages"}  # the anchor holds no bytes
    assert logical["layouts"] == {"deepseek_v4_c4": "deepseek_v4_c4_page_first"}


# -- what a hit is ------------------------------------------------------------------------


def test_batch_exists_v2_stops_at_the_first_page_any_pool_lacks(report: dict[str, Facts]) -> None:
    got = facts(report, "stops")
    for case in ("kv_hole", "draft_hole", "only_kv"):
        assert got[f"{case}_set"], case
    # KV lacks the fifth page: no prefix past 4; Mamba states end prefixes 2 and 4
    assert got["kv_hole"] == hit(4, {"kv": 4, "draft": 4, "mamba": 4}, [2, 4])
    # the draft pool lacks the fourth page: no prefix past 3, of those only 2 ends on a state
    assert got["draft_hole"] == hit(2, {"kv": 7, "draft": 3, "mamba": 6}, [2])
    assert got["only_kv"] == hit(0, {"kv": 7}, [])
    # reads stop where the pool's pages stop
    assert got["draft_hole_draft_get"] == [True] * 3 + [False] * 4
    assert got["only_kv_draft_get"] == [False] * 7


def test_a_half_stored_page_is_never_a_hit(report: dict[str, Facts]) -> None:
    got = facts(report, "half", quiet=False)
    # the sidecars of a node without its KV pages
    assert got["sidecars_set"] == {"swa": [True] * 2, "mamba": [True], "draft": [True] * 3}
    assert got["sidecars_only"] == hit(0, {}, [])
    # one pool of a call cannot store: the other's pages of the same keys are not published
    assert got["one_fails_set"] == {"draft": [False] * 3, "swa": [False] * 3}
    assert got["one_fails_published"] == [False] * 3
    assert got["one_fails_kv_set"] == [True] * 3
    assert got["one_fails"] == hit(0, {"kv": 3}, [])
    assert any("swa pages not stored" in line for line in got["log"])
    # KV and the window, no Mamba state: the window alone restores nothing
    assert got["no_state_set"] == [True] * 5
    assert got["no_state"] == hit(0, {"kv": 3, "swa": 3}, [])
    # a page one pool of a read lacks is read in none
    assert got["no_state_get"] == {"swa": [True, False], "mamba": [False]}


def test_mamba_state_is_each_ranks_own_beside_replicated_mla_kv(
    report: dict[str, Facts],
) -> None:
    got = facts(report, "mla_mamba")
    for rank in (0, 1):
        assert got[f"replicated{rank}"] == {"kv": True, "mamba": False}
        assert got[f"set{rank}"] == {"mamba": [True], "kv": [True] * 3}
        assert got[f"exists{rank}"] == hit(3, {"kv": 3, "mamba": 3}, [3])
        assert got[f"get{rank}"] == [True] * 3
        assert got[f"state{rank}"] == [True]
        assert got[f"kv_same{rank}"], "MLA KV is rank 0's on every rank"
        assert got[f"state_same{rank}"], "a rank read a state that is not its own"
        assert not got[f"state_other{rank}"]


def test_prefix_keys_are_kept_as_parents(report: dict[str, Facts]) -> None:
    """Each chain was stored in two calls; L2 is then filled until it evicts.
    With prefix_keys the second call hangs under the first: eviction takes the
    chain from its tail. Without, the first call's last page goes first."""
    got = facts(report, "parents")
    first_loss = got["first_loss"]
    assert first_loss["kv"] == [True] * 7 + [False]
    assert first_loss["swa"] == [True] * 7 + [False]
    assert first_loss["unlinked"] == [True] * 3 + [False] + [True] * 4


# -- errors ----------------------------------------------------------------------------------


def test_what_breaks_sglangs_contract_is_a_value_error(report: dict[str, Facts]) -> None:
    got = facts(report, "bad", quiet=False)
    assert got["block_groups"].startswith("ValueError: pool mamba: hit policy block_groups")
    assert got["unregistered"].startswith("ValueError: pool swa was never registered")
    assert got["unregistered_set"].startswith("ValueError: pool swa was never registered")
    assert got["too_big"].startswith("InvalidNamespace: page_bytes must be in 1..262144")
    # a sidecar's indices that do not cover its pages: misses, as SGLang's backends answer
    assert got["short_set"] == got["short_get"] == {"mamba": [False]}
    assert got["empty"] == [hit(0, {}, []), {}, {}, {"mamba": []}]


def test_no_daemon_costs_misses_not_errors(report: dict[str, Facts]) -> None:
    got = facts(report, "down", quiet=False)
    assert got["exists"] == hit(0, {}, [])
    assert got["set"] == got["get"] == {"swa": [False, False], "mamba": [False]}
    assert got["calls_s"] < 3.0
    assert any("unreachable" in line for line in got["log"])


def test_a_page_reused_while_it_is_read_is_never_reported_read(report: dict[str, Facts]) -> None:
    """A slot changes owner before or during a read's copy (fault injection:
    the handle's generation moves): every page reported read holds the bytes
    stored, whichever way the pool's pages are copied; the reused one is not read."""
    got = facts(report, "stale", quiet=False)
    cases = {k: v for k, v in got.items() if isinstance(v, dict)}
    assert {"mamba_RowPages_pre", "mamba_FlatPages_post", "flat_kv_pre", "flat_kv_post"} <= set(
        cases
    ), sorted(cases)
    for name, case in cases.items():
        lies = [
            j
            for j, (read, same) in enumerate(zip(case["read"], case["same"], strict=True))
            if read and not same
        ]
        assert not lies, f"{name}: pages {lies} reported read with other bytes"
        assert not case["read"][2], f"{name}: the reused page reported read"
