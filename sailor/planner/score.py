"""The closed-form score of a count vector of pipeline kinds: the iteration time and cost the
planner's searches (`engine`, `paper`) rank candidates by.

Notation. A pipeline kind k (`kinds.Kind`: an option and a zone per stage) has, under the closed
form of `simulator.schedule.closed_form_1f1b` (affine in m from m = 2 on: the straggler pays each
extra micro-batch), a time for m micro-batches (`kinds.Curve`)

    time_k(1) = A_k,   time_k(m) = B_k + (m - 2)·t_k  for m >= 2

and uses G_k GPUs. A candidate is a count vector n (n_k pipelines of kind k). Its iteration time is

    T(n) = W(n) + max_i S_i(n) + O(n) + C(n)

with W the pipeline makespan under the best integer batch shares, S_i the all-reduce of stage i over
the D = Σ n_k replicas, O the slowest optimizer step and C the step's two all-reduces over every
rank (`simulator.sync.step_allreduces_s`). The stages' memory options are the same
for every kind of a family (one StageMemory per stage); a count vector is feasible only when D
reaches every used kind's `min_replicas` (ZeRO options fit from some D on). Under ZeRO the optimizer
step (and under ZeRO-3 the per-micro-batch weight gathers) depend on D, so the scorer rebuilds those
kinds at the vector's D (`Kind.at`), exactly as `simulate` times them; the kinds handed to the bounds
hold D-free lower bounds (gathers at min_replicas, optimizer at the largest possible D).

Batch shares (exact): W(n) = min τ such that Σ_k n_k·cap_k(τ) >= M, cap_k(τ) = max{m >= 1 :
time_k(m) <= τ}, M = global batch / micro-batch (`min_makespan`); each pipeline gets cap_k(τ)
micro-batches and the excess is taken back from the pipelines whose micro-batches pay the most
egress (cross-zone activations), then from the slowest. Every split with makespan <= τ keeps each
pipeline between 1 and cap_k(τ) micro-batches, so this split has the least p2p egress among the
splits of least makespan: under the throughput objective (time first, then cost) it is the best
split; under the cost objective it is the best split that keeps the makespan minimal (the space's
rule: batch shares never trade makespan for egress). The published space (`paper`) gives every
pipeline M / D micro-batches instead (`Scorer.equal_shares`).

Gradient sync and the step's all-reduces: as `simulate` computes them on the plan
`finalists.plan_from_kinds` builds, pipelines placed on nodes as the launcher places them
(`simulator.place`); kinds in different (zone, GPU type) pools are placed as if alone, which lets
their placements be memoised per kind (`placed_apart`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from sailor.core.units import HOUR_S
from sailor.planner.alike import canonical_used
from sailor.planner.kinds import Kind, make_kinds
from sailor.simulator import SimContext, Slot, place, stage_sync, stage_time, tied_sync, time_options
from sailor.simulator.collectives import Group, group_members, ring_key
from sailor.simulator.sync import step_allreduces_s, world_groups


def min_makespan(kinds: list[Kind], counts: tuple[int, ...], M: int) -> float | None:
    """Smallest τ at which the pipelines (counts[k] of kind k) can finish M micro-batches, each
    pipeline at least one; None when there are more pipelines than micro-batches.

    The answer is a breakpoint time_k(m). Ignoring the floors, Σ_k n_k·(2 + (τ - B_k)/t_k) = M gives
    τ0; the floors lose less than one micro-batch per pipeline, so τ* lies in [τ0, τ0 + max t_k] and
    only the few breakpoints in that window are tried, in order.
    """
    D = sum(counts)
    if D == 0 or D > M:
        return None
    used = [(kinds[k], n) for k, n in enumerate(counts) if n]
    lo = max(t.fill_s for t, _ in used)

    def total(tau: float) -> int:
        return sum(n * t.cap(tau) for t, n in used)

    if total(lo) >= M:
        return lo
    rate = sum(n / t.period_s for t, n in used)
    tau0 = max(lo, (M - sum(n * (2.0 - t.two_s / t.period_s) for t, n in used)) / rate)
    t_max = max(t.period_s for t, _ in used)
    points = {t.two_s for t, _ in used if t.two_s >= lo}
    for t, _ in used:
        j0 = max(0, math.floor((tau0 - t.two_s) / t.period_s) - 1)
        j1 = math.ceil((tau0 + t_max - t.two_s) / t.period_s) + 1
        points.update(t.two_s + j * t.period_s for j in range(j0, j1 + 1))
    for tau in sorted(p for p in points if p >= lo):
        if total(tau) >= M:
            return tau
    raise AssertionError("makespan window missed")  # the window argument above rules this out


def waterfill(kinds: list[Kind], counts: tuple[int, ...], M: int) -> tuple[float, list[list[int]]] | None:
    """Best integer batch shares: (makespan W in s, micro-batches per pipeline for each kind), or None
    when the pipelines outnumber the M micro-batches (each needs at least one)."""
    tau = min_makespan(kinds, counts, M)
    if tau is None:
        return None
    shares = [[kinds[k].cap(tau)] * n if n else [] for k, n in enumerate(counts)]
    excess = sum(map(sum, shares)) - M
    # Take the excess back from the kinds whose micro-batches pay the most egress first; among kinds
    # of equal egress one micro-batch per pipeline per pass, slowest kinds first. The makespan stays τ
    # (τ is optimal, so it cannot drop below it) and every pipeline keeps at least one.
    by_egress: dict[float, list[int]] = {}
    for k in range(len(kinds)):
        if shares[k]:
            by_egress.setdefault(kinds[k].egress_usd_per_mb, []).append(k)
    for e in sorted(by_egress, reverse=True):
        order = sorted(by_egress[e], key=lambda k: -kinds[k].time_s(shares[k][0]))
        room = sum(m - 1 for k in order for m in shares[k])
        take = min(excess, room)
        excess -= take
        while take > 0:
            for k in order:
                for j, m in enumerate(shares[k]):
                    if take == 0:
                        break
                    if m > 1:
                        shares[k][j] = m - 1
                        take -= 1
    assert excess == 0
    W = max(kinds[k].time_s(max(s)) for k, s in enumerate(shares) if s)
    return W, shares


@dataclass
class Scorer:
    """Scores count vectors over `kinds` (all with the family's memory options) for one
    (P, mbs, partition, memory) family; caches the sync and the step's all-reduces per count vector."""

    ctx: SimContext
    partition: tuple
    mbs: int
    kinds: list[Kind]
    M: int
    equal_shares: bool = False  # the published space: every pipeline gets M / D micro-batches
    _sync: dict = field(default_factory=dict)
    _step: dict = field(default_factory=dict)
    _canonical: dict = field(default_factory=dict)
    _at: dict = field(default_factory=dict)
    _passes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        memory = self.kinds[0].memory if self.kinds else ()
        # the sync's collectives depend on the stages' ZeRO levels only (not on D)
        self._sync_options = [time_options(m, 2) for m in memory]
        self._d_dependent = any(k.depends_on_replicas for k in self.kinds)

    def kinds_at(self, D: int, counts: tuple[int, ...]) -> list[Kind]:
        """The kinds with constants exact for D pipelines (`Kind.at`) where `counts` uses them, the
        others as they are (`score` reads nothing of an unused kind: a scorer holds every kind of
        a packing, a count vector uses a few); cached per D and kind."""
        if not self._d_dependent:
            return self.kinds
        if D not in self._at:
            self._at[D] = (list(self.kinds), set())
        at, done = self._at[D]
        want = [j for j, n in enumerate(counts) if n and j not in done]
        if want:
            todo = [self.kinds[j] for j in want if self.kinds[j].depends_on_replicas and self.kinds[j].replicas != D]
            for memory in dict.fromkeys(k.memory for k in todo):  # batched calls (`Kind.at` builds one by one)
                make_kinds(self.ctx, [k.spec for k in todo if k.memory == memory], self.partition,
                           self.mbs, memory, D)
            for j in want:
                at[j] = self.kinds[j].at(self.ctx, self.partition, self.mbs, D)
            done.update(want)
        return at

    def _used(self, counts: tuple[int, ...]) -> tuple[tuple, tuple]:
        """(each used kind's (slots, count), in kind order; the same with zones renamed to those of an
        alike region, `alike.canonical_used`) of these counts: what `sync` and `step_collectives`
        memoise their terms by (cached per count vector)."""
        if counts not in self._canonical:
            used = tuple((k.slots, n) for k, n in zip(self.kinds, counts) if n)
            self._canonical[counts] = used, canonical_used(self.ctx, used)
        return self._canonical[counts]

    def sync(self, counts: tuple[int, ...], rounds: int = 1) -> tuple[float, float]:
        """(tied + slowest stage gradient sync seconds, egress $ per iteration) for these counts, as
        `simulate` computes them (`tied_sync`, `stage_sync` with the stages' options at D) on the
        plan `finalists.plan_from_kinds` makes: pipelines in kind order, placed on nodes as the launcher
        places them (`place`), so replicas that share a node reduce over the intra-node link; `rounds`:
        the largest pipeline's micro-batches (`Plan.step_rounds`), how often ZeRO-2/3 reduce-scatter.
        Memoised in the context by what it depends on (each used kind's slots and count, in order,
        zones renamed to those of an alike region, `alike.canonical_used`; the partition; the stages'
        sync options; the micro-batch size, whose backward hides it; the rounds), so scorers over
        other kind lists, and over the same pipelines in an alike region, share it."""
        if (counts, rounds) not in self._sync:
            used, canonical = self._used(counts)
            key = ("counts-sync", canonical, tuple(self.partition), tuple(self._sync_options), self.mbs, rounds)
            if key not in self.ctx.memo:
                self.ctx.memo[key] = self._sync_of(used, rounds)
            self._sync[(counts, rounds)] = self.ctx.memo[key]
        return self._sync[(counts, rounds)]

    def _sync_of(self, used: tuple[tuple[tuple[Slot, ...], int], ...], rounds: int) -> tuple[float, float]:
        """`sync` of the used kinds' (slots, count), in kind order, over `rounds` micro-batch rounds."""
        P, D = len(self.partition), sum(n for _, n in used)
        ends = (self._sync_options[0].zero, self._sync_options[-1].zero) if self._sync_options else (0, 0)
        alone = placed_apart(used)
        if alone:  # each kind's pipelines placed as if alone: its pairs and stage members memoised
            pairs = [term for slots, n in used for term in _tied_terms(self.ctx, slots, n, ends, D)]
        else:
            placed = place([pipe for slots, n in used for pipe in [list(slots)] * n], self.ctx.cluster)
            pairs = [(tied_sync(self.ctx, first, last, P, ends, D), n)
                     for (first, last), n in Counter((pipe[0], pipe[-1]) for pipe in placed).items()]
        tied, usd = 0.0, 0.0
        for (s, _, u), n in pairs:
            tied = max(tied, s)
            usd += n * u
        worst = 0.0
        stages = apart_groups(self.ctx, used) if alone else None
        for i, (a, e) in enumerate(self.partition):
            groups = stages[i] if alone else group_members([pipe[i] for pipe in placed])
            s, _, u = stage_sync(self.ctx, groups, ((a, e),), self._sync_options[i], self.mbs, rounds=rounds)
            worst = max(worst, s)
            usd += u
        return tied + worst, usd

    def step_collectives(self, counts: tuple[int, ...]) -> float:
        """Seconds of the step's two all-reduces over every rank (`simulator.sync.step_allreduces_s`)
        of the plan these counts make, placed as `sync` places it. They read the pipelines' stage
        count, their number and where their ranks sit, nothing of the partition, micro-batch size or
        memory options: memoised in the context by each used kind's slots and count, in order, zones
        renamed to those of an alike region (`alike.canonical_used`), so every family's scorers over
        these pipelines share it."""
        if counts not in self._step:
            used, canonical = self._used(counts)
            key = ("counts-step", canonical)
            if key not in self.ctx.memo:
                self.ctx.memo[key] = step_allreduces_s(self.ctx, _world_of(self.ctx, used), len(used[0][0]),
                                                       sum(n for _, n in used))
            self._step[counts] = self.ctx.memo[key]
        return self._step[counts]

    def score(self, counts: tuple[int, ...], hopeless: Callable[[float, float], bool] | None = None,
              floor_s: float = 0.0) -> "Candidate | None":
        """The candidate of these counts (None when its pipelines outnumber the micro-batches, when
        equal shares do not divide M, or when some option needs more data-parallel replicas). With
        `hopeless` (`Finalists.hopeless`), also None when it is true of (seconds, $/iteration)
        without the gradient sync, a lower bound on both, and the sync is not computed; or when it
        is true of the bounds that `floor_s`, a makespan the counts cannot beat (a packing's τ,
        `pack.Packer.fastest`), gives with the kinds' lower bounds over D (`kinds.make_kinds`) and
        the cheapest egress, and then the batch shares are not computed either."""
        D = sum(counts)
        if D == 0 or D < max((k.min_replicas for k, n in zip(self.kinds, counts) if n), default=1):
            return None
        if hopeless is not None and floor_s > 0:
            used = [(k, n) for k, n in zip(self.kinds, counts) if n]
            t = floor_s + max(k.optimizer_s for k, _ in used)
            usd = sum(k.usd_per_hour * n for k, n in used) * t / HOUR_S + self.M * min(k.egress_usd_per_mb for k, _ in used)
            if hopeless(t, usd):
                return None
        kinds = self.kinds_at(D, counts)
        if self.equal_shares:
            if self.M % D:
                return None
            shares = [[self.M // D] * n for n in counts]
            W = max(k.time_s(self.M // D) for k, n in zip(kinds, counts) if n)
        else:
            wf = waterfill(kinds, counts, self.M)
            if wf is None:
                return None
            W, shares = wf
        egress = sum(k.egress_usd_per_mb * sum(sh) for k, sh in zip(kinds, shares) if sh)
        opt = max(k.optimizer_s for k, n in zip(kinds, counts) if n)
        rate = sum(k.usd_per_hour * n for k, n in zip(kinds, counts))
        if hopeless is not None and hopeless(W + opt, rate * (W + opt) / HOUR_S + egress):
            return None
        sync_s, sync_usd = self.sync(counts, max(max(sh) for sh in shares if sh))
        egress += sync_usd
        T = W + sync_s + opt + self.step_collectives(counts)
        return Candidate(iteration_time_s=T, cost_per_iteration_usd=rate * T / HOUR_S + egress,
                         usd_per_hour_gpus=rate, counts=counts, shares=shares, scorer=self, makespan_s=W)

    def event_floor_s(self, cand: "Candidate") -> float:
        """A lower bound on the iteration time the event simulation gives `cand`'s plan (seconds):
        its closed form with the makespan W replaced by the largest `pipeline_floor_s` over the used
        kinds at their largest share. The closed form's pipeline times are an estimate
        (`simulator.schedule.closed_form_1f1b`), which the event simulation can undercut; the sync,
        the optimizer step and the step's all-reduces are the same in both (`simulate`)."""
        D = sum(cand.counts)
        kinds = self.kinds_at(D, cand.counts)
        W = 0.0
        for j, (kind, shares) in enumerate(zip(kinds, cand.shares)):
            if shares:
                if (j, D) not in self._passes:
                    options = [time_options(mem, D) for mem in kind.memory]
                    self._passes[(j, D)] = _stage_passes(self.ctx, kind.slots, self.partition, self.mbs, options)
                W = max(W, pipeline_floor_s(*self._passes[(j, D)], max(shares)))
        return cand.iteration_time_s - cand.makespan_s + W


def _stage_passes(ctx: SimContext, slots: tuple[Slot, ...], partition, mbs: int,
                  options: list) -> tuple[np.ndarray, np.ndarray]:
    """(lead, busy), arrays (P,) of seconds for a pipeline on `slots`: busy[s] = f_s + b_s, one
    micro-batch's forward and backward on stage s (`stage_time` under the stage's time options), and
    lead[s] = Σ_{i<s} busy[i]."""
    times = [stage_time(ctx, slot, mbs, a, e, o) for slot, (a, e), o in zip(slots, partition, options)]
    busy = np.array([t.forward_s + t.backward_s for t in times])
    return np.concatenate(([0.0], np.cumsum(busy)[:-1])), busy


def pipeline_floor_s(lead: np.ndarray, busy: np.ndarray, m: int) -> float:
    """A lower bound on one pipeline's 1F1B time for m micro-batches in any simulation whose stages
    run their passes one at a time and whose transfers take no negative time (the event simulation):
        max_s  lead[s] + m·busy[s]
    (`_stage_passes`). Stage s cannot start its first forward before every earlier stage has run
    one, runs its m forwards and m backwards one after another, and after its last backward every
    earlier stage runs one more; the earlier stages' forward and backward of one micro-batch add up
    to lead[s]."""
    return float(np.max(lead + m * busy))


def placed_apart(used: tuple[tuple[tuple[Slot, ...], int], ...]) -> bool:
    """True when no two kinds of `used` ((slots, count) each) share a (zone, GPU type) pool: the
    launcher fills each pool's nodes separately, so each kind's pipelines are then placed as if
    alone (`placed_alone`)."""
    pools = [{(s.zone, s.gpu) for s in slots} for slots, _ in used]
    return sum(map(len, pools)) == len(set().union(*pools))


def placed_alone(ctx: SimContext, slots: tuple[Slot, ...], n: int) -> list[tuple[Slot, ...]]:
    """n pipelines of these slots placed on nodes alone (`simulator.place`), each a tuple (smaller
    than a list: the memo holds tens of thousands of placements). The launcher places pipelines in
    order, so n of them sit where the first n of more do: one placement per kind, the longest asked
    for (grown by doubling), serves every count (memoised in the context)."""
    key = ("placed", slots)
    have = ctx.memo.get(key)
    if have is None or len(have) < n:
        have = [tuple(p) for p in place([list(slots)] * max(n, 2 * len(have or ())), ctx.cluster)]
        ctx.memo[key] = have
    return have[:n]


def _world_of(ctx: SimContext, used: tuple[tuple[tuple[Slot, ...], int], ...]) -> list[Group]:
    """Every rank of the pipelines of `used` ((slots, count) per kind, in order) placed as
    `Scorer.sync` places them, as ring groups (`simulator.sync.world_groups`). Kinds placed apart
    (`placed_apart`): each kind's ranks found once (memoised per kind and count), merged in ring
    order as `apart_groups` merges a stage's."""
    if not placed_apart(used):
        return world_groups(sl for pipe in place([pipe for slots, n in used for pipe in [list(slots)] * n],
                                                 ctx.cluster) for sl in pipe)
    parts = []
    for slots, n in used:
        key = ("placed-world", slots, n)
        part = ctx.memo.get(key)
        if part is None:
            part = ctx.memo[key] = _ring_part(world_groups(sl for pipe in placed_alone(ctx, slots, n) for sl in pipe))
        parts.append(part)
    return _merge_ring_parts(parts)


def _tied_terms(ctx: SimContext, slots: tuple[Slot, ...], n: int, zero: tuple[int, int],
                replicas: int) -> list[tuple[tuple[float, float, float], int]]:
    """(`tied_sync` of a (first, last) pair, how many pipelines have it) for n pipelines of these
    slots placed alone, of `replicas` pipelines in all, the end stages at ZeRO levels `zero`; pairs
    in order of first appearance (memoised per kind, count, ZeRO levels and pipelines)."""
    key = ("placed-tied", slots, n, zero, replicas)
    if key not in ctx.memo:
        pairs = Counter((pipe[0], pipe[-1]) for pipe in placed_alone(ctx, slots, n))
        ctx.memo[key] = [(tied_sync(ctx, first, last, len(slots), zero, replicas), k)
                         for (first, last), k in pairs.items()]
    return ctx.memo[key]


def apart_groups(ctx: SimContext, used: tuple[tuple[tuple[Slot, ...], int], ...]) -> list[list[Group]]:
    """Each stage's replicas as `group_members` orders them, [stage][group], for kinds ((slots, count)
    each, all of P stages) placed apart (`placed_apart`): each kind's groups of every stage are found
    and sorted once (memoised per kind and count, one look-up per kind for all P stages: its slots'
    tuple is hashed anew at each look-up), then merged in ring order (their members differ, so the
    ring keys do): where the kinds' ranges of ring keys do not overlap (each pool's nodes are named
    apart, `simulator.place`), the kinds' groups one after the other, ordered by their first keys,
    are that order. A kind's groups of a stage are memoised with the ring keys of the first and last
    only (the merge reads no others): the memo holds the groups of many kinds and counts, each group
    one object however many entries hold it (n pipelines of a kind sit where the first n of more
    do, `placed_alone`, so the entries of one kind at several counts hold mostly the same groups)."""
    per_kind = []
    shared = ctx.memo.setdefault("placed groups", {})  # one object per group
    for slots, n in used:
        key = ("placed-stages", slots, n)
        stages = ctx.memo.get(key)
        if stages is None:
            placed = placed_alone(ctx, slots, n)
            stages = ctx.memo[key] = [
                _ring_part([shared.get(g) or shared.setdefault(g, g) for g in group_members([pipe[i] for pipe in placed])])
                for i in range(len(slots))]
        per_kind.append(stages)
    return [_merge_ring_parts([stages[i] for stages in per_kind if stages[i]]) for i in range(len(used[0][0]))]


def _ring_part(groups: list[Group]) -> tuple[tuple, tuple, list[Group]] | None:
    """(first group's ring key, last group's ring key, the groups) of one kind's groups of a stage in
    ring order; None for none."""
    return (ring_key(groups[0]), ring_key(groups[-1]), groups) if groups else None


def _merge_ring_parts(parts: list[tuple[tuple, tuple, list[Group]]]) -> list[Group]:
    """The groups of `parts` (`_ring_part`s of kinds whose members are apart) in ring order
    (`apart_groups`)."""
    if len(parts) == 1:
        return list(parts[0][2])
    parts.sort(key=lambda part: part[0])
    if all(a[1] < b[0] for a, b in zip(parts, parts[1:])):
        return [g for part in parts for g in part[2]]
    return [g for _, g in sorted((ring_key(g), g) for part in parts for g in part[2])]


@dataclass
class Candidate:
    """A scored point of the space (closed form)."""

    iteration_time_s: float
    cost_per_iteration_usd: float
    usd_per_hour_gpus: float
    counts: tuple[int, ...]
    shares: list[list[int]]
    scorer: Scorer
    makespan_s: float = 0.0  # W: the slowest pipeline's closed-form time under its share

    @property
    def throughput(self) -> float:
        return 1.0 / self.iteration_time_s

    @property
    def cost_per_hour_usd(self) -> float:
        return self.cost_per_iteration_usd * HOUR_S / self.iteration_time_s
