"""Megatron-style tensor parallelism applied to a plain GPT stage (Shoeybi et al. 2019, §3).

`apply_tp` swaps modules in place, keeping every parameter's canonical name:
- q, k, v, fc1 / gate, up -> `ColumnParallelLinear` (output features split, whole heads per rank);
- o, fc2 / down           -> `RowParallelLinear` (input features split, one all-reduce, bias replicated);
- the token embedding     -> `VocabParallelEmbedding` (vocabulary rows split, one all-reduce);
- the head                -> `VocabParallelHead`: the LM head's vocabulary rows split
  (`ParallelLMHead`), and its loss (`head_loss`) the vocab-parallel cross-entropy
  (`vocab_parallel_loss_sum`, Megatron-LM's `vocab_parallel_cross_entropy`): each rank keeps the
  logits of its vocabulary shard only; no rank ever holds all V logits, or an fp32 copy of them.
- an MoE MLP             -> its experts' and shared experts' SwiGLUs split like the dense MLP, with
  one copy-in of the input and one all-reduce of all expert outputs (`moe.MoEMLP.shard`); its
  router and shared gate replicated. Per-head q and k norms (`qk_norm`) are replicated, their
  gradients partial sums over each rank's heads (`grad_weight`).
Norms and the position table stay replicated. `shard_dim` is the table of which parameter is split
along which dimension; checkpoints and gradient sync use the same table.

Communication (f and g of Megatron): `copy_to_tp` is identity forward / all-reduce backward,
`reduce_from_tp` all-reduce forward / identity backward; the loss's own all-reduces are in
`_VocabParallelCE`. With TP 1 nothing is swapped.

Sequence parallelism (`sequence_parallel=True`; Korthikanti et al. 2022, §4.2.2): inside the stage's
transformer blocks the activations between the TP regions are split along the sequence, so norms and
residual adds work on T/t tokens. A column-parallel linear all-gathers its input along the sequence
(g) and keeps only its own slice for backward, gathering it again there; a row-parallel linear
reduce-scatters its output along the sequence (ḡ) instead of all-reducing it. Where a run of
blocks (one chunk's) follows the embedding, its first block takes this rank's slice of the (full)
input; where it precedes the head, its last block all-gathers its output, so the embedding and the
head see full (B, T, h) activations as without SP. At a stage boundary nothing is gathered or
sliced (`sliced_edges`): the chunk receives and sends this rank's sequence slice, which is exactly
the slice the scatter-gather boundary moves (`runtime.pipeline`). The
replicated parameters inside the blocks (norms, row-parallel biases) then see only this rank's tokens:
their gradients are partial sums that gradient sync adds over the TP group (`grad_weight`).
Shapes are batch-first: the sequence is dim 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sailor.runtime.model import Block, Embedding, Head, lm_loss_sum
from sailor.runtime.moe import MoEMLP

_COLUMN = ("attn.q", "attn.k", "attn.v", "mlp.fc1", "mlp.gate", "mlp.up")
_ROW = ("attn.o", "mlp.fc2", "mlp.down")
_BLOCK_PARTS = ("norm1", "attn", "norm2", "mlp")  # submodules of a `Block`
_EXPERT_PREFIXES = ("mlp.experts.", "mlp.shared.")  # SwiGLUs of a `moe.MoEMLP`
_PARTIAL = ("attn.q_norm", "attn.k_norm")  # replicated, but each TP rank applies them to its own heads


def shard_dim(name: str) -> int | None:
    """Dimension along which canonical parameter `name` is split over TP ranks (None: replicated).
    The SwiGLUs of an MoE MLP (`mlp.experts.<j>.*`, `mlp.shared.*`) split like a dense MLP; its
    router and shared gate are replicated."""
    module, leaf = name.rsplit(".", 1)
    local = module.split(".", 2)[-1]  # strip "layers.<i>."
    if local.startswith(_EXPERT_PREFIXES):
        local = "mlp." + local.rsplit(".", 1)[-1]  # mlp.experts.3.gate -> mlp.gate
    if local in _COLUMN:
        return 0
    if local in _ROW:
        return 1 if leaf == "weight" else None
    if local in ("tok", "lm"):
        return 0
    return None


def grad_weight(name: str, tp: int, sequence_parallel: bool) -> float:
    """Weight of this rank's gradient of `name` in the sample-weighted gradient SUM over the ranks
    holding it (`runtime.buckets`): 1 for a TP shard; for a replicated parameter 1/tp when every TP
    rank holds the same whole gradient, 1 when each holds a partial sum: over its sequence slice
    (replicated parameters inside the blocks of a sequence-parallel stage), or over its own heads
    (the per-head q and k norms of `qk_norm`)."""
    if shard_dim(name) is not None:
        return 1.0
    if name.rsplit(".", 1)[0].split(".", 2)[-1] in _PARTIAL:
        return 1.0
    in_block = name.split(".", 2)[-1].split(".", 1)[0] in _BLOCK_PARTS
    return 1.0 if sequence_parallel and in_block else 1.0 / tp


def shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank `tp_rank`'s contiguous slice of `full` along `dim` (a copy; `full` itself if replicated)."""
    if dim is None or tp == 1:
        return full
    assert full.shape[dim] % tp == 0, (full.shape, dim, tp)
    return full.chunk(tp, dim=dim)[tp_rank].contiguous()


