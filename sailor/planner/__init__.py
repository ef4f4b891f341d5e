"""Planner: which GPUs, where, and how to parallelize — the best plan under the simulator.

Three phases (STYLE.md §2.8): (1) tables — `space`: stage options, TP templates, partitions;
(2) search — `branch` walks the tree (region, P, micro-batch) -> partition -> TP templates -> pipeline
counts per (GPU type, zone), pruned with the lower bounds of `bounds`; `search` scores a count vector
with the simulator's closed form and the best integer batch shares; exact on small spaces, bounded
scans on large ones; (3) scoring — the best `rescore` candidates are simulated again with the 1F1B
event simulation and the best of them under the objective is returned with its alternatives.
Settings live in `options`.

Pruning (DESIGN.md §5): H1 TP within a node; H2 only TP degrees whose memory fits (stage options);
H3/H4 pipeline counts: every count vector on small spaces, else a scan over the number of pipelines D
that skips every D whose bound cannot win; H5 a plan uses the zones of one region; H6 zones of a region share one search
(their pipelines are counted per zone, so prices and links of each zone still count). Outer loops
(P, micro-batch, partition, templates) are skipped when a lower bound on their best score cannot beat
the best plan found so far.

Every call builds its own SimContext: nothing is cached across calls.
"""

from __future__ import annotations

import dataclasses
import heapq
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from sailor.errors import InfeasibleError
from sailor.plan import Plan, StageMemory
from sailor.planner import search as S
from sailor.planner.branch import coarse_nodes, families, points, search_counts
from sailor.planner.options import EXACT_MAX_GPUS, Constraints, Objective, PlanOptions, SearchSpace, objective_key
from sailor.planner.space import even_partition, memory_candidates, sp_possible, stage_options, zero3_needed
from sailor.simulator import Estimate, SimContext, simulate
from sailor.simulator.memory import replica_memory

__all__ = ["Choice", "Constraints", "Objective", "PlanOptions", "PlanResult", "SearchSpace", "plan_job"]

GB = 1e9



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


