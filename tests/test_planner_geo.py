"""Planner across zones and regions, hand-computed: a job one region cannot hold spans regions (pipeline
parallelism across regions, egress in the estimate); a job one region holds stays in it; data
parallelism across regions is taken when it wins (a large batch), not when it loses.

The setting: a 4-layer model (embedding, 2 blocks, untied head) of which one V100-16 holds half
(emb + block or block + head: about 10 GB of weights, gradients and Adam states) but not all (21 GB);
one GPU per node (TP 1 only); layer times given by hand (emb and head 0.1 s forward, 0.2 s backward;
each block 1.0 s and 2.0 s), no optimizer time, no calibration; links given per class. So the only
2-stage partition that fits is [0, 2) + [2, 4), each stage f = 1.1 s, b = 2.2 s, and the 1F1B time of
m micro-batches over a boundary of c seconds is (closed form = event simulation on uniform stages)

    T(m) = 2·(f + b) + 2·c + (m - 1)·(f + b + 2·c).
"""

from __future__ import annotations

import numpy as np
import pytest

from sailor.catalog import LinkClass
from sailor.perf.profile_lookup import Profiles
from sailor.planner import PlanOptions, SearchSpace, plan_job
from sailor.simulator import make_context
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

MODEL = {"name": "geo4", "num_blocks": 2, "hidden_size": 6144, "num_heads": 48, "vocab_size": 32000,
         "max_sequence_length": 512, "tied_embeddings": False}
F, B = 1.1, 2.2  # per stage and micro-batch (s): emb/head 0.1 + 0.2, block 1.0 + 2.0
ZA, ZW = "us-central1-a", "us-west1-b"  # two regions of one continent
ACT_BYTES = 12_582_912  # 1 x 512 x 6144 x 4: the activation crossing the boundary (fp32, micro-batch 1)
# links: inside a zone an activation takes 0.01 s; across regions 2 s latency + 0.1 s of bytes
NET = {"same_zone": {"latency_s": 0.0, "bandwidth_bytes_per_s": ACT_BYTES / 0.01},
       "same_continent": {"latency_s": 2.0, "bandwidth_bytes_per_s": ACT_BYTES / 0.1}}
C_ZONE, C_CROSS = 0.01, 2.1
ALPHA_CROSS, BETA_CROSS = 2.0, ACT_BYTES / 0.1
ALPHA_ZONE, BETA_ZONE = 0.0, ACT_BYTES / 0.01


def _ctx(global_batch: int, zones: dict, net: dict = NET, provider: str | list[str] = "gcp"):
    # DeepSpeed's whole sync after the pipeline (`sync.stage_sync`), so the hand figures below are
    # one ring all-reduce per stage; Sailor's overlapped buckets are checked in test_simulator*.py
    job = JobSpec(model=MODEL, global_batch_size=global_batch, sequence_length=512, framework="deepspeed")
    cluster = ClusterSpec(provider=provider, zones=zones, gpus_per_node={"V100-16": 1}, network=net)
    layers = np.array([[0.1, 0.2], [1.0, 2.0], [1.0, 2.0], [0.1, 0.2]])
    prof = Profiles(model="geo4", sequence_length=512, precision="fp32", times={("V100-16", 1): {1: layers}},
                    optimizer_s_per_param={"V100-16": 0.0}, activation_bytes={1: np.full(4, 1e6)})
    return make_context(job, cluster, prof, calibration={})


def pipeline_time(m: int, c: float) -> float:
    return 2 * (F + B) + 2 * c + (m - 1) * (F + B + 2 * c)


def _regions(plan, cluster) -> set[str]:
    return {cluster.prov.region(r.zone) for p in plan.pipelines for r in p.replicas}


