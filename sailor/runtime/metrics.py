"""Training metrics: model FLOP utilisation (MFU), the JSONL lines of `--metrics`, TensorBoard event
files, and a progress line per logging interval. `StepLog` is what rank 0 of the worker does with
each step's record (on every path: `sailor train`, `sailor run`, `sailor launch`).

MFU = model FLOPs per step / step time / peak FLOP/s of the plan's GPUs (PaLM, Chowdhery et al.
2022, App. B: "model FLOPs" count the forward and backward passes of the model, 3 x forward, never
recomputation). Forward FLOPs per layer come from `ModelSpec.forward_flop` at TP 1 (Megatron
accounting, SC'21 §5.1) for the whole global batch; the peak is the sum over the plan's ranks of the
catalog's dense peak for the job's precision (`catalog.GpuSpec.peak`). Torch-free except for
TensorBoard, whose writer (`torch.utils.tensorboard`, which needs the `tensorboard` package) is
imported only when asked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sailor import catalog
from sailor.core.errors import SailorInputError
from sailor.plan.spec import Plan
from sailor.specs.job import JobSpec

# What TensorBoard gets per step (a key absent or None is left out: an fp16 step skipped for an
# overflow has no gradient norm; only fp16 runs have a loss scale).
SCALARS = ("loss", "lr", "eval_loss", "tokens_per_s", "mfu", "grad_norm", "step_time_s", "loss_scale")


def model_flop_per_step(job: JobSpec) -> float:
    """FLOPs of one optimizer step of the whole model on the global batch: 3 x forward (module docstring)."""
    m = job.model
    forward = sum(m.forward_flop(i, tp=1, mbs=job.global_batch_size, seq=job.seq) for i in range(m.num_layers))
    return 3.0 * forward


def peak_flop_per_s(plan: Plan, job: JobSpec) -> float:
    """Dense peak FLOP/s of all of the plan's GPUs for the job's precision (catalog figures)."""
    dtype = job.precision
    return sum(r.tp * catalog.gpu(r.gpu).peak(dtype) for p in plan.pipelines for r in p.replicas)


def check_tensorboard(folder: str | None) -> None:
    """Raise SailorInputError when `--tensorboard` is given but TensorBoard's writer cannot be imported."""
    if folder is None:
        return
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ModuleNotFoundError:
        raise SailorInputError("TensorBoard event files need the tensorboard package", source="--tensorboard",
                               fix="pip install 'sailor-train[tensorboard]'") from None


class StepMetrics:
    """Adds `mfu` to each step event and writes TensorBoard scalars when `tensorboard` is a folder.

    Call `on_step(event)` with each step event (it is updated in place), `close()` at the end.
    """

    def __init__(self, plan: Plan, job: JobSpec, tensorboard: str | Path | None = None) -> None:
        self.flop_per_step = model_flop_per_step(job)
        self.peak = peak_flop_per_s(plan, job)
        self.writer = None
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tensorboard))

    def on_step(self, ev: dict[str, Any]) -> None:
        ev["mfu"] = self.flop_per_step / ev["step_time_s"] / self.peak
        if self.writer is not None:
            for key in SCALARS:
                if ev.get(key) is not None:
                    self.writer.add_scalar(f"train/{key}", ev[key], ev["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class IntervalLog:
    """One line per `every` steps: loss, tokens/s and MFU over the interval (total tokens and FLOPs
    over total step time), e.g. `step 20/100  loss 3.2100  lr 3.00e-04  tokens/s 1,234  MFU 2.31 %`, with
    `eval_loss 3.3000` after the loss when the interval's last step was evaluated; a step evaluated
    between interval lines gets a line of its own (`step 7/100  eval_loss 3.3000`)."""

    def __init__(self, plan: Plan, job: JobSpec, *, every: int, total_steps: int, write: Callable[[str], None]) -> None:
        self.every, self.total, self.write = every, total_steps, write
        self.flop_per_step, self.peak = model_flop_per_step(job), peak_flop_per_s(plan, job)
        self._tokens = self._time = self._flop = 0.0

    def on_step(self, ev: dict[str, Any]) -> None:
        self._tokens += ev["tokens"]
        self._time += ev["step_time_s"]
        self._flop += self.flop_per_step
        if self.every and (ev["step"] % self.every == 0 or ev["step"] == self.total):
            mfu = self._flop / self._time / self.peak
            ev_loss = f"  eval_loss {ev['eval_loss']:.4f}" if ev.get("eval_loss") is not None else ""
            lr = f"  lr {ev['lr']:.2e}" if ev.get("lr") is not None else ""
            self.write(f"step {ev['step']}/{self.total}  loss {ev['loss']:.4f}{ev_loss}{lr}"
                       f"  tokens/s {self._tokens / self._time:,.0f}  MFU {100 * mfu:.2f} %")
            self._tokens = self._time = self._flop = 0.0
        elif self.every and ev.get("eval_loss") is not None:  # an evaluation between interval lines: its own line
            self.write(f"step {ev['step']}/{self.total}  eval_loss {ev['eval_loss']:.4f}")


class StepLog:
    """Rank 0's record of each step: `mfu` added to it (`StepMetrics`, with TensorBoard scalars when
    `tensorboard` is a folder), one JSON line appended to `metrics` (the record without its "event"
    key; its folder is created here), and every `every` steps an `IntervalLog` line passed to `write`.

    Call `on_step(record)` once per step (it adds "mfu" in place), `close()` at the end.
    """

    def __init__(self, plan: Plan, job: JobSpec, *, metrics: str | Path | None = None,
                 tensorboard: str | Path | None = None, every: int = 0, total_steps: int,
                 write: Callable[[str], None] = print) -> None:
        self.metrics = metrics
        if metrics is not None:
            Path(metrics).parent.mkdir(parents=True, exist_ok=True)
        self.step_metrics = StepMetrics(plan, job, tensorboard)
        self.interval = IntervalLog(plan, job, every=every, total_steps=total_steps, write=write)

    def on_step(self, record: dict[str, Any]) -> None:
        self.step_metrics.on_step(record)
        if self.metrics is not None:
            with open(self.metrics, "a") as f:
                f.write(json.dumps({k: v for k, v in record.items() if k != "event"}) + "\n")
        self.interval.on_step(record)

    def close(self) -> None:
        self.step_metrics.close()
