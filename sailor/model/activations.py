"""Activation memory of one layer for one micro-batch, per framework and memory option.

Every function here returns the bytes of the tensors a layer's autograd graph saves for its
backward pass, deduplicated by storage and without parameters, on ONE GPU of a TP group of t GPUs,
for a micro-batch of b samples of s tokens whose activations take e bytes per element. A layer's
input counts when the layer itself saves it (a block's first norm saves the block input); its output
does not (the next layer saves it). One function per (framework, layer kind), so each can be checked
against a measurement (saved-tensor hooks) and corrected on its own.

Notation: h hidden size, a heads, d = h/a head size, kv = KV heads x d (grouped-query attention),
f MLP width, V padded vocabulary, t TP degree.

Megatron-LM (`Framework.MEGATRON`), Korthikanti et al. 2022, §4.1 and Table 2, generalised to any
element size e, grouped-query attention and gated MLPs. Per block:
  outside the TP regions (replicated; /t with SP): LayerNorm inputs 2·e, QKV and MLP inputs e each,
      two dropout masks 1 byte each                                   -> s·b·h·(4e + 2)
  inside (sharded over t): Q e·h, K and V e·kv each, out-projection input e·h, MLP intermediates
      (GeLU input and output 2·e·f; SwiGLU: the fused fc1 output 2f and its product f, 3·e·f)
  attention core (sharded): softmax output e, its dropout mask 1, dropout output e per score
                                                                       -> a·s²·b·(2e + 1)
For e = 2, f = 4h, kv = h these are Table 2's rows exactly: s·b·h·(34 + 5as/h) without
parallelism, s·b·h·(10 + 24/t + 5as/(ht)) with TP, s·b·h·(34/t + 5as/(ht)) with TP + SP,
s·b·h·(10 + 24/t) with TP + selective recomputation, s·b·h·34/t with TP + SP + selective, and
2·s·b·h with full recomputation (the block input; /t with SP). LayerNorm statistics are ignored, as
in the paper. Embedding: its dropout mask. Head: the final LayerNorm's input, the LM-head input and
the fp32 softmax of the vocab-parallel cross entropy (V/t per token).

Sailor's runtime (`Framework.SAILOR`, `sailor.runtime.model`): no dropout, causal attention through
`F.scaled_dot_product_attention` (flash / memory-efficient kernels keep the output and a log-sum-exp
per query, never the s x s scores). Per block:
  norm1 input x and its output (the q/k/v input), norm2 input and its output (the MLP input): 4·e·h
      per token (3·e·h with a parallel residual, GPT-NeoX: both norms read x), plus fp32 statistics
      per token and norm (mean and rstd: 8 bytes; RMSNorm, PyTorch's composite op: rstd, 4, and the
      normalised input, e·h)
  SDPA inputs: q, and k, v repeated to all heads when kv < h (repeat_interleave makes new tensors),
      so 3·e·h/t per token either way; RoPE (rotary models) makes new q, k and saves its cos and sin
      tables, 2 calls x 2 tables x s·r/2 x e bytes per block (not sharded; r = `ModelSpec.rotary_dim`,
      the rotating part of d)
  SDPA output e·h/t and log-sum-exp fp32 4·a/t per token; the out-projection's input is a view of
      that output with learned positions and a copy (e·h/t more) after RoPE
  MLP: GeLU input and output 2·e·f/t; SwiGLU gate output, SiLU output, up output and their product
      4·e·f/t per token; ReLU (OPT) keeps its output, not its input: e·f/t less. Biases keep nothing.
Embedding: the token ids (int64; under TP also the shifted local ids and a bool mask) and the
position ids. Head: the final norm's input, statistics and output; at TP 1 the fp32 log-probabilities
over the real vocabulary (padding columns dropped), the int64 targets and two fp32 scalars (the loss
weight and the scaled loss); under TP the vocab-parallel cross entropy's saved tensors: this rank's
shard of the logits in the compute dtype (e·min(V/t, real vocabulary) per token on the first rank,
the widest: padding rows give no logits), the fp32 log-sum-exp and the int64 shard-local target
per token, and the fp32 scaled loss.
An MoE block keeps `moe_mlp_bytes` in place of its MLP's (router, routed token buffers, experts'
and shared experts' intermediates), as `sailor.runtime.moe` saves them (checked against the hooks
at TP 1, tests/test_moe.py); with `head_size` set, q and the attention output are a·d wide.
Dense blocks' bytes are what the runtime's saved-tensor hooks measure (tests/test_runtime_memory.py,
through `stage_activation_bytes`, the runtime's accounting of one stage) for blocks, embedding and head; the
runtime's executor also keeps each stage's output until its backward, which `stage_activation_bytes`
adds and `simulator.memory` counts as a buffer.

Memory options, as Sailor's runtime applies them (Megatron-LM's are the same):
- sequence parallelism (SP): every tensor outside the TP regions is split along the sequence (/t);
  column-parallel linears save their sharded input and all-gather it again in the backward.
- selective recomputation: checkpoint of the attention core (RoPE + SDPA; Megatron: QKᵀ, softmax,
  dropout, attention·V): keeps its q, k, v inputs and (Sailor) the output the out-projection reads,
  not the rest of what it makes.
- full recomputation: checkpoint of the whole block: keeps the block input only. During the
  backward of a recomputed block its activations exist once more (`recompute_transient_bytes`).
The embedding and the head are never recomputed and are not affected by SP (they see the full
activation; a block at a stage boundary receives and sends only its sequence slice).
"""

