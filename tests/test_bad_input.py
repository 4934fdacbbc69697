"""Bad input gets an error reply or is dropped and counted; the daemon keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from hicached import Client
from hicached import protocol as p
from hicached.cache import Cache
from hicached.config import Config, PoolConfig
from hicached.daemon.requests import SKIP_BATCH, RequestLoop
from hicached.errors import BadRequest, ForeignLease, InvalidNamespace, TooLarge, UnknownLease
from hicached.server import peek_request
from hicached.wire.namespace import MAX_KEY_BYTES
from tests.support import NS, PAGE_BYTES, PAGE_TOKENS, Daemon, page_bytes_for


class Raw:
    """A bare DEALER that sends whatever it is given."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def call(self, message: object) -> p.AnyReply:
        self.send(msgspec.msgpack.encode(message))
        reply = self.recv(2000)
        assert reply is not None, "no reply"
        return reply

    def recv(self, timeout_ms: int) -> p.AnyReply | None:
        if not self.sock.poll(timeout_ms):
            return None
        return p.reply_decoder.decode(self.sock.recv())

    def hello(self) -> None:
        reply = self.call(p.Hello(id=1, major=p.PROTOCOL_MAJOR, minor=0))
        assert isinstance(reply, p.HelloOk)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def small_daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(extra="max_message_bytes = 65536\n")


@pytest.fixture
def raw(small_daemon: Daemon) -> Iterator[Raw]:
    r = Raw(small_daemon.endpoint)
    yield r
    r.close()


def still_serving(d: Daemon) -> p.DaemonStats:
    with d.client() as c:
        ns = c.register(**NS)
        toks = np.arange(0, 2 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
        assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))
        return c.stats()


def test_random_bytes_are_dropped_and_counted(small_daemon: Daemon, raw: Raw) -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        raw.send(rng.integers(0, 256, int(rng.integers(1, 2000)), dtype=np.uint8).tobytes())
    raw.send(b"\x93\x01\x02\x03")  # valid msgpack, not a request map
    assert raw.recv(300) is None
    stats = still_serving(small_daemon)
    assert stats.dropped.get("malformed", 0) >= 45  # a few random blobs decode to maps


def test_wrong_frame_count_is_dropped_and_counted(small_daemon: Daemon, raw: Raw) -> None:
    raw.send(b"a", b"b")
    raw.send(b"a", b"b", b"c")
    raw.send(*[b""] * 100_000)  # frames the daemon reads and lets go of, keeping none
    assert raw.recv(300) is None
    assert still_serving(small_daemon).dropped["bad_frames"] == 3


def test_a_message_of_many_frames_is_read_over_several_turns(tmp_path: Path) -> None:
    """The frames of a message that is not a request are let go of
    ``SKIP_BATCH`` a turn, with the event loop free between turns; the request
    behind them is then answered."""
    config = Config(pool=PoolConfig(size_mib=2, slab_mib=1, max_page_bytes=PAGE_BYTES))
    cache = Cache(config, pool_path="/nonexistent")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    # inproc: a message is in the router's pipe once send returns (over ipc the
    # I/O thread may bring the request only after the turns ended; without the
    # reader, which the daemon's loop has, nothing would read it)
    endpoint = f"inproc://{tmp_path}"
    router.bind(endpoint)
    dealer.connect(endpoint)
    frames = 3 * SKIP_BATCH + 5

    async def run() -> int:
        loop = RequestLoop(router, cache, config.server, tenants=False, metrics=None, tier=None)
        dealer.send_multipart([b""] * frames)
        dealer.send(p.encode(p.Hello(id=9, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR)))
        assert router.poll(5000) and router.poll(5000)  # both messages are in
        loop._drain()  # one turn: the message's first SKIP_BATCH frames past its two
        assert loop._skipping and cache.dropped["bad_frames"] == 1
        turns = 0
        while not dealer.poll(0):
            assert turns < 100, "the request behind the frames was not answered"
            await asyncio.sleep(0)
            turns += 1
        reply = p.reply_decoder.decode(dealer.recv())
        assert isinstance(reply, p.HelloOk) and reply.id == 9
        return turns

    try:
        assert asyncio.run(run()) >= 3  # three more turns read the rest, then the hello
        assert cache.dropped["bad_frames"] == 1
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_wrong_major_version_is_refused(small_daemon: Daemon, raw: Raw) -> None:
    reply = raw.call(p.Hello(id=3, major=p.PROTOCOL_MAJOR + 1, minor=0))
    assert isinstance(reply, p.Error) and reply.id == 3 and reply.code == "version_mismatch"
    assert "protocol 2.0" in reply.message
    assert still_serving(small_daemon).errors["version_mismatch"] == 1


