"""Engine-side client: what both transports share (client/sync.py, client/aio.py).

``Client`` is synchronous and ``AsyncClient`` is for asyncio; both run the
same exchange logic (hello, namespace registration, transparent re-hello and
re-registration after a daemon restart) and differ only in how they wait.
A ``Client`` may be shared by threads: its calls take turns, each waiting at
most its ``timeout`` for its turn, and ``close()`` ends a call another thread
waits in. An ``AsyncClient`` belongs to one event loop at a time. A client
made before a fork refuses calls in the child: make one there.

Typical use::

    with hicached.Client() as c:
        ns = c.register(model="org/m", kv_dtype="bfloat16", layout="layer_first",
                        page_tokens=64, page_bytes=65536)
        c.store(ns, tokens, pages)          # pages: (n_full_pages, page_bytes)
        hit = c.match(ns, tokens)
        data = c.read_pages(hit)
        c.release(hit)

Copies go through handles (client/handles.py, client/mapping.py); a stale handle gives a
miss or a clear error, never another key's bytes. The pool a client maps, and the
one of a daemon instance before a restart, are client/poolview.py's. A call to a daemon that is
not running fails at once with ``DaemonUnavailable``.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import os
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar, cast

import msgspec
import numpy as np

from hicached.client.dealer import CurveKeys, Dealer, _Process
from hicached.client.handles import (
    TOKEN_WRITE,
    Fetch,
    FetchProgress,
    Hit,
    KeysFound,
    LeaseState,
    Namespace,
    PortableHandle,
    Reservation,
    check_kind,
)
from hicached.client.mapping import lease_margin
from hicached.client.poolview import PoolView
from hicached.client.report import GatherReporter
from hicached.config import check_endpoint, default_endpoint
from hicached.errors import (
    BadRequest,
    ForeignLease,
    HicachedError,
    LeaseEnded,
    SessionLost,
    StaleHandle,
    UnknownLease,
    VersionMismatch,
)
from hicached.wire import protocol as p
from hicached.wire.hashing import pack_tokens
from hicached.wire.namespace import EventMeta, NamespaceSpec

__all__ = ["CurveKeys", "Exchange"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=p.Reply)
# Tries of a request whose session the daemon forgot (restart, or a full session
# table that made room): each says hello again first.
_SESSION_TRIES = 3
_decode, _encode = p.reply_decoder.decode, p.encode
# exists_keys' ``where`` byte of each key to its L2 and its L3 flag (bytes.translate)
_IN_L2 = bytes(b & 1 for b in range(256))
_IN_L3 = bytes(b >> 1 & 1 for b in range(256))
_MAX_WAIT_S = 1e9  # the longest timeout: about 31 years, a deadline that still fits
Exchange = Generator[p.Request, p.AnyReply, Any]


class _Core(Dealer):
    """What both clients share: state, message building and the exchange logic."""

    def __init__(
        self,
        endpoint: str | None,
        timeout: float,
        name: str,
        curve: CurveKeys | None,
        map_pool: bool,
        connect_timeout: float,
        prefault: bool = False,
        max_reply_bytes: int = p.MAX_REPLY_BYTES,
    ) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.prefault = prefault  # fault the pool mapping in on a thread of its own
        try:
            check_endpoint(self.endpoint, remote=curve is not None)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self.curve = curve
        self.map_pool = map_pool
        for what, seconds in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            # a request's deadline goes out in ms since the epoch, in a 64-bit integer
            if not (math.isfinite(seconds) and 0 < seconds <= _MAX_WAIT_S):
                raise BadRequest(
                    f"{what} must be a positive number of seconds up to {_MAX_WAIT_S:.0e}, "
                    f"got {seconds}"
                )
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        if type(max_reply_bytes) is not int or max_reply_bytes < p.MIN_REPLY_BYTES:
            raise BadRequest(
                f"max_reply_bytes must be a whole number of bytes >= {p.MIN_REPLY_BYTES}, "
                f"got {max_reply_bytes!r}"
            )
        self.max_reply_bytes = max_reply_bytes  # larger messages drop the connection
        self.name = name or f"pid-{os.getpid()}"
        self._forks = _Process.forks  # this client's sockets belong to this process
        self._closing = False  # close() began: no call goes out any more
        self._ids = itertools.count(1)
        self._hello: p.HelloOk | None = None
        self._pool = PoolView()  # mapped at each hello with map_pool
        self._namespaces: list[Namespace] = []
        self._instance = 0
        self._max_pages = 0  # the last hello's server.max_pages_per_request
        self._max_message = 0  # and its server.max_message_bytes
        self._margin = 1.0  # seconds before a lease's deadline that copies stop
        self._reporter = GatherReporter()  # this process's gather pick, told the daemon

    # -- exchanges ------------------------------------------------------------

    def _exchange(
        self, make: Callable[[], p.Request], expect: type[R], instance: int = 0
    ) -> Generator[p.Request, p.AnyReply, R]:
        """Send ``make()``; re-hello and retry once if the daemon forgot this client
        (``instance``: that of the lease the request is bound to, if any)."""
        for attempt in range(_SESSION_TRIES):
            if self._hello is None:
                yield from self._handshake()
            self._same_instance(instance)
            reply = yield make()
            if isinstance(reply, expect):
                return reply
            self._refused(reply, expect, attempt)
        raise SessionLost("the daemon keeps forgetting this client")  # pragma: no cover

    def _same_instance(self, instance: int) -> None:
        """Raise ``LeaseEnded`` if a request bound to a lease of ``instance`` (0:
        none) would go to another daemon instance: after a restart, the call's
        hello went to a daemon that never granted the lease."""
        if instance and instance != self._instance:
            raise LeaseEnded(
                "the daemon restarted since this lease was granted: the lease ended with it"
            )

    def _refused(self, reply: p.AnyReply, expect: type[R], attempt: int) -> None:
        """A reply other than the ``expect`` asked for: its error is raised, unless
        the daemon forgot this session and the request may go again after a new
        hello (``attempt``: how many went before)."""
        if isinstance(reply, p.Error):
            if reply.code == SessionLost.code and attempt < _SESSION_TRIES - 1:
                self._hello = None
                return
            raise reply.to_exception()
        got = type(reply).__name__
        raise HicachedError(f"expected {expect.__name__} from the daemon, got {got}")

    def _handshake(self) -> Exchange:
        reply = yield p.Hello(
            id=0, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR, client=self.name, pid=os.getpid()
        )
        if isinstance(reply, p.Error):
            raise reply.to_exception()
        if not isinstance(reply, p.HelloOk):  # not a daemon, or a broken one
            raise HicachedError(
                f"expected HelloOk from the daemon at {self.endpoint}, got "
                f"{type(reply).__name__}: is a hicached daemon there?"
            )
        if reply.major != p.PROTOCOL_MAJOR:  # a daemon refuses a client's other major
            raise VersionMismatch(
                f"the daemon at {self.endpoint} speaks protocol {reply.major}.{reply.minor}; "
                f"this client speaks {p.PROTOCOL_MAJOR}.{p.PROTOCOL_MINOR}"
            )
        if self.map_pool:  # this daemon's pool; a restarted one's old pool is kept a while
            self._pool.hello(reply, prefault=self.prefault)
        renumber = reply.instance != self._instance
        self._instance = reply.instance
        self._max_pages = reply.max_pages_per_request
        self._max_message = reply.max_message_bytes
        self._margin = lease_margin(reply.lease_ttl_s)
        self._check_reply_bound(reply)
        self._reporter.new_session()
        # The namespaces again, before the session counts as open (``_hello``):
        # until then no request of this exchange goes out, and none ever
        # carries an id of the daemon before. One that cannot be registered
        # keeps id 0, which no daemon gives: its requests fail
        # (UnknownNamespace), the others' go on; the call that said hello
        # raises why. Ids of this very instance stay: an AsyncClient's task
        # whose exchange met the lost session says hello while others may be
        # saying theirs (in connect), and a reset by the later hello would
        # send the first task's request as namespace 0.
        for ns in self._namespaces if renumber else ():
            ns.id = 0
        refused: p.Error | None = None
        for ns in self._namespaces:
            ok = yield _register_msg(ns.spec, ns.events, reply.minor)
            if isinstance(ok, p.Error):
                refused = refused or ok
                continue
            if not isinstance(ok, p.NamespaceOk):
                got = type(ok).__name__
                raise HicachedError(f"expected NamespaceOk from the daemon, got {got}")
            ns.id = ok.ns
        self._hello = reply
        if refused is not None:
            raise refused.to_exception()

    def _check_reply_bound(self, hello: p.HelloOk) -> None:
        """Warn when this daemon's limits allow replies over ``max_reply_bytes``:
        the libzmq of this client would refuse them, dropping the connection,
        and a call over that many pages would end at its timeout."""
        largest = hello.max_pages_per_request * p.REPLY_BYTES_PER_PAGE + p.REPLY_BYTES_BESIDE_PAGES
        if largest > self.max_reply_bytes:
            log.warning(
                "the daemon at %s takes requests of up to %d pages, whose replies may be "
                "larger than this client's max_reply_bytes (%d): give the client a "
                "max_reply_bytes of %d or more",
                self.endpoint,
                hello.max_pages_per_request,
                self.max_reply_bytes,
                largest,
            )

    def _register(
        self, spec: NamespaceSpec | None, fields: dict[str, Any], events: EventMeta | None = None
    ) -> Exchange:
        if spec is None:
            try:
                spec = msgspec.convert(fields, NamespaceSpec)
            except msgspec.ValidationError as exc:
                raise BadRequest(f"namespace: {exc}") from None
        elif fields:
            raise TypeError("pass either a NamespaceSpec or its fields, not both")
        ok = yield from self._exchange(
            lambda: _register_msg(spec, events, self._minor()),
            p.NamespaceOk,
        )
        for ns in self._namespaces:
            if ns.digest == ok.digest:
                ns.id = ok.ns
                ns.events = events or ns.events
                return ns
        ns = Namespace(spec, ok.ns, ok.digest, events)
        self._namespaces.append(ns)
        return ns

    def _deadline(self, sent: float) -> float:
        """A lease granted for a request sent at ``sent`` (monotonic): when copies stop."""
        hello = self._hello
        ttl = hello.lease_ttl_s if hello is not None else 0.0
        return sent + ttl - self._margin

    def _gens(self, offsets: list[int]) -> Any:
        mapping = self._pool.current
        if mapping is None or not offsets:
            return np.empty(0, dtype=np.uint32)
        return mapping.snapshot(offsets)

    def _reserve(self, ns: Namespace, tokens: Any) -> Exchange:
        packed = pack_tokens(tokens)
        sent = time.monotonic()
        ok = yield from self._exchange(
            lambda: p.Reserve(id=0, ns=ns.id, tokens=packed), p.ReserveOk
        )
        return Reservation(
            ns,
            ok.lease,
            ok.present,
            ok.offsets,
            ok.pool_full,
            self._instance,
            LeaseState(self._deadline(sent)),
            self._gens(ok.offsets),
        )

    def _commit(
        self, res: Reservation | Fetch, pages: int | None, ok: Sequence[bool] | None = None
    ) -> Exchange:
        check_kind(res, (Reservation, Fetch), "commit", "a Reservation or a Fetch (from prefetch)")
        mask = b""
        if ok is not None:
            if not isinstance(res, Reservation) or len(ok) != len(res.offsets):
                raise BadRequest("ok takes one flag per fresh slot of a key-addressed reservation")
            mask = bytes(bool(flag) for flag in ok)
        if isinstance(res, Reservation):
            _own(res, "commit")
            res.state.closed = True
        if not res.lease:
            return p.CommitOk(id=0, published=0, duplicates=0)
        if res.instance != self._instance:
            raise UnknownLease("the daemon restarted since this reservation; reserve again")
        count = -1 if pages is None else pages
        return (
            yield from self._exchange(
                lambda: p.Commit(id=0, lease=res.lease, pages=count, mask=mask),
                p.CommitOk,
                res.instance,
            )
        )

    # -- key-addressed namespaces -------------------------------------------------

    @staticmethod
    def _found(ok: p.ExistsKeysOk) -> KeysFound:
        where = ok.where  # per key: 1 in L2, 2 in L3
        l2, l3 = where.translate(_IN_L2), where.translate(_IN_L3)
        return KeysFound(ok.l2, ok.leading, _flags(l2), _flags(l3))

    def _reserve_keys(self, ns: Namespace, keys: Sequence[bytes], parent: bytes | None) -> Exchange:
        wire, up = _keys(keys), _parent(parent)
        sent = time.monotonic()
        ok = yield from self._exchange(
            lambda: p.ReserveKeys(id=0, ns=ns.id, keys=wire, parent=up), p.ReserveKeysOk
        )
        return Reservation(
            ns,
            ok.lease,
            0,
            ok.offsets,
            ok.pool_full,
            self._instance,
            LeaseState(self._deadline(sent)),
            self._gens(ok.offsets),
            indices=ok.indices,
            present_mask=[bool(b) for b in ok.present],
        )

    @property
    def instance(self) -> int:
        """The daemon instance this client last spoke to (0 before it connected)."""
        return self._instance

    @property
    def max_pages(self) -> int:
        """The most pages (keys) one request may cover at the daemon this client
        last said hello to (its ``server.max_pages_per_request``; longer ones
        are refused as TooLarge); 0 before the first hello."""
        return self._max_pages

    def pages_per_request(self, page_bytes: int) -> int:
        """The most pages one request may name where each takes ``page_bytes``
        of it (a page's tokens: 4 bytes a token): the daemon's
        ``server.max_pages_per_request``, or fewer where more would be over its
        ``server.max_message_bytes`` (refused as TooLarge); 0 before the first
        hello."""
        if not self._max_pages:
            return 0
        fits = (self._max_message - p.REQUEST_BYTES_BESIDE_PAGES) // max(page_bytes, 1)
        return max(1, min(self._max_pages, fits))

    def keys_per_request(self, keys: Sequence[bytes]) -> int:
        """The most of ``keys`` (or keys as long as its longest) one request may
        name (``pages_per_request``); 0 before the first hello. Each key counts
        as the wire carries it: an "S" array's keys are whole rows, trailing
        NULs and all, which its items drop."""
        longest = max(map(len, _keys(keys)), default=0)
        return self.pages_per_request(longest + p.KEY_FRAMING_BYTES)

    @property
    def protocol(self) -> tuple[int, int] | None:
        """The (major, minor) protocol of the daemon this client's session is open
        with; None without a session (not connected, or only a probe answered)."""
        return None if self._hello is None else (self._hello.major, self._hello.minor)

    def _minor(self) -> int:
        """The minor protocol version of the daemon the session is open with (0
        without one): what a request may carry."""
        return self._hello.minor if self._hello else 0

    def adopt(self, handle: PortableHandle) -> Reservation | Hit:
        """A copy-only handle from another process's ``portable()`` (same host, same
        daemon): write_pages/read_pages through it, while the process that holds
        the lease commits or releases it. Copies through it are fenced as any;
        ``Client.adopt`` first catches up with a daemon that restarted."""
        check_kind(handle, PortableHandle, "adopt", "a PortableHandle (from portable())")
        retired = handle.kind == "read" and self._pool.retired(handle.instance) is not None
        if self._hello is None or (handle.instance != self._instance and not retired):
            raise StaleHandle("this handle is from another daemon instance than this client's")
        if handle.kind not in ("write", "read"):
            raise BadRequest(f"a portable handle is of kind 'write' or 'read', not {handle.kind!r}")
        if handle.kind == "write" and not handle.spec.keyed:
            raise BadRequest(TOKEN_WRITE)
        if handle.spec.page_bytes < 1:
            raise BadRequest(f"a portable handle of pages of {handle.spec.page_bytes} bytes")
        if len(handle.gens) != 4 * len(handle.offsets):  # uint32 each
            raise BadRequest("a portable handle needs one generation per offset")
        gens = np.frombuffer(handle.gens, dtype=np.uint32).copy()
        ns = Namespace(handle.spec, 0, b"")
        state = LeaseState(self._adopted_deadline(handle))
        offsets = list(handle.offsets)
        if handle.kind == "write":
            return Reservation(
                ns, handle.lease, 0, offsets, False, handle.instance, state, gens, view=True
            )
        hits = len(offsets)
        return Hit(ns, hits, offsets, handle.lease, handle.instance, 0, state, gens, view=True)

    def _adopted_deadline(self, handle: PortableHandle) -> float:
        """When copies through an adopted handle stop: its deadline, which no
        lease of the daemon this client speaks to passes by more than its
        ``lease_ttl_s`` from now (the lease was granted or renewed before the
        handle was made). Copies must stop before a lease's end: the
        quarantine of an expired write lease's slots covers only a late
        copy's margin, so a deadline that is not a number, or past any lease
        of the daemon, would let a write land in a reused page."""
        if math.isnan(handle.deadline):
            raise BadRequest("a portable handle's deadline is not a number")
        if handle.instance != self._instance:  # an earlier daemon's read handle
            return handle.deadline  # served while its pool's leases may live (poolview.py)
        return min(handle.deadline, self._deadline(time.monotonic()))

    def _hit(self, ns: Namespace, ok: p.MatchOk, sent: float) -> Hit:
        if not ok.lease:
            return Hit(ns, ok.hits, ok.offsets, 0, self._instance, ok.l3_hits)
        return Hit(
            ns,
            ok.hits,
            ok.offsets,
            ok.lease,
            self._instance,
            ok.l3_hits,
            LeaseState(self._deadline(sent)),
            self._gens(ok.offsets),
        )

    def _renew(self, handle: Reservation | Hit) -> Exchange:
        check_kind(handle, (Reservation, Hit), "renew", "a Reservation or a Hit")
        if handle.closed or not handle.lease or handle.instance != self._instance:
            raise UnknownLease("this handle holds no open lease to renew")
        sent = time.monotonic()
        ok = yield from self._exchange(
            lambda: p.Renew(id=0, lease=handle.lease), p.RenewOk, handle.instance
        )
        handle.state.deadline = sent + ok.ttl_s - self._margin  # for every view of it too
        return None

    def _progress(self, pf: Fetch) -> Exchange:
        check_kind(pf, Fetch, "progress", "a Fetch (from prefetch)")
        if not pf.lease:
            return FetchProgress(planned=0, completed=0, done=True, failed=False)
        if pf.instance != self._instance:
            raise UnknownLease("the daemon restarted since this prefetch; start it again")
        ok = yield from self._exchange(
            lambda: p.Progress(id=0, lease=pf.lease), p.ProgressOk, pf.instance
        )
        return FetchProgress(ok.planned, ok.completed, ok.done, ok.failed)

    def _release(self, handle: Reservation | Hit | Fetch) -> Exchange:
        send, ours = self._releasing(handle), True  # a view is refused before anything
        try:
            if send:
                yield from self._exchange(
                    lambda: p.Release(id=0, lease=handle.lease), p.Ok, handle.instance
                )
        except LeaseEnded:
            pass  # it ended with the daemon that granted it: released
        except ForeignLease:
            ours = False
            raise
        finally:
            if ours:
                _released(handle)
        return None

    def _left_open(self, handle: Reservation | Hit | Fetch, exc: BaseException) -> bool:
        """Whether ``handle``'s lease may still be open at the daemon after the
        request that was to end it failed with ``exc`` (it may not have gone
        out, or not in time): not when the daemon said it is not open or not
        this client's, or when it ended with the daemon that granted it."""
        if isinstance(exc, (UnknownLease, ForeignLease)):
            return False
        return bool(handle.lease) and handle.instance == self._instance

    def _releasing(self, handle: Reservation | Hit | Fetch) -> bool:
        """Whether the daemon must be asked to end ``handle``'s lease (not when it
        holds none, or when it ended with the daemon that granted it); a view
        made by select() is refused."""
        check_kind(handle, (Reservation, Hit, Fetch), "release", "a Reservation, a Hit or a Fetch")
        if not isinstance(handle, Fetch):
            _own(handle, "release")
        return bool(handle.lease) and handle.instance == self._instance

    def _stats(self, session: bool = True) -> Exchange:
        if not session and self._hello is None:  # a probe: answered without a session
            reply = yield p.Stats(id=0)
            if isinstance(reply, p.StatsOk):
                return reply.stats
            if not (isinstance(reply, p.Error) and reply.code == SessionLost.code):
                self._refused(reply, p.StatsOk, _SESSION_TRIES)  # raises its error
        ok = yield from self._exchange(lambda: p.Stats(id=0), p.StatsOk)
        if ok.stats.instance != self._instance:
            # answered without this client's session (stats needs none): the daemon
            # restarted, so say hello to the new one, as any other call would
            self._hello = None
            ok = yield from self._exchange(lambda: p.Stats(id=0), p.StatsOk)
        return ok.stats


