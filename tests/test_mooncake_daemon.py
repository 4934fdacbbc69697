"""The Mooncake backend through real daemons and a real Mooncake master."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import numpy as np

from hicached.testing import free_tcp_port
from tests.l3util import (
    down_and_l2_serves,
    evict_everything,
    l3_count,
    read_back,
    refused_start,
    storage,
    wait_for,
    wait_prefetch,
    written_and_read_back,
)
from tests.services import MooncakeMaster
from tests.support import NS, PAGE_TOKENS, Daemon, page_bytes_for


def seq(start: int, pages: int) -> np.ndarray:
    return np.arange(start, start + pages * PAGE_TOKENS, dtype=np.uint32)


def master_at(ports: tuple[int, int]) -> str:
    """[storage.mooncake] of a master at ``ports`` (rpc, http metadata) on
    loopback, whether one runs there or not."""
    return (
        f'[storage.mooncake]\nmaster = "127.0.0.1:{ports[0]}"\n'
        f'metadata_server = "http://127.0.0.1:{ports[1]}/metadata"\n'
        "global_segment_mib = 64\nlocal_buffer_mib = 16\n"
    )


def test_two_hosts_share_pages_through_one_master(
    daemon_factory: Callable[..., Daemon], mooncake: MooncakeMaster
) -> None:
    a = daemon_factory(size_mib=1, slab_mib=1, storage=storage("mooncake"), tail=mooncake.toml())
    b = daemon_factory(size_mib=1, slab_mib=1, storage=storage("mooncake"), tail=mooncake.toml())
    toks = seq(0, 24)
    with a.client() as ca, b.client() as cb:
        ns_a = ca.register(**NS)
        ca.store(ns_a, toks, page_bytes_for(toks))
        wait_for(lambda: l3_count(ca, "written") == 24)
        # the same host reads it back after L2 forgot it
        evict_everything(ca, ns_a)
        pf = ca.prefetch(ns_a, toks)
        assert wait_prefetch(ca, pf).completed == 24
        ca.commit(pf)
        assert np.array_equal(ca.load(ns_a, toks), page_bytes_for(toks))
        # another host finds it through the master and reads it into its own pool
        ns_b = cb.register(**NS)
        pf = cb.prefetch(ns_b, toks)
        done = wait_prefetch(cb, pf)
        assert (done.completed, done.failed) == (24, False)
        assert cb.commit(pf).published == 24
        assert np.array_equal(cb.load(ns_b, toks), page_bytes_for(toks))
        assert cb.stats().l3_backend == "mooncake"


def test_a_dead_master_keeps_the_backend_down(daemon_factory: Callable[..., Daemon]) -> None:
    """With the master gone, writes fail and the breaker opens; its health probe
    must fail too (the client's own check passes without a master), so L3 stays
    down instead of flapping up between failures. L2 keeps serving."""
    master = MooncakeMaster()
    try:
        d = daemon_factory(
            size_mib=1,
            slab_mib=1,
            storage=storage(
                "mooncake", more="breaker_failures = 1\nbreaker_cooldown_s = 0.3\nretries = 0\n"
            ),
            tail=master.toml(),
        )
        with d.client(timeout=10.0) as c:
            ns = c.register(**NS)
            toks = seq(0, 4)
            c.store(ns, toks, page_bytes_for(toks))
            wait_for(lambda: l3_count(c, "written") == 4)
            master.stop()
            more = seq(10**6, 4)
            c.store(ns, more, page_bytes_for(more))
            wait_for(lambda: c.stats().l3_state == "down", timeout=30)
            states = set()
            for k in range(8):  # several cooldowns; each write after one runs a probe
                page = seq(2 * 10**6 + k * 1000, 1)
                c.store(ns, page, page_bytes_for(page))
                time.sleep(0.5)
                states.add(c.stats().l3_state)
            assert "up" not in states, states
            assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))
    finally:
        master.stop()


def test_a_master_that_comes_up_after_the_daemon_is_used_once_it_answers(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A master not yet up at the daemon's start: the start does not wait on
    Mooncake's own retries (some 90 s, holding the GIL, deaf to SIGTERM), the
    daemon serves from L2 with L3 down, and its probe sets the store up once a
    master answers; pages are then written there and read back."""
    ports = (free_tcp_port(), free_tcp_port())
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        storage=storage("mooncake", more="breaker_cooldown_s = 0.3\n"),
        tail=master_at(ports),
    )
    master = None
    try:
        with d.client(timeout=10.0) as c:
            ns = down_and_l2_serves(d, c)
            master = MooncakeMaster(ports=ports)
            wait_for(lambda: c.stats().l3_state == "up", timeout=30)
            written_and_read_back(c, ns)
    finally:
        if master is not None:
            master.stop()


