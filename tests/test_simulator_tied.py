"""The gradient bytes the simulator says a tied (or untied) model syncs equal what Sailor's runtime
reduces: hand-computed for the tiny model and for models without a position table, and equal by
construction to the runtime's own gradient buckets (`runtime.buckets.build_buckets` over the meta
parameters of each rank's stage) and tied-gradient transfers (`runtime.tied.twin_transfers`).
No process is started.

The two model errors these pin (found on the testbed, issue 25): a one-stage plan of a tied model
all-reduces both copies of the token matrix (the runtime keeps the LM head's own copy), and the
first and last stage of a pipeline exchange the token matrix's gradient only, not the position
table's.
"""

import pytest
import torch

from sailor.model.spec import ModelSpec
from sailor.plan.spec import Plan
from sailor.runtime.buckets import build_buckets
from sailor.runtime.model import GPT
from sailor.runtime.pipeline import build_stage
from sailor.runtime.tensor_parallel import apply_tp
from sailor.runtime.tied import twin_transfers
from sailor.runtime.topology import derive_topology
from sailor.simulator import TiedCopies, TrafficKind, make_context, simulate, tied_sync
from sailor.simulator.terms import placed_slots
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZA, ZB = "us-central1-a", "us-west1-b"
CLUSTER = ClusterSpec(provider="gcp", zones={ZA: {"A100-40": 8}, ZB: {"A100-40": 8}})
# Llama-like: rotary positions (no position table), RMSNorm, SwiGLU, GQA, no biases; untied and tied
LLAMA = {"name": "llama-like", "num_blocks": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 96, "vocab_size": 1000, "max_sequence_length": 64, "gated_mlp": True,
         "learned_positions": False, "bias": False, "rms_norm": True, "tied_embeddings": False}
LLAMA_TIED = {**LLAMA, "name": "llama-like-tied", "tied_embeddings": True}


def _plan(stages, pipes, zero=0) -> Plan:
    """One pipeline per entry of `pipes` ((zone, TP) per stage), 2 micro-batches of 4, ZeRO `zero`."""
    return Plan.model_validate({
        "micro_batch_size": 4, "stages": [list(s) for s in stages], "memory": [{"zero": zero}] * len(stages),
        "pipelines": [{"microbatches": 2, "replicas": [{"stage": i, "gpu": "A100-40", "zone": z, "tp": t}
                                                       for i, (z, t) in enumerate(zones)]} for zones in pipes]})


def _job(model, plan: Plan) -> JobSpec:
    return JobSpec(model=model, global_batch_size=plan.global_batch_size)


def _sync_bytes(plan: Plan, model) -> list[tuple[TrafficKind, float]]:
    est = simulate(plan, make_context(_job(model, plan), CLUSTER))
    return [(t.kind, t.moved_bytes) for t in est.traffic]


# ---- hand-computed bytes ------------------------------------------------------------------------
def test_tiny_one_stage_dp2_syncs_both_copies_of_the_token_matrix():
    # tiny (h 64, V 256, 4 blocks, LayerNorm, biases, 64 learned positions), fp32 gradients:
    #   embedding 256 x 64 + 64 x 64 = 20480; block 4h^2 + 8h^2 (weights) + 3h + h + 4h + h (biases)
    #   + 4h (two LayerNorms) = 49984; head 2h (norm) + 256 x 64 (its own copy) = 16512
    #   stage = 20480 + 4 x 49984 + 16512 = 236928 params = 947712 B per rank (measured on the
    #   testbed's link: 947712; one copy would be 882176)
    assert 64 * 64 * 12 + 3 * 64 + 64 + 4 * 64 + 64 + 4 * 64 == 49984
    plan = _plan([(0, 6)], [[(ZA, 1)], [(ZB, 1)]])
    # a 2-member ring across the zones: each member sends 2(D-1)/D x 947712 B = 947712 B
    assert _sync_bytes(plan, "tiny") == [(TrafficKind.SYNC, pytest.approx(2 * 947712))]


@pytest.mark.parametrize("shares", [(4, 4), (4, 2)])
def test_zero2_and_3_reduce_scatter_bytes_cross_once_per_micro_batch_round(shares):
    # the one-stage tiny of the test above (947712 B of fp32 gradients per rank), a ring of 2 across
    # the zones. ZeRO-0 all-reduces once: 2 x 947712 B; ZeRO-1 reduce-scatters once (half of that) and
    # all-gathers the fp32 weights once (the other half). ZeRO-2/3 reduce-scatter after every
    # micro-batch: 4 rounds (the larger share: the pipeline of 2 runs 2 rounds of collectives alone,
    # `Plan.step_rounds`), 4 x 947712 B, plus ZeRO-2's all-gather
    half = 947712
    for zero, expected in ((0, 2 * half), (1, 2 * half), (2, 4 * half + half), (3, 4 * half)):
        plan = Plan.model_validate({
            "micro_batch_size": 4, "stages": [[0, 6]], "memory": [{"zero": zero}],
            "pipelines": [{"microbatches": m, "replicas": [{"stage": 0, "gpu": "A100-40", "zone": z, "tp": 1}]}
                          for m, z in zip(shares, (ZA, ZB))]})
        ctx = make_context(_job("tiny", plan), CLUSTER)
        est = simulate(plan, ctx)
        assert [(t.kind, t.moved_bytes) for t in est.traffic] == [(TrafficKind.SYNC, pytest.approx(expected))], zero
        assert est.cross_zone_bytes == pytest.approx(expected)
        price = CLUSTER.prov.egress_usd_per_gb[ctx.network.link_class(ZA, ZB)]
        assert est.egress_per_iteration_usd == pytest.approx(expected / 1e9 * price)