def test_unknown_op_and_bad_fields_get_error_replies(small_daemon: Daemon, raw: Raw) -> None:
    reply = raw.call({"op": "frobnicate", "id": 5})
    assert isinstance(reply, p.Error) and reply.id == 5 and reply.code == "bad_request"
    assert "frobnicate" in reply.message
    reply = raw.call({"op": "match", "id": 6, "ns": "one", "tokens": b""})
    assert isinstance(reply, p.Error) and reply.id == 6 and "$.ns" in reply.message
    reply = raw.call({"op": "stats", "id": 7, "extra": 1})
    assert isinstance(reply, p.Error) and reply.id == 7 and "extra" in reply.message
    still_serving(small_daemon)


def test_requests_before_hello_are_told_to_hello(small_daemon: Daemon, raw: Raw) -> None:
    reply = raw.call(p.Renew(id=9, lease=1))
    assert isinstance(reply, p.Error) and reply.code == "no_session" and reply.retriable
    probe = raw.call(p.Stats(id=10))  # stats alone needs no session
    assert isinstance(probe, p.StatsOk) and probe.id == 10


def test_oversized_messages(small_daemon: Daemon, raw: Raw) -> None:
    raw.hello()
    big = raw.call({"op": "stats", "id": 11, "pad": b"x" * 100_000})
    assert isinstance(big, p.Error) and big.id == 11 and big.code == "too_large"
    # beyond the hard guard (16x) the peer is dropped by the transport
    raw.send(b"y" * (16 * 65536 + 10))
    assert raw.recv(300) is None
    stats = still_serving(small_daemon)
    assert stats.errors["too_large"] == 1