def plan_job(ctx: SimContext, options: PlanOptions | None = None,
             progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """Find the best plan for ctx.job on ctx.cluster.

    Best-first branch and bound (`_search`): coarse nodes (region, P, micro-batch) and, once expanded,
    their families (one per layer partition) are taken in order of their lower bounds (`bounds`);
    the search stops when the next bound cannot beat the best plan found. Exact for the space on
    clusters of up to EXACT_MAX_GPUS GPUs; on larger ones heuristic (see `branch` and
    `bounds.coarse_estimate`), and split over processes from PARALLEL_MIN_GPUS GPUs on.

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
    if ctx.memory_margin != opts.memory_margin:
        # the margin is read through ctx.memory_limit; memoised feasibility depends on it, so the
        # copy starts a memo of its own (the layer tables it shares do not)
        ctx = dataclasses.replace(ctx, memory_margin=opts.memory_margin, memo={})
    cluster = ctx.cluster
    if cluster.total_gpus() == 0:
        raise InfeasibleError("the cluster offers no GPUs", field="zones")
    key = objective_key(opts.objective)
    exact = ctx.cluster.total_gpus() <= EXACT_MAX_GPUS
    coarse = sorted(coarse_nodes(ctx, opts, exact), key=lambda x: x[0])
    workers = _workers(ctx, len(coarse))
    if workers > 1:
        found = _search_parallel(ctx, opts, coarse, workers, progress)
    else:
        found = _search(ctx, opts, coarse, None, progress)
    if progress:
        progress(len(coarse), len(coarse))
    if not found.finalists:
        raise InfeasibleError(_why_infeasible(ctx, opts, found.any_family))
    ranked = sorted(found.finalists, key=lambda v: v[0])
    choices = [Choice(plan, t, c) for _, t, c, plan in ranked[: max(opts.rescore, opts.top_k + 1)]]
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
                      points=found.points, candidates=found.candidates, pareto=sorted(found.front))


@dataclass
class _Found:
    """What one search (this process or a worker) found: finalists as (objective key, closed-form
    time s, closed-form $/iteration, plan), the Pareto front, and counts."""

    finalists: list[tuple[tuple[float, float], float, float, Plan]] = field(default_factory=list)
    front: list[tuple[float, float]] = field(default_factory=list)
    points: int = 0
    candidates: int = 0
    any_family: bool = False


def _search(ctx: SimContext, opts: PlanOptions, coarse: list, shared_best, progress) -> _Found:
    """Two-level best-first branch and bound over `coarse` nodes (bound, (zones, P, mbs)): a node is
    expanded into families (one per partition) only when its bound can still beat the best plan;
    families are searched in bound order; everything left once the smallest bound cannot win is
    pruned. `shared_best` (a multiprocessing.Value or None) carries the best first objective component
    found by any process, so that parallel searches prune with each other's plans."""
    key = objective_key(opts.objective)
    exact = ctx.cluster.total_gpus() <= EXACT_MAX_GPUS
    keep = 2 * max(opts.top_k, opts.rescore)
    finalists: dict[tuple, tuple[tuple[float, float], S.Candidate, tuple]] = {}
    found = _Found()
    state = {"best": None}

    def best0() -> float:
        local = state["best"][0] if state["best"] is not None else float("inf")
        return min(local, shared_best.value) if shared_best is not None else local

    def offer(cand: S.Candidate, point: tuple) -> None:
        found.candidates += 1
        _pareto_add(found.front, (cand.iteration_time_s, cand.cost_per_iteration_usd))
        if not opts.constraints.ok(cand.iteration_time_s, cand.cost_per_iteration_usd):
            return
        k = key(cand.iteration_time_s, cand.cost_per_iteration_usd)
        finalists[(point, cand.counts)] = (k, cand, point)
        if state["best"] is None or k < state["best"]:
            state["best"] = k
            if shared_best is not None:
                with shared_best.get_lock():
                    shared_best.value = min(shared_best.value, k[0])
        if len(finalists) > 2 * keep:
            for sig in sorted(finalists, key=lambda s: finalists[s][0])[keep:]:
                del finalists[sig]

    heap = [(bound, 0, n, node) for n, (bound, node) in enumerate(coarse)]
    heapq.heapify(heap)
    counter, done = len(coarse), 0
    while heap:
        bound, kind, _, item = heapq.heappop(heap)
        if bound[0] >= best0():
            break  # the heap is ordered by bound: nothing left can win
        if kind == 0:
            for fbound, fam in families(ctx, opts, *item):
                found.any_family = True
                counter += 1
                heapq.heappush(heap, (fbound, 1, counter, fam))
            done += 1
            if progress:
                progress(done, len(coarse))
            continue
        for types, point in points(ctx, opts, item, exact):
            found.points += 1
            search_counts(ctx, opts, types, point, item.M, offer, best0, exact)
    found.finalists = [(k, cand.iteration_time_s, cand.cost_per_iteration_usd, _build_plan(ctx, cand, point))
                       for k, cand, point in sorted(finalists.values(), key=lambda v: v[0])[:keep]]
    return found


# Planning splits its coarse nodes over this many processes when the cluster has at least
# PARALLEL_MIN_GPUS GPUs (below that a search takes about a second and forking does not pay).
PARALLEL_MIN_GPUS = 256
_PARALLEL_JOB: tuple | None = None  # (ctx, opts, groups, shared best) for forked workers; set per call


def _workers(ctx: SimContext, nodes: int) -> int:
    if ctx.cluster.total_gpus() < PARALLEL_MIN_GPUS or nodes < 8 or "fork" not in mp.get_all_start_methods():
        return 1
    return max(1, min(os.cpu_count() or 1, 4))


def _worker(index: int) -> _Found:
    ctx, opts, groups, shared = _PARALLEL_JOB
    return _search(ctx, opts, groups[index], shared, None)


def _search_parallel(ctx: SimContext, opts: PlanOptions, coarse: list, workers: int, progress) -> _Found:
    """`_search` over `workers` forked processes, coarse nodes dealt round-robin in bound order, the
    best objective shared through a multiprocessing.Value; results merged here."""
    global _PARALLEL_JOB
    fork = mp.get_context("fork")
    shared = fork.Value("d", float("inf"))
    groups = [coarse[i::workers] for i in range(workers)]
    _PARALLEL_JOB = (ctx, opts, groups, shared)
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=fork) as pool:
            parts = list(pool.map(_worker, range(workers)))
    finally:
        _PARALLEL_JOB = None
    merged = _Found()
    for i, part in enumerate(parts):
        merged.finalists += part.finalists
        for p in part.front:
            _pareto_add(merged.front, p)
        merged.points += part.points
        merged.candidates += part.candidates
        merged.any_family |= part.any_family
        if progress:
            progress(sum(len(g) for g in groups[: i + 1]), len(coarse))
    return merged


