"""`--report`: figures (PNG + SVG) and index.html for a plan, drawn from its estimate and the
planner's comparison searches, and the 1F1B timeline behind them."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sailor.plan import plan_from_dict
from sailor.planner import PlanOptions, SearchSpace, plan_job
from sailor.planner.compare import Comparison, OtherSearch, compare_searches
from sailor.report import write_report
from sailor.simulator import make_context, simulate
from sailor.simulator.schedule import simulate_1f1b, timeline_1f1b
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

SAILOR = Path(sys.executable).with_name("sailor")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rep(stage: int, gpu: str, zone: str, tp: int) -> dict:
    return {"stage": stage, "gpu": gpu, "zone": zone, "tp": tp}


JOB = JobSpec(model="opt-350m", global_batch_size=12)
CLUSTER = ClusterSpec(zones={"us-central1-a": {"A100-40": 16}, "us-central1-b": {"V100-16": 16},
                             "us-west1-b": {"V100-16": 8}})
PLAN = plan_from_dict({"micro_batch_size": 1, "stages": [[0, 10], [10, 26]], "pipelines": [
    {"microbatches": 5, "replicas": [_rep(0, "A100-40", "us-central1-a", 4), _rep(1, "V100-16", "us-central1-b", 4)]},
    {"microbatches": 4, "replicas": [_rep(0, "A100-40", "us-central1-a", 4), _rep(1, "V100-16", "us-central1-b", 4)]},
    {"microbatches": 3, "replicas": [_rep(0, "A100-40", "us-central1-a", 4), _rep(1, "V100-16", "us-west1-b", 2)]},
]}).with_specs(JOB, CLUSTER)


@pytest.mark.parametrize("P, m", [(1, 1), (1, 4), (2, 1), (2, 5), (3, 3), (4, 8)])
def test_timeline_has_the_event_simulations_makespan(P, m):
    rng = np.random.default_rng(P * 10 + m)
    f, b, c = rng.uniform(0.5, 2, P), rng.uniform(1, 3, P), rng.uniform(0, 0.5, max(P - 1, 0))
    ops = timeline_1f1b(f, b, c, m)
    makespan, _busy, end = simulate_1f1b(f, b, c, m)
    assert max(o[3] for stage in ops for o in stage) == makespan
    for i, stage in enumerate(ops):
        assert stage[-1][3] == end[i]
        assert sorted(k for kind, k, *_ in stage if kind == "F") == list(range(m))
        assert sorted(k for kind, k, *_ in stage if kind == "B") == list(range(m))
        for (_, _, s0, e0), (_, _, s1, e1) in itertools.pairwise(stage):  # one op at a time, in order
            assert s0 <= e0 <= s1 <= e1


def _check_figure(path: Path, *labels: str) -> None:
    png, svg = path.with_suffix(".png"), path.with_suffix(".svg")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for label in labels:
        assert label in text, f"{label!r} not in {svg.name}"


def test_simulate_report(tmp_path):
    ctx = make_context(JOB, CLUSTER)
    est = simulate(PLAN, ctx)
    written = write_report(tmp_path / "r", PLAN, est, CLUSTER, title="test report")
    names = sorted(p.name for p in written)
    assert names == ["index.html", "memory.png", "memory.svg", "placement.png", "placement.svg",
                     "timeline.png", "timeline.svg"]
    r = tmp_path / "r"
    _check_figure(r / "timeline", "1F1B timeline", "pipeline 2 · stage 1 · V100-16 TP2", "gradient sync")
    _check_figure(r / "memory", "Memory per GPU", "stage 1 · V100-16 TP4 (x2)", "optimizer states", "activations")
    _check_figure(r / "placement", "GPUs used / available", "us-west1-b", "8 / 16", "2 / 8", "Cross-zone traffic",
                  "us-central1-a - us-west1-b (regions)", "us-central1-a - us-central1-b (zones)")
    page = (r / "index.html").read_text()
    for name in ("timeline.png", "memory.png", "placement.png", "timeline.svg"):
        assert f"'{name}'" in page
    assert "micro-batches each" in page and "A100-40 + V100-16" in page and "us-central1-a + us-west1-b" in page
    assert "pareto" not in page


SMALL_JOB = JobSpec(model="opt-350m", global_batch_size=64)
SMALL_CLUSTER = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}, "us-central1-b": {"V100-16": 8}})


def test_plan_report_marks_the_other_searches(tmp_path):
    opts = PlanOptions(max_stages=2, top_k=2)
    result = plan_job(make_context(SMALL_JOB, SMALL_CLUSTER), opts)
    comparison = compare_searches(result, lambda: make_context(SMALL_JOB, SMALL_CLUSTER), opts)
    written = write_report(tmp_path, result.plan, result.estimate, SMALL_CLUSTER, title="plan report",
                           comparison=comparison)
    assert (tmp_path / "pareto.png") in written and (tmp_path / "index.html") in written
    paper, homogeneous = (comparison.best_by_space()[s] for s in ("paper", "homogeneous"))
    # each plan is marked with the numbers of its own estimate
    _check_figure(tmp_path / "pareto", "every search: Pareto front", "paper search: Pareto front",
                  f"chosen plan: {result.estimate.throughput_iters_per_s:.3f} it/s",
                  f"best paper plan: {paper.estimate.throughput_iters_per_s:.3f} it/s",
                  f"best homogeneous plan: {homogeneous.estimate.throughput_iters_per_s:.3f} it/s",
                  "cost per iteration ($)", "throughput (iterations/s)")
    page = (tmp_path / "index.html").read_text()
    assert "'pareto.png'" in page and "no plan" not in page


def test_a_comparison_search_without_a_plan_is_noted_not_marked(tmp_path):
    opts = PlanOptions(max_stages=2, top_k=1)
    result = plan_job(make_context(SMALL_JOB, SMALL_CLUSTER), opts)
    failed = OtherSearch("homogeneous search", PlanOptions(max_stages=2, search=SearchSpace.HOMOGENEOUS), None,
                         "no plan fits one zone")
    comparison = Comparison(result, opts, (failed,), result.pareto)
    write_report(tmp_path, result.plan, result.estimate, SMALL_CLUSTER, title="plan report", comparison=comparison)
    assert "homogeneous search: no plan (no plan fits one zone)" in (tmp_path / "index.html").read_text()
    svg = (tmp_path / "pareto.svg").read_text()
    assert "chosen plan" in svg and "homogeneous" not in svg and "paper" not in svg


@pytest.mark.integration
def test_cli_simulate_report(tmp_path):
    if not SAILOR.exists():
        pytest.skip(f"console script {SAILOR} is not installed (pip install -e .)")
    PLAN.save(tmp_path / "plan.json")
    r = subprocess.run([str(SAILOR), "simulate", str(tmp_path / "plan.json"), "--report", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"index.html", "timeline.png", "memory.svg"}
    (tmp_path / "file").write_text("x")
    r = subprocess.run([str(SAILOR), "simulate", str(tmp_path / "plan.json"), "--report", str(tmp_path / "file")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a folder" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_front_is_drawn_as_what_a_budget_buys():
    # planner fronts come sorted by time (fastest, dearest first); drawn by cost, the step at each cost
    # is the throughput that cost buys: $0.365 buys 1/22.4 it/s, only $0.505 buys 1/15.6
    from sailor.report.figures import front_steps
    costs, thr = front_steps([(15.6, 0.505), (22.4, 0.365), (30.0, 0.30)])
    assert costs.tolist() == [0.30, 0.365, 0.505]
    assert thr.tolist() == [1 / 30.0, 1 / 22.4, 1 / 15.6]


def test_the_page_holds_everything_needed_to_rebuild_the_plan(tmp_path):
    """Memory options per stage, schedule, sequence length and precision are on the page, and the
    plan's JSON there loads back as the same plan."""
    import html
    import json
    import re

    from sailor.plan.spec import Plan
    job = JobSpec(model="opt-350m", global_batch_size=12, sequence_length=1024, precision="bf16")
    d = PLAN.to_dict(with_specs=False) | {
        "schedule": {"kind": "interleaved-1f1b", "virtual_stages": 2},
        "stages": [[0, 5], [5, 10], [10, 18], [18, 26]],
        "memory": [{"recompute": "full", "recompute_blocks": 3, "zero": 1},
                   {"recompute": "selective", "zero": 2, "sequence_parallel": True}]}
    plan = plan_from_dict(d).with_specs(job, CLUSTER)
    est = simulate(plan, make_context(job, CLUSTER))
    write_report(tmp_path, plan, est, CLUSTER, title="rebuild")
    page = (tmp_path / "index.html").read_text()
    text = re.sub(r"<[^>]+>", "|", page)
    for row in ("sequence length (tokens)||1024", "precision||bf16", "optimizer||adam", "global batch (samples)||12",
                "0||[0, 5) + [10, 18)||13||full (first 3 blocks)||1||off",
                "1||[5, 10) + [18, 26)||13||selective||2||on"):
        assert row in text, row
    assert "interleaved 1F1B (v = 2) (kind interleaved-1f1b, virtual stages 2), micro-batch size 1" in text
    assert f"opt-350m ({job.model.model_params() / 1e6:,.1f} M parameters, 24 blocks)" in text
    shown = json.loads(html.unescape(re.search(r"<pre>(.*?)</pre>", page, re.DOTALL).group(1)))
    back = Plan.model_validate({k: v for k, v in shown.items() if k not in ("job", "cluster")})
    assert back.to_dict(with_specs=False) == plan.to_dict(with_specs=False)
    assert shown["job"]["sequence_length"] == 1024 and shown["job"]["precision"] == "bf16"


