"""Write the unit's drop-in of ReadWritePaths= for a config's paths.

The unit makes the file system read-only (ProtectSystem=strict) except its
own directories: /run/hicached, /var/lib/hicached (the defaults of
server.runtime_dir and storage.data_dir) and /dev/shm (pool.shm_dir). A
config that puts the store, the pool or a socket elsewhere needs those paths
writable too; `make install-service` runs this script with the installed
venv's python:

    python systemd/hicached-paths.py CONFIG DROPIN [--create]

It writes DROPIN (hicached.service.d/50-paths.conf) when some path is
needed, removes a stale one when none is, and with --create makes missing
directories (owner hicached, group hicached-clients, mode 0700; the daemon
opens a socket directory to that group itself), all but pool.shm_dir, which
must be a tmpfs already. Run it again, then `systemctl daemon-reload`, after
moving a path in the config.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from hicached.config import load_config
from hicached.errors import ConfigError

UNIT_OWN = (Path("/run/hicached"), Path("/var/lib/hicached"), Path("/dev/shm"))
HIDDEN = (Path("/home"), Path("/root"), Path("/run/user"), Path("/tmp"), Path("/var/tmp"))
USER, GROUP = "hicached", "hicached-clients"


def needed_paths(config_path: Path) -> list[Path]:
    """Directories the daemon writes that the unit does not already allow."""
    config = load_config(config_path)
    found: list[Path] = []
    for value in (
        config.storage.data_dir,
        config.storage.file.path,
        config.pool.shm_dir,
        config.server.runtime_dir,
    ):
        if value:
            found.append(Path(value))
    for endpoint in (config.server.endpoint, config.events.endpoint, config.events.replay_endpoint):
        if endpoint.startswith("ipc://"):
            found.append(Path(endpoint[len("ipc://") :]).parent)
    paths: list[Path] = []
    for path in found:
        if any(path == own or own in path.parents for own in UNIT_OWN) or path in paths:
            continue
        paths.append(path)
    return paths


def render(paths: list[Path]) -> str:
    lines = [
        "# Written by systemd/hicached-paths.py from the config: paths the daemon",
        "# writes outside the unit's own directories.",
        "[Service]",
    ]
    lines += [f"ReadWritePaths={path}" for path in paths]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("dropin", type=Path)
    parser.add_argument("--create", action="store_true", help="make missing directories")
    args = parser.parse_args(argv)
    try:
        paths = needed_paths(args.config)
    except ConfigError as exc:
        print(f"hicached-paths: {exc.message}", file=sys.stderr)
        return 2
    for path in paths:
        if any(path == hidden or hidden in path.parents for hidden in HIDDEN):
            print(
                f"hicached-paths: {path} is hidden from the service (ProtectHome=, "
                "PrivateTmp=): choose a path outside /home, /root, /run/user and /tmp",
                file=sys.stderr,
            )
            return 2
    if not paths:
        if args.dropin.exists():
            args.dropin.unlink()
            print(f"hicached-paths: removed {args.dropin} (no path outside the unit's own)")
        return 0
    args.dropin.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    args.dropin.write_text(render(paths))
    args.dropin.chmod(0o644)
    print(f"hicached-paths: wrote {args.dropin}: ReadWritePaths={' '.join(map(str, paths))}")
    if args.create:
        shm_dir = Path(load_config(args.config).pool.shm_dir)
        for path in paths:
            if path == shm_dir and not path.is_dir():
                print(f"hicached-paths: pool.shm_dir {path} does not exist: mount a tmpfs there")
            elif not path.exists():
                path.mkdir(mode=0o700, parents=True)
                shutil.chown(path, USER, GROUP)
                print(f"hicached-paths: created {path} ({USER}:{GROUP}, 0700)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
