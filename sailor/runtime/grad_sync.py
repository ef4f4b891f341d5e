"""Overlapped gradient reduction: when each bucket's collective is issued, waiting for them, and the
step's timeline of both.

DDP and FSDP start a bucket's all-reduce or reduce-scatter as soon as its gradients are final, while
the backward goes on with the earlier layers (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3;
torch docs, `DistributedDataParallel`, "gradient bucketing ... overlapping with backward"). The
optimizer (`zero.ShardedAdamW`) does the same, with `async_op=True` collectives (torch.distributed
docs, "Synchronous and asynchronous collective operations": the call returns a work handle; on NCCL
the collective runs on the communicator's own stream, and `Work.wait()` makes the current stream wait
for it; under gloo it runs on the process group's worker threads and `wait` blocks the host).

When a bucket's gradients are final:
- ZeRO-0/1 accumulate every micro-batch into the bucket's buffer, so its gradients are final after the
  layer's last backward of the step: the last B op of the layer's chunk in the stage's order, or the
  last W op under a split backward (ZB-H1). `backwards_per_layer` counts those ops per layer from the
  order (skipped rounds included: they call the same hooks), and `ReadyOrder` counts the optimizer's
  `after_backward` calls against it.
- ZeRO-2/3 reduce-scatter every micro-batch's gradients of a layer right after its backward; those are
  issued at once, and waited on one layer later (`InFlight.wait(keep=...)`), so each runs under the
  next layer's backward, or the next micro-batch's compute for the first layer of a micro-batch.
  Not later: waiting only before a bucket's next use (its layer's backward of the next micro-batch)
  would let a whole micro-batch of the stage's flat fp32 gradients be in flight at once, 4 bytes a
  parameter more than the sharded gradients ZeRO-2 exists to save; one layer later bounds the
  transient to one layer's (`simulator.memory.sync_buffer_bytes` counts it), as FSDP2 bounds its
  own (its post-backward waits for the previous reduce-scatter before issuing the next). The price:
  where one layer's reduce-scatter outlasts the next layer's backward, that backward waits for it.
  `SyncTimeline.finished` records where each collective was waited on.
Everything is waited on in `ShardedAdamW.reduce`, before the tied embedding's twins, clipping and the
step.

Why every member of a group issues its collectives in the same order (NCCL requires it per
communicator; gloo matches collectives by a per-group sequence number, so it needs it too):
- ZeRO-0/1: buckets are issued in one fixed order, the bucket list (`runtime.buckets`: sorted by
  (layer, group size, group), one total order on every rank) reversed, each bucket once it and every
  bucket before it in that order are final (`ReadyOrder`). So the sequence of bucket collectives on
  every rank is that reversed list, whatever the schedule and however many micro-batches its pipeline
  runs; two ranks in a group issue their common buckets in the same relative order. The only timing
  that differs between ranks is how early each is issued. A stage's backward finishes its layers in
  descending order (and an interleaved stage's higher chunks, which hold higher layers, before its
  lower ones), so the fixed order delays nothing in the usual case: a bucket waits only for final
  buckets of higher layers. During the schedule, no other collective runs on a bucket's group of
  another pipeline (gradient groups of ZeRO-0/1 carry nothing else until `reduce`); a TP group that
  is also a stage group (one pipeline) sees its ranks run one program, so TP collectives and bucket
  collectives interleave identically on both.
- ZeRO-2/3: issued in the executor's layer-hook order, as before (`executor` module docstring): every
  member runs the same rounds (`schedule.step_rounds`), so the same hooks in the same order.
- Lanes (`groups.create_sync_lanes`, under gloo): a group's reductions go out on its lanes in turn,
  the k-th reduction of the group on lane k mod lanes (`Lanes`); k counts the group's reductions
  on this rank, which is the same sequence on every member by the two points above, so every lane
  sees one order on all its members too. Other collectives of the group (the ZeRO-1 all-gathers,
  checkpoints) stay on its lane 0, the group itself, in their fixed places between the reductions.
`comm_check` models the pipeline's point-to-point transfers, not collectives: this ordering argument is
what covers them.

The timeline (`SyncTimeline`): per step, the point each bucket's collective was issued, the point the
stage's last layer backward of the step finished, and the point every collective had been waited on,
as `timing.PhaseClock` marks (host clock on CPU, CUDA events on a GPU, where issuing is queuing on the
stream), read as seconds since the step's first forward hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from sailor.plan.orders import BWD, WGRAD, Op
from sailor.runtime.timing import PhaseClock, seconds_between
from sailor.runtime.topology import Ranks


def backwards_per_layer(order: Sequence[Op], chunks: Sequence[tuple[int, int]]) -> dict[int, int]:
    """{layer: how many times a step of `order` runs the layer's last backward hook}: the W ops of the
    layer's chunk when the order splits backwards (has W ops), else its B ops; `chunks[c]` is chunk c's
    half-open layer range."""
    kind = WGRAD if any(op.kind == WGRAD for op in order) else BWD
    per_chunk = [sum(1 for op in order if op.kind == kind and op.chunk == c) for c in range(len(chunks))]
    return {layer: per_chunk[c] for c, (a, b) in enumerate(chunks) for layer in range(a, b)}


class ReadyOrder:
    """Which buckets to issue now (module docstring): buckets go out in the order `order` (bucket
    indices), each once it and all before it are final; a bucket is final when its layer
    (`layer_of[i]`) has had its `expected` backwards of the step. Without `expected` nothing becomes
    final during the step and `rest` hands out everything."""

    def __init__(self, order: Sequence[int], layer_of: Sequence[int]) -> None:
        self.order, self.layer_of = list(order), list(layer_of)
        self.expected: Mapping[int, int] | None = None
        self._count: dict[int, int] = {}
        self._next = 0  # position in `order` of the first bucket not yet handed out

    @property
    def all_final(self) -> bool:
        """Every layer had its expected backwards this step (False without `expected`)."""
        return self.expected is not None and all(self._count.get(layer, 0) >= n for layer, n in self.expected.items())

    def layer_final(self, layer: int) -> bool:
        """`layer` had its expected backwards this step (False without `expected`)."""
        return self.expected is not None and self._count.get(layer, 0) >= self.expected.get(layer, 0)

    def backward_done(self, layer: int) -> list[int]:
        """Count one backward of `layer`; returns the buckets that may now be issued, in order.
        Raises AssertionError if the layer ran more backwards than expected."""
        self._count[layer] = self._count.get(layer, 0) + 1
        if self.expected is None:
            return []
        assert self._count[layer] <= self.expected.get(layer, 0), (layer, self._count[layer], self.expected)
        out = []
        while (self._next < len(self.order)
               and self._count.get(self.layer_of[self.order[self._next]], 0) >= self.expected.get(
                   self.layer_of[self.order[self._next]], 0)):
            out.append(self.order[self._next])
            self._next += 1
        return out

    def rest(self) -> list[int]:
        """The buckets not handed out yet, in order; starts the next step (counts back to zero)."""
        out = self.order[self._next:]
        self._count.clear()
        self._next = 0
        return out


class InFlight:
    """Asynchronous collectives issued and not yet waited on, in issue order: (work handle or None,
    what to do once it completed)."""

    def __init__(self) -> None:
        self.items: list[tuple[object | None, Callable[[], None]]] = []

    def add(self, work, finish: Callable[[], None]) -> None:
        self.items.append((work, finish))

    def wait(self, keep: int = 0) -> None:
        """Wait for all but the `keep` most recent, oldest first, and run their `finish`."""
        n = max(0, len(self.items) - keep)
        done, self.items = self.items[:n], self.items[n:]
        for work, finish in done:
            if work is not None:
                work.wait()  # type: ignore[attr-defined]
            finish()


class Lanes:
    """The process group each gradient reduction of a group goes out on (module docstring): in turn
    over `lanes[ranks]` (the group's lanes, `groups.create_sync_lanes`), or `groups[ranks]` for a
    group without lanes."""

    def __init__(self, groups: Mapping[Ranks, object], lanes: Mapping[Ranks, Sequence[object]]) -> None:
        self.groups, self.lanes = groups, lanes
        self.issued: dict[Ranks, int] = {}  # reductions handed out per group with lanes

    def next(self, ranks: Ranks) -> object:
        """The group the next reduction over `ranks` goes out on. Raises KeyError for a group this
        rank has neither lanes nor a group of."""
        lanes = self.lanes.get(ranks)
        if not lanes:
            return self.groups[ranks]
        k = self.issued.get(ranks, 0)
        self.issued[ranks] = k + 1
        return lanes[k % len(lanes)]


class SyncTimeline:
    """One step's gradient-sync points (module docstring), as `PhaseClock` marks."""

    def __init__(self, device: torch.device) -> None:
        self.clock = PhaseClock(device)
        self.start: object = None  # the step's first forward hook
        self.issued: list[tuple[int, object]] = []  # (bucket, mark) per collective issued
        self.finished: list[tuple[int, object]] = []  # (bucket, mark) per collective waited on, in wait order
        self.backward_end: object = None  # the last layer's last backward hook of the step
        self.waited: object = None  # every collective waited on (`reduce`)
        self.gathers: list[tuple[int, bool]] = []  # ZeRO-3: (layer, issued ahead by the prefetch) per gather

    def mark(self) -> object:
        return self.clock.mark()

    def seconds(self) -> dict:
        """{"issued_s": [(bucket, s)], "finished_s": [(bucket, s)], "backward_end_s": s or None,
        "waited_s": s or None}, seconds since `start` (on CUDA, waits for the marks; a finished mark is
        where the host waited, the device's wait may end later). Raises AssertionError when the step
        never started."""
        assert self.start is not None, "no step recorded"

        def s(m: object) -> float | None:
            return None if m is None else seconds_between(self.start, m)

        return {"issued_s": [(i, s(m)) for i, m in self.issued], "finished_s": [(i, s(m)) for i, m in self.finished],
                "backward_end_s": s(self.backward_end), "waited_s": s(self.waited)}