def test_job_one_region_cannot_hold_spans_regions_with_egress():
    ctx = _ctx(4, {ZA: {"V100-16": 1}, ZW: {"V100-16": 1}})
    assert ctx.job.model.num_layers == 4
    r = plan_job(ctx, PlanOptions(max_mbs=1, schedules=False))
    plan, est = r.plan, r.estimate
    assert plan.stages == ((0, 2), (2, 4)) and len(plan.pipelines) == 1
    assert {x.zone for x in plan.pipelines[0].replicas} == {ZA, ZW}  # one stage in each region
    assert est.iteration_time_s == pytest.approx(pipeline_time(4, C_CROSS), rel=1e-9)  # 33.3 s
    # every micro-batch sends its activation forward and its gradient back across the regions
    moved = 2 * ACT_BYTES * 4
    assert est.cross_zone_bytes == pytest.approx(moved, rel=1e-9)
    egress = moved / 1e9 * ctx.cluster.prov.egress_usd_per_gb[LinkClass.SAME_CONTINENT]
    assert est.egress_per_iteration_usd == pytest.approx(egress, rel=1e-9)
    assert est.cost_per_iteration_usd == pytest.approx(2 * 2.859998 * est.iteration_time_s / 3600 + egress, rel=1e-9)
    assert r.exact


def test_job_one_region_holds_stays_in_it():
    ctx = _ctx(4, {ZA: {"V100-16": 2}, ZW: {"V100-16": 2}})
    r = plan_job(ctx, PlanOptions(max_mbs=1, schedules=False))
    stays = pipeline_time(4, C_ZONE)  # one pipeline in one zone: 16.58 s
    # the alternatives by hand: one pipeline across the regions 33.3 s; two pipelines whose stage 0
    # sits in one region and stage 1 in the other (data parallelism inside each region) 18.3 s of
    # pipeline + the in-zone all-reduce of a stage; one pipeline per region 9.94 s + a cross-region
    # all-reduce of a 2.6 GB stage gradient (25 s)
    grad = max(ctx.stage_params(1, a, e) * 4 for a, e in ((0, 2), (2, 4)))
    assert pipeline_time(2, C_CROSS) + 2 * (ALPHA_ZONE + grad / 2 / BETA_ZONE) > stays
    assert pipeline_time(2, C_ZONE) + 2 * (ALPHA_CROSS + grad / 2 / BETA_CROSS) > stays
    assert len(_regions(r.plan, ctx.cluster)) == 1 and len(r.plan.pipelines) == 1
    assert r.estimate.iteration_time_s == pytest.approx(stays, rel=1e-9)
    assert r.estimate.egress_per_iteration_usd == 0.0
    assert r.exact


def test_pipelines_across_regions_with_data_parallelism_inside_each():
    """With a fast cross-region link, two pipelines whose stage 0 sits in one region and stage 1 in
    the other beat one pipeline in one region: each stage all-reduces inside its zone (the published
    planner's shape: pipelines across regions, data parallelism within one)."""
    net = dict(NET, same_continent={"latency_s": 0.1, "bandwidth_bytes_per_s": BETA_CROSS})
    ctx = _ctx(4, {ZA: {"V100-16": 2}, ZW: {"V100-16": 2}}, net)
    r = plan_job(ctx, PlanOptions(max_mbs=1, schedules=False))
    plan = r.plan
    grad = max(ctx.stage_params(1, a, e) * 4 for a, e in plan.stages)
    expected = pipeline_time(2, 0.2) + 2 * (ALPHA_ZONE + grad / 2 / BETA_ZONE)
    assert expected < pipeline_time(4, C_ZONE)
    assert len(plan.pipelines) == 2 and all({x.zone for x in p.replicas} == {ZA, ZW} for p in plan.pipelines)
    for i in range(2):  # each stage's two replicas share a zone
        assert len({p.replicas[i].zone for p in plan.pipelines}) == 1
    assert r.estimate.iteration_time_s == pytest.approx(expected, rel=1e-9)
    assert r.estimate.egress_per_iteration_usd > 0


