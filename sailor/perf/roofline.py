"""Analytic layer times: a roofline per operation of each layer, summed.

Each layer's forward and backward pass is a list of operations (`Op`): matmuls, attention kernels
and memory-bound elementwise kernels, each with its FLOPs and the bytes it reads and writes in
device memory. One operation takes

    max(FLOPs / (dense peak x efficiency of its kind), bytes / (HBM bandwidth x memory efficiency))

with the peaks from the GPU catalog and the efficiencies of `catalog.Efficiency` (each from an
independent measurement, cited in gpus.yaml: maximum achievable matmul FLOPS, a streaming-bandwidth
measurement, FlashAttention's published throughput). A layer's time is the sum over its operations
(kernels run one after another on one stream). These are estimates, labelled as such wherever they
are used; TP collectives are not in them (the simulator adds them from the intra-node link), nor are
recomputation passes (the simulator adds the recomputed forward).

Operations per transformer block, for one micro-batch of N = b·s tokens on one GPU of a TP group of
t (h, kv, f, a, V as in `sailor.model.activations`; e bytes per element; o = t under sequence parallelism
for what lies outside the TP regions, else 1):
- Megatron-LM (`Framework.MEGATRON`, its fused kernels, Narayanan et al. SC'21 §4.2): LayerNorm;
  QKV GEMM; attention scores QKᵀ (batched GEMM writing b·(a/t)·s² scores); fused scale-mask-softmax;
  dropout (writes a 1-byte mask); attention·V; output projection; bias-dropout-add; LayerNorm; fc1;
  fused bias-GeLU (SwiGLU); fc2; bias-dropout-add.
- Sailor's runtime (`Framework.SAILOR`, plain PyTorch ops): norm; q, k, v linears (each reads the
  input); RoPE (rotary models: slices, four multiplies, a subtract, an add and a concatenation, about
  8 reads and writes per element of q and k); KV repeat (grouped-query attention); causal SDPA
  (flash kernel at the attention efficiency; with a causal mask it computes half of the 4·b·s²·h/t
  FLOPs); the head-merging copy; output linear; bias add and residual add; norm; MLP linears; GeLU
  (or SiLU and the gating multiply); down linear; bias and residual adds.
Backward passes: every GEMM twice (input and weight gradients), the flash attention backward at
2.5x its forward FLOPs (it recomputes the scores: five matmuls for the forward's two), and each
elementwise kernel reads what it saved and the incoming gradient and writes the outgoing one.
Embedding: the row gather (and position add), its backward a scatter-add into fp32 gradients. Head:
norm, LM-head GEMM and the fp32 cross entropy (Megatron-LM: vocab-parallel over V/t; Sailor's
runtime: over the all-gathered V). Every layer's backward also accumulates its fresh weight
gradients (e bytes per parameter) into the gradient buffer kept across micro-batches (read and
written at the job's gradient bytes): Megatron-LM's `param.main_grad.add_(param.grad)` hook of its
DDP wrapper, PyTorch's AccumulateGrad in Sailor's runtime.
An MoE block (`ModelSpec.is_moe_block`) has `moe_mlp_ops` in place of its MLP, in both frameworks:
the router GEMM, softmax and top-k, the gather of the routed rows, the experts' GEMMs over those
rows (every expert's weights read once), the weighting and scatter-add, and the shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from sailor import catalog
from sailor.model.geometry import LayerKind
from sailor.model.spec import Framework, ModelSpec
from sailor.specs.job import JobSpec

FP32 = 4
GRAD_ACCUM_BYTES = 4  # fp32 gradient accumulation of the embedding's scatter-add (read + write)


class OpKind(str, Enum):
    """Which efficiency bounds an operation's FLOP rate."""

    MATMUL = "matmul"
    ATTENTION = "attention"  # a fused (flash) attention kernel
    MEMORY = "memory"  # elementwise / copies: bandwidth only


@dataclass(frozen=True)
class Op:
    """One kernel: its FLOPs, the device-memory bytes it moves, and whether it belongs to the
    attention core (what selective recomputation re-runs)."""

    name: str
    kind: OpKind
    flop: float
    bytes: float
    core: bool = False

    def scaled(self, factor: float, name: str) -> "Op":
        """This operation `factor` times over (FLOPs and bytes), renamed."""
        return Op(name, self.kind, self.flop * factor, self.bytes * factor, self.core)


