"""Per-stage op orders of every pipeline schedule (1F1B, interleaved 1F1B, ZB-H1), torch-free and pure:
the one definition the simulator times (`simulator.schedules`) and the runtime executes
(`plan.spec.Schedule.order`, through `runtime.schedule.runtime_schedule`); `stage_order` dispatches on the plan's schedule.

Notation, for one pipeline of p stages, v layer chunks per stage and m micro-batches. Virtual stage
u = c·p + i is chunk c of stage i (`Plan.stage_chunks`); a micro-batch runs F through u = 0, 1, ...,
p·v - 1 and its backward back down. An op is (kind, chunk, micro-batch):
  F  forward of one chunk;
  B  backward of one chunk (under ZB-H1 only its input-gradient part, which the previous stage waits for);
  W  weight-gradient part of one chunk's backward (ZB-H1 only; nothing waits for it).

Orders (one list per stage, executed in sequence):
- `one_f_one_b_order`, 1F1B (PipeDream-Flush, Narayanan et al. SC'21 §2.2): stage i runs
  w = min(p - i, m) forwards, then alternates one backward and one forward until its forwards are
  done, then drains its backwards; at most w micro-batches are in flight. Megatron-LM counts
  p - i - 1 warm-up forwards and starts its steady state with a forward, DeepSpeed's `TrainSchedule`
  counts p - i: both run this same order of passes.
- `interleaved_order`, Narayanan et al. SC'21 §2.2.2 as Megatron-LM runs it: micro-batches in groups
  of p, each group forwarded through chunk 0, then chunk 1, ... (backwards: last chunk first); stage i
  warms up with 2(p - i - 1) + (v - 1)·g forwards (g the first group's size), then alternates one
  forward and one backward, then drains. When p does not divide m the remainder is spread over the
  groups (sizes p..2p-1, larger first; `microbatch_groups`) instead of a short last group: a group
  smaller than p leaves the stage idle while its micro-batches go round the pipeline, a larger one
  does not; where a larger group's backward would come before its own forward, the stage runs the
  forwards it needs first.
- `zb_h1_order`, Qi et al., ICLR 2024, §3.1 (ZB-H1): 1F1B's warm-up (p - i forwards, Megatron's
  p - i - 1 plus the first steady one), then for each micro-batch k: B_k, then W_{k-i} once k >= i,
  then the next forward; the i deferred W passes run after the last B. Stage i thus holds at most
  min(p, m) micro-batches whose W has not run, every stage the same as 1F1B's first stage, and
  stage i's deferred W passes fill the bubble at the end while the B passes, no longer waiting for W,
  reach the first stage sooner.

The orders say nothing about transfers. The runtime posts its sends without blocking (`isend`), so a
stage waits only for the inputs of its own next op; under that rule these orders never deadlock
(tested on their event simulation). The simulator times every order of a job of Sailor's runtime
under the same rule, and 1F1B of a DeepSpeed or Megatron-LM job under DeepSpeed's blocking
send/receive pairs (`simulator.schedule`), which it says in its output
(`PipelineSchedule.runtime_difference`).
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

FWD, BWD, WGRAD = "F", "B", "W"


class ScheduleKind(str, Enum):
    """Pipeline schedule of a plan's pipelines (`plan.spec.Schedule`; the orders are this module's)."""

    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved-1f1b"
    ZB_H1 = "zb-h1"


class Op(NamedTuple):
    """One pass of one stage: kind F, B or W; chunk c (0 <= c < v); micro-batch k."""

    kind: str
    chunk: int
    micro_batch: int


def one_f_one_b_order(num_stages: int, stage: int, m: int) -> list[Op]:
    """Op order of `stage` under 1F1B (module docstring): min(p - i, m) forwards, then one backward
    and one forward in turn, then the remaining backwards."""
    warm = min(num_stages - stage, m)
    order = [Op(FWD, 0, k) for k in range(warm)]
    for k in range(m):
        order.append(Op(BWD, 0, k))
        if warm + k < m:
            order.append(Op(FWD, 0, warm + k))
    return order


def stage_order(kind: ScheduleKind, virtual_stages: int, num_stages: int, stage: int, m: int) -> list[Op]:
    """The ops of `stage` of a pipeline of `num_stages` stages running `m` micro-batches (or rounds)
    under schedule `kind` with `virtual_stages` chunks per stage, in execution order."""
    if kind is ScheduleKind.INTERLEAVED:
        return interleaved_order(num_stages, virtual_stages, stage, m)
    if kind is ScheduleKind.ZB_H1:
        return zb_h1_order(num_stages, stage, m)
    return one_f_one_b_order(num_stages, stage, m)


def microbatch_groups(num_stages: int, m: int) -> list[int]:
    """Sizes of the interleaved schedule's micro-batch groups: floor(m / p) groups as even as possible
    (p..2p-1 each, larger first); a single group of all m when m < p."""
    n = max(1, m // num_stages)
    base, extra = divmod(m, n)
    return [base + (1 if g < extra else 0) for g in range(n)]


def interleaved_order(num_stages: int, v: int, stage: int, m: int) -> list[Op]:
    """Op order of `stage` under interleaved 1F1B with v chunks per stage (module docstring)."""
    p = num_stages
    fwd: list[tuple[int, int]] = []  # (chunk, micro-batch) in forward order
    bwd: list[tuple[int, int]] = []
    first = 0
    groups = microbatch_groups(p, m)
    for g in groups:
        ks = range(first, first + g)
        fwd += [(c, k) for c in range(v) for k in ks]
        bwd += [(c, k) for c in reversed(range(v)) for k in ks]
        first += g
    n = v * m
    nf = min(n, 2 * (p - stage - 1) + (v - 1) * groups[0])  # warm-up forwards
    order = [Op(FWD, *x) for x in fwd[:nf]]
    done = set(fwd[:nf])
    for x in bwd:
        if nf < n:  # one forward, then one backward
            order.append(Op(FWD, *fwd[nf]))
            done.add(fwd[nf])
            nf += 1
        while x not in done:  # a group larger than the first: its backward needs more forwards first
            order.append(Op(FWD, *fwd[nf]))
            done.add(fwd[nf])
            nf += 1
        order.append(Op(BWD, *x))
    return order


def zb_h1_order(num_stages: int, stage: int, m: int) -> list[Op]:
    """Op order of `stage` under ZB-H1 (module docstring); one chunk per stage."""
    warm = min(num_stages - stage, m)
    order = [Op(FWD, 0, k) for k in range(warm)]
    nf, nw = warm, 0
    for k in range(m):
        order.append(Op(BWD, 0, k))
        if k >= stage:
            order.append(Op(WGRAD, 0, nw))
            nw += 1
        if nf < m:
            order.append(Op(FWD, 0, nf))
            nf += 1
    order += [Op(WGRAD, 0, k) for k in range(nw, m)]
    return order
