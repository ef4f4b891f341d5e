"""Lower bounds and estimates that let the search skip parts of its space (branch and bound).

A *bound* is an objective key that no plan in that part of the space beats, for any mix of GPU types,
zones and TP degrees inside a pipeline (`node_bound` for a (P, micro-batch) node, `family_bound` for
a partition's kinds); pruning with bounds never loses the best plan, which the brute-force tests
check in exact mode. An *estimate* (`node_estimate`) is what a plan of uniform pipelines would
reach; the heuristic mode on large clusters orders and prunes nodes by the larger of the two.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math

import numpy as np

from sailor.core.units import HOUR_S
from sailor.model.spec import Recompute
from sailor.plan.placement import same_node_boundaries
from sailor.planner.kinds import Kind, Pool, boundary, pool_price
from sailor.planner.options import Objective, PlanOptions
from sailor.planner.score import apart_groups
from sailor.planner.space import even_partition, mbs_candidates, zero3_needed
from sailor.simulator import (DEFAULT_TIME, SimContext, Slot, TimeOptions, allreduce_s, optimizer_s, stage_sync,
                              time_options)

Key = tuple[float, float]
ESTIMATE_MARGIN = 0.1  # heuristic mode: a node is pruned when its estimate is 10 % above the best plan


@dataclasses.dataclass
class NodeKeys:
    """The search's (P, micro-batch) nodes with their keys, each key computed when first asked for.

    `bounds`: (`node_bound`, P, micro-batch) per node; `sync`: the sync floor per P (`sync_floor`
    times the least share of an all-reduce a stage's sync takes under the memory options the search
    may use, `zero_sync_share`). A node's key (`key`) is its bound in exact mode; outside, the larger
    of that and `node_estimate` discounted by ESTIMATE_MARGIN (the estimate assumes the even split
    and one TP degree; the best plan of a node has been seen up to 5 % below it), so that estimates
    prune only clear losers; where no zone holds a uniform pipeline (pipelines must span zones or
    regions) the estimate says nothing and the bound stands. The key is never below the bound, so a
    search that takes nodes in key order may hold a node at its bound until it comes up and only
    then ask for its key (`in_key_order`): the order is the same, and the estimates of the nodes
    never reached are not computed."""

    ctx: SimContext
    opts: PlanOptions
    exact_mode: bool
    bounds: list[tuple[Key, int, int]]
    sync: dict[int, float]
    _keys: dict[tuple[int, int], Key] = dataclasses.field(default_factory=dict)

    def key(self, bound: Key, P: int, mbs: int) -> Key:
        """The key of node (P, mbs) whose bound is `bound` (computed once)."""
        if (P, mbs) not in self._keys:
            key = bound
            est = None if self.exact_mode else node_estimate(self.ctx, P, mbs, self.opts)
            if est is not None and est[0] < math.inf:  # none when no zone holds a uniform pipeline
                key = max(key, (est[0] / (1 + ESTIMATE_MARGIN), est[1]))
            self._keys[(P, mbs)] = key
        return self._keys[(P, mbs)]


def node_keys(ctx: SimContext, opts: PlanOptions, exact_mode: bool) -> NodeKeys:
    """Every node of the search with its bound, and the sync floor per P (`NodeKeys`)."""
    job = ctx.job
    bounds, sync = [], {}
    share = zero_sync_share(ctx, opts)  # the least share of an all-reduce a stage's sync can take
    for P in range(1, min(job.model.num_layers, opts.max_stages) + 1):
        sync[P] = share * sync_floor(ctx, P, pairs=exact_mode)
        for mbs in mbs_candidates(job.global_batch_size, opts.max_mbs):
            bounds.append((node_bound(ctx, P, mbs, opts, sync[P]), P, mbs))
    return NodeKeys(ctx, opts, exact_mode, bounds, sync)


def in_key_order(nodes: NodeKeys):
    """(key, P, micro-batch) of every node in order of (key, P, micro-batch), as sorting the keyed
    nodes gives them; a node's key is computed when its bound comes up (`NodeKeys`), so a caller
    that stops early leaves the later nodes' estimates uncomputed."""
    heap = [(bound, P, mbs, False) for bound, P, mbs in nodes.bounds]
    heapq.heapify(heap)
    while heap:
        bound, P, mbs, keyed = heapq.heappop(heap)
        if keyed:
            yield bound, P, mbs
        else:
            heapq.heappush(heap, (nodes.key(bound, P, mbs), P, mbs, True))