def op_time_s(op: Op, spec: catalog.GpuSpec, precision: str) -> float:
    """Seconds of one operation on one GPU of type `spec` (module docstring)."""
    eff = spec.efficiency
    memory_s = op.bytes / (spec.hbm_bytes_per_s * eff.memory)
    if op.kind is OpKind.MEMORY:
        return memory_s
    rate = spec.peak(precision) * (eff.matmul if op.kind is OpKind.MATMUL else eff.attention)
    return max(op.flop / rate, memory_s)


def _gemm(name: str, tokens: float, k: float, n: float, e: int, reads: int = 1) -> Op:
    """A (tokens x k) @ (k x n) GEMM: reads its input `reads` times (one per linear sharing it),
    the weight, writes the output."""
    return Op(name, OpKind.MATMUL, 2.0 * tokens * k * n, e * (reads * tokens * k + k * n + tokens * n))


def _mem(name: str, nbytes: float, core: bool = False) -> Op:
    return Op(name, OpKind.MEMORY, 0.0, nbytes, core)


def moe_mlp_ops(m: ModelSpec, *, tp: int, mbs: int, seq: int, e: int) -> tuple[list[Op], list[Op]]:
    """(forward, backward) operations of an MoE block's MLP (`sailor.runtime.moe`; both frameworks),
    with R = k·c·N routed rows (c the capacity factor, 1 dropless) and E experts: the router GEMM
    (N x h x E, on every TP rank); softmax and top-k over the fp32 logits; the gather of the routed
    rows; the experts' gate-and-up and down GEMMs over R rows in all, reading every expert's weights
    once; SiLU and the gating product; the weighting and scatter-add back to the tokens; the shared
    experts as a dense SwiGLU of width f_s with their sigmoid gate. Backward: every GEMM twice,
    every memory-bound kernel's traffic twice (its saved input and the incoming gradient read, the
    outgoing one written)."""
    moe, t, N, h = m.moe, tp, mbs * seq, m.hidden_size
    R, E = routed_rows(m, mbs=mbs, seq=seq), moe.num_experts
    router = _gemm("router", N, h, E, e)
    routing = _mem("softmax and top-k", N * E * (e + 3 * FP32))
    gather = _mem("token gather", 2 * e * R * h)
    up, act, down = _expert_kernels(m, tp=tp, e=e, rows=R, experts=E)
    combine = _mem("weighting and scatter-add", 4 * e * R * h)
    fwd = [router, routing, gather, up, act, down, combine]
    gemms = [router, up, down]
    if moe.shared_experts:
        fs = moe.shared_width
        shared = [_gemm("shared in", N, h, 2 * fs / t, e, reads=2), _gemm("shared down", N, fs / t, h, e)]
        gate = [_gemm("shared gate", N, h, 1, e)] if moe.shared_gate else []
        fwd += [shared[0], _mem("shared activation", (2 + 3) * e * N * fs / t), shared[1], *gate,
                _mem("shared add", 3 * e * N * h)]
        gemms += shared + gate
    bwd = [g.scaled(2, g.name + " backward") for g in gemms]
    bwd += [op.scaled(2, op.name + " backward") for op in fwd if op.kind is OpKind.MEMORY]
    return fwd, bwd


def routed_rows(m: ModelSpec, *, mbs: int, seq: int) -> float:
    """Routed copies R = k·c·N of one micro-batch's N = mbs·seq tokens in an MoE block (c the
    capacity factor: buffers padded to capacity; 1 dropless)."""
    return m.moe.top_k * (m.moe.capacity_factor or 1.0) * mbs * seq


def _expert_kernels(m: ModelSpec, *, tp: int, e: int, rows: float, experts: int) -> tuple[Op, Op, Op]:
    """The experts' gate-and-up GEMMs, SiLU and gating product, and down GEMMs over `rows` routed
    rows in all, reading the weights of `experts` experts once (their TP shards, f_e / t wide)."""
    h, fe, R = m.hidden_size, m.moe.expert_ffn_size / tp, rows
    up = Op("experts gate and up", OpKind.MATMUL, 2.0 * R * h * 2 * fe,
            e * (2 * R * h + experts * h * 2 * fe + R * 2 * fe))
    act = _mem("experts activation", (2 + 3) * e * R * fe)
    down = Op("experts down", OpKind.MATMUL, 2.0 * R * fe * h, e * (R * fe + experts * fe * h + R * h))
    return up, act, down


