"""The runtime's optimizer: AdamW over one stage, with ZeRO-0/1/2/3 sharding and mixed precision.

Every stage runs through `ShardedAdamW`; `StageMemory.zero` (read once, in the worker) says how much
of the training state is sharded among the ranks that hold each element (`runtime.buckets`: one
bucket per layer and group, the same block ownership gradient sync uses, so replicas of different TP
degrees and GPU types shard correctly):

| ZeRO | weights           | gradients                                   | fp32 master + Adam moments |
|------|-------------------|---------------------------------------------|----------------------------|
| 0    | full              | full, one all-reduce per bucket per step     | full (every member updates all) |
| 1    | full              | full, one reduce-scatter per bucket per step | own shard                  |
| 2    | full              | own shard, reduce-scattered per micro-batch  | own shard                  |
| 3    | own shard only    | as ZeRO-2                                    | own shard                  |

ZeRO-1 is Megatron-LM's distributed optimizer (Narayanan et al. SC'21 code base, `--use-distributed-
optimizer`): gradients accumulate in full over the micro-batches, one reduce-scatter gives each member
the summed gradient of its shard, it updates that shard, and an all-gather of the updated shards
rebuilds the full weights (the volume of one all-reduce; Rajbhandari et al. 2020, §7). Under ZeRO-2
and 3 no full gradient outlives one layer's backward: after each layer's backward of each micro-batch
its gradients are reduce-scattered and added to the own shard's fp32 accumulator (DeepSpeed's
ZeRO-2). Under ZeRO-3 a layer's weights are all-gathered before its forward and again before its
backward, and freed after each (`untyped_storage().resize_(0)`, which also frees the views autograd
saved; refilling goes through `.data`, so their version counters stay valid). Pipelines of one stage
may run different numbers of micro-batches (uneven batch shares): under ZeRO-2/3 the members of a
group meet in a collective for every micro-batch, so every pipeline runs the 1F1B schedule of the
largest share, doing only the collectives (with zero gradients) in the rounds it has no micro-batch
for (`pipeline.run_pipeline`).

The layer hooks, the end-of-step `reduce` and the collectives behind them (ZeRO-3's gathers and
their prefetch, the gradient buffers, the overlapped reductions) are `ShardedAdamW`'s base class,
`runtime.zero_hooks.ZeroLayerHooks`, whose module docstring describes them.

Mixed precision (CUDA only; on CPU `dtype` is fp32 unless a test asks for a half dtype): the model
runs in bf16 or fp16, gradients accumulate in the fp32 buffers, and the fp32 master weights and fp32
Adam moments are kept per owned range. fp16 adds dynamic loss scaling (`runtime.scaler`): the
gradients arrive multiplied by the loss scale, `clip(scale=S)` divides them by it, and a step whose
gradient norm is not finite is skipped (`skip`). fp16 holds the same bytes as bf16 (18 per parameter
at ZeRO-0: its gradients are fp32 too, unlike Megatron-LM's fp16 with fp16 gradients, 20). Bytes per
parameter as Megatron-LM counts them (NVIDIA/Megatron-LM,
docs/api-guide/dist_optimizer.md: bf16 parameters with fp32 gradients 18 without and 6 + 12/d with the
distributed optimizer; fp32 16 and 8 + 8/d): here bf16 ZeRO-0 2 + 4 + 4 + 8 = 18; ZeRO-1 2 + 4 + 12/d;
ZeRO-2 2 + 16/d; ZeRO-3 16/d (the bf16 weights then exist only one layer at a time). In fp32 no
separate master is kept, the weights are the master (updated in place, `_weight_views`): 16 at
ZeRO-0, 4 + 4 + 8/d at ZeRO-1, 4 + 12/d at ZeRO-2, 16/d at ZeRO-3. d is the group size of the
bucket: the pipelines for TP shards, every rank of the stage for replicated parameters (and for all
of a stage's parameters when no replica shards).

The update is torch's own AdamW arithmetic (`torch.optim.adamw.adamw`) on the owned flat ranges
(with fp32 weights outside ZeRO-3, on the weights themselves wherever a piece's owned elements are
contiguous in its weight: no copy of the weights is made and written back; ZeRO-1 then all-gathers
a copy of the owned shard), multi-tensor (foreach=True: one call per weight-decay setting over many
ranges, the default of torch's AdamW on GPUs), so sharding changes no arithmetic of the update; on
CPU it gives the same bits as the per-tensor loop (foreach=False; checked by
`tests/test_grad_sync.py`). A job whose recipe names sgd
gets torch's SGD arithmetic (`torch.optim.sgd.sgd`, weight decay added to the gradient, momentum
without dampening) the same way, its momentum buffer held in `exp_avg` (zeros before the first step,
which gives torch's first step exactly: 0·m + g = g); `exp_avg_sq` is then kept unused, 4 bytes per
owned parameter more than the memory model counts for SGD (`specs.job.STATE_BYTES_PER_PARAM`). Global-norm
clipping takes torch's norms (fp32, per range) of the owned gradient elements, each counted once
over the world (`clip`), and sums their squares in fp64.

Tied embeddings (`runtime.tied`): the reduction ends by adding to each held element of the embedding
and of the LM head its twin of the other copy, received from the rank that holds it
(`Tied.transfers`), so both copies take the step of the one shared matrix; the head's elements are
left out of the norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from sailor.runtime.buckets import (
    Bucket,
    build_buckets,
    flatten,
    full_slice,
    owned_pieces,
    piece_view,
    unflatten,
)
from sailor.runtime.grad_sync import InFlight, Lanes, ReadyOrder, SyncTimeline
from sailor.runtime.optim import OptimConfig
from sailor.runtime.tied import Tied, twin_ranges
from sailor.runtime.topology import RankRole, Ranks
from sailor.runtime.zero_hooks import FP32, ZeroLayerHooks


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The weights' and activations' dtype for a job's `precision`: bf16 or fp16 on CUDA for "bf16" or
    "fp16", fp32 otherwise (the runtime trains in fp32 on CPU; tests pass a half dtype explicitly)."""
    if device.type != "cuda":
        return FP32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, FP32)


