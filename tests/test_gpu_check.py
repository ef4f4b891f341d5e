"""benchmarks/gpu_check.py on a machine without CUDA: exit 2 with one line, nothing else run."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
from benchmark_module import load_benchmark


def _module():
    return load_benchmark("gpu_check")


def test_without_cuda_exits_2_with_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path)])
    assert _module().main() == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "gpu_check: needs a CUDA device\n"
    assert list(tmp_path.iterdir()) == []


def test_the_one_gpu_plan_is_a_valid_plan_that_fits_the_job():
    from sailor.plan import load_plan

    plan = _module().one_gpu_plan("H100-80", {"model": "opt-350m", "global_batch_size": 8, "sequence_length": 512,
                                              "precision": "bf16"}, 2, 4)
    p = load_plan(plan)
    assert p.world_size == 1 and p.stages == ((0, 26),) and p.pipelines[0].microbatches * p.micro_batch_size == 8


def test_the_prediction_is_made_for_every_catalog_gpu_type(tmp_path):
    """Several catalog types have no GCP list price (V100-32, A100-80-PCIe, H100-PCIe, H100-NVL,
    RTX-3090, RTX-2080, Titan-RTX); `sailor simulate` of the plan alone refused them, which left the
    check on such a GPU without its memory prediction."""
    from sailor.catalog.cuda import CAPABILITY

    mod = _module()
    job = {"model": "tiny", "global_batch_size": 8, "precision": "fp16"}
    totals = {}
    for gpu in CAPABILITY:
        plan = tmp_path / f"{gpu}.json"
        plan.write_text(json.dumps(mod.one_gpu_plan(gpu, job, 2, 4)))
        got = mod.predict(gpu, plan)
        assert 0 < got["predicted_without_sync_buffer_bytes"] < got["predicted_bytes"], gpu
        totals[gpu] = got["predicted_bytes"]
    assert set(totals) >= {"V100-32", "H100-NVL", "RTX-3090"}


@pytest.mark.parametrize("argv, words", [
    (["--steps", "0"], "gpu_check: --steps: must be >= 1, got 0"),
    (["--mbs", "-1"], "gpu_check: --mbs: must be >= 1, got -1"),
    (["--model", "opt-350"], None),
    (["--model", "no-such-model"], "gpu_check: --model: "),
    (["--model", "tiny", "--seq", "65"], "gpu_check: --seq: 65 is longer than tiny's context (64)"),
    (["--out", "a-file"], "gpu_check: --out: "),
])
def test_bad_arguments_exit_2_before_cuda_is_asked(monkeypatch, capsys, tmp_path, argv, words):
    """A typo must not spend a GPU session: arguments are checked before anything else."""
    (tmp_path / "a-file").write_text("")
    argv = [str(tmp_path / a) if a == "a-file" else a for a in argv]
    def no_cuda():
        raise AssertionError("CUDA was asked before the arguments were checked")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda if words else (lambda: False))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path), *argv])
    assert _module().main() == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(words or "gpu_check: needs a CUDA device"), err


@pytest.mark.parametrize("bf16, precision", [(True, "bf16"), (False, "fp16")])
def test_the_profile_runs_in_the_precision_training_runs_in(monkeypatch, tmp_path, bf16, precision):
    """Before bf16 (V100, T4) training runs fp16; the profile used to time fp32 there."""
    mod = _module()
    calls = []

    def sailor(*args, timeout_s):
        calls.append(args)
        return subprocess.CompletedProcess(args, 2, "", "error: stand-in\n")

    monkeypatch.setattr(mod, "sailor", sailor)
    from sailor.runtime import profiler
    monkeypatch.setattr(profiler, "device_description", lambda d: "stand-in")
    args = argparse.Namespace(model="tiny", seq=64, mbs=2, bf16=bf16)
    assert mod.profile(args, tmp_path)["error"] == "error: stand-in"
    assert json.loads((tmp_path / "job.json").read_text())["precision"] == precision
    assert calls[0][:2] == ("profile", "--job")


def test_memory_sampler_without_nvidia_smi_records_why(monkeypatch, tmp_path):
    """No nvidia-smi on PATH (some containers): the sampler thread used to die with a traceback on
    stderr; now the peaks say why there are no samples."""
    mod = _module()

    def missing(*a, **k):
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")

    monkeypatch.setattr(mod.subprocess, "run", missing)
    with mod.MemorySampler(tmp_path / "m.jsonl", period_s=0.01) as sampler:
        sampler._thread.join(timeout=5)
    peaks = sampler.peaks()
    assert peaks["samples"] == 0 and peaks["startup_peak_bytes"] is None
    assert peaks["sampler_error"].startswith("FileNotFoundError"), peaks


def test_a_rerun_into_the_same_folder_starts_a_fresh_metrics_file(monkeypatch, tmp_path):
    """`sailor train --metrics` appends; the last run's lines made the sampler count every sample of
    the new run as steady state and report the old run's first loss."""
    mod = _module()
    old = tmp_path / "metrics-fp16.jsonl"
    old.write_text('{"step": 1, "loss": 9.9, "stages": []}\n')
    seen = []

    def sailor(*args, timeout_s):
        seen.append(old.exists())
        old.write_text('{"step": 1, "loss": 5.0, "step_time_s": 1.0, "tokens_per_s": 1.0, "stages": []}\n')
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(mod, "sailor", sailor)
    monkeypatch.setattr(mod, "predict", lambda gpu, plan: {})
    monkeypatch.setattr(mod.MemorySampler, "_run", lambda self: None)
    args = argparse.Namespace(model="tiny", seq=64, mbs=2, microbatches=4, steps=1)
    out = mod.train("H100-80", "fp16", args, tmp_path)
    assert seen == [False] and out["loss_first"] == 5.0, out
