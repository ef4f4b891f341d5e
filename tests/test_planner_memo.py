"""The planner's memo holds what later steps read: a family's kinds are dropped once the search is
done with it (`kinds.forget_kinds`)."""

from __future__ import annotations

import dataclasses

from sailor.plan.spec import DEFAULT_STAGE_MEMORY
from sailor.planner import PlanOptions, engine
from sailor.planner.kinds import Kind, forget_kinds, make_kinds
from sailor.planner.space import stage_options
from sailor.simulator import make_context
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZA, ZB = "us-central1-a", "us-central1-b"


def test_forgotten_kinds_are_built_again_equal():
    job = JobSpec(model="opt-350m", global_batch_size=64)
    part, mbs, M = ((0, 13), (13, 26)), 2, 32
    memory = (DEFAULT_STAGE_MEMORY,) * 2
    ctx = make_context(job, ClusterSpec(zones={ZA: {"A100-40": 8, "V100-16": 8}},
                                        gpus_per_node={"A100-40": 4, "V100-16": 4}), calibration={})
    a = stage_options(ctx, "A100-40", part, mbs, M)[0]
    v = stage_options(ctx, "V100-16", part, mbs, M)[1]
    specs = [((ZA, ZA), (a[0], a[0])), ((ZA, ZA), (a[-1], v[0]))]
    first = make_kinds(ctx, specs, part, mbs, memory)
    assert all(x is y for x, y in zip(make_kinds(ctx, specs, part, mbs, memory), first))  # memoised
    forget_kinds(ctx, part, mbs, memory)
    again = make_kinds(ctx, specs, part, mbs, memory)
    assert again == first and all(x is not y for x, y in zip(again, first))
    other = ((0, 10), (10, 26))  # another family's kinds are not dropped
    kept = make_kinds(ctx, specs, other, mbs, memory)
    forget_kinds(ctx, part, mbs, memory)
    assert all(x is y for x, y in zip(make_kinds(ctx, specs, other, mbs, memory), kept))


def _memo_kinds(memo: dict) -> list[Kind]:
    """The kinds the memo holds, as values or in dicts of values."""
    out = []
    for v in memo.values():
        for x in (v.values() if isinstance(v, dict) else (v,)):
            if isinstance(x, Kind):
                out.append(x)
    return out


def test_the_search_drops_the_kinds_of_the_families_it_searched(monkeypatch):
    job = JobSpec(model="opt-350m", global_batch_size=128)
    cluster = ClusterSpec(zones={ZA: {"A100-40": 64, "V100-16": 64}, ZB: {"A100-40": 64}},
                          gpus_per_node={"A100-40": 4, "V100-16": 4})
    opts = PlanOptions(max_stages=4, max_mbs=2)
    ctx = make_context(job, cluster, calibration={})
    ctx = dataclasses.replace(ctx, memory_margin=opts.memory_margin)
    searched: list[Kind] = []  # the searched families' kinds (held, so that no id is reused)
    at_end: list[Kind] = []
    search_family, refine = engine._search_family, engine._refine_with_spanning

    def spy_search(ctx_, opts_, fam, *a):
        searched.extend(fam.kinds)
        return search_family(ctx_, opts_, fam, *a)

    def spy_refine(ctx_, *a):
        at_end.extend(_memo_kinds(ctx_.memo))  # the memo when the families' loop ends
        return refine(ctx_, *a)

    monkeypatch.setattr(engine, "_search_family", spy_search)
    monkeypatch.setattr(engine, "_refine_with_spanning", spy_refine)
    engine.search(ctx, opts)
    assert len(searched) > 100
    assert not {id(k) for k in searched} & {id(k) for k in at_end}
