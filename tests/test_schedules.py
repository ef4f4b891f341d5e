"""Pipeline schedules (issue 16, phase 1): orders, event simulations, closed forms, memory in flight,
the plan's `schedule` field as the simulator reads it, and the timeline picture."""

from __future__ import annotations

from sailor.model.spec import Framework

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.plan import plan_from_dict
from sailor.plan.orders import BWD, FWD, WGRAD, interleaved_order, microbatch_groups, zb_h1_order
from sailor.plan.spec import ScheduleKind
from sailor.report.figures import timeline_figure
from sailor.simulator import TrafficKind, make_context, simulate
from sailor.simulator.memory import replica_memory
from sailor.simulator.schedule_orders import run_orders
from sailor.simulator.schedules import (ONE_F_ONE_B, PipelineSchedule, PipelineTimes, bubble_ratio,
                                        closed_form_interleaved, closed_form_zb_h1, pipeline_schedule)
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

INTERLEAVED = lambda v: PipelineSchedule(kind=ScheduleKind.INTERLEAVED, virtual_stages=v)  # noqa: E731
ZB_H1 = PipelineSchedule(kind=ScheduleKind.ZB_H1)


def _orders(sched: PipelineSchedule, p: int, m: int):
    if sched.kind is ScheduleKind.ZB_H1:
        return [zb_h1_order(p, i, m) for i in range(p)]
    return [interleaved_order(p, sched.virtual_stages, i, m) for i in range(p)]


# ---- orders ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, v, m", list(itertools.product((1, 2, 3, 5), (1, 2, 3), (1, 2, 4, 7, 10))))
def test_every_pass_once_and_after_its_own_forward(p, v, m):
    for sched in (INTERLEAVED(v), ZB_H1) if v > 1 else (ZB_H1,):
        for order in _orders(sched, p, m):
            kinds = (FWD, BWD, WGRAD) if sched.splits_backward else (FWD, BWD)
            assert sorted(order) == sorted((k, c, mb) for k in kinds for c in range(sched.virtual_stages)
                                           for mb in range(m))
            seen = {}
            for n, op in enumerate(order):
                seen[op] = n
                if op.kind == BWD:
                    assert seen[(FWD, op.chunk, op.micro_batch)] < n
                if op.kind == WGRAD:
                    assert seen[(BWD, op.chunk, op.micro_batch)] < n


def test_orders_by_hand():
    # interleaved, 2 stages x 2 chunks, 2 micro-batches: one group of 2; stage 1 warms up with
    # 2(p-i-1) + (v-1)·2 = 2 forwards, then one forward and one backward at a time
    assert [tuple(o) for o in interleaved_order(2, 2, 1, 2)] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 0, 0), ("B", 0, 1)]
    assert [tuple(o)[0] for o in interleaved_order(2, 2, 0, 2)] == ["F"] * 4 + ["B"] * 4
    # ZB-H1, 3 stages, 4 micro-batches: stage 1 defers one W, stage 2 two
    assert [f"{o.kind}{o.micro_batch}" for o in zb_h1_order(3, 1, 4)] == [
        "F0", "F1", "B0", "F2", "B1", "W0", "F3", "B2", "W1", "B3", "W2", "W3"]
    assert [f"{o.kind}{o.micro_batch}" for o in zb_h1_order(3, 2, 4)] == [
        "F0", "B0", "F1", "B1", "F2", "B2", "W0", "F3", "B3", "W1", "W2", "W3"]
    assert microbatch_groups(4, 11) == [6, 5] and microbatch_groups(4, 3) == [3] and microbatch_groups(4, 8) == [4, 4]
    assert microbatch_groups(3, 10) == [4, 3, 3] and microbatch_groups(4, 7) == [7]


