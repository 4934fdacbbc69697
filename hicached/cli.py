"""The ``hicached`` command: serve, status, events, check-config, keygen, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from hicached.config import load_config
from hicached.errors import HicachedError

if TYPE_CHECKING:
    from hicached.config import Config
    from hicached.wire import protocol as p


def _cmd_serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    logging.basicConfig(
        level=config.log.level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from hicached.daemon.server import serve

    serve(config, fresh=args.fresh)
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    config = load_config(args.path)
    from hicached.config import endpoint, runtime_dir
    from hicached.daemon.access import Access
    from hicached.daemon.arenas import checked_layout
    from hicached.daemon.startpaths import check_paths

    # what serve refuses of tenant arenas fails here too: sizes that are not
    # whole slabs, a pool too small for them, and accounts that could open
    # another tenant's arena (as passwd and group list them on this host)
    checked_layout(config, endpoint(config), runtime_dir(config))
    access = Access(config, endpoint(config))
    access.resolve_group()  # server.client_group and events.group, as serve resolves them
    access.check()  # the CURVE key files and the tenants' keys, as serve reads them
    _check_metrics_access(config)
    if config.storage.backend:
        # the backend must be installed, and its options valid as a whole: what
        # its start would refuse (a missing bucket, ...) fails here already
        from hicached.daemon.tier import backend_options
        from hicached_backends import load_backend_class

        backend_options(config, load_backend_class(config.storage.backend))
    check_paths(config)  # pool.shm_dir, and where a file store's segments go
    print(f"{args.path}: ok")
    return 0


def _check_metrics_access(config: Config) -> None:
    """The TLS files and the metrics token file as serve reads them; root checks
    the token for whichever user will run the daemon, so its owner is checked
    only as that user. With tenants and no credential, a warning: every scrape
    would be refused."""
    m = config.metrics
    if not m.enabled:
        return
    if m.tls_cert:
        from hicached.daemon.metrics_http import tls_context

        tls_context(m)
    if m.token_file:
        from hicached.daemon.metrics_http import read_token

        read_token(m.token_file, check_owner=os.geteuid() != 0)
    elif config.tenants and not m.authenticated:
        print(
            "warning: metrics: with [tenants] every scrape is refused (401) until "
            "metrics.token_file (or client_ca) is set (docs/operations.md, Metrics)",
            file=sys.stderr,
        )


def _cmd_status(args: argparse.Namespace) -> int:
    from hicached.client import Client, CurveKeys
    from hicached.errors import ResourceExhausted

    curve = None
    if args.curve_server_key or args.curve_key:
        if not (args.curve_server_key and args.curve_key):
            raise SystemExit("--curve-server-key and --curve-key go together")
        curve = CurveKeys.load(args.curve_server_key, args.curve_key)
    client = Client(
        args.endpoint,
        timeout=args.timeout,
        name="hicached-status",
        curve=curve,
        map_pool=False,  # status needs no slots, and may ask another host
    )
    try:
        try:
            stats = client.stats()
        except ResourceExhausted:  # every client slot holds leases: ask without a session
            stats = client.stats(session=False)
        protocol = client.protocol  # the session's, before close() forgets it
    finally:
        client.close()
    if args.json:
        print(json.dumps(msgspec.to_builtins(stats), indent=2, sort_keys=True))
        return 0
    if stats.scope == "tenant":
        print("\n".join(_tenant_status(stats, client.endpoint, protocol)))
        return 0
    mib = 1 << 20
    used_pct = 100.0 * stats.pool_used_bytes / stats.pool_bytes if stats.pool_bytes else 0.0
    lines = [
        f"hicached at {client.endpoint} (instance {stats.instance:x}, up {stats.uptime_s:.0f}s)",
        f"pool:       {stats.pool_bytes / mib:.1f} MiB, used {stats.pool_used_bytes / mib:.1f} MiB "
        f"({used_pct:.1f}%), free {stats.pool_free_bytes / mib:.1f} MiB",
        f"pages:      {stats.pages} indexed, {stats.pinned_pages} pinned, "
        f"{stats.reserved_pages} reserved, {stats.evicted_pages} evicted",
        f"namespaces: {stats.namespaces}   clients: {stats.clients}   leases: {stats.leases} "
        f"({stats.expired_leases} expired)",
        "requests:   " + _pairs(stats.requests),
        "errors:     " + _pairs(stats.errors),
        "dropped:    " + _pairs(stats.dropped),
        "matched:    " + _pairs(stats.match_pages),
    ]
    if stats.tenant is not None:
        lines.append(_tenant_line(stats.tenant))
    if stats.adopted_pages or stats.adoption_dropped:
        lines.append(
            f"adopted:    {stats.adopted_pages} pages at start; dropped "
            + _pairs(stats.adoption_dropped)
        )
    if stats.l3_backend:
        lines.append(
            f"L3:         {stats.l3_backend} {stats.l3_state}, {stats.l3_pages_known} pages known; "
            f"{stats.l3_write_amplification:.2f} pages written a page committed"
            + (
                " (undersized: smaller than L2, keeps the pages written last)"
                if stats.l3_undersized
                else ""
            )
            + "; "
            + _pairs(stats.l3)
        )
    lines.extend(_gather_lines(stats.gather_clients, protocol))
    lines.append(_collector_line(stats.collector, protocol))
    lines.append(f"metrics:    {stats.metrics_endpoint or 'off'}")
    print("\n".join(lines))
    return 0


# The largest message `hicached events` takes from a publisher: batches of a
# daemon with events.batch_kib up to 64 MiB (or its config's, if larger).
EVENTS_MESSAGE_BYTES = 64 << 20
# After a dropped connection `hicached events` dials again this long after,
# doubling at each drop up to the most, back to the least once a message came:
# a publisher that drops every connection at once is dialed a few times a
# second at most, not as fast as TCP connects (and a line on stderr for each).
_REDIAL_S = (0.1, 5.0)
_GATHER_SHOWN = 8  # measured clients given a line each; --json has them all
_HOW = {"measured": "measured", "forced": "set by HICACHED_GATHER", "no_torch": "without torch"}


def _gather_lines(clients: list[p.GatherClient], protocol: tuple[int, int] | None) -> list[str]:
    """Clients' scattered-copy kernels (client/gather.py): a summary, then one
    line per measured client with the rates that decided. ``protocol``: the
    daemon's version where known; one older than 1.5 keeps no reports, which
    is not the same as none reported."""
    from hicached.wire.protocol import GATHER_MINOR, PROTOCOL_MAJOR

    if protocol is not None and protocol < (PROTOCOL_MAJOR, GATHER_MINOR):
        return [
            f"gather:     not kept by this daemon (protocol {protocol[0]}.{protocol[1]}; "
            f"{PROTOCOL_MAJOR}.{GATHER_MINOR} and later keep them)"
        ]
    if not clients:
        return ["gather:     none reported"]
    picks: dict[str, int] = {}
    hows: dict[str, int] = {}
    for c in clients:
        pick = f"{c.read}/{c.write}"
        picks[pick] = picks.get(pick, 0) + 1
        hows[c.how] = hows.get(c.how, 0) + 1
    summary = ", ".join(
        f"{n} client{'s' if n > 1 else ''} {pick}" for pick, n in sorted(picks.items())
    )
    how = ", ".join(f"{n} {_HOW.get(h, h)}" for h, n in sorted(hows.items()))
    lines = [f"gather:     {summary} (read/write kernels; {how})"]
    measured = [c for c in clients if c.how == "measured"]
    for c in measured[:_GATHER_SHOWN]:
        lines.append(
            f"            #{c.session} {_shown(c.client)} (pid {c.pid}): read {c.read} "
            f"(numpy {c.read_numpy_gbps:.1f}, torch {c.read_torch_gbps:.1f} GB/s), write "
            f"{c.write} (numpy {c.write_numpy_gbps:.1f}, torch {c.write_torch_gbps:.1f} GB/s); "
            f"{c.sample_pages} x {c.page_bytes >> 10} KiB a round, "
            f"{c.rounds} round{'s' if c.rounds != 1 else ''}"
        )
    if len(measured) > _GATHER_SHOWN:
        lines.append(f"            and {len(measured) - _GATHER_SHOWN} more measured (--json)")
    return lines


def _tenant_status(
    stats: p.DaemonStats, endpoint: str, protocol: tuple[int, int] | None
) -> list[str]:
    """Status as a tenant's peer sees it (1.10): its own tenant's figures, the
    L3 tier's health; the daemon's totals are the operator's."""
    mib = 1 << 20
    lines = [
        f"hicached at {endpoint} (instance {stats.instance:x}, up {stats.uptime_s:.0f}s)",
        f"pool:       {stats.pool_bytes / mib:.1f} MiB",
    ]
    if stats.tenant is not None:
        lines.append(_tenant_line(stats.tenant))
    if stats.l3_backend:
        lines.append(f"L3:         {stats.l3_backend} {stats.l3_state}")
    lines.extend(_gather_lines(stats.gather_clients, protocol))
    lines.append(f"metrics:    {stats.metrics_endpoint or 'off'}")
    lines.append(
        "daemon:     its totals are not shown to a tenant's peers: ask as a user of no "
        "tenant (root, the daemon's user), or scrape the metrics"
    )
    return lines


