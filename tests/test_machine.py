"""Quick profiles of this machine for local plans: measured once, cached by everything that matters,
written atomically, and used by `sailor plan` on the local provider unless --profiles is given."""

import json
import sys

import pytest

from sailor.runtime import machine
from sailor.runtime.machine import cache_dir, cache_key, cache_path, local_profiles
from sailor.specs.job import JobSpec

JOB = JobSpec(model="tiny", global_batch_size=8)


def _fake_profile(block_s: float) -> dict:
    rows = [{"gpu": "cpu", "tp": 1, "mbs": b, "forward_s": [block_s * b] * 6, "backward_s": [2 * block_s * b] * 6}
            for b in machine.QUICK_MBS]
    return {"schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32",
            "date": "2025-01-01T00:00:00+00:00", "layers": rows, "optimizer": {"cpu": {"seconds_per_param": 1e-9}}}


class Counter:
    def __init__(self, block_s: float = 1e-3):
        self.calls, self.block_s = 0, block_s

    def __call__(self, job, threads):
        self.calls += 1
        return _fake_profile(self.block_s)


def test_measured_once_then_read_from_the_cache(tmp_path):
    measure = Counter()
    prof, note = local_profiles(JOB, folder=tmp_path, measure=measure)
    assert measure.calls == 1 and "measured this machine" in note and str(tmp_path) in note
    assert prof.layer_times(JOB, "cpu", 1, 4)[1, 0] == pytest.approx(4e-3)
    path = cache_path(JOB, folder=tmp_path)
    assert json.loads(path.read_text())["layers"][0]["gpu"] == "cpu"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    prof2, note2 = local_profiles(JOB, folder=tmp_path, measure=measure)
    assert measure.calls == 1 and "from the cache" in note2
    assert prof2.layer_times(JOB, "cpu", 1, 4)[1, 0] == pytest.approx(4e-3)


def test_the_key_holds_what_the_timings_depend_on(tmp_path):
    import torch
    key = cache_key(JOB)
    assert key["torch"] == torch.__version__ and key["threads"] == 1 and key["sequence_length"] == 64
    assert key["precision"] == "fp32" and key["model"]["hidden_size"] == 64 and "cores" in key and key["cpu"]
    measure = Counter()
    local_profiles(JOB, folder=tmp_path, measure=measure)
    local_profiles(JOB, threads=2, folder=tmp_path, measure=measure)  # other threads: measured again
    longer = JobSpec(model="tiny", global_batch_size=8, sequence_length=32)
    assert cache_path(longer, folder=tmp_path) != cache_path(JOB, folder=tmp_path)
    assert measure.calls == 2 and len(list(tmp_path.iterdir())) == 2


def test_a_broken_cache_entry_is_measured_again(tmp_path):
    path = cache_path(JOB, folder=tmp_path)
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
    assert measure.calls == 1 and "measured this machine" in err
    # 8 samples, each block 5 ms x mbs forward and 10 ms x mbs backward: far slower than the roofline
    assert got["estimate"]["iteration_time_s"] > 8 * 6 * 15e-3 / 2 * 0.9
    _, err = plan()
    assert measure.calls == 1 and "from the cache" in err
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_fake_profile(1e-3)))
    got, err = plan("--profiles", str(prof))
    assert measure.calls == 1 and "machine" not in err
    assert got["estimate"]["iteration_time_s"] < 8 * 6 * 15e-3 / 2 * 0.5


@pytest.mark.integration
def test_a_real_quick_profile_loads_and_is_cached(tmp_path):
    prof, note = local_profiles(JOB, folder=tmp_path)
    assert "measured this machine" in note
    assert prof.measured("cpu", 1) and prof.layer_times(JOB, "cpu", 1, 2).shape == (6, 2)
    assert local_profiles(JOB, folder=tmp_path)[1].startswith("profile of this machine from the cache")
