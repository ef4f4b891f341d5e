"""What a search keeps of its candidates (`planner.finalists`): the time-cost Pareto front."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sailor.planner.finalists import pareto_add, pareto_front

POINTS = st.lists(st.tuples(st.integers(0, 6).map(float), st.integers(0, 6).map(float)), max_size=30)


def test_pareto_front_by_hand():
    # (2, 2) is beaten by (1, 2); (3, 3) by all three kept; (1, 2) comes twice and is kept once
    assert pareto_front([(2, 2), (1, 2), (3, 3), (1, 2), (4, 0.5), (0.5, 5)]) == [(0.5, 5), (1, 2), (4, 0.5)]
    assert pareto_front([]) == []


@given(POINTS)
def test_pareto_front_is_every_point_no_other_matches_or_beats(points):
    front = pareto_front(points)
    expected = sorted({p for p in points if not any(q != p and q[0] <= p[0] and q[1] <= p[1] for q in points)})
    assert front == expected
    assert pareto_front(reversed(points)) == front  # the order points come in does not matter


@given(POINTS, POINTS)
def test_fronts_merge_like_their_points(a, b):
    kept = list(pareto_front(a))
    for p in b:
        pareto_add(kept, p)
    assert sorted(kept) == pareto_front(pareto_front(a) + pareto_front(b)) == pareto_front(a + b)