def zero_sync_share(ctx: SimContext, opts: PlanOptions) -> float:
    """Smallest fraction of the gradient all-reduce's time a stage's sync can take under the memory
    options the search may use: ZeRO-1/2 reduce-scatter the gradients (half) and all-gather the
    weights (half, at weight bytes), ZeRO-3 only reduce-scatters (half; searched only when needed,
    `space.zero3_needed`)."""
    per = ctx.job.state_bytes_per_param
    share = min(1.0, (per["gradients"] + per["weights"]) / (2 * per["gradients"]))
    return min(share, 0.5) if zero3_needed(ctx, opts.max_stages) else share


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


def _key(opts: PlanOptions, time_s: float, cost_usd: float) -> Key:
    return (time_s, cost_usd) if opts.objective is Objective.THROUGHPUT else (cost_usd, time_s)


def _layer_table(ctx: SimContext, mbs: int) -> list[tuple[str, int, np.ndarray]]:
    """(GPU type, TP, per-layer forward + backward seconds (L,)) for every GPU type offered and TP
    degree within a node and within the most GPUs of that type in one zone."""
    out = []
    for g in ctx.cluster.gpu_types():
        most = max(ctx.cluster.available(z, g) for z in ctx.cluster.zones)
        for t in ctx.job.model.tp_degrees(ctx.cluster.node_size(g)):
            if t <= most:
                out.append((g, t, ctx.layer_s(g, t, mbs).sum(axis=1)))
    return out


