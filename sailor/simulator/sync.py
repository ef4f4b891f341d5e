"""The simulator's gradient-sync terms: each stage's gradient sync across its data-parallel replicas
(`stage_sync`: the collectives its ZeRO level runs, and under Sailor's runtime only the part its
backward cannot hide, `exposed_sync_s`), the tied embedding's exchange between a pipeline's first
and last stage (`tied_sync`), with the bytes each puts across zones, and the step's two small
all-reduces over every rank of the world (`step_allreduces_s`); shared with the planner so that
both score plans the same way. Per-micro-batch terms are in `terms`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from sailor.model.spec import Collective, Framework
from sailor.plan.comms import step_allreduce_bytes
from sailor.simulator.collectives import (Group, Member, RingEdges, group_members, ring_crossings, ring_egress, ring_key,
                                          tree_allreduce_s)
from sailor.simulator.context import ALL_PARAMS, ParamShare, SimContext, TiedCopies, tied_embeddings
from sailor.simulator.terms import (DEFAULT_TIME, RING_SHARE, Slot, TimeOptions, allreduce_s, collective_rings,
                                   collective_s, group_shape, shape_memo, timed_collective_s)
from sailor.simulator.traffic import Crossing


def _sync_shards(ctx: SimContext, groups: list[Group], chunks: Sequence[tuple[int, int]],
                 share: ParamShare = ALL_PARAMS) -> tuple[int, float]:
    """(t, parameters one replica syncs) of a stage's gradient sync (`stage_sync`): t = the finest
    common sharding's flow count, parameters = t x params(stage, t) (the `share` of them the
    members hold and sync together under expert parallelism, `context.ParamShare`)."""
    t = min(r.tp for r, _ in groups)
    return t, t * sum(ctx.stage_params(t, a, e, share) for a, e in chunks)


def _sync_collectives(ctx: SimContext, params: float, opts: TimeOptions,
                      rounds: int) -> list[tuple[Collective, float, int]]:
    """[(collective, bytes of one replica's tensor, runs per iteration)] of a stage's gradient sync
    over `params` parameters: a collective `TimeOptions.sync` runs once per micro-batch (the ZeRO-2/3
    reduce-scatter) runs `rounds` times (`Plan.step_rounds`: the largest pipeline's micro-batches,
    the rounds the runtime's stage group meets in), every other once. The one place the sync's
    collectives are counted: `stage_sync` times and prices these, `stage_sync_crossings` itemises them."""
    return [(kind, params * ctx.job.state_bytes_per_param[state], rounds if per_microbatch else 1)
            for kind, state, per_microbatch in opts.sync()]


def exposed_sync_s(collective_s: Sequence[float], compute_s: Sequence[float], rounds: int = 1) -> float:
    """Seconds a chain of bucket collectives runs past the end of the backward that issues them, both
    in the order the backward finishes its layers: bucket k is issued once its layer's backward is
    done (after compute_s[0..k]) and starts when the collective before it has ended (one link, one
    communicator): E_k = max(R_k, E_(k-1)) + collective_s[k], exposed = E_last - R_last. At least the
    last bucket's collective, at most all of them. `rounds`: the chain `rounds` times in a row (one
    backward per micro-batch, each reducing its buckets: ZeRO-2/3), each round's compute after the
    previous round's.

    In O(buckets + rounds): the lag L_k = E_k - R_k follows L_k = max(L_(k-1) - compute_s[k], 0) +
    collective_s[k] (Lindley's recursion of a single-server queue), and a whole round, a composition
    of such maps, is L -> max(L + A, B) for L >= 0, with A = sum(collective_s - compute_s) and
    B = the round's lag from an empty queue."""
    empty, shift = 0.0, 0.0  # B and A of one round
    for c, t in zip(compute_s, collective_s):
        empty = max(empty - c, 0.0) + t
        shift += t - c
    lag = 0.0
    for _ in range(rounds):
        lag = max(lag + shift, empty)
    return lag


def _slowest_backward(ctx: SimContext, groups: list[Group], mbs: int, layers: Sequence[int],
                      split: bool = False) -> np.ndarray:
    """Per layer of `layers`, the longest backward seconds of one micro-batch among the members'
    GPU types and TP degrees (the layer times; recomputation and TP collectives left out, which only
    shortens the compute a sync can hide under). `split` (a schedule that splits the backward,
    ZB-H1): the weight-gradient pass alone (`SimContext.stage_backward_split_s`), since a layer's
    gradients are final after its last W pass, and a stage's last ops are W passes, each running
    the stage's layers' weight gradients and nothing else."""
    members = {(r.gpu, r.tp) for r, _ in groups}
    if split:
        rows = [[ctx.stage_backward_split_s(g, t, mbs, x, x + 1)[1] for x in layers] for g, t in members]
        return np.max(np.array(rows), axis=0)
    rows = [ctx.layer_s(g, t, mbs)[:, 1] for g, t in members]
    return np.max(np.vstack(rows), axis=0)[list(layers)]


def stage_sync(ctx: SimContext, groups: list[Group], chunks: Sequence[tuple[int, int]],
               opts: TimeOptions = DEFAULT_TIME, mbs: int | None = None, *,
               rounds: int = 1, split_backward: bool = False,
               share: ParamShare = ALL_PARAMS) -> tuple[float, float, float]:
    """(seconds, bytes crossing zones, egress $) per iteration of the gradient sync of the layer
    ranges `chunks` (one stage's, `Plan.stage_chunks`; reduced together) across the replicas of that
    stage, given as (Slot, count) groups in ring order (`group_members`): an all-reduce of the
    gradients, or under ZeRO their reduce-scatter plus (ZeRO-1/2) the all-gather of the updated
    weights (`TimeOptions.sync`); under ZeRO-2/3 the reduce-scatter runs once per micro-batch round,
    `rounds` times (`_sync_collectives`; `Plan.step_rounds`; default 1, which the planner's lower
    bounds use). Each of the t ranks syncs its own shard of params(stage, t) parameters (replicated
    norms and biases included), t = the finest common sharding's flow count. The bytes and $ are the
    totals of `stage_sync_crossings`, collective by collective.

    Seconds: DeepSpeed and Megatron-LM (`Framework`, the modelled public runs) reduce after the
    pipeline's last backward, so every collective counts in full, each of its runs. Sailor's runtime
    reduces one bucket per layer, issued as soon as its gradients are final and overlapping the
    backward of the layers below (`runtime.grad_sync`): under ZeRO-0/1 after the layer's last
    backward of the iteration, under ZeRO-2/3 after each micro-batch's, the earlier rounds' then
    hiding under the later micro-batches' backward; the all-gather of the updated weights follows
    the optimizer step. So only the part of the gradient collectives the backward cannot hide counts
    (`exposed_sync_s`), over the stage's layers in backward order (repeated for each round), with
    each layer's collective taking its share of the stage's bytes plus one collective's latency (the
    time of a 1-byte collective) and the compute the slowest member's layer backward of micro-batch
    size `mbs` (the forwards between two rounds' backwards left out: conservative), its weight-gradient
    pass alone under a schedule that splits the backward (`split_backward`, ZB-H1). It is measured
    as each stage's `sync_exposed_s` in the runtime's metrics. It is charged from the stage's own
    last backward on, although the later stages' last backward ends before the pipeline's
    (conservative). Without `mbs`: a lower bound of that (the last layer's collective alone), which
    the planner's bounds use. `share`: only that part of the stage's parameters
    (`context.ParamShare`; expert parallelism syncs the dense ones over every replica and each
    EP rank's experts over its expert DP group, `simulator.experts`)."""
    t, params = _sync_shards(ctx, groups, chunks, share)
    overlap = ctx.job.framework is Framework.SAILOR and sum(n for _, n in groups) > 1
    collectives = _sync_collectives(ctx, params, opts, rounds)
    shape = group_shape(groups)
    key = (("stage_sync", shape, params, tuple(collectives))
           + ((tuple(chunks), mbs, split_backward, share) if overlap else ()))
    if key not in ctx.memo:
        seconds, moved, usd = 0.0, 0.0, 0.0
        layers = [x for a, e in sorted(chunks, reverse=True) for x in reversed(range(a, e))]
        edges_of = shape_memo(ctx, "ring edges")  # the egress reads the zones in ring order, as the shape has them
        if shape not in edges_of:
            edges_of[shape] = RingEdges.of(groups, ctx.network)
        edges = edges_of[shape]
        for kind, nbytes, runs in collectives:
            mb, mu = edges.egress(nbytes)
            full = collective_s(ctx, groups, kind, nbytes, t, shape)
            if overlap and kind is not Collective.ALL_GATHER:  # the gradients' collective, per layer bucket
                latency = collective_s(ctx, groups, kind, 1.0, t, shape)
                per = [latency + (full - latency) * t * ctx.stage_params(t, x, x + 1, share) / params for x in layers]
                seconds += per[-1] if mbs is None else exposed_sync_s(
                    per, _slowest_backward(ctx, groups, mbs, layers, split_backward), rounds=runs)
            else:
                seconds += runs * full
            moved += runs * RING_SHARE[kind] * mb
            usd += runs * RING_SHARE[kind] * mu
        ctx.memo[key] = (seconds, moved, usd)
    return ctx.memo[key]


def stage_sync_crossings(ctx: SimContext, groups: list[Group], chunks: Sequence[tuple[int, int]],
                         opts: TimeOptions = DEFAULT_TIME, *, rounds: int = 1,
                         share: ParamShare = ALL_PARAMS) -> list[Crossing]:
    """The zone crossings of `stage_sync` (same arguments) per iteration: per collective, each ring
    edge between zones (`collectives.ring_crossings`) at that collective's share of a ring
    all-reduce's bytes, times its runs."""
    _, params = _sync_shards(ctx, groups, chunks, share)
    return [c.scaled(runs * RING_SHARE[kind]) for kind, nbytes, runs in _sync_collectives(ctx, params, opts, rounds)
            for c in ring_crossings(groups, nbytes, ctx.network)]


def _ties(ctx: SimContext, num_stages: int) -> bool:
    """True when a pipeline of `num_stages` stages all-reduces tied embedding gradients (P > 1, a
    tied model)."""
    return num_stages > 1 and tied_embeddings(ctx.job.model)


def tied_share(ctx: SimContext, zero: tuple[int, int], replicas: int) -> float:
    """Fraction of the tied copy's gradient one pipeline's first and last stage exchange, averaged
    over the two directions, given the two stages' ZeRO levels `zero` = (first, last) and the plan's
    `replicas` pipelines. Sailor's runtime (`TiedCopies.RUNTIME`) sends each element of a copy once
    to each of its holders after the reduction (`runtime.tied.twin_transfers`): under ZeRO-0 every
    pipeline holds the whole copy (share 1), under ZeRO >= 1 each element has one owner among the
    pipelines (share 1 / replicas, the pipelines together exchanging the copy once). DeepSpeed's
    ReduceTiedGrads all-reduces the whole module in every pipeline before ZeRO (share 1)."""
    if ctx.tied is not TiedCopies.RUNTIME:
        return 1.0
    return sum(1.0 / replicas if z >= 1 else 1.0 for z in zero) / 2


def _tied_allreduce(ctx: SimContext, first: Slot, last: Slot, share: float) -> tuple[list[Group], float, int]:
    """(ring groups, bytes each way, t) of the tied-embedding exchange between a pipeline's first
    and last stage: `share` (`tied_share`) of the copy's gradient (`SimContext.tied_copy_params`),
    as a 2-member ring all-reduce, whose edge carries its bytes once each way."""
    t = min(first.tp, last.tp)
    nbytes = share * t * ctx.tied_copy_params(t) * ctx.job.state_bytes_per_param["gradients"]
    return group_members([first, last]), nbytes, t


def tied_sync(ctx: SimContext, first: Slot, last: Slot, num_stages: int, zero: tuple[int, int] = (0, 0),
              replicas: int = 1) -> tuple[float, float, float]:
    """(seconds, bytes crossing zones, egress $) of the exchange of tied embedding gradients between
    a pipeline's first and last stage (DeepSpeed ReduceTiedGrads; Sailor's runtime sums the copies,
    `runtime.tied`), the stages at ZeRO levels `zero` = (first, last) in a plan of `replicas`
    pipelines (`tied_share`); 0 for one stage or untied models. The bytes and $ are the totals of
    `tied_sync_crossings`."""
    if not _ties(ctx, num_stages):
        return 0.0, 0.0, 0.0
    share = tied_share(ctx, zero, replicas)
    # two members: the ring has the edge each way, so only whether they share a node matters, not
    # which node (nor which of the two sorts first)
    key = ("tied_sync", first.zone, first.gpu, first.tp, last.zone, last.gpu, last.tp, first.node is None,
           last.node is None, first.node == last.node, share)
    if key not in ctx.memo:
        groups, nbytes, t = _tied_allreduce(ctx, first, last, share)
        ctx.memo[key] = (allreduce_s(ctx, groups, nbytes, t), *ring_egress(groups, nbytes, ctx.network))
    return ctx.memo[key]


def tied_sync_crossings(ctx: SimContext, first: Slot, last: Slot, num_stages: int, zero: tuple[int, int] = (0, 0),
                        replicas: int = 1) -> list[Crossing]:
    """The zone crossings of `tied_sync` (same arguments): the ring edges between the two zones."""
    if not _ties(ctx, num_stages):
        return []
    groups, nbytes, _ = _tied_allreduce(ctx, first, last, tied_share(ctx, zero, replicas))
    return ring_crossings(groups, nbytes, ctx.network)


def world_groups(slots: Iterable[Slot]) -> list[Group]:
    """Every rank of a plan as ring groups (ring order, `collectives.ring_key`), from its placed
    replicas' slots (`terms.place`; each slot once per replica): a replica of TP degree t is t ranks
    on its node, each a member of TP 1 (one flow per ring edge, as one rank in one communicator);
    the ranks of one GPU type on one node are one group."""
    ranks: Counter[Member] = Counter()
    for sl, n in Counter(slots).items():
        assert sl.node is not None, f"world ranks need placed slots, got {sl}"
        ranks[Member(sl.zone, sl.gpu, 1, sl.node)] += n * sl.tp
    return sorted(ranks.items(), key=ring_key)


def step_allreduces_s(ctx: SimContext, world: list[Group], num_stages: int, pipelines: int) -> float:
    """Seconds per iteration of the two all-reduces the runtime runs over every rank of the world once
    per step (`plan.comms.step_allreduce_bytes`): the gradient norm's, S_1 = 8 bytes, which waits for
    every rank's backward and gradient sync (`runtime.zero.ShardedAdamW.clip`), and the step's
    statistics, S_2 = 8·(1 + P·k + D + 2·W) bytes, after the update (`runtime.worker.run_steps`);
    `world` = the plan's ranks (`world_groups`, W of them), P = `num_stages`, D = `pipelines`.
    Each is a collective of its own over one group (`terms.timed_collective_s`): the backend's start-up
    α_c (`perf.network.CollectiveCost`) plus the cheaper of the ring and the hierarchical all-reduce
    (`collectives.AllreduceRings`, or the one the cluster spec pins), the ring
        T_ring(S) = 2(W-1)·α + stream(2(W-1)/W·S)/η + processing(2(W-1)/W·S),
    α the slowest edge's one-way latency: with so few bytes nearly all of it is the 2(W-1) hop
    latencies (the hierarchy: those of its islands' rings and of the ring across them). Under NCCL
    (`CollectiveCost.backend`) the tree where it is cheaper (`collectives.tree_allreduce_s`, α_c
    added): 2·⌈log2 N⌉ hops over N nodes, as NCCL picks its algorithm by its cost model; gloo runs
    the ring. So
        T = T(S_1) + T(S_2).
    Their bytes between zones (16 KiB per step at W = 1000) are left out of the plan's traffic and egress.
    These are Sailor's runtime's collectives: 0 for a job modelled after DeepSpeed or Megatron-LM
    (`model.spec.Framework`), whose own per-step reductions (gradient norm, loss) are not modelled."""
    if ctx.job.framework is not Framework.SAILOR:
        return 0.0
    W = sum(n for _, n in world)
    if W < 2:
        return 0.0
    rings = collective_rings(ctx, world)  # not memoised by the world's shape: one per plan (callers memoise)
    cost = ctx.network.collective
    total = 0.0
    for nbytes in step_allreduce_bytes(num_stages, pipelines, W):
        t = timed_collective_s(ctx, *rings, Collective.ALL_REDUCE, nbytes)
        if cost.backend == "nccl":
            t = min(t, cost.startup_s + tree_allreduce_s(world, nbytes, ctx.network))
        total += t
    return total
