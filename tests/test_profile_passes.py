"""The plans and the arithmetic of the fixed cost per stage pass (`runtime.profile_passes`); the
measurement itself starts processes and runs in tests/test_profiler.py."""

from __future__ import annotations

import pytest

from sailor.plan.orders import ScheduleKind
from sailor.runtime.pipeline import OpTrace
from sailor.runtime.profile_passes import idle_plan, p2p_overhead_s, pass_overhead_s, pass_plans, transfer_latencies
from sailor.runtime.topology import derive_topology


def _layers(plan) -> list[int]:
    """Layers each rank of `plan` holds."""
    return [sum(b - a for a, b in r.chunks) for r in derive_topology(plan).roles]


@pytest.mark.parametrize("num_layers, v", [(6, 3), (7, 3), (26, 13), (4, 2)])
def test_both_plans_give_each_rank_the_same_layers(num_layers, v):
    one, inter, got_v = pass_plans(num_layers, tp=1, mbs=2, microbatches=8, gpu="cpu")
    assert got_v == v and inter.schedule.kind is ScheduleKind.INTERLEAVED and inter.schedule.virtual_stages == v
    assert one.schedule.kind is ScheduleKind.ONE_F_ONE_B and one.stages == ((0, v), (v, num_layers))
    roles = derive_topology(inter).roles
    assert [len(r.chunks) for r in roles] == [v, v]  # v chunk passes per micro-batch and direction
    assert _layers(one) == _layers(inter) == [v, num_layers - v]
    assert inter.stages[-1] == (2 * v - 1, num_layers)  # an odd layer count: the last chunk holds two


def test_both_plans_at_tp_2_use_four_ranks():
    one, inter, _ = pass_plans(6, tp=2, mbs=1, microbatches=8, gpu="cpu")
    assert len(derive_topology(one).roles) == len(derive_topology(inter).roles) == 4


def test_pass_overhead_is_the_extra_time_over_the_extra_passes():
    # v = 3 chunks, 8 micro-batches: 16 more passes per direction; 1F1B forward 40 ms, interleaved 42 ms
    assert pass_overhead_s(0.040, 0.042, 3, 8) == pytest.approx(0.002 / 16)
    assert pass_overhead_s(0.040, 0.039, 3, 8) == 0.0  # noise: a pass costs no less than its layers
    with pytest.raises(AssertionError):
        pass_overhead_s(0.040, 0.042, 1, 8)


def test_the_idle_plan_is_the_1f1b_plan_with_one_micro_batch():
    one, _, _ = pass_plans(6, tp=1, mbs=2, microbatches=8, gpu="cpu")
    idle = idle_plan(one)
    assert idle.pipelines[0].microbatches == 1 and idle.stages == one.stages
    assert idle.pipelines[0].replicas == one.pipelines[0].replicas


def test_transfer_latencies_by_hand():
    # two stages, v = 1, micro-batches 0 and 1 (times in ms). Stage 0 sends F0's output at 10 and
    # F1's at 20; stage 1 began F0 at 5 (waiting) and had it at 12: 2 ms; it began F1 at 30, after
    # the send (it was busy): left out. Stage 1 sends B0's gradient at 40; stage 0 began B0 at 25
    # and had it at 43: 3 ms. B1 sent at 60, stage 0 waiting since 50, has it at 61: 1 ms.
    ms = 1e-3
    s0 = [OpTrace("F", 0, 0, False, 0 * ms, 0 * ms, 10 * ms), OpTrace("F", 0, 1, False, 10 * ms, 10 * ms, 20 * ms),
          OpTrace("B", 0, 0, True, 25 * ms, 43 * ms, 48 * ms), OpTrace("B", 0, 1, True, 50 * ms, 61 * ms, 70 * ms)]
    s1 = [OpTrace("F", 0, 0, True, 5 * ms, 12 * ms, 15 * ms), OpTrace("B", 0, 0, False, 15 * ms, 15 * ms, 40 * ms),
          OpTrace("F", 0, 1, True, 30 * ms, 30.5 * ms, 35 * ms), OpTrace("B", 0, 1, False, 45 * ms, 45 * ms, 60 * ms)]
    assert transfer_latencies([[s0], [s1]], 1) == pytest.approx([3 * ms, 1 * ms, 2 * ms])
    # a TP pair as stage 0: the later sender's end counts (F0 at 11), and each rank's receives count
    s0b = [op._replace(end_s=op.end_s + 1 * ms) if op.kind == "F" and op.micro_batch == 0 else op for op in s0]
    assert transfer_latencies([[s0, s0b], [s1]], 1) == pytest.approx([3 * ms, 1 * ms, 3 * ms, 1 * ms, 1 * ms])


def test_transfer_latencies_of_interleaved_chunks():
    # p = 2, v = 2: chunk 1 of stage 0 (virtual stage 2) receives from chunk 0 of stage 1 (u = 1), and
    # its backward from nothing (the last virtual stage is 3 = chunk 1 of stage 1)
    ms = 1e-3
    s0 = [OpTrace("F", 1, 0, True, 0 * ms, 9 * ms, 12 * ms)]
    s1 = [OpTrace("F", 0, 0, True, 0 * ms, 1 * ms, 5 * ms), OpTrace("B", 0, 0, True, 20 * ms, 26 * ms, 30 * ms)]
    s0 += [OpTrace("F", 0, 0, False, 0 * ms, 0 * ms, 0.5 * ms), OpTrace("B", 1, 0, False, 15 * ms, 15 * ms, 24 * ms)]
    assert transfer_latencies([[s0], [s1]], 2) == pytest.approx([4 * ms, 0.5 * ms, 2 * ms])


def test_p2p_overhead_is_the_difference_of_the_mean_latencies():
    assert p2p_overhead_s([1e-3, 5e-3], [0.5e-3, 0.3e-3]) == pytest.approx(3e-3 - 0.4e-3)
    assert p2p_overhead_s([1e-3], [2e-3]) == 0.0  # noise: a run adds nothing
    assert p2p_overhead_s([], [1e-3]) == p2p_overhead_s([1e-3], []) == 0.0
