"""Which pieces of the training state each rank of a new plan needs, and where they are now: the pure
half of moving state in memory across a plan change (`reshard` executes it; no process group here).

Vocabulary. The state is, per canonical parameter, three fp32 tensors ("param", the fp32 master
weights; "exp_avg" and "exp_avg_sq", the Adam moments, or SGD's momentum and an unused buffer) plus
the optimizer's step count, which every rank holds. A *slice* names elements of one of them the way a
checkpoint entry does (`checkpoint` docstring): elements [lo, hi) of the row-major flattening of the
slice [start, start + width) along `dim` of the full, unsharded tensor (`dim` None: of the whole
tensor). Geometry is done on the full tensor seen as 2-D (`checkpoint_io.as_2d`: a vector is one
row), where a slice is at most three rectangles (`checkpoint_io.entry_rects`).

What a rank holds under a plan comes from the runtime's own code, not from a copy of its rules: its
stage's parameters and their TP shards from `worker.meta_stage` (the model built on the meta device,
cut by `pipeline.build_stage`, sharded by `tensor_parallel.apply_tp`), its ZeRO ownership from the
optimizer's buckets (`buckets.build_buckets`, `buckets.owned_pieces`, `buckets.full_slice`, which
`zero.ShardedAdamW.checkpoint_entries` also reads). So a rank of the old plan holds:
- the moments and fp32 master of the ranges it owns (`owned_pieces`; under ZeRO-0 every member of a
  bucket's group owns all of it, so every replica holds a copy);
- with `weights_fp32` (the compute dtype is fp32, so the weights *are* the master) and ZeRO < 3, its
  whole TP shard of every weight, as the model's parameter (`Slice.weights`), which every replica of
  the stage holds whatever its ZeRO stage.
A rank of the new plan needs exactly what `worker.build_rank` takes from a checkpoint and keeps: the
whole TP shard of each weight under ZeRO < 3 (the weights are replicated over the ZeRO group), only its
owned ranges under ZeRO-3, and the moments of its owned ranges (the rest of what `build_rank` asks for
is dropped by `ShardedAdamW.adopt`).

Choosing sources. Each needed rectangle is cut at the edges of the held rectangles that overlap it;
each cell is taken from one holder, preferring (1) the same process (a survivor keeping what it has:
no transfer), (2) a holder on the same node as the receiver, (3) the holder with the fewest elements
assigned to send so far (spreading the load over replicas), (4) the lowest old rank; cells taken from
the same held rectangle are merged back into rectangles. A cell no survivor holds comes from the
checkpoint (`CHECKPOINT`). Every new rank's needs are covered exactly once (tested as a property).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from sailor.model.spec import ModelSpec
from sailor.plan.placement import rank_layout
from sailor.plan.spec import Plan
from sailor.runtime.buckets import build_buckets, full_slice, owned_pieces
from sailor.runtime.checkpoint import OPTIMIZER_KEYS
from sailor.runtime.checkpoint_io import entry_rects
from sailor.runtime.model import param_shapes
from sailor.runtime.tensor_parallel import shard_dim
from sailor.runtime.topology import RankRole, derive_topology
from sailor.runtime.worker import meta_stage

CHECKPOINT = -1  # `Transfer.src` of a piece no survivor holds: read from the checkpoint
KEYS = ("param", *OPTIMIZER_KEYS)
Rect = tuple[int, int, int, int]  # (row0, col0, rows, cols) of a full tensor seen as 2-D
SrcRect = tuple[int, int, int, int, int]  # `checkpoint_io.entry_rects`: a Rect and its position in the slice


@dataclass(frozen=True)
class Slice:
    """Elements [lo, hi) of the row-major flattening of the slice [start, start + width) along `dim` of
    full tensor `key` of parameter `name` (`dim` None: the whole tensor; start = width = 0), as one
    rank holds them in one flat tensor: its owned optimizer state (the tuples
    `ShardedAdamW.checkpoint_entries(every_holder=True)` yields) or, `weights`, its TP shard of the
    weights (the parameter itself, flattened)."""

    name: str
    key: str
    dim: int | None
    start: int
    width: int
    lo: int
    hi: int
    weights: bool = False

    def rects(self, shape: Sequence[int]) -> list[SrcRect]:
        """The slice's elements as rectangles of the full tensor of `shape` seen as 2-D."""
        return entry_rects(self.dim, self.start, self.width, self.lo, self.hi, list(shape))


