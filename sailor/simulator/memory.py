"""Peak memory per GPU of a replica, as `nvidia-smi` counts it.

    total = weights + gradients + optimizer states          (bytes/param by precision and optimizer)
          + activations x in-flight micro-batches            (min(P - i, m) under 1F1B)
          + received inputs x in-flight                       (stage > 0: the activation received from
                                                               the previous stage, kept for backward)
          + gradient receive buffer                           (stage < P-1: one activation-sized tensor)
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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from sailor.simulator.calibration import gpu_constant
from sailor.simulator.schedule import in_flight as _schedule_in_flight

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


def in_flight(stage: int, num_stages: int, microbatches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak under 1F1B: min(P - i, m)."""
    return _schedule_in_flight(num_stages, stage, microbatches)


def logits_grad_bytes(ctx: "SimContext", tp: int, mbs: int) -> float:
    """Bytes of the head's fp32 logits gradient for one micro-batch on one GPU: mbs x seq x V/t x 4."""
    m = ctx.job.model
    return float(mbs * ctx.job.seq * m.padded_vocab(tp) // tp * LOGIT_BYTES)


def replica_memory(ctx: "SimContext", gpu: str, tp: int, mbs: int, a: int, b: int, *, stage: int,
                   num_stages: int, microbatches: int) -> MemoryBreakdown:
    """Memory per GPU of a replica holding layers [a, b) at TP `tp` (bytes); see the module docstring."""
    per_param = ctx.job.state_bytes_per_param
    params = ctx.stage_params(tp, a, b)
    act_cum = ctx.act_cumsum(tp, mbs)
    held = in_flight(stage, num_stages, microbatches)
    activations = float(act_cum[b] - act_cum[a]) * held
    n_layers = ctx.job.model.num_layers
    buffers = 0.0
    if a > 0:
        buffers += ctx.boundary_bytes(a, mbs) * held  # received inputs, kept for backward
    if b < n_layers:
        buffers += ctx.boundary_bytes(b, mbs)  # gradient arriving from the next stage
    else:
        buffers += logits_grad_bytes(ctx, tp, mbs)
    reserve = (activations + buffers) * gpu_constant(ctx.calibration, gpu, "reserve_fraction", 0.0)
    return MemoryBreakdown(
        weights=params * per_param["weights"], gradients=params * per_param["gradients"],
        optimizer=params * per_param["optimizer"], activations=activations, buffers=buffers,
        reserve=reserve, framework=ctx.framework_bytes(gpu))
