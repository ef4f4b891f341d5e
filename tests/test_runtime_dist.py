"""The runtime against the single-process reference, on CPU with gloo (torchrun, <= 6 processes each).

For the `tiny` model (global batch 8, micro-batch 2, sequence 64) every plan's loss at each step and
its final parameters must equal the reference's within 1e-5 relative, with every point-to-point tag
forced to 0 as under NCCL (`SAILOR_IGNORE_TAGS=1`); a run saved under one plan and
resumed under another must continue the reference's loss curve; a crashing rank must end the job
fast with a clear message; a stop request must checkpoint and exit 3; nothing may be left running.
Plans with memory options (recomputation, ZeRO-1/2/3, sequence parallelism, with replicas of different
TP and shares 3:1) must do the same, and every rank's held bytes (weights, gradients, optimizer states,
saved activations) must equal the ZeRO rules and `sailor.model.activations.stage_activation_bytes`.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import live_processes

from sailor.model.activations import stage_activation_bytes
from sailor.plan.spec import Plan
from sailor.runtime import checkpoint as ckpt
from sailor.runtime.checkpoint_io import load_tensors
from sailor.runtime.data import load_corpus
from sailor.runtime.groups import IGNORE_TAGS_ENV
from sailor.runtime.launcher import ExitStatus, launch
from sailor.runtime.prepare import TrainOptions, prepare
from sailor.runtime.reference import train_reference
from sailor.specs.job import JobSpec

JOB = {"model": "tiny", "global_batch_size": 8}
STEPS = 5
RTOL = 1e-5


def _rep(stage: int, tp: int) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


PLANS = {
    "a_two_stages": {"stages": [[0, 3], [3, 6]], "pipelines": [{"microbatches": 4, "replicas": [_rep(0, 1), _rep(1, 1)]}]},
    "b_tp1_tp2_shares_3_1": {"stages": [[0, 6]], "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 1)]},
                                                               {"microbatches": 1, "replicas": [_rep(0, 2)]}]},
    "c_mixed_tp_two_stages": {"stages": [[0, 3], [3, 6]],
                              "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 2), _rep(1, 1)]},
                                            {"microbatches": 1, "replicas": [_rep(0, 1), _rep(1, 2)]}]},
    # sequence parallelism on both sides of a boundary: each rank sends and receives its slice of the
    # sequence, and neither replica gathers there
    "d_sp_tp2_to_sp_tp2": {"stages": [[0, 3], [3, 6]], "memory": [{"sequence_parallel": True}] * 2,
                           "pipelines": [{"microbatches": 4, "replicas": [_rep(0, 2), _rep(1, 2)]}]},
}


# Several memory options per plan, so few launches cover them: stage by stage, replicas of TP 1 and 2
# (A), shares 3:1 (rounds without a micro-batch under ZeRO-2/3), sequence parallelism (C).
MEMORY_PLANS = {
    "A_zero3_full1_zero1_selective": {
        "stages": [[0, 3], [3, 6]],
        "memory": [{"recompute": "full", "recompute_blocks": 1, "zero": 3}, {"recompute": "selective", "zero": 1}],
        "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 2), _rep(1, 1)]},
                      {"microbatches": 1, "replicas": [_rep(0, 1), _rep(1, 2)]}]},
    "C_sp_zero2_selective_zero3_full": {
        "stages": [[0, 3], [3, 6]],
        "memory": [{"recompute": "selective", "zero": 2, "sequence_parallel": True},
                   {"recompute": "full", "zero": 3, "reshard_after_forward": False}],
        "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 2), _rep(1, 1)]},
                      {"microbatches": 1, "replicas": [_rep(0, 2), _rep(1, 1)]}]},
}


def write_plan(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({"micro_batch_size": 2, **{**PLANS, **MEMORY_PLANS}[name], "job": JOB}))
    return str(path)


@pytest.fixture(scope="module")
def reference():
    losses, model = train_reference(JobSpec(**JOB), steps=STEPS, seed=0, corpus=load_corpus())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _run(tmp: Path, plan: str, **kw) -> tuple:
    metrics = tmp / f"metrics-{Path(plan).stem}-{time.monotonic_ns()}.jsonl"
    opts = TrainOptions(plan=plan, metrics=str(metrics), timeout_s=60, **kw)
    result = launch(prepare(opts), handle_signals=False)
    assert result.status is ExitStatus.DONE, result.message + str(result.events)
    return result, [json.loads(line) for line in metrics.read_text().splitlines()]


def _leftovers(marker: str) -> list[str]:
    """Command lines of live processes mentioning `marker` (a test's temporary folder)."""
    return [cmd for _, cmd in live_processes(marker)]


@pytest.mark.integration
@pytest.mark.parametrize("name", list(PLANS))
def test_plan_equals_single_process_run(name, tmp_path, reference, monkeypatch):
    monkeypatch.setenv(IGNORE_TAGS_ENV, "1")
    ref_losses, ref_params = reference
    result, rows = _run(tmp_path, write_plan(tmp_path, name), steps=STEPS, checkpoint_dir=str(tmp_path / "ck"))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r, want in zip(rows, ref_losses):
        assert r["loss"] == pytest.approx(want, rel=RTOL)
        assert r["samples"] == 8 and r["tokens"] == 8 * 64 and r["step_time_s"] > 0
        assert len(r["stages"]) == len(PLANS[name]["stages"])
        # scatter-gather boundaries: each of the 4 micro-batches' activations (2 x 64 x 64 fp32) crosses
        # once forward and once back, whatever the TP degrees on either side (plan c: 2 -> 1, 1 -> 2)
        sent = [(s["sent_activation_bytes"], s["sent_gradient_bytes"]) for s in r["stages"]]
        assert sent == ([(4 * 32768, 0), (0, 4 * 32768)] if len(sent) == 2 else [(0, 0)])
        assert all(0.0 <= st["sync_exposed_s"] < r["step_time_s"] for st in r["stages"])
    found = ckpt.find_latest(tmp_path / "ck")
    assert found.manifest["step"] == STEPS
    got = load_tensors(found.path, found.manifest, list(ref_params))
    for n, want in ref_params.items():
        torch.testing.assert_close(got[n]["param"], want, rtol=RTOL, atol=RTOL, msg=n)
    assert not _leftovers(str(tmp_path))


@pytest.mark.integration
def test_save_under_c_resume_under_a(tmp_path, reference):
    ref_losses, _ = reference
    ck = str(tmp_path / "ck")
    _run(tmp_path, write_plan(tmp_path, "c_mixed_tp_two_stages"), steps=3, checkpoint_dir=ck)
    prep = prepare(TrainOptions(plan=write_plan(tmp_path, "a_two_stages"), steps=STEPS, checkpoint_dir=ck,
                                resume=True))
    assert prep.resume_step == 3
    _, rows = _run(tmp_path, write_plan(tmp_path, "a_two_stages"), steps=STEPS, checkpoint_dir=ck, resume=True)
    assert [r["step"] for r in rows] == [4, 5]  # no step skipped or repeated
    for r, want in zip(rows, ref_losses[3:]):
        assert r["loss"] == pytest.approx(want, rel=RTOL)
    # Asked for fewer steps than the checkpoint holds: nothing is started, and the message says why.
    r = subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", "train",
                        write_plan(tmp_path, "a_two_stages"), "--steps", "2", "--resume", "--checkpoint-dir", ck],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"done: the checkpoint is at step {STEPS} (--steps 2)" in r.stderr, r.stderr


