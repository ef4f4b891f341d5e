"""Bytes the Sailor runtime keeps from one micro-batch's forward until its backward, per layer (torch-free).

This is what `sailor train` actually holds, counted op by op from what each op of
`sailor.runtime.model` saves for its backward, plus what the runtime's executor keeps (each stage's
input and output); `tests/test_runtime_memory.py` measures it with
`torch.autograd.graph.saved_tensors_hooks` (distinct storages, parameters excluded) on CPU and checks
every figure here exactly. It differs from Korthikanti et al. 2022, Table 2 (`ModelSpec.
activation_bytes`) where the runtime differs from Megatron: SDPA keeps no s x s score tensors (it
keeps q, k, v, its output and the fp32 log-sum-exp), there is no dropout (no masks), separate q/k/v
projections share one saved input, and index tensors (token ids) count.

Symbols: b micro-batch, s sequence, h hidden, t TP degree, e element bytes of the compute dtype,
σ bytes of a norm statistic (CPU: e; CUDA's layer_norm keeps fp32 statistics for half inputs: 4),
nh/nkv attention/KV heads, hd head dim, f MLP width.

What each op keeps (at TP t, local heads nh/t; n = s/t tokens inside a sequence-parallel region,
n = s otherwise):
- LayerNorm: its input n·b·h·e, mean and rstd 2·n·b·σ. RMSNorm (torch's composite CPU op): input,
  rstd n·b·σ and the normalised input n·b·h·e (counted for fp32; half-precision RMSNorm upcasts and
  was not measured). With a parallel residual (GPT-NeoX) both norms read the block input, which is
  then kept once.
- q, k, v projections: their shared input (the norm output) once, n·b·h·e (the SP column-parallel
  linear keeps its sharded input).
- attention core: RoPE keeps its cos and sin tables per call, 2·s·(rd/2)·e, for q and for k (rd the
  rotating dimensions, `ModelSpec.rotary_dim`: hd, or a fraction of it as in GPT-NeoX); SDPA keeps
  q, k, v (k, v repeated to nh heads for grouped-query attention), 3·s·b·(h/t)·e, its output
  s·b·(h/t)·e and the log-sum-exp b·(nh/t)·s·4. The output projection keeps its input, the output
  back in (b, s, h/t): a view of SDPA's output with learned positions (q is a transposed view of its
  projection and SDPA lays its output out like q), a copy (s·b·(h/t)·e more) after RoPE (contiguous q).
  Selective recomputation keeps instead the core's inputs (the projections' outputs,
  s·b·(nh + 2·nkv)·hd/t·e) and its output.
- MLP: GELU keeps its input, fc2 its input: 2·s·b·(f/t)·e; SwiGLU keeps gate and up outputs, the SiLU
  output and the product: 4·s·b·(f/t)·e. ReLU keeps its output instead of its input, which is the
  next op's saved input: one (b, s, f/t) tensor less. Biases add nothing (a linear's backward needs
  its input and weight only), nor do the tanh GELU, the RoPE base and scaling.
- a fully recomputed block keeps only its input, n·b·h·e.
- embedding: the token ids b·s·8, the position ids s·8 (learned positions); at TP > 1 also the local
  ids b·s·8 and the out-of-shard mask b·s·1.
- head: its norm, its input to the LM head b·s·h·e, the fp32 log-softmax b·s·v·4 over the real
  vocabulary v (`ModelSpec.vocab_size`: the logits are gathered over TP and their padding columns
  dropped), the target ids b·s·8, the loss weight and the scaled loss (4 + 4).
- the executor: the stage's last output (b·s·h·e, gathered under SP) until its backward, unless it is
  the loss; under SP the full input of the first block (b·s·h·e), counted for the layer that made it
  (the embedding) or, when the block is the stage's first layer, for that block.

One storage is counted once per micro-batch: a tensor saved by the next layer (a block's input saved
by its first norm or by its checkpoint) is counted for that next layer.
"""

from __future__ import annotations

from sailor.models import LayerKind, ModelSpec
from sailor.plan import Recompute, StageMemory

INDEX_BYTES = 8  # int64 token and position ids
LSE_BYTES = 4  # SDPA's log-sum-exp is fp32 whatever the input dtype
LOSS_BYTES = 4  # fp32 log-softmax; the loss weight and the scaled loss are fp32 scalars


def _norm_bytes(model: ModelSpec, tokens: int, e: int, sigma: int, *, with_input: bool = True) -> int:
    """What one norm keeps for `tokens` token vectors: its input (unless another op keeps it) and
    statistics (and RMSNorm's normalised input)."""
    h = model.hidden_size
    extra = tokens * sigma + tokens * h * e if model.rms_norm else 2 * tokens * sigma
    return (tokens * h * e if with_input else 0) + extra