# ---- event simulation by hand --------------------------------------------------------------------------
def test_zb_h1_two_stages_by_hand():
    # f = b = w = 1, m = 2: stage 1 F0 [1,2] B0 [2,3] F1 [3,4] B1 [4,5] W0 [5,6] W1 [6,7]; stage 0
    # F0 F1 [0,2], waits, B0 [3,4] W0 [4,5] B1 [5,6] W1 [6,7]: 7 s (1F1B with B+W = 2: 9 s)
    t = PipelineTimes.uniform(2, 1, forward_s=1.0, backward_s=1.0, weight_s=1.0)
    assert ZB_H1.time_s(t, 2) == pytest.approx(7.0)
    assert ZB_H1.closed_form_s(t, 2) == pytest.approx(7.0)
    merged = PipelineTimes.uniform(2, 1, forward_s=1.0, backward_s=2.0)
    assert closed_form_interleaved(merged, 2) == pytest.approx(9.0)


def test_interleaved_two_stages_by_hand():
    # chunk passes of 1 s, 2 stages x 2 chunks, 2 micro-batches: stage 0 ends with B(0, 1) at 10 s
    t = PipelineTimes.uniform(2, 2, forward_s=2.0, backward_s=2.0)
    ops = INTERLEAVED(2).timeline(t, 2)
    assert [(o.kind, o.chunk, o.micro_batch, o.start_s) for o in ops[0]] == [
        ("F", 0, 0, 0.0), ("F", 0, 1, 1.0), ("F", 1, 0, 2.0), ("F", 1, 1, 3.0),
        ("B", 1, 0, 5.0), ("B", 1, 1, 7.0), ("B", 0, 0, 8.0), ("B", 0, 1, 9.0)]
    assert INTERLEAVED(2).time_s(t, 2) == pytest.approx(10.0) == closed_form_interleaved(t, 2)


def test_transfers_arrive_later_and_do_not_block_the_sender():
    # 2 stages, f = 1, b = 2, c = 0.5, one micro-batch: F0 [0,1], arrives 1.5, F [1.5,2.5], B [2.5,4.5],
    # gradient arrives 5.0, B [5,7]
    t = PipelineTimes(np.array([[1.0], [1.0]]), np.array([[2.0], [2.0]]), np.zeros((2, 1)), np.array([0.5]))
    ops = [[], []]
    end = run_orders([zb_h1_order(2, i, 1) for i in range(2)], t.forward_s, t.backward_s, t.weight_s,
                     t.transfer_s, 1, ops)
    assert end.tolist() == [7.0, 4.5]
    assert [(o.start_s, o.end_s) for o in ops[0]] == [(0.0, 1.0), (5.0, 7.0), (7.0, 7.0)]


# ---- closed forms = event simulation on uniform pipelines (properties) ----------------------------------
passes = st.floats(min_value=0.01, max_value=5.0)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 6), st.integers(2, 4), st.integers(1, 20), passes, passes)
def test_interleaved_closed_form_equals_event_without_transfers(p, v, m, f, b):
    t = PipelineTimes.uniform(p, v, forward_s=f, backward_s=b)
    assert closed_form_interleaved(t, m) == pytest.approx(INTERLEAVED(v).time_s(t, m), rel=1e-9)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 6), st.integers(2, 4), st.integers(1, 5), st.booleans(), passes, passes, st.floats(0.0, 1.0))
def test_interleaved_closed_form_equals_event_with_hidden_transfers(p, v, groups, few, f, b, share):
    m = max(1, p - groups) if few else groups * p  # m <= p or a multiple of p
    c = share * min(f, b) / v  # no longer than the shortest chunk pass
    t = PipelineTimes.uniform(p, v, forward_s=f, backward_s=b, transfer_s=c)
    assert closed_form_interleaved(t, m) == pytest.approx(INTERLEAVED(v).time_s(t, m), rel=1e-9)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), passes, passes, passes)
def test_zb_h1_closed_form_equals_event_without_transfers(p, m, f, b, w):
    t = PipelineTimes.uniform(p, 1, forward_s=f, backward_s=b, weight_s=w)
    assert closed_form_zb_h1(t, m) == pytest.approx(ZB_H1.time_s(t, m), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6), st.integers(1, 16), passes, passes, passes, st.floats(0.001, 3.0))
