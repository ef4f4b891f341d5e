"""1F1B pipeline schedule: an event simulation and the closed form the planner uses.

Notation, for one pipeline of P stages running m micro-batches:
  f[i], b[i]   forward / backward seconds of one micro-batch on stage i
  c[i]         seconds to move one micro-batch's activation from stage i to i+1 (its gradient comes
               back in the same time), i = 0..P-2
Stage i runs the runtime's 1F1B order (`sailor.plan.orders.one_f_one_b_order`): w_i = min(P - i, m)
forwards, then one backward and one forward in turn, then the remaining backwards.

Communication follows DeepSpeed's pipeline engine (`deepspeed/runtime/pipe/schedule.py`,
`TrainSchedule`), which Megatron-DeepSpeed runs: the schedule is a list of 2(m + P - 1) steps; a
stage forwards on steps of its own parity and backwards on the others. A forward step first sends
the gradient of the previous (backward) step upstream, then receives this step's activation; a
backward step first receives this step's gradient, then sends the previous (forward) step's
activation downstream. Transfers are blocking on *both* sides (NCCL send/recv on the compute
stream): a transfer starts when sender and receiver have both reached it and both are busy for c.
So a middle stage spends 4 transfers per micro-batch (receive and send of an activation and of a
gradient), an end stage 2, and an activation leaves its stage only one step after it was computed.
"""

from __future__ import annotations

import numpy as np

from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_PIPELINE_TASKS
from sailor.plan.orders import BWD, FWD

# Transfer instruction kinds of `pipeline_instructions` (compute: `plan.orders` FWD, BWD).
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "SA", "RA", "SG", "RG"
_PEER = {SEND_ACT: (1, RECV_ACT), RECV_ACT: (-1, SEND_ACT), SEND_GRAD: (-1, RECV_GRAD), RECV_GRAD: (1, SEND_GRAD)}



def _step_micro_batch(step: int, num_stages: int, stage: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) of `stage` at schedule step `step` (DeepSpeed TrainSchedule's
    `_step_to_micro_batch`); the micro-batch may be out of range (an idle step)."""
    if step % 2 == stage % 2:  # forward steps have the stage's parity
        return (step - stage % 2) // 2 - stage // 2, True
    if step % 2 == 0:  # odd stage, even step
        return step // 2 - num_stages + (stage + 1) // 2, False
    return (step - 1) // 2 - num_stages + 1 + stage // 2, False


def pipeline_instructions(num_stages: int, stage: int, m: int) -> list[tuple[str, int]]:
    """Instruction stream of `stage`: compute ("F"/"B", k) and transfers ("SA"/"RA"/"SG"/"RG", k) in
    DeepSpeed TrainSchedule order (see the module docstring)."""
    P, i = num_stages, stage
    out: list[tuple[str, int]] = []
    prev = -1
    for step in range(2 * (m + P - 1)):
        k, forward = _step_micro_batch(step, P, i)
        if forward:
            if 0 <= prev < m and i > 0:
                out.append((SEND_GRAD, prev))
            if 0 <= k < m and i > 0:
                out.append((RECV_ACT, k))
        else:
            if 0 <= k < m and i < P - 1:
                out.append((RECV_GRAD, k))
            if 0 <= prev < m and i < P - 1:
                out.append((SEND_ACT, prev))
        if 0 <= k < m:
            out.append((FWD if forward else BWD, k))
        prev = k
    return out


def in_flight(num_stages: int, stage: int, m: int) -> int:
    """Most micro-batches whose activations `stage` holds at once (forwarded, not yet backwarded):
    min(P - i, m) under 1F1B."""
    return min(num_stages - stage, m)


def simulate_1f1b(f: np.ndarray, b: np.ndarray, c: np.ndarray, m: int) -> tuple[float, np.ndarray, np.ndarray]:
    """Event simulation of one pipeline iteration (compute and p2p only; no sync or optimizer).

    Every stage executes `pipeline_instructions` in order; a compute instruction takes f[i] or b[i];
    a transfer across boundary i is a rendezvous: it starts when both stages reached it and ends c[i]
    later for both.

    Args:
        f, b: arrays (P,) of forward / backward seconds per micro-batch for each stage.
        c: array (P-1,) of seconds per message across each stage boundary.
        m: micro-batches.
    Returns:
        (makespan_s, busy_s (P,) compute seconds per stage, end_s (P,) when each stage finished).
    """
    clock = _run_1f1b(f, b, c, m, None)
    return float(clock.max()), m * (f + b), clock.copy()


def timeline_1f1b(f: np.ndarray, b: np.ndarray, c: np.ndarray, m: int) -> list[list[tuple[str, int, float, float]]]:
    """Per-stage op timeline of the event simulation `simulate_1f1b` runs (same events, same makespan).

    Args: as `simulate_1f1b`.
    Returns:
        one list per stage of (kind, micro-batch, start_s, end_s) in execution order; kind is one of
        "F", "B" (compute) or "SA", "RA", "SG", "RG" (send/receive of an activation or a gradient).
        Gaps between consecutive ops are the stage's idle time (bubbles, waits for a peer).
    """
    ops: list[list[tuple[str, int, float, float]]] = [[] for _ in range(len(f))]
    _run_1f1b(f, b, c, m, ops)
    return ops


def check_pipeline_tasks(stages: int, m: int, chunks: int = 1) -> None:
    """Refuse an event simulation of `stages` stages of `chunks` chunks each (virtual stages under
    interleaving) running `m` micro-batches when its stages x chunks x micro-batches tasks exceed
    `limits.MAX_PIPELINE_TASKS` (time and memory grow with them). Raises SailorInputError."""
    tasks = stages * chunks * m
    if tasks > MAX_PIPELINE_TASKS:
        what = f"{stages} stages" + (f" x {chunks} chunks" if chunks > 1 else "")
        raise SailorInputError(f"a pipeline of {what} running {m} micro-batches is {tasks:,} tasks per iteration,"
                               f" more than the event simulation runs ({MAX_PIPELINE_TASKS:,},"
                               " sailor.core.limits.MAX_PIPELINE_TASKS)", field="pipelines",
                               fix="use a larger micro-batch size, more pipelines or fewer stages")


def _run_1f1b(f: np.ndarray, b: np.ndarray, c: np.ndarray, m: int,
              ops: list[list[tuple[str, int, float, float]]] | None) -> np.ndarray:
    """The event loop shared by `simulate_1f1b` and `timeline_1f1b`: (P,) end times per stage; appends
    every op to `ops[stage]` when `ops` is given (mutates it). Raises SailorInputError beyond
    `limits.MAX_PIPELINE_TASKS` micro-batch x stage tasks (time and memory grow with them)."""
    P = len(f)
    check_pipeline_tasks(P, m)
    progs = [pipeline_instructions(P, i, m) for i in range(P)]
    pos = [0] * P
    clock = np.zeros(P)
    remaining = sum(len(p) for p in progs)
    while remaining:
        progressed = False
        for i in range(P):
            while pos[i] < len(progs[i]):
                kind, k = progs[i][pos[i]]
                if kind == FWD or kind == BWD:
                    start = clock[i]
                    clock[i] += f[i] if kind == FWD else b[i]
                    if ops is not None:
                        ops[i].append((kind, k, float(start), float(clock[i])))
                else:
                    step, want = _PEER[kind]
                    j = i + step
                    if pos[j] >= len(progs[j]) or progs[j][pos[j]] != (want, k):
                        break  # the peer has not reached the matching transfer yet
                    start = max(clock[i], clock[j])
                    clock[i] = clock[j] = start + c[min(i, j)]
                    if ops is not None:
                        ops[i].append((kind, k, float(start), float(clock[i])))
                        ops[j].append((want, k, float(start), float(clock[j])))
                    pos[j] += 1
                    remaining -= 1
                pos[i] += 1
                remaining -= 1
                progressed = True
        assert progressed, "pipeline schedule deadlocked"  # cannot happen: DeepSpeed's order is safe
    return clock


def stage_times(f: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Seconds each stage is busy per micro-batch in steady state, transfers included: f_i + b_i +
    2·c_i (activation out, gradient in; i < P-1) + 2·c_{i-1} (activation in, gradient out; i > 0).
    Array (P,); with leading batch dimensions, f and b (..., P) and c (..., P-1) give (..., P)."""
    t = f + b
    t[..., :-1] += 2.0 * c
    t[..., 1:] += 2.0 * c
    return t


