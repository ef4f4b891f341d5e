"""Unit tests for each term of the simulator's time and memory model (issue 4)."""

import itertools

import numpy as np
import pytest

from sailor.perf.calibration import fit_memory
from sailor.perf.profile_lookup import Profiles
from sailor.plan.orders import ScheduleKind, one_f_one_b_order
from sailor.plan.spec import Plan, Schedule
from sailor.simulator import TiedCopies, head_vocab_params, make_context, simulate, tied_embeddings
from sailor.simulator.memory import in_flight, logits_grad_bytes
from sailor.simulator.schedule import closed_form_1f1b, pipeline_instructions, simulate_1f1b, stage_times
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

JOB = JobSpec(model="opt-350m", global_batch_size=32)
# 4 GPUs per node: every TP-4 replica has a node of its own, so every link is between two nodes
CLUSTER = ClusterSpec(provider="gcp", zones={"us-central1-a": {"A100-40": 16}}, gpus_per_node={"A100-40": 4})


def _plan(stages, tp=4, d=1, m=4, mbs=2):
    reps = [{"stage": i, "gpu": "A100-40", "zone": "us-central1-a", "tp": tp} for i in range(len(stages))]
    return Plan.model_validate({"micro_batch_size": mbs, "stages": stages,
                                "pipelines": [{"microbatches": m, "replicas": reps}] * d})


def test_the_simulated_1f1b_runs_the_runtimes_op_order():
    # the DeepSpeed instruction stream the simulator times computes in exactly the order the runtime runs
    for P, m in itertools.product((1, 2, 3, 4, 5), (1, 2, 3, 5, 8)):
        for i in range(P):
            comp = [x for x in pipeline_instructions(P, i, m) if x[0] in ("F", "B")]
            assert comp == [(op.kind, op.micro_batch) for op in Schedule().order(i, P, m)]
            assert comp == [(op.kind, op.micro_batch) for op in one_f_one_b_order(P, i, m)]



def test_deepspeed_order_two_stages_by_hand():
    # stage 0 of 2 stages, 2 micro-batches: F0, send act 0, F1, recv grad 0, send act 1, B0, recv grad 1, B1
    assert pipeline_instructions(2, 0, 2) == [("F", 0), ("SA", 0), ("F", 1), ("RG", 0), ("SA", 1), ("B", 0),
                                              ("RG", 1), ("B", 1)]


def test_two_stage_by_hand_with_rendezvous_transfers():
    # f = 1, b = 2, c = 0.5, m = 2: stage 1 gets act 0 at 1.5, F0 to 2.5, B0 to 4.5, sends grad (5.0),
    # receives act 1 (5.5), F1 6.5, B1 8.5, sends grad 9.0; stage 0 then B1 -> 11.0.
    f, b, c = np.array([1.0, 1.0]), np.array([2.0, 2.0]), np.array([0.5])
    assert simulate_1f1b(f, b, c, 2)[0] == pytest.approx(11.0)
    assert closed_form_1f1b(f, b, c, 2) == pytest.approx(11.0)


def test_closed_form_equals_event_simulation_on_uniform_pipelines():
    for P, m, f, b, c in itertools.product((1, 2, 3, 4, 6), (1, 2, 3, 8), (0.5, 1.0), (1.0, 2.5), (0.0, 0.2, 1.5)):
        F, B, C = np.full(P, f), np.full(P, b), np.full(P - 1, c)
        assert closed_form_1f1b(F, B, C, m) == pytest.approx(simulate_1f1b(F, B, C, m)[0], rel=1e-12)


def test_middle_stage_pays_four_transfers_per_micro_batch():
    t = stage_times(np.ones(3), np.ones(3), np.array([0.1, 0.1]))
    assert t.tolist() == pytest.approx([2.2, 2.4, 2.2])


def test_in_flight_capped_by_micro_batches():
    assert [in_flight(i, 4, 32).micro_batches for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight(i, 4, 2).micro_batches for i in range(4)] == [2, 2, 2, 1]


