"""Profiles: interpolation in micro-batch size, roofline and scaled estimates (labelled), our format,
the Sailor importer, and errors."""

import json

import numpy as np
import pytest

from sailor import catalog
from sailor.core.errors import SailorInputError
from sailor.model.activations import layer_bytes
from sailor.perf.profile_lookup import Profiles, roofline_profiles, roofline_times
from sailor.perf.profiles import load_profiles, profiles_from_dict
from sailor.specs.job import JobSpec

JOB = JobSpec(model="tiny", global_batch_size=8)


def _table(value: float) -> np.ndarray:
    return np.full((6, 2), value)


def _prof() -> Profiles:
    return Profiles(model="tiny", sequence_length=64, precision="fp32",
                    times={("A100-40", 1): {2: _table(1.0), 4: _table(3.0)}})


def test_interpolates_linearly_between_measured_sizes():
    p = _prof()
    assert p.layer_times(JOB, "A100-40", 1, 3) == pytest.approx(_table(2.0))
    assert p.layer_times(JOB, "A100-40", 1, 4) == pytest.approx(_table(3.0))
    assert p.layer_times(JOB, "A100-40", 1, 1) == pytest.approx(_table(0.5))  # proportional below
    assert p.layer_times(JOB, "A100-40", 1, 8) == pytest.approx(_table(6.0))  # and above
    assert p.estimates_used == set()


def test_roofline_is_labelled_estimated():
    p = _prof()
    got = p.layer_times(JOB, "V100-16", 2, 2)
    assert got == pytest.approx(roofline_times(JOB, "V100-16", 2, 2))
    assert ("V100-16", 2, "roofline") in p.estimates_used


def test_unmeasured_tp_is_scaled_from_nearest_measured_and_labelled():
    p = _prof()
    got = p.layer_times(JOB, "A100-40", 2, 2)
    ratio = np.divide(_table(1.0), roofline_times(JOB, "A100-40", 1, 2))
    assert got == pytest.approx(roofline_times(JOB, "A100-40", 2, 2) * ratio)
    assert ("A100-40", 2, "scaled from TP 1") in p.estimates_used


def test_optimizer_time_measured_or_memory_bound():
    p = _prof()
    p.optimizer_s_per_param["A100-40"] = 2e-9
    assert p.optimizer_time_s(JOB, "A100-40", 1e6) == pytest.approx(2e-3)
    # AdamW in fp32 moves 28 bytes per parameter, at 88 % of the V100's 900 GB/s
    assert p.optimizer_time_s(JOB, "V100-16", 1e6) == pytest.approx(1e6 * 28 / (900e9 * 0.88))
    # mixed precision also writes the half-precision weights: 30 bytes
    bf16 = JobSpec(model="tiny", global_batch_size=8, precision="bf16")
    assert p.optimizer_time_s(bf16, "V100-16", 1e6) == pytest.approx(1e6 * 30 / (900e9 * 0.88))


def test_activation_bytes_measured_scale_with_mbs_else_formula():
    p = _prof()
    p.activation_bytes[1] = np.arange(6, dtype=float)
    assert p.activation_bytes_per_layer(JOB, 1, 3) == pytest.approx(3 * np.arange(6))
    formula = [layer_bytes(JOB.model, i, tp=2, mbs=3, seq=64, elem_bytes=4) for i in range(6)]
    assert p.activation_bytes_per_layer(JOB, 2, 3) == pytest.approx(formula)


def test_check_job_mismatches():
    p = _prof()
    p.check_job(JOB)
    roofline_profiles(JobSpec(model="opt-350m", global_batch_size=1)).check_job(JOB)  # no data: fits any job
    with pytest.raises(SailorInputError, match="profiles are for model 'tiny', the job trains 'opt-350m'"):
        p.check_job(JobSpec(model="opt-350m", global_batch_size=1))
    with pytest.raises(SailorInputError, match="sequence length 64, the job uses 32"):
        p.check_job(JobSpec(model="tiny", global_batch_size=1, sequence_length=32))
    with pytest.raises(SailorInputError, match="taken in fp32, the job trains in bf16"):
        p.check_job(JobSpec(model="tiny", global_batch_size=1, precision="bf16"))


