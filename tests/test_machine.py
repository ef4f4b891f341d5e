"""Quick profiles of this machine for local plans: measured once, cached by everything that matters,
written atomically, and used by `sailor plan` on the local provider unless --profiles is given."""

import json
import sys

import pytest

from sailor.runtime import machine
from sailor.runtime.machine import cache_dir, cache_key, cache_path, considered_tps, local_gpus, local_profiles
from sailor.specs.job import JobSpec

JOB = JobSpec(model="tiny", global_batch_size=8)


def _fake_profile(block_s: float, tp: int = 1) -> dict:
    rows = [{"gpu": "cpu", "tp": tp, "mbs": b, "forward_s": [block_s * b] * 6, "backward_s": [2 * block_s * b] * 6}
            for b in machine.QUICK_MBS]
    return {"schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32",
            "date": "2025-01-01T00:00:00+00:00", "layers": rows, "optimizer": {"cpu": {"seconds_per_param": 1e-9}},
            "memory": [{"gpu": "cpu", "tp": tp, "activation_bytes_per_sample": [1000.0 / tp] * 6}],
            "runtime": {"microbatch_overhead_s": [{"gpu": "cpu", "tp": tp, "seconds": 1e-4 * tp}]},
            "settings": {"replicas_at_once": {str(tp): 1}}}


class Counter:
    """A stand-in measurement: blocks of `block_s` x mbs forward at TP 1, `per_tp[tp]` x that at TP tp."""

    def __init__(self, block_s: float = 1e-3, per_tp: dict | None = None):
        self.calls, self.block_s, self.per_tp, self.asked = 0, block_s, per_tp or {}, []

    def __call__(self, job, threads, tp, replicas):
        self.calls += 1
        self.asked.append((tp, replicas))
        return _fake_profile(self.block_s * self.per_tp.get(tp, 1.0), tp)


def test_measured_once_then_read_from_the_cache(tmp_path):
    measure = Counter()
    prof, note = local_profiles(JOB, folder=tmp_path, measure=measure)
    assert measure.calls == 1 and "measured this machine" in note and str(tmp_path) in note
    assert prof.layer_times(JOB, "cpu", 1, 4)[1, 0] == pytest.approx(4e-3)
    path = cache_path(JOB, tp=1, folder=tmp_path)
    assert json.loads(path.read_text())["layers"][0]["gpu"] == "cpu"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    prof2, note2 = local_profiles(JOB, folder=tmp_path, measure=measure)
    assert measure.calls == 1 and "from the cache" in note2
    assert prof2.layer_times(JOB, "cpu", 1, 4)[1, 0] == pytest.approx(4e-3)


def test_the_key_holds_what_the_timings_depend_on(tmp_path):
    import torch
    key = cache_key(JOB)
    assert key["torch"] == torch.__version__ and key["threads"] == 1 and key["sequence_length"] == 64
    assert key["tp"] == 1 and key["replicas"] == 1
    assert key["precision"] == "fp32" and key["model"]["hidden_size"] == 64 and "cores" in key and key["cpu"]
    measure = Counter()
    local_profiles(JOB, folder=tmp_path, measure=measure)
    local_profiles(JOB, threads=2, folder=tmp_path, measure=measure)  # other threads: measured again
    longer = JobSpec(model="tiny", global_batch_size=8, sequence_length=32)
    assert cache_path(longer, folder=tmp_path) != cache_path(JOB, folder=tmp_path)
    assert measure.calls == 2 and len(list(tmp_path.iterdir())) == 2


def test_a_broken_cache_entry_is_measured_again(tmp_path):
    path = cache_path(JOB, tp=1, folder=tmp_path)
    path.write_text("{not json")
    measure = Counter(block_s=2e-3)
    prof, note = local_profiles(JOB, folder=tmp_path, measure=measure)
    assert measure.calls == 1 and "measured" in note
    assert prof.layer_times(JOB, "cpu", 1, 1)[1, 0] == pytest.approx(2e-3)


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SAILOR_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" / "profiles"
    monkeypatch.delenv("SAILOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "sailor" / "profiles"


def test_plan_on_the_local_provider_measures_and_profiles_win(monkeypatch, tmp_path, capsys):
    from sailor.cli import main
    monkeypatch.setenv("SAILOR_CACHE_DIR", str(tmp_path / "cache"))
    measure = Counter(block_s=5e-3)
    monkeypatch.setattr(machine, "_measure", measure)
    (tmp_path / "job.yaml").write_text("model: tiny\nglobal_batch_size: 8\n")
    (tmp_path / "cluster.yaml").write_text("provider: local\nzones: {local: {cpu: 2}}\n")

    def plan(*extra):
        monkeypatch.setattr(sys, "argv", ["sailor", "plan", "--job", str(tmp_path / "job.yaml"),
                                          "--cluster", str(tmp_path / "cluster.yaml"), "--json", *extra])
        with pytest.raises(SystemExit) as e:
            main()
        out = capsys.readouterr()
        assert e.value.code == 0, out.err
        return json.loads(out.out.strip().splitlines()[-1]), out.err

    got, err = plan()
    assert measure.calls == 2 and "measured this machine" in err and "TP 1,2" in err  # both TP degrees of 2 GPUs
    # 8 samples, each block 5 ms x mbs forward and 10 ms x mbs backward: far slower than the roofline
    assert got["estimate"]["iteration_time_s"] > 8 * 6 * 15e-3 / 2 * 0.9
    _, err = plan()
    assert measure.calls == 2 and "from the cache" in err
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_fake_profile(1e-3)))
    got, err = plan("--profiles", str(prof))
    assert measure.calls == 2 and "machine" not in err
    assert got["estimate"]["iteration_time_s"] < 8 * 6 * 15e-3 / 2 * 0.5


