"""Functions that run inside rank processes (importable by spawned children)."""

from __future__ import annotations

import time
from typing import Any

from hicached.dist import Agreement, Fields, Topology

FIELDS = Fields(min=("pages", "acks"), max=("busy", "done"), cautious=(("busy", 1),))


def agree_steps(topo: Topology, steps: int) -> dict[str, Any]:
    """Constant per-rank values; every step's agreed values, as each rank saw them."""
    agreement = Agreement(topo, FIELDS)
    seen = []
    for _ in range(steps):
        seen.append(
            agreement.agree(
                "test.step",
                pages=10 + topo.rank,
                acks=100 - topo.rank,
                busy=int(topo.rank == 1),
                done=int(topo.rank == 0),
            )
        )
    agreement.close()
    return {"seen": seen, "collectives": agreement.collectives, "pending": len(agreement.pending)}


def skip_a_sync(topo: Topology, skipper: int) -> str:
    sites = ("sync.first", "sync.second", "sync.third", "sync.fourth")
    agreement = Agreement(topo, FIELDS, sites=sites)
    values = dict(pages=1, acks=1, busy=0, done=0)
    agreement.agree("sync.first", **values)
    if topo.rank != skipper:
        agreement.agree("sync.second", **values)
    agreement.agree("sync.third", **values)
    agreement.agree("sync.fourth", **values)
    return "no error"


def many_steps(topo: Topology, steps: int, jitter_rank: int) -> dict[str, int]:
    """Backup acks grow at different paces per stage; all apply the same counts."""
    from hicached.coordinator import BackupAgreement

    backups = BackupAgreement(topo)
    applied = []
    worst_pending = 0
    for step in range(steps):
        if topo.rank == jitter_rank and step % 50 == 0:
            time.sleep(0.01)  # this stage's acks (and steps) lag now and then
        local = step // (2 if topo.pp_rank else 1)  # stages finish backups at different rates
        agreed = backups.finished(local)
        assert agreed <= local, "a rank was told more backups finished than it has"
        applied.append(agreed)
        worst_pending = max(worst_pending, len(backups.agreement.pending))
    backups.close()
    return {"last": applied[-1], "sum": sum(applied), "worst_pending": worst_pending}


def sleep_then_agree(topo: Topology) -> str:
    agreement = Agreement(topo, FIELDS)
    values = dict(pages=1, acks=1, busy=0, done=0)
    for _ in range(1000):
        agreement.agree("loop", **values)
        time.sleep(0.01)
    return "finished"


# -- prefetch coordination -------------------------------------------------------------

PAGE_TOKENS = 16
PAGES = 12
WINDOW_TOKENS = 32  # two pages
WINDOW_PAGES = 2


def spec_fields(topo_like: Any, pool: str) -> dict[str, Any]:
    tp_rank, tp_size, pp_stage, pp_size = topo_like
    return dict(
        model="sim/hybrid",
        kv_dtype="bfloat16",
        layout=pool,
        page_tokens=PAGE_TOKENS,
        page_bytes=4096,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_stage=pp_stage,
        pp_size=pp_size,
    )


def coords(topo: Topology) -> tuple[int, int, int, int]:
    return (topo.tp_rank, topo.tp_size, topo.pp_rank, topo.pp_size)