@dataclass(frozen=True)
class Transfer:
    """New rank `dst` gets rectangle `rect` of full tensor `key` of `name` from old rank `src` (the
    process `ReshardPlan.survivors[src]`), which holds it in its flat tensor `source`, inside that
    slice's rectangle `src_rect` (elements `source`[p : p + rows·cols] are that rectangle, row-major);
    `src` CHECKPOINT: from the checkpoint (`source`, `src_rect` None)."""

    dst: int
    name: str
    key: str
    rect: Rect
    src: int
    source: Slice | None = None
    src_rect: SrcRect | None = None

    @property
    def numel(self) -> int:
        return self.rect[2] * self.rect[3]


@dataclass(frozen=True)
class ReshardPlan:
    """Every transfer that moves a job's state from the old plan's ranks to the new plan's.

    Processes are named by their rank in the process group the move runs on: new rank r is group rank
    r; old rank o, if it survives, is group rank `survivors[o]` (which may be >= `new_world`: a process
    that leaves once it has sent what it holds)."""

    old_world: int
    new_world: int
    survivors: Mapping[int, int]
    shapes: Mapping[str, tuple[int, ...]]  # full shape of every parameter
    new_roles: tuple[RankRole, ...]  # the new plan's roles, by rank
    local_shapes: Mapping[int, Mapping[str, tuple[int, ...]]]  # new rank -> its stage's TP shard shapes
    needs: Mapping[int, tuple[Slice, ...]]  # new rank -> the slices it must be given
    transfers: tuple[Transfer, ...]  # ordered by (sending process, CHECKPOINT first; dst; name; key; rect)

    @property
    def needs_checkpoint(self) -> bool:
        """Whether some piece has no living holder."""
        return any(t.src == CHECKPOINT for t in self.transfers)

    def process(self, src: int) -> int | None:
        """The group rank that sends old rank `src`'s pieces (None: the checkpoint)."""
        return None if src == CHECKPOINT else self.survivors[src]

    def messages(self, *, moments: bool = True) -> dict[tuple[int, int], list[Transfer]]:
        """(sending process, receiving new rank) -> the transfers one message between them carries, in
        the order they are packed (`moments` False: before the first optimizer step, "param" only);
        pairs of one process with itself and checkpoint reads left out. Both ends derive it from the
        same plan, so each pair's send and receive have the same size and order (`reshard`)."""
        out: dict[tuple[int, int], list[Transfer]] = {}
        for t in self.transfers:
            src = self.process(t.src)
            if src is not None and src != t.dst and (moments or t.key == "param"):
                out.setdefault((src, t.dst), []).append(t)
        return out

    def moved_elements(self) -> dict[str, int]:
        """Elements that cross between processes ("sent"), stay in one ("local") and are read from the
        checkpoint ("checkpoint")."""
        out = {"sent": 0, "local": 0, "checkpoint": 0}
        for t in self.transfers:
            kind = "checkpoint" if t.src == CHECKPOINT else "local" if self.process(t.src) == t.dst else "sent"
            out[kind] += t.numel
        return out


class _Stages:
    """Each role's stage parameters (meta TP shards, `worker.meta_stage`), built once per (layer chunks,
    TP degree, sequence parallelism): shapes do not depend on the TP rank."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.cache: dict[tuple, dict[str, torch.nn.Parameter]] = {}

    def params(self, role: RankRole) -> dict[str, torch.nn.Parameter]:
        key = (role.chunks, role.tp, role.memory.sequence_parallel)
        if key not in self.cache:
            self.cache[key] = dict(meta_stage(self.spec, role).named_parameters())
        return self.cache[key]


def _tp_shard(name: str, key: str, local_shape: Sequence[int], role: RankRole, *, weights: bool) -> Slice:
    """The whole of `role`'s TP shard of tensor `key` of `name`."""
    numel = math.prod(local_shape)
    dim = shard_dim(name) if role.tp > 1 else None
    if dim is None:
        return Slice(name, key, None, 0, 0, 0, numel, weights)
    return Slice(name, key, dim, role.tp_rank * local_shape[dim], local_shape[dim], 0, numel, weights)


