"""Peak memory per GPU of a replica.

    total = weights + gradients + optimizer states          (bytes/param by precision and optimizer)
          + activations x in-flight micro-batches            (min(P - i, m) under 1F1B)
          + p2p buffers                                       (one activation in, one out, and grads)
          + allocator reserve                                  (fraction of the above, per GPU type)
          + framework                                          (CUDA context, workspaces; per GPU type)

State bytes per parameter: see `specs.STATE_BYTES_PER_PARAM`. Activation bytes: measured (profiles)
or Korthikanti et al. 2022 (`models.ModelSpec.activation_bytes`). The allocator reserve and the
framework constant are per-GPU-type constants (catalog defaults, or fitted in `calibration`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sailor.simulator import SimContext


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
    return min(num_stages - stage, microbatches)


def replica_memory(ctx: "SimContext", gpu: str, tp: int, mbs: int, a: int, b: int, *, stage: int,
                   num_stages: int, microbatches: int) -> MemoryBreakdown:
    """Memory per GPU of a replica holding layers [a, b) at TP `tp` (bytes)."""
    per_param = ctx.job.state_bytes_per_param
    params = ctx.stage_params(tp, a, b)
    act_cum = ctx.act_cumsum(tp, mbs)
    activations = float(act_cum[b] - act_cum[a]) * in_flight(stage, num_stages, microbatches)
    buffers = 2.0 * (ctx.boundary_bytes(a, mbs) if a > 0 else 0.0) + 2.0 * (
        ctx.boundary_bytes(b, mbs) if b < ctx.job.model.num_layers else 0.0)
    cal = ctx.calibration.get(gpu, {})
    tensors = params * (per_param["weights"] + per_param["gradients"] + per_param["optimizer"]) + activations + buffers
    return MemoryBreakdown(
        weights=params * per_param["weights"], gradients=params * per_param["gradients"],
        optimizer=params * per_param["optimizer"], activations=activations, buffers=buffers,
        reserve=tensors * cal.get("reserve_fraction", 0.0), framework=ctx.framework_bytes(gpu))