def coordinated_prefetch(
    topo: Topology,
    endpoint: str,
    policy: dict[str, Any],
    die_at_step: tuple[int, int] | None = None,
    end_at: tuple[int, int, str] | None = None,
    stored_pages: int = PAGES,
    asked_pages: int = PAGES,
) -> dict[str, Any]:
    """``die_at_step = (rank, step)``: that rank SIGKILLs itself mid-prefetch.

    ``stored_pages``: the leading pages of the ``asked_pages`` asked for that
    were stored (a daemon that takes fewer pages a request holds no longer
    sequence).

    ``end_at = (rank, pages, how)``: once that rank's KV prefetch has read
    ``pages`` pages, it ends the prefetch there: ``"terminate"`` through the
    coordinator, ``"cancel"`` by cancelling its daemon prefetch behind the
    coordinator's back (as if the daemon had ended it)."""
    import numpy as np
    import torch.distributed as dist

    from hicached import Client
    from hicached.coordinator import PoolSpec, PrefetchCoordinator, StopPolicy
    from hicached.dist import RankFailure
    from hicached.errors import UnknownLease
    from tests.l3util import evict_everything, settle_writes
    from tests.support import page_bytes_for

    client = Client(endpoint, timeout=10).connect()

    def released(fetch: Any) -> bool:
        """The daemon no longer knows the prefetch ``fetch`` (None: never started)."""
        if fetch is None:
            return True
        try:
            client.progress(fetch)
        except UnknownLease:
            return True
        return False

    pools = {
        name: client.register(**spec_fields(coords(topo), name)) for name in ("kv", "swa", "state")
    }
    asked = np.arange(asked_pages * PAGE_TOKENS, dtype=np.uint32) + 7
    toks = asked[: stored_pages * PAGE_TOKENS]
    data = {name: page_bytes_for(toks, salt=hash((name, topo.rank))) for name in pools}
    for name, ns in pools.items():
        client.store(ns, toks, data[name])
    settle_writes(client)
    dist.barrier()
    if topo.rank == 0:
        filler = client.register(**{**spec_fields((0, 1, 0, 1), "filler")})
        evict_everything(client, filler)
    dist.barrier()
    coordinator = PrefetchCoordinator(
        client,
        topo,
        pools["kv"],
        sidecars=[
            PoolSpec.window("swa", pools["swa"], WINDOW_TOKENS),
            PoolSpec("state", pools["state"], 1, "state"),
        ],
        policy=StopPolicy(**policy),
    )
    coordinator.start(asked)
    decision = None
    ended_after = None  # steps this rank had taken when it ended the prefetch
    while decision is None:
        run = coordinator._run
        if end_at is not None and end_at[0] == topo.rank and run and ended_after is None:
            assert run.kv is not None
            if client.progress(run.kv).completed >= end_at[1]:
                if end_at[2] == "terminate":
                    coordinator.terminate()
                else:
                    client.cancel(run.kv)
                ended_after = run.steps
        if (
            die_at_step is not None
            and die_at_step[0] == topo.rank
            and run
            and run.steps == die_at_step[1]
        ):
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        try:
            decision = coordinator.step()
        except RankFailure as exc:  # what the coordinator left of the prefetch, in the error
            assert run is not None
            fetches = [run.kv, *run.sidecars.values()]
            raise RankFailure(
                f"{exc} [abandoned: run cleared {coordinator._run is None}, "
                f"released {sum(map(released, fetches))} of {len(fetches)}]"
            ) from exc
        time.sleep(0.005)
    length = decision.kv_pages
    hit = client.match(pools["kv"], toks)
    assert hit.hits >= length, "the agreed pages are not all in L2"
    got = client.read_pages(hit.select(range(length)))
    assert np.array_equal(got, data["kv"][:length]), "wrong bytes in an agreed page"
    client.release(hit)
    in_l2 = {}
    for name in ("swa", "state"):
        side = client.match(pools[name], toks, lease=False)
        in_l2[name] = side.hits
    if decision.sidecars["swa"]:  # the window that ends at the agreed length, byte for byte
        side = client.match(pools["swa"], toks)
        window = range(max(0, length - WINDOW_PAGES), length)
        assert side.hits >= length, "the agreed window is not all in L2"
        got = client.read_pages(side.select(window))
        assert np.array_equal(got, data["swa"][window.start : window.stop]), "wrong window"
        client.release(side)
    coordinator.close()
    dist.barrier()
    client.close()
    return {
        "kv": length,
        "sidecars": decision.sidecars,
        "steps": decision.steps,
        "waited": decision.waited_s,
        "in_l2": in_l2,
        "missing": coordinator.missing_results,
        "reason": decision.reason,
        "ended_after": ended_after,
    }


