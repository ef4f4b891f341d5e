"""Expert parallelism (issue #30, `plan.experts`): the plan's EP degree and placement validated with one
line naming the field, defaults that leave every plan as it was, the ranks' EP and expert gradient-sync
groups against hand-derived ones, the optimizer's buckets of a rank holding some of the experts, and
(integration, up to 4 processes) training on plans with EP 2 and EP 4, with TP, ZeRO, recomputation,
pipelines and uneven placements, whose loss equals the single-process run's within 1e-5 at every step."""

from __future__ import annotations

import json
import sys

import pytest

from sailor.core.errors import SailorInputError
from sailor.core.schema import parse_model
from sailor.model.moe import MoE
from sailor.model.spec import ModelSpec
from sailor.plan.spec import Plan
from sailor.runtime.topology import derive_topology
from sailor.specs.job import JobSpec

E = 4


def _spec(sparse: bool = True, **moe) -> ModelSpec:
    return ModelSpec(name="m", num_blocks=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                     vocab_size=300, max_sequence_length=64, gated_mlp=True, learned_positions=False, bias=False,
                     rms_norm=True, tied_embeddings=False,
                     moe=MoE(num_experts=E, top_k=2, expert_ffn_size=32, **moe) if sparse else None)


def _rep(stage: int = 0, tp: int = 1) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