def test_tiny_two_stages_exchange_the_token_matrix_only():
    # the first and last stage sum the copies of the 256 x 64 token matrix: 65536 B each way (the
    # 64 x 64 position table stays on stage 0: with it, 81920 B); activations: 2 micro-batches of
    # 4 x 64 x 64 x 4 B = 65536 B each way
    plan = _plan([(0, 3), (3, 6)], [[(ZA, 1), (ZB, 1)]])
    assert _sync_bytes(plan, "tiny") == [(TrafficKind.P2P, pytest.approx(2 * 2 * 65536)),
                                         (TrafficKind.SYNC, pytest.approx(2 * 65536))]


def test_llama_like_untied_and_tied_by_hand():
    h, f, kv, v = 64, 96, 2 * 16, 1024  # vocab 1000 padded to 1024
    block = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h  # q k v o, gate up down, two RMSNorms
    assert block == 8192 + 4096 + 18432 + 128 == 30848
    params = v * h + 2 * block + h + v * h  # embedding (no position table), 2 blocks, head
    for model in (LLAMA, LLAMA_TIED):  # tied or not, the runtime holds and reduces both matrices
        plan = _plan([(0, 4)], [[(ZA, 1)], [(ZB, 1)]])
        assert _sync_bytes(plan, model) == [(TrafficKind.SYNC, pytest.approx(2 * 4 * params))]
    # two stages: an untied model exchanges nothing between its ends; a tied one its token matrix
    plan = _plan([(0, 2), (2, 4)], [[(ZA, 1), (ZB, 1)]])
    act = 2 * 2 * 4 * 64 * h * 4  # 2 micro-batches of 4 x 64 x h fp32, each way
    assert _sync_bytes(plan, LLAMA) == [(TrafficKind.P2P, pytest.approx(act))]
    assert _sync_bytes(plan, LLAMA_TIED) == [(TrafficKind.P2P, pytest.approx(act)),
                                             (TrafficKind.SYNC, pytest.approx(2 * v * h * 4))]


def test_deepspeed_layout_is_kept_for_the_runs_that_ran_it():
    # `TiedCopies.MODULE` (DeepSpeed's TiedLayerSpec: what the public Sailor runs measured): one copy
    # on one stage, the whole embedding module (token and position tables) between two
    job = JobSpec(model="tiny", global_batch_size=8)
    ctx = make_context(JobSpec(model="tiny", global_batch_size=8, framework="deepspeed"), CLUSTER)
    assert ctx.tied is TiedCopies.MODULE
    assert ctx.stage_params(1, 0, 6) == 236928 - 256 * 64
    assert ctx.tied_copy_params(1) == 256 * 64 + 64 * 64
    assert make_context(job, CLUSTER).tied_copy_params(1) == 256 * 64


# ---- equal to the runtime's buckets and transfers -------------------------------------------------
def _meta_stage(spec: ModelSpec, role) -> dict[str, torch.nn.Parameter]:
    """The rank's stage parameters as the worker builds them (`worker.build_rank`), on meta."""
    with torch.device("meta"):
        stage = GPT(spec)
    build_stage(stage, role.chunks)
    apply_tp(stage, tp_rank=role.tp_rank, tp=role.tp, group=None)
    return dict(stage.named_parameters())


CASES = [  # (model, stages, pipelines as [(zone, tp) per stage], ZeRO)
    ("tiny", [(0, 6)], [[(ZA, 1)], [(ZB, 1)]], 0),
    ("tiny", [(0, 6)], [[(ZA, 2)], [(ZB, 2)]], 1),
    ("tiny", [(0, 3), (3, 6)], [[(ZA, 1), (ZB, 1)]], 0),
    ("tiny", [(0, 2), (2, 6)], [[(ZA, 2), (ZB, 1)], [(ZA, 2), (ZB, 1)]], 0),
    ("tiny", [(0, 6)], [[(ZA, 1)], [(ZB, 2)]], 0),  # replicas of different TP sync shard by shard
    (LLAMA, [(0, 4)], [[(ZA, 2)], [(ZB, 2)]], 0),
    (LLAMA, [(0, 2), (2, 4)], [[(ZA, 1), (ZB, 2)], [(ZA, 1), (ZB, 2)]], 2),
    (LLAMA_TIED, [(0, 1), (1, 4)], [[(ZA, 2), (ZB, 2)]], 0),
    (LLAMA_TIED, [(0, 4)], [[(ZA, 1)], [(ZB, 1)], [(ZA, 1)]], 3),
]