def engine_groups(topo: Topology) -> dict[str, int]:
    """An engine's own TP and CP groups (no combined group): every group of
    size > 1 is reduced, TP and CP both."""
    import torch.distributed as dist

    tp, cp = topo.tp_size, topo.cp_size
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    engine = Topology.from_groups(
        tp_group=tp_groups[topo.cp_rank], cp_group=cp_groups[topo.tp_rank], timeout=15
    )
    agreement = Agreement(engine, Fields(min=("pages",), max=("busy",)))
    out = agreement.agree("engine", pages=10 + topo.rank, busy=int(topo.rank == 3))
    agreement.close()
    return {**out, "collectives": agreement.collectives}


def inconsistent_attn_group(topo: Topology) -> str:
    """An attention group over both TP ranks, but no TP group: refused, as the PP
    ring's ends are found from tp x cp."""
    import torch.distributed as dist

    stage = dist.new_group([0, 1], backend="gloo")
    try:
        Topology.from_groups(tp_group=None, attn_group=stage)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def two_agreements_out_of_order(topo: Topology) -> str:
    """Rank 1 runs two agreements of different widths in the other order."""
    small = Agreement(topo, Fields(min=("finished",)), sites=("backups.finished",))
    wide = Agreement(topo, FIELDS, sites=("prefetch.step",))
    if topo.rank == 0:
        small.agree("backups.finished", finished=5)
    wide.agree("prefetch.step", pages=1, acks=1, busy=0, done=0)
    small.agree("backups.finished", finished=5)
    return "no mismatch seen"


def _prefetch_setup(topo: Topology, endpoint: str, pools: tuple[str, ...]) -> tuple[Any, Any, Any]:
    """A client, its namespaces and tokens whose pages are in L3 only."""
    import numpy as np
    import torch.distributed as dist

    from hicached import Client
    from tests.l3util import evict_everything, settle_writes
    from tests.support import page_bytes_for

    client = Client(endpoint, timeout=10).connect()
    spaces = {name: client.register(**spec_fields(coords(topo), name)) for name in pools}
    toks = np.arange(PAGES * PAGE_TOKENS, dtype=np.uint32) + 7
    for name, ns in spaces.items():
        client.store(ns, toks, page_bytes_for(toks, salt=hash((name, topo.rank))))
    settle_writes(client)
    dist.barrier()
    if topo.rank == 0:
        evict_everything(client, client.register(**spec_fields((0, 1, 0, 1), "filler")))
    dist.barrier()
    return client, spaces, toks


def _to_the_end(coordinator: Any) -> Any:
    decision = None
    while decision is None:
        decision = coordinator.step()
        time.sleep(0.005)
    return decision


def two_prefetches_in_a_row(topo: Topology, endpoint: str, terminator: int) -> dict[str, Any]:
    """One coordinator, two prefetches, as an engine runs request after request;
    ``terminator`` ends the first one. The second must start from nothing the
    first agreed: it is not 'ended by a rank', and ends with every page read."""
    import torch.distributed as dist

    from hicached.coordinator import PrefetchCoordinator, StopPolicy

    client, spaces, toks = _prefetch_setup(topo, endpoint, ("kv",))
    coordinator = PrefetchCoordinator(
        client, topo, spaces["kv"], policy=StopPolicy("wait_complete")
    )
    coordinator.start(toks[: 4 * PAGE_TOKENS])
    if topo.rank == terminator:
        coordinator.terminate()
    first = _to_the_end(coordinator)
    dist.barrier()
    coordinator.start(toks)
    second = _to_the_end(coordinator)
    in_l2 = client.match(spaces["kv"], toks, lease=False).hits
    coordinator.close()
    dist.barrier()
    client.close()
    return {"first": first.reason, "second": (second.kv_pages, second.reason), "in_l2": in_l2}


