"""The planner's search space and its tables (phase 1 of 3: tables, search, scoring).

The space:
- P, the number of pipeline stages, 1..min(layers, max_stages);
- the micro-batch size, powers of two dividing the global batch (up to `max_mbs`);
- the layer partition, shared by all pipelines: every contiguous partition when there are at most
  `EXHAUSTIVE_PARTITIONS` of them, else the even split plus, for every GPU type and TP degree,
  the partition that minimises its slowest stage (balanced to stage speeds);
- the stages' memory options (`plan.spec.StageMemory`, one per stage, the same on every replica of a
  stage): candidates from `memory_candidates`, only where they are needed or can be faster;
- per stage the feasible options (`stage_options`; H1: TP <= GPUs per node and divides the heads;
  H2: the stage fits in memory at that degree with min(P - i, M) micro-batches in flight, with its
  memory options; a ZeRO option fits from some number of replicas D on, which the option carries as
  `min_replicas`);
- pipelines: one option and one zone per stage (`kinds`: GPU types, TP degrees and zones may differ
  from stage to stage), any number of each the GPUs allow, in any zones and regions, and each
  pipeline's number of micro-batches (its share of the global batch).
TP *templates* (one option per stage for one GPU type) are the heuristic's single-type pipelines:
all of them when there are at most `EXHAUSTIVE_TEMPLATES`, else the Pareto set (for every bound on
the slowest stage, the fewest GPUs per stage that meet it) plus the uniform ones
(`pareto_templates`). Everything here is a pure function of its arguments (memoised in the
planning call's context).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from sailor.model.spec import Recompute
from sailor.perf.calibration import gpu_constant
from sailor.plan.spec import DEFAULT_STAGE_MEMORY, StageMemory
from sailor.simulator import SimContext, Slot, stage_time, time_options
from sailor.simulator.memory import gathered_weights_bytes, replica_memory

EXHAUSTIVE_PARTITIONS = 16
EXHAUSTIVE_TEMPLATES = 8

Partition = tuple[tuple[int, int], ...]


def mbs_candidates(global_batch: int, max_mbs: int = 32) -> list[int]:
    """Micro-batch sizes tried: powers of two that divide the global batch, up to `max_mbs`."""
    out, m = [], 1
    while m <= min(global_batch, max_mbs):
        if global_batch % m == 0:
            out.append(m)
        m *= 2
    return out


def even_partition(num_layers: int, num_stages: int) -> Partition:
    """Layers split as evenly as possible, the extra layers going to the last stages (the published
    planner's rule, kept for `--search paper`)."""
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if i >= num_stages - extra else 0) for i in range(num_stages)]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return tuple((int(bounds[i]), int(bounds[i + 1])) for i in range(num_stages))


def balanced_partition(layer_costs: np.ndarray, num_stages: int) -> Partition:
    """Contiguous partition minimising the largest stage cost (linear-partition DP, O(P·L²)).

    best[k][j] = min over i < j of max(best[k-1][i], cost(i, j)): the cheapest way to cut the first j
    layers into k stages; every stage holds at least one layer.
    """
    L = len(layer_costs)
    cum = np.concatenate([[0.0], np.cumsum(layer_costs)])
    best = np.full((num_stages + 1, L + 1), np.inf)
    cut = np.zeros((num_stages + 1, L + 1), dtype=int)
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, L - (num_stages - k) + 1):
            i = np.arange(k - 1, j)
            vals = np.maximum(best[k - 1][i], cum[j] - cum[i])
            a = int(np.argmin(vals))
            best[k][j], cut[k][j] = vals[a], i[a]
    bounds, j = [L], L
    for k in range(num_stages, 0, -1):
        j = int(cut[k][j])
        bounds.append(j)
    bounds.reverse()
    assert bounds[0] == 0 and len(bounds) == num_stages + 1
    return tuple((bounds[i], bounds[i + 1]) for i in range(num_stages))


def all_partitions(num_layers: int, num_stages: int) -> list[Partition]:
    """Every contiguous partition of `num_layers` layers into `num_stages` non-empty stages."""
    out = []
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        b = (0, *cuts, num_layers)
        out.append(tuple((b[i], b[i + 1]) for i in range(num_stages)))
    return out


