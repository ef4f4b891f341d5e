"""The planner's older search (`--search legacy`), kept so that benchmarks can compare against it.

Best-first branch and bound over coarse nodes (region, P, micro-batch) -> families (one per layer
partition) -> points (one TP template per GPU type, every combination) -> count vectors of
single-type, single-zone pipelines (`branch`, `bounds`); exact on clusters of up to
`EXACT_MAX_GPUS` GPUs, bounded scans beyond, split over processes from `PARALLEL_MIN_GPUS` GPUs on.
Its cost grows with the product of the TP templates of every GPU type (about tenfold per added type),
which is why `engine` replaced it. It honours a time limit (`PlanOptions.time_limit_s`) so that a
benchmark can ask what it finds within the time the new search took.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import heapq
import multiprocessing as mp
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor

from sailor.planner.branch import coarse_nodes, families, points, search_counts
from sailor.planner.finalists import Finalists, Found, pareto_add, plan_from_kinds
from sailor.planner.options import EXACT_MAX_GPUS, PlanOptions, SearchSpace
from sailor.simulator import SimContext

# Planning splits its coarse nodes over this many processes when the cluster has at least
# PARALLEL_MIN_GPUS GPUs (below that a search takes about a second and forking does not pay).
PARALLEL_MIN_GPUS = 256
_PARALLEL_JOB: tuple | None = None  # (ctx, opts, groups, shared best, deadline) for forked workers; set per call


def search(ctx: SimContext, opts: PlanOptions, progress=None, deadline: float | None = None) -> Found:
    """The older full search over ctx's cluster (see the module docstring); `deadline` is a
    time.perf_counter() value after which it stops and returns what it found."""
    opts = dataclasses.replace(opts, search=SearchSpace.FULL)
    exact = ctx.cluster.total_gpus() <= EXACT_MAX_GPUS
    coarse = sorted(coarse_nodes(ctx, opts, exact), key=lambda x: x[0])
    workers = _workers(ctx, len(coarse))
    if workers > 1:
        found = _search_parallel(ctx, opts, coarse, workers, progress, deadline)
    else:
        found = _search(ctx, opts, coarse, None, progress, deadline)
    found.exact = exact and not found.timed_out
    return found


def _search(ctx: SimContext, opts: PlanOptions, coarse: list, shared_best, progress, deadline) -> Found:
    """Two-level best-first branch and bound over `coarse` nodes (bound, (zones, P, mbs)): a node is
    expanded into families (one per partition) only when its bound can still beat the best plan;
    families are searched in bound order; everything left once the smallest bound cannot win is
    pruned. `shared_best` (a multiprocessing.Value or None) carries the best first objective component
    found by any process, so that parallel searches prune with each other's plans."""
    exact = ctx.cluster.total_gpus() <= EXACT_MAX_GPUS
    keep = Finalists(opts)

    def best0() -> float:
        local = keep.best0()
        return min(local, shared_best.value) if shared_best is not None else local

    def offer(cand, point) -> None:
        k = keep.offer(cand, point)
        if k is not None and shared_best is not None:
            with shared_best.get_lock():
                shared_best.value = min(shared_best.value, k[0])

    heap = [(bound, 0, n, node) for n, (bound, node) in enumerate(coarse)]
    heapq.heapify(heap)
    counter, done = len(coarse), 0
    while heap:
        if deadline is not None and time.perf_counter() > deadline:
            keep.found.timed_out = True
            break
        bound, kind, _, item = heapq.heappop(heap)
        if bound[0] >= best0():
            break  # the heap is ordered by bound: nothing left can win
        if kind == 0:
            for fbound, fam in families(ctx, opts, *item):
                keep.found.any_family = True
                counter += 1
                heapq.heappush(heap, (fbound, 1, counter, fam))
            done += 1
            if progress:
                progress(done, len(coarse))
            continue
        for types, point in points(ctx, opts, item, exact):
            keep.found.points += 1
            search_counts(ctx, opts, types, point, item.M, offer, best0, exact)
    return keep.finish(lambda cand, point: plan_from_kinds(ctx, cand, point[0], point[1], point[4]))


def _workers(ctx: SimContext, nodes: int) -> int:
    if ctx.cluster.total_gpus() < PARALLEL_MIN_GPUS or nodes < 8 or "fork" not in mp.get_all_start_methods():
        return 1
    return max(1, min(os.cpu_count() or 1, 4))


def _die_with_parent() -> None:
    """Worker initializer (Linux): the kernel kills a forked worker when the search's process dies
    (PR_SET_PDEATHSIG), so a killed `sailor plan` leaves no worker running on."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _worker(index: int) -> Found:
    ctx, opts, groups, shared, deadline = _PARALLEL_JOB
    return _search(ctx, opts, groups[index], shared, None, deadline)


def _search_parallel(ctx: SimContext, opts: PlanOptions, coarse: list, workers: int, progress, deadline) -> Found:
    """`_search` over `workers` forked processes, coarse nodes dealt round-robin in bound order, the
    best objective shared through a multiprocessing.Value; results merged here."""
    global _PARALLEL_JOB
    fork = mp.get_context("fork")
    shared = fork.Value("d", float("inf"))
    groups = [coarse[i::workers] for i in range(workers)]
    _PARALLEL_JOB = (ctx, opts, groups, shared, deadline)
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=fork, initializer=_die_with_parent) as pool:
            parts = list(pool.map(_worker, range(workers)))
    finally:
        _PARALLEL_JOB = None
    merged = Found()
    for i, part in enumerate(parts):
        merged.finalists += part.finalists
        for p in part.front:
            pareto_add(merged.front, p)
        merged.points += part.points
        merged.candidates += part.candidates
        merged.any_family |= part.any_family
        merged.timed_out |= part.timed_out
        if progress:
            progress(sum(len(g) for g in groups[: i + 1]), len(coarse))
    return merged