def _tenant_line(t: p.TenantStats) -> str:
    """The asking peer's own tenant (1.8, with [tenants]): the lines above are
    the daemon's totals, this one is the tenant's alone; from 1.9 also what it
    holds of its share of the shared bounds."""
    quota = [f"{t.max_slots} pages"] if t.max_slots else []
    quota += [f"{t.max_bytes / (1 << 20):.1f} MiB"] if t.max_bytes else []
    held = (
        f"; clients {t.clients}/{t.max_clients} leases {t.leases}/{t.max_leases} "
        f"namespaces {t.namespaces}/{t.max_namespaces}"
        if t.max_clients  # 0 from a daemon older than 1.9
        else ""
    )
    return (
        f"tenant:     {t.tenant}: {t.pages} pages, {t.slots} slots "
        f"({t.bytes / (1 << 20):.1f} MiB), quota {' and '.join(quota) or 'none'}; "
        f"matched asked={t.asked} l2={t.hits}; evicted {t.evicted} "
        f"({t.quota_evicted} for its quota){held}"
    )


def _collector_line(c: p.CollectorStats | None, protocol: tuple[int, int] | None) -> str:
    """The daemon's garbage collector (daemon/collector.py): full collections
    (generation 2) apart from young ones, as the full ones are what hold the
    daemon long; then what is frozen. A daemon older than 1.7 reports none."""
    from hicached.wire.protocol import COLLECTOR_MINOR, PROTOCOL_MAJOR

    if c is None:
        if protocol is not None and protocol < (PROTOCOL_MAJOR, COLLECTOR_MINOR):
            return (
                f"collector:  not reported by this daemon (protocol {protocol[0]}.{protocol[1]}; "
                f"{PROTOCOL_MAJOR}.{COLLECTOR_MINOR} and later report it)"
            )
        return "collector:  not reported"
    young = sum(c.collections[:-1])
    frozen = (
        f"{c.frozen_objects} objects frozen ({c.freezes} freezes)"
        if c.freeze
        else f"freezing off (server.gc_freeze), {c.frozen_objects} objects frozen"
    )
    return (
        f"collector:  {c.collections[-1]} full collections, {c.pause_s[-1]:.3f}s in all, "
        f"longest {c.longest_s[-1] * 1e3:.1f} ms; {young} young, {sum(c.pause_s[:-1]):.3f}s, "
        f"longest {max(c.longest_s[:-1]) * 1e3:.1f} ms; {frozen}"
    )


