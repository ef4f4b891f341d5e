"""Tied input and output embeddings across pipeline stages (Megatron-LM / DeepSpeed `ReduceTiedGrads`).

A tied model (`ModelSpec.tied_embeddings`: GPT-2, OPT, Qwen2-0.5B...) uses one matrix as token
embedding and LM head. The runtime keeps the plan-independent layer list instead: the first stage holds
`layers.0.tok.weight`, the last `layers.<N+1>.lm.weight`, both start from the same value
(`model.initial_value`), and after each backward both copies get the sum of the two gradients, so
they take the same optimizer step and stay equal — the update of the single shared matrix. The
global gradient norm counts the matrix once (`model.tied_head` names the copy it skips).

Within a pipeline the two copies may be sharded differently (first and last replica of different TP
degree): the vocabulary rows are cut into `L = lcm(a, b)` blocks, and the ranks holding block k on
either side swap it (`exchanges`, pure). A one-stage pipeline holds both copies on each rank and adds
them locally. Pipelines are then summed by the usual data-parallel gradient sync.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sailor.models import ModelSpec
from sailor.runtime.model import EMBEDDING_WEIGHT, tied_head
from sailor.runtime.topology import Topology

TAG = 7100  # p2p tag of tied-gradient swaps (pipeline transfers use the default tag)


@dataclass(frozen=True)
class Exchange:
    """Swap rows [start, start + rows) of this rank's local shard with `peer` (global rank)."""

    peer: int
    start: int
    rows: int


def exchanges(topo: Topology, rank: int, vocab_rows: int) -> list[Exchange]:
    """The swaps rank `rank` makes with the other end of its pipeline (empty for middle stages and
    one-stage pipelines). `vocab_rows` is the padded vocabulary (rows of the full matrix); blocks are
    listed in increasing order, the same order on both sides."""
    me = topo.roles[rank]
    if me.num_stages == 1 or not (me.is_first_stage or me.is_last_stage):
        return []
    other_stage = me.num_stages - 1 if me.is_first_stage else 0
    other = sorted((r for r in topo.roles if r.pipeline == me.pipeline and r.stage == other_stage),
                   key=lambda r: r.tp_rank)
    a, b = me.tp, len(other)
    L = math.lcm(a, b)
    assert vocab_rows % L == 0, (vocab_rows, L)
    width = vocab_rows // L
    mine = range(me.tp_rank * (L // a), (me.tp_rank + 1) * (L // a))
    return [Exchange(peer=other[k // (L // b)].rank, start=(k - mine.start) * width, rows=width) for k in mine]


class TiedGrads:
    """Sums the tied embedding and LM-head gradients of one rank (module docstring); a no-op for
    untied models and for ranks that hold neither copy."""

    def __init__(self, spec: ModelSpec, params: Mapping[str, nn.Parameter], topo: Topology, rank: int,
                 vocab_rows: int) -> None:
        head = tied_head(spec)
        self.local = None
        self.swaps: list[tuple[nn.Parameter, Exchange]] = []
        if head is None:
            return
        emb, lm = params.get(EMBEDDING_WEIGHT), params.get(head)
        if emb is not None and lm is not None:
            self.local = (emb, lm)
        elif emb is not None or lm is not None:
            self.swaps = [(emb if emb is not None else lm, x) for x in exchanges(topo, rank, vocab_rows)]

    def sync(self) -> None:
        """Make both copies' `.grad` the sum of the two (collective with the other end's ranks)."""
        if self.local is not None:
            emb, lm = self.local
            total = _grad(emb) + _grad(lm)
            emb.grad.copy_(total)
            lm.grad.copy_(total)
            return
        if not self.swaps:
            return
        ops, recvs = [], []
        for p, x in self.swaps:
            mine = _grad(p).narrow(0, x.start, x.rows)
            theirs = torch.empty_like(mine)
            ops += [dist.P2POp(dist.isend, mine.contiguous(), x.peer, tag=TAG),
                    dist.P2POp(dist.irecv, theirs, x.peer, tag=TAG)]
            recvs.append((mine, theirs))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for mine, theirs in recvs:
            mine.add_(theirs)


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
