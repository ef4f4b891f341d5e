"""Lower bounds that let the planner skip whole parts of its search (branch and bound).

Each bound is the objective key of no plan better than it in that part of the space; they are
valid for the closed-form scores `search.Scorer` computes, so pruning with them never loses the best
plan of the space (the brute-force tests check this in the planner's exact mode).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sailor.model.spec import Recompute
from sailor.plan.spec import DEFAULT_STAGE_MEMORY
from sailor.planner import search as S
from sailor.planner.options import Objective, PlanOptions
from sailor.planner.space import zero3_needed
from sailor.simulator import DEFAULT_TIME, SimContext, Slot, TimeOptions, allreduce_s, stage_sync, time_options


def pair_groups(ctx: SimContext, slot: Slot) -> list[list[tuple[Slot, int]]]:
    """The two-replica member sets a stage's sync is bounded by: on two nodes, and on one node when
    two replicas fit there (the launcher co-locates them, and the intra-node link is usually the
    faster; a ring or hierarchical all-reduce over D >= 2 members takes at least half the cheaper
    of the two, see `lower_bound`)."""
    out = [[(slot, 2)]]
    if 2 * slot.tp <= ctx.cluster.node_size(slot.gpu):
        out.append([(dataclasses.replace(slot, node=f"{slot.zone}/{slot.gpu}/bound"), 2)])
    return out


def pair_sync(ctx: SimContext, slot: Slot, a: int, e: int, sync: TimeOptions = DEFAULT_TIME) -> float:
    """The cheaper two-replica gradient sync of layers [a, e) under the stage's options `sync`
    (`pair_groups`), seconds."""
    return min(stage_sync(ctx, g, ((a, e),), sync)[0] for g in pair_groups(ctx, slot))


def pair_allreduce(ctx: SimContext, slot: Slot, nbytes: float, t: int) -> float:
    """The cheaper two-replica all-reduce of `nbytes` (`pair_groups`), seconds."""
    return min(allreduce_s(ctx, g, nbytes, t) for g in pair_groups(ctx, slot))


def coarse_bound(ctx: SimContext, zones, P: int, mbs: int, opts: PlanOptions) -> tuple[float, float]:
    """Lower bound on any plan with P stages and micro-batch `mbs` in these zones, whatever its
    partition and TP degrees (memory ignored, so it stays a bound).

    Per GPU type: a pipeline's first micro-batch takes at least fill = Σ_layers min_t (f+b)(layer, t),
    each further one at least fill / P (its slowest stage holds at least 1/P of that compute), and a
    pipeline j of any TP degrees spends at least work = Σ_layers min_t t·(f+b)(layer, t) GPU-seconds
    per micro-batch (G_j x its period). A pipeline finishes cap_j <= 1 + (τ - fill_j)/period_j <=
    τ·G_j/work micro-batches by τ (fill_j >= period_j), so `a` GPUs of a type in a zone finish at most
    min((a/P)·(1 + (τ - fill)·P/fill), a·τ/work) by τ.
    The sync of two or more replicas is at least half the two-replica all-reduce of 1/P of the
    model's gradient at the most favourable TP degree and zone, times the smallest share of it any
    memory option leaves (`zero_sync_share`). Cost: every micro-batch costs at least the cheapest
    price x work.
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
                sync2 = min(sync2, pair_allreduce(ctx, Slot(zone=z, gpu=g, tp=t), nbytes, t))
    if not kinds:
        return (float("inf"), float("inf"))

    def capacity(tau: float) -> float:
        total = 0.0
        for a, fill, per, work, _ in kinds:
            if tau >= fill:
                total += min((a // P) * (1 + math.floor((tau - fill) / per + 1e-9)), a * tau / work)
        return total

    M = job.global_batch_size // mbs
    lo = smallest_time(lambda tau: capacity(tau) >= M, min(k[1] for k in kinds),
                       max(k[1] for k in kinds) * (1 + job.global_batch_size))
    alone = min(fill + (M - 1) * per for _, fill, per, _, _ in kinds)
    T = min(alone, lo + zero_sync_share(ctx, opts) * sync2 / 2)
    cost = M * min(price * work for _, _, _, work, price in kinds) / 3600.0
    return (T, cost) if opts.objective is Objective.THROUGHPUT else (cost, T)


def zero_sync_share(ctx: SimContext, opts: PlanOptions) -> float:
    """Smallest fraction of the gradient all-reduce's time a stage's sync can take under the memory
    options the search may use: ZeRO-1/2 reduce-scatter the gradients (half) and all-gather the
    weights (half, at weight bytes), ZeRO-3 only reduce-scatters (half; searched only when needed,
    `space.zero3_needed`)."""
    per = ctx.job.state_bytes_per_param
    share = min(1.0, (per["gradients"] + per["weights"]) / (2 * per["gradients"]))
    return min(share, 0.5) if zero3_needed(ctx, opts.max_stages) else share


def coarse_estimate(ctx: SimContext, zones, P: int, mbs: int, opts: PlanOptions) -> tuple[float, float]:
    """Optimistic estimate (not a strict bound) of the best plan with P stages and micro-batch `mbs`,
    for the heuristic mode on large clusters: per GPU type and zone and per uniform TP degree t whose
    average stage fits in memory ((states + one micro-batch of activations) / P + framework), n =
    a // (P·t) pipelines of fill = Σ_layers (f+b)(layer, t) + 2(P-1) transfers and per-micro-batch
    time max(Σ / P, the heaviest layer) + the stage's transfers (2 for P = 2, 4 beyond: blocking
    sends and receives both ways); the makespan for each possible largest share m with the fewest
    pipelines D = ceil(M / m), plus the all-reduce floor of D replicas (sync2·(D-1)/D). Mixed-TP templates and memory beyond the
    average stage are ignored, which is why the exact mode uses `coarse_bound` instead."""
    job, model = ctx.job, ctx.job.model
    L, M = model.num_layers, job.global_batch_size // mbs
    state = job.state_bytes_per_param
    zero3 = zero3_needed(ctx, opts.max_stages)
    runs = []  # (pipelines, fill, per-mb, usd/hour per pipeline, (gpu, zone))
    sync2 = float("inf")
    for z in zones:
        for g, a in ctx.cluster.zones[z].items():
            cap_bytes = ctx.memory_limit(g)
            for t in model.tp_degrees(ctx.cluster.node_size(g)):
                n = a // (P * t)
                if n == 0:
                    continue
                # the least the average stage can hold: full recomputation, ZeRO over the n replicas
                act = ctx.act_cumsum(t, mbs, Recompute.FULL)[-1]
                per_param = (state["weights"] / (n if zero3 else 1)) + (state["gradients"] + state["optimizer"]) / n
                if (ctx.stage_params(t, 0, L) * per_param + act) / P + ctx.framework_bytes(g) > cap_bytes:
                    continue
                layers = np.diff(ctx.layer_cumsum(g, t, mbs), axis=0).sum(axis=1)
                c = ctx.network.transfer_time_s(z, g, z, g, ctx.boundary_bytes(1, mbs), flows=t) if P > 1 else 0.0
                sends = 0 if P == 1 else (2 if P == 2 else 4)  # transfers a stage makes per micro-batch
                fill = float(layers.sum()) + 2 * (P - 1) * c
                per = max(float(layers.sum()) / P, float(layers.max())) + sends * c
                runs.append((n, fill, per, P * t * ctx.cluster.price(z, g), (g, z)))
                grad = t * ctx.stage_params(t, 0, L) / P * job.state_bytes_per_param["gradients"]
                sync2 = min(sync2, pair_allreduce(ctx, Slot(zone=z, gpu=g, tp=t), grad, t))
    if not runs:
        return (float("inf"), float("inf"))
    best_t, best_c = float("inf"), float("inf")
    m = 1
    while m <= M:
        D = -(-M // m)
        # the fastest runs first, one TP degree per (GPU type, zone), until D pipelines are covered
        taken, have, tau, rate = set(), 0, 0.0, float("inf")
        for n, fill, per, usd, gz in sorted(runs, key=lambda r: r[1] + (m - 1) * r[2]):
            if have >= D:
                break
            if gz not in taken:
                taken.add(gz)
                have += n
                tau = fill + (m - 1) * per
                rate = min(rate, usd)
        if have >= D:
            t = tau + (sync2 * (D - 1) / D if D > 1 else 0.0)
            best_t = min(best_t, t)
            best_c = min(best_c, D * rate * t / 3600.0)
        m = -(-M // (D - 1)) if D > 1 else M + 1  # next share size that lowers D

    # all pipelines at once, each kind with its own share (faster kinds take more micro-batches)
    def chosen(tau: float) -> list[tuple[int, int]]:  # (pipelines, micro-batches each) per (gpu, zone)
        best: dict[tuple, tuple[int, int]] = {}
        for n, fill, per, _, gz in runs:
            cap = 1 + math.floor((tau - fill) / per + 1e-9) if tau >= fill else 0
            if n * cap > best.get(gz, (0, 0))[0] * best.get(gz, (0, 0))[1]:
                best[gz] = (n, cap)
        return list(best.values())

    tau = smallest_time(lambda x: sum(n * c for n, c in chosen(x)) >= M, min(r[1] for r in runs),
                        max(r[1] + M * r[2] for r in runs))
    D = sum(n for n, c in chosen(tau * (1 + 1e-9)) if c)
    if D:
        t = tau + (sync2 * (D - 1) / D if D > 1 else 0.0)
        best_t = min(best_t, t)
        best_c = min(best_c, D * min(r[3] for r in runs) * t / 3600.0)
    return (best_t, best_c) if opts.objective is Objective.THROUGHPUT else (best_c, best_t)


def sync_floor(ctx, gpu: str, zones, options, partition, memory=None) -> float:
    """Lower bound on the gradient sync of any plan with >= 2 pipelines of `gpu`: per stage, the
    sync between just two replicas (under the stage's memory options) at the most favourable
    feasible TP degree, in the most favourable zone and placement (`pair_sync`; more members, mixed
    TP degrees or other zones only add ring steps, shrink the flow count or slow the links)."""
    memory = memory or (DEFAULT_STAGE_MEMORY,) * len(partition)
    best = float("inf")
    for z in zones:
        worst = 0.0
        for opts_i, (a, e), mem in zip(options, partition, memory):
            sync = time_options(mem, 2)
            worst = max(worst, min(pair_sync(ctx, Slot(zone=z, gpu=gpu, tp=o.tp), a, e, sync) for o in opts_i))
        best = min(best, worst)
    return best


def types_sync_floor(ctx, types: list[S.PipelineType], partition) -> float:
    """`sync_floor` for pipeline types whose TP template and memory options are fixed."""
    return min(max(pair_sync(ctx, t.slot(i), a, e, time_options(t.memory[i], 2))
                   for i, (a, e) in enumerate(partition)) for t in types)


def lower_bound(types: list[S.PipelineType], M: int, opts: PlanOptions, sync2: float,
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

    lo = smallest_time(lambda tau: capacity(tau) >= M, min(t.fill_s for t in used),
                       max(t.two_s for t in used) + M * max(t.period_s for t in used))
    opt = min(t.optimizer_s for t in used)
    alone = min(t.time_s(M) for t in used) + opt
    many = lo + sync2 / 2 + opt if sum(t.max_count for t in used) >= 2 else float("inf")
    T = min(alone, many)
    rate = min(t.usd_per_hour for t in used)
    base = min(t.usd_per_hour * min(t.fill_s, t.two_s - t.period_s) for t in used)
    work = (M * min(t.usd_per_hour * t.period_s for t in used) + min(base, 0.0) * M + max(base, 0.0)) / 3600.0
    cost = min(min(t.usd_per_hour * t.time_s(M) for t in used) / 3600.0,
               max(work, 2 * rate * (lo + sync2 / 2 + opt) / 3600.0))
    return (T, cost) if opts.objective is Objective.THROUGHPUT else (cost, T)


def smallest_time(enough, lo: float, hi: float, iterations: int = 50) -> float:
    """Lower end of the bisection for the smallest τ in [lo, hi] with enough(τ) (non-decreasing in
    τ): a value <= that τ, within (hi - lo)/2^iterations of it — what a lower bound needs."""
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if enough(mid):
            hi = mid
        else:
            lo = mid
    return lo