def test_data_parallelism_across_regions_when_it_wins():
    ctx = _ctx(64, {ZA: {"V100-16": 2}, ZW: {"V100-16": 2}})
    r = plan_job(ctx, PlanOptions(max_mbs=1, schedules=False))
    plan, est = r.plan, r.estimate
    # one pipeline per region, 32 micro-batches each, stages all-reduced across the regions: a ring of
    # two replicas takes 2 steps of half the gradient, each alpha + bytes / beta
    sync = max(2 * (ALPHA_CROSS + ctx.stage_params(1, a, e) * 4 / 2 / BETA_CROSS) for a, e in plan.stages)
    expected = pipeline_time(32, C_ZONE) + sync
    alone = pipeline_time(64, C_ZONE)
    assert expected < alone  # the hand numbers: 109.5 + 24.8 s against 215.8 s
    assert _regions(plan, ctx.cluster) == {"us-central1", "us-west1"} and len(plan.pipelines) == 2
    assert all(len({x.zone for x in p.replicas}) == 1 for p in plan.pipelines)  # pipelines stay in a zone
    assert sorted(p.microbatches for p in plan.pipelines) == [32, 32]
    assert est.iteration_time_s == pytest.approx(expected, rel=1e-9)
    # ring egress: both ring edges cross regions and each carries the whole stage gradient (2(D-1)/D = 1)
    price = ctx.cluster.prov.egress_usd_per_gb[LinkClass.SAME_CONTINENT]
    egress = sum(2 * ctx.stage_params(1, a, e) * 4 / 1e9 * price for a, e in plan.stages)
    assert est.egress_per_iteration_usd == pytest.approx(egress, rel=1e-9)


def _mixed_ctx(zones: dict, batch: int):
    """The 4-layer model where only a big-memory GPU holds the first stage: the embedding keeps 10 GB
    of activations per sample (twice that with two micro-batches in flight), more than a V100-16
    has, while a V100 holds the block and the head of stage [2, 4). The big GPU (A100-80 here) is
    given the slow layer times: emb 0.1 + 0.2 s, block 2.0 + 4.0 s, head 0.1 + 0.2 s; the V100
    block 1.0 + 2.0 s, head 0.1 + 0.2 s."""
    job = JobSpec(model=MODEL, global_batch_size=batch, sequence_length=512, framework="deepspeed")  # as `_ctx`
    cluster = ClusterSpec(zones=zones, gpus_per_node={"V100-16": 1, "A100-80": 1}, network=NET)
    slow = np.array([[0.1, 0.2], [2.0, 4.0], [2.0, 4.0], [0.1, 0.2]])
    fast = np.array([[0.1, 0.2], [1.0, 2.0], [1.0, 2.0], [0.1, 0.2]])
    prof = Profiles(model="geo4", sequence_length=512, precision="fp32",
                    times={("A100-80", 1): {1: slow}, ("V100-16", 1): {1: fast}},
                    optimizer_s_per_param={"V100-16": 0.0, "A100-80": 0.0},
                    activation_bytes={1: np.array([10e9, 1e6, 1e6, 1e6])})
    return make_context(job, cluster, prof, calibration={})


@pytest.mark.parametrize("zones, batch, pipelines", [({ZA: {"A100-80": 1, "V100-16": 3}}, 4, 1),    # exact mode
                                                     ({ZA: {"A100-80": 8, "V100-16": 40}}, 32, 8)])  # heuristic