@pytest.mark.parametrize("model,stages,pipes,zero", CASES)
def test_stage_sync_params_equal_the_runtimes_buckets(model, stages, pipes, zero):
    plan = _plan(stages, pipes, zero=zero)
    job = _job(model, plan)
    ctx, topo = make_context(job, CLUSTER), derive_topology(plan)
    for stage in range(plan.num_stages):
        roles = [r for r in topo.roles if r.stage == stage]
        t = min(r.tp for r in roles)  # the simulator's flows: the finest common sharding
        predicted = t * sum(ctx.stage_params(t, a, e) for a, e in plan.stage_chunks(stage))
        for pipeline in range(len(plan.pipelines)):
            replica = [r for r in roles if r.pipeline == pipeline]
            held = [sum(b.numel for b in build_buckets(_meta_stage(job.model, r), r, zero=zero,
                                                       sequence_parallel=False)) for r in replica]
            assert held == [ctx.stage_params(r.tp, *stages[stage]) for r in replica]  # rank by rank
            if all(r.tp == t for r in roles):  # one replica's gradient, all its TP ranks (mixed TP: each
                assert sum(held) == predicted, (stage, pipeline)  # TP rank also holds the replicated ones)


@pytest.mark.parametrize("model", ["tiny", LLAMA_TIED])
@pytest.mark.parametrize("tp", [1, 2])
def test_tied_exchange_equals_the_runtimes_transfers(model, tp):
    # ZeRO-0: each pipeline's first and last stage exchange the whole token matrix, each way; the
    # simulator's 2-member ring moves its `nbytes` each way
    layers = 6 if model == "tiny" else 4
    plan = _plan([(0, 2), (2, layers)], [[(ZA, tp), (ZB, tp)], [(ZA, tp), (ZB, tp)]])
    job = _job(model, plan)
    ctx, topo = make_context(job, CLUSTER), derive_topology(plan)
    stage_of = {r.rank: (r.pipeline, r.stage) for r in topo.roles}
    moved: dict[tuple, int] = {}
    for x in twin_transfers(job.model, plan, topo):
        key = (stage_of[x.src], stage_of[x.dst])
        moved[key] = moved.get(key, 0) + x.hi - x.lo
    matrix = tp * ctx.tied_copy_params(tp)
    assert matrix == job.model.padded_vocab(1) * job.model.hidden_size
    assert moved == {((j, a), (j, b)): matrix for j in range(2) for a, b in ((0, 1), (1, 0))}
    for first, *_, last in placed_slots(plan, CLUSTER):
        seconds, crossing_bytes, _ = tied_sync(ctx, first, last, plan.num_stages)
        assert seconds > 0 and crossing_bytes == pytest.approx(2 * matrix * 4)


def test_one_stage_tied_exchange_stays_on_the_rank():
    # both copies on one rank: the runtime adds them locally; the simulator charges no tied transfer
    plan = _plan([(0, 6)], [[(ZA, 1)], [(ZB, 1)]])
    job = _job("tiny", plan)
    transfers = twin_transfers(job.model, plan, derive_topology(plan))
    assert transfers and all(x.src == x.dst for x in transfers)
    ctx = make_context(job, CLUSTER)
    (slot,) = placed_slots(plan, CLUSTER)[0]
    assert tied_sync(ctx, slot, slot, 1) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("zero", [(0, 0), (1, 1), (2, 0), (0, 3)])
@pytest.mark.parametrize("pipelines,tp", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_tied_bytes_across_zones_equal_the_runtimes_under_zero(zero, pipelines, tp):
    # every first stage in one zone, every last stage in the other: the tied exchange is the only
    # sync that crosses. Under ZeRO >= 1 a copy's element has one owner among the pipelines, so the
    # pipelines together receive that copy once (ZeRO-0: once per pipeline)
    plan = Plan.model_validate({
        "micro_batch_size": 4, "stages": [[0, 3], [3, 6]], "memory": [{"zero": z} for z in zero],
        "pipelines": [{"microbatches": 2, "replicas": [{"stage": 0, "gpu": "A100-40", "zone": ZA, "tp": tp},
                                                       {"stage": 1, "gpu": "A100-40", "zone": ZB, "tp": tp}]}] * pipelines})
    job = _job("tiny", plan)
    topo = derive_topology(plan)
    stage_of = {r.rank: r.stage for r in topo.roles}
    runtime = 4 * sum(x.hi - x.lo for x in twin_transfers(job.model, plan, topo) if stage_of[x.src] != stage_of[x.dst])
    held = [1 / pipelines if z else 1 for z in zero]  # share of a copy each pipeline's stage holds
    assert runtime == pytest.approx(pipelines * 256 * 64 * 4 * sum(held))
    est = simulate(plan, make_context(job, CLUSTER))
    assert [t.moved_bytes for t in est.traffic if t.kind is TrafficKind.SYNC] == [pytest.approx(runtime)]