def _mlp_tensors(model: ModelSpec) -> int:
    """(b, s, f/t) tensors the MLP keeps: the activation's input unless it is ReLU (which keeps its
    output, the next op's saved input), its output, and for a gated MLP the up projection and the
    product."""
    return (1 if model.act == "relu" else 2) + (2 if model.gated_mlp else 0)


def block_bytes(model: ModelSpec, *, mbs: int, seq: int, tp: int, elem_bytes: int, recompute: Recompute,
                sequence_parallel: bool = False, stats_bytes: int | None = None) -> int:
    """Bytes one transformer block keeps for one micro-batch (module docstring), `recompute` being
    this block's mode (`full`: this block is fully recomputed)."""
    b, s, t, e = mbs, seq, tp, elem_bytes
    sigma = e if stats_bytes is None else stats_bytes
    h, f, hd = model.hidden_size, model.ffn, model.head_dim
    n = b * (s // t if sequence_parallel else s)  # token vectors a norm sees
    if recompute is Recompute.FULL:
        return n * h * e
    # norm1, norm2 and their outputs; a parallel residual's two norms share their input
    keep = 2 * n * h * e + _norm_bytes(model, n, e, sigma) + _norm_bytes(model, n, e, sigma,
                                                                         with_input=not model.parallel_residual)
    local = b * s * (h // t) * e  # one (b, s, h/t) tensor
    if recompute is Recompute.SELECTIVE:
        keep += b * s * (model.num_heads + 2 * model.kv_heads) * hd // t * e + local
    else:
        # RoPE tables for q and k; with RoPE the output projection keeps a copy of SDPA's output.
        rope = 2 * (2 * s * (model.rotary_dim // 2) * e) + local if not model.learned_positions else 0
        keep += rope + 3 * local + local + b * (model.num_heads // t) * s * LSE_BYTES
    keep += _mlp_tensors(model) * b * s * (f // t) * e
    return keep


def embedding_bytes(model: ModelSpec, *, mbs: int, seq: int, tp: int) -> int:
    """Bytes the embedding keeps for one micro-batch (index tensors only)."""
    b, s = mbs, seq
    keep = b * s * INDEX_BYTES + (s * INDEX_BYTES if model.learned_positions else 0)
    if tp > 1:
        keep += b * s * INDEX_BYTES + b * s  # local ids, out-of-shard mask (bool)
    return keep


def head_bytes(model: ModelSpec, *, mbs: int, seq: int, elem_bytes: int, stats_bytes: int | None = None) -> int:
    """Bytes the head (final norm, LM head, loss) keeps for one micro-batch; the same at every TP
    degree (the logits are gathered before the loss)."""
    b, s, e = mbs, seq, elem_bytes
    sigma = e if stats_bytes is None else stats_bytes
    vocab = model.vocab_size  # the runtime drops the logits of its padded vocabulary's extra rows
    return (_norm_bytes(model, b * s, e, sigma) + b * s * model.hidden_size * e + b * s * vocab * LOSS_BYTES
            + b * s * INDEX_BYTES + 2 * LOSS_BYTES)


def stage_activation_bytes(model: ModelSpec, layers: tuple[int, int], memory: StageMemory, *, mbs: int, seq: int,
                           tp: int, elem_bytes: int, stats_bytes: int | None = None) -> dict[int, int]:
    """Bytes one micro-batch keeps per layer of the stage holding `layers` (half-open) under the
    stage's memory options, on one rank of a TP-`tp` replica: {layer: bytes}, summing to what the
    stage keeps per in-flight micro-batch."""
    first, end = layers
    blocks = [i for i in range(first, end) if model.layer_kind(i) is LayerKind.BLOCK]
    full = set(blocks if memory.recompute_blocks is None else blocks[:memory.recompute_blocks]) \
        if memory.recompute is Recompute.FULL else set()
    sp = memory.sequence_parallel
    full_act = mbs * seq * model.hidden_size * elem_bytes  # one full (b, s, h) activation
    out: dict[int, int] = {}
    for i in range(first, end):
        kind = model.layer_kind(i)
        if kind is LayerKind.EMBEDDING:
            out[i] = embedding_bytes(model, mbs=mbs, seq=seq, tp=tp)
        elif kind is LayerKind.HEAD:
            out[i] = head_bytes(model, mbs=mbs, seq=seq, elem_bytes=elem_bytes, stats_bytes=stats_bytes)
        else:
            mode = Recompute.FULL if i in full else (Recompute.NONE if memory.recompute is Recompute.FULL
                                                     else memory.recompute)
            out[i] = block_bytes(model, mbs=mbs, seq=seq, tp=tp, elem_bytes=elem_bytes, recompute=mode,
                                 sequence_parallel=sp, stats_bytes=stats_bytes)
    if model.layer_kind(end - 1) is not LayerKind.HEAD:
        out[end - 1] += full_act  # the stage output, kept until its backward
    if sp and blocks:
        out[max(first, blocks[0] - 1)] += full_act  # the first block's full input
    return out
