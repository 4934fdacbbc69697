"""Pages between SGLang's host pools and the daemon, for one pool or for
several at once: stores that skip what is stored and publish a page in every
pool of a call or in none, and loads that bring back from L3 what L2 let go.

A call's pools are namespaces of their own (the daemon has no store across
namespaces), so "all or nothing" is as far as one call goes: each pool's
fresh pages are published only where every pool of the call has the same
page stored or written, and a page is reported stored only when it is
published in each. A commit that fails after another pool's went through
leaves that pool's page alone in storage, which no hit counts without the
others (``hits.fold``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hicached.client import Client, KeysFound
from hicached.client.handles import Namespace, Reservation
from hicached.errors import HicachedError, StaleHandle
from hicached.integrations.common import parts
from hicached.integrations.sglang.link import UNREACHABLE, Session
from hicached.integrations.sglang.pages import once

log = logging.getLogger("hicached.integrations.sglang")

Copy = Callable[[Client, Any, int], None]  # (client, handle, index of its first page)


@dataclass(slots=True)
class Move:
    """One pool's part of a call: its keys (page hashes in order: for a
    store each once, ``pages.once``; for a load one per page, repeats and
    all), how to copy a handle's pages (``copy(c, handle, i)``: the handle's
    pages are ``keys[i:]``; None: this pool's pages cannot be copied in this
    call, so none of its keys is done, here or in another pool of the call),
    the key before ``keys[0]`` for a store, and where a store's keys sent
    once are the call's pages (``Once.at``; None: one key a page)."""

    pool: str
    keys: list[bytes]
    copy: Copy | None
    parent: bytes | None = None
    at: list[int] | None = None
    done: list[bool] = field(default_factory=list)  # per key: stored, or read


# -- queries ---------------------------------------------------------------------------


def found(c: Client, ns: Namespace, keys: list[bytes], *, whole: bool = True) -> KeysFound:
    """Where the pages of ``keys`` are, asked in parts of the most keys the
    daemon takes in a request (SGLang asks about a whole request's pages at
    once); ``whole`` False: no part after one that holds a page neither tier
    has (the keys after it are not found), for a leading count alone."""
    cuts = parts(len(keys), c.keys_per_request(keys))
    if len(cuts) <= 1:
        return c.exists_keys(ns, keys)
    l2 = leading = 0
    in_l2: list[bool] = []
    in_l3: list[bool] = []
    for cut in cuts:
        if not whole and leading < cut.start:
            break
        part = c.exists_keys(ns, keys[cut.start : cut.stop])
        l2 += part.l2 if l2 == cut.start else 0
        leading += part.leading if leading == cut.start else 0
        in_l2 += part.in_l2
        in_l3 += part.in_l3
    rest = [False] * (len(keys) - len(in_l2))
    return KeysFound(l2, leading, in_l2 + rest, in_l3 + rest)


# -- stores ----------------------------------------------------------------------------


def store(c: Client, session: Session, moves: list[Move]) -> bool:
    """Store the pages of ``moves`` that neither L2 nor L3 holds, each pool's
    under its parent; set each move's ``done`` (see the module docstring)."""
    opened: list[_Open] = []
    ready: dict[bytes, bool] = {}  # per key: stored or written in every pool of the call
    try:
        for move in moves:
            move.done = [False] * len(move.keys)
            if move.keys and move.copy is not None:
                _reserve(c, session.ns(move.pool), move, opened)
        for job in opened:
            try:
                if job.res.offsets:
                    assert job.move.copy is not None
                    job.move.copy(c, job.res, job.first)
                job.written = True
            except StaleHandle as exc:  # past its deadline: these pages are not stored
                log.info("hicached: a %s reservation went stale: %s", job.move.pool, exc)
            for i in job.res.indices:
                job.move.done[job.first + i] = job.written
        for move in moves:
            for key, ok in zip(move.keys, move.done, strict=True):
                ready[key] = ready.get(key, True) and ok
        while opened:
            job = opened[0]
            mask = [ready[job.move.keys[job.first + i]] for i in job.res.indices]
            c.commit(job.res, ok=mask)
            opened.pop(0)
    finally:
        for job in opened:  # a failure on the way: their leases end now
            with contextlib.suppress(HicachedError, *UNREACHABLE):
                c.release(job.res)
    for move in moves:
        move.done = [ready[key] for key in move.keys]
    return True


