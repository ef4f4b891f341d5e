"""Interleaved 1F1B and ZB-H1: the order of each stage's passes, their event simulation, and the
micro-batches a stage holds at its memory peak.

Notation, for one pipeline of p stages, v layer chunks per stage and m micro-batches. Virtual stage
u = c·p + i is chunk c of stage i (`Plan.stage_chunks`); a micro-batch runs F through u = 0, 1, ...,
p·v - 1 and its backward back down. An op is (kind, chunk, micro-batch):
  F  forward of one chunk;
  B  backward of one chunk (under ZB-H1 only its input-gradient part, which the previous stage waits for);
  W  weight-gradient part of one chunk's backward (ZB-H1 only; nothing waits for it).

Orders (one list per stage, executed in sequence):
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

Transfers follow Sailor's runtime rather than DeepSpeed's engine (`schedule` keeps DeepSpeed's
blocking model for plain 1F1B): a send is posted when its pass ends and never blocks the sender;
the message arrives `transfer_s[u]` later on the link between the two stages (the last stage to the
first one between chunks, under interleaving); a pass starts when its stage is free and its input
has arrived. Messages in flight on one link do not slow each other down.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

FWD, BWD, WGRAD = "F", "B", "W"


class Op(NamedTuple):
    """One pass of one stage: kind F, B or W; chunk c (0 <= c < v); micro-batch k."""

    kind: str
    chunk: int
    micro_batch: int


class TimedOp(NamedTuple):
    """An executed op: kind, chunk, micro-batch, start and end (seconds from the iteration's start)."""

    kind: str
    chunk: int
    micro_batch: int
    start_s: float
    end_s: float


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


def run_orders(orders: Sequence[Sequence[Op]], forward_s: np.ndarray, backward_s: np.ndarray, weight_s: np.ndarray,
               transfer_s: np.ndarray, m: int, ops: list[list[TimedOp]] | None = None) -> np.ndarray:
    """Event simulation of one iteration: every stage runs its order; a pass starts when its stage
    is free and its input has arrived (module docstring).

    Args:
        orders: one op list per stage (p of them).
        forward_s, backward_s, weight_s: arrays (p, v), seconds of one micro-batch's pass through
            chunk c of stage i (weight_s: W passes; zeros when the schedule runs none).
        transfer_s: array (p·v - 1,), seconds per message across virtual boundary u -> u + 1 (the
            activation forward, its gradient back).
        m: micro-batches.
        ops: when given, `ops[i]` gets every op of stage i with its times, in execution order (mutated).
    Returns:
        array (p,): when each stage finishes (seconds).
    """
    p, v = forward_s.shape
    f_end = np.full((p * v, m), np.nan)  # when the forward of micro-batch k through virtual stage u ended
    b_end = np.full((p * v, m), np.nan)
    dur = {FWD: forward_s, BWD: backward_s, WGRAD: weight_s}
    pos = [0] * p
    clock = np.zeros(p)
    left = sum(len(o) for o in orders)
    last = p * v - 1
    while left:
        progressed = False
        for i in range(p):
            order = orders[i]
            while pos[i] < len(order):
                kind, c, k = order[pos[i]]
                u = c * p + i
                start = clock[i]
                if kind == FWD:
                    if u > 0:
                        ready = f_end[u - 1, k]
                        if ready != ready:  # nan: the previous chunk has not run it yet
                            break
                        start = max(start, ready + transfer_s[u - 1])
                elif kind == BWD:
                    assert f_end[u, k] == f_end[u, k], f"stage {i} runs B{k} of chunk {c} before its forward"
                    if u < last:
                        ready = b_end[u + 1, k]
                        if ready != ready:
                            break
                        start = max(start, ready + transfer_s[u])
                else:
                    assert b_end[u, k] == b_end[u, k], f"stage {i} runs W{k} of chunk {c} before its B"
                clock[i] = start + dur[kind][i, c]
                if kind == FWD:
                    f_end[u, k] = clock[i]
                elif kind == BWD:
                    b_end[u, k] = clock[i]
                if ops is not None:
                    ops[i].append(TimedOp(kind, c, k, float(start), float(clock[i])))
                pos[i] += 1
                left -= 1
                progressed = True
        assert progressed, "pipeline schedule deadlocked"  # the orders above never do (tested)
    return clock


def held_at_peak(order: Sequence[Op], held_bytes: np.ndarray, pending_bytes: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Micro-batches one stage holds per chunk at its memory peak, walking its order.

    A forward of chunk c adds one micro-batch holding `held_bytes[c]` (its activations and received
    input); with W passes in the order, its B moves it to pending (`pending_bytes[c]` more: the output
    gradients its W needs; the activations stay until W), its W frees it; without, its B frees it.
    Memory is a function of the order alone, not of timing. Returns (held, pending) counts per chunk
    at the first point where Σ held·held_bytes + pending·(held_bytes + pending_bytes) is largest.
    """
    v = len(held_bytes)
    split = any(op.kind == WGRAD for op in order)
    held, pending = [0] * v, [0] * v
    total, best, at = 0.0, -1.0, ((0,) * v, (0,) * v)
    for kind, c, _k in order:
        if kind == FWD:
            held[c] += 1
            total += held_bytes[c]
        elif kind == BWD:
            held[c] -= 1
            if split:
                pending[c] += 1
                total += pending_bytes[c]
            else:
                total -= held_bytes[c]
        else:
            pending[c] -= 1
            total -= held_bytes[c] + pending_bytes[c]
        if total > best:
            best, at = total, (tuple(held), tuple(pending))
    return at