def test_every_tp_degree_the_planner_considers_is_measured_with_the_clusters_load(tmp_path):
    from sailor.specs.cluster import ClusterSpec
    local = lambda n: ClusterSpec(provider="local", zones={"local": {"cpu": n}})  # noqa: E731
    # tiny has 4 heads: TP degrees dividing them, up to the GPUs offered (and the node size)
    assert [considered_tps(JOB, local(n)) for n in (1, 2, 3, 4, 8)] == [(1,), (1, 2), (1, 2), (1, 2, 4), (1, 2, 4)]
    assert local_gpus(local(4)) == 4 and local_gpus(ClusterSpec(provider="local", zones={"local": {"cpu": 0}})) == 1
    measure = Counter(per_tp={2: 3.0, 4: 5.0})
    local_profiles(JOB, tps=(1, 2), processes=4, folder=tmp_path, measure=measure)
    prof, note = local_profiles(JOB, tps=(1, 2, 4), processes=4, folder=tmp_path, measure=measure)
    # 4 processes at once for every degree: 4 TP-1 groups, 2 TP-2 groups, 1 TP-4 group; a degree
    # added later is measured alone, the others read from the cache
    assert measure.asked == [(1, 4), (2, 2), (4, 1)] and "at TP 4 (" in note and "4 process(es)" in note
    assert "TP 1,2 from the cache" in note
    for tp, factor in ((1, 1.0), (2, 3.0), (4, 5.0)):
        assert prof.measured("cpu", tp) and prof.includes_tp_comm("cpu", tp) == (tp > 1)
        assert prof.layer_times(JOB, "cpu", tp, 4)[1, 0] == pytest.approx(4e-3 * factor)
        assert prof.microbatch_overhead("cpu", tp) == pytest.approx(1e-4 * tp)
        assert prof.activation_bytes[tp][1] == pytest.approx(1000.0 / tp)
    assert not prof.estimates_used and len(list(tmp_path.iterdir())) == 3  # one cache file per TP degree
    # a cluster with fewer GPUs loads the machine less: measured again (TP 1 as 2 groups, TP 2 as 1)
    local_profiles(JOB, tps=(1, 2), processes=2, folder=tmp_path, measure=measure)
    assert measure.asked[3:] == [(1, 2), (2, 1)]
    _, note = local_profiles(JOB, tps=(1, 2, 4), processes=4, folder=tmp_path, measure=measure)
    assert measure.calls == 5 and "measured this machine" not in note and "TP 1,2,4 from the cache" in note


def test_tp_communication_is_labelled_by_what_was_measured(tmp_path):
    from sailor.plan.spec import Plan
    from sailor.simulator import make_context, simulate
    from sailor.specs.cluster import ClusterSpec
    from sailor.perf.network_files import network_for
    cluster = ClusterSpec(provider="local", zones={"local": {"cpu": 4}})
    plan = Plan.model_validate({"micro_batch_size": 4, "stages": [[0, 6]], "pipelines": [
        {"microbatches": 1, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 2}]},
        {"microbatches": 1, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 4}]}]})

    def est(tps):
        prof, _ = local_profiles(JOB, tps=tps, processes=4, folder=tmp_path, measure=Counter())
        return simulate(plan, make_context(JOB, cluster, prof, network_for(cluster, None)))

    only_tp1 = est((1,))  # TP 2 and 4 scaled from TP 1, which ran no collective: charged on the link
    assert only_tp1.tp_communication == ["cpu TP 2: charged (intra-node link)", "cpu TP 4: charged (intra-node link)"]
    assert {e.split(": ")[1] for e in only_tp1.estimated} >= {"scaled from TP 1"}
    with_tp2 = est((1, 2))
    assert with_tp2.tp_communication == ["cpu TP 2: included (measured)", "cpu TP 4: included (scaled from TP 2)"]
    assert est((1, 2, 4)).tp_communication == ["cpu TP 2: included (measured)", "cpu TP 4: included (measured)"]
    assert not est((1, 2, 4)).estimated or all("TP 2" not in e and "TP 4" not in e for e in est((1, 2, 4)).estimated)