def materialize_shards(stage: nn.Module, shard_value, *, tp: int, device: torch.device, prefix: str = "") -> None:
    """Allocate `stage`'s (meta, TP-sharded) parameters on `device` and fill each with
    `shard_value(name, dim, full_shape)`: this rank's shard along `dim` (`shard_dim(name)`; None:
    replicated) of the parameter whose full, unsharded shape is `full_shape`. `stage` may be one
    layer of a stage: `prefix` ("layers.<i>.") then makes its parameter names canonical."""
    full = {}
    for name, p in stage.named_parameters(prefix=prefix.rstrip(".")):
        shape, dim = list(p.shape), shard_dim(name)
        if dim is not None:
            shape[dim] *= tp
        full[name] = tuple(shape)
    stage.to_empty(device=device)
    with torch.no_grad():
        for name, p in stage.named_parameters(prefix=prefix.rstrip(".")):
            p.copy_(shard_value(name, shard_dim(name), full[name]))


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


# ---- sequence parallelism: the sequence is dim 1 of (B, T, ...) --------------------------------
def _seq_gather(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the sequence: (B, T/t, ...) on each rank -> (B, T, ...) (a new tensor)."""
    t = dist.get_world_size(group)
    parts = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # (t·B, T/t, ...)
    dist.all_gather_single(parts, x.contiguous(), group=group)
    return parts.view(t, *x.shape).transpose(0, 1).reshape(x.shape[0], t * x.shape[1], *x.shape[2:])


def _seq_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the TP ranks, each keeping its slice of the sequence: (B, T, ...) -> (B, T/t, ...)."""
    t = dist.get_world_size(group)
    B, T = x.shape[0], x.shape[1]
    parts = x.reshape(B, t, T // t, *x.shape[2:]).transpose(0, 1).reshape(t * B, T // t, *x.shape[2:])
    out = torch.empty((B, T // t, *x.shape[2:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, parts, group=group)  # parts: (t·B, T/t, ...), rank r's slice r-th
    return out


def _seq_slice(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the sequence (a new, contiguous tensor)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(t, dim=1)[r].contiguous()


def _seq_function(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function x -> forward(x, group) whose backward is grad -> backward(grad, group)."""
    run_forward, run_backward = forward, backward

    class _Seq(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return run_forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return run_backward(grad, ctx.group), None

    _Seq.__name__ = _Seq.__qualname__ = name
    return _Seq


# Enter the SP region: full (B, T, h), the same on every TP rank -> own slice; the gradient of the
# full input is the gathered gradient of the slices (every rank gets all of it).
_ScatterSeq = _seq_function("_ScatterSeq", _seq_slice, _seq_gather)
# Leave the SP region: own slice -> full (B, T, h). Every TP rank computes the same loss from the
# full tensor, so the gradient of its slice is its slice of the (identical) full gradient.
_GatherSeq = _seq_function("_GatherSeq", _seq_gather, _seq_slice)
# Row-parallel output under SP: partial (B, T, h) -> summed slice (B, T/t, h); backward gathers.
_ReduceScatterSeq = _seq_function("_ReduceScatterSeq", _seq_reduce_scatter, _seq_gather)


class _SPColumnLinear(torch.autograd.Function):
    """Column-parallel linear under SP: gather the sequence, then x Wᵀ + b. Saves only the sharded
    input (B, T/t, in) and gathers it again in backward (Korthikanti et al. 2022, §4.2.2); the input
    gradient (B, T, in) is reduce-scattered back to the slices."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_seq_gather(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = _seq_gather(x, ctx.group)  # (B, T, in)
        grad_in = _seq_reduce_scatter(grad.matmul(weight), ctx.group)  # (B, T/t, in)
        g2 = grad.reshape(-1, grad.shape[-1])  # (B·T, out/t)
        grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_in, grad_w, grad_b, None


def _empty_param(*shape: int, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device))


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's output features split: (B, T, in) -> (B, T, out / tp); with sequence
    parallelism (B, T / tp, in) -> (B, T, out / tp)."""

    def __init__(self, base: nn.Linear, tp: int, group, sequence_parallel: bool = False) -> None:
        super().__init__()
        out_f, in_f = base.weight.shape
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _empty_param(out_f // tp, in_f, device=base.weight.device)
        self.bias = _empty_param(out_f // tp, device=base.weight.device) if base.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _SPColumnLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input features split: (B, T, in / tp) -> (B, T, out), summed over TP;
    with sequence parallelism -> (B, T / tp, out), reduce-scattered along the sequence."""

    def __init__(self, base: nn.Linear, tp: int, group, sequence_parallel: bool = False) -> None:
        super().__init__()
        out_f, in_f = base.weight.shape
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _empty_param(out_f, in_f // tp, device=base.weight.device)
        self.bias = _empty_param(out_f, device=base.weight.device) if base.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = _ReduceScatterSeq.apply(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split: (B, T) ids -> (B, T, h), summed over TP."""

    def __init__(self, base: nn.Embedding, tp_rank: int, tp: int, group) -> None:
        super().__init__()
        vocab, h = base.weight.shape
        self.group = group
        self.start, self.end = tp_rank * vocab // tp, (tp_rank + 1) * vocab // tp
        self.weight = _empty_param(vocab // tp, h, device=base.weight.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(x, self.group)


class ParallelLMHead(nn.Module):
    """LM head with the vocabulary split: (B, T, h) -> (B, T, w) logits of this rank's rows
    [start, start + w) of the real vocabulary (w = `width`; rows past the real vocabulary, the
    padding, give no logit and so no gradient, as in `model.Head`)."""

    def __init__(self, base: nn.Linear, tp_rank: int, tp: int, group, vocab: int) -> None:
        super().__init__()
        padded, h = base.weight.shape
        rows = padded // tp
        self.group, self.start = group, tp_rank * rows
        self.width = max(0, min(rows, vocab - self.start))
        self.weight = _empty_param(rows, h, device=base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.width == self.weight.shape[0] else self.weight[: self.width]
        return F.linear(copy_to_tp(x, self.group), w)


class VocabParallelHead(nn.Module):
    """`model.Head` under TP (same parameter names): final norm, then this rank's vocabulary shard of
    the logits, (B, T, h) -> (B, T, w); `loss_sum` is its loss."""

    def __init__(self, base: Head, tp_rank: int, tp: int, group) -> None:
        super().__init__()
        self.norm = base.norm
        self.vocab = base.vocab
        self.lm = ParallelLMHead(base.lm, tp_rank, tp, group, base.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.norm(x))

    def all_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's shard put together, for a caller that needs whole logits (inference, tests;
        training never does): collective over the TP group, (B, T, w) -> (B, T, vocab)."""
        rows = self.lm.weight.shape[0]
        padded = F.pad(logits, (0, rows - logits.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(self.lm.group))]
        dist.all_gather(parts, padded, group=self.lm.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab]

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`vocab_parallel_loss_sum` of this rank's shard `logits`: (B, T, w), (B, T) -> () fp32."""
        return vocab_parallel_loss_sum(logits, targets, start=self.lm.start, group=self.lm.group)


def _shard_targets(targets: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """(N,) target ids -> their index in the shard [start, start + width), -1 where the target is
    another shard's."""
    local = targets - start
    return local.masked_fill((local < 0) | (local >= width), -1)


def _shard_max(logits: torch.Tensor) -> torch.Tensor:
    """(N, w) -> (N,) fp32 row maxima (-inf for a shard of padding only, w = 0)."""
    if logits.shape[1] == 0:
        return torch.full((logits.shape[0],), float("-inf"), device=logits.device)
    return logits.max(dim=-1).values.float()


def _shard_sums(logits: torch.Tensor, local: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(2, N) fp32: Σ exp(logit − m) over the shard, and the target's logit where the shard holds it
    (0 elsewhere)."""
    both = torch.zeros(2, logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[1]:
        # one fp32 temporary of the shard's size (a copy even when the logits are fp32: they are saved)
        both[0] = logits.to(torch.float32, copy=True).sub_(m.unsqueeze(1)).exp_().sum(dim=-1)
        picked = logits.gather(1, local.clamp(min=0).unsqueeze(1)).squeeze(1).float()
        both[1] = torch.where(local >= 0, picked, 0.0)
    return both


def _shard_grad(logits: torch.Tensor, lse: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """d (Σ loss) / d logits of the shard, (N, w) fp32: softmax − onehot(target)."""
    p = logits.to(torch.float32, copy=True).sub_(lse.unsqueeze(1)).exp_()
    rows = torch.nonzero(local >= 0).squeeze(1)
    p[rows, local[rows]] -= 1.0
    return p


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:  # None: one rank holds the whole vocabulary
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCE(torch.autograd.Function):
    """Sum over tokens of the cross-entropy, from each TP rank's vocabulary shard of the logits.

    Forward (per token, over the TP group; Megatron-LM `tensor_parallel/cross_entropy.py`, Shoeybi
    et al. 2019 §3): m = max of the logits (all-reduce MAX); S = Σ exp(logit − m) and the target's
    logit z_y (held by one rank, 0 elsewhere) in one all-reduce SUM; loss = log S + m − z_y.
    Backward: this shard's d loss / d logits = softmax − onehot(y), from the saved logits and
    lse = m + log S (no communication: each rank's shard gradient is local). Saved: the shard's
    logits (compute dtype), lse (fp32) and the shard-local target index (int64, −1 when the target
    is another rank's). The fp32 temporaries are the shard's size, freed when the call returns.
    """

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        local = _shard_targets(targets, start, logits.shape[1])  # (N,) int64
        m = _all_reduce(_shard_max(logits), dist.ReduceOp.MAX, group)
        both = _all_reduce(_shard_sums(logits, local, m), dist.ReduceOp.SUM, group)
        lse = m + both[0].log()
        ctx.save_for_backward(logits, lse, local)
        return (lse - both[1]).sum()

    @staticmethod
    def backward(ctx, grad):
        logits, lse, local = ctx.saved_tensors
        return _shard_grad(logits, lse, local).mul_(grad).to(logits.dtype), None, None, None


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, *, start: int, group) -> torch.Tensor:
    """Sum over tokens of the next-token cross-entropy (nats, fp32), computed from this TP rank's
    shard of the logits, vocabulary ids [start, start + w): (B, T, w), (B, T) int64 -> () (the same
    value on every rank of `group`; `_VocabParallelCE`). Equals `model.lm_loss_sum` of the full
    logits up to rounding."""
    return _VocabParallelCE.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), start, group)


def head_loss(stage: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss the output of `stage`'s head takes: its vocab-parallel loss under TP
    (`VocabParallelHead.loss_sum`), `model.lm_loss_sum` otherwise (the stage's head, if any, then
    returns all logits)."""
    for m in stage.modules():
        if isinstance(m, VocabParallelHead):
            return m.loss_sum
    return lm_loss_sum


def apply_tp(stage: nn.Module, *, tp_rank: int, tp: int, group, sequence_parallel: bool = False) -> nn.Module:
    """Swap `stage`'s layers for their TP-sharded versions in place (module docstring); returns it.

    Run it before weights are materialised: the new parameters are uninitialised, with the shard's
    shape, on the device of the ones they replace (typically `meta`). `sequence_parallel` needs
    tp > 1 and at least one block in the stage (checked by `runtime.validate`).
    """
    if tp == 1:
        assert not sequence_parallel, "sequence parallelism needs TP > 1"
        return stage
    sp = sequence_parallel
    for name, module in list(stage.named_modules()):
        local = name.split(".", 2)[-1] if name.startswith("layers.") else name
        parent_name, _, child = name.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        new: nn.Module | None = None
        if isinstance(module, nn.Linear) and local in _COLUMN:
            new = ColumnParallelLinear(module, tp, group, sp)
        elif isinstance(module, nn.Linear) and local in _ROW:
            new = RowParallelLinear(module, tp, group, sp)
        elif isinstance(module, nn.Embedding) and isinstance(parent, Embedding) and child == "tok":
            new = VocabParallelEmbedding(module, tp_rank, tp, group)
        elif isinstance(module, Head):
            new = VocabParallelHead(module, tp_rank, tp, group)
        elif isinstance(module, MoEMLP):
            assert not sp, "sequence parallelism with MoE blocks is refused by Plan.check_against"
            module.shard(tp, lambda x: copy_to_tp(x, group), lambda x: reduce_from_tp(x, group))
        if new is not None:
            setattr(parent, child, new)
    if sp:
        blocks = [(int(i), m) for i, m in stage.layers.items() if isinstance(m, Block)]
        assert blocks, "sequence parallelism needs a block in the stage"
        held = {int(i) for i in stage.layers}
        # one run of consecutive blocks per chunk (interleaved stages hold several, never adjacent);
        # its ends next to a stage boundary stay sliced (`sliced_edges`)
        starts = [n for n in range(len(blocks)) if n == 0 or blocks[n][0] != blocks[n - 1][0] + 1]
        for a, b in zip(starts, starts[1:] + [len(blocks)]):
            if blocks[a][0] - 1 in held:
                blocks[a][1].register_forward_pre_hook(lambda module, args: (_ScatterSeq.apply(args[0], group),))
            if blocks[b - 1][0] + 1 in held:
                blocks[b - 1][1].register_forward_hook(lambda module, args, out: _GatherSeq.apply(out, group))
    return stage


def sliced_edges(stage: nn.Module, chunks: Sequence[tuple[int, int]], *,
                 sequence_parallel: bool) -> tuple[tuple[bool, bool], ...]:
    """For each chunk (half-open layer range) of `stage` (layers outside the stage deleted,
    `pipeline.build_stage`): whether its input and its output cross a stage boundary as this rank's
    sequence slice (B, T/t, h) rather than the full (B, T, h) tensor. Under sequence parallelism an
    edge is sliced when the chunk's first (last) layer is a block whose previous (next) layer the
    stage does not hold: `apply_tp` then neither slices the input nor gathers the output there
    (module docstring). All False without sequence parallelism."""
    held = {int(i) for i in stage.layers}
    out = []
    for a, e in chunks:
        first, last = stage.layers[str(a)], stage.layers[str(e - 1)]
        out.append((sequence_parallel and isinstance(first, Block) and a - 1 not in held,
                    sequence_parallel and isinstance(last, Block) and e not in held))
    return tuple(out)