def lose_after_the_agreement(topo: Topology, endpoint: str, loser: int) -> dict[str, Any]:
    """``loser``'s KV prefetch ends (as when its lease expires or its daemon
    restarts) right after a step's agreement, before the commit."""
    import torch.distributed as dist

    from hicached.coordinator import PoolSpec, PrefetchCoordinator, PrefetchLost, StopPolicy

    client, spaces, toks = _prefetch_setup(topo, endpoint, ("kv", "swa"))
    coordinator = PrefetchCoordinator(
        client,
        topo,
        spaces["kv"],
        sidecars=[PoolSpec.window("swa", spaces["swa"], WINDOW_TOKENS)],
        policy=StopPolicy("wait_complete"),
    )
    coordinator.start(toks)
    if topo.rank == loser:
        agree = coordinator.agreement.agree

        def agree_then_lose(site: str, **values: int) -> dict[str, int]:
            agreed = agree(site, **values)
            if not agreed["must_not_terminate"]:  # the deciding step
                run = coordinator._run
                assert run is not None and run.kv is not None
                client.cancel(run.kv)
            return agreed

        coordinator.agreement.agree = agree_then_lose  # type: ignore[method-assign]
    try:
        outcome: Any = _to_the_end(coordinator).kv_pages
    except PrefetchLost as exc:
        outcome = f"PrefetchLost: {exc}"
    dist.barrier()  # both ranks have settled their prefetches
    leases = client.stats().leases
    coordinator.close()
    dist.barrier()
    client.close()
    return {"outcome": outcome, "leases": leases}


def two_agreements_interleaved(topo: Topology) -> list[dict[str, int]]:
    """Two agreements on one topology, run in the same order on every rank, one
    idle while the other runs: each must take only its own relayed values.
    The last stage holds no pages and is busy; stage 0 holds 100 and is willing."""
    prefetch = Agreement(topo, FIELDS, sites=("prefetch.step",))
    backups = Agreement(topo, Fields(min=("finished",)), sites=("backups.finished",))
    last = topo.pp_rank == topo.pp_size - 1
    mine = dict(pages=0 if last else 100, acks=0 if last else 100, busy=int(last), done=0)
    seen = [prefetch.agree("prefetch.step", **mine)]
    for _ in range(3):
        backups.agree("backups.finished", finished=1000)
    seen += [prefetch.agree("prefetch.step", **mine) for _ in range(2)]
    prefetch.close()
    backups.close()
    return seen


def interleaved_instances(topo: Topology, ends: str) -> list[Any]:
    """World 4: two data-parallel instances of pp=2, laid out pp outermost as
    engines do (instance 0 is ranks 0 and 2, instance 1 is ranks 1 and 3),
    each with its own PP group. Instance 0's stages hold 100 and 50 pages,
    instance 1's 200 and 200. ``ends``: the ring's ends are "given" (global
    ranks), "local" (ranks within the instance's PP group: wrong) or "none"."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pp_rank, dp_rank = divmod(rank, 2)
    groups = [dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")]
    try:
        engine = Topology.from_groups(
            tp_group=None,
            pp_rank=pp_rank,
            pp_size=2,
            pp_prev=rank - 2 if pp_rank else None,
            pp_next=rank + 2 if not pp_rank else None,
            pp_group=groups[dp_rank],
            pp_first={"given": dp_rank, "local": 0}.get(ends),
            pp_last={"given": dp_rank + 2, "local": 1}.get(ends),
            timeout=10,
        )
    except ValueError as exc:
        return [str(exc)]
    agreement = Agreement(engine, Fields(min=("pages",)))
    pages = (100 if pp_rank == 0 else 50) if dp_rank == 0 else 200
    seen = [agreement.agree("step", pages=pages)["pages"] for _ in range(3)]
    agreement.close()
    return seen


def one_bad_value(topo: Topology, bad_rank: int, value: Any, linger: float) -> dict[str, Any]:
    """Three steps; at the second, ``bad_rank`` gives ``pages`` a value that
    does not fit an int64 word. What each rank raised, at which step, and how
    long that agree call took. A rank that raised stays up ``linger`` seconds,
    as an engine that reports the error and goes on would: a rank that left
    would fail its peers' collectives at once anyway."""
    agreement = Agreement(topo, FIELDS)
    for step in (1, 2, 3):
        pages = value if step == 2 and topo.rank == bad_rank else 1
        started = time.monotonic()
        try:
            agreement.agree("test.bad", pages=pages, acks=1, busy=0, done=0)
        except Exception as exc:
            elapsed = time.monotonic() - started
            time.sleep(linger)
            return {"error": f"{type(exc).__name__}: {exc}", "step": step, "seconds": elapsed}
    agreement.close()
    return {"error": None, "step": 3}