def test_zb_h1_closed_form_is_a_lower_bound_with_transfers(p, m, f, b, w, c):
    t = PipelineTimes.uniform(p, 1, forward_s=f, backward_s=b, weight_s=w, transfer_s=c)
    assert closed_form_zb_h1(t, m) <= ZB_H1.time_s(t, m) * (1 + 1e-9)


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (4, 4, 16), (3, 2, 6), (8, 3, 8)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, v, m):
    t = PipelineTimes.uniform(p, v, forward_s=1.0, backward_s=2.0)
    assert bubble_ratio(INTERLEAVED(v), t, m) == pytest.approx((p - 1) / (v * m))
    assert bubble_ratio(ONE_F_ONE_B, PipelineTimes.uniform(p, 1, forward_s=1.0, backward_s=2.0), m) == pytest.approx(
        (p - 1) / m)


def test_zb_h1_bubble_is_a_third_of_1f1b_for_equal_passes():
    # Qi et al. 2024: ZB-H1's bubble is (p - 1)(T_F + T_B - T_W), a third of 1F1B's for equal passes
    p, m = 4, 12
    zb = PipelineTimes.uniform(p, 1, forward_s=1.0, backward_s=1.0, weight_s=1.0)
    plain = PipelineTimes.uniform(p, 1, forward_s=1.0, backward_s=2.0)
    assert ZB_H1.time_s(zb, m) - m * 3 == pytest.approx((p - 1) * 1.0)
    assert ONE_F_ONE_B.time_s(plain, m) - m * 3 == pytest.approx((p - 1) * 3.0)


@st.composite
def pipelines(draw):
    p, v, m = draw(st.integers(2, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 12))
    arr = lambda: np.array(draw(st.lists(passes, min_size=p * v, max_size=p * v))).reshape(p, v)  # noqa: E731
    c = np.array(draw(st.lists(st.floats(0.0, 2.0), min_size=p * v - 1, max_size=p * v - 1)))
    return p, v, m, PipelineTimes(arr(), arr(), arr() if v == 1 else np.zeros((p, v)), c)


@settings(max_examples=150, deadline=None)
@given(pipelines(), st.data())
def test_faster_pass_or_link_never_slows_a_heterogeneous_pipeline(pl, data):
    p, v, m, t = pl
    sched = ZB_H1 if v == 1 else INTERLEAVED(v)
    base = sched.time_s(t, m)
    i, c = data.draw(st.integers(0, p - 1)), data.draw(st.integers(0, v - 1))
    cut = data.draw(st.floats(0.05, 1.0))
    arrays = [x.copy() for x in (t.forward_s, t.backward_s, t.weight_s)]
    for x in arrays:
        x[i, c] *= cut
    assert sched.time_s(PipelineTimes(*arrays, t.transfer_s), m) <= base + 1e-9
    assert sched.time_s(PipelineTimes(t.forward_s, t.backward_s, t.weight_s, t.transfer_s * cut), m) <= base + 1e-9


# ---- planner hooks ------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(pipelines(), st.data())
def test_closed_forms_are_affine_in_m_from_where_they_say(pl, data):
    p, v, _, t = pl
    sched = data.draw(st.sampled_from([ZB_H1, ONE_F_ONE_B] if v == 1 else [INTERLEAVED(v)]))
    a, slope, m0 = sched.closed_form_affine(t)
    assert m0 == (2 if sched == ONE_F_ONE_B else p) and slope > 0
    for m in range(m0, m0 + 6):
        assert sched.closed_form_s(t, m) == pytest.approx(a + slope * m, rel=1e-9, abs=1e-9)


def test_interleave_partition_keeps_each_stages_layer_count():
    from sailor.plan.spec import interleave_partition

    # 26 layers over 4 stages (7, 6, 7, 6) into 2 chunks each: stage 0 gets 4 + 3 layers, ...
    chunks = interleave_partition([(0, 7), (7, 13), (13, 20), (20, 26)], 2)
    assert chunks == ((0, 4), (4, 7), (7, 11), (11, 14), (14, 17), (17, 20), (20, 23), (23, 26))
    plan = _plan([list(c) for c in chunks], {"kind": "interleaved-1f1b", "virtual_stages": 2})
    assert [sum(b - a for a, b in plan.stage_chunks(i)) for i in range(4)] == [7, 6, 7, 6]
    assert interleave_partition([(0, 3), (3, 6)], 1) == ((0, 3), (3, 6))


