"""Pipeline parallelism: stage slicing, point-to-point transfers and the execution of a schedule.

`torch.distributed.pipelining` assumes one rank per stage and the same shapes on both sides of a
stage boundary; it cannot connect a TP-2 replica to a TP-1 replica, nor fan one activation out to
several TP ranks. So the runtime keeps its own small schedules: `plan.spec.Schedule.order`
(pure) orders the passes of one stage (1F1B, interleaved 1F1B, ZB-H1), and `run_pipeline` executes
that order with non-blocking sends and receives that wait with a timeout, each pass through the
`executor.StageExecutor` of its chunk. Every activation crossing a boundary is the full (B, T, h)
tensor in the compute dtype, which every TP rank of a replica holds (a sequence-parallel chunk
gathers its last block's output first).

Sends are posted with `isend` (a send's tensor is released once it completed, at the latest at the
end of the step): the orders are deadlock-free once no send blocks (Narayanan et al., SC'21, §2.2;
the interleaved and ZB-H1 orders are checked by their event simulation, `simulator.schedule_orders`).
Under interleaving one pair of ranks carries several chunks' activations and gradients (stage p-1
to stage 0 between chunks; for p = 2 both directions between the same two replicas), so every
transfer is tagged with its virtual boundary u -> u + 1 and direction (`transfer_tag`): messages of
one tag arrive in the order they were sent, which is the micro-batch order of both ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from sailor.plan.orders import BWD, FWD, Op
from sailor.runtime.executor import ActivationMeter, StageExecutor
from sailor.runtime.topology import RankRole


def build_stage(model: nn.Module, chunks: Sequence[tuple[int, int]]) -> nn.Module:
    """Delete the layers of `model` (a GPT) outside the half-open ranges `chunks`, in place; returns
    it. Remaining layers keep their global names `layers.<i>`."""
    keep = [i for a, b in chunks for i in range(a, b)]
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    assert list(model.layers.keys()) == [str(i) for i in sorted(keep)]
    return model


def transfer_tag(boundary: int, gradient: bool) -> int:
    """p2p tag of the activation (or, `gradient`, of its gradient) crossing virtual boundary
    `boundary` -> `boundary` + 1 (module docstring)."""
    return 2 * boundary + int(gradient)


@dataclass
class StageTimes:
    """Seconds this rank spent in one step, by phase."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0  # blocked on receives from neighbour stages


@dataclass
class P2P:
    """Point-to-point transfers of one rank across its stage boundaries (global ranks, world group).
    Activations and their gradients cross in `dtype`, the weights' compute dtype (the same on both
    sides of every boundary: it is the job's)."""

    role: RankRole
    shape: tuple[int, ...]  # (B, T, h) of one micro-batch's activation
    device: torch.device
    timeout: timedelta
    dtype: torch.dtype = torch.float32
    pending: list = field(default_factory=list)  # (work, tensor): kept alive until the send completes

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        work = dist.irecv(buf, src, tag=tag)
        if not work.wait(self.timeout):
            raise TimeoutError(f"rank {self.role.rank}: no data from rank {src} within {self.timeout}")
        return buf

    def _send(self, t: torch.Tensor, dsts: tuple[int, ...], tag: int) -> None:
        # Sends that completed free their tensors now, not at the end of the step.
        self.pending = [(w, x) for w, x in self.pending if not w.is_completed()]
        t = t.detach().to(self.dtype).contiguous()
        for d in dsts:
            self.pending.append((dist.isend(t, d, tag=tag), t))

    def recv_forward(self, boundary: int) -> torch.Tensor:
        """The activation crossing virtual boundary `boundary` (into this rank's chunk)."""
        return self._recv(self.role.fwd_recv_from, transfer_tag(boundary, False))

    def send_forward(self, t: torch.Tensor, boundary: int) -> None:
        self._send(t, self.role.fwd_send_to, transfer_tag(boundary, False))

    def recv_backward(self, boundary: int) -> torch.Tensor:
        """The gradient crossing virtual boundary `boundary` back (into this rank's chunk)."""
        return self._recv(self.role.bwd_recv_from, transfer_tag(boundary, True))

    def send_backward(self, t: torch.Tensor, boundary: int) -> None:
        self._send(t, self.role.bwd_send_to, transfer_tag(boundary, True))

    def finish(self) -> None:
        """Wait for every send posted this step."""
        for work, _ in self.pending:
            work.wait(self.timeout)
        self.pending.clear()


def run_pipeline(executors: Sequence[StageExecutor], role: RankRole, p2p: P2P, *, order: Sequence[Op],
                 inputs: Callable[[int], torch.Tensor], targets: Callable[[int], torch.Tensor],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], loss_scale: float,
                 meter: ActivationMeter | None = None) -> tuple[torch.Tensor, StageTimes]:
    """Run this rank's `order` (`plan.spec.Schedule.order`): F, B and W ops of its chunks.

    `executors[c]` runs chunk c (`role.chunks[c]`, virtual stage u = c·p + i); a forward of virtual
    stage 0 reads `inputs(k)` (micro-batch k's (B, T) token ids), the last virtual stage applies the
    loss to `targets(k)`, every other forward receives its input from virtual stage u - 1 and sends
    its output to u + 1, and backwards the reverse. A B op runs the whole backward, or only its
    input-gradient pass when the order has W ops (their weight-gradient passes). Each micro-batch's
    loss is multiplied by `loss_scale` before backward, so gradients accumulate as a weighted sum.
    Ops of micro-batches k >= `role.microbatches` (rounds of a longer order, `schedule` module
    docstring) skip the compute but not the layer hooks. `meter` measures micro-batch 0's kept
    activations. Returns the unscaled loss sum over this pipeline's tokens, a () fp64 tensor on
    `p2p.device` (0 except on the stage holding the head; summed on the device, so no micro-batch
    waits for the host: the caller reads it once per step), and the time spent per phase (W passes
    count as backward).
    """
    times = StageTimes()
    loss_sum = torch.zeros((), dtype=torch.float64, device=p2p.device)
    p = role.num_stages
    last = p * len(executors) - 1
    split = any(op.kind not in (FWD, BWD) for op in order)

    def loss(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def apply(logits: torch.Tensor) -> torch.Tensor:
            value = loss_fn(logits, targets(k))
            loss_sum.add_(value.detach())
            return value * loss_scale
        return apply

    for kind, c, k in order:
        ex, u = executors[c], c * p + role.stage
        t0 = time.perf_counter()
        if k >= role.microbatches:
            if kind == FWD:
                ex.skip_forward()
            elif kind == BWD:
                ex.skip_backward(split=split)
            else:
                ex.skip_weight()
            t1 = t0
        elif kind == FWD:
            x = inputs(k) if u == 0 else p2p.recv_forward(u - 1)
            t1 = time.perf_counter()
            out = ex.forward(k, x, loss=loss(k) if u == last else None, meter=meter if k == 0 else None)
            if u < last:
                p2p.send_forward(out, u)
        elif kind == BWD:
            grad = None if u == last else p2p.recv_backward(u)
            t1 = time.perf_counter()
            grad_in = ex.backward_input(k, grad) if split else ex.backward(k, grad)
            if u > 0:
                p2p.send_backward(grad_in, u - 1)
        else:
            t1 = t0
            ex.backward_weight(k)
        times.wait_s += t1 - t0
        if kind == FWD:
            times.forward_s += time.perf_counter() - t1
        else:
            times.backward_s += time.perf_counter() - t1
    p2p.finish()
    return loss_sum, times
