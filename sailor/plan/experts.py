"""Expert parallelism (EP) of a plan's stages: `StageExperts`, one per pipeline stage (`Plan.experts`).

```
experts: [{ep: 2, placement: [[0, 1, 2], [3]]}, {}]   # stage 0: EP 2, uneven; stage 1: EP 1
```

How EP ranks relate to the data-parallel ranks (the arrangement of GShard, Lepikhin et al. 2021,
§3.1, and of Megatron-Core's expert parallelism, where EP groups are carved out of the DP ranks):
stage i of pipeline j is EP rank `j % ep` of EP group `j // ep`. So an EP group is `ep` consecutive
pipelines, and the stage's D pipelines form D / ep EP groups. In every EP group, EP rank q holds the
routed experts `placement[q]` (global expert ids) of every MoE block of the stage; the router,
shared experts, attention and norms stay replicated over all D pipelines as without EP.

- Forward of a micro-batch: each rank routes its own tokens, sends each routed copy to the EP rank of
  its group that holds the chosen expert (all-to-all dispatch), runs its experts on what it received
  and sends the outputs back (all-to-all combine). Under TP every TP rank of a replica holds the whole
  token set and its TP shard of each held expert, so the all-to-all runs among the ranks of equal TP
  rank across the EP group's replicas, and the TP all-reduce of the expert outputs follows the combine
  (`runtime.moe`).
- Gradient sync: an expert's gradient is summed over the D / ep ranks that hold it, EP rank q of every
  EP group (its *expert DP group*), block by block under TP like any sharded parameter
  (`runtime.topology`); every other parameter syncs over the whole stage as before.

Defaults leave every plan unchanged: `ep` 1 (every rank holds every expert, no all-to-all). `placement`
None is the even split: EP rank q holds experts [q·E/ep, (q+1)·E/ep), needing ep to divide E; a given
placement may be uneven (a bigger or faster GPU type holding more experts), but every EP rank holds
at least one and together they hold each of the model's E experts once (checked against the job,
`check_experts_for_job`). The all-to-all meets once per micro-batch and MoE block, so the replicas of
one EP group must have the same TP degree on the stage and their pipelines the same micro-batch count
(`check_plan_experts`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field, model_validator

from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_GLOBAL_BATCH, MAX_WIDTH
from sailor.core.schema import SPEC_CONFIG, Whole
from sailor.model.spec import ModelSpec


class StageExperts(BaseModel):
    """Expert parallelism of one stage (module docstring).

    Attributes:
        ep: EP degree: pipelines per EP group, among which the stage's routed experts are split.
        placement: per EP rank (0..ep-1), the global ids of the experts it holds; None: the even
            split of the model's experts in id order.
        imbalance: the simulator's load-balance assumption (`sailor.simulator.experts`): the
            routed rows the busiest EP rank receives over its share under uniform routing (>= 1;
            1 = every expert gets k·N/E of a batch's N tokens). Only with ep > 1: at EP 1 every
            rank runs all experts on its own tokens, whatever their spread, and the simulator
            charges no EP rank (a value other than 1 there is refused, not ignored). The runtime
            routes as the router says and does not read it.
    """

    model_config = SPEC_CONFIG
    ep: Whole(1, MAX_GLOBAL_BATCH) = 1
    placement: tuple[tuple[Whole(0, MAX_WIDTH - 1), ...], ...] | None = None
    imbalance: float = Field(default=1.0, ge=1.0, le=MAX_WIDTH)

    @model_validator(mode="after")
    def _check(self) -> "StageExperts":
        if self.ep == 1 and self.imbalance != 1.0:
            raise SailorInputError(f"imbalance {self.imbalance} with ep 1: it is the busiest EP rank's share of the"
                                   " all-to-all's rows, and at EP 1 every rank runs every expert on its own tokens",
                                   field="imbalance", fix="remove it, or set ep > 1")
        if self.placement is None:
            return self
        if len(self.placement) != self.ep:
            raise SailorInputError(f"{len(self.placement)} EP ranks placed for ep {self.ep} (one list of expert ids"
                                   " per EP rank)", field="placement")
        seen: set[int] = set()
        for q, ids in enumerate(self.placement):
            if not ids:
                raise SailorInputError(f"EP rank {q} holds no expert", field=f"placement.{q}")
            for e in ids:
                if e in seen:
                    raise SailorInputError(f"expert {e} is placed twice", field=f"placement.{q}")
                seen.add(e)
        return self

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_STAGE_EXPERTS

    def held(self, ep_rank: int, num_experts: int) -> tuple[int, ...]:
        """Global ids of the experts EP rank `ep_rank` holds, of a model of `num_experts` (sorted)."""
        if self.placement is not None:
            return tuple(sorted(self.placement[ep_rank]))
        n = num_experts // self.ep
        return tuple(range(ep_rank * n, (ep_rank + 1) * n))

    def ep_rank(self, pipeline: int) -> int:
        """EP rank of pipeline `pipeline`'s replica of the stage (module docstring)."""
        return pipeline % self.ep

    def ep_groups(self, num_pipelines: int) -> list[range]:
        """The pipelines of each EP group, in EP-rank order."""
        return [range(g, g + self.ep) for g in range(0, num_pipelines, self.ep)]


DEFAULT_STAGE_EXPERTS = StageExperts()


def check_plan_experts(experts: Sequence[StageExperts], tp: Sequence[Sequence[int]],
                       microbatches: Sequence[int]) -> None:
    """Raise SailorInputError unless a plan's `experts` fit the plan itself (`Plan._check`): none or
    one entry per stage, ep dividing the pipelines, and within every EP group one TP degree per stage
    and one micro-batch count (module docstring). `tp[j][i]`: the TP degree of pipeline j's replica
    of stage i; `microbatches[j]`: pipeline j's micro-batches."""
    if not experts:
        return
    P, D = len(tp[0]), len(tp)
    if len(experts) != P:
        raise SailorInputError(f"{len(experts)} entries for {P} stages (one per stage, or none)", field="experts")
    for i, ex in enumerate(experts):
        if ex.ep == 1:
            continue
        if D % ex.ep:
            raise SailorInputError(f"ep {ex.ep} does not divide the plan's {D} pipelines (EP groups are ep consecutive"
                                   " pipelines)", field=f"experts.{i}.ep", fix="use a divisor of the pipeline count")
        for group in ex.ep_groups(D):
            f = group[0]
            for j in group[1:]:
                if tp[j][i] != tp[f][i]:
                    raise SailorInputError(f"pipelines {f} and {j} share an EP group on stage {i} but have TP"
                                           f" {tp[f][i]} and {tp[j][i]} there (the all-to-all pairs equal TP ranks)",
                                           field=f"pipelines.{j}.replicas.{i}.tp")
                if microbatches[j] != microbatches[f]:
                    raise SailorInputError(f"pipelines {f} and {j} share an EP group on stage {i} but run"
                                           f" {microbatches[f]} and {microbatches[j]} micro-batches (the all-to-all"
                                           " meets every micro-batch)", field=f"pipelines.{j}.microbatches")


def check_experts_for_job(experts: Sequence[StageExperts], model: ModelSpec,
                          stages: Sequence[tuple[str, bool]]) -> None:
    """Raise SailorInputError unless every stage's expert parallelism fits `model`
    (`Plan.check_against`): EP > 1 only on a stage holding mixture-of-experts blocks, ep at most the
    model's E experts, an even split needing ep to divide E, and a given placement holding each of
    the E experts once. `stages[i]`: stage i's layers for people and whether it holds an MoE block."""
    for i, ex in enumerate(experts):
        if ex.ep == 1:
            continue
        where = f"experts.{i}"
        layers, sparse = stages[i]
        if not sparse:
            raise SailorInputError(f"ep {ex.ep} on stage {i} {layers}, which holds no mixture-of-experts block of"
                                   f" {model.name}", field=f"{where}.ep", fix="use ep 1")
        E = model.moe.num_experts
        if ex.ep > E:
            raise SailorInputError(f"ep {ex.ep} exceeds the {E} experts of {model.name}", field=f"{where}.ep")
        if ex.placement is None:
            if E % ex.ep:
                raise SailorInputError(f"ep {ex.ep} does not divide the {E} experts of {model.name}",
                                       field=f"{where}.ep", fix="give a placement (an uneven split) or a divisor")
            continue
        placed = sorted(e for ids in ex.placement for e in ids)
        if placed != list(range(E)):
            bad = sorted(set(placed) - set(range(E)))
            what = f"expert {bad[0]} does not exist" if bad else f"expert {min(set(range(E)) - set(placed))} is not placed"
            raise SailorInputError(f"{what} ({model.name} has experts 0..{E - 1}; each is placed once)",
                                   field=f"{where}.placement")


def experts_to_dict(experts: Sequence[StageExperts]) -> list[dict] | None:
    """The plan file's `experts` list, or None when every stage has the defaults."""
    if all(ex.is_default for ex in experts):
        return None
    return [ex.model_dump(mode="json", exclude_defaults=True) for ex in experts]