# ---- memory in flight -----------------------------------------------------------------------------------
def test_in_flight_per_schedule():
    assert [ONE_F_ONE_B.in_flight(i, 4, 8).held for i in range(4)] == [(4,), (3,), (2,), (1,)]
    # ZB-H1: every stage holds min(p, m) micro-batches whose W has not run (at its peak)
    assert [ZB_H1.in_flight(i, 4, 8).micro_batches for i in range(4)] == [4, 4, 4, 4]
    assert [ZB_H1.in_flight(i, 4, 2).micro_batches for i in range(4)] == [2, 2, 2, 2]
    # interleaved: warm-up 2(p - i - 1) + (v - 1)·p forwards plus the first steady one, in chunk passes
    got = [INTERLEAVED(2).in_flight(i, 4, 8) for i in range(4)]
    assert [x.micro_batches for x in got] == [11, 9, 7, 5]
    # stage 0 forwards chunk 0 of 0..3, chunk 1 of 0..3, chunk 0 of 4, 5 (warm-up) and 6 before its first B
    assert got[0].held == (7, 4)
    assert INTERLEAVED(2).in_flight(0, 4, 2).micro_batches == 4  # every chunk pass of m = 2


def test_uneven_chunks_pick_the_heaviest_point():
    # stage 0 of 2 x 2 chunks, m = 4: chunk 1 is 10x heavier, so the peak is where the most chunk-1
    # forwards are held, not where the most passes are
    light = INTERLEAVED(2).in_flight(0, 2, 4, held_bytes=[1.0, 1.0])
    heavy = INTERLEAVED(2).in_flight(0, 2, 4, held_bytes=[1.0, 10.0])
    assert light.micro_batches >= heavy.micro_batches and heavy.held[1] >= light.held[1]


JOB = JobSpec(model="opt-350m", global_batch_size=32)
CLUSTER = ClusterSpec(zones={"us-central1-a": {"A100-40": 16}, "us-west1-b": {"A100-40": 16}})
FOUR = [[0, 7], [7, 13], [13, 20], [20, 26]]
EIGHT = [[0, 4], [4, 7], [7, 10], [10, 13], [13, 16], [16, 19], [19, 22], [22, 26]]


def _plan(stages, schedule=None, zones=("us-central1-a",) * 4, micro=(16,), memory=None):
    reps = [{"stage": i, "gpu": "A100-40", "zone": z, "tp": 1} for i, z in enumerate(zones)]
    d = {"micro_batch_size": 2, "stages": stages, "pipelines": [{"microbatches": m, "replicas": reps} for m in micro]}
    if schedule:
        d["schedule"] = schedule
    if memory:
        d["memory"] = memory
    return plan_from_dict(d).with_specs(JOB, CLUSTER)


def test_interleaved_sync_buffer_counts_every_chunk_of_the_stage():
    # stage 0 of EIGHT under v = 2 holds [0, 4) and [13, 16): the flat gradient copy of its sync
    # covers both chunks (DeepSpeed-style, ZeRO-0), or the largest layer of either under ZeRO-2
    ctx = make_context(JOB, CLUSTER)
    grad = JOB.state_bytes_per_param["gradients"]
    inter = {"kind": "interleaved-1f1b", "virtual_stages": 2}
    est = simulate(_plan(EIGHT, inter), ctx)
    both = ctx.stage_params(1, 0, 4) + ctx.stage_params(1, 13, 16)
    assert est.replicas[0].chunks == ((0, 4), (13, 16))
    assert est.replicas[0].memory.sync_buffer == pytest.approx(both * grad)
    zero2 = simulate(_plan(EIGHT, inter, micro=(8, 8), memory=[{"zero": 2}] * 4), ctx)
    largest = max(JOB.model.params(x, 1) for x in (*range(0, 4), *range(13, 16)))
    assert zero2.replicas[0].memory.sync_buffer == pytest.approx(largest * grad)