def test_the_client_refuses_a_request_over_the_limit_and_keeps_its_session(
    small_daemon: Daemon,
) -> None:
    """A request the daemon would refuse (or, far past the limit, drop with the
    connection, and with it the client's session and its leases) is refused by
    the client at once; its open reservation still commits."""
    with small_daemon.client(timeout=2.0) as c:
        ns = c.register(**NS)
        toks = np.arange(0, 2 * PAGE_TOKENS, dtype=np.uint32)
        res = c.reserve(ns, toks)
        huge = np.arange(0, 40 * 65536 // 4, dtype=np.uint32)  # 40x max_message_bytes
        started = time.monotonic()
        with pytest.raises(TooLarge, match="max_message_bytes"):
            c.match(ns, huge)
        assert time.monotonic() - started < 1.5  # refused here, not after the timeout (2 s)
        c.write_pages(res, page_bytes_for(toks))
        assert c.commit(res).published == 2
    with pytest.raises(BadRequest, match="positive number of seconds"):
        Client(small_daemon.endpoint, timeout=float("nan"))


def test_too_many_pages_and_bad_tokens(small_daemon: Daemon, raw: Raw) -> None:
    raw.hello()
    reply = raw.call(p.RegisterNamespace(id=2, spec=msgspec.convert(NS, p.NamespaceSpec)))
    assert isinstance(reply, p.NamespaceOk)
    odd = raw.call(p.Match(id=3, ns=reply.ns, tokens=b"abc"))
    assert isinstance(odd, p.Error) and odd.code == "bad_request"
    unsafe = raw.call(p.RegisterNamespace(id=4, spec=p.NamespaceSpec(**{**NS, "tenant": "../x"})))
    assert isinstance(unsafe, p.Error) and unsafe.code == "invalid_namespace"
    # a refused name is quoted in part: the reply is not as long as the request
    for field in ("model", "kv_dtype", "key_scheme"):
        spec = p.NamespaceSpec(**{**NS, field: "x/y/" + "A" * 20_000})
        long = raw.call(p.RegisterNamespace(id=5, spec=spec))
        assert isinstance(long, p.Error) and long.code == "invalid_namespace"
        assert len(long.message) < 400 and "AAA'..." in long.message, long.message


def test_unknown_namespace(small_daemon: Daemon, raw: Raw) -> None:
    raw.hello()
    reply = raw.call(p.Reserve(id=4, ns=999, tokens=b"\0" * 64))
    assert isinstance(reply, p.Error) and reply.code == "unknown_namespace"
    still_serving(small_daemon)


def test_double_commit_and_foreign_release(small_daemon: Daemon) -> None:
    with small_daemon.client() as a, small_daemon.client() as b:
        ns_a, ns_b = a.register(**NS), b.register(**NS)
        toks = np.arange(0, 2 * PAGE_TOKENS, dtype=np.uint32)
        res = a.reserve(ns_a, toks)
        a.write_pages(res, page_bytes_for(toks))
        # B cannot end A's lease, not even by guessing its id
        with pytest.raises(ForeignLease):
            b.abort(res)
        assert a.commit(res).published == 2
        with pytest.raises(UnknownLease):
            a.commit(res)
        hit = a.match(ns_a, toks)
        with pytest.raises(ForeignLease):
            b.release(hit)
        a.release(hit)
        with pytest.raises(UnknownLease):
            a.release(hit)
        assert np.array_equal(b.load(ns_b, toks), page_bytes_for(toks))
        stats = a.stats()
        assert stats.errors == {"foreign_lease": 2, "unknown_lease": 2}
        assert stats.leases == 0 and stats.pinned_pages == 0


def test_progress_of_a_lease_that_is_no_prefetch_says_what_it_is(
    small_daemon: Daemon, raw: Raw
) -> None:
    """``progress`` of an open reservation or read lease is told what the lease
    is, not that it is "not open": the client may still commit or release it.
    Another client's lease is foreign, as for commit and release."""
    raw.hello()
    ns = raw.call(p.RegisterNamespace(id=2, spec=p.NamespaceSpec(**NS)))  # type: ignore[arg-type]
    assert isinstance(ns, p.NamespaceOk)
    tokens = np.arange(1000, 1000 + 2 * PAGE_TOKENS, dtype=np.uint32).tobytes()
    res = raw.call(p.Reserve(id=3, ns=ns.ns, tokens=tokens))
    assert isinstance(res, p.ReserveOk) and res.lease
    said = raw.call(p.Progress(id=4, lease=res.lease))
    assert isinstance(said, p.Error) and said.code == "bad_request"
    assert "is a reservation, not a prefetch" in said.message
    other = Raw(small_daemon.endpoint)
    try:
        other.hello()
        foreign = other.call(p.Progress(id=5, lease=res.lease))
        assert isinstance(foreign, p.Error) and foreign.code == "foreign_lease"
    finally:
        other.close()
    assert isinstance(raw.call(p.Commit(id=6, lease=res.lease)), p.CommitOk)  # still open
    hit = raw.call(p.Match(id=7, ns=ns.ns, tokens=tokens))
    assert isinstance(hit, p.MatchOk) and hit.lease
    said = raw.call(p.Progress(id=8, lease=hit.lease))
    assert isinstance(said, p.Error) and "is a read lease, not a prefetch" in said.message
    assert isinstance(raw.call(p.Release(id=9, lease=hit.lease)), p.Ok)
    gone = raw.call(p.Progress(id=10, lease=hit.lease))
    assert isinstance(gone, p.Error) and gone.code == "unknown_lease"
    still_serving(small_daemon)


def test_commit_of_a_read_lease_and_overlong_commit(small_daemon: Daemon) -> None:
    with small_daemon.client() as c:
        ns = c.register(**NS)
        toks = np.arange(0, 2 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks))
        hit = c.match(ns, toks)
        from hicached import Reservation

        with pytest.raises(Exception, match="read lease"):
            c.commit(Reservation(ns, hit.lease, 0, [], False, hit.instance))
        c.release(hit)
        res = c.reserve(ns, np.arange(100, 100 + 2 * PAGE_TOKENS, dtype=np.uint32))
        with pytest.raises(Exception, match="reserved 2"):
            c.commit(res, pages=3)
        assert c.stats().reserved_pages == 0  # the lease was aborted, its slots freed


