"""The report's figures, one function per figure; each writes `<base>.png` and `<base>.svg`.

matplotlib is imported inside the functions (Agg backend, no display), so importing this module
is cheap and `sailor plan` without `--report` never loads matplotlib.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sailor.catalog import LinkClass
from sailor.core.units import GIB
from sailor.plan.orders import BWD, FWD, WGRAD
from sailor.plan.spec import Plan
from sailor.simulator import Estimate, ReplicaEstimate

if TYPE_CHECKING:
    from sailor.planner.compare import Comparison
    from sailor.specs.cluster import ClusterSpec

GB = 1e9
MAX_TIMELINE_ROWS = 16  # rows of the timeline; identical pipelines share a row block, never split
MAX_MEMORY_BARS = 24  # distinct replica kinds drawn in the memory figure

SPACE_STYLE = {"paper": ("#2ca02c", "s"), "homogeneous": ("#ff7f0e", "^")}
"""(colour, marker) of each compared search space in the Pareto figure."""

# Colours (matplotlib's tab10), one per activity, the same in every figure.
COLOR = {"forward": "#1f77b4", "backward": "#ff7f0e", "weight gradient": "#17becf", "p2p": "#9467bd", "sync": "#d62728",
         "optimizer": "#8c564b", "step all-reduces": "#e377c2", "idle": "#e8e8e8",
         "weights": "#1f77b4", "gradients": "#ff7f0e", "optimizer states": "#2ca02c",
         "activations": "#9467bd", "buffers & reserve": "#bcbd22", "framework": "#7f7f7f"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "svg.fonttype": "none"})  # SVG keeps text as text (searchable)
    return plt


def save_figure(fig, path: str | Path, **savefig_kw) -> None:
    """Write `fig` to `path` atomically (format from the suffix; folders created): rendered into
    memory, then `write_atomic`, so a failure never leaves a half-written image."""
    import io

    from sailor.core.fileio import write_atomic

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".").lower() or "png", **savefig_kw)
    write_atomic(path, buf.getvalue())


def _save(fig, base: Path) -> list[Path]:
    paths = [base.with_suffix(".png"), base.with_suffix(".svg")]
    save_figure(fig, paths[0], dpi=130, bbox_inches="tight")
    save_figure(fig, paths[1], bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths


# ---- 1. Pareto front ------------------------------------------------------------------------------
def front_steps(front: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """($/iteration, iterations/s) of a Pareto front of (seconds, $) points, by cost: drawn with
    `steps-post`, each plan's throughput holds up to the next dearer plan's cost, the best throughput
    a budget buys (by time, the line would promise the fastest plan at the cheapest plan's cost)."""
    t, c = np.array(sorted(front, key=lambda p: (p[1], p[0]))).T
    return c, 1.0 / t


def pareto_figure(comparison: "Comparison", base: Path) -> list[Path]:
    """`draw_pareto`, saved. Returns [png, svg] paths."""
    return _save(draw_pareto(comparison), base)


def draw_pareto(comparison: "Comparison"):
    """Iterations/s against $/iteration: the Pareto front of every candidate the comparison's searches
    scored, the fronts of the `paper` and `homogeneous` searches, the main search's alternatives, its
    chosen plan and the other spaces' best plans (`Comparison.best_by_space`; a space without a plan
    is not drawn). Each front is drawn as `Comparison.drawn_front` / `space_front` compute it: the
    marked plans sit where the event simulation puts them, so the chosen plan is a point of the
    front unless a closed-form point beats it (`Comparison.chosen_off_front` says why, on the page).

    Returns:
        the matplotlib Figure (open; `pareto_figure` saves and closes it).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    main, bests = comparison.main, comparison.best_by_space()
    fronts = [("every search: Pareto front", comparison.drawn_front(), "#1f77b4", 1.0)]
    fronts += [(f"{name} search: Pareto front", comparison.space_front(r), SPACE_STYLE[name][0], 0.5)
               for name, r in bests.items()]
    for label, front, color, alpha in fronts:
        if front:
            c, thr = front_steps(front)
            ax.plot(c, thr, "-o", color=color, alpha=alpha, markersize=3, linewidth=1.2, label=label,
                    drawstyle="steps-post" if len(c) > 1 else "default")
    alts = [a.estimate for a in main.alternatives if a.estimate is not None]
    if alts:
        ax.scatter([e.cost_per_iteration_usd for e in alts], [e.throughput_iters_per_s for e in alts],
                   s=28, facecolors="none", edgecolors="#555555", label="alternatives (event-simulated)", zorder=3)
    marks = [("chosen plan", main, "*", "#d62728", 220)]
    marks += [(f"best {name} plan", r, SPACE_STYLE[name][1], SPACE_STYLE[name][0], 90) for name, r in bests.items()]
    for label, r, marker, color, size in marks:
        e = r.estimate
        ax.scatter([e.cost_per_iteration_usd], [e.throughput_iters_per_s], marker=marker, s=size, color=color,
                   edgecolors="black", linewidths=0.6, zorder=5,
                   label=f"{label}: {e.throughput_iters_per_s:.3f} it/s, ${e.cost_per_iteration_usd:.3f}")
    ax.set_xlabel("cost per iteration ($)")
    ax.set_ylabel("throughput (iterations/s)")
    ax.set_title("Plans: throughput against cost (up and left is better)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


# ---- 2. pipeline timeline ------------------------------------------------------------------------
def _pipeline_groups(plan: Plan, est: Estimate) -> list[tuple[list[int], list[ReplicaEstimate]]]:
    """Pipelines that run identical timelines (same GPUs, zones, TP, micro-batches), slowest first:
    [(pipeline indices, that pipeline's replicas by stage)]."""
    by_pipe: dict[int, list[ReplicaEstimate]] = {}
    for r in est.replicas:
        by_pipe.setdefault(r.pipeline, []).append(r)
    groups: dict[tuple, list[int]] = {}
    for j, p in enumerate(plan.pipelines):
        key = (p.microbatches, tuple((r.gpu, r.zone, r.tp) for r in p.replicas))
        groups.setdefault(key, []).append(j)
    out = [(js, sorted(by_pipe[js[0]], key=lambda r: r.stage)) for js in groups.values()]
    out.sort(key=lambda g: -est.pipeline_times_s[g[0][0]])
    return out


def _pipes_label(js: list[int]) -> str:
    if len(js) == 1:
        return f"pipeline {js[0]}"
    return f"pipelines {js[0]}..{js[-1]} (x{len(js)})" if js == list(range(js[0], js[-1] + 1)) \
        else f"pipelines {','.join(map(str, js[:3]))}{',...' if len(js) > 3 else ''} (x{len(js)})"


def timeline_figure(plan: Plan, est: Estimate, base: Path) -> list[Path]:
    """The chosen plan's iteration as a Gantt chart: one row per (pipeline, stage), the passes of its
    schedule as the event simulation ran them (`PipelineSchedule.timeline`: forwards, backwards, ZB-H1's
    weight-gradient passes, 1F1B's blocking p2p transfers; under interleaving later chunks are drawn
    lighter), then gradient sync, the optimizer step and the step's all-reduces over every rank as the
    simulator orders them; idle time
    (bubbles, waits for a peer or for the slowest pipeline) in grey. Identical pipelines share one row
    block; at most MAX_TIMELINE_ROWS rows, slowest first (the fastest kind is kept when some are left
    out).

    Returns:
        [png, svg] paths.
    """
    plt = _pyplot()
    groups = _pipeline_groups(plan, est)
    per_group = plan.num_stages
    shown = groups[:max(1, MAX_TIMELINE_ROWS // per_group)]
    if len(shown) < len(groups) and len(shown) > 1:  # keep the fastest kind too: the contrast is the point
        shown[-1] = groups[-1]
    rows = [(js, reps, r) for js, reps in shown for r in reps]
    end_pipe = est.pipeline_s
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.42 * len(rows)))
    labels = []
    sched = est.schedule
    timelines = {js[0]: sched.timeline(est.pipeline_passes[js[0]], plan.pipelines[js[0]].microbatches) for js, _ in shown}
    activity = {FWD: "forward", BWD: "backward", WGRAD: "weight gradient"}
    v = sched.virtual_stages
    for y, (js, reps, r) in enumerate(rows):
        ax.broken_barh([(0, est.iteration_time_s)], (y - 0.4, 0.8), color=COLOR["idle"])
        spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for op in timelines[js[0]][r.stage]:
            kind = activity.get(op.kind, "p2p")
            spans.setdefault((kind, op.chunk), []).append((op.start_s, op.end_s - op.start_s))
        for (kind, chunk), bars in spans.items():
            ax.broken_barh(bars, (y - 0.4, 0.8), color=COLOR[kind], alpha=1.0 - 0.45 * chunk / max(v - 1, 1),
                           linewidth=0.2 if v > 1 else 0, edgecolor="white")
        ax.broken_barh([(end_pipe, r.sync_s)], (y - 0.4, 0.8), color=COLOR["sync"], linewidth=0)
        ax.broken_barh([(end_pipe + est.gradient_sync_s, r.optimizer_s)], (y - 0.4, 0.8),
                       color=COLOR["optimizer"], linewidth=0)
        # the gradient norm's all-reduce runs before the update, the statistics' after it: drawn
        # together at the iteration's end (each a few ms)
        ax.broken_barh([(est.iteration_time_s - est.step_collectives_s, est.step_collectives_s)], (y - 0.4, 0.8),
                       color=COLOR["step all-reduces"], linewidth=0)
        labels.append(f"{_pipes_label(js)} · stage {r.stage} · {r.gpu} TP{r.tp}")
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, est.iteration_time_s * 1.01)
    ax.set_xlabel("time in the iteration (s)")
    hidden = len(groups) - len(shown)
    ax.set_title(f"{sched.label} timeline of one iteration ({est.iteration_time_s:.3f} s)"
                 + (f"; {hidden} more pipeline kind(s) not shown" if hidden else ""))
    from matplotlib.patches import Patch

    drawn = {activity.get(op.kind, "p2p") for t in timelines.values() for stage in t for op in stage}
    names = {"p2p": "p2p send/recv", "backward": "backward (input gradient)" if sched.splits_backward else "backward"}
    legend = [Patch(color=COLOR[k], label=names.get(k, k)) for k in ("forward", "backward", "weight gradient", "p2p")
              if k in drawn]
    legend += [Patch(color=COLOR["sync"], label=f"gradient sync ({est.gradient_sync_s:.3f} s)"),
               Patch(color=COLOR["optimizer"], label=f"optimizer ({est.optimizer_s:.3f} s)"),
               Patch(color=COLOR["step all-reduces"], label=f"step all-reduces ({est.step_collectives_s:.3f} s)"),
               Patch(color=COLOR["idle"], label="idle (bubble / wait)")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.45 / max(len(rows), 1) - 0.12),
              ncol=len(legend), fontsize=8, frameon=False)
    return _save(fig, base)


# ---- 3. memory -----------------------------------------------------------------------------------
def memory_figure(est: Estimate, base: Path) -> list[Path]:
    """Memory per GPU against its capacity, stacked by weights, gradients, optimizer states,
    activations, buffers & reserve, and framework; one bar per distinct replica kind (stage, GPU
    type, TP, same breakdown), at most MAX_MEMORY_BARS, fullest first.

    Returns:
        [png, svg] paths.
    """
    plt = _pyplot()
    kinds: dict[tuple, list[ReplicaEstimate]] = {}
    for r in est.replicas:
        m = r.memory
        key = (r.stage, r.gpu, r.tp, round(m.total / 2**20))
        kinds.setdefault(key, []).append(r)
    bars = sorted(kinds.values(), key=lambda rs: (rs[0].stage, rs[0].gpu, rs[0].tp))
    bars = sorted(bars, key=lambda rs: -rs[0].peak_memory_bytes / rs[0].memory_capacity_bytes)[:MAX_MEMORY_BARS]
    bars.sort(key=lambda rs: (rs[0].stage, rs[0].gpu, rs[0].tp))
    parts = [("weights", lambda m: m.weights), ("gradients", lambda m: m.gradients),
             ("optimizer states", lambda m: m.optimizer), ("activations", lambda m: m.activations),
             ("buffers & reserve", lambda m: m.buffers + m.reserve + m.sync_buffer), ("framework", lambda m: m.framework)]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(bars)))
    y = np.arange(len(bars))
    left = np.zeros(len(bars))
    for name, get in parts:
        v = np.array([get(rs[0].memory) for rs in bars]) / GIB
        ax.barh(y, v, left=left, color=COLOR[name], label=name, height=0.6)
        left += v
    cap = np.array([rs[0].memory_capacity_bytes for rs in bars]) / GIB
    ax.scatter(cap, y, marker="|", s=500, color="black", linewidths=2, label="capacity", zorder=4)
    for k, rs in enumerate(bars):
        used, total = rs[0].peak_memory_bytes / GIB, cap[k]
        ax.text(max(used, total) + 0.01 * cap.max(), k, f"{used:.1f} / {total:.0f} GiB" + ("  OOM" if rs[0].oom else ""),
                va="center", fontsize=8, color="#d62728" if rs[0].oom else "black")
    ax.set_yticks(y, [f"stage {rs[0].stage} · {rs[0].gpu} TP{rs[0].tp}" + (f" (x{len(rs)})" if len(rs) > 1 else "")
                      for rs in bars])
    ax.invert_yaxis()
    ax.set_xlim(0, max(cap.max(), left.max()) * 1.25)
    ax.set_xlabel("memory per GPU (GiB)")
    ax.set_title("Memory per GPU against capacity" + (f" (fullest {len(bars)} of {len(kinds)} kinds)"
                                                      if len(kinds) > len(bars) else ""))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / max(len(bars), 1) - 0.15), ncol=7, fontsize=8,
              frameon=False)
    return _save(fig, base)


