"""Pipeline parallelism: stage slicing, point-to-point transfers and the execution of a schedule.

`torch.distributed.pipelining` assumes one rank per stage and the same shapes on both sides of a
stage boundary; it cannot connect a TP-2 replica to a TP-1 replica, nor fan one activation out to
several TP ranks. So the runtime keeps its own small schedules: `plan.spec.Schedule.order`
(pure) orders the passes of one stage (1F1B, interleaved 1F1B, ZB-H1), and `run_pipeline` executes
that order, each pass through the `executor.StageExecutor` of its chunk.

Stage boundaries are scatter-gather (Narayanan et al., SC'21 §4.1, generalised to replicas of
different TP degrees): every TP rank of a replica holds the full (B, T, h) output (a
sequence-parallel chunk gathers its last block's output first); flattened in sequence-major order
((T, B, h), Megatron-LM's layout) it is cut into the slices of `plan.comms.boundary_pieces`. TP rank
s of a sending replica of TP degree a sends only its 1/a of it, in the compute dtype, to the ranks
of the receiving replica (TP degree b) whose 1/b slice overlaps it; TP rank r of the receiver
collects its 1/b slice from one or more senders and all-gathers the full tensor over its TP group,
on the fast intra-node link (`P2P.receive`). The input gradient goes back the same way. So each
activation and each gradient crosses the boundary once, not once per receiving rank; `P2P.sent`
counts the bytes. Under sequence parallelism a chunk's edge at a boundary is already this rank's
slice of the sequence, which is exactly its slice above (the sequence-major 1/t share; T is a
multiple of t): there the sender gathers nothing before sending and the receiver nothing after
receiving (`tensor_parallel.sliced_edges`, `P2P.sliced`).

Transfers follow NCCL's rules (checked on CPU by `comm_check`, over the tests' plans and a sweep):
- Each channel, one direction of one kind (activations or gradients) between two ranks, has its
  own 2-rank process group (`groups.create_channel_groups`, created at start-up in one order on all
  ranks): under NCCL its own communicator and stream, so a send blocked until its receiver is ready
  holds up only later messages of its own channel, never the other direction or kind.
- No transfer has a tag. On each channel both ends post in the same order (`messages` module
  docstring: the schedules run their forwards, and their backwards, in one (chunk, micro-batch)
  sequence on every stage), so messages are matched in posting order, as NCCL does; the CPU tests run
  with every tag forced to 0 (`groups.ignore_tags`) and still equal the single-process run.
- The op order and its transfers come from `messages.rank_program`: a rank posts op j + 1's receive
  at the start of op j, so the next input can arrive during op j's compute. Sends are `isend`s whose
  tensors are kept until they complete (at the latest at the end of the step). With non-blocking
  sends the orders are deadlock-free (Narayanan et al., SC'21, §2.2; the interleaved and ZB-H1 orders
  are checked by their event simulation, `simulator.schedule_orders`), and on separate channels an
  NCCL send blocks only its own channel's stream, not the compute (`comm_check` models both).
- Who posts: on CUDA the rank's thread calls `isend`/`irecv`, which only enqueue the transfer on its
  channel's NCCL stream (the compute goes on: the device's NIC and copy engines move the bytes). On
  CPU (gloo) the calling thread would itself write the message into the socket and post each
  receive's notification, so the rank's compute thread would pay every transfer's network stack
  work, and a testbed's device quota would throttle transfers as compute. There every `isend` and
  `irecv` of `P2P` is posted instead by the process's post thread (`post_thread.PostThread`, named
  for the testbed's communication cgroup), in the order `P2P` submits them: one thread with one FIFO
  queue, so each channel's posting order is the rank's program order, as above. The rank keeps each
  post's Future and waits on its Work (`P2P.receive`, `P2P.finish`); what posting raised is raised in
  the rank, and a post the thread does not make within `timeout` raises TimeoutError.
- On CUDA a receive is waited on by the stream (`Work.wait()` makes the current stream wait for it;
  the host goes on); a transfer that hangs fails after the group's timeout (NCCL's watchdog). On
  CPU (gloo) the host waits, at most `timeout`.
- The world group carries no pipeline transfer (only the tied embedding's and ZeRO's batched
  transfers after the schedule, and collectives).
- Not yet run on a GPU. NCCL's user guide ("Using multiple NCCL communicators concurrently") does not
  guarantee progress when kernels of several communicators of one device wait on each other at once;
  the runtime relies, as overlapped data-parallel and pipeline communication in torch and Megatron-LM
  do, on the GPU running them concurrently. A first GPU run should check it with activations of real
  sizes (>= 4 MiB, beyond NCCL's buffers).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import Work

from sailor.plan.orders import BWD, FWD, Op
from sailor.runtime.balance import LoadBalancing
from sailor.runtime.executor import ActivationMeter, StageExecutor
from sailor.runtime.messages import ACTIVATION, Channel, Transfer, rank_program
from sailor.runtime.post_thread import PostThread, shared_post_thread
from sailor.runtime.timing import PhaseClock
from sailor.runtime.topology import Link, RankRole


def build_stage(model: nn.Module, chunks: Sequence[tuple[int, int]]) -> nn.Module:
    """Delete the layers of `model` (a GPT) outside the half-open ranges `chunks`, in place; returns
    it. Remaining layers keep their global names `layers.<i>`."""
    keep = [i for a, b in chunks for i in range(a, b)]
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    assert list(model.layers.keys()) == [str(i) for i in sorted(keep)]
    return model


@dataclass
class StageTimes:
    """Seconds this rank spent in one step, by phase: on a GPU the device's time between the phase's
    points of the compute stream (CUDA events, `runtime.timing.PhaseClock`), on the CPU the host's."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0  # blocked on receives from neighbour stages
    weight_s: float = 0.0  # of backward_s: the weight-gradient passes (W ops) of a split backward