def closed_form_1f1b(f: np.ndarray, b: np.ndarray, c: np.ndarray, m: int) -> float | np.ndarray:
    """Closed-form pipeline time with the straggler stage s = argmax_i t_i (`stage_times`):

        T = Σ_i(f_i + b_i) + 2·Σ_i c_i + (m - 1)·t_s - [m > 1, 0 < s < P-1]·(min(c', f_s) + min(c', b_s))

    with c' = min(c_{s-1}, c_s). One micro-batch pays the full fill and drain (the first two terms);
    the other m - 1 each cost the straggler's busy time; a middle straggler's receive of the first
    micro-batch's activation overlaps its neighbour's compute by up to a forward, and its last
    gradient send by up to a backward, hence the last term (an end stage has one neighbour, nothing
    overlaps). Equal to `simulate_1f1b` on uniform stages and links for every P, m, f, b, c (derived
    from the DeepSpeed order; tested on a grid); an estimate otherwise, which is why the planner
    re-scores its finalists with the event simulation.

    f, b: (P,) and c: (P-1,) give a float; with leading batch dimensions ((..., P), (..., P-1)) the
    times of many pipelines at once, an array (...) (the planner scores its pipeline kinds so).
    """
    t = stage_times(f, b, c)
    s = np.argmax(t, axis=-1)[..., None]  # the straggler (first of equals), kept as an index axis
    total = (f + b).sum(axis=-1) + 2.0 * c.sum(axis=-1) + (m - 1) * np.take_along_axis(t, s, -1)[..., 0]
    P = t.shape[-1]
    if m > 1 and P > 2:
        cc = np.minimum(np.take_along_axis(c, np.clip(s - 1, 0, P - 2), -1),
                        np.take_along_axis(c, np.clip(s, 0, P - 2), -1))[..., 0]
        overlap = (np.minimum(cc, np.take_along_axis(f, s, -1)[..., 0])
                   + np.minimum(cc, np.take_along_axis(b, s, -1)[..., 0]))
        middle = (s[..., 0] > 0) & (s[..., 0] < P - 1)
        total = total - np.where(middle, overlap, 0.0)
    return float(total) if np.ndim(total) == 0 else total