def test_a_negative_page_count_other_than_minus_one_is_refused(small_daemon: Daemon) -> None:
    """-1 is "all" for a commit's pages and a prefetch's max_pages; another negative
    count (a caller's arithmetic gone below zero, such as an agreed length less the
    L2 hits) is refused, not read as "all": that would publish pages the ranks did
    not agree on. The lease stays open, and nothing is published."""
    with small_daemon.client() as c:
        ns = c.register(**NS)
        keyed = c.register(**{**NS, "key_scheme": "sglang"})
        toks = np.arange(500, 500 + 3 * PAGE_TOKENS, dtype=np.uint32)
        res = c.reserve(ns, toks)
        c.write_pages(res, page_bytes_for(toks))
        reply = c._roundtrip(p.Commit(id=0, lease=res.lease, pages=-2))
        assert isinstance(reply, p.Error) and reply.code == "bad_request", reply
        assert "-2" in reply.message
        keys = [bytes([i]) * 32 for i in range(1, 4)]
        kres = c.reserve_keys(keyed, keys)
        reply = c._roundtrip(p.Commit(id=0, lease=kres.lease, pages=-5))
        assert isinstance(reply, p.Error) and reply.code == "bad_request", reply
        stats = c.stats()
        assert stats.pages == 0 and stats.leases == 2  # nothing published, both still open
        for request in (
            p.Prefetch(id=0, ns=ns.id, tokens=toks.tobytes(), max_pages=-3),
            p.PrefetchKeys(id=0, ns=keyed.id, keys=keys, max_pages=-3),
        ):
            reply = c._roundtrip(request)
            assert isinstance(reply, p.Error) and reply.code == "bad_request", reply
        assert c.commit(res).published == 3  # -1, the client's "all", still is
        c.release(kres)
        # keys twice in one prefetch: refused without L3 and with every page in L2
        twice = [keys[0], keys[1], keys[0]]
        reply = c._roundtrip(p.PrefetchKeys(id=0, ns=keyed.id, keys=twice, max_pages=-1))
        assert isinstance(reply, p.Error) and reply.code == "bad_request", reply
        assert "must differ" in reply.message
        # a parent that is one of the keys, or longer than a key may be
        for parent in (keys[1], bytes(MAX_KEY_BYTES + 1)):
            reply = c._roundtrip(p.PrefetchKeys(id=0, ns=keyed.id, keys=keys, parent=parent))
            assert isinstance(reply, p.Error) and reply.code == "bad_request", reply
            assert "parent" in reply.message
    still_serving(small_daemon)


def test_garbage_over_tcp_does_not_hurt(daemon_factory: Callable[..., Daemon]) -> None:
    import socket

    d = daemon_factory(tcp=True)
    host, port = d.endpoint[len("tcp://") :].rsplit(":", 1)
    for _ in range(20):
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(os.urandom(4096))
    still_serving(d)


# Arrays nested deeper than any Python lets the decoder go (up to 3.11 it
# stops at the interpreter's recursion limit, 1,000; later ones at the C
# limit, 10,000 on 3.13), and still within small_daemon's 64 KiB messages.
TOO_DEEP = 20_000


def deep(request_id: int, depth: int = TOO_DEEP) -> bytes:
    """{"op": "stats", "id": request_id, "x": [[[...]]]}: ``depth`` nested arrays."""
    head = b"\x83\xa2op\xa5stats\xa2id" + msgspec.msgpack.encode(request_id) + b"\xa1x"
    return head + b"\x91" * depth + b"\xc0"


def test_deeply_nested_frame_does_not_hold_up_other_clients(small_daemon: Daemon) -> None:
    a, b = Raw(small_daemon.endpoint), Raw(small_daemon.endpoint)
    try:
        a.hello()
        b.hello()
        assert small_daemon.proc is not None
        for round_ in range(3):
            # Paused, the daemon finds both messages queued when it wakes up:
            # the nested one first, then another client's request.
            small_daemon.proc.send_signal(signal.SIGSTOP)
            try:
                a.send(deep(100 + round_))
                time.sleep(0.05)
                b.send(msgspec.msgpack.encode(p.Stats(id=200 + round_)))
                time.sleep(0.2)
            finally:
                small_daemon.proc.send_signal(signal.SIGCONT)
            reply = b.recv(2000)
            assert isinstance(reply, p.StatsOk) and reply.id == 200 + round_
            # its id is at the head of the map: the nested frame is answered too
            error = a.recv(2000)
            assert isinstance(error, p.Error) and error.id == 100 + round_
            assert error.code == "bad_request"
        # nested deeper still, beyond the size limit, and with no id before the nesting
        a.send(deep(7, depth=100_000))
        assert isinstance(reply := a.recv(2000), p.Error) and reply.code == "too_large"
        a.send(b"\x82\xa1x" + b"\x91" * TOO_DEEP + b"\xc0" + b"\xa2id\x08")
        a.send(b"\x82\xa2id\x09\xa1x" + b"\x91" * TOO_DEEP + b"\xc0")  # no op
        assert isinstance(reply := a.recv(2000), p.Error) and reply.id == 9
        assert reply.code == "bad_request" and "nested" in reply.message
        stats = still_serving(small_daemon)
        assert stats.dropped["malformed"] == 1 and stats.errors["bad_request"] == 4
        assert "internal" not in stats.errors
    finally:
        a.close()
        b.close()


