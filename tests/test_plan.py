"""Plan format: validation, consistency with job and cluster, rank layout, Sailor importer."""

import json
import warnings

import pytest

from sailor.core.errors import SailorInputError, SailorWarning
from sailor.model.spec import Recompute
from sailor.plan import load_plan, plan_from_dict
from sailor.plan.placement import node_blocks, pack_replicas, rank_layout
from sailor.plan.spec import Plan, StageMemory
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

JOB = JobSpec(model="tiny", global_batch_size=12)
CLUSTER = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}, "us-central1-b": {"V100-16": 8}})


def _plan(stages=((0, 3), (3, 6)), tps=(2, 2), micro=(4, 2), mbs=2, gpus=("A100-40", "V100-16"),
          zones=("us-central1-a", "us-central1-b")) -> dict:
    reps = [{"stage": i, "gpu": g, "zone": z, "tp": t} for i, (g, z, t) in enumerate(zip(gpus, zones, tps))]
    return {"micro_batch_size": mbs, "stages": [list(s) for s in stages],
            "pipelines": [{"microbatches": m, "replicas": reps} for m in micro]}


def test_derived_values():
    plan = Plan.model_validate(_plan())
    assert plan.num_stages == 2 and plan.num_layers == 6
    assert plan.global_batch_size == 2 * (4 + 2)  # uneven shares: 8 + 4 samples
    assert plan.world_size == 8
    assert plan.gpu_usage() == {("us-central1-a", "A100-40"): 4, ("us-central1-b", "V100-16"): 4}
    plan.check_against(JOB, CLUSTER)


@pytest.mark.parametrize("stages, match", [
    ([[0, 3], [2, 6]], r"stages\.1: stage 1 starts at layer 2 and overlaps the previous stage"),
    ([[0, 3], [4, 6]], r"stages\.1: stage 1 starts at layer 4 and leaves a gap"),
    ([[1, 3], [3, 6]], r"stages\.0: stage 0 starts at layer 1"),
    ([[0, 3], [3, 3]], r"stages\.1: stage 1 \[3, 3\) holds no layer"),
])
def test_layer_partition_errors(stages, match):
    with pytest.raises(SailorInputError, match=match):
        plan_from_dict(_plan(stages=stages), "plan.json")


def test_replica_count_and_stage_index_errors():
    d = _plan()
    d["pipelines"][0]["replicas"] = d["pipelines"][0]["replicas"][:1]
    with pytest.raises(SailorInputError, match=r"pipelines\.0\.replicas: pipeline 0 has 1 replicas for 2 stages"):
        plan_from_dict(d, "plan.json")
    d = _plan()
    d["pipelines"][1]["replicas"] = list(reversed(d["pipelines"][1]["replicas"]))
    with pytest.raises(SailorInputError, match=r"pipelines\.1\.replicas\.0\.stage: replica 0 of pipeline 1 names stage 1"):
        plan_from_dict(d, "plan.json")


def test_field_type_errors():
    with pytest.raises(SailorInputError, match=r"plan\.json: pipelines\.0\.microbatches: Input should be greater than 0 \(got -4\)"):
        plan_from_dict(_plan(micro=(-4, 2)), "plan.json")
    with pytest.raises(SailorInputError, match=r"plan\.json: pipelines\.0\.replicas\.0\.tp: Input should be a valid integer"):
        plan_from_dict(_plan(tps=("two", 2)), "plan.json")
    with pytest.raises(SailorInputError, match=r"pipelines\.0\.replicas\.1\.gpu: unknown GPU type 'V100'"):
        plan_from_dict(_plan(gpus=("A100-40", "V100")), "plan.json")


