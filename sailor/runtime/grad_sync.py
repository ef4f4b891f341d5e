"""Data-parallel gradient synchronisation across replicas of different TP degrees, and clipping.

Before sync, each rank's `.grad` holds its pipeline's share of the global-batch gradient: every
micro-batch loss was scaled by 1 / (global batch tokens), so the gradient is
(samples of this pipeline / global batch) x (mean gradient over this pipeline's samples). Summing the
pipelines' shares therefore gives exactly the mean gradient over the global batch, however unequal
the shares are: the all-reduce is a plain SUM of sample-weighted gradients.

Which ranks sum which elements comes from `topology` (one group per block of the finest sharding of
a stage; the whole stage for replicated parameters). Elements with the same group travel in one flat
buffer, so a homogeneous plan does one all-reduce per stage. A replicated parameter is held by all
`tp` ranks of a replica with the same gradient, so each copy is weighted by 1 / tp.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import torch
import torch.distributed as dist
from torch import nn

from sailor.runtime.tensor_parallel import shard_dim
from sailor.runtime.topology import RankRole, Ranks

# One piece of a bucket: (parameter, dim or None, start, length along dim, weight).
_Piece = tuple[nn.Parameter, int | None, int, int, float]


class GradSync:
    """Sums the gradients of one stage's parameters over the ranks that hold each block.

    Args:
        params: this rank's parameters by canonical name (TP shards).
        role: this rank's role (TP degree, blocks and their groups).
        groups: torch process group per rank tuple (from `groups.create_groups`).
    """

    def __init__(self, params: Mapping[str, nn.Parameter], role: RankRole, groups: Mapping[Ranks, object]) -> None:
        self.buckets: dict[Ranks, list[_Piece]] = {}
        self.groups = groups
        per_rank = role.sync_blocks // role.tp  # blocks of the finest sharding this rank holds
        for name, p in params.items():
            dim = shard_dim(name) if role.tp > 1 or role.sync_blocks > 1 else None
            if dim is None:
                self.buckets.setdefault(role.stage_group, []).append((p, None, 0, 0, 1.0 / role.tp))
                continue
            width = p.shape[dim] // per_rank
            for b, ranks in enumerate(role.block_groups):
                self.buckets.setdefault(ranks, []).append((p, dim, b * width, width, 1.0))

    def sync(self) -> None:
        """All-reduce (SUM) every bucket among its ranks, in place in `.grad`."""
        for ranks, pieces in self.buckets.items():
            views = [_view(p, dim, start, n) for p, dim, start, n, _ in pieces]
            if len(ranks) == 1:
                continue  # a block only this rank holds: nothing to add (weights are 1 there)
            flat = torch.cat([(v * w).reshape(-1) for v, (_, _, _, _, w) in zip(views, pieces)])
            dist.all_reduce(flat, group=self.groups[ranks])
            offset = 0
            for v in views:
                v.copy_(flat[offset:offset + v.numel()].view_as(v))
                offset += v.numel()


def _view(p: nn.Parameter, dim: int | None, start: int, n: int) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad if dim is None else p.grad.narrow(dim, start, n)


def clip_grad_norm(params: Mapping[str, nn.Parameter], role: RankRole, max_norm: float,
                   copies: Collection[str] = ()) -> float:
    """Clip all gradients of the model (every rank's shards together) to global L2 norm `max_norm`,
    as `torch.nn.utils.clip_grad_norm_` would on the whole model; returns the norm before clipping.
    `copies` are parameters that duplicate another (a tied LM head): clipped, not counted.

    After sync every pipeline holds the same gradients, so each rank counts its squares with weight
    1 / D (1 / (D x tp) for parameters its TP group replicates) and one SUM over the world gives
    the squared norm of the single model.
    """
    device = next(iter(params.values())).device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for name, p in params.items():
        if p.grad is None or name in copies:
            continue
        w = 1.0 / role.num_pipelines / (role.tp if shard_dim(name) is None else 1)
        sq += w * p.grad.detach().double().pow(2).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    norm = math.sqrt(sq.item())
    coef = min(1.0, max_norm / (norm + 1e-6))  # the same epsilon as torch's clip_grad_norm_
    for p in params.values():
        if p.grad is not None:
            p.grad.mul_(coef)
    return norm