def candidate_partitions(ctx: SimContext, num_stages: int, mbs: int, gpus: list[str]) -> list[Partition]:
    """Partitions tried for P = `num_stages`: all of them when few, else even + balanced per GPU
    type and per uniform TP degree."""
    L = ctx.job.model.num_layers
    if math.comb(L - 1, num_stages - 1) <= EXHAUSTIVE_PARTITIONS:
        return all_partitions(L, num_stages)
    out = {even_partition(L, num_stages)}
    for g in gpus:
        for tp in ctx.job.model.tp_degrees(ctx.cluster.node_size(g)):
            per_layer = ctx.profiles.layer_times(ctx.job, g, tp, mbs).sum(axis=1)
            out.add(balanced_partition(per_layer, num_stages))
    return sorted(out)


@dataclass(frozen=True)
class Option:
    """Stage i on one replica of `tp` GPUs of type `gpu` with the stage's memory options: seconds per
    micro-batch (in the GPU type's home zone, at min_replicas), and the fewest data-parallel replicas
    D with which it fits in memory (1 unless ZeRO shards what does not fit otherwise)."""

    gpu: str
    tp: int
    forward_s: float
    backward_s: float
    min_replicas: int = 1

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def gpus(self) -> int:
        return self.tp


Memory = tuple[StageMemory, ...]  # one StageMemory per stage


def home_zone(ctx: SimContext, gpu: str) -> str:
    """The zone with the most GPUs of type `gpu` (where stage options are timed: TP collectives and
    ZeRO-3 gathers run on that zone's links; the count search times every zone exactly); memoised
    in the context with `gpus_of_type`."""
    return _type_totals(ctx, gpu)[0]


def gpus_of_type(ctx: SimContext, gpu: str) -> int:
    """GPUs of type `gpu` in the whole cluster (memoised in the context with `home_zone`)."""
    return _type_totals(ctx, gpu)[1]


def _type_totals(ctx: SimContext, gpu: str) -> tuple[str, int]:
    """(`home_zone`, `gpus_of_type`) of `gpu`, found once per planning call: every stage option and
    ZeRO feasibility check asks for them, and a cluster may have a hundred zones."""
    key = ("type totals", gpu)
    if key not in ctx.memo:
        zones = ctx.cluster.zones
        ctx.memo[key] = (max(sorted(zones), key=lambda z: ctx.cluster.available(z, gpu)),
                         sum(ctx.cluster.available(z, gpu) for z in zones))
    return ctx.memo[key]


def sp_possible(ctx: SimContext, tp: int, a: int = 0, b: int | None = None) -> bool:
    """Sequence parallelism of a stage of layers [a, b) (the whole model when b is None) needs TP > 1,
    a sequence the TP degree divides, and no mixture-of-experts block among the layers
    (`Plan.check_against`'s rules: the runtime does not run MoE blocks sequence-parallel)."""
    model = ctx.job.model
    if tp < 2 or ctx.job.seq % tp:
        return False
    return not model.holds_moe_block([(a, model.num_layers if b is None else b)])


def option_time_s(ctx: SimContext, gpu: str, tp: int, mbs: int, a: int, b: int, memory: StageMemory,
                  replicas: int) -> tuple[float, float]:
    """(forward_s, backward_s) per micro-batch of stage [a, b) on `gpu` at TP `tp` under `memory`
    with `replicas` replicas, timed in the GPU type's `home_zone`."""
    st = stage_time(ctx, Slot(zone=home_zone(ctx, gpu), gpu=gpu, tp=tp), mbs, a, b, time_options(memory, replicas))
    return st.forward_s, st.backward_s


