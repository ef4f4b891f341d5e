"""The searches that put a found plan in context (`sailor plan --report`): the same job, cluster and
constraints in the other search spaces of `COMPARED_SPACES`, and the same space for the other
objective without constraints; and one Pareto front of every candidate they scored.

Why the other objective: a search scores candidates from its own objective's side of the trade-off
only (the branch and bound prunes the rest), so its `PlanResult.pareto` is one-sided. Every search's
candidates are plans of the full space (the other spaces are parts of it), so the merged front
(`finalists.pareto_front`) is the full space's trade-off curve as far as these searches saw it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from sailor.core.errors import InfeasibleError
from sailor.planner import Constraints, Objective, PlanOptions, PlanResult, SearchSpace, plan_job
from sailor.planner.finalists import pareto_front
from sailor.simulator import SimContext

COMPARED_SPACES = (SearchSpace.PAPER, SearchSpace.HOMOGENEOUS)
"""The search spaces a plan is compared with, in the order they are searched."""


@dataclass(frozen=True)
class OtherSearch:
    """One comparison search: what it ran and what it found."""

    label: str
    """Names it for progress and notes, e.g. "paper search", "cost search"."""
    options: PlanOptions
    result: PlanResult | None
    """None when it found no plan."""
    reason: str = ""
    """Why it found no plan (`InfeasibleError.one_line`); empty when it found one."""


Point = tuple[float, float]
"""(iteration time s, $/iteration) of a plan, as the fronts hold them."""


def _marked(result: PlanResult) -> list[tuple[Point | None, Point]]:
    """The plans of one search a Pareto figure marks (its chosen plan and alternatives), each as
    (closed-form point, or None when unknown; event-simulated point)."""
    e = result.estimate
    closed = ((result.best_closed.closed_time_s, result.best_closed.closed_cost_usd)
              if result.best_closed.plan == result.plan else None)
    out: list[tuple[Point | None, Point]] = [(closed, (e.iteration_time_s, e.cost_per_iteration_usd))]
    out += [((a.closed_time_s, a.closed_cost_usd), (a.estimate.iteration_time_s, a.estimate.cost_per_iteration_usd))
            for a in result.alternatives if a.estimate is not None]
    return out


def _with_marked(front: list[Point], marked: list[tuple[Point | None, Point]]) -> list[Point]:
    """`front` (closed form) with each marked plan's closed-form point replaced by its
    event-simulated one, then the points no other matches or beats on both (`pareto_front`), sorted
    by time."""
    replaced = {c for c, _ in marked if c is not None}
    return pareto_front([p for p in front if p not in replaced] + [e for _, e in marked])


def _beating(point: Point, front: list[Point]) -> list[Point]:
    """The points of `front` that beat `point`: no slower, no dearer, and not the same point (to a
    relative 1e-12, the same figures computed twice)."""
    t, c = point
    same = lambda a, b: abs(a - b) <= 1e-12 * max(abs(a), abs(b))  # noqa: E731
    return [(ft, fc) for ft, fc in front if ft <= t and fc <= c and not (same(ft, t) and same(fc, c))]


@dataclass(frozen=True)
class Comparison:
    """A plan's search result and the comparison searches around it (`compare_searches`)."""

    main: PlanResult
    options: PlanOptions
    """The main search's options."""
    others: tuple[OtherSearch, ...]
    """The spaces of `COMPARED_SPACES` the main search did not search, in that order, then the main
    space for the other objective."""
    pareto: list[tuple[float, float]]
    """Closed-form (iteration time s, $/iteration) of every candidate scored by the main search and
    the others that no other candidate matches or beats on both, sorted by time (constraints not
    applied)."""

    def best_by_space(self) -> dict[str, PlanResult]:
        """The best plan of each space of `COMPARED_SPACES` under the main objective and constraints,
        keyed by the space's name ("paper", "homogeneous"): the main result for the space it
        searched; a space whose search found no plan is left out."""
        found = {self.options.search: self.main}
        found |= {o.options.search: o.result for o in self.others
                  if o.result is not None and o.options.objective is self.options.objective}
        return {s.value: found[s] for s in COMPARED_SPACES if s in found}

    def space_front(self, result: PlanResult) -> list[Point]:
        """The Pareto front of one search as a figure draws it: its closed-form front
        (`PlanResult.pareto`) with its marked plans (chosen and alternatives) where the event
        simulation puts them."""
        return _with_marked(result.pareto, _marked(result))

    def drawn_front(self) -> list[Point]:
        """The front of every search together (`pareto`), with the marked plans of the main search
        and of each space's best search where the event simulation puts them: the front the chosen
        plan is judged on."""
        marked = _marked(self.main)
        marked += [m for r in self.best_by_space().values() if r is not self.main for m in _marked(r)]
        return _with_marked(self.pareto, marked)

    def chosen_off_front(self) -> str | None:
        """None when the chosen plan is a point of `drawn_front`; otherwise one line saying that it
        is not, which points beat it, and why the planner did not choose them: outside the
        constraints, or closed-form scores the planner's event simulation (which ranks its
        finalists, and places the chosen plan) did not confirm."""
        e = self.main.estimate
        star = (e.iteration_time_s, e.cost_per_iteration_usd)
        better = _beating(star, self.drawn_front())
        if not better:
            return None
        ok = self.options.constraints.ok
        outside = [p for p in better if not ok(*p)]
        inside = [p for p in better if ok(*p)]
        why = []
        if outside:
            why.append(f"{len(outside)} of them break the constraints (budget, rate or throughput floor)")
        if inside:
            why.append(f"{len(inside)} of them are closed-form scores of candidates the planner did not choose: it"
                       " ranks its best few finalists by the event simulation (which places the star), and these"
                       " were either outside those few or slower once event-simulated")
        pts = ", ".join(f"{1 / t:.3f} it/s at ${c:.4f}" for t, c in sorted(better)[:3])
        return (f"The chosen plan ({1 / star[0]:.3f} it/s at ${star[1]:.4f}) is not on the drawn Pareto front:"
                f" {len(better)} point(s) beat it ({pts}{', ...' if len(better) > 3 else ''}); "
                + "; ".join(why) + ".")


