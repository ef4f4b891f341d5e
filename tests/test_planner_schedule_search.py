"""The schedule dimension searched with the partitions (issue #28, Build item 4): phase 3 tries ZB-H1,
interleaved 1F1B and kept ZeRO-3 weights on every finalist and on the best plan of each pipeline depth
the finalists lack (`planner._variants`), so a partition that ranks low under 1F1B and wins only under
another schedule is found."""

from __future__ import annotations

import pytest

from sailor.plan.spec import ScheduleKind
from sailor.planner import PlanOptions, plan_job
from sailor.planner.schedules import fits, kept_weight_variants, schedule_variants
from sailor.simulator import make_context, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZA = "us-central1-a"


def test_a_deeper_pipeline_that_wins_only_interleaved_is_found():
    # 24 blocks of h = 1024 on four T4s, one per node, global batch 8: under 1F1B the best plan is
    # data-parallel (a pipeline's bubble, (P - 1) of P + m - 1 slots, costs more than it saves);
    # interleaved, the bubble of a 2-stage pipeline shrinks by v and it wins (the runtime's 1F1B,
    # sends never blocking: with DeepSpeed's blocking ones the same held for 12 blocks of h = 2560
    # and global batch 4)
    job = JobSpec(model={"name": "m", "num_blocks": 24, "hidden_size": 1024, "num_heads": 16, "vocab_size": 32000,
                         "max_sequence_length": 2048}, global_batch_size=8)
    cluster = ClusterSpec(zones={ZA: {"T4": 4}}, gpus_per_node={"T4": 1})
    ctx = make_context(job, cluster)
    res = plan_job(ctx, PlanOptions(max_stages=8, max_mbs=4))
    # the best 1F1B plan after the event simulation (the plan the schedules were tried on before)
    plain = [c for c in res.alternatives if c.plan.schedule.kind is ScheduleKind.ONE_F_ONE_B]
    best_1f1b = min(plain, key=lambda c: c.estimate.iteration_time_s).plan
    assert res.plan.schedule.kind is not ScheduleKind.ONE_F_ONE_B
    assert res.plan.num_stages != best_1f1b.num_stages  # another partition than the best 1F1B plan's
    # what trying the schedules on the best 1F1B plan alone reaches (event-simulated, within memory)
    alone = [simulate(p, ctx) for p in schedule_variants(best_1f1b) + kept_weight_variants(best_1f1b)]
    alone = [e.iteration_time_s for e in alone if fits(e, ctx)] + [simulate(best_1f1b, ctx).iteration_time_s]
    assert res.estimate.iteration_time_s < min(alone) * 0.95
    assert res.estimate.iteration_time_s == pytest.approx(simulate(res.plan, ctx).iteration_time_s, rel=1e-9)