def expert_ops(m: ModelSpec, *, tp: int, mbs: int, seq: int, e: int, experts: int | None = None,
               rows: float = 1.0, ep: bool = False, grad_bytes: int = 0) -> tuple[list[Op], list[Op]]:
    """(forward, backward) operations of the routed experts alone of one MoE block (the part of
    `moe_mlp_ops` and `grad_accumulation_op` expert parallelism changes) on an EP rank holding
    `experts` experts (default all E) that processes `rows` x R routed rows (R of its own
    micro-batch, `routed_rows`); under expert parallelism (`ep`) also the runtime's sort of the
    arrived rows by expert and the copy of the outputs back to arrival order
    (`runtime.moe.ExpertParallel.run`: 2·e·h bytes per row each). Backward: each GEMM twice, each
    memory-bound kernel's traffic twice, and with `grad_bytes` (the job's gradient bytes per
    parameter) the accumulation of the held experts' weight gradients into the gradient buffer
    (their share of `grad_accumulation_op`: 3·h·f_e/t parameters per expert)."""
    R = rows * routed_rows(m, mbs=mbs, seq=seq)
    n = m.moe.num_experts if experts is None else experts
    up, act, down = _expert_kernels(m, tp=tp, e=e, rows=R, experts=n)
    fwd = [up, act, down]
    if ep:
        fwd += [_mem("arrived rows by expert", 2 * e * R * m.hidden_size),
                _mem("outputs to arrival order", 2 * e * R * m.hidden_size)]
    bwd = [up.scaled(2, up.name + " backward"), down.scaled(2, down.name + " backward")]
    bwd += [op.scaled(2, op.name + " backward") for op in fwd if op.kind is OpKind.MEMORY]
    if grad_bytes:
        bwd.append(_accumulation("experts gradient accumulation", n * 3 * m.hidden_size * m.moe.expert_ffn_size / tp,
                                 e, grad_bytes))
    return fwd, bwd


def ops_time_s(ops: list[Op], gpu: str, precision: str) -> float:
    """Seconds of running `ops` one after another on one GPU of type `gpu` (`op_time_s`)."""
    spec = catalog.gpu(gpu)
    return sum(op_time_s(op, spec, precision) for op in ops)


def megatron_block_ops(m: ModelSpec, *, tp: int, mbs: int, seq: int, e: int, sp: bool,
                       sparse: bool = False) -> tuple[list[Op], list[Op]]:
    """(forward, backward) operations of one block under Megatron-LM (module docstring); an MoE
    block (`sparse`) has `moe_mlp_ops` in place of fc1, bias-GeLU and fc2."""
    t, o, N, h, s, b = tp, (tp if sp else 1), mbs * seq, m.hidden_size, seq, mbs
    kv, f, q = m.kv_heads * m.head_dim, m.ffn, m.attn_width
    f_in = 2 * f if m.gated_mlp else f
    X = b * m.num_heads / t * s * s  # attention scores per GPU
    qkv = _gemm("qkv", N, h, (q + 2 * kv) / t, e)
    qk = Op("scores", OpKind.MATMUL, 2.0 * b * s * s * q / t, e * (N * (q + kv) / t + X), core=True)
    av = Op("attention-v", OpKind.MATMUL, 2.0 * b * s * s * q / t, e * (X + N * kv / t + N * q / t), core=True)
    proj, fc1, fc2 = _gemm("proj", N, q / t, h, e), _gemm("fc1", N, h, f_in / t, e), _gemm("fc2", N, f / t, h, e)
    norm, bda = _mem("layernorm", 2 * e * N * h / o), _mem("bias-dropout-add", (3 * e + 1) * N * h / o)
    if sparse:
        mlp, mlp_bwd = moe_mlp_ops(m, tp=tp, mbs=mbs, seq=seq, e=e)
    else:
        mlp = [fc1, _mem("bias-gelu", e * N * (f_in + f) / t), fc2]
        mlp_bwd = [fc1.scaled(2, "fc1 backward"), fc2.scaled(2, "fc2 backward"),
                   _mem("bias-gelu backward", e * N * (2 * f_in + f) / t)]
    fwd = [norm, qkv, qk, _mem("softmax", 2 * e * X, True), _mem("dropout", (2 * e + 1) * X, True), av, proj, bda,
           norm, *mlp, bda]
    bwd = [g.scaled(2, g.name + " backward") for g in (qkv, qk, av, proj)] + mlp_bwd[:2] + [
        _mem("softmax backward", 3 * e * X, True), _mem("dropout backward", (2 * e + 1) * X, True),
        _mem("layernorm backward", 2 * 3 * e * N * h / o), _mem("bias-dropout-add backward", 2 * (5 * e + 1) * N * h / o),
        *mlp_bwd[2:]]
    return fwd, bwd