from __future__ import annotations

from typing import Protocol

from sailor.model.geometry import LayerKind
from sailor.model.spec import Framework, ModelSpec, Recompute

INDEX_BYTES = 8  # int64 token, target and position ids
STAT_BYTES = 4  # fp32 normalisation statistics and log-sum-exp
FP32_BYTES = 4  # Megatron's cross entropy and Sailor's loss work on fp32 logits in every precision


class MemoryOptions(Protocol):
    """A stage's memory options as the activation count reads them (`sailor.plan.spec.StageMemory`)."""

    recompute: Recompute
    recompute_blocks: int | None
    sequence_parallel: bool


def layer_bytes(m: "ModelSpec", layer: int, *, tp: int, mbs: int, seq: int, elem_bytes: int,
                framework: Framework = Framework.SAILOR, recompute: Recompute = Recompute.NONE,
                sequence_parallel: bool = False, stats_bytes: int = STAT_BYTES) -> float:
    """Bytes layer `layer` keeps for its backward on one GPU of a TP-`tp` group, for one micro-batch of
    `mbs` samples of `seq` tokens at `elem_bytes` per element (see the module docstring). `stats_bytes`
    is the size of one normalisation statistic in Sailor's runtime: fp32 (4) on CUDA, the input's
    element size on CPU, where torch keeps them in the input dtype."""
    kind = m.layer_kind(layer)
    args = dict(tp=tp, mbs=mbs, seq=seq, e=elem_bytes)
    sailor = dict(args, sigma=stats_bytes)
    if framework is Framework.MEGATRON:
        if kind is LayerKind.EMBEDDING:
            return megatron_embedding_bytes(m, **args)
        if kind is LayerKind.HEAD:
            return megatron_head_bytes(m, **args)
        return megatron_block_bytes(m, **args, recompute=recompute, sp=sequence_parallel, sparse=m.is_moe_block(layer))
    if kind is LayerKind.EMBEDDING:
        return sailor_embedding_bytes(m, **args)
    if kind is LayerKind.HEAD:
        return sailor_head_bytes(m, **sailor)
    return sailor_block_bytes(m, **sailor, recompute=recompute, sp=sequence_parallel, sparse=m.is_moe_block(layer))


def recompute_transient_bytes(m: "ModelSpec", layer: int, *, tp: int, mbs: int, seq: int, elem_bytes: int,
                              framework: Framework = Framework.SAILOR, recompute: Recompute = Recompute.NONE,
                              sequence_parallel: bool = False, stats_bytes: int = STAT_BYTES) -> float:
    """Bytes the recompute forward of one block rebuilds while that block runs its backward (they are
    freed before the next block's): full recomputation rebuilds everything but the kept input;
    selective rebuilds the attention core's saved tensors (those not aliasing its kept inputs).
    0 without recomputation and for the embedding and the head."""
    if recompute is Recompute.NONE or m.layer_kind(layer) is not LayerKind.BLOCK:
        return 0.0
    args = dict(tp=tp, mbs=mbs, seq=seq, e=elem_bytes, sp=sequence_parallel, sparse=m.is_moe_block(layer))
    if framework is Framework.MEGATRON:
        block = megatron_block_bytes
    else:
        def block(m, **kw):
            return sailor_block_bytes(m, **kw, sigma=stats_bytes)
    if recompute is Recompute.FULL:
        return block(m, **args, recompute=Recompute.NONE) - block(m, **args, recompute=Recompute.FULL)
    if framework is Framework.MEGATRON:
        return _megatron_core_bytes(m, tp=tp, mbs=mbs, seq=seq, e=elem_bytes)
    # the recompute re-runs RoPE and SDPA, whose saved tensors (new q, k, v, the output, the
    # log-sum-exp, RoPE's tables) exist again until the core's backward: a new output too, even
    # where the out-projection keeps (a view of) the first one
    return _sailor_core_bytes(m, tp=tp, mbs=mbs, seq=seq, e=elem_bytes)