def test_a_master_that_accepts_but_never_answers_holds_nothing_of_the_daemon(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Something listens on the master's and the metadata server's ports but
    never answers (a hung master, another service): Mooncake's setup would
    hold the interpreter's lock for minutes, so it is first tried in a process
    of its own. The daemon starts, serves from L2 with L3 down while probes
    try again, and stops at once on SIGTERM."""
    listeners = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        listeners.append(s)
    rpc, http = (s.getsockname()[1] for s in listeners)
    try:
        d = daemon_factory(
            size_mib=1,
            slab_mib=1,
            storage=storage("mooncake", more="breaker_cooldown_s = 0.3\n"),
            tail=master_at((rpc, http)),
        )
        with d.client(timeout=5.0) as c:
            ns = c.register(**NS)
            toks = seq(0, 4)
            c.store(ns, toks, page_bytes_for(toks))
            until = time.monotonic() + 20  # past a trial's 15 s: one is given up on
            while time.monotonic() < until:
                assert c.stats().l3_state == "down"  # each answered within its 5 s
                assert np.array_equal(c.load(ns, toks), page_bytes_for(toks))
                # asks the store nothing while a probe runs (it waited for the
                # trial's end, up to 15 s); one probe at a time
                pf = c.prefetch(ns, seq(10**6, 2))
                assert wait_prefetch(c, pf, timeout=5.0).failed
                time.sleep(0.5)
        assert "did not end within" in d.log.read_text()
        assert d.stop(timeout=20) == 0
    finally:
        for s in listeners:
            s.close()


def test_pages_adopted_while_the_master_is_down_are_written_once_it_answers(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Pages committed while the master was down stay in L2 only; the restart
    that adopts them finds the master down too, and writes them once its probe
    finds a master: none is queued into a store still down and lost to L3."""
    ports = (free_tcp_port(), free_tcp_port())
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        fresh=False,
        storage=storage("mooncake", more="breaker_cooldown_s = 0.3\n"),
        tail=master_at(ports),
    )
    toks = seq(0, 8)
    with d.client() as c:
        c.store(c.register(**NS), toks, page_bytes_for(toks))
    assert d.stop() == 0
    d.start()
    master = None
    try:
        with d.client(timeout=10.0) as c:
            ns = c.register(**NS)
            assert c.stats().l3_state == "down"
            assert c.match(ns, toks, lease=False).hits == 8  # adopted
            time.sleep(1.0)  # probes fail meanwhile; the adopted pages wait
            master = MooncakeMaster(ports=ports)
            wait_for(lambda: l3_count(c, "written") == 8, timeout=30)
            read_back(c, ns, toks)
    finally:
        if master is not None:
            master.stop()


def test_a_setup_the_host_cannot_give_is_refused_once(
    daemon_factory: Callable[..., Daemon], mooncake: MooncakeMaster
) -> None:
    """A segment larger than the host can give: the trial (no memory of its
    own) passes and the daemon's own setup fails. At the start that is exit 2,
    saying so; with the master up only later, L3 stays down, and the setup is
    not tried again at every probe (each try left Mooncake's threads, memory
    and descriptors in the daemon)."""
    huge = "global_segment_mib = 100000000\n"
    d = Daemon(
        size_mib=1,
        slab_mib=1,
        storage=storage("mooncake"),
        tail=mooncake.toml().replace("global_segment_mib = 64\n", huge),
    )
    refused_start(d, "cannot be given on this host")
    ports = (free_tcp_port(), free_tcp_port())
    d = daemon_factory(
        size_mib=1,
        slab_mib=1,
        storage=storage("mooncake", more="breaker_cooldown_s = 0.3\n"),
        tail=master_at(ports).replace("global_segment_mib = 64\n", huge),
    )
    assert d.proc is not None
    master = MooncakeMaster(ports=ports)
    try:
        with d.client(timeout=10.0) as c:
            wait_for(lambda: "stays down until the daemon restarts" in d.log.read_text(), 30)
            threads = len(os.listdir(f"/proc/{d.proc.pid}/task"))
            time.sleep(3.0)  # some 10 probes
            assert c.stats().l3_state == "down"
            assert len(os.listdir(f"/proc/{d.proc.pid}/task")) < threads + 5
    finally:
        master.stop()