def _keys(keys: Sequence[bytes]) -> list[bytes]:
    """Engine keys as the wire carries them (bytes each; the daemon checks lengths)."""
    if isinstance(keys, np.ndarray) and keys.dtype.kind == "S":
        # numpy's fixed-size bytes drop trailing NULs as items: take whole rows
        width = keys.dtype.itemsize
        return [row.tobytes() for row in keys.reshape(-1).view(np.uint8).reshape(-1, width)]
    wire = list(keys)  # once: ``keys`` may be a one-shot iterable
    if list(map(type, wire)).count(bytes) == len(wire):  # the common case, at C speed
        return wire
    if any(isinstance(key, str) for key in wire):
        raise BadRequest("keys are bytes: encode text keys (bytes.fromhex for hex digests)")
    if any(_number(key) for key in wire):
        # bytes(n) is n zero bytes: the page of another key, or gigabytes of zeros
        raise BadRequest(
            "keys are bytes, not numbers: encode a numeric hash (n.to_bytes(8, 'big'))"
        )
    return [bytes(key) for key in wire]


def _parent(parent: bytes | None) -> bytes:
    """A reservation's parent key as sent (none: empty); a number is refused."""
    if _number(parent):
        raise BadRequest("parent is a key's bytes, not a number (bytes(n) is n zero bytes)")
    return bytes(parent or b"")


