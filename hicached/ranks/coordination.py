"""Prefetch coordination: every rank of an instance loads, stops and commits alike.

Engine side. Each rank drives its own daemon prefetches (its KV shard, plus
sidecar pools: a sliding-window pool and a Mamba-style state pool) and calls
``step()`` once per scheduler step. One agreement per step reduces, in one
collective (dist.Agreement):

- MIN: the KV pages ready (L2 hit + verified prefetched pages), and each
  sidecar pool's ready pages, in a fixed named order (``PoolSpec.name``);
- MAX: must-not-terminate, terminated (no end while a sidecar transfer runs).

A rank may end a prefetch only when its stop policy allows it AND every
sidecar transfer is done (a window pool's counts as done once it holds every
page up to this rank's ready KV pages, all a decision can ask of it); the
prefetch ends when no rank must go on, or as soon as any rank has already
ended it: ``terminate()`` was called there, or its KV prefetch is gone (never
started, or the daemon ended it). Then every rank commits exactly the agreed
KV length L, and each sidecar all-or-nothing: a window pool is
committed only if every rank holds the window that ends at L (the pool's
pages before it come along, as the daemon's index keeps prefixes whole), a
state pool only if every rank loaded the state; else the pool is released on
every rank. A pool whose result is missing (the daemon said no, or errored)
counts as 0 pages: handled, not a crash.

With PP, stage 0 decides on the other stages' values of one step before
(ranks/agreement.py). Those only grow while a rank's prefetches hold their pins, so
the decision is one every rank can honour. A rank whose prefetch was lost
in that step (its daemon restarted, or its lease ended), or whose commit
fails, cannot: it releases everything it still holds and raises
PrefetchLost, never a Decision for pages it does not have.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from hicached.client import Client, Fetch, Namespace
from hicached.errors import HicachedError
from hicached.ranks.agreement import Agreement, Fields, Topology
from hicached.wire.hashing import TOKEN_BYTES

log = logging.getLogger("hicached.coordinator")

SITES = ("prefetch.step",)


class PrefetchLost(HicachedError):
    """The ranks agreed on pages this rank no longer holds: a prefetch was lost
    between its last report and the commit, or its commit failed. What is not
    committed by then is released; the engine must not take the decision for
    this request."""

    code = "prefetch_lost"


@dataclass(frozen=True)
class StopPolicy:
    """When a rank is willing to stop waiting for L3.

    best_effort: at once, with what is there; wait_complete: when the KV
    prefetch is complete; timeout: when complete, or after
    min(base_s + per_1k_tokens_s * tokens / 1000, cap_s) seconds.
    """

    kind: Literal["best_effort", "wait_complete", "timeout"] = "timeout"
    base_s: float = 0.5
    per_1k_tokens_s: float = 0.05
    cap_s: float = 5.0

    def deadline_s(self, tokens: int) -> float:
        return min(self.base_s + self.per_1k_tokens_s * tokens / 1000.0, self.cap_s)


@dataclass(frozen=True)
class PoolSpec:
    """A sidecar pool: its agreement field name, this rank's namespace, and how
    many pages it must load to be usable (a window: ceil(window / page_tokens);
    a state: 1). Sidecars are reduced in the order given, by name.

    A window pool is usable at the agreed length L when it holds the ``pages``
    pages ending at L (all L of them when L is shorter): its prefetch reads
    every page after its L2 hit, since the window's place is known only when
    the KV length is agreed, and the daemon indexes a page only with its whole
    prefix. A state pool loads ``pages`` pages after its L2 hit."""

    name: str
    ns: Namespace
    pages: int
    kind: Literal["window", "state"] = "window"

    @classmethod
    def window(cls, name: str, ns: Namespace, window_tokens: int) -> PoolSpec:
        return cls(name, ns, math.ceil(window_tokens / ns.page_tokens), "window")


@dataclass
class Decision:
    """What every rank committed: KV pages (``l2_pages`` of them were already in
    this rank's L2), and which sidecars."""

    kv_pages: int
    sidecars: dict[str, bool]
    steps: int
    reason: str
    waited_s: float
    l2_pages: int = 0


@dataclass
class _Running:
    tokens: int
    started: float
    kv: Fetch | None
    sidecars: dict[str, Fetch | None] = field(default_factory=dict)
    steps: int = 0
    ended: bool = False  # this rank ended it: every rank ends it at the next agreement
    lost: set[str] = field(default_factory=set)  # pools ("kv" too) whose prefetch is gone


class PrefetchCoordinator:
    """Drives one prefetch at a time on this rank, in step with the others."""

    def __init__(
        self,
        client: Client,
        topology: Topology,
        kv: Namespace,
        sidecars: list[PoolSpec] | None = None,
        policy: StopPolicy | None = None,
    ) -> None:
        self.client = client
        self.kv_ns = kv
        self.sidecars = list(sidecars or [])
        names = [p.name for p in self.sidecars]
        if len(set(names)) != len(names) or "kv" in names:
            raise ValueError("sidecar pools need distinct names other than 'kv'")
        self.policy = policy or StopPolicy()
        self.fields = Fields(
            min=("kv", *names),
            max=("must_not_terminate", "terminated"),
            cautious=(("must_not_terminate", 1),),
        )
        self.agreement = Agreement(topology, self.fields, sites=SITES)
        self._run: _Running | None = None
        self.missing_results = 0  # pools whose progress could not be read

    # -- one prefetch ------------------------------------------------------------------

    def start(self, tokens: Any) -> None:
        """Begin loading ``tokens`` on this rank (every rank calls it for the same
        request): as many of their leading pages as the daemon takes in a request
        (its ``server.max_pages_per_request`` in each pool, and the tokens its
        ``server.max_message_bytes`` holds), the most a token namespace holds
        of one sequence."""
        if self._run is not None:
            raise RuntimeError("a prefetch is already running: step() it to the end first")
        tokens = tokens[: self._most_tokens(len(tokens))]
        n_tokens = len(tokens)
        self.agreement.new_run()  # the last prefetch's values say nothing of this one
        run = _Running(n_tokens, time.monotonic(), self._safe_prefetch(self.kv_ns, tokens, -1))
        run.ended = run.kv is None  # nothing can be committed: no reason to wait for others
        for pool in self.sidecars:
            # a window's place is known only once the KV length is agreed: read on
            cap = -1 if pool.kind == "window" else pool.pages
            run.sidecars[pool.name] = self._safe_prefetch(pool.ns, tokens, cap)
        self._run = run

    def terminate(self) -> None:
        """End the running prefetch on this rank (the request was aborted here,
        say): the next ``step()`` returns the Decision on every rank, all
        committing the same agreed pages (what every rank holds by then)."""
        if self._run is None:
            raise RuntimeError("no prefetch is running: call start() first")
        self._run.ended = True

    def _most_tokens(self, asked: int) -> int:
        """The leading tokens of ``asked`` whose pages no pool's request takes past
        the daemon's limits, on pages and on a message's bytes (a longer
        prefetch is refused whole: a miss)."""
        if not self.client.max_pages:
            return asked
        pools = (self.kv_ns, *(p.ns for p in self.sidecars))
        most = min(
            self.client.pages_per_request(TOKEN_BYTES * ns.spec.page_tokens) * ns.spec.page_tokens
            for ns in pools
        )
        return min(asked, most)

    def _safe_prefetch(self, ns: Namespace, tokens: Any, max_pages: int) -> Fetch | None:
        try:
            return self.client.prefetch(ns, tokens, max_pages=max_pages)
        except HicachedError as exc:
            log.warning("prefetch in %s not started: %s", ns.spec.model, exc)
            self.missing_results += 1
            return None

    def _progress(self, run: _Running, name: str, pf: Fetch | None) -> tuple[int, bool]:
        """(pages ready in L2 for this pool, transfer done); a missing result is (0, done).

        A prefetch whose progress cannot be read is treated as gone from then on
        (its lease ended, or the daemon restarted): its pins cannot be trusted.
        """
        if pf is None or name in run.lost:
            return 0, True
        try:
            p = self.client.progress(pf)
        except HicachedError as exc:
            log.warning("prefetch progress in %s missing: %s", name, exc)
            self.missing_results += 1
            run.lost.add(name)
            return 0, True
        return pf.l2_hits + p.completed, p.done

    def step(self) -> Decision | None:
        """One agreement; returns the Decision on the step the prefetch ends (on every rank)."""
        run = self._run
        if run is None:
            raise RuntimeError("no prefetch is running: call start() first")
        run.steps += 1
        kv_ready, kv_done = self._progress(run, "kv", run.kv)
        if "kv" in run.lost:
            run.ended = True  # the daemon ended it here: nothing more to wait for
        values: dict[str, int] = {"kv": kv_ready}
        sidecars_done = True
        for pool in self.sidecars:
            ready, done = self._progress(run, pool.name, run.sidecars[pool.name])
            if pool.kind == "window":
                # its leading pages: the window ending at the agreed length needs them all
                values[pool.name] = ready
                done = done or ready >= kv_ready  # holds all an agreed length can ask for
            else:
                # all or nothing: a pool reports its pages only once it has all it needs
                values[pool.name] = pool.pages if ready >= pool.pages else 0
            sidecars_done &= done
        waited = time.monotonic() - run.started
        kind = self.policy.kind
        if kind == "best_effort":
            willing = True
        elif kind == "wait_complete":
            willing = kv_done
        else:
            willing = kv_done or waited >= self.policy.deadline_s(run.tokens)
        # never end while a sidecar transfer (e.g. a Mamba state) is still running
        can_end = willing and sidecars_done
        values["must_not_terminate"] = 0 if can_end else 1
        values["terminated"] = int(run.ended)
        try:
            agreed = self.agreement.agree("prefetch.step", **values)
        except BaseException:  # a peer rank died or hung (RankFailure), or a signal
            self._abandon(run)
            raise
        if agreed["must_not_terminate"] and not agreed["terminated"]:
            return None
        return self._finish(run, agreed, waited)

    def _abandon(self, run: _Running) -> None:
        """The ranks cannot agree on ``run`` any more: its prefetches are released
        here now (not at their leases' TTL), and a next ``start()`` may begin
        another (on an agreement the ranks have set up again). A release that
        breaks off (a socket error) leaves that prefetch to its TTL and the
        others are released: the agreement's failure is the one raised."""
        self._run = None
        for name, pf in [("kv", run.kv), *run.sidecars.items()]:
            try:
                self._settle(run, name, pf, None, [])
            except Exception as exc:  # not a signal: that one ends the release here
                log.warning("prefetch in %s not released: %s", name, exc)

    def _finish(self, run: _Running, agreed: dict[str, int], waited: float) -> Decision:
        self._run = None
        length = agreed["kv"]
        failed: list[str] = []  # what this rank cannot honour; every pool is settled first
        if length > 0 and "kv" in run.lost:
            failed.append(f"kv: its prefetch was lost, {length} pages agreed")
        # nothing agreed: released, so a lease that ran out meanwhile is no failure
        kv_pages = max(0, length - run.kv.l2_hits) if run.kv and length > 0 else None
        self._settle(run, "kv", run.kv, None if failed else kv_pages, failed)
        committed = {}
        for pool in self.sidecars:
            pf = run.sidecars[pool.name]
            if pool.kind == "window":
                # every rank holds the window ending at the agreed length (and all before it)
                keep = length > 0 and agreed[pool.name] >= length
                end = length
            else:
                keep = agreed[pool.name] >= pool.pages  # every rank has all of it
                end = pool.pages
            if keep and pool.name in run.lost:
                failed.append(f"{pool.name}: its prefetch was lost")
            # a partial window is released, never committed
            pages = max(0, end - pf.l2_hits) if pf and keep and not failed else None
            self._settle(run, pool.name, pf, pages, failed)
            committed[pool.name] = keep
        if failed:
            raise PrefetchLost(
                f"rank {self.agreement.topo.rank}: the ranks agreed on {length} KV pages, but "
                f"this rank cannot commit them ({'; '.join(failed)}); it released the rest"
            )
        reason = "ended by a rank" if agreed["terminated"] else "willing"
        l2 = min(length, run.kv.l2_hits) if run.kv is not None else 0
        return Decision(length, committed, run.steps, f"{self.policy.kind}: {reason}", waited, l2)

    def _settle(
        self, run: _Running, name: str, pf: Fetch | None, pages: int | None, failed: list[str]
    ) -> None:
        """Commit ``pages`` of a prefetch, or release it (None); a commit that fails
        (the lease was lost since the last report) goes into ``failed``."""
        if pf is None:
            return
        if name in run.lost or pages is None:
            with contextlib.suppress(HicachedError):  # a lost lease is most likely gone already
                self.client.cancel(pf)
            return
        try:
            self.client.commit(pf, pages=pages)
        except HicachedError as exc:
            failed.append(f"{name}: commit failed: {exc}")

    def close(self) -> None:
        self.agreement.close()


class BackupAgreement:
    """How many asynchronous L1 -> L2 backups every rank may treat as done.

    Each rank counts its own finished backups; the agreed count is the MIN over
    TP and CP together, decided by PP stage 0 and relayed down the pipeline
    (reports 000 and 002), so every rank applies the same count.
    """

    def __init__(self, topology: Topology) -> None:
        self.agreement = Agreement(topology, Fields(min=("finished",)), sites=("backups.finished",))

    def finished(self, local: int) -> int:
        return self.agreement.agree("backups.finished", finished=local)["finished"]

    def close(self) -> None:
        self.agreement.close()