def test_our_format_round_trip(tmp_path):
    p = _prof()
    p.optimizer_s_per_param["A100-40"] = 1e-9
    p.activation_bytes[1] = np.ones(6)
    p.save(tmp_path / "prof.json")
    q = load_profiles(tmp_path / "prof.json", JOB)
    assert q.times.keys() == p.times.keys()
    assert q.layer_times(JOB, "A100-40", 1, 3) == pytest.approx(_table(2.0))
    assert q.optimizer_s_per_param == {"A100-40": 1e-9}
    assert q.activation_bytes[1] == pytest.approx(np.ones(6))


def test_the_runtime_pass_overhead_is_optional_and_kept_by_a_round_trip():
    head = {"schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32",
            "layers": [_row()]}
    # files written before the fixed cost per stage pass was measured: without it, or without any
    # runtime section, every pass pays 0 s (documented default), the per-micro-batch overhead as given
    mb_rows = [{"gpu": "A100-40", "tp": 1, "seconds": 1e-4}]
    old = profiles_from_dict(head | {"runtime": {"microbatch_overhead_s": mb_rows}})
    assert old.pass_overhead_s == {} and old.pass_overhead("A100-40", 1) == (0.0, 0.0)
    assert old.microbatch_overhead("A100-40", 1) == 1e-4 and "pass_overhead_s" not in old.to_dict()["runtime"]
    assert profiles_from_dict(head).pass_overhead("A100-40", 1) == (0.0, 0.0)
    new = profiles_from_dict(head | {"runtime": {"microbatch_overhead_s": [],
                                                 "pass_overhead_s": [{"gpu": "A100-40", "tp": 2, "forward_s": 1e-4,
                                                                      "backward_s": 3e-4}]}})
    assert new.pass_overhead_s == {("A100-40", 2): (1e-4, 3e-4)} and new.pass_overhead("A100-40", 1) == (1e-4, 3e-4)
    assert profiles_from_dict(new.to_dict()).pass_overhead_s == new.pass_overhead_s


@pytest.mark.parametrize("rows, match", [
    ([{"gpu": "A100-40", "tp": 1, "forward_s": 1e-4}], r"runtime\.pass_overhead_s\.0: expected a mapping with gpu, tp and forward_s and backward_s"),
    ([{"gpu": "A100-40", "tp": 1, "forward_s": 1e-4, "backward_s": -1.0}], r"runtime\.pass_overhead_s\.0\.backward_s: must be >= 0"),
    ({"A100-40": 1e-4}, r"runtime: expected a mapping"),
])
def test_bad_pass_overhead_rows(rows, match):
    d = {"schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32", "layers": [_row()],
         "runtime": {"pass_overhead_s": rows}}
    with pytest.raises(SailorInputError, match=match):
        profiles_from_dict(d, "p.json")


def _row(**kw):
    return {"gpu": "A100-40", "tp": 1, "mbs": 1, "forward_s": [1.0] * 6, "backward_s": [2.0] * 6} | kw


@pytest.mark.parametrize("extra, match", [
    ({"layers": [_row(forward_s=[1, 1, 1, 1, 1, -1])]}, r"layers\.0\.forward_s\.5: must be >= 0, got -1"),
    ({"layers": [_row(backward_s=[1.0] * 5)]}, r"layers\.0\.backward_s: expected 6 values"),
    ({"layers": [_row(tp="x")]}, r"layers\.0\.tp: expected a whole number, got 'x'"),
    ({"layers": [_row(mbs=0)]}, r"layers\.0\.mbs: must be a whole number from 1 to 65536, got 0"),
    ({"layers": [_row(gpu="K80")]}, r"layers\.0\.gpu: unknown GPU type 'K80'"),
    ({"layers": [7]}, r"layers\.0: expected a mapping"),
    ({"layers": "none"}, r"layers: expected a list"),
    ({"layers": [_row()], "optimizer": {"A100-40": 3}}, r"optimizer\.A100-40\.seconds_per_param: expected a number"),
    ({"layers": [_row()], "memory": [{"activation_bytes_per_sample": [1] * 6}]}, r"memory\.0: expected a mapping with tp"),
])
def test_bad_profile_fields(extra, match):
    d = {"schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32"} | extra
    with pytest.raises(SailorInputError, match=r"prof\.json: " + match):
        profiles_from_dict(d, "prof.json")


