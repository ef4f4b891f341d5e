"""What `sailor train` checks and settles before any process starts: the options a user gives
(`TrainOptions`), `prepare`, which checks plan, job, data and checkpoint against each other and
returns the validated run (`Prepared`) that `runtime.launcher.launch` starts, and the settings every
rank is started with (`worker_settings`, one `command.WorkerSettings` for all ranks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sailor import catalog
from sailor.core.errors import SailorInputError, counted
from sailor.core.fileio import check_distinct_outputs, check_output_path
from sailor.core.limits import max_local_processes
from sailor.model.spec import ModelSpec
from sailor.plan import load_plan
from sailor.plan.placement import RankInfo, rank_layout
from sailor.plan.spec import Plan
from sailor.runtime import checkpoint as ckpt
from sailor.runtime.command import (
    TRAIN_STEPS,
    WorkerSettings,
    check_takes_effect,
    steps_for,
)
from sailor.runtime.data import check_corpus, load_corpus
from sailor.runtime.metrics import check_tensorboard
from sailor.runtime.validate import check_plan_for_job
from sailor.specs import load_job
from sailor.specs.job import JobSpec


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """Everything `sailor train` is asked to do (paths as given by the user)."""

    plan: str
    job: str | None = None
    steps: int | None = None  # None: the job's recipe.schedule.total_steps, else command.TRAIN_STEPS
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # None: the job's recipe.checkpoint.every
    resume: bool = False
    metrics: str | None = None
    seed: int = 0
    device: str = "cpu"
    data: str | None = None
    stop_file: str | None = None
    timeout_s: float = 300.0
    init_from: str | None = None  # Hugging Face model folder whose weights start the run
    tensorboard: str | None = None  # folder for TensorBoard event files
    log_every: int = 0  # rank 0 prints a progress line every N steps on stdout (0: never)


@dataclass(frozen=True)
class Prepared:
    """A validated run: the plan, its job, the rank layout and the checkpoint to resume from."""

    options: TrainOptions
    plan: Plan
    job: JobSpec
    ranks: list[RankInfo]
    resume_from: Path | None
    resume_step: int
    notes: tuple[str, ...]  # things to tell the user (e.g. a checkpoint skipped for its checksum)

    def settings(self, stop_file: str) -> WorkerSettings:
        """What every rank of this run is started with (`worker_settings`), watching `stop_file`."""
        return worker_settings(self.options, resume_from=self.resume_from, stop_file=stop_file)


def prepare(options: TrainOptions, *, local: bool = True) -> Prepared:
    """Check plan, job, data and checkpoint against each other without starting any process.

    `local` False: the ranks run on other hosts (`sailor run --hosts`), so this machine's CUDA
    devices are not counted, and --device cpu may run GPU types there.

    Raises:
        SailorInputError: the plan does not fit the job (layers, global batch, TP not dividing the
            heads), a memory option or precision the runtime cannot execute, no job is given, bad
            steps/device/data, or an incompatible checkpoint.
    """
    if options.steps is None:
        plan = load_plan(options.plan)
        job = load_job(options.job) if options.job else plan.job
        options = dataclasses.replace(options, steps=steps_for(job, None, fallback=TRAIN_STEPS))
    check_train_options(options)
    plan = load_plan(options.plan)
    job = load_job(options.job) if options.job else plan.job
    check_plan_for_job(plan, job, plan.cluster, source=options.plan, job_source=options.job)
    # cpu may name GPU types here: the loop below says which replica is not this machine's CPU.
    catalog.check_device(options.device, (g for _, g in plan.gpu_usage()), what="the plan runs on", cpu_runs_any=True)
    if options.device == "cpu" and job.precision != "fp32":
        raise SailorInputError(f"the runtime trains in fp32 on cpu, the job says {job.precision}",
                               source=options.job or options.plan, field="precision", fix="set precision: fp32")
    if options.device == "cpu" and local:
        # A plan for real GPUs would run every rank of a multi-GPU job on this machine's CPU: refuse.
        # On other hosts (`local` False) --device cpu runs the plan's ranks as gloo processes there,
        # as `sailor launch --device cpu` does (the testbed's device classes stand for GPU types).
        for j, p in enumerate(plan.pipelines):
            for i, r in enumerate(p.replicas):
                if r.gpu != "cpu":
                    raise SailorInputError(f"{r.gpu} in {r.zone} is not this machine's CPU",
                                           source=options.plan, field=f"pipelines.{j}.replicas.{i}.gpu",
                                           fix="plan for provider local (GPU type cpu), use --device cuda on"
                                               " a machine with the plan's GPUs, or `sailor launch` for a cluster")
    if options.device == "cpu" and local and plan.world_size > max_local_processes():
        raise SailorInputError(f"the plan has {plan.world_size} ranks, more processes than this machine can run"
                               f" ({max_local_processes()}, 4 per CPU core)", source=options.plan,
                               fix="plan for fewer local GPUs")
    if options.device == "cuda" and local:
        import torch

        have = torch.cuda.device_count()
        if plan.world_size > have:
            # (a plan of GPU type cpu was refused above, so --device cpu is no way out here)
            where = ("no CUDA device (or this torch is a CPU build)" if have == 0
                     else counted(have, "CUDA device"))
            raise SailorInputError(f"the plan has {counted(plan.world_size, 'rank')} but this machine has {where}",
                                   source=options.plan, fix="run it on a machine with a GPU per rank (a CUDA build of"
                                   " torch, README \"GPU\"), or start it on a cluster with `sailor launch`")
    check_training_data(job, options.data, source=options.job or options.plan)
    notes: list[str] = []
    resume_from, resume_step = None, 0
    held = ckpt.newest_step_dir(options.checkpoint_dir) if options.checkpoint_dir and not options.resume else None
    if held is not None:  # starting from step 0 would replace that run's checkpoints one by one
        raise SailorInputError(f"{options.checkpoint_dir} holds the checkpoints of a run ({held.name});"
                               " this run would replace them", source="--checkpoint-dir",
                               fix="pass --resume to continue that run, or use another folder")
    if options.resume:
        if not options.checkpoint_dir:
            raise SailorInputError("--resume needs --checkpoint-dir", source="--resume")
        found = ckpt.find_latest(options.checkpoint_dir)
        notes += [f"skipped checkpoint: {why}" for why in found.skipped]
        if found.path is None and found.skipped:  # starting over would replace them as it reached their steps
            raise SailorInputError(f"no verified checkpoint in {options.checkpoint_dir} ({'; '.join(found.skipped)})",
                                   source="--resume", fix="move the damaged checkpoints away to start over, or restore them")
        if found.path is None:
            notes.append(f"no checkpoint in {options.checkpoint_dir} yet; starting from step 0")
        else:
            from sailor.runtime.checkpoint_io import check_model_matches_tensors

            check_model_matches_tensors(found.path, found.manifest)  # before comparing that model with the job's
            ckpt.check_compatible(_current_model_fields(found.manifest), ckpt.run_meta(job, options.seed),
                                  source=str(found.path))
            check_resumable(found.path, found.manifest)
            resume_from, resume_step = found.path, int(found.manifest["step"])
            notes.append(f"resuming from {found.path} (step {resume_step})")
    if options.init_from and resume_from is not None:
        notes.append(f"--init-from {options.init_from} not read: the checkpoint holds the weights")
    elif options.init_from:
        from sailor.runtime.hf_weights import check_init_from

        check_init_from(options.init_from, job.model)  # names, shapes and dtypes, before any process starts
    ranks = rank_layout(plan, {r.gpu: plan.world_size for p in plan.pipelines for r in p.replicas})
    return Prepared(options, plan, job, ranks, resume_from, resume_step, tuple(notes))


def check_training_data(job: JobSpec, data: str | None, *, source: str | None) -> None:
    """Raise SailorInputError when the training tokens `data` (`--data`; None: the built-in text) or
    the job's held-out tokens (`check_eval_data`, naming `source`, the job's file) cannot be read or
    do not fit the job's sequence length and vocabulary."""
    check_corpus(load_corpus(data), seq=job.seq, vocab_size=job.model.vocab_size, source=data or "pydoc_data.topics")
    check_eval_data(job, source=source)


