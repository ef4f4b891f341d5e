"""The pipeline schedule as the runtime runs it (torch-free): `runtime_schedule(plan)` is the one place
the runtime reads `Plan.schedule`; the worker, `pipeline.run_pipeline` and `validate` take the
`RuntimeSchedule` it returns.

Each stage executes a list of ops (`pipeline_orders.Op`: kind F, B or W; chunk; micro-batch):
- `1f1b`: `schedule_1f1b`, min(P - i - 1, m) warm-up forwards (Megatron-LM's count), then one
  forward and one backward alternately, then the remaining backwards;
- `interleaved-1f1b`: `pipeline_orders.interleaved_order` (Megatron-LM's interleaved order), the
  stage's v chunks as separate executors;
- `zb-h1`: `pipeline_orders.zb_h1_order`, B the input-gradient pass and W the deferred
  weight-gradient pass (Qi et al., ICLR 2024).
The simulator simulates the same interleaved and ZB-H1 orders (`simulator.schedule_orders`), so
what it predicts is what runs; its 1F1B follows DeepSpeed's engine (one more warm-up forward on
each stage), the runtime's predates the schedules and is kept as it was.

Rounds: a stage whose ZeRO-2/3 groups meet per micro-batch runs the order of the largest pipeline's
micro-batch count on every pipeline and skips the compute of the rounds k >= its own count (the
collectives still run), so every member of a group issues the same collectives in the same order.
The real micro-batches keep the dependencies of a deadlock-free order (removing ops from every stage
of a pipeline removes dependencies and adds none), so the order stays deadlock-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from sailor.plan.orders import BWD, FWD, Op, interleaved_order, zb_h1_order
from sailor.plan.spec import Plan, ScheduleKind


def schedule_1f1b(stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of one stage: [("F", k) | ("B", k)].

    Stage i first runs min(P - i - 1, m) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards; at most P - i micro-batches are in flight.
    """
    warm = min(num_stages - stage - 1, microbatches)
    order = [(FWD, k) for k in range(warm)]
    for k in range(microbatches - warm):
        order += [(FWD, warm + k), (BWD, k)]
    order += [(BWD, k) for k in range(microbatches - warm, microbatches)]
    return order


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
        if self.kind is ScheduleKind.INTERLEAVED:
            return interleaved_order(num_stages, self.virtual_stages, stage, microbatches)
        if self.kind is ScheduleKind.ZB_H1:
            return zb_h1_order(num_stages, stage, microbatches)
        return [Op(kind, 0, k) for kind, k in schedule_1f1b(stage, num_stages, microbatches)]


ONE_F_ONE_B = RuntimeSchedule()


def runtime_schedule(plan: Plan) -> RuntimeSchedule:
    """The schedule of `plan`: the one place the runtime reads `Plan.schedule`."""
    return RuntimeSchedule(plan.schedule.kind, plan.schedule.virtual_stages)
