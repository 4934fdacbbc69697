"""hicached as SGLang's HiCache storage backend, driven by a real SGLang's own
classes (``tests/engines/sglang_check.py`` in its own venv) against a real
daemon with a file L3: the storage backend factory builds the backend from
the dynamic extra config, keys are SGLang's page hashes, and pages go between
SGLang's host pools (MHA under TP 2 in every page layout it can copy, MLA
with one writer) and the daemon through the zero-copy calls, byte for byte,
from one instance to another; pages L2 let go of come back from L3.

The venv is built once, outside the clone (tests/engines/sglang_venv.py);
the first test that needs it waits for the build. All scenarios run in one
process of that venv (SGLang takes seconds to import); each test checks the
facts its scenario reported.
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

from tests.engines import sglang_venv
from tests.l3util import storage
from tests.support import Daemon

# The first test waits for the venv build (minutes, once per pin and machine).
pytestmark = pytest.mark.timeout(1200)

CHECK = Path(__file__).parent / "engines" / "sglang_check.py"
ROOT = Path(__file__).resolve().parents[1]
L3 = "[storage.file]\ncapacity_mib = 64\nsegment_mib = 4\nio_threads = 2\n"
MHA_LAYOUTS = ("page_first", "page_first_direct", "page_head", "layer_first")
MLA_LAYOUTS = ("page_first", "page_first_direct", "layer_first")
# The check's geometry: pages of 16 tokens, 2 layers; MHA 2 heads of 64, MLA rows of 64 + 16.
MHA_PAGE_BYTES = 2 * 16 * 2 * 2 * 64 * 2
Facts = dict[str, Any]


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The SGLang venv's python, built on first use."""
    return sglang_venv.build()


@pytest.fixture(scope="module")
def report(sglang_python: Path) -> Iterator[dict[str, Facts]]:
    """Every scenario's facts, from one run of the check against one daemon
    (small L2, file L3, write-through). The last scenario kills the daemon."""
    nowhere = Path(tempfile.mkdtemp(prefix="hc-sgl-", dir="/tmp"))
    daemon = Daemon(size_mib=8, slab_mib=1, storage=storage("file"), tail=L3)
    events = f"ipc://{daemon.runtime}/events.sock"
    daemon.config.write_text(daemon.config.read_text() + f'[events]\nendpoint = "{events}"\n')
    daemon.start()
    small = Daemon(size_mib=8, slab_mib=1, extra="max_pages_per_request = 4")
    try:
        small.start()
        scenarios = [
            "factory",
            *(f"roundtrip:{layout}" for layout in MHA_LAYOUTS),
            *(f"mla:{layout}" for layout in MLA_LAYOUTS),
            "partial",
            "skip_present",
            "flat",
            "bad_input",
            "l3",
            "repeats",
            f"limit:{small.endpoint}",
            f"l3_parents:{events}",
            f"down:ipc://{nowhere}/none.sock",
            f"dies:{daemon.proc.pid if daemon.proc else 0}",
        ]
        done = subprocess.run(
            [str(sglang_python), str(CHECK), daemon.endpoint, *scenarios],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env=sglang_venv.env(ROOT),
        )
        assert done.returncode == 0, done.stderr[-4000:]
        out: dict[str, Facts] = json.loads(done.stdout)
        yield {_name(scenario): facts for scenario, facts in out.items()}
    finally:
        daemon.cleanup()
        small.cleanup()
        shutil.rmtree(nowhere, ignore_errors=True)


def _name(scenario: str) -> str:
    """A scenario's name in the report: its layout kept, other arguments left out."""
    kind = scenario.partition(":")[0]
    return scenario if kind in ("roundtrip", "mla") else kind


def facts(report: dict[str, Facts], name: str, quiet: bool = True) -> Facts:
    """One scenario's facts; its traceback if it raised, what the backend
    logged if it logged anything in a scenario where nothing goes wrong."""
    got = report[name]
    assert "error" not in got, got["error"]
    assert not (quiet and got["log"]), "\n".join(got["log"])
    return got