@dataclass(slots=True)
class _Open:
    """A reservation of a store, open until its commit."""

    move: Move
    res: Reservation
    first: int  # the reservation's keys are move.keys[first:]
    written: bool = False


def _reserve(c: Client, ns: Namespace, move: Move, opened: list[_Open]) -> None:
    """Mark the leading keys L2 or L3 holds done, and reserve slots for the
    rest (holes allowed: keys in L2 among them are pinned as present), in
    parts of as many keys as the daemon takes in a request, each under the
    key before it; each reservation joins ``opened`` once granted."""
    where = found(c, ns, move.keys)
    have = [a or b for a, b in zip(where.in_l2, where.in_l3, strict=True)]
    first = have.index(False) if False in have else len(have)
    move.done = [i < first for i in range(len(move.keys))]
    for cut in parts(len(move.keys) - first, c.keys_per_request(move.keys)):
        start = first + cut.start
        parent = move.keys[start - 1] if start else move.parent
        res = c.reserve_keys(ns, move.keys[start : first + cut.stop], parent=parent)
        for i, present in enumerate(res.present_mask):
            move.done[start + i] = bool(present)
        opened.append(_Open(move, res, start))


# -- loads -----------------------------------------------------------------------------


def load(c: Client, session: Session, moves: list[Move], wait_s: float) -> bool:
    """Copy out each move's leading pages that L2 holds, then those that come
    back from L3 within ``wait_s`` (for the whole call); set each ``done``,
    and leave a page done only where every move that names it read it. The
    pages go in parts of as many as the daemon takes in a request, each part
    after a whole one. A key named by several pages of a move is fetched from
    L3 once (``pages.once``: the daemon refuses a key twice in a prefetch),
    and each of those pages is copied out of its L2 slot."""
    deadline = time.monotonic() + wait_s
    for move in moves:
        move.done = [False] * len(move.keys)
        if move.copy is None or not move.keys:
            continue
        ns = session.ns(move.pool)
        done = 0
        for cut in parts(len(move.keys), c.keys_per_request(move.keys)):
            keys = move.keys[cut.start : cut.stop]
            got, more = _read(c, ns, move, keys, done)
            # the pages L3 gives back enter L2 under the key before them
            before = move.keys[done + got - 1] if done + got else None
            if more and _prefetch(c, ns, once(keys[got:]).keys, before, deadline):
                got += _read(c, ns, move, keys[got:], done + got)[0]
            done += got
            if got < len(keys):
                break
        move.done = [i < done for i in range(len(move.keys))]
    read: dict[bytes, bool] = {}  # per key: read by every move that names it
    for move in moves:
        here: dict[bytes, bool] = {}  # read at one of its pages at least (the rest: past a miss)
        for key, ok in zip(move.keys, move.done, strict=True):
            here[key] = here.get(key, False) or ok
        for key, ok in here.items():
            read[key] = read.get(key, True) and ok
    for move in moves:
        move.done = [ok and read[key] for key, ok in zip(move.keys, move.done, strict=True)]
    return True


def _read(c: Client, ns: Namespace, move: Move, keys: list[bytes], first: int) -> tuple[int, bool]:
    """Copy the leading pages of ``keys`` that L2 holds: how many, and whether
    L3 holds the next ones."""
    if not keys:
        return 0, False
    assert move.copy is not None
    hit = c.match_keys(ns, keys)
    try:
        if hit.hits:
            move.copy(c, hit, first)
    except StaleHandle as exc:
        log.info("hicached: pages changed while they were read: %d of %d read", exc.valid, hit.hits)
        return exc.valid, False
    finally:
        c.release(hit)
    return hit.hits, hit.hits < len(keys) and hit.l3_hits > 0


def _prefetch(
    c: Client, ns: Namespace, keys: list[bytes], parent: bytes | None, deadline: float
) -> bool:
    """Bring the leading ``keys`` L3 holds into L2 (the first under ``parent``,
    the key before it), waiting until ``deadline`` at most; whether any came."""
    fetch = c.prefetch_keys(ns, keys, parent=parent if parent not in keys else None)
    if not fetch.lease:
        return False
    pause = 0.0005
    try:
        while not (progress := c.progress(fetch)).done and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        if not progress.completed:
            c.release(fetch)
            return False
        c.commit(fetch, pages=progress.completed)
    except BaseException:  # the prefetch's lease ends now, not at its TTL
        with contextlib.suppress(HicachedError, *UNREACHABLE):
            c.release(fetch)
        raise
    return True