def test_tied_embeddings_held_as_the_runtime_and_as_deepspeed_hold_them():
    m = JOB.model
    assert tied_embeddings(m)
    whole = sum(m.params(i, 4) for i in range(m.num_layers))
    last = sum(m.params(i, 4) for i in range(13, m.num_layers))
    # Sailor's runtime (the default framework): the LM head keeps its own copy of the token matrix
    # even on a one-stage plan, and the last stage holds no position table
    runtime = make_context(JOB, CLUSTER)
    assert runtime.tied is TiedCopies.RUNTIME
    assert runtime.stage_params(4, 0, m.num_layers) == whole
    assert runtime.stage_params(4, 13, m.num_layers) == last
    assert runtime.tied_copy_params(4) == head_vocab_params(m, 4) == 50688 * 1024 // 4
    # DeepSpeed's TiedLayerSpec: one copy on one stage, the whole embedding module on the last
    for ctx in (make_context(JobSpec(model="opt-350m", global_batch_size=32, framework="deepspeed"), CLUSTER),
                make_context(JobSpec(model="opt-350m", global_batch_size=32, framework="megatron-lm"), CLUSTER)):
        assert ctx.tied is TiedCopies.MODULE
        assert ctx.stage_params(4, 0, m.num_layers) == whole - head_vocab_params(m, 4)
        assert ctx.stage_params(4, 13, m.num_layers) == last - head_vocab_params(m, 4) + m.params(0, 4)
        assert ctx.tied_copy_params(4) == m.params(0, 4) == 50688 * 1024 // 4 + 2048 * 1024


# DeepSpeed's sync runs after the pipeline, whole (`sync.stage_sync`): the collectives' formulas in full
JOB_DS = JOB.model_copy(update={"framework": "deepspeed"})


def test_gradient_sync_uses_tp_shard_bytes_and_optimizer_scales_with_stage_params():
    cal = {"A100-40": {"allreduce_efficiency": 1.0}}
    one = simulate(_plan([[0, 26]], d=2, m=2), make_context(JOB_DS, CLUSTER, calibration=cal))
    two = simulate(_plan([[0, 13], [13, 26]], d=2, m=2), make_context(JOB_DS, CLUSTER, calibration=cal))
    assert one.gradient_sync_s > 0 and two.gradient_sync_s < one.gradient_sync_s
    r0, r1 = two.replicas[0], two.replicas[1]
    ctx = make_context(JOB_DS, CLUSTER)
    ratio = ctx.stage_params(4, 0, 13) / ctx.stage_params(4, 13, 26)
    assert r0.optimizer_s / r1.optimizer_s == pytest.approx(ratio)
    # halving the all-reduce efficiency doubles the streaming part of the sync, not its hop latency
    half = simulate(_plan([[0, 26]], d=2, m=2),
                    make_context(JOB_DS, CLUSTER, calibration={"A100-40": {"allreduce_efficiency": 0.5}}))
    hops = 2 * 0.15e-3  # D = 2: two hops of the catalog's same-zone latency
    assert half.gradient_sync_s - hops == pytest.approx(2 * (one.gradient_sync_s - hops))


def test_tied_gradient_reduction_only_with_pipelines():
    cal = {"A100-40": {"allreduce_efficiency": 1.0}}
    two = simulate(_plan([[0, 13], [13, 26]], d=1), make_context(JOB, CLUSTER, calibration=cal))
    one = simulate(_plan([[0, 26]], d=1), make_context(JOB, CLUSTER, calibration=cal))
    assert one.gradient_sync_s == 0.0
    assert two.gradient_sync_s > 0.0  # D = 1, so all of it is the tied embedding reduction


def test_memory_terms():
    cal = {"A100-40": {"framework_bytes": 1e9, "reserve_fraction": 0.1}}
    ctx = make_context(JOB, CLUSTER, calibration=cal)
    est = simulate(_plan([[0, 13], [13, 26]], m=4, mbs=2), ctx)
    first, last = est.replicas[0].memory, est.replicas[1].memory
    act = ctx.act_cumsum(4, 2)
    assert first.activations == pytest.approx((act[13] - act[0]) * 2)  # two micro-batches in flight
    assert last.activations == pytest.approx(act[26] - act[13])
    assert first.buffers == pytest.approx(ctx.boundary_bytes(13, 2))  # gradient receive buffer
    assert last.buffers == pytest.approx(ctx.boundary_bytes(13, 2) + logits_grad_bytes(ctx, 4, 2))
    assert logits_grad_bytes(ctx, 4, 2) == 2 * 2048 * 50688 // 4 * 4
    assert first.reserve == pytest.approx(0.1 * (first.activations + first.buffers))
    assert first.framework == 1e9
    assert first.weights == pytest.approx(4 * ctx.stage_params(4, 0, 13))


def test_fit_memory_recovers_constants():
    fixed = np.array([1e9, 2e9, 0.5e9, 1.5e9])
    trans = np.array([5e9, 20e9, 2e9, 10e9])
    meas = fixed + 1.12 * trans + 3e9
    got = fit_memory(fixed, trans, meas)
    assert got["reserve_fraction"] == pytest.approx(0.12)
    assert got["framework_bytes"] == pytest.approx(3e9)