def test_profile_of_an_inline_architecture_loads_for_that_model_only():
    arch = {"name": "gpt-2x64", "num_blocks": 2, "hidden_size": 64, "num_heads": 4, "vocab_size": 128,
            "max_sequence_length": 64}
    job = JobSpec(model=arch, global_batch_size=4)
    row = {"gpu": "cpu", "tp": 1, "mbs": 1, "forward_s": [0.001] * 4, "backward_s": [0.002] * 4}
    prof = profiles_from_dict({"schema": "sailor.profiles/1", "model": "gpt-2x64", "sequence_length": 64,
                               "precision": "fp32", "layers": [row]}, "prof.json")
    prof.check_job(job)
    assert prof.layer_times(job, "cpu", 1, 1)[0, 1] == 0.002
    with pytest.raises(SailorInputError, match=r"prof\.json: model: profiles are for model 'gpt-2x64', the job trains 'tiny'"):
        prof.check_job(JOB, "prof.json")


def test_not_a_profile_file(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"layers": []}))
    with pytest.raises(SailorInputError, match=r"x\.json: schema: not a profile file"):
        load_profiles(tmp_path / "x.json", JOB)


def test_sailor_importer(sailor_ref):
    job = JobSpec(model="opt-350m", global_batch_size=8)
    prof = load_profiles(sailor_ref / "profiles", job)
    raw = json.loads((sailor_ref / "profiles" / "profiles_tmp.json").read_text())["OPT-350"]["GH-96"]["4"]["4"]
    got = prof.layer_times(job, "GH200-96", 4, 4)
    assert got.shape == (26, 2)
    assert got[5].tolist() == [raw["5"][0], raw["5"][1]]  # forward, backward; update_s dropped
    assert prof.measured("A100-40", 1) and not prof.measured("A100-40", 16)
    info = json.loads((sailor_ref / "profiles" / "llm_info.json").read_text())["OPT-350"]["2"]
    assert prof.activation_bytes[2][3] == info["3"]["act_mem_floats"] * 4
    assert prof.precision == "fp32" and prof.sequence_length == 2048
    assert catalog.canonical_gpu("GH-96") in {g for g, _ in prof.times}


def test_sailor_importer_without_the_model(sailor_ref):
    with pytest.raises(SailorInputError, match="holds no profiles for tiny"):
        load_profiles(sailor_ref / "profiles", JOB)


# ---- backward split into input- and weight-gradient passes (issue 16) -------------------------------------
def test_backward_split_estimated_from_flops_and_labelled():
    # tiny block (h = 64, f = 4h, seq 64): matmuls M = 2·s·(3h² + h² + 2hf) = 6·A with the attention
    # core A = 4·s²·h, so W = M out of a backward of 2(M + A): 3/7. Head: half. Embedding: all W.
    p = _prof()
    backward = np.arange(1.0, 7.0)
    split = p.backward_split(JOB, "A100-40", 1, 2, backward)
    assert split[:, 0] + split[:, 1] == pytest.approx(backward)
    assert split[1, 1] / backward[1] == pytest.approx(3 / 7)
    assert split[5, 1] / backward[5] == pytest.approx(0.5)
    assert split[0].tolist() == [0.0, 1.0]
    assert ("A100-40", 1, "backward split from FLOPs") in p.estimates_used and not p.split_measured("A100-40", 1)


def test_measured_backward_split_round_trips_and_is_not_an_estimate(tmp_path):
    row = {"gpu": "A100-40", "tp": 1, "mbs": 2, "forward_s": [1.0] * 6, "backward_s": [2.0] * 6,
           "backward_input_s": [0.5] * 6, "backward_weight_s": [1.6] * 6}
    d = {"schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32", "layers": [row]}
    p = profiles_from_dict(d)
    assert p.split_measured("A100-40", 1)
    got = p.backward_split(JOB, "A100-40", 1, 4, np.zeros(6))  # proportional above the measured size
    assert got[:, 0] == pytest.approx([1.0] * 6) and got[:, 1] == pytest.approx([3.2] * 6)
    assert p.estimates_used == set()
    p.save(tmp_path / "p.json")
    again = json.loads((tmp_path / "p.json").read_text())["layers"][0]
    assert again["backward_input_s"] == [0.5] * 6 and again["backward_weight_s"] == [1.6] * 6
    with pytest.raises(SailorInputError, match=r"layers\.0\.backward_weight_s: expected 6 values"):
        profiles_from_dict(d | {"layers": [row | {"backward_weight_s": [1.0] * 5}]})