def test_the_factory_builds_the_backend_from_the_dynamic_config(
    report: dict[str, Facts],
) -> None:
    got = facts(report, "factory")
    assert got["module"].startswith("hicached.integrations.sglang")
    assert got["class"] == "HicachedStorage"
    fields = got["fields"]
    # a model path: its last parts, and the whole path digested in the revision
    assert fields["model"] == "Test/Tiny-MHA"
    assert fields["revision"].startswith("path-")
    assert fields["key_scheme"] == "sglang-sha256"
    assert (fields["kv_dtype"], fields["layout"]) == ("bfloat16", "page_first")
    assert (fields["page_tokens"], fields["page_bytes"]) == (16, MHA_PAGE_BYTES)
    assert (fields["tp_rank"], fields["tp_size"], fields["replicated"]) == (1, 2, False)


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_tp2_pages_go_from_one_instance_to_another(report: dict[str, Facts], layout: str) -> None:
    got = facts(report, f"roundtrip:{layout}")
    assert not got["same_namespace"]  # one namespace per TP rank
    for rank in (0, 1):
        assert got[f"set{rank}"] == [True] * 6
        assert got[f"exists{rank}"] == 6
        assert got[f"get{rank}"] == [True] * 6
        assert got[f"same{rank}"] == [True] * 6, "the pages read are not the pages written"
        assert not got[f"same_as_other_rank{rank}"], "a rank read the other rank's shard"


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pages_are_written_once_and_read_by_every_rank(
    report: dict[str, Facts], layout: str
) -> None:
    got = facts(report, f"mla:{layout}")
    assert got["writer"] == [True, False]
    assert got["same_namespace"]  # replicated: the TP rank is not part of it
    assert got["rank1_set"] == [True] * 5  # SGLang's writer stores them
    assert got["rank1_stored"] == 0  # so this rank stored nothing
    assert got["rank0_set"] == [True] * 5
    for rank in (0, 1):
        assert got[f"exists{rank}"] == 5
        assert got[f"get{rank}"] == [True] * 5
        assert got[f"same{rank}"] == [True] * 5


def test_existence_and_reads_stop_at_the_first_missing_page(report: dict[str, Facts]) -> None:
    got = facts(report, "partial")
    assert got["set_head"] == got["set_tail"] == [True] * 3
    assert got["exists"] == 3
    assert got["exists_tail"] == 3
    assert got["get"] == [True] * 3 + [False] * 4
    assert got["same_head"] == [True] * 3


def test_pages_already_stored_are_not_written_again(report: dict[str, Facts]) -> None:
    got = facts(report, "skip_present")
    assert got["first"] == got["again"] == [True] * 4
    assert got["new_pages_again"] == 0
    assert got["kept_first"] == [True] * 4, "a page was written again over the stored one"
    assert got["next"] == [True] * 2  # the sequence goes on under its prefix
    assert got["new_pages_next"] == 2
    assert got["in_l2"] == [True] * 6


def test_flat_pages_are_the_bytes_the_zero_copy_calls_move(report: dict[str, Facts]) -> None:
    got = facts(report, "flat")
    assert got["v1_set"] == got["flat_get"] == got["flat_same"] == [True] * 3
    assert got["flat_set"]
    assert got["v1_get"] == got["v1_same"] == [True] * 3
    assert got["exists_one"]
    assert got["get_missing"]


def test_keys_that_are_not_page_hashes_are_misses(report: dict[str, Facts]) -> None:
    got = facts(report, "bad_input")
    assert got["set_good"] == [True] * 3
    for name in ("short", "upper", "not_str", "not_hex"):
        assert got[f"exists_{name}"] == 1, name
        assert got[f"set_{name}"] == [True, False, False], name
        assert got[f"get_{name}"] == [True, False, False], name
    assert got["empty"] == [0, [], []]


def test_indices_that_do_not_cover_the_pages_are_value_errors(report: dict[str, Facts]) -> None:
    got = facts(report, "bad_input")
    assert got["set_short_indices"] == "ValueError: 3 keys need 48 host indices (16 a page), got 47"
    assert got["get_long_indices"] == "ValueError: 2 keys need 32 host indices (16 a page), got 48"
    for name in ("set_unaligned", "get_scattered"):
        assert got[name] == (
            "ValueError: host indices must cover whole host pages, each from its first slot"
        )
    assert got["flat_get_targets"] == "ValueError: 3 keys need as many target pages, got 1"


def test_float_indices_and_flat_pages_of_another_size_are_refused_before_a_copy(
    report: dict[str, Facts],
) -> None:
    got = facts(report, "bad_input")
    # an int64 cast would have truncated them: the pages of other slots than named
    assert got["get_float_indices"] == (
        "BadRequest: host indices must be an integer tensor, got torch.float64"
    )
    assert got["set_float_indices"] == (
        "BadRequest: host indices must be an integer tensor, got torch.float32"
    )
    assert got["set_float_stored"] == 0
    half = MHA_PAGE_BYTES // 2
    assert got["flat_get_small_target"] == (
        f"BadRequest: target 1 holds {half} bytes ((4096,) of torch.bfloat16); "
        f"a page of this pool is {MHA_PAGE_BYTES} bytes"
    )
    assert got["flat_get_strided_target"] == (
        "BadRequest: target 1 is not contiguous: the page is copied into it whole"
    )
    assert got["flat_get_good_target_untouched"], "a page was copied before the refusal"
    assert got["flat_set_small_page"] == (
        f"BadRequest: page 1 holds {half} bytes ((4096,) of torch.bfloat16); "
        f"a page of this pool is {MHA_PAGE_BYTES} bytes"
    )
    assert got["flat_set_stored"] == 0


