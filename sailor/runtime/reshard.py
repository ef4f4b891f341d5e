"""Move the training state to a new plan in memory: every rank of the new plan gets its (layer,
shard) pieces of weights and optimizer state point to point from the live ranks of the old plan that
hold them (`reshard_plan.plan_reshard` says which), and reads from the checkpoint only what no living
rank holds. Then it builds its stage through the checkpoint's own load path (`worker.build_rank` with
a `ReceivedState` in place of the checkpoint `Reader`), so the result is what saving under the old
plan and loading under the new one gives, bit for bit.

Use from a live worker, once the new plan's process groups exist (every process of the group calls
it, the leaving ones too):

    rp = plan_reshard(old_plan, new_plan, job.model, survivors, weights_fp32=...)   # the same on all
    rk = rebuild_rank(rp, new_plan, job, new_groups, old=old_optimizer_or_None, device=device,
                      group=group, checkpoint=reader_or_None)                     # None on a leaver

Communication follows NCCL's rules (DESIGN.md §10). One all-reduce (MAX) over the group first: it
agrees on the optimizer step count (which a newcomer does not know), checks that the survivors and
the checkpoint agree on it, and, being the group's first collective, makes every member join the
communicator before any point-to-point call (torch's `batch_isend_irecv` requires all members in the
group's first collective). Then all pieces one process sends another travel as one fp32 message, so a
pair exchanges at most one message each way and tags play no part (NCCL ignores them); every process
posts its sends and receives in one global order of (sender, receiver) pairs with
`batch_isend_irecv`, and waits for all of them. Pieces a process keeps are copied locally and
checkpoint pieces read while the messages are in flight.

Memory: a sender builds its outgoing messages at once (up to one copy of what it sends), and a
receiver holds its whole stage's TP shards of all three tensors until `build_rank` has taken them
(zeros where it owns nothing under ZeRO): the old and the new state coexist for the move.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from sailor.plan.spec import Plan
from sailor.runtime import checkpoint as ckpt
from sailor.runtime.checkpoint_io import Reader
from sailor.runtime.reshard_plan import (
    CHECKPOINT,
    KEYS,
    ReshardPlan,
    Slice,
    SrcRect,
    Transfer,
)
from sailor.runtime.tensor_parallel import shard_dim
from sailor.runtime.worker import RankModel, build_rank
from sailor.runtime.zero import ShardedAdamW
from sailor.specs.job import JobSpec

FP32 = torch.float32
_NONE = float(2 ** 52)  # "no value" in the MAX all-reduce of step counts (exact in fp64)


class ReshardError(RuntimeError):
    """The state cannot be moved as planned: survivors or checkpoint disagree on the step, a rank
    needs checkpoint pieces and has no checkpoint, or a process's live state is not the old plan's.
    Raised on every process alike (the decision follows the one all-reduce), so none is left
    waiting."""


class ReceivedState:
    """One new rank's TP shards of "param" and, once a step was taken, the Adam moments, filled with
    the pieces it is given (zeros elsewhere: elements it does not own under ZeRO, which
    `ShardedAdamW.adopt` drops). Stands in for `checkpoint_io.Reader` in `worker.build_rank`.

    Args:
        rp: the plan of the move; rank: this new rank; steps: the optimizer steps taken;
        device: where the tensors live.
    """

    def __init__(self, rp: ReshardPlan, rank: int, steps: int, device: torch.device) -> None:
        self.rank, self.steps = rank, steps
        self.role = rp.new_roles[rank]
        keys = self.held_keys()
        self.buffers: dict[tuple[str, str], torch.Tensor] = {
            (n, k): torch.zeros(shape, dtype=FP32, device=device)
            for n, shape in rp.local_shapes[rank].items() for k in keys}
        self.origin: dict[str, tuple[int, int]] = {}  # name -> (row, col) of the shard's first element, 2-D
        for n, shape in rp.local_shapes[rank].items():
            dim = shard_dim(n) if self.role.tp > 1 else None
            first = 0 if dim is None else self.role.tp_rank * shape[dim]
            self.origin[n] = (first, 0) if dim == 0 and len(shape) == 2 else (0, first)

    def held_keys(self) -> list[str]:
        """The tensors held per parameter ("param", and the moments once a step was taken)."""
        return list(KEYS) if self.steps else ["param"]

    def put(self, t: Transfer, values: torch.Tensor) -> None:
        """Write `values` (t.rect's rows x cols, any float dtype) into the shard of `t.key` of `t.name`."""
        buf = self.buffers[(t.name, t.key)]
        view = buf.view(1, -1) if buf.dim() == 1 else buf
        r0, c0, h, w = t.rect
        a, b = self.origin[t.name]
        view[r0 - a:r0 - a + h, c0 - b:c0 - b + w].copy_(values.reshape(h, w))

    def shard(self, name: str, key: str, tp_rank: int, tp: int) -> torch.Tensor:
        """This rank's TP shard of tensor `key` of `name` (`Reader.shard`'s signature; only this rank's
        own TP rank and degree are held)."""
        assert (tp_rank, tp) == (self.role.tp_rank, self.role.tp), (name, tp_rank, tp)
        return self.buffers[(name, key)]

    def close(self) -> None:
        self.buffers.clear()


def _agree(rp: ReshardPlan, me: int, old: ShardedAdamW | None, checkpoint: Reader | None,
           device: torch.device, group: Any, problem: str | None) -> int:
    """The optimizer steps the state has taken, agreed over the group by one MAX all-reduce of
    (live steps, -live steps, checkpoint steps, -checkpoint steps, this rank lacks a checkpoint it
    needs, this process cannot send its pieces: `problem`); raises ReshardError on every process
    when they do not fit (`ReshardError`)."""
    live = old.steps if old is not None and rp.survivors.get(old.rank) == me else None
    ck = ckpt.optimizer_steps(checkpoint.manifest) if checkpoint is not None else None
    lacks = checkpoint is None and any(t.src == CHECKPOINT and t.dst == me for t in rp.transfers)
    v = torch.tensor([-1.0 if live is None else live, -_NONE if live is None else -live,
                      -1.0 if ck is None else ck, -_NONE if ck is None else -ck, float(lacks),
                      float(problem is not None)], dtype=torch.float64, device=device)
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
    live_max, live_min, ck_max, ck_min, lacking, broken = v.tolist()
    live_min, ck_min = -live_min, -ck_min
    if broken:
        raise ReshardError(problem or "another process cannot send the pieces the plan expects of it")
    if live_max >= 0 and live_max != live_min:
        raise ReshardError(f"the surviving ranks disagree on the optimizer step ({live_min:.0f} to {live_max:.0f})")
    if rp.needs_checkpoint:
        if lacking:
            raise ReshardError("some pieces have no living holder and a rank that needs them was given no checkpoint")
        if ck_max != ck_min:
            raise ReshardError(f"the ranks were given checkpoints of different steps ({ck_min:.0f} to {ck_max:.0f})")
        if live_max >= 0 and ck_max != live_max:
            raise ReshardError(f"the checkpoint holds optimizer step {ck_max:.0f}, the survivors step {live_max:.0f}:"
                               " mixing them would train a state no run had; move from the checkpoint alone"
                               " (no survivors) or from a checkpoint of the survivors' step")
    steps = live_max if live_max >= 0 else ck_max
    if steps < 0:
        raise ReshardError("no survivor and no checkpoint: there is no state to move")
    return int(steps)


def _sources(rp: ReshardPlan, me: int, old: ShardedAdamW, wanted: set[Slice]) -> dict[Slice, torch.Tensor]:
    """The flat tensors of `old` (this process's optimizer under the old plan) that `wanted` names:
    owned state from `checkpoint_entries(every_holder=True)`, weights from the parameters.

    Raises:
        ReshardError: a wanted slice this process does not hold (its state is not the old plan's), or
            weights asked for that are not fp32.
    """
    out: dict[Slice, torch.Tensor] = {}
    if any(not s.weights for s in wanted):
        for name, key, dim, start, width, lo, flat in old.checkpoint_entries(every_holder=True):
            s = Slice(name, key, dim, start, width, lo, lo + flat.numel())
            if s in wanted:
                out[s] = flat
    for s in wanted:
        if s.weights:
            p = old.params.get(s.name)
            if p is None or p.dtype != FP32 or p.numel() != s.hi:
                raise ReshardError(f"process {me}: no fp32 weights of {s.name} to send (plan_reshard's weights_fp32"
                                   " must be False under bf16/fp16)")
            out[s] = p.data.reshape(-1)
    missing = wanted - out.keys()
    if missing:
        raise ReshardError(f"process {me} does not hold {min(missing, key=repr)}: its state is not the old"
                           " plan's")
    return out


def _cut(flat: torch.Tensor, src_rect: SrcRect, rect: tuple[int, int, int, int]) -> torch.Tensor:
    """Rectangle `rect` (full 2-D coordinates) of a slice's flat tensor whose rectangle `src_rect` holds it."""
    a, b, h, w, p = src_rect
    r0, c0, rh, rw = rect
    return flat[p:p + h * w].view(h, w)[r0 - a:r0 - a + rh, c0 - b:c0 - b + rw]


def _read(reader: Reader, t: Transfer, shape: tuple[int, ...]) -> torch.Tensor:
    """Rectangle `t.rect` of full tensor `t.key` of `t.name` from a checkpoint, reading the slice along
    the dimension that wastes least (whole rows when the rectangle spans them, else its columns)."""
    r0, c0, h, w = t.rect
    if reader.v1:  # format 1: whole tensors only
        full = reader.shard(t.name, t.key, 0, 1)
        return (full.view(1, -1) if full.dim() == 1 else full)[r0:r0 + h, c0:c0 + w]
    if len(shape) == 1:
        return reader.slice(t.name, t.key, 0, c0, w)
    if w == shape[1]:
        return reader.slice(t.name, t.key, 0, r0, h)
    return reader.slice(t.name, t.key, 1, c0, w)[r0:r0 + h]


def move_state(rp: ReshardPlan, old: ShardedAdamW | None, *, device: torch.device, group: Any = None,
               checkpoint: Reader | None = None) -> ReceivedState | None:
    """Collective over `group` (default: the world): this process's part in moving the state as `rp`
    plans (module docstring). `old`: this process's optimizer under the old plan (None for a process
    that was not a rank of it, or whose state is lost); its old rank must map to this process's group
    rank in `rp.survivors`. `checkpoint`: a Reader of the checkpoint that pieces without a living
    holder come from (needed by the ranks that receive such pieces). Returns this new rank's state
    for `worker.build_rank`, or None for a process with no rank in the new plan (it only sends).

    Raises:
        ReshardError: (on every process, after the all-reduce) see `ReshardError`.
    """
    me = dist.get_rank(group)
    mine = [t for t in rp.transfers if t.src != CHECKPOINT and rp.survivors[t.src] == me]
    flats, problem = {}, None
    try:  # what this process sends, found before anyone waits on it
        if old is not None and rp.survivors.get(old.rank) != me:
            raise ReshardError(f"process {me} holds old rank {old.rank}'s state, which survivors maps to"
                               f" {rp.survivors.get(old.rank)}")
        if mine and old is None:
            raise ReshardError(f"process {me} is to send old ranks' pieces but was given no old state")
        if mine:
            flats = _sources(rp, me, old, {t.source for t in mine if old.steps or t.key == "param"})
    except ReshardError as e:
        problem = str(e)
    steps = _agree(rp, me, old, checkpoint, device, group, problem)
    todo = [t for t in rp.transfers if steps or t.key == "param"]  # moments exist once a step was taken
    state = ReceivedState(rp, me, steps, device) if me < rp.new_world else None

    messages = {pair: ts for pair, ts in rp.messages(moments=steps > 0).items() if me in pair}
    sends = {dst: torch.cat([_cut(flats[t.source], t.src_rect, t.rect).reshape(-1).to(device, FP32) for t in ts])
             for (src, dst), ts in messages.items() if src == me}
    incoming = {src: ts for (src, dst), ts in messages.items() if dst == me}
    recvs = {s: torch.empty(sum(t.numel for t in ts), dtype=FP32, device=device) for s, ts in incoming.items()}
    ops = []  # one global order of (sender, receiver) pairs
    for (src, dst) in sorted(messages):
        if src == me:
            ops.append(dist.P2POp(dist.isend, sends[dst], _global(group, dst), group))
        else:
            ops.append(dist.P2POp(dist.irecv, recvs[src], _global(group, src), group))
    works = dist.batch_isend_irecv(ops) if ops else []
    for t in todo:  # local copies and checkpoint reads while the messages travel
        if t.dst != me:
            continue
        if t.src == CHECKPOINT:
            state.put(t, _read(checkpoint, t, rp.shapes[t.name]))
        elif rp.survivors[t.src] == me:
            state.put(t, _cut(flats[t.source], t.src_rect, t.rect))
    for w in works:
        w.wait()
    for src, ts in incoming.items():
        at = 0
        for t in ts:
            state.put(t, recvs[src][at:at + t.numel])
            at += t.numel
    return state


def _global(group: Any, rank: int) -> int:
    """The global rank of group rank `rank` (P2POp takes global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def rebuild_rank(rp: ReshardPlan, new: Plan, job: JobSpec, new_groups: Mapping, *, old: ShardedAdamW | None,
                 device: torch.device, group: Any = None, checkpoint: Reader | None = None, seed: int = 0,
                 dtype: torch.dtype | None = None) -> RankModel | None:
    """`move_state`, then this process's stage of plan `new` built from what it received (`worker.build_rank`
    with the new plan's process groups `new_groups`, `groups.create_groups`), exactly as a resume from
    a checkpoint of the same state builds it; None on a process with no rank in `new`. `seed` is
    unused (no weight is initialised); `dtype` as in `build_rank`."""
    state = move_state(rp, old, device=device, group=group, checkpoint=checkpoint)
    if state is None:
        return None
    try:
        return build_rank(new, job, state.role, dict(new_groups), device=device, seed=seed, reader=state,
                          step=state.steps, dtype=dtype)
    finally:
        state.close()
