"""The cost trade-off of a family's packing (phase 2, `engine`): for the cost objective or under
constraints, the count vectors between the fastest packing and the slowest kind doing the whole
batch alone, and where they cross each constraint."""

from __future__ import annotations

import math

import numpy as np

from sailor.planner.finalists import Finalists
from sailor.planner.kinds import Pool
from sailor.planner.options import PlanOptions
from sailor.planner.pack import Packer, leave_pools_out
from sailor.planner.score import Candidate, Scorer

VARIANTS_MAX = 64       # cheapest count vectors per makespan of the cost trade-off (`cheapest_variants`)
BOUNDARY_STEPS = 12     # bisection steps towards a constraint between two of them


def trade_off(opts: PlanOptions, packer: Packer, scorer: Scorer, base: np.ndarray, tau: float,
               keep: Finalists, point: tuple) -> None:
    """Candidates between the fastest packing (makespan τ) and the slowest kind doing the whole
    batch alone: on a grid of makespans (`Packer.tau_grid`, on a lattice shared by every cluster)
    the most-capacity and the cheapest count vectors; then, for each constraint, the makespan where
    the cheapest count vectors cross it, by bisection between grid points (the time of the cheapest
    vector rises with the makespan allowed, its $/iteration and $/hour fall).

    The cheapest count vector (`Packer.cheapest`) does not see egress: a pool more (a zone, or a GPU
    type in a zone) with GPUs as cheap can make it spread the batch over that pool too and pay
    egress, or lose a schedule the plan without it would gain. So the cheapest vectors without the
    pools it uses are scored too (`cheapest_variants`), and a makespan meets a constraint when one
    of them does: at every makespan of the grid, a cluster with a pool more has the vectors of the
    cluster without it among its candidates."""
    grid = packer.tau_grid(tau)
    cheap: dict[float, list[Candidate]] = {}

    def cheapest(t: float) -> list[Candidate]:
        if t not in cheap:
            cheap[t] = cheapest_variants(packer, scorer, t)
            for x in cheap[t]:
                keep.offer(x, point)
        return cheap[t]

    for t in grid:
        keep.offer_counts(scorer, packer.max_capacity(base, t), point)
        cheapest(t)
    c = opts.constraints
    tests = []  # (holds at small makespans?, test)
    if c.min_throughput is not None:
        tests.append((True, lambda x: x.iteration_time_s * c.min_throughput <= 1.0))  # a floor of 0 holds always
    if c.max_cost_per_iteration is not None:
        tests.append((False, lambda x: x.cost_per_iteration_usd <= c.max_cost_per_iteration))
    if c.max_cost_per_hour is not None:
        tests.append((False, lambda x: x.cost_per_hour_usd <= c.max_cost_per_hour))
    for small, test in tests:
        ok = [t for t in grid if any(map(test, cheapest(t)))]
        if not ok or len(ok) == len(grid):
            continue
        edge = max(ok) if small else min(ok)  # the last grid point that holds, and the next that does not
        j = grid.index(edge) + (1 if small else -1)
        if not 0 <= j < len(grid):
            continue
        lo, hi = sorted((edge, grid[j]))
        for _ in range(BOUNDARY_STEPS):
            mid = math.sqrt(lo * hi)
            if any(map(test, cheapest(mid))) == small:
                lo = mid
            else:
                hi = mid


def cheapest_variants(packer: Packer, scorer: Scorer, tau: float) -> list[Candidate]:
    """The scored cheapest count vectors at makespan τ (`Packer.cheapest`), each once: over all kinds
    and, recursively, over the kinds outside each (zone, GPU type) pool the vector found uses,
    fewest pools left out first, at most VARIANTS_MAX greedy runs (`pack.leave_pools_out`); [] when
    none fits. A cluster with a pool more has the smaller cluster's among them (within
    VARIANTS_MAX): the vector without that pool is the smaller cluster's (the greedy takes the
    other kinds in the same order)."""
    def find(without: frozenset[Pool]) -> list[np.ndarray]:
        counts = packer.cheapest(tau, without)
        return [] if counts is None or not counts.any() else [counts]

    found = leave_pools_out(packer.kinds, find, lambda counts: counts, VARIANTS_MAX)
    return [c for c in (scorer.score(tuple(int(x) for x in counts)) for _, counts in found) if c is not None]
