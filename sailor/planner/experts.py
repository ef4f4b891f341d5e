"""Expert parallelism for the planner's best plans (the EP dimension of the search, issue #30).

The search (engine, paper) builds plans with EP 1: every replica holds every routed expert, and the
partitions, TP degrees, placement and batch shares it weighs do not depend on EP. For a model with
mixture-of-experts blocks, `expert_variants` then tries, on every plan whose schedule variants are
tried (`planner._variants`: the event-simulated finalists and the deeper plans), each EP degree e in
`ep_degrees` on every stage that holds an MoE block, where the plan allows it
(`plan.experts.check_plan_experts`: e divides the pipelines, one TP degree and micro-batch count per
EP group):

- EP trades the experts' memory and gradient sync (each rank holds E/e experts, synced over D/e
  holders) for two all-to-alls each way per MoE block and micro-batch, among the e consecutive
  pipelines of each EP group (`plan.experts`). Where those replicas sit is the launcher's placement
  (`plan.placement`, which the simulator prices): inside a node the all-to-all runs on NVLink-class
  links, across nodes on the nodes' adapters, across zones on the zone link. Nothing here forbids a
  slow link: the simulator charges each EP group the link it spans (`collectives.all_to_all_time_s`),
  so an all-to-all over a slow link is kept only where it still wins under the objective.
- Placement: the even split (E/e experts per EP rank), and, where the EP ranks of the stage are of
  different GPU types (the same EP rank has one type in every group), `speed_placement`: experts in
  proportion to each EP rank's speed on the stage, so a faster GPU holds and computes more.

Each variant is validated like every plan (`schedules.checked_variant`) and kept only where it fits in
memory; `planner._variants` ranks them with the schedule variants by their closed forms and
event-simulates the best. `explain` says, for `sailor plan`, where the chosen plan's experts sit,
over which links, and what EP gained or why EP 1 stayed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sailor.catalog import LinkClass
from sailor.core.units import GIB
from sailor.plan.experts import StageExperts
from sailor.plan.spec import Plan
from sailor.planner.schedules import checked_variant, fits
from sailor.simulator import Estimate, simulate
from sailor.simulator.collectives import same_node
from sailor.simulator.context import SimContext
from sailor.simulator.terms import placed_slots

# ZeRO levels a reshaped plan is also tried at (above its own): EP spreads the experts but leaves the
# dense parameters and every expert's optimizer state on its D/ep holders; ZeRO-1/2 shard those
# (a plan's own ZeRO-3 stays ZeRO-3).
SHARDINGS = (1, 2)


def ep_degrees(num_experts: int) -> list[int]:
    """EP degrees tried for a model of `num_experts` routed experts: the powers of two from 2 up to
    E that divide E (the even split needs e | E; published MoE runs use powers of two, e.g.
    Megatron-Core's Mixtral 8x7B at EP 8)."""
    out, e = [], 2
    while e <= num_experts:
        if num_experts % e == 0:
            out.append(e)
        e *= 2
    return out


def speed_placement(speeds: list[float], num_experts: int) -> tuple[tuple[int, ...], ...]:
    """Expert ids per EP rank in proportion to `speeds` (one per EP rank, > 0): EP rank q holds
    round(E·s_q/Σs) experts by largest remainders, at least one each, in id order. E >= len(speeds).

    Example: speeds (3, 1) and 8 experts -> ((0, 1, 2, 3, 4, 5), (6, 7))."""
    n, total = len(speeds), sum(speeds)
    exact = [num_experts * s / total for s in speeds]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > num_experts:  # the floor of one per rank overshot: take from the largest
        counts[max(range(n), key=lambda q: counts[q])] -= 1
    order = sorted(range(n), key=lambda q: exact[q] - int(exact[q]), reverse=True)
    for q in order[: num_experts - sum(counts)]:
        counts[q] += 1
    out, start = [], 0
    for c in counts:
        out.append(tuple(range(start, start + c)))
        start += c
    return tuple(out)


def _stage_speeds(plan: Plan, ctx: SimContext, stage: int, ep: int) -> list[float] | None:
    """Speed (1 / seconds of the stage's forward and backward per micro-batch, `SimContext.layer_s`)
    of each EP rank of the stage when every EP group has one GPU type per EP rank and the types
    differ; None when they are all one type or differ between groups (then the even split)."""
    kinds = [(p.replicas[stage].gpu, p.replicas[stage].tp) for p in plan.pipelines]
    by_rank = [{kinds[j] for j in range(q, len(kinds), ep)} for q in range(ep)]
    if any(len(s) != 1 for s in by_rank) or len({next(iter(s)) for s in by_rank}) == 1:
        return None
    chunks = plan.stage_chunks(stage)
    return [1.0 / sum(float(ctx.layer_s(gpu, tp, plan.micro_batch_size, a, b).sum()) for a, b in chunks)
            for gpu, tp in (next(iter(s)) for s in by_rank)]


def _sparse_stages(plan: Plan, ctx: SimContext) -> list[int]:
    """Pipeline stages of `plan` holding at least one MoE block (all of a stage's chunks counted)."""
    return [i for i in range(plan.num_stages) if ctx.job.model.holds_moe_block(plan.stage_chunks(i))]


def narrower_tp(plan: Plan, factor: int, *, split_micro_batch: bool = False) -> dict | None:
    """`plan` (`Plan.to_dict` form) on the same GPUs with every replica's TP degree divided by
    `factor`: each pipeline becomes `factor` consecutive pipelines with the same stages, zones and
    GPU types, each running 1/factor of its micro-batches, or, with `split_micro_batch`, all of its
    micro-batches at 1/factor of the micro-batch size; the global batch is unchanged either way.
    None where some TP degree, or the micro-batch count (the micro-batch size with
    `split_micro_batch`), is not a multiple of `factor`."""
    d = plan.to_dict()
    split = d["micro_batch_size"] if split_micro_batch else None
    if any(r["tp"] % factor for p in d["pipelines"] for r in p["replicas"]) or \
            (split % factor if split else any(p["microbatches"] % factor for p in d["pipelines"])):
        return None
    pipes = [{"microbatches": p["microbatches"] if split else p["microbatches"] // factor,
              "replicas": [r | {"tp": r["tp"] // factor} for r in p["replicas"]]}
             for p in d["pipelines"] for _ in range(factor)]
    return d | {"pipelines": pipes} | ({"micro_batch_size": split // factor} if split else {})


def expert_variants(plan: Plan, ctx: SimContext) -> list[Plan]:
    """`plan` (EP 1, carrying its job and cluster) with EP e on every stage holding an MoE block,
    for each e of `ep_degrees`, at the plan's TP degrees and at each narrower TP on the same GPUs
    (`narrower_tp`, with the micro-batches split among the new pipelines and, apart, with the
    micro-batch split: the experts EP spreads no longer need TP to fit, and the dense layers trade TP
    for data parallelism; each narrower shape also at EP 1, so that EP is weighed against the same
    GPUs without it); each shape also with every stage at least at ZeRO-1 and at ZeRO-2
    (`SHARDINGS`: more replicas to shard over); evenly placed and, where the EP ranks' GPU types
    differ, placed by speed (module docstring); each valid for its job and cluster
    (`schedules.checked_variant`). Empty for a dense model or a plan that already sets EP."""
    model = ctx.job.model
    if model.moe is None or plan.experts:
        return []
    sparse = _sparse_stages(plan, ctx)
    if not sparse:
        return []
    widest = max(r.tp for p in plan.pipelines for r in p.replicas)
    shapes = [(f, d) for f in _powers_of_two(widest) for split in ((False, True) if f > 1 else (False,))
              if (d := narrower_tp(plan, f, split_micro_batch=split)) is not None]
    lowest = min(plan.stage_memory(i).zero for i in range(plan.num_stages))
    shapes = [(f, d | {"memory": [m | {"zero": max(m.get("zero", 0), z)} for m in _memory(d, plan.num_stages)]}
               if z else d) for f, d in shapes for z in [0] + [z for z in SHARDINGS if z > lowest]]
    out = []
    for f, base in shapes:
        shaped = checked_variant(base)
        if shaped is None:
            continue
        if f > 1:
            out.append(shaped)  # the narrower shape at EP 1: EP's yardstick on the same GPUs
        for ep in ep_degrees(model.moe.num_experts):
            if len(shaped.pipelines) % ep:
                continue
            placements: list[dict[int, tuple | None]] = [{i: None for i in sparse}]
            uneven = {i: _stage_speeds(shaped, ctx, i, ep) for i in sparse}
            if any(s is not None for s in uneven.values()):
                placements.append({i: speed_placement(s, model.moe.num_experts) if s else None
                                   for i, s in uneven.items()})
            for where in placements:
                experts = [StageExperts(ep=ep, placement=where[i]) if i in where else StageExperts()
                           for i in range(plan.num_stages)]
                p = checked_variant(base | {"experts": [e.model_dump(mode="json", exclude_defaults=True)
                                                        for e in experts]})
                if p is not None:
                    out.append(p)
    return out


def _memory(d: dict, stages: int) -> list[dict]:
    """The `memory` list of a plan in `Plan.to_dict` form, one entry per stage (defaults filled)."""
    return list(d.get("memory") or [{} for _ in range(stages)])


def _powers_of_two(n: int) -> list[int]:
    """1, 2, 4, ... up to n."""
    return [1 << k for k in range(n.bit_length()) if 1 << k <= n]


def _span(slots: list[list], ctx: SimContext, stage: int, ep: int) -> LinkClass:
    """The slowest link class (`catalog.LinkClass`) an EP group of the stage spans, given the plan's
    placed slots `slots` ([pipeline][stage], `simulator.terms.placed_slots`: the launcher's
    placement): SAME_NODE when every group sits on one node."""
    order = list(LinkClass)
    members = [pipeline[stage] for pipeline in slots]
    worst = LinkClass.SAME_NODE
    for g in range(0, len(members), ep):
        first = members[g]
        for m in members[g + 1:g + ep]:
            c = ctx.network.link_class(first.zone, m.zone, same_node(first, m))
            worst = max(worst, c, key=order.index)
    return worst


_LINK_WORDS = {LinkClass.SAME_NODE: "one node (NVLink-class links)", LinkClass.SAME_ZONE: "nodes of one zone",
               LinkClass.SAME_REGION: "zones of one region", LinkClass.SAME_CONTINENT: "regions of one continent",
               LinkClass.INTERCONTINENTAL: "continents"}


@dataclass(frozen=True)
class RankExperts:
    """The routed experts one EP rank of a stage holds (`StageExperts.held`), and the GPU types of
    the replicas that are that EP rank (one in each EP group)."""

    ep_rank: int
    expert_ids: tuple[int, ...]
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class StageChoice:
    """Expert parallelism of one stage of the chosen plan: its EP degree, what each EP rank holds
    (one rank holding all E at EP 1) and the slowest link its EP groups' all-to-alls cross (`_span`;
    None at EP 1, which runs none)."""

    stage: int
    ep: int
    ranks: tuple[RankExperts, ...]
    link: LinkClass | None


@dataclass(frozen=True)
class EPVariant:
    """The best expert-parallel variant of an EP-1 plan that fits (`expert_variants`): EP degree,
    TP degree of its first replica, the slowest link its EP groups span, closed-form iterations/s."""

    ep: int
    tp: int
    link: LinkClass
    iters_per_s: float


@dataclass(frozen=True)
class ExpertsExplanation:
    """Where the chosen plan's experts sit and why (`explain`); `lines()` for people, `to_dict()`
    for `sailor plan --json`.

    Attributes:
        num_experts: the model's routed experts E.
        stages: each pipeline stage's `StageChoice`.
        iters_per_s: the chosen plan's iterations/s (closed form, `simulate(event=False)`).
        best_flat_iters_per_s: iterations/s of the best plan the search found at EP 1
            (event-simulated; the caller's figure, None when not given).
        flat_iters_per_s: the chosen shape at EP 1 (the `experts` dropped), closed form; None when
            the chosen plan keeps EP 1, or when that shape does not fit (`flat_oom`).
        flat_oom: (GPU type, bytes needed, bytes allowed) of the fullest GPU of the chosen shape at
            EP 1 when it does not fit in memory, else None.
        best_variant: when the chosen plan keeps EP 1, its best expert-parallel variant that fits
            (None when none does).
    """

    num_experts: int
    stages: tuple[StageChoice, ...]
    iters_per_s: float
    best_flat_iters_per_s: float | None = None
    flat_iters_per_s: float | None = None
    flat_oom: tuple[str, float, float] | None = None
    best_variant: EPVariant | None = None

    @property
    def uses_ep(self) -> bool:
        return any(s.ep > 1 for s in self.stages)

    def lines(self) -> list[str]:
        """`sailor plan`'s lines: stages with one expert parallelism grouped, then why."""
        E = self.num_experts
        if not self.uses_ep:
            lines = [f"experts: EP 1, every replica holds all {E} experts of every MoE block"]
            v = self.best_variant
            if v is None:
                return lines + ["  why: no expert-parallel variant of this plan fits in memory or applies (EP groups"
                                " need ep | pipelines, one TP degree and micro-batch count per group)"]
            return lines + [f"  why: its best expert-parallel variant, EP {v.ep} at TP {v.tp} over {_LINK_WORDS[v.link]},"
                            f" runs {v.iters_per_s:.4g} it/s against {self.iters_per_s:.4g} (closed form): its"
                            " all-to-alls cost more than it saves"]
        runs: list[tuple[list[int], tuple]] = []
        for st in self.stages:
            what = (st.ep, tuple(sorted({(len(r.expert_ids), "+".join(r.gpus)) for r in st.ranks})), st.link)
            if runs and runs[-1][1] == what:
                runs[-1][0].append(st.stage)
            else:
                runs.append(([st.stage], what))
        lines = []
        for stages, (ep, per, link) in runs:
            name = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}"
            if ep == 1:
                lines.append(f"experts: {name} EP 1 (every replica holds all {E})")
                continue
            lines.append(f"experts: {name} EP {ep}: {', '.join(f'{n} on {g}' for n, g in per)} per EP rank; each EP"
                         f" group of {ep} replicas sits on {_LINK_WORDS[link]}")
        why = "  why: fewer experts per GPU to hold, compute and sync, for two all-to-alls each way per MoE block"
        if self.best_flat_iters_per_s is not None:
            why += f"; the best plan found at EP 1 runs {self.best_flat_iters_per_s:.4g} it/s"
        if self.flat_oom is not None:
            gpu, need, limit = self.flat_oom
            why += f"; this shape at EP 1 would need {need / GIB:.1f} GiB on a {gpu} (limit {limit / GIB:.1f})"
        else:
            why += (f"; in closed form this plan runs {self.iters_per_s:.4g} it/s, the same shape at EP 1"
                    f" {self.flat_iters_per_s:.4g}")
        return lines + [why]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the fields above, links as `LinkClass` values, memory in bytes."""
        v, oom = self.best_variant, self.flat_oom
        return {
            "num_experts": self.num_experts, "iters_per_s": self.iters_per_s,
            "stages": [{"stage": st.stage, "ep": st.ep, "all_to_all_link": st.link.value if st.link else None,
                        "ranks": [{"ep_rank": r.ep_rank, "experts": len(r.expert_ids), "expert_ids": list(r.expert_ids),
                                   "gpus": list(r.gpus)} for r in st.ranks]} for st in self.stages],
            "ep1": {"best_found_iters_per_s": self.best_flat_iters_per_s,
                    "same_shape_iters_per_s": self.flat_iters_per_s,
                    "same_shape_oom": {"gpu": oom[0], "need_bytes": oom[1], "limit_bytes": oom[2]} if oom else None},
            "best_ep_variant": {"ep": v.ep, "tp": v.tp, "all_to_all_link": v.link.value,
                                "iters_per_s": v.iters_per_s} if v else None,
        }


def _rate(est: Estimate) -> float:
    """Iterations/s of an estimate."""
    return 1.0 / est.iteration_time_s


def _stage_choices(plan: Plan, ctx: SimContext) -> tuple[StageChoice, ...]:
    """Each stage's `StageChoice` under `plan`, its EP groups placed as the launcher places them."""
    E, slots = ctx.job.model.moe.num_experts, placed_slots(plan, ctx.cluster)
    out = []
    for i in range(plan.num_stages):
        ex = plan.stage_experts(i)
        ranks = tuple(RankExperts(q, ex.held(q, E), tuple(sorted({p.replicas[i].gpu for p in plan.pipelines[q::ex.ep]})))
                      for q in range(ex.ep))
        out.append(StageChoice(i, ex.ep, ranks, _span(slots, ctx, i, ex.ep) if ex.ep > 1 else None))
    return tuple(out)


def explain(chosen: Plan, ctx: SimContext, best_flat: float | None = None) -> ExpertsExplanation | None:
    """Where the experts of `chosen` (a plan `plan_job` returned) sit and why, for `sailor plan`; None
    for a dense model. Each stage's EP degree, the experts each EP rank holds and on which GPU types,
    and the slowest link its EP groups span (`_span`); then why: the iterations/s of the best plan
    the search found at EP 1 (`best_flat`, when given) and of the same shape at EP 1, or the memory
    that shape would need where it does not fit; or, when `chosen` keeps EP 1, the best EP variant
    tried on it (`expert_variants`, closed form). Memory is judged with `ctx`'s margin."""
    model = ctx.job.model
    if model.moe is None:
        return None
    est = simulate(chosen, ctx, event=False)
    x = ExpertsExplanation(model.moe.num_experts, _stage_choices(chosen, ctx), _rate(est), best_flat)
    if not x.uses_ep:
        fit = [(p, _rate(e)) for p in expert_variants(chosen, ctx) if fits(e := simulate(p, ctx, event=False), ctx)]
        if not fit:
            return x
        best, rate = max(fit, key=lambda v: v[1])
        ep = max(e.ep for e in best.experts)
        span = _span(placed_slots(best, ctx.cluster), ctx, _sparse_stages(best, ctx)[0], ep)
        return dataclasses.replace(x, best_variant=EPVariant(ep, best.pipelines[0].replicas[0].tp, span, rate))
    flat = simulate(checked_variant({k: v for k, v in chosen.to_dict().items() if k != "experts"}), ctx, event=False)
    if fits(flat, ctx):
        return dataclasses.replace(x, flat_iters_per_s=_rate(flat))
    worst = max(flat.replicas, key=lambda r: r.peak_memory_bytes / ctx.memory_limit(r.gpu))
    return dataclasses.replace(x, flat_oom=(worst.gpu, worst.peak_memory_bytes, ctx.memory_limit(worst.gpu)))
