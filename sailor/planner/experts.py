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

from sailor.catalog import LinkClass
from sailor.plan.experts import StageExperts
from sailor.plan.spec import Plan
from sailor.planner.schedules import checked_variant, fits
from sailor.simulator import simulate
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


def narrower_tp(plan: Plan, factor: int) -> dict | None:
    """`plan` (`Plan.to_dict` form) on the same GPUs with every replica's TP degree divided by
    `factor`: each pipeline becomes `factor` consecutive pipelines with the same stages, zones and
    GPU types, each running 1/factor of its micro-batches (so the global batch is unchanged). None
    where some TP degree or micro-batch count is not a multiple of `factor`."""
    d = plan.to_dict()
    if any(r["tp"] % factor for p in d["pipelines"] for r in p["replicas"]) or \
            any(p["microbatches"] % factor for p in d["pipelines"]):
        return None
    pipes = [{"microbatches": p["microbatches"] // factor,
              "replicas": [r | {"tp": r["tp"] // factor} for r in p["replicas"]]}
             for p in d["pipelines"] for _ in range(factor)]
    return d | {"pipelines": pipes}


def expert_variants(plan: Plan, ctx: SimContext) -> list[Plan]:
    """`plan` (EP 1, carrying its job and cluster) with EP e on every stage holding an MoE block,
    for each e of `ep_degrees`, at the plan's TP degrees and at each narrower TP on the same GPUs
    (`narrower_tp`: the experts EP spreads no longer need TP to fit, and the dense layers trade TP
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
    shapes = [(f, d) for f in _powers_of_two(widest) if (d := narrower_tp(plan, f)) is not None]
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


def _rate(plan: Plan, ctx: SimContext) -> float:
    """Closed-form iterations/s of `plan` (`simulate(event=False)`)."""
    return 1.0 / simulate(plan, ctx, event=False).iteration_time_s


def explain(chosen: Plan, ctx: SimContext, best_flat: float | None = None) -> list[str]:
    """Lines for `sailor plan` on a mixture-of-experts model (empty for a dense one): for each run of
    stages with one expert parallelism, its EP degree, the experts each EP rank holds and on which
    GPU type, and the slowest link its EP groups span (`_span`); then why: the iterations/s of the
    best plan the search found at EP 1 (`best_flat`, when given) and whether the chosen shape fits at
    EP 1 at all, or, when `chosen` keeps EP 1, the best EP variant tried on it (`expert_variants`,
    closed form) and what it lacked."""
    model = ctx.job.model
    if model.moe is None:
        return []
    E = model.moe.num_experts
    if not chosen.experts or all(e.ep == 1 for e in chosen.experts):
        lines = [f"experts: EP 1, every replica holds all {E} experts of every MoE block"]
        fit = [(p, _rate(p, ctx)) for p in expert_variants(chosen, ctx) if fits(simulate(p, ctx, event=False), ctx)]
        if not fit:
            lines.append("  why: no expert-parallel variant of this plan fits in memory or applies (EP groups need ep"
                         " | pipelines, one TP degree and micro-batch count per group)")
            return lines
        best, rate = max(fit, key=lambda v: v[1])
        ep = max(e.ep for e in best.experts)
        span = _span(placed_slots(best, ctx.cluster), ctx, _sparse_stages(best, ctx)[0], ep)
        lines.append(f"  why: its best expert-parallel variant, EP {ep} at TP {best.pipelines[0].replicas[0].tp} over"
                     f" {_LINK_WORDS[span]}, runs {rate:.4g} it/s"
                     f" against {_rate(chosen, ctx):.4g} (closed form): its all-to-alls cost more than it saves")
        return lines
    lines, runs, slots = [], [], placed_slots(chosen, ctx.cluster)
    for i, ex in enumerate(chosen.experts):
        gpus = [chosen.pipelines[q].replicas[i].gpu for q in range(ex.ep)]
        what = (ex.ep, tuple((len(ex.held(q, E)), g) for q, g in enumerate(gpus)), _span(slots, ctx, i, ex.ep))
        if runs and runs[-1][1] == what:
            runs[-1][0].append(i)
        else:
            runs.append(([i], what))
    for stages, (ep, held, span) in runs:
        name = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}"
        if ep == 1:
            lines.append(f"experts: {name} EP 1 (every replica holds all {E})")
            continue
        per = sorted({h for h in held})
        per_rank = ", ".join(f"{n} on {g}" for n, g in per) if len(per) > 1 else f"{per[0][0]} on {per[0][1]}"
        lines.append(f"experts: {name} EP {ep}: {per_rank} per EP rank; each EP group of {ep} replicas sits on"
                     f" {_LINK_WORDS[span]}")
    flat = checked_variant({k: v for k, v in chosen.to_dict().items() if k != "experts"})
    flat_est = simulate(flat, ctx, event=False)
    why = "  why: fewer experts per GPU to hold, compute and sync, for two all-to-alls each way per MoE block"
    if best_flat is not None:
        why += f"; the best plan found at EP 1 runs {best_flat:.4g} it/s"
    if not fits(flat_est, ctx):
        worst = max(flat_est.replicas, key=lambda r: r.peak_memory_bytes / ctx.memory_limit(r.gpu))
        why += (f"; this shape at EP 1 would need {worst.peak_memory_bytes / 2**30:.1f} GiB on a {worst.gpu}"
                f" (limit {ctx.memory_limit(worst.gpu) / 2**30:.1f})")
    else:
        why += (f"; in closed form this plan runs {_rate(chosen, ctx):.4g} it/s, the same shape at EP 1"
                f" {1.0 / flat_est.iteration_time_s:.4g}")
    return lines + [why]
