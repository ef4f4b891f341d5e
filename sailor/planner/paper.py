"""The published Sailor planner's search space, searched (`--search paper`), and the homogeneous one
(`--search homogeneous`).

The published space (DESIGN.md §5), with the stages' memory options of every search space (the
lightest candidates of `space.memory_candidates`, for each group of pools below on its own count of
GPUs): P stages over the even layer split; one TP degree per GPU type, by its fixed rule (the
smallest degree at which the type holds every stage it can hold in memory, H1/H2); D data-parallel
replicas of every stage, each stage's replicas on any GPU types and zones of one region (H5: data
parallelism within a region; H6: zones pooled; for the cost objective or under constraints each zone
is also searched on its own, since the pooled search fills the zones in a fixed order and the
cheapest plans often sit in one zone), as its dynamic program over stages assigns them; pipeline j
is replica j of every stage; every pipeline takes M / D micro-batches (equal batch shares).

With equal shares the slowest replica of any stage sets the pace, so for a straggler bound θ the
question is whether every stage can get D replicas whose stage time is at most θ from the GPUs of
the region: a transportation problem (stages demand D replicas each; a (zone, GPU type) pool supplies
its GPUs // TP replicas to any stage it is fast enough for), decided by a maximum flow. For each
(P, micro-batch, region) and D (H3: from large to small while the score improves, for throughput;
H4: from small to large while it improves, for cost) the smallest feasible θ gives the assignment;
each stage's replicas are listed in the same (zone, GPU type) order, so that pipeline j stays in one
pool wherever the counts allow. Candidates are scored by the same closed form as the full search.

The homogeneous space: one GPU type in one zone, one TP degree on every stage, the even split and
equal shares.
"""

from __future__ import annotations

import math
import time

import numpy as np

from sailor.planner.finalists import Finalists, Found, plan_from_kinds
from sailor.planner.geo import free_pools, scopes
from sailor.planner.kinds import Pool, make_kinds, option_table
from sailor.planner.options import EXACT_MAX_GPUS, Constraints, Objective, PlanOptions, SearchSpace
from sailor.planner.prune import NodeKeys, in_key_order, node_keys
from sailor.planner.score import Candidate, Scorer
from sailor.planner.space import Memory, Option, even_partition, memory_candidates, memory_rank, zero3_needed
from sailor.simulator import SimContext


def search(ctx: SimContext, opts: PlanOptions, progress=None, deadline: float | None = None,
           nodes: NodeKeys | None = None) -> Found:
    """The best plans of the published space (or, with `opts.search` HOMOGENEOUS, of the homogeneous
    one) under the closed form; see the module docstring. (P, micro-batch) nodes are taken in order
    of their keys (`prune.node_keys`, or `nodes` when the caller has them; `prune.in_key_order`) until
    a key cannot beat the best plan found."""
    keep = Finalists(opts)
    keep.found.exact = False
    job = ctx.job
    L = job.model.num_layers
    if nodes is None:
        nodes = node_keys(ctx, opts, ctx.cluster.total_gpus() <= EXACT_MAX_GPUS)
    homogeneous = opts.search is SearchSpace.HOMOGENEOUS
    gpus = ctx.cluster.gpu_types()
    zero_max = 3 if zero3_needed(ctx, opts.max_stages) else 2
    free = free_pools(ctx)
    if homogeneous:
        groups = [{p: n} for p, n in sorted(free.items())]
    else:  # each region (zones pooled); for the cost trade-off each zone of a region on its own too
        groups = [s.free(free) for s in scopes(ctx) if s.name != "all regions"]
        if opts.objective is Objective.COST or opts.constraints != Constraints():
            by_zone: dict[str, dict[Pool, int]] = {}
            for (z, g), n in free.items():
                by_zone.setdefault(z, {})[(z, g)] = n
            groups += [by_zone[z] for z in sorted(by_zone) if by_zone[z] not in groups]
    held_by = [sum(pools.values()) for pools in groups]  # GPUs of each group
    for done, (key, P, mbs) in enumerate(in_key_order(nodes), 1):
        if deadline is not None and time.perf_counter() > deadline:
            keep.found.timed_out = True
            break
        if key[0] >= keep.best0() or key[0] == math.inf:
            break
        partition = even_partition(L, P)
        M = job.global_batch_size // mbs
        # each group's own candidates: a group smaller than the cluster holds fewer replicas, and an
        # option that needs more of them for ZeRO to shard over would take the place of one it can use
        by_group: dict[int, list[Memory]] = {}
        for held in held_by:
            if held not in by_group:
                by_group[held] = memory_candidates(ctx, gpus, partition, mbs, M, zero_max, opts.memory_per_partition,
                                                   gpus_offered=held)
        for memory in sorted({m for ms in by_group.values() for m in ms}, key=lambda v: (memory_rank(v), str(v))):
            table = option_table(ctx, gpus, partition, mbs, M, memory)
            for tps in _tp_rules(table, every=homogeneous):
                for pools, held in zip(groups, held_by):
                    if memory not in by_group[held] or not any(gpu in tps for _, gpu in pools):
                        continue
                    keep.found.any_family = True
                    keep.found.points += 1
                    _scan(ctx, opts, keep, partition, mbs, M, memory, table, tps, pools)
        if progress:
            progress(done, len(nodes.bounds))
    if progress:
        progress(len(nodes.bounds), len(nodes.bounds))
    return keep.finish(lambda cand, point: plan_from_kinds(ctx, cand, *point))


