"""Options and input loading shared by several commands (defined once, with units in their help)."""

from __future__ import annotations

import functools
import sys

import typer

from sailor.api import choice, resolve_models, resolve_specs  # noqa: F401  (shared by the commands)
from sailor.core.schema import Checks
from sailor.model.spec import Recompute
from sailor.plan.spec import Plan

JobOpt = typer.Option(None, "--job", help="Job spec (YAML/JSON): model, global_batch_size, precision, optimizer.")
ClusterOpt = typer.Option(None, "--cluster", help="Cluster spec (YAML/JSON): GPUs available per zone and type, prices.")
# exists=True: a missing path is refused while the options are read, naming --profiles (the loader's
# "no such file" would name only the path, after the job and cluster were read).
ProfilesOpt = typer.Option(None, "--profiles", exists=True, help="Profile file (ours) or a folder with Sailor's profiles_tmp.json"
                           " and llm_info.json. Default: roofline estimates from the GPU catalog.")
NetworkOpt = typer.Option(None, "--network", help="Link file (ours) or a Sailor network folder. Default: catalog links.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of tables.")
# Said by every output option: a path such as runs/exp3/plan.json works without a `mkdir -p` first
# (`core.fileio.check_output_path` refuses a parent that is a file or cannot be written, before any work).
MAKES_FOLDERS = " Missing folders on its path are created."

# What every rank trains with (`sailor train`, `sailor run`, `sailor launch`; the worker's settings,
# `sailor.runtime.command.WorkerSettings`).
StepsOpt = typer.Option(None, "--steps", help="Train until this many optimizer steps in total (a resumed run"
                        " counts the checkpoint's steps), e.g. 100. Default: the job's recipe.schedule.total_steps"
                        " (train: else 10; launch: else required).")
SeedOpt = typer.Option(0, "--seed", min=0, help="Seed of initial weights and data order.")
DataOpt = typer.Option(None, "--data", help="Token file (.bin as nanoGPT/Megatron write them, .npy; see `sailor data"
                       " prepare`), or a text file or folder of files as byte tokens; default: Python's own pydoc"
                       " topics as bytes.")
InitFromOpt = typer.Option(None, "--init-from", help="Hugging Face model folder (config.json + safetensors) to start"
                           " from; each rank reads only its own shard.")
CheckpointEveryOpt = typer.Option(None, "--checkpoint-every", min=0, help="Checkpoint every N steps (0: only at the end"
                                  " and on a stop). Default: the job's recipe.checkpoint.every (100 unless set).")
METRICS_HELP = "Append one JSON line per step to this file (.jsonl), written by rank 0." + MAKES_FOLDERS
MetricsOpt = typer.Option(None, "--metrics", help=METRICS_HELP)
LogEveryOpt = typer.Option(10, "--log-every", min=0, help="Print loss, tokens/s and MFU every N steps (0: never).")
TensorboardOpt = typer.Option(None, "--tensorboard", help="Also write TensorBoard event files into this folder (needs"
                              " the tensorboard package).")
TimeoutOpt = typer.Option(300.0, "--timeout-s", help="Seconds any collective or transfer may wait before the job fails.")


def job_label(job) -> str:
    """What a plan or simulation is for, in the words of its outputs: model, parameter count (as
    Hugging Face counts them, `ModelSpec.model_params`), global batch and sequence length, e.g.
    "opt-350m (331.2M parameters), global batch 1024, sequence 2048"."""
    n = job.model.model_params()
    count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"
    return f"{job.model.name} ({count} parameters), global batch {job.global_batch_size}, sequence {job.seq}"


def console():
    """A rich Console on stdout; 160 columns wide when output is not a terminal (pipes, CI logs). A
    reader that leaves (`sailor plan | head -1`) raises BrokenPipeError, which `sailor.cli.main` ends
    quietly with status 0 (rich's own Console would exit with status 1)."""
    return _pipe_console()(width=None if sys.stdout is not None and sys.stdout.isatty() else 160)


