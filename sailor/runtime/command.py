"""The worker's command line, defined once.

`WorkerSettings` holds every setting one rank of `python -m sailor.runtime.worker` takes; `argv()`
writes them as the arguments torchrun is given after its own (`-m sailor.runtime.worker --plan=...`),
and `parse` is the worker's own parser, built from the same fields, so that
`parse(s.argv()[2:]) == s` for every `s`. `sailor train`, `sailor run` (local and `--hosts`) and
every `sailor launch` backend build their commands with `argv()`, so a setting given to any of them
reaches every rank.

Each option is written `--name=value`: a value that starts with `-` (a relative path such as
`-x.bin`) stays the option's value instead of reading as another option. Every setting with a
value is written, defaults included, so a command says all it does (None: left out). Torch-free: the
launch backends import it without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sailor import catalog
from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_SECONDS, MAX_STEPS

MODULE = "sailor.runtime.worker"
Device = Literal["cpu", "cuda"]


def _setting(default: Any = dataclasses.MISSING, *, help: str, path: bool = False) -> Any:
    """A field of WorkerSettings: its `--option` help and whether it names a file or folder."""
    return field(default=default, metadata={"help": help, "path": path})


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """Every setting of one rank (the worker's options, one field each; `option(name)` is its flag).

    Paths are as the ranks see them: `sailor train` and `sailor run` make them absolute
    (`absolute()`); the launch backends keep them as given (they name files on the nodes).

    Raises (when built):
        SailorInputError: naming the option: steps outside 1..MAX_STEPS, a timeout that is not a
            finite number of seconds in (0, MAX_SECONDS], a negative seed, checkpoint or log
            interval (or one above MAX_STEPS), an empty path, an unknown device.
    """

    plan: str = _setting(help="plan file (JSON/YAML; ours or Sailor's plan_config)", path=True)
    steps: int = _setting(help="train until this many optimizer steps in total")
    job: str | None = _setting(None, help="job spec file; default: the job carried by the plan", path=True)
    seed: int = _setting(0, help="seed of the initial weights and the data order")
    device: Device = _setting("cpu", help="cpu (gloo) or cuda (NCCL)")
    data: str | None = _setting(None, help="token file (.bin, .npy) or text file or folder; default: pydoc topics",
                                path=True)
    init_from: str | None = _setting(None, help="Hugging Face model folder to start from (safetensors)", path=True)
    checkpoint_dir: str | None = _setting(None, help="checkpoint folder (step-<n>/ each)", path=True)
    checkpoint_every: int | None = _setting(None, help="also checkpoint every N steps (0: only at the end and on stop;"
                                            " default: the job's recipe.checkpoint.every)")
    resume_from: str | None = _setting(None, help="checkpoint folder (step-<n>) to continue from", path=True)
    metrics: str | None = _setting(None, help="rank 0 appends one JSON line per step to this file", path=True)
    log_every: int = _setting(0, help="rank 0 prints loss, tokens/s and MFU every N steps on stdout (0: never)")
    tensorboard: str | None = _setting(None, help="rank 0 writes TensorBoard event files into this folder", path=True)
    stop_file: str | None = _setting(None, help="once this file exists, the ranks stop at the next step boundary",
                                     path=True)
    timeout_s: float = _setting(300.0, help="seconds any collective or transfer may wait before the job fails")

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= MAX_STEPS:
            raise SailorInputError(f"must be between 1 and {MAX_STEPS:,} (limits.MAX_STEPS), got {self.steps}",
                                   source="--steps")
        t = self.timeout_s
        if not (isinstance(t, (int, float)) and math.isfinite(t) and 0 < t <= MAX_SECONDS):
            raise SailorInputError(f"must be a number of seconds > 0 and <= {MAX_SECONDS:g}, got {t}",
                                   source="--timeout-s")
        if self.seed < 0:
            raise SailorInputError(f"must be >= 0, got {self.seed}", source="--seed")
        for name in ("checkpoint_every", "log_every"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_STEPS:
                raise SailorInputError(f"must be between 0 and {MAX_STEPS:,} (limits.MAX_STEPS), got"
                                       f" {getattr(self, name)}", source=option(name))
        for f in dataclasses.fields(self):  # "" would become the current folder once made absolute
            value = getattr(self, f.name)
            if f.metadata["path"] and value is not None and not str(value).strip():
                raise SailorInputError("is an empty path", source=option(f.name), fix="name a file or folder, or leave"
                                       " the option out")
        catalog.check_device(self.device)

    def argv(self) -> list[str]:
        """What torchrun runs: `-m sailor.runtime.worker` and every setting that is not None, as
        `--name=value` (module docstring)."""
        return ["-m", MODULE, *(f"{option(f.name)}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                                if getattr(self, f.name) is not None)]

    def absolute(self) -> WorkerSettings:
        """A copy with every path made absolute (against this process's working folder): a run on
        several hosts needs them to name the same files everywhere."""
        return dataclasses.replace(self, **{f.name: str(Path(getattr(self, f.name)).resolve())
                                            for f in dataclasses.fields(self)
                                            if f.metadata["path"] and getattr(self, f.name) is not None})


def check_takes_effect(settings: WorkerSettings) -> None:
    """Raise SailorInputError for a setting that a run with `settings` would ignore: --checkpoint-every
    without --checkpoint-dir (nothing is saved). Kept out of `WorkerSettings` itself, which a rank
    parses as given."""
    if settings.checkpoint_every and settings.checkpoint_dir is None:
        raise SailorInputError(f"every {settings.checkpoint_every} steps, but there is no --checkpoint-dir to save"
                               " them in", source="--checkpoint-every",
                               fix="add --checkpoint-dir DIR, or leave --checkpoint-every out")


TRAIN_STEPS = 10  # `sailor train`'s steps when neither --steps nor the job's recipe.schedule.total_steps says


def steps_for(job: Any, steps: int | None, *, fallback: int | None) -> int:
    """The steps a run trains: `steps` (--steps) when given, else the job's
    `recipe.schedule.total_steps`, else `fallback` (`sailor train`: TRAIN_STEPS; `sailor launch`:
    None, which refuses: a cluster run of an unsaid length is a mistake).

    Raises:
        SailorInputError: naming --steps, when there is no number and no fallback.
    """
    if steps is not None:
        return steps
    total = job.recipe.schedule.total_steps if job is not None else None
    if total is not None:
        return total
    if fallback is None:
        raise SailorInputError("not given, and the job's recipe sets no schedule.total_steps", source="--steps",
                               fix="pass --steps N, or set recipe.schedule.total_steps in the job")
    return fallback


def checkpoint_every_for(job: Any, every: int | None) -> int:
    """Steps between periodic checkpoints of a run: `every` (--checkpoint-every) when given, else the
    job's `recipe.checkpoint.every` (0: only at the end, on a stop and, for `sailor run`, at switches)."""
    return job.recipe.checkpoint.every if every is None else every


def option(name: str) -> str:
    """The worker's flag for field `name` of WorkerSettings, e.g. "--checkpoint-dir"."""
    return "--" + name.replace("_", "-")


def _value_type(hint: Any) -> tuple[type, tuple[str, ...] | None]:
    """(converter, choices) of a field's annotation: `str | None` -> str; Literal["a", "b"] -> choices."""
    if typing.get_origin(hint) is Literal:
        return str, typing.get_args(hint)
    (base,) = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    assert base in (int, float, str), hint
    return base, None


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors (an unknown option, a missing one, a value of the wrong type)
    raised as SailorInputError: a rank reports them as it reports any bad input."""

    def error(self, message: str) -> typing.NoReturn:
        raise SailorInputError(message, source=self.prog)


def parser() -> argparse.ArgumentParser:
    """The worker's argument parser: one option per field of WorkerSettings, with its help."""
    ap = _Parser(prog=f"python -m {MODULE}", allow_abbrev=False,
                                 description="One rank of a Sailor training run (torchrun starts one per rank).")
    hints = typing.get_type_hints(WorkerSettings)
    for f in dataclasses.fields(WorkerSettings):
        convert, choices = _value_type(hints[f.name])
        required = f.default is dataclasses.MISSING
        ap.add_argument(option(f.name), dest=f.name, type=convert, choices=choices, required=required,
                        default=None if required else f.default, help=f.metadata["help"])
    return ap


def parse(args: Sequence[str]) -> WorkerSettings:
    """The settings of the worker's arguments (`argv()` without `-m sailor.runtime.worker`).

    Raises:
        SailorInputError: an unknown or missing option, a value of the wrong type, or a value
            WorkerSettings refuses (its docstring).
    """
    return WorkerSettings(**vars(parser().parse_args(list(args))))
