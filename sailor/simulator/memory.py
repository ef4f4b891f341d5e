"""Peak memory per GPU of a replica, as `nvidia-smi` counts it.

    total = weights + gradients + optimizer states          (bytes/param by precision and optimizer,
                                                              sharded over D replicas by ZeRO)
          + activations x in-flight micro-batches            (per chunk, at the schedule's peak:
                                                              min(P - i, m) under 1F1B, `in_flight`;
                                                              what each layer keeps under the
                                                              stage's recomputation and SP)
          + recomputation transient                          (one recomputed block's rebuilt
                                                              activations, during its backward)
          + received inputs x in-flight                       (a chunk not starting at layer 0: the
                                                               activation received from the previous
                                                               chunk's stage, kept for backward)
          + pending weight-gradient inputs x pending          (zb-h1: output gradients the deferred
                                                               W passes need, `weight_grad_pending_bytes`)
          + gradient receive buffer                           (a chunk before the head: one
                                                               activation-sized tensor)
          + logits gradient                                   (the head's stage: fp32 d(loss)/d(logits))
          + ZeRO-3 gather buffer                              (the largest layer's full weights)
          + gradient sync buffer                              (a flat copy of the gradients the sync
                                                               reduces at once)
          + expert-parallel token buffers                     (EP > 1: one MoE block's dispatched and
                                                               arrived rows, `experts.token_buffer_bytes`)
          + allocator reserve                                 (reserve_fraction x the transient tensors)
          + framework                                         (CUDA context and kernels; per GPU type)
          + NCCL buffers                                      (per communicator the rank opens,
                                                               `plan.comms`; not for a calibrated
                                                               GPU type, whose measured framework
                                                               figure holds them)

`replica_memory` is the one place the simulator turns a stage's memory options (`plan.spec.StageMemory`,
read from the plan by `terms.stage_memory`) into memory; the schedule comes in as a `PipelineSchedule` (`schedules.pipeline_schedule`), and the
two combine: what one micro-batch keeps per chunk under the stage's options, times the micro-batches
the schedule holds per chunk at its peak. State bytes per parameter: `specs.job.STATE_BYTES_PER_PARAM`
(Megatron-LM's count), divided by the stage's D replicas for what ZeRO shards (`state_bytes`); each
block is sharded among the D ranks that hold it, so a replica's share is 1/D whatever the TP degrees
of the others. Parameters per stage follow tied embeddings (`SimContext.stage_params`). Activation
bytes: measured (profiles, the increase of allocated memory over one layer's forward), scaled to the
options by the model's own ratio, or the model's formula (`sailor.model.activations`). The received input
of a stage is not in those per-layer increases (the previous layer's output is, but it lives on the
previous stage), hence its own term. The head's backward materialises the gradient of the
vocab-parallel logits, (mbs, seq, V/t) in fp32, while all of the micro-batch's activations are still
held. The gradient sync flattens the gradients it reduces into one new buffer (`sync_buffer_bytes`):
DeepSpeed's `allreduce_bucket` the whole stage's at once (up to 5e8 elements), which the `sailor`
framework's published runs used, so the stage's (all of its chunks') is counted; Sailor's own runtime
reduces its per-bucket gradient buffers in place under ZeRO-0/1 (`runtime.zero`), with only one
layer's freshly computed gradients outside them, so the count is conservative for it; under ZeRO-2/3 no full gradient outlives a layer's
backward, so one layer's; Megatron-LM (`Framework.MEGATRON`) reduces its contiguous gradient buffer
in place. It is allocated after the activations were freed, but the caching allocator keeps their
blocks reserved and cannot carve one gradient-sized block out of them, so `nvidia-smi` sees both
(`sync_buffer`, outside the reserve). Weights, gradients and optimizer states are allocated once and do not fragment; the PyTorch
caching allocator keeps freed blocks of the transient tensors (activations, buffers) reserved, which
`reserve_fraction` captures. `reserve_fraction` and `framework_bytes` are per-GPU-type constants
(catalog default, or fitted in `calibration`).
Under zb-h1 a micro-batch's activations stay held from its forward until its deferred weight-gradient
pass, not only until its input-gradient pass: splitting a backward with autograd keeps the graph, and
every tensor it saved, alive between the two passes (as `torch.distributed.pipelining`'s
`stage_backward_input` / `stage_backward_weight` do); the output gradients the weight pass needs come
on top. Under interleaving every chunk of the stage counts with its own in-flight micro-batches; a
stage recomputes one block at a time, so its transient is the largest of its chunks'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from sailor.model.spec import Framework, Recompute
from sailor.perf.calibration import gpu_constant
from sailor.plan.comms import uniform_nccl_bytes
from sailor.plan.spec import DEFAULT_STAGE_MEMORY, StageMemory, split_recompute_blocks
from sailor.simulator.context import ALL_PARAMS, ParamShare, held_layer_params, stage_blocks
from sailor.simulator.experts import DENSE_ONLY, EPRank, expert_activation_bytes, moe_blocks, token_buffer_bytes
from sailor.simulator.schedules import ONE_F_ONE_B, InFlight, PipelineSchedule
from sailor.simulator.terms import recomputed_blocks

if TYPE_CHECKING:
    from sailor.simulator.context import SimContext

LOGIT_BYTES = 4  # Megatron's vocab-parallel cross entropy works on fp32 logits in every precision


@dataclass
class MemoryBreakdown:
    """Bytes per GPU by category (activations include the recomputation transient)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    reserve: float
    framework: float
    sync_buffer: float = 0.0
    nccl: float = 0.0  # NCCL communicators' buffers, outside the caching allocator (`plan.comms`)

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.buffers
                + self.reserve + self.framework + self.sync_buffer + self.nccl)

    @property
    def persistent(self) -> float:
        """Bytes the caching allocator's reserve does not scale: states, sync buffer, NCCL buffers
        (framework aside)."""
        return self.weights + self.gradients + self.optimizer + self.sync_buffer + self.nccl

    @property
    def transient(self) -> float:
        """Bytes the reserve scales: activations and p2p / logits buffers."""
        return self.activations + self.buffers

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