def overlapping_labels(fig) -> list[tuple[str, str]]:
    """Pairs of visible, non-empty texts of `fig` (tick labels, cell labels, titles, legends...) whose
    boxes, as matplotlib's renderer lays them out, overlap."""
    from matplotlib.text import Text
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip()]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


def _many_group_plan():
    """16 one-replica pipelines over 8 zones in 4 regions on 3 continents and 4 GPU types."""
    zones = ["us-central1-a", "us-central1-b", "us-west1-a", "us-east1-b", "us-east4-a", "europe-west4-a",
             "europe-west4-b", "asia-east1-a"]
    gpus = ["A100-40", "V100-16", "A100-80", "H100-80"]
    cluster = ClusterSpec(zones={z: {g: 8 + 4 * k for k, g in enumerate(gpus)} for z in zones})
    job = JobSpec(model="tiny", global_batch_size=16)
    pipes = [{"microbatches": 1, "replicas": [_rep(0, gpus[k % 4], zones[k % 8], 1 + k % 2)]} for k in range(16)]
    plan = plan_from_dict({"micro_batch_size": 1, "stages": [[0, 6]], "pipelines": pipes}).with_specs(job, cluster)
    return plan, simulate(plan, make_context(job, cluster)), cluster


def test_no_two_labels_of_the_placement_figure_overlap():
    import re

    import matplotlib.pyplot as plt

    from sailor.report.figures import draw_placement
    plan, est, cluster = _many_group_plan()
    assert len({t.zones for t in est.traffic}) >= 6  # many zone pairs: many bar labels
    for p, e, c in ((plan, est, cluster), (PLAN, simulate(PLAN, make_context(JOB, CLUSTER)), CLUSTER)):
        fig = draw_placement(p, e, c)
        try:
            labels = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
            cells = sum(n > 0 for z in c.zones.values() for n in z.values())  # the others show "-"
            assert sum(bool(re.fullmatch(r"\d+ / \d+", t)) for t in labels) == cells
            assert overlapping_labels(fig) == []
        finally:
            plt.close(fig)