def _pipelines_floor(M: int, N: int, d_max: int, fill: float, per: float, work: float, bubble: float,
                     sync_s: float) -> float:
    """Least makespan + sync of D pipelines, minimised over D = 1..d_max, where one pipeline running m
    micro-batches takes at least fill + (m - 1)·per seconds (some pipeline runs ceil(M / D)), and the
    N GPUs, each busy at most the makespan τ, must supply M·work GPU-seconds of micro-batches plus
    `bubble` GPU-seconds per pipeline (a pipeline's fill and drain): N·τ >= M·work + D·bubble. Two or
    more pipelines also pay `sync_s`."""
    def tau(D: int) -> float:
        return max(fill + (-(-M // D) - 1) * per, (M * work + D * bubble) / N)

    best = tau(1)
    if d_max >= 2:
        lo, hi = 2, d_max  # the first term falls with D, the second rises: bisect for their crossing
        while lo < hi:
            mid = (lo + hi) // 2
            if fill + (-(-M // mid) - 1) * per <= (M * work + mid * bubble) / N:
                hi = mid
            else:
                lo = mid + 1
        best = min(best, min(tau(D) for D in {max(2, lo - 1), lo}) + sync_s)
    return best


def sync_floor(ctx: SimContext, P: int, pairs: bool) -> float:
    """Lower bound on the slowest stage's gradient all-reduce of any plan with P stages and D >= 2
    replicas: the heaviest stage holds at least 1/P of the model's parameters, and a ring of D
    replicas takes 2(D-1) steps of 1/D of them — at least half the time two replicas take (also where
    bandwidth varies with message size within 2x). Two replicas of one slot (zone, GPU type, TP) at
    the most favourable slot; with `pairs` also two replicas of any two different slots; each on two
    nodes and on one where both fit (`two_replica_groups`)."""
    model, grad = ctx.job.model, ctx.job.state_bytes_per_param["gradients"]
    slots = [Slot(zone=z, gpu=g, tp=t) for z in sorted(ctx.cluster.zones) for g, n in ctx.cluster.zones[z].items()
             if n > 0 for t in model.tp_degrees(ctx.cluster.node_size(g)) if t <= n]
    groups = two_replica_groups(ctx, slots, pairs)
    best = math.inf
    for grp in groups:
        t = min(s.tp for s, _ in grp)
        nbytes = t * ctx.stage_params(t, 0, model.num_layers) / P * grad
        best = min(best, allreduce_s(ctx, grp, nbytes, t))
    return 0.0 if best == math.inf else best / 2


def two_replica_groups(ctx: SimContext, slots: list[Slot], pairs: bool) -> list[list[tuple[Slot, int]]]:
    """The two-replica member sets a stage's gradient sync is bounded by (`sync_floor`,
    `two_replica_sync`): two replicas of each slot, on two nodes and on one node where two fit (the
    launcher co-locates replicas, `simulator.place`, and the intra-node link is usually the faster);
    with `pairs` also one replica each of two different slots, on two nodes and, when they share a
    zone and GPU type and fit one node together, on one. Without `pairs`, one slot of each class of
    `alike_slots` (the others' groups take the same times)."""
    groups = []
    if not pairs:
        slots = alike_slots(ctx, slots)
    for s in slots:
        groups.append([(s, 2)])
        if 2 * s.tp <= ctx.cluster.node_size(s.gpu):
            groups.append([(dataclasses.replace(s, node=f"{s.zone}/{s.gpu}/bound"), 2)])
    if pairs:
        for a, b in itertools.combinations(slots, 2):
            x, y = sorted((a, b), key=lambda s: (s.zone, s.gpu, s.tp))
            groups.append([(x, 1), (y, 1)])
            if (x.zone, x.gpu) == (y.zone, y.gpu) and x.tp + y.tp <= ctx.cluster.node_size(x.gpu):
                node = f"{x.zone}/{x.gpu}/bound"
                groups.append([(dataclasses.replace(x, node=node), 1), (dataclasses.replace(y, node=node), 1)])
    return groups


def alike_slots(ctx: SimContext, slots: list[Slot]) -> list[Slot]:
    """`slots` without those alike an earlier one: the same GPU type, TP degree, node and cut in a
    zone of the same class (`NetworkModel.zone_class`). Two replicas of alike slots, on two nodes or
    on one, take the same time in every collective, so zones the network model tells apart by
    nothing give one slot per GPU type and TP degree."""
    seen, out = set(), []
    for s in slots:
        key = (dataclasses.replace(s, zone=""), ctx.network.zone_class(s.zone, s.gpu))
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def two_replica_sync(ctx: SimContext, slots: list[Slot], stage: tuple[int, int], pairs: bool,
                     sync: TimeOptions = DEFAULT_TIME) -> float:
    """The cheapest gradient sync of the layers `stage` over the member sets of `two_replica_groups`
    under the stage's options `sync`, seconds: a ring or hierarchical all-reduce over D >= 2 replicas
    takes at least half of it (`sync_floor`)."""
    return min(stage_sync(ctx, g, (stage,), sync)[0] for g in two_replica_groups(ctx, slots, pairs))


def node_bound(ctx: SimContext, P: int, mbs: int, opts: PlanOptions, sync_s: float) -> Key:
    """Lower bound on any plan with P stages and micro-batch `mbs` (any partition, TP degrees, GPU
    types and zones per stage; memory ignored, so it stays a bound).

    A pipeline's first micro-batch takes at least fill = Σ_layers min over (GPU type, TP) of
    (f + b); each further one at least fill / P (its slowest stage holds at least 1/P of it;
    transfers only add, and the closed form's overlap is smaller than the fill's transfers); one
    micro-batch costs at least work = Σ_layers min t·(f + b) GPU-seconds, and a pipeline's GPUs idle
    at least (P - 1)·fill GPU-seconds besides (each of its stages waits for the others' share of the
    first micro-batch); N GPUs hold at most N // P pipelines (`_pipelines_floor`). Two or more
    pipelines pay at least `sync_s` (`node_keys`); every plan at least the smallest optimizer step
    of 1/P of the model over M shards (ZeRO). Cost: every micro-batch at least the cheapest $ per
    layer's work.
    """
    job, model = ctx.job, ctx.job.model
    L, M = model.num_layers, job.global_batch_size // mbs
    rows = _layer_table(ctx, mbs)
    N = ctx.cluster.total_gpus()
    if not rows or N < P:
        return (math.inf, math.inf)
    per_layer = np.min([r for _, _, r in rows], axis=0)
    work_layer = np.min([t * r for _, t, r in rows], axis=0)
    price = {g: min(pool_price(ctx, (z, g)) for z in ctx.cluster.zones if ctx.cluster.available(z, g))
             for g in ctx.cluster.gpu_types()}
    usd_layer = np.min([price[g] * t * r for g, t, r in rows], axis=0)
    fill, work = float(per_layer.sum()), float(work_layer.sum())
    # ZeRO may split the optimizer step over up to one replica per micro-batch
    opt = min(ctx.profiles.optimizer_time_s(job, g, ctx.stage_params(t, 0, L) / P / M) for g, t, _ in rows)
    T = _pipelines_floor(M, N, N // P, fill, fill / P, work, (P - 1) * fill, sync_s) + opt
    cost = M * float(usd_layer.sum()) / HOUR_S
    return _key(opts, T, cost)


def node_estimate(ctx: SimContext, P: int, mbs: int, opts: PlanOptions) -> Key:
    """What uniform pipelines reach with P stages and micro-batch `mbs` (not a bound): per (GPU type,
    zone) and uniform TP t whose average stage fits in memory at the least the memory options allow
    ((states, ZeRO-sharded over the n pipelines, + one micro-batch of activations under full
    recomputation) / P + framework), n = a // (P·t) pipelines of fill = Σ_layers (f + b) + 2 x the
    P - 1 transfers (each inside a node or between two, as the block placement puts the pipeline,
    `plan.placement.same_node_boundaries`) and period = max(Σ / P, the heaviest layer) + the stage's
    transfers (2 for P = 2, 4 beyond, at the slowest boundary's); the makespan at which all of them, each kind with its own share, finish the batch, plus
    the all-reduce of the fastest of those pipelines that cover the batch (each pool at its best TP
    degree at that makespan) over the even partition's stages, and the optimizer step. The best of
    these over TP floors (runs of TP >= t only), as the sync is slower the finer the sharding, and
    over the same pipelines cut between nodes (`_node_group_estimate`). For the cost objective
    `_cheapest_estimate` instead (or the cut pipelines' where cheaper)."""
    job, model = ctx.job, ctx.job.model
    L, M = model.num_layers, job.global_batch_size // mbs
    state = job.state_bytes_per_param
    zero3 = zero3_needed(ctx, opts.max_stages)
    runs = []  # (pipelines, fill, period, $/hour per pipeline, pool index)
    cut_runs = []  # (zone, GPU type, TP, pipelines, per-layer s, zone class, price) of runs that could be cut
    tps: list[int] = []
    opt = math.inf
    pools = [(z, g, a) for z in sorted(ctx.cluster.zones) for g, a in ctx.cluster.zones[z].items() if a > 0]
    nbytes = ctx.boundary_bytes(1, mbs)
    per_type: dict[tuple[str, int], tuple] = {}  # (GPU type, TP) -> what every zone's pool of it shares
    per_class: dict[tuple, tuple[float, float]] = {}  # (zone class, TP) -> (fill, period) of its pools' runs
    for p, (z, g, a) in enumerate(pools):
        zone_class, price = ctx.network.zone_class(z, g), pool_price(ctx, (z, g))
        for t in model.tp_degrees(ctx.cluster.node_size(g)):
            n = a // (P * t)
            if n == 0:
                continue
            if (g, t) not in per_type:
                layers = ctx.layer_s(g, t, mbs).sum(axis=1)
                params = ctx.stage_params(t, 0, L)
                # each boundary inside a node or between two, as the block placement puts the pipeline
                per_type[(g, t)] = (ctx.act_cumsum(t, mbs, Recompute.FULL)[-1], params, layers,
                                    float(layers.sum()), float(layers.max()),
                                    same_node_boundaries([(z, g, t)] * P, ctx.cluster.node_size),
                                    (ctx.framework_bytes(g), ctx.memory_limit(g)),
                                    ctx.profiles.optimizer_time_s(job, g, params / P))
            act, params, layers, total, heaviest, inside, (framework, limit), step = per_type[(g, t)]
            # the least the average stage can hold: full recomputation, ZeRO over the n replicas
            per_param = state["weights"] / (n if zero3 else 1) + (state["gradients"] + state["optimizer"]) / n
            if (params * per_param + act) / P + framework > limit:
                continue
            cls = (zone_class, t)  # the zone's links are all the transfers read of it
            if cls not in per_class:
                link = {on: ctx.network.transfer_time_s(z, g, z, g, nbytes, flows=t, same_node=on) for on in set(inside)}
                c = [link[on] for on in inside]
                sends = 0 if P == 1 else (2 if P == 2 else 4)
                per_class[cls] = (total + 2 * sum(c), max(total / P, heaviest) + sends * max(c, default=0.0))
            fill, per = per_class[cls]
            runs.append((n, fill, per, P * t * price, p))
            tps.append(t)
            opt = min(opt, step)
            if any(inside):
                cut_runs.append((z, g, t, n, layers, zone_class, price))
    if not runs:
        return (math.inf, math.inf)
    n, fill, per, usd, pool, tp = (np.array(x) for x in zip(*[r + (t,) for r, t in zip(runs, tps)]))
    if opts.objective is Objective.COST:
        best = _cheapest_estimate(ctx, opts, P, M, pools, n, fill, per, usd, pool, tp, opt)
    else:
        best = (math.inf, math.inf)
        for floor in sorted(set(tps)):  # sync is slower the finer the sharding: each TP floor on its own
            keep = tp >= floor
            best = _uniform_estimate(ctx, opts, P, M, pools, n[keep], fill[keep], per[keep], usd[keep],
                                     pool[keep], tp[keep], opt, best)
    return _node_group_estimate(ctx, opts, P, M, mbs, cut_runs, opt, best)


def _node_group_estimate(ctx: SimContext, opts: PlanOptions, P: int, M: int, mbs: int, runs, opt: float,
                         best: Key = (math.inf, math.inf)) -> Key:
    """`node_estimate` of uniform pipelines cut between nodes before every stage (`plan.placement`),
    for the runs (zone, GPU type, TP t, pipelines n, per-layer seconds, the zone's class
    `NetworkModel.zone_class`, $/GPU-hour) whose uncut pipelines keep a boundary inside a node: D = u
    and 2u (at most min(n, M)) of them, u = node size // t (the pipelines whose stage replicas fill
    one node each, or two: beyond, a stage's replicas span nodes however the pipelines are cut); fill
    and period as `node_estimate`'s with every boundary between two nodes; time fill + (ceil(M / D)
    - 1)·period + the slowest stage's gradient sync of D replicas placed so (`_placed_sync`) + the
    optimizer step; the best run and D, or `best` where that is better (the sync, the costly part, is
    left out where the rest alone does not beat the best so far: the key only grows with it). A run
    alike one before (a zone of its class, the same TP, count and price) has its keys, and is skipped."""
    part = even_partition(ctx.job.model.num_layers, P)
    seen = set()
    for z, g, t, n, layers, zone_class, price in runs:
        alike = (zone_class, t, n, price)  # the same keys as a run seen
        if alike in seen:
            continue
        seen.add(alike)
        c = ctx.network.transfer_time_s(z, g, z, g, ctx.boundary_bytes(1, mbs), flows=t)
        fill = float(layers.sum()) + 2 * (P - 1) * c
        per = max(float(layers.sum()) / P, float(layers.max())) + (2 if P == 2 else 4) * c
        unit, most = max(1, ctx.cluster.node_size(g) // t), min(n, M)
        slot = Slot(zone=z, gpu=g, tp=t, node_cut=True)  # a cut before stage 0 places nothing differently
        for D in (unit, 2 * unit):
            if D <= most:
                def key(sync: float) -> Key:
                    T = fill + (-(-M // D) - 1) * per + sync + opt
                    return _key(opts, T, D * P * t * price * T / HOUR_S)

                if D > 1 and key(0.0) >= best:
                    continue
                best = min(best, key(_placed_sync(ctx, [(slot, D)], part) if D > 1 else 0.0))
    return best


def _cheapest_estimate(ctx: SimContext, opts: PlanOptions, P: int, M: int, pools, n, fill, per, usd, pool, tp,
                       opt: float) -> Key:
    """Cost objective: per (pool, TP) run, the fewest D of its pipelines (at most its count) whose
    time fill + (ceil(M / D) - 1)·period + sync(D) meets the throughput floor (sync(D) ≈ the
    two-replica all-reduce of the heaviest even stage x 2(D - 1)/D, a ring's growth), costing D
    pipelines' $/hour over that time; the cheapest run."""
    L = ctx.job.model.num_layers
    heaviest = max(even_partition(L, P), key=lambda s: ctx.stage_params(1, *s))
    limit = 1.0 / opts.constraints.min_throughput if opts.constraints.min_throughput else math.inf
    best = (math.inf, math.inf)
    for r in range(len(n)):
        z, g, _ = pools[int(pool[r])]
        s2 = two_replica_sync(ctx, [Slot(zone=z, gpu=g, tp=int(tp[r]))], heaviest, pairs=False)

        def time_of(D: int) -> float:
            return fill[r] + (-(-M // D) - 1) * per[r] + (s2 * 2 * (D - 1) / D if D > 1 else 0.0) + opt

        lo, hi = 1, int(min(n[r], M))
        if time_of(hi) > limit:
            continue
        while lo < hi:  # the fewest pipelines that meet the floor
            mid = (lo + hi) // 2
            if time_of(mid) <= limit:
                hi = mid
            else:
                lo = mid + 1
        T = time_of(lo)
        best = min(best, _key(opts, T, lo * float(usd[r]) * T / HOUR_S))
    return best


def _uniform_estimate(ctx: SimContext, opts: PlanOptions, P: int, M: int, pools, n, fill, per, usd, pool, tp,
                      opt: float, best: Key = (math.inf, math.inf)) -> Key:
    """`node_estimate` for one set of runs (arrays over (pool, TP) runs, pool by pool), or `best` where
    that is better (the sync is left out where the rest alone does not beat it)."""
    starts = np.flatnonzero(np.r_[True, pool[1:] != pool[:-1]])  # each pool's first run

    def runs_cap(tau: float) -> np.ndarray:  # micro-batches by τ of each run's pipelines: whole numbers
        return np.where(tau >= fill, 1 + np.floor((tau - fill) / per + 1e-9), 0) * n

    def enough(tau: float) -> bool:  # each pool's best run (TP degree) by τ together finish the batch
        return np.maximum.reduceat(runs_cap(tau), starts).sum() >= M

    tau = smallest_time(enough, float(fill.min()), float((fill + M * per).max()))
    cap = runs_cap(tau * (1 + 1e-9)).tolist()  # Python numbers: read one by one below
    top: dict[int, int] = {}  # pool -> its run of most micro-batches by τ (the first of equals)
    for r, p in enumerate(pool.tolist()):
        if p not in top or cap[r] > cap[top[p]]:
            top[p] = r
    chosen = []  # (micro-batches each by τ, pipelines, pool, run): each pool's best TP degree at τ
    for p in sorted(top):
        r = top[p]
        if cap[r] > 0:
            chosen.append((cap[r] / n[r], int(n[r]), p, r))
    groups, D, need = [], 0, M  # the fastest pipelines until the batch is covered
    for each, count, p, r in sorted(chosen, key=lambda c: -c[0]):
        take = min(count, max(1, int(-(-need // each))))
        groups.append((Slot(zone=pools[p][0], gpu=pools[p][1], tp=int(tp[r])), take))
        D += take
        need -= take * each
        if need <= 0:
            break
    def key(sync: float) -> Key:
        T = tau + sync + opt
        return _key(opts, T, D * float(usd.min()) * T / HOUR_S)

    if D > 1 and key(0.0) >= best:
        return best
    return min(best, key(_placed_sync(ctx, groups, even_partition(ctx.job.model.num_layers, P)) if D > 1 else 0.0))


def _placed_sync(ctx: SimContext, groups: list[tuple[Slot, int]], partition) -> float:
    """The slowest stage's gradient sync of uniform pipelines (`count` of each slot on every stage;
    the slots in different pools), placed on nodes as the launcher places them, as the scorer
    computes it (`score.apart_groups`, placements shared with it)."""
    P = len(partition)
    key = ("placed-sync", tuple(groups), tuple(partition))
    if key not in ctx.memo:
        used = tuple(((slot,) * P, count) for slot, count in groups)
        stages = apart_groups(ctx, used)
        ctx.memo[key] = max(stage_sync(ctx, stages[i], ((a, e),))[0] for i, (a, e) in enumerate(partition))
    return ctx.memo[key]


def family_bound(ctx: SimContext, kinds: list[Kind], free: dict[Pool, int], partition, M: int,
                 opts: PlanOptions, pairs: bool) -> Key:
    """Lower bound on any count vector over `kinds` within `free`.

    Capacity: the pipelines sitting partly in pool p finish, per GPU of p they use, at most
    max_k cap_k(τ) / use_kp micro-batches, so all of them at most Σ_p free_p·max_k cap_k(τ)/use_kp
    (a fractional relaxation). One pipeline alone pays no sync: min_k time_k(M). Two or more: the
    relaxed makespan plus half the smallest two-replica all-reduce of each stage's slots (`sync_floor`
    argument; with `pairs` also pairs of different slots), the slowest stage's; plus the smallest
    optimizer step. Cost: one pipeline's own; or every micro-batch at least min_k $/hour·t_k, and two
    pipelines' rate over the time bound.
    """
    if not kinds:
        return (math.inf, math.inf)
    rows = [(k, p, n) for k, kind in enumerate(kinds) for p, n in kind.use]
    pool_ids = {p: j for j, p in enumerate(sorted({p for _, p, _ in rows}))}
    kk = np.array([r[0] for r in rows])
    pp = np.array([pool_ids[r[1]] for r in rows])
    use = np.array([r[2] for r in rows], dtype=float)
    avail = np.array([free.get(p, 0) for p in sorted(pool_ids)], dtype=float)
    fill = np.array([k.fill_s for k in kinds])
    two = np.array([k.two_s for k in kinds])
    period = np.array([k.period_s for k in kinds])

    def capacity(tau: float) -> float:
        caps = np.where(tau < fill, 0, np.where(tau < two, 1, 2 + np.floor((tau - two) / period + 1e-9)))
        ratio = np.zeros(len(avail))
        np.maximum.at(ratio, pp, caps[kk] / use)
        return float((ratio * avail).sum())

    lo = smallest_time(lambda tau: capacity(tau) >= M, float(fill.min()), float(max(k.time_s(M) for k in kinds)))
    opt = min(k.optimizer_s for k in kinds)
    alone = min(k.time_s(M) + k.optimizer_s for k in kinds)
    s2 = 0.0
    for i, (a, e) in enumerate(partition):
        slots = sorted({k.slot(i) for k in kinds}, key=lambda s: (s.zone, s.gpu, s.tp))
        sync = time_options(kinds[0].memory[i], 2) if kinds[0].memory else DEFAULT_TIME
        s2 = max(s2, two_replica_sync(ctx, slots, (a, e), pairs, sync))
    many = lo + s2 / 2 + opt
    T = min(alone, many)
    rate = min(k.usd_per_hour for k in kinds)
    cost = min(min(k.usd_per_hour * (k.time_s(M) + k.optimizer_s) for k in kinds),
               max(M * min(k.usd_per_hour * k.period_s for k in kinds), 2 * rate * many)) / HOUR_S
    return _key(opts, T, cost)


def boundary_floors(ctx: SimContext, table, partition, mbs: int, free: dict[Pool, int], pairs: bool) -> list[float]:
    """Per stage boundary, the fastest transfer (s per micro-batch) between an option of the stage
    before and one of the stage after (`kinds.boundary`, the simulator's own transfer), between two
    nodes and, where both ends are in one pool and fit one node together, inside a node (the block
    placement, `plan.placement.node_blocks`). With `pairs` every pair of options, each in every zone
    that has its GPU type (a valid floor); without, an estimate: the two stages on the same GPU type
    and TP degree in that type's largest zone (a pipeline that changes type, degree or zone pays
    more, as links go)."""
    zones_of: dict[str, list[str]] = {}
    for (z, g), n in sorted(free.items(), key=lambda kv: -kv[1]):
        zones_of.setdefault(g, []).append(z)
    out = []
    for i in range(len(table) - 1):
        # a transfer depends on the two ends' GPU types, zones and TP degrees (`terms.link_transfer`)
        ends = sorted({(oa.gpu, ob.gpu, oa.tp, ob.tp) for oa in table[i] for ob in table[i + 1]
                       if pairs or (oa.gpu, oa.tp) == (ob.gpu, ob.tp)})
        best = math.inf
        for ga, gb, ta, tb in ends:
            for za in (zones_of.get(ga, []) if pairs else zones_of.get(ga, [])[:1]):
                for zb in (zones_of.get(gb, []) if pairs else [za]):
                    a, b = Slot(zone=za, gpu=ga, tp=ta), Slot(zone=zb, gpu=gb, tp=tb)
                    best = min(best, boundary(ctx, a, b, partition[i], partition[i + 1], mbs)[0])
                    if (za, ga) == (zb, gb) and ta + tb <= ctx.cluster.node_size(ga):  # one block: one node
                        best = min(best, boundary(ctx, a, b, partition[i], partition[i + 1], mbs, True)[0])
        out.append(0.0 if best == math.inf else best)
    return out


def table_bound(ctx: SimContext, table, partition, memory, M: int, opts: PlanOptions, sync_s: float,
                links: list[float]) -> Key:
    """Lower bound on any plan of a family from its option table alone (before its kinds are built).

    Per stage i, with c_i the fastest transfer over boundary i (`boundary_floors`) and k_i = 2·c_{i-1}
    + 2·c_i the transfers a stage makes per micro-batch: t_i = the fastest option's seconds + k_i,
    w_i = the least GPU-seconds of an option (its seconds + k_i), u_i = the least $·s of one (at its
    GPU type's lowest price), g_i = the fewest GPUs of an option. (a) A pipeline's first micro-batch
    takes at least fill = Σ (fastest option) + 2·Σ c_i, each further one max t_i, a micro-batch at
    least Σ w_i GPU-seconds, and a pipeline's GPUs idle at least min g_i·(P - 1)·Σ (fastest option)
    GPU-seconds besides; the N GPUs hold at most N // Σ g_i pipelines (`_pipelines_floor`). (b) A
    pipeline whose period is θ takes at least G(θ) GPUs, the fewest with which every stage has an
    option no slower than θ - k_i, and finishes at most 1 + (τ - fill)/θ micro-batches by τ: N GPUs
    at most N·max_θ (1 + (τ - fill)/θ)/G(θ). The larger of the two; sync as `node_bound` (`sync_s`,
    for two or more pipelines); the optimizer step at least max_i of stage i's smallest (under ZeRO at
    one replica per micro-batch). Cost: M·Σ u_i."""
    N = ctx.cluster.total_gpus()
    price = {g: min(pool_price(ctx, (z, g)) for z in ctx.cluster.zones if ctx.cluster.available(z, g))
             for g in ctx.cluster.gpu_types()}
    P = len(table)
    k = [2 * ((links[i - 1] if i > 0 else 0.0) + (links[i] if i < P - 1 else 0.0)) for i in range(P)]
    compute = [min(o.time_s for o in stage) for stage in table]
    t = [x + y for x, y in zip(compute, k)]
    w = sum(min(o.gpus * (o.time_s + k[i]) for o in stage) for i, stage in enumerate(table))
    u = sum(min(price[o.gpu] * o.gpus * o.time_s for o in stage) for stage in table)
    g = [min(o.gpus for o in stage) for stage in table]
    d_max = N // sum(g)
    if d_max < 1:
        return (math.inf, math.inf)
    opt = max(min(optimizer_s(ctx, Slot(zone="", gpu=o.gpu, tp=o.tp), a, e, time_options(mem, M)) for o in stage)
              for stage, (a, e), mem in zip(table, partition, memory))
    fill = sum(compute) + 2 * sum(links)
    T = _pipelines_floor(M, N, d_max, fill, max(t), w, min(g) * (P - 1) * sum(compute), sync_s)
    periods = []  # (θ, G(θ))
    for theta in sorted({o.time_s + k[i] for i, stage in enumerate(table) for o in stage}):
        if theta >= max(t):
            periods.append((theta, sum(min(o.gpus for o in stage if o.time_s + k[i] <= theta)
                                       for i, stage in enumerate(table))))
    thetas = np.array([p for p, _ in periods])
    gpus = np.array([q for _, q in periods], dtype=float)

    def capacity(tau: float) -> float:
        if tau < fill:
            return 0.0
        return float(N * ((1 + np.floor((tau - fill) / thetas + 1e-9)) / gpus).max())

    lo = smallest_time(lambda tau: capacity(tau) >= M, fill, fill + M * max(t))
    T = max(T, min(fill + (M - 1) * max(t), lo + sync_s if d_max >= 2 else math.inf))
    return _key(opts, T + opt, M * u / HOUR_S)