def test_zb_h1_memory_holds_pending_weight_gradient_inputs():
    ctx = make_context(JOB, CLUSTER)
    m = JOB.model
    one = replica_memory(ctx, "A100-40", 1, 2, ((7, 13),), stage=1, num_stages=4, microbatches=16)
    zb = replica_memory(ctx, "A100-40", 1, 2, ((7, 13),), stage=1, num_stages=4, microbatches=16, schedule=ZB_H1)
    act = float(ctx.act_cumsum(1, 2)[13] - ctx.act_cumsum(1, 2)[7])
    pending = sum(m.weight_grad_pending_bytes(x, tp=1, mbs=2, seq=JOB.seq, elem_bytes=JOB.elem_bytes) for x in range(7, 13))
    held = ZB_H1.in_flight(1, 4, 16, [act + ctx.boundary_bytes(7, 2)], [pending])
    assert one.activations == pytest.approx(3 * act)  # 1F1B: p - i = 3
    assert zb.activations == pytest.approx(held.micro_batches * act + held.pending[0] * pending)
    assert held.micro_batches == 4 and held.pending[0] >= 1
    # block: s·b·e·((h + 2h + f)/t + 2h) with f = 4h, e = 4 (fp32)
    h = m.hidden_size
    assert m.weight_grad_pending_bytes(1, tp=1, mbs=2, seq=JOB.seq, elem_bytes=4) == JOB.seq * 2 * 4 * (7 * h + 2 * h)


def test_simulate_reads_the_plans_schedule():
    ctx = make_context(JOB, CLUSTER)
    plain, zb = simulate(_plan(FOUR), ctx), simulate(_plan(FOUR, {"kind": "zb-h1"}), ctx)
    inter = simulate(_plan(EIGHT, {"kind": "interleaved-1f1b", "virtual_stages": 2}), ctx)
    assert pipeline_schedule(_plan(FOUR), Framework.DEEPSPEED) == ONE_F_ONE_B and zb.schedule == ZB_H1
    # a job of Sailor's runtime times 1F1B as the runtime runs it: its op order, sends never blocking
    assert plain.schedule == pipeline_schedule(_plan(FOUR)) and not plain.schedule.sends_block
    assert plain.schedule.runtime_difference is None and ONE_F_ONE_B.runtime_difference is not None
    assert zb.pipeline_s < plain.pipeline_s  # the W passes fill the bubble
    assert zb.replicas[0].forward_s == pytest.approx(plain.replicas[0].forward_s)
    assert zb.replicas[0].backward_s == pytest.approx(plain.replicas[0].backward_s)  # B + W = backward (FLOP split)
    assert any("backward split from FLOPs" in e for e in zb.estimated)
    r0 = inter.replicas[0]
    assert r0.chunks == ((0, 4), (13, 16)) and r0.layers == (0, 16)
    assert inter.to_dict()["replicas"][0]["chunks"] == [[0, 4], [13, 16]]
    f = sum(ctx.stage_compute_s("A100-40", 1, 2, a, e)[0] for a, e in r0.chunks)
    assert r0.forward_s == pytest.approx(f)
    # the same totals whichever way the pipeline is cut: gradients, weights and the optimizer step
    assert sum(r.memory.weights for r in inter.replicas) == pytest.approx(sum(r.memory.weights for r in plain.replicas))


