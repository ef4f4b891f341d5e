"""The Python API takes what the CLI takes and refuses what it refuses, with the same one-line errors."""

import pytest

import sailor

JOB = {"model": "tiny", "global_batch_size": 8}
CLUSTER = {"provider": "local", "zones": {"local": {"cpu": 2}}}


@pytest.mark.parametrize("options, match", [
    ({"max_stages": -5}, "--max-stages: must be a whole number from 1 to"),
    ({"max_stages": 0}, "--max-stages: must be a whole number from 1 to"),
    ({"max_stages": "4"}, "--max-stages: expected a whole number, got '4'"),
    ({"top": -1}, "--top: must be a whole number >= 0, got -1"),
    ({"max_cost_per_hour": float("nan")}, "--max-cost-per-hour: must be a finite positive number, got nan"),
    ({"time_limit": 0}, "--time-limit: must be a finite positive number, got 0"),
    ({"min_throughput": -1}, "--min-throughput: must be a finite non-negative number, got -1"),
    ({"objective": "speed"}, "unknown objective 'speed'"),
    ({"search": "legacy"}, "unknown search space 'legacy'"),
    ({"progress": 5}, "progress must be a function of \\(done, total\\), got int"),
])
def test_find_plan_refuses_what_the_cli_refuses(options, match):
    with pytest.raises(sailor.SailorInputError, match=match) as e:
        sailor.find_plan(JOB, CLUSTER, **options)
    assert "\n" not in e.value.one_line()


def test_find_plan_takes_the_bounds_themselves():
    # the smallest depth and no alternatives are valid settings, not errors
    result = sailor.find_plan(JOB, CLUSTER, max_stages=1, top=0)
    assert result.plan.num_stages == 1 and result.alternatives == []
