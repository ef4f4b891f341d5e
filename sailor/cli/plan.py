"""`sailor plan`: choose GPUs, zones and the parallelization plan (the main job)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sailor.api import plan_options
from sailor.cli.app import app
from sailor.cli.common import (MAKES_FOLDERS, ClusterOpt, JobOpt, JsonOpt, NetworkOpt, ProfilesOpt, console, job_label,
                               machine_profiles,
                               memory_label, resolve_models)
from sailor.core.errors import SailorInputError
from sailor.core.fileio import check_output_path
from sailor.core.rounding import parts_adding_up
from sailor.core.units import GIB
from sailor.plan.spec import Plan
from sailor.planner import Objective, PlanOptions, PlanResult, SearchSpace, plan_job
from sailor.planner.compare import compare_searches
from sailor.planner.experts import ExpertsExplanation, explain
from sailor.planner.options import DEFAULT_MEMORY_MARGIN
from sailor.simulator import SimContext, make_context
from sailor.specs import EXAMPLE_CLUSTER, EXAMPLE_JOB, load_cluster, load_job
from sailor.specs.cluster import ClusterSpec


@app.command("plan")
def plan_command(
    job: Optional[Path] = JobOpt,
    cluster: Optional[Path] = ClusterOpt,
    profiles: Optional[Path] = ProfilesOpt,
    network: Optional[Path] = NetworkOpt,
    objective: Objective = typer.Option(Objective.THROUGHPUT, "--objective",
                                        help="throughput: max iterations/s; cost: min $/iteration."),
    max_cost_per_iteration: Optional[float] = typer.Option(None, "--max-cost-per-iteration",
                                                           help="Budget in $ per iteration, e.g. 1.2."),
    max_cost_per_hour: Optional[float] = typer.Option(None, "--max-cost-per-hour",
                                                      help="Spending rate limit in $/hour, e.g. 500."),
    min_throughput: Optional[float] = typer.Option(None, "--min-throughput",
                                                   help="Floor in iterations/s, e.g. 0.2."),
    search: SearchSpace = typer.Option(SearchSpace.FULL, "--search",
                                       help="full (ours), paper (published space) or homogeneous (one GPU type,"
                                            " one zone)."),
    max_stages: int = typer.Option(16, "--max-stages", min=1, help="Largest pipeline depth P tried."),
    time_limit: Optional[float] = typer.Option(None, "--time-limit",
                                               help="Stop searching after this many seconds and take the best plan"
                                                    " found so far, e.g. 10 (an error if none was found)."),
    memory_margin: float = typer.Option(DEFAULT_MEMORY_MARGIN, "--memory-margin",
                                        help="Fraction of each GPU's memory a plan leaves free, 0 <= x < 1"
                                             f" (default {DEFAULT_MEMORY_MARGIN}: the simulator's memory error"
                                             " on measured runs plus unmeasured framework memory)."),
    top: int = typer.Option(3, "--top", min=0, help="Alternatives to show."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the plan (with its job and cluster) to this JSON file."
                                                + MAKES_FOLDERS),
    report: Optional[Path] = typer.Option(None, "--report", help="Write figures (PNG, SVG) and index.html to this"
                                          " folder, e.g. report/ (also runs the paper and homogeneous searches and"
                                          " the search for the other objective)." + MAKES_FOLDERS),
    as_json: bool = JsonOpt,
) -> None:
    """Find the best plan for JOB on the GPUs CLUSTER offers (built-in example when both are omitted)."""
    if (job is None) != (cluster is None):
        raise SailorInputError("pass both --job and --cluster, or neither for the built-in example")
    opts = plan_options(objective=objective, search=search, max_cost_per_iteration=max_cost_per_iteration,
                        max_cost_per_hour=max_cost_per_hour, min_throughput=min_throughput, max_stages=max_stages,
                        top=top, time_limit=time_limit, memory_margin=memory_margin)
    inputs = {"--job": job, "--cluster": cluster, "--profiles": profiles, "--network": network}
    check_output_path(out, "--out", inputs=inputs)
    check_output_path(report, "--report", folder=True, inputs=inputs)
    job_spec = load_job(job) if job else EXAMPLE_JOB
    cluster_spec = load_cluster(cluster) if cluster else EXAMPLE_CLUSTER
    prof, net = resolve_models(job_spec, cluster_spec, machine_profiles(job_spec, cluster_spec, profiles,
                                                           job_source=str(job) if job else None), network)
    ctx = make_context(job_spec, cluster_spec, prof, net)
    con = console()
    try:
        if as_json:
            result = plan_job(ctx, opts)
        else:
            bar, progress = search_progress(con)
            with bar:
                result = plan_job(ctx, opts, progress=progress)
    except SailorInputError as e:
        # an error about the cluster's own fields (e.g. no GPUs in any zone) names the cluster file
        raise (e.located(source=str(cluster)) if cluster and e.field == "zones" else e) from None
    if out:
        result.plan.save(out)
    if report:
        title = f"sailor plan: {job_label(job_spec)}"
        err = Console(stderr=True)
        with Progress(TextColumn("report: {task.fields[step]}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True, disable=as_json or not err.is_terminal) as bar:
            task = bar.add_task("report", total=None, step="starting")
            write_plan_report(report, result, lambda: make_context(job_spec, cluster_spec, prof, net), opts,
                              cluster_spec, title=title,
                              progress=lambda name, d, t: bar.update(task, completed=d, total=t, step=name))
    experts = explain_experts(result, ctx, opts)  # mixture-of-experts models: where the experts sit, and why
    if as_json:
        print(json.dumps({"plan": result.plan.to_dict(), "estimate": result.estimate.to_dict(),
                          "sequence_length": job_spec.seq, "parameters": job_spec.model.model_params(),
                          "search_time_s": result.search_time_s, "experts": experts.lines() if experts else [],
                          "expert_parallelism": experts.to_dict() if experts else None,
                          "alternatives": [{"plan": c.plan.to_dict(with_specs=False), "estimate": c.estimate.to_dict()}
                                           for c in result.alternatives]}))
        return
    render_plan_result(result, con, title=job_label(job_spec) + ("" if job else " (built-in example)"))
    for line in experts.lines() if experts else []:
        con.print(line)
    if out:
        con.print(f"plan written to {out}")
    if report:
        con.print(f"report written to {report / 'index.html'}")


def explain_experts(result: PlanResult, ctx: SimContext, opts: PlanOptions) -> ExpertsExplanation | None:
    """`planner.experts.explain` of the chosen plan against the best plan found at EP 1, memory
    judged with the planner's margin (`opts.memory_margin`); None for a dense model."""
    flat = result.best_without_experts
    ctx = dataclasses.replace(ctx, memory_margin=opts.memory_margin, memo={})
    return explain(result.plan, ctx, 1.0 / flat.estimate.iteration_time_s if flat and flat.estimate else None)


