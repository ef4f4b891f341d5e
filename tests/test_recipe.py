"""The training recipe (`sailor.specs.recipe`): the learning-rate schedule against hand-computed values,
the recipe's one-line errors, the optimizer named once, the default sequence length, checkpoint
retention, `sailor launch`'s safer defaults; and on CPU ranks (integration) a warmup + cosine
schedule with weight decay and evaluation on a heterogeneous pipelined plan equal to the
single-process reference, loss, learning rate and eval loss per step, and a killed rank leaving a
default checkpoint that a resumed run continues the reference from.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sailor.core.errors import SailorInputError
from sailor.specs import load_job
from sailor.specs.job import DEFAULT_MAX_SEQUENCE, JobSpec
from sailor.specs.recipe import ScheduleRecipe, learning_rate

LR, MIN = 1e-3, 1e-4


def _lr(n: int, **schedule) -> float:
    return learning_rate(ScheduleRecipe(**schedule), LR, n)


# ---- the schedule ------------------------------------------------------------------------------------
def test_warmup_is_linear_from_lr_over_w_and_ends_at_lr():
    s = {"warmup_steps": 10, "decay": "cosine", "min_lr": MIN, "total_steps": 110}
    assert _lr(1, **s) == pytest.approx(1e-4)
    assert _lr(5, **s) == pytest.approx(5e-4)
    assert _lr(10, **s) == pytest.approx(LR)  # warmup end


def test_cosine_midpoint_quarter_and_end():
    s = {"warmup_steps": 10, "decay": "cosine", "min_lr": MIN, "total_steps": 110}
    assert _lr(60, **s) == pytest.approx((LR + MIN) / 2)  # p = 1/2: cos(pi/2) = 0
    # p = 1/4: 1e-4 + 0.9e-3 * (1 + cos(pi/4)) / 2 = 1e-4 + 0.45e-3 * 1.70710678 = 8.68198052e-4
    assert _lr(35, **s) == pytest.approx(8.68198052e-4)
    assert _lr(110, **s) == pytest.approx(MIN)  # the last step runs at min_lr
    assert _lr(500, **s) == pytest.approx(MIN)


def test_linear_and_constant():
    s = {"warmup_steps": 10, "decay": "linear", "min_lr": MIN, "total_steps": 110}
    assert _lr(35, **s) == pytest.approx(LR - 0.9e-3 * 0.25)  # 7.75e-4
    assert _lr(110, **s) == pytest.approx(MIN)
    assert _lr(1) == LR  # no warmup, constant: every step at lr
    assert _lr(10**6, warmup_steps=3) == LR


def test_wsd_is_stable_then_decays_over_its_fraction():
    s = {"warmup_steps": 10, "decay": "wsd", "min_lr": MIN, "total_steps": 110, "decay_fraction": 0.2}
    assert _lr(90, **s) == pytest.approx(LR)  # p = 0.8: the stable phase ends
    assert _lr(100, **s) == pytest.approx((LR + MIN) / 2)  # halfway through the last 20 steps
    assert _lr(110, **s) == pytest.approx(MIN)


def test_step_numbers_start_at_one():
    with pytest.raises(ValueError, match="start at 1"):
        _lr(0)


# ---- validation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe, line", [
    ({"schedule": {"decay": "cosine"}}, "job.yaml: recipe.schedule.total_steps: a cosine decay needs the run's length"),
    ({"schedule": {"warmup_steps": 10, "decay": "linear", "total_steps": 10}}, "job.yaml: recipe.schedule.warmup_steps:"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "job.yaml: recipe.optimizer.betas.1: must be < 1, got 1"),
    ({"optimizer": {"lr": 0}}, "job.yaml: recipe.optimizer.lr: must be > 0"),
    ({"optimizer": {"name": "lion"}}, "job.yaml: recipe.optimizer.name: Input should be 'adamw' or 'sgd'"),
    ({"optimizer": {"momentum": 0.9}}, "job.yaml: recipe.optimizer.momentum: is an sgd setting"),
    ({"optimizer": {"lr": 1e-4}, "schedule": {"min_lr": 1e-3}}, "job.yaml: recipe.schedule.min_lr: 0.001 is above"),
    ({"schedule": {"total_steps": 12}, "eval": {"data": "held.npy", "every": 100}},
     "job.yaml: recipe.eval.every: 100 is beyond the run's 12 steps"),
    ({"eval": {"every": 5}}, "job.yaml: recipe.eval.data: Field required"),
    ({"checkpoint": {"keep": 0}}, "job.yaml: recipe.checkpoint.keep:"),
    ({"checkpoint": {"evry": 5}}, "job.yaml: recipe.checkpoint.evry:"),
])
def test_recipe_errors_name_file_and_field(tmp_path, monkeypatch, recipe, line):
    monkeypatch.chdir(tmp_path)
    Path("job.yaml").write_text(yaml.safe_dump({"model": "tiny", "global_batch_size": 8, "recipe": recipe}))
    with pytest.raises(SailorInputError) as e:
        load_job("job.yaml")
    assert e.value.one_line().startswith(line), e.value.one_line()


def test_the_optimizer_is_named_once():
    job = {"model": "tiny", "global_batch_size": 8}
    assert JobSpec(**job, recipe={"optimizer": {"name": "sgd"}}).optimizer.value == "sgd"
    assert JobSpec(**job, optimizer="sgd").recipe.optimizer.name == "sgd"
    assert JobSpec(**job).recipe.optimizer.name == "adamw"
    with pytest.raises(SailorInputError, match="optimizer: adam disagrees with recipe.optimizer.name sgd"):
        load_job({**job, "optimizer": "adam", "recipe": {"optimizer": {"name": "sgd"}}})
    # written and read back: the same job; a default recipe is left out of the file
    rich = JobSpec(**job, recipe={"schedule": {"warmup_steps": 2, "decay": "cosine", "total_steps": 9}})
    assert load_job(rich.to_dict()) == rich
    assert "recipe" not in JobSpec(**job, optimizer="sgd").to_dict()


def test_sequence_length_defaults_to_context_up_to_4096():
    assert JobSpec(model="opt-350m", global_batch_size=8).seq == 2048  # its context
    with pytest.warns(UserWarning, match="sequence_length: not set: training llama-3-8b on 4096 tokens"):
        job = JobSpec(model="llama-3-8b", global_batch_size=8)
    assert job.seq == DEFAULT_MAX_SEQUENCE == 4096
    assert job.to_dict()["sequence_length"] == 4096  # the plan files made from it say it


def test_sgd_momentum_counts_its_buffer():
    plain = JobSpec(model="tiny", global_batch_size=8, optimizer="sgd")
    assert plain.state_bytes_per_param == {"weights": 4, "gradients": 4, "optimizer": 0}
    momentum = JobSpec(model="tiny", global_batch_size=8, recipe={"optimizer": {"name": "sgd", "momentum": 0.9}})
    assert momentum.state_bytes_per_param == {"weights": 4, "gradients": 4, "optimizer": 4}
    bf16 = JobSpec(model="tiny", global_batch_size=8, precision="bf16",
                   recipe={"optimizer": {"name": "sgd", "momentum": 0.9}})
    assert bf16.state_bytes_per_param == {"weights": 2, "gradients": 4, "optimizer": 8}  # fp32 master + momentum


def test_prune_keeps_the_newest(tmp_path):
    from sailor.runtime import checkpoint as ckpt

    for step in (2, 4, 6, 8):
        ckpt.step_dir(tmp_path, step).mkdir()
    assert [p.name for p in ckpt.prune(tmp_path, keep=2, upto=8)] == ["step-00000002", "step-00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000008"]
    # a run that went back to step 6 (step 8 failed its checksums) and just wrote step 7 keeps 7, not 8
    ckpt.step_dir(tmp_path, 7).mkdir()
    assert [p.name for p in ckpt.prune(tmp_path, keep=1, upto=7)] == ["step-00000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000007", "step-00000008"]


def test_interval_line_shows_eval_loss_and_lr():
    from sailor.plan import plan_from_dict
    from sailor.runtime.metrics import IntervalLog

    plan = plan_from_dict({"micro_batch_size": 8, "stages": [[0, 6]], "pipelines": [
        {"microbatches": 1, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}]})
    lines: list[str] = []
    log = IntervalLog(plan, JobSpec(model="tiny", global_batch_size=8), every=2, total_steps=4, write=lines.append)
    for step in (1, 2):
        log.on_step({"step": step, "loss": 3.0, "tokens": 512, "step_time_s": 1.0, "lr": 2.5e-4,
                     **({"eval_loss": 3.25} if step == 2 else {})})
    assert lines and lines[0].startswith("step 2/4  loss 3.0000  eval_loss 3.2500  lr 2.50e-04  tokens/s 512")
    log.on_step({"step": 3, "loss": 3.0, "tokens": 512, "step_time_s": 1.0, "lr": 2.5e-4, "eval_loss": 3.125})
    assert lines[1:] == ["step 3/4  eval_loss 3.1250"]  # evaluated between interval lines


# ---- sailor launch's defaults ------------------------------------------------------------------------------
CPU_PLAN = {"micro_batch_size": 2, "stages": [[0, 3], [3, 6]], "job": {"model": "tiny", "global_batch_size": 8},
            "pipelines": [{"microbatches": 4, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1},
                                                           {"stage": 1, "gpu": "cpu", "zone": "local", "tp": 1}]}]}


def _main(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    from sailor.cli import main

    monkeypatch.setattr(sys, "argv", ["sailor", *argv])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def _launch_files(tmp_path: Path, monkeypatch, plan: dict = CPU_PLAN) -> None:
    monkeypatch.chdir(tmp_path)
    Path("plan.json").write_text(json.dumps(plan))


def test_launch_needs_steps_from_the_job_or_the_command(tmp_path, monkeypatch, capsys):
    _launch_files(tmp_path, monkeypatch)
    code, _, err = _main(["launch", "plan.json", "--backend", "torchrun", "--dry-run"], monkeypatch, capsys)
    assert code == 2 and err.strip() == ("error: --steps: not given, and the job's recipe sets no"
                                         " schedule.total_steps (pass --steps N, or set recipe.schedule.total_steps"
                                         " in the job)"), err
    job = {**CPU_PLAN["job"], "recipe": {"schedule": {"total_steps": 7}}}
    _launch_files(tmp_path, monkeypatch, {**CPU_PLAN, "job": job})
    code, out, err = _main(["launch", "plan.json", "--backend", "torchrun", "--dry-run", "--checkpoint-dir", "/ck"],
                           monkeypatch, capsys)
    assert code == 0 and "--steps=7" in out and "--checkpoint-every" not in out, err  # the recipe's interval


def test_launch_without_a_checkpoint_folder_warns_and_max_restarts_needs_one(tmp_path, monkeypatch, capsys):
    _launch_files(tmp_path, monkeypatch)
    code, _, err = _main(["launch", "plan.json", "--backend", "torchrun", "--dry-run", "--steps", "5"],
                         monkeypatch, capsys)
    assert code == 0 and "warning: no --checkpoint-dir: the run writes no checkpoint" in err, err
    # nor is the data copied to the nodes: without --data the ranks would train on built-in text
    assert "warning: no --data: every rank trains on Python's built-in pydoc text" in err, err
    job = {**CPU_PLAN["job"], "recipe": {"eval": {"data": "held.npy", "every": 2}}}
    _launch_files(tmp_path, monkeypatch, {**CPU_PLAN, "job": job})
    code, _, err = _main(["launch", "plan.json", "--backend", "torchrun", "--dry-run", "--steps", "5", "--data",
                          "/d/train.npy"], monkeypatch, capsys)
    assert code == 0 and "no --data" not in err and "recipe.eval.data held.npy is read on the nodes" in err, err
    # starting the nodes: the same notes, said once, before the nodes run (that path ends in typer.Exit,
    # which skips the notes said at the end)
    Path("hosts.yaml").write_text(json.dumps({"groups": [{"zone": "local", "gpu": "cpu",
                                                          "hosts": ["127.0.0.1", "127.0.0.2"]}]}))
    said_before = []

    def fake_launch(plan, opts, hosts) -> int:
        said_before.append(capsys.readouterr().err)
        return 0

    monkeypatch.setattr("sailor.launch.launch", fake_launch)
    code, _, err = _main(["launch", "plan.json", "--backend", "torchrun", "--hosts", "hosts.yaml", "--steps", "5"],
                         monkeypatch, capsys)
    assert code == 0 and len(said_before) == 1, err
    assert "warning: no --data" in said_before[0] and "warning: no --checkpoint-dir" in said_before[0], said_before
    assert "recipe.eval.data held.npy is read on the nodes" in said_before[0] and "warning" not in err, err
    code, _, err = _main(["launch", "plan.json", "--backend", "kubernetes", "--dry-run", "--steps", "5",
                          "--max-restarts", "3"], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: --max-restarts: 3 restarts would each start over from step 0"), err


@pytest.mark.parametrize("host, refused", [("34.1.2.3", True), ("10.0.0.5", False), ("127.0.0.1", False),
                                           ("node-a", False), ("2001:4860::1", True), ("fd00::1", False)])
def test_public_rendezvous_address_is_refused_unless_accepted(tmp_path, monkeypatch, capsys, host, refused):
    _launch_files(tmp_path, monkeypatch)
    Path("h.yaml").write_text(yaml.safe_dump({"groups": [{"zone": "local", "gpu": "cpu", "gpus_per_node": 1,
                                                          "hosts": [host, "10.0.0.9"]}]}))
    argv = ["launch", "plan.json", "--backend", "torchrun", "--hosts", "h.yaml", "--dry-run", "--steps", "5"]
    code, _, err = _main(argv, monkeypatch, capsys)
    if refused:
        assert code == 2 and err.startswith(f"error: h.yaml: groups.0.hosts.0: {host} is a public address"), err
        code, _, err = _main([*argv, "--allow-public-rendezvous"], monkeypatch, capsys)
    assert code == 0, err


# ---- on CPU ranks -------------------------------------------------------------------------------------------
RECIPE = {"optimizer": {"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0},
          "schedule": {"warmup_steps": 2, "decay": "cosine", "min_lr": 3e-4, "total_steps": 6},
          "checkpoint": {"every": 2, "keep": 1}}
STEPS = 6
RTOL = 1e-5


def _held_out(tmp: Path) -> str:
    """A held-out text (byte tokens) unlike the training corpus (Python's pydoc topics)."""
    path = tmp / "held_out.txt"
    path.write_text(Path(__file__).read_text() * 2)
    return str(path)


def _job(tmp: Path) -> dict:
    return {"model": "tiny", "global_batch_size": 8,
            "recipe": {**RECIPE, "eval": {"data": _held_out(tmp), "every": 2, "batches": 2}}}


def _reference(job: dict) -> list[dict]:
    from sailor.runtime.data import load_corpus
    from sailor.runtime.reference import train_reference

    spec = JobSpec(**job)
    log: list[dict] = []
    train_reference(spec, steps=STEPS, seed=0, corpus=load_corpus(), eval_corpus=load_corpus(spec.recipe.eval.data),
                    log=log)
    return log


def _same(rows: list[dict], ref: list[dict]) -> None:
    for r, want in zip(rows, ref, strict=True):
        assert r["step"] == want["step"]
        assert r["loss"] == pytest.approx(want["loss"], rel=RTOL), r["step"]
        assert r["lr"] == want["lr"]  # the one schedule function on both sides
        assert ("eval_loss" in r) == ("eval_loss" in want), r
        if "eval_loss" in want:
            assert r["eval_loss"] == pytest.approx(want["eval_loss"], rel=RTOL), r["step"]


def _cpu(stage: int, tp: int) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


EVAL_PLANS = {
    # pipelined, a TP-2 replica sending to a TP-1 replica (3 ranks)
    "tp2_to_tp1": {"stages": [[0, 3], [3, 6]], "pipelines": [{"microbatches": 4, "replicas": [_cpu(0, 2), _cpu(1, 1)]}]},
    # ZeRO-3 (weights kept from the first gather of a step) over two pipelines with shares 3:1 (2 ranks):
    # the eval's forwards run the rounds of the larger share, so the smaller one joins every gather
    "zero3_kept_shares_3_1": {"stages": [[0, 6]], "memory": [{"zero": 3, "reshard_after_forward": False}],
                              "pipelines": [{"microbatches": 3, "replicas": [_cpu(0, 1)]},
                                            {"microbatches": 1, "replicas": [_cpu(0, 1)]}]},
}


# SGD with momentum and weight decay, warmup then linear decay, on the two-stage plan (2 ranks)
SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "grad_clip": 1.0},
       "schedule": {"warmup_steps": 1, "decay": "linear", "min_lr": 0.005, "total_steps": 6}}