def rank_slices(role: RankRole, params: Mapping[str, torch.Tensor], *, whole_param: bool,
                weights: bool = False) -> list[Slice]:
    """The slices of `role`'s state (its stage parameters `params`, TP shards, meta will do): the
    owned ranges of every key (`buckets.owned_pieces` of its buckets at its stage's ZeRO stage), except
    that with `whole_param` "param" is its whole TP shard of each parameter instead (marked `weights`
    when `weights`)."""
    mem = role.memory
    buckets = build_buckets(params, role, zero=mem.zero, sequence_parallel=mem.sequence_parallel)
    out = []
    for b in buckets:
        for o in owned_pieces(b):
            start, width = full_slice(o.piece, params[o.piece.name].shape, role.tp_rank)
            out += [Slice(o.piece.name, key, o.piece.dim, start, width, o.lo, o.hi)
                    for key in KEYS if not (whole_param and key == "param")]
    if whole_param:
        out += [_tp_shard(n, "param", tuple(p.shape), role, weights=weights) for n, p in params.items()]
    return out


def held_by(plan: Plan, spec: ModelSpec, ranks: Iterable[int], *, weights_fp32: bool,
            stages: _Stages | None = None) -> dict[int, list[Slice]]:
    """What each of `ranks` holds under `plan` (module docstring)."""
    stages = stages or _Stages(spec)
    roles = derive_topology(plan).roles
    return {r: rank_slices(roles[r], stages.params(roles[r]), whole_param=weights_fp32 and roles[r].memory.zero < 3,
                           weights=True) for r in ranks}


def needed_by(plan: Plan, spec: ModelSpec, *, stages: _Stages | None = None) -> dict[int, list[Slice]]:
    """What each rank of `plan` must be given to build its stage (module docstring)."""
    stages = stages or _Stages(spec)
    return {role.rank: rank_slices(role, stages.params(role), whole_param=role.memory.zero < 3)
            for role in derive_topology(plan).roles}


def _check_survivors(old: Plan, survivors: Mapping[int, int]) -> dict[int, int]:
    """`survivors` as a dict after checking it (ValueError naming the entry)."""
    out = {}
    for o, g in survivors.items():
        if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < old.world_size:
            raise ValueError(f"survivors: {o!r} is not a rank of the old plan (world size {old.world_size})")
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ValueError(f"survivors[{o}]: {g!r} is not a process group rank (a whole number >= 0)")
        out[o] = g
    if len(set(out.values())) != len(out):
        raise ValueError(f"survivors: two old ranks map to one process: {sorted(out.items())}")
    return out


def plan_reshard(old: Plan, new: Plan, spec: ModelSpec, survivors: Mapping[int, int], *, weights_fp32: bool = True,
                 node_of: Mapping[int, str] | None = None) -> ReshardPlan:
    """The transfers that give every rank of `new` its state (module docstring), from the ranks of
    `old` that survive and, for pieces none of them holds, from the checkpoint.

    Args:
        old, new: the plans before and after the change (the same model `spec`; any TP degrees, stage
            partitions, ZeRO stages, GPU types and numbers of pipelines).
        survivors: old rank -> its process's rank in the group the move runs on (module docstring of
            `ReshardPlan`); the other old ranks are gone.
        weights_fp32: the old ranks' weights are fp32 (`zero.compute_dtype` of the job's precision on
            the device), so their full TP shards are sources of "param" too; False under bf16/fp16,
            where only the fp32 master of owned ranges is.
        node_of: group rank -> node name, for preferring sources on the receiver's node; default:
            the new plan's placement (`placement.rank_layout`) for ranks < new.world_size.

    Raises:
        ValueError: `survivors` names a rank the old plan does not have, or maps two to one process.
    """
    procs = _check_survivors(old, survivors)
    stages = _Stages(spec)
    shapes = param_shapes(spec)
    held = held_by(old, spec, sorted(procs), weights_fp32=weights_fp32, stages=stages)
    needs = needed_by(new, spec, stages=stages)
    if node_of is None:
        node_of = {info.rank: info.node for info in rank_layout(new)}
    holders: dict[tuple[str, str], list[tuple[int, Slice, SrcRect]]] = {}
    for o, slices in held.items():
        for s in slices:
            for r in s.rects(shapes[s.name]):
                holders.setdefault((s.name, s.key), []).append((o, s, r))
    load = dict.fromkeys(procs.values(), 0)  # elements each process sends

    def pick(candidates: list[tuple[int, Slice, SrcRect]], dst: int, numel: int) -> int:
        def rank(i: int) -> tuple:
            g = procs[candidates[i][0]]
            node = node_of.get(g)
            return (g != dst, node is None or node != node_of.get(dst), load[g], candidates[i][0])
        best = min(range(len(candidates)), key=rank)
        g = procs[candidates[best][0]]
        if g != dst:
            load[g] += numel
        return best

    transfers = []
    for dst in sorted(needs):
        for s in needs[dst]:
            for r0, c0, h, w, _ in s.rects(shapes[s.name]):
                for rect, choice in _cover((r0, c0, h, w), holders.get((s.name, s.key), []),
                                           lambda cands, n, dst=dst: pick(cands, dst, n)):
                    src, source, src_rect = choice if choice is not None else (CHECKPOINT, None, None)
                    transfers.append(Transfer(dst, s.name, s.key, rect, src, source, src_rect))
    transfers.sort(key=lambda t: (-1 if t.src == CHECKPOINT else procs[t.src], t.dst, t.name, t.key, t.rect))
    roles = derive_topology(new).roles
    local_shapes = {role.rank: {n: tuple(p.shape) for n, p in stages.params(role).items()} for role in roles}
    return ReshardPlan(old.world_size, new.world_size, procs, shapes, roles, local_shapes,
                       {r: tuple(v) for r, v in needs.items()}, tuple(transfers))


