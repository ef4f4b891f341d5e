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

ZeRO-3 gathers, prefetched: before a layer's forward (backward) the hooks also issue, asynchronously,
the all-gather of the layer the same pass runs next (`executor`: `before_forward(l, next)`), so it
runs while layer l computes, as FSDP's forward and backward prefetch do (Zhao et al., "PyTorch FSDP",
VLDB 2023, §3.3.3: one layer ahead, bounding the extra memory to one more gathered layer); the
first layer of each pass is gathered on demand. Whether the next layer is issued depends only on the
hook sequence, which is the same on every member of a group (below), so every member issues the
gathers in one order. `reshard_after_forward` (the plan's `StageMemory`, FSDP's name for it): True
frees a layer's gathered weights after each forward and each backward (2·m gathers per layer per
step of m micro-batches); False keeps them from their first gather of the step until the layer's last
backward of the step (one gather per layer per step; the whole stage's weights may then be held at
once, as under ZeRO-2). Without `expect_backwards`, kept weights are freed in `reduce`; `step` never
leaves a gathered (then stale) layer in place.

Gradient buffers (ZeRO-0/1): each bucket has one fp32 buffer, padded to its shards, that every
layer's backward adds its gradients into and frees them (`_accumulate`; at most one layer's gradients
exist outside the buffers); the buffer is weighted and all-reduced (ZeRO-0) or reduce-scattered
(ZeRO-1) in place, as Megatron-LM's contiguous gradient buffer (`main_grad`) is, so no second full
copy of the gradients is ever made (one made per bucket would add 4 bytes/param at the reduction).
After the step a buffer is not zeroed: the layer's first backward of the next step writes its
gradients over it (a copy instead of an add: one pass over the buffer less per step).

Overlap (`runtime.grad_sync`): the collectives are asynchronous. Under ZeRO-0/1 a bucket's is issued
as soon as its layer's last backward of the step is done (`expect_backwards` tells how many backwards
that is; without it, e.g. when a caller drives the hooks by hand, everything is issued in `reduce`),
in one fixed bucket order on every rank; under ZeRO-2/3 each layer's reduce-scatter of a micro-batch
is issued after its backward and waited on after the next layer's. Transients this adds over the
sequential rule: ZeRO-1, each in-flight reduce-scatter's output shard until `reduce` (at most 4/d
bytes per parameter); ZeRO-2/3, one more layer's flat fp32 gradient and shard. `reduce` waits for
everything; the step's `timeline` records when each was issued and when the backward ended. Under
gloo the reductions of a group go out on its lanes in turn (`lanes`, `groups.create_sync_lanes`), so
several move at once over their own connections.

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
from sailor.runtime.tied import Tied, add_twins, twin_ranges
from sailor.runtime.topology import RankRole, Ranks

