"""What a search keeps of the candidates it scores: the best few under the objective (finalists for the
event simulation), the time-cost Pareto front, and counters. Shared by `engine` and `paper`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from sailor.core.units import HOUR_S
from sailor.plan.spec import Plan, StageMemory
from sailor.planner.options import PlanOptions, SearchSpace, objective_key
from sailor.planner.score import Candidate, Scorer
from sailor.simulator import SimContext


@dataclass
class Found:
    """A search's result: finalists as (objective key, closed-form time s, closed-form $/iteration,
    plan), the Pareto front of scored candidates (time s, $/iteration), counters, and flags.

    `exact`: every part of the space was searched exhaustively or pruned by valid bounds (the result
    is the optimum of the space under the closed form). `timed_out`: the time limit stopped it."""

    finalists: list[tuple[tuple[float, float], float, float, Plan]] = field(default_factory=list)
    front: list[tuple[float, float]] = field(default_factory=list)
    points: int = 0
    candidates: int = 0
    any_family: bool = False
    exact: bool = True
    timed_out: bool = False
    pinned: list[Plan] = field(default_factory=list)
    """Plans that phase 3 must event-simulate whatever their closed-form rank (the published
    planner's best, so that the full search is never beaten by it in the simulator)."""
    near: list[tuple[tuple[float, float], float, float, Plan]] = field(default_factory=list)
    """Near misses, best in the closed form first, as (objective key at the event simulation's lower
    bound, closed-form time s, closed-form $/iteration, plan): candidates that miss a floor on throughput or a cap on
    $/iteration in the closed form but meet it at the lower bound (`Finalists.offer`); phase 3
    event-simulates those that could beat its best plan (`planner._near_meeting`)."""
    deep: list[Plan] = field(default_factory=list)
    """The best plan of each pipeline depth P >= 2 that no finalist has: phase 3 tries the schedules
    on those deeper than its best finalist too (`planner._variants`), as a deeper pipeline can pay
    only once its bubble shrinks."""
    least_hourly: tuple[float, float] | None = None
    """(closed-form $/hour, iterations/s) of the scored candidate with the lowest $/hour, constraints
    not applied (None before any): what a $/hour cap that no plan meets is told it would need
    (`planner._why_infeasible`)."""


class Finalists:
    """Keeps the best `2·max(top_k, rescore)` candidates under the objective and the constraints, and
    as many near misses (`offer`)."""

    def __init__(self, opts: PlanOptions) -> None:
        self.opts = opts
        self.key = objective_key(opts.objective)
        self.keep = 2 * max(opts.top_k, opts.rescore)
        self.best: tuple[float, float] | None = None
        self._kept: dict[tuple, tuple[tuple[float, float], Candidate, tuple]] = {}
        self._cut: tuple[float, float] | None = None  # the keep-th best key at the last trim
        self._deepest: dict[int, tuple[tuple[float, float], Candidate, tuple]] = {}  # P -> best of that depth
        self._near: dict[tuple, tuple[tuple[float, float], tuple[float, float], Candidate, tuple]] = {}  # closed, bound keys
        self.found = Found()

    def best0(self) -> float:
        """First component of the best objective key so far (inf before any)."""
        return self.best[0] if self.best is not None else math.inf

    def seed(self, key: tuple[float, float]) -> None:
        """Prune with a plan found elsewhere (its objective key) as if it had been offered here."""
        if self.best is None or key < self.best:
            self.best = key

    def offer(self, cand: Candidate | None, point: tuple) -> tuple[float, float] | None:
        """Record a scored candidate of `point` (hashable: what, with the candidate, rebuilds its plan);
        returns its objective key when it meets the constraints."""
        if cand is None:
            return None
        self.found.candidates += 1
        pareto_add(self.found.front, (cand.iteration_time_s, cand.cost_per_iteration_usd))
        least = self.found.least_hourly
        if least is None or cand.cost_per_hour_usd < least[0]:
            self.found.least_hourly = (cand.cost_per_hour_usd, cand.throughput)
        sig = (point, tuple(cand.scorer.kinds[i] for i, n in enumerate(cand.counts) if n),
               tuple(n for n in cand.counts if n))
        if not self.opts.constraints.ok(cand.iteration_time_s, cand.cost_per_iteration_usd):
            self._offer_near(cand, point, sig)
            return None
        k = self.key(cand.iteration_time_s, cand.cost_per_iteration_usd)
        self._kept[sig] = (k, cand, point)
        P = len(cand.scorer.partition)
        if P >= 2 and (P not in self._deepest or k < self._deepest[P][0]):
            self._deepest[P] = (k, cand, point)
        if self.best is None or k < self.best:
            self.best = k
        if len(self._kept) > 2 * self.keep:
            ranked = sorted(self._kept, key=lambda s: self._kept[s][0])
            for s in ranked[self.keep:]:
                del self._kept[s]
            self._cut = self._kept[ranked[self.keep - 1]][0]
        return k

    def offer_counts(self, scorer: Scorer, counts: np.ndarray, point: tuple, floor_s: float = 0.0) -> bool:
        """Score the count vector `counts` over `scorer`'s kinds and offer it (`floor_s`: a makespan it
        cannot beat, `Scorer.score`); False when it is all zeros."""
        vec = tuple(int(x) for x in counts)
        if not any(vec):
            return False
        self.offer(scorer.score(vec, self.hopeless, floor_s), point)
        return True

    def _offer_near(self, cand: Candidate, point: tuple, sig: tuple) -> None:
        """Keep `cand`, which misses the constraints in the closed form, among the near misses when
        its plan could meet them in the event simulation: at the event simulation's lower bound on
        its iteration time (`Scorer.event_floor_s`, and the $/iteration that time gives) it meets the
        throughput floor and the $/iteration cap, and its closed form meets the $/hour cap (which a
        shorter iteration only raises: a plan over it in the closed form is kept only if the event
        simulation runs slower, which this does not chase). The best `keep` by the objective in the
        closed form are kept (at the bound, plans whose transfers dominate would crowd out those
        that miss by a hair: a newcomer's floor at 0.99999 of the unconstrained plan's figure found
        nothing); they never prune (`best`), as the bound can be far below the plan's time."""
        c = self.opts.constraints
        if c.min_throughput is None and c.max_cost_per_iteration is None:
            return
        if c.max_cost_per_hour is not None and cand.cost_per_hour_usd > c.max_cost_per_hour:
            return
        t = cand.scorer.event_floor_s(cand)
        usd = cand.cost_per_iteration_usd - cand.usd_per_hour_gpus * (cand.iteration_time_s - t) / HOUR_S
        if not replace(c, max_cost_per_hour=None).ok(t, usd):
            return
        self._near[sig] = (self.key(cand.iteration_time_s, cand.cost_per_iteration_usd), self.key(t, usd), cand, point)
        if len(self._near) > 2 * self.keep:
            for s in sorted(self._near, key=lambda s: self._near[s][0])[self.keep:]:
                del self._near[s]

    def hopeless(self, seconds: float, usd: float) -> bool:
        """True when a candidate at least `seconds` per iteration and `usd` per iteration can change
        nothing kept: a point of the Pareto front is no worse on both, and its objective key would
        be worse than the keep-th best key at the last trim (keys only improve, so it could never
        be a finalist). Lets the scorer skip its gradient sync (`score.Scorer.score`)."""
        if self._cut is None or self.key(seconds, usd) <= self._cut:
            return False
        return any(q[0] <= seconds and q[1] <= usd for q in self.found.front)

    def top(self, n: int) -> list[tuple[Candidate, tuple]]:
        """The best n kept candidates (candidate, point), best first."""
        return [(c, p) for _, c, p in sorted(self._kept.values(), key=lambda v: v[0])[:n]]

    def finish(self, build: Callable[[Candidate, tuple], Plan]) -> Found:
        """The Found with the plans of the best kept candidates built, best first, each plan once: as
        many as phase 3 looks at (`planner._rescore`: max(rescore, top_k + 1)); building a large plan
        is not cheap. Also the best plan of each pipeline depth the finalists lack (`Found.deep`)."""
        n = max(self.opts.rescore, self.opts.top_k + 1)
        seen, out = set(), []
        for k, c, p in sorted(self._kept.values(), key=lambda v: v[0]):
            plan = build(c, p)
            same = plan_signature(plan)  # another kind list can build the same plan
            if same not in seen:
                seen.add(same)
                out.append((k, c.iteration_time_s, c.cost_per_iteration_usd, plan))
                if len(out) == n:
                    break
        self.found.finalists = out
        self.found.near = [(bound, c.iteration_time_s, c.cost_per_iteration_usd, build(c, p))
                           for _, bound, c, p in sorted(self._near.values(), key=lambda v: v[0])[:self.opts.rescore]]
        depths = {plan.num_stages for *_, plan in out}
        if self.opts.schedules and self.opts.search is SearchSpace.FULL:
            self.found.deep = [build(c, p) for P, (_, c, p) in sorted(self._deepest.items()) if P not in depths]
        return self.found


def plan_signature(plan: Plan) -> str:
    """What tells two plans apart (their JSON without the job and cluster they carry)."""
    return plan.model_dump_json(exclude={"job", "cluster"})


def pareto_add(front: list[tuple[float, float]], p: tuple[float, float]) -> None:
    """Add (time, cost) to a Pareto front (minimise both) kept in place; amortised cheap because most
    points are dominated by one of the few front points."""
    if any(q[0] <= p[0] and q[1] <= p[1] for q in front):
        return
    front[:] = [q for q in front if not (p[0] <= q[0] and p[1] <= q[1])]
    front.append(p)


def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (time, cost) points that no different point matches or beats on both, each once, sorted by
    time: `pareto_add` over `points` (e.g. several searches' fronts merged)."""
    front: list[tuple[float, float]] = []
    for p in points:
        pareto_add(front, p)
    return sorted(front)


def plan_from_kinds(ctx: SimContext, cand: Candidate, partition, mbs: int, memory: tuple[StageMemory, ...] = ()) -> Plan:
    """The plan of a candidate (its kinds name an option and a zone per stage, and the pipeline's
    cuts between nodes, `kinds.Kind`): one pipeline per share, with the stages' memory options. Over a single pipeline ZeRO shards nothing:
    ZeRO-1 is left out, ZeRO-2/3 become ZeRO-2, which still syncs one layer's gradients at a time
    instead of flattening the stage's (`simulator.memory.sync_buffer_bytes`, what `space.min_replicas`
    counted)."""
    pipelines = []
    for k, shares in zip(cand.scorer.kinds, cand.shares):
        reps = [{"stage": i, "gpu": s.gpu, "zone": s.zone, "tp": s.tp} | ({"node_cut": True} if s.node_cut else {})
                for i, s in enumerate(k.slots)]
        for m in shares:
            pipelines.append({"microbatches": m, "replicas": reps})
    if len(pipelines) == 1:
        memory = tuple(m.model_copy(update={"zero": 2 if m.zero >= 2 else 0, "reshard_after_forward": True})
                       for m in memory)
    plan = Plan.model_validate({"micro_batch_size": mbs, "stages": [list(s) for s in partition], "pipelines": pipelines,
                                "memory": [m.model_dump(mode="json") for m in memory] if any(not m.is_default for m in memory) else [],
                                "job": ctx.job.to_dict(), "cluster": ctx.cluster.to_dict()})
    plan.check_against(ctx.job, ctx.cluster)
    return plan