@functools.cache
def _pipe_console() -> type:
    """rich's Console, but a write into a closed pipe raises BrokenPipeError instead of exiting 1."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:  # rich's documented hook
            self.quiet = True
            # no errno: typer's own EPIPE handler (exit status 1) lets it through to `sailor.cli.main`
            raise BrokenPipeError("the reader of standard output has gone")
    return PipeConsole


def pipe_safe_help() -> None:
    """Give the consoles typer draws help (`sailor --help`, `sailor plan --help`) with the same
    broken-pipe ending as `console()`, so `sailor --help | head -1` ends quietly with status 0 as
    `sailor plan | head -1` does (rich's own Console exits with status 1). Idempotent.

    typer makes those consoles in `typer.rich_utils._get_rich_console` (typer >= 0.12); without it
    (a typer that draws help otherwise) this does nothing.
    """
    import types

    try:
        from typer import rich_utils
    except ImportError:  # typer without rich: click prints help, and a BrokenPipeError reaches main
        return
    make = getattr(rich_utils, "_get_rich_console", None)
    if make is None or getattr(make, "sailor_pipe_safe", False):
        return

    def make_pipe_safe(stderr: bool = False):
        c = make(stderr=stderr)
        c.on_broken_pipe = types.MethodType(_pipe_console().on_broken_pipe, c)
        return c

    make_pipe_safe.sailor_pipe_safe = True  # type: ignore[attr-defined]
    rich_utils._get_rich_console = make_pipe_safe


def progress_bar(*columns, transient: bool = True):
    """A rich Progress with `columns`, drawn on stderr, and only when both stdout and stderr are
    terminals: a bar written into a pipe, a file or a CI log is frames of escape codes before the
    output (`sailor profile network | cat`, `sailor data prepare --json > out`)."""
    from rich.console import Console
    from rich.progress import Progress

    shown = all(s is not None and s.isatty() for s in (sys.stdout, sys.stderr))
    return Progress(*columns, console=Console(stderr=True), transient=transient, disable=not shown)


TRAIN_EXTRA = "pip install 'sailor-train[train]'"  # what puts torch next to a plain install


def require_torch(command: str, *modules: str) -> None:
    """Raise SailorInputError (one line, exit 2) when torch (or another of `modules`, e.g.
    "safetensors") is not installed: `command` trains or measures with them, while a plain install
    (no `train` extra) only plans, simulates and launches."""
    import importlib.util

    for name in ("torch", *modules):
        if importlib.util.find_spec(name) is None:
            from sailor.core.errors import SailorInputError
            raise SailorInputError(f"`sailor {command}` needs {name}, which is not installed", fix=TRAIN_EXTRA)


def check_number(value: float | None, option: str, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> float | None:
    """`value` (None passes) if it is a finite number in [lo, hi] ((lo, hi] with `lo_open`); else a
    SailorInputError naming `option` (typer's float options take "nan" and "inf")."""
    return None if value is None else Checks(option).number(value, "", lo=lo, hi=hi, lo_open=lo_open)


NOTES_AT_END: list[str] = []  # lines `sailor.cli.main` prints on stderr once a command has succeeded


def say_notes_now() -> None:
    """Print the notes gathered so far (`NOTES_AT_END`) on stderr now and drop them: for a command
    about to start something long whose own output should come after them (`sailor launch` starting
    its nodes), the one way such a command says its notes early."""
    for line in NOTES_AT_END:
        print(line, file=sys.stderr, flush=True)
    NOTES_AT_END.clear()


def machine_profiles(job, cluster, profiles, *, job_source: str | None = None):
    """What `resolve_models` should load: `profiles` when given; on the local provider without
    them, a quick profile of this machine (`runtime.machine.local_profiles`: cached, or measured now,
    saying which on stderr when the command succeeds, so that an error stays one line) at every TP
    degree the planner can choose on `cluster` (`machine.considered_tps`), with as many processes at
    once as `cluster` offers GPUs; else None (the catalog's roofline). Without torch (a plain
    install) the roofline stays, and stderr says why. A job this machine cannot measure (a precision
    other than fp32, a model whose weights and gradients exceed its memory) is refused naming `job_source`.

    The one way `sailor plan`, `simulate`, `run` and `replay` find the machine's profile: the same
    job and cluster give the same profile (the same cache files), hence the same predictions."""
    if profiles is not None or cluster.provider != "local":
        return profiles
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        NOTES_AT_END.append(f"no profile of this machine: measuring it needs torch ({TRAIN_EXTRA}); roofline estimates")
        return None
    from sailor.runtime.machine import considered_tps, local_gpus, local_profiles  # imports torch: only here

    from sailor.core.errors import SailorInputError

    try:
        prof, note = local_profiles(job, tps=considered_tps(job, cluster), processes=local_gpus(cluster),
                                    announce=lambda line: print(line, file=sys.stderr, flush=True))
    except SailorInputError as e:
        raise (e.located(source=job_source) if e.field in ("precision", "model") else e) from None
    NOTES_AT_END.append(note)
    return prof


def memory_label(plan: Plan, stage: int) -> str:
    """Short label of stage `stage`'s memory options, e.g. "full(2) ZeRO-1 SP" ("ZeRO-3 kept": gathered
    weights kept for the iteration, `reshard_after_forward` false); "-" for the defaults
    (the command line's one reader of `Plan.memory`)."""
    mem = plan.stage_memory(stage)
    parts = []
    if mem.recompute is not Recompute.NONE:
        blocks = f"({mem.recompute_blocks})" if mem.recompute_blocks is not None else ""
        parts.append(f"{mem.recompute.value}{blocks}")
    if mem.zero:
        parts.append(f"ZeRO-{mem.zero}" + ("" if mem.reshard_after_forward else " kept"))
    if mem.sequence_parallel:
        parts.append("SP")
    return " ".join(parts) or "-"
