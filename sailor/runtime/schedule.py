"""The pipeline schedule as the runtime runs it (torch-free): `runtime_schedule(plan)` is the one place
the runtime reads `Plan.schedule`; the worker, `pipeline.run_pipeline` and `validate` take the
`plan.spec.Schedule` it returns.

Each stage executes the list of ops `sailor.plan.orders.stage_order` gives (kind F, B or W; chunk;
micro-batch), the same order the simulator times: 1F1B, interleaved 1F1B (the stage's v chunks as
separate executors) or ZB-H1 (B the input-gradient pass, W the deferred weight-gradient pass).

Rounds (`step_rounds`): when any stage's ZeRO-2/3 groups meet per micro-batch, every rank runs the
order of the largest pipeline's micro-batch count and skips the compute of the rounds k >= its own
pipeline's count (the collectives still run), so every member of a group issues the same
collectives in the same order. Every stage of a pipeline runs the same count: interleaved orders of
different counts group micro-batches differently, and a channel's two ends would then post their
messages in different orders (`messages` module docstring). The real micro-batches keep the
dependencies of a deadlock-free order (removing ops from every stage of a pipeline removes
dependencies and adds none), so the order stays deadlock-free.
"""

from __future__ import annotations

from sailor.plan.spec import Plan, Schedule
from sailor.runtime.topology import RankRole


def runtime_schedule(plan: Plan) -> Schedule:
    """The schedule of `plan` (`plan.spec.Schedule`: its kind, chunks per stage, whether backwards
    are split, and each stage's op order): the one place the runtime reads `Plan.schedule`."""
    return plan.schedule


def step_rounds(plan: Plan, role: RankRole) -> int:
    """Micro-batch rounds `role`'s rank runs per step (module docstring; `Plan.step_rounds`, the rule
    the simulator counts the per-micro-batch reduce-scatters by): the largest pipeline's micro-batch
    count when any stage shards gradients per micro-batch (ZeRO-2/3), else its own pipeline's."""
    return plan.step_rounds(role.pipeline)
