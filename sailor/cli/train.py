"""`sailor train PLAN`: run a plan with torch.distributed on this machine (torchrun, one process per rank).

Exit statuses: 0 done, 1 a rank failed, 2 bad input (before any process starts, or a rank refusing its GPU), 3 stopped on
request (SIGTERM/SIGINT or --stop-file) after writing a checkpoint, 130 killed by a second interrupt.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.table import Table

from sailor.cli.app import app
from sailor.cli.common import (CheckpointEveryOpt, DataOpt, InitFromOpt, LogEveryOpt, MetricsOpt, SeedOpt, StepsOpt,
                               TensorboardOpt, TimeoutOpt, require_torch)
from sailor.core.errors import counted


@app.command()
def train(
    plan: str = typer.Argument(..., help="Plan file (JSON/YAML; ours or Sailor's plan_config). GPU type 'cpu' and"
                                         " zone 'local' run on this machine's CPU."),
    job: str = typer.Option(None, "--job", help="Job spec file; default: the job carried by the plan."),
    steps: int | None = StepsOpt,
    checkpoint_dir: str = typer.Option(None, "--checkpoint-dir", help="Folder for checkpoints (step-<n>/ each):"
                                       " every --checkpoint-every steps, at the end and on stop. Default: a new"
                                       " checkpoints/<plan name>-<UTC time>/ beside the plan file."),
    checkpoint_every: int | None = CheckpointEveryOpt,
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest verified checkpoint in"
                                                        " --checkpoint-dir (any plan)."),
    metrics: str = MetricsOpt,
    seed: int = SeedOpt,
    device: str = typer.Option("cpu", "--device", help="cpu (gloo) or cuda (NCCL, bf16 autocast)."),
    data: str = DataOpt,
    init_from: str = InitFromOpt,
    tensorboard: str = TensorboardOpt,
    log_every: int = LogEveryOpt,
    stop_file: str = typer.Option(None, "--stop-file", help="Creating this file stops the run gracefully at the"
                                                            " next step boundary (checkpoint, exit 3)."),
    timeout_s: float = TimeoutOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the rank layout and exit."),
) -> None:
    """Train a plan exactly: tensor, pipeline (its schedule) and data parallelism as the plan says."""
    require_torch("train")
    from sailor.runtime.command import checkpoint_every_for
    from sailor.runtime.launcher import ExitStatus, launch
    from sailor.runtime.prepare import TrainOptions, prepare

    err = Console(stderr=True, soft_wrap=True)  # one message, one line, whatever the terminal width
    chosen_dir = checkpoint_dir is None and not resume
    if chosen_dir:
        checkpoint_dir = default_checkpoint_dir(plan)
    prep = prepare(TrainOptions(plan=plan, job=job, steps=steps, checkpoint_dir=checkpoint_dir,
                                checkpoint_every=checkpoint_every, resume=resume, metrics=metrics, seed=seed,
                                device=device, data=data, stop_file=stop_file, timeout_s=timeout_s,
                                init_from=init_from, tensorboard=tensorboard))
    for note in prep.notes:
        err.print(f"[yellow]{note}[/yellow]" if note.startswith("skipped") else note)
    every = checkpoint_every_for(prep.job, checkpoint_every)
    err.print(f"checkpoints into {checkpoint_dir}: every {every} steps, at the end and on stop (the newest"
              f" {prep.job.recipe.checkpoint.keep} kept)" if every else
              f"checkpoints into {checkpoint_dir}: at the end and on stop", markup=False, highlight=False)
    if dry_run:
        Console().print(_layout_table(prep))
        return
    steps = prep.options.steps  # --steps, or the job's recipe.schedule.total_steps (`command.steps_for`)
    if prep.resume_step >= steps:  # nothing to train: say so instead of starting every rank
        err.print(f"[green]done: the checkpoint is at step {prep.resume_step} (--steps {steps})[/green]")
        return
    result = _run_with_progress(prep, launch, err, log_every)
    if result.status is ExitStatus.DONE:
        err.print(f"[green]{result.message}[/green]")
    elif result.status is ExitStatus.STOPPED:
        err.print(f"[yellow]{result.message}[/yellow]")
    else:
        if result.status is not ExitStatus.BAD_INPUT:  # bad input is the rank's one line alone
            sys.stderr.write(result.stderr_tail[-2000:])
        print(f"error: {result.message}", file=sys.stderr)
        if result.checkpoint is not None:
            again = resume_command(plan, checkpoint_dir, steps, job=job, data=data, metrics=metrics, seed=seed,
                                   device=device, tensorboard=tensorboard, checkpoint_every=checkpoint_every,
                                   timeout_s=timeout_s)
            print(f"to go on from {result.checkpoint}: {again}", file=sys.stderr)
    raise typer.Exit(code=int(result.status))


def resume_command(plan: str, checkpoint_dir: str, steps: int, *, job: str | None, data: str | None,
                   metrics: str | None, seed: int, device: str, tensorboard: str | None,
                   checkpoint_every: int | None, timeout_s: float) -> str:
    """The `sailor train` command that goes on from a failed run's newest checkpoint: the run's own
    options (job, data, metrics, seed, device, ...; a resume with other data would train on it
    silently), with --checkpoint-dir and --resume; --init-from is left out (the checkpoint holds the
    weights). Shell-quoted."""
    import shlex

    args = ["sailor", "train", plan, "--checkpoint-dir", checkpoint_dir, "--resume", "--steps", str(steps)]
    for flag, value, default in (("--job", job, None), ("--data", data, None), ("--metrics", metrics, None),
                                 ("--seed", seed, 0), ("--device", device, "cpu"), ("--tensorboard", tensorboard, None),
                                 ("--checkpoint-every", checkpoint_every, None), ("--timeout-s", timeout_s, 300.0)):
        if value is not None and value != default:  # the defaults as the options declare them
            args += [flag, str(value)]
    return shlex.join(args)


def default_checkpoint_dir(plan: str) -> str:
    """Where `sailor train` checkpoints without --checkpoint-dir: a new folder
    checkpoints/<plan file's stem>-<UTC yyyymmdd-hhmmss> beside the plan file (a new run never meets
    an earlier run's checkpoints; --checkpoint-dir DIR --resume continues one)."""
    import datetime
    from pathlib import Path

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    base = Path(plan).parent / "checkpoints" / f"{Path(plan).stem}-{stamp}"
    path, n = base, 1
    while path.exists():  # two runs started within one second
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return str(path)