def _number(key: object) -> bool:
    """An integer (Python's, numpy's, or a 0-d numpy array): no key's bytes."""
    return isinstance(key, numbers.Integral) or (isinstance(key, np.ndarray) and key.ndim == 0)


def _own(handle: Reservation | Hit, what: str) -> None:
    """Views made by select() copy; only the handle the daemon gave ends its lease."""
    if handle.view:
        raise BadRequest(f"{what} the handle the daemon gave, not a view made by select()")


def _flags(flags: bytes) -> list[bool]:
    """Bytes of 0 and 1 as a list of bools, at C speed (read as C bools)."""
    return cast(list[bool], memoryview(flags).cast("?").tolist())


def _released(handle: Reservation | Hit | Fetch) -> None:
    """A handle's lease ended here, or had ended before: copies through it stop
    (unless the daemon said the lease is another client's)."""
    if not isinstance(handle, Fetch):
        handle.state.closed = True


def _run(gen: Exchange, roundtrip: Callable[[p.Request], p.AnyReply]) -> Any:
    try:
        request = next(gen)
        while True:
            request = gen.send(roundtrip(request))
    except StopIteration as stop:
        return stop.value


def _prefetch_keys_msg(
    ns: int, keys: list[bytes], max_pages: int, parent: bytes | None, minor: int
) -> p.PrefetchKeys:
    """A prefetch of ``keys``: with the key before them (``parent``) for a daemon
    of protocol 1.11 or later, without for an older one, which refuses fields
    it does not know (its first page read then has no parent)."""
    if minor < p.PREFETCH_PARENT_MINOR:
        parent = None
    return p.PrefetchKeys(id=0, ns=ns, keys=keys, max_pages=max_pages, parent=parent or b"")


def _register_msg(spec: NamespaceSpec, events: EventMeta | None, minor: int) -> p.RegisterNamespace:
    """The registration of ``spec``: with its event metadata for a daemon of
    protocol 1.6 or later, without for an older one, which refuses fields it
    does not know (its events then name no KV cache spec kind)."""
    if minor < p.EVENT_META_MINOR:
        events = None
    return p.RegisterNamespace(id=0, spec=spec, events=events)
