"""The planner's search (phase 2 of 3): best-first branch and bound whose work grows polynomially in
the number of GPU types, zones and regions.

Tree. Nodes (P, micro-batch) -> families (one per layer partition, `space.candidate_partitions`,
and memory candidate of it, `space.memory_candidates`: the stages' recomputation, ZeRO and SP) -> per
scope (each region, and all regions together: `geo.scopes`) a count vector over the family's
pipeline kinds (`kinds`). Nodes and families are taken in order of their keys; the search stops when
the next key cannot beat the best plan found.

Per family:
- exact mode (clusters of at most EXACT_MAX_GPUS GPUs): every kind (an option and a zone per stage:
  GPU types, TP degrees and zones mixed freely inside a pipeline) and every count vector the GPUs
  allow, when there are at most EXHAUSTIVE_KINDS option-zone sequences and EXHAUSTIVE_COUNTS count
  vectors; keys are valid bounds (`prune.node_bound`, `prune.family_bound`), so the result is the
  optimum of the space under the closed form (`Found.exact`; the brute-force tests check it);
- otherwise (or past those limits): single-zone kinds (`kinds.homogeneous_kinds`, Pareto templates
  per GPU type), memory-mixed kinds where a GPU type cannot hold every stage
  (`kinds.memory_mixed_kinds`), the packing of `pack` per scope (the smallest makespan by
  bisection, and for the throughput objective the same without the (zone, GPU type) pools it
  uses, `pack.fastest_packings`; for the cost objective or under constraints also a grid of
  makespans, each with its most-capacity and its cheapest count vectors, `tradeoff.trade_off`), pipelines
  spanning zones and regions on the GPUs
  left over by the best candidates (`geo.build_spanning`, at the end), and spanning pipelines alone
  where no single zone can hold one; pipelines cut between nodes (`kinds.node_cut_variants`) are
  packed apart and also offered alone in node-filling counts (`_offer_node_groups`).
  Node keys take the larger of the bound and `prune.node_estimate` discounted by a margin
  (`prune.node_keys`), each computed when its node comes up (`prune.NodeKeys`).

A pool more keeps the smaller cluster's candidates by the search's structure: the packings and
cheapest covers see neither the gradient sync nor egress, so a pool more (a zone, or a GPU type in
a zone) can turn them into plans that score worse; so those without each pool they use are found
and scored too, recursively (`pack.leave_pools_out`), and the ones of a cluster with a pool more
without that pool are the smaller cluster's. A cluster with a pool more thus has among its
candidates every cheapest cover of the cluster without it (`tradeoff.cheapest_variants`, within
`tradeoff.VARIANTS_MAX` greedy runs), and its fastest packing where the new pool is unused or among the first
`pack.FASTEST_RUNS` - 1 pools that `pack.drop_order` leaves out (pools in the zones holding the
fewest of the packing's pipelines first; the budget leaves out one pool at a time, the smaller
cluster's packings without pools are kept within it only). In exact mode, where a family's kinds or
count vectors outgrow EXHAUSTIVE_KINDS or EXHAUSTIVE_COUNTS, every kind and count vector of the
cluster without each pool is built and scored where those are few enough
(`_and_kinds_without_a_pool`, `_offer_all_without_a_pool`): a cluster without that pool would score
them all.

The work per family is polynomial: kinds are O(zones x GPU types x templates), a packing step is
linear in the kinds of each pool (squared), and the number of bisection steps is fixed
(`pack.BISECTION_STEPS`), as are the packings without pools (`pack.FASTEST_RUNS`); nothing loops
over the global batch.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from sailor.core.units import HOUR_S
from sailor.plan.placement import node_blocks
from sailor.planner import paper
from sailor.planner.finalists import Finalists, Found, pareto_add, plan_from_kinds, plan_signature
from sailor.planner.geo import Scope, build_spanning, free_pools, scopes, spanning_thetas
from sailor.planner.kinds import (Kind, Pool, Table, all_kinds, block_key, forget_kinds, homogeneous_kinds,
                                  kind_optimizer_s, memory_mixed_kinds, memory_number, option_table, pool_class)
from sailor.planner.options import EXACT_MAX_GPUS, Constraints, Objective, PlanOptions, SearchSpace, objective_key
from sailor.planner.pack import Packer, count_vectors, fastest_packings, node_unit, packing_key
from sailor.planner.prune import boundary_floors, family_bound, node_keys, table_bound
from sailor.planner.score import Scorer
from sailor.planner.tradeoff import trade_off
from sailor.planner.space import Memory, candidate_partitions, mbs_candidates, memory_candidates, zero3_needed
from sailor.simulator import SimContext, place, stage_sync, time_options
from sailor.simulator.collectives import group_members

EXHAUSTIVE_KINDS = 512
EXHAUSTIVE_COUNTS = 4096
SPANNING_MAX = 64       # spanning pipelines built per target θ
REFINE_TOP = 4          # best candidates that get spanning pipelines on the GPUs they leave
NODE_GROUP_STEPS = 3    # pipelines cut between nodes offered alone at u, 2u, 4u (`_offer_node_groups`)


@dataclass
class Family:
    """(P, micro-batch, partition, stage memory options) with its option table and kinds;
    `exhaustive` when the kinds are all of them."""

    P: int
    mbs: int
    M: int
    partition: tuple
    memory: Memory
    table: Table
    kinds: list[Kind]
    exhaustive: bool
    key: tuple[float, float] = (0.0, 0.0)
    scopes: list[Scope] = field(default_factory=list)
    packings: dict = field(default_factory=dict)  # `pack.packing_key` -> `pack.fastest_packings` (`_pack_kinds`)


def search(ctx: SimContext, opts: PlanOptions, progress: Callable[[int, int], None] | None = None,
           deadline: float | None = None) -> Found:
    """The best plans of the space (module docstring) for ctx.job on ctx.cluster.

    Args:
        progress: called as progress(done, total) with nodes done (searched or pruned) of all nodes.
        deadline: time.perf_counter() value after which the search stops with what it found.
    """
    exact_mode = ctx.cluster.total_gpus() <= EXACT_MAX_GPUS
    keep = Finalists(opts)
    found = keep.found
    job = ctx.job
    P_max = min(job.model.num_layers, opts.max_stages)
    total = P_max * len(mbs_candidates(job.global_batch_size, opts.max_mbs))
    if progress:
        progress(0, total)
    nodes = node_keys(ctx, opts, exact_mode)
    # The published planner's space first (it is small): its best plan is the first incumbent and a
    # finalist of phase 3 whatever its rank, so it can never beat the result in the simulator.
    # (its best plan only: top_k 0, rescore 1)
    seed = paper.search(ctx, dataclasses.replace(opts, search=SearchSpace.PAPER, top_k=0, rescore=1), None, deadline,
                        nodes)
    if seed.finalists:
        keep.seed(seed.finalists[0][0])
    found.exact = exact_mode
    free = free_pools(ctx)
    all_scopes = scopes(ctx)
    if exact_mode:
        all_scopes = all_scopes[-1:]  # the widest scope: its count vectors include every region's
    # each node held at its bound until it comes up, then at its key (`prune.NodeKeys`): the same order
    heap = [(bound, 0, n, (P, mbs, False)) for n, (bound, P, mbs) in enumerate(nodes.bounds)]
    done = 0
    assert len(heap) == total
    heapq.heapify(heap)
    counter = len(heap)
    while heap:
        if deadline is not None and time.perf_counter() > deadline:
            found.timed_out = True
            found.exact = False
            break
        key, level, tie, item = heapq.heappop(heap)
        if key[0] >= keep.best0() or key[0] == math.inf:
            break  # ordered by key: nothing left can win (or fit)
        if level == 0 and not item[2]:  # a node at its bound: to its key
            heapq.heappush(heap, (nodes.key(key, *item[:2]), 0, tie, (*item[:2], True)))
            continue
        counter += 1
        if level == 0:  # a node: its families, keyed by their option tables' bounds
            for fam in _families(ctx, opts, *item[:2], free, all_scopes, nodes.sync[item[0]], exact_mode):
                heapq.heappush(heap, (max(key, fam.key), 1, counter, fam))
                counter += 1
            done += 1
            if progress:
                progress(done, total)
        elif level == 1:  # a family: build its kinds, key it by their bound
            _build_kinds(ctx, opts, item, free, exact_mode)
            found.any_family |= bool(item.kinds) or not exact_mode
            if not item.exhaustive:
                found.exact = False
            heapq.heappush(heap, (max(key, item.key), 2, counter, item))
        else:
            found.points += 1
            if not _search_family(ctx, opts, item, free, keep, exact_mode):
                found.exact = False
            forget_kinds(ctx, item.partition, item.mbs, item.memory)
    _refine_with_spanning(ctx, keep, free)
    if progress:
        progress(total, total)
    out = keep.finish(lambda cand, point: plan_from_kinds(ctx, cand, *point))
    if seed.finalists:
        if plan_signature(seed.finalists[0][3]) not in {plan_signature(v[3]) for v in out.finalists}:
            out.finalists = sorted(out.finalists + seed.finalists[:1], key=lambda v: v[0])[: keep.keep]
        out.pinned = [seed.finalists[0][3]]
        for p in seed.front:
            pareto_add(out.front, p)
        out.candidates += seed.candidates
    out.least_hourly = min(filter(None, (out.least_hourly, seed.least_hourly)), default=None)  # the lower $/hour
    if seed.near:  # the published space's near misses compete with the full search's
        out.near = sorted(out.near + seed.near, key=lambda v: objective_key(opts.objective)(v[1], v[2]))[: opts.rescore]
    out.any_family |= seed.any_family
    return out


def _families(ctx: SimContext, opts: PlanOptions, P: int, mbs: int, free: dict[Pool, int], all_scopes: list[Scope],
              sync_s: float, exact_mode: bool):
    """Families of node (P, mbs): one per candidate partition and memory candidate (the lightest
    `opts.memory_per_partition`) whose every stage has an option, keyed by `prune.table_bound`
    (kinds are built when the family comes up)."""
    M = ctx.job.global_batch_size // mbs
    gpus = ctx.cluster.gpu_types()
    zero_max = 3 if zero3_needed(ctx, opts.max_stages) else 2
    for partition in candidate_partitions(ctx, P, mbs, gpus):
        for memory in memory_candidates(ctx, gpus, partition, mbs, M, zero_max, opts.memory_per_partition):
            table = option_table(ctx, gpus, partition, mbs, M, memory)
            if any(not stage for stage in table):
                continue
            fam = Family(P, mbs, M, partition, memory, table, [], False, scopes=all_scopes)
            links = boundary_floors(ctx, table, partition, mbs, free, pairs=exact_mode)
            fam.key = table_bound(ctx, table, partition, memory, M, opts, sync_s, links)
            yield fam


def _build_kinds(ctx: SimContext, opts: PlanOptions, fam: Family, free: dict[Pool, int], exact_mode: bool) -> None:
    """Fill in the family's kinds (every one in exact mode when few, else the heuristic ones) and
    its key (`prune.family_bound`; the table's when only spanning pipelines can be built)."""
    args = (ctx, fam.table, free, fam.partition, fam.mbs, fam.memory)
    kinds = all_kinds(*args, EXHAUSTIVE_KINDS) if exact_mode else None
    fam.exhaustive = kinds is not None
    if kinds is None:
        kinds = homogeneous_kinds(*args) + memory_mixed_kinds(*args)
        if exact_mode:
            kinds = _and_kinds_without_a_pool(ctx, fam, free, kinds)
    fam.kinds = kinds
    if kinds:
        fam.key = max(fam.key, family_bound(ctx, kinds, free, fam.partition, fam.M, opts, pairs=exact_mode))


def _and_kinds_without_a_pool(ctx: SimContext, fam: Family, free: dict[Pool, int], kinds: list[Kind]) -> list[Kind]:
    """`kinds` and, where the family's option-zone sequences are too many to build every kind (more
    than EXHAUSTIVE_KINDS), every kind of the cluster without each (zone, GPU type) pool wherever
    those are few enough (`kinds.all_kinds`), each kind once: a cluster without that pool builds
    them all, so one with it has them too (a newcomer's pair: OPT-350M at batch 64 on 4 A100-40 in
    us-central1-a and 4 V100-16 in -b, `--objective cost --min-throughput 0.25`, found
    $0.04891/iteration with a 3-stage pipeline over both zones; with 4 V100-16 more in -c its
    3-stage families had too many sequences, only single-zone kinds were built, $0.06324).
    `_search_family` then scores their count vectors without each pool (`_offer_all_without_a_pool`)."""
    have = {(k.zones, k.options, k.cuts) for k in kinds}
    out = list(kinds)
    pools = [p for p, n in free.items() if n]
    for pool in pools if len(pools) > 1 else ():
        sub = {p: n for p, n in free.items() if p != pool}
        for k in all_kinds(ctx, fam.table, sub, fam.partition, fam.mbs, fam.memory, EXHAUSTIVE_KINDS) or ():
            if (k.zones, k.options, k.cuts) not in have:
                have.add((k.zones, k.options, k.cuts))
                out.append(k)
    return out


def _search_family(ctx: SimContext, opts: PlanOptions, fam: Family, free: dict[Pool, int], keep: Finalists,
                   exact_mode: bool) -> bool:
    """Offer the family's candidates to `keep`; True when the family was searched exhaustively."""
    point = (fam.partition, fam.mbs, fam.memory)
    exhaustive = fam.exhaustive
    alone: set[int] = set()  # ids of the cut kinds offered alone so far (`_pack`)
    region = ctx.cluster.prov.region
    every = [(k, tuple(p for p, _ in k.use)) for k in fam.kinds]  # each kind with its pools
    by_region: dict[str | None, list[tuple[Kind, tuple]]] = {}  # the kinds of each region, in order
    for k, pools in every:
        regions = {region(z) for z in k.zones}
        by_region.setdefault(regions.pop() if len(regions) == 1 else None, []).append((k, pools))
    for scope in fam.scopes:
        sfree = scope.free(free)
        regions = {region(z) for z, _ in scope.pools}
        # a kind outside the scope's one region has a pool outside the scope: only that region's are tried
        tried = by_region.get(regions.pop(), []) if len(regions) == 1 else every
        kinds = [k for k, pools in tried if scope.pools.issuperset(pools)]
        if exhaustive:
            vectors = count_vectors(kinds, sfree, EXHAUSTIVE_COUNTS)
            if vectors is not None:
                _offer_all(opts, Scorer(ctx, fam.partition, fam.mbs, kinds, fam.M), vectors, keep, point)
                continue
            exhaustive = False
        if exact_mode:
            _offer_all_without_a_pool(ctx, opts, fam, kinds, sfree, keep, point)
        _pack(ctx, opts, fam, kinds, sfree, keep, point, alone)
    return exhaustive


def _offer_all_without_a_pool(ctx: SimContext, opts: PlanOptions, fam: Family, kinds: list[Kind],
                              free: dict[Pool, int], keep: Finalists, point: tuple) -> None:
    """Where a family's count vectors are too many to score them all (more than EXHAUSTIVE_COUNTS),
    those of its kinds outside each (zone, GPU type) pool they use, wherever they are few enough
    (`_offer_all`): a cluster without that pool has those kinds (every kind, `kinds.all_kinds`) and
    may score every vector of them, so a cluster with one pool more does too (a newcomer's pair:
    OPT-350M at batch 256 on 8 A100-40 + 8 V100-16, `--objective cost --min-throughput 0.14`, gave
    $0.1621/iteration; with 8 V100-16 more in a third zone the vectors outgrew the limit and the
    packing found $0.1628)."""
    pools = sorted({p for k in kinds for p, _ in k.use})
    for pool in pools if len(pools) > 1 else ():
        sub = [k for k in kinds if all(p != pool for p, _ in k.use)]
        vectors = count_vectors(sub, free, EXHAUSTIVE_COUNTS)
        if vectors is not None:
            _offer_all(opts, Scorer(ctx, fam.partition, fam.mbs, sub, fam.M), vectors, keep, point)


def _pack(ctx: SimContext, opts: PlanOptions, fam: Family, kinds: list[Kind], free: dict[Pool, int],
          keep: Finalists, point: tuple, alone: set[int]) -> None:
    """The packing candidates of one scope (engine docstring), each scored and offered. The packing
    maximises micro-batches per makespan and does not see the gradient sync, which is slower the
    finer the TP sharding (each rank all-reduces params/t) and crosses nodes unless the pipelines are
    cut between them: so it also runs on the kinds whose every stage has at least TP t, for each t,
    and on the cut kinds apart (`_placement_groups`). Cut kinds are offered alone
    (`_offer_node_groups`) in the first scope that holds them, their ids added to `alone`: a cut
    kind sits in one pool, which every scope holding it offers in full, so a later scope would score
    the same candidates again."""
    offered = False
    for subset in _placement_groups(kinds):
        offered |= _pack_kinds(ctx, opts, fam, subset, free, keep, point)
    cut = [k for k in kinds if any(k.cuts) and id(k) not in alone]
    alone.update(map(id, cut))
    _offer_node_groups(ctx, fam, cut, free, keep, point)
    if not offered:  # no single-zone pipeline: pipelines spanning zones and regions only
        for theta in spanning_thetas(fam.table):
            pipes = build_spanning(ctx, fam.table, free, fam.partition, fam.mbs, fam.memory, theta,
                                   min(SPANNING_MAX, fam.M))
            for D in sorted({1, len(pipes)} | {2**j for j in range(7) if 2**j < len(pipes)}):
                if D <= len(pipes):
                    _offer_pipelines(ctx, fam, pipes[:D], keep, point)


def _placement_groups(kinds: list[Kind]) -> list[list[Kind]]:
    """The kind lists the packing runs on: the kinds not cut between nodes and, apart, those cut
    (`kinds.node_cut_variants`), each by TP floor (`_tp_floors`). A cut pipeline is never faster
    than its uncut twin (its activations cross nodes), so packed together the cut ones would never be
    taken; what they win, a gradient sync inside nodes, shows only in the score."""
    whole = [k for k in kinds if not any(k.cuts)]
    cut = [k for k in kinds if any(k.cuts)]
    return _tp_floors(whole) + (_tp_floors(cut) if cut else [])


def _offer_node_groups(ctx: SimContext, fam: Family, kinds: list[Kind], free: dict[Pool, int], keep: Finalists,
                       point: tuple) -> None:
    """Pipelines cut between nodes pay off where their stages' replicas share nodes, which the
    packing (the fastest makespan, so as many pipelines as the batch takes) does not aim for: offer
    each cut kind alone at D = u, 2u, 4u pipelines (NODE_GROUP_STEPS; at most as many as fit and as
    micro-batches), u the pipelines whose segments fill one node each (the fewest node size //
    segment GPUs over the kind's blocks, `plan.placement.node_blocks`): beyond, a stage's replicas
    span several nodes however the pipelines are cut, and the packing of the cut kinds has the most
    that fit."""
    for kind in kinds:
        scorer = None  # built for the first D whose lower bound `_hopeless_alone` does not rule out
        unit = _node_group_unit(ctx, kind.slots)
        most = min(kind.fits(free), fam.M)
        for D in (unit << j for j in range(NODE_GROUP_STEPS) if unit << j <= most):
            if _hopeless_alone(ctx, keep, fam, kind, D):
                continue
            scorer = scorer or Scorer(ctx, fam.partition, fam.mbs, [kind], fam.M)  # one kind: counts of one entry
            keep.offer_counts(scorer, np.array([D]), point)


def _node_group_unit(ctx: SimContext, slots: tuple) -> int:
    """`_offer_node_groups`' u for a cut kind's slots: the fewest node size // segment GPUs over its
    blocks (`plan.placement.node_blocks`), at least 1. Memoised by what the blocks read of the slots
    (each one's GPU type, TP, cut, and whether it is in the previous one's pool), so that families
    and pools share it (`kinds.block_key`)."""
    key = ("node-group unit", block_key(ctx, slots))
    if key not in ctx.memo:
        blocks = node_blocks([(s.zone, s.gpu, s.tp) for s in slots], ctx.cluster.node_size, [s.node_cut for s in slots])
        widths = [sum(s.tp for s, b in zip(slots, blocks) if b == j) for j in range(blocks[-1] + 1)]
        ctx.memo[key] = max(1, min(ctx.cluster.node_size(slots[0].gpu) // w for w in widths))
    return ctx.memo[key]


def _hopeless_alone(ctx: SimContext, keep: Finalists, fam: Family, kind: Kind, D: int) -> bool:
    """True when `Scorer.score` of D pipelines of this one kind would return None for too few
    replicas or by `keep.hopeless`, told without building the scorer (most node groups end so).
    Without ZeRO-3 the kind's curve is the same at every D (only ZeRO-3's weight gathers depend on
    D, `simulator.terms.zero_gather_s`), so the makespan is at least time(ceil(M / D)) (some pipeline
    runs that many micro-batches), and with the optimizer step at D (`kinds.kind_optimizer_s`, what
    `Kind.at` puts there) the time and cost without the sync are those of `score`, by the same
    expressions; `hopeless` is monotone in both. A ZeRO-3 kind is left to the scorer."""
    M = fam.M
    if D < kind.min_replicas:
        return True
    if D > M or any(m.zero >= 3 for m in kind.memory):
        return False
    opt = kind.optimizer_s
    if kind.depends_on_replicas and kind.replicas != D:
        opt = kind_optimizer_s(ctx, kind.slots, fam.partition, [time_options(m, D) for m in kind.memory])
    lb = kind.time_s(-(-M // D)) + opt
    return keep.hopeless(lb, kind.usd_per_hour * D * lb / HOUR_S + kind.egress_usd_per_mb * M)


def _tp_floors(kinds: list[Kind]) -> list[list[Kind]]:
    """The kinds, and for each TP degree t above the smallest, those whose stages all have TP >= t."""
    floors = sorted({min(o.tp for o in k.options) for k in kinds})
    return [[k for k in kinds if min(o.tp for o in k.options) >= t] for t in floors]


def _pack_kinds(ctx: SimContext, opts: PlanOptions, fam: Family, kinds: list[Kind], free: dict[Pool, int],
                keep: Finalists, point: tuple) -> bool:
    """Packings of `kinds`: the fastest for each base of multi-pool kinds and, for the throughput
    objective, those without the pools they use while they could beat the best plan (`_wanted`,
    `pack.fastest_packings`), each also rounded up to whole nodes (`pack.round_to_nodes`); for the
    cost objective or under constraints also the grid of makespans from the fastest. True when
    some count vector was offered."""
    if not kinds:
        return False
    offered = False
    costed = opts.objective is Objective.COST or opts.constraints != Constraints()

    memory_id = memory_number(ctx, fam.memory)
    syncs: dict[tuple[int, int], float] = {}

    def sync(k: int, D: int) -> float:  # D pipelines of kind k, placed as the launcher places them
        # (ZeRO-2/3 reduce-scatter once per round: the largest share of M split evenly over D).
        # Memoised in the context by what it reads: for a kind in one pool its pool class and cuts
        # (`kinds.pool_class`: the sync's rings run over the routes of one zone, and the placement
        # reads the GPUs per node only), else its slots; the packer asks for most kinds at every τ
        if (k, D) not in syncs:
            kind = kinds[k]
            where = pool_class(ctx, kind.zones, kind.options)
            key = ("kind-sync", (where, kind.cuts) if where else kind.slots, D, fam.partition, memory_id, fam.mbs)
            if key not in ctx.memo:
                placed = place([list(kind.slots)] * D, ctx.cluster)
                ctx.memo[key] = max(stage_sync(ctx, group_members([p[i] for p in placed]), ((a, e),),
                                               time_options(fam.memory[i], 2), fam.mbs, rounds=-(-fam.M // D))[0]
                                    for i, (a, e) in enumerate(fam.partition))
            syncs[(k, D)] = ctx.memo[key]
        return syncs[(k, D)]

    scorer = Scorer(ctx, fam.partition, fam.mbs, kinds, fam.M)
    units = [node_unit(k, ctx.cluster.node_size) for k in kinds]
    wanted = _wanted(opts, kinds, keep)
    if costed:
        packer = Packer(kinds, free, fam.M, sync)
        packings = fastest_packings(packer, units, wanted)
    else:  # the packings read no zone (`pack.packing_key`): scopes alike (regions whose zones offer
        # the same GPUs, with kinds of the same curves) share them within the family (a later
        # scope's `wanted` would drop no more: the best plan only gets better)
        key = packing_key(kinds, free, fam.M)
        if key not in fam.packings:
            fam.packings[key] = fastest_packings(Packer(kinds, free, fam.M), units, wanted)
        packings = fam.packings[key]
    for packing in packings:
        if packing.dropped and not wanted(packing.tau):
            continue
        offered |= keep.offer_counts(scorer, packing.counts, point, packing.tau * (1 - 1e-9))
        if (packing.whole != packing.counts).any():  # the same packing on whole nodes (`pack.round_to_nodes`)
            keep.offer_counts(scorer, packing.whole, point)
        if costed and not packing.dropped:  # the cheapest covers leave pools out on their own
            trade_off(opts, packer, scorer, packing.base, packing.tau, keep, point)
    return offered


def _wanted(opts: PlanOptions, kinds: list[Kind], keep: Finalists) -> Callable[[float], bool]:
    """`pack.fastest_packings`' `expand`: whether a count vector of makespan τ or more over `kinds`
    could still beat the best plan found (as the search's keys do, `search`); such vectors are not
    scored either. Its iteration time is at least τ (the packing's kinds are lower bounds over the
    pipelines' count, `kinds.Kind.replicas`) plus the fastest optimizer step. Under the cost
    objective none is wanted: the cheapest covers leave pools out there (`tradeoff.cheapest_variants`)."""
    if opts.objective is not Objective.THROUGHPUT:
        return lambda tau: False
    step = min(k.optimizer_s for k in kinds)
    return lambda tau: tau * (1 - 1e-9) + step < keep.best0()


def _offer_all(opts: PlanOptions, scorer: Scorer, vectors: list[tuple[int, ...]], keep: Finalists,
               point: tuple) -> None:
    """Score every count vector, in order of a lower bound on its objective, until the bound cannot
    beat the best plan found: the makespan is at least every used kind's fill and at least τ0, where
    the pipelines' continuous capacity Σ_k n_k·(2 + (τ0 - B_k)/t_k) (at least their true capacity
    from the largest fill on) reaches M; sync is at least 0; the optimizer step is the used kinds'
    slowest. Cost: the GPUs' rate over that time."""
    kinds = scorer.kinds
    if not vectors:
        return
    V = np.array(vectors, dtype=float)                        # (vectors, kinds)
    two = np.array([k.two_s for k in kinds])
    period = np.array([k.period_s for k in kinds])
    used = V > 0
    fill = np.where(used, np.array([k.fill_s for k in kinds]), 0.0).max(axis=1)
    tau0 = (scorer.M - V @ (2.0 - two / period)) / (V @ (1.0 / period))
    opt = np.where(used, np.array([k.optimizer_s for k in kinds]), 0.0).max(axis=1)
    time_lb = np.maximum(fill, tau0) + opt
    cost_lb = (V @ np.array([k.usd_per_hour for k in kinds])) * time_lb / HOUR_S
    lb = time_lb if opts.objective is Objective.THROUGHPUT else cost_lb
    for j in np.argsort(lb, kind="stable"):
        if lb[j] >= keep.best0():
            break
        keep.offer(scorer.score(vectors[j], keep.hopeless), point)


def _offer_pipelines(ctx: SimContext, fam: Family, pipes: list[Kind], keep: Finalists, point: tuple) -> None:
    """Score a list of pipelines (kinds repeated as often as they run)."""
    distinct = sorted(set(pipes), key=pipes.index)
    counts = tuple(pipes.count(k) for k in distinct)
    keep.offer(Scorer(ctx, fam.partition, fam.mbs, distinct, fam.M).score(counts), point)


def _refine_with_spanning(ctx: SimContext, keep: Finalists, free: dict[Pool, int]) -> None:
    """The best REFINE_TOP candidates plus pipelines spanning zones on the GPUs they leave in the
    regions they use (`geo.build_spanning`, stages no slower than the candidate's slowest option),
    when any fit: packing takes whole single-zone pipelines, and the rest of each pool is left over."""
    for cand, (partition, mbs, memory) in keep.top(REFINE_TOP):
        kinds = [k for k, n in zip(cand.scorer.kinds, cand.counts) if n]
        counts = [n for n in cand.counts if n]
        regions = {ctx.cluster.prov.region(z) for k in kinds for z in k.zones}
        left = {p: n for p, n in free.items() if ctx.cluster.prov.region(p[0]) in regions}
        for k, n in zip(kinds, counts):
            for p, g in k.use:
                left[p] -= g * n
        M = ctx.job.global_batch_size // mbs
        room = M - sum(counts)
        if room < 1 or not any(left.values()):
            continue
        table = option_table(ctx, ctx.cluster.gpu_types(), partition, mbs, M, memory)
        theta = max(o.time_s for k in kinds for o in k.options)
        extra = build_spanning(ctx, table, left, partition, mbs, memory, theta, min(SPANNING_MAX, room))
        if extra:
            pipes = [k for k, n in zip(kinds, counts) for _ in range(n)] + extra
            distinct = list(dict.fromkeys(pipes))
            keep.offer(Scorer(ctx, partition, mbs, distinct, M).score(tuple(pipes.count(k) for k in distinct)),
                       (partition, mbs, memory))