def replica_cap(ctx: SimContext, gpu: str, tp: int, microbatches: int) -> int:
    """Most data-parallel replicas a stage on `gpu` at TP `tp` could have: every GPU of the type in
    the cluster holding one replica, and no more replicas than micro-batches."""
    return max(1, min(microbatches, gpus_of_type(ctx, gpu) // tp))


def min_replicas(ctx: SimContext, gpu: str, tp: int, mbs: int, a: int, b: int, *, stage: int, num_stages: int,
                 microbatches: int, memory: StageMemory, most: int | None = None) -> int | None:
    """Fewest data-parallel replicas D (at most `replica_cap`, and at most `most` where given) with
    which a replica of stage [a, b) fits in memory under `memory`; None when it never does. Memory is A + B/D with B the states the
    ZeRO level shards (`simulator.memory.state_bytes`) and A the rest (plus, under ZeRO-3, the
    gathered weights), so D = ceil(B / (limit - A)), limit = the memory a plan
    may fill (`SimContext.memory_limit`: capacity less the memory margin)."""
    key = ("min_replicas", gpu, tp, mbs, a, b, stage, num_stages, microbatches, memory.recompute,
           memory.recompute_blocks, memory.sequence_parallel, memory.zero, memory.reshard_after_forward)
    if key not in ctx.memo:
        ctx.memo[key] = _min_replicas(ctx, key, gpu, tp, mbs, a, b, stage, num_stages, microbatches, memory)
    d = ctx.memo[key]
    return d if most is None or (d is not None and d <= most) else None  # the fewest, if within `most`


def _min_replicas(ctx: SimContext, key: tuple, gpu: str, tp: int, mbs: int, a: int, b: int, stage: int,
                  num_stages: int, microbatches: int, memory: StageMemory) -> int | None:
    """`min_replicas` without `most` (memoised there under `key`)."""
    # at D = 1 nothing is sharded: the same for every ZeRO level but for the gradient sync's flat
    # buffer (`simulator.memory.sync_buffer_bytes`: the stage's gradients, one layer's under ZeRO-2/3)
    # (memoised as the four numbers read here: the breakdown object is some 4 times their size)
    one_key = ("memory at D = 1", *key[1:-2], memory.zero >= 2)
    if one_key not in ctx.memo:
        one = replica_memory(ctx, gpu, tp, mbs, ((a, b),), stage=stage, num_stages=num_stages,
                             microbatches=microbatches, memory=memory, replicas=1)
        ctx.memo[one_key] = (one.total, one.optimizer, one.gradients, one.weights)
    total, optimizer, gradients, weights = ctx.memo[one_key]
    cap, top = ctx.memory_limit(gpu), replica_cap(ctx, gpu, tp, microbatches)  # within the memory margin
    if total <= cap:
        d = 1
    elif memory.zero == 0 or top == 1:
        d = None
    else:
        sharded = optimizer + (gradients if memory.zero >= 2 else 0.0) + (weights if memory.zero >= 3 else 0.0)
        rest = total - sharded
        if memory.zero >= 3:  # the gathered weights (`simulator.memory.gathered_weights_bytes`), and their reserve
            gathered = gathered_weights_bytes(ctx, tp, ((a, b),), memory.reshard_after_forward)
            rest += gathered * (1 + gpu_constant(ctx.calibration, gpu, "reserve_fraction", 0.0))
        need = math.ceil(sharded / (cap - rest) - 1e-9) if cap > rest else top + 1
        d = max(2, need) if need <= top else None
    return d


def stage_options(ctx: SimContext, gpu: str, partition: Partition, mbs: int, microbatches: int,
                  memory: Memory | None = None) -> list[list[Option]]:
    """Feasible TP options per stage for GPU type `gpu` under the stages' memory options `memory`
    (defaults when None) (H1: TP within a node and dividing the heads; H2: fits in memory with
    min(P - i, microbatches) micro-batches in flight, from `min_replicas` replicas on). A stage with
    no option makes the GPU type unusable for this partition (empty inner list)."""
    P = len(partition)
    memory = memory or (DEFAULT_STAGE_MEMORY,) * P
    out = []
    for i, (a, b) in enumerate(partition):
        opts = []
        for tp in ctx.job.model.tp_degrees(ctx.cluster.node_size(gpu)):
            mem = memory[i]
            if mem.sequence_parallel and not sp_possible(ctx, tp, a, b):
                continue
            d = min_replicas(ctx, gpu, tp, mbs, a, b, stage=i, num_stages=P, microbatches=microbatches, memory=mem)
            if d is not None:
                opts.append(Option(gpu, tp, *option_time_s(ctx, gpu, tp, mbs, a, b, mem, d), d))
        out.append(opts)
    return out


# Memory options tried for one stage (`cheapest_fit`): per ZeRO level, recomputation x SP.
_RECOMPUTE_SP = [(Recompute.NONE, False), (Recompute.NONE, True), (Recompute.SELECTIVE, False),
                 (Recompute.SELECTIVE, True), (Recompute.FULL, False), (Recompute.FULL, True)]
_CONFIGS = {zero: [StageMemory(recompute=r, zero=zero, sequence_parallel=sp) for r, sp in _RECOMPUTE_SP]
            for zero in range(4)}


def _fitting_options(ctx: SimContext, gpu: str, tp: int, mbs: int, a: int, b: int, i: int, P: int, M: int,
                     zero_max: int, most: int | None = None) -> list[tuple]:
    """The memory options of stage i that fit with up to `replica_cap` replicas (and `most`), as (seconds per
    micro-batch, ZeRO level, SP, recomputation rank, StageMemory): for every recomputation x SP, the
    lowest ZeRO level <= 2 at which it fits (ZeRO-1/2 change nothing per micro-batch, and a higher
    level only shards more), or ZeRO-3 when zero_max = 3 and nothing lighter fits (its gathers cost
    time)."""
    key = ("fitting_options", gpu, tp, mbs, a, b, i, P, M, zero_max, most)
    if key not in ctx.memo:
        out = []
        for rank, (recompute, sp) in enumerate(_RECOMPUTE_SP):
            if sp and not sp_possible(ctx, tp, a, b):
                continue
            fits = {}
            for zero in (2, 1, 0):  # from the most sharding down: stop where it no longer fits
                d = min_replicas(ctx, gpu, tp, mbs, a, b, stage=i, num_stages=P, microbatches=M,
                                 memory=_CONFIGS[zero][rank], most=most)
                if d is None:
                    break
                fits[zero] = d
            if zero_max == 3 and not fits:  # ZeRO-3 only where nothing lighter fits
                d3 = min_replicas(ctx, gpu, tp, mbs, a, b, stage=i, num_stages=P, microbatches=M, memory=_CONFIGS[3][rank],
                                  most=most)
                if d3 is not None:
                    fits[3] = d3
            if fits:
                zero = min(fits)
                mem = _CONFIGS[zero][rank]
                out.append((sum(option_time_s(ctx, gpu, tp, mbs, a, b, mem, fits[zero])), zero, sp, rank, mem))
        ctx.memo[key] = out
    return ctx.memo[key]


def cheapest_fit(ctx: SimContext, gpu: str, tp: int, mbs: int, a: int, b: int, i: int, P: int, M: int,
                 zero_max: int, most: int | None = None) -> StageMemory | None:
    """The memory options of stage i (layers [a, b)) on `gpu` at TP `tp` that fit with up to
    `replica_cap` replicas (and at most `most`) at the lowest per-micro-batch time, ZeRO level at most `zero_max` (ties:
    the lower ZeRO level, no SP, the lighter recomputation); None when none fits."""
    if min_replicas(ctx, gpu, tp, mbs, a, b, stage=i, num_stages=P, microbatches=M, memory=DEFAULT_STAGE_MEMORY) == 1:
        return DEFAULT_STAGE_MEMORY  # fits as it is: the fastest there is
    fits = [x for x in _fitting_options(ctx, gpu, tp, mbs, a, b, i, P, M, max(zero_max, 2), most) if x[1] <= zero_max]
    return min(fits, key=lambda x: x[:4])[4] if fits else None


def memory_candidates(ctx: SimContext, gpus: list[str], partition: Partition, mbs: int, M: int,
                      zero_max: int = 2, lightest: int | None = None,
                      gpus_offered: int | None = None) -> list[Memory]:
    """Memory options for the stages of `partition` (one StageMemory per stage) the planner tries:
    the defaults alone when every GPU type holds every stage as it is at some TP degree (options are
    searched where they are needed); else, for every GPU type and uniform TP degree t, and every ZeRO
    ceiling z <= zero_max, each stage takes its cheapest options that fit (`cheapest_fit`): none
    where the stage fits as it is (no recomputation when it fits), else the SP, recomputation and
    ZeRO level that cost it the least time per micro-batch. ZeRO-1/2 cost nothing per micro-batch; ZeRO-3's gathers do, and the
    planner allows it (zero_max = 3) only where nothing fits without it. At TP t the P stages have
    at most N // (t·P) replicas each (N the cluster's GPUs), so no option is taken that needs more
    than that: a candidate the cluster cannot hold would take the place of one it can. Distinct
    vectors only, lightest first (`memory_weight`; the defaults, when every stage fits as it is, lead). `gpus_offered`: N in place of the cluster's (what a larger cluster would take). `lightest` k: the k
    lightest and every other one as light as the k-th (which of equal weights come first depends on
    the order they were found in, and the search must not); and, for each GPU type whose own GPUs
    (at most N) hold none of those, the lightest vector it holds alone."""
    P = len(partition)
    base = (DEFAULT_STAGE_MEMORY,) * P
    tps = {g: ctx.job.model.tp_degrees(ctx.cluster.node_size(g)) for g in gpus}
    if all(any(min_replicas(ctx, g, t, mbs, a, b, stage=i, num_stages=P, microbatches=M, memory=DEFAULT_STAGE_MEMORY) == 1
               for t in tps[g]) for g in gpus for i, (a, b) in enumerate(partition)):
        return [base]  # every GPU type holds every stage as it is at some TP degree: nothing is needed
    n = ctx.cluster.total_gpus() if gpus_offered is None else gpus_offered
    seen = sorted(_vectors(ctx, gpus, tps, partition, mbs, M, zero_max, n), key=memory_rank)
    out = seen if lightest is None or len(seen) <= lightest else [
        v for v in seen if memory_weight(v) <= memory_weight(seen[lightest - 1])]
    # A GPU type whose own GPUs hold no candidate (too few pipelines of it for the ZeRO the cluster's
    # count allows) also gets the lightest it can hold alone: 16 A100-40 hold one OPT-30B pipeline
    # (TP 8, 2 stages), whose ZeRO-2 shards nothing, next to V100-16s that cannot hold it at all.
    for g in gpus:
        alone = min(n, gpus_of_type(ctx, g))
        if not any(_holds(ctx, g, tps[g], partition, mbs, M, v, alone) for v in out):
            own = sorted(_vectors(ctx, [g], tps, partition, mbs, M, zero_max, alone), key=memory_rank)
            if own and own[0] not in out:
                out.append(own[0])
    return out


def _vectors(ctx: SimContext, gpus: list[str], tps: dict[str, list[int]], partition: Partition, mbs: int, M: int,
             zero_max: int, gpus_offered: int) -> list[Memory]:
    """`memory_candidates`' vectors before ranking: per GPU type, TP t and ZeRO ceiling, each stage's
    `cheapest_fit` with at most gpus_offered // (t·P) replicas; distinct, in the order found."""
    seen: list[Memory] = []
    for g in gpus:
        for t in tps[g]:
            k = gpus_offered // (t * len(partition))
            if k < 1:
                continue  # the GPUs cannot hold one pipeline of P stages at TP t
            for z in range(zero_max + 1):
                vec = tuple(cheapest_fit(ctx, g, t, mbs, a, b, i, len(partition), M, z, k)
                            for i, (a, b) in enumerate(partition))
                if None not in vec and vec not in seen:
                    seen.append(vec)
                if all(m == DEFAULT_STAGE_MEMORY for m in vec):
                    break  # every stage fits as it is: nothing is cheaper
    return seen


def _holds(ctx: SimContext, gpu: str, tps: list[int], partition: Partition, mbs: int, M: int, memory: Memory,
           gpus: int) -> bool:
    """True when `gpus` GPUs of type `gpu` hold a plan of their own under `memory`: at some TP degree,
    every stage fits with as many replicas as they make pipelines of P stages."""
    P = len(partition)
    return any(gpus // (t * P) >= 1 and all(
        not (m.sequence_parallel and not sp_possible(ctx, t, a, b))
        and min_replicas(ctx, gpu, t, mbs, a, b, stage=i, num_stages=P, microbatches=M, memory=m,
                         most=gpus // (t * P)) is not None
        for i, ((a, b), m) in enumerate(zip(partition, memory))) for t in tps)


def memory_rank(memory: Memory) -> tuple[float, int]:
    """The order candidates are tried in: lightest first (`memory_weight`), ties with less sharding first."""
    return memory_weight(memory), sum(m.zero for m in memory)


def memory_weight(memory: Memory) -> float:
    """How much a vector of memory options adds, for ranking candidates (0 for the defaults): per
    stage, ZeRO-1/2 0.5, SP 1, selective 2, full 4, ZeRO-3 8, added up."""
    weight = {Recompute.NONE: 0.0, Recompute.SELECTIVE: 2.0, Recompute.FULL: 4.0}
    return sum(weight[m.recompute] + m.sequence_parallel + (8.0 if m.zero == 3 else 0.5 if m.zero else 0.0)
               for m in memory)


def pareto_templates(stages: list[list], exhaustive: int = EXHAUSTIVE_TEMPLATES) -> list[tuple]:
    """Option templates (one option per stage; options with `tp`, `gpus` and `time_s`, e.g.
    `Option`s) for one GPU type: all of them when at most `exhaustive`, in
    product order, else the Pareto set — for each bound θ on the slowest stage, the option with the
    fewest GPUs (then fastest) meeting it on every stage — plus, per TP degree every stage offers,
    the fastest option of that degree on each stage. Empty when some stage has no option."""
    if any(not o for o in stages):
        return []
    if math.prod(len(o) for o in stages) <= exhaustive:
        return list(itertools.product(*stages))
    out: set[tuple] = set()
    for theta in sorted({x.time_s for o in stages for x in o}):
        pick = []
        for o in stages:
            ok = [x for x in o if x.time_s <= theta]
            if not ok:
                break
            pick.append(min(ok, key=lambda x: (x.gpus, x.time_s)))
        else:
            out.add(tuple(pick))
    for tp in set.intersection(*({x.tp for x in o} for o in stages)):
        out.add(tuple(min((x for x in o if x.tp == tp), key=lambda x: x.time_s) for o in stages))
    return sorted(out, key=lambda t: tuple((x.gpus, x.time_s) for x in t))


def zero3_needed(ctx: SimContext, max_stages: int) -> bool:
    """True when no plan the cluster has the GPUs for fits without ZeRO-3: no GPU type, TP degree t
    and pipeline depth P holds every stage of the even partition at micro-batch 1 under some
    recomputation and SP with ZeRO-2 over at most N // (t·P) replicas (N the cluster's GPUs; a
    deeper pipeline than the GPUs allow does not count). ZeRO-3 gathers the weights for every
    micro-batch, so it is searched only then (memoised for the call)."""
    key = ("zero3_needed", max_stages)
    if key not in ctx.memo:
        job, n = ctx.job, ctx.cluster.total_gpus()
        M, L = job.global_batch_size, job.model.num_layers

        def holds(g: str, t: int, P: int) -> bool:
            most = n // (t * P)  # replicas the cluster has the GPUs for
            return most >= 1 and all(
                any(min_replicas(ctx, g, t, 1, a, b, stage=i, num_stages=P, microbatches=M, memory=mem, most=most)
                    is not None for mem in _CONFIGS[2] if not mem.sequence_parallel or sp_possible(ctx, t, a, b))
                for i, (a, b) in enumerate(even_partition(L, P)))

        ctx.memo[key] = not any(holds(g, t, P) for g in ctx.cluster.gpu_types()
                                for t in job.model.tp_degrees(ctx.cluster.node_size(g))
                                for P in range(1, min(L, max_stages) + 1))
    return ctx.memo[key]
