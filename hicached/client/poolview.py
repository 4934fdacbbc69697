"""One client's view of the daemon's pool, across daemon restarts.

A client maps the pool of the daemon instance it speaks to (client/mapping.py
holds the mapping and the fenced copies). When the daemon restarts and adopts the
pool of the one before it (same file, same ``pool_id``), the mapping stays:
read handles of the old instance keep working where the slots' generations
say the pages are unchanged, writes through its handles are refused. When the
new instance has a pool of its own, the old one stays mapped until every read
lease it granted has ended, so that a read through one of its handles (by a
worker that adopted it before the restart was known) is served, not failed.
Nothing writes that pool any more (its daemon serves no requests), so its
pages hold the bytes of their keys; its generations still fence every read.
Writes through its handles are refused. Only the latest such pool is kept.

The view also remembers whether CUDA registration was asked for
(``pin_memory``), so that every pool mapped after a restart is pinned too.

Tenant arenas: the daemon names the client's tenant's arena file, and where its
first slot lies in the daemon's pool (``pool_base``); the mapping translates
offsets (client/mapping.py). A connection whose tenant has no arena maps
nothing, and copies are refused, saying why.
"""

from __future__ import annotations

import threading
import time

from hicached.client.mapping import PoolMapping
from hicached.errors import VersionMismatch
from hicached.wire import protocol as p
from hicached.wire.arena import Arena


class PoolView:
    """The mapping of the current daemon instance's pool, and the one before."""

    def __init__(self) -> None:
        self.current: PoolMapping | None = None
        self._retired: tuple[PoolMapping, float] | None = None  # and until when it may be read
        self._pin = False  # pin() was asked for
        self._lease_ttl = 0.0  # of the daemon last spoken to: its read leases' longest life
        self.unmapped = ""  # why the daemon gave no pool to map ("": it did, or no hello yet)

    def hello(self, reply: p.HelloOk, *, prefault: bool) -> None:
        """A daemon answered hello: map its pool unless it is the one mapped now
        (the one before is retired); ``prefault`` faults it in on a thread."""
        current = self.current
        self.unmapped = ""
        if not reply.pool_bytes:
            self._retire()
            self.unmapped = (
                "the daemon gives this connection no pool to map: its tenant has no arena "
                "(no tenant lists this client's uid or gid; docs/operations.md, Tenants)"
            )
        elif (
            current is not None
            and reply.instance != current.instance
            and _same_pool(current, reply)
        ):
            # the new daemon adopted this very pool: the mapping stays, and the
            # read handles of the daemon before stay good where generations say so
            current.adopted_by(reply.instance)
        elif current is None or reply.instance != current.instance:
            if not reply.gen_granule:
                raise VersionMismatch(
                    f"the daemon speaks protocol {reply.major}.{reply.minor} and keeps no slot "
                    "generations: upgrade it to map its pool"
                )
            # no faulting here: a large pool maps in one system call (page-table
            # entries come with the copies, or from the prefault thread)
            try:
                arena = Arena.attach(reply.pool_path, reply.pool_bytes, huge_pages=reply.huge_pages)
            except BaseException:
                self._retire()
                raise
            if prefault:
                threading.Thread(
                    target=arena.prefault, name="hicached-prefault", daemon=True
                ).start()
            mapping = PoolMapping(
                arena,
                reply.instance,
                reply.gen_granule,
                pool_id=reply.pool_id,
                base=reply.pool_base,
            )
            # another daemon's pool: kept for its read handles a while; the new
            # one is current from the same moment (copies of other threads never
            # find none)
            self._retire(mapping)
            if self._pin:
                mapping.pin()
        self._lease_ttl = reply.lease_ttl_s

    def pin(self) -> None:
        """Register the current mapping with CUDA, and every one mapped later."""
        self._pin = True
        if self.current is not None:
            self.current.pin()

    def unpin(self) -> None:
        self._pin = False
        if self.current is not None:
            self.current.unpin()

    def _retire(self, new: PoolMapping | None = None) -> None:
        """The current mapping is retired, ``new`` current in its place."""
        mapping, self.current = self.current, new
        if self._retired is not None:
            self._retired[0].close()
            self._retired = None
        if mapping is not None:
            self._retired = (mapping, time.monotonic() + self._lease_ttl)

    def retired(self, instance: int) -> PoolMapping | None:
        """The mapping that serves the read handles of an earlier ``instance``:
        the current one where the daemon adopted that instance's pool, else the
        retired one, while its read leases may live."""
        current = self.current
        if current is not None and instance in current.earlier:
            return current
        retired = self._retired
        if retired is None:
            return None
        mapping, until = retired
        if time.monotonic() >= until:
            self._retired = None
            mapping.close()
            return None
        return mapping if mapping.instance == instance else None

    def close(self) -> None:
        """Unmap both pools (unregistering them from CUDA first)."""
        if self.current is not None:
            mapping, self.current = self.current, None
            mapping.close()
        if self._retired is not None:
            retired, self._retired = self._retired[0], None
            retired.close()


def _same_pool(mapping: PoolMapping, reply: p.HelloOk) -> bool:
    """Whether ``reply``'s daemon serves the pool file ``mapping`` maps."""
    return bool(
        reply.pool_id
        and reply.pool_id == mapping.pool_id
        and reply.pool_path == str(mapping.arena.path)
        and reply.pool_bytes == mapping.arena.size
        and reply.pool_base == mapping.base
        and reply.gen_granule == mapping.granule
    )