def state_bytes(per_param: dict[str, int], params: float, zero: int, replicas: int) -> dict[str, float]:
    """Weights, gradients and optimizer-state bytes of `params` parameters on one GPU: ZeRO-1 shards
    the optimizer states over the `replicas` ranks holding each block, ZeRO-2 also the gradients,
    ZeRO-3 also the weights (Rajbhandari et al. 2020, §5; with Megatron-LM's bytes per parameter,
    ZeRO-1 gives its distributed optimizer's 6 + 12/d for bf16)."""
    shard = {"optimizer": 1, "gradients": 2, "weights": 3}
    return {k: params * per_param[k] / (replicas if zero >= shard[k] else 1) for k in shard}


def stage_activation_bytes(ctx: "SimContext", tp: int, mbs: int, a: int, b: int,
                           mem: StageMemory) -> tuple[float, float]:
    """(kept bytes per in-flight micro-batch, recomputation transient bytes) of layers [a, b) on one
    GPU under the stage's recomputation (the first `recompute_blocks` blocks under `full`) and SP."""
    sp = mem.sequence_parallel
    plain = ctx.act_cumsum(tp, mbs, Recompute.NONE, sp)
    if mem.recompute is Recompute.NONE:
        return float(plain[b] - plain[a]), 0.0
    first, n = stage_blocks(ctx.job.model, a, b)
    if mem.recompute is Recompute.FULL and mem.recompute_blocks is not None:
        n = min(n, mem.recompute_blocks)
    if n == 0:
        return float(plain[b] - plain[a]), 0.0
    kept = ctx.act_cumsum(tp, mbs, mem.recompute, sp)
    total = (plain[b] - plain[a]) - (plain[first + n] - plain[first]) + (kept[first + n] - kept[first])
    transient = ctx.recompute_transient_bytes(first, tp, mbs, mem.recompute, sp)
    return float(total), float(transient)