def write_plan_report(folder: Path, result: PlanResult, ctx_factory: Callable[[], SimContext], options: PlanOptions,
                      cluster: ClusterSpec, *, title: str,
                      progress: Callable[[str, int, int], None] | None = None) -> list[Path]:
    """`sailor plan --report`: the planner's comparison searches around `result`
    (`planner.compare.compare_searches`: the other search spaces and the other objective), then the
    report drawn from them (`report.write_report`). Returns every file written.

    progress(step, done, total) comes before each search and before the figures (step names what
    runs next; done of total steps are finished), and as ("done", total, total) at the end.
    """
    from sailor.report import write_report

    def step(name: str, done: int, total: int) -> None:
        if progress:
            progress(name, done, total)

    comparison = compare_searches(result, ctx_factory, options, progress=lambda name, d, n: step(name, d, n + 1))
    n = len(comparison.others)
    step("figures", n, n + 1)
    written = write_report(folder, result.plan, result.estimate, cluster, title=title, comparison=comparison)
    step("done", n + 1, n + 1)
    return written


def search_progress(con: Console) -> tuple[Progress, Callable[[int, int], None]]:
    """The search's progress bar on `con` (transient) and the `plan_job` callback that moves it:
    (P, micro-batch) nodes done of the nodes enumerated, "starting" until the search has counted them."""
    bar = Progress(TextColumn("searching plans"), BarColumn(), TextColumn("{task.fields[nodes]}"),
                   TimeElapsedColumn(), console=con, transient=True, disable=not con.is_terminal)
    task = bar.add_task("plan", total=None, nodes="starting")
    return bar, lambda done, total: bar.update(task, completed=done, total=total,
                                               nodes=f"{done}/{total} (P, micro-batch) nodes")