def _star_and_front(fig):
    """(star (cost, it/s), vertices of the 'every search' front line) as drawn in the Pareto figure."""
    ax = fig.axes[0]
    line = next(ln for ln in ax.get_lines() if ln.get_label() == "every search: Pareto front")
    star = next(c for c in ax.collections if c.get_label().startswith("chosen plan"))
    return tuple(star.get_offsets()[0]), np.column_stack([line.get_xdata(), line.get_ydata()])


def test_the_chosen_plan_is_a_point_of_the_front_as_drawn(tmp_path):
    import matplotlib.pyplot as plt

    from sailor.report.figures import draw_pareto
    opts = PlanOptions(max_stages=2, top_k=2)
    result = plan_job(make_context(SMALL_JOB, SMALL_CLUSTER), opts)
    comparison = compare_searches(result, lambda: make_context(SMALL_JOB, SMALL_CLUSTER), opts)
    fig = draw_pareto(comparison)
    try:
        star, vertices = _star_and_front(fig)
    finally:
        plt.close(fig)
    assert np.isclose(vertices, star, rtol=1e-9, atol=0).all(axis=1).any()  # the star is a vertex of the line
    assert star == pytest.approx((result.estimate.cost_per_iteration_usd, result.estimate.throughput_iters_per_s))
    assert comparison.chosen_off_front() is None
    write_report(tmp_path, result.plan, result.estimate, SMALL_CLUSTER, title="t", comparison=comparison)
    assert "the chosen plan (the star) is a point of the front" in (tmp_path / "index.html").read_text()