def one_wrong_call(topo: Topology, bad_rank: int, how: str, linger: float) -> dict[str, Any]:
    """Three steps; at the second, ``bad_rank`` calls agree() wrongly: ``how`` is
    "missing" (a field left out), "unknown" (a field the agreement lacks) or
    "site" (a field left out, at another site than the others). What each rank
    raised, at which step, and how long that agree call took; a rank that raised
    stays up ``linger`` seconds, as an engine that reports the error and goes on."""
    agreement = Agreement(topo, FIELDS, sites=("test.wrong", "test.elsewhere"))
    for step in (1, 2, 3):
        site, values = "test.wrong", dict(pages=1, acks=1, busy=0, done=0)
        if step == 2 and topo.rank == bad_rank:
            if how in ("missing", "site"):
                del values["acks"]
            else:
                values["pagez"] = 1
            site = "test.elsewhere" if how == "site" else site
        started = time.monotonic()
        try:
            agreement.agree(site, **values)
        except Exception as exc:
            elapsed = time.monotonic() - started
            time.sleep(linger)
            return {"error": f"{type(exc).__name__}: {exc}", "step": step, "seconds": elapsed}
    agreement.close()
    return {"error": None, "step": 3}


def other_field_order(topo: Topology, odd_rank: int) -> dict[str, Any]:
    """``odd_rank`` lists the MIN fields in another order (as an engine whose
    sidecar pools come in another order on one rank would); every rank gives
    pages=10, acks=100. What each rank agreed on, or raised."""
    fields = FIELDS
    if topo.rank == odd_rank:
        fields = Fields(min=("acks", "pages"), max=FIELDS.max, cautious=FIELDS.cautious)
    agreement = Agreement(topo, fields, sites=("test.fields",))
    started = time.monotonic()
    try:
        agreed = agreement.agree("test.fields", pages=10, acks=100, busy=0, done=0)
        agreement.close()
        return {"agreed": agreed}
    except Exception as exc:
        elapsed = time.monotonic() - started
        time.sleep(3)  # up a while, as an engine that reports the error and goes on
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": elapsed}


def wrong_on_the_last_step(topo: Topology, how: str) -> dict[str, Any]:
    """Two steps, then close(); at the second the last stage is at another site
    (``how`` "site") or gives a value that does not fit (``how`` "value").
    Where each rank raised (in "agree" or "close") and what; a rank that raised
    stays up a while, as an engine that reports the error and goes on."""
    agreement = Agreement(topo, FIELDS, sites=("test.last", "test.other"))
    last = topo.pp_rank == topo.pp_size - 1
    where = "agree"
    try:
        for step in (1, 2):
            site, pages = "test.last", 1
            if step == 2 and last:
                site, pages = ("test.other", 1) if how == "site" else ("test.last", 1 << 64)
            agreement.agree(site, pages=pages, acks=1, busy=0, done=0)
        where = "close"
        agreement.close()
    except Exception as exc:
        time.sleep(3)
        return {"where": where, "error": f"{type(exc).__name__}: {exc}"}
    return {"where": None, "error": None}


