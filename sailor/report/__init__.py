"""Plan reports: figures (PNG and SVG, matplotlib) and an index.html that shows them with the plan.

A report only draws: every number comes from the Estimate (the simulator) or from a Comparison (the
planner's searches, `sailor.planner.compare`). `write_report` draws, into one folder:
- `pareto`: iterations/s against $/iteration of the scored candidates, the chosen plan and the
  `paper` and `homogeneous` searches' best plans (only with a Comparison, i.e. from `sailor plan`);
- `timeline`: the chosen plan's iteration under its pipeline schedule, per pipeline and stage;
- `memory`: memory per GPU against capacity, by category;
- `placement`: GPUs used / available per zone and GPU type, and cross-zone traffic per zone pair
  (`Estimate.traffic`).
matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sailor.core.errors import SailorInputError
from sailor.plan.spec import Plan
from sailor.simulator import Estimate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

if TYPE_CHECKING:
    from sailor.planner.compare import Comparison


def write_report(out_dir: str | Path, plan: Plan, est: Estimate, cluster: ClusterSpec, *, title: str,
                 comparison: "Comparison | None" = None, notes: list[str] | None = None,
                 job: JobSpec | None = None) -> list[Path]:
    """Write the figures and index.html for `plan` into `out_dir` (created if missing).

    Args:
        plan, est: the plan and its estimate (`simulate(plan, ctx)`, or the planner's).
        cluster: the cluster the plan was made for (GPUs available per zone, link classes).
        title: page heading.
        comparison: the planner's comparison searches around `plan` (`planner.compare.compare_searches`)
            for the Pareto figure; no Pareto figure without it. A search that found no plan is
            named in the notes.
        notes: extra lines for the page.
        job: what the plan was made for (default `plan.job`), shown on the page.
    Returns:
        every file written (index.html last).
    Raises:
        SailorInputError: `out_dir` exists and is not a folder.
    """
    from sailor.report import figures
    from sailor.report.html import write_index

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SailorInputError("exists and is not a folder", source=str(out), fix="pass a folder for --report")
    out.mkdir(parents=True, exist_ok=True)
    notes = list(notes or [])
    written: list[Path] = []
    shown: list[tuple[str, str, Path]] = []
    if comparison is not None:
        paths = figures.pareto_figure(comparison, out / "pareto")
        written += paths
        off = comparison.chosen_off_front()
        shown.append(("Throughput against cost", "The Pareto front of the candidates the planner's searches"
                      " scored, in closed form except for the plans marked (the chosen plan, the alternatives and"
                      " the best plans of the paper's and the homogeneous search spaces), which sit where the event"
                      " simulation puts them; " + (off if off else "the chosen plan (the star) is a point of the"
                                                   " front."), paths[0]))
        notes += [f"{o.label}: no plan ({o.reason})" for o in comparison.others if o.result is None]
        notes += [off] if off else []
    steps = [
        (f"{est.schedule.label} timeline", "One iteration of the chosen plan: one row per pipeline and stage"
         " (identical pipelines share a row); forwards, backwards (and weight-gradient passes, blocking p2p"
         " transfers where the schedule has them) by the event simulation, then gradient sync and the optimizer"
         " step; grey is idle.", lambda: figures.timeline_figure(plan, est, out / "timeline")),
        ("Memory per GPU", "Peak memory per GPU by category against the GPU's capacity (black tick); one bar"
         " per kind of replica.", lambda: figures.memory_figure(est, out / "memory")),
        ("Placement and cross-zone traffic", "GPUs used out of those available per zone and GPU type; bytes"
         " per iteration crossing each pair of zones.",
         lambda: figures.placement_figure(plan, est, cluster, out / "placement")),
    ]
    for heading, caption, draw in steps:
        paths = draw()
        written += paths
        shown.append((heading, caption, paths[0]))
    written.append(write_index(out, title=title, plan=plan, est=est, figures=shown, notes=notes, job=job))
    return written
