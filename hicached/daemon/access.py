"""Who may reach the daemon's sockets, and as whom: private directories for
ipc sockets (0700, or 0750 and the clients' group, server.client_group; the KV
events' sockets 0660 of events.group where it is set), CURVE on tcp sockets,
and with ``[tenants]`` the ZAP handler that names each request connection's
tenant (daemon/tenants.py)."""

from __future__ import annotations

import errno
import grp
import logging
import os
import socket
import stat
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from hicached.config import Config, runtime_dir
from hicached.daemon.metrics_http import regular_file
from hicached.daemon.tenants import EVENTS_DOMAIN, PeerAuthenticator, TenantMap
from hicached.errors import ConfigError

log = logging.getLogger("hicached")


def ensure_private_dir(
    path: Path, group: int | None = None, *, key: str = "server.client_group", setgid: bool = False
) -> None:
    """Create ``path`` mode 0700, or check that an existing one is ours and private.
    With ``group`` (server.client_group, or events.group as ``key`` says) it is
    0750 and that group's: its members reach the sockets inside, nobody else
    does. ``setgid`` (2750) makes what is bound inside that group's from birth,
    so no chown is needed (the unit's system call filter allows none)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError as exc:  # a file in the way, /proc, a name too long
        raise ConfigError(f"{path}: cannot make it a directory: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} must be a directory, not a link or a file")
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & (0o077 if group is None else 0o027):
        raise ConfigError(
            f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
            f"run chmod {700 if group is None else 750} {path}"
        )
    if group is not None:
        share_with_group(path, group, 0o2750 if setgid else 0o750, key)


def client_group_id(name: str, key: str = "server.client_group") -> int | None:
    """The gid of a group key (server.client_group, events.group): a name or a
    number; None when unset, ConfigError when the host has no such group. A
    number is looked up too: one the host lacks would give a socket to nobody's
    group, and 4294967295, chown's "leave the group as it is", would leave it
    the daemon's own group's."""
    if not name:
        return None
    if name.isascii() and name.isdigit():  # str.isdigit takes "²", which int refuses
        try:
            return grp.getgrgid(int(name)).gr_gid
        except (KeyError, OverflowError):
            raise ConfigError(f"{key}: no group numbered {name} on this host") from None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"{key}: no group named {name!r} on this host") from None


def events_group_id(config: Config) -> int | None:
    """events.group's gid (``client_group_id``). With [tenants] it may not be
    server.client_group's, whose members are every tenant's users: the config
    compares the two strings, this the groups (one named, the other numbered)."""
    gid = client_group_id(config.events.group, "events.group")
    if gid is not None and config.tenants and gid == client_group_id(config.server.client_group):
        raise ConfigError(
            f"events.group: with [tenants] it must not be server.client_group (group {gid}), "
            "whose members are every tenant's users: name a group of the routers' users"
        )
    return gid


def share_with_group(path: Path, group: int, mode: int, key: str = "server.client_group") -> None:
    """Give ``path`` (ours) to ``group`` with ``mode``; no chown when it has that group."""
    try:
        if path.lstat().st_gid != group:
            os.chown(path, -1, group, follow_symlinks=False)
        os.chmod(path, mode)
    except OSError as exc:
        raise ConfigError(
            f"{key}: cannot give {path} to group {group}: {exc.strerror} "
            "(the daemon's user must be in that group)"
        ) from None


def check_passage(directory: Path, group: int, socket: Path) -> None:
    """events.group's members reach ``socket`` only through ``directory`` and every
    directory above it: one that only its owner may pass is a ConfigError (the
    knob could grant nothing); one that only its own group may pass, another
    group, is logged (the members pass it only if they are in that group too)."""
    for where in (directory, *directory.parents):
        st = where.stat()
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o001 or (st.st_gid == group and mode & 0o010):
            continue
        if not mode & 0o010:
            raise ConfigError(
                f"events.group: only its owner may pass {where} (mode {mode:o}), so no "
                f"member of group {group} reaches {socket}: put the events sockets in a "
                "directory of their own that the group may reach (docs/events.md)"
            )
        log.warning(
            "events.group: members of group %d reach %s only if they are in group %d "
            "too, the only group that may pass %s (mode %o)",
            group,
            socket,
            st.st_gid,
            where,
            mode,
        )


def release_stale(path: Path, key: str) -> None:
    """Remove the socket file a daemon before left at ``path``, refusing one a
    process still listens on: binding over it would take that daemon's clients
    (its runtime directory's lock guards only daemons of one runtime
    directory), and a file that is not a socket is nobody's to remove."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{key}: {path} exists and is not a socket; remove it or choose a path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)  # a listener whose backlog is full is still a listener
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:  # nobody listens: left by a daemon that stopped
        path.unlink(missing_ok=True)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno != errno.EAGAIN and not isinstance(exc, TimeoutError):
            raise ConfigError(
                f"{key}: cannot tell whether {path} is in use ({exc.strerror}); "
                "remove it if no daemon listens there"
            ) from None
    finally:
        probe.close()
    raise ConfigError(
        f"{key}: another process listens on {path} (another hicached daemon?); "
        "give each daemon endpoints of its own, or stop that one first"
    )


