"""Megatron-style tensor parallelism applied to a plain GPT stage (Shoeybi et al. 2019, §3).

`apply_tp` swaps modules in place, keeping every parameter's canonical name:
- q, k, v, fc1 / gate, up -> `ColumnParallelLinear` (output features split, whole heads per rank);
- o, fc2 / down           -> `RowParallelLinear` (input features split, one all-reduce, bias replicated);
- the token embedding     -> `VocabParallelEmbedding` (vocabulary rows split, one all-reduce);
- the LM head             -> `ParallelLMHead` (vocabulary split; logits all-gathered so the loss is
  the plain cross-entropy: the simple equivalent of Megatron's vocab-parallel loss).
Norms and the position table stay replicated. `shard_dim` is the table of which parameter is split
along which dimension; checkpoints and gradient sync use the same table.

Communication (f and g of Megatron): `copy_to_tp` is identity forward / all-reduce backward,
`reduce_from_tp` all-reduce forward / identity backward, `gather_from_tp` all-gather of the last
dimension forward / own slice backward. With TP 1 nothing is swapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sailor.runtime.model import Embedding, Head

_COLUMN = ("attn.q", "attn.k", "attn.v", "mlp.fc1", "mlp.gate", "mlp.up")
_ROW = ("attn.o", "mlp.fc2", "mlp.down")


def shard_dim(name: str) -> int | None:
    """Dimension along which canonical parameter `name` is split over TP ranks (None: replicated)."""
    module, leaf = name.rsplit(".", 1)
    local = module.split(".", 2)[-1]  # strip "layers.<i>."
    if local in _COLUMN:
        return 0
    if local in _ROW:
        return 1 if leaf == "weight" else None
    if local in ("tok", "lm"):
        return 0
    return None


def shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank `tp_rank`'s contiguous slice of `full` along `dim` (a copy; `full` itself if replicated)."""
    if dim is None or tp == 1:
        return full
    assert full.shape[dim] % tp == 0, (full.shape, dim, tp)
    return full.chunk(tp, dim=dim)[tp_rank].contiguous()


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


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        # Every TP rank computes the same loss from the gathered logits, so its gradient w.r.t. its
        # own shard is just its slice of the full gradient (no reduction).
        return grad[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous(), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromTP.apply(x, group)


def _empty_param(*shape: int, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device))


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's output features split: (B, T, in) -> (B, T, out / tp)."""

    def __init__(self, base: nn.Linear, tp: int, group) -> None:
        super().__init__()
        out_f, in_f = base.weight.shape
        self.group = group
        self.weight = _empty_param(out_f // tp, in_f, device=base.weight.device)
        self.bias = _empty_param(out_f // tp, device=base.weight.device) if base.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input features split: (B, T, in / tp) -> (B, T, out), summed over TP."""

    def __init__(self, base: nn.Linear, tp: int, group) -> None:
        super().__init__()
        out_f, in_f = base.weight.shape
        self.group = group
        self.weight = _empty_param(out_f, in_f // tp, device=base.weight.device)
        self.bias = _empty_param(out_f, device=base.weight.device) if base.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
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
    """LM head with the vocabulary split: (B, T, h) -> (B, T, V) full logits (all-gathered)."""

    def __init__(self, base: nn.Linear, tp: int, group) -> None:
        super().__init__()
        vocab, h = base.weight.shape
        self.group = group
        self.weight = _empty_param(vocab // tp, h, device=base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_tp(F.linear(copy_to_tp(x, self.group), self.weight), self.group)


def apply_tp(stage: nn.Module, *, tp_rank: int, tp: int, group) -> nn.Module:
    """Swap `stage`'s layers for their TP-sharded versions in place (module docstring); returns it.

    Run it before weights are materialised: the new parameters are uninitialised, with the shard's
    shape, on the device of the ones they replace (typically `meta`).
    """
    if tp == 1:
        return stage
    for name, module in list(stage.named_modules()):
        local = name.split(".", 2)[-1] if name.startswith("layers.") else name
        parent_name, _, child = name.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        new: nn.Module | None = None
        if isinstance(module, nn.Linear) and local in _COLUMN:
            new = ColumnParallelLinear(module, tp, group)
        elif isinstance(module, nn.Linear) and local in _ROW:
            new = RowParallelLinear(module, tp, group)
        elif isinstance(module, nn.Embedding) and isinstance(parent, Embedding) and child == "tok":
            new = VocabParallelEmbedding(module, tp_rank, tp, group)
        elif isinstance(module, nn.Linear) and isinstance(parent, Head) and child == "lm":
            new = ParallelLMHead(module, tp, group)
        if new is not None:
            setattr(parent, child, new)
    return stage