class ShardedAdamW(ZeroLayerHooks):
    """AdamW over one stage's parameters, sharded as ZeRO-`zero` (module docstring); also the layer
    hooks `executor.StageExecutor` calls around each layer's forward and backward (`ZeroLayerHooks`).

    Args:
        params: this rank's stage parameters by canonical name (TP shards), fp32 with their initial
            (or checkpoint) values, taken over at once (cast to `dtype`, freed under ZeRO-3); or on
            the meta device (shapes only), each layer then handed over by `adopt`.
        role: this rank's role (stage groups and blocks).
        groups: torch process group per rank tuple (`groups.create_groups`).
        zero: ZeRO stage 0..3 of this rank's stage.
        sequence_parallel: the stage runs with sequence parallelism (gradient weights).
        cfg: AdamW settings (the reference's).
        dtype: the weights' compute dtype (fp32, or bf16 on CUDA).
        tied: this rank's part in a tied embedding's gradient (`tied.tied_for_rank`); None: untied.
        device: where the state lives (default: the parameters' device; needed for meta parameters).
        reshard_after_forward: ZeRO-3 only: free gathered weights after every pass (True) or keep
            them for the step (False; module docstring).
        lanes: the groups each gradient-sync group's reductions go out on in turn, by its rank tuple
            (`groups.create_sync_lanes`); a group without lanes reduces on `groups`' own.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], role: RankRole, groups: Mapping[Ranks, object], *,
                 zero: int, sequence_parallel: bool, cfg: OptimConfig, dtype: torch.dtype = FP32,
                 tied: Tied | None = None, device: torch.device | None = None,
                 reshard_after_forward: bool = True, lanes: Mapping[Ranks, Sequence[object]] | None = None) -> None:
        assert 0 <= zero <= 3, zero
        self.params, self.zero, self.cfg, self.dtype = dict(params), zero, cfg, dtype
        self.reshard = reshard_after_forward
        self._gathered: set[int] = set()  # ZeRO-3: layers whose full weights are in place
        self._prefetched: dict[int, list[tuple]] = {}  # ZeRO-3: layer -> its all-gathers in flight
        self.groups = groups
        self.steps = 0  # optimizer steps taken
        self.tp_rank = role.tp_rank
        self.device = device or next(iter(self.params.values())).device
        self.buckets = build_buckets(self.params, role, zero=zero, sequence_parallel=sequence_parallel)
        self._tied_setup(role, tied)
        self.layer_buckets: dict[int, list[int]] = {}
        for i, b in enumerate(self.buckets):
            self.layer_buckets.setdefault(b.layer, []).append(i)
        self.layer_params: dict[int, list[str]] = {}
        for name in self.params:
            self.layer_params.setdefault(int(name.split(".")[1]), []).append(name)
        # fp32 master of the owned range: kept where the weights cannot serve as master (ZeRO-3, or
        # half-precision weights); otherwise built from the weights at each step.
        n = len(self.buckets)
        self.master: list[torch.Tensor | None] = [None] * n
        self.exp_avg: list[torch.Tensor] = [None] * n  # type: ignore[list-item]  # filled by `adopt`
        self.exp_avg_sq: list[torch.Tensor] = [None] * n  # type: ignore[list-item]
        # Owned gradient: accumulated over the step's micro-batches under ZeRO-2/3; under ZeRO-0/1 a
        # view of the bucket's gradient buffer that `reduce` reduced in place (None between steps).
        self.grad: list[torch.Tensor | None] = [None] * n
        # ZeRO-0/1: the fp32 gradient buffer of each bucket (padded to its shards), which every layer's
        # backward adds its gradients into (Megatron-LM's contiguous grad buffer); the only full copy.
        # Made per layer by `adopt`.
        self.grad_buffer: list[torch.Tensor] | None = [None] * n if zero < 2 else None  # type: ignore[list-item]
        # ZeRO-0/1: the buffer still holds the last step's gradient: the next backward writes over it
        # instead of adding to it (no pass that zeroes it between steps)
        self._stale = [False] * n
        # Overlapped reduction (`runtime.grad_sync`): buckets issued in reverse bucket order.
        self._ready = ReadyOrder(list(reversed(range(n))), [b.layer for b in self.buckets])
        self._inflight = InFlight()
        self._lanes = Lanes(groups, lanes or {})
        self.timeline = SyncTimeline(self.device)  # the step in progress
        self.last_timeline: SyncTimeline | None = None  # the last step `reduce` finished
        if not any(p.is_meta for p in self.params.values()):
            for layer in self.layer_params:
                self.adopt(layer)

    def adopt(self, layer: int, params: Mapping[str, nn.Parameter] | None = None,
              moments: Callable[[str], Mapping[str, torch.Tensor]] | None = None) -> None:
        """Take over layer `layer`'s parameters: `params` (this rank's TP shards by canonical name, fp32
        with their initial or checkpoint values, replacing the meta ones the optimizer was built from;
        None: those it holds), with the Adam moments `moments(key)` ({name: TP shard} of the layer for
        "exp_avg", then "exp_avg_sq", asked for one key at a time; None: zeros). Builds the layer's fp32
        master and moments of the owned ranges, casts its weights to `dtype` and frees them under
        ZeRO-3, so that start-up holds one layer beyond the steady state (`worker.build_rank`
        materialises the stage layer by layer)."""
        if params is not None:
            self.params.update(params)
        buckets = self.layer_buckets.get(layer, [])
        for i in buckets:
            b = self.buckets[i]
            if self._keeps_master:
                self.master[i] = self._owned(b, flatten(b, self.params, dtype=FP32, device=self.device, padded=True))
            self.grad[i] = torch.zeros(b.shard_numel, dtype=FP32, device=self.device) if self.zero >= 2 else None
            if self.grad_buffer is not None:
                self.grad_buffer[i] = torch.zeros(b.shards * b.shard_numel, dtype=FP32, device=self.device)
        for key, store in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            values = moments(key) if moments is not None else None
            for i in buckets:
                b = self.buckets[i]
                store[i] = (self._owned(b, flatten(b, values, dtype=FP32, device=self.device, padded=True))
                            if values is not None else torch.zeros(b.shard_numel, dtype=FP32, device=self.device))
            del values
        with torch.no_grad():
            for n in self.layer_params[layer]:
                p = self.params[n]
                if p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
        if self.zero == 3:
            self._free(layer)

    def expect_backwards(self, per_layer: Mapping[int, int]) -> None:
        """The number of `after_backward` calls each layer gets per step (`grad_sync.backwards_per_layer`
        of the stage's order), so that ZeRO-0/1 issue a bucket's reduction once its layer's last one is
        done. The same on every rank of the job (every rank calls it, or none)."""
        self._ready.expected = dict(per_layer)

    @property
    def _keeps_master(self) -> bool:
        return self.zero == 3 or self.dtype != FP32

    # ---- the step ------------------------------------------------------------------------------
    def owned_norm_sq(self) -> torch.Tensor:
        """The squared L2 norm of this rank's part of the gradient (`norm_ranges`), a 0-d fp64 tensor:
        torch's clip arithmetic (`get_total_norm`: fp32 norms per range, multi-tensor), squared in
        fp64. `clip` sums it over the world."""
        parts = [self.grad[i][lo:hi] for i, lo, hi in self.norm_ranges]
        return (torch.nn.utils.get_total_norm(parts, foreach=True).double() ** 2 if parts
                else torch.zeros((), dtype=torch.float64, device=self.device))

    def clip(self, max_norm: float, scale: float = 1.0) -> float:
        """Clip the whole model's gradient (every rank's owned elements together, over the world)
        to L2 norm `max_norm`, as `torch.nn.utils.clip_grad_norm_` does on one model; returns the
        norm before clipping. Each rank adds up the squares of `norm_ranges` (under ZeRO-0, where
        every member of a group holds the whole reduced bucket, its 1/members part of it; owned
        shards are disjoint), one all-reduce sums them. Gradients are multiplied by the clip
        coefficient only when it is not 1.

        `scale`: the loss scale the gradients carry (fp16, `runtime.scaler`); they are divided by it
        in the same pass (the returned norm is the unscaled one). A non-finite norm (an overflow on
        some rank: the all-reduce gives every rank the same value) leaves the gradients as they are;
        the caller then skips the step (`skip`)."""
        sq = self.owned_norm_sq()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq)
        norm = math.sqrt(sq.item()) / scale
        if not math.isfinite(norm):
            return norm
        coef = min(1.0, max_norm / (norm + 1e-6)) / scale  # the same epsilon as torch's clip_grad_norm_
        if coef != 1.0:  # times 1 changes no bit
            torch._foreach_mul_(self.grad, coef)
        return norm

    def step(self, lr: float | None = None) -> None:
        """AdamW at learning rate `lr` (default `cfg.lr`; the worker passes the schedule's rate of
        this step) on every owned range, then the weights rebuilt from the updated shards (module
        docstring, "The update"): one multi-tensor call per weight-decay setting over a batch of
        buckets (`_step_batches`), then each bucket's all-gather in bucket order."""
        cfg = self.cfg
        assert not self._gathered, f"gathered weights would go stale at the step: layers {sorted(self._gathered)}"
        lr = cfg.lr if lr is None else lr
        for batch in self._step_batches():
            masters, views = {}, {}
            tensors: dict[bool, tuple[list, list, list, list]] = {True: ([], [], [], []), False: ([], [], [], [])}
            for i in batch:
                b = self.buckets[i]
                ranges = views[i] = None if self._keeps_master else self._weight_views(b)
                if ranges is None:
                    masters[i] = self.master[i] if self.master[i] is not None else self._own(
                        b, flatten(b, self.params, dtype=FP32, device=self.device, padded=True)).clone()
                    ranges = [(masters[i][lo:hi], lo, hi, decay) for lo, hi, decay in b.segments()]
                for w, lo, hi, decay in ranges:
                    for into, t in zip(tensors[decay], (w, self.grad[i][lo:hi], self.exp_avg[i][lo:hi],
                                                        self.exp_avg_sq[i][lo:hi])):
                        into.append(t)
            for decay, (p, g, m, v) in tensors.items():
                if p and cfg.name == "sgd":  # the momentum buffer is the first moment's (`exp_avg`)
                    sgd(p, g, m, foreach=True, weight_decay=cfg.weight_decay if decay else 0.0, momentum=cfg.momentum,
                        lr=lr, dampening=0.0, nesterov=False, maximize=False)
                elif p:  # one step tensor per range: the multi-tensor update increments each
                    adamw(p, g, m, v, [], [torch.tensor(float(self.steps)) for _ in p], foreach=True, amsgrad=False,
                          beta1=cfg.betas[0], beta2=cfg.betas[1], lr=lr,
                          weight_decay=cfg.weight_decay if decay else 0.0, eps=cfg.eps, maximize=False)
            for i in batch:
                b = self.buckets[i]
                if self.zero < 3 and i in masters:
                    unflatten(b, self._all_gather(b, masters[i].to(self.dtype)), self.params)
                elif self.zero < 3 and b.shards > 1:  # the updated weights in place; the others' shards
                    own = torch.zeros(b.shard_numel, dtype=FP32, device=self.device)
                    for w, lo, hi, _ in views[i]:
                        own[lo:hi].copy_(w)
                    unflatten(b, self._all_gather(b, own), self.params)
                self._clear_grad(i)
        self.steps += 1

    def _weight_views(self, b: Bucket) -> list[tuple[torch.Tensor, int, int, bool]] | None:
        """The owned elements of bucket `b` as flat views of the fp32 weights themselves, which `step`
        then updates in place (the weights are the master: no copy of them is made): [(view, start,
        end, decay)] with [start, end) in owned-shard offsets, one per owned piece; None when some
        piece's owned elements are not contiguous in its weight (a slice along a dimension > 0)."""
        out = []
        for o in owned_pieces(b):
            w = piece_view(self.params[o.piece.name].data, o.piece)
            if not w.is_contiguous():
                return None
            out.append((w.view(-1)[o.lo:o.hi], o.at, o.at + o.hi - o.lo, o.piece.decay))
        return out

    def _step_batches(self) -> list[list[int]]:
        """The buckets `step` updates together: all of them where a separate fp32 master is kept
        (mixed precision, ZeRO-3); otherwise layer by layer, since a bucket whose weights cannot be
        updated in place (`_weight_views`) gets a copy of them made at the step (at most one layer's
        copy at a time instead of the whole stage's)."""
        if self._keeps_master:
            return [list(range(len(self.buckets)))]
        return [self.layer_buckets[layer] for layer in sorted(self.layer_buckets)]

    def skip(self) -> None:
        """Drop this step's gradients without an update (an fp16 overflow, `runtime.scaler`): weights,
        master, Adam moments and the step count stay as they are."""
        for i in range(len(self.buckets)):
            self._clear_grad(i)

    def _clear_grad(self, i: int) -> None:
        """Bucket `i`'s gradient back to zero for the next step (ZeRO-0/1: its buffer is marked stale,
        which the next backward writes over, and the owned view is dropped)."""
        if self.grad_buffer is not None:
            self._stale[i] = True
            self.grad[i] = None
        else:
            self.grad[i].zero_()

    # ---- checkpoints -----------------------------------------------------------------------------
    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Collective over every bucket's group: each parameter's TP shard as fp32 CPU tensors,
        {name: {"param", "exp_avg", "exp_avg_sq"}} (the moments once a step was taken)."""
        out: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.params}
        for i, b in enumerate(self.buckets):
            master = self.master[i] if self.master[i] is not None else self._own(
                b, flatten(b, self.params, dtype=FP32, device=self.device, padded=True))
            parts = [("param", master)] + ([("exp_avg", self.exp_avg[i]), ("exp_avg_sq", self.exp_avg_sq[i])]
                                           if self.steps else [])
            for key, own in parts:
                full = self._all_gather(b, own).cpu()
                tensors = {pc.name: out[pc.name].setdefault(key, torch.empty(self.params[pc.name].shape, dtype=FP32))
                           for pc in b.pieces}
                unflatten(b, full, tensors)
        return out

    def checkpoint_entries(self, *, every_holder: bool = False):
        """The elements this rank writes into a checkpoint (`checkpoint` docstring): for each bucket it
        owns a shard of (an unsharded bucket: only its lowest rank, unless `every_holder`), per
        parameter piece (`buckets.owned_pieces`), yields (name, key, dim, start, width, lo, flat):
        elements [lo, lo + len(flat)) of the flattened slice [start, start + width) along `dim` of the
        full tensor (`dim` None: the whole tensor), for the fp32 weights and, once a step was taken,
        both Adam moments. No collective; `flat` is a view of the owned state where it can be (a copy
        of one piece at most otherwise). `every_holder`: every member of an unsharded (ZeRO-0) bucket
        yields it, as the holder of a copy (`reshard` takes pieces from any of them)."""
        for i, b in enumerate(self.buckets):
            if b.shards == 1 and b.ranks[0] != self.rank and not every_holder:
                continue
            for o in owned_pieces(b):
                piece, p = o.piece, self.params[o.piece.name]
                start, width = full_slice(piece, p.shape, self.tp_rank)
                a, c = o.at, o.at + o.hi - o.lo  # in the owned shard
                param = (self.master[i][a:c] if self.master[i] is not None
                         else piece_view(p.data, piece).reshape(-1)[o.lo:o.hi])
                yield piece.name, "param", piece.dim, start, width, o.lo, param
                if self.steps:
                    yield piece.name, "exp_avg", piece.dim, start, width, o.lo, self.exp_avg[i][a:c]
                    yield piece.name, "exp_avg_sq", piece.dim, start, width, o.lo, self.exp_avg_sq[i][a:c]

    # ---- accounting --------------------------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: `params` (the weights' storage, plus under fp32 ZeRO-3 the owned
        shard, which is then the only copy of the weights), `grads` (gradients of the weights,
        fp32 accumulators and owned shards), `optimizer` (Adam moments and a separate fp32 master)."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()

        master = sum(size(m) for m in self.master)
        weights_master = self.zero == 3 and self.dtype == FP32
        return {"params": sum(size(p) for p in self.params.values()) + (master if weights_master else 0),
                "grads": (sum(size(p.grad) for p in self.params.values()) + sum(size(g) for g in self.grad_buffer or ())
                          + (0 if self.grad_buffer is not None else sum(size(g) for g in self.grad))),
                "optimizer": sum(size(m) + size(v) for m, v in zip(self.exp_avg, self.exp_avg_sq))
                + (0 if weights_master else master)}

    # ---- tied embeddings ---------------------------------------------------------------------
    def _tied_setup(self, role: RankRole, tied: Tied | None) -> None:
        """`twins`: each transfer as (send, peer, bucket, start, end) in owned-shard offsets;
        `norm_ranges` from the owned ranges the norm counts (all but the tied head's, `twin_ranges`)."""
        self.rank = role.rank
        counted_ranges, self.twins = twin_ranges(self.buckets, self.params, role, tied)
        # [(bucket, start, end)]: the owned gradient ranges this rank's share of the norm adds up,
        # every element of the world's gradient counted once: the counted ranges of its shards, and
        # of an unsharded (ZeRO-0) bucket, which every member holds whole after its all-reduce, the
        # member's 1/n of each range (n members, member j the j-th part)
        self.norm_ranges: list[tuple[int, int, int]] = []
        for i, (b, counted) in enumerate(zip(self.buckets, counted_ranges)):
            n, j = (len(b.ranks), b.ranks.index(self.rank)) if b.shards == 1 else (1, 0)
            self.norm_ranges += [(i, lo + (hi - lo) * j // n, lo + (hi - lo) * (j + 1) // n) for lo, hi in counted
                                 if (hi - lo) * (j + 1) // n > (hi - lo) * j // n]