def test_check_against_job():
    with pytest.raises(SailorInputError, match=r"stages cover layers \[0, 5\) but tiny has 6 layers"):
        Plan.model_validate(_plan(stages=((0, 3), (3, 5)))).check_against(JOB)
    with pytest.raises(SailorInputError, match=r"micro_batch_size 2 x microbatches \[4, 1\] = 10 samples.*global batch is 12"):
        Plan.model_validate(_plan(micro=(4, 1))).check_against(JOB)
    with pytest.raises(SailorInputError, match=r"pipelines\.0\.replicas\.0\.tp: TP 3 does not divide the 4 attention heads"):
        Plan.model_validate(_plan(tps=(3, 2))).check_against(JOB)


def test_check_against_cluster():
    small = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}, "us-central1-b": {"V100-16": 8}},
                        gpus_per_node={"V100-16": 2})
    with pytest.raises(SailorInputError, match=r"pipelines\.0\.replicas\.1\.tp: TP 4 is larger than one V100-16 node \(2 GPUs\)"):
        Plan.model_validate(_plan(tps=(2, 4))).check_against(JOB, small)
    few = ClusterSpec(zones={"us-central1-a": {"A100-40": 2}, "us-central1-b": {"V100-16": 8}})
    with pytest.raises(SailorInputError, match=r"the plan uses 4 A100-40 in us-central1-a but the cluster has 2"):
        Plan.model_validate(_plan()).check_against(JOB, few)
    with pytest.raises(SailorInputError, match=r"pipelines\.0\.replicas\.1\.zone: unknown gcp zone 'us-central1-q'"):
        Plan.model_validate(_plan(zones=("us-central1-a", "us-central1-q"))).check_against(JOB, CLUSTER)


