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
