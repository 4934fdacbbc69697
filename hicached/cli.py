"""The ``hicached`` command: serve, status, check-config, keygen, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

import msgspec

from hicached.config import load_config
from hicached.errors import HicachedError


def _cmd_serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    logging.basicConfig(
        level=config.log.level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from hicached.server import serve

    serve(config)
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    config = load_config(args.path)
    if config.storage.backend:
        # the backend must be installed, and its options valid as a whole: what
        # its start would refuse (a missing bucket, ...) fails here already
        from hicached.storage import backend_options
        from hicached_backends import load_backend_class

        backend_options(config, load_backend_class(config.storage.backend))
    print(f"{args.path}: ok")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from hicached.client import Client, CurveKeys

    curve = None
    if args.curve_server_key or args.curve_key:
        if not (args.curve_server_key and args.curve_key):
            raise SystemExit("--curve-server-key and --curve-key go together")
        curve = CurveKeys.load(args.curve_server_key, args.curve_key)
    with Client(
        args.endpoint,
        timeout=args.timeout,
        name="hicached-status",
        curve=curve,
        map_pool=False,  # status needs no slots, and may ask another host
    ) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(msgspec.to_builtins(stats), indent=2, sort_keys=True))
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
    if stats.l3_backend:
        lines.append(
            f"L3:         {stats.l3_backend} {stats.l3_state}, {stats.l3_pages_known} pages known; "
            + _pairs(stats.l3)
        )
    lines.append(f"metrics:    {stats.metrics_endpoint or 'off'}")
    print("\n".join(lines))
    return 0


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
    serve.set_defaults(func=_cmd_serve)

    status = sub.add_parser("status", help="show what a running daemon holds")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--endpoint", help="daemon endpoint (default: $HICACHED_ENDPOINT or the default ipc socket)"
    )
    status.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the daemon")
    status.add_argument("--curve-server-key", help="the daemon's public CURVE certificate (.key)")
    status.add_argument("--curve-key", help="this client's secret CURVE certificate (.key_secret)")
    status.set_defaults(func=_cmd_status)

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
    bench.add_argument("which", choices=["control", "data", "l3", "ranks", "cuda"])
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--endpoint", help="use this daemon instead of the default one")
    bench.add_argument("--requests", type=int, default=2000, help="timed requests per client")
    bench.add_argument("--pages", type=int, default=256, help="data, cuda: pages per copy")
    bench.add_argument("--page-bytes", type=int, default=65536, help="data, cuda: bytes per page")
    bench.add_argument("--backend", default="file", help="l3: file, s3 or mooncake")
    bench.add_argument("--mib", type=int, default=128, help="l3: MiB moved per page size")
    bench.add_argument("--rounds", type=int, default=5, help="l3: paired read rounds")
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
