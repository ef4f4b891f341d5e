"""The runtime's communication under NCCL's rules, modelled on CPU (`runtime.comm_check`, no process
group): per-communicator FIFO with tags ignored, blocking sends, collectives in one order on all
members. Every plan of the equivalence suites, and a sweep over p 2-5, v 1-3, m 1-10, mixed TP,
unequal shares and ZeRO stages, must finish with every message in the buffer of its kind, boundary
and micro-batch; the point-to-point code before per-channel groups (one communicator per pair of
ranks) must fail on every pipelined plan.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_runtime_dist import MEMORY_PLANS, PLANS
from test_runtime_schedules import ODD_PLAN
from test_runtime_schedules import PLANS as SCHEDULE_PLANS

from sailor.plan.orders import Op
from sailor.plan.spec import Plan
from sailor.runtime.comm_check import check_plan, simulate
from sailor.runtime.messages import (
    ACTIVATION,
    GRADIENT,
    Channel,
    Message,
    plan_channels,
    plan_programs,
    rank_program,
)
from sailor.runtime.topology import derive_topology

SUITE = {**{k: {"micro_batch_size": 2, **v} for k, v in {**PLANS, **MEMORY_PLANS, **SCHEDULE_PLANS}.items()},
         "interleaved_p2_odd_m": ODD_PLAN}


def _rep(stage: int, tp: int) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


def _two_stages(m: int, schedule: dict | None = None, v: int = 1) -> Plan:
    return Plan.model_validate({"micro_batch_size": 1, "stages": [[i, i + 1] for i in range(2 * v)],
                                "schedule": schedule or {"kind": "1f1b"},
                                "pipelines": [{"microbatches": m, "replicas": [_rep(0, 1), _rep(1, 1)]}]})


# ---- messages, by hand ----------------------------------------------------------------------------
def test_channels_and_program_of_two_stages_by_hand():
    plan = _two_stages(2)
    topo = derive_topology(plan)
    assert plan_channels(topo) == [Channel(0, 1, ACTIVATION), Channel(1, 0, GRADIENT)]
    first, last = plan_programs(plan, topo)
    # stage 0 runs F0 F1 B0 B1; it posts B0's receive at F1's start (one op ahead) and B1's at B0's
    assert [s.op for s in first] == [Op("F", 0, 0), Op("F", 0, 1), Op("B", 0, 0), Op("B", 0, 1)]
    assert [[t.message for t in s.post] for s in first] == [[], [Message(GRADIENT, 0, 0)], [Message(GRADIENT, 0, 1)],
                                                            []]
    assert [[t.message for t in s.sends] for s in first] == [[Message(ACTIVATION, 0, 0)], [Message(ACTIVATION, 0, 1)],
                                                             [], []]
    # stage 1 runs F0 B0 F1 B1: it receives activations, sends gradients
    assert [[t.message for t in s.recv] for s in last] == [[Message(ACTIVATION, 0, 0)], [],
                                                           [Message(ACTIVATION, 0, 1)], []]
    assert [t.message for s in last for t in s.sends] == [Message(GRADIENT, 0, 0), Message(GRADIENT, 0, 1)]
    # without lookahead each op posts only its own receive
    role = topo.roles[0]
    assert [[t.message for t in s.post] for s in rank_program(role, [s.op for s in first], lookahead=False)] == [
        [], [], [Message(GRADIENT, 0, 0)], [Message(GRADIENT, 0, 1)]]


def test_mixed_tp_scatters_one_channel_per_slice():
    # stage 0 at TP 2 (ranks 0, 1) feeds stage 1 at TP 1 (rank 2): rank 2 receives one half from
    # each, and sends each its half of the gradient back
    plan = Plan.model_validate({"micro_batch_size": 2, **PLANS["c_mixed_tp_two_stages"]})
    topo = derive_topology(plan)
    chans = plan_channels(topo)
    assert [c for c in chans if c.dst == 2 or c.src == 2] == [
        Channel(0, 2, ACTIVATION), Channel(1, 2, ACTIVATION), Channel(2, 0, GRADIENT), Channel(2, 1, GRADIENT)]
    # rank 2's first forward waits for both halves of one message, posted in slice order
    first = plan_programs(plan, topo)[2][0]
    assert [(t.channel.src, t.message) for t in first.recv] == [(0, Message(ACTIVATION, 0, 0)),
                                                                 (1, Message(ACTIVATION, 0, 0))]
    assert first.post[:2] == first.recv


def test_tp_2_to_3_boundary_by_hand():
    # L = 6 pieces: rank 0 (TP 2) sends [0, 2/6) to TP-3 rank 0 and [2/6, 3/6) to rank 1; rank 1
    # sends [3/6, 4/6) to rank 1 and [4/6, 1) to rank 2. Four channels each way, every one used.
    plan = Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 1], [1, 2]],
                                "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 2), _rep(1, 3)]}]})
    topo = derive_topology(plan)
    assert [(c.src, c.dst) for c in plan_channels(topo) if c.kind == ACTIVATION] == [(0, 2), (0, 3), (1, 3), (1, 4)]
    assert [(c.src, c.dst) for c in plan_channels(topo) if c.kind == GRADIENT] == [(2, 0), (3, 0), (3, 1), (4, 1)]
    assert [x.rank for x in topo.roles[3].fwd_recv_from] == [0, 1]
    for blocking in (True, False):
        rep = check_plan(plan, blocking_sends=blocking)
        assert rep.ok and rep.messages == 2 * 4 * 3  # 4 slices per message, both kinds, 3 micro-batches


# ---- the model itself -----------------------------------------------------------------------------
def test_pairs_deadlock_in_two_stage_1f1b_by_hand():
    # One communicator for both directions, blocking sends: stage 0 sends activation 0 (matched by
    # stage 1's first receive), then activation 1, while stage 1 sends gradient 0: both stream heads
    # are sends, neither is a receive.
    old = check_plan(_two_stages(2), "pairs")
    assert old.deadlock and old.messages == 1
    assert "stream heads: send activation u0 k1 0->1" in old.blocked[0]
    assert "stream heads: send gradient u0 k0 1->0" in old.blocked[1]
    assert check_plan(_two_stages(1), "pairs").ok  # one micro-batch: nothing overlaps
    new = check_plan(_two_stages(2))
    assert new.ok and new.messages == 4


def test_pairs_deliver_into_the_wrong_buffers_when_sends_do_not_block():
    # Interleaved, 2 stages, 5 micro-batches, small messages (sends complete at once): with tags
    # ignored, stage 1's receive of a gradient takes the activation stage 0 sent first.
    plan = Plan.model_validate(ODD_PLAN)
    old = check_plan(plan, "pairs", blocking_sends=False)
    assert not old.deadlock and old.wrong_buffer
    assert any(want.kind != got.kind for _, want, got in old.wrong_buffer)
    assert check_plan(plan, blocking_sends=False).ok


def test_model_reports_posting_orders_that_differ_and_collectives_out_of_order():
    plan = _two_stages(3)
    topo = derive_topology(plan)
    programs = plan_programs(plan, topo)
    # the receiver posts micro-batch 1's receive first and 0's second: each buffer gets the other's data
    (k0,), (k1,) = programs[1][0].recv, programs[1][2].recv
    swap = {k0: k1, k1: k0}
    swapped = [s._replace(post=tuple(swap.get(t, t) for t in s.post), recv=tuple(swap.get(t, t) for t in s.recv))
               for s in programs[1]]
    bad = simulate(topo, [programs[0], swapped])
    assert not bad.deadlock and [(w.micro_batch, g.micro_batch) for _, w, g in bad.wrong_buffer] == [(1, 0), (0, 1)]
    # two ZeRO-3 pipelines whose stage 0s run their ops in different orders meet in mismatched collectives
    zplan = Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 1]], "memory": [{"zero": 3}],
                                 "pipelines": [{"microbatches": 2, "replicas": [_rep(0, 1)]}] * 2})
    ztopo = derive_topology(zplan)
    zp = plan_programs(zplan, ztopo)
    rep = simulate(ztopo, [zp[0], [zp[1][1], zp[1][0], *zp[1][2:]]])
    assert rep.collective_mismatch and not rep.ok


# ---- the suite's plans and the sweep --------------------------------------------------------------
@pytest.mark.parametrize("name", list(SUITE))
def test_equivalence_plans_pass_nccl_rules(name):
    plan = Plan.model_validate(SUITE[name])
    for blocking in (True, False):
        rep = check_plan(plan, blocking_sends=blocking)
        assert rep.ok, (rep.blocked, rep.wrong_buffer, rep.collective_mismatch)


def test_old_point_to_point_fails_on_every_pipelined_equivalence_plan():
    # Every plan of the suite with 2+ stages and 2+ micro-batches in a pipeline deadlocks under one
    # communicator per pair; the one single-stage plan has no point-to-point transfer.
    dead = {n for n, d in SUITE.items() if check_plan(Plan.model_validate(d), "pairs").deadlock}
    pipelined = {n for n, d in SUITE.items() if len(d["pipelines"][0]["replicas"]) > 1}
    assert dead == pipelined and len(SUITE) - len(dead) == 1


@st.composite
def plans(draw) -> Plan:
    p, v = draw(st.integers(2, 5)), draw(st.integers(1, 3))
    kind = "interleaved-1f1b" if v > 1 else draw(st.sampled_from(["1f1b", "zb-h1"]))
    schedule = {"kind": kind, "virtual_stages": v} if v > 1 else {"kind": kind}
    pipes = [{"microbatches": draw(st.integers(1, 10)), "replicas": [_rep(i, draw(st.integers(1, 3))) for i in range(p)]}
             for _ in range(draw(st.integers(1, 2)))]
    zeros = st.integers(0, 2) if kind == "zb-h1" else st.integers(0, 3)  # the runtime refuses ZB-H1 with ZeRO-3
    memory = [{"zero": draw(zeros)} for _ in range(p)]
    return Plan.model_validate({"micro_batch_size": 1, "stages": [[i, i + 1] for i in range(p * v)],
                                "schedule": schedule, "memory": memory, "pipelines": pipes})


@settings(max_examples=300, deadline=None)
@given(plan=plans())
def test_sweep_passes_nccl_rules_and_old_point_to_point_deadlocks(plan):
    for blocking in (True, False):
        rep = check_plan(plan, blocking_sends=blocking)
        assert rep.ok, (rep.blocked, rep.wrong_buffer, rep.collective_mismatch)
    pipelined = any(p.microbatches >= 2 for p in plan.pipelines)
    assert check_plan(plan, "pairs").deadlock == pipelined
