"""The plans and the arithmetic of the fixed cost per stage pass (`runtime.profile_passes`); the
measurement itself starts processes and runs in tests/test_profiler.py."""

from __future__ import annotations

import pytest

from sailor.plan.orders import ScheduleKind
from sailor.runtime.profile_passes import pass_overhead_s, pass_plans
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