# ---- Megatron-LM ---------------------------------------------------------------------------------
def _mlp_width_megatron(m: "ModelSpec") -> int:
    """Saved MLP intermediates per token, in elements: GeLU input and output (2f); SwiGLU: the fused
    fc1 output (2f) and the gated product (f)."""
    return 3 * m.ffn if m.gated_mlp else 2 * m.ffn


def _megatron_core_bytes(m: "ModelSpec", *, tp: int, mbs: int, seq: int, e: int) -> float:
    """Attention core of one block: softmax output, dropout mask and dropout output per score."""
    return m.num_heads * seq * seq * mbs * (2 * e + 1) / tp


def megatron_block_bytes(m: "ModelSpec", *, tp: int, mbs: int, seq: int, e: int, recompute: Recompute,
                         sp: bool, sparse: bool = False) -> float:
    """One transformer block under Megatron-LM (Korthikanti et al. 2022 Table 2, generalised; q and the
    out-projection input are a·d wide; an MoE block (`sparse`) keeps `moe_mlp_bytes` for its MLP)."""
    s, b, h = seq, mbs, m.hidden_size
    outside_tp = tp if sp else 1
    if recompute is Recompute.FULL:
        return e * s * b * h / outside_tp
    kv = m.kv_heads * m.head_dim
    replicated = s * b * h * (4 * e + 2)
    mlp = moe_mlp_bytes(m, tp=tp, mbs=mbs, seq=seq, e=e) if sparse else s * b * e * _mlp_width_megatron(m) / tp
    sharded = s * b * e * (2 * m.attn_width + 2 * kv)
    core = 0.0 if recompute is Recompute.SELECTIVE else _megatron_core_bytes(m, tp=tp, mbs=mbs, seq=seq, e=e)
    return replicated / outside_tp + sharded / tp + mlp + core


def megatron_embedding_bytes(m: "ModelSpec", *, tp: int, mbs: int, seq: int, e: int) -> float:
    """Embedding under Megatron-LM: its dropout mask (1 byte per element; the dropout output is the
    first block's saved input)."""
    return float(seq * mbs * m.hidden_size)


def megatron_head_bytes(m: "ModelSpec", *, tp: int, mbs: int, seq: int, e: int) -> float:
    """Head under Megatron-LM: final LayerNorm input, LM-head input, fp32 softmax over V/t."""
    s, b = seq, mbs
    return 2.0 * e * s * b * m.hidden_size + FP32_BYTES * s * b * m.padded_vocab(tp) / tp


# ---- Sailor's runtime ----------------------------------------------------------------------------
def _norm_bytes_per_token(m: "ModelSpec", e: int, sigma: int, *, with_input: bool = True) -> float:
    """What one norm saves per token: its input (unless another op keeps it) and its statistics of
    `sigma` bytes each (LayerNorm mean and rstd); RMSNorm (PyTorch's composite op) rstd and the
    normalised input."""
    own = e * m.hidden_size + sigma if m.rms_norm else 2 * sigma
    return (e * m.hidden_size if with_input else 0) + own