def replica_memory(ctx: "SimContext", gpu: str, tp: int, mbs: int, chunks: Sequence[tuple[int, int]], *,
                   stage: int, num_stages: int, microbatches: int, memory: StageMemory = DEFAULT_STAGE_MEMORY,
                   replicas: int = 1, schedule: PipelineSchedule = ONE_F_ONE_B,
                   experts: EPRank | None = None) -> MemoryBreakdown:
    """Memory per GPU of a replica holding the layer ranges `chunks` (one unless interleaved,
    `Plan.stage_chunks`) at TP `tp` (bytes), with the stage's memory options `memory` over its
    `replicas` data-parallel replicas D, under `schedule`; see the module docstring. Under expert
    parallelism (`experts`, `simulator.experts`): the dense parameters' states sharded over D, its
    own experts' over their D/ep holders, the experts' activations for the rows it receives and one
    MoE block's dispatch and combine buffers."""
    job = ctx.job
    n_layers = job.model.num_layers
    if experts is None:
        params = sum(ctx.stage_params(tp, a, b) for a, b in chunks)
        state = state_bytes(job.state_bytes_per_param, params, memory.zero, replicas)
    else:
        dense, own = (sum(ctx.stage_params(tp, a, b, share) for a, b in chunks)
                      for share in (DENSE_ONLY, experts.experts_share))
        d_state = state_bytes(job.state_bytes_per_param, dense, memory.zero, replicas)
        e_state = state_bytes(job.state_bytes_per_param, own, memory.zero, experts.expert_replicas)
        state = {k: d_state[k] + e_state[k] for k in d_state}
    chunk_memory = split_recompute_blocks(memory, chunks, n_layers)
    per_chunk = [stage_activation_bytes(ctx, tp, mbs, a, b, mem) for (a, b), mem in zip(chunks, chunk_memory)]
    if experts is not None:  # the rows its experts receive in place of its own (`experts`)
        more = [expert_activation_bytes(ctx, tp, mbs, a, b, experts, mem.recompute,
                                        recomputed_blocks(ctx, a, b, mem.recompute, mem.recompute_blocks))
                for (a, b), mem in zip(chunks, chunk_memory)]
        per_chunk = [(kept + dk, transient + dt) for (kept, transient), (dk, dt) in zip(per_chunk, more)]
    acts = [kept for kept, _ in per_chunk]
    inputs = [ctx.boundary_bytes(a, mbs) if a > 0 else 0.0 for a, _ in chunks]  # received, kept for backward
    pending = [sum(job.model.weight_grad_pending_bytes(x, tp=tp, mbs=mbs, seq=job.seq, elem_bytes=job.elem_bytes)
                   for x in range(a, b)) if schedule.splits_backward else 0.0 for a, b in chunks]
    held = in_flight(stage, num_stages, microbatches, schedule, [x + y for x, y in zip(acts, inputs)], pending)
    activations = sum((h + q) * x + q * y for h, q, x, y in zip(held.held, held.pending, acts, pending))
    activations += max(transient for _, transient in per_chunk)  # one block recomputes at a time
    buffers = sum((h + q) * x for h, q, x in zip(held.held, held.pending, inputs))
    # one gradient arriving from the next stage at a time, or the head's logits gradient
    buffers += max(ctx.boundary_bytes(b, mbs) if b < n_layers else logits_grad_bytes(ctx, tp, mbs) for _, b in chunks)
    held = ALL_PARAMS if experts is None else experts.share
    if memory.zero >= 3 and replicas > 1:
        buffers += gathered_weights_bytes(ctx, tp, chunks, memory.reshard_after_forward, held)
    if experts is not None and any(moe_blocks(ctx, a, b) for a, b in chunks):
        buffers += token_buffer_bytes(ctx, tp, mbs, experts)
    reserve = (activations + buffers) * gpu_constant(ctx.calibration, gpu, "reserve_fraction", 0.0)
    return MemoryBreakdown(
        weights=state["weights"], gradients=state["gradients"], optimizer=state["optimizer"],
        activations=activations, buffers=buffers, reserve=reserve, framework=ctx.framework_bytes(gpu),
        sync_buffer=sync_buffer_bytes(ctx, tp, chunks, memory.zero, held),
        nccl=0.0 if ctx.framework_calibrated(gpu) else uniform_nccl_bytes(
            tp, stage, num_stages, replicas, interleaved=schedule.virtual_stages > 1))


def gathered_weights_bytes(ctx: "SimContext", tp: int, chunks: Sequence[tuple[int, int]], reshard: bool,
                           share: ParamShare = ALL_PARAMS) -> float:
    """Peak bytes of full (gathered) weights a ZeRO-3 replica holding the layer ranges `chunks` at TP
    `tp` has on one GPU (`runtime.zero`): re-sharded after every pass (`reshard`), the layer being
    computed and the next one of its pass being prefetched, so the largest two adjacent layers of a
    chunk (or its one layer); kept for the iteration, every layer of the stage plus one layer's
    gather buffer as it is filled in. Under expert parallelism only the experts the replica holds
    (`share`)."""
    m, wb = ctx.job.model, ctx.job.state_bytes_per_param["weights"]
    sizes = [[held_layer_params(m, i, tp, share) for i in range(a, b)] for a, b in chunks]
    if not reshard:
        return (sum(map(sum, sizes)) + max(map(max, sizes))) * wb
    return max(max(x + y for x, y in zip(c, c[1:])) if len(c) > 1 else c[0] for c in sizes) * wb


def sync_buffer_bytes(ctx: "SimContext", tp: int, chunks: Sequence[tuple[int, int]], zero: int = 0,
                      share: ParamShare = ALL_PARAMS) -> float:
    """Bytes of the flat gradient copy the sync of a stage holding the layer ranges `chunks`
    (`Plan.stage_chunks`) allocates on one GPU at TP `tp` (module docstring): the stage's gradients
    (all of its chunks', the `share` of them the replica holds under expert parallelism), or under
    ZeRO-2/3 its largest layer's; none for Megatron-LM, whose gradients live in one contiguous
    buffer that is all-reduced in place."""
    if ctx.job.framework is Framework.MEGATRON:
        return 0.0
    grad = ctx.job.state_bytes_per_param["gradients"]
    if zero >= 2:
        return max(held_layer_params(ctx.job.model, i, tp, share) for a, b in chunks for i in range(a, b)) * grad
    return sum(ctx.stage_params(tp, a, b, share) for a, b in chunks) * grad