def _shown(name: str) -> str:
    """A name a client chose (its hello's), or a publisher's topic or medium, as
    a terminal may print it: control and other unprintable characters escaped,
    so that it can neither add lines to the output nor move the cursor or clear
    the screen."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def _cmd_events(args: argparse.Namespace) -> int:
    """Print the KV event stream; replay from ``--from`` first, and replay any gap
    the live stream shows (when a replay endpoint is known)."""
    import contextlib
    import time

    import zmq

    from hicached.wire.events import END_SEQ, decode_batch

    events = load_config(args.config).events
    endpoint = args.endpoint or events.endpoint
    replay_at = args.replay_endpoint if args.replay_endpoint is not None else events.replay_endpoint
    layout = args.format or events.format
    if not endpoint:
        raise SystemExit("hicached events: no endpoint: give --endpoint, or --config with one")
    if args.from_seq is not None and not replay_at:
        raise SystemExit("hicached events: --from needs a replay endpoint (--replay-endpoint)")
    curve = None
    if args.curve_server_key or args.curve_key:
        from hicached.client import CurveKeys

        if not (args.curve_server_key and args.curve_key):
            raise SystemExit("--curve-server-key and --curve-key go together")
        curve = CurveKeys.load(args.curve_server_key, args.curve_key)
    _check_events_flags(args, endpoint, replay_at, remote=curve is not None)

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    # A batch's payload is at most the daemon's events.batch_kib; a larger
    # message (not a daemon's) drops the connection before it is buffered.
    # EVENTS_MESSAGE_BYTES covers a daemon whose batch_kib is larger than the
    # config read here (none given: the defaults).
    most = max(EVENTS_MESSAGE_BYTES, events.batch_kib * 1024 + 1024)

    def socket(kind: int, where: str) -> zmq.Socket[bytes]:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, most)
        if curve is not None:
            sock.curve_serverkey = curve.server_public
            sock.curve_publickey = curve.public
            sock.curve_secretkey = curve.secret
        sock.connect(where)
        return sock

    printed = 0
    last = -1

    def show(topic: bytes, seq_frame: bytes, payload: bytes) -> None:
        nonlocal printed, last
        seq = int.from_bytes(seq_frame, "big")
        if seq <= last:
            return  # already shown (a replay and the live stream overlap)
        try:
            batch = decode_batch(payload, layout)
        except msgspec.MsgspecError as exc:  # a publisher that is not a daemon, or --format
            print(f"hicached events: batch {seq} is not an event batch ({exc})", file=sys.stderr)
            return
        name = _shown(topic.decode(errors="replace"))
        decoded = [_event_json(e) for e in batch.events]
        if args.json:
            line = {
                "seq": seq,
                "topic": name,
                "ts": batch.ts,
                "data_parallel_rank": batch.data_parallel_rank,
                "events": decoded,
            }
            print(json.dumps(line), flush=True)
        else:
            print(f"#{seq} {name} ts={batch.ts:.6f} dp={batch.data_parallel_rank}")
            for event in decoded:
                print("  " + _event_text(event))
            sys.stdout.flush()
        printed += 1
        last = seq

    def replay(start: int) -> None:
        sock = socket(zmq.DEALER, replay_at)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while not (args.count and printed >= args.count):
                if not sock.poll(int(args.replay_timeout * 1000)):
                    print(f"hicached events: replay from {start} stopped", file=sys.stderr)
                    return
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                show(*frames[1:])
        finally:
            sock.close()

    live_last = -1  # the last batch number the live stream showed
    sub = socket(zmq.SUB, endpoint)
    # libzmq dials a publisher that went away again by itself, but gives a
    # connection up for good after a protocol error, such as a message over
    # ``most``: without a dial of our own the command would wait in silence.
    drops = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(drops, zmq.POLLIN)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
        if args.from_seq is not None:
            time.sleep(0.2)  # let the subscription reach the daemon: nothing falls between
            replay(args.from_seq)
        idle_since = time.monotonic()
        pause, redial_at = _REDIAL_S[0], None  # redial_at: when to dial after a drop
        while not (args.count and printed >= args.count):
            ready = dict(poller.poll(100))
            now = time.monotonic()
            if drops in ready:
                drops.recv_multipart()  # one event: (event id and value, endpoint)
                if redial_at is None:
                    print(
                        f"hicached events: the connection to {endpoint} dropped (the daemon "
                        f"stopped, or sent a message over {most} bytes); dialing again "
                        f"in {pause:.1f} s",
                        file=sys.stderr,
                    )
                    # libzmq's own redials stop too: the next dial is ours, paced
                    with contextlib.suppress(zmq.ZMQError):  # libzmq may have let it go
                        sub.disconnect(endpoint)
                    redial_at, pause = now + pause, min(pause * 2, _REDIAL_S[1])
            if redial_at is not None and now >= redial_at:
                sub.connect(endpoint)
                redial_at = None
            if sub not in ready:
                if args.idle_exit and now - idle_since >= args.idle_exit:
                    break
                continue
            idle_since, pause = time.monotonic(), _REDIAL_S[0]
            frames = sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:  # not (topic, seq, payload)
                print(
                    f"hicached events: a message of {len(frames)} frames is not an event batch",
                    file=sys.stderr,
                )
                continue
            topic, seq_frame, payload = frames
            seq = int.from_bytes(seq_frame, "big")
            restarted = seq <= live_last  # the live stream only goes up, within one start
            if restarted:
                # a new daemon numbers from 0 again: what it sends is new, and what
                # it sent before this (its AllBlocksCleared first) is a gap
                print(
                    f"hicached events: the daemon started again (batch {seq} after "
                    f"{live_last}); its batches are numbered from 0",
                    file=sys.stderr,
                )
                last = -1
            live_last = seq
            if (last >= 0 or restarted) and seq > last + 1:
                print(f"hicached events: batches {last + 1}..{seq - 1} missed", file=sys.stderr)
                if replay_at:
                    replay(last + 1)
            show(topic, seq_frame, payload)
    finally:
        sub.disable_monitor()
        drops.close()
        sub.close()
        ctx.term()
    return 0


def _check_events_flags(
    args: argparse.Namespace, endpoint: str, replay_at: str, *, remote: bool
) -> None:
    """What ``events`` is given, checked before any socket: a bad flag ran into
    a traceback, or a wait without end (a negative replay timeout polls for
    ever, a NaN idle time never passes)."""
    import math

    from hicached.endpoints import check_endpoint

    for flag, where in (("--endpoint", endpoint), ("--replay-endpoint", replay_at)):
        try:
            if where:
                check_endpoint(where, remote=remote)
        except ValueError as exc:
            raise SystemExit(f"hicached events: {flag}: {exc}") from None
    if args.from_seq is not None and not 0 <= args.from_seq < 1 << 64:
        raise SystemExit("hicached events: --from is a batch number, 0 to 2**64-1")
    if not (math.isfinite(args.replay_timeout) and 0 < args.replay_timeout <= 1e9):
        raise SystemExit("hicached events: --replay-timeout is a positive number of seconds")
    if not (math.isfinite(args.idle_exit) and 0 <= args.idle_exit <= 1e9):
        raise SystemExit("hicached events: --idle-exit is a number of seconds, 0 (never) or more")
    if args.count < 0:
        raise SystemExit("hicached events: --count is a number of batches, 0 (no end) or more")


def _hash_json(value: object) -> object:
    return value.hex() if isinstance(value, bytes) else value


def _event_json(event: msgspec.Struct) -> dict[str, object]:
    """An event as a JSON object: {"type": ..., field: value, ...}; byte hashes in hex."""
    out: dict[str, object] = {"type": event.__struct_config__.tag}
    for field in msgspec.structs.fields(event):
        name = field.name
        value = getattr(event, name)
        if name == "block_hashes":
            value = [_hash_json(h) for h in value]
        elif name == "parent_block_hash":
            value = _hash_json(value)
        out[name] = value
    return out


def _event_text(event: dict[str, object]) -> str:
    kind = event["type"]
    if kind == "AllBlocksCleared":
        return str(kind)
    hashes = event["block_hashes"]
    assert isinstance(hashes, list)
    medium = event["medium"]
    shown = _shown(medium) if isinstance(medium, str) else medium
    text = f"{kind} {shown} {len(hashes)} blocks {hashes}"
    if kind == "BlockStored":
        tokens = event["token_ids"]
        assert isinstance(tokens, list)
        text += (
            f" parent={event['parent_block_hash']} block_size={event['block_size']}"
            f" tokens={len(tokens)}"
        )
    return text


def _cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", args.name):
        raise SystemExit(f"name {args.name!r}: letters, digits, '.', '_' and '-' only")
    directory = Path(args.directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (directory / f"{args.name}.key").exists():
        raise SystemExit(f"{directory / args.name}.key exists: choose another name")
    public, secret = zmq.auth.create_certificates(str(directory), args.name)
    os.chmod(secret, 0o600)
    print(f"public: {public}\nsecret: {secret}")
    return 0


def _pairs(counts: dict[str, int]) -> str:
    return " ".join(f"{key}={value}" for key, value in sorted(counts.items())) or "none"


def _cmd_bench(args: argparse.Namespace) -> int:
    from hicached.bench import run_bench

    result = run_bench(args.which, args)
    if args.plot:
        from hicached.bench.plot import draw

        draw(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        for name, value in sorted(result["figures"].items()):
            print(f"{name:24} {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicached", description="Hierarchical KV-cache daemon.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", help="TOML config file (default: built-in defaults)")
    serve.add_argument(
        "--fresh",
        action="store_true",
        help="make a new pool instead of adopting the one the daemon before left (pool.adopt)",
    )
    serve.set_defaults(func=_cmd_serve)

    status = sub.add_parser("status", help="show what a running daemon holds")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--endpoint", help="daemon endpoint (default: $HICACHED_ENDPOINT or the default ipc socket)"
    )
    status.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for the daemon (default: 3)"
    )
    status.add_argument("--curve-server-key", help="the daemon's public CURVE certificate (.key)")
    status.add_argument("--curve-key", help="this client's secret CURVE certificate (.key_secret)")
    status.set_defaults(func=_cmd_status)

    events = sub.add_parser(
        "events", help="print the KV event stream (docs/events.md), replayed from --from"
    )
    events.add_argument("--config", help="take the endpoints and format from this config file")
    events.add_argument("--endpoint", help="the PUB endpoint (default: events.endpoint)")
    events.add_argument(
        "--replay-endpoint", help="the replay endpoint (default: events.replay_endpoint)"
    )
    events.add_argument(
        "--from", dest="from_seq", type=int, help="replay from this sequence number first"
    )
    events.add_argument("--json", action="store_true", help="one JSON object per batch")
    events.add_argument("--format", choices=["map", "array"], help="default: events.format")
    events.add_argument("--topic", default="", help="subscribe to topics starting with this")
    events.add_argument("--count", type=int, default=0, help="stop after this many batches")
    events.add_argument(
        "--idle-exit", type=float, default=0.0, help="stop after this many seconds without one"
    )
    events.add_argument(
        "--replay-timeout",
        type=float,
        default=10.0,
        help="seconds a replay may stay silent (default: 10)",
    )
    events.add_argument("--curve-server-key", help="the daemon's public CURVE certificate (.key)")
    events.add_argument("--curve-key", help="this client's secret CURVE certificate (.key_secret)")
    events.set_defaults(func=_cmd_events)

    keygen = sub.add_parser(
        "keygen", help="write a CURVE key pair: NAME.key (public) and NAME.key_secret"
    )
    keygen.add_argument("directory", help="where to write them (created mode 0700)")
    keygen.add_argument("name", help="file name stem, e.g. the host or client name")
    keygen.set_defaults(func=_cmd_keygen)

    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("path")
    check.set_defaults(func=_cmd_check_config)

    bench = sub.add_parser("bench", help="run a benchmark and print its figures")
    bench.add_argument(
        "which", choices=["control", "data", "l3", "ranks", "cuda", "scale", "adopt"]
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--endpoint", help="use this daemon instead of the default one")
    bench.add_argument("--requests", type=int, default=2000, help="timed requests per client")
    bench.add_argument("--pages", type=int, default=256, help="data, cuda: pages per copy")
    bench.add_argument("--page-bytes", type=int, default=65536, help="data, cuda: bytes per page")
    bench.add_argument("--backend", default="file", help="l3: file, s3 or mooncake")
    bench.add_argument("--mib", type=int, default=128, help="l3: MiB moved per page size")
    bench.add_argument("--rounds", type=int, default=5, help="l3: paired read rounds")
    bench.add_argument(
        "--pool-mib", type=int, default=16384, help="adopt: MiB of the pool that is filled"
    )
    bench.add_argument(
        "--no-million",
        dest="million",
        action="store_false",
        help="adopt: leave out the case of a million 4 KiB pages",
    )
    bench.add_argument(
        "--read-processes",
        type=int,
        default=None,
        help="l3 file: the store's reader processes (default: storage.file.read_processes)",
    )
    bench.add_argument(
        "--s3-endpoint", default="", help="l3: use this S3 endpoint (default: start one)"
    )
    bench.add_argument("--s3-bucket", default="hicached-bench", help="l3: bucket at --s3-endpoint")
    bench.add_argument(
        "--mooncake-master", default="", help="l3: use this master (default: start one)"
    )
    bench.add_argument(
        "--mooncake-metadata", default="", help="l3: metadata server of --mooncake-master"
    )
    bench.add_argument(
        "--plot", default="", help="also draw the figures beside their baselines into this PNG"
    )
    bench.add_argument("--pool-gib", type=int, default=16, help="scale: pool size for attach")
    bench.add_argument(
        "--hugetlbfs", default="", help="scale: a hugetlbfs mount for the huge-page attach figures"
    )
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except HicachedError as exc:
        print(f"hicached {args.command}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