class Access:
    """The daemon's access control, from its config; ``start`` with the context."""

    def __init__(self, config: Config, endpoint: str) -> None:
        self.config = config
        self.endpoint = endpoint
        self.client_gid: int | None = None  # server.client_group, resolved at start
        self.events_gid: int | None = None  # events.group, resolved at start
        self.auth: ThreadAuthenticator | None = None
        self.curve_keys: tuple[bytes, bytes] | None = None
        self.tenants: TenantMap | None = None  # with [tenants]: who each peer is

    def resolve_group(self) -> int | None:
        """server.client_group's gid (ConfigError when no such group, or no
        group named by events.group)."""
        self.client_gid = client_group_id(self.config.server.client_group)
        self.events_gid = events_group_id(self.config)
        return self.client_gid

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    def start(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Load the daemon's CURVE keys, and start the ZAP handler that admits
        authorized peers and names each request connection's tenant."""
        cfg = self.config
        curve = cfg.curve
        authorized: set[bytes] = set()
        if curve.secret_key_file:
            authorized = self._load_curve()
        elif not cfg.tenants:
            return
        if cfg.tenants:
            keys = self._tenant_keys(authorized)
            self.tenants = TenantMap(cfg.tenants, keys, ipc=self.endpoint.startswith("ipc://"))
        auth = PeerAuthenticator(ctx, self.tenants, authorized)
        auth.start()
        self.auth = auth
        if curve.secret_key_file:
            auth.configure_curve(domain="*", location=curve.authorized_keys_dir)
            log.info("CURVE on tcp:// sockets; authorized keys from %s", curve.authorized_keys_dir)
        if cfg.tenants:
            log.info(
                "tenants %s; a connection's tenant comes from its %s",
                ", ".join(sorted(cfg.tenants)),
                (
                    "uid, then current gid, then its user's groups"
                    if self.endpoint.startswith("ipc://")
                    else "CURVE key"
                ),
            )

    def check(self) -> None:
        """Read what ``start`` reads (the CURVE key files and the tenants' keys),
        starting nothing: ``hicached check-config``."""
        authorized = self._load_curve() if self.config.curve.secret_key_file else set()
        if self.config.tenants:
            self._tenant_keys(authorized)

    def _load_curve(self) -> set[bytes]:
        """The daemon's key pair (kept for binding) and the authorized public keys."""
        curve = self.config.curve
        regular_file(curve.secret_key_file, "curve.secret_key_file")
        try:
            public, secret = zmq.auth.load_certificate(curve.secret_key_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"curve.secret_key_file: cannot read {curve.secret_key_file}: {exc}"
            ) from None
        if not secret:
            raise ConfigError(
                f"curve.secret_key_file: {curve.secret_key_file} holds a public key only; "
                "give the .key_secret file"
            )
        if not Path(curve.authorized_keys_dir).is_dir():
            raise ConfigError(
                f"curve.authorized_keys_dir: {curve.authorized_keys_dir} is not a directory"
            )
        for cert in sorted(Path(curve.authorized_keys_dir).glob("*.key")):
            regular_file(cert, "curve.authorized_keys_dir")
        try:
            authorized = set(zmq.auth.load_certificates(curve.authorized_keys_dir))
        except (OSError, ValueError) as exc:  # a .key file that holds no public key
            raise ConfigError(
                f"curve.authorized_keys_dir: cannot read {curve.authorized_keys_dir}: {exc}"
            ) from None
        self.curve_keys = (public, secret)
        return authorized

    def _tenant_keys(self, authorized: set[bytes]) -> dict[bytes, str]:
        """Z85 public key -> tenant, from the certificates each tenant lists."""
        keys = {}
        for name, tenant in self.config.tenants.items():
            for cert in tenant.curve_keys:
                path = Path(self.config.curve.authorized_keys_dir, cert)  # as is if absolute
                what = f"tenants.{name}.curve_keys"
                regular_file(path, what)
                try:
                    public, _ = zmq.auth.load_certificate(path)
                except (OSError, ValueError) as exc:
                    raise ConfigError(f"{what}: cannot read {path}: {exc}") from None
                if public not in authorized:
                    raise ConfigError(
                        f"{what}: {path} is not authorized: put it in curve.authorized_keys_dir"
                    )
                keys[public] = name
        return keys

    def bind(self, sock: zmq.Socket[bytes], endpoint: str, key: str) -> None:
        """Bind (tcp:// with CURVE when configured) or close the socket and say
        which config key names the endpoint; an ipc:// socket goes to the
        clients' group."""
        self._listen(sock, endpoint, key)
        if endpoint.startswith("ipc://") and self.client_gid is not None:
            share_with_group(Path(endpoint[len("ipc://") :]), self.client_gid, 0o660)

    def _listen(self, sock: zmq.Socket[bytes], endpoint: str, key: str) -> None:
        if endpoint.startswith("tcp://") and self.curve_keys is not None:
            sock.curve_publickey, sock.curve_secretkey = self.curve_keys
            sock.curve_server = True
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"{key}: cannot listen on {endpoint}: {exc}") from None

    def bind_private(self, sock: zmq.Socket[bytes], where: str, key: str) -> None:
        """Bind like ``bind``, an ipc:// socket in a private directory (the KV
        events' sockets). With events.group the socket is 0660 of that group:
        connecting to a unix socket takes write permission on it. Otherwise, with
        tenants, it stays the daemon's user's (0600 in a directory the clients'
        group may pass): the events name every tenant's pages and their token ids,
        and every tenant's users are in the clients' group (docs/events.md). Over
        tcp (CURVE: Config) a key that a tenant lists is refused, and over ipc a
        peer that a tenant lists (``PeerAuthenticator``): a tenant's user may be
        in events.group too."""
        if self.tenants is not None:
            sock.setsockopt(zmq.ZAP_DOMAIN, EVENTS_DOMAIN)
        if not where.startswith("ipc://"):
            self.bind(sock, where, key)
            return
        path = Path(where[len("ipc://") :])
        self._events_dir(path)
        release_stale(path, key)
        self._listen(sock, where, key)
        if self.events_gid is not None:
            share_with_group(path, self.events_gid, 0o660, "events.group")
        elif self.client_gid is not None and not self.config.tenants:
            share_with_group(path, self.client_gid, 0o660)
        elif self.client_gid is not None:
            os.chmod(path, 0o600)  # whatever the umask: the group passes its directory

    def _events_dir(self, socket: Path) -> None:
        """The directory of an events socket: the daemon's own (its runtime
        directory, or its request socket's) keeps the clients' group; any other,
        with events.group, is that group's, 2750 (docs/events.md)."""
        directory, gid = socket.parent, self.events_gid
        own = {runtime_dir(self.config).resolve()}
        if self.endpoint.startswith("ipc://"):
            own.add(Path(self.endpoint[len("ipc://") :]).parent.resolve())
        if gid is None or directory.resolve() in own:
            ensure_private_dir(directory, self.client_gid)
        else:
            ensure_private_dir(directory, gid, key="events.group", setgid=True)
        if gid is not None:
            check_passage(directory, gid, socket)
