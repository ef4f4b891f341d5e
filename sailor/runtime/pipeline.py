"""Pipeline parallelism: stage slicing, point-to-point transfers and the 1F1B schedule.

`torch.distributed.pipelining` assumes one rank per stage and the same shapes on both sides of a
stage boundary; it cannot connect a TP-2 replica to a TP-1 replica, nor fan one activation out to
several TP ranks. So the runtime keeps its own small schedule: `schedule_1f1b` (pure) orders the
forward and backward passes of one stage, and `run_pipeline` executes that order with non-blocking
sends and receives that wait with a timeout, each pass through `executor.StageExecutor`. Every
activation crossing a boundary is the full (B, T, h) tensor in the compute dtype, which every TP rank
of a replica holds (a sequence-parallel stage gathers its last block's output first).

Sends are posted with `isend` (a send's tensor is released once it completed, at the latest at the
end of the step): the 1F1B order is deadlock-free once no send blocks (Narayanan et al., SC'21, §2.2).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from sailor.runtime.executor import ActivationMeter, StageExecutor
from sailor.runtime.topology import RankRole


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
    """Point-to-point transfers of one rank across its stage boundaries (global ranks, world group).
    Activations and their gradients cross in `dtype`, the weights' compute dtype (the same on both
    sides of every boundary: it is the job's)."""

    role: RankRole
    shape: tuple[int, ...]  # (B, T, h) of one micro-batch's activation
    device: torch.device
    timeout: timedelta
    dtype: torch.dtype = torch.float32
    pending: list = field(default_factory=list)  # (work, tensor): kept alive until the send completes

    def _recv(self, src: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        work = dist.irecv(buf, src)
        if not work.wait(self.timeout):
            raise TimeoutError(f"rank {self.role.rank}: no data from rank {src} within {self.timeout}")
        return buf

    def _send(self, t: torch.Tensor, dsts: tuple[int, ...]) -> None:
        # Sends that completed free their tensors now, not at the end of the step.
        self.pending = [(w, x) for w, x in self.pending if not w.is_completed()]
        t = t.detach().to(self.dtype).contiguous()
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


def run_pipeline(executor: StageExecutor, role: RankRole, p2p: P2P, *, inputs: Callable[[int], torch.Tensor],
                 targets: Callable[[int], torch.Tensor], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 loss_scale: float, rounds: int | None = None,
                 meter: ActivationMeter | None = None) -> tuple[float, StageTimes]:
    """Forward and backward every micro-batch of this rank's pipeline in 1F1B order.

    `inputs(k)` / `targets(k)` give micro-batch k's (B, T) token ids (used on the first / last stage);
    each micro-batch's loss is multiplied by `loss_scale` before backward, so gradients accumulate
    as a weighted sum. `rounds` (>= the pipeline's micro-batches; default equal) runs the 1F1B order
    of that many micro-batches, skipping the compute of rounds k >= microbatches but not their layer
    hooks: the stage's ZeRO-2/3 groups then meet equally often in every pipeline. The order of the
    real micro-batches is the pipeline's own 1F1B order (dropping the rounds k >= m from the order of
    M > m micro-batches leaves the order of m). `meter` measures micro-batch 0's kept activations.
    Returns the unscaled loss sum over this pipeline's tokens (0 except on the last stage) and the
    time spent per phase.
    """
    times = StageTimes()
    loss_sum = 0.0

    def loss(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def apply(logits: torch.Tensor) -> torch.Tensor:
            nonlocal loss_sum
            value = loss_fn(logits, targets(k))
            loss_sum += value.item()
            return value * loss_scale
        return apply

    for op, k in schedule_1f1b(role.stage, role.num_stages, rounds or role.microbatches):
        t0 = time.perf_counter()
        if k >= role.microbatches and op == "F":
            executor.skip_forward()
            times.forward_s += time.perf_counter() - t0
        elif k >= role.microbatches:
            executor.skip_backward()
            times.backward_s += time.perf_counter() - t0
        elif op == "F":
            x = inputs(k) if role.is_first_stage else p2p.recv_forward()
            t1 = time.perf_counter()
            out = executor.forward(k, x, loss=loss(k) if role.is_last_stage else None,
                                   meter=meter if k == 0 else None)
            if not role.is_last_stage:
                p2p.send_forward(out)
            times.wait_s += t1 - t0
            times.forward_s += time.perf_counter() - t1
        else:
            grad = None if role.is_last_stage else p2p.recv_backward()
            t1 = time.perf_counter()
            grad_in = executor.backward(k, grad)
            if not role.is_first_stage:
                p2p.send_backward(grad_in)
            times.wait_s += t1 - t0
            times.backward_s += time.perf_counter() - t1
    p2p.finish()
    return loss_sum, times
