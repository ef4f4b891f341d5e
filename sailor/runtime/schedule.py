"""The pipeline schedule as the runtime runs it (torch-free): `runtime_schedule(plan)` is the one place
the runtime reads `Plan.schedule`; the worker, `pipeline.run_pipeline` and `validate` take the
`RuntimeSchedule` it returns.

Each stage executes the list of ops `sailor.plan.orders.stage_order` gives (kind F, B or W; chunk;
micro-batch), the same order the simulator times: 1F1B, interleaved 1F1B (the stage's v chunks as
separate executors) or ZB-H1 (B the input-gradient pass, W the deferred weight-gradient pass).

Rounds: a stage whose ZeRO-2/3 groups meet per micro-batch runs the order of the largest pipeline's
micro-batch count on every pipeline and skips the compute of the rounds k >= its own count (the
collectives still run), so every member of a group issues the same collectives in the same order.
The real micro-batches keep the dependencies of a deadlock-free order (removing ops from every stage
of a pipeline removes dependencies and adds none), so the order stays deadlock-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from sailor.plan.orders import Op, stage_order
from sailor.plan.spec import Plan, ScheduleKind


@dataclass(frozen=True)
class RuntimeSchedule:
    """The schedule every pipeline of a plan runs (module docstring).

    Attributes:
        kind: `ScheduleKind`.
        virtual_stages: v, layer chunks per stage (1 unless interleaved).
    """

    kind: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    virtual_stages: int = 1

    @property
    def splits_backward(self) -> bool:
        """Backwards run as an input-gradient pass (B) and a later weight-gradient pass (W)."""
        return self.kind is ScheduleKind.ZB_H1

    def order(self, stage: int, num_stages: int, microbatches: int) -> list[Op]:
        """The ops of `stage` of a pipeline of `num_stages` stages running `microbatches`
        micro-batches (or rounds), in execution order."""
        return stage_order(self.kind, self.virtual_stages, num_stages, stage, microbatches)


ONE_F_ONE_B = RuntimeSchedule()


def runtime_schedule(plan: Plan) -> RuntimeSchedule:
    """The schedule of `plan`: the one place the runtime reads `Plan.schedule`."""
    return RuntimeSchedule(plan.schedule.kind, plan.schedule.virtual_stages)