def other_searches(options: PlanOptions) -> list[tuple[str, PlanOptions]]:
    """(label, options) of the comparison searches of a search run with `options`: each space of
    `COMPARED_SPACES` but its own (same objective and constraints), then its own space for the other
    objective, without constraints."""
    flipped = Objective.COST if options.objective is Objective.THROUGHPUT else Objective.THROUGHPUT
    out = [(f"{s.value} search", dataclasses.replace(options, search=s)) for s in COMPARED_SPACES
           if s is not options.search]
    out.append((f"{flipped.value} search", dataclasses.replace(options, objective=flipped, constraints=Constraints())))
    return out


def compare_searches(result: PlanResult, ctx_factory: Callable[[], SimContext], options: PlanOptions, *,
                     progress: Callable[[str, int, int], None] | None = None) -> Comparison:
    """Run the comparison searches of `result` (`other_searches`) and merge the Pareto fronts.

    Args:
        result: the main search's result.
        ctx_factory: returns a fresh SimContext for the job and cluster (one per `plan_job` call).
        options: the main search's options.
        progress: called as progress(label, done, total) before each search (done of total
            searches finished).
    Returns:
        the Comparison; a search that finds no plan is kept with its reason.
    """
    planned = other_searches(options)
    others = []
    for done, (label, opts) in enumerate(planned):
        if progress:
            progress(label, done, len(planned))
        try:
            others.append(OtherSearch(label, opts, plan_job(ctx_factory(), opts)))
        except InfeasibleError as e:
            others.append(OtherSearch(label, opts, None, e.one_line()))
    fronts = [result.pareto] + [o.result.pareto for o in others if o.result is not None]
    return Comparison(result, options, tuple(others), pareto_front(p for front in fronts for p in front))
