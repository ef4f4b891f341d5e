"""benchmarks/gpu_check.py on a machine without CUDA: exit 2 with one line, nothing else run."""

import importlib.util
import sys
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