class OpTrace(NamedTuple):
    """One op of `run_pipeline` on the CPU: its kind (F, B, W), chunk, micro-batch, whether it received
    its input from a neighbour stage, and three points of the host's monotonic clock (seconds,
    `time.perf_counter`, shared by every process of the machine): the op began (its receives
    posted), its input was there (the receive taken; = start without one), its pass ended (read
    before its sends are posted, so that on the shared clock every message arrives after its
    sender's end: a read after the posts could come later than the receiver's)."""

    kind: str
    chunk: int
    micro_batch: int
    received: bool
    start_s: float
    ready_s: float
    end_s: float


@dataclass
class P2P:
    """Point-to-point transfers of one rank across its stage boundaries, each on its channel's group
    (`channels`, from `groups.create_channel_groups`; global ranks), scattered and gathered as the
    module docstring says. Activations and their gradients cross in `dtype`, the weights' compute
    dtype (the same on both sides of every boundary: it is the job's). `tp_group` is this rank's TP
    group (needed to gather when `role.tp` > 1). Raises KeyError for a transfer on a channel it has
    no group for, ValueError when a slice does not fall on whole elements."""

    role: RankRole
    shape: tuple[int, ...]  # (B, T, h) of one micro-batch's activation
    device: torch.device
    timeout: timedelta
    dtype: torch.dtype = torch.float32
    channels: Mapping[Channel, dist.ProcessGroup] = field(default_factory=dict)
    tp_group: dist.ProcessGroup | None = None
    # per chunk, (input, output) cross as this rank's sequence slice (`tensor_parallel.sliced_edges`)
    sliced: tuple[tuple[bool, bool], ...] = ()
    pending: list = field(default_factory=list)  # (post, tensor): kept alive until the send completes
    posted: dict = field(default_factory=dict)  # Transfer -> post of a receive posted, not yet taken
    slices: dict = field(default_factory=dict)  # Message -> this rank's slice buffer, filled by `posted`
    sent: dict = field(default_factory=dict)  # kind -> bytes this rank has sent (ACTIVATION, GRADIENT)
    # kind -> elements (fp64) of the side message every transfer of that kind is followed by on its
    # channel (`balance.LoadBalancing.side_sizes`, set by `run_pipeline`; none when empty)
    side_sizes: Mapping[str, int] = field(default_factory=dict)
    side_posted: dict = field(default_factory=dict)  # Transfer -> (post, buffer) of a side receive
    # A *post* is the Work of an isend/irecv, or on CPU the Future of it from the post thread.
    _poster: PostThread | None = field(default=None, init=False, repr=False)

    def _post(self, fn: Callable, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup) -> Work | Future:
        """fn(tensor, peer, group=group) (`dist.isend` or `dist.irecv`): on CPU posted by this process's
        post thread (`post_thread`, module docstring; a Future of the Work), on CUDA here (the Work)."""
        if self.device.type == "cuda":
            return fn(tensor, peer, group=group)
        if self._poster is None:
            self._poster = shared_post_thread()
        return self._poster.submit(functools.partial(fn, group=group), tensor, peer)

    def _work(self, post: Work | Future) -> Work:
        """The Work of `post`, waiting at most `timeout` for the post thread to post it; raises what
        posting raised, or TimeoutError."""
        if not isinstance(post, Future):
            return post
        try:
            return post.result(self.timeout.total_seconds())
        except TimeoutError:
            if post.done():  # what posting raised
                raise
            raise TimeoutError(f"rank {self.role.rank}: the post thread posted no transfer within {self.timeout}") from None

    def _done(self, post: Work | Future) -> bool:
        """Whether `post` is posted and its transfer complete (raises what posting raised)."""
        return (not isinstance(post, Future) or post.done()) and self._work(post).is_completed()

    def _span(self, link: Link) -> tuple[int, int]:
        """[start, end) in elements of the flattened (T, B, h) tensor of `link`'s slice."""
        n = math.prod(self.shape)
        lo, hi = link.lo * n, link.hi * n
        if lo.denominator != 1 or hi.denominator != 1:
            raise ValueError(f"rank {self.role.rank}: slice [{link.lo}, {link.hi}) of a {self.shape} activation "
                             "is not whole elements (h must be divisible by both TP degrees)")
        return int(lo), int(hi)

    def _link(self, t: Transfer, receiving: bool) -> Link:
        ch = t.channel
        if receiving:
            links, peer = (self.role.fwd_recv_from if ch.kind == ACTIVATION else self.role.bwd_recv_from), ch.src
        else:
            links, peer = (self.role.fwd_send_to if ch.kind == ACTIVATION else self.role.bwd_send_to), ch.dst
        return next(link for link in links if link.rank == peer)

    def _sliced(self, t: Transfer, receiving: bool) -> bool:
        """Whether `t`'s end on this rank is a sequence-parallel slice (no gather, no full tensor)."""
        if not self.sliced:
            return False
        u = t.message.boundary  # the boundary u -> u + 1: this rank is u + 1 for an activation it
        mine_is_input = (t.channel.kind == ACTIVATION) == receiving  # receives or a gradient it sends
        chunk = (u + 1 if mine_is_input else u) // self.role.num_stages
        return self.sliced[chunk][0 if mine_is_input else 1]

    def post(self, t: Transfer) -> None:
        """Post the receive of `t` into its part of this rank's slice buffer of `t.message` (1/tp of
        the flattened tensor, made at the message's first post)."""
        n, tp, r = math.prod(self.shape), self.role.tp, self.role.tp_rank
        buf = self.slices.get(t.message)
        if buf is None:
            buf = self.slices[t.message] = torch.empty(n // tp, dtype=self.dtype, device=self.device)
        a, b = self._span(self._link(t, receiving=True))
        base = r * (n // tp)  # this rank's slice starts there
        group = self.channels[t.channel]
        self.posted[t] = self._post(dist.irecv, buf[a - base:b - base], t.channel.src, group)
        size = self.side_sizes.get(t.channel.kind)
        if size:  # posted right after the slice on the same channel: the sender's order
            side = torch.empty(size, dtype=torch.float64, device=self.device)
            self.side_posted[t] = (self._post(dist.irecv, side, t.channel.src, group), side)

    def _wait(self, t: Transfer, post: Work | Future) -> None:
        if self.device.type == "cuda":
            post.wait()
        elif not self._work(post).wait(self.timeout):
            raise TimeoutError(f"rank {self.role.rank}: no data from rank {t.channel.src} within {self.timeout}")

    def receive(self, transfers: Sequence[Transfer]) -> torch.Tensor:
        """The (B, T, h) tensor whose slices `transfers` (one message) bring (posted now if they were
        not); gathered over the TP group when tp > 1. On CUDA the current stream waits for the
        receives; on CPU the host, at most `timeout` each (raises TimeoutError)."""
        assert transfers and len({t.message for t in transfers}) == 1, transfers
        for t in transfers:
            if t not in self.posted:
                self.post(t)
        for t in transfers:
            self._wait(t, self.posted.pop(t))
        mine = self.slices.pop(transfers[0].message)
        B, T, h = self.shape
        if self._sliced(transfers[0], receiving=True):  # this rank's tokens: (T/t, B, h) -> (B, T/t, h)
            return mine.view(T // self.role.tp, B, h).transpose(0, 1).contiguous()
        if self.role.tp > 1:
            full = torch.empty(math.prod(self.shape), dtype=self.dtype, device=self.device)
            dist.all_gather_into_tensor(full, mine, group=self.tp_group)  # TP rank order = slice order
        else:
            full = mine
        return full.view(T, B, h).transpose(0, 1).contiguous()  # (T, B, h) -> (B, T, h)

    def receive_side(self, transfers: Sequence[Transfer]) -> torch.Tensor:
        """The side message that followed `transfers` (one message, already `receive`d), from the first
        sender (every sender sends the same)."""
        sides = []
        for t in transfers:
            work, side = self.side_posted.pop(t)
            self._wait(t, work)
            sides.append(side)
        return sides[0]

    def send(self, x: torch.Tensor, transfers: Sequence[Transfer], side: torch.Tensor | None = None) -> None:
        """Send each transfer's slice of `x` ((B, T, h), or this rank's (B, T/t, h) where the edge is
        sliced, in `dtype`) on its channel, each followed there by `side` (fp64, `side_sizes`) if given."""
        # Sends that completed free their tensors now, not at the end of the step.
        self.pending = [(w, y) for w, y in self.pending if not self._done(w)]
        if not transfers:
            return
        flat = x.detach().to(self.dtype).transpose(0, 1).contiguous().view(-1)  # sequence-major (T, B, h)
        n, sliced = math.prod(self.shape), self._sliced(transfers[0], receiving=False)
        base = self.role.tp_rank * (n // self.role.tp) if sliced else 0  # where a sliced x starts in the full one
        assert flat.numel() == (n // self.role.tp if sliced else n), (x.shape, self.shape, sliced)
        for t in transfers:
            a, b = self._span(self._link(t, receiving=False))
            piece = flat[a - base:b - base]
            for y in (piece,) if side is None else (piece, side):  # one channel: the side right after
                self.pending.append((self._post(dist.isend, y, t.channel.dst, self.channels[t.channel]), y))
                self.sent[t.channel.kind] = self.sent.get(t.channel.kind, 0) + y.numel() * y.element_size()

    def finish(self) -> None:
        """Wait for every send posted this step (on CPU, at most `timeout` for the post thread to post
        it, and raises what posting raised); every posted receive must have been taken."""
        assert not self.posted, f"rank {self.role.rank}: receives posted but not taken: {list(self.posted)}"
        assert not self.side_posted, f"rank {self.role.rank}: side messages never taken: {list(self.side_posted)}"
        assert not self.slices, f"rank {self.role.rank}: slices never gathered: {list(self.slices)}"
        for post, _ in self.pending:
            self._work(post).wait(self.timeout)
        self.pending.clear()


def run_pipeline(executors: Sequence[StageExecutor], role: RankRole, p2p: P2P, *, order: Sequence[Op],
                 inputs: Callable[[int], torch.Tensor], targets: Callable[[int], torch.Tensor],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], loss_scale: float,
                 meter: ActivationMeter | None = None,
                 balance: LoadBalancing | None = None,
                 trace: list[OpTrace] | None = None) -> tuple[torch.Tensor, StageTimes]:
    """Run this rank's `order` (`plan.spec.Schedule.order`): F, B and W ops of its chunks.

    `executors[c]` runs chunk c (`role.chunks[c]`, virtual stage u = c·p + i); a forward of virtual
    stage 0 reads `inputs(k)` (micro-batch k's (B, T) token ids), the last virtual stage applies the
    loss to `targets(k)`, every other forward receives its input from virtual stage u - 1 and sends
    its output to u + 1, and backwards the reverse (transfers from `messages.rank_program`). A B op
    runs the whole backward, or only its input-gradient pass when the order has W ops (their
    weight-gradient passes). Each micro-batch's
    loss is multiplied by `loss_scale` before backward, so gradients accumulate as a weighted sum.
    Ops of micro-batches k >= `role.microbatches` (rounds of a longer order, `schedule` module
    docstring) skip the compute but not the layer hooks. `meter` measures micro-batch 0's kept
    activations. `balance` (a mixture of experts with a load-balancing loss) adds that loss
    (`runtime.balance`): its statistics ride forward with the activations and its gradient back with
    theirs, as side messages (this call sets `P2P.side_sizes` to its `side_sizes`, or none), and each
    micro-batch's coef · N · aux joins the loss sum. Returns the unscaled loss sum over this
    pipeline's tokens, a () fp64 tensor on `p2p.device` (0 except on the stage holding the head; summed on the device, so no micro-batch
    waits for the host: the caller reads it once per step), and the time spent per phase (W passes
    count as backward, and apart as `weight_s`). `trace` (CPU only: host clock; raises ValueError on
    another device) gets one `OpTrace` per op, in execution order (mutated).
    """
    if trace is not None and p2p.device.type != "cpu":
        raise ValueError(f"an op trace reads the host clock; on {p2p.device.type} it would time the launches, not the ops")
    p2p.side_sizes = balance.side_sizes if balance is not None else {}
    clock = PhaseClock(p2p.device)  # CUDA events on a GPU (`runtime.timing`), read once at the end
    loss_sum = torch.zeros((), dtype=torch.float64, device=p2p.device)
    p = role.num_stages
    last = p * len(executors) - 1
    split = any(op.kind not in (FWD, BWD) for op in order)

    def loss(c: int, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def apply(logits: torch.Tensor) -> torch.Tensor:
            value = loss_fn(logits, targets(k))
            loss_sum.add_(value.detach())
            if balance is not None:
                loss_sum.add_(balance.finish(c, k, loss_scale))
            return value * loss_scale
        return apply

    for step in rank_program(role, order):
        kind, c, k = step.op
        ex, u = executors[c], c * p + role.stage
        t0 = clock.mark()
        sent = None  # the trace's end of an op that sends: before its sends are posted
        for t in step.post:
            p2p.post(t)
        if k >= role.microbatches:
            if kind == FWD:
                ex.skip_forward()
            elif kind == BWD:
                ex.skip_backward(split=split)
            else:
                ex.skip_weight()
            t1 = t0
        elif kind == FWD:
            x = p2p.receive(step.recv) if step.recv else inputs(k)
            if balance is not None:
                balance.begin_forward(c, k, p2p.receive_side(step.recv) if step.recv else None)
            t1 = clock.mark()
            out = ex.forward(k, x, loss=loss(c, k) if u == last else None, meter=meter if k == 0 else None)
            sent = clock.mark() if trace is not None else None
            p2p.send(out, step.sends, balance.end_forward(c, k) if balance is not None else None)
        elif kind == BWD:
            grad = p2p.receive(step.recv) if step.recv else None
            if balance is not None:
                balance.begin_backward(c, k, p2p.receive_side(step.recv) if step.recv else None)
            t1 = clock.mark()
            grad_in = ex.backward_input(k, grad) if split else ex.backward(k, grad)
            sent = clock.mark() if trace is not None else None
            p2p.send(grad_in, step.sends, balance.end_backward(c, k) if balance is not None else None)
        else:
            t1 = t0
            ex.backward_weight(k)
        clock.add("wait_s", t0, t1)
        t2 = clock.mark()
        clock.add("forward_s" if kind == FWD else "backward_s", t1, t2)
        if kind not in (FWD, BWD):
            clock.add("weight_s", t1, t2)
        if trace is not None:
            end = t2 if sent is None else sent
            trace.append(OpTrace(kind, c, k, bool(step.recv), float(t0), float(t1), float(end)))  # type: ignore[arg-type]
    p2p.finish()
    return loss_sum, StageTimes(**clock.totals())