FP32 = torch.float32


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The weights' and activations' dtype for a job's `precision`: bf16 or fp16 on CUDA for "bf16" or
    "fp16", fp32 otherwise (the runtime trains in fp32 on CPU; tests pass a half dtype explicitly)."""
    if device.type != "cuda":
        return FP32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, FP32)


class ShardedAdamW:
    """AdamW over one stage's parameters, sharded as ZeRO-`zero` (module docstring); also the layer
    hooks `executor.StageExecutor` calls around each layer's forward and backward.

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

    # ---- layer hooks (called by the executor, in the same order on every member) ----------------
    def before_forward(self, layer: int, upcoming: int | None = None) -> None:
        if self.timeline.start is None:
            self.timeline.start = self.timeline.mark()
        if self.zero == 3:
            self._gather(layer, upcoming)

    def after_forward(self, layer: int) -> None:
        if self.zero == 3 and self.reshard:
            self._free(layer)

    def before_backward(self, layer: int, upcoming: int | None = None) -> None:
        if self.zero == 3:
            self._gather(layer, upcoming)

    def after_backward(self, layer: int) -> None:
        """The layer's backward of one micro-batch is done (or skipped: its gradients are None): its
        gradients go into the buffers (ZeRO-0/1; buckets now final are issued) or are reduce-scattered
        (ZeRO-2/3)."""
        if self.zero >= 2:
            self._reduce_scatter(layer)
        else:
            self._accumulate(layer)
        ready = self._ready.backward_done(layer)
        if self._ready.all_final and self.timeline.backward_end is None:
            self.timeline.backward_end = self.timeline.mark()
        if self.grad_buffer is not None:
            for i in ready:
                self._issue(i)
        if self.zero == 3 and (self.reshard or self._ready.layer_final(layer)):
            self._free(layer)

    # ---- the step ------------------------------------------------------------------------------
    def reduce(self) -> None:
        """After the last backward of the step: issue the buckets' reductions not issued yet (ZeRO-0:
        all-reduce, ZeRO-1: reduce-scatter; ZeRO-2/3 issued theirs per micro-batch), wait for every
        one, then add the tied copies' twins (collective with the other copy's holders). Ends the
        step's `timeline` (kept as `last_timeline`)."""
        assert not self._prefetched, f"gathers still in flight at the step's end: {sorted(self._prefetched)}"
        for layer in sorted(self._gathered):  # kept weights (no `expect_backwards`)
            self._free(layer)
        rest = self._ready.rest()
        if self.grad_buffer is not None:
            for i in rest:
                self._issue(i)
        self._inflight.wait()
        self.timeline.waited = self.timeline.mark()
        self.last_timeline, self.timeline = self.timeline, SyncTimeline(self.device)
        self._add_twins()

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
        parts = [self.grad[i][lo:hi] for i, lo, hi in self.norm_ranges]
        # torch's clip arithmetic (`get_total_norm`: fp32 norms per range, multi-tensor), squared and
        # summed over the world in fp64
        sq = (torch.nn.utils.get_total_norm(parts, foreach=True).double() ** 2 if parts
              else torch.zeros((), dtype=torch.float64, device=self.device))
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

    def _add_twins(self) -> None:
        """Add to each held element of a tied copy the other copy's (`tied.add_twins`)."""
        add_twins(self.twins, self.grad, self.rank, self.device)

    # ---- collectives -------------------------------------------------------------------------
    def _owned(self, b: Bucket, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a padded flat vector of `b` that is its own storage (`flat` itself
        when the rank owns all of it, no copy)."""
        return flat if b.shards == 1 else self._own(b, flat).clone()

    def _own(self, b: Bucket, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a padded flat vector of bucket `b` (the whole of it under ZeRO-0)."""
        return flat[b.index * b.shard_numel:(b.index + 1) * b.shard_numel]

    def _all_gather(self, b: Bucket, own: torch.Tensor) -> torch.Tensor:
        """The padded flat vector of `b` from every member's shard `own`."""
        work, full = self._all_gather_async(b, own)
        if work is not None:
            work.wait()
        return full

    def _all_gather_async(self, b: Bucket, own: torch.Tensor) -> tuple[object | None, torch.Tensor]:
        """Start gathering the padded flat vector of `b` from every member's shard `own`: (work handle,
        the vector, valid once the work is waited on); (None, own) when the rank owns all of it."""
        if b.shards == 1:
            return None, own
        full = torch.empty(b.shards * b.shard_numel, dtype=own.dtype, device=own.device)
        return dist.all_gather_single(full, own.contiguous(), group=self.groups[b.ranks], async_op=True), full

    def _reduce_async(self, b: Bucket, flat: torch.Tensor) -> tuple[object | None, torch.Tensor]:
        """Start the SUM over `b`'s members of their padded flat vectors `flat`: (work handle, result)
        with the result all of `flat` under ZeRO-0 (all-reduce, in place) and a new tensor for this
        rank's shard otherwise (reduce-scatter); valid once the work is waited on. It goes out on the
        group's next lane (`grad_sync.Lanes`). A group of one rank: (None, flat)."""
        if len(b.ranks) == 1:
            return None, flat
        group = self._lanes.next(b.ranks)
        if b.shards == 1:
            return dist.all_reduce(flat, group=group, async_op=True), flat
        out = torch.empty(b.shard_numel, dtype=flat.dtype, device=flat.device)
        return dist.reduce_scatter_single(out, flat, group=group, async_op=True), out

    def _gather(self, layer: int, upcoming: int | None) -> None:
        """ZeRO-3: put `layer`'s full weights in place (waiting for its prefetch, or gathering now),
        then issue the prefetch of `upcoming` (module docstring)."""
        if layer not in self._gathered:
            self.timeline.gathers.append((layer, layer in self._prefetched))
            pending = self._prefetched.pop(layer, None) or self._start_gather(layer)
            for n in self.layer_params[layer]:
                p = self.params[n]
                p.untyped_storage().resize_(p.numel() * p.element_size())
            for work, full, _own, i in pending:
                if work is not None:
                    work.wait()
                unflatten(self.buckets[i], full, self.params)
            self._gathered.add(layer)
        if upcoming is not None and upcoming not in self._gathered and upcoming not in self._prefetched:
            self._prefetched[upcoming] = self._start_gather(upcoming)

    def _start_gather(self, layer: int) -> list[tuple]:
        """Issue the all-gathers of `layer`'s buckets: [(work or None, padded full flat, own shard,
        bucket)], the full vectors valid once their work is waited on."""
        out = []
        for i in self.layer_buckets[layer]:
            own = self.master[i].to(self.dtype)
            out.append((*self._all_gather_async(self.buckets[i], own), own, i))
        return out

    def _free(self, layer: int) -> None:
        for n in self.layer_params[layer]:
            self.params[n].untyped_storage().resize_(0)
        self._gathered.discard(layer)

    @torch.no_grad()
    def _accumulate(self, layer: int) -> None:
        """ZeRO-0/1: add the layer's gradients of this micro-batch (unweighted) into its buckets'
        gradient buffers and free them; at most one layer's gradients exist outside the buffers."""
        for i in self.layer_buckets[layer]:
            b, flat, offset = self.buckets[i], self.grad_buffer[i], 0
            for piece in b.pieces:
                g, dst = self.params[piece.name].grad, flat[offset:offset + piece.numel]
                if g is not None and self._stale[i]:
                    dst.view(piece_view(g, piece).shape).copy_(piece_view(g, piece))
                elif g is not None:
                    dst.view(piece_view(g, piece).shape).add_(piece_view(g, piece))
                elif self._stale[i]:
                    dst.zero_()
                offset += piece.numel
            self._stale[i] = False
        for n in self.layer_params[layer]:
            self.params[n].grad = None

    @torch.no_grad()
    def _issue(self, i: int) -> None:
        """ZeRO-0/1, bucket `i` final: weight its gradient buffer per piece (module docstring: gradient
        sum) and start its SUM over the members, in place; once waited on, `grad[i]` is the buffer
        (ZeRO-0) or the own shard written back into its place in the buffer (ZeRO-1: a transient of one
        shard). No copy of the buffer is made; nothing writes to it until `step` clears it."""
        b, flat = self.buckets[i], self.grad_buffer[i]
        if self._stale[i]:  # no backward of the step reached it
            flat.zero_()
            self._stale[i] = False
        offset = 0
        for piece in b.pieces:
            if piece.weight != 1.0:
                flat[offset:offset + piece.numel].mul_(piece.weight)
            offset += piece.numel
        work, out = self._reduce_async(b, flat)
        if work is not None:
            self.timeline.issued.append((i, self.timeline.mark()))

        def finish() -> None:
            if b.shards == 1:
                self.grad[i] = out
            else:
                own = self._own(b, flat)
                own.copy_(out)
                self.grad[i] = own
            if work is not None:
                self.timeline.finished.append((i, self.timeline.mark()))
        self._inflight.add(work, finish)

    @torch.no_grad()
    def _reduce_scatter(self, layer: int) -> None:
        """ZeRO-2/3: start the reduce-scatter of the layer's weighted gradients of this micro-batch
        (added to the owned accumulators once done), then wait for the previous layer's."""
        issued = 0
        for i in self.layer_buckets[layer]:
            b = self.buckets[i]
            flat = flatten(b, {pc.name: self.params[pc.name].grad for pc in b.pieces}, weighted=True,
                           dtype=FP32, device=self.device, padded=True)
            work, out = self._reduce_async(b, flat)
            if work is not None:
                self.timeline.issued.append((i, self.timeline.mark()))

            # `flat` stays referenced until the collective is waited on (it reads it until then)
            def finish(i: int = i, out: torch.Tensor = out, flat: torch.Tensor = flat, work=work) -> None:
                self.grad[i].add_(out)
                if work is not None:
                    self.timeline.finished.append((i, self.timeline.mark()))
            self._inflight.add(work, finish)
            issued += 1
        for n in self.layer_params[layer]:
            self.params[n].grad = None
        self._inflight.wait(keep=issued)

