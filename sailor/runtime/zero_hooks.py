"""The layer hooks of the runtime's optimizer (`runtime.zero.ShardedAdamW`, built on `ZeroLayerHooks`),
its end-of-step reduction and the collectives they run: ZeRO-3's parameter gathers and their
prefetch, and the gradient reductions of every ZeRO stage, overlapped with the backward.

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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sailor.runtime.buckets import Bucket, flatten, piece_view, unflatten
from sailor.runtime.grad_sync import SyncTimeline
from sailor.runtime.tied import add_twins

FP32 = torch.float32


class ZeroLayerHooks:
    """The layer hooks `executor.StageExecutor` calls around each layer's forward and backward, the
    step's `reduce` and the collectives behind them (module docstring), as the base class of
    `zero.ShardedAdamW`. It keeps no state of its own: it works on what `ShardedAdamW.__init__` sets
    up (`params`, `buckets`, `layer_buckets`, `layer_params`, `groups`, `zero`, `reshard`, `dtype`,
    `device`, `master`, `grad`, `grad_buffer`, `twins`, `rank`, `timeline`, and the bookkeeping
    `_gathered`, `_prefetched`, `_stale`, `_ready`, `_inflight`, `_lanes`).
    """

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

    # ---- the step's reduction ------------------------------------------------------------------
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
