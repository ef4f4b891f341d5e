"""Planner: optimality against brute force, objectives, constraints, availability, no state leaks,
infeasibility messages, and the built-in example."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from sailor.errors import InfeasibleError
from sailor.plan import Plan, StageMemory
from sailor.planner import Constraints, Objective, PlanOptions, SearchSpace, plan_job
from sailor.planner.space import (all_partitions, mbs_candidates, memory_candidates, stage_options, templates,
                                  zero3_needed)
from sailor.simulator import make_context, simulate
from sailor.specs import EXAMPLE_CLUSTER, EXAMPLE_JOB, ClusterSpec, JobSpec

TINY = JobSpec(model="tiny", global_batch_size=8)


def _key(objective: Objective, est) -> tuple[float, float]:
    t, c = est.iteration_time_s, est.cost_per_iteration_usd
    return (t, c) if objective is Objective.THROUGHPUT else (c, t)


def _multisets(total: int, parts: int):
    """Non-increasing sequences of `parts` positive integers summing to `total`."""
    def rec(left, k, cap):
        if k == 0:
            if left == 0:
                yield ()
            return
        for first in range(min(cap, left - (k - 1)), 0, -1):
            for rest in rec(left - first, k - 1, first):
                yield (first,) + rest
    yield from rec(total, parts, total)


def brute_force(job: JobSpec, cluster: ClusterSpec, opts: PlanOptions) -> tuple[float, float]:
    """Best objective key over every plan of the planner's space, each scored with
    simulate(event=False): every P, micro-batch, partition, memory candidate of it (the stages'
    memory options, the same `memory_candidates` the planner searches), TP template per GPU type (from the same
    `templates` function), number of pipelines per (GPU type, zone) with as many pipelines as the
    templates' ZeRO options need, and split of the micro-batches; memory feasible within the
    options' memory margin, as the planner's."""
    ctx = dataclasses.replace(make_context(job, cluster), memory_margin=opts.memory_margin)
    zones = sorted(cluster.zones)
    regions = {cluster.prov.region(z) for z in zones}
    assert len(regions) == 1
    L = job.model.num_layers
    zero_max = 3 if zero3_needed(ctx, opts.max_stages) else 2
    best = None
    for P in range(1, min(L, opts.max_stages) + 1):
        for mbs in mbs_candidates(job.global_batch_size, opts.max_mbs):
            M = job.global_batch_size // mbs
            for part in all_partitions(L, P):
                for memory in memory_candidates(ctx, cluster.gpu_types(), part, mbs, M, zero_max)[: opts.memory_per_partition]:
                    best = _brute_force_point(ctx, cluster, opts, zones, part, mbs, M, memory, best)
    return best


def _brute_force_point(ctx, cluster, opts, zones, part, mbs, M, memory, best):
    per_gpu, need = {}, {}
    for g in cluster.gpu_types():
        options = stage_options(ctx, g, part, mbs, M, memory)
        tm = templates(options)
        if tm:
            per_gpu[g] = tm
            need[g] = {t: max(next(o.min_replicas for o in opts_i if o.tp == tp) for opts_i, tp in zip(options, t))
                       for t in tm}
    choices = [[None] + [(g, t) for t in tm] for g, tm in per_gpu.items()]
    for pick in itertools.product(*choices):
        chosen = [x for x in pick if x is not None]
        if not chosen:
            continue
        kinds = [(g, z, t) for g, t in chosen for z in zones if cluster.available(z, g) >= sum(t)]
        caps = [cluster.available(z, g) // sum(t) for g, z, t in kinds]
        for counts in itertools.product(*(range(c + 1) for c in caps)):
            used_gpus = {g for (g, _, _), n in zip(kinds, counts) if n}
            if used_gpus != {g for g, _ in chosen} or not 0 < sum(counts) <= M:
                continue
            live = [(k, n) for k, n in zip(kinds, counts) if n]
            if sum(counts) < max(need[g][t] for (g, _, t), _ in live):
                continue  # a ZeRO option needs more replicas to fit
            # every way to hand out M micro-batches (pipelines of one kind are interchangeable)
            def splits(i, left):
                if i == len(live):
                    if left == 0:
                        yield ()
                    return
                n = live[i][1]
                for tot in range(n, left - sum(x[1] for x in live[i + 1:]) + 1):
                    for ms in _multisets(tot, n):
                        for rest in splits(i + 1, left - tot):
                            yield (ms,) + rest
            for split in splits(0, M):
                pipes = [{"microbatches": m, "replicas": [
                    {"stage": i, "gpu": g, "zone": z, "tp": tp} for i, tp in enumerate(t)]}
                    for ((g, z, t), _), ms in zip(live, split) for m in ms]
                plan = Plan.model_validate({"micro_batch_size": mbs, "stages": [list(s) for s in part],
                                            "pipelines": pipes, "memory": [m.model_dump() for m in memory]})
                est = simulate(plan, ctx, event=False)
                if not opts.constraints.ok(est.iteration_time_s, est.cost_per_iteration_usd):
                    continue
                k = _key(opts.objective, est)
                best = k if best is None or k < best else best
    return best


def _random_cluster(rng: random.Random) -> ClusterSpec:
    zones = ["us-central1-a", "us-central1-b"][: rng.randint(1, 2)]
    gpus = rng.sample(["A100-40", "V100-16", "T4"], rng.randint(1, 2))
    spec = {z: {g: rng.choice([0, 1, 2, 3, 4]) for g in gpus} for z in zones}
    if sum(n for z in spec.values() for n in z.values()) == 0:
        spec[zones[0]][gpus[0]] = 2
    return ClusterSpec(zones=spec, gpus_per_node={g: 2 for g in gpus})


@pytest.mark.parametrize("seed", range(6))
def test_planner_matches_brute_force_on_small_clusters(seed):
    rng = random.Random(seed)
    cluster = _random_cluster(rng)
    objective = Objective.THROUGHPUT if seed % 2 == 0 else Objective.COST
    opts = PlanOptions(objective=objective, max_stages=2, max_mbs=4)
    expected = brute_force(TINY, cluster, opts)
    result = plan_job(make_context(TINY, cluster), opts)
    got = _key(objective, simulate(result.best_closed.plan, make_context(TINY, cluster), event=False))
    assert got[0] == pytest.approx(expected[0], rel=1e-9)
    assert result.best_closed.closed_time_s == pytest.approx(simulate(result.best_closed.plan, make_context(TINY, cluster),
                                                                        event=False).iteration_time_s, rel=1e-9)


# Needs memory options: 4 blocks of h = 4096 at sequence 4096, fp32 (about 14 GB of weights and Adam
# states), on 16 GB T4s one per node (no TP): one stage only fits with ZeRO or recomputation.
TIGHT = JobSpec(model={"name": "tight", "num_blocks": 4, "hidden_size": 4096, "num_heads": 32, "vocab_size": 8192,
                       "max_sequence_length": 4096}, global_batch_size=4)


@pytest.mark.parametrize("objective", [Objective.THROUGHPUT, Objective.COST])
def test_planner_matches_brute_force_when_memory_options_are_needed(objective):
    cluster = ClusterSpec(zones={"us-central1-a": {"T4": 4}}, gpus_per_node={"T4": 1})
    opts = PlanOptions(objective=objective, max_stages=2, max_mbs=2)
    ctx = make_context(TIGHT, cluster)
    part = ((0, 6),)
    assert StageMemory() not in memory_candidates(ctx, ["T4"], part, 2, 2)[0]  # one stage needs options
    expected = brute_force(TIGHT, cluster, opts)
    result = plan_job(make_context(TIGHT, cluster), opts)
    got = _key(objective, simulate(result.best_closed.plan, make_context(TIGHT, cluster), event=False))
    assert got[0] == pytest.approx(expected[0], rel=1e-9)
    assert result.estimate.fits_in_memory


def test_planner_matches_brute_force_under_a_budget():
    # the tiny model computes for tens of µs per iteration: more GPUs pay only on a µs network
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 4, "V100-16": 2}}, gpus_per_node={"A100-40": 2, "V100-16": 2},
                          network={"same_zone": {"latency_s": 1e-6, "bandwidth_bytes_per_s": 1e11}})
    fast = plan_job(make_context(TINY, cluster), PlanOptions(max_stages=2, max_mbs=4)).best_closed
    cheap = plan_job(make_context(TINY, cluster), PlanOptions(objective=Objective.COST, max_stages=2, max_mbs=4)).best_closed
    assert cheap.closed_cost_usd < fast.closed_cost_usd
    budget = (fast.closed_cost_usd + cheap.closed_cost_usd) / 2  # rules out the fastest plan
    opts = PlanOptions(max_stages=2, max_mbs=4, constraints=Constraints(max_cost_per_iteration=budget))
    expected = brute_force(TINY, cluster, opts)
    result = plan_job(make_context(TINY, cluster), opts)
    assert result.best_closed.closed_time_s == pytest.approx(expected[0], rel=1e-9)
    assert result.best_closed.closed_cost_usd <= budget


def _usage_ok(plan: Plan, cluster: ClusterSpec) -> bool:
    return all(n <= cluster.available(z, g) for (z, g), n in plan.gpu_usage().items())


@pytest.mark.parametrize("seed", range(4))
def test_plans_respect_availability_and_memory(seed):
    rng = random.Random(100 + seed)
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": rng.choice([8, 16, 24]), "V100-16": rng.choice([0, 8, 16])},
                                 "us-central1-b": {"A100-40": rng.choice([0, 8])}})
    job = JobSpec(model="opt-350m", global_batch_size=256)
    result = plan_job(make_context(job, cluster), PlanOptions(max_stages=4))
    assert _usage_ok(result.plan, cluster)
    assert result.estimate.fits_in_memory
    result.plan.check_against(job, cluster)
    for alt in result.alternatives:
        assert _usage_ok(alt.plan, cluster) and alt.estimate.fits_in_memory


def test_objectives_and_constraints_are_respected():
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 16, "V100-16": 16}})
    job = JobSpec(model="opt-350m", global_batch_size=256)
    fast = plan_job(make_context(job, cluster), PlanOptions(objective=Objective.THROUGHPUT, max_stages=4)).estimate
    cheap = plan_job(make_context(job, cluster), PlanOptions(objective=Objective.COST, max_stages=4)).estimate
    assert fast.throughput_iters_per_s >= cheap.throughput_iters_per_s
    assert cheap.cost_per_iteration_usd <= fast.cost_per_iteration_usd
    assert cheap.cost_per_iteration_usd < fast.cost_per_iteration_usd or cheap.throughput_iters_per_s == fast.throughput_iters_per_s
    # a spending-rate cap below the fastest plan's rate
    cap = fast.cost_per_hour_usd * 0.5
    capped = plan_job(make_context(job, cluster), PlanOptions(max_stages=4, constraints=Constraints(max_cost_per_hour=cap))).estimate
    assert capped.cost_per_hour_usd <= cap
    # a throughput floor for the cost objective
    floor = (cheap.throughput_iters_per_s + fast.throughput_iters_per_s) / 2
    floored = plan_job(make_context(job, cluster), PlanOptions(objective=Objective.COST, max_stages=4,
                                                               constraints=Constraints(min_throughput=floor))).estimate
    assert floored.throughput_iters_per_s >= floor
    assert floored.cost_per_iteration_usd >= cheap.cost_per_iteration_usd


def test_no_state_leaks_between_calls():
    job = JobSpec(model="opt-350m", global_batch_size=256)
    big = ClusterSpec(zones={"us-central1-a": {"A100-40": 32}})
    small = big.with_zones({"us-central1-a": {"A100-40": 8}})
    first = plan_job(make_context(job, big)).plan.to_dict()
    second = plan_job(make_context(job, small)).plan
    assert second.world_size <= 8
    assert second.to_dict() == plan_job(make_context(job, small)).plan.to_dict()
    assert plan_job(make_context(job, big)).plan.to_dict() == first


def test_infeasible_memory_names_the_numbers():
    job = JobSpec(model="opt-30b", global_batch_size=64)
    cluster = ClusterSpec(zones={"us-central1-a": {"T4": 4}}, gpus_per_node={"T4": 4})
    with pytest.raises(InfeasibleError, match=r"opt-30b needs \d+\.\d GB per GPU at best without memory options and"
                                              r" \d+\.\d GB with full recomputation, SP and ZeRO-3 over 1 replicas .*"
                                              r"largest GPU offered \(T4\) has 17\.2 GB \(15\.5 GB usable with the 10% memory margin\);"
                                              r" full recomputation, SP and ZeRO-3"
                                              r" over \d+ replicas \(\d+ T4, TP 4, 2 stages\) would make it fit"):
        plan_job(make_context(job, cluster), PlanOptions(max_stages=2))
    # a head whose logits alone outgrow the GPU: nothing helps
    wide = JobSpec(model={"name": "wide", "num_blocks": 2, "hidden_size": 1024, "num_heads": 16, "vocab_size": 256000,
                          "max_sequence_length": 65536}, global_batch_size=4)
    with pytest.raises(InfeasibleError, match=r"wide needs .* and no memory option makes it fit"):
        plan_job(make_context(wide, cluster), PlanOptions(max_stages=2))


def test_infeasible_constraint_names_the_binding_limit():
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}})
    job = JobSpec(model="opt-350m", global_batch_size=256)
    with pytest.raises(InfeasibleError, match=r"no plan meets at least 1e\+06 iterations/s: the fastest plan reaches"):
        plan_job(make_context(job, cluster), PlanOptions(constraints=Constraints(min_throughput=1e6)))


def test_no_gpus_is_infeasible():
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 0}})
    with pytest.raises(InfeasibleError, match="no GPUs"):
        plan_job(make_context(TINY, cluster))


def test_full_search_is_never_worse_than_paper_and_homogeneous():
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 16, "V100-16": 32}})
    job = JobSpec(model="opt-350m", global_batch_size=256)
    ctx = make_context(job, cluster)
    full = plan_job(ctx, PlanOptions(max_stages=4)).best_closed.closed_time_s
    for space in (SearchSpace.PAPER, SearchSpace.HOMOGENEOUS):
        other = plan_job(make_context(job, cluster), PlanOptions(search=space, max_stages=4)).best_closed.closed_time_s
        assert full <= other * (1 + 1e-9)


def test_homogeneous_search_uses_one_gpu_type_and_zone():
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 8, "V100-16": 16}, "us-central1-b": {"A100-40": 8}})
    plan = plan_job(make_context(JobSpec(model="opt-350m", global_batch_size=128), cluster),
                    PlanOptions(search=SearchSpace.HOMOGENEOUS, max_stages=4)).plan
    assert len({(r.gpu, r.zone) for p in plan.pipelines for r in p.replicas}) == 1
    assert len({p.microbatches for p in plan.pipelines}) == 1


def test_paper_search_uses_even_split_equal_shares_one_tp_per_type():
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 8, "V100-16": 16}})
    plan = plan_job(make_context(JobSpec(model="opt-350m", global_batch_size=128), cluster),
                    PlanOptions(search=SearchSpace.PAPER, max_stages=4)).plan
    sizes = [b - a for a, b in plan.stages]
    assert max(sizes) - min(sizes) <= 1
    assert len({p.microbatches for p in plan.pipelines}) == 1
    for g in {r.gpu for p in plan.pipelines for r in p.replicas}:
        assert len({r.tp for p in plan.pipelines for r in p.replicas if r.gpu == g}) == 1


def test_builtin_example_plans_and_fits():
    result = plan_job(make_context(EXAMPLE_JOB, EXAMPLE_CLUSTER))
    assert result.estimate.fits_in_memory
    assert _usage_ok(result.plan, EXAMPLE_CLUSTER)
    assert result.plan.global_batch_size == EXAMPLE_JOB.global_batch_size


def test_parallel_search_finds_the_same_best_plan(monkeypatch):
    import sailor.planner as planner

    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 24, "V100-16": 24}})
    job = JobSpec(model="opt-350m", global_batch_size=256)
    monkeypatch.setattr(planner, "PARALLEL_MIN_GPUS", 10**9)
    seq = plan_job(make_context(job, cluster), PlanOptions(max_stages=4))
    monkeypatch.setattr(planner, "PARALLEL_MIN_GPUS", 1)
    assert planner._workers(make_context(job, cluster), 8) >= 1
    par = plan_job(make_context(job, cluster), PlanOptions(max_stages=4))
    assert par.best_closed.closed_time_s == pytest.approx(seq.best_closed.closed_time_s, rel=1e-12)
    assert par.estimate.iteration_time_s == pytest.approx(seq.estimate.iteration_time_s, rel=1e-12)


def test_too_few_gpus_for_one_pipeline_is_infeasible_not_a_hang():
    job = JobSpec(model="opt-30b", global_batch_size=256)
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}})
    with pytest.raises(InfeasibleError, match=r"opt-30b needs at least \d+ A100-40 GPUs in one zone .* the most any zone offers is 8"):
        plan_job(make_context(job, cluster), PlanOptions(max_stages=8))


def _without_memory_options(plan: Plan) -> Plan:
    d = plan.to_dict(with_specs=False)
    d.pop("memory", None)
    return Plan.model_validate(d)


@pytest.mark.parametrize("job, gpu, n", [
    # on 64 A100-40s 8 stages of TP 4 fit without options (34 GB of 40); on 32 the fastest plan shards
    (JobSpec(model="opt-30b", global_batch_size=256, precision="bf16"), "A100-40", 32),
    (JobSpec(model="llama-3-8b", global_batch_size=64, sequence_length=8192, precision="bf16"), "L4", 16),
])
def test_large_jobs_get_plans_with_the_memory_options_they_need(job, gpu, n):
    cluster = ClusterSpec(zones={"us-central1-a": {gpu: n}})
    result = plan_job(make_context(job, cluster))
    plan = result.plan
    assert result.estimate.fits_in_memory and _usage_ok(plan, cluster)
    assert any(not plan.stage_memory(i).is_default for i in range(plan.num_stages))
    # the options are needed: the same layout without them runs out of memory
    assert not simulate(_without_memory_options(plan), make_context(job, cluster)).fits_in_memory
    for i in range(plan.num_stages):
        mem = plan.stage_memory(i)
        assert mem.zero == 0 or len(plan.pipelines) > 1  # ZeRO only with replicas to shard over
        assert not mem.sequence_parallel or all(p.replicas[i].tp > 1 for p in plan.pipelines)