def test_a_star_off_the_front_is_explained_on_the_page(tmp_path):
    from sailor.planner.options import Constraints
    opts = PlanOptions(max_stages=2, top_k=1)
    result = plan_job(make_context(SMALL_JOB, SMALL_CLUSTER), opts)
    t, c = result.estimate.iteration_time_s, result.estimate.cost_per_iteration_usd
    # a closed-form candidate faster and cheaper than the star's event-simulated point
    faster = Comparison(result, opts, (), sorted(result.pareto + [(0.8 * t, 0.99 * c)]))
    note = faster.chosen_off_front()
    assert note.startswith(f"The chosen plan ({1 / t:.3f} it/s at ${c:.4f}) is not on the drawn Pareto front: 1 point")
    assert "closed-form scores of candidates the planner did not choose" in note and "constraints" not in note
    write_report(tmp_path, result.plan, result.estimate, SMALL_CLUSTER, title="t", comparison=faster)
    assert "is not on the drawn Pareto front" in (tmp_path / "index.html").read_text()
    # the same point at a $/hour above the limit the plan was made under: the constraint is the reason
    rate = c / t * 3600
    capped = PlanOptions(max_stages=2, top_k=1, constraints=Constraints(max_cost_per_hour=rate * 1.1))
    note = Comparison(result, capped, (), sorted(result.pareto + [(0.8 * t, 0.99 * c)])).chosen_off_front()
    assert "1 of them break the constraints" in note and "closed-form scores" not in note


def test_no_two_labels_of_the_other_figures_overlap(monkeypatch):
    """The timeline, memory and Pareto figures too, on the many-group plan and on PLAN."""
    import matplotlib.pyplot as plt

    from sailor.report import figures
    monkeypatch.setattr(figures, "_save", lambda fig, base: fig)  # keep the figure open to measure it
    many, many_est, _ = _many_group_plan()
    opts = PlanOptions(max_stages=2, top_k=2)
    result = plan_job(make_context(SMALL_JOB, SMALL_CLUSTER), opts)
    comparison = compare_searches(result, lambda: make_context(SMALL_JOB, SMALL_CLUSTER), opts)
    est = simulate(PLAN, make_context(JOB, CLUSTER))
    for fig in (figures.timeline_figure(many, many_est, None), figures.memory_figure(many_est, None),
                figures.timeline_figure(PLAN, est, None), figures.memory_figure(est, None),
                figures.pareto_figure(comparison, None)):
        try:
            assert overlapping_labels(fig) == []
        finally:
            plt.close(fig)
