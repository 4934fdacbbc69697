"""Each client process tells the daemon which scattered-copy kernels it picked
(client/gather.py; protocol 1.5's gather report), and ``hicached status``, stats
and the metrics show them per client session until the session ends. Clients
run as processes of their own against a real daemon, since the pick is the
process's; bad reports come over a raw socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from hicached.client import Client, gather
from hicached.testing import scrape
from hicached.wire import protocol as p
from tests.support import NS, Daemon

ENGINE = textwrap.dedent(
    """
    import json, logging, os, sys
    import msgspec
    import numpy as np
    endpoint, mode, base = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode != "no-torch":
        import torch  # as every engine has it
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    for name in ("hicached.client.dealer", "hicached.client.report"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    from hicached.client import Client, gather_choice

    size = 65536
    with Client(endpoint, timeout=10.0, name=f"engine-{mode}") as c:
        ns = c.register(model="t/g", kv_dtype="bfloat16", layout="layer_first",
                        page_tokens=16, page_bytes=size)
        tokens = np.arange(base, base + 8 * 16, dtype=np.uint32)
        data = np.random.default_rng(base).integers(0, 256, (8, size), dtype=np.uint8)
        order = [5, 2, 7, 0, 3, 6, 1, 4]
        res = c.reserve(ns, tokens)
        c.write_pages(res.select(order), data)  # the first scattered copy: the pick
        c.commit(res)
        hit = c.match(ns, tokens)
        back = c.read_pages(hit.select(order))
        c.release(hit)
        choice = gather_choice()
        stats = c.stats()  # after the report on this connection: it holds this one's
        mine = [msgspec.to_builtins(g) for g in stats.gather_clients if g.pid == os.getpid()]
        print(json.dumps({
            "ok": bool(np.array_equal(back, data)),
            "pid": os.getpid(),
            "choice": choice and choice.as_dict(),
            "mine": mine,
            "errors": stats.errors,
            "requests": stats.requests,
        }), flush=True)
        # the session stays open until the test has looked; "again": two more
        # calls (the first says hello again to a restarted daemon, and sends the
        # report after it), then the records as the second one saw them
        while sys.stdin.readline().strip() == "again":
            c.stats()
            again = [msgspec.to_builtins(g) for g in c.stats().gather_clients]
            print(json.dumps([g for g in again if g["pid"] == os.getpid()]), flush=True)
    """
)


class Engine:
    """A client process that stores and reads scattered pages, then holds its session."""

    def __init__(self, endpoint: str, mode: str, base: int, env: dict[str, str]) -> None:
        environ = {k: v for k, v in os.environ.items() if k != gather.ENV}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, endpoint, mode, str(base)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**environ, **env},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(self.finish())
        self.out: dict[str, Any] = json.loads(line)

    def again(self) -> list[dict[str, Any]]:
        """Its own records in stats after two more calls."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("again\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(self.finish())
        mine: list[dict[str, Any]] = json.loads(line)
        return mine

    def finish(self) -> str:
        """Let it close its client (goodbye) and exit; its stderr."""
        _, err = self.proc.communicate("\n", timeout=60)
        assert self.proc.returncode == 0, err
        return err


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        if engine.proc.poll() is None:
            engine.proc.kill()
            engine.proc.wait()


def probe_stats(endpoint: str) -> p.DaemonStats:
    """Stats from a client that maps no pool, so it reports nothing itself."""
    with Client(endpoint, timeout=5.0, map_pool=False) as c:
        return c.stats()


def hicached(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "hicached", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_each_client_process_reports_its_kernels_until_its_session_ends(
    daemon_factory: Callable[..., Daemon], engines: list[Engine]
) -> None:
    pytest.importorskip("torch")
    d = daemon_factory(size_mib=8, populate=False)
    before = probe_stats(d.endpoint).requests.get("gather", 0)  # the harness's own, if any
    runs = [("measure", {}), ("torch", {gather.ENV: "torch"}), ("no-torch", {})]
    for at, (mode, env) in enumerate(runs):
        engines.append(Engine(d.endpoint, mode, at * 5000, env))
    measured, forced, bare = (e.out for e in engines)
    for out in (measured, forced, bare):
        assert out["ok"] and not out["errors"]
        assert len(out["mine"]) == 1  # the engine saw its own record in stats
    # a real measurement: its picks and rates as the process has them
    got, choice = measured["mine"][0], measured["choice"]
    assert got["how"] == "measured" and choice["how"] == "measured"
    for way in ("read", "write"):
        assert got[way] == choice[way]["pick"] in p.GATHER_KERNELS
        for kernel in p.GATHER_KERNELS:
            assert got[f"{way}_{kernel}_gbps"] == choice[way][f"{kernel}_gbps"]
    assert max(got["read_numpy_gbps"], got["read_torch_gbps"]) > 0  # measured, not left 0.0
    assert (got["page_bytes"], got["sample_pages"]) == (65536, choice["sample_pages"])
    assert 1 <= got["rounds"] <= gather.ROUNDS and got["client"] == "engine-measure"
    # forced by HICACHED_GATHER: torch both ways, nothing measured
    got = forced["mine"][0]
    assert (got["how"], got["read"], got["write"]) == ("forced", "torch", "torch")
    assert got["read_torch_gbps"] == got["read_numpy_gbps"] == 0.0
    # torch not loaded: numpy copies without measuring, and says so
    got = bare["mine"][0]
    assert (got["how"], got["read"], got["write"]) == ("no_torch", "numpy", "numpy")
    assert bare["choice"] is None
    stats = probe_stats(d.endpoint)
    pids = {e.out["pid"] for e in engines}
    assert {g.pid for g in stats.gather_clients} == pids
    # one report a session, though each engine made several calls after its pick
    assert stats.requests["gather"] - before == 3 and not stats.errors

    text = hicached("status", "--endpoint", d.endpoint)
    line = next(x for x in text.splitlines() if x.startswith("gather:"))
    m = measured["mine"][0]
    picks = sorted([f"{m['read']}/{m['write']}", "torch/torch", "numpy/numpy"])
    for pick in set(picks):
        n = picks.count(pick)
        assert f"{n} client{'s' if n > 1 else ''} {pick}" in line, line
    assert "1 measured" in line and "1 set by HICACHED_GATHER" in line and "1 without torch" in line
    assert f"engine-measure (pid {measured['pid']}): read {m['read']}" in text
    js = json.loads(hicached("status", "--json", "--endpoint", d.endpoint))
    assert sorted(g["how"] for g in js["gather_clients"]) == ["forced", "measured", "no_torch"]

    metrics = scrape(stats.metrics_endpoint)
    labels = (("how", "forced"), ("read", "torch"), ("write", "torch"))
    assert metrics[("hicached_gather_clients", labels)] == 1
    total = sum(v for (name, _), v in metrics.items() if name == "hicached_gather_clients")
    assert total == 3

    # the record goes with the session: a client that closes is forgotten
    err = engines[1].finish()
    assert "refused" not in err
    after = probe_stats(d.endpoint)
    assert {g.pid for g in after.gather_clients} == pids - {forced["pid"]}
    for engine in (engines[0], engines[2]):
        engine.finish()
    assert probe_stats(d.endpoint).gather_clients == []
    assert "gather:     none reported" in hicached("status", "--endpoint", d.endpoint)


def test_a_restarted_daemon_hears_the_pick_again_at_the_new_hello(
    daemon_factory: Callable[..., Daemon], engines: list[Engine]
) -> None:
    pytest.importorskip("torch")
    d = daemon_factory(size_mib=8, populate=False)
    engine = Engine(d.endpoint, "torch", 0, {gather.ENV: "numpy"})
    engines.append(engine)
    (first,) = engine.out["mine"]
    assert engine.again() == [first]  # more calls: the same record, no new report
    d.stop()
    d.start()  # a new daemon: no session, no record
    stats = probe_stats(d.endpoint)
    assert stats.gather_clients == []
    before = stats.requests.get("gather", 0)  # the harness's own, if any
    (got,) = engine.again()  # its calls said hello again, then reported
    assert (got["how"], got["read"], got["write"]) == ("forced", "numpy", "numpy")
    assert probe_stats(d.endpoint).requests["gather"] - before == 1
    engine.finish()


ASYNC_ENGINE = textwrap.dedent(
    """
    import asyncio, json, os, sys
    import numpy as np
    import torch  # loaded: HICACHED_GATHER names torch
    from hicached.client import AsyncClient

    async def main():
        size = 16384
        async with AsyncClient(sys.argv[1], timeout=10.0, name="async-engine") as c:
            ns = await c.register(model="t/async", kv_dtype="bfloat16", layout="layer_first",
                                  page_tokens=16, page_bytes=size)
            tokens = np.arange(0, 4 * 16, dtype=np.uint32)
            data = np.random.default_rng(3).integers(0, 256, (4, size), dtype=np.uint8)
            res = await c.reserve(ns, tokens)
            c.write_pages(res.select([2, 0, 3, 1]), data)  # scattered: the pick
            await asyncio.gather(c.commit(res), c.stats(), c.stats())  # calls in flight
            stats = await c.stats()
            mine = [g.how + " " + g.read for g in stats.gather_clients if g.pid == os.getpid()]
            print(json.dumps({"mine": mine, "errors": stats.errors, "n": stats.requests}))

    asyncio.run(main())
    """
)


def test_an_async_client_reports_once_with_calls_in_flight(daemon: Daemon) -> None:
    pytest.importorskip("torch")
    before = probe_stats(daemon.endpoint).requests.get("gather", 0)
    environ = {k: v for k, v in os.environ.items() if k != gather.ENV}
    out = subprocess.run(
        [sys.executable, "-c", ASYNC_ENGINE, daemon.endpoint],
        capture_output=True,
        text=True,
        timeout=90,
        env={**environ, gather.ENV: "torch"},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["mine"] == ["forced torch"] and not got["errors"]
    assert got["n"]["gather"] - before == 1
    assert probe_stats(daemon.endpoint).gather_clients == []  # closed: forgotten


class Raw:
    """A DEALER that speaks the protocol by hand: reports a client library never sends."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(endpoint)
        self.ids = 0

    def send(self, payload: dict[str, Any]) -> p.AnyReply:
        self.ids += 1
        self.sock.send(msgspec.msgpack.encode({"id": self.ids, **payload}))
        reply = p.reply_decoder.decode(self.sock.recv())
        assert reply.id == self.ids
        return reply

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


GOOD = {
    "op": "gather",
    "how": "measured",
    "read": "torch",
    "write": "numpy",
    "read_numpy_gbps": 6.5,
    "read_torch_gbps": 14.0,
    "write_numpy_gbps": 9.0,
    "write_torch_gbps": 2.0,
    "page_bytes": 65536,
    "sample_pages": 32,
    "rounds": 5,
    "seconds": 0.05,
}
BAD = [
    ({"read_torch_gbps": 1e9}, "read_torch_gbps"),
    ({"write_numpy_gbps": float("nan")}, "write_numpy_gbps"),
    ({"read_numpy_gbps": float("inf")}, "read_numpy_gbps"),
    ({"write_torch_gbps": -1.0}, "write_torch_gbps"),
    ({"read": "cuda"}, "read kernel 'cuda' is none of numpy, torch"),
    ({"write": "x" * 100_000}, "$.write"),
    ({"how": "guessed"}, "how 'guessed' is none of measured, forced, no_torch"),
    ({"how": "no_torch"}, "without torch both ways are numpy's"),
    ({"how": "forced"}, "HICACHED_GATHER"),
    ({"page_bytes": 1 << 40}, "page_bytes"),
    ({"rounds": -1}, "rounds"),
    ({"seconds": 1e12}, "seconds"),
    ({"extra": 1}, "extra"),
]


def test_bad_reports_are_refused_and_the_daemon_serves_on(daemon: Daemon) -> None:
    raw = Raw(daemon.endpoint)
    try:
        refused = raw.send(GOOD)  # before a hello: no session to keep it in
        assert isinstance(refused, p.Error) and refused.code == "no_session"
        hello = raw.send({"op": "hello", "major": p.PROTOCOL_MAJOR, "minor": p.PROTOCOL_MINOR})
        assert isinstance(hello, p.HelloOk)
        for change, named in BAD:
            reply = raw.send({**GOOD, **change})
            assert isinstance(reply, p.Error), change
            assert reply.code == "bad_request" and named in reply.message, reply.message
            assert len(reply.message) < 300  # a long name is not echoed back
        stats = probe_stats(daemon.endpoint)
        assert stats.errors["bad_request"] == len(BAD)
        assert stats.gather_clients == []  # nothing kept of a refused report
        assert isinstance(raw.send(GOOD), p.Ok)
        (got,) = probe_stats(daemon.endpoint).gather_clients
        assert got.session == hello.session
        kept = msgspec.structs.asdict(got)
        assert all(kept[field] == value for field, value in GOOD.items() if field != "op")
        # a second report replaces the first: one record a session
        assert isinstance(raw.send({**GOOD, "read": "numpy", "read_torch_gbps": 3.0}), p.Ok)
        (got,) = probe_stats(daemon.endpoint).gather_clients
        assert (got.read, got.read_torch_gbps) == ("numpy", 3.0)
        assert isinstance(raw.send({"op": "goodbye"}), p.Ok)
        assert probe_stats(daemon.endpoint).gather_clients == []
    finally:
        raw.close()


def test_a_client_of_1_4_never_reports_and_is_served_as_before(daemon: Daemon) -> None:
    raw = Raw(daemon.endpoint)
    try:
        hello = raw.send({"op": "hello", "major": p.PROTOCOL_MAJOR, "minor": 4, "client": "old"})
        assert isinstance(hello, p.HelloOk) and hello.minor == p.PROTOCOL_MINOR
        ok = raw.send({"op": "register", "spec": NS})
        assert isinstance(ok, p.NamespaceOk)
        tokens = bytes(range(16 * 4 * 2))  # 2 pages of uint32 tokens
        res = raw.send({"op": "reserve", "ns": ok.ns, "tokens": tokens})
        assert isinstance(res, p.ReserveOk) and len(res.offsets) == 2
        assert isinstance(raw.send({"op": "commit", "lease": res.lease}), p.CommitOk)
        hit = raw.send({"op": "match", "ns": ok.ns, "tokens": tokens, "lease": False})
        assert isinstance(hit, p.MatchOk) and hit.hits == 2
        stats = raw.send({"op": "stats"})
        assert isinstance(stats, p.StatsOk)
        assert stats.stats.clients == 1 and stats.stats.gather_clients == []
        assert not stats.stats.errors
    finally:
        raw.close()
    out = hicached("status", "--endpoint", daemon.endpoint)
    assert "gather:     none reported" in out


@pytest.mark.parametrize(
    ("minor", "refusal"),
    [(p.GATHER_MINOR - 1, False), (p.GATHER_MINOR, True)],
    ids=["daemon-1.4", "daemon-1.5-that-refuses"],
)
def test_a_daemon_without_the_report_costs_a_client_nothing(
    daemon_factory: Callable[..., Daemon],
    engines: list[Engine],
    monkeypatch: pytest.MonkeyPatch,
    minor: int,
    refusal: bool,
) -> None:
    """A daemon older than 1.5 is sent no report; one that says 1.5 and refuses
    it anyway (tests/old_daemon.py: the current daemon with the report taken out
    of its decoder, for the client's refusal path) costs a debug line. Either
    way every copy and call of the client goes through."""
    pytest.importorskip("torch")
    monkeypatch.setenv("HICACHED_TEST_DAEMON_MINOR", str(minor))
    d = daemon_factory(size_mib=8, populate=False, module="tests.old_daemon")
    before = probe_stats(d.endpoint).errors.get("bad_request", 0)  # the harness's own, if any
    engine = Engine(d.endpoint, "torch", 0, {gather.ENV: "torch"})
    engines.append(engine)
    assert engine.out["ok"] and engine.out["mine"] == []
    assert engine.out["choice"]["read"]["pick"] == "torch"
    err = engine.finish()
    stats = probe_stats(d.endpoint)
    assert stats.gather_clients == []
    assert stats.errors.keys() <= {"bad_request"}
    if refusal:
        assert stats.errors["bad_request"] - before == 1
        assert "refused the gather report" in err and "malformed request" in err
    else:
        assert not stats.errors and "gather" not in err
        assert "gather" not in stats.requests  # never sent
    # the status tells a daemon that keeps no reports from one that heard none
    out = hicached("status", "--endpoint", d.endpoint)
    if refusal:
        assert "gather:     none reported" in out
    else:
        assert f"gather:     not kept by this daemon (protocol 1.{minor};" in out


def test_status_prints_a_client_name_with_control_characters_escaped(daemon: Daemon) -> None:
    """The name a client gives in its hello is its own to choose: one with a
    newline or a terminal escape must not add lines to, or rewrite, what
    ``hicached status`` prints for an operator (a fake 'l3: up' line, a
    cleared screen)."""
    raw = Raw(daemon.endpoint)
    try:
        name = "eng\nl3:         up (fake)\x1b[2J\r"
        hello = raw.send(
            {"op": "hello", "major": p.PROTOCOL_MAJOR, "minor": p.PROTOCOL_MINOR, "client": name}
        )
        assert isinstance(hello, p.HelloOk)
        assert isinstance(raw.send(GOOD), p.Ok)
        text = hicached("status", "--endpoint", daemon.endpoint)
        assert "\x1b" not in text and "\r" not in text
        assert not any(line.startswith("l3:         up (fake)") for line in text.splitlines())
        (line,) = [x for x in text.splitlines() if f"#{hello.session} " in x]
        assert "eng\\nl3:" in line and "\\x1b[2J\\r" in line, line  # shown, escaped
        # --json keeps the name as given (JSON escapes it)
        js = json.loads(hicached("status", "--json", "--endpoint", daemon.endpoint))
        assert [g["client"] for g in js["gather_clients"]] == [name]
    finally:
        raw.close()