def _expected_held_bytes(plan: Plan, stage: int, tp: int) -> dict[str, int]:
    """fp32 weights, gradients and Adam states one rank of TP degree `tp` holds in `stage`, from the
    model's parameter counts and the ZeRO rules: ZeRO >= 1 shards the optimizer states, >= 2 the
    gradients, 3 the weights, each among the holders of a block (one rank per pipeline; every rank of
    the stage for replicated parameters; the whole stage when no replica shards), padded per layer."""
    spec, mem = JobSpec(**JOB).model, plan.stage_memory(stage)
    tps = [p.replicas[stage].tp for p in plan.pipelines]
    blocks, pipes, holders = math.lcm(*tps), len(tps), sum(tps)
    held = own = padded = 0  # padded: the ZeRO-1 gradient buffers, each bucket padded to its holders
    for layer in range(*plan.stages[stage]):
        whole, half = spec.params(layer, 1), spec.params(layer, 2)
        sharded, replicated = 2 * (whole - half), whole - 2 * (whole - half)  # TP-split / replicated counts
        held += sharded // tp + replicated
        if blocks == 1:
            own += math.ceil(whole / holders)
            padded += math.ceil(whole / holders) * holders
        else:
            own += blocks // tp * math.ceil(sharded // blocks / pipes) + math.ceil(replicated / holders)
            padded += (blocks // tp * math.ceil(sharded // blocks / pipes) * pipes
                       + math.ceil(replicated / holders) * holders)
    own = own if mem.zero else held
    grads = {0: held, 1: padded}.get(mem.zero, own)
    return {"params": 4 * (own if mem.zero == 3 else held), "grads": 4 * grads, "optimizer": 8 * own}


def _check_memory(result, plan_path: str, world: int) -> None:
    plan = Plan.model_validate_json(Path(plan_path).read_text())
    events = [e for e in result.events if e["event"] == "memory"]
    assert sorted(e["rank"] for e in events) == list(range(world))
    for e in events:
        i = e["stage"]
        want = _expected_held_bytes(plan, i, e["tp"])
        assert {k: e[k] for k in want} == want, e
        acts = stage_activation_bytes(JobSpec(**JOB).model, plan.stages[i], plan.stage_memory(i), mbs=2, seq=64,
                                      tp=e["tp"], elem_bytes=4)
        assert {int(k): v for k, v in e["activations"].items()} == acts, e