def _tp_rules(table, every: bool) -> list[dict[str, int]]:
    """TP degree per GPU type: the smallest that fits every stage the type can hold at all (the
    published rule, H2; the stages it cannot hold go to other types), or, with `every`, one dict per
    degree that fits every stage of some type (the homogeneous space tries each uniform degree)."""
    by_gpu: dict[str, set[int]] = {}
    for g in {o.gpu for stage in table for o in stage}:
        held = [{o.tp for o in stage if o.gpu == g} for stage in table]
        if every and not all(held):
            continue
        fits = set.intersection(*(h for h in held if h))
        if fits:
            by_gpu[g] = fits
    if not every:
        return [{g: min(t) for g, t in by_gpu.items()}] if by_gpu else []
    return [{g: t} for g, ts in sorted(by_gpu.items()) for t in sorted(ts)]


def _scan(ctx: SimContext, opts: PlanOptions, keep: Finalists, partition, mbs: int, M: int, memory: Memory, table,
          tps: dict[str, int], pools: dict[Pool, int]) -> None:
    """D over the divisors of M, from large to small for throughput (small to large for cost), while
    the score improves (H3/H4); options whose memory needs more replicas (ZeRO) sit out smaller D."""
    opt_of = {(i, o.gpu): o for i, stage in enumerate(table) for o in stage if tps.get(o.gpu) == o.tp}
    usable = sorted(p for p in pools if p[1] in tps and pools[p] >= tps[p[1]])
    replicas = {p: pools[p] // tps[p[1]] for p in usable}
    P = len(partition)
    D_max = min(M, sum(replicas.values()) // P)
    divisors = [d for d in range(1, D_max + 1) if M % d == 0]
    if opts.objective is Objective.THROUGHPUT:
        divisors.reverse()
    best = None
    for D in divisors:
        fit = {k: o for k, o in opt_of.items() if o.min_replicas <= D}
        assignment = _assign(P, D, usable, replicas, fit)
        if assignment is None:
            continue
        cand = _score(ctx, partition, mbs, M, memory, assignment, fit)
        k = keep.offer(cand, (partition, mbs, memory))
        if k is None or best is None or k < best:
            best = k if k is not None else best
            continue
        break  # the score stopped improving


def _assign(P: int, D: int, pools: list[Pool], replicas: dict[Pool, int],
            opt_of: dict[tuple[int, str], Option]) -> list[list[Pool]] | None:
    """Per stage, D pools (one per replica) under the smallest straggler bound θ that admits them:
    bisection over the distinct stage times (`_feasible` decides each step), then a maximum flow from
    stages (D each) through (stage, pool) edges of time <= θ to pools (their replicas) gives the
    assignment. None if no θ does."""
    times = {(i, p): opt_of[(i, p[1])].time_s for i in range(P) for p in pools if (i, p[1]) in opt_of}
    thetas = sorted(set(times.values()))
    lo, hi, found = 0, len(thetas) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if _feasible(P, D, pools, replicas, times, thetas[mid]):
            found, hi = thetas[mid], mid - 1
        else:
            lo = mid + 1
    if found is None:
        return None
    flow = _flow(P, D, pools, replicas, times, found)
    return [[p for j, p in enumerate(pools) for _ in range(int(flow[i, j]))] for i in range(P)]


def _feasible(P: int, D: int, pools: list[Pool], replicas: dict[Pool, int], times: dict, theta: float) -> bool:
    """Hall's condition for the transportation problem: every set of stages demands D each, at most
    what the pools eligible for any of them supply. Stages with the same eligible pools are one class,
    so only the unions of classes (few) are checked."""
    classes: dict[frozenset, int] = {}
    for i in range(P):
        eligible = frozenset(p for p in pools if times.get((i, p), np.inf) <= theta)
        classes[eligible] = classes.get(eligible, 0) + 1
    items = list(classes.items())
    if len(items) > 12:  # too many classes to enumerate their unions: ask the flow
        return _flow(P, D, pools, replicas, times, theta) is not None
    for mask in range(1, 1 << len(items)):
        chosen = [items[k] for k in range(len(items)) if mask >> k & 1]
        union = frozenset().union(*(e for e, _ in chosen))
        if D * sum(n for _, n in chosen) > sum(replicas[p] for p in union):
            return False
    return True


def _flow(P: int, D: int, pools: list[Pool], replicas: dict[Pool, int], times: dict, theta: float) -> np.ndarray | None:
    """Replicas per (stage, pool), array (P, pools), of a maximum flow meeting every stage's demand D,
    or None when the pools cannot."""
    n = 2 + P + len(pools)  # source 0, stages 1..P, pools P+1.., sink n-1
    cap = np.zeros((n, n), dtype=np.int64)
    cap[0, 1:P + 1] = D
    for j, p in enumerate(pools):
        cap[P + 1 + j, n - 1] = replicas[p]
        for i in range(P):
            if times.get((i, p), np.inf) <= theta:
                cap[1 + i, P + 1 + j] = D
    flow = max_flow(cap, 0, n - 1)
    if flow[0].sum() < P * D:
        return None
    return flow[1:P + 1, P + 1:P + 1 + len(pools)]


def max_flow(cap: np.ndarray, source: int, sink: int) -> np.ndarray:
    """Edmonds-Karp maximum flow on a dense integer capacity matrix (n, n): shortest augmenting paths
    by breadth-first search, each carrying its bottleneck (Edmonds & Karp 1972; O(V·E²) augmentations
    whatever the capacities). Returns the flow matrix (n, n), non-negative, flow[u, v] on edge u->v."""
    n = len(cap)
    flow = np.zeros_like(cap)
    while True:
        parent = [-1] * n
        parent[source] = source
        queue = [source]
        for u in queue:
            if parent[sink] != -1:
                break
            residual = cap[u] - flow[u] + flow[:, u]
            for v in np.nonzero(residual > 0)[0]:
                if parent[v] == -1:
                    parent[v] = u
                    queue.append(int(v))
        if parent[sink] == -1:
            return flow
        path, v = [], sink
        while v != source:
            path.append((parent[v], v))
            v = parent[v]
        push = min(int(cap[u, v] - flow[u, v] + flow[v, u]) for u, v in path)
        for u, v in path:
            back = min(push, int(flow[v, u]))  # cancel reverse flow first
            flow[v, u] -= back
            flow[u, v] += push - back


def _score(ctx: SimContext, partition, mbs: int, M: int, memory: Memory, assignment: list[list[Pool]],
           opt_of: dict[tuple[int, str], Option]) -> Candidate | None:
    """Pipeline j = replica j of every stage; identical pipelines are one kind; equal shares."""
    D = len(assignment[0])
    pipes: dict[tuple[Pool, ...], int] = {}
    for j in range(D):
        key = tuple(stage[j] for stage in assignment)
        pipes[key] = pipes.get(key, 0) + 1
    specs = [(tuple(p[0] for p in key), tuple(opt_of[(i, p[1])] for i, p in enumerate(key))) for key in pipes]
    kinds = make_kinds(ctx, specs, partition, mbs, memory)
    return Scorer(ctx, partition, mbs, kinds, M, equal_shares=True).score(tuple(pipes.values()))