def test_big_memory_gpu_takes_the_first_stage_when_memory_forces_it(zones, batch, pipelines):
    ctx = _mixed_ctx(zones, batch)
    r = plan_job(ctx, PlanOptions(max_stages=2, max_mbs=1, schedules=False))
    plan = r.plan
    assert plan.stages == ((0, 2), (2, 4)) and len(plan.pipelines) == pipelines
    for p in plan.pipelines:
        assert [x.gpu for x in p.replicas] == ["A100-80", "V100-16"]
    m = max(p.microbatches for p in plan.pipelines)
    # stage 0 on the A100-80: 0.3 + 6.0 s, stage 1 on a V100: 3.0 + 0.3 s, both in one zone; the
    # closed form (the planner's score) pays the slow stage for every further micro-batch
    expected = (6.3 + 3.3) + 2 * C_ZONE + (m - 1) * (6.3 + 2 * C_ZONE)
    D = len(plan.pipelines)  # and, with several pipelines, each stage's ring all-reduce in the zone
    expected += max(2 * (D - 1) * (ALPHA_ZONE + ctx.stage_params(1, a, e) * 4 / D / BETA_ZONE) for a, e in plan.stages)
    assert r.best_closed.closed_time_s == pytest.approx(expected, rel=1e-9)
    assert r.estimate.iteration_time_s <= expected
    # pipelines of one GPU type: the A100-80s alone (the V100s cannot hold stage 0), 12.6 s a micro-batch
    single = plan_job(_mixed_ctx(zones, batch), PlanOptions(max_stages=2, max_mbs=1, search=SearchSpace.HOMOGENEOUS)).estimate
    assert all(x.gpu == "A100-80" for x in single.replicas)
    assert r.estimate.iteration_time_s < 0.7 * single.iteration_time_s


def test_paper_search_mixes_gpu_types_per_stage_as_the_published_dp():
    """The published space assigns each stage's replicas to GPU types; a V100 that cannot hold the
    first stage still serves the second."""
    plan = plan_job(_mixed_ctx({ZA: {"A100-80": 1, "V100-16": 3}}, 4),
                    PlanOptions(max_stages=2, max_mbs=1, search=SearchSpace.PAPER)).plan
    assert [[r.gpu for r in p.replicas] for p in plan.pipelines] == [["A100-80", "V100-16"]]


def test_the_planner_takes_the_schedule_that_pays_on_the_same_gpus():
    """The two-region pipeline of the first test: 1F1B idles through (P-1) micro-batch slots and
    blocks on the slow cross-region link; the schedule search keeps the stages and GPUs and takes a
    schedule the simulator finds faster, scored exactly as `simulate` scores the plan it returns."""
    from sailor.plan.spec import ScheduleKind
    from sailor.planner.schedules import schedule_variants
    from sailor.simulator import simulate

    ctx = _ctx(4, {ZA: {"V100-16": 1}, ZW: {"V100-16": 1}})
    plain = plan_job(ctx, PlanOptions(max_mbs=1, schedules=False))
    assert plain.plan.schedule.kind is ScheduleKind.ONE_F_ONE_B
    variants = schedule_variants(plain.plan)
    # ZB-H1, and interleaving only up to each stage's 2 layers (v = 2: four 1-layer chunks)
    assert [(p.schedule.kind, p.virtual_stages) for p in variants] == [(ScheduleKind.ZB_H1, 1),
                                                                      (ScheduleKind.INTERLEAVED, 2)]
    assert variants[1].stages == ((0, 1), (1, 2), (2, 3), (3, 4))  # chunk k on stage k mod 2
    assert variants[1].stage_chunks(0) == ((0, 1), (2, 3))  # stage 0 runs chunks 0 and 2
    best = plan_job(ctx, PlanOptions(max_mbs=1))
    assert best.plan.schedule.kind is not ScheduleKind.ONE_F_ONE_B
    assert best.plan.gpu_usage() == plain.plan.gpu_usage()
    assert best.estimate.iteration_time_s < plain.estimate.iteration_time_s
    assert best.estimate.iteration_time_s == pytest.approx(simulate(best.plan, ctx).iteration_time_s, rel=1e-12)
    assert best.estimate.iteration_time_s == min(simulate(p, ctx).iteration_time_s for p in [plain.plan, *variants])
    assert schedule_variants(best.plan) == []  # a plan that names its schedule is kept as it is