def test_pages_evicted_from_l2_come_back_from_l3(report: dict[str, Facts]) -> None:
    got = facts(report, "l3")
    assert got["set"] == [True] * 8
    assert got["in_l2"] == [False] * 8, f"L2 kept them after {got['filler_rounds']} rounds"
    assert got["in_l3"] == [True] * 8
    assert got["exists"] == 8  # batch_exists counts what L3 holds
    assert got["get"] == [True] * 8
    assert got["same"] == [True] * 8
    assert got["l3"]["pages_prefetched"] == 8
    assert got["in_l2_after"] == [True] * 8


def test_pages_l3_gives_back_after_pages_l2_holds_enter_l2_under_the_page_before(
    report: dict[str, Facts],
) -> None:
    """A read of six pages after L2 let go of them all: a read of the first
    three brings them back (the first of them starts the sequence), then a
    read of all six reads those three from L2 and asks L3 for the rest. Each
    enters L2 under the page before it; the daemon took the fourth for the
    start of a sequence, since the prefetch named only the pages after the
    ones L2 held."""
    got = facts(report, "l3_parents")
    assert got["set"] == got["get"] == [True] * 6
    assert got["get_first"] == [True] * 3
    assert got["in_l2"] == [False] * 6
    assert got["parents"] == [-1, 0, 1, 2, 3, 4], got["parents"]


def test_a_key_twice_in_a_call_is_sent_once_and_answers_every_page(
    report: dict[str, Facts],
) -> None:
    """The daemon refuses a key twice in one reservation or prefetch, so a
    read of a key twice whose pages only L3 held missed whole, and a store
    stopped at the repeat. Each key goes once; its answer goes to every page."""
    got = facts(report, "repeats")
    assert got["set_aba"] == [True] * 3
    assert got["new_pages_aba"] == 2  # stored once
    assert got["set_aab"] == [True] * 3
    # [A, B, A, C]: C follows A, not B, so it is not linked under B: left out
    assert got["set_abac"] == [True, True, True, False]
    assert got["stored_abac"] == [True, True, False]
    assert got["new_pages"] == 6
    assert got["flat_set"] is True
    assert got["flat_stored"] == 2
    assert got["in_l2"] == [False] * 4, f"L2 kept them after {got['filler_rounds']} rounds"
    assert got["in_l3"] == [True] * 4
    assert got["exists"] == 5
    assert got["get"] == [True] * 5, "a key twice in a prefetch missed the whole read"
    assert got["same"] == [True] * 5
    assert got["get_past_miss"] == [True, False, False]
    assert got["flat_get"] == [True] * 3
    assert got["flat_same"] == [True] * 3


def test_requests_over_the_daemons_page_limit_count_and_move_every_page_in_parts(
    report: dict[str, Facts],
) -> None:
    got = facts(report, "limit")
    assert got["set"] == [True] * 10
    # the query goes in parts the daemon takes, each after a whole one
    assert got["exists"] == got["exists_past"] == got["exists_v2"] == 10
    # reads and stores go in parts the daemon takes (before: the first part
    # alone, the rest misses)
    assert got["get"] == [True] * 10
    assert got["same"] == [True] * 10
    assert got["set_more"] == [True] * 6
    assert got["exists_more"] == 6
    assert got["get_more"] == got["same_more"] == [True] * 6


def test_no_daemon_costs_misses_not_errors(report: dict[str, Facts]) -> None:
    got = facts(report, "down", quiet=False)
    assert got["exists"] == 0
    assert got["set"] == got["get"] == [False] * 4
    assert got["first_calls_s"] < 3.0  # one connection attempt, then no more for retry_s
    assert got["backed_off_s"] < 0.5
    assert any("unreachable" in line for line in got["log"])


def test_a_daemon_killed_under_the_backend_costs_misses(report: dict[str, Facts]) -> None:
    got = facts(report, "dies", quiet=False)
    assert got["set_alive"] == [True] * 4
    assert got["exists_alive"] == 4
    assert got["exists"] == 0
    assert got["set"] == [False] * 2
    assert got["get"] == [False] * 4
    assert got["calls_s"] < 3.0


def test_a_relative_model_directory_tagged_by_sglang_is_still_told_by_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang gives storage backends its model path with the host pool's page
    format added ("models/llama-unified-token-major"), which names no directory:
    two hosts' different directories of one relative name must not share a
    namespace (as a hub id's "main" revision would make them), while a hub id
    stays "main"."""
    from hicached.integrations.common import default_revision

    tag = "-unified-token-major"  # hicached/integrations/sglang/pages.py FORMAT_TAGS
    revisions = []
    for host in ("a", "b"):
        (tmp_path / host / "models" / "llama").mkdir(parents=True)
        monkeypatch.chdir(tmp_path / host)
        revisions.append(default_revision("models/llama" + tag, (tag,)))
    assert all(r.startswith("path-") for r in revisions) and revisions[0] != revisions[1]
    assert default_revision("meta-llama/Llama-3-8B" + tag, (tag,)) == "main"
    assert default_revision("models/llama" + tag) == "main"  # without the tag: a hub id