def _pareto_add(front: list[tuple[float, float]], p: tuple[float, float]) -> None:
    """Add (time, cost) to a Pareto front (minimise both) kept in place; amortised cheap because most
    points are dominated by one of the few front points."""
    if any(q[0] <= p[0] and q[1] <= p[1] for q in front):
        return
    front[:] = [q for q in front if not (p[0] <= q[0] and p[1] <= q[1])]
    front.append(p)


def _build_plan(ctx: SimContext, cand: S.Candidate, point) -> Plan:
    partition, mbs, memory = point[0], point[1], point[4]
    types = cand.scorer.types
    pipelines = []
    for t, shares in zip(types, cand.shares):
        for m in shares:
            pipelines.append({"microbatches": m, "replicas": [
                {"stage": i, "gpu": t.gpu, "zone": t.zone, "tp": tp} for i, tp in enumerate(t.tps)]})
    if len(pipelines) == 1:  # ZeRO over one replica shards nothing: leave it out of the plan
        memory = tuple(m.model_copy(update={"zero": 0}) for m in memory)
    plan = Plan.model_validate({"micro_batch_size": mbs, "stages": [list(s) for s in partition], "pipelines": pipelines,
                                "memory": [m.model_dump(mode="json") for m in memory] if any(not m.is_default for m in memory) else [],
                                "job": ctx.job.to_dict(), "cluster": ctx.cluster.to_dict()})
    plan.check_against(ctx.job, ctx.cluster)
    return plan


def _why_infeasible(ctx: SimContext, opts: PlanOptions, any_fit: bool) -> str:
    """The binding reason no plan was found, with numbers."""
    job, cluster = ctx.job, ctx.cluster
    model = job.model
    if not any_fit:
        return _no_fit(ctx, opts)
    c = opts.constraints
    if c == Constraints():
        return _too_few_gpus(ctx, opts)
    parts = []
    if c.min_throughput is not None:
        parts.append(f"at least {c.min_throughput:g} iterations/s")
    if c.max_cost_per_iteration is not None:
        parts.append(f"at most ${c.max_cost_per_iteration:g}/iteration")
    if c.max_cost_per_hour is not None:
        parts.append(f"at most ${c.max_cost_per_hour:g}/hour")
    # Without constraints the search either succeeds or fails for a reason that is not a constraint
    # (InfeasibleError propagates): no recursion back here.
    free = dict(search=opts.search, max_stages=opts.max_stages, max_mbs=opts.max_mbs, top_k=1, rescore=1,
                memory_margin=opts.memory_margin)
    fastest = plan_job(ctx, PlanOptions(objective=Objective.THROUGHPUT, **free)).estimate
    cheapest = plan_job(ctx, PlanOptions(objective=Objective.COST, **free)).estimate
    return (f"no plan meets {' and '.join(parts)}: the fastest plan reaches"
            f" {fastest.throughput_iters_per_s:.3g} iterations/s at ${fastest.cost_per_iteration_usd:.3g}/iteration"
            f" (${fastest.cost_per_hour_usd:.3g}/hour); the cheapest costs"
            f" ${cheapest.cost_per_iteration_usd:.3g}/iteration at {cheapest.throughput_iters_per_s:.3g} iterations/s")


# No memory options, and the ones that save the most (the infeasibility message compares them).
_SAVINGS = [("no memory options", StageMemory()),
            ("full recomputation, SP and ZeRO-3", StageMemory(recompute="full", sequence_parallel=True, zero=3))]


