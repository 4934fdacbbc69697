"""The daemon process: serve -> startup -> main loop -> shutdown.

One asyncio loop (uvloop when installed) owns the Cache. The server binds
the ROUTER socket and hands it to the request loop (daemon/requests.py),
which drains it in bounded batches and answers every request or counts it
dropped. KV events go out through a ``Publisher`` (wire/events.py). Signals
only set a flag; a second signal exits at once.

Access control (private directories, the clients' group, CURVE, the ZAP
handler) is daemon/access.py's. Tenants: with ``[tenants]`` configured, a
connection's tenant comes from who it is (daemon/tenants.py), never from what
it says; the cache checks each request against it. Over ipc each tenant's
pages live in an arena file of its own that only it may open (daemon/arenas.py).
SIGHUP reads the config file again and applies what may change at run time
(daemon/reload.py); everything else keeps its running value, logged.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.auth

from hicached.cache import Cache
from hicached.cache.journal import Recorder
from hicached.config import (
    Config,
    config_source,
    endpoint,
    runtime_dir,
)
from hicached.daemon.access import Access, ensure_private_dir, release_stale
from hicached.daemon.adoption import OpenedPool, open_arenas, open_pool
from hicached.daemon.arenas import checked_layout, grant
from hicached.daemon.collector import Collector
from hicached.daemon.journal import JournalFile, journal_files, journal_path
from hicached.daemon.metrics import Metrics
from hicached.daemon.notify import StartupProgress, sd_notify, watchdog_interval
from hicached.daemon.publisher import Publisher
from hicached.daemon.reload import reload_plan
from hicached.daemon.requests import RequestLoop
from hicached.daemon.reread import ConfigReader, ReadTimeout
from hicached.daemon.routing import unpredictable_routing_ids
from hicached.daemon.startpaths import check_paths
from hicached.daemon.tenants import TENANT_DOMAIN
from hicached.daemon.tier import Tier, make_backend
from hicached.daemon.waits import TASK_STOP_S, end_tasks, unless_set, wait_event
from hicached.errors import ConfigError
from hicached.wire.arena import Arena, arena_path
from hicached.wire.arenas import TenantArena, TenantArenas
from hicached.wire.peek import peek_request  # noqa: F401 (still importable from here)

log = logging.getLogger("hicached")


# ZAP domain of the request socket when tenants are configured: its peers get
# their tenant as User-Id. Other sockets keep the default domain and handling.
class Server:
    """One daemon instance; ``await run()`` serves until a signal or ``stop()``.

    ``config_path``: the file SIGHUP reads again (by default the one
    ``load_config`` read ``config`` from, if it did)."""

    def __init__(
        self, config: Config, config_path: str | None = None, *, fresh: bool = False
    ) -> None:
        self.config = config
        self.fresh = fresh  # make a new pool even where one could be adopted
        self.config_path = config_path or config_source(config)
        self.endpoint = endpoint(config)
        self.runtime_dir = runtime_dir(config)
        self.cache: Cache | None = None
        self.tier: Tier | None = None
        self.arena: Arena | TenantArenas | None = None  # tenant arenas: daemon/arenas.py
        self.journal: JournalFile | None = None  # with pool.adopt
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._requests: RequestLoop | None = None  # serves _sock once it is bound
        self.publisher: Publisher | None = None
        self._lock_fd: int | None = None
        self.access = Access(config, self.endpoint)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._signals = 0
        self.metrics: Metrics | None = None
        # the garbage collector's figures, and its tuning (server.gc_freeze)
        self.collector = Collector(config.server.gc_freeze)
        self._reload_wanted = asyncio.Event()
        self._reader = ConfigReader()  # reads the file for reloads, under a deadline
        # the process is this daemon's own (serve): it may exit past stuck calls
        self.exit_past_stuck_calls = False
        self._resweep = asyncio.Event()  # set by a reload: the sweep takes its new interval
        self.ready = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload_wanted.set)
        try:
            # A start that waits (an L3 store opening, a scan before READY) ends
            # at SIGTERM: the rest of the stop runs at once, and a store call
            # stuck on a thread is not waited for.
            if await unless_set(self.startup(), self._stop, "the start"):
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
        self.collector.schedule = asyncio.get_running_loop().call_soon_threadsafe
        self.collector.start()
        # STATUS and EXTEND_TIMEOUT_USEC while the pool fills and L3 is scanned
        with StartupProgress() as progress:
            populated = [0]  # MiB, as _prepare prefaults the pool
            progress.phase(
                f"opening the {cfg.pool.size_mib} MiB pool (adopting the one before, "
                "or populating a new one)",
                lambda: populated[0],
                stall_s=None,
                unit=" MiB",
            )
            self._prepare(lambda done: populated.__setitem__(0, done >> 20))
            assert self.cache is not None and self.arena is not None
            self.cache.report_collector(self.collector.figures)
            if cfg.storage.backend:
                # tenant arenas: no helper process maps the pool (it is not one file)
                path = str(self.arena.path) if isinstance(self.arena, Arena) else ""
                backend = make_backend(cfg, self.arena.array.data, path)
                tier = Tier(self.cache, backend, self.arena)
                # a scan in the background ends while the daemon serves
                tier.on_scanned = lambda: self.collector.settle("the startup L3 scan ended")
                scan = cfg.storage.scan_on_start and not cfg.storage.scan_in_background
                progress.phase(
                    f"L3: opening the {cfg.storage.backend} store"
                    + (", scanning its pages" if scan else ""),
                    lambda: tier.scan_pages,
                    stall_s=2 * cfg.storage.op_timeout_s,
                    unit=" pages",
                )
                try:
                    await tier.start()  # opens the store and learns what it holds
                except BaseException:  # a failed or stopped start closes what it opened
                    await tier.dispatcher.stop(time.monotonic())
                    raise
                self.cache.use_tier(tier)
                self.tier = tier
                log.info("L3: %s backend, %s", cfg.storage.backend, cfg.storage.write_policy)
            if cfg.metrics.enabled:
                metrics = Metrics(cfg.metrics, self.cache.stats, tenants=bool(cfg.tenants))
                metrics.start()
                self.metrics = metrics
                self.cache.serve_metrics(metrics.endpoint)
                if self.tier is not None:
                    self.tier.dispatcher.on_call = metrics.observe_l3
                self.collector.on_pause = metrics.observe_gc
        # what the start made (an adopted pool, what a scan found) lives long
        self.collector.settle("started")
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
            release_stale(sock_path, "server.endpoint")
        started = time.monotonic()
        check_paths(cfg)  # pool.shm_dir, and where a file store's segments go
        path = arena_path(cfg.pool.shm_dir, self.runtime_dir)
        layout = checked_layout(cfg, self.endpoint, self.runtime_dir)
        if layout:
            self._prepare_arenas(layout, path, gid, on_populate)
            log.info(
                "pool: %d MiB in %d tenant arenas (%.2fs)",
                cfg.pool.size_mib,
                len(layout),
                time.monotonic() - started,
            )
            return
        opened = open_pool(cfg, path, gid, self.fresh, on_populate)
        self.arena = opened.arena
        recorder = Recorder() if cfg.pool.adopt else None
        self.cache = Cache(
            cfg,
            pool_path=str(self.arena.path),
            gens=self.arena.gens,
            journal=recorder,
            pool_id=opened.header.pool_id,
        )
        self._adopt(opened, path, recorder)
        log.info(
            "pool: %d MiB at %s (%.2fs)",
            cfg.pool.size_mib,
            self.arena.path,
            time.monotonic() - started,
        )

    def _adopt(self, opened: OpenedPool, path: Path, recorder: Recorder | None) -> None:
        """Adopt what the daemon before left (when ``opened`` has its journal),
        then start this daemon's journal (pool.adopt)."""
        assert self.cache is not None
        if opened.records is not None:
            adopted = self.cache.adopt(opened.records)
            log.info(
                "pool: adopted %d pages of %d namespaces, %d slots quarantined, dropped %s%s",
                adopted.pages,
                adopted.namespaces,
                adopted.quarantined,
                adopted.dropped or "none",
                f", {opened.torn} bytes of torn journal" if opened.torn else "",
            )
        if recorder is not None:
            self.journal = JournalFile(journal_path(path), opened.header, recorder)
            self.journal.start()

    def _prepare_arenas(
        self,
        layout: list[TenantArena],
        path: Path,
        gid: int | None,
        on_populate: Callable[[int], None] | None,
    ) -> None:
        """The pool as tenant arenas, one file per tenant (daemon/arenas.py),
        adopted from the daemon before where its journal describes these very
        arenas (daemon/adoption.py), else made anew."""
        cfg = self.config
        opened = open_arenas(cfg, layout, path, grant(cfg, gid), self.fresh, on_populate)
        arenas = opened.arena
        assert isinstance(arenas, TenantArenas)
        self.arena = arenas
        recorder = Recorder() if cfg.pool.adopt else None
        self.cache = Cache(
            cfg, pool_path="", gens=arenas.gens, journal=recorder, pool_id=opened.header.pool_id
        )
        self.cache.l2.use_arenas({a.tenant: (a.start, a.size) for a in layout})
        self.cache.clients.use_arenas(layout)
        self._adopt(opened, path, recorder)
        for arena in layout:
            log.info(
                "pool: tenant %s: %d MiB at %s (pool bytes %d..%d)",
                arena.tenant,
                arena.size >> 20,
                arena.path,
                arena.start,
                arena.start + arena.size,
            )

    def _listen(self) -> None:
        """Bind the socket and start serving; READY goes to systemd last."""
        cfg = self.config
        assert self.cache is not None
        unpredictable_routing_ids()  # before the first ROUTER socket (daemon/routing.py)
        self._ctx = zmq.Context()
        self.access.start(self._ctx)
        if cfg.events.endpoint:
            # Before the request socket: a refused events bind stops the start
            # before any client is answered (it was answered while the stop ran).
            self._start_events()
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
        tenants = self.access.tenants is not None
        requests = RequestLoop(
            sock,
            self.cache,
            server,
            tenants=tenants,
            metrics=self.metrics,
            tier=self.tier,
            journal=self.journal,
        )
        requests.start()
        self._requests = requests
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._sweep()))
        interval = watchdog_interval()
        if interval:
            self._tasks.append(loop.create_task(self._watchdog(interval)))
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
        await end_tasks(self._tasks, TASK_STOP_S, "the sweep and watchdog")
        self._tasks.clear()
        if self._requests is not None:
            self._requests.stop()
        if self._sock is not None:
            self._sock.close(linger=0)  # no new requests while L3 settles
        if self.tier is not None:
            await self.tier.stop()  # events keep flowing: write-back acks
            self.tier = None
        if self.publisher is not None:
            await self.publisher.stop()  # every queued event goes out
        if self.metrics is not None:
            self.collector.on_pause = None
            self.metrics.stop()
            self.metrics = None
        self.collector.stop()
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
            # closes, without linger, any socket a failed start left open (an
            # option its setup refused): term() alone would wait for it for ever
            self._ctx.destroy(linger=0)
            self._ctx = None
        if bound and self.endpoint.startswith("ipc://"):  # never another daemon's socket
            Path(self.endpoint[len("ipc://") :]).unlink(missing_ok=True)
        keep = False
        if self.journal is not None:
            self.journal.flush()
            self.journal.close()
            keep = not self.journal.failed  # the next start adopts the pool
            self.journal = None
        if self.arena is not None:
            self.arena.close(keep=keep)  # kept: the next start adopts it (pool.adopt)
            if not keep:
                pool = arena_path(self.config.pool.shm_dir, self.runtime_dir)
                for stale in journal_files(pool):
                    stale.unlink(missing_ok=True)
            self.arena = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- background ---------------------------------------------------------------

    async def _sweep(self) -> None:
        assert self.cache is not None
        while True:
            # a reload wakes it, so a shorter interval applies at once
            await wait_event(self._resweep, self.config.leases.sweep_interval_s)
            self._resweep.clear()
            ended = self.cache.expire()
            self.collector.stored(self.cache.committed_pages)  # may freeze what they made
            if ended:
                log.info("expired %d leases", ended)
            if self.journal is not None:
                self.journal.flush()  # what changed without a reply (prefetches, expiry)

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
        could be applied (no file, an invalid one, or a failure).

        Never raises: a reload that fails in a way no check foresaw is logged
        with its traceback and counted (``hicached_reloads_total{result="failed"}``),
        and the next SIGHUP is taken as ever; raising here would end the task
        that waits for SIGHUPs, and every later reload would do nothing."""
        try:
            result = await self._reload()
        except Exception:
            log.exception(
                "reload of %s failed; the daemon keeps running (with its config as it was, "
                "or the part of the new one applied before the failure) and takes the next "
                "SIGHUP",
                self.config_path,
            )
            result = "failed"
        if self.metrics is not None:
            self.metrics.count_reload(result)
        return result == "applied"

    async def _reload(self) -> str:
        """One reload; its result: applied, invalid (nothing changed) or timeout."""
        path = self.config_path
        if path is None:
            log.warning("SIGHUP: started without a config file (--config); nothing to reload")
            return "invalid"
        try:
            metrics = self.metrics
            token_file = self.config.metrics.token_file if metrics is not None else ""
            wanted, token = await self._reader.read(
                path, self.config.server.reload_timeout_s, token_file
            )
            config, applied, refused = reload_plan(self.config, wanted)
        except ReadTimeout as exc:
            log.error("reload: %s; the daemon keeps running with its config as it was", exc)
            return "timeout"
        except ConfigError as exc:
            log.error("reload: %s; the daemon keeps running with its config as it was", exc)
            return "invalid"
        for key in refused:
            log.warning(
                "reload: %s changed in %s, but only a restart applies it; it keeps its "
                "running value",
                key,
                path,
            )
        assert self.cache is not None
        self.config = config
        if self._requests is not None:
            self._requests.config = config.server  # drain_batch
        wrote_all = self.cache.policy.writes_all
        evicted = self.cache.reconfigure(config)
        self._resweep.set()
        if self.tier is not None:
            self.tier.reconfigure(config.storage, wrote_all=wrote_all)
        logging.getLogger().setLevel(config.log.level.upper())
        for name, pages in evicted.items():
            log.info(
                "reload: tenant %s is past its new quota: %d of its pages evicted", name, pages
            )
        if metrics is not None and token is not None and metrics.use_token(token):
            applied["metrics.token_file"] = "(a new token)"  # never the token itself
        changes = ", ".join(f"{key} = {value!r}" for key, value in applied.items())
        log.info("reload of %s: %s", path, changes or "nothing to change")
        return "applied"


def serve(config: Config, config_path: str | None = None, *, fresh: bool = False) -> None:
    """Run a daemon in this process until SIGTERM or SIGINT; SIGHUP reloads
    ``config_path`` (by default the file ``config`` was loaded from). ``fresh``:
    make a new pool even where the one before could be adopted."""
    server = Server(config, config_path, fresh=fresh)
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