def test_profile_gap_only_applies_to_measured_profiles():
    ctx = make_context(JOB, CLUSTER, calibration={"A100-40": {"profile_overhead_s": 1.0}})
    assert ctx.stage_compute_s("A100-40", 4, 2, 1, 2)[0] > 0  # roofline estimate: no gap subtracted


def test_p2p_overhead_is_added_to_every_boundary_transfer():
    from sailor.simulator import Slot, pipeline_arrays
    slots = [Slot(zone="us-central1-a", gpu="A100-40", tp=4)] * 3
    stages = [(0, 9), (9, 18), (18, 26)]
    base = pipeline_arrays(make_context(JOB, CLUSTER, calibration={}), slots, stages, 2)[2]
    cal = {"A100-40": {"p2p_overhead_s": 1e-3}}
    more = pipeline_arrays(make_context(JOB, CLUSTER, calibration=cal), slots, stages, 2)[2]
    assert more == pytest.approx(base + 1e-3)


def test_allreduce_is_a_ring_over_the_links_at_the_calibrated_efficiency():
    # one stage, D replicas of TP 4, each on its own node: 4 flows share the catalog's same-zone NIC
    # (5 GB/s; one flow 1.3 GB/s, 4 reach the NIC) and each hop costs 0.15 ms
    big = ClusterSpec(provider="gcp", zones={"us-central1-a": {"A100-40": 64}}, gpus_per_node={"A100-40": 4})
    ctx = make_context(JOB_DS, big, calibration={"A100-40": {"allreduce_efficiency": 0.25}})
    grad = 4 * ctx.stage_params(4, 0, 26) * 4  # a replica's gradient: 4 shards of fp32
    for d in (2, 4, 16):
        want = 2 * (d - 1) * 0.15e-3 + 2 * (d - 1) / d * grad / 5.0e9 / 0.25
        assert simulate(_plan([[0, 26]], d=d, m=2), ctx).gradient_sync_s == pytest.approx(want), d
    assert simulate(_plan([[0, 26]], d=1, m=2), ctx).gradient_sync_s == 0.0


def test_microbatch_overhead_is_added_once_per_stage_and_micro_batch():
    # tiny (6 layers), every layer f = 1 s, b = 2 s at micro-batch 2, and 0.5 s of runtime overhead
    # per stage and micro-batch (`runtime.microbatch_overhead_s`), on the forward.
    job = JobSpec(model="tiny", global_batch_size=8)
    n = job.model.num_layers
    prof = Profiles(model="tiny", sequence_length=job.seq, precision=job.precision,
                    times={("A100-40", 1): {2: np.tile([1.0, 2.0], (n, 1))}},
                    microbatch_overhead_s={("A100-40", 1): 0.5})
    ctx = make_context(job, CLUSTER, prof)
    assert ctx.stage_compute_s("A100-40", 1, 2, 0, 3) == pytest.approx((3.5, 6.0))
    assert ctx.stage_compute_s("A100-40", 1, 2, 3, 4) == pytest.approx((1.5, 2.0))  # one layer pays it all
    # nearest measured TP of the GPU type stands in; another GPU type has none
    assert prof.microbatch_overhead("A100-40", 2) == 0.5 and prof.microbatch_overhead("V100-16", 1) == 0.0

    def plan(stages, m):
        reps = [{"stage": i, "gpu": "A100-40", "zone": "us-central1-a", "tp": 1} for i in range(len(stages))]
        return Plan.model_validate({"micro_batch_size": 2, "stages": stages,
                                    "pipelines": [{"microbatches": m, "replicas": reps}]})

    # one stage, 4 micro-batches: 4 x (6 + 0.5 + 12) = 74 s
    one = simulate(plan([[0, 6]], 4), ctx)
    assert one.pipeline_s == pytest.approx(74.0) and one.replicas[0].forward_s == pytest.approx(6.5)
    # two uniform stages of 3 layers (f = 3.5, b = 6), m micro-batches, transfer c: fill and drain 2 x 9.5 + 2c,
    # then m - 1 more at an end stage's 9.5 + 2c; event simulation and closed form agree.
    for m in (2, 4, 8):
        est = simulate(plan([[0, 3], [3, 6]], m), ctx)
        c = est.replicas[0].p2p_s
        assert est.pipeline_s == pytest.approx(19.0 + 2 * c + (m - 1) * (9.5 + 2 * c))
        assert simulate(plan([[0, 3], [3, 6]], m), ctx, event=False).pipeline_s == pytest.approx(est.pipeline_s)