def _no_fit(ctx: SimContext, opts: PlanOptions) -> str:
    """No partition fits: the least memory per GPU without and with the strongest memory options
    (TP within a node, P up to max_stages, even partition, micro-batch 1, ZeRO over as many replicas
    as the GPUs of the type allow), naming the option that would make it fit with more GPUs (ZeRO
    over more replicas), or saying that none would."""
    job, cluster, model = ctx.job, ctx.cluster, ctx.job.model
    largest = max(cluster.gpu_types(), key=lambda x: ctx.memory_limit(x))
    cap = ctx.memory_limit(largest)  # what a plan may fill: capacity less the memory margin

    def least(mem: StageMemory, more: int = 1):
        best = None  # (bytes, gpu, tp, P, replicas)
        for g in cluster.gpu_types():
            for tp in model.tp_degrees(cluster.node_size(g)):
                if mem.sequence_parallel and not sp_possible(ctx, tp):
                    continue
                for P in range(1, min(model.num_layers, opts.max_stages) + 1):
                    have = sum(cluster.available(z, g) for z in cluster.zones) // (tp * P)
                    d = min(job.global_batch_size, max(1, have) * more) if mem.zero else 1
                    need = max(replica_memory(ctx, g, tp, 1, ((a, b),), stage=i, num_stages=P, microbatches=job.global_batch_size,
                                              memory=mem, replicas=d).total - ctx.memory_limit(g) + cap
                               for i, (a, b) in enumerate(even_partition(model.num_layers, P)))
                    if best is None or need < best[0]:
                        best = (need, g, tp, P, d)
        return best

    plain, strongest = least(_SAVINGS[0][1]), least(_SAVINGS[-1][1])
    if plain is None:
        return "no GPU type in the cluster can hold a TP group of this model"
    where = f"TP {strongest[2]}, {strongest[3]} stages, micro-batch 1"
    head = (f"{model.name} needs {plain[0] / GB:.1f} GB per GPU at best without memory options and"
            f" {strongest[0] / GB:.1f} GB with full recomputation, SP and ZeRO-3 over {strongest[4]} replicas ({where});"
            f" the largest GPU offered ({largest}) has {ctx.memory_capacity(largest) / GB:.1f} GB"
            + (f" ({cap / GB:.1f} GB usable with the {ctx.memory_margin:.0%} memory margin)" if ctx.memory_margin else ""))
    for more in (2, 4, 8, 16, 64, 256, 1024):
        bigger = least(_SAVINGS[-1][1], more)
        if bigger[4] <= strongest[4]:
            break  # as many replicas as micro-batches already
        if bigger[0] <= cap:
            return (f"{head}; full recomputation, SP and ZeRO-3 over {bigger[4]} replicas ({bigger[4] * bigger[2] * bigger[3]}"
                    f" {bigger[1]}, TP {bigger[2]}, {bigger[3]} stages) would make it fit")
    return f"{head}, and no memory option makes it fit"


def _too_few_gpus(ctx: SimContext, opts: PlanOptions) -> str:
    """Some GPU type can hold the model's stages, but no zone has enough of them for one pipeline:
    the smallest pipeline (fewest GPUs over P and TP, micro-batch 1) against the most one zone offers."""
    job, cluster = ctx.job, ctx.cluster
    L = job.model.num_layers
    best = None  # (shortfall ratio, GPUs needed, gpu, P, most in one zone)
    for g in cluster.gpu_types():
        most = max(cluster.available(z, g) for z in cluster.zones)
        for P in range(1, min(L, opts.max_stages) + 1):
            part = even_partition(L, P)
            for memory in memory_candidates(ctx, [g], part, 1, job.global_batch_size,
                                            3 if zero3_needed(ctx, opts.max_stages) else 2):
                options = stage_options(ctx, g, part, 1, job.global_batch_size, memory)
                if all(options):
                    need = sum(min(o.tp for o in stage) for stage in options)
                    if best is None or need / max(most, 1) < best[0]:
                        best = (need / max(most, 1), need, g, P, most)
    if best is None:
        return f"no GPU type in the cluster can hold {job.model.name}'s stages in memory"
    _, need, g, P, most = best
    return (f"{job.model.name} needs at least {need} {g} GPUs in one zone for one pipeline ({P} stages,"
            f" micro-batch 1, to fit in memory); the most any zone offers is {most}")
