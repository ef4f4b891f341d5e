"""Event-simulated pipeline time for many micro-batches without simulating every one of them.

An event simulation of m micro-batches costs O(P·m) steps, so a global batch of 10^9 samples would
take hours. The pipeline is a max-plus linear system (every start time is a max of earlier end times
plus constant durations), so its makespan T(m) is eventually affine with slope λ = the steady-state
period of the schedule (for 1F1B, the straggler's busy time per micro-batch, `stage_times`); checked
on random pipelines, the increments T(m+1) - T(m) are non-decreasing once m >= P and reach λ, after
which they stay at λ (tests/test_simulator.py). So once a simulation at m1 shows T(m1 + 1) - T(m1)
= λ, T(m) = T(m1) + (m - m1)·λ for every m > m1 exactly.

`makespan_s` simulates m1 = DIRECT_MAX_MICROBATCHES (doubling while the increment has not reached λ,
up to LONGEST_SIMULATED) and extrapolates. If the increment still lies below λ there (a transient
longer than 2^16 micro-batches, from two nearly equal critical cycles), the λ extrapolation is an
upper bound that exceeds the truth by at most (m - m1)·(λ - increment). So the event simulation of a
pipeline never refuses a plan for its number of micro-batches (`limits.MAX_PIPELINE_TASKS` bounds
what is simulated, not what is asked).
"""

from __future__ import annotations

from typing import Callable

from sailor.limits import MAX_PIPELINE_TASKS

# Pipelines of at most this many micro-batches are simulated directly (milliseconds for P <= 16).
DIRECT_MAX_MICROBATCHES = 512
# Longest simulation `makespan_s` runs to find the affine regime (about a second for P = 16), and
# never more micro-batch x stage tasks than the event simulation accepts (limits.MAX_PIPELINE_TASKS).
LONGEST_SIMULATED = 1 << 16


def makespan_s(run: Callable[[int], float], period_s: float, m: int, num_stages: int) -> float:
    """Makespan (s) of `m` micro-batches from `run(k)` (the event simulation of k micro-batches),
    using run(m) directly when m <= DIRECT_MAX_MICROBATCHES and the affine extrapolation of the module
    docstring beyond.

    Args:
        run: event simulation, micro-batches -> makespan in seconds.
        period_s: the schedule's steady-state period λ (seconds per micro-batch).
        m: micro-batches (>= 1).
        num_stages: P (the extrapolation starts no earlier than 4·P micro-batches).
    """
    longest = min(LONGEST_SIMULATED, MAX_PIPELINE_TASKS // num_stages - 1)
    if m <= max(DIRECT_MAX_MICROBATCHES, 4 * num_stages + 2):
        return run(m)
    m1 = max(DIRECT_MAX_MICROBATCHES, 4 * num_stages)
    while True:
        t1 = run(m1)
        if run(m1 + 1) - t1 >= period_s * (1 - 1e-12) or 2 * m1 > longest:
            return t1 + (m - m1) * period_s
        if 2 * m1 >= m:
            return run(m)
        m1 *= 2