@pytest.mark.integration
@pytest.mark.parametrize("name, recipe", [*((n, {}) for n in EVAL_PLANS), ("two_stages_sgd", SGD)])
def test_schedule_and_eval_on_a_heterogeneous_pipeline_equal_the_reference(tmp_path, name, recipe):
    """Each step's loss and learning rate, and the eval loss every 2 steps, as the single-process
    run has them (AdamW with weight decay, warmup then cosine; or SGD)."""
    from sailor.runtime.launcher import ExitStatus, launch
    from sailor.runtime.prepare import TrainOptions, prepare

    job = _job(tmp_path)
    job["recipe"].update(recipe)
    plan = tmp_path / "plan.json"
    layout = EVAL_PLANS.get(name) or {k: v for k, v in CPU_PLAN.items() if k in ("stages", "pipelines")}
    plan.write_text(json.dumps({"micro_batch_size": 2, **layout, "job": job}))
    metrics = tmp_path / "m.jsonl"
    result = launch(prepare(TrainOptions(plan=str(plan), metrics=str(metrics), timeout_s=60,
                                         checkpoint_dir=str(tmp_path / "ck"))), handle_signals=False)
    assert result.status is ExitStatus.DONE, result.message
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    ref = _reference(job)
    assert [r["lr"] for r in ref] == pytest.approx(
        [0.05, 0.05 - 0.045 / 5, 0.05 - 2 * 0.045 / 5, 0.05 - 3 * 0.045 / 5, 0.05 - 4 * 0.045 / 5, 0.005] if recipe else
        [1.5e-3, 3e-3, 3e-4 + 2.7e-3 * (1 + math.cos(math.pi / 4)) / 2, 1.65e-3,
         3e-4 + 2.7e-3 * (1 + math.cos(3 * math.pi / 4)) / 2, 3e-4])
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 6]
    _same(rows, ref)
    # the steps came from the recipe's total_steps; retention kept the newest checkpoint only
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000006"]


