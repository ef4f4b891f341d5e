"""Tied input and output embeddings across pipeline stages (Megatron-LM / DeepSpeed `ReduceTiedGrads`),
in the sharded optimizer's terms.

A tied model (`ModelSpec.tied_embeddings`: GPT-2, OPT, Qwen2-0.5B...) uses one matrix as token
embedding and LM head. The runtime keeps the plan-independent layer list instead: the first stage holds
`layers.0.tok.weight`, the last `layers.<N+1>.lm.weight`, both start from the same value
(`model.initial_value`), and each step both copies get the sum of the two gradients, so they take the
same optimizer step and stay equal — the update of the single shared matrix.

Where the sum is made: after the step's gradient reduction (`zero.ShardedAdamW.reduce`), a rank holds,
for each element of its copy it owns (`buckets`), that copy's gradient summed over the pipelines. The
matrix's gradient is the sum of both copies' sums (the reduction is a plain SUM), so every holder of an
element of one copy adds the same element of the other copy, received from one rank that holds it.
The holders come from the same bucket layout the optimizer uses (`holdings`): under ZeRO >= 1 each
element of a copy has one owner among all pipelines, under ZeRO-0 one holder per pipeline (the sender
is then the one in the receiver's pipeline). The first and last stage may differ in TP degree and
ZeRO stage; each piece of each transfer is a contiguous run of the full matrix's row-major elements
(`twin_transfers`, pure, tested without process groups). A one-stage pipeline holds both copies: its
transfers may be local. So no gradient is kept beyond what the stage's ZeRO stage keeps, and each
element of a copy crosses once per step to each of its holders (under ZeRO >= 1: once).

The global gradient norm counts the matrix once: the LM head's copy is left out (`Tied.copy`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sailor.model.spec import ModelSpec
from sailor.plan.spec import Plan
from sailor.runtime.buckets import Bucket, build_buckets, held_elements
from sailor.runtime.model import EMBEDDING_WEIGHT, Embedding, Head, on_meta, tied_head
from sailor.runtime.tensor_parallel import shard_dim
from sailor.runtime.topology import RankRole, Topology

TAG = 7100  # p2p tag of tied-gradient transfers (pipeline transfers go on their own groups, untagged)


@dataclass(frozen=True)
class Transfer:
    """After the reduction, rank `dst` adds to its elements [lo, hi) of `dst_name` (full row-major
    indices of the matrix) the same elements of `src_name` as rank `src` holds them."""

    src: int
    src_name: str
    dst: int
    dst_name: str
    lo: int
    hi: int


@dataclass(frozen=True)
class Tied:
    """What one rank's optimizer does for the tied matrix (`zero.ShardedAdamW(tied=...)`)."""

    copy: str  # the LM head's name: its elements are left out of the gradient norm
    transfers: tuple[Transfer, ...]  # those this rank sends or receives, in one order on every rank


@dataclass(frozen=True)
class Holding:
    """Elements [lo, hi) of copy `name` that rank `rank` (of pipeline `pipeline`) holds after the
    reduction."""

    rank: int
    pipeline: int
    name: str
    lo: int
    hi: int


def _copy_params(spec: ModelSpec, role: RankRole) -> dict[str, torch.Tensor]:
    """Meta tensors, with this rank's TP-shard shapes, of the parameters of its stage's embedding and
    head layers (the layers whose buckets hold a copy), named and ordered as in its stage."""
    last = spec.num_layers - 1
    out = {}
    for index, layer in ((0, Embedding), (last, Head)):
        if not any(a <= index < b for a, b in role.chunks):
            continue
        with on_meta():
            module = layer(spec)
        for local, p in module.named_parameters():
            name = f"layers.{index}.{local}"
            dim, shape = shard_dim(name), list(p.shape)
            if dim is not None:
                shape[dim] //= role.tp
            out[name] = torch.empty(shape, device="meta")
    return out


def holdings(spec: ModelSpec, topo: Topology) -> list[Holding]:
    """What every rank holding a copy holds of it after the reduction, from its buckets
    (`buckets.build_buckets` with its stage's ZeRO stage, as its optimizer builds them)."""
    names = (EMBEDDING_WEIGHT, tied_head(spec))
    out = []
    for role in topo.roles:
        params = _copy_params(spec, role)
        if not any(n in params for n in names):
            continue
        buckets = build_buckets(params, role, zero=role.memory.zero, sequence_parallel=role.memory.sequence_parallel)
        for name in names:
            if name in params:
                rows = params[name].shape[0]
                for h in held_elements(buckets, name, first_row=role.tp_rank * rows, row_numel=spec.hidden_size):
                    out.append(Holding(role.rank, role.pipeline, name, h.lo, h.hi))
    return out


