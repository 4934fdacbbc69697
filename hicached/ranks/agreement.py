"""Rank agreement: every rank of a model instance takes the same decision.

Engine side; the only daemon-free module that imports torch. A model instance
runs over tensor- (TP), context- (CP) and pipeline-parallel (PP) ranks; each
talks to its host's daemon about its own KV shard, and each one's storage
I/O finishes at its own pace. ``Agreement.agree`` turns the ranks' local
views into one answer per step:

- Fields are named and fixed: MIN fields (e.g. pages a prefetch completed,
  each sidecar pool's hit pages, finished write backups) and MAX fields
  (e.g. must-not-terminate, terminated), packed into one int64 tensor, MAX
  folded into MIN by negation, plus a fingerprint of the call site and step.
- ONE collective per step: an all-reduce(MIN) over the ranks of this PP stage
  (TP and CP together; never one or the other).
- PP relay: stage 0 decides; stage k receives the decision from k-1 and sends
  it on to k+1 with a non-blocking send. Pending sends are kept and reaped
  every step, so the list stays bounded. So that stage 0's decision covers
  every stage, each stage also folds its own reduced values into the relayed
  message and the last stage sends the fold back to stage 0, which uses it
  one step later. Every field is monotone over a run of agreements (one
  prefetch: its pages are pinned as they arrive, so they only grow, and flags
  only rise), so a one-step-old value is safe: it can delay a decision by a
  step, never allow one a stage cannot honour. Until the first fold of a run
  arrives, stage 0 assumes the most cautious values (0 pages, busy); a new
  run (``Agreement.new_run``) never takes the last run's fold. A stage whose
  pins were lost meanwhile (its daemon restarted) cannot honour the decision
  and must say so (coordinator.PrefetchLost).
- A value that is not an integer fitting an int64 word (the MAX fields
  negated), or field names that are not the agreement's (one missing, one
  unknown), do not stop their rank before the collective, where the others
  would wait out their timeout: the rank sends a marker naming itself and
  the field (or "the names") in the fingerprint's place, and every rank of
  the stage raises RankBadValue at once (along PP, the stages after it in the same step, the
  ones before it one step later, as they hear of it).
- Mismatch detection: ranks that reach different call sites or steps, or
  whose agreements have other fields (the same names in another order
  included), see different fingerprints; every rank raises RankMismatch
  naming them. Every
  agreement sends the same number of words (``WIRE``), whatever its fields,
  so that ranks running two different agreements out of order still meet in
  one collective of one size and see the mismatch. A dead
  rank makes the others raise RankFailure at once; a stuck one within the
  group timeout.
- CPU only: the packed tensor stays on the CPU, so every group it crosses
  must reduce CPU tensors (gloo, or a group with a CPU backend beside its
  CUDA one). A group that only has a CUDA backend is refused when the
  Topology is built: a CUDA collective with a dead peer blocks a stream, not
  this thread, so no timeout could turn it into an error here.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hicached.errors import HicachedError

WIRE = 16  # int64 words of every agreement's message: fields, padding, fingerprint
_BIG = (1 << 62) - 1  # "no constraint" for a MIN field
_POISON = -(1 << 62)  # sent along PP by a rank that found a mismatch
# Sent in the fingerprint's place by a rank whose value does not fit an int64
# word, less (rank x WIRE + field): below every fingerprint and _POISON, so the
# MIN carries it to every rank, which names that rank and field.
_UNFIT = _POISON - 1
_INT64 = (-(1 << 63), (1 << 63) - 1)
# The field position such a marker gives for a rank whose field names are not the
# agreement's (past every field: an agreement carries at most WIRE - 2).
_NAMES = WIRE - 1


class RankFailure(HicachedError):
    """A peer rank died, hung past the timeout, or a collective failed."""

    code = "rank_failure"


class RankMismatch(HicachedError):
    """Ranks reached different sync points (a skipped or reordered sync)."""

    code = "rank_mismatch"


class RankBadValue(HicachedError):
    """A rank gave agree() a value that does not fit the agreement's signed
    64-bit words, or field names that are not the agreement's; every rank
    raises it, naming that rank and field (the rank at fault also says which
    names were missing or unknown)."""

    code = "rank_bad_value"


def _cpu_capable(group: dist.ProcessGroup | None) -> tuple[bool, str]:
    """(whether ``group`` (None: the default group) reduces CPU tensors, its backend)."""
    config = str(dist.get_backend_config(group))
    if ":" in config:  # "cpu:gloo,cuda:nccl"
        devices = {part.split(":", 1)[0].strip() for part in config.split(",")}
    else:  # a bare backend name
        devices = set(dist.Backend.backend_capability.get(config.lower(), ()))
    return "cpu" in devices, config


def _require_cpu(group: dist.ProcessGroup | None, what: str) -> None:
    ok, config = _cpu_capable(group)
    if not ok:
        raise RankFailure(
            f"{what} has backend {config!r}, which cannot reduce CPU tensors; rank agreement "
            "runs on the CPU so that a dead peer is an error within the timeout, not a hang: "
            "pass a gloo group over the same ranks (an engine's CPU group, or "
            "torch.distributed.new_group(ranks, backend='gloo'))"
        )


@dataclass
class Topology:
    """This rank's place in one model instance, and the groups it syncs over.

    ``stage_group`` holds every rank of this PP stage (all TP x CP ranks);
    ``pp_prev``/``pp_next`` are the global ranks at the same TP/CP place in the
    neighbouring stages (None at the ends), ``pp_first``/``pp_last`` those in
    the first and the last stage (the relay's ring closes between them; by
    default ``rank -+ pp_rank * tp * cp`` and so on, which a layout whose
    neighbours are not ``rank -+ tp * cp`` must replace: it is refused
    without them); the relay along PP sends over ``relay_group`` (None: the
    default group). Every group used must reduce
    CPU tensors: one that cannot raises RankFailure here (``check``).
    """

    rank: int
    tp_rank: int
    tp_size: int
    cp_rank: int
    cp_size: int
    pp_rank: int
    pp_size: int
    stage_group: dist.ProcessGroup | None
    stage_groups: Sequence[dist.ProcessGroup] = ()  # used instead when no combined group exists
    pp_prev: int | None = None
    pp_next: int | None = None
    timeout: timedelta = timedelta(seconds=30)
    relay_group: dist.ProcessGroup | None = None
    pp_first: int | None = None
    pp_last: int | None = None

    def __post_init__(self) -> None:
        self.check()
        if self.pp_size > 1 and (self.pp_first is None or self.pp_last is None):
            stage = self.stage_size
            dense = (self.pp_prev is None or self.pp_prev == self.rank - stage) and (
                self.pp_next is None or self.pp_next == self.rank + stage
            )
            if not dense:
                raise ValueError(
                    f"rank {self.rank}: pp_prev {self.pp_prev} / pp_next {self.pp_next} are not "
                    f"this rank -+ tp x cp ({stage}): pass pp_first and pp_last, the ranks at "
                    "this place in the first and the last stage, where the relay's ring closes"
                )
            first = self.rank - self.pp_rank * stage
            self.pp_first = first if self.pp_first is None else self.pp_first
            self.pp_last = (
                first + (self.pp_size - 1) * stage if self.pp_last is None else self.pp_last
            )
        ends = {0: self.pp_first, self.pp_size - 1: self.pp_last}
        if self.pp_size > 1 and self.pp_rank in ends and ends[self.pp_rank] != self.rank:
            raise ValueError(
                f"rank {self.rank} is PP stage {self.pp_rank}, but pp_first / pp_last are "
                f"{self.pp_first} / {self.pp_last}: they are global ranks, this one at its end"
            )

    def check(self) -> None:
        """Refuse, before any collective, a group that cannot carry CPU tensors."""
        if self.stage_group is not None:
            _require_cpu(self.stage_group, "the stage (attention) group")
        for group in self.stage_groups:
            _require_cpu(group, "a TP or CP group")
        if self.pp_size > 1:
            what = "the PP relay group" if self.relay_group is not None else "the default group"
            _require_cpu(self.relay_group, f"{what} (it carries the PP relay)")

    @property
    def stage_size(self) -> int:
        return self.tp_size * self.cp_size

    @classmethod
    def create(cls, tp: int, cp: int = 1, pp: int = 1, *, timeout: float = 30.0) -> Topology:
        """Build the groups of one instance over the whole default group.

        Rank layout: ``rank = pp_rank * (cp * tp) + cp_rank * tp + tp_rank``.
        Every rank must call this, in the same order as any other new_group.
        The groups are gloo groups whatever the default backend is; with PP over
        a default group that cannot carry CPU tensors (NCCL alone), a gloo group
        over the whole world is made for the relay too.
        """
        if not dist.is_initialized():
            raise RankFailure("torch.distributed is not initialized")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != tp * cp * pp:
            raise RankFailure(f"world size {world} is not tp x cp x pp = {tp} x {cp} x {pp}")
        stage = tp * cp
        pp_rank, within = divmod(rank, stage)
        cp_rank, tp_rank = divmod(within, tp)
        td = timedelta(seconds=timeout)
        mine = None
        for s in range(pp):  # every rank creates every group, in the same order
            group = (
                dist.new_group(list(range(s * stage, (s + 1) * stage)), timeout=td, backend="gloo")
                if stage > 1
                else None
            )
            if s == pp_rank:
                mine = group
        relay = None
        if pp > 1 and not _cpu_capable(None)[0]:  # same answer on every rank: all create it
            relay = dist.new_group(list(range(world)), timeout=td, backend="gloo")
        return cls(
            rank=rank,
            tp_rank=tp_rank,
            tp_size=tp,
            cp_rank=cp_rank,
            cp_size=cp,
            pp_rank=pp_rank,
            pp_size=pp,
            stage_group=mine,
            pp_prev=rank - stage if pp_rank > 0 else None,
            pp_next=rank + stage if pp_rank < pp - 1 else None,
            timeout=td,
            relay_group=relay,
        )

    @classmethod
    def from_groups(
        cls,
        *,
        tp_group: dist.ProcessGroup | None,
        cp_group: dist.ProcessGroup | None = None,
        attn_group: dist.ProcessGroup | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        pp_prev: int | None = None,
        pp_next: int | None = None,
        pp_group: dist.ProcessGroup | None = None,
        timeout: float = 30.0,
        pp_first: int | None = None,
        pp_last: int | None = None,
    ) -> Topology:
        """Wrap an engine's own groups. ``attn_group`` (all TP x CP ranks of the
        stage) gives one collective; without it, every group of size > 1 is
        reduced in turn. ``pp_group`` (holding this rank and ``pp_prev`` /
        ``pp_next``, which stay global ranks) carries the PP relay; None: the
        default group. ``pp_first``/``pp_last``: the global ranks at this place
        in the first and the last stage, needed where neighbours are not
        ``rank -+ tp x cp`` (data-parallel instances interleaved, say). Every
        group must reduce CPU tensors (gloo): an NCCL-only group raises
        RankFailure here, before any collective."""
        size = dist.get_world_size
        tp_size = size(tp_group) if tp_group is not None else 1
        cp_size = size(cp_group) if cp_group is not None else 1
        groups = [g for g in (tp_group, cp_group) if g is not None and size(g) > 1]
        if attn_group is not None and size(attn_group) != tp_size * cp_size:
            raise ValueError(
                f"attn_group has {size(attn_group)} ranks, but tp x cp = {tp_size} x {cp_size}: "
                "pass the TP and CP groups it is made of"
            )
        return cls(
            rank=dist.get_rank(),
            tp_rank=dist.get_rank(tp_group) if tp_group is not None else 0,
            tp_size=tp_size,
            cp_rank=dist.get_rank(cp_group) if cp_group is not None else 0,
            cp_size=cp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            stage_group=attn_group,
            stage_groups=() if attn_group is not None else groups,
            pp_prev=pp_prev,
            pp_next=pp_next,
            timeout=timedelta(seconds=timeout),
            relay_group=pp_group,
            pp_first=pp_first,
            pp_last=pp_last,
        )


@dataclass(frozen=True)
class Fields:
    """The named, ordered fields of one kind of agreement.

    ``cautious`` gives, for MAX fields, the value that holds a decision back
    (1 for a "busy" flag; the default 0 suits a "done" flag); MIN fields are
    held back by 0.
    """

    min: tuple[str, ...]
    max: tuple[str, ...] = ()
    cautious: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if len(self.min) + len(self.max) > WIRE - 2:
            raise ValueError(f"an agreement carries at most {WIRE - 2} fields")

    @property
    def width(self) -> int:
        return WIRE  # the fields, zeros after them, the fingerprint and its negation

    def pack(self, values: dict[str, int]) -> list[int]:
        """The fields in order, MAX ones negated, padded to the message's width less
        the fingerprint's two words."""
        body = [int(values[n]) for n in self.min] + [-int(values[n]) for n in self.max]
        return body + [0] * (WIRE - 2 - len(body))

    def unfit(self, values: dict[str, int]) -> int | None:
        """The position of the first field whose value (negated, for a MAX
        field) is not an integer that fits an int64 word; None if all fit.

        An integer: ``int()`` gives back the same value (2.0 and numpy or torch
        integers are; 2.5 and "7", which ``int()`` takes, are not)."""
        for i, name in enumerate(self.min + self.max):
            raw = values[name]
            try:
                value = int(raw)
                if isinstance(raw, str | bytes) or not bool(value == raw):
                    return i
            except Exception:  # None, nan, inf, arrays: any value int() refuses
                return i
            word = value if i < len(self.min) else -value
            if not _INT64[0] <= word <= _INT64[1]:
                return i
        return None

    def cautious_packed(self) -> list[int]:
        hold = dict(self.cautious)
        return self.pack({n: hold.get(n, 0) for n in self.min + self.max})


