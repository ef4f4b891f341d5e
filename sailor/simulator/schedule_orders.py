"""Event simulation of interleaved 1F1B and ZB-H1 over their op orders (`sailor.plan.orders`), and
the micro-batches a stage holds at its memory peak.

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

from sailor.plan.orders import BWD, FWD, WGRAD, Op


class TimedOp(NamedTuple):
    """An executed op: kind, chunk, micro-batch, start and end (seconds from the iteration's start)."""

    kind: str
    chunk: int
    micro_batch: int
    start_s: float
    end_s: float


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