def check_eval_data(job: JobSpec, *, source: str | None) -> None:
    """Raise SailorInputError naming `source` (the job's file) and recipe.eval.data when the job's
    held-out tokens cannot be read or do not fit its sequence length and vocabulary."""
    ev = job.recipe.eval
    if ev is None:
        return
    try:
        check_corpus(load_corpus(ev.data), seq=job.seq, vocab_size=job.model.vocab_size, source=ev.data)
    except SailorInputError as e:
        raise SailorInputError(f"{ev.data}: {e.message}", source=source, field="recipe.eval.data", fix=e.fix) from None


def check_resumable(path: Path, manifest: dict[str, Any]) -> None:
    """Raise SailorInputError when a verified checkpoint cannot continue a training run: one taken
    after an optimizer step (`ckpt.optimizer_steps`: fp16's skipped steps took none) that holds the
    weights alone (`keys` ["param"], as a conversion writes), without the Adam moments it needs."""
    if manifest.get("format") == ckpt.FORMAT and ckpt.optimizer_steps(manifest) > 0 and manifest["keys"] == ["param"]:
        raise SailorInputError(f"the checkpoint of step {manifest['step']} holds the weights alone, without the"
                               f" Adam moments ({', '.join(ckpt.OPTIMIZER_KEYS)}) that resuming training needs",
                               source=str(Path(path) / "manifest.json"), field="keys",
                               fix="export it (sailor export) and start a new run from it with --init-from")


