"""The planner's expert-parallel dimension (`sailor.planner.experts`, issue #30 item 5): the EP degrees
and placements it tries, the narrower-TP shapes on the same GPUs, the plans it returns for an MoE
model (EP weighed against the best plan at EP 1), and what `sailor plan` says about them."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.catalog import LinkClass
from sailor.model.moe import MoE
from sailor.model.spec import ModelSpec
from sailor.plan.spec import Plan
from sailor.planner import PlanOptions, plan_job
from sailor.planner.experts import _span, ep_degrees, expert_variants, explain, narrower_tp, speed_placement
from sailor.planner.schedules import fits
from sailor.planner.space import sp_possible
from sailor.simulator import make_context, placed_slots, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

A, B = "us-central1-a", "us-central1-b"


def test_ep_degrees_are_the_powers_of_two_dividing_the_experts():
    assert ep_degrees(8) == [2, 4, 8]
    assert ep_degrees(6) == [2]
    assert ep_degrees(1) == []
    assert ep_degrees(128) == [2, 4, 8, 16, 32, 64, 128]


def test_speed_placement_by_hand():
    assert speed_placement([3.0, 1.0], 8) == ((0, 1, 2, 3, 4, 5), (6, 7))
    # 4/3 each: one each, the remainder to the first of the equal remainders
    assert speed_placement([1.0, 1.0, 1.0], 4) == ((0, 1), (2,), (3,))
    # the slow rank still holds one: exact shares 3.64 and 0.36
    assert speed_placement([10.0, 1.0], 4) == ((0, 1, 2), (3,))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.05, 20.0), min_size=1, max_size=8), st.integers(1, 64))
def test_speed_placement_places_every_expert_once_and_follows_speed(speeds, extra):
    E = len(speeds) + extra - 1
    placed = speed_placement(speeds, E)
    assert [e for ids in placed for e in ids] == list(range(E))  # each once, in id order
    assert all(len(ids) >= 1 for ids in placed)
    for p in range(len(speeds)):  # a faster rank never holds fewer than a slower one less one (rounding)
        for q in range(len(speeds)):
            if speeds[p] > speeds[q]:
                assert len(placed[p]) >= len(placed[q]) - 1


def _moe(num_blocks: int = 4) -> ModelSpec:
    return ModelSpec(name="moe", num_blocks=num_blocks, hidden_size=1024, num_heads=8, num_kv_heads=4,
                     ffn_hidden_size=2048, vocab_size=1000, max_sequence_length=1024, gated_mlp=True,
                     learned_positions=False, bias=False, rms_norm=True, tied_embeddings=False,
                     moe=MoE(num_experts=8, top_k=2, expert_ffn_size=1024))


def _plan(ctx, *, tp: int = 2, pipelines: int = 2, microbatches: int = 4, zero: int = 0, zones=(A,)) -> Plan:
    return Plan.model_validate({
        "micro_batch_size": 1, "stages": [[0, 3], [3, 6]], "memory": [{"zero": zero}, {"zero": zero}],
        "pipelines": [{"microbatches": microbatches,
                       "replicas": [{"stage": i, "gpu": "H100-80", "zone": zones[j % len(zones)], "tp": tp}
                                    for i in range(2)]} for j in range(pipelines)]}).with_specs(ctx.job, ctx.cluster)


def _ctx(model: ModelSpec | None = None, *, gpus: int = 8, zones=(A,), batch: int = 8) -> object:
    job = JobSpec(model=model or _moe(), global_batch_size=batch, sequence_length=512, precision="bf16")
    return make_context(job, ClusterSpec(zones={z: {"H100-80": gpus} for z in zones}, gpus_per_node={"H100-80": 8}))


def test_narrower_tp_keeps_the_gpus_and_the_batch():
    ctx = _ctx()
    plan = _plan(ctx, tp=4, pipelines=1, microbatches=8)
    d = narrower_tp(plan, 2)
    assert [p["microbatches"] for p in d["pipelines"]] == [4, 4]
    assert [[r["tp"] for r in p["replicas"]] for p in d["pipelines"]] == [[2, 2], [2, 2]]
    shaped = Plan.model_validate(d)
    assert shaped.world_size == plan.world_size and shaped.global_batch_size == plan.global_batch_size
    assert narrower_tp(_plan(ctx, tp=4, pipelines=1, microbatches=7), 2) is None  # 7 micro-batches do not split
    assert narrower_tp(plan, 8) is None  # TP 4 does not divide by 8


def test_narrower_tp_can_split_the_micro_batch_instead():
    # TP 4, micro-batch 2, 8 micro-batches -> two pipelines at TP 2, each 8 micro-batches of 1
    ctx = _ctx(batch=16)
    body = _plan(ctx, tp=4, pipelines=1, microbatches=8).to_dict() | {"micro_batch_size": 2}
    plan = Plan.model_validate(body).with_specs(ctx.job, ctx.cluster)
    d = narrower_tp(plan, 2, split_micro_batch=True)
    assert d["micro_batch_size"] == 1 and [p["microbatches"] for p in d["pipelines"]] == [8, 8]
    assert [[r["tp"] for r in p["replicas"]] for p in d["pipelines"]] == [[2, 2], [2, 2]]
    shaped = Plan.model_validate(d)
    assert shaped.world_size == plan.world_size and shaped.global_batch_size == plan.global_batch_size == 16
    assert narrower_tp(plan, 4, split_micro_batch=True) is None  # micro-batch 2 does not split in 4
    # expert_variants offers both shapes at TP 2: micro-batch 2 (2 pipelines x 4) and 1 (2 x 8); at TP 1
    # only micro-batch 2 (4 pipelines x 2)
    got = {(p.pipelines[0].replicas[0].tp, len(p.pipelines), p.micro_batch_size, p.pipelines[0].microbatches)
           for p in expert_variants(plan, ctx)}
    assert got == {(2, 2, 2, 4), (2, 2, 1, 8), (1, 4, 2, 2)}  # 1 pipeline at TP 4: no EP group


def test_expert_variants_of_a_plan():
    ctx = _ctx()
    plan = _plan(ctx)  # TP 2, two pipelines
    got = sorted((p.pipelines[0].replicas[0].tp, len(p.pipelines), max((e.ep for e in p.experts), default=1),
                  p.stage_memory(0).zero) for p in expert_variants(plan, ctx))
    # TP 2 x 2 pipelines: EP 2; TP 1 x 4 pipelines: EP 1 (the narrower shape alone), 2 and 4; each at
    # the plan's ZeRO-0, at ZeRO-1 and at ZeRO-2
    assert got == sorted((tp, d, ep, z) for tp, d, ep in [(1, 4, 1), (1, 4, 2), (1, 4, 4), (2, 2, 2)] for z in (0, 1, 2))
    for p in expert_variants(plan, ctx):
        assert p.world_size == plan.world_size and p.global_batch_size == plan.global_batch_size
        assert all(e.placement is None for e in p.experts)  # one GPU type: the even split
    dense = _ctx(_moe().model_copy(update={"moe": None}))
    assert expert_variants(_plan(dense), dense) == []
    z3 = expert_variants(_plan(ctx, zero=3), ctx)  # ZeRO-3 stays ZeRO-3 (no level above it to try)
    assert len(z3) == 4 and all(p.stage_memory(0).zero == 3 for p in z3)


def test_an_ep_group_across_zones_spans_the_zone_link():
    ctx = _ctx(zones=(A, B), gpus=4)
    inside = [p for p in expert_variants(_plan(ctx, tp=1, zones=(A, A, B, B), pipelines=4, microbatches=2), ctx)
              if max(e.ep for e in p.experts) == 2 and len(p.pipelines) == 4]
    across = [p for p in expert_variants(_plan(ctx, tp=1, zones=(A, B), pipelines=4, microbatches=2), ctx)
              if max(e.ep for e in p.experts) == 2 and len(p.pipelines) == 4]
    assert _span(placed_slots(inside[0], ctx.cluster), ctx, 0, 2) is LinkClass.SAME_NODE
    assert _span(placed_slots(across[0], ctx.cluster), ctx, 0, 2) is LinkClass.SAME_REGION
    # the simulator charges the zone link where the all-to-all crosses it (the pipeline's passes), and
    # where the experts' gradient sync crosses it (EP rank q of the groups in A and in B): the planner
    # weighs the two
    a, b = simulate(across[0], ctx, event=False), simulate(inside[0], ctx, event=False)
    assert a.pipeline_s > 5 * b.pipeline_s
    assert b.gradient_sync_s > 5 * a.gradient_sync_s


def test_no_sequence_parallelism_offered_on_moe_blocks():
    # a plan with SP on a stage holding an MoE block is refused (Plan.check_against): the planner's test
    ctx = _ctx()
    moe = [layer for layer in range(ctx.job.model.num_layers) if ctx.job.model.is_moe_block(layer)]
    assert moe  # blocks 1..4 are layers 1..4
    assert not sp_possible(ctx, 2, 0, 3) and not sp_possible(ctx, 2)
    assert sp_possible(ctx, 2, 0, 1) and sp_possible(ctx, 2, 5, 6)  # the embedding, the head
    assert not sp_possible(ctx, 1, 0, 1)  # SP needs TP > 1
    dense = _ctx(_moe().model_copy(update={"moe": None}))
    assert sp_possible(dense, 2, 0, 3) and sp_possible(dense, 2)


@pytest.fixture(scope="module")
def mixtral():
    job = JobSpec(model="mixtral-8x7b", global_batch_size=256, sequence_length=4096, precision="bf16")
    ctx = make_context(job, ClusterSpec(zones={A: {"H100-80": 64}}, gpus_per_node={"H100-80": 8}))
    return ctx, plan_job(ctx, PlanOptions())


def test_the_planner_weighs_ep_against_the_best_plan_at_ep1(mixtral):
    ctx, res = mixtral
    assert max(e.ep for e in res.plan.experts) > 1  # Mixtral on H100s: EP pays
    flat = res.best_without_experts
    assert flat is not None and not flat.plan.experts
    assert res.estimate.iteration_time_s < flat.estimate.iteration_time_s
    assert fits(res.estimate, dataclasses.replace(ctx, memory_margin=PlanOptions().memory_margin, memo={}))
    # what the planner returns is what the simulator says of it
    assert res.estimate.iteration_time_s == pytest.approx(simulate(res.plan, ctx).iteration_time_s, rel=1e-9)


def test_sailor_plan_says_where_the_experts_sit_and_why(mixtral):
    ctx, res = mixtral
    x = explain(res.plan, ctx, 1.0 / res.best_without_experts.estimate.iteration_time_s)
    lines = x.lines()
    ep = max(e.ep for e in res.plan.experts)
    assert lines[0].startswith(f"experts: stages 0-{res.plan.num_stages - 1} EP {ep}: {8 // ep} on H100-80 per EP rank")
    assert "one node" in lines[0]  # EP groups of consecutive pipelines sit on one 8-GPU node
    assert f"the best plan found at EP 1 runs {1.0 / res.best_without_experts.estimate.iteration_time_s:.4g}" in lines[1]
    # the same in fields: every stage at EP ep, EP rank q holding the even split's 8/ep experts
    assert [(stage.ep, stage.link) for stage in x.stages] == [(ep, LinkClass.SAME_NODE)] * res.plan.num_stages
    assert [r.expert_ids for r in x.stages[0].ranks] == [tuple(range(q * 8 // ep, (q + 1) * 8 // ep)) for q in range(ep)]
    assert (x.flat_iters_per_s is None) != (x.flat_oom is None) and x.best_variant is None


def test_the_explanation_of_an_uneven_placement_on_two_gpu_types():
    # pipeline 0 on H100-80, pipeline 1 on A100-80: one EP group of 2, EP rank 0 (H100) holding
    # experts 0-5, EP rank 1 (A100) experts 6 and 7; the two types sit on different nodes of zone A
    ctx = make_context(JobSpec(model=_moe(), global_batch_size=8, sequence_length=512, precision="bf16"),
                       ClusterSpec(zones={A: {"H100-80": 8, "A100-80": 8}}, gpus_per_node={"H100-80": 8, "A100-80": 8}))
    body = {"micro_batch_size": 1, "stages": [[0, 3], [3, 6]],
            "experts": [{"ep": 2, "placement": [[0, 1, 2, 3, 4, 5], [6, 7]]}] * 2,
            "pipelines": [{"microbatches": 4, "replicas": [{"stage": i, "gpu": g, "zone": A, "tp": 1} for i in range(2)]}
                          for g in ("H100-80", "A100-80")]}
    plan = Plan.model_validate(body).with_specs(ctx.job, ctx.cluster)
    x = explain(plan, ctx, 100.0)
    got = json.loads(json.dumps(x.to_dict()))
    assert got["num_experts"] == 8
    assert got["stages"][1] == {"stage": 1, "ep": 2, "all_to_all_link": "same_zone", "ranks": [
        {"ep_rank": 0, "experts": 6, "expert_ids": [0, 1, 2, 3, 4, 5], "gpus": ["H100-80"]},
        {"ep_rank": 1, "experts": 2, "expert_ids": [6, 7], "gpus": ["A100-80"]}]}
    flat = Plan.model_validate({k: v for k, v in body.items() if k != "experts"})
    assert got["iters_per_s"] == pytest.approx(1.0 / simulate(plan, ctx, event=False).iteration_time_s, rel=1e-12)
    assert got["ep1"] == {"best_found_iters_per_s": 100.0, "same_shape_oom": None, "same_shape_iters_per_s":
                          pytest.approx(1.0 / simulate(flat, ctx, event=False).iteration_time_s, rel=1e-12)}
    assert got["best_ep_variant"] is None
    assert x.lines()[0] == ("experts: stages 0-1 EP 2: 2 on A100-80, 6 on H100-80 per EP rank; each EP group of 2"
                            " replicas sits on nodes of one zone")


def test_the_explanation_of_a_plan_at_ep1_names_its_best_ep_variant():
    ctx = _ctx()
    plan = _plan(ctx)  # TP 2 x 2 pipelines at EP 1
    x = explain(plan, ctx)
    assert [(stage.ep, stage.link, len(stage.ranks[0].expert_ids)) for stage in x.stages] == [(1, None, 8)] * 2
    rates = [1.0 / e.iteration_time_s for p in expert_variants(plan, ctx)
             if fits(e := simulate(p, ctx, event=False), ctx)]
    v = x.to_dict()["best_ep_variant"]
    assert rates and v["iters_per_s"] == max(rates)
    assert v["ep"] in (2, 4) and v["tp"] in (1, 2) and v["all_to_all_link"] == "same_node"  # 8 GPUs a node
    assert x.to_dict()["ep1"]["same_shape_iters_per_s"] is None  # the plan is its own EP-1 shape


def test_sailor_plan_json_carries_the_explanation_in_fields(tmp_path, monkeypatch, capsys):
    from sailor.cli import main
    ctx = _ctx(gpus=4)
    (tmp_path / "job.json").write_text(json.dumps(ctx.job.to_dict()))
    (tmp_path / "cluster.json").write_text(json.dumps(ctx.cluster.to_dict()))
    monkeypatch.setattr(sys, "argv", ["sailor", "plan", "--job", str(tmp_path / "job.json"), "--cluster",
                                      str(tmp_path / "cluster.json"), "--json"])
    with pytest.raises(SystemExit) as e:
        main()
    out = json.loads(capsys.readouterr().out)
    assert e.value.code == 0
    plan, x = Plan.model_validate(out["plan"]), out["expert_parallelism"]
    assert [stage["ep"] for stage in x["stages"]] == [plan.stage_experts(i).ep for i in range(plan.num_stages)]
    for i, stage in enumerate(x["stages"]):
        ex = plan.stage_experts(i)
        assert [r["expert_ids"] for r in stage["ranks"]] == [list(ex.held(q, 8)) for q in range(ex.ep)]
        assert all(r["gpus"] == ["H100-80"] for r in stage["ranks"])
        assert stage["all_to_all_link"] == ("same_node" if ex.ep > 1 else None)  # 4 GPUs, one 8-GPU node
    assert x["iters_per_s"] == pytest.approx(1.0 / simulate(plan, ctx, event=False).iteration_time_s, rel=1e-9)
    margin = dataclasses.replace(ctx, memory_margin=PlanOptions().memory_margin, memo={})  # as `sailor plan` judges
    assert out["experts"] == explain(plan, margin, x["ep1"]["best_found_iters_per_s"]).lines()  # the text beside them
    assert max(stage["ep"] for stage in x["stages"]) > 1  # (EP pays here as on 8 GPUs)
