"""The training recipe of a job: optimizer, learning-rate schedule, evaluation and checkpoints.

A job file's `recipe:` (every part optional; the defaults are below):

    recipe:
      optimizer: {name: adamw, lr: 3.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1, grad_clip: 1.0}
      schedule: {warmup_steps: 100, decay: cosine, min_lr: 3.0e-5, total_steps: 10000}
      eval: {data: held_out.npy, every: 200, batches: 8}
      checkpoint: {every: 500, keep: 3}

The recipe travels inside the job (and so inside every plan file that carries it), so every rank, the
single-process reference and a resumed run read the same one. `learning_rate(schedule, lr, n)` is
the one definition of the schedule: pure (no torch), used by the runtime's optimizer step and by the
reference trainer.

Schedule (n = 1, 2, ... the number of the optimizer step, as in the metrics lines' "step"; W the
warmup steps, T the total steps, lr the optimizer's peak rate, m the minimum):
- warmup, n <= W: lr · n / W (linear from lr/W, so the first step does not take a zero step; the
  step count is 1-based as in nanoGPT's `get_lr` with `it + 1`);
- then with the decay progress p = (n - W) / (T - W), clipped to [0, 1]:
  constant: lr; linear: lr - (lr - m) · p; cosine: m + (lr - m) · (1 + cos(pi · p)) / 2 (SGDR without
  restarts, Loshchilov & Hutter 2017, eq. 5, as GPT-3 used it, Brown et al. 2020 App. B);
  wsd (warmup-stable-decay, Hu et al. 2024 "MiniCPM" §4; Hägele et al. 2024): lr until the last
  `decay_fraction` of the post-warmup steps, then linear to m over them;
- the last step, n = T, runs at m (constant: lr), and any step past T too.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_STEPS
from sailor.core.schema import SPEC_CONFIG, Real, Whole

# Checkpoint interval when the recipe does not set one: often enough that a failure loses minutes,
# not hours, and at most one write per 100 steps (the write is collective and stops the step).
DEFAULT_CHECKPOINT_EVERY = 100
DEFAULT_CHECKPOINT_KEEP = 3  # checkpoints kept by default: the newest and two older ones, in case it is damaged


class Decay(str, Enum):
    """How the learning rate falls after the warmup (module docstring)."""

    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"
    WSD = "wsd"


class OptimizerRecipe(BaseModel):
    """The optimizer and its settings. Defaults: AdamW as GPT-3 trained (Brown et al. 2020, App. B:
    betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices, clipping at global norm 1.0) at lr 1e-3."""

    model_config = SPEC_CONFIG

    name: Literal["adamw", "sgd"] = Field(default="adamw", description="adamw, or sgd (torch's SGD, with"
                                                                         " `momentum`).")
    lr: Real(0.0, 10.0) = Field(default=1e-3, description="Peak learning rate (after the warmup).")
    betas: tuple[Real(0.0, 1.0), Real(0.0, 1.0)] = Field(default=(0.9, 0.95), description="Adam's moment decays.")
    eps: Real(0.0, 1.0) = Field(default=1e-8, description="Adam's denominator epsilon.")
    weight_decay: Real(0.0, 10.0) = Field(default=0.1, description="Decoupled weight decay on matrices (>= 2 dims);"
                                                                   " biases and norms get none.")
    grad_clip: Real(0.0, 1e9) = Field(default=1.0, description="Global L2 norm the gradient is clipped to.")
    momentum: Real(0.0, 1.0) = Field(default=0.0, description="sgd only: momentum.")

    @model_validator(mode="after")
    def _check(self) -> OptimizerRecipe:
        if self.lr <= 0:
            raise SailorInputError(f"must be > 0, got {self.lr:g}", field="lr")
        if self.name == "adamw":
            if self.eps <= 0:
                raise SailorInputError(f"must be > 0, got {self.eps:g}", field="eps")
            for i, b in enumerate(self.betas):
                if b >= 1:
                    raise SailorInputError(f"must be < 1, got {b:g}", field=f"betas.{i}")
            if self.momentum:
                raise SailorInputError("is an sgd setting; adamw has betas", field="momentum")
        if self.grad_clip <= 0:
            raise SailorInputError(f"must be > 0, got {self.grad_clip:g}", field="grad_clip")
        return self


class ScheduleRecipe(BaseModel):
    """The learning-rate schedule (module docstring). Default: constant lr, no warmup."""

    model_config = SPEC_CONFIG

    warmup_steps: Whole(0, MAX_STEPS) = Field(default=0, description="Steps of linear warmup.")
    decay: Decay = Field(default=Decay.CONSTANT, description="constant, cosine, linear or wsd.")
    min_lr: Real(0.0, 10.0) = Field(default=0.0, description="Rate at the end of the decay.")
    total_steps: Whole(1, MAX_STEPS) | None = Field(default=None, description="Steps of the whole run: where the"
                                                    " decay ends; also `sailor launch`'s default --steps.")
    decay_fraction: Real(0.0, 1.0) = Field(default=0.2, description="wsd: share of the post-warmup steps spent"
                                           " decaying (the last ones).")

    @model_validator(mode="after")
    def _check(self) -> ScheduleRecipe:
        if self.decay is not Decay.CONSTANT and self.total_steps is None:
            raise SailorInputError(f"a {self.decay.value} decay needs the run's length", field="total_steps",
                                   fix="set total_steps, e.g. 10000")
        if self.total_steps is not None and self.warmup_steps >= self.total_steps and self.decay is not Decay.CONSTANT:
            raise SailorInputError(f"warmup of {self.warmup_steps} steps leaves nothing of total_steps"
                                   f" {self.total_steps} to decay over", field="warmup_steps")
        if self.decay is Decay.WSD and self.decay_fraction <= 0:
            raise SailorInputError("must be > 0 for wsd", field="decay_fraction")
        return self


class EvalRecipe(BaseModel):
    """Evaluation on held-out tokens: every `every` steps, `batches` global batches of `data`."""

    model_config = SPEC_CONFIG

    data: str = Field(min_length=1, description="Held-out token file (.bin, .npy) or text, as the ranks see it"
                                                " (relative to their working folder, like --data).")
    every: Whole(1, MAX_STEPS) = Field(default=200, description="Evaluate after every this many steps.")
    batches: Whole(1, 10_000) = Field(default=8, description="Global batches per evaluation (the same ones each time).")


class CheckpointRecipe(BaseModel):
    """Periodic checkpoints: on by default (`DEFAULT_CHECKPOINT_EVERY`), the newest `keep` kept."""

    model_config = SPEC_CONFIG

    every: Whole(0, MAX_STEPS) = Field(default=DEFAULT_CHECKPOINT_EVERY,
                                       description="Checkpoint every this many steps (0: only at the end and on stop).")
    keep: Whole(1, 1_000_000) = Field(default=DEFAULT_CHECKPOINT_KEEP, description="Newest checkpoints kept; older"
                                      " ones are deleted once a newer one is committed.")


class Recipe(BaseModel):
    """What a job trains with (module docstring)."""

    model_config = SPEC_CONFIG

    optimizer: OptimizerRecipe = Field(default_factory=OptimizerRecipe)
    schedule: ScheduleRecipe = Field(default_factory=ScheduleRecipe)
    eval: EvalRecipe | None = Field(default=None, description="Held-out evaluation; none by default.")
    checkpoint: CheckpointRecipe = Field(default_factory=CheckpointRecipe)

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.schedule.min_lr > self.optimizer.lr:
            raise SailorInputError(f"{self.schedule.min_lr:g} is above the optimizer's lr {self.optimizer.lr:g}",
                                   field="schedule.min_lr")
        total = self.schedule.total_steps
        if self.eval is not None and total is not None and self.eval.every > total:
            raise SailorInputError(f"{self.eval.every} is beyond the run's {total} steps (schedule.total_steps): no"
                                   f" evaluation would run", field="eval.every", fix=f"at most {total}")
        return self

    def lr(self, n: int) -> float:
        """The learning rate of optimizer step `n` (1-based) under this recipe (`learning_rate`)."""
        return learning_rate(self.schedule, self.optimizer.lr, n)


def learning_rate(schedule: ScheduleRecipe, lr: float, n: int) -> float:
    """The learning rate of optimizer step `n` (1-based: the first step is 1) with peak rate `lr`
    (module docstring for the formulas and their sources). Pure: no torch, no state.

    Raises:
        ValueError: `n` < 1 (a caller's mistake).
    """
    if n < 1:
        raise ValueError(f"step numbers start at 1, got {n}")
    w, m = schedule.warmup_steps, schedule.min_lr
    if n <= w:
        return lr * n / w
    if schedule.decay is Decay.CONSTANT:
        return lr
    t = schedule.total_steps
    assert t is not None and t > w, (t, w)  # ScheduleRecipe checks it
    p = min(1.0, (n - w) / (t - w))
    if schedule.decay is Decay.LINEAR:
        return lr - (lr - m) * p
    if schedule.decay is Decay.COSINE:
        return m + (lr - m) * 0.5 * (1.0 + math.cos(math.pi * p))
    f = schedule.decay_fraction  # wsd: stable, then linear over the last fraction f
    q = max(0.0, p - (1.0 - f)) / f
    return lr - (lr - m) * min(1.0, q)
