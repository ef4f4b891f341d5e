"""Peak memory per GPU of a replica, as `nvidia-smi` counts it.

    total = weights + gradients + optimizer states          (bytes/param by precision and optimizer)
          + activations x in-flight micro-batches            (per chunk, at the schedule's peak:
                                                               min(P - i, m) under 1F1B; `in_flight`)
          + received inputs x in-flight                       (a chunk not starting at layer 0: the
                                                               activation received from the previous
                                                               chunk's stage, kept for backward)
          + pending weight-gradient inputs x pending          (zb-h1: output gradients the deferred
                                                               W passes need, `weight_grad_pending_bytes`)
          + gradient receive buffer                           (a chunk before the head: one
                                                               activation-sized tensor)
          + logits gradient                                   (the head's stage: fp32 d(loss)/d(logits))
          + allocator reserve                                 (reserve_fraction x the transient tensors)
          + framework                                         (CUDA context, kernels, NCCL; per GPU type)

State bytes per parameter: see `specs.STATE_BYTES_PER_PARAM`; parameters per stage follow tied
embeddings (`SimContext.stage_params`). Activation bytes: measured (profiles, the increase of
allocated memory over one layer's forward) or Korthikanti et al. 2022 (`models.ModelSpec.
activation_bytes`). The received input of a stage is not in those per-layer increases (the previous
layer's output is, but it lives on the previous stage), hence its own term. The head's backward
materialises the gradient of the vocab-parallel logits, (mbs, seq, V/t) in fp32, while all of the
micro-batch's activations are still held. Weights, gradients and optimizer states are allocated once
and do not fragment; the PyTorch caching allocator keeps freed blocks of the transient tensors
(activations, buffers) reserved, which `reserve_fraction` captures. `reserve_fraction` and
`framework_bytes` are per-GPU-type constants (catalog default, or fitted in `calibration`).
Under zb-h1 a micro-batch's activations stay held from its forward until its deferred weight-gradient
pass, not only until its input-gradient pass: splitting a backward with autograd keeps the graph, and
every tensor it saved, alive between the two passes (as `torch.distributed.pipelining`'s
`stage_backward_input` / `stage_backward_weight` do); the output gradients the weight pass needs come
on top. Under interleaving every chunk of the stage counts with its own in-flight micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from sailor.simulator.calibration import gpu_constant
from sailor.simulator.schedules import ONE_F_ONE_B, InFlight, PipelineSchedule

if TYPE_CHECKING:
    from sailor.simulator import SimContext

LOGIT_BYTES = 4  # Megatron's vocab-parallel cross entropy works on fp32 logits in every precision


@dataclass
class MemoryBreakdown:
    """Bytes per GPU by category."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    reserve: float
    framework: float

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.buffers
                + self.reserve + self.framework)

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


def in_flight(stage: int, num_stages: int, microbatches: int, schedule: PipelineSchedule = ONE_F_ONE_B,
              held_bytes: Sequence[float] | None = None, pending_bytes: Sequence[float] | None = None) -> InFlight:
    """Micro-batches stage `stage` holds at its peak under `schedule`, per chunk
    (`PipelineSchedule.in_flight`): min(P - i, m) under 1F1B."""
    return schedule.in_flight(stage, num_stages, microbatches, held_bytes, pending_bytes)


def logits_grad_bytes(ctx: "SimContext", tp: int, mbs: int) -> float:
    """Bytes of the head's fp32 logits gradient for one micro-batch on one GPU: mbs x seq x V/t x 4."""
    m = ctx.job.model
    return float(mbs * ctx.job.seq * m.padded_vocab(tp) // tp * LOGIT_BYTES)


def replica_memory(ctx: "SimContext", gpu: str, tp: int, mbs: int, chunks: Sequence[tuple[int, int]], *,
                   stage: int, num_stages: int, microbatches: int,
                   schedule: PipelineSchedule = ONE_F_ONE_B) -> MemoryBreakdown:
    """Memory per GPU of a replica holding the layer ranges `chunks` (one under 1F1B and ZB-H1,
    `Plan.stage_chunks`) at TP `tp` under `schedule` (bytes); see the module docstring."""
    job = ctx.job
    per_param = job.state_bytes_per_param
    params = sum(ctx.stage_params(tp, a, b) for a, b in chunks)
    act_cum = ctx.act_cumsum(tp, mbs)
    n_layers = job.model.num_layers
    acts = [float(act_cum[b] - act_cum[a]) for a, b in chunks]
    inputs = [ctx.boundary_bytes(a, mbs) if a > 0 else 0.0 for a, _ in chunks]  # received, kept for backward
    pending = [sum(job.model.weight_grad_pending_bytes(x, tp=tp, mbs=mbs, seq=job.seq, elem_bytes=job.elem_bytes)
                   for x in range(a, b)) if schedule.splits_backward else 0.0 for a, b in chunks]
    held = in_flight(stage, num_stages, microbatches, schedule, [x + y for x, y in zip(acts, inputs)], pending)
    activations = sum((h + q) * x + q * y for h, q, x, y in zip(held.held, held.pending, acts, pending))
    buffers = sum((h + q) * x for h, q, x in zip(held.held, held.pending, inputs))
    # one gradient arriving from the next stage at a time, or the head's logits gradient
    buffers += max(ctx.boundary_bytes(b, mbs) if b < n_layers else logits_grad_bytes(ctx, tp, mbs) for _, b in chunks)
    reserve = (activations + buffers) * gpu_constant(ctx.calibration, gpu, "reserve_fraction", 0.0)
    return MemoryBreakdown(
        weights=params * per_param["weights"], gradients=params * per_param["gradients"],
        optimizer=params * per_param["optimizer"], activations=activations, buffers=buffers,
        reserve=reserve, framework=ctx.framework_bytes(gpu))
