"""Plan reports: figures (PNG and SVG, matplotlib) and an index.html that shows them with the plan.

`write_report` draws, into one folder:
- `pareto`: iterations/s against $/iteration of the candidates, the chosen plan and the `paper` and
  `homogeneous` searches' best plans (only when a PlanResult is given, i.e. from `sailor plan`);
- `timeline`: the chosen plan's iteration under its pipeline schedule, per pipeline and stage;
- `memory`: memory per GPU against capacity, by category;
- `placement`: GPUs used / available per zone and GPU type, and cross-zone traffic per zone pair.
matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sailor.core.errors import InfeasibleError, SailorInputError
from sailor.plan.spec import Plan
from sailor.simulator import Estimate, SimContext

if TYPE_CHECKING:
    from sailor.planner import PlanOptions, PlanResult


def write_report(out_dir: str | Path, plan: Plan, est: Estimate, ctx: SimContext, *, title: str,
                 result: "PlanResult | None" = None, paper: "PlanResult | None" = None,
                 homogeneous: "PlanResult | None" = None, notes: list[str] | None = None) -> list[Path]:
    """Write the figures and index.html for `plan` into `out_dir` (created if missing).

    Args:
        plan, est: the plan and its estimate (`simulate(plan, ctx)`).
        ctx: the simulation context the estimate came from (cluster, network, profiles).
        title: page heading.
        result, paper, homogeneous: planner results for the Pareto figure (no Pareto figure
            without `result`; a missing `paper` / `homogeneous` is simply not marked).
        notes: extra lines for the page.
    Returns:
        every file written (index.html last).
    Raises:
        SailorInputError: `out_dir` exists and is not a folder.
    """
    from sailor.report import figures
    from sailor.report.html import write_index
    from sailor.report.traffic import cross_zone_traffic

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SailorInputError("exists and is not a folder", source=str(out), fix="pass a folder for --report")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    shown: list[tuple[str, str, Path]] = []
    if result is not None:
        paths = figures.pareto_figure(result, out / "pareto", paper=paper, homogeneous=homogeneous)
        written += paths
        shown.append(("Throughput against cost", "The closed-form Pareto front of the candidates the planner"
                      " scored; the chosen plan, the alternatives and the best plans of the paper's and the"
                      " homogeneous search spaces are event-simulated.", paths[0]))
    steps = [
        (f"{est.schedule.label} timeline", "One iteration of the chosen plan: one row per pipeline and stage"
         " (identical pipelines share a row); forwards, backwards (and weight-gradient passes, blocking p2p"
         " transfers where the schedule has them) by the event simulation, then gradient sync and the optimizer"
         " step; grey is idle.", lambda: figures.timeline_figure(plan, est, out / "timeline")),
        ("Memory per GPU", "Peak memory per GPU by category against the GPU's capacity (black tick); one bar"
         " per kind of replica.", lambda: figures.memory_figure(est, out / "memory")),
        ("Placement and cross-zone traffic", "GPUs used out of those available per zone and GPU type; bytes"
         " per iteration crossing each pair of zones.",
         lambda: figures.placement_figure(plan, est, ctx.cluster, cross_zone_traffic(plan, ctx), out / "placement")),
    ]
    for heading, caption, draw in steps:
        paths = draw()
        written += paths
        shown.append((heading, caption, paths[0]))
    written.append(write_index(out, title=title, plan=plan, est=est, figures=shown, notes=notes or []))
    return written


def plan_report(out_dir: str | Path, result: "PlanResult", ctx_factory, options: "PlanOptions", *,
                title: str, progress: Callable[[str, int, int], None] | None = None) -> list[Path]:
    """`sailor plan --report`: run the `paper` and `homogeneous` searches too (same job, cluster and
    constraints), then `write_report`. A search that finds no plan is noted, not marked.

    Args:
        result: the main search's result.
        ctx_factory: returns a fresh SimContext (one per planning call; caches must not be shared).
        options: the main search's options (search space replaced for the two extra searches).
        progress: called as progress(step, done, total) before each extra search and the figures
            (step names what runs next; done of total steps are finished).
    """
    import dataclasses

    from sailor.planner import Constraints, Objective, SearchSpace, plan_job

    others: dict[str, "PlanResult | None"] = {}
    notes = []
    flipped = Objective.COST if options.objective is Objective.THROUGHPUT else Objective.THROUGHPUT
    spaces = [s for s in (SearchSpace.PAPER, SearchSpace.HOMOGENEOUS) if s is not options.search]
    steps = [f"{s.value} search" for s in spaces] + [f"{flipped.value} search", "figures"]

    def step(done: int) -> None:
        if progress:
            progress(steps[done] if done < len(steps) else "done", done, len(steps))

    for space in (SearchSpace.PAPER, SearchSpace.HOMOGENEOUS):
        if options.search is space:
            others[space.value] = result
            continue
        step(spaces.index(space))
        try:
            others[space.value] = plan_job(ctx_factory(), dataclasses.replace(options, search=space))
        except InfeasibleError as e:
            others[space.value] = None
            notes.append(f"{space.value} search: no plan ({e.one_line()})")
    # The main search scores candidates from its own objective's side of the trade-off only (branch and
    # bound prunes the rest). The front drawn for it also takes the plans scored by the search for the
    # other objective and by the paper and homogeneous searches: all of them are plans of the full space.
    points = list(result.pareto)
    step(len(spaces))
    try:
        points += plan_job(ctx_factory(), dataclasses.replace(options, objective=flipped, constraints=Constraints())).pareto
    except InfeasibleError:
        pass
    points += [p for r in others.values() if r is not None for p in r.pareto]
    front = sorted({p for p in points if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points)})
    result = dataclasses.replace(result, pareto=front)
    ctx = ctx_factory()
    step(len(spaces) + 1)
    written = write_report(out_dir, result.plan, result.estimate, ctx, title=title, result=result,
                           paper=others["paper"], homogeneous=others["homogeneous"], notes=notes)
    step(len(steps))
    return written