def twin_transfers(spec: ModelSpec, plan: Plan, topo: Topology) -> list[Transfer]:
    """Every transfer of the tied matrix's gradient in one step (module docstring), in one order;
    empty for an untied model. Each element of each copy's holders is received exactly once."""
    head = tied_head(spec)
    if head is None:
        return []
    held = holdings(spec, topo)
    stage_of = {EMBEDDING_WEIGHT: 0, head: plan.num_stages - 1}
    out = []
    for mine, twin in ((EMBEDDING_WEIGHT, head), (head, EMBEDDING_WEIGHT)):
        per_pipeline = topo.stage_memory(stage_of[twin]).zero == 0  # every pipeline holds all of the twin
        senders = [h for h in held if h.name == twin]
        for r in (h for h in held if h.name == mine):
            for s in senders:
                lo, hi = max(r.lo, s.lo), min(r.hi, s.hi)
                if lo < hi and (not per_pipeline or s.pipeline == r.pipeline):
                    out.append(Transfer(s.rank, twin, r.rank, mine, lo, hi))
    return sorted(out, key=lambda t: (t.src, t.dst, t.dst_name, t.lo))


def tied_for_rank(spec: ModelSpec, plan: Plan, topo: Topology, rank: int) -> Tied | None:
    """This rank's part in the tied matrix's gradient (None for an untied model)."""
    head = tied_head(spec)
    if head is None:
        return None
    mine = tuple(t for t in twin_transfers(spec, plan, topo) if rank in (t.src, t.dst))
    return Tied(copy=head, transfers=mine)


Twin = tuple[bool, int, int, int, int]  # (send, peer, bucket, start, end): owned-shard offsets


def twin_ranges(buckets: Sequence[Bucket], params: Mapping[str, torch.Tensor], role: RankRole,
                tied: Tied | None) -> tuple[list[list[tuple[int, int]]], list[Twin]]:
    """For one rank's optimizer (`zero.ShardedAdamW`): per bucket, the owned [start, end) ranges the
    gradient norm counts (all but the tied head's), and each of `tied`'s transfers this rank takes
    part in as (send, peer, bucket, start, end) in owned-shard offsets (None: untied, no transfers)."""
    counted = [[(0, b.shard_numel)] for b in buckets]
    twins: list[Twin] = []
    if tied is None:
        return counted, twins
    held = {}  # copy name -> where this rank's owned elements of it lie
    for name in {tied.copy} | {t.src_name for t in tied.transfers} | {t.dst_name for t in tied.transfers}:
        if name in params:
            p = params[name]
            held[name] = held_elements(buckets, name, first_row=role.tp_rank * p.shape[0],
                                       row_numel=p.numel() // p.shape[0])
    for h in held.get(tied.copy, []):
        counted[h.bucket] = _minus(counted[h.bucket], h.at, h.at + h.hi - h.lo)

    def local(name: str, lo: int, hi: int) -> tuple[int, int, int]:
        h = next(h for h in held[name] if h.lo <= lo and hi <= h.hi)  # a transfer lies in one range
        return h.bucket, h.at + lo - h.lo, h.at + hi - h.lo

    for t in tied.transfers:
        if t.src == role.rank:
            twins.append((True, t.dst, *local(t.src_name, t.lo, t.hi)))
        if t.dst == role.rank:
            twins.append((False, t.src, *local(t.dst_name, t.lo, t.hi)))
    return counted, twins


def add_twins(twins: Sequence[Twin], grad: Sequence[torch.Tensor], rank: int, device: torch.device) -> None:
    """Add to each held element of a tied copy the other copy's (module docstring): `grad[i]` is
    bucket i's owned reduced gradient (fp32). What is sent is taken before anything is added; a
    transfer to this rank itself is a local add. Point-to-point on the world group, tag `TAG`."""
    if not twins:
        return
    sent = [(peer, grad[i][a:c].clone()) for send, peer, i, a, c in twins if send]
    local = [buf for peer, buf in sent if peer == rank]
    recvs = [(peer, i, a, c) for send, peer, i, a, c in twins if not send]
    bufs = [local.pop(0) if peer == rank else torch.empty(c - a, dtype=torch.float32, device=device)
            for peer, i, a, c in recvs]
    ops = [dist.P2POp(dist.isend, buf, peer, tag=TAG) for peer, buf in sent if peer != rank]
    ops += [dist.P2POp(dist.irecv, buf, peer, tag=TAG) for (peer, *_), buf in zip(recvs, bufs) if peer != rank]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for (_, i, a, c), buf in zip(recvs, bufs):
        grad[i][a:c].add_(buf)


def _minus(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """`ranges` (disjoint [start, end) pairs) without [lo, hi)."""
    out = []
    for a, b in ranges:
        out += [(x, y) for x, y in ((a, min(b, lo)), (max(a, hi), b)) if x < y]
    return out