def test_recompute_blocks_count_over_the_chunks_and_memory_combines_with_the_schedule():
    from sailor.plan.spec import StageMemory
    from sailor.simulator.memory import stage_activation_bytes

    # stage 1 holds [4, 7) and [16, 19): recomputing its first 4 blocks is 4, 5, 6 and 16
    mem = [{}, {"recompute": "full", "recompute_blocks": 4}, {"zero": 1}, {}]
    plan = _plan(EIGHT, {"kind": "interleaved-1f1b", "virtual_stages": 2}, micro=(8, 8), memory=mem)
    assert plan.chunk_memory(1) == (StageMemory(recompute="full", recompute_blocks=3),
                                    StageMemory(recompute="full", recompute_blocks=1))
    assert plan.chunk_memory(2) == (StageMemory(zero=1),) * 2
    ctx = make_context(JOB, CLUSTER)
    est = simulate(plan, ctx)
    c = ctx.layer_cumsum("A100-40", 1, 2)
    r1 = est.replicas[1]
    assert r1.recompute_s == pytest.approx(c[7, 0] - c[4, 0] + c[17, 0] - c[16, 0])
    assert est.pipeline_passes[0].backward_s[1, 1] == pytest.approx(ctx.stage_compute_s("A100-40", 1, 2, 16, 19)[1]
                                                                    + c[17, 0] - c[16, 0])
    # memory: each chunk's bytes under its options, times the interleaved schedule's micro-batches per chunk
    per = [stage_activation_bytes(ctx, 1, 2, a, e, m) for (a, e), m in zip(plan.stage_chunks(1), plan.chunk_memory(1))]
    inputs = [ctx.boundary_bytes(a, 2) for a, _ in plan.stage_chunks(1)]
    held = INTERLEAVED(2).in_flight(1, 4, 8, [k + x for (k, _), x in zip(per, inputs)])
    assert r1.memory.activations == pytest.approx(sum(h * k for h, (k, _) in zip(held.held, per)) + max(t for _, t in per))
    assert per[1][0] > per[0][0] / 3  # chunk 1 keeps blocks 17, 18 whole
    # ZeRO-1 on stage 2: the optimizer steps over half of both chunks' parameters
    full = sum(ctx.stage_params(1, a, e) for a, e in plan.stage_chunks(2))
    assert est.replicas[2].optimizer_s == pytest.approx(ctx.profiles.optimizer_time_s(JOB, "A100-40", full / 2))
    assert est.replicas[2].memory.optimizer == pytest.approx(full * JOB.state_bytes_per_param["optimizer"] / 2)


def test_zb_h1_keeps_what_the_options_add_in_the_input_gradient_pass():
    plan = _plan(FOUR, {"kind": "zb-h1"}, memory=[{}, {}, {"recompute": "selective"}, {}])
    ctx = make_context(JOB, CLUSTER)
    est = simulate(plan, ctx)
    t = est.pipeline_passes[0]
    bi, bw = ctx.stage_backward_split_s("A100-40", 1, 2, 13, 20)
    assert t.weight_s[2, 0] == pytest.approx(bw) and bw > 0
    assert t.backward_s[2, 0] == pytest.approx(bi + est.replicas[2].recompute_s) and est.replicas[2].recompute_s > 0
    one = simulate(_plan(FOUR, memory=[{}, {}, {"recompute": "selective"}, {}]), ctx)
    assert est.replicas[2].backward_s == pytest.approx(one.replicas[2].backward_s)  # FLOP split: B + W = backward


def test_megatron_exchanges_block_the_sender_under_interleaving():
    # Megatron-LM's interleaved schedule waits for each pass's batch_isend_irecv: the send is charged
    # to the pass, the message arrives when it ends; 1F1B keeps DeepSpeed's blocking transfers
    zones = ("us-central1-a", "us-central1-a", "us-west1-b", "us-west1-b")
    plan = _plan(EIGHT, {"kind": "interleaved-1f1b", "virtual_stages": 2}, zones=zones)
    mega = make_context(JobSpec(**(JOB.model_dump(mode="json") | {"framework": "megatron-lm"})), CLUSTER)
    ours, theirs = simulate(plan, make_context(JOB, CLUSTER)), simulate(plan, mega)
    t = theirs.pipeline_passes[0]
    assert not t.transfer_s.any()
    # virtual stage 1 (stage 1, chunk 0, layers [4, 7)) sends its output across the regions and its
    # input's gradient back to virtual stage 0: both are charged to its passes, on the links between
    # the replicas as placed (stages 0 and 1 share a node)
    from sailor.simulator import link_transfer, placed_slots, stage_time
    a, b, west = placed_slots(plan, mega.cluster)[0][:3]
    assert a.node is not None and a.node == b.node
    st = stage_time(mega, b, 2, 4, 7)
    assert t.forward_s[1, 0] == pytest.approx(st.forward_s + link_transfer(mega, b, west, mega.boundary_bytes(7, 2))[0])
    assert t.backward_s[1, 0] == pytest.approx(st.backward_s + link_transfer(mega, a, b, mega.boundary_bytes(4, 2))[0])
    assert theirs.pipeline_s > ours.pipeline_s
    plain = simulate(_plan(FOUR, zones=zones), mega).pipeline_passes[0]  # 1F1B: DeepSpeed's blocking transfers
    assert plain.transfer_s[1] > 0


