"""Simulator: every memory option by hand (recomputation time and memory, ZeRO-1/2/3 sync, gathers,
optimizer and state bytes, sequence parallelism, TP collectives charged or not), and the closed
form still equal to the event simulation on uniform pipelines with options."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.catalog import Link, LinkClass
from sailor.model.activations import layer_bytes, recompute_transient_bytes
from sailor.model.spec import Collective, Recompute
from sailor.perf.network import NetworkModel
from sailor.perf.profile_lookup import Profiles
from sailor.plan.spec import Plan, StageMemory
from sailor.simulator import Slot, make_context, simulate, stage_time, time_options
from sailor.simulator.collectives import tp_collective_time_s
from sailor.simulator.memory import replica_memory
from sailor.simulator.terms import exposed_gathers
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZONE = "us-central1-a"
JOB = JobSpec(model="tiny", global_batch_size=16)  # 6 layers: embedding, 4 blocks, head; seq 64, fp32
# 1 GPU per node: every replica on a node of its own (a TP-2 group still gets one node), so every
# transfer and sync between replicas takes the same_zone link below (placement: tests/test_network.py)
CLUSTER = ClusterSpec(zones={ZONE: {"A100-40": 16}}, prices={"A100-40": 1.0}, gpus_per_node={"A100-40": 1})
ALPHA, BETA = 1e-3, 1e8  # same_zone link between replicas: 1 ms + bytes / 100 MB/s


def _profiles(embed_head_s: float = 1.0) -> Profiles:
    """Measured at TP 1 and 2 (so TP collectives are in the times): every block f = 1 s, b = 2 s per
    micro-batch of 2; the embedding and head take `embed_head_s` forward and twice that backward."""
    t = np.tile([1.0, 2.0], (6, 1))
    t[[0, 5]] = [embed_head_s, 2 * embed_head_s]
    return Profiles(model="tiny", sequence_length=64, precision=JOB.precision,
                    times={("A100-40", 1): {2: t}, ("A100-40", 2): {2: t}}, optimizer_s_per_param={"A100-40": 1e-6})


def _ctx(job=JOB, profiles=None):
    net = NetworkModel(cluster=CLUSTER, class_links={LinkClass.SAME_ZONE: Link(ALPHA, BETA)})
    return make_context(job, CLUSTER, profiles if profiles is not None else _profiles(), net, calibration={})


def _plan(memory, stages=((0, 6),), d=1, tp=1, m=2, mbs=2) -> Plan:
    reps = [{"stage": i, "gpu": "A100-40", "zone": ZONE, "tp": tp} for i in range(len(stages))]
    return Plan.model_validate({"micro_batch_size": mbs, "stages": [list(s) for s in stages],
                                "pipelines": [{"microbatches": m, "replicas": reps}] * d,
                                "memory": [dict(x) for x in memory]})


def test_full_recomputation_adds_the_recomputed_blocks_forward_to_the_backward():
    ctx = _ctx()
    slot = Slot(zone=ZONE, gpu="A100-40", tp=1)
    plain = stage_time(ctx, slot, 2, 0, 6)
    assert (plain.forward_s, plain.backward_s) == pytest.approx((6.0, 12.0))
    full = stage_time(ctx, slot, 2, 0, 6, time_options(StageMemory(recompute="full")))
    assert (full.forward_s, full.backward_s, full.recompute_s) == pytest.approx((6.0, 16.0, 4.0))  # 4 blocks
    two = stage_time(ctx, slot, 2, 0, 6, time_options(StageMemory(recompute="full", recompute_blocks=2)))
    assert two.backward_s == pytest.approx(14.0)
    # selective: the attention core's share of each block's forward (the analytic model's share)
    share = ctx.profiles.attention_core_share(JOB, "A100-40", 1, 2)
    assert 0 < share < 1
    sel = stage_time(ctx, slot, 2, 0, 6, time_options(StageMemory(recompute="selective")))
    assert sel.backward_s == pytest.approx(12.0 + 4 * share)
    # the plan's recompute FLOPs: 4 blocks' forward per sample, every sample of the batch
    est = simulate(_plan([{"recompute": "full"}], m=8), ctx)
    assert est.recompute_flop_per_iteration == pytest.approx(16 * 4 * JOB.model.forward_flop(1, tp=1, mbs=1, seq=64))


def test_zero_sync_is_reduce_scatter_plus_all_gather_and_the_optimizer_steps_on_a_shard():
    ctx = _ctx(JobSpec(model="tiny", global_batch_size=16, precision="bf16"))
    d = 4
    n = ctx.stage_params(1, 0, 6)
    weights = 2 * n  # bf16 weights (the gradients are fp32: 4 bytes a parameter)
    step = lambda nbytes: ALPHA + nbytes / d / BETA  # one ring step of a D = 4 ring of TP-1 replicas
    est = {z: simulate(_plan([{"zero": z}], d=d), ctx) for z in (0, 1, 2, 3)}
    # the gradients' collectives run per layer bucket under the backward (2 s a layer), so only the
    # last one's shows: the embedding's (layer 0); the weights' all-gather follows the step in full
    last = 4 * ctx.stage_params(1, 0, 1)
    assert est[0].gradient_sync_s == pytest.approx(2 * (d - 1) * step(last), rel=1e-5)  # all-reduce
    assert est[1].gradient_sync_s == pytest.approx((d - 1) * step(last) + (d - 1) * step(weights), rel=1e-5)
    assert est[2].gradient_sync_s == pytest.approx(est[1].gradient_sync_s)
    assert est[3].gradient_sync_s == pytest.approx((d - 1) * step(last), rel=1e-5)  # reduce-scatter only
    assert est[0].optimizer_s == pytest.approx(n * 1e-6)
    for z in (1, 2, 3):
        assert est[z].optimizer_s == pytest.approx(n * 1e-6 / d)
    # ZeRO-3 all-gathers each layer's weights before every micro-batch's forward and again before its
    # backward, one layer ahead: each layer's gather (about 3.5 ms) hides under the previous layer's
    # compute (1 s forward, 2 s backward), all but the first of each pass (layer 0 forward, 5 backward)
    gather = [(d - 1) * step(2 * ctx.stage_params(1, x, x + 1)) for x in range(6)]
    assert max(gather) < 1.0
    r0, r3 = est[0].replicas[0], est[3].replicas[0]
    assert r3.forward_s == pytest.approx(r0.forward_s + gather[0])
    assert r3.backward_s == pytest.approx(r0.backward_s + gather[5])
    assert r3.gather_s == pytest.approx(gather[0] + gather[5]) and r0.gather_s == 0.0
    # kept for the iteration: nothing per micro-batch; the first forward's gathers delay the fill once
    kept = simulate(_plan([{"zero": 3, "reshard_after_forward": False}], d=d), ctx)
    rk = kept.replicas[0]
    assert (rk.forward_s, rk.backward_s, rk.gather_s) == pytest.approx((r0.forward_s, r0.backward_s, 0.0))
    assert kept.pipeline_s == pytest.approx(est[0].pipeline_s + gather[0])
    assert kept.gradient_sync_s == pytest.approx(est[3].gradient_sync_s)
    # with one replica nothing is sharded or gathered
    alone = simulate(_plan([{"zero": 3}], d=1), ctx)
    assert alone.replicas[0].forward_s == pytest.approx(r0.forward_s) and alone.gradient_sync_s == 0.0


def test_zero2_and_3_reduce_scatter_once_per_micro_batch():
    # d = 4 replicas of one 6-layer stage, 4 micro-batches each, fp32 (4 B gradients and weights)
    job = JobSpec(model="tiny", global_batch_size=32)
    d, m, n = 4, 4, _ctx(job).stage_params(1, 0, 6)
    grads = 4 * n
    plans = {z: _plan([{"zero": z}], d=d, m=m) for z in (1, 2, 3)}
    assert [p.step_rounds(0) for p in plans.values()] == [m, m, m]  # the runtime's rounds too
    # DeepSpeed reduces after the backward, nothing hidden: the reduce-scatter (half a ring all-reduce,
    # (d - 1) steps) once under ZeRO-1, once per micro-batch under ZeRO-2/3; the weights' all-gather once
    ds = _ctx(job.model_copy(update={"framework": "deepspeed"}))
    nd = ds.stage_params(1, 0, 6)  # DeepSpeed's stage holds one copy of the tied token matrix
    rs = ag = (d - 1) * (ALPHA + 4 * nd / d / BETA)  # fp32: the weights as many bytes as the gradients
    est = {z: simulate(p, ds) for z, p in plans.items()}
    assert est[1].gradient_sync_s == pytest.approx(rs + ag)
    assert est[2].gradient_sync_s == pytest.approx(4 * rs + ag)
    assert est[3].gradient_sync_s == pytest.approx(4 * rs)
    # Sailor's runtime, on a link slow enough (10 kB/s) that every layer's reduce-scatter outlasts any
    # layer's 2 s backward: the collectives queue without a gap from the first layer's backward on
    # (layer 5, 2 s), so past the last backward (at m x 12 s) shows 2 + rounds x sum(per layer) - m x 12
    beta = 1e4
    net = NetworkModel(cluster=CLUSTER, class_links={LinkClass.SAME_ZONE: Link(ALPHA, beta)})
    slow = make_context(job, CLUSTER, _profiles(), net, calibration={})

    def rs_s(nbytes: float) -> float:
        return (d - 1) * (ALPHA + nbytes / d / beta)

    # each layer's bucket: one collective's latency (a 1-byte one) plus its share of the bytes
    per = [rs_s(1) + (rs_s(grads) - rs_s(1)) * slow.stage_params(1, x, x + 1) / n for x in range(6)]
    assert min(per) > 2.0
    once = 2.0 + sum(per) - 12.0  # ZeRO-1: one reduce-scatter, after the last micro-batch's backward
    est = {z: simulate(p, slow) for z, p in plans.items()}
    assert est[1].gradient_sync_s == pytest.approx(once + rs_s(4 * n), rel=1e-9)
    assert est[3].gradient_sync_s == pytest.approx(2.0 + m * sum(per) - m * 12.0, rel=1e-9)
    assert est[2].gradient_sync_s == pytest.approx(est[3].gradient_sync_s + rs_s(4 * n), rel=1e-9)
    # 3 more rounds of reduce-scatters, less the 3 rounds of backward they run under
    assert est[2].gradient_sync_s - est[1].gradient_sync_s == pytest.approx(3 * sum(per) - 3 * 12.0, rel=1e-9)


def test_state_bytes_and_gather_buffer_under_zero():
    ctx = _ctx(JobSpec(model="tiny", global_batch_size=16, precision="bf16"))
    n, d = ctx.stage_params(1, 0, 6), 4
    mem = {z: replica_memory(ctx, "A100-40", 1, 2, ((0, 6),), stage=0, num_stages=1, microbatches=2,
                             memory=StageMemory(zero=z), replicas=d) for z in (0, 1, 2, 3)}
    assert (mem[0].weights, mem[0].gradients, mem[0].optimizer) == pytest.approx((2 * n, 4 * n, 12 * n))
    assert (mem[1].weights, mem[1].gradients, mem[1].optimizer) == pytest.approx((2 * n, 4 * n, 12 * n / d))
    assert (mem[2].weights, mem[2].gradients, mem[2].optimizer) == pytest.approx((2 * n, 4 * n / d, 12 * n / d))
    assert (mem[3].weights, mem[3].gradients, mem[3].optimizer) == pytest.approx((2 * n / d, 4 * n / d, 12 * n / d))
    # ZeRO-3 holds the full weights of the layer being computed and of the next one, being prefetched
    layers = [JOB.model.params(i, 1) for i in range(6)]
    assert mem[3].buffers - mem[2].buffers == pytest.approx(2 * max(x + y for x, y in zip(layers, layers[1:])))
    # kept for the iteration: every layer, and one layer's gather buffer as it is filled in
    kept = replica_memory(ctx, "A100-40", 1, 2, ((0, 6),), stage=0, num_stages=1, microbatches=2,
                          memory=StageMemory(zero=3, reshard_after_forward=False), replicas=d)
    assert kept.buffers - mem[2].buffers == pytest.approx(2 * (sum(layers) + max(layers)))


def test_exposed_gathers_hide_each_layer_under_the_previous_layers_compute():
    # first layer on demand (2); then 3 - 1 = 2 shows, 0.5 hides under 1, 4 - 0.5 = 3.5 shows
    assert exposed_gathers([2.0, 3.0, 0.5, 4.0], [1.0, 1.0, 0.5, 9.0]) == pytest.approx(2.0 + 2.0 + 3.5)
    assert exposed_gathers([0.25], [5.0]) == 0.25 and exposed_gathers([], []) == 0.0


def test_recomputation_memory_keeps_inputs_and_one_transient_block():
    ctx = _ctx(profiles=Profiles(model="tiny", sequence_length=64, precision="fp32"))  # formula activations
    m, kw = JOB.model, dict(tp=2, mbs=2, seq=64, elem_bytes=4)
    held = 3  # stage 0 of 3 with 8 micro-batches holds 3 in flight under 1F1B

    def acts(mem):
        return replica_memory(ctx, "A100-40", 2, 2, ((0, 3),), stage=0, num_stages=3, microbatches=8,
                              memory=StageMemory(**mem)).activations

    embed = layer_bytes(m, 0, **kw)
    block = layer_bytes(m, 1, **kw)
    assert acts({}) == pytest.approx(held * (embed + 2 * block))
    full_in = layer_bytes(m, 1, **kw, recompute=Recompute.FULL)
    transient = recompute_transient_bytes(m, 1, **kw, recompute=Recompute.FULL)
    assert transient == pytest.approx(block - full_in)
    assert acts({"recompute": "full"}) == pytest.approx(held * (embed + 2 * full_in) + transient)
    assert acts({"recompute": "full", "recompute_blocks": 1}) == pytest.approx(held * (embed + full_in + block) + transient)
    sel = layer_bytes(m, 1, **kw, recompute=Recompute.SELECTIVE)
    sel_t = recompute_transient_bytes(m, 1, **kw, recompute=Recompute.SELECTIVE)
    assert acts({"recompute": "selective"}) == pytest.approx(held * (embed + 2 * sel) + sel_t)
    sp = layer_bytes(m, 1, **kw, sequence_parallel=True)
    assert sp < block and acts({"sequence_parallel": True}) == pytest.approx(held * (embed + 2 * sp))


def test_measured_activations_are_scaled_to_the_options_by_the_models_ratio():
    prof = Profiles(model="tiny", sequence_length=64, precision="fp32", activation_bytes={2: np.full(6, 1000.0)})
    m, kw = JOB.model, dict(tp=2, mbs=2, seq=64, elem_bytes=4)
    got = prof.activation_bytes_per_layer(JOB, 2, 2, recompute=Recompute.FULL)
    ratio = layer_bytes(m, 3, **kw, recompute=Recompute.FULL) / layer_bytes(m, 3, **kw)
    assert got[3] == pytest.approx(2000.0 * ratio)
    assert got[0] == pytest.approx(2000.0)  # the embedding is never recomputed


def test_tp_collectives_are_charged_on_roofline_times_and_only_sp_extra_on_measured_ones():
    slot = Slot(zone=ZONE, gpu="A100-40", tp=2)
    roof = _ctx(profiles=Profiles(model="tiny", sequence_length=64, precision="fp32"))
    n = 2 * 64 * 64 * 4  # one activation of a micro-batch of 2, fp32

    def coll(ctx, kind, nbytes):
        return tp_collective_time_s(ctx.network, ZONE, "A100-40", 2, kind, nbytes)

    ar = coll(roof, Collective.ALL_REDUCE, n)
    step = roof.network.transfer_time_s(ZONE, "A100-40", ZONE, "A100-40", n / 2, same_node=True)
    assert ar == pytest.approx(2 * step)  # a ring of 2: 2(t-1) steps of n/t
    # block 1 on its own: 2 all-reduces forward, 2 backward (4 more forward-pass ones with full recompute)
    st = stage_time(roof, slot, 2, 1, 2)
    assert st.tp_comm_s == pytest.approx(4 * ar)
    assert stage_time(roof, slot, 2, 1, 2, time_options(StageMemory(recompute="full"))).tp_comm_s == pytest.approx(6 * ar)
    # embedding: one all-reduce forward; head: the logits all-gather forward, one all-reduce backward
    logits = 2 * 64 * JOB.model.padded_vocab(1) * 4
    assert stage_time(roof, slot, 2, 0, 1).tp_comm_s == pytest.approx(ar)
    assert stage_time(roof, slot, 2, 5, 6).tp_comm_s == pytest.approx(coll(roof, Collective.ALL_GATHER, logits) + ar)
    # measured times hold the TP collectives: nothing is charged, but SP's backward re-gathers are
    meas = _ctx()
    assert meas.tp_comm_included("A100-40", 2)
    assert stage_time(meas, slot, 2, 1, 2).tp_comm_s == 0.0
    sp = stage_time(meas, slot, 2, 1, 2, time_options(StageMemory(sequence_parallel=True)))
    assert sp.tp_comm_s == pytest.approx(2 * coll(meas, Collective.ALL_GATHER, n))
    assert simulate(_plan([{"sequence_parallel": True}], tp=2), meas).tp_communication == ["A100-40 TP 2: included (measured)"]
    assert simulate(_plan([{}], tp=2), roof).tp_communication == ["A100-40 TP 2: charged (intra-node link)"]


@settings(max_examples=40, deadline=None)
@given(P=st.sampled_from([1, 2, 4]), m=st.integers(1, 9), tp=st.sampled_from([1, 2]),
       recompute=st.sampled_from(["none", "selective", "full"]), zero=st.sampled_from([0, 1, 2]),
       sp=st.booleans(), d=st.integers(1, 3))
def test_closed_form_equals_event_simulation_on_uniform_pipelines_with_options(P, m, tp, recompute, zero, sp, d):
    # the same number of blocks per stage and no time in the embedding and head: every stage is alike
    stages = {1: [(0, 6)], 2: [(0, 3), (3, 6)], 4: [(0, 2), (2, 3), (3, 4), (4, 6)]}[P]
    mem = {"recompute": recompute, "zero": zero, "sequence_parallel": sp and tp > 1}
    plan = _plan([mem] * P, stages=stages, d=d, tp=tp, m=m)
    ctx = _ctx(profiles=_profiles(embed_head_s=0.0))
    event, closed = simulate(plan, ctx), simulate(plan, ctx, event=False)
    if P == 1:  # nothing is sent: the runtime's 1F1B and DeepSpeed's closed form agree
        assert closed.pipeline_s == pytest.approx(event.pipeline_s, rel=1e-12)
        assert closed.iteration_time_s == pytest.approx(event.iteration_time_s, rel=1e-12)
    else:  # the closed form charges each transfer to both stages: never less than the runtime's order
        assert closed.pipeline_s >= event.pipeline_s * (1 - 1e-12)
    # a Megatron-LM job (DeepSpeed's blocking 1F1B in the event simulation too) agrees everywhere
    mega = _ctx(JobSpec(model="tiny", global_batch_size=16, framework="megatron-lm"),
                profiles=_profiles(embed_head_s=0.0))
    assert simulate(plan, mega, event=False).pipeline_s == pytest.approx(simulate(plan, mega).pipeline_s, rel=1e-12)


def test_kept_zero3_weights_beat_zero2_where_its_post_step_all_gather_shows():
    # ZeRO-2 all-gathers the updated weights after the step; kept ZeRO-3 gathers them once under the
    # first forward, of which only the first layer's gather shows (as above)
    from sailor.planner.schedules import kept_weight_variants

    ctx = _ctx(JobSpec(model="tiny", global_batch_size=16, precision="bf16"))
    d = 4
    zero2 = _plan([{"zero": 2}], d=d)
    variants = kept_weight_variants(zero2)
    assert [v.stage_memory(0) for v in variants] == [StageMemory(zero=3, reshard_after_forward=False)]
    assert kept_weight_variants(_plan([{"zero": 2}], d=1)) == []  # one pipeline: nothing sharded
    two, kept = simulate(zero2, ctx), simulate(variants[0], ctx)
    n = ctx.stage_params(1, 0, 6)
    first = (d - 1) * (ALPHA + 2 * ctx.stage_params(1, 0, 1) / d / BETA)
    assert two.iteration_time_s - kept.iteration_time_s == pytest.approx((d - 1) * (ALPHA + 2 * n / d / BETA) - first)


def test_bucket_syncs_overlap_the_backward_as_a_queue_on_one_link():
    from sailor.simulator.sync import exposed_sync_s

    # layers finish at 1, 2, 3; collectives of 0.5 s hide but the last; of 2 s they queue: ends 3, 5, 7
    assert exposed_sync_s([0.5, 0.5, 0.5], [1.0, 1.0, 1.0]) == pytest.approx(0.5)
    assert exposed_sync_s([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == pytest.approx(7.0 - 3.0)
    assert exposed_sync_s([], []) == 0.0
    # rounds: the chain again after each round's compute. 2 s collectives, 2 rounds: ends 3, 5, ..., 13
    # after the last layer at 6; a 3 s and a 0.1 s collective under 1 s and 2 s layers: layers end at
    # 1, 3, 4, 6, collectives at 4, 4.1, 7.1, 7.2
    assert exposed_sync_s([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], rounds=2) == pytest.approx(13.0 - 6.0)
    assert exposed_sync_s([0.5, 0.5, 0.5], [1.0, 1.0, 1.0], rounds=3) == pytest.approx(0.5)
    assert exposed_sync_s([3.0, 0.1], [1.0, 2.0], rounds=2) == pytest.approx(7.2 - 6.0)
    assert exposed_sync_s([3.0, 0.1] * 2, [1.0, 2.0] * 2) == pytest.approx(7.2 - 6.0)


def test_sailor_sync_is_what_the_backward_cannot_hide_deepspeed_syncs_after_it():
    from sailor.simulator.collectives import group_members
    from sailor.simulator.sync import stage_sync

    job = JobSpec(model="tiny", global_batch_size=16)
    groups = group_members([Slot(zone=ZONE, gpu="A100-40", tp=1)] * 4)
    sailor, ds = _ctx(job), _ctx(job.model_copy(update={"framework": "deepspeed"}))
    # one D = 4 ring all-reduce per layer: 2 x 3 steps of α + bytes / 4 / β, under the layers' 2 s backward
    per = [6 * (ALPHA + 4 * sailor.stage_params(1, x, x + 1) / 4 / BETA) for x in (3, 2, 1)]
    assert max(per) < 2.0
    assert stage_sync(sailor, groups, ((1, 4),), mbs=2)[0] == pytest.approx(per[-1], rel=1e-5)  # only the last shows
    assert stage_sync(sailor, groups, ((1, 4),))[0] == pytest.approx(per[-1], rel=1e-5)  # the planner's lower bound
    whole = 6 * (ALPHA + 4 * ds.stage_params(1, 1, 4) / 4 / BETA)
    assert stage_sync(ds, groups, ((1, 4),), mbs=2)[0] == pytest.approx(whole)
