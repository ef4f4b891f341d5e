"""`sailor replay`: interval accounting on a hand-made trace, every reference trace under every
policy (skipped when ../shared is absent), and the CLI's JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SAILOR_REF  # noqa: E402

from sailor.elastic.availability import load_trace
from sailor.elastic.replay import Policy, RestartModel, replay
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

TRACES = SAILOR_REF / "traces"
OPT = JobSpec(model="opt-350m", global_batch_size=1024)
# The paper's prices (shared/reference/sailor/README.md), the same in every zone.
GCP = ClusterSpec(provider="gcp", zones={}, prices={"A100-40": 3.673385, "V100-16": 2.859998})
ONE_A100_ZONE = ClusterSpec(provider="gcp", zones={"us-central1-a": {"A100-40": 0}}, prices={"A100-40": 3.673385})
SAILOR = [sys.executable, "-c", "from sailor.cli import main; main()"]


def _events(tmp: Path, *points: tuple[float, int]) -> Path:
    p = tmp / "t.json"
    p.write_text(json.dumps([{"time_s": t, "zone": "us-central1-a", "gpu": "A100-40", "count": n} for t, n in points]))
    return p


def test_interval_accounting_by_hand(tmp_path):
    trace = load_trace(_events(tmp_path, (0, 16), (600, 8), (1200, 8), (1800, 16)), GCP)
    res = replay(OPT, GCP, trace, policy=Policy.STATIC)
    assert [i.start_s for i in res.intervals] == [0, 600, 1800]
    assert res.intervals[-1].end_s == 2400  # last point + the trace's spacing (600 s)
    first, shrunk, grown = res.intervals
    assert not first.switched and first.switch_s == 0 and first.gpus_used <= 16
    # 16 -> 8: the plan lost GPUs, so even `static` re-plans; the switch costs a restart (11.25 s
    # published), the planner's search is not charged
    assert shrunk.switched and shrunk.gpus_used <= 8
    assert shrunk.switch_s == RestartModel().total_s == 11.25 and shrunk.replan_s > 0
    assert shrunk.iterations == pytest.approx((1200 - shrunk.switch_s) / shrunk.iteration_time_s)
    assert shrunk.cost_usd == pytest.approx(shrunk.gpus_used * 3.673385 * 1200 / 3600, rel=1e-6)
    # 8 -> 16: `static` keeps its plan; `sailor` takes the faster one when the gain pays.
    assert not grown.switched and grown.plan == shrunk.plan
    s = replay(OPT, GCP, trace, policy=Policy.SAILOR)
    assert s.intervals[-1].switched and s.intervals[-1].gpus_used > 8
    assert s.iterations > res.iterations
    tot = s.totals()
    assert tot["usd_per_iteration"] == pytest.approx(tot["cost_usd"] / tot["iterations"])
    assert tot["switch_time_s"] == pytest.approx(sum(i.switch_s for i in s.intervals))


def test_a_replay_does_not_depend_on_the_planners_wall_clock(tmp_path, monkeypatch):
    # Two replays of one trace, each with a fresh planner (nothing cached), every search of the second
    # taking 5 s longer (a loaded machine): every interval is the same but for the planner's seconds.
    import dataclasses

    from sailor.elastic.replan import Replanner

    trace = load_trace(_events(tmp_path, (0, 16), (600, 8), (1200, 8), (1800, 16)), GCP)
    first = replay(OPT, GCP, trace, policy=Policy.SAILOR).to_dict()
    search = Replanner.plan

    def slow(self, zones):
        planned = search(self, zones)
        return dataclasses.replace(planned, replan_s=planned.replan_s + 5.0)
    monkeypatch.setattr(Replanner, "plan", slow)
    second = replay(OPT, GCP, trace, policy=Policy.SAILOR).to_dict()
    assert second["totals"]["planning_s"] >= 5.0 * len(trace.snapshots) == 15.0

    def modelled(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in ("replan_s", "planning_s")}
    assert [modelled(i) for i in second["intervals"]] == [modelled(i) for i in first["intervals"]]
    assert modelled(second["totals"]) == modelled(first["totals"])
    assert first["totals"]["switches"] >= 2  # the shrink and the grow were both charged the same


def test_no_gpus_means_no_work_and_no_cost(tmp_path):
    res = replay(OPT, GCP, load_trace(_events(tmp_path, (0, 8), (100, 0), (200, 8)), GCP), policy=Policy.SAILOR)
    idle = res.intervals[1]
    assert idle.plan is None and idle.iterations == 0 and idle.cost_usd == 0
    assert res.intervals[2].switched  # restarting after the gap costs a restart


def _cases():
    if not TRACES.is_dir():
        return [pytest.param(None, None, marks=pytest.mark.skip(reason=f"{TRACES} is absent"))]
    out = []
    for f in sorted(TRACES.iterdir()):
        for pol in Policy:
            out.append(pytest.param(f, pol, id=f"{f.stem}-{pol.value}"))
    return out


@pytest.mark.parametrize("path,policy", _cases())
def test_every_reference_trace(path, policy):
    cluster = ONE_A100_ZONE if path.suffix == ".json" else GCP
    trace = load_trace(path, cluster)
    res = replay(OPT, cluster, trace, policy=policy)
    assert len(res.intervals) == len(trace.snapshots)
    assert res.iterations > 0 and res.cost_usd > 0
    for i, snap in zip(res.intervals, trace.snapshots):
        assert i.start_s == snap.time_s and i.gpus_used <= i.gpus_available
        assert 0 <= i.switch_s <= i.end_s - i.start_s and i.iterations >= 0
    if policy is Policy.STATIC:  # switches only when the running plan lost GPUs
        for prev, cur in zip(res.intervals, res.intervals[1:]):
            if cur.switched:
                assert cur.gpus_available < prev.gpus_used


@pytest.mark.integration
@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/reference/sailor/traces is absent")
def test_cli_json_and_plot(tmp_path, monkeypatch, capsys):
    from test_cli_bad_input import _main

    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": "opt-350m", "global_batch_size": 1024}))
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(GCP.to_dict()))
    png = tmp_path / "r.png"
    p = subprocess.run([*SAILOR, "replay", "--job", str(job), "--cluster", str(cluster), "--availability",
                        str(TRACES / "gpu_trace_scaled.csv"), "--json", "--plot", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["intervals"]) == 3 and out["totals"]["iterations"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a bad option: through sailor.cli.main in this process (the console command is checked above)
    code, _, err = _main(["replay", "--job", str(job), "--cluster", str(cluster), "--availability",
                          str(TRACES / "gpu_trace_scaled.csv"), "--policy", "greedy"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "unknown policy 'greedy'" in err


def test_live_switch_cost_from_the_bytes_written_and_moved():
    """2 data-parallel A100 replicas of the whole model under ZeRO-1 -> one replica: each old rank
    writes its half of the 12 bytes/param state, and the new rank holds (receives, in the model) all
    12 bytes/param over the same-zone link; C_live = fixed + written / storage + transfer time."""
    from sailor.elastic.replan import Replanner
    from sailor.elastic.switch_cost import STATE_BYTES_PER_PARAM, LiveSwitchModel
    from sailor.plan.spec import Plan

    zones = {"us-central1-a": {"A100-40": 2}}
    layers = OPT.model.num_layers

    def plan(pipelines: int) -> Plan:
        return Plan.model_validate({
            "micro_batch_size": 1, "stages": [[0, layers]], "memory": [{"zero": 1}],
            "pipelines": [{"microbatches": 1024 // pipelines, "replicas": [
                {"stage": 0, "gpu": "A100-40", "zone": "us-central1-a", "tp": 1}]}] * pipelines})

    ctx = Replanner(OPT, ONE_A100_ZONE).context(zones)
    params = ctx.stage_params(1, 0, layers)
    assert STATE_BYTES_PER_PARAM == 12 and params > 3e8  # OPT-350m
    model = LiveSwitchModel(fixed_s=0.5, storage_bytes_per_s=2e9)
    moved = ctx.network.transfer_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 12 * params)
    assert moved > 0
    assert model.seconds(ctx, plan(2), plan(1)) == pytest.approx(0.5 + 6 * params / 2e9 + moved)
    # the other way, each new rank holds the whole fp32 weights and half the moments (ZeRO-1)
    half = ctx.network.transfer_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 8 * params)
    assert model.seconds(ctx, plan(1), plan(2)) == pytest.approx(0.5 + 12 * params / 2e9 + half)
    # without the safety checkpoint (periodic checkpoints on, every piece with a living holder)
    kept = LiveSwitchModel(fixed_s=0.5, storage_bytes_per_s=2e9, writes_checkpoint=False)
    assert kept.seconds(ctx, plan(2), plan(1)) == pytest.approx(0.5 + moved)


def test_live_switch_cost_counts_every_chunk_of_an_interleaved_stage():
    """One pipeline of 2 stages x 2 chunks (interleaved; stage 0 holds [0, 5) and [13, 20)) -> one
    stage holding the whole model, ZeRO-0, no checkpoint: the new rank holds 12 bytes of every
    parameter; the other way, the busiest new rank holds 12 bytes of each of its two chunks'."""
    from sailor.elastic.replan import Replanner
    from sailor.elastic.switch_cost import LiveSwitchModel
    from sailor.plan.spec import Plan

    layers = OPT.model.num_layers
    rep = {"gpu": "A100-40", "zone": "us-central1-a", "tp": 1}
    one = Plan.model_validate({"micro_batch_size": 1, "stages": [[0, layers]],
                               "pipelines": [{"microbatches": 1024, "replicas": [rep | {"stage": 0}]}]})
    chunks = [[0, 5], [5, 13], [13, 20], [20, layers]]
    inter = Plan.model_validate({"micro_batch_size": 1, "stages": chunks,
                                 "schedule": {"kind": "interleaved-1f1b", "virtual_stages": 2},
                                 "pipelines": [{"microbatches": 1024, "replicas": [rep | {"stage": i} for i in (0, 1)]}]})
    ctx = Replanner(OPT, ONE_A100_ZONE).context({"us-central1-a": {"A100-40": 2}})
    model = LiveSwitchModel(fixed_s=0.0, writes_checkpoint=False)

    def t(n: float) -> float:
        return ctx.network.transfer_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 12 * n)

    p = [ctx.stage_params(1, a, b) for a, b in chunks]
    assert model.seconds(ctx, inter, one) == pytest.approx(t(ctx.stage_params(1, 0, layers)))
    assert model.seconds(ctx, one, inter) == pytest.approx(t(max(p[0] + p[2], p[1] + p[3])))


