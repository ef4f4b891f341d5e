"""Planner: which GPUs, where, and how to parallelize — the best plan under the simulator.

Three phases (STYLE.md §2.8): (1) tables — `space`: stage options, TP templates, partitions;
(2) search — `search`: pipeline counts per (GPU type, zone) and batch shares, exact on small spaces
and bounded scans on large ones, everything scored with the simulator's closed form; (3) scoring —
the best `rescore` candidates are simulated again with the 1F1B event simulation and the best of them
under the objective is returned with its alternatives.

Pruning (DESIGN.md §5): H1 TP within a node; H2 only TP degrees whose memory fits (stage options);
H3/H4 data-parallel degree scanned from large to small (throughput) or small to large (cost) with a
sound stopping bound; H5 a plan uses the zones of one region; H6 zones of a region share one search
(their pipelines are counted per zone, so prices and links of each zone still count). Outer loops
(P, micro-batch, partition, templates) are skipped when a lower bound on their best score cannot beat
the best plan found so far.

Every call builds its own SimContext: nothing is cached across calls.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from sailor.errors import InfeasibleError, SailorInputError
from sailor.plan import Plan
import numpy as np

from sailor.simulator import Estimate, SimContext, Slot, simulate, stage_sync
from sailor.simulator.collectives import allreduce_time_s
from sailor.simulator.memory import replica_memory
from sailor.planner import search as S
from sailor.planner.space import (candidate_partitions, even_partition, mbs_candidates, stage_options,
                                  templates)

GB = 1e9
# Clusters of at most this many GPUs are searched exactly (every template, every count vector where
# there are at most search.EXHAUSTIVE_COUNTS); larger ones with the heuristics of `_template_combos`
# and `_search_counts` (the brute-force tests check the exact mode).
EXACT_MAX_GPUS = 32


class Objective(str, Enum):
    """What to optimise. With a fixed global batch, these are time-to-train and cost-to-train."""

    THROUGHPUT = "throughput"  # maximise iterations/s
    COST = "cost"              # minimise $/iteration


class SearchSpace(str, Enum):
    """`full`: our space. `paper`: the published one (even layer split, equal batch per pipeline, one
    TP per GPU type). `homogeneous`: one GPU type in one zone, uniform TP, even split, equal shares."""

    FULL = "full"
    PAPER = "paper"
    HOMOGENEOUS = "homogeneous"


@dataclass(frozen=True)
class Constraints:
    """Limits a plan must respect (None = no limit). Units: $/iteration, $/hour, iterations/s."""

    max_cost_per_iteration: float | None = None
    max_cost_per_hour: float | None = None
    min_throughput: float | None = None

    def ok(self, time_s: float, cost_usd: float) -> bool:
        if self.max_cost_per_iteration is not None and cost_usd > self.max_cost_per_iteration:
            return False
        if self.max_cost_per_hour is not None and cost_usd * 3600.0 / time_s > self.max_cost_per_hour:
            return False
        if self.min_throughput is not None and 1.0 / time_s < self.min_throughput:
            return False
        return True


@dataclass
class PlanOptions:
    """Search settings. `max_stages` bounds P; `max_mbs` the micro-batch size; `top_k` the
    alternatives kept; `rescore` how many closed-form finalists get the event simulation;
    `templates_per_gpu` how many TP templates per GPU type enter the count search on large spaces."""

    objective: Objective = Objective.THROUGHPUT
    constraints: Constraints = field(default_factory=Constraints)
    search: SearchSpace = SearchSpace.FULL
    max_stages: int = 16
    max_mbs: int = 32
    top_k: int = 5
    rescore: int = 8
    templates_per_gpu: int = 3


@dataclass
class Choice:
    """A finalist: the plan, its closed-form score and (after phase 3) its event-simulated estimate."""

    plan: Plan
    closed_time_s: float
    closed_cost_usd: float
    estimate: Estimate | None = None


@dataclass
class PlanResult:
    """The best plan, its estimate, the alternatives and search statistics."""

    plan: Plan
    estimate: Estimate
    alternatives: list[Choice]
    best_closed: Choice
    search_time_s: float
    points: int           # (P, mbs, partition, templates) points searched
    candidates: int       # count vectors scored
    pareto: list[tuple[float, float]] = field(default_factory=list)
    """Closed-form (iteration time s, $/iteration) of the scored candidates that no other scored
    candidate beats on both, sorted by time (constraints not applied): the trade-off curve."""


def _key(objective: Objective) -> Callable[[float, float], tuple[float, float]]:
    if objective is Objective.THROUGHPUT:
        return lambda t, c: (t, c)
    return lambda t, c: (c, t)


def plan_job(ctx: SimContext, options: PlanOptions | None = None,
             progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """Find the best plan for ctx.job on ctx.cluster.

    Best-first branch and bound over *families* (region, P, micro-batch, partition): each family gets
    a lower bound on its best objective from an optimistic virtual pipeline (every stage at its
    fastest feasible TP, the fewest GPUs per pipeline); families are searched in bound order and the
    search stops when the next bound cannot beat the best plan found (exact for the space).

    Args:
        ctx: job, cluster, profiles and network (a fresh SimContext per call).
        options: objective, constraints, search space and bounds.
        progress: called as progress(done, total) as families are searched or pruned.
    Returns:
        PlanResult with the best plan (carrying job and cluster) and its event-simulated estimate.
    Raises:
        InfeasibleError: no plan fits memory, GPUs or constraints; the message names the binding reason.
    """
    opts = options or PlanOptions()
    t0 = time.perf_counter()
    job, cluster = ctx.job, ctx.cluster
    if cluster.total_gpus() == 0:
        raise InfeasibleError("the cluster offers no GPUs")
    key = _key(opts.objective)
    finalists: dict[tuple, tuple[tuple[float, float], S.Candidate, tuple]] = {}
    state = {"best": None, "points": 0, "candidates": 0}
    keep = 2 * max(opts.top_k, opts.rescore)

    front: list[tuple[float, float]] = []

    def offer(cand: S.Candidate, point: tuple) -> None:
        state["candidates"] += 1
        _pareto_add(front, (cand.iteration_time_s, cand.cost_per_iteration_usd))
        if not opts.constraints.ok(cand.iteration_time_s, cand.cost_per_iteration_usd):
            return
        k = key(cand.iteration_time_s, cand.cost_per_iteration_usd)
        finalists[(point, cand.counts)] = (k, cand, point)
        if state["best"] is None or k < state["best"]:
            state["best"] = k
        if len(finalists) > 2 * keep:
            for sig in sorted(finalists, key=lambda s: finalists[s][0])[keep:]:
                del finalists[sig]

    exact = cluster.total_gpus() <= EXACT_MAX_GPUS
    # Two-level best-first branch and bound: coarse nodes (region, P, micro-batch) are expanded into
    # families (one per partition) only when their bound can still beat the best plan; families are
    # searched in bound order; everything left once the smallest bound cannot win is pruned.
    heap: list = []
    coarse = list(_coarse_nodes(ctx, opts))
    for n, (bound, node) in enumerate(coarse):
        heapq.heappush(heap, (bound, 0, n, node))
    counter, done, any_family = len(coarse), 0, False
    while heap:
        bound, kind, _, item = heapq.heappop(heap)
        if state["best"] is not None and bound[0] >= state["best"][0]:
            break  # the heap is ordered by bound: nothing left can win
        if kind == 0:
            for fbound, fam in _families(ctx, opts, *item):
                any_family = True
                counter += 1
                heapq.heappush(heap, (fbound, 1, counter, fam))
            done += 1
            if progress:
                progress(done, len(coarse))
            continue
        for types, point in _points(ctx, opts, item, exact):
            state["points"] += 1
            _search_counts(ctx, opts, types, point, item.M, offer, state, key, exact)
    if progress:
        progress(len(coarse), len(coarse))

    if not finalists:
        raise InfeasibleError(_why_infeasible(ctx, opts, any_family))
    ranked = sorted(finalists.values(), key=lambda v: v[0])
    choices = [Choice(_build_plan(ctx, cand, point), cand.iteration_time_s, cand.cost_per_iteration_usd)
               for _, cand, point in ranked[: max(opts.rescore, opts.top_k + 1)]]
    best_closed = choices[0]
    for ch in choices[: opts.rescore]:
        ch.estimate = simulate(ch.plan, ctx)
    scored = [c for c in choices[: opts.rescore]
              if opts.constraints.ok(c.estimate.iteration_time_s, c.estimate.cost_per_iteration_usd)]
    scored = scored or choices[:1]
    scored.sort(key=lambda c: key(c.estimate.iteration_time_s, c.estimate.cost_per_iteration_usd))
    best = scored[0]
    alternatives = [c for c in choices if c is not best][: opts.top_k]
    for c in alternatives:
        if c.estimate is None:
            c.estimate = simulate(c.plan, ctx)
    alternatives.sort(key=lambda c: key(c.estimate.iteration_time_s, c.estimate.cost_per_iteration_usd))
    return PlanResult(plan=best.plan, estimate=best.estimate, alternatives=alternatives,
                      best_closed=best_closed, search_time_s=time.perf_counter() - t0,
                      points=state["points"], candidates=state["candidates"], pareto=sorted(front))


def _pareto_add(front: list[tuple[float, float]], p: tuple[float, float]) -> None:
    """Add (time, cost) to a Pareto front (minimise both) kept in place; amortised cheap because most
    points are dominated by one of the few front points."""
    if any(q[0] <= p[0] and q[1] <= p[1] for q in front):
        return
    front[:] = [q for q in front if not (p[0] <= q[0] and p[1] <= q[1])]
    front.append(p)


@dataclass(frozen=True)
class Family:
    """(region, P, micro-batch, partition) with the TP templates feasible per GPU type."""

    zones: tuple[str, ...]
    mbs: int
    M: int
    partition: tuple
    templates: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]  # (gpu, its templates)


def _coarse_nodes(ctx: SimContext, opts: PlanOptions):
    """Yield (lower-bound key, (zones, P, mbs)) for every region, pipeline depth and micro-batch."""
    job = ctx.job
    P_max = min(job.model.num_layers, opts.max_stages)
    for zones in _regions(ctx.cluster).values():
        for P in range(1, P_max + 1):
            for mbs in mbs_candidates(job.global_batch_size, opts.max_mbs):
                yield _coarse_bound(ctx, zones, P, mbs, opts), (tuple(zones), P, mbs)


def _coarse_bound(ctx: SimContext, zones, P: int, mbs: int, opts: PlanOptions) -> tuple[float, float]:
    """Lower bound on any plan with P stages and micro-batch `mbs` in these zones, whatever its
    partition and TP degrees (memory ignored, so it stays a bound).

    Per GPU type: a pipeline's first micro-batch takes at least fill = Σ_layers min_t (f+b)(layer, t),
    each further one at least fill / P (its slowest stage holds at least 1/P of that compute), and a
    pipeline j of any TP degrees spends at least work = Σ_layers min_t t·(f+b)(layer, t) GPU-seconds
    per micro-batch (G_j x its period). A pipeline finishes cap_j <= 1 + (τ - fill_j)/period_j <=
    τ·G_j/work micro-batches by τ (fill_j >= period_j), so `a` GPUs of a type in a zone finish at most
    min((a/P)·(1 + (τ - fill)·P/fill), a·τ/work) by τ.
    The sync of two or more replicas is at least half the two-replica all-reduce of 1/P of the
    model's gradient at the most favourable TP degree and zone. Cost: every micro-batch costs at
    least the cheapest price x work.
    """
    job, model = ctx.job, ctx.job.model
    L = model.num_layers
    grad = job.state_bytes_per_param["gradients"]
    kinds = []  # (available, fill, per-mb, work, price)
    sync2 = float("inf")
    for z in zones:
        for g, a in ctx.cluster.zones[z].items():
            if a < P:
                continue
            tps = [t for t in model.tp_degrees(ctx.cluster.node_size(g)) if t <= a]
            per_tp = np.array([np.diff(ctx.layer_cumsum(g, t, mbs), axis=0).sum(axis=1) for t in tps])  # (tps, L)
            fill = float(per_tp.min(axis=0).sum())
            work = float((per_tp * np.array(tps)[:, None]).min(axis=0).sum())
            kinds.append((a, fill, fill / P, work, ctx.cluster.price(z, g)))
            for t in tps:
                nbytes = t * ctx.stage_params(t, 0, L) / P * grad
                slot = Slot(zone=z, gpu=g, tp=t)
                s = allreduce_time_s([(slot, 2)], nbytes, ctx.network) / ctx.allreduce_efficiency([slot])
                sync2 = min(sync2, s)
    if not kinds:
        return (float("inf"), float("inf"))

    def capacity(tau: float) -> float:
        total = 0.0
        for a, fill, per, work, _ in kinds:
            if tau >= fill:
                total += min((a // P) * (1 + math.floor((tau - fill) / per + 1e-9)), a * tau / work)
        return total

    lo = min(k[1] for k in kinds)
    hi = max(k[1] for k in kinds) * (1 + job.global_batch_size)
    M = job.global_batch_size // mbs
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if capacity(mid) >= M:
            hi = mid
        else:
            lo = mid
    alone = min(fill + (M - 1) * per for _, fill, per, _, _ in kinds)
    T = min(alone, lo + sync2 / 2)
    cost = M * min(price * work for _, _, _, work, price in kinds) / 3600.0
    return (T, cost) if opts.objective is Objective.THROUGHPUT else (cost, T)


def _families(ctx: SimContext, opts: PlanOptions, zones: tuple[str, ...], P: int, mbs: int):
    """Yield (lower-bound key, Family) for every partition of (zones, P, mbs) with a feasible template."""
    job = ctx.job
    M = job.global_batch_size // mbs
    gpus = sorted({g for z in zones for g, n in ctx.cluster.zones[z].items() if n > 0})
    if opts.search is SearchSpace.FULL:
        partitions = candidate_partitions(ctx, P, mbs, gpus)
    else:
        partitions = [even_partition(job.model.num_layers, P)]
    for partition in partitions:
        per_gpu, relaxed, s2 = [], [], float("inf")
        for g in gpus:
            options = stage_options(ctx, g, partition, mbs, M)
            tmpl = templates(options)
            if opts.search is not SearchSpace.FULL:
                uniform = [t for t in tmpl if len(set(t)) == 1]
                # the published rule: the smallest TP degree that fits (H2), one per GPU type
                tmpl = uniform[:1] if opts.search is SearchSpace.PAPER else uniform
            if not tmpl:
                continue
            per_gpu.append((g, tuple(tmpl)))
            # relaxation: every template of a GPU type may use all of its GPUs at once
            relaxed += [x for t in tmpl for x in _types(ctx, {g: t}, list(zones), partition, mbs)]
            s2 = min(s2, _sync_floor(ctx, g, zones, options, partition))
        if per_gpu:
            fam = Family(tuple(zones), mbs, M, partition, tuple(per_gpu))
            yield _lower_bound(relaxed, M, opts, s2, shared=True), fam


def _sync_floor(ctx, gpu: str, zones, options, partition) -> float:
    """Lower bound on the gradient sync of any plan with >= 2 pipelines of `gpu`: per stage, the
    all-reduce between just two replicas at the most favourable feasible TP degree, in the most
    favourable zone (more members, mixed TP degrees or other zones only add ring steps, shrink the
    flow count or slow the links)."""
    best = float("inf")
    for z in zones:
        worst = 0.0
        for opts_i, (a, e) in zip(options, partition):
            worst = max(worst, min(stage_sync(ctx, [(Slot(zone=z, gpu=gpu, tp=o.tp), 2)], a, e)[0] for o in opts_i))
        best = min(best, worst)
    return best


def _regions(cluster) -> dict[str, list[str]]:
    """Region -> zones with GPUs, in a stable order."""
    out: dict[str, list[str]] = {}
    for zone in sorted(cluster.zones):
        if sum(cluster.zones[zone].values()) > 0:
            out.setdefault(cluster.prov.region(zone), []).append(zone)
    return out


def _points(ctx: SimContext, opts: PlanOptions, fam: Family, exact: bool):
    """Yield (pipeline types, point) for every template combination of a family, best bound first."""
    per_gpu = dict(fam.templates)
    zones = list(fam.zones)
    if opts.search is SearchSpace.HOMOGENEOUS:
        combos = [({g: t}, [z]) for g, tmpls in per_gpu.items() for z in zones if ctx.cluster.available(z, g)
                  for t in tmpls]
    else:
        combos = [(c, zones) for c in _template_combos(ctx, per_gpu, zones, fam.partition, fam.mbs, opts, exact, fam.M)]
    pts = []
    for combo, zs in combos:
        types = _types(ctx, combo, zs, fam.partition, fam.mbs)
        if types:
            point = (fam.partition, fam.mbs, tuple(sorted(combo.items())), tuple(zs))
            pts.append((_lower_bound(types, fam.M, opts, _types_sync_floor(ctx, types, fam.partition)), types, point))
    pts.sort(key=lambda x: x[0])
    for _, types, point in pts:
        yield types, point


def _types_sync_floor(ctx, types: list[S.PipelineType], partition) -> float:
    """`_sync_floor` for pipeline types whose TP template is fixed."""
    return min(max(stage_sync(ctx, [(t.slot(i), 2)], a, e)[0] for i, (a, e) in enumerate(partition)) for t in types)


def _types(ctx, combo: dict[str, tuple[int, ...]], zones: list[str], partition, mbs: int) -> list[S.PipelineType]:
    out = []
    for g, tps in sorted(combo.items()):
        for z in zones:
            avail = ctx.cluster.available(z, g)
            if avail >= sum(tps):
                out.append(S.make_pipeline_type(ctx, g, z, tps, partition, mbs, avail // sum(tps)))
    return out


def _template_combos(ctx, per_gpu: dict[str, list[tuple[int, ...]]], zones, partition, mbs, opts: PlanOptions,
                     exact: bool, M: int):
    """One template per GPU type (or the type unused). Outside exact mode only the best
    `templates_per_gpu` templates per type enter, ranked by the objective of that type alone."""
    lists = []
    for g, tmpls in sorted(per_gpu.items()):
        if not exact and len(tmpls) > opts.templates_per_gpu:
            tmpls = sorted(tmpls, key=lambda t: _alone_score(ctx, g, zones, t, partition, mbs, M, opts))
            tmpls = tmpls[: opts.templates_per_gpu]
        lists.append([(g, t) for t in tmpls] + [None])
    for pick in itertools.product(*lists):
        chosen = {x[0]: x[1] for x in pick if x is not None}
        if chosen:
            yield chosen


def _alone_score(ctx, gpu, zones, tps, partition, mbs, M: int, opts: PlanOptions) -> tuple[float, float]:
    """Objective key of the best of a few plans using only this template in its largest zone
    (all, half, a quarter of the pipelines that fit, and one)."""
    zone = max(zones, key=lambda z: ctx.cluster.available(z, gpu))
    n_max = min(ctx.cluster.available(zone, gpu) // sum(tps), M)
    if n_max < 1:
        return (float("inf"), float("inf"))
    t = S.make_pipeline_type(ctx, gpu, zone, tps, partition, mbs, n_max)
    scorer = S.Scorer(ctx, partition, [t], M)
    key = _key(opts.objective)
    best = (float("inf"), float("inf"))
    for n in {n_max, max(1, n_max // 2), max(1, n_max // 4), 1}:
        c = scorer.score((n,))
        if c is not None:
            best = min(best, key(c.iteration_time_s, c.cost_per_iteration_usd))
    return best


def _search_counts(ctx, opts: PlanOptions, types: list[S.PipelineType], point, M: int, offer, state, key,
                   exact: bool) -> None:
    """Phase 2 for one point: every count vector on small spaces, else the bounded D scan."""
    s_min = _types_sync_floor(ctx, types, point[0])
    if state["best"] is not None and _lower_bound(types, M, opts, s_min)[0] >= state["best"][0]:
        return
    scorer = S.Scorer(ctx, point[0], types, M, equal_shares=opts.search is not SearchSpace.FULL)
    gpus_in_point = {g for g, _ in point[2]}

    def consider(counts) -> S.Candidate | None:
        if {t.gpu for t, n in zip(types, counts) if n} != gpus_in_point:
            return None  # a vector leaving a GPU type unused belongs to another combination
        cand = scorer.score(counts)
        if cand is not None:
            offer(cand, point)
        return cand

    if opts.search is not SearchSpace.FULL:
        _equal_share_scan(types, M, consider, exact)
        return
    if exact and _prod(types) <= S.EXHAUSTIVE_COUNTS:
        for counts in S.all_count_vectors(types):
            consider(counts)
        return
    D_max = min(sum(t.max_count for t in types), M)
    opt_min = min(t.optimizer_s for t in types)
    subsets = _subsets(types)
    seen: set[tuple[int, ...]] = set()
    for D in range(1, D_max + 1):
        floor = S.makespan_floor(types, D, M) + s_min * (D - 1) / D + opt_min
        if state["best"] is not None and opts.objective is Objective.THROUGHPUT and floor >= state["best"][0]:
            continue
        for subset in subsets:
            counts = S.fastest_first(subset, D)
            if counts is not None and counts not in seen:
                seen.add(counts)
                consider(counts)


def _equal_share_scan(types, M, consider, exact: bool) -> None:
    """Published space: every pipeline gets M / D micro-batches, so D divides M. Small spaces: every
    count vector; otherwise, for every divisor D, the D fastest pipelines and D of each type alone."""
    if exact and _prod(types) <= S.EXHAUSTIVE_COUNTS:
        for counts in S.all_count_vectors(types):
            if M % sum(counts) == 0:
                consider(counts)
        return
    D_max = min(sum(t.max_count for t in types), M)
    for D in (d for d in range(1, D_max + 1) if M % d == 0):
        for subset in _subsets(types):
            counts = S.fastest_first(subset, D)
            if counts is not None:
                consider(counts)


def _subsets(types: list[S.PipelineType]) -> list[list[S.PipelineType]]:
    """All types together, then each type alone (the others' max_count set to 0)."""
    return [types] + [[t if j == k else dataclasses.replace(t, max_count=0) for j, t in enumerate(types)]
                      for k in range(len(types))]


def _prod(types) -> int:
    n = 1
    for t in types:
        n *= t.max_count + 1
    return n


def _lower_bound(types: list[S.PipelineType], M: int, opts: PlanOptions, sync2: float,
                 shared: bool = False) -> tuple[float, float]:
    """Lower bound on the objective key of any count vector over `types` (at most max_count each).

    One pipeline alone pays no sync: time >= min_k time_k(M). Two or more: the makespan is at least
    the smallest τ at which the available pipelines could finish M micro-batches even if some sat
    idle (Σ_k max_count_k·cap_k(τ) >= M; with `shared`, types of one GPU type and zone are
    alternative templates competing for the same GPUs, so only the best of them counts at each τ),
    and the sync at least sync2 / 2 (a ring over D replicas takes 2(D-1) steps of 1/D of the
    gradient: at least (D-1)/D >= 1/2 of the two-replica time `sync2`, even where bandwidth varies
    with message size within 2x); plus the smallest optimizer step. Cost: the same times at the
    cheapest rates, and each micro-batch costs at least the cheapest rate x period.
    """
    used = [t for t in types if t.max_count]
    if not used:
        return (float("inf"), float("inf"))
    groups: dict[tuple, list[S.PipelineType]] = {}
    for t in used:
        groups.setdefault((t.gpu, t.zone) if shared else (t,), []).append(t)

    def capacity(tau: float) -> int:
        return sum(max(min(t.max_count, M) * t.cap(tau) for t in g) for g in groups.values())

    lo, hi = min(t.fill_s for t in used), max(t.two_s for t in used) + M * max(t.period_s for t in used)
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if capacity(mid) >= M:
            hi = mid
        else:
            lo = mid
    opt = min(t.optimizer_s for t in used)
    alone = min(t.time_s(M) for t in used) + opt
    many = lo + sync2 / 2 + opt if sum(t.max_count for t in used) >= 2 else float("inf")
    T = min(alone, many)
    rate = min(t.usd_per_hour for t in used)
    base = min(t.usd_per_hour * min(t.fill_s, t.two_s - t.period_s) for t in used)
    work = (M * min(t.usd_per_hour * t.period_s for t in used) + min(base, 0.0) * M + max(base, 0.0)) / 3600.0
    cost = min(min(t.usd_per_hour * t.time_s(M) for t in used) / 3600.0 + 0.0,
               max(work, 2 * rate * (lo + sync2 / 2 + opt) / 3600.0))
    return (T, cost) if opts.objective is Objective.THROUGHPUT else (cost, T)


def _build_plan(ctx: SimContext, cand: S.Candidate, point) -> Plan:
    partition, mbs = point[0], point[1]
    types = cand.scorer.types
    pipelines = []
    for t, shares in zip(types, cand.shares):
        for m in shares:
            pipelines.append({"microbatches": m, "replicas": [
                {"stage": i, "gpu": t.gpu, "zone": t.zone, "tp": tp} for i, tp in enumerate(t.tps)]})
    plan = Plan.model_validate({"micro_batch_size": mbs, "stages": [list(s) for s in partition], "pipelines": pipelines,
                                "job": ctx.job.to_dict(), "cluster": ctx.cluster.to_dict()})
    plan.check_against(ctx.job, ctx.cluster)
    return plan


def _why_infeasible(ctx: SimContext, opts: PlanOptions, any_fit: bool) -> str:
    """The binding reason no plan was found, with numbers."""
    job, cluster = ctx.job, ctx.cluster
    model = job.model
    if not any_fit:
        # memory: the least memory per GPU over stage counts, TP degrees and a micro-batch of 1
        best = None
        for g in cluster.gpu_types():
            for tp in model.tp_degrees(cluster.node_size(g)):
                for P in range(1, min(model.num_layers, opts.max_stages) + 1):
                    part = even_partition(model.num_layers, P)
                    need = max(replica_memory(ctx, g, tp, 1, a, b, stage=i, num_stages=P, microbatches=job.global_batch_size).total
                               for i, (a, b) in enumerate(part))
                    if best is None or need < best[0]:
                        best = (need, g, tp, P)
        if best is None:
            return "no GPU type in the cluster can hold a TP group of this model"
        need, g, tp, P = best
        largest = max(cluster.gpu_types(), key=lambda x: ctx.memory_capacity(x))
        return (f"{model.name} needs {need / GB:.1f} GB per GPU at best (TP {tp}, {P} stages, micro-batch 1);"
                f" the largest GPU offered ({largest}) has {ctx.memory_capacity(largest) / GB:.1f} GB")
    c = opts.constraints
    parts = []
    if c.min_throughput is not None:
        parts.append(f"at least {c.min_throughput:g} iterations/s")
    if c.max_cost_per_iteration is not None:
        parts.append(f"at most ${c.max_cost_per_iteration:g}/iteration")
    if c.max_cost_per_hour is not None:
        parts.append(f"at most ${c.max_cost_per_hour:g}/hour")
    free = plan_job(ctx, PlanOptions(objective=opts.objective, search=opts.search, max_stages=opts.max_stages,
                                     max_mbs=opts.max_mbs, top_k=1, rescore=1))
    fastest = plan_job(ctx, PlanOptions(objective=Objective.THROUGHPUT, search=opts.search,
                                        max_stages=opts.max_stages, max_mbs=opts.max_mbs, top_k=1, rescore=1))
    cheapest = plan_job(ctx, PlanOptions(objective=Objective.COST, search=opts.search,
                                         max_stages=opts.max_stages, max_mbs=opts.max_mbs, top_k=1, rescore=1))
    del free
    return (f"no plan meets {' and '.join(parts)}: the fastest plan reaches"
            f" {fastest.estimate.throughput_iters_per_s:.3g} iterations/s at ${fastest.estimate.cost_per_iteration_usd:.3g}/iteration"
            f" (${fastest.estimate.cost_per_hour_usd:.3g}/hour); the cheapest costs"
            f" ${cheapest.estimate.cost_per_iteration_usd:.3g}/iteration at {cheapest.estimate.throughput_iters_per_s:.3g} iterations/s")