class Agreement:
    """One ``agree`` per step gives every rank of the instance the same values."""

    MAX_PENDING_SENDS = 64

    def __init__(self, topology: Topology, fields: Fields, sites: Sequence[str] = ()) -> None:
        """``sites``: the call sites this agreement will see, so that a rank can
        name the site another rank is at in a mismatch error."""
        self.topo = topology
        self.fields = fields
        self.step = 0
        # The fields, in order, are part of every fingerprint: ranks whose fields differ
        # (the same names in another order, say) would otherwise mix one field's words
        # with another's in the MIN, silently.
        self._schema = zlib.crc32(repr((fields.min, fields.max)).encode())
        self.sites: dict[int, str] = {}
        for site in sites:
            self.sites[self._site_tag(site)] = site
        self.pending: list[dist.Work] = []
        self.collectives = 0  # collectives issued, for tests and the bench
        # PP messages of this agreement travel under a tag of its own, so that two
        # agreements of one topology never take each other's messages: its declared
        # sites, or with none its fields. Not the fields where sites are declared: a
        # stage whose fields differ would wait for a message under another tag until
        # its timeout; under one tag the fingerprints (fields included) differ, and
        # every stage raises RankMismatch at once.
        kind = repr(sorted(sites)) if sites else repr((fields.min, fields.max))
        self._tag = zlib.crc32(kind.encode()) & 0x3FFFFFFF
        self._fold: list[int] | None = None  # stage 0: the last stage's fold, one step old
        self._last_fp = 0  # stage 0: the fingerprint of its previous step
        self._fresh = True  # stage 0: no fold of this run has arrived yet
        self._agreed = False  # the last agree() returned its values on this rank
        self._upstream: int | None = None  # the stages before were at this fingerprint

    def new_run(self) -> None:
        """The values agreed from the next step on start afresh (a new prefetch):
        stage 0 holds back until a fold of this run has arrived. Every rank calls
        it at the same point."""
        self._fresh = True

    # -- the fingerprint ------------------------------------------------------------

    def _site_tag(self, site: str) -> int:
        return (zlib.crc32(site.encode()) ^ self._schema) & 0x7FFFFFFF

    def _fingerprint(self, site: str) -> int:
        tag = self._site_tag(site)
        self.sites[tag] = site
        return (tag << 30) | (self.step & 0x3FFFFFFF)

    def _describe(self, fp: int) -> str:
        tag, step = fp >> 30, fp & 0x3FFFFFFF
        if tag not in self.sites:
            return f"site #{tag:x} (step {step}; another site, or one with other fields)"
        return f"{self.sites[tag]} (step {step}, fields {list(self.fields.min + self.fields.max)})"

    # -- the step -------------------------------------------------------------------------

    def agree(self, site: str, **values: int) -> dict[str, int]:
        """Reduce this rank's ``values`` with every other rank's; call it at the
        same sites in the same order on every rank. Returns the agreed values."""
        f = self.fields
        self._agreed = False
        self._upstream = None
        wrong = ""  # what is wrong with this rank's field names, if anything
        if set(values) != set(f.min) | set(f.max):
            missing = sorted((set(f.min) | set(f.max)) - set(values))
            extra = sorted(set(values) - set(f.min) - set(f.max))
            wrong = f"missing fields {missing}, unknown fields {extra}"
        self.step += 1
        fp = self._fingerprint(site)
        bad = _NAMES if wrong else f.unfit(values)
        if bad is None:
            packed = [*f.pack(values), fp, -fp]
        else:  # still take part, so that every rank fails now, not at its timeout
            mark = _UNFIT - (self.topo.rank * WIRE + bad)
            packed = [0] * (WIRE - 2) + [mark, -mark]
        tensor = torch.tensor(packed, dtype=torch.int64)
        try:
            self._reduce(tensor)
            decided = self._relay(tensor) if self.topo.pp_size > 1 else tensor.tolist()
            self._reap()
        except (RuntimeError, ValueError) as exc:  # torch reports a dead or stuck peer so
            raise RankFailure(
                f"rank {self.topo.rank} at {site} (step {self.step}): {exc}"
            ) from None
        self._verdict(decided[-2], -decided[-1], fp, f"at {site}, step {self.step}", wrong)
        self._agreed = True
        names = f.min + f.max
        return {
            n: (v if i < len(f.min) else -v)
            for i, (n, v) in enumerate(zip(names, decided, strict=False))
        }

    def _verdict(self, low: int, high: int, fp: int, where: str, wrong: str = "") -> None:
        """Raise if the reduced fingerprint words (``low``, ``high``) carry a bad-value
        marker or are not this rank's fingerprint ``fp`` on every rank."""
        if low <= _UNFIT:
            rank, field = divmod(_UNFIT - low, WIRE)
            names = self.fields.min + self.fields.max
            name = repr(names[field]) if field < len(names) else f"#{field}"
            what = f"gave field {name} a value that is not an integer within a signed 64-bit word"
            if field == _NAMES:
                what = (
                    f"called agree() with field names that are not the agreement's "
                    f"{list(names)}" + (f" ({wrong})" if rank == self.topo.rank and wrong else "")
                )
            raise RankBadValue(
                f"rank {rank} {what}; every rank stops at this agreement (rank {self.topo.rank} "
                f"{where})"
            )
        if low == _POISON or low != high or low != fp:
            if low != _POISON:
                other = f"{self._describe(low)} / {self._describe(high)}"
            elif self._upstream is not None:
                other = f"{self._describe(self._upstream)} (the stages before this one)"
            else:
                other = "a rank that stopped on a mismatch"
            raise RankMismatch(
                f"rank {self.topo.rank} is at {self._describe(fp)}, but other ranks are at "
                f"{other}: every rank must run the same sync points, with the same fields, "
                "in the same order"
            )

    def _reduce(self, tensor: torch.Tensor) -> None:
        topo = self.topo
        groups = [topo.stage_group] if topo.stage_group is not None else list(topo.stage_groups)
        for group in groups:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
            self.collectives += 1

    def _relay(self, reduced: torch.Tensor) -> list[int]:
        """Stage 0 decides; the decision travels down, each stage's values fold in.

        Message down the pipeline: [decision | fold]; the last stage sends the
        fold back to stage 0, which takes it into its next decision.
        """
        topo, width = self.topo, self.fields.width
        own = reduced.tolist()
        if topo.pp_rank == 0:
            if self.step > 1:
                self._fold = self._recv(self._last_stage(), width)
            last_fp, self._last_fp = self._last_fp, own[-2]
            if self._fold is None or self._fresh:  # the last run's values say nothing
                values = self.fields.cautious_packed()
            else:
                values = self._fold[:-2]
            self._fresh = False
            # stages disagreed last step, or the fold is not of this agreement's last step
            # (a later stage's bad value goes on as it is, so every stage names it)
            if self._fold is not None and self._fold[-2] <= _UNFIT:
                mark = min(own[-2], self._fold[-2])
                own = [*own[:-2], mark, -mark]
            elif self._fold is not None and not self._fold[-2] == -self._fold[-1] == last_fp:
                own = [*own[:-2], _POISON, -_POISON]
            decision = [min(a, b) for a, b in zip(own[:-2], values, strict=True)] + own[-2:]
            fold = own
        else:
            assert topo.pp_prev is not None
            received = self._recv(topo.pp_prev, 2 * width)
            decision, fold = received[:width], received[width:]
            if min(decision[-2], own[-2]) <= _UNFIT:  # a bad value, here or before: pass it on
                mark = min(decision[-2], own[-2])
                decision = [*decision[:-2], mark, -mark]
            elif decision[-2] != own[-2]:  # this stage is elsewhere: stop everyone downstream
                if decision[-2] != _POISON:  # found here: say where the stages before are
                    self._upstream = decision[-2]
                decision = [*decision[:-2], _POISON, -_POISON]
            fold = [min(a, b) for a, b in zip(fold, own, strict=True)]
        if topo.pp_next is not None:
            self._send(decision + fold, topo.pp_next)
        else:  # close the ring
            self._send(fold, self._first_stage())
        return decision

    def _first_stage(self) -> int:
        assert self.topo.pp_first is not None
        return self.topo.pp_first

    def _last_stage(self) -> int:
        assert self.topo.pp_last is not None
        return self.topo.pp_last

    def _send(self, values: list[int], dst: int) -> None:
        tensor = torch.tensor(values, dtype=torch.int64)
        work = dist.isend(tensor, dst, group=self.topo.relay_group, tag=self._tag)
        assert work is not None, "isend returns a handle for a peer rank"
        self.pending.append(work)

    def _recv(self, src: int, width: int) -> list[int]:
        buf = torch.empty(width, dtype=torch.int64)
        work = dist.irecv(buf, src, group=self.topo.relay_group, tag=self._tag)
        assert work is not None, "irecv returns a handle for a peer rank"
        if not work.wait(self.topo.timeout):
            raise RankFailure(
                f"no message from rank {src} within {self.topo.timeout.total_seconds()}s"
            )
        return buf.tolist()

    def _reap(self) -> None:
        """Drop finished sends; if too many are still pending, wait for the oldest."""
        self.pending = [w for w in self.pending if not w.is_completed()]
        while len(self.pending) > self.MAX_PENDING_SENDS:
            self.pending.pop(0).wait(self.topo.timeout)

    def close(self) -> None:
        """End the relay cleanly: stage 0 takes the ring's last message, and every
        send still in flight completes. Call on every rank before the groups go.

        Stage 0 hears of a later stage's mismatch or bad value a step late: for
        the last step, here. If that step returned its values on stage 0 and a
        later stage was elsewhere or gave a bad value, this raises what that
        stage raised (RankMismatch, RankBadValue): the step was not agreed."""
        fold = None
        try:
            if self.topo.pp_size > 1 and self.topo.pp_rank == 0 and self.step > 0:
                fold = self._recv(self._last_stage(), self.fields.width)
            for work in self.pending:
                work.wait(self.topo.timeout)
        except RuntimeError as exc:
            raise RankFailure(f"rank {self.topo.rank} closing the agreement: {exc}") from None
        finally:
            self.pending.clear()
        if fold is not None and self._agreed:
            where = f"closing after step {self.step}, which a later stage did not agree on"
            self._verdict(fold[-2], -fold[-1], self._last_fp, where)