def _layout_table(prep) -> Table:
    t = Table(title=f"{counted(prep.plan.world_size, 'rank')}, {prep.job.model.name},"
                    f" global batch {prep.job.global_batch_size}")
    for col in ("rank", "pipeline", "stage", "layers", "tp rank", "gpu", "zone", "microbatches"):
        t.add_column(col)
    for r in prep.ranks:
        a, b = prep.plan.stages[r.stage]
        t.add_row(str(r.rank), str(r.pipeline), str(r.stage), f"[{a}, {b})", f"{r.tp_rank}/{r.tp}", r.gpu, r.zone,
                  str(prep.plan.pipelines[r.pipeline].microbatches))
    return t


def _run_with_progress(prep, launch, console: Console, log_every: int):
    # The progress bar owns the terminal, so the interval lines are printed here, above it, from
    # rank 0's step events (the worker's own --log-every stays 0 under `sailor train`).
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sailor.runtime.metrics import IntervalLog

    columns = [TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn()]
    # drawn on terminals only (`cli.common.progress_bar`): in a pipe or log its frame would come before an error line
    shown = console.is_terminal and sys.stdout is not None and sys.stdout.isatty()
    with Progress(*columns, console=console, disable=not shown) as progress:
        task = progress.add_task("train", total=prep.options.steps, completed=prep.resume_step, info="starting")
        interval = IntervalLog(prep.plan, prep.job, every=log_every, total_steps=prep.options.steps,
                               write=progress.console.print)

        def on_event(ev) -> None:
            if ev["event"] == "step":
                progress.update(task, completed=ev["step"],
                                info=f"loss {ev['loss']:.4f}  {ev['tokens_per_s']:,.0f} tokens/s  MFU {100 * ev['mfu']:.2f} %")
                interval.on_step(ev)
            elif ev["event"] == "checkpoint":
                progress.console.print(f"checkpoint {ev['path']}")

        return launch(prep, on_event=on_event)
