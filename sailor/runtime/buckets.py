"""Which elements of a stage's parameters each rank reduces, shards and updates, and with whom.

Gradient sum. Before reduction each rank's gradient holds its pipeline's share of the global-batch
gradient: every micro-batch loss was scaled by 1 / (global batch tokens), so the gradient is
(samples of this pipeline / global batch) x (mean gradient over this pipeline's samples). Summing the
pipelines' shares gives exactly the mean gradient over the global batch however unequal the shares
are: every reduction is a plain SUM of sample-weighted gradients. A replicated parameter is held by
all `tp` ranks of a replica; when each holds the same whole gradient its copy is weighted by 1 / tp,
when each holds a partial sum over its sequence slice (sequence parallelism) by 1
(`tensor_parallel.grad_weight`).

Buckets. The ranks that hold an element come from `topology`: a sharded parameter is cut into the
L blocks of its stage's finest sharding, block k held by one rank per pipeline (`role.block_groups`);
replicated parameters are held by every rank of the stage (`role.stage_group`); under expert
parallelism a routed expert's parameters only by the ranks holding the expert (`role.sync_groups`).
A *bucket* is the part of one layer that one group holds: for each of a layer's parameters, the block(s) this rank holds
for that group, flattened and concatenated into one flat vector. Every member builds the same vector
(the same blocks of the same parameters in the same order; shapes do not depend on the TP degree
because a block is a fixed slice of the full tensor), so flat offsets mean the same element on every
member. Pieces of weight-decayed parameters (>= 2 dims) come first, so a contiguous range of the
vector has at most two weight-decay segments.

Shards (ZeRO, Rajbhandari et al. 2020): with ZeRO >= 1 a bucket of n = len(group) members is padded
to a multiple of n and member i owns elements [i·s, (i+1)·s), s = ceil(numel / n); with ZeRO-0 every
member owns the whole bucket. Buckets are ordered by (layer, len(group), group), one total order on
every rank, so the collectives of any two ranks in a group come in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from sailor.runtime.tensor_parallel import grad_weight, shard_dim
from sailor.runtime.topology import RankRole, Ranks


@dataclass(frozen=True)
class Piece:
    """The elements of parameter `name` one bucket holds: all of it (`dim` None) or the slice
    [start, start + width) along `dim`, flattened row-major."""

    name: str
    dim: int | None
    start: int
    width: int
    numel: int
    weight: float  # multiplies this rank's gradient before the SUM (module docstring)
    decay: bool  # AdamW weight decay applies (parameters with >= 2 dims)


@dataclass(frozen=True)
class Bucket:
    """One layer's elements held by one group of ranks; this rank owns [lo, hi) of its flat vector."""

    layer: int
    ranks: Ranks
    pieces: tuple[Piece, ...]
    numel: int
    decay_numel: int  # the first decay_numel elements are weight-decayed
    shards: int  # 1 (ZeRO-0: every member owns all of it) or len(ranks)
    index: int  # this rank's shard (0 under ZeRO-0)

    @property
    def shard_numel(self) -> int:
        """Elements of one shard (the last one padded): ceil(numel / shards)."""
        return math.ceil(self.numel / self.shards)

    @property
    def lo(self) -> int:
        return self.index * self.shard_numel

    @property
    def hi(self) -> int:
        return min(self.lo + self.shard_numel, self.numel)

    def segments(self) -> list[tuple[int, int, bool]]:
        """[(start, end, decay)]: the owned range split at the weight-decay boundary, in shard-local
        offsets (0 = element `lo`); empty parts left out."""
        out = []
        for a, b, decay in ((0, self.decay_numel, True), (self.decay_numel, self.numel, False)):
            a, b = max(a, self.lo), min(b, self.hi)
            if a < b:
                out.append((a - self.lo, b - self.lo, decay))
        return out


def build_buckets(params: Mapping[str, nn.Parameter], role: RankRole, *, zero: int,
                  sequence_parallel: bool) -> list[Bucket]:
    """The buckets of this rank's stage parameters (canonical name -> TP shard), in the global order
    (module docstring). A parameter TP does not shard (or a stage without any sharding: one TP-1
    replica per pipeline) goes to the stage group."""
    me = role.rank
    per_rank = role.sync_blocks // role.tp  # blocks of the finest sharding this rank holds
    pieces: dict[tuple[int, Ranks], list[Piece]] = {}
    for name, p in params.items():
        layer = int(name.split(".")[1])
        dim = shard_dim(name) if role.tp > 1 or role.sync_blocks > 1 else None
        decay = p.dim() >= 2
        stage_group, block_groups = role.sync_groups(name)  # a routed expert's: its expert DP group's
        if dim is None:
            piece = Piece(name, None, 0, 0, p.numel(), grad_weight(name, role.tp, sequence_parallel), decay)
            pieces.setdefault((layer, stage_group), []).append(piece)
            continue
        width = p.shape[dim] // per_rank
        for b, ranks in enumerate(block_groups):
            numel = p.numel() // p.shape[dim] * width
            pieces.setdefault((layer, ranks), []).append(Piece(name, dim, b * width, width, numel, 1.0, decay))
    out = []
    for (layer, ranks), ps in sorted(pieces.items(), key=lambda kv: (kv[0][0], len(kv[0][1]), kv[0][1])):
        ps = [x for x in ps if x.decay] + [x for x in ps if not x.decay]
        shards = len(ranks) if zero >= 1 else 1
        out.append(Bucket(layer=layer, ranks=ranks, pieces=tuple(ps), numel=sum(x.numel for x in ps),
                          decay_numel=sum(x.numel for x in ps if x.decay), shards=shards,
                          index=ranks.index(me) if shards > 1 else 0))
    return out


