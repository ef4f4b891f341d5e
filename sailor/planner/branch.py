"""The older search's tree (`legacy`): coarse nodes (region, P, micro-batch), families (one per layer
partition), points (one TP template per GPU type) and, inside a point, count vectors.

`legacy.search` walks it best-bound-first; this module enumerates it and searches one point.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable

from sailor.plan.spec import StageMemory
from sailor.planner import search as S
from sailor.planner.bounds import coarse_bound, coarse_estimate, lower_bound, sync_floor, types_sync_floor
from sailor.planner.options import Objective, PlanOptions, objective_key
from sailor.planner.space import (candidate_partitions, mbs_candidates, memory_candidates, stage_options, templates,
                                  zero3_needed)
from sailor.simulator import SimContext


@dataclass(frozen=True)
class Family:
    """(region, P, micro-batch, partition, stage memory options) with the TP templates feasible per
    GPU type and, per GPU type, stage and TP degree, the fewest replicas that fit (ZeRO)."""

    zones: tuple[str, ...]
    mbs: int
    M: int
    partition: tuple
    templates: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]  # (gpu, its templates)
    memory: tuple[StageMemory, ...] = ()
    min_replicas: tuple[tuple[str, tuple[tuple[tuple[int, int], ...], ...]], ...] = ()  # (gpu, per stage ((tp, D),))

    def template_min_replicas(self, gpu: str, tps: tuple[int, ...]) -> int:
        """Fewest replicas with which every stage of template `tps` on `gpu` fits."""
        per_stage = dict(self.min_replicas).get(gpu)
        return max(dict(stage)[tp] for stage, tp in zip(per_stage, tps)) if per_stage else 1


def coarse_nodes(ctx: SimContext, opts: PlanOptions, exact: bool):
    """Yield (bound key, (zones, P, mbs)) for every region, pipeline depth and micro-batch: the valid
    `coarse_bound` in exact mode; outside it the larger of that and the tighter `coarse_estimate`."""
    job = ctx.job
    P_max = min(job.model.num_layers, opts.max_stages)
    for zones in regions(ctx.cluster).values():
        for P in range(1, P_max + 1):
            for mbs in mbs_candidates(job.global_batch_size, opts.max_mbs):
                bound = coarse_bound(ctx, zones, P, mbs, opts)
                if not exact:
                    bound = max(bound, coarse_estimate(ctx, zones, P, mbs, opts))
                yield bound, (tuple(zones), P, mbs)


def families(ctx: SimContext, opts: PlanOptions, zones: tuple[str, ...], P: int, mbs: int):
    """Yield (lower-bound key, Family) for every partition of (zones, P, mbs) and every memory
    candidate of it (`space.memory_candidates`) with a feasible template."""
    job = ctx.job
    M = job.global_batch_size // mbs
    gpus = sorted({g for z in zones for g, n in ctx.cluster.zones[z].items() if n > 0})
    zero_max = 3 if zero3_needed(ctx, opts.max_stages) else 2
    for partition in candidate_partitions(ctx, P, mbs, gpus):
        for memory in memory_candidates(ctx, gpus, partition, mbs, M, zero_max, opts.memory_per_partition):
            per_gpu, min_d, relaxed, s2 = [], [], [], float("inf")
            for g in gpus:
                options = stage_options(ctx, g, partition, mbs, M, memory)
                tmpl = templates(options)
                if not tmpl:
                    continue
                per_gpu.append((g, tuple(tmpl)))
                min_d.append((g, tuple(tuple((o.tp, o.min_replicas) for o in stage) for stage in options)))
                fam_g = Family(tuple(zones), mbs, M, partition, (), memory, (min_d[-1],))
                # relaxation: every template of a GPU type may use all of its GPUs at once
                relaxed += [x for t in tmpl for x in pipeline_types(ctx, {g: t}, list(zones), partition, mbs, fam_g)]
                s2 = min(s2, sync_floor(ctx, g, zones, options, partition, memory))
            if per_gpu:
                fam = Family(tuple(zones), mbs, M, partition, tuple(per_gpu), memory, tuple(min_d))
                yield lower_bound(relaxed, M, opts, s2, shared=True), fam


def regions(cluster) -> dict[str, list[str]]:
    """Region -> zones with GPUs, in a stable order."""
    out: dict[str, list[str]] = {}
    for zone in sorted(cluster.zones):
        if sum(cluster.zones[zone].values()) > 0:
            out.setdefault(cluster.prov.region(zone), []).append(zone)
    return out


def points(ctx: SimContext, opts: PlanOptions, fam: Family, exact: bool):
    """Yield (pipeline types, point) for every template combination of a family, best bound first.
    A point is (partition, mbs, ((gpu, template), ...), zones, memory)."""
    zones = list(fam.zones)
    combos = [(c, zones) for c in template_combos(ctx, fam, zones, opts, exact)]
    pts = []
    for combo, zs in combos:
        types = pipeline_types(ctx, combo, zs, fam.partition, fam.mbs, fam)
        if types:
            point = (fam.partition, fam.mbs, tuple(sorted(combo.items())), tuple(zs), fam.memory)
            pts.append((lower_bound(types, fam.M, opts, types_sync_floor(ctx, types, fam.partition)), types, point))
    pts.sort(key=lambda x: x[0])
    for _, types, point in pts:
        yield types, point


def pipeline_types(ctx, combo: dict[str, tuple[int, ...]], zones: list[str], partition, mbs: int,
                   fam: Family) -> list[S.PipelineType]:
    """One pipeline type per (GPU type, zone) with room for at least one pipeline of its template,
    with the family's memory options (constants: D-free lower bounds, `make_pipeline_type`)."""
    out = []
    for g, tps in sorted(combo.items()):
        for z in zones:
            avail = ctx.cluster.available(z, g)
            if avail >= sum(tps):
                out.append(S.make_pipeline_type(ctx, g, z, tps, partition, mbs, avail // sum(tps), memory=fam.memory,
                                                min_replicas=fam.template_min_replicas(g, tps)))
    return out


