"""Training metrics (sailor.runtime.metrics): MFU by hand, TensorBoard event files read back with
TensorBoard's own reader, the interval line, and a clear error without the tensorboard package."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sailor.plan.spec import Plan
from sailor.runtime.metrics import IntervalLog, StepLog, StepMetrics, model_flop_per_step, peak_flop_per_s
from sailor.specs.job import JobSpec

JOB = JobSpec(model="tiny", global_batch_size=8)  # h 64, f 256, V 256, 4 blocks, sequence 64
PLAN = Plan.model_validate({"micro_batch_size": 2, "stages": [[0, 6]], "pipelines": [
    {"microbatches": 3, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 2}]},
    {"microbatches": 1, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}]})


def test_model_flops_and_peak_by_hand():
    b, s, h, f, V = 8, 64, 64, 256, 256
    block = 2 * b * s * (h * 3 * h + h * h + 2 * h * f) + 4 * b * s * s * h  # QKV, out, MLP; QK^T and AV
    head = 2 * b * s * h * V
    assert model_flop_per_step(JOB) == pytest.approx(3 * (4 * block + head))  # forward + backward (2x)
    assert peak_flop_per_s(PLAN, JOB) == 3 * 192e9  # three cpu ranks at the catalog's fp32 peak


def _events():
    return [{"event": "step", "step": k, "loss": 5.0 - 0.1 * k, "tokens": 512, "step_time_s": 0.5 + 0.1 * k,
             "tokens_per_s": 512 / (0.5 + 0.1 * k), "grad_norm": 1.0} for k in range(1, 5)]


def test_tensorboard_scalars_read_back_with_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = StepMetrics(PLAN, JOB, tensorboard=tmp_path / "tb")
    events = _events()
    for ev in events:
        m.on_step(ev)
    m.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([ev["loss"] for ev in events])
    mfu = [e.value for e in acc.Scalars("train/mfu")]
    want = [model_flop_per_step(JOB) / ev["step_time_s"] / (3 * 192e9) for ev in events]
    assert mfu == pytest.approx(want, rel=1e-6) and [ev["mfu"] for ev in events] == pytest.approx(want)


def test_interval_line_averages_over_the_interval():
    lines = []
    log = IntervalLog(PLAN, JOB, every=2, total_steps=3, write=lines.append)
    for ev in _events()[:3]:
        log.on_step(ev)
    # steps 1-2: 1024 tokens in 0.6 + 0.7 s; step 3 (the last) alone
    flop, peak = model_flop_per_step(JOB), 3 * 192e9
    assert lines == [f"step 2/3  loss 4.8000  tokens/s {1024 / 1.3:,.0f}  MFU {100 * 2 * flop / 1.3 / peak:.2f} %",
                     f"step 3/3  loss 4.7000  tokens/s {512 / 0.8:,.0f}  MFU {100 * flop / 0.8 / peak:.2f} %"]


def test_rank_zeros_step_log_writes_the_metrics_lines_and_the_interval_lines(tmp_path):
    lines, path = [], tmp_path / "runs" / "m.jsonl"  # the folder is made
    log = StepLog(PLAN, JOB, metrics=path, every=2, total_steps=3, write=lines.append)
    events = _events()[:3]
    for ev in events:
        log.on_step(ev)
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    flop, peak = model_flop_per_step(JOB), 3 * 192e9
    assert [r["step"] for r in rows] == [1, 2, 3] and all("event" not in r for r in rows)
    assert [r["mfu"] for r in rows] == pytest.approx([flop / ev["step_time_s"] / peak for ev in events])
    assert all(ev["mfu"] == r["mfu"] for ev, r in zip(events, rows))  # the step event carries it too
    assert [line.split("  ")[0] for line in lines] == ["step 2/3", "step 3/3"]


@pytest.mark.integration
def test_missing_tensorboard_is_one_line(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN.to_dict(with_specs=False) | {"job": JOB.to_dict()}))
    code = "import sys; sys.modules['tensorboard'] = None; from sailor.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, "train", str(plan), "--tensorboard", str(tmp_path / "tb")],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--tensorboard: TensorBoard event files need the tensorboard package" in lines[0]
    assert not (tmp_path / "tb").exists()