def check_train_options(options: TrainOptions) -> None:
    """Raise SailorInputError for options no run can use: a setting the worker refuses
    (`WorkerSettings`: steps, timeout, seed, intervals, empty paths, device), an output path that
    cannot be written (checked before any work), two of them naming one path (`check_distinct_outputs`),
    a stop file that already exists (the run would stop before its first step) or is a folder,
    --checkpoint-every without --checkpoint-dir (`command.check_takes_effect`), or --tensorboard
    without the tensorboard package."""
    check_takes_effect(worker_settings(options))
    if options.stop_file is not None and Path(options.stop_file).exists():
        raise SailorInputError(f"{options.stop_file} exists already, so the run would stop before its first step",
                               source="--stop-file", fix="remove it, or name a file that does not exist yet")
    check_output_path(options.stop_file, "--stop-file")
    check_output_path(options.checkpoint_dir, "--checkpoint-dir", folder=True)
    check_output_path(options.metrics, "--metrics")
    check_output_path(options.tensorboard, "--tensorboard", folder=True)
    check_distinct_outputs({"--checkpoint-dir": options.checkpoint_dir, "--metrics": options.metrics,
                            "--tensorboard": options.tensorboard, "--stop-file": options.stop_file})
    check_tensorboard(options.tensorboard)


def _current_model_fields(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its model spec re-read, so that ModelSpec fields added since it was written
    (with defaults that keep the model the same) do not make it look like another model."""
    try:
        model = ModelSpec.model_validate(manifest.get("model")).model_dump(mode="json")
    except ValueError:
        return manifest  # not a spec we can read: check_compatible reports the difference
    return {**manifest, "model": model}


def worker_settings(options: TrainOptions, *, resume_from: str | Path | None = None,
                    stop_file: str | None = None) -> WorkerSettings:
    """The settings every rank of `options` runs with, resuming from `resume_from`, every path made
    absolute: a run on several hosts needs them to name the same files on every one.

    Raises:
        SailorInputError: a setting WorkerSettings refuses (its docstring).
    """
    o = options
    return WorkerSettings(plan=o.plan, steps=o.steps, job=o.job, seed=o.seed, device=o.device, data=o.data,
                          init_from=o.init_from, checkpoint_dir=o.checkpoint_dir, checkpoint_every=o.checkpoint_every,
                          resume_from=None if resume_from is None else str(resume_from), metrics=o.metrics,
                          log_every=o.log_every, tensorboard=o.tensorboard, stop_file=stop_file,
                          timeout_s=o.timeout_s).absolute()