def template_combos(ctx, fam: Family, zones, opts: PlanOptions, exact: bool):
    """One template per GPU type (or the type unused). Outside exact mode only the best
    `templates_per_gpu` templates per type enter, ranked by the objective of that type alone."""
    lists = []
    for g, tmpls in sorted(dict(fam.templates).items()):
        if not exact and len(tmpls) > opts.templates_per_gpu:
            tmpls = sorted(tmpls, key=lambda t: alone_score(ctx, g, zones, t, fam, opts))
            tmpls = tmpls[: opts.templates_per_gpu]
        lists.append([(g, t) for t in tmpls] + [None])
    for pick in itertools.product(*lists):
        chosen = {x[0]: x[1] for x in pick if x is not None}
        if chosen:
            yield chosen


def alone_score(ctx, gpu, zones, tps, fam: Family, opts: PlanOptions) -> tuple[float, float]:
    """Objective key of the best of a few plans using only this template in its largest zone
    (all, half, a quarter of the pipelines that fit, and one)."""
    zone = max(zones, key=lambda z: ctx.cluster.available(z, gpu))
    n_max = min(ctx.cluster.available(zone, gpu) // sum(tps), fam.M)
    if n_max < 1:
        return (float("inf"), float("inf"))
    t = S.make_pipeline_type(ctx, gpu, zone, tps, fam.partition, fam.mbs, n_max, memory=fam.memory,
                             min_replicas=fam.template_min_replicas(gpu, tps))
    scorer = S.Scorer(ctx, fam.partition, fam.mbs, [t], fam.M)
    key = objective_key(opts.objective)
    best = (float("inf"), float("inf"))
    for n in {n_max, max(1, n_max // 2), max(1, n_max // 4), 1}:
        c = scorer.score((n,))
        if c is not None:
            best = min(best, key(c.iteration_time_s, c.cost_per_iteration_usd))
    return best


def search_counts(ctx, opts: PlanOptions, types: list[S.PipelineType], point, M: int, offer,
                  best: Callable[[], float], exact: bool) -> None:
    """Phase 2 for one point: every count vector on small spaces, else the bounded D scan.
    `offer(candidate, point)` receives every scored candidate; `best()` is the first component of the
    best objective key found so far (inf before any), used to prune."""
    s_min = types_sync_floor(ctx, types, point[0])
    if lower_bound(types, M, opts, s_min)[0] >= best():
        return
    scorer = S.Scorer(ctx, point[0], point[1], types, M)
    gpus_in_point = {g for g, _ in point[2]}

    def consider(counts) -> S.Candidate | None:
        if {t.gpu for t, n in zip(types, counts) if n} != gpus_in_point:
            return None  # a vector leaving a GPU type unused belongs to another combination
        cand = scorer.score(counts)
        if cand is not None:
            offer(cand, point)
        return cand

    if exact and count_vectors_number(types) <= S.EXHAUSTIVE_COUNTS:
        for counts in S.all_count_vectors(types):
            consider(counts)
        return
    D_max = min(sum(t.max_count for t in types), M)
    opt_min = min(t.optimizer_s for t in types)
    kinds = subsets(types)
    seen: set[tuple[int, ...]] = set()
    for D in range(1, D_max + 1):
        floor = S.makespan_floor(types, D, M) + s_min * (D - 1) / D + opt_min
        if opts.objective is Objective.THROUGHPUT and floor >= best():
            continue
        for subset in kinds:
            counts = S.fastest_first(subset, D)
            if counts is not None and counts not in seen:
                seen.add(counts)
                consider(counts)


def subsets(types: list[S.PipelineType]) -> list[list[S.PipelineType]]:
    """All types together, then each type alone (the others' max_count set to 0)."""
    return [types] + [[t if j == k else dataclasses.replace(t, max_count=0) for j, t in enumerate(types)]
                      for k in range(len(types))]


def count_vectors_number(types) -> int:
    n = 1
    for t in types:
        n *= t.max_count + 1
    return n