def _rope_table_bytes(m: "ModelSpec", *, seq: int, e: int) -> float:
    """cos and sin tables (seq x d/2 each) saved by the two RoPE calls (q and k) of a rotary block."""
    return 0.0 if m.learned_positions else 2 * 2 * seq * (m.rotary_dim // 2) * e


def _sdpa_copy_width(m: "ModelSpec") -> int:
    """Elements per token (before /t) of the q, k, v that SDPA saves and that are new tensors rather
    than the projections' outputs: RoPE makes new q and k; repeating KV heads makes new k and v."""
    h, rotary, gqa = m.attn_width, not m.learned_positions, m.kv_heads < m.num_heads
    return (h if rotary else 0) + (h if rotary or gqa else 0) + (h if gqa else 0)


def _sailor_core_bytes(m: "ModelSpec", *, tp: int, mbs: int, seq: int, e: int) -> float:
    """What the attention core (RoPE + SDPA) saves beyond the q, k, v projections it reads: its new
    q, k, v tensors (`_sdpa_copy_width`), the output, the fp32 log-sum-exp and the RoPE tables."""
    s, b = seq, mbs
    copies = e * s * b * _sdpa_copy_width(m) / tp
    out = e * s * b * m.attn_width / tp
    lse = STAT_BYTES * b * m.num_heads * s / tp
    return copies + out + lse + _rope_table_bytes(m, seq=seq, e=e)


def sailor_block_bytes(m: "ModelSpec", *, tp: int, mbs: int, seq: int, e: int, recompute: Recompute,
                       sp: bool, sigma: int = STAT_BYTES, sparse: bool = False) -> float:
    """One transformer block in Sailor's runtime (see the module docstring for every term; an MoE
    block (`sparse`) keeps `moe_mlp_bytes` for its MLP, q and the attention output are a·d wide, and
    `qk_norm` keeps each normalised q and k and the norm's output)."""
    s, b, h = seq, mbs, m.hidden_size
    outside_tp = tp if sp else 1
    if recompute is Recompute.FULL:
        return e * s * b * h / outside_tp
    kv = m.kv_heads * m.head_dim
    local = e * s * b * m.attn_width / tp  # one (b, s, a·d/t) tensor
    # norm1 and norm2 with their outputs; with a parallel residual (GPT-NeoX) both norms read x, kept once
    outside = s * b * (2 * e * h + _norm_bytes_per_token(m, e, sigma)
                       + _norm_bytes_per_token(m, e, sigma, with_input=not m.parallel_residual))
    mlp = moe_mlp_bytes(m, tp=tp, mbs=mbs, seq=seq, e=e) if sparse else \
        e * s * b * m.ffn * ((1 if m.act == "relu" else 2) + (2 if m.gated_mlp else 0)) / tp
    qk_norm = (2 * e * s * b * (m.attn_width + kv) / tp + 2 * sigma * s * b * (m.num_heads + m.kv_heads) / tp
               if m.qk_norm else 0.0)  # RMSNorm per head: normalised input and output, rstd per head
    if recompute is Recompute.SELECTIVE:
        # the checkpoint keeps its inputs (the q, k, v projections); the out-projection its output
        core = e * s * b * (m.attn_width + 2 * kv) / tp + local
    else:
        # SDPA keeps all-head q, k, v (3h whether they are the projections or new tensors), its
        # output, the log-sum-exp and RoPE's tables; the out-projection's input is a view of SDPA's
        # output with learned positions, a copy after RoPE
        copies = e * s * b * _sdpa_copy_width(m) / tp
        core = 3 * local + _sailor_core_bytes(m, tp=tp, mbs=mbs, seq=seq, e=e) - copies
        core += 0.0 if m.learned_positions else local
    return outside / outside_tp + core + mlp + qk_norm


def moe_mlp_bytes(m: ModelSpec, *, tp: int, mbs: int, seq: int, e: int) -> float:
    """What an MoE block's MLP keeps for its backward (`sailor.runtime.moe`; both frameworks): the
    tensors its autograd graph saves, per token:
    - the router: fp32 softmax output 4·E, the int64 top-k indices 8·k, and when `norm_topk_prob`
      the top-k probabilities and their sum 4·(k + 1);
    - every routed copy of the token (k·c of them, c the capacity factor, 1 dropless: the routed
      token buffers): its gathered input e·h (full width on every TP rank), the expert's SwiGLU
      intermediates 4·e·f_e/t (as a dense gated MLP's), its output e·h and its fp32 routing weight
      kept for the weighting, the weighted copy e·h the scatter-add keeps, and four int64 indices
      (the expert's (token, slot) pair, the gathered token and slot ids) 32;
    - the shared experts: SwiGLU intermediates 4·e·f_s/t, their output e·h and the gate's sigmoid
      output e.
    At TP 1 this is what the saved-tensor hooks measure (tests/test_moe.py).
    The MLP's input (the second norm's output) is counted with the norm."""
    moe, h = m.moe, m.hidden_size
    router = FP32_BYTES * moe.num_experts + INDEX_BYTES * moe.top_k + FP32_BYTES * (moe.top_k + 1) * moe.norm_topk_prob
    routed = moe.top_k * (moe.capacity_factor or 1.0) * (3 * e * h + 4 * e * moe.expert_ffn_size / tp + FP32_BYTES
                                                         + 4 * INDEX_BYTES)
    shared = (4 * e * moe.shared_width / tp + e * h + e) if moe.shared_experts else 0.0
    return float(seq * mbs * (router + routed + shared))


def expert_row_bytes(m: ModelSpec, *, tp: int, e: int) -> float:
    """Bytes an MoE block's experts keep per routed row they process (part of `moe_mlp_bytes`'s
    per-copy term, the part that stays with the expert when expert parallelism sends the row to
    another rank): its input e·h and the SwiGLU intermediates 4·e·f_e/t."""
    return e * m.hidden_size + 4 * e * m.moe.expert_ffn_size / tp


def sailor_embedding_bytes(m: "ModelSpec", *, tp: int, mbs: int, seq: int, e: int) -> float:
    """Embedding in Sailor's runtime: the int64 token ids (under TP also the shifted local ids and a
    bool mask of ids outside this rank's rows) and, for learned positions, the int64 position ids."""
    ids = INDEX_BYTES * seq * mbs + ((INDEX_BYTES + 1) * seq * mbs if tp > 1 else 0)
    return float(ids + (INDEX_BYTES * seq if m.learned_positions else 0))


def sailor_head_bytes(m: "ModelSpec", *, tp: int, mbs: int, seq: int, e: int, sigma: int = STAT_BYTES) -> float:
    """Head in Sailor's runtime: final norm input, statistics and output; at TP 1 the fp32
    log-probabilities over the real vocabulary (padding rows dropped) and the int64 targets; under TP
    the vocab-parallel loss's logit shard (compute dtype, the first rank's width), fp32 log-sum-exp
    and int64 local targets (`runtime.tensor_parallel._VocabParallelCE`). Module docstring."""
    s, b = seq, mbs
    norm = s * b * (_norm_bytes_per_token(m, e, sigma) + e * m.hidden_size)
    if tp == 1:
        return float(norm + FP32_BYTES * s * b * m.vocab_size + INDEX_BYTES * s * b + 2 * FP32_BYTES)
    width = min(m.padded_vocab(1) // tp, m.vocab_size)
    return float(norm + s * b * (e * width + FP32_BYTES + INDEX_BYTES) + FP32_BYTES)


# ---- one stage, as Sailor's runtime holds it -------------------------------------------------------
def stage_activation_bytes(m: ModelSpec, layers: tuple[int, int], memory: MemoryOptions, *, mbs: int, seq: int,
                           tp: int, elem_bytes: int, stats_bytes: int | None = None) -> dict[int, float]:
    """Bytes one micro-batch keeps per layer of the stage holding `layers` (half-open) in Sailor's
    runtime, under the stage's memory options, on one rank of a TP-`tp` replica: {layer: bytes},
    summing to what the stage keeps per in-flight micro-batch. What `sailor train` holds, checked
    exactly against saved-tensor hooks on the runtime (tests/test_runtime_memory.py).

    Beyond `layer_bytes` (Framework.SAILOR) per layer it counts what the runtime's executor keeps: the
    stage's last output (b·s·h·e) until its backward, unless it is the loss (under SP, when that
    layer is a block, only this rank's sequence slice, b·s·h·e/t: it leaves the stage sliced,
    `runtime.tensor_parallel.sliced_edges`); under SP the full input of the first block (b·s·h·e)
    when the embedding made it, counted for the embedding (a block that is the stage's first layer
    receives its slice, which its first norm saves anyway). `memory.recompute_blocks` counts the stage's first
    blocks in layer order under full recomputation. `stats_bytes` None: `elem_bytes` (CPU's norms
    keep their statistics in the input dtype; CUDA's keep fp32, pass 4).
    """
    first, end = layers
    sigma = elem_bytes if stats_bytes is None else stats_bytes
    blocks = [i for i in range(first, end) if m.layer_kind(i) is LayerKind.BLOCK]
    full = set(blocks if memory.recompute_blocks is None else blocks[:memory.recompute_blocks]) \
        if memory.recompute is Recompute.FULL else set()
    sp = memory.sequence_parallel
    full_act = mbs * seq * m.hidden_size * elem_bytes  # one full (b, s, h) activation
    out: dict[int, float] = {}
    for i in range(first, end):
        mode = Recompute.FULL if i in full else (Recompute.NONE if memory.recompute is Recompute.FULL
                                                 else memory.recompute)
        out[i] = layer_bytes(m, i, tp=tp, mbs=mbs, seq=seq, elem_bytes=elem_bytes, recompute=mode,
                             sequence_parallel=sp, stats_bytes=sigma)
    if m.layer_kind(end - 1) is LayerKind.BLOCK:
        out[end - 1] += full_act / tp if sp else full_act  # the stage output, kept until its backward
    elif m.layer_kind(end - 1) is not LayerKind.HEAD:
        out[end - 1] += full_act
    if sp and blocks and blocks[0] > first:
        out[first] += full_act  # the first block's full input, from the embedding
    return out