def sailor_block_ops(m: ModelSpec, *, tp: int, mbs: int, seq: int, e: int, sp: bool,
                     sparse: bool = False) -> tuple[list[Op], list[Op]]:
    """(forward, backward) operations of one block in Sailor's runtime (module docstring); an MoE
    block (`sparse`) has `moe_mlp_ops` in place of the MLP linears and activation, and `qk_norm`
    (Qwen3) adds a per-head RMSNorm pass over q and k."""
    t, o, N, h, s, b = tp, (tp if sp else 1), mbs * seq, m.hidden_size, seq, mbs
    kv, f, q = m.kv_heads * m.head_dim, m.ffn, m.attn_width
    mlp_in = 2 if m.gated_mlp else 1
    stats = (FP32 if m.rms_norm else 2 * FP32) * N / o
    norm = _mem("norm", 2 * e * N * h / o + stats)
    qkv = _gemm("q,k,v", N, h, (q + 2 * kv) / t, e, reads=3)
    attn_flop = 4.0 * b * s * s * q / t / 2  # causal: the flash kernel skips the masked half
    sdpa = Op("sdpa", OpKind.ATTENTION, attn_flop, e * 4 * N * q / t + FP32 * b * m.num_heads / t * s, core=True)
    out = _gemm("out", N, q / t, h, e)
    up = _gemm("mlp in", N, h, mlp_in * f / t, e, reads=mlp_in)
    down = _gemm("down", N, f / t, h, e)
    adds = _mem("bias and residual adds", (m.has_out_bias + m.has_mlp_bias + 3) * e * N * h / o)
    act = (2 + 3) * e * N * f / t if m.gated_mlp else 2 * e * N * f / t  # SiLU and the gating product, or GeLU
    if sparse:
        mlp, mlp_bwd = moe_mlp_ops(m, tp=tp, mbs=mbs, seq=seq, e=e)
    else:
        mlp = [up, _mem("activation", act), down]
        mlp_bwd = [up.scaled(2, "mlp in backward"), down.scaled(2, "down backward"),
                   _mem("activation backward", (5 + 3) * e * N * f / t if m.gated_mlp else 3 * e * N * f / t)]
    qk_norm = [_mem("q, k norm", 3 * e * N * (q + kv) / t)] if m.qk_norm else []
    core: list[Op] = []
    if not m.learned_positions:
        core.append(_mem("rope", 8 * e * N * (q + kv) / t, True))
    if m.kv_heads < m.num_heads:
        core.append(_mem("kv repeat", 2 * e * N * (kv + q) / t, True))
    core.append(sdpa)
    fwd = [norm, qkv, *qk_norm, *core, _mem("head merge", 2 * e * N * q / t), out, adds, norm, *mlp, adds]
    core_bwd = [op.scaled(1.0, op.name + " backward") for op in core if op is not sdpa]  # same traffic
    core_bwd.append(Op("sdpa backward", OpKind.ATTENTION, 2.5 * attn_flop, e * 8 * N * q / t, core=True))
    bwd = [g.scaled(2, g.name + " backward") for g in (qkv, out)] + mlp_bwd[:2] + core_bwd + [
        _mem("head merge backward", 2 * e * N * q / t), _mem("norm backward", 2 * (3 * e * N * h / o + stats)),
        adds.scaled(2, "adds backward"), *[op.scaled(2, op.name + " backward") for op in qk_norm], *mlp_bwd[2:]]
    return fwd, bwd


def embedding_ops(m: ModelSpec, *, tp: int, mbs: int, seq: int, e: int,
                  framework: Framework) -> tuple[list[Op], list[Op]]:
    """Row gather (+ position add; Megatron-LM: + dropout); backward: scatter-add into fp32 grads."""
    N, h = mbs * seq, m.hidden_size
    fwd = [_mem("lookup", 2 * e * N * h)]
    bwd = [_mem("lookup backward", N * h * (e + 2 * GRAD_ACCUM_BYTES))]
    if m.learned_positions:
        fwd.append(_mem("position add", 3 * e * N * h))
        bwd.append(_mem("position backward", N * h * (e + 2 * GRAD_ACCUM_BYTES)))
    if framework is Framework.MEGATRON:
        fwd.append(_mem("dropout", (2 * e + 1) * N * h))
        bwd.append(_mem("dropout backward", (2 * e + 1) * N * h))
    return fwd, bwd