def _inside(outer: SrcRect | Rect, r0: int, r1: int, c0: int, c1: int) -> bool:
    """Whether rows [r0, r1) x cols [c0, c1) lie inside rectangle `outer`."""
    a, b, h, w = outer[:4]
    return a <= r0 and r1 <= a + h and b <= c0 and c1 <= b + w


def _cover(need: Rect, holders: Sequence[tuple[int, Slice, SrcRect]], pick) -> list[tuple[Rect, tuple | None]]:
    """`need` cut into rectangles each taken from one of `holders` ((old rank, slice, its rectangle)),
    or from nobody (None): the rectangle is split at every edge of an overlapping holder, each cell
    given to `pick(candidates, numel)` (an index into the candidates containing it), and cells of
    one row band with the same holder merged, then bands with the same pieces merged."""
    r0, c0, h, w = need
    over = [x for x in holders if x[2][0] < r0 + h and x[2][0] + x[2][2] > r0
            and x[2][1] < c0 + w and x[2][1] + x[2][3] > c0]
    rows = sorted({r0, r0 + h} | {min(max(x[2][0], r0), r0 + h) for x in over}
                  | {min(max(x[2][0] + x[2][2], r0), r0 + h) for x in over})
    cols = sorted({c0, c0 + w} | {min(max(x[2][1], c0), c0 + w) for x in over}
                  | {min(max(x[2][1] + x[2][3], c0), c0 + w) for x in over})
    bands = []  # (row0, row1, [[col0, col1, holder index or -1]])
    for a, b in itertools.pairwise(rows):
        segs: list[list[int]] = []
        for c, d in itertools.pairwise(cols):
            cands = [i for i, x in enumerate(over) if _inside(x[2], a, b, c, d)]
            choice = cands[pick([over[i] for i in cands], (b - a) * (d - c))] if cands else -1
            if segs and segs[-1][2] == choice:
                segs[-1][1] = d
            else:
                segs.append([c, d, choice])
        bands.append((a, b, segs))
    done, open_ = [], {}  # (col0, col1, choice) -> row0 of a rectangle reaching the last band's end
    for a, _, segs in bands:
        nxt = {k: open_.pop(k, a) for k in (tuple(seg) for seg in segs)}  # bands are contiguous: extend
        done += [(row0, a, k) for k, row0 in open_.items()]  # not continued: closed at row a
        open_ = nxt
    done += [(row0, r0 + h, k) for k, row0 in open_.items()]
    out = []
    for a, b, (c, d, choice) in sorted(done):
        out.append(((a, c, b - a, d - c), over[choice] if choice >= 0 else None))
    return out
