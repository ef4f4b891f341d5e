"""The runtime under interleaved 1F1B and ZB-H1: op orders, topology, refusals (no process group) and
training runs against the single-process reference (CPU, gloo, <= 6 processes each).

Each run's loss at every step and its final parameters must equal the reference's within 1e-5
relative, with every point-to-point tag forced to 0 (`SAILOR_IGNORE_TAGS=1`: gloo then matches a
pair's messages in posting order, as NCCL does). The plans mix what can differ: replicas of TP 1 and 2 in one stage, shares 3:1 (rounds
without a micro-batch under ZeRO-2/3), uneven chunks, v = 2 and 3, recomputation (full, counted over
a stage's chunks, and selective), ZeRO-1/2/3 and sequence parallelism.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import live_processes
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.core.errors import SailorInputError
from sailor.plan import plan_from_dict
from sailor.plan.orders import BWD, FWD, WGRAD, interleaved_order, one_f_one_b_order, zb_h1_order
from sailor.plan.spec import Plan, Schedule, ScheduleKind
from sailor.runtime import checkpoint as ckpt
from sailor.runtime.checkpoint_io import load_tensors
from sailor.runtime.data import load_corpus
from sailor.runtime.groups import IGNORE_TAGS_ENV
from sailor.runtime.launcher import ExitStatus, launch
from sailor.runtime.prepare import TrainOptions, prepare
from sailor.runtime.reference import train_reference
from sailor.runtime.schedule import runtime_schedule
from sailor.runtime.topology import derive_topology
from sailor.runtime.validate import check_runtime_options
from sailor.simulator.schedule_orders import run_orders
from sailor.specs.job import JobSpec

JOB = {"model": "tiny", "global_batch_size": 8}
STEPS = 5
RTOL = 1e-5
INTERLEAVED = lambda v: {"kind": "interleaved-1f1b", "virtual_stages": v}  # noqa: E731


def _rep(stage: int, tp: int) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


def _pipes(*tps_and_m) -> list[dict]:
    return [{"microbatches": m, "replicas": [_rep(i, t) for i, t in enumerate(tps)]} for tps, m in tps_and_m]


PLANS = {
    # stage 0 holds [0, 2) + [3, 5): blocks 1, 3, 4 (its first 2 blocks recomputed: 1 and 3, one per
    # chunk); stage 1 holds [2, 3) + [5, 6)
    "interleaved_v2_uneven_mixed_tp": {
        "stages": [[0, 2], [2, 3], [3, 5], [5, 6]], "schedule": INTERLEAVED(2),
        "memory": [{"recompute": "full", "recompute_blocks": 2}, {"recompute": "selective", "zero": 1}],
        "pipelines": _pipes(((2, 1), 3), ((1, 2), 1))},
    # v = 3 one layer per chunk: stage 0 holds layers 0, 2, 4, stage 1 holds 1, 3, 5
    "interleaved_v3_zero3_sp_zero2_full": {
        "stages": [[i, i + 1] for i in range(6)], "schedule": INTERLEAVED(3),
        "memory": [{"zero": 3, "sequence_parallel": True}, {"zero": 2, "recompute": "full"}],
        "pipelines": _pipes(((2, 1), 3), ((2, 1), 1))},
    "zb_h1_mixed_tp_selective_zero1_zero2": {
        "stages": [[0, 3], [3, 6]], "schedule": {"kind": "zb-h1"},
        "memory": [{"recompute": "selective", "zero": 1}, {"zero": 2}],
        "pipelines": _pipes(((2, 1), 3), ((1, 2), 1))},
    "zb_h1_three_stages_sp": {
        "stages": [[0, 2], [2, 4], [4, 6]], "schedule": {"kind": "zb-h1"},
        "memory": [{"sequence_parallel": True}, {}, {}],
        "pipelines": _pipes(((2, 1, 1), 4))},
}


def _plan(d: dict) -> Plan:
    return Plan.model_validate({"micro_batch_size": 2, **d})


# ---- orders ---------------------------------------------------------------------------------------
def test_runtime_reads_the_schedule_once_and_runs_the_simulated_orders():
    assert runtime_schedule(_plan(PLANS["zb_h1_three_stages_sp"])) == Schedule(kind=ScheduleKind.ZB_H1)
    inter = runtime_schedule(_plan(PLANS["interleaved_v3_zero3_sp_zero2_full"]))
    assert inter == Schedule(kind=ScheduleKind.INTERLEAVED, virtual_stages=3) and not inter.splits_backward
    assert inter.order(1, 2, 5) == interleaved_order(2, 3, 1, 5)
    assert Schedule(kind=ScheduleKind.ZB_H1).order(0, 3, 4) == zb_h1_order(3, 0, 4)
    assert Schedule().order(0, 2, 4) == one_f_one_b_order(2, 0, 4)
    # ZB-H1 by hand, 2 stages, 3 micro-batches: stage 1 runs each W right after its B
    assert [f"{o.kind}{o.micro_batch}" for o in zb_h1_order(2, 1, 3)] == ["F0", "B0", "F1", "B1", "W0", "F2", "B2",
                                                                          "W1", "W2"]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 4), v=st.integers(1, 3), rounds=st.integers(1, 9), data=st.data())
def test_orders_of_more_rounds_than_micro_batches_keep_every_pass_once_and_never_deadlock(p, v, rounds, data):
    # A pipeline with m < rounds runs the order of `rounds` and skips k >= m: its real passes are
    # each run once, forward before backward before weight pass, and the event simulation (sends
    # never block, as in the runtime) finishes.
    m = data.draw(st.integers(1, rounds))
    sched = Schedule(kind=ScheduleKind.INTERLEAVED, virtual_stages=v) if v > 1 else Schedule(kind=ScheduleKind.ZB_H1)
    orders = [[op for op in sched.order(i, p, rounds) if op.micro_batch < m] for i in range(p)]
    vv = max(v, 1)
    for order in orders:
        kinds = (FWD, BWD, WGRAD) if sched.splits_backward else (FWD, BWD)
        assert sorted(orders[0]) != [] and sorted(order) == sorted((k, c, j) for k in kinds for c in range(vv)
                                                                   for j in range(m))
        for c in range(vv):
            for j in range(m):
                pos = [order.index((k, c, j)) for k in kinds]
                assert pos == sorted(pos)
    ones = torch.ones(p, vv).numpy()
    end = run_orders(orders, ones, ones, ones if sched.splits_backward else 0 * ones,
                     torch.full((p * vv - 1,), 0.3).numpy(), m)
    assert end.max() > 0


# ---- topology and refusals ----------------------------------------------------------------------
def test_interleaved_topology_wraps_from_the_last_stage_to_the_first():
    topo = derive_topology(_plan(PLANS["interleaved_v2_uneven_mixed_tp"]))
    r = topo.roles
    # ranks: p0 s0 tp2 -> 0, 1; p0 s1 tp1 -> 2; p1 s0 tp1 -> 3; p1 s1 tp2 -> 4, 5
    assert r[0].chunks == ((0, 2), (3, 5)) and r[2].chunks == ((2, 3), (5, 6))
    peers = [tuple(x.rank for x in links) for links in
             (r[0].fwd_recv_from, r[1].fwd_recv_from, r[2].fwd_send_to, r[2].bwd_recv_from, r[0].bwd_send_to,
              r[3].fwd_recv_from, r[4].fwd_send_to, r[5].fwd_send_to)]
    # chunk 1's input from stage 1 (TP 1 -> TP 2: one half each); TP 2 -> TP 1: both halves to rank 3
    assert peers == [(2,), (2,), (0, 1), (0, 1), (2,), (4, 5), (3,), (3,)]
    plain = derive_topology(_plan(PLANS["zb_h1_mixed_tp_selective_zero1_zero2"])).roles
    assert plain[0].fwd_recv_from == () and plain[2].fwd_send_to == () and plain[0].chunks == ((0, 3),)


def test_runtime_refuses_zb_h1_with_zero3_and_full_recomputation_in_one_line():
    job = JobSpec(**JOB)
    zb3 = _plan(PLANS["zb_h1_mixed_tp_selective_zero1_zero2"] | {"memory": [{}, {"zero": 3}]})
    with pytest.raises(SailorInputError, match=r"^plan\.json: memory\.1\.zero: zb-h1 defers weight-gradient passes,"
                                               r" which the runtime cannot run under ZeRO-3"):
        check_runtime_options(zb3, job, source="plan.json")
    with pytest.raises(SailorInputError, match=r"memory\.0\.recompute: zb-h1 defers weight-gradient passes"):
        plan_from_dict({"micro_batch_size": 2, **PLANS["zb_h1_three_stages_sp"],
                        "memory": [{"recompute": "full"}, {}, {}]}, "plan.json")
    for d in PLANS.values():
        check_runtime_options(_plan(d), job)  # every plan below runs


# ---- training runs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    losses, model = train_reference(JobSpec(**JOB), steps=STEPS, seed=0, corpus=load_corpus())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.integration
@pytest.mark.parametrize("name", list(PLANS))
def test_schedule_equals_single_process_run(name, tmp_path, reference, monkeypatch):
    monkeypatch.setenv(IGNORE_TAGS_ENV, "1")
    ref_losses, ref_params = reference
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"micro_batch_size": 2, **PLANS[name], "job": JOB}))
    metrics = tmp_path / f"metrics-{time.monotonic_ns()}.jsonl"
    result = launch(prepare(TrainOptions(plan=str(path), metrics=str(metrics), timeout_s=60, steps=STEPS,
                                         checkpoint_dir=str(tmp_path / "ck"))), handle_signals=False)
    assert result.status is ExitStatus.DONE, result.message + str(result.events)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r, want in zip(rows, ref_losses):
        assert r["loss"] == pytest.approx(want, rel=RTOL)
    found = ckpt.find_latest(tmp_path / "ck")
    got = load_tensors(found.path, found.manifest, list(ref_params))
    for n, want in ref_params.items():
        torch.testing.assert_close(got[n]["param"], want, rtol=RTOL, atol=RTOL, msg=n)
    assert not [cmd for _, cmd in live_processes(str(tmp_path))]


# Interleaved, 2 stages, an odd micro-batch count: one pair of ranks carries activations and gradients
# of several chunks in both directions, the case where messages matched by posting order alone (tags
# ignored) once landed in the wrong buffers and trained to other losses.
ODD_JOB = {"model": "tiny", "global_batch_size": 5}
ODD_PLAN = {"micro_batch_size": 1, "stages": [[0, 2], [2, 3], [3, 5], [5, 6]], "schedule": INTERLEAVED(2),
            "pipelines": _pipes(((1, 1), 5))}


@pytest.mark.integration
def test_interleaved_two_stages_odd_m_with_tags_ignored_equals_single_process_run(tmp_path, monkeypatch):
    monkeypatch.setenv(IGNORE_TAGS_ENV, "1")
    steps = 3
    ref_losses, _ = train_reference(JobSpec(**ODD_JOB), steps=steps, seed=0, corpus=load_corpus())
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({**ODD_PLAN, "job": ODD_JOB}))
    metrics = tmp_path / "metrics.jsonl"
    result = launch(prepare(TrainOptions(plan=str(path), metrics=str(metrics), timeout_s=60, steps=steps)),
                    handle_signals=False)
    assert result.status is ExitStatus.DONE, result.message + str(result.events)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == steps
    for r, want in zip(rows, ref_losses):
        assert r["loss"] == pytest.approx(want, rel=RTOL)
    assert not [cmd for _, cmd in live_processes(str(tmp_path))]