def test_save_and_load_round_trip(tmp_path):
    plan = Plan.model_validate(_plan()).with_specs(JOB, CLUSTER)
    plan.save(tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert again == plan and again.job == JOB and again.cluster == CLUSTER


def test_truncated_plan_file(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(_plan())[:50])
    with pytest.raises(SailorInputError, match=r"plan\.json: invalid JSON at line 1"):
        load_plan(p)


def test_rank_layout_places_each_pipeline_as_a_block_on_a_node():
    plan = Plan.model_validate(_plan(tps=(4, 2), gpus=("A100-40", "A100-40"), zones=("z", "z")))
    ranks = rank_layout(plan, {"A100-40": 8})
    assert len(ranks) == 12 and [r.rank for r in ranks] == list(range(12))
    # each pipeline's two stages (4 + 2 GPUs) are one block: pipeline 0 takes node 0's locals 0-5;
    # pipeline 1's block of 6 does not fit the 2 left there and opens node 1 (its stages stay together)
    assert [(r.node, r.local_rank) for r in ranks[:6]] == [("z/A100-40/0", k) for k in range(6)]
    assert [(r.node, r.local_rank) for r in ranks[6:]] == [("z/A100-40/1", k) for k in range(6)]


def test_sailor_plan_config_import():
    d = {"mbs": 2, "gbs": 16, "pipeline_list": [{
        "num_stages": 2, "layers_per_stage": [[0, 1, 2], [3, 4, 5]], "dp": [2, 2],
        "tmp_per_stage": [[[[["GH-96", 4, "us-central1-a"]], 4], [[["GH-96", 4, "us-central1-a"]], 2]],
                          [[[["GH-96", 4, "us-central1-a"]], 4], [[["GH-96", 4, "us-central1-a"]], 2]]]}]}
    plan = plan_from_dict(d, "cfg.json")
    assert plan.stages == ((0, 3), (3, 6))
    assert [p.microbatches for p in plan.pipelines] == [4, 4]  # 16 / (2 x 2 pipelines)
    assert [[(r.gpu, r.tp) for r in p.replicas] for p in plan.pipelines] == [
        [("GH200-96", 4), ("GH200-96", 4)], [("GH200-96", 2), ("GH200-96", 2)]]


@pytest.mark.parametrize("entry, match", [
    ({"num_stages": 2}, r"pipeline_list\.0\.layers_per_stage: missing field"),
    ({"layers_per_stage": [[0, 2], [3, 4, 5]], "dp": [1, 1], "tmp_per_stage": []},
     r"pipeline_list\.0\.layers_per_stage\.0: stage layers are not contiguous"),
    ({"layers_per_stage": [[0, 1, 2], [3, 4, 5]], "dp": [1, 2], "tmp_per_stage": []},
     r"pipeline_list\.0\.dp: stages with different data-parallel degrees"),
    ({"layers_per_stage": [[0, 1, 2], [3, 4, 5]], "dp": [1, 1], "tmp_per_stage": [[[[["GH-96", 4, "z"]], 4]]]},
     r"pipeline_list\.0\.tmp_per_stage: expected 2 item\(s\) \(one list of replicas per stage\), got 1"),
    ({"layers_per_stage": [[0, 1, 2], [3, 4, 5]], "dp": [1, 1], "num_stages": 3, "tmp_per_stage": []},
     r"pipeline_list\.0\.num_stages: num_stages 3 but layers_per_stage lists 2 stages"),
    ({"layers_per_stage": [[0, 1, 2], [3, 4, 5]], "dp": [1, 1],
      "tmp_per_stage": [[[[["GH-96", 4, "z"]], 8]], [[[["GH-96", 4, "z"]], 4]]]},
     r"pipeline_list\.0\.tmp_per_stage\.0\.0\.1: TP 8 is larger than the replica's node of 4 GPUs"),
    ({"layers_per_stage": [[0, 1, 2], [3, 4, 5]], "dp": [1, 1],
      "tmp_per_stage": [[[[["GH-96", 4, "z"]], 4]], [[[["GH200-96", 8, "z"]], 4]]]},
     r"pipeline_list\.0\.tmp_per_stage\.1\.0\.0\.0\.1: GH200-96 nodes of 8 GPUs here but of 4 elsewhere"),
    ({"layers_per_stage": [[0, 1, 2], [3, 4, True]], "dp": [1, 1], "tmp_per_stage": []},
     r"pipeline_list\.0\.layers_per_stage\.1\.2: expected a whole number, got true"),  # as JSON spells it
    ({"layers_per_stage": [[0, 1, 2], [3, 4, 5]], "dp": [1, 1],
      "tmp_per_stage": [[[[["GH-96", 4.0, "z"]], 4]], [[[["GH-96", 4, "z"]], 4]]]},
     r"pipeline_list\.0\.tmp_per_stage\.0\.0\.0\.0\.1: expected a whole number, got 4\.0"),
])
def test_sailor_plan_config_errors(entry, match):
    with pytest.raises(SailorInputError, match=r"cfg\.json: " + match):
        plan_from_dict({"mbs": 1, "gbs": 4, "pipeline_list": [entry]}, "cfg.json")


@pytest.mark.parametrize("top, match", [
    ({"mbs": 0, "gbs": 16}, r"mbs: must be a whole number from 1 to 65536, got 0"),
    ({"mbs": 4.7, "gbs": 16}, r"mbs: expected a whole number, got 4\.7"),
    ({"mbs": 2, "gbs": 1024.9}, r"gbs: expected a whole number, got 1024\.9"),
    ({"mbs": 3, "gbs": 16}, r"gbs: gbs 16 is not a multiple of mbs 3"),
    ({"mbs": 8, "gbs": 16}, r"gbs: gbs 16 / mbs 8 = 2 micro-batches cannot feed 3 pipelines"),
])
def test_sailor_plan_config_bad_batch(top, match):
    entry = {"layers_per_stage": [[0, 1, 2, 3, 4, 5]], "dp": [3], "tmp_per_stage": [[[[["GH-96", 4, "z"]], 1]] * 3]}
    with pytest.raises(SailorInputError, match=r"cfg\.json: " + match):
        plan_from_dict(top | {"pipeline_list": [entry]}, "cfg.json")


@pytest.mark.parametrize("gbs, mbs, dp, shares", [(16, 2, 3, [3, 3, 2]), (1024, 1, 3, [342, 341, 341]),
                                                  (10, 1, 4, [3, 3, 2, 2]), (12, 2, 3, [2, 2, 2])])
def test_sailor_plan_config_uneven_batch_is_spread_and_said(gbs, mbs, dp, shares):
    entry = {"layers_per_stage": [[0, 1, 2, 3, 4, 5]], "dp": [dp], "tmp_per_stage": [[[[["GH-96", 4, "z"]], 1]] * dp]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_from_dict({"mbs": mbs, "gbs": gbs, "pipeline_list": [entry]}, "cfg.json")
    assert [p.microbatches for p in plan.pipelines] == shares
    assert plan.global_batch_size == gbs
    said = [str(w.message) for w in caught if issubclass(w.category, SailorWarning)]
    if len(set(shares)) == 1:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(f"cfg.json: gbs: gbs {gbs} / mbs {mbs}")
        assert f"{shares.count(max(shares))} x {max(shares)}" in said[0]


def test_reference_plan_configs_import(sailor_ref):
    folder = sailor_ref / "validation" / "gh200-opt350"
    job = JobSpec(model="OPT-350", global_batch_size=1)
    for path in sorted(folder.glob("plan_config_*.json")):
        raw = json.loads(path.read_text())
        plan = load_plan(path)
        assert plan.global_batch_size == raw["gbs"] and plan.micro_batch_size == raw["mbs"]
        assert plan.num_layers == 26, path.name
        plan.check_against(job.model_copy(update={"global_batch_size": raw["gbs"]}))
        # N nodes of 4 GH200 each, TP 4: D pipelines of N / D stages
        assert plan.world_size == 4 * raw["N"], path.name
        assert plan.num_stages * len(plan.pipelines) == raw["N"], path.name


def test_memory_options_default_round_trip_and_checks():
    plan = Plan.model_validate(_plan())
    assert plan.stage_memory(1) == StageMemory() and "memory" not in plan.to_dict()
    d = _plan() | {"memory": [{"recompute": "full", "recompute_blocks": 1, "zero": 1}, {"sequence_parallel": True}]}
    plan = Plan.model_validate(d)
    assert plan.stage_memory(0).recompute is Recompute.FULL and plan.stage_memory(1).sequence_parallel
    assert plan.to_dict()["memory"] == [{"recompute": "full", "recompute_blocks": 1, "zero": 1}, {"sequence_parallel": True}]
    assert Plan.model_validate(plan.to_dict()) == plan
    plan.check_against(JOB, CLUSTER)
    with pytest.raises(SailorInputError, match=r"memory\.0\.recompute_blocks: recompute_blocks 3 but stage 0 holds 2"):
        Plan.model_validate(_plan() | {"memory": [{"recompute": "full", "recompute_blocks": 3}, {}]}).check_against(JOB)
    # sequence parallelism splits the sequence over TP: 64 tokens do not divide by TP 3
    six = JobSpec(model={"name": "six", "num_blocks": 4, "hidden_size": 48, "num_heads": 6, "vocab_size": 100,
                         "max_sequence_length": 64}, global_batch_size=12)
    sp = Plan.model_validate(_plan(tps=(3, 2)) | {"memory": [{"sequence_parallel": True}, {}]})
    with pytest.raises(SailorInputError, match=r"memory\.0\.sequence_parallel: .*64 tokens do not divide by TP 3"):
        sp.check_against(six)


# ---- schedule (issue 16) -----------------------------------------------------------------------------
INTERLEAVED = {"kind": "interleaved-1f1b", "virtual_stages": 2}


def _interleaved(stages=((0, 1), (1, 3), (3, 4), (4, 6)), schedule=INTERLEAVED, **kw) -> dict:
    return _plan(**kw) | {"stages": [list(s) for s in stages], "schedule": schedule}


def test_plans_without_a_schedule_are_1f1b_and_stay_as_they_were():
    d = _plan()
    plan = Plan.model_validate(d)
    assert plan.schedule.kind.value == "1f1b" and plan.virtual_stages == 1
    assert "schedule" not in plan.to_dict() and plan.to_dict(with_specs=False) == d
    assert plan.stage_chunks(1) == ((3, 6),)


def test_interleaved_chunks_go_round_robin_over_the_stages(tmp_path):
    # 2 stages x 2 uneven chunks of the 6-layer tiny model: stage 0 holds [0, 1) and [3, 4)
    plan = Plan.model_validate(_interleaved()).with_specs(JOB, CLUSTER)
    assert plan.num_stages == 2 and plan.virtual_stages == 2 and plan.num_layers == 6
    assert plan.stage_chunks(0) == ((0, 1), (3, 4)) and plan.stage_chunks(1) == ((1, 3), (4, 6))
    assert plan.stage_layers_text(1) == "[1, 3) + [4, 6)"
    plan.check_against(JOB, CLUSTER)
    assert len(rank_layout(plan)) == plan.world_size == 8  # chunks do not change the ranks
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan
    assert json.loads((tmp_path / "plan.json").read_text())["schedule"] == INTERLEAVED
    zb = Plan.model_validate(_plan() | {"schedule": {"kind": "zb-h1"}})
    assert zb.to_dict()["schedule"] == {"kind": "zb-h1"} and zb.num_stages == 2


@pytest.mark.parametrize("change, match", [
    ({"schedule": {"kind": "interleaved-1f1b"}}, r"schedule\.virtual_stages: interleaved-1f1b needs virtual_stages >= 2"),
    ({"schedule": {"kind": "zb-h1", "virtual_stages": 2}}, r"schedule\.virtual_stages: zb-h1 runs one chunk per stage"),
    ({"schedule": {"kind": "2f2b"}}, r"schedule\.kind: Input should be '1f1b', 'interleaved-1f1b' or 'zb-h1'"),
    ({"stages": [[0, 1], [1, 3], [3, 6]]}, r"stages: 3 layer chunks for 2 virtual stages per pipeline stage"),
    ({"stages": [[0, 1], [2, 3], [3, 4], [4, 6]]}, r"stages\.1: chunk 1 starts at layer 2 and leaves a gap"),
    ({"stages": [[0, 3], [3, 6]]}, r"schedule\.kind: interleaved-1f1b needs at least 2 pipeline stages"),
    ({"memory": [{}, {}, {}, {}]}, r"memory: 4 entries for 2 stages"),
])
def test_schedule_errors_name_the_field(change, match):
    d = _interleaved() | change
    if "stages" in change and len(change["stages"]) == 2:
        d["pipelines"] = [{"microbatches": 4, "replicas": d["pipelines"][0]["replicas"][:1]}]
    with pytest.raises(SailorInputError, match=match):
        plan_from_dict(d, "plan.json")


def test_replicas_count_pipeline_stages_not_chunks():
    d = _interleaved()
    d["pipelines"][0]["replicas"] = d["pipelines"][0]["replicas"] * 2
    with pytest.raises(SailorInputError, match=r"pipelines\.0\.replicas: pipeline 0 has 4 replicas for 2 stages"):
        plan_from_dict(d, "plan.json")


def test_zb_h1_refuses_full_recomputation_and_interleaved_counts_blocks_over_chunks():
    d = _plan() | {"schedule": {"kind": "zb-h1"}, "memory": [{}, {"recompute": "full"}]}
    with pytest.raises(SailorInputError, match=r"memory\.1\.recompute: zb-h1 defers weight-gradient passes.*stage 1"):
        plan_from_dict(d, "plan.json")
    plan_from_dict(d | {"memory": [{}, {"recompute": "selective"}]}, "plan.json")  # selective keeps them: fine
    # stage 1 holds [1, 3) and [4, 6): blocks 1, 2 and 4 (layer 5 is the head) -> 3 blocks
    ok = Plan.model_validate(_interleaved() | {"memory": [{}, {"recompute": "full", "recompute_blocks": 3}]})
    ok.check_against(JOB)
    too_many = Plan.model_validate(_interleaved() | {"memory": [{}, {"recompute": "full", "recompute_blocks": 4}]})
    with pytest.raises(SailorInputError, match=r"memory\.1\.recompute_blocks: recompute_blocks 4 but stage 1 holds 3"):
        too_many.check_against(JOB)


def _block_first_fit(pipelines, sizes, cuts=None):
    """Reference placement: cut each pipeline into blocks (a stage joins the one before when it is in
    the same pool, is not cut from it (`cuts`: per pipeline, per stage; none by default) and the block
    still fits one node), then, for every block in order, scan the pool's nodes from the first and take
    the first with room for it, else open a node; a block after a cut skips the nodes its pipeline
    already holds."""
    free, out = {}, []
    for j, pipe in enumerate(pipelines):
        cut = cuts[j] if cuts else [False] * len(pipe)
        blocks = []
        for i, (zone, gpu, tp) in enumerate(pipe):
            if (i and not cut[i] and pipe[i - 1][:2] == (zone, gpu)
                    and sum(pipe[k][2] for k in blocks[-1]) + tp <= sizes[gpu]):
                blocks[-1].append(i)
            else:
                blocks.append([i])
        row = [None] * len(pipe)
        for block in blocks:
            zone, gpu, _ = pipe[block[0]]
            width = sum(pipe[k][2] for k in block)
            cap = max(sizes[gpu], width)
            held = {row[k][0] for k in range(block[0]) if row[k] is not None} if cut[block[0]] else set()
            nodes = free.setdefault((zone, gpu), [])
            idx = next((k for k, f in enumerate(nodes) if f >= width and f"{zone}/{gpu}/{k}" not in held), None)
            if idx is None:
                nodes.append(cap)
                idx = len(nodes) - 1
            local = cap - nodes[idx]
            for k in block:
                row[k] = (f"{zone}/{gpu}/{idx}", local)
                local += pipe[k][2]
            nodes[idx] -= width
        out.append(row)
    return out


def test_pack_replicas_is_block_first_fit():
    # mixed TP degrees in shared pools (8 GPUs per node, one type at 4, TP 8 groups opening wider
    # nodes): the linear-time packing places every replica where the plain block first-fit scan does
    import random
    rng = random.Random(7)
    sizes = {"A100-40": 8, "V100-16": 4}
    for _ in range(200):
        pipes = [[(rng.choice(["z1", "z2"]), rng.choice(list(sizes)), rng.choice([1, 2, 4, 8]))
                  for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 40))]
        assert pack_replicas(pipes, sizes) == _block_first_fit(pipes, sizes)
    # hand cases: TP 2, 4, 2 on 4-GPU nodes -> three blocks (2 + 4 > 4, 4 + 2 > 4); the third fills
    # node 0 next to the first
    assert pack_replicas([[("z", "V100-16", 2), ("z", "V100-16", 4), ("z", "V100-16", 2)]], sizes) == \
        [[("z/V100-16/0", 0), ("z/V100-16/1", 0), ("z/V100-16/0", 2)]]
    # TP 2, 2, 2, 4 on 8-GPU nodes: stages 0-2 one block (6 GPUs), stage 3 opens node 1 (6 + 4 > 8)
    assert node_blocks([("z", "A100-40", t) for t in (2, 2, 2, 4)], sizes.get) == [0, 0, 0, 1]
    # a second such pipeline: its block of 6 finds no node with 6 free (node 0 has 2, node 1 has 4)
    two = pack_replicas([[("z", "A100-40", t) for t in (2, 2, 2, 4)]] * 2, sizes)
    assert two[1] == [("z/A100-40/2", 0), ("z/A100-40/2", 2), ("z/A100-40/2", 4), ("z/A100-40/1", 4)]
    # a change of zone or GPU type always ends a block
    assert node_blocks([("z", "A100-40", 1), ("y", "A100-40", 1), ("y", "V100-16", 1), ("y", "V100-16", 1)],
                       sizes.get) == [0, 1, 2, 2]