def test_live_switches_cost_less_than_restarts_in_a_replay(tmp_path):
    """The hand trace of `test_interval_accounting_by_hand` replayed with the live model: the same
    plans are chosen, each switch costs the live model's seconds (here less than the restart
    model's), so more iterations are done for the same $."""
    from sailor.elastic.switch_cost import LiveSwitchModel

    trace = load_trace(_events(tmp_path, (0, 16), (600, 8), (1200, 8), (1800, 16)), GCP)
    restart = replay(OPT, GCP, trace, policy=Policy.SAILOR)
    live = replay(OPT, GCP, trace, policy=Policy.SAILOR, live=LiveSwitchModel())
    assert [i.plan for i in live.intervals] == [i.plan for i in restart.intervals]
    assert live.switches == restart.switches >= 2
    for i in live.intervals:
        if i.switched:
            assert 0 < i.switch_s < RestartModel().total_s
    assert live.iterations > restart.iterations and live.cost_usd == pytest.approx(restart.cost_usd)


def _replay_cli(tmp_path, monkeypatch, capsys, *options: str) -> tuple[int, str, str]:
    """`sailor replay` in-process on OPT and GCP over the hand trace of `test_interval_accounting_by_hand`:
    (exit status, stdout, stderr)."""
    from sailor.cli import main

    (tmp_path / "job.json").write_text(json.dumps({"model": "opt-350m", "global_batch_size": 1024}))
    (tmp_path / "c.json").write_text(json.dumps(GCP.to_dict()))
    trace = _events(tmp_path, (0, 16), (600, 8), (1200, 8), (1800, 16))
    monkeypatch.setattr(sys, "argv", ["sailor", "replay", "--job", str(tmp_path / "job.json"), "--cluster",
                                      str(tmp_path / "c.json"), "--availability", str(trace), *options])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_replay_prices_the_live_switch_sailor_run_would_make(tmp_path, monkeypatch, capsys):
    """With periodic checkpoints (the job's recipe: every 100 steps, `sailor run`'s default) a live
    switch writes no checkpoint, with --checkpoint-every 0 it does. By hand, from the plans the
    replay chose: C = 1 s + [0] max over old ranks of 12 bytes x its stage's parameters at its TP
    (/D under ZeRO) / 1 GB/s + the same-zone transfer of the most state a new rank holds (fp32
    weights 4 bytes/param, /D under ZeRO-3, Adam moments 8, /D under ZeRO)."""
    from sailor.plan.spec import Plan
    from sailor.simulator import make_context

    runs = {}
    for options in ((), ("--checkpoint-every", "0")):
        code, out, err = _replay_cli(tmp_path, monkeypatch, capsys, "--switch", "live", "--json", *options)
        assert code == 0, err
        runs[options] = json.loads(out)["intervals"]
    periodic, at_switch = runs.values()
    assert [i["plan"] for i in periodic] == [i["plan"] for i in at_switch]
    ctx = make_context(OPT, GCP.with_zones({"us-central1-a": {"A100-40": 16}}))

    def state(plan: Plan, stage: int, tp: int) -> tuple[float, float]:  # (bytes written, bytes held) by one rank
        zero, d = plan.stage_memory(stage).zero, len(plan.pipelines)
        n = sum(ctx.stage_params(tp, a, b) for a, b in plan.stage_chunks(stage))
        return 12 * n / (d if zero else 1), 4 * n / (d if zero >= 3 else 1) + 8 * n / (d if zero else 1)

    switched = 0
    for k in range(1, len(periodic)):
        if not periodic[k]["switched"]:
            continue
        switched += 1
        old, new = Plan.model_validate(periodic[k - 1]["plan"]), Plan.model_validate(periodic[k]["plan"])
        written = max(state(old, r.stage, r.tp)[0] for p in old.pipelines for r in p.replicas)
        held = max(state(new, r.stage, r.tp)[1] for p in new.pipelines for r in p.replicas)
        move = ctx.network.transfer_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", held)
        assert written > 1e9  # OPT-350m: seconds of writing at 1 GB/s
        for run, checkpoint in ((periodic, 0.0), (at_switch, written / 1e9)):
            assert run[k]["switch_s"] == pytest.approx(1.0 + checkpoint + move, rel=1e-9)
    assert switched == 2  # the shrink to 8 and the grow back to 16


def test_checkpoint_every_prices_live_switches_only(tmp_path, monkeypatch, capsys):
    code, _, err = _replay_cli(tmp_path, monkeypatch, capsys, "--checkpoint-every", "0")
    assert code == 2 and err.strip() == ("error: --checkpoint-every: only with --switch live (a restart always writes"
                                         " its checkpoint) (add --switch live, or leave --checkpoint-every out)"), err