@pytest.mark.integration
def test_memory_options_equal_reference_and_checkpoints_cross_zero_stages(tmp_path, monkeypatch):
    """A (ZeRO-3 / ZeRO-1, recomputation) steps 1-3 -> checkpoint -> B unsharded (ZeRO-0) steps 4-5 ->
    checkpoint -> C (sequence parallelism, ZeRO-2 / ZeRO-3) steps 6-7: the reference's loss at every
    step, its parameters at the end."""
    monkeypatch.setenv(IGNORE_TAGS_ENV, "1")
    steps = 7
    ref_losses, model = train_reference(JobSpec(**JOB), steps=steps, seed=0, corpus=load_corpus())
    ck = str(tmp_path / "ck")
    legs = [("A_zero3_full1_zero1_selective", 3), ("b_tp1_tp2_shares_3_1", 5), ("C_sp_zero2_selective_zero3_full", 7)]
    done = 0
    for name, until in legs:
        plan = write_plan(tmp_path, name)
        result, rows = _run(tmp_path, plan, steps=until, checkpoint_dir=ck, resume=done > 0)
        assert [r["step"] for r in rows] == list(range(done + 1, until + 1))  # no step skipped or repeated
        for r in rows:
            assert r["loss"] == pytest.approx(ref_losses[r["step"] - 1], rel=RTOL), (name, r["step"])
        if name in MEMORY_PLANS:
            _check_memory(result, plan, world=6)
        done = until
    found = ckpt.find_latest(ck)
    assert found.manifest["step"] == steps
    got = load_tensors(found.path, found.manifest, [n for n, _ in model.named_parameters()])
    for n, want in model.named_parameters():
        torch.testing.assert_close(got[n]["param"], want.detach(), rtol=RTOL, atol=RTOL, msg=n)
    assert not _leftovers(str(tmp_path))


TIMEOUT_S = 120  # the ranks' collective timeout in the crash test


@pytest.mark.integration
def test_crashing_rank_ends_the_job_fast_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SAILOR_FAULT", "1:2")  # rank 1 dies at step 2 (0-based)
    plan = write_plan(tmp_path, "a_two_stages")
    t0 = time.monotonic()
    result = launch(prepare(TrainOptions(plan=plan, steps=50, timeout_s=TIMEOUT_S)), handle_signals=False)
    elapsed = time.monotonic() - t0
    assert result.status is ExitStatus.FAILED
    assert "rank 1 exited with status 13" in result.message
    assert result.last_step == 2
    # The survivor is ended by the launcher when rank 1 dies, not by its collective timeout: the whole
    # job, start-up included, is over before one timeout could have passed.
    assert elapsed < TIMEOUT_S, elapsed
    assert not _leftovers(str(tmp_path))


@pytest.mark.integration
def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint(tmp_path):
    plan = write_plan(tmp_path, "a_two_stages")
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", "from sailor.cli import main; main()", "train", plan,
                             "--steps", "100000", "--metrics", str(metrics), "--checkpoint-dir", str(ck)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == ExitStatus.STOPPED, err
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    found = ckpt.find_latest(ck)
    assert found.manifest["step"] == last  # the checkpoint holds exactly the steps reported
    assert "stopped on request" in err
    assert not _leftovers(str(tmp_path))


@pytest.mark.parametrize("change, message", [
    (lambda d: d["pipelines"][0]["replicas"][0].update(tp=3), "TP 3 does not divide the 4 attention heads"),
    (lambda d: d["pipelines"][0].update(microbatches=2), "micro_batch_size 2 x microbatches [2, 1] = 6 samples"),
    (lambda d: d.update(stages=[[0, 3], [3, 7]]), "stages cover layers [0, 7) but tiny has 6 layers"),
    (lambda d: d.update(cluster={"provider": "local", "zones": {"local": {"cpu": 4}}}),
     "the plan uses 6 cpu in local but the cluster has 4"),
    (lambda d: d.update(memory=[{"sequence_parallel": True}, {}]), "memory.0.sequence_parallel: sequence parallelism"
     " needs TP > 1, but replica 0 of pipeline 1 has TP 1"),
    (lambda d: d.update(stages=[[0, 1], [1, 6]], memory=[{"recompute": "full"}, {}]),
     "memory.0.recompute: stage 0 [0, 1) holds no transformer block"),
])
def test_bad_plan_exits_2_with_one_line_before_any_process(change, message, tmp_path, monkeypatch, capsys):
    d = {"micro_batch_size": 2, **json.loads(json.dumps(PLANS["c_mixed_tp_two_stages"])), "job": JOB}
    change(d)
    plan = tmp_path / "bad.json"
    plan.write_text(json.dumps(d))

    def no_process(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(sys, "argv", ["sailor", "train", str(plan), "--steps", "2"])
    from sailor.cli import main
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


@pytest.mark.integration
def test_killing_the_launcher_leaves_no_process(tmp_path):
    plan = write_plan(tmp_path, "b_tp1_tp2_shares_3_1")
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", "from sailor.cli import main; main()", "train", plan,
                             "--steps", "100000", "--metrics", str(metrics)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (metrics.exists() and metrics.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        assert len(_leftovers(str(tmp_path))) >= 4  # launcher, torchrun and 3 ranks are running
    finally:
        proc.kill()  # SIGKILL: the launcher cannot clean up; the kernel's parent-death signals do
        proc.wait()
    deadline = time.monotonic() + 15
    while _leftovers(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _leftovers(str(tmp_path))