def test_gradient_sync_buffer_by_framework_and_zero():
    from sailor.simulator.memory import sync_buffer_bytes
    ctx = make_context(JOB, CLUSTER)
    grad = JOB.state_bytes_per_param["gradients"]
    # DeepSpeed's allreduce_bucket flattens the stage's gradient: a copy of all of it
    assert sync_buffer_bytes(ctx, 4, ((0, 13),)) == pytest.approx(ctx.stage_params(4, 0, 13) * grad)
    # ZeRO-2/3 reduce-scatter layer by layer: the largest layer's gradient
    assert sync_buffer_bytes(ctx, 4, ((0, 13),), zero=2) == pytest.approx(max(JOB.model.params(i, 4) for i in range(13)) * grad)
    # Megatron-LM all-reduces its contiguous gradient buffer in place
    meg = make_context(JobSpec(model="opt-350m", global_batch_size=32, framework="megatron-lm"), CLUSTER)
    assert sync_buffer_bytes(meg, 4, ((0, 13),)) == 0.0
    est = simulate(_plan([[0, 13], [13, 26]], m=4, mbs=2), ctx)
    assert est.replicas[0].memory.sync_buffer == pytest.approx(ctx.stage_params(4, 0, 13) * grad)


def test_an_interleaved_stage_pays_the_pass_overhead_once_per_chunk_pass():
    # tiny (6 layers), every layer f = 1 s, b = 2 s at micro-batch 2; the runtime's fixed cost of a
    # stage pass (`runtime.pass_overhead_s`) 0.25 s forward, 0.5 s backward, its per-micro-batch
    # overhead 0.125 s (forward): a pass of a chunk of n layers takes n + 0.375 forward, 2n + 0.5 backward.
    from sailor.simulator import Slot, pipeline_times
    from sailor.simulator.schedules import PipelineSchedule

    job = JobSpec(model="tiny", global_batch_size=8)
    n = job.model.num_layers
    prof = Profiles(model="tiny", sequence_length=job.seq, precision=job.precision,
                    times={("A100-40", 1): {2: np.tile([1.0, 2.0], (n, 1))}},
                    microbatch_overhead_s={("A100-40", 1): 0.125}, pass_overhead_s={("A100-40", 1): (0.25, 0.5)})
    ctx = make_context(job, CLUSTER, prof)
    slots = [Slot(zone="us-central1-a", gpu="A100-40", tp=1)] * 2
    # 1F1B over stages [0, 3) and [3, 6): one pass per micro-batch and direction, 3 layers each
    one = pipeline_times(ctx, slots, [(0, 3), (3, 6)], 2)
    assert one.forward_s[:, 0] == pytest.approx([3.375] * 2) and one.backward_s[:, 0] == pytest.approx([6.5] * 2)
    # interleaved, v = 3 one-layer chunks per stage: the same 3 layers per stage, 3 passes per
    # micro-batch and direction, each paying the fixed costs: 3 x 1.375 = 4.125 forward, 3 x 2.5 = 7.5 backward
    inter = PipelineSchedule(kind=ScheduleKind.INTERLEAVED, virtual_stages=3)
    t = pipeline_times(ctx, slots, [(i, i + 1) for i in range(6)], 2, schedule=inter)
    assert t.forward_s == pytest.approx(np.full((2, 3), 1.375)) and t.backward_s == pytest.approx(np.full((2, 3), 2.5))
    assert t.forward_s.sum(axis=1) - one.forward_s[:, 0] == pytest.approx([2 * 0.375] * 2)  # v - 1 more of each
    assert t.backward_s.sum(axis=1) - one.backward_s[:, 0] == pytest.approx([2 * 0.5] * 2)
    # ZB-H1 splits the backward: the input-gradient pass (which sends) pays the backward's fixed cost, W none
    zb = pipeline_times(ctx, slots, [(0, 3), (3, 6)], 2, schedule=PipelineSchedule(kind=ScheduleKind.ZB_H1))
    bi, bw = ctx.stage_backward_split_s("A100-40", 1, 2, 0, 3)
    assert bi + bw == pytest.approx(6.5) and zb.backward_s[0, 0] == pytest.approx(bi) and zb.weight_s[0, 0] == pytest.approx(bw)
    split = prof.backward_split(job, "A100-40", 1, 2, np.full(n, 2.0))  # the layers' split by FLOPs
    assert bi == pytest.approx(split[:3, 0].sum() + 0.5) and bw == pytest.approx(split[:3, 1].sum())
    # a TP degree without its own figure takes the nearest measured one's; another GPU type pays none
    assert prof.pass_overhead("A100-40", 2) == (0.25, 0.5) and prof.pass_overhead("V100-16", 1) == (0.0, 0.0)