def test_peek_request_reads_the_head_of_a_map_only() -> None:
    assert peek_request(p.encode(p.Stats(id=5))) == ("stats", 5)
    assert peek_request(p.encode(p.Release(id=2**40, lease=3))) == ("release", 2**40)
    assert peek_request(msgspec.msgpack.encode({"id": -3, "op": "match"})) == ("match", -3)
    assert peek_request(deep(12)) == ("stats", 12)
    assert peek_request(msgspec.msgpack.encode({"x": [1], "id": 4})) == ("", None)
    assert peek_request(msgspec.msgpack.encode({"pad": b"y" * 300, "id": 4})) == ("", 4)
    assert peek_request(msgspec.msgpack.encode({"id": "4"})) == ("", None)
    whole = msgspec.msgpack.encode({"op": "stats", "id": 70000})
    for cut in range(len(whole)):
        assert peek_request(whole[:cut])[1] is None
    assert peek_request(b"") == peek_request(b"\x93\x01\x02\x03") == ("", None)


def test_a_page_size_that_would_list_millions_of_slots_is_refused(daemon: Daemon) -> None:
    """A slab's slots are listed when it is carved: pages so small that a slab
    holds more than 65,536 of them are refused, not listed (1-byte pages in a
    64 MiB slab would take gigabytes of the daemon's memory)."""
    with daemon.client() as c:
        with pytest.raises(InvalidNamespace, match="too small for slabs of 1 MiB: at least 16"):
            c.register(**{**NS, "page_bytes": 8})
        ns = c.register(**{**NS, "page_bytes": 16, "model": "test/small"})
        toks = np.arange(0, 2 * PAGE_TOKENS, dtype=np.uint32)
        c.store(ns, toks, page_bytes_for(toks, page_bytes=16))
        assert c.match(ns, toks, lease=False).hits == 2


def _unseeded_routing_id_starts(sockets: int) -> list[int]:
    """Where libzmq starts the routing id counters of a process's first
    ``sockets`` ROUTER sockets when nothing seeded the C library's ``rand()``:
    one ``rand() | (rand() & 1) << 31`` each (libzmq's generate_random)."""
    script = (
        "import ctypes; libc = ctypes.CDLL(None); libc.srand(1); "
        f"print(*[libc.rand() for _ in range({2 * sockets})])"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True, text=True)
    draws = [int(x) for x in out.stdout.split()]
    return [(draws[2 * i] | (draws[2 * i + 1] & 1) << 31) & 0xFFFFFFFF for i in range(sockets)]


def test_routing_ids_a_peer_sets_never_make_the_daemon_abort(small_daemon: Daemon) -> None:
    """A peer connects with the routing ids libzmq would give the next clients
    (a zero byte and a counter) set by hand; libzmq aborts the process when it
    makes an id a peer holds. The daemon's counters start where no peer can
    foresee, so a client that connects after them is served."""
    assert small_daemon.proc is not None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    held = []
    try:
        for start in _unseeded_routing_id_starts(4):
            for step in range(16):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                rid = b"\x00" + struct.pack(">I", (start + step) & 0xFFFFFFFF)
                sock.setsockopt(zmq.ROUTING_ID, rid)
                sock.connect(small_daemon.endpoint)
                sock.send(p.encode(p.Stats(id=1)))  # its connection is made and named
                held.append(sock)
        for sock in held:
            assert sock.poll(5000), "no reply to a peer that set its routing id"
            assert isinstance(p.reply_decoder.decode(sock.recv()), p.StatsOk)
        for _ in range(4):  # clients that take the ids libzmq makes
            with small_daemon.client() as c:
                c.stats()
        assert small_daemon.proc.poll() is None, "the daemon aborted"
        still_serving(small_daemon)
    finally:
        for sock in held:
            sock.close()
        ctx.term()
