"""Pipeline parallelism: stage slicing, point-to-point transfers and the 1F1B schedule.

`torch.distributed.pipelining` assumes one rank per stage and the same shapes on both sides of a
stage boundary; it cannot connect a TP-2 replica to a TP-1 replica, nor fan one activation out to
several TP ranks. So the runtime keeps its own small schedule: `schedule_1f1b` (pure) orders the
forward and backward passes of one stage, and `run_pipeline` executes that order with non-blocking
sends and receives that wait with a timeout. Every activation crossing a boundary is the full
(B, T, h) fp32 tensor, which every TP rank of a replica holds.

Sends are posted with `isend` and waited for at the end of the step: the 1F1B order is deadlock-free
once no send blocks (Narayanan et al., SC'21, §2.2).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from sailor.runtime.topology import RankRole

BOUNDARY_DTYPE = torch.float32  # activations and their gradients cross stage boundaries in fp32


def build_stage(model: nn.Module, layers: tuple[int, int]) -> nn.Module:
    """Delete the layers of `model` (a GPT) outside the half-open range `layers`, in place; returns
    it. Remaining layers keep their global names `layers.<i>`."""
    first, end = layers
    for key in list(model.layers.keys()):
        if not first <= int(key) < end:
            del model.layers[key]
    assert list(model.layers.keys()) == [str(i) for i in range(first, end)]
    return model


def schedule_1f1b(stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of one stage: [("F", k) | ("B", k)].

    Stage i first runs min(P - i - 1, m) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards; at most P - i micro-batches are in flight.
    """
    warm = min(num_stages - stage - 1, microbatches)
    order = [("F", k) for k in range(warm)]
    for k in range(microbatches - warm):
        order += [("F", warm + k), ("B", k)]
    order += [("B", k) for k in range(microbatches - warm, microbatches)]
    return order


@dataclass
class StageTimes:
    """Seconds this rank spent in one step, by phase."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0  # blocked on receives from neighbour stages


@dataclass
class P2P:
    """Point-to-point transfers of one rank across its stage boundaries (global ranks, world group)."""

    role: RankRole
    shape: tuple[int, ...]  # (B, T, h) of one micro-batch's activation
    device: torch.device
    timeout: timedelta
    pending: list = field(default_factory=list)  # (work, tensor): kept alive until the send completes

    def _recv(self, src: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=BOUNDARY_DTYPE, device=self.device)
        work = dist.irecv(buf, src)
        if not work.wait(self.timeout):
            raise TimeoutError(f"rank {self.role.rank}: no data from rank {src} within {self.timeout}")
        return buf

    def _send(self, t: torch.Tensor, dsts: tuple[int, ...]) -> None:
        t = t.detach().to(BOUNDARY_DTYPE).contiguous()
        for d in dsts:
            self.pending.append((dist.isend(t, d), t))

    def recv_forward(self) -> torch.Tensor:
        return self._recv(self.role.fwd_recv_from)

    def send_forward(self, t: torch.Tensor) -> None:
        self._send(t, self.role.fwd_send_to)

    def recv_backward(self) -> torch.Tensor:
        return self._recv(self.role.bwd_recv_from)

    def send_backward(self, t: torch.Tensor) -> None:
        self._send(t, self.role.bwd_send_to)

    def finish(self) -> None:
        """Wait for every send posted this step."""
        for work, _ in self.pending:
            work.wait(self.timeout)
        self.pending.clear()


def run_pipeline(stage: nn.Module, role: RankRole, p2p: P2P, *, inputs: Callable[[int], torch.Tensor],
                 targets: Callable[[int], torch.Tensor], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 loss_scale: float, autocast: Callable[[], object]) -> tuple[float, StageTimes]:
    """Forward and backward every micro-batch of this rank's pipeline in 1F1B order.

    `inputs(k)` / `targets(k)` give micro-batch k's (B, T) token ids (used on the first / last stage);
    each micro-batch's loss is multiplied by `loss_scale` before backward, so gradients accumulate
    into the parameters' `.grad` as a weighted sum. Returns the unscaled loss sum over this pipeline's
    tokens (0 except on the last stage) and the time spent per phase.
    """
    times = StageTimes()
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # k -> (stage input, output or loss)
    loss_sum = 0.0
    for op, k in schedule_1f1b(role.stage, role.num_stages, role.microbatches):
        if op == "F":
            t0 = time.perf_counter()
            if role.is_first_stage:
                x = inputs(k)
            else:
                x = p2p.recv_forward().requires_grad_()
            t1 = time.perf_counter()
            with autocast():
                out = stage(x)
            if role.is_last_stage:
                loss = loss_fn(out, targets(k))
                loss_sum += loss.item()
                out = loss * loss_scale
            else:
                p2p.send_forward(out)
            saved[k] = (None if role.is_first_stage else x, out)
            times.wait_s += t1 - t0
            times.forward_s += time.perf_counter() - t1
        else:
            x, out = saved.pop(k)
            t0 = time.perf_counter()
            grad = None if role.is_last_stage else p2p.recv_backward()
            t1 = time.perf_counter()
            torch.autograd.backward(out, grad)
            if x is not None:
                p2p.send_backward(x.grad)
            times.wait_s += t1 - t0
            times.backward_s += time.perf_counter() - t1
    p2p.finish()
    return loss_sum, times