@pytest.mark.integration
def test_a_real_quick_profile_loads_and_is_cached(tmp_path):
    prof, note = local_profiles(JOB, folder=tmp_path)
    assert "measured this machine" in note
    assert prof.measured("cpu", 1) and prof.layer_times(JOB, "cpu", 1, 2).shape == (6, 2)
    assert local_profiles(JOB, folder=tmp_path)[1].startswith("profile of this machine at TP 1 from the cache")


def test_plan_run_and_replay_predict_the_same_step_time_from_one_machine_profile(monkeypatch, tmp_path, capsys):
    """`sailor plan`, `sailor run` and `sailor replay` on the local provider all price plans with the
    machine profile `cli.common.machine_profiles` finds: measured once (here a stand-in, far slower
    than the roofline), then read from the cache by the other two; the same plan gets the same
    predicted iteration time from all three."""
    from sailor.cli import main
    from sailor.elastic import controller
    monkeypatch.setenv("SAILOR_CACHE_DIR", str(tmp_path / "cache"))
    measure = Counter(block_s=5e-3, per_tp={2: 1.5, 4: 1.2})
    monkeypatch.setattr(machine, "_measure", measure)
    for name, text in (("job.yaml", "model: tiny\nglobal_batch_size: 8\n"),
                       ("cluster.yaml", "provider: local\nzones: {local: {cpu: 4}}\n"),
                       ("trace.json", '[{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 4}]')):
        (tmp_path / name).write_text(text)
    files = ["--job", str(tmp_path / "job.yaml"), "--cluster", str(tmp_path / "cluster.yaml")]

    def sailor(*args, code=0):
        monkeypatch.setattr(sys, "argv", ["sailor", *args])
        with pytest.raises(SystemExit) as e:
            main()
        out = capsys.readouterr()
        assert e.value.code == code, out.err
        return out.out, out.err

    out, err = sailor("plan", *files, "--json")
    planned = json.loads(out.strip().splitlines()[-1])
    assert measure.calls == 3 and "measured this machine" in err  # TP 1, 2 and 4
    out, err = sailor("replay", *files, "--availability", str(tmp_path / "trace.json"), "--json")
    replayed = json.loads(out.strip().splitlines()[-1])["intervals"][0]
    assert measure.calls == 3 and "from the cache" in err
    seen = {}

    def fake_run(options):  # what `sailor run` would plan first, without starting a rank
        c = controller.Controller(options)
        seen["planned"] = c.replanner.plan(options.trace.snapshots[0].zones)
        return controller.RunResult(controller.ExitStatus.DONE, "done", steps=0)

    monkeypatch.setattr(controller, "run", fake_run)
    _, err = sailor("run", *files, "--availability", str(tmp_path / "trace.json"), "--steps", "1",
                    "--checkpoint-dir", str(tmp_path / "ck"))
    assert measure.calls == 3 and err.count("from the cache") == 1, err  # said once, before the run
    t = planned["estimate"]["iteration_time_s"]
    assert t > 0.1  # 8 samples x 6 layers x 15 ms per sample on 4 processes: the stand-in, not the roofline
    assert replayed["iteration_time_s"] == pytest.approx(t, rel=1e-9)
    assert seen["planned"].estimate.iteration_time_s == pytest.approx(t, rel=1e-9)
    # and the plan each of them chose, simulated by `sailor simulate` (the same profile again), agrees
    (tmp_path / "replayed.json").write_text(json.dumps(replayed["plan"]))
    out, _ = sailor("simulate", str(tmp_path / "replayed.json"), *files, "--json")
    assert json.loads(out.strip().splitlines()[-1])["iteration_time_s"] == pytest.approx(t, rel=1e-9)


def test_degrees_the_machine_cannot_run_stay_estimated_and_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "max_local_processes", lambda: 2)
    measure = Counter()
    prof, note = local_profiles(JOB, tps=(1, 2, 4), processes=4, folder=tmp_path, measure=measure)
    assert [tp for tp, _ in measure.asked] == [1, 2] and "TP 4 not measured" in note
    assert prof.measured("cpu", 2) and not prof.measured("cpu", 4)
