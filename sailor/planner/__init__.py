"""Planner: which GPUs, where, and how to parallelize — the best plan under the simulator.

Three phases (STYLE.md §2.8): (1) tables — `space` (partitions, micro-batch sizes, memory-feasible
stage options) and `kinds` (the option table of a family, pipeline kinds); (2) search — `engine`,
a best-first branch and bound over (P, micro-batch) -> partition -> scope (region, or all regions)
-> count vector of pipeline kinds (`pack`, `geo`), pruned by the bounds of `prune`; every candidate
is scored with the simulator's closed form and the best integer batch shares (`score.Scorer`);
(3) scoring — the best `rescore` candidates are simulated again with the 1F1B event simulation, each
of them and the best candidate of each pipeline depth they lack is tried under the other schedules
and memory options of `schedules` (`_variants`), and the best plan under the objective is returned
with its alternatives.

Search spaces (`SearchSpace`): `full` (ours: uneven layer partitions, a TP degree per stage and
replica, GPU types and zones mixed inside a pipeline, pipelines across zones and regions, data
parallelism across regions when it wins, uneven batch shares); `paper` (the published planner's
space, `paper`); `homogeneous` (one GPU type in one zone). The full search also runs the published
planner's space and keeps its best plan among the finalists, so the published planner's best plan
never beats it in the simulator.

Pruning (DESIGN.md §5): H1 TP within a node and H2 memory (stage options); H3/H4 become the
makespan-target packing of `pack`; H5 each region is searched alone and all regions together; H6
zones of a region share one search. Every call builds its own SimContext: nothing is cached across
calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass, field
from typing import Callable

from sailor.core.errors import InfeasibleError
from sailor.core.limits import MAX_PIPELINE_TASKS
from sailor.plan.spec import Plan, StageMemory
from sailor.planner import engine, paper
from sailor.planner.experts import expert_variants
from sailor.planner.finalists import Found, plan_signature
from sailor.planner.geo import free_pools, scopes
from sailor.planner.options import Constraints, Objective, PlanOptions, SearchSpace, objective_key
from sailor.planner.schedules import fits, kept_weight_variants, schedule_variants
from sailor.planner.space import even_partition, memory_candidates, sp_possible, stage_options, zero3_needed
from sailor.simulator import Estimate, SimContext, simulate
from sailor.simulator.memory import replica_memory

__all__ = ["Choice", "Constraints", "Objective", "PlanOptions", "PlanResult", "SearchSpace", "plan_job"]

GB = 1e9
VARIANT_MARGIN = 0.1  # another plan's variant is event-simulated when its closed form is within 10 % of the best's
VARIANT_EVENTS = 3    # and at most this many of them, best closed form first


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
    points: int           # families (P, mbs, partition) searched
    candidates: int       # count vectors scored
    pareto: list[tuple[float, float]] = field(default_factory=list)
    """Closed-form (iteration time s, $/iteration) of the scored candidates that no other scored
    candidate beats on both, sorted by time (constraints not applied): the trade-off curve."""
    exact: bool = False
    """True when the search proved its best plan optimal in its space under the closed form (small
    clusters, every part searched exhaustively or pruned by valid bounds)."""
    timed_out: bool = False
    """True when `PlanOptions.time_limit_s` stopped the search before it finished."""
    best_without_experts: Choice | None = None
    """For a mixture-of-experts model whose best plan uses expert parallelism: the best plan
    evaluated at EP 1 (event-simulated), what EP is measured against (`planner.experts.explain`)."""


def plan_job(ctx: SimContext, options: PlanOptions | None = None,
             progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """Find the best plan for ctx.job on ctx.cluster in the search space of `options.search`.

    Args:
        ctx: job, cluster, profiles and network (a fresh SimContext per call).
        options: objective, constraints, search space, time limit.
        progress: called as progress(done, total) as parts of the search are searched or pruned.
    Returns:
        PlanResult with the best plan (carrying job and cluster) and its event-simulated estimate.
    Raises:
        InfeasibleError: no plan fits memory, GPUs or constraints, or none was found within the time
            limit; the message names the binding reason.
    """
    with _collector_paused():
        return _plan_job(ctx, options or PlanOptions(), progress)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while the planner runs (as it was before, after). The
    search allocates millions of small acyclic objects (memo keys and entries, placed slots, kinds)
    that the memo keeps alive, so each of the collector's full passes walks all of them and frees
    nothing: a few hundred cyclic objects per search, against 10-20 % of its time on the 4096-GPU
    scenarios of `benchmarks/planner_scale.py`. Reference counting still frees everything else at
    once; the cycles go at the next collection after the search."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan_job(ctx: SimContext, opts: PlanOptions, progress: Callable[[int, int], None] | None) -> PlanResult:
    """`plan_job` with the collector paused."""
    t0 = time.perf_counter()
    if ctx.memory_margin != opts.memory_margin:
        # the margin is read through ctx.memory_limit; memoised feasibility depends on it, so the
        # copy starts a memo of its own (the layer tables it shares do not)
        ctx = dataclasses.replace(ctx, memory_margin=opts.memory_margin, memo={})
    if ctx.cluster.total_gpus() == 0:
        raise InfeasibleError("the cluster offers no GPUs", field="zones")
    deadline = t0 + opts.time_limit_s if opts.time_limit_s is not None else None
    found = _SEARCHES[opts.search](ctx, opts, progress, deadline)
    if not found.finalists and not found.near:
        if found.timed_out:
            raise InfeasibleError(f"no plan found within the time limit of {opts.time_limit_s:g} s",
                                  source="--time-limit", fix="allow more time")
        raise InfeasibleError(_why_infeasible(ctx, opts, found))
    return _rescore(ctx, opts, found, t0)


_SEARCHES = {SearchSpace.FULL: engine.search, SearchSpace.PAPER: paper.search, SearchSpace.HOMOGENEOUS: paper.search}


def _rescore(ctx: SimContext, opts: PlanOptions, found: Found, t0: float) -> PlanResult:
    """Phase 3: event-simulate the best `rescore` finalists (and every pinned plan) and return the
    best of them under the objective and constraints, with the alternatives. Where none of them meets
    the constraints, the next finalists in closed-form order are event-simulated until one does
    (`_first_meeting`). The near misses that could beat that plan are event-simulated too, and
    compete where they meet the constraints there (`_near_meeting`). InfeasibleError when no plan
    meets them."""
    key = objective_key(opts.objective)
    ranked = sorted(found.finalists, key=lambda v: v[0])
    choices = [Choice(plan, t, c) for _, t, c, plan in ranked[: max(opts.rescore, opts.top_k + 1)]]
    scored = choices[: opts.rescore]
    for plan in found.pinned:
        if plan_signature(plan) not in {plan_signature(c.plan) for c in choices}:
            closed = simulate(plan, ctx, event=False)
            pin = Choice(plan, closed.iteration_time_s, closed.cost_per_iteration_usd)
            choices.append(pin)
            scored.append(pin)
    for ch in scored:
        ch.estimate = _event_or_closed(ch.plan, ctx)
    ok = [c for c in scored if _meets(opts.constraints, c.estimate)] or _first_meeting(ctx, opts.constraints, choices)
    near = _near_meeting(ctx, opts, found.near, ok, choices)
    if not ok and not near:
        raise InfeasibleError(_missed(opts.constraints, choices) if choices else _why_infeasible(ctx, opts, found))
    best_closed = (choices or near)[0]
    choices += near
    ok += near
    ok.sort(key=lambda c: key(c.estimate.iteration_time_s, c.estimate.cost_per_iteration_usd))
    if opts.search is SearchSpace.FULL:  # the schedule dimension and kept ZeRO-3 weights, where they pay
        deeper = [(p, simulate(p, ctx, event=False)) for p in found.deep if p.num_stages > ok[0].plan.num_stages]
        for variant in _variants(ctx, opts, ok[0].plan, [(c.plan, c.estimate) for c in ok[1:]] + deeper,
                                 ok[0].estimate):
            choices.append(variant)
            ok.append(variant)
        ok.sort(key=lambda c: key(c.estimate.iteration_time_s, c.estimate.cost_per_iteration_usd))
    best = ok[0]
    flat = [c for c in ok if not c.plan.experts] if best.plan.experts else []
    alternatives: list[Choice] = []  # the next plans in closed-form order that meet the constraints, each once
    seen = {plan_signature(best.plan)}
    for c in choices:
        if len(alternatives) == opts.top_k:
            break
        if plan_signature(c.plan) in seen:
            continue
        seen.add(plan_signature(c.plan))
        if c.estimate is None:
            c.estimate = _event_or_closed(c.plan, ctx)
        if _meets(opts.constraints, c.estimate):
            alternatives.append(c)
    alternatives.sort(key=lambda c: key(c.estimate.iteration_time_s, c.estimate.cost_per_iteration_usd))
    return PlanResult(plan=best.plan, estimate=best.estimate, alternatives=alternatives,
                      best_closed=best_closed, search_time_s=time.perf_counter() - t0,
                      points=found.points, candidates=found.candidates, pareto=sorted(found.front),
                      exact=found.exact, timed_out=found.timed_out, best_without_experts=flat[0] if flat else None)


def _variants(ctx: SimContext, opts: PlanOptions, best_plan: Plan, others: list[tuple[Plan, Estimate]],
              best: Estimate) -> list[Choice]:
    """The schedule dimension searched with the partitions (`planner.schedules`): the best finalist
    `best_plan` (estimate `best`) and the other plans, each with its estimate (the other
    event-simulated finalists, then the best plan of each pipeline depth deeper than the best
    finalist's that they lack, `Found.deep`), with kept ZeRO-3 weights, and under the other schedules
    where the plan is the best finalist or even without its 1F1B bubble it would beat `best` (a
    bubble shrunk by v or by ZB-H1 pays the more, the deeper the pipeline). Kept weights are tried on
    every plan, as they change the passes, not only their order (their gathers and the ZeRO-2
    all-gather they drop are not in the bubble), so the bubble bound does not hold for them; which
    plan ranks best before the variants must not decide whether a kept-weight plan is found. They
    cost at most two closed forms per plan with a ZeRO-2 or ZeRO-3 stage (none for the others,
    `kept_weight_variants`). Each plan's variants are closed-form simulated and its best that fits
    in memory kept; the best plan's, then the others' in order of their closed forms while within
    VARIANT_MARGIN of `best` under the objective (at most VARIANT_EVENTS of them), are
    event-simulated like a finalist and returned where they meet the constraints. A partition that
    ranks low under 1F1B can so win under interleaving or ZB-H1, and a finalist that ranks below the
    best with kept weights. For a mixture-of-experts model every plan also gets its expert-parallel
    variants (`planner.experts.expert_variants`: EP degrees at its TP and at narrower TP on the same
    GPUs), also on its best other schedule, and the best of them that fits its other schedules; the
    bubble bound does not apply to them either (EP changes the passes, not only their order)."""
    key = objective_key(opts.objective)

    def closed_key(e: Estimate) -> tuple[float, float]:
        return key(e.iteration_time_s, e.cost_per_iteration_usd)

    def best_of(cands: list[tuple[Estimate, Plan]]) -> tuple[Estimate, Plan]:
        """The (closed estimate, plan) of `cands` best under the objective (the first of equals)."""
        return min(cands, key=lambda v: closed_key(v[0]))

    def no_bubble(plan: Plan, e: Estimate) -> tuple[float, float]:
        """Objective key of `e` less the 1F1B bubble's share of it, (P - 1) / (m + P - 1) with m the
        largest share of micro-batches: no schedule of the plan does better (it only moves passes)."""
        m = max(p.microbatches for p in plan.pipelines)
        keep = 1 - (plan.num_stages - 1) / (m + plan.num_stages - 1)
        return key(e.iteration_time_s * keep, e.cost_per_iteration_usd * keep)

    bar = key(best.iteration_time_s * (1 + VARIANT_MARGIN), best.cost_per_iteration_usd * (1 + VARIANT_MARGIN))
    picks = []  # (closed estimate, plan, is the best finalist's)
    for plan, estimate in [(best_plan, best)] + others:
        experts = expert_variants(plan, ctx)
        scheduled = plan is best_plan or bool(experts) or no_bubble(plan, estimate)[0] < closed_key(best)[0]
        variants = schedule_variants(plan) if opts.schedules and scheduled else []
        variants += kept_weight_variants(plan)
        closed = [(simulate(p, ctx, event=False), p) for p in variants + experts]
        closed = [(e, p) for e, p in closed if fits(e, ctx)]
        if experts and opts.schedules:  # EP on the best other schedule, other schedules on the best EP shape
            reshaped = {id(p) for p in experts}
            scheduled = [(e, p) for e, p in closed if id(p) not in reshaped and p.schedule != plan.schedule]
            ep_fit = [(e, p) for e, p in closed if id(p) in reshaped]
            more = expert_variants(best_of(scheduled)[1], ctx) if scheduled else []
            more += schedule_variants(best_of(ep_fit)[1]) if ep_fit else []
            closed += [(e, p) for e, p in ((simulate(p, ctx, event=False), p) for p in more) if fits(e, ctx)]
        if closed:
            top = best_of(closed)
            picks.append((*top, plan is best_plan))
            flat = [v for v in closed if not v[1].experts]
            if top[1].experts and flat and plan is best_plan:  # EP's yardstick: the best at EP 1 too
                picks.append((*best_of(flat), True))
    first = [x for x in picks if x[2]]
    rest = sorted((x for x in picks if not x[2] and closed_key(x[0])[0] <= bar[0]), key=lambda x: closed_key(x[0]))
    out = []
    for e, variant, _ in first + rest[:VARIANT_EVENTS]:
        est = _event_or_closed(variant, ctx)
        if _meets(opts.constraints, est):
            out.append(Choice(variant, e.iteration_time_s, e.cost_per_iteration_usd, est))
    return out


def _meets(c: Constraints, e: Estimate) -> bool:
    """Whether estimate `e` meets the constraints `c`."""
    return c.ok(e.iteration_time_s, e.cost_per_iteration_usd)


def _first_meeting(ctx: SimContext, c: Constraints, choices: list[Choice]) -> list[Choice]:
    """[the first of `choices` (closed-form order) whose event simulation meets `c`] ([] when none
    does), for when none of the event-simulated finalists does: each finalist met `c` in the closed
    form, which the event simulation can undo."""
    for ch in choices:
        if ch.estimate is None:
            ch.estimate = _event_or_closed(ch.plan, ctx)
        if _meets(c, ch.estimate):
            return [ch]
    return []


def _near_meeting(ctx: SimContext, opts: PlanOptions, near: list[tuple[tuple[float, float], float, float, Plan]],
                  ok: list[Choice], choices: list[Choice]) -> list[Choice]:
    """The near misses (`Found.near`: plans that miss the constraints in the closed form but meet
    them at the event simulation's lower bound) whose event simulation meets the constraints: those
    whose objective key at the bound beats the best of `ok` (every one when `ok` is empty) and that
    `choices` lack are event-simulated, in closed-form order."""
    key = objective_key(opts.objective)
    bar = min((key(c.estimate.iteration_time_s, c.estimate.cost_per_iteration_usd) for c in ok), default=None)
    have = {plan_signature(c.plan) for c in choices}
    out = []
    for k, t, usd, plan in near:
        if (bar is not None and k >= bar) or plan_signature(plan) in have:
            continue
        have.add(plan_signature(plan))
        ch = Choice(plan, t, usd, _event_or_closed(plan, ctx))
        if _meets(opts.constraints, ch.estimate):
            out.append(ch)
    return out


def _missed(c: Constraints, choices: list[Choice]) -> str:
    """Why no plan was returned although the search found `choices` that meet `c` in the closed form:
    each missed it in the event simulation (the first, the closed form's best, is quoted)."""
    return (f"no plan meets {_constraint_words(c)} in the event simulation: the {len(choices)} plans that"
            f" meet it in the closed form miss it there; the closed form's best reaches"
            f" {_quoted(choices[0].estimate, c)} there")


def _constraint_words(c: Constraints) -> str:
    """The constraints `c` in words, e.g. 'at least 2 iterations/s and at most $40/hour'."""
    parts = []
    if c.min_throughput is not None:
        parts.append(f"at least {c.min_throughput:g} iterations/s")
    if c.max_cost_per_iteration is not None:
        parts.append(f"at most ${c.max_cost_per_iteration:g}/iteration")
    if c.max_cost_per_hour is not None:
        parts.append(f"at most ${c.max_cost_per_hour:g}/hour")
    return " and ".join(parts)


def _event_or_closed(plan: Plan, ctx: SimContext) -> Estimate:
    """A finalist's estimate: the event simulation, or the closed form where one of its pipelines runs
    more stage x chunk x micro-batch passes than the event simulation takes (`limits.MAX_PIPELINE_TASKS`,
    `simulator.schedule.check_pipeline_tasks`)."""
    tasks = max(plan.num_stages * plan.virtual_stages * p.microbatches for p in plan.pipelines)
    return simulate(plan, ctx, event=tasks <= MAX_PIPELINE_TASKS)


def _why_infeasible(ctx: SimContext, opts: PlanOptions, found: Found) -> str:
    """The binding reason no plan was found by the search that gave `found`, with numbers: the
    fastest and the cheapest plan per iteration without the constraints and, under a $/hour cap, the
    lowest $/hour among the plans found (those two and the candidates the search scored,
    `Found.least_hourly`, in the closed form). A floor above the fastest plan's throughput, or a cap
    below the cheapest figure of its kind, is named alone as the binding one."""
    if not found.any_family:
        return _no_fit(ctx, opts)
    c = opts.constraints
    if c == Constraints():
        return _too_few_gpus(ctx, opts)
    # Without constraints the search either succeeds or fails for a reason that is not a constraint
    # (InfeasibleError propagates): no recursion back here.
    free = dict(search=opts.search, max_stages=opts.max_stages, max_mbs=opts.max_mbs, top_k=1, rescore=1,
                memory_margin=opts.memory_margin)
    fastest = plan_job(ctx, PlanOptions(objective=Objective.THROUGHPUT, **free)).estimate
    cheapest = plan_job(ctx, PlanOptions(objective=Objective.COST, **free)).estimate
    # (the lowest $/hour, iterations/s there, whether in the closed form) among the plans found
    hourly = min([(e.cost_per_hour_usd, e.throughput_iters_per_s, False) for e in (fastest, cheapest)]
                 + ([(*found.least_hourly, True)] if found.least_hourly else []))
    # a floor above the fastest plan's throughput, or a cap below the cheapest figure of its kind, binds alone
    alone = Constraints(
        min_throughput=c.min_throughput if c.min_throughput and fastest.throughput_iters_per_s < c.min_throughput else None,
        max_cost_per_iteration=(c.max_cost_per_iteration if c.max_cost_per_iteration is not None
                                and cheapest.cost_per_iteration_usd > c.max_cost_per_iteration else None),
        max_cost_per_hour=c.max_cost_per_hour if c.max_cost_per_hour is not None and hourly[0] > c.max_cost_per_hour else None)
    several = sum(x is not None for x in (c.min_throughput, c.max_cost_per_iteration, c.max_cost_per_hour)) > 1
    words = _constraint_words(alone) if alone != Constraints() else _constraint_words(c) + (" together" if several else "")
    space = "" if opts.search is SearchSpace.FULL else f" in the {opts.search.value} search space"
    lowest = ("" if c.max_cost_per_hour is None else
              f"; the lowest $/hour of the plans found is ${_figure(hourly[0], c.max_cost_per_hour)}/hour at"
              f" {_figure(hourly[1], c.min_throughput)} iterations/s{' (closed form)' if hourly[2] else ''}")
    return (f"no plan meets {words}{space}: the fastest plan reaches {_quoted(fastest, c)}; the cheapest costs"
            f" ${_figure(cheapest.cost_per_iteration_usd, c.max_cost_per_iteration)}/iteration"
            f" (${_figure(cheapest.cost_per_hour_usd, c.max_cost_per_hour)}/hour) at"
            f" {_figure(cheapest.throughput_iters_per_s, c.min_throughput)} iterations/s{lowest}")


def _quoted(e: Estimate, c: Constraints) -> str:
    """'X iterations/s at $Y/iteration ($Z/hour)' for estimate `e`, each figure on its side of the
    constraint of its kind in `c` (`_figure`)."""
    return (f"{_figure(e.throughput_iters_per_s, c.min_throughput)} iterations/s at"
            f" ${_figure(e.cost_per_iteration_usd, c.max_cost_per_iteration)}/iteration"
            f" (${_figure(e.cost_per_hour_usd, c.max_cost_per_hour)}/hour)")


def _figure(value: float, limit: float | None) -> str:
    """`value` to 3 significant figures, or as many more as it takes to print it on its side of
    `limit` (a figure that misses a limit must not read as meeting it: 0.143761 against a floor of
    0.144 prints 0.1438, not 0.144)."""
    for digits in range(3, 18):
        text = f"{value:.{digits}g}"
        if limit is None or value == limit or (float(text) < limit) == (value < limit) and float(text) != limit:
            return text
    return repr(value)


# No memory options, and the ones that save the most (the infeasibility message compares them).
_SAVINGS = [("no memory options", StageMemory()),
            ("full recomputation, SP and ZeRO-3", StageMemory(recompute="full", sequence_parallel=True, zero=3)),
            ("full recomputation and ZeRO-3", StageMemory(recompute="full", zero=3))]  # where no TP degree allows SP


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

    plain = least(_SAVINGS[0][1])
    if plain is None:
        return "no GPU type in the cluster can hold a TP group of this model"
    for label, strong in _SAVINGS[1:]:  # with SP where a TP degree allows it, else without
        strongest = least(strong)
        if strongest is not None:
            break
    if min(plain[0], strongest[0]) <= cap:  # it fits with more stages or TP than the cluster's GPUs make
        return _too_few_gpus(ctx, opts)
    where = f"TP {strongest[2]}, {strongest[3]} stage{'s' * (strongest[3] != 1)}, micro-batch 1 of {job.seq} tokens"
    head = (f"{model.name} needs {plain[0] / GB:.1f} GB per GPU at best without memory options and"
            f" {strongest[0] / GB:.1f} GB with {label} over {strongest[4]} replica{'s' * (strongest[4] != 1)} ({where});"
            f" the largest GPU offered ({largest}) has {ctx.memory_capacity(largest) / GB:.1f} GB"
            + (f" ({cap / GB:.1f} GB usable with the {ctx.memory_margin:.0%} memory margin)" if ctx.memory_margin else ""))
    for more in (2, 4, 8, 16, 64, 256, 1024):
        bigger = least(strong, more)
        if bigger[4] <= strongest[4]:
            break  # as many replicas as micro-batches already
        if bigger[0] <= cap:
            return (f"{head}; {label} over {bigger[4]} replicas ({bigger[4] * bigger[2] * bigger[3]}"
                    f" {bigger[1]}, TP {bigger[2]}, {bigger[3]} stages) would make it fit")
    return f"{head}, and no memory option makes it fit"


def _too_few_gpus(ctx: SimContext, opts: PlanOptions) -> str:
    """Some GPU type can hold the model's stages, but the cluster has too few GPUs for the smallest
    plan: over P and the memory candidates the search takes (the lightest `opts.memory_per_partition`
    of the even split's), the fewest GPUs of D pipelines, D the replicas ZeRO needs
    for the options taken (each stage on whatever GPU type and TP holds it with the fewest GPUs at
    that D, micro-batch 1), against the GPUs offered."""
    job, cluster = ctx.job, ctx.cluster
    L = job.model.num_layers
    gpus = cluster.gpu_types()
    zero_max = 3 if zero3_needed(ctx, opts.max_stages) else 2
    best = None  # (GPUs needed, P, D)
    for P in range(1, min(L, opts.max_stages) + 1):
        part = even_partition(L, P)
        # what the search takes on this cluster and on the smallest that hold 1 or 2 pipelines of P
        # stages at one TP degree (a cluster's candidates take only the options its GPUs can hold)
        sizes = {cluster.total_gpus()} | {d * P * t for g in gpus for t in job.model.tp_degrees(cluster.node_size(g))
                                          for d in (1, 2)}
        tried = {tuple(m) for n in sizes for m in memory_candidates(
            ctx, gpus, part, 1, job.global_batch_size, zero_max, opts.memory_per_partition, gpus_offered=n)}
        for memory in sorted(tried, key=str):
            stages = [[o for g in gpus for o in stage_options(ctx, g, part, 1, job.global_batch_size, memory)[i]]
                      for i in range(P)]
            if not all(stages):
                continue
            for D in sorted({o.min_replicas for stage in stages for o in stage}):
                fewest = [min((o.tp for o in stage if o.min_replicas <= D), default=None) for stage in stages]
                if None not in fewest and (best is None or D * sum(fewest) < best[0]):
                    best = (D * sum(fewest), P, D)
    if best is None:
        return f"no GPU type in the cluster can hold {job.model.name}'s stages in memory"
    need, P, D = best
    replicas = "" if D == 1 else f", {D} pipelines for ZeRO to shard over"
    head = f"{job.model.name} needs at least {need} GPUs ({P} stage{'s' * (P != 1)}{replicas}, micro-batch 1, to fit in memory"
    if opts.search is SearchSpace.FULL:
        offered = cluster.total_gpus()
        tail = (f"the cluster offers {offered}" if need > offered else
                f"the cluster offers {offered}, yet no plan was found with the memory options searched (the lightest"
                f" that {offered} GPUs allow, which can need more pipelines than the GPU types that hold them make)")
        return f"{head}; its stages may sit on any GPU type, zone and region); {tail}"
    # the other spaces use fewer GPUs together: one region (paper) or one zone's GPU type
    pools = free_pools(ctx)
    if opts.search is SearchSpace.HOMOGENEOUS:
        together, where = max(pools.values()), "one zone and GPU type"
    else:
        together, where = max(sum(s.free(pools).values()) for s in scopes(ctx) if s.name != "all regions"), "one region"
    verdict = (f"the most it can use together {'is' if together == 1 else 'are'} {together}" if need > together
               else f"it found no plan on the {together} it can use together")
    return f"{head}); the {opts.search.value} search keeps a plan in {where}, and {verdict}"
