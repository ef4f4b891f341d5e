"""Elastic library without processes: trace parsing and bad input, the switch rule, crash
deductions, and the re-planning cache."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from sailor.core.errors import SailorInputError
from sailor.elastic.availability import Availability, load_trace
from sailor.elastic.policy import SwitchCosts, decide, lost_gpus
from sailor.elastic.replan import Replanner
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

LOCAL = ClusterSpec(provider="local", zones={"local": {"cpu": 4}})
GCP = ClusterSpec(provider="gcp", zones={})
SAILOR = [sys.executable, "-c", "from sailor.cli import main; main()"]  # the console script, in this venv


def _write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(text)
    return p


def _events(*counts: tuple[float, int]) -> str:
    return json.dumps([{"time_s": t, "zone": "local", "gpu": "cpu", "count": n} for t, n in counts])


def test_json_events_become_snapshots(tmp_path):
    tr = load_trace(_write(tmp_path, "t.json", _events((0, 4), (3, 2), (5, 2), (6, 3))), LOCAL)
    assert [(s.time_s, s.zones) for s in tr.snapshots] == [
        (0.0, {"local": {"cpu": 4}}), (3.0, {"local": {"cpu": 2}}), (6.0, {"local": {"cpu": 3}})]
    assert tr.at(4.9).total() == 2 and tr.at(-1).total() == 0
    assert tr.next_change_after(3.0) == 6.0 and tr.next_change_after(6.0) is None
    assert (tr.last_point_s, tr.spacing_s) == (6.0, 1.0)


def test_csv_with_index_column_and_aliases(tmp_path):
    text = (",Timestamp,A100-40_us-central1-a,V100-16_us-central1-b\n"
            "0,1712574014.5,32,96\n1,1712574137.5,80,0\n")
    tr = load_trace(_write(tmp_path, "t.csv", text), GCP)
    assert [s.time_s for s in tr.snapshots] == [0.0, 123.0]
    assert tr.snapshots[1].zones == {"us-central1-a": {"A100-40": 80}, "us-central1-b": {"V100-16": 0}}


def test_time_gpus_form_maps_onto_the_clusters_one_pair(tmp_path):
    one = ClusterSpec(provider="gcp", zones={"us-central1-a": {"A100-40": 0}})
    tr = load_trace(_write(tmp_path, "a.json", '[{"Time": 0, "GPUs": 4}, {"Time": 63, "GPUs": 3}]'), one)
    assert tr.snapshots[1].zones == {"us-central1-a": {"A100-40": 3}}
    two = ClusterSpec(provider="gcp", zones={"us-central1-a": {"A100-40": 1, "V100-16": 1}})
    with pytest.raises(SailorInputError, match="exactly one zone and GPU type"):
        load_trace(tmp_path / "a.json", two)


@pytest.mark.parametrize("name,text,match", [
    ("t.json", "[{\"time_s\": 0, \"zone\": \"local\"", "invalid JSON at line 1"),
    ("t.json", "[]", "non-empty list"),
    ("t.json", _events((3, 4), (1, 2)), "time goes backwards"),
    ("t.json", _events((0, -1)), "whole number >= 0"),
    ("t.json", '[{"time_s": 0, "zone": "mars", "gpu": "cpu", "count": 1}]', "unknown local zone 'mars'"),
    ("t.json", '[{"time_s": 0, "zone": "local", "gpu": "tpu9", "count": 1}]', "unknown GPU type 'tpu9'"),
    ("t.json", '[{"time_s": 0, "zone": "local", "gpus": "cpu", "count": 1}]', "missing gpu; unknown gpus"),
    ("t.csv", "a,b\n1,2\n", "no Timestamp column"),
    ("t.csv", "Timestamp,cpu_local\n0,1,5\n", "3 fields, the header has 2"),
    ("t.csv", "Timestamp,cpu_local\n0,x\n", "expected a number"),
])
def test_bad_traces_raise_one_clear_error(tmp_path, name, text, match):
    with pytest.raises(SailorInputError, match=match) as e:
        load_trace(_write(tmp_path, name, text), LOCAL)
    assert "\n" not in str(e.value) and name in str(e.value)


A100_LOCAL = ("no list price for GPU type 'A100-40' at provider 'local' in zone 'local' (give one in the cluster spec"
              " under prices)")


@pytest.mark.parametrize("name,text,line", [
    # two counts for one (zone, GPU type) at one time: the second entry, with the first's
    ("t.json", _events((0, 4), (5, 2), (5, 3)),
     "[2]: a second count for cpu in local at 5 s: 3 here, 2 at [1] (give one count per zone and GPU type at"
     " each time)"),
    ("t.csv", "Timestamp,cpu_local\n100,4\n\n100,2\n",
     "line 4.cpu_local: a second count for cpu in local at 0 s: 2 here, 4 at line 2.cpu_local (give one"
     " count per zone and GPU type at each time)"),
    ("t.json", '[{"Time": 0, "GPUs": 4}, {"Time": 0, "GPUs": 3}]',
     "[1]: a second count for cpu in local at 0 s: 3 here, 4 at [0] (give one count per zone and GPU type"
     " at each time)"),
    ("t.csv", "Timestamp,cpu_local,H100-PCIe_local,H100-PCIE_local\n0,4,0,0\n",  # an alias: the same pair
     "header.H100-PCIE_local: a second column for H100-PCIe in local (the first: column 3, 'H100-PCIe_local')"
     " (keep one column per GPU type and zone)"),
    # a (zone, GPU type) offered without a price: the first entry offering it
    ("t.json", json.dumps([{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 4},
                           {"time_s": 0, "zone": "local", "gpu": "A100-40", "count": 0},
                           {"time_s": 7, "zone": "local", "gpu": "A100-40", "count": 2}]),
     f"[2]: offered at 7 s, but {A100_LOCAL}"),
    ("t.csv", "Timestamp,cpu_local,A100-40_local\n10,4,0\n19.5,4,1\n",
     f"line 3.A100-40_local: offered at 9.5 s, but {A100_LOCAL}"),
])
def test_trace_errors_name_the_entry(tmp_path, name, text, line):
    with pytest.raises(SailorInputError) as e:
        load_trace(_write(tmp_path, name, text), LOCAL)
    assert str(e.value) == f"{tmp_path / name}: {line}"


def test_a_pair_never_offered_needs_no_price(tmp_path):
    # A100-40 has no price on provider local; a count of 0 offers nothing, so nothing is priced
    tr = load_trace(_write(tmp_path, "t.csv", "Timestamp,cpu_local,A100-40_local\n0,4,0\n5,2,0\n"), LOCAL)
    assert [s.zones for s in tr.snapshots] == [{"local": {"cpu": 4, "A100-40": 0}}, {"local": {"cpu": 2, "A100-40": 0}}]


def test_missing_trace_file(tmp_path):
    with pytest.raises(SailorInputError, match="no such file"):
        load_trace(tmp_path / "nope.json", LOCAL)


@pytest.mark.integration
def test_cli_bad_trace_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    """`sailor run` through the console command (a process of its own: its whole stderr), `sailor
    replay` through `sailor.cli.main` in this process (the same entry point, one start-up fewer)."""
    from test_cli_bad_input import _main

    job = _write(tmp_path, "job.json", '{"model": "tiny", "global_batch_size": 8}')
    cluster = _write(tmp_path, "c.json", '{"provider": "local", "zones": {"local": {"cpu": 4}}}')
    trace = _write(tmp_path, "t.csv", "Timestamp,A100-40_local\n0,4\n")
    args = ["--job", str(job), "--cluster", str(cluster), "--availability", str(trace)]
    p = subprocess.run([*SAILOR, "run", *args], capture_output=True, text=True, timeout=60)
    replay_code, _, replay_err = _main(["replay", *args], tmp_path, monkeypatch, capsys)
    for code, err in ((p.returncode, p.stderr), (replay_code, replay_err)):
        assert code == 2, err
        lines = err.strip().splitlines()
        assert lines == [f"error: {trace}: line 2.A100-40_local: offered at 0 s, but {A100_LOCAL}"], err


def test_cli_run_on_a_trace_that_never_offers_a_gpu_exits_2(tmp_path, monkeypatch, capsys):
    from test_cli_bad_input import _main

    job = _write(tmp_path, "job.json", '{"model": "tiny", "global_batch_size": 8}')
    cluster = _write(tmp_path, "c.json", '{"provider": "local", "zones": {"local": {"cpu": 4}}}')
    trace = _write(tmp_path, "t.json", '[{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 0}]')
    code, _, err = _main(["run", "--job", str(job), "--cluster", str(cluster), "--availability", str(trace)], tmp_path,
                         monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == [f"error: {trace}: the trace never offers a GPU"
                                                      " (give some zone and GPU type a count above 0)"], err


def test_switch_rule():
    # Lost GPUs: always, whatever the numbers.
    assert decide(lost=True, old_iteration_s=1.0, new_iteration_s=2.0, remaining_iterations=0,
                  switch_cost_s=100).switch
    # R x (o - n) = 100 x (1.0 - 0.8) = 20 s saved against a 10 s switch: switch; against 30 s: keep.
    d = decide(lost=False, old_iteration_s=1.0, new_iteration_s=0.8, remaining_iterations=100, switch_cost_s=10)
    assert d.switch and d.gain_s == pytest.approx(20.0)
    assert not decide(lost=False, old_iteration_s=1.0, new_iteration_s=0.8, remaining_iterations=100,
                      switch_cost_s=30).switch
    # The brief's form: (new thr - old thr) x remaining time > cost x new thr  <=>  R (o - n) > C.
    o, n, R, C = 1.0, 0.8, 100, 19.9
    assert ((1 / n - 1 / o) * R * o > C * (1 / n)) == decide(
        lost=False, old_iteration_s=o, new_iteration_s=n, remaining_iterations=R, switch_cost_s=C).switch
    assert decide(lost=False, old_iteration_s=None, new_iteration_s=1.0, remaining_iterations=1, switch_cost_s=5).switch


def test_switch_costs_are_measured_after_the_first():
    c = SwitchCosts(default_s=11.0)
    assert c.estimate_s() == 11.0
    c.record(6.0)
    c.record(8.0)
    assert c.estimate_s() == 7.0
    assert SwitchCosts(fixed_s=0.0, measured_s=[5.0]).estimate_s() == 0.0


def test_lost_gpus():
    use = Counter({("local", "cpu"): 3})
    assert lost_gpus(use, {"local": {"cpu": 2}}) and not lost_gpus(use, {"local": {"cpu": 3}})


def test_crash_deduction_lasts_until_the_trace_reports_that_pair_again(tmp_path):
    tr = load_trace(_write(tmp_path, "t.json", json.dumps([
        {"time_s": 0, "zone": "us-central1-a", "gpu": "A100-40", "count": 4},
        {"time_s": 0, "zone": "us-central1-b", "gpu": "A100-40", "count": 4},
        {"time_s": 5, "zone": "us-central1-b", "gpu": "A100-40", "count": 2},
        {"time_s": 9, "zone": "us-central1-a", "gpu": "A100-40", "count": 3}])), GCP)
    av = Availability(tr)
    assert av.advance(0.0) and not av.advance(1.0)
    av.lost[("us-central1-a", "A100-40")] += 1
    assert av.zones()["us-central1-a"]["A100-40"] == 3
    av.advance(5.0)  # another pair changed: the crash still counts
    assert av.zones() == {"us-central1-a": {"A100-40": 3}, "us-central1-b": {"A100-40": 2}}
    av.advance(9.0)  # a fresh count for the crashed pair replaces the deduction
    assert av.zones()["us-central1-a"]["A100-40"] == 3 and not av.lost


def test_replanner_cache_is_keyed_on_every_input():
    job = JobSpec(model="tiny", global_batch_size=8)
    rp = Replanner(job, LOCAL)
    a = rp.plan({"local": {"cpu": 4}})
    b = rp.plan({"local": {"cpu": 4}})
    c = rp.plan({"local": {"cpu": 2}})
    assert not a.cached and b.cached and not c.cached
    assert b.plan == a.plan and c.plan.world_size <= 2
    # Same availability, other prices or job: planned again (a fresh Replanner has its own cache).
    other = Replanner(JobSpec(model="tiny", global_batch_size=16), LOCAL)
    assert not other.plan({"local": {"cpu": 4}}).cached
    assert rp.score(a.plan, {"local": {"cpu": 2}}) is None  # a plan on 4 does not fit on 2
    assert rp.score(c.plan, {"local": {"cpu": 4}}) is not None


def test_an_events_file_holding_events_is_not_appended_to_unasked(tmp_path):
    # a second run's events went after the first's, in one file, without a word
    from sailor.elastic.options import RunOptions, check_run

    trace = load_trace(_write(tmp_path, "t.json", _events((0, 2))), LOCAL)
    events = tmp_path / "e.jsonl"
    check_run(RunOptions(job=JobSpec(model="tiny", global_batch_size=8), cluster=LOCAL, trace=trace,
                         events=str(events)))  # no file yet
    events.write_text("")
    opts = RunOptions(job=JobSpec(model="tiny", global_batch_size=8), cluster=LOCAL, trace=trace, events=str(events))
    check_run(opts)  # an empty file holds nothing to mix with
    events.write_text('{"event": "start"}\n')
    with pytest.raises(SailorInputError) as e:
        check_run(opts)
    assert str(e.value) == (f"--events: {events} holds events already (an earlier run's?); this run's would be mixed"
                            " into them (name a new file, or pass --append-events to add this run's after them)")
    check_run(RunOptions(**{**opts.__dict__, "append_events": True}))  # asked for
    with pytest.raises(SailorInputError, match="^--append-events: only with --events"):
        check_run(RunOptions(**{**opts.__dict__, "events": None, "append_events": True}))


def test_the_lines_a_user_watches_take_the_number_of_their_count(capsys):
    # "launch: 1 ranks from step 0" was printed for a one-GPU plan
    from rich.console import Console

    from sailor.cli.elastic import _say

    err = Console(stderr=True, soft_wrap=True)
    for ev in ({"event": "launch", "world_size": 1, "resume_step": 0}, {"event": "rollback", "steps": 1, "to_step": 5},
               {"event": "launch", "world_size": 4, "resume_step": 5}, {"event": "rollback", "steps": 0, "to_step": 5}):
        _say(err, ev)
    assert capsys.readouterr().err.splitlines() == ["launch: 1 rank from step 0", "rolled back 1 step to step 5",
                                                    "launch: 4 ranks from step 5", "rolled back 0 steps to step 5"]


def test_a_trace_offering_a_gpu_type_the_zone_lacks_names_its_entry(tmp_path):
    # the trace's zones replace the cluster's: they are held to the catalog as the cluster's are
    gcp = ClusterSpec(provider="gcp", zones={"us-central1-a": {"A100-40": 1}}, prices={"A100-40": 3.0})
    text = json.dumps([{"time_s": 0, "zone": "us-central1-a", "gpu": "A100-40", "count": 4},
                       {"time_s": 9, "zone": "europe-west1-b", "gpu": "A100-40", "count": 2}])
    with pytest.raises(SailorInputError) as e:
        load_trace(_write(tmp_path, "t.json", text), gcp)
    assert str(e.value).endswith(
        "t.json: [1]: offered at 9 s, but gcp does not offer A100-40 in zone 'europe-west1-b' (it offers H100-80,"
        " H200-141, L4, T4 there) (use a zone that does, e.g. europe-west4-a, asia-northeast1-a, asia-northeast3-a;"
        " or, if yours does, give its price there under prices.europe-west1-b.A100-40)")
    priced = gcp.model_copy(update={"prices": {"A100-40": 3.0, "europe-west1-b": {"A100-40": 3.5}}})
    assert load_trace(tmp_path / "t.json", priced).snapshots[-1].zones["europe-west1-b"] == {"A100-40": 2}