# ---- 4. placement --------------------------------------------------------------------------------
def _traffic_by_pair(est: Estimate) -> dict[tuple[str, str], dict[str, float]]:
    """`Estimate.traffic` as one bar per zone pair: {pair: {"p2p": bytes, "sync": bytes, "usd": egress $}}."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for t in est.traffic:
        bar = out.setdefault(t.zones, {"p2p": 0.0, "sync": 0.0, "usd": 0.0})
        bar[t.kind.value] += t.moved_bytes
        bar["usd"] += t.egress_usd
    return out


def placement_figure(plan: Plan, est: Estimate, cluster: "ClusterSpec", base: Path) -> list[Path]:
    """`draw_placement`, saved. Returns [png, svg] paths."""
    return _save(draw_placement(plan, est, cluster), base)


def draw_placement(plan: Plan, est: Estimate, cluster: "ClusterSpec"):
    """Left: zones x GPU types, GPUs used / available (colour: share used). Right: GB per iteration
    crossing each zone pair, pipeline p2p and gradient sync (`Estimate.traffic`), with the pair's
    egress $ and whether it crosses zones, regions or continents.

    No two labels overlap, however many zones, GPU types and zone pairs: the figure grows with
    them (each column as wide as its widest "used / available" label), GPU-type labels are turned
    45 degrees, the traffic axis has few ticks, and each traffic bar's figures are written in the
    axes' right margin (`tests/test_report.py` checks every pair of text boxes).

    Returns:
        the matplotlib Figure (open; `placement_figure` saves and closes it).
    """
    plt = _pyplot()
    use = plan.gpu_usage()
    zones = sorted(set(cluster.zones) | {z for z, _ in use})
    gpus = sorted({g for z in cluster.zones.values() for g, n in z.items() if n} | {g for _, g in use})
    share = np.full((len(zones), len(gpus)), np.nan)
    for a, z in enumerate(zones):
        for b, g in enumerate(gpus):
            have = cluster.available(z, g)
            if have:
                share[a, b] = use.get((z, g), 0) / have
    pairs = sorted(_traffic_by_pair(est).items(), key=lambda kv: -(kv[1]["p2p"] + kv[1]["sync"]))
    cells = {(z, g): f"{use.get((z, g), 0)} / {cluster.available(z, g)}" if cluster.available(z, g) else "-"
             for z in zones for g in gpus}
    cell_w = max(0.8, 0.075 * max(map(len, cells.values())))  # inches per column: its widest label at 8 pt
    left_w = max(4.0, cell_w * len(gpus) + 2.5)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(left_w + 8.0, 2.0 + 0.5 * max(len(zones), len(pairs), 3)),
                                 gridspec_kw={"width_ratios": [left_w, 5.0], "wspace": 0.9})
    cmap = plt.get_cmap("Blues").with_extremes(bad="#eeeeee")  # grey: no such GPU in that zone
    # vmax above 1 keeps the darkest cell light enough for its black label
    im = ax.imshow(np.ma.masked_invalid(share), cmap=cmap, vmin=0, vmax=1.3, aspect="auto")
    for a, z in enumerate(zones):
        for b, g in enumerate(gpus):
            ax.text(b, a, cells[(z, g)], ha="center", va="center", fontsize=8, color="black")
    ax.set_xticks(range(len(gpus)), gpus, rotation=45, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(len(zones)), zones)
    ax.set_title(f"GPUs used / available ({plan.world_size} used)")
    fig.colorbar(im, ax=ax, fraction=0.05, pad=0.03, label="share used").ax.set_ylim(0, 1)
    if pairs:
        kind = {LinkClass.SAME_REGION: "zones", LinkClass.SAME_CONTINENT: "regions", LinkClass.INTERCONTINENTAL: "continents"}
        labels = [f"{a} - {b} ({kind.get(cluster.prov.link_class(a, b), '')})" for (a, b), _ in pairs]
        p2p = np.array([v["p2p"] for _, v in pairs]) / GB
        sync = np.array([v["sync"] for _, v in pairs]) / GB
        y = np.arange(len(pairs))
        bx.barh(y, p2p, color=COLOR["p2p"], label="pipeline p2p", height=0.6)
        bx.barh(y, sync, left=p2p, color=COLOR["sync"], label="gradient sync", height=0.6)
        for k, (_, v) in enumerate(pairs):  # in the right margin, one row each, clear of the bars
            bx.text(1.02, k, f"{p2p[k] + sync[k]:.3g} GB, ${v['usd']:.4f}", va="center", fontsize=8,
                    transform=bx.get_yaxis_transform())
        bx.set_yticks(y, labels, fontsize=8)
        bx.set_ylim(len(pairs) - 0.5, -0.5)  # first pair on top
        bx.set_xlim(0, (p2p + sync).max() * 1.05)
        bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / max(len(pairs), 3)), ncol=2, fontsize=8,
                  frameon=False)
    else:
        bx.text(0.5, 0.5, "no traffic crosses zones", ha="center", va="center", transform=bx.transAxes)
        bx.set_yticks([])
    from matplotlib.ticker import MaxNLocator, StrMethodFormatter

    bx.xaxis.set_major_locator(MaxNLocator(nbins=4))  # few ticks, short labels: they never touch
    bx.xaxis.set_major_formatter(StrMethodFormatter("{x:.3g}"))
    bx.set_xlabel("GB per iteration")
    bx.set_title(f"Cross-zone traffic: {est.cross_zone_bytes / GB:.2f} GB/iteration,\n"
                 f"egress ${est.egress_per_iteration_usd:.4f}/iteration")
    return fig