def _plan(experts: list[dict] | None, tps: tuple[int, ...] = (1, 1), mbs: tuple[int, ...] | None = None,
          stages: list | None = None) -> dict:
    stages = stages or [[0, 4]]
    mbs = mbs or (4 // len(tps),) * len(tps)
    d = {"micro_batch_size": 2, "stages": stages,
         "pipelines": [{"microbatches": m, "replicas": [_rep(i, t) for i in range(len(stages))]}
                       for t, m in zip(tps, mbs)]}
    return d | ({"experts": experts} if experts is not None else {})


def _refused(plan: dict, field: str, match: str, model: ModelSpec | None = None) -> None:
    gbs = plan["micro_batch_size"] * sum(p["microbatches"] for p in plan["pipelines"])
    with pytest.raises(SailorInputError, match=match) as e:
        parse_model(Plan, plan, "plan.json").check_against(JobSpec(model=model or _spec(), global_batch_size=gbs,
                                                                   sequence_length=32))
    assert e.value.field == field


@pytest.mark.parametrize("plan, field, match", [
    (_plan([{"ep": 2}, {}]), "experts", "2 entries for 1 stages"),
    (_plan([{"ep": 2}], tps=(1, 1, 1), mbs=(2, 1, 1)), "experts.0.ep", "ep 2 does not divide the plan's 3 pipelines"),
    (_plan([{"ep": 2}], tps=(1, 2)), "pipelines.1.replicas.0.tp", "have TP 1 and 2 there"),
    (_plan([{"ep": 2}], mbs=(3, 1)), "pipelines.1.microbatches", "run 3 and 1 micro-batches"),
    (_plan([{"imbalance": 1.5}]), "experts.0.imbalance", "imbalance 1.5 with ep 1"),
    (_plan([{"ep": 2, "placement": [[0, 1, 2, 3]]}]), "experts.0.placement", "1 EP ranks placed for ep 2"),
    (_plan([{"ep": 2, "placement": [[0, 1, 2, 3], []]}]), "experts.0.placement.1", "EP rank 1 holds no expert"),
    (_plan([{"ep": 2, "placement": [[0, 1], [1, 2, 3]]}]), "experts.0.placement.1", "expert 1 is placed twice"),
    (_plan([{"ep": 2, "placement": [[0, 1], [2]]}]), "experts.0.placement", "expert 3 is not placed"),
    (_plan([{"ep": 2, "placement": [[0, 1], [2, 3, 4]]}]), "experts.0.placement", "expert 4 does not exist"),
    (_plan([{"ep": 8}], tps=(1,) * 8, mbs=(1,) * 8), "experts.0.ep", "ep 8 exceeds the 4 experts"),
    (_plan([{"ep": 3}], tps=(1,) * 3, mbs=(1,) * 3), "experts.0.ep", "ep 3 does not divide the 4 experts"),
    (_plan([{}, {"ep": 2}], stages=[[0, 2], [2, 4]]), "experts.1.ep", "holds no mixture-of-experts block"),
])
def test_bad_expert_parallelism_is_refused_naming_the_field(plan, field, match):
    # (the last: block 1, layer 2, is dense, so stage 1 [2, 4) has no MoE block)
    _refused(plan, field, match, _spec(dense_blocks=(1,)) if field == "experts.1.ep" else None)


def test_ep_on_a_dense_model_is_refused():
    _refused(_plan([{"ep": 2}]), "experts.0.ep", "holds no mixture-of-experts block", _spec(sparse=False))


def _simulate_refused(plan: dict, tmp_path, monkeypatch, capsys, command: tuple[str, ...] = ("simulate",)) -> str:
    """`sailor simulate` (or `command`: the command, then options after the plan) of `plan` (written to
    plan.json): exit 2 and one stderr line, returned."""
    from sailor.cli import main

    (tmp_path / "plan.json").write_text(json.dumps(plan))
    monkeypatch.setattr(sys, "argv", ["sailor", command[0], str(tmp_path / "plan.json"), *command[1:]])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "plan.json" in err[0]
    return err[0]


def test_bad_placement_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    plan = _plan([{"ep": 2, "placement": [[0, 1], []]}]) | {"job": {"model": "tiny", "global_batch_size": 8}}
    line = _simulate_refused(plan, tmp_path, monkeypatch, capsys)
    assert "experts.0.placement.1" in line and "EP rank 1 holds no expert" in line


def test_an_imbalance_at_ep_1_exits_2_with_one_line_and_its_default_is_accepted(tmp_path, monkeypatch, capsys):
    plan = _plan([{"ep": 1, "imbalance": 2.0}]) | {"job": {"model": "tiny", "global_batch_size": 8}}
    line = _simulate_refused(plan, tmp_path, monkeypatch, capsys)
    assert "plan.json: experts.0.imbalance: imbalance 2.0 with ep 1" in line, line
    assert Plan.model_validate(_plan([{"ep": 1, "imbalance": 1.0}])).stage_experts(0).is_default
    assert Plan.model_validate(_plan([{"ep": 2, "imbalance": 2.0}])).stage_experts(0).imbalance == 2.0


def test_the_simulator_refuses_expert_parallelism_it_does_not_model(tmp_path, monkeypatch, capsys):
    job = {"model": _spec().model_dump(mode="json", exclude_defaults=True), "global_batch_size": 8,
           "sequence_length": 32}
    cluster = {"provider": "local", "zones": {"local": {"cpu": 4}}}
    plan = _plan([{"ep": 2}]) | {"job": job | {"framework": "deepspeed"}, "cluster": cluster}
    line = _simulate_refused(plan, tmp_path, monkeypatch, capsys)
    assert "experts.0.ep" in line and "does not model expert parallelism under DeepSpeed" in line


def test_sequence_parallelism_on_an_moe_stage_is_refused_by_the_plan():
    # stage 0 [0, 2) holds block 0 (MoE); stage 1 [2, 4) block 1 (dense) and the head
    two = {"stages": [[0, 2], [2, 4]], "pipelines": [{"microbatches": 2, "replicas": [_rep(0, 2), _rep(1, 2)]}] * 2}
    sparse_sp = _plan(None) | two | {"memory": [{"sequence_parallel": True}, {}]}
    _refused(sparse_sp, "memory.0.sequence_parallel", r"stage 0 \[0, 2\) holds mixture-of-experts blocks",
             _spec(dense_blocks=(1,)))
    dense_sp = _plan(None) | two | {"memory": [{}, {"sequence_parallel": True}]}
    parse_model(Plan, dense_sp, "plan.json").check_against(JobSpec(model=_spec(dense_blocks=(1,)), global_batch_size=8,
                                                                   sequence_length=32))


@pytest.mark.parametrize("command", [("simulate",), ("train", "--dry-run"),
                                     ("launch", "--backend", "torchrun", "--dry-run")])
def test_every_command_refuses_sequence_parallelism_on_an_moe_stage_in_one_line(tmp_path, monkeypatch, capsys,
                                                                                  command):
    job = {"model": _spec().model_dump(mode="json", exclude_defaults=True), "global_batch_size": 8,
           "sequence_length": 32}
    plan = _plan(None, tps=(2, 2)) | {"memory": [{"sequence_parallel": True}], "job": job,
                                      "cluster": {"provider": "local", "zones": {"local": {"cpu": 4}}}}
    line = _simulate_refused(plan, tmp_path, monkeypatch, capsys, command)
    assert "memory.0.sequence_parallel" in line and "holds mixture-of-experts blocks" in line, line


def test_defaults_leave_a_plan_unchanged():
    plain = Plan.model_validate(_plan(None, tps=(2, 1)))
    explicit = Plan.model_validate(_plan([{"ep": 1}], tps=(2, 1)))
    assert "experts" not in plain.to_dict() and "experts" not in explicit.to_dict()
    for a, b in zip(derive_topology(plain).roles, derive_topology(explicit).roles):
        assert a == b
        assert (a.ep_group, a.expert_block_groups, a.expert_stage_group) == ((a.rank,), a.block_groups, a.stage_group)
    assert derive_topology(plain).groups() == [(0, 1), (0, 2), (1, 2), (0, 1, 2)]  # TP, two blocks, the stage
    uneven = Plan.model_validate(_plan([{"ep": 2, "placement": [[3], [0, 2, 1]]}]))
    assert Plan.model_validate(uneven.to_dict()) == uneven  # the file round-trips
    assert uneven.stage_experts(0).held(1, E) == (0, 1, 2)
    assert Plan.model_validate(_plan([{"ep": 2}])).stage_experts(0).held(1, E) == (2, 3)  # the even split


def test_ranks_hold_their_experts_groups():
    # 4 pipelines of TP 2, 2, 1, 1 (ranks 0-1, 2-3, 4, 5), EP 2: EP groups {0, 1} and {2, 3}; the finest
    # sharding has 2 blocks. EP rank 0 is pipelines 0 and 2, EP rank 1 pipelines 1 and 3.
    topo = derive_topology(Plan.model_validate(_plan([{"ep": 2}], tps=(2, 2, 1, 1))))
    want = {  # rank: (EP rank, all-to-all group, expert block groups, expert stage group)
        0: (0, (0, 2), ((0, 4),), (0, 1, 4)), 1: (0, (1, 3), ((1, 4),), (0, 1, 4)),
        2: (1, (0, 2), ((2, 5),), (2, 3, 5)), 3: (1, (1, 3), ((3, 5),), (2, 3, 5)),
        4: (0, (4, 5), ((0, 4), (1, 4)), (0, 1, 4)), 5: (1, (4, 5), ((2, 5), (3, 5)), (2, 3, 5))}
    for r in topo.roles:
        assert (r.ep_rank, r.ep_group, r.expert_block_groups, r.expert_stage_group) == want[r.rank]
        assert r.stage_group == (0, 1, 2, 3, 4, 5)
        assert r.sync_groups("layers.1.mlp.experts.3.up.weight") == (r.expert_stage_group, r.expert_block_groups)
        assert r.sync_groups("layers.1.mlp.router.weight") == (r.stage_group, r.block_groups)
    groups = topo.groups()
    for g in [(0, 2), (1, 3), (4, 5), (0, 4), (2, 5), (0, 1, 4), (2, 3, 5)]:
        assert g in groups


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_ep_plans_neither_deadlock_nor_mismatch_under_nccl_rules(schedule):
    # the all-to-alls of both stages' EP groups, each in every real F and B, under ZeRO-2 (per-micro-
    # batch reduce-scatters in the expert groups too), on the step model of `comm_check`
    from sailor.runtime.comm_check import check_plan, op_collectives

    plan = Plan.model_validate(_plan([{"ep": 2, "placement": [[3], [0, 1, 2]]}, {"ep": 2}], mbs=(2, 2),
                                     stages=[[0, 2], [2, 4]]) | {"schedule": {"kind": schedule},
                                                                 "memory": [{"zero": 2}, {}]})
    report = check_plan(plan)
    assert report.ok and report.messages > 0, report
    role = derive_topology(plan).roles[0]
    assert ((0, 2), ("F", 0, 1)) in op_collectives(role, "F", 0, 1)


torch = pytest.importorskip("torch")


def test_a_rank_buckets_only_its_experts_with_their_holders():
    from sailor.runtime.buckets import build_buckets
    from sailor.runtime.worker import meta_stage

    # 4 pipelines of TP 1, EP 2 placed unevenly: EP rank 0 (pipelines 0, 2) holds expert 3, EP rank 1
    # (pipelines 1, 3) experts 0-2
    plan = Plan.model_validate(_plan([{"ep": 2, "placement": [[3], [0, 1, 2]]}], tps=(1, 1, 1, 1)))
    spec = _spec()
    for role in derive_topology(plan).roles:
        params = dict(meta_stage(spec, role).named_parameters())
        held = {int(n.split(".")[4]) for n in params if ".mlp.experts." in n}
        assert held == ({3} if role.ep_rank == 0 else {0, 1, 2})
        buckets = build_buckets(params, role, zero=1, sequence_parallel=False)
        for b in buckets:
            experts = [p for p in b.pieces if ".mlp.experts." in p.name]
            assert not experts or len(experts) == len(b.pieces)  # experts never share a bucket with others
            assert b.ranks == ((0, 2) if role.ep_rank == 0 else (1, 3)) if experts else (0, 1, 2, 3)
            assert b.shards == len(b.ranks)
        expert_numel = sum(b.numel for b in buckets if ".mlp.experts." in b.pieces[0].name)
        assert expert_numel == 2 * len(held) * 3 * 64 * 32  # two MoE blocks, held experts' SwiGLUs


# ---- training (integration) ---------------------------------------------------------------------------


def _train_ep(arch: str, body: dict, tmp_path):
    pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
    from test_hf_train import _train

    return _train(arch, body, tmp_path)


def _held_params(result, spec: ModelSpec, placement: list[list[int]], ep_of_pipeline) -> None:
    """Each rank's weights (fp32, ZeRO-0, one stage, TP 1) are the model's without the experts its EP
    rank does not hold."""
    from sailor.runtime.model import param_shapes

    shapes = param_shapes(spec)

    def numel(shape):
        n = 1
        for s in shape:
            n *= s
        return n

    events = [e for e in result.events if e["event"] == "memory"]
    assert events
    for e in events:
        held = set(placement[ep_of_pipeline(e["pipeline"])])
        want = sum(numel(s) for n, s in shapes.items()
                   if ".mlp.experts." not in n or int(n.split(".")[4]) in held)
        assert e["params"] == 4 * want, (e["rank"], e["params"], 4 * want)


@pytest.mark.integration
def test_ep2_with_an_uneven_placement_equals_the_single_process_run(tmp_path):
    # Mixtral (4 experts, top 2), one stage on 2 pipelines: EP rank 0 holds expert 3 alone, EP rank 1
    # experts 0-2 (sent in place order, not id order); each rank holds only its experts' weights
    placement = [[3], [0, 1, 2]]
    result, _, _, folder = _train_ep("mixtral", {
        "stages": [[0, 4]], "experts": [{"ep": 2, "placement": placement}],
        "pipelines": [{"microbatches": 2, "replicas": [_rep()]}] * 2}, tmp_path)
    from sailor.runtime.hf_weights import load_full_model
    _held_params(result, load_full_model(folder).spec, placement, lambda j: j)


@pytest.mark.integration
def test_ep2_with_tp2_recomputation_and_zero1_equals_the_single_process_run(tmp_path):
    # Qwen2-MoE (a gated shared expert): 2 pipelines of TP 2, EP 2 (the all-to-all pairs TP rank 0 of
    # both replicas, and TP rank 1 of both), every block recomputed in the backward
    _train_ep("qwen2_moe", {"stages": [[0, 4]], "experts": [{"ep": 2}],
                            "memory": [{"recompute": "full", "zero": 1}],
                            "pipelines": [{"microbatches": 2, "replicas": [_rep(0, 2)]}] * 2}, tmp_path)


@pytest.mark.integration
def test_ep4_under_zero2_equals_the_single_process_run(tmp_path):
    # Mixtral on 4 pipelines, one expert each; gradients reduce-scattered per micro-batch
    _train_ep("mixtral", {"stages": [[0, 4]], "experts": [{"ep": 4}], "memory": [{"zero": 2}],
                          "pipelines": [{"microbatches": 1, "replicas": [_rep()]}] * 4}, tmp_path)


@pytest.mark.integration
def test_two_ep_groups_sync_each_experts_gradients_under_zero3(tmp_path):
    # Qwen3-MoE on 4 pipelines, EP 2 unevenly: EP groups {0, 1} and {2, 3}; expert 3's gradient is
    # summed over pipelines 1 and 3 only, experts 0-2's over 0 and 2, the rest over all four (ZeRO-3:
    # the experts' weights sharded within their holders too)
    _train_ep("qwen3_moe", {"stages": [[0, 4]], "experts": [{"ep": 2, "placement": [[0, 1, 2], [3]]}],
                            "memory": [{"zero": 3, "recompute": "full"}],
                            "pipelines": [{"microbatches": 1, "replicas": [_rep()]}] * 4}, tmp_path)


PIPELINED = {
    # Mixtral on 2 stages x 2 pipelines under ZB-H1 (the all-to-all's backward in the input-gradient
    # pass, the experts' weight gradients in the deferred one), EP 2 on each stage, one uneven
    "zb-h1": ("mixtral", {"schedule": {"kind": "zb-h1"},
                          "experts": [{"ep": 2, "placement": [[3], [0, 1, 2]]}, {"ep": 2}]}),
    # Qwen3-MoE interleaved, one layer per chunk (stage 0 holds block 2, stage 1 block 1), ZeRO-1 and 3
    "interleaved": ("qwen3_moe", {"stages": [[0, 1], [1, 2], [2, 3], [3, 4]],
                                  "schedule": {"kind": "interleaved-1f1b", "virtual_stages": 2},
                                  "experts": [{"ep": 2}, {"ep": 2, "placement": [[1, 2, 3], [0]]}],
                                  "memory": [{"zero": 1}, {"zero": 3}]}),
}


@pytest.mark.integration
@pytest.mark.parametrize("schedule", list(PIPELINED))
def test_ep2_on_both_stages_of_a_pipeline_equals_the_single_process_run(schedule, tmp_path):
    arch, body = PIPELINED[schedule]
    _train_ep(arch, body | {"pipelines": [{"microbatches": 2, "replicas": [_rep(0), _rep(1)]}] * 2}, tmp_path)


@pytest.mark.integration
def test_a_checkpoint_saved_under_one_placement_resumes_under_another(tmp_path):
    # Checkpoints name each expert by its global index: two steps under EP 2 (expert 3 alone on EP
    # rank 0), saved, then two more under EP 4 (each expert on a rank of its own) from that checkpoint
    # train as one process does for four steps
    pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
    import numpy as np
    from hf_models import VOCAB, make_model

    from sailor.runtime.data import load_corpus
    from sailor.runtime.hf_weights import load_full_model
    from sailor.runtime.launcher import ExitStatus, launch
    from sailor.runtime.prepare import TrainOptions, prepare
    from sailor.runtime.reference import train_reference

    folder, data, ck = tmp_path / "mixtral", tmp_path / "train.bin", str(tmp_path / "ck")
    make_model("mixtral", folder)
    np.random.default_rng(0).integers(0, VOCAB, 20_000).astype(np.uint16).tofile(data)
    job = {"model": str(folder / "config.json"), "global_batch_size": 8, "sequence_length": 32}

    def run(experts: dict, pipelines: int, steps: int, **kw) -> list[dict]:
        plan, metrics = tmp_path / f"plan-{steps}.json", tmp_path / f"metrics-{steps}.jsonl"
        plan.write_text(json.dumps({"micro_batch_size": 2, "stages": [[0, 4]], "job": job, "experts": [experts],
                                    "pipelines": [{"microbatches": 4 // pipelines, "replicas": [_rep()]}] * pipelines}))
        result = launch(prepare(TrainOptions(plan=str(plan), steps=steps, data=str(data), metrics=str(metrics),
                                             checkpoint_dir=ck, timeout_s=60, **kw)), handle_signals=False)
        assert result.status is ExitStatus.DONE, result.message
        return [json.loads(line) for line in metrics.read_text().splitlines()]

    rows = run({"ep": 2, "placement": [[3], [0, 1, 2]]}, 2, 2, init_from=str(folder))
    rows += run({"ep": 4}, 4, 4, resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    losses, _ = train_reference(JobSpec(**job), steps=4, seed=0, corpus=load_corpus(data),
                                model=load_full_model(folder))
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-5)