def own_daemon_dies(
    topo: Topology, endpoints: list[str], victim: tuple[int, int], after_pages: int
) -> dict[str, Any]:
    """Every rank talks to a daemon of its own (``endpoints[rank]``), as ranks on
    different hosts do. ``victim = (rank, pid)``: once that rank's KV prefetch
    has read ``after_pages`` pages, it SIGKILLs its daemon (process ``pid``)
    mid-prefetch (fault injection). What each rank decided, or raised, and the
    leases a survivor's daemon still holds."""
    import os
    import signal

    import numpy as np
    import torch.distributed as dist

    from hicached import Client
    from hicached.coordinator import PrefetchCoordinator, StopPolicy
    from tests.l3util import evict_everything, settle_writes
    from tests.support import page_bytes_for

    client = Client(endpoints[topo.rank], timeout=5).connect()
    ns = client.register(**spec_fields(coords(topo), "kv"))
    toks = np.arange(PAGES * PAGE_TOKENS, dtype=np.uint32) + 7
    client.store(ns, toks, page_bytes_for(toks, salt=topo.rank))
    settle_writes(client)
    evict_everything(client, client.register(**spec_fields((0, 1, 0, 1), "filler")))
    dist.barrier()
    coordinator = PrefetchCoordinator(client, topo, ns, policy=StopPolicy("wait_complete"))
    coordinator.start(toks)
    decision, killed = None, False
    try:
        while decision is None:
            run = coordinator._run
            kv = run.kv if run is not None and topo.rank == victim[0] and not killed else None
            if kv is not None and client.progress(kv).completed >= after_pages:
                os.kill(victim[1], signal.SIGKILL)
                killed = True
            decision = coordinator.step()
            time.sleep(0.005)
        outcome: Any = (decision.kv_pages, decision.steps, decision.reason)
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    leases = None if topo.rank == victim[0] else client.stats().leases
    coordinator.close()
    client.close()
    return {"outcome": outcome, "leases": leases}


def a_release_that_breaks_on_a_failed_agreement(topo: Topology, endpoint: str) -> dict[str, Any]:
    """The agreement of the first step fails (a peer rank died), and the first
    release after it breaks off with a socket error (the client's link to the
    daemon broken at that moment). What the step raises, and which of the
    prefetches the daemon still knows."""
    import zmq

    from hicached.coordinator import PoolSpec, PrefetchCoordinator, StopPolicy
    from hicached.dist import RankFailure
    from hicached.errors import UnknownLease

    client, spaces, toks = _prefetch_setup(topo, endpoint, ("kv", "swa", "state"))
    coordinator = PrefetchCoordinator(
        client,
        topo,
        spaces["kv"],
        sidecars=[
            PoolSpec.window("swa", spaces["swa"], WINDOW_TOKENS),
            PoolSpec("state", spaces["state"], 1, "state"),
        ],
        policy=StopPolicy("wait_complete"),
    )
    coordinator.start(toks)
    run = coordinator._run
    assert run is not None

    def agree_fails(site: str, **values: int) -> dict[str, int]:
        raise RankFailure("rank 1 is gone")

    cancel = client.cancel
    broken = [True]

    def cancel_breaks_once(pf: Any) -> None:
        if broken:
            broken.clear()
            raise zmq.ZMQError(zmq.ETERM)
        cancel(pf)

    coordinator.agreement.agree = agree_fails  # type: ignore[method-assign]
    client.cancel = cancel_breaks_once  # type: ignore[method-assign]
    try:
        coordinator.step()
        raised = "nothing"
    except Exception as exc:
        raised = type(exc).__name__
    client.cancel = cancel  # type: ignore[method-assign]

    def known(fetch: Any) -> bool:
        try:
            client.progress(fetch)
        except UnknownLease:
            return False
        return True

    out = {
        "raised": raised,
        "cleared": coordinator._run is None,
        "known": {name: known(pf) for name, pf in [("kv", run.kv), *run.sidecars.items()]},
    }
    client.close()
    return out