@dataclass(frozen=True)
class Owned:
    """The elements of one piece of a bucket that a rank owns (its ZeRO shard of the bucket; under
    ZeRO-0 all of it): elements [lo, hi) of the piece's row-major flattening, at [at, at + hi - lo)
    of the rank's owned shard of the bucket."""

    piece: Piece
    lo: int
    hi: int
    at: int


def owned_pieces(bucket: Bucket) -> list[Owned]:
    """What a rank owns of `bucket`, piece by piece (pieces it owns nothing of left out). Pure: the
    optimizer's checkpoint entries, the tied-gradient transfers and the planner of in-memory
    resharding (`reshard`) all read ownership from here."""
    out, offset = [], 0
    for piece in bucket.pieces:
        lo, hi = max(offset, bucket.lo), min(offset + piece.numel, bucket.hi)
        if lo < hi:
            out.append(Owned(piece, lo - offset, hi - offset, lo - bucket.lo))
        offset += piece.numel
    return out


def full_slice(piece: Piece, local_shape: Sequence[int], tp_rank: int) -> tuple[int, int]:
    """(start, width) of `piece` along `piece.dim` in the full (unsharded) tensor, for the rank of TP
    rank `tp_rank` whose shard of the parameter has shape `local_shape` (its shard starts at
    tp_rank x the local size along `dim`); (0, 0) for a whole parameter (`dim` None). With `dim`,
    the piece's elements are the checkpoint's slice [start, start + width) along `dim`
    (`checkpoint` docstring)."""
    if piece.dim is None:
        return 0, 0
    return tp_rank * local_shape[piece.dim] + piece.start, piece.width


@dataclass(frozen=True)
class Held:
    """Elements [lo, hi) of a parameter, in its full (unsharded) tensor's row-major order, that a rank
    holds after the gradient reduction: at shard-local offset `at` of its bucket number `bucket`."""

    lo: int
    hi: int
    bucket: int
    at: int


def held_elements(buckets: Sequence[Bucket], name: str, *, first_row: int, row_numel: int) -> list[Held]:
    """Where the owned elements of parameter `name` lie in `buckets` (one rank's), for a parameter
    TP-sharded along dim 0 or not at all: `first_row` is the full tensor's row of this rank's shard row
    0 (TP rank x local rows; 0 unsharded), `row_numel` the elements of one row. Under ZeRO-0 a rank
    owns all it holds."""
    out = []
    for i, b in enumerate(buckets):
        for o in owned_pieces(b):
            if o.piece.name == name:
                assert o.piece.dim in (None, 0), o.piece
                base = (first_row + o.piece.start) * row_numel  # full index of the piece's flat element 0
                out.append(Held(o.lo + base, o.hi + base, i, o.at))
    return out


def piece_view(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's elements of a parameter-shaped tensor (a view)."""
    return t if piece.dim is None else t.narrow(piece.dim, piece.start, piece.width)


@torch.no_grad()
def flatten(bucket: Bucket, tensors: Mapping[str, torch.Tensor | None], *, dtype: torch.dtype, device,
            weighted: bool = False, padded: bool = False) -> torch.Tensor:
    """The bucket's flat vector of `dtype` from parameter-shaped tensors by name (a missing or None
    tensor counts as zeros), each piece times its weight if `weighted`; `padded`: length
    shards x shard_numel (zero tail)."""
    n = bucket.shards * bucket.shard_numel if padded else bucket.numel
    flat = torch.empty(n, dtype=dtype, device=device)  # every element written once below
    offset = 0
    for piece in bucket.pieces:
        t, dst = tensors.get(piece.name), flat[offset:offset + piece.numel]
        if t is None:
            dst.zero_()
        else:
            dst.copy_(piece_view(t, piece).reshape(-1))
            if weighted and piece.weight != 1.0:
                dst.mul_(piece.weight)
        offset += piece.numel
    flat[offset:].zero_()
    return flat


@torch.no_grad()
def unflatten(bucket: Bucket, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy the bucket's flat vector (at least `numel` long) into parameter-shaped tensors by name,
    through `.data` (no autograd version bump: parameters saved for a backward stay valid)."""
    offset = 0
    for piece in bucket.pieces:
        dst = piece_view(tensors[piece.name].data, piece)
        dst.copy_(flat[offset:offset + piece.numel].view(dst.shape))
        offset += piece.numel
