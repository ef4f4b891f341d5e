"""Pipeline schedules for the planner's best plans (the schedule dimension of the search).

The search (engine, paper) builds 1F1B plans: partitions, TP, placement and batch shares do
not depend on the schedule. On every event-simulated finalist, and on the best plan of each deeper
pipeline depth the finalists lack (`finalists.Found.deep`: a deeper partition can pay only once its
bubble shrinks), where even without its bubble it would beat the best finalist, `schedule_variants`
then tries what the plan module offers on the same GPUs (`sailor.plan`, module docstring):

- `zb-h1` (Qi et al., ICLR 2024): the same stages, weight-gradient passes filling the bubble at
  1F1B's activation memory;
- `interleaved-1f1b` with v in `VIRTUAL_STAGES` (Narayanan et al., SC'21 §2.2.2): each stage's layers
  cut into v chunks (`plan.spec.interleave_partition`, so a stage keeps the layers it had), which divides
  the bubble by v and costs v times the point-to-point transfers and more activations in flight.

`kept_weight_variants` tries, on each of those plans without the bubble condition (the option
changes the passes, not their order), one memory option the search does not weigh, ZeRO-3 with
its gathered weights kept for the iteration (`StageMemory.reshard_after_forward` false): it holds
ZeRO-2's weights during the iteration, but gathers once, prefetched under the first forward, where
ZeRO-2 all-gathers the updated weights after the step on the critical path, and ZeRO-3 re-sharded
gathers twice per micro-batch. So it can be the fastest wherever it fits.

A variant counts only where the plan validation and `Plan.check_against` take it (e.g. no ZB-H1
with full recomputation, no chunk without a layer) and it stays inside the memory limit (the
planner's margin included). `planner._variants` ranks each plan's variants by their closed forms
(`simulator.schedules`) and event-simulates the best one like every finalist (for plans other than
the best finalist, the few whose closed forms come within `planner.VARIANT_MARGIN` of its estimate);
`planner._rescore` keeps it when it is better under the objective ("where it pays").
"""

from __future__ import annotations

from sailor.plan.spec import DEFAULT_SCHEDULE, Plan, ScheduleKind, interleave_partition
from sailor.simulator import Estimate
from sailor.simulator.context import SimContext

# Chunks per stage tried for interleaving: Megatron-LM's Table 1 runs use 2 to 6.
VIRTUAL_STAGES = (2, 3, 4, 6)


def checked_variant(fields: dict) -> Plan | None:
    """The plan of `fields` (`Plan.to_dict` form) when the plan validation and, where it carries its
    job and cluster, `Plan.check_against` take it; None when either refuses it (module docstring)."""
    try:
        p = Plan.model_validate(fields)
        if p.job is not None and p.cluster is not None:
            p.check_against(p.job, p.cluster)
    except ValueError:  # SailorInputError or pydantic's ValidationError: this variant cannot run
        return None
    return p


def schedule_variants(plan: Plan) -> list[Plan]:
    """The plans that run `plan` (a 1F1B plan carrying its job and cluster) under another schedule:
    ZB-H1, and interleaved 1F1B for each v in VIRTUAL_STAGES at most every stage's layer count; each
    valid for its job and cluster (`checked_variant`). Empty for a single stage or a plan that already names
    a schedule."""
    if plan.num_stages < 2 or plan.schedule != DEFAULT_SCHEDULE:
        return []
    base = plan.to_dict()
    smallest = min(b - a for a, b in plan.stages)
    tries = [({"kind": ScheduleKind.ZB_H1.value}, plan.stages)]
    tries += [({"kind": ScheduleKind.INTERLEAVED.value, "virtual_stages": v}, interleave_partition(plan.stages, v))
              for v in VIRTUAL_STAGES if v <= smallest]
    made = (checked_variant(base | {"schedule": schedule, "stages": [list(s) for s in stages]}) for schedule, stages in tries)
    return [p for p in made if p is not None]


def kept_weight_variants(plan: Plan) -> list[Plan]:
    """`plan` with every ZeRO-3 stage keeping its gathered weights for the iteration, and `plan` with
    every ZeRO-2 or ZeRO-3 stage turned into ZeRO-3 keeping them; each where it differs from `plan`
    and is valid for its job and cluster (`checked_variant`; module docstring). Empty for a plan of one
    pipeline (ZeRO shards nothing there) or without a ZeRO-2 or ZeRO-3 stage."""
    memory = [plan.stage_memory(i) for i in range(plan.num_stages)]
    if len(plan.pipelines) < 2 or all(m.zero < 2 for m in memory):
        return []
    out, seen = [], {plan.model_dump_json()}
    for lowest in (3, 2):
        kept = [m.model_copy(update={"zero": 3, "reshard_after_forward": False}) if m.zero >= lowest else m
                for m in memory]
        p = checked_variant(plan.to_dict() | {"memory": [m.model_dump(mode="json") for m in kept]})
        if p is not None and p.model_dump_json() not in seen:
            seen.add(p.model_dump_json())
            out.append(p)
    return out


def fits(estimate: Estimate, ctx: SimContext) -> bool:
    """Whether every GPU of `estimate` stays inside `ctx.memory_limit` (capacity less the margin)."""
    return all(r.peak_memory_bytes <= ctx.memory_limit(r.gpu) for r in estimate.replicas)
