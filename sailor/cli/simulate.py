"""`sailor simulate PLAN`: predicted iteration time, memory per GPU and cost of a plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from sailor.cli.app import app
from sailor.cli.common import (MAKES_FOLDERS, ClusterOpt, JobOpt, JsonOpt, NetworkOpt, ProfilesOpt, console, job_label,
                               machine_profiles,
                               memory_label, resolve_models, resolve_specs)
from sailor.core.fileio import check_output_path
from sailor.core.rounding import parts_adding_up
from sailor.core.units import GIB
from sailor.plan import load_plan
from sailor.plan.spec import Plan
from sailor.simulator import Estimate, check_modelled, make_context, simulate
from sailor.simulator.schedule import check_pipeline_tasks


@app.command("simulate")
def simulate_command(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="Plan file (ours, or a Sailor plan_config JSON)."),
    job: Optional[Path] = JobOpt,
    cluster: Optional[Path] = ClusterOpt,
    profiles: Optional[Path] = ProfilesOpt,
    network: Optional[Path] = NetworkOpt,
    report: Optional[Path] = typer.Option(None, "--report", help="Write figures (PNG, SVG) and index.html to this"
                                          " folder, e.g. report/." + MAKES_FOLDERS),
    as_json: bool = JsonOpt,
) -> None:
    """Simulate one training iteration of PLAN: time, memory per GPU, cost."""
    check_output_path(report, "--report", folder=True, inputs={"PLAN": plan_path, "--job": job, "--cluster": cluster,
                                                               "--profiles": profiles, "--network": network})
    plan = load_plan(plan_path)
    try:
        job_spec, cluster_spec = resolve_specs(plan, job, cluster)
        plan.check_against(job_spec, cluster_spec)
        check_modelled(plan, job_spec.framework)
        for pipe in plan.pipelines:  # before the work (profiling this machine, the simulation)
            check_pipeline_tasks(plan.num_stages, pipe.microbatches, plan.virtual_stages)
    except Exception as e:
        from sailor.core.errors import SailorInputError
        if isinstance(e, SailorInputError):
            raise e.located(source=str(plan_path)) from None
        raise
    prof, net = resolve_models(job_spec, cluster_spec, machine_profiles(job_spec, cluster_spec, profiles,
                                                           job_source=str(job or plan_path)), network)
    ctx = make_context(job_spec, cluster_spec, prof, net)
    est = simulate(plan, ctx)
    if report:
        from sailor.report import write_report
        write_report(report, plan, est, cluster_spec, job=job_spec,
                     title=f"sailor simulate: {job_label(job_spec)} · {plan_path.name}")
    if as_json:
        print(json.dumps({**est.to_dict(), "sequence_length": job_spec.seq,
                          "parameters": job_spec.model.model_params()}))
        return
    render_estimate(est, console(), title=f"{job_label(job_spec)} · {plan_path}", plan=plan,
                    moe=job_spec.model.moe is not None)


def render_estimate(est: Estimate, console: Console, title: str = "", plan: Plan | None = None,
                    moe: bool = False) -> None:
    """Rich tables: one row per replica (with its stage's memory options when `plan` is given; for a
    mixture-of-experts model, `moe`, its stage's EP degree and its all-to-all seconds per
    micro-batch, "a2a", part of fwd+bwd), then totals and whether TP collectives were charged or
    measured. The iteration's parts (pipeline, gradient sync, optimizer, step all-reduces) are printed
    so that they add up to the printed iteration time (`core.rounding.parts_adding_up`: largest
    remainder)."""
    t = Table(title=title or None, show_lines=False)
    experts = ("EP", "a2a/mb (s)") if moe else ()
    for col in ("stage", "pipe", "GPU", "zone", "TP", *experts[:1], "layers", "options", "fwd+bwd/mb (s)",
                *experts[1:], "recompute/mb (s)", "TP comm/mb (s)", "p2p/mb (s)", "sync (s)", "memory (GiB)", "OOM"):
        t.add_column(col, justify="right" if col not in ("GPU", "zone", "options") else "left")
    for r in sorted(est.replicas, key=lambda r: (r.stage, r.pipeline)):
        ep = (str(plan.stage_experts(r.stage).ep) if plan else "",) if moe else ()
        a2a = (f"{r.all_to_all_s:.4f}",) if moe else ()
        t.add_row(str(r.stage), str(r.pipeline), r.gpu, r.zone, str(r.tp), *ep,
                  " + ".join(f"[{a},{b})" for a, b in r.chunks), memory_label(plan, r.stage) if plan else "",
                  f"{r.forward_s + r.backward_s:.4f}", *a2a, f"{r.recompute_s:.4f}", f"{r.tp_comm_s:.4f}",
                  f"{r.p2p_s:.4f}", f"{r.sync_s:.4f}",
                  f"{r.peak_memory_bytes / GIB:.1f} / {r.memory_capacity_bytes / GIB:.1f}",
                  "[red]yes[/red]" if r.oom else "no")
    console.print(t)
    s = Table(show_header=False, box=None)
    s.add_column(justify="left")
    s.add_column(justify="right")
    iteration, (pipeline, sync, optimizer, step) = parts_adding_up(
        est.iteration_time_s, est.iteration_parts, 4)
    rows = [
        ("iteration time (s)", iteration),
        (f"  pipeline ({est.schedule.label}, slowest) (s)", pipeline),
        ("  gradient sync (s)", sync),
        ("  optimizer (s)", optimizer),
        ("  step all-reduces (s)", step),
        ("iterations/s", f"{est.throughput_iters_per_s:.4f}"),
        ("samples/s", f"{est.samples_per_s:.1f}"),
        ("tokens/s", f"{est.tokens_per_s:,.0f}"),
        ("MFU", f"{est.mfu:.1%}"),
        ("TFLOP/s per GPU (with recompute)", f"{est.flop_per_s_per_gpu / 1e12:.1f}"),
        ("GPUs", str(est.gpus)),
        ("$/iteration", f"{est.cost_per_iteration_usd:.4f}"),
        ("$/hour", f"{est.cost_per_hour_usd:.2f}"),
        ("egress $/iteration", f"{est.egress_per_iteration_usd:.4f}"),
        ("fits in memory", "yes" if est.fits_in_memory else "[red]NO[/red]"),
    ]
    for k, v in rows:
        s.add_row(k, v)
    console.print(s)
    if est.tp_communication:
        console.print(f"TP communication: {'; '.join(est.tp_communication)}")
    if est.schedule_timing:
        console.print(f"schedule: {est.schedule_timing}")
    if est.estimated:
        console.print(f"[yellow]estimated (no measurement): {'; '.join(est.estimated)}[/yellow]")
