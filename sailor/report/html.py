"""index.html of a report: what the plan was made for (job), the plan itself to the last field
(pipelines, stages with their memory options, schedule, and its JSON), the key numbers and the
figures (PNG, linking the SVG)."""

from __future__ import annotations

import html
import json
from pathlib import Path

from sailor.core.rounding import parts_adding_up
from sailor.core.units import GIB
from sailor.model.spec import Recompute
from sailor.plan.spec import Plan, StageMemory
from sailor.simulator import Estimate
from sailor.specs.job import JobSpec

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em 0; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: left; }
th { background: #f3f3f3; }
td.num { text-align: right; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 0.9em; }
pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
.warn { color: #a05a00; }
"""


def plan_rows(plan: Plan) -> list[tuple[str, str, str, int, str]]:
    """The plan table: pipelines grouped by GPU types, zones and TP per stage:
    (GPU types, zones, TP per stage, pipelines, micro-batches each)."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for p in plan.pipelines:
        gpus = " + ".join(dict.fromkeys(r.gpu for r in p.replicas))
        zones = " + ".join(dict.fromkeys(r.zone for r in p.replicas))
        tps = ", ".join(str(r.tp) for r in p.replicas)
        groups.setdefault((gpus, zones, tps), []).append(p.microbatches)
    return [(g, z, t, len(m), "/".join(map(str, sorted(set(m))))) for (g, z, t), m in groups.items()]


def memory_cells(mem: StageMemory) -> list[str]:
    """One stage's memory options as the report's table cells: recomputation (with the recomputed
    blocks under `full`: "full (first 4 blocks)" or "full (all blocks)"), ZeRO level, sequence
    parallelism ("on"/"off")."""
    rec = mem.recompute.value
    if mem.recompute is Recompute.FULL:
        rec += " (all blocks)" if mem.recompute_blocks is None else f" (first {mem.recompute_blocks} blocks)"
    return [rec, str(mem.zero), "on" if mem.sequence_parallel else "off"]


def job_rows(job: JobSpec) -> list[list[str]]:
    """The job's fields a plan depends on, as (field, value) rows: model and its parameter count
    (`ModelSpec.model_params`, as Hugging Face counts them), global batch, sequence length,
    precision, optimizer, framework."""
    m = job.model
    return [["model", f"{m.name} ({m.model_params() / 1e6:,.1f} M parameters, {m.num_blocks} blocks)"],
            ["global batch (samples)", str(job.global_batch_size)],
            ["sequence length (tokens)", str(job.seq)],
            ["precision", job.precision],
            ["optimizer", job.optimizer.value],
            ["framework", job.framework.value]]


def _table(header: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td{' class=num' if k in numeric else ''}>{html.escape(str(c))}</td>"
                                    for k, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_index(out_dir: Path, *, title: str, plan: Plan, est: Estimate,
                figures: list[tuple[str, str, Path]], notes: list[str], job: JobSpec | None = None) -> Path:
    """Write `out_dir/index.html`: the job (`job_rows`), the plan (pipelines; stages with their
    layers and memory options, `memory_cells`; the schedule; the plan's JSON, everything
    `sailor train` needs to run it again), the prediction, notes and figures.

    Args:
        title: page heading.
        plan, est: the plan and its estimate (tables).
        job: what the plan was made for (default `plan.job`; without either the job table is left out).
        figures: (heading, caption, PNG path) per figure; the SVG beside it is linked.
        notes: lines shown under the tables (e.g. a search that found no plan).
    Returns:
        the path of index.html.
    """
    job = job or plan.job
    stages = [[str(i), plan.stage_layers_text(i), str(sum(b - a for a, b in plan.stage_chunks(i))),
               *memory_cells(plan.memory[i] if plan.memory else StageMemory())] for i in range(plan.num_stages)]
    sched = plan.schedule
    schedule = (f"{est.schedule.label} (kind {sched.kind.value}, virtual stages {sched.virtual_stages}),"
                f" micro-batch size {plan.micro_batch_size}")
    plan_json = json.dumps(plan.to_dict(), indent=1)  # with its job and cluster when it carries them
    pipes = [[g, z, t, str(n), m] for g, z, t, n, m in plan_rows(plan)]
    iteration, (pipeline, sync, optimizer, step) = parts_adding_up(  # printed parts add up to the printed total
        est.iteration_time_s, est.iteration_parts, 4)
    summary = [
        ["iteration time (s)", iteration],
        [f"  pipeline, {est.schedule.label} slowest (s)", pipeline],
        ["  gradient sync (s)", sync],
        ["  optimizer (s)", optimizer],
        ["  step all-reduces (s)", step],
        ["iterations/s", f"{est.throughput_iters_per_s:.4f}"],
        ["tokens/s", f"{est.tokens_per_s:,.0f}"],
        ["GPUs", str(est.gpus)],
        ["$/iteration", f"{est.cost_per_iteration_usd:.4f}"],
        ["$/hour", f"{est.cost_per_hour_usd:.2f}"],
        ["cross-zone GB/iteration", f"{est.cross_zone_bytes / 1e9:.2f}"],
        ["memory headroom (GiB, fullest GPU)", f"{est.min_headroom_bytes / GIB:.1f}"],
        ["MFU", f"{est.mfu:.1%}"],
    ]
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_STYLE}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p>{plan.num_stages} stage(s), micro-batch size {plan.micro_batch_size}, {len(plan.pipelines)}"
             f" pipeline(s) on {plan.world_size} GPUs, global batch {plan.global_batch_size}.</p>",
             *(["<h2>Job</h2>", _table(["", "value"], job_rows(job))] if job is not None else []),
             "<h2>Plan</h2>",
             f"<p>schedule: {html.escape(schedule)}</p>",
             _table(["GPU", "zone", "TP per stage", "pipelines", "micro-batches each"], pipes, {3}),
             _table(["stage", "layers", "layer count", "recomputation", "ZeRO", "sequence parallel"], stages, {2, 4}),
             "<details><summary>plan JSON (as <code>sailor plan --out</code> writes it; <code>sailor train</code>"
             " runs it)</summary>"
             f"<pre>{html.escape(plan_json)}</pre></details>",
             "<h2>Prediction</h2>",
             _table(["", "value"], summary, {1})]
    if est.estimated:
        parts.append(f"<p class=warn>estimated (no measurement): {html.escape('; '.join(est.estimated))}</p>")
    parts += [f"<p class=warn>{html.escape(n)}</p>" for n in notes]
    for heading, caption, png in figures:
        svg = png.with_suffix(".svg").name
        parts.append(f"<figure><h2>{html.escape(heading)}</h2><a href='{html.escape(svg)}'>"
                     f"<img src='{html.escape(png.name)}' alt='{html.escape(heading)}'></a>"
                     f"<figcaption>{html.escape(caption)} (<a href='{html.escape(svg)}'>SVG</a>)</figcaption></figure>")
    parts.append("</body></html>\n")
    path = out_dir / "index.html"
    from sailor.core.fileio import write_atomic

    write_atomic(path, "\n".join(parts))
    return path
