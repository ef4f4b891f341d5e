"""Comparison searches (`planner.compare`): which searches run around a found plan, what they report
while running, the best plan of each compared space, and the merged Pareto front."""

from __future__ import annotations

import pytest

from sailor.planner import Constraints, Objective, PlanOptions, SearchSpace, plan_job
from sailor.planner.compare import Comparison, OtherSearch, compare_searches, other_searches
from sailor.simulator import make_context
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

JOB = JobSpec(model="opt-350m", global_batch_size=64)
CLUSTER = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}, "us-central1-b": {"V100-16": 8}})
OPTS = PlanOptions(max_stages=2, top_k=2)


def _context():
    return make_context(JOB, CLUSTER)


@pytest.fixture(scope="module")
def compared():
    result = plan_job(_context(), OPTS)
    steps = []
    comparison = compare_searches(result, _context, OPTS, progress=lambda *step: steps.append(step))
    return result, comparison, steps


def test_the_other_spaces_then_the_other_objective_run_in_order(compared):
    result, comparison, steps = compared
    assert steps == [("paper search", 0, 3), ("homogeneous search", 1, 3), ("cost search", 2, 3)]
    assert [o.label for o in comparison.others] == [label for label, _, _ in steps]
    paper, homogeneous, cost = (o.options for o in comparison.others)
    assert (paper.search, homogeneous.search, cost.search) == (SearchSpace.PAPER, SearchSpace.HOMOGENEOUS,
                                                               SearchSpace.FULL)
    assert paper.objective is homogeneous.objective is Objective.THROUGHPUT and cost.objective is Objective.COST
    assert all(o.result is not None and o.reason == "" for o in comparison.others)
    assert comparison.main is result
    best = comparison.best_by_space()
    assert list(best) == ["paper", "homogeneous"]
    assert best["paper"] is comparison.others[0].result and best["homogeneous"] is comparison.others[1].result


def test_the_merged_front_covers_every_search(compared):
    result, comparison, _ = compared
    fronts = [result.pareto] + [o.result.pareto for o in comparison.others]
    merged = comparison.pareto
    assert merged == sorted(merged) and len(set(merged)) == len(merged)
    # every point of every search's front is matched or beaten by a merged point, and every merged
    # point is a scored candidate that no other one beats
    assert all(any(q[0] <= p[0] and q[1] <= p[1] for q in merged) for front in fronts for p in front)
    assert all(any(p in front for front in fronts) for p in merged)
    assert not any(q != p and q[0] <= p[0] and q[1] <= p[1] for p in merged for q in merged)
    # the cost search adds cheap plans the throughput search never kept
    assert merged != result.pareto


def test_a_search_in_a_compared_space_is_its_own_best_and_is_not_rerun(compared):
    _, comparison, _ = compared
    paper_opts = PlanOptions(max_stages=2, top_k=2, search=SearchSpace.PAPER)
    planned = other_searches(paper_opts)
    assert [label for label, _ in planned] == ["homogeneous search", "cost search"]
    assert planned[1][1].search is SearchSpace.PAPER and planned[1][1].objective is Objective.COST
    paper, homogeneous, cost = comparison.others
    # the cost search of the paper space is not the paper space's best under throughput
    mine = Comparison(paper.result, paper_opts, (homogeneous, OtherSearch("cost search", planned[1][1], cost.result)), [])
    assert mine.best_by_space() == {"paper": paper.result, "homogeneous": homogeneous.result}


def test_a_search_without_a_plan_keeps_its_reason():
    result = plan_job(_context(), OPTS)
    beyond = PlanOptions(max_stages=2, top_k=1, constraints=Constraints(min_throughput=1e6))
    comparison = compare_searches(result, _context, beyond)
    paper, homogeneous, cost = comparison.others
    for o in (paper, homogeneous):
        assert o.result is None and "no plan meets at least 1e+06 iterations/s" in o.reason
    assert cost.result is not None and cost.options.constraints == Constraints()  # the other objective: unconstrained
    assert comparison.best_by_space() == {}
