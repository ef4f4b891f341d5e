"""Checks a plan must pass before the runtime starts any process (torch-free)."""

from __future__ import annotations

from sailor.errors import SailorInputError
from sailor.plan import Plan, ScheduleKind
from sailor.specs import JobSpec


def check_runtime_geometry(plan: Plan, job: JobSpec, *, source: str | None = None) -> None:
    """Raise SailorInputError unless every replica's TP degree splits the tensors the runtime shards:
    attention and KV heads (whole heads per rank), the MLP width and the padded vocabulary
    (`ModelSpec.padded_vocab(1)`, the runtime's one vocabulary). Layers, global batch and heads are
    checked by `Plan.check_against`; this adds what sharding needs beyond it. The runtime runs the
    1F1B schedule only: other schedules are simulated, not executed yet (issue 16, phase 2)."""
    if plan.schedule.kind is not ScheduleKind.ONE_F_ONE_B:
        raise SailorInputError(f"the runtime executes schedule 1f1b only; {plan.schedule.kind.value} is simulated"
                               " but not run yet", source=source, field="schedule.kind",
                               fix="train with schedule 1f1b, or use sailor simulate to compare schedules")
    model = job.model
    vocab = model.padded_vocab(1)
    for j, p in enumerate(plan.pipelines):
        for i, r in enumerate(p.replicas):
            for what, size in (("attention heads", model.num_heads), ("KV heads", model.kv_heads),
                               ("MLP width", model.ffn), ("padded vocabulary", vocab)):
                if size % r.tp:
                    raise SailorInputError(f"TP {r.tp} does not divide the {size} {what} of {model.name}",
                                           source=source, field=f"pipelines.{j}.replicas.{i}.tp",
                                           fix="use a TP degree that divides it")