def head_ops(m: ModelSpec, *, tp: int, mbs: int, seq: int, e: int, framework: Framework) -> tuple[list[Op], list[Op]]:
    """Final norm, LM-head GEMM and the fp32 cross entropy (vocab-parallel for Megatron-LM, over the
    gathered vocabulary in Sailor's runtime)."""
    N, h = mbs * seq, m.hidden_size
    lm = _gemm("lm head", N, h, m.padded_vocab(tp) / tp, e)
    if framework is Framework.MEGATRON:
        logits = N * m.padded_vocab(tp) / tp
        loss = _mem("cross entropy", (e + FP32) * logits + 4 * 2 * FP32 * logits)  # cast, then ~4 fp32 passes
        loss_bwd = _mem("cross entropy backward", (3 * FP32 + e) * logits)
    else:
        logits = N * m.vocab_size  # the runtime drops the padding rows' logits before the loss
        loss = _mem("cross entropy", (e + FP32) * logits + 3 * FP32 * logits)  # cast, log-softmax
        loss_bwd = _mem("cross entropy backward", 3 * FP32 * logits + (FP32 + e) * logits
                        + 2 * e * N * m.padded_vocab(1) / tp)  # log-softmax, cast, slice of the gather
    norm = _mem("norm", 2 * e * N * h)
    return [norm, lm, loss], [loss_bwd, lm.scaled(2, "lm head backward"), _mem("norm backward", 3 * e * N * h)]


def _accumulation(name: str, params: float, e: int, grad: int) -> Op:
    """Adding one micro-batch's weight gradients of `params` parameters (e bytes each) into the
    gradient buffer (read and written at `grad` bytes per parameter)."""
    return _mem(name, params * (e + 2 * grad))


def grad_accumulation_op(job: JobSpec, layer: int, tp: int) -> Op:
    """Adding one micro-batch's weight gradients of `layer` (every parameter one GPU of its TP group
    holds at EP 1) into the gradient buffer (`_accumulation` at the job's gradient bytes)."""
    return _accumulation("gradient accumulation", job.model.params(layer, tp), job.elem_bytes,
                         job.state_bytes_per_param["gradients"])


def layer_ops(job: JobSpec, layer: int, tp: int, mbs: int, sp: bool = False) -> tuple[list[Op], list[Op]]:
    """(forward, backward) operations of `layer` for `job` (its model, sequence, precision, framework)."""
    m = job.model
    kw = dict(tp=tp, mbs=mbs, seq=job.seq, e=job.elem_bytes)
    kind = m.layer_kind(layer)
    if kind is LayerKind.EMBEDDING:
        fwd, bwd = embedding_ops(m, **kw, framework=job.framework)
    elif kind is LayerKind.HEAD:
        fwd, bwd = head_ops(m, **kw, framework=job.framework)
    else:
        ops = megatron_block_ops if job.framework is Framework.MEGATRON else sailor_block_ops
        fwd, bwd = ops(m, **kw, sp=sp, sparse=m.is_moe_block(layer))
    return fwd, bwd + [grad_accumulation_op(job, layer, tp)]


def layer_times(job: JobSpec, gpu: str, tp: int, mbs: int) -> np.ndarray:
    """Analytic forward and backward seconds of every layer: array (num_layers, 2). An estimate."""
    spec = catalog.gpu(gpu)
    out = np.zeros((job.model.num_layers, 2))
    blocks: dict[bool, tuple[float, float]] = {}  # dense or MoE block -> its times
    for i in range(job.model.num_layers):
        sparse = job.model.is_moe_block(i)
        if job.model.layer_kind(i) is LayerKind.BLOCK and sparse in blocks:
            out[i] = blocks[sparse]  # every block of a kind is the same
            continue
        fwd, bwd = layer_ops(job, i, tp, mbs)
        out[i] = (sum(op_time_s(x, spec, job.precision) for x in fwd), sum(op_time_s(x, spec, job.precision) for x in bwd))
        if job.model.layer_kind(i) is LayerKind.BLOCK:
            blocks[sparse] = (out[i, 0], out[i, 1])
    return out


def attention_core_share(job: JobSpec, gpu: str, tp: int, mbs: int) -> float:
    """Fraction of a block's analytic forward time spent in its attention core (the operations
    selective recomputation re-runs)."""
    spec = catalog.gpu(gpu)
    block = 1 if job.model.num_blocks else 0
    fwd, _ = layer_ops(job, block, tp, mbs)
    total = sum(op_time_s(x, spec, job.precision) for x in fwd)
    return sum(op_time_s(x, spec, job.precision) for x in fwd if x.core) / total
