"""The daemon process: serve -> startup -> main loop -> shutdown.

One asyncio loop (uvloop when installed) owns the Cache. The ROUTER socket
is read by a drain loop: the loop wakes on the socket's file descriptor and
receives without blocking until the socket is empty, a bounded batch at a
time. Every request gets a reply or is counted as dropped: a fault while
serving one (a bug) becomes an ``internal`` error reply and the drain goes
on with the next message. KV events go out through a ``Publisher``
(wire/events.py). Signals only set a flag; a second signal exits at once.

Access control (private directories, the clients' group, CURVE, the ZAP
handler) is daemon/access.py's; the head reader that names a request it cannot
decode, wire/peek.py's. Tenants: with ``[tenants]`` configured, a connection's
tenant comes from who it is (daemon/tenants.py), never from what it says; the
cache checks each request against it. SIGHUP reads the config file again and
applies what may change at run time (daemon/reload.py); everything else keeps
its running value, logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
import zmq.auth

from hicached.cache import OP_NAMES, Cache, L3Lookup
from hicached.config import (
    Config,
    config_source,
    endpoint,
    load_config,
    runtime_dir,
)
from hicached.daemon.access import Access, ensure_private_dir
from hicached.daemon.metrics import Metrics
from hicached.daemon.notify import StartupProgress, sd_notify, watchdog_interval
from hicached.daemon.publisher import Publisher
from hicached.daemon.reload import reload_plan
from hicached.daemon.tenants import TENANT_DOMAIN, user_id
from hicached.daemon.tier import Tier, make_backend
from hicached.errors import BadRequest, ConfigError, HicachedError, TooLarge
from hicached.wire import protocol as p
from hicached.wire.arena import Arena, arena_path
from hicached.wire.peek import peek_request

log = logging.getLogger("hicached")

TOO_DEEP = "malformed request: values nested deeper than any request has"
INTERNAL = (
    "the daemon failed on this request (a bug; the daemon's log has the details); it may "
    "have been applied in part, and a lease it opened expires after leases.ttl_s"
)

# socket flags and options as plain ints: pyzmq converts its enums on every call
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_POLLIN = int(zmq.POLLIN)


# ZAP domain of the request socket when tenants are configured: its peers get
# their tenant as User-Id. Other sockets keep the default domain and handling.
class Server:
    """One daemon instance; ``await run()`` serves until a signal or ``stop()``.

    ``config_path``: the file SIGHUP reads again (by default the one
    ``load_config`` read ``config`` from, if it did)."""

    def __init__(self, config: Config, config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path or config_source(config)
        self.endpoint = endpoint(config)
        self.runtime_dir = runtime_dir(config)
        self.cache: Cache | None = None
        self.tier: Tier | None = None
        self.arena: Arena | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self.publisher: Publisher | None = None
        self._lock_fd: int | None = None
        self.access = Access(config, self.endpoint)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._signals = 0
        self.metrics: Metrics | None = None
        self._reload_wanted = asyncio.Event()
        # the process is this daemon's own (serve): it may exit past stuck calls
        self.exit_past_stuck_calls = False
        self._resweep = asyncio.Event()  # set by a reload: the sweep takes its new interval
        self._fault_logged = -math.inf  # monotonic time of the last logged internal error
        self._faults_unlogged = 0  # internal errors since then, not logged
        self.ready = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload_wanted.set)
        try:
            await self.startup()
            self._serving()
            await self._stop.wait()
        finally:
            await self.shutdown()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        if self.exit_past_stuck_calls:  # a stop, not a failure (its error stays the exit's)
            # before the runner waits for every task: a read stuck in a storage
            # call would hold it past the stop deadline
            _exit_past_stuck_calls()

    def stop(self) -> None:
        self._stop.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second %s: exiting now", sig.name)
            os._exit(1)
        log.info("%s: shutting down", sig.name)
        self._stop.set()

    async def startup(self) -> None:
        cfg = self.config
        # STATUS and EXTEND_TIMEOUT_USEC while the pool fills and L3 is scanned
        with StartupProgress() as progress:
            populated = [0]  # MiB, as _prepare prefaults the pool
            progress.phase(
                f"populating the {cfg.pool.size_mib} MiB pool",
                lambda: populated[0],
                stall_s=None,
                unit=" MiB",
            )
            self._prepare(lambda done: populated.__setitem__(0, done >> 20))
            assert self.cache is not None and self.arena is not None
            if cfg.storage.backend:
                backend = make_backend(cfg, self.arena.array.data, str(self.arena.path))
                tier = Tier(self.cache, backend, self.arena)
                scan = cfg.storage.scan_on_start and not cfg.storage.scan_in_background
                progress.phase(
                    f"L3: opening the {cfg.storage.backend} store"
                    + (", scanning its pages" if scan else ""),
                    lambda: tier.scan_pages,
                    stall_s=2 * cfg.storage.op_timeout_s,
                    unit=" pages",
                )
                await tier.start()  # opens the store and learns what it holds
                self.cache.use_tier(tier)
                self.tier = tier
                log.info("L3: %s backend, %s", cfg.storage.backend, cfg.storage.write_policy)
            if cfg.metrics.enabled:
                metrics = Metrics(cfg.metrics, self.cache.stats)
                metrics.start()
                self.metrics = metrics
                self.cache.serve_metrics(metrics.endpoint)
                if self.tier is not None:
                    self.tier.dispatcher.on_call = metrics.observe_l3

        self._listen()

    def _prepare(self, on_populate: Callable[[int], None] | None = None) -> None:
        """Directories, the single-instance lock, the pool and the state."""
        cfg = self.config
        gid = self.access.resolve_group()
        ensure_private_dir(self.runtime_dir, gid)
        self._lock_fd = os.open(
            self.runtime_dir / "hicached.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"another hicached daemon runs with runtime directory {self.runtime_dir}"
            ) from None
        if self.endpoint.startswith("ipc://"):
            sock_path = Path(self.endpoint[len("ipc://") :])
            ensure_private_dir(sock_path.parent, gid)
            sock_path.unlink(missing_ok=True)
        size = cfg.pool.size_mib << 20
        started = time.monotonic()
        self.arena = Arena.create(
            arena_path(cfg.pool.shm_dir, self.runtime_dir),
            size,
            cfg.pool.populate,
            gid,
            on_populate,
            cfg.pool.huge_pages,
        )
        log.info(
            "pool: %d MiB at %s (%.2fs)",
            cfg.pool.size_mib,
            self.arena.path,
            time.monotonic() - started,
        )
        self.cache = Cache(cfg, pool_path=str(self.arena.path), gens=self.arena.gens)

    def _listen(self) -> None:
        """Bind the socket and start serving; READY goes to systemd last."""
        cfg = self.config
        assert self.cache is not None
        self._ctx = zmq.Context()
        self.access.start(self._ctx)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.access.tenants is not None:
            sock.setsockopt(zmq.ZAP_DOMAIN, TENANT_DOMAIN)  # every peer's tenant, by ZAP
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Queued requests and replies are bounded in bytes per client: past
        # queue_mib the daemon stops reading that client's connection until it
        # catches up, and replies it does not read are dropped (their leases end).
        server = cfg.server
        queued = max(4, (server.queue_mib << 20) // server.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, min(server.hwm, queued))
        largest_reply = 10 * server.max_pages_per_request + 256  # offsets, as msgpack
        sock.setsockopt(
            zmq.SNDHWM, min(server.hwm, max(64, (server.queue_mib << 20) // largest_reply))
        )
        # Hard guard on memory: libzmq drops the peer beyond this; between
        # max_message_bytes and this the request gets a too_large reply.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * server.max_message_bytes)
        self.access.bind(sock, self.endpoint, "server.endpoint")
        self._sock = sock
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._drain)
        loop.call_soon(self._drain)  # messages may already be queued
        self._tasks.append(loop.create_task(self._sweep()))
        interval = watchdog_interval()
        if interval:
            self._tasks.append(loop.create_task(self._watchdog(interval)))
        if cfg.events.endpoint:
            self._start_events()
        log.info("listening on %s (instance %x)", self.endpoint, self.cache.instance)
        sd_notify(f"READY=1\nSTATUS=serving on {self.endpoint}")
        self.ready.set()

    # -- KV events ----------------------------------------------------------------------

    def _start_events(self) -> None:
        assert self._ctx is not None and self.cache is not None
        publisher = Publisher(self.config.events, self.cache.events, self.cache.dropped)
        self.publisher = publisher
        publisher.start(self._ctx, self.access.bind_private)
        log.info("KV events on %s", self.config.events.endpoint)

    async def shutdown(self) -> None:
        sd_notify("STOPPING=1")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close(linger=0)  # no new requests while L3 settles
        if self.tier is not None:
            await self.tier.stop()  # events keep flowing: write-back acks
            self.tier = None
        if self.publisher is not None:
            await self.publisher.stop()  # every queued event goes out
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        self._release()
        log.info("stopped")

    def _release(self) -> None:
        """Close the socket, the pool and the lock, in that order."""
        if self.publisher is not None:
            self.publisher.close()  # idempotent; a context ends only with its sockets closed
            self.publisher = None
        bound = self._sock is not None
        if self._sock is not None:
            self._sock.close(linger=0)  # idempotent
            self._sock = None
        self.access.stop()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if bound and self.endpoint.startswith("ipc://"):  # never another daemon's socket
            Path(self.endpoint[len("ipc://") :]).unlink(missing_ok=True)
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- sockets -------------------------------------------------------------------

    # -- the request path --------------------------------------------------------

    def _drain(self) -> None:
        """Handle what the socket holds, up to ``drain_batch`` requests a turn.

        Frame by frame, with integer flags. With tenants a request's frame is
        read as a frame, for the User-Id that the ZAP handler gave its
        connection (the peer's tenant); without, as bytes, and ``RCVMORE``
        says whether more frames follow (a frame object costs more than the
        option). After each request one ``EVENTS`` read says whether another
        waits, which also re-arms the socket's file descriptor; no empty
        receive is raised.
        """
        sock = self._sock
        if sock is None:
            return
        recv, get, tenants = sock.recv, sock.getsockopt, self.access.tenants is not None
        for _ in range(self.config.server.drain_batch):
            try:
                routing_id = recv(_NOBLOCK)
            except zmq.Again:
                return
            # a message's frames arrive together, and a routing id never alone
            if tenants:
                frame = recv(_NOBLOCK, copy=False)
                frames, peer, more = [routing_id, frame.bytes], user_id(frame), frame.more
            else:
                frames, peer, more = [routing_id, recv(_NOBLOCK)], None, bool(get(_RCVMORE))
            while more:  # not a request (_handle counts it): take the rest
                extra = recv(_NOBLOCK, copy=False)
                frames.append(extra.bytes)
                more = extra.more
            try:
                self._handle(frames, peer)
            except Exception as exc:  # a bug: this request fails, the others go on
                self._fault(frames, exc)
            if not int(get(_EVENTS)) & _POLLIN:
                return
        asyncio.get_running_loop().call_soon(self._drain)  # more may wait; let others run first

    def _handle(self, frames: list[bytes], peer: str | None = None) -> None:
        cache = self.cache
        assert cache is not None
        if len(frames) != 2:
            cache.count_drop("bad_frames")
            return
        routing_id, payload = frames
        if len(payload) > self.config.server.max_message_bytes:
            self._reject(
                routing_id,
                payload,
                TooLarge(
                    f"message of {len(payload)} bytes exceeds server.max_message_bytes "
                    f"({self.config.server.max_message_bytes})"
                ),
            )
            return
        try:
            request = p.request_decoder.decode(payload)
        except msgspec.MsgspecError as exc:
            self._reject(routing_id, payload, BadRequest(f"malformed request: {exc}"))
            return
        except RecursionError:
            self._reject(routing_id, payload, BadRequest(TOO_DEEP))
            return
        if request.deadline_ms and request.deadline_ms < time.time() * 1000:
            cache.count_drop("past_deadline")
            return
        if self.metrics is None:
            reply = cache.handle(routing_id, request, peer)
        else:
            started = time.perf_counter()
            reply = cache.handle(routing_id, request, peer)
            self.metrics.observe_request(OP_NAMES[type(request)], time.perf_counter() - started)
        if isinstance(reply, L3Lookup):  # L3's record is incomplete: the backend is asked
            self._lookup(routing_id, reply)
            return
        self._send(routing_id, reply)

    def _lookup(self, routing_id: bytes, lookup: L3Lookup) -> None:
        """Send a reply that waits on L3 once the tier has asked the backend (or
        at its deadline); a lease it carries ends if it cannot be sent."""
        cache, tier = self.cache, self.tier
        assert cache is not None

        def answer(found: int) -> None:
            sock = self._sock
            if sock is None or sock.closed:  # stopping: nobody reads it
                cache.count_drop("unroutable")
                cache.undelivered(routing_id, lookup)
                return
            try:
                reply = lookup.finish(found)
            except Exception as exc:  # a bug: this request fails, the daemon goes on
                cache.undelivered(routing_id, lookup)
                cache.count_error("internal")
                log.error(
                    "internal error finishing request %d after an L3 lookup",
                    lookup.id,
                    exc_info=exc,
                )
                reply = p.Error(id=lookup.id, code="internal", message=INTERNAL)
            self._send(routing_id, reply)

        if tier is None:  # pragma: no cover - the cache asks only with a tier
            answer(0)
        else:
            tier.lookup(lookup.ns, lookup.keys, answer)

    def _reject(self, routing_id: bytes, payload: bytes, exc: HicachedError) -> None:
        """Answer an unusable message if it names a request id, else drop and count it."""
        cache = self.cache
        assert cache is not None
        try:
            request_id = p.envelope_decoder.decode(payload).id
        except msgspec.MsgspecError:
            cache.count_drop("malformed")
            return
        except RecursionError:  # nested too deep to skip: read the id from the map's head
            found = peek_request(payload)[1]
            if found is None:
                cache.count_drop("malformed")
                return
            request_id = found
        cache.count_error(exc.code)
        self._send(routing_id, p.Error.of(request_id, exc))

    def _fault(self, frames: list[bytes], exc: Exception) -> None:
        """A request made the daemon fail: log it, count it, and answer
        ``internal`` when its id can be read (else drop and count it)."""
        cache = self.cache
        assert cache is not None
        cache.count_error("internal")
        op, request_id = peek_request(frames[-1]) if len(frames) == 2 else ("", None)
        now = time.monotonic()
        if now - self._fault_logged >= 1.0:  # a request that keeps failing must not flood the log
            more = self._faults_unlogged
            log.error(
                "internal error on %s request (id %s)%s",
                op if op.isidentifier() and len(op) <= 32 else "an unknown",
                request_id,
                f"; {more} more since the last report" if more else "",
                exc_info=exc,
            )
            self._fault_logged, self._faults_unlogged = now, 0
        else:
            self._faults_unlogged += 1
        if request_id is None:
            cache.count_drop("internal")
            return
        try:
            self._send(frames[0], p.Error(id=request_id, code="internal", message=INTERNAL))
        except Exception:  # pragma: no cover - the reply itself failed
            cache.count_drop("internal")

    def _send(self, routing_id: bytes, reply: p.AnyReply) -> None:
        assert self._sock is not None and self.cache is not None
        sock, payload = self._sock, p.encode(reply)
        try:
            # two sends with integer flags: a third of what send_multipart costs;
            # a message queues whole or not at all (the HWM admits messages)
            sock.send(routing_id, _SNDMORE_NOBLOCK)
            sock.send(payload, _NOBLOCK)
        except zmq.Again:
            self.cache.count_drop("send_full")
            self.cache.undelivered(routing_id, reply)
        except zmq.ZMQError:
            self.cache.count_drop("unroutable")

    # -- background ---------------------------------------------------------------

    async def _sweep(self) -> None:
        assert self.cache is not None
        while True:
            # a reload wakes it, so a shorter interval applies at once
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resweep.wait(), self.config.leases.sweep_interval_s)
            self._resweep.clear()
            ended = self.cache.expire()
            if ended:
                log.info("expired %d leases", ended)

    async def _watchdog(self, interval: float) -> None:
        while True:
            sd_notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    # -- reloads ---------------------------------------------------------------------

    def _serving(self) -> None:
        """Once the state exists: per-tenant metrics, and reloads on SIGHUP."""
        assert self.cache is not None
        if self.metrics is not None:
            self.metrics.tenants = self.cache.tenant_figures
        self._tasks.append(asyncio.get_running_loop().create_task(self._reloads()))

    async def _reloads(self) -> None:
        while True:
            await self._reload_wanted.wait()
            self._reload_wanted.clear()
            await self.reload()

    async def reload(self) -> bool:
        """Read the config file again and apply what may change at run time
        (daemon/reload.py's RELOADABLE, tenants' quotas); other changes are refused, each with
        a log line, and keep their running values. No session, lease or page is
        dropped, except pages past a quota that went down. False when nothing
        could be applied (no file, or an invalid one)."""
        path = self.config_path
        if path is None:
            log.warning("SIGHUP: started without a config file (--config); nothing to reload")
            return False
        try:
            wanted = await asyncio.get_running_loop().run_in_executor(None, load_config, path)
            config, applied, refused = reload_plan(self.config, wanted)
        except ConfigError as exc:
            log.error("reload: %s; the daemon keeps running with its config as it was", exc)
            return False
        for key in refused:
            log.warning(
                "reload: %s changed in %s, but only a restart applies it; it keeps its "
                "running value",
                key,
                path,
            )
        assert self.cache is not None
        self.config = config
        evicted = self.cache.reconfigure(config)
        self._resweep.set()
        if self.tier is not None:
            self.tier.config = config.storage
        logging.getLogger().setLevel(config.log.level.upper())
        for name, pages in evicted.items():
            log.info(
                "reload: tenant %s is past its new quota: %d of its pages evicted", name, pages
            )
        changes = ", ".join(f"{key} = {value!r}" for key, value in applied.items())
        log.info("reload of %s: %s", path, changes or "nothing to change")
        return True


def serve(config: Config, config_path: str | None = None) -> None:
    """Run a daemon in this process until SIGTERM or SIGINT; SIGHUP reloads
    ``config_path`` (by default the file ``config`` was loaded from)."""
    server = Server(config, config_path)
    server.exit_past_stuck_calls = True
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(server.run())
    else:
        uvloop.run(server.run())


def _exit_past_stuck_calls(grace_s: float = 0.5) -> None:
    """The daemon has stopped; a storage call that still hangs past the stop
    deadline (an unreachable store) runs on a thread that the interpreter would
    wait for at exit. Wait a moment for them, then exit without them."""
    end = time.monotonic() + grace_s
    stuck = []
    for thread in threading.enumerate():
        if thread.name.startswith("hicached-") and not thread.daemon:
            thread.join(max(0.0, end - time.monotonic()))
            if thread.is_alive():
                stuck.append(thread.name)
    if stuck:
        log.warning("exiting with %d storage calls still running: %s", len(stuck), stuck)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