def pipeline_groups(plan: Plan) -> list[tuple[str, str, tuple[int, ...], list[int]]]:
    """Pipelines grouped by (GPU type, zone, TP per stage): (gpu, zone, tps, micro-batches of each).
    Mixed pipelines are shown with '+'-joined GPU types and zones."""
    groups: dict[tuple, list[int]] = {}
    for p in plan.pipelines:
        gpus = "+".join(dict.fromkeys(r.gpu for r in p.replicas))
        zones = "+".join(dict.fromkeys(r.zone for r in p.replicas))
        groups.setdefault((gpus, zones, tuple(r.tp for r in p.replicas)), []).append(p.microbatches)
    return [(g, z, t, m) for (g, z, t), m in groups.items()]


def render_plan_result(result: PlanResult, con, title: str) -> None:
    """The chosen plan, its predictions and the alternatives, as rich tables."""
    plan, est = result.plan, result.estimate
    con.print(f"[bold]{title}[/bold]")
    stages = ", ".join(f"{i}: layers {plan.stage_layers_text(i)}" for i in range(plan.num_stages))
    con.print(f"{plan.num_stages} stage(s) ({stages}); {est.schedule.label}; micro-batch {plan.micro_batch_size}; "
              f"{len(plan.pipelines)} pipeline(s) on {plan.world_size} GPUs")
    labels = [memory_label(plan, i) for i in range(plan.num_stages)]
    if any(x != "-" for x in labels):
        con.print("memory options per stage: " + ", ".join(f"{i}: {x}" for i, x in enumerate(labels)))
    t = Table(title="pipelines (data-parallel replicas)")
    for col in ("GPU", "zone", "TP per stage", "pipelines", "micro-batches each", "samples each"):
        t.add_column(col)
    for gpu, zone, tps, mbs in pipeline_groups(plan):
        shares = sorted(set(mbs))
        t.add_row(gpu, zone, ",".join(map(str, tps)), str(len(mbs)), "/".join(map(str, shares)),
                  "/".join(str(m * plan.micro_batch_size) for m in shares))
    con.print(t)
    s = Table(show_header=False, box=None)
    s.add_column()
    s.add_column(justify="right")
    iteration, (pipeline, sync, optimizer, step) = parts_adding_up(  # printed parts add up to the printed total
        est.iteration_time_s, est.iteration_parts, 3)
    for k, v in [("iterations/s", f"{est.throughput_iters_per_s:.4f}"),
                 ("iteration time (s)", f"{iteration} (pipeline {pipeline}, sync {sync}, optimizer {optimizer},"
                                        f" step all-reduces {step})"),
                 ("tokens/s", f"{est.tokens_per_s:,.0f}"),
                 ("$/iteration", f"{est.cost_per_iteration_usd:.4f}" + (
                     f" (egress {est.egress_per_iteration_usd:.4f}, {est.cross_zone_bytes / 1e9:,.1f} GB across zones)"
                     if est.cross_zone_bytes else "")),
                 ("$/hour", f"{est.cost_per_hour_usd:.2f}"),
                 ("memory headroom (GiB)", f"{est.min_headroom_bytes / GIB:.1f} on the fullest GPU"),
                 ("MFU", f"{est.mfu:.1%}"),
                 ("search time (s)", f"{result.search_time_s:.2f}" + (" (stopped at the time limit)" if result.timed_out
                                                                   else " (optimal in its space)" if result.exact else ""))]:
        s.add_row(k, v)
    con.print(s)
    if est.tp_communication:
        con.print(f"TP communication: {'; '.join(est.tp_communication)}")
    if est.estimated:
        con.print(f"[yellow]estimated (no measurement): {'; '.join(est.estimated)}[/yellow]")
    if result.alternatives:
        a = Table(title="alternatives")
        for col in ("#", "stages", "micro-batch", "pipelines", "GPUs", "iterations/s", "$/iteration", "$/hour"):
            a.add_column(col, justify="right")
        for i, c in enumerate(result.alternatives, 1):
            e, p = c.estimate, c.plan
            desc = "; ".join(f"{len(m)}x {g} {z} TP {','.join(map(str, tp))}" for g, z, tp, m in pipeline_groups(p))
            mems = sorted({memory_label(p, i) for i in range(p.num_stages)} - {"-"})
            desc += f" [{', '.join(mems)}]" if mems else ""
            desc += f" {e.schedule.label}" if e.schedule.label != est.schedule.label else ""
            a.add_row(str(i), str(p.num_stages), str(p.micro_batch_size), desc, str(p.world_size),
                      f"{e.throughput_iters_per_s:.4f}", f"{e.cost_per_iteration_usd:.4f}", f"{e.cost_per_hour_usd:.2f}")
        con.print(a)
