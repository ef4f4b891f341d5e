"""The planner's search space and its cost tables (phase 1 of 3: tables, search, scoring).

The space, for a job on the GPUs of one region (H5: data-parallel traffic stays in one region):
- P, the number of pipeline stages, 1..min(layers, max_stages);
- the micro-batch size, powers of two dividing the global batch (up to `max_mbs`);
- the layer partition, shared by all pipelines: every contiguous partition when there are at most
  `EXHAUSTIVE_PARTITIONS` of them, else the even split plus, for every GPU type and TP template,
  the partition that minimises its slowest stage (balanced to stage speeds);
- per GPU type a TP *template*: one TP degree per stage (H1: TP <= GPUs per node and divides the
  heads; H2: the stage fits in memory at that degree with min(P - i, M) micro-batches in flight);
  all templates when there are at most `EXHAUSTIVE_TEMPLATES`, else the Pareto set (for every
  bound on the slowest stage, the fewest GPUs per stage that meet it) plus the uniform ones;
- per (GPU type, zone) a number of pipelines, all single-zone and single-type, and each pipeline's
  number of micro-batches (its share of the global batch).
Everything here is a pure function of its arguments.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from sailor.simulator import SimContext
from sailor.simulator.memory import replica_memory

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
class StageOption:
    """Stage i on one replica of `tp` GPUs of type `gpu`: seconds per micro-batch."""

    tp: int
    forward_s: float
    backward_s: float

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s


def stage_options(ctx: SimContext, gpu: str, partition: Partition, mbs: int, microbatches: int) -> list[list[StageOption]]:
    """Feasible TP options per stage for GPU type `gpu` (H1: TP within a node and dividing the heads;
    H2: fits in memory with min(P - i, microbatches) micro-batches in flight). A stage with no option
    makes the GPU type unusable for this partition (empty inner list)."""
    P = len(partition)
    cap = ctx.memory_capacity(gpu)
    out = []
    for i, (a, b) in enumerate(partition):
        opts = []
        for tp in ctx.job.model.tp_degrees(ctx.cluster.node_size(gpu)):
            mem = replica_memory(ctx, gpu, tp, mbs, ((a, b),), stage=i, num_stages=P, microbatches=microbatches)
            if mem.total <= cap:
                f, bw = ctx.stage_compute_s(gpu, tp, mbs, a, b)
                opts.append(StageOption(tp, f, bw))
        out.append(opts)
    return out


def templates(options: list[list[StageOption]]) -> list[tuple[int, ...]]:
    """TP templates (one degree per stage) for one GPU type: all when few, else the Pareto set
    (for each bound θ on the slowest stage, the smallest TP per stage meeting it) plus the uniform
    ones. Empty when some stage has no feasible option."""
    if any(not o for o in options):
        return []
    if math.prod(len(o) for o in options) <= EXHAUSTIVE_TEMPLATES:
        return [tuple(x.tp for x in combo) for combo in itertools.product(*options)]
    out: set[tuple[int, ...]] = set()
    for theta in sorted({x.time_s for o in options for x in o}):
        pick = []
        for o in options:
            ok = [x for x in o if x.time_s <= theta]
            if not ok:
                break
            pick.append(min(ok, key=lambda x: (x.tp, x.time_s)).tp)
        else:
            out.add(tuple(pick))
    common = set.intersection(*({x.tp for x in o} for o in options))
    out.update(tuple([t] * len(options)) for t in common)
    return sorted(out)