@pytest.mark.integration
def test_killed_rank_leaves_a_default_checkpoint_to_resume_from(tmp_path):
    """`sailor train` without --checkpoint-dir: rank 1 dies at step 5 (1-based); the default folder
    beside the plan holds step 4 (every 2, keep 1), and `--resume` from it finishes the reference's
    curve, learning rate included."""
    job = _job(tmp_path)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({**CPU_PLAN, "job": job}))
    cli = [sys.executable, "-c", "from sailor.cli import main; main()", "train", str(plan), "--timeout-s", "60"]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "SAILOR_FAULT": "1:4"})
    assert r.returncode == 1, r.stderr
    (folder,) = (tmp_path / "checkpoints").iterdir()
    assert folder.name.startswith("plan-") and [p.name for p in folder.iterdir()] == ["step-00000004"]
    assert f"--checkpoint-dir {folder} --resume" in r.stderr, r.stderr
    metrics = tmp_path / "m.jsonl"
    r = subprocess.run([*cli, "--checkpoint-dir", str(folder), "--resume", "--metrics", str(metrics)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    _same(rows, _reference(job)[4:])


def test_the_resume_command_of_a_failed_run_carries_its_options():
    import shlex

    from sailor.cli.train import resume_command

    line = resume_command("my plan.json", "ck", 12, job=None, data="train.npy", metrics="m.jsonl", seed=0,
                          device="cpu", tensorboard=None, checkpoint_every=None, timeout_s=300.0)
    assert shlex.split(line) == ["sailor", "train", "my plan.json", "--checkpoint-dir", "ck", "--resume", "--steps", "12",
                                 "--data", "train.npy", "--metrics", "m.jsonl"]
    line = resume_command("p.json", "ck", 5, job="j.yaml", data=None, metrics=None, seed=3, device="cuda",
                          tensorboard="tb", checkpoint_every=2, timeout_s=60.0)
    assert shlex.split(line)[8:] == ["--job", "j.yaml", "--seed", "3", "--device", "cuda", "--tensorboard", "tb",
                                     "--checkpoint-every", "2", "--timeout-s", "60.0"]


def test_a_checkpoint_refuses_a_resume_under_another_recipe():
    from sailor.runtime import checkpoint as ckpt

    job = JobSpec(model="tiny", global_batch_size=8, recipe={"optimizer": {"lr": 3e-4}})
    manifest = ckpt.run_meta(job, 0)
    ckpt.check_compatible(manifest, ckpt.run_meta(job, 0), source="ck/step-00000004")  # the same recipe
    other = JobSpec(model="tiny", global_batch_size=8, recipe={"optimizer": {"lr": 1e-3}})
    with pytest.raises(SailorInputError) as e:
        ckpt.check_compatible(manifest, ckpt.run_meta(other, 0), source="ck/step-00000004")
    # the one setting that differs, not both recipes whole
    assert e.value.one_line().startswith("ck/step-00000004: the checkpoint was written by a job with"
                                         " recipe.optimizer.lr 0.0003, this run's job has 0.001")
    assert len(e.value.one_line()) < 200
    # a manifest written before the recipe was recorded is compared without it
    old = {**manifest, "job": {k: v for k, v in manifest["job"].items() if k != "recipe"}}
    ckpt.check_compatible(old, ckpt.run_meta(other, 0), source="ck/step-00000004")