def test_interleaving_pays_the_wrap_link_and_its_traffic_adds_up():
    zones = ("us-central1-a", "us-central1-a", "us-west1-b", "us-west1-b")
    ctx = make_context(JOB, CLUSTER)
    plain_plan = _plan(FOUR, zones=zones)
    plan = _plan(EIGHT, {"kind": "interleaved-1f1b", "virtual_stages": 2}, zones=zones)
    inter = simulate(plan, ctx)
    p2p = lambda est: sum(t.moved_bytes for t in est.traffic if t.kind is TrafficKind.P2P)  # noqa: E731
    # 1F1B crosses regions once per micro-batch (stage 1 -> 2); interleaved three times (1 -> 2 twice
    # and the last stage back to the first between chunks); the tied-embedding all-reduce once each
    plain = simulate(plain_plan, ctx)
    assert p2p(inter) == pytest.approx(3 * p2p(plain)) and p2p(plain) > 0
    assert sum(t.moved_bytes for t in inter.traffic) == pytest.approx(inter.cross_zone_bytes)
    assert inter.replicas[3].p2p_s > inter.replicas[2].p2p_s  # stage 3 sends over the wrap link too


def test_closed_form_path_of_simulate_uses_the_schedules_closed_form():
    plan = _plan(FOUR, {"kind": "zb-h1"})
    closed = simulate(plan, make_context(JOB, CLUSTER), event=False)
    ctx = make_context(JOB, CLUSTER)
    assert closed.pipeline_s == pytest.approx(ZB_H1.closed_form_s(simulate(plan, ctx).pipeline_passes[0], 16))


@pytest.mark.parametrize("stages, schedule, label", [
    (FOUR, None, "1F1B"), (FOUR, {"kind": "zb-h1"}, "ZB-H1"),
    (EIGHT, {"kind": "interleaved-1f1b", "virtual_stages": 2}, "interleaved 1F1B (v = 2)")])
def test_timeline_draws_each_schedule(tmp_path, stages, schedule, label):
    plan = _plan(stages, schedule, micro=(10, 6))
    est = simulate(plan, make_context(JOB, CLUSTER))
    for j, p in enumerate(plan.pipelines):
        ops = est.schedule.timeline(est.pipeline_passes[j], p.microbatches)
        assert max(o.end_s for stage in ops for o in stage) == pytest.approx(est.pipeline_times_s[j])
        for stage in ops:
            for a, b in itertools.pairwise(stage):
                assert a.start_s <= a.end_s <= b.start_s + 1e-12
    png, svg = timeline_figure(plan, est, tmp_path / "timeline")
    text = svg.read_text()
    assert f"{label} timeline of one iteration" in text
    assert ("weight gradient" in text) == (label == "ZB-H1")


def test_measured_split_feeds_zb_h1_less_the_profilers_gap():
    from sailor.perf.profiles import profiles_from_dict

    n = JOB.model.num_layers
    row = {"gpu": "A100-40", "tp": 1, "mbs": 2, "forward_s": [0.01] * n, "backward_s": [0.02] * n,
           "backward_input_s": [0.012] * n, "backward_weight_s": [0.011] * n}
    prof = profiles_from_dict({"schema": "sailor.profiles/1", "model": "opt-350m", "sequence_length": JOB.seq,
                               "precision": "fp32", "layers": [row]})
    ctx = make_context(JOB, CLUSTER, profiles=prof, calibration={"A100-40": {"profile_overhead_s": 0.001}})
    # layers [7, 13): 6 layers of (0.012 - 0.001) and (0.011 - 0.001): measured, so B + W > backward
    assert ctx.stage_backward_split_s("A100-40", 1, 2, 7, 13) == pytest.approx((6 * 0.011, 6 * 0.010))
    assert ctx.stage_compute_s("A100-40", 1, 2, 7, 13)[1] == pytest.approx(6 * 0.019)
    est = simulate(_plan(FOUR, {"kind": "zb-h1"}), ctx)
    assert est.pipeline_passes[0].weight_s[1, 0] == pytest.approx(0.06) and est.estimated == []
