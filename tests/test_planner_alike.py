"""Regions alike but for their zones' names share the search's packings and gradient syncs
(`planner.alike`, `pack.packing_key`): the keys hold every figure those read, and a search that
shares them finds what one that does not finds."""

from __future__ import annotations

import dataclasses

import pytest

from sailor.plan.spec import DEFAULT_STAGE_MEMORY
from sailor.planner import PlanOptions, engine, plan_job, score
from sailor.planner import kinds as kinds_module
from sailor.planner.alike import canonical_used, canonical_zones
from sailor.planner.kinds import homogeneous_kinds, make_kinds, option_table
from sailor.planner.pack import Packer, fastest_packings, node_unit, packing_key
from sailor.planner.score import Scorer
from sailor.planner.space import stage_options
from sailor.simulator import make_context
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

EAST1 = ["us-east1-b", "us-east1-c", "us-east1-d"]
EAST4 = ["us-east4-a", "us-east4-b", "us-east4-c"]  # zone by zone alike EAST1 on the default links
OFFER = {"A100-40": 8, "V100-16": 8}
NODE = {"A100-40": 4, "V100-16": 4}
JOB = JobSpec(model="opt-350m", global_batch_size=64)


def _ctx(zones: dict, **spec):
    return make_context(JOB, ClusterSpec(zones=zones, gpus_per_node=NODE, **spec), calibration={})


def _two_regions(**spec):
    return _ctx({z: dict(OFFER) for z in EAST1 + EAST4}, **spec)


def test_alike_regions_map_rank_by_rank_to_the_first():
    canon = canonical_zones(_two_regions())
    assert [canon[z] for z in EAST4] == [("us-east4", z) for z in EAST1]
    assert [canon[z] for z in EAST1] == [("us-east1", z) for z in EAST1]


@pytest.mark.parametrize("change", [
    {"zones": {**{z: dict(OFFER) for z in EAST1 + EAST4}, "us-east4-b": {"A100-40": 8, "V100-16": 4}}},
    {"prices": {"us-east4-c": {"A100-40": 1.0}}},
    {"zone_network": {"us-east4-a": {"same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}}}},
    {"zone_network": {"us-east4-a": {"same_node": {"latency_s": 1e-6, "bandwidth_bytes_per_s": 1e11}}}},
])
def test_a_region_that_differs_in_what_the_sync_reads_is_its_own(change):
    zones = change.pop("zones", {z: dict(OFFER) for z in EAST1 + EAST4})
    canon = canonical_zones(_ctx(zones, **change))
    assert [canon[z][1] for z in EAST4] == EAST4


def _region_kinds(ctx, zones):
    part, mbs, memory = ((0, 13), (13, 26)), 2, (DEFAULT_STAGE_MEMORY,) * 2
    free = {(z, g): n for z in zones for g, n in OFFER.items()}
    table = option_table(ctx, ctx.cluster.gpu_types(), part, mbs, 32, memory)
    return part, mbs, free, homogeneous_kinds(ctx, table, free, part, mbs, memory)


def test_alike_regions_have_one_packing_key_and_equal_packings():
    ctx = _two_regions()
    _, _, free1, kinds1 = _region_kinds(ctx, EAST1)
    _, _, free4, kinds4 = _region_kinds(ctx, EAST4)
    assert packing_key(kinds1, free1, 32) == packing_key(kinds4, free4, 32)
    got1, got4 = (fastest_packings(Packer(k, f, 32), [node_unit(x, ctx.cluster.node_size) for x in k])
                  for k, f in ((kinds1, free1), (kinds4, free4)))
    assert len(got1) == len(got4) >= 1
    for (b1, t1, c1, w1, d1), (b4, t4, c4, w4, d4) in zip(got1, got4):
        assert t1 == t4 and d1 == d4 and (c1 == c4).all() and (w1 == w4).all() and (b1 == b4).all() and c1.any()


def test_the_packing_key_changes_with_every_figure_the_packing_reads():
    ctx = _two_regions()
    _, _, free, kinds = _region_kinds(ctx, EAST1)
    key = packing_key(kinds, free, 32)
    k = kinds[0]
    (pool, n), = k.use
    other_gpu = "V100-16" if pool[1] == "A100-40" else "A100-40"
    changed = [dataclasses.replace(k, fill_s=k.fill_s * 1.01), dataclasses.replace(k, two_s=k.two_s * 1.01),
               dataclasses.replace(k, period_s=k.period_s * 1.01), dataclasses.replace(k, gpus=k.gpus + 1),
               dataclasses.replace(k, use=((pool, n + 1),)), dataclasses.replace(k, use=(((pool[0], other_gpu), n),)),
               dataclasses.replace(k, use=(((EAST1[2] if pool[0] != EAST1[2] else EAST1[0], pool[1]), n),))]
    for kind in changed:
        assert packing_key([kind] + kinds[1:], free, 32) != key, kind
    assert packing_key(kinds, free, 33) != key
    assert packing_key(kinds, {**free, next(iter(free)): 4}, 32) != key
    assert packing_key(kinds[::-1], free, 32) != key


def test_a_sync_shared_by_an_alike_region_equals_its_own():
    ctx = _two_regions()
    fresh = _two_regions()
    part, mbs, free1, kinds1 = _region_kinds(ctx, EAST1)
    _, _, free4, kinds4 = _region_kinds(ctx, EAST4)
    # two pipelines of each of two kinds in different zones: the stage's ring crosses zones
    pick = [j for j, k in enumerate(kinds1) if len(k.use) == 1 and k.use[0][0][1] == "A100-40"]
    a, b = next((x, y) for x in pick for y in pick if kinds1[x].zones[0] != kinds1[y].zones[0])
    counts = tuple(2 if j in (a, b) else 0 for j in range(len(kinds1)))
    first = Scorer(ctx, part, mbs, kinds1, 32).sync(counts)
    shared = Scorer(ctx, part, mbs, kinds4, 32).sync(counts)  # from the memo of EAST1's
    used4 = tuple((k.slots, n) for k, n in zip(kinds4, counts) if n)
    assert {s.zone for slots, _ in used4 for s in slots} <= set(EAST4)
    assert canonical_used(ctx, used4) == tuple((k.slots, n) for k, n in zip(kinds1, counts) if n)
    _, _, _, own_kinds = _region_kinds(fresh, EAST4)
    own = Scorer(fresh, part, mbs, own_kinds, 32).sync(counts)  # computed on EAST4's own zones
    assert shared == own == first and own[0] > 0 and own[1] > 0  # the ring pays egress between zones


def test_a_plan_spanning_regions_keeps_its_zones():
    ctx = _two_regions()
    _, _, _, kinds1 = _region_kinds(ctx, EAST1)
    _, _, _, kinds4 = _region_kinds(ctx, EAST4)
    used = ((kinds1[0].slots, 1), (kinds4[0].slots, 1))
    assert canonical_used(ctx, used) is used


def test_a_search_sharing_alike_regions_finds_what_one_without_finds(monkeypatch):
    def run():
        ctx = _ctx({z: {"A100-40": 16, "V100-16": 16} for z in EAST1 + EAST4})
        r = plan_job(ctx, PlanOptions(max_stages=3, max_mbs=4))
        return (r.plan.model_dump_json(), r.estimate.throughput_iters_per_s, r.pareto,
                [(a.plan.model_dump_json() if hasattr(a, "plan") else repr(a)) for a in r.alternatives])

    shared = run()
    calls = []
    monkeypatch.setattr(score, "canonical_used", lambda ctx, used: calls.append(1) or used)
    monkeypatch.setattr(kinds_module, "canonical_zones_of", lambda ctx, zones: calls.append(1) or zones)
    monkeypatch.setattr(engine, "packing_key", lambda kinds, free, M: object())  # never found again
    alone = run()
    assert calls and shared == alone


def test_a_curve_shared_by_an_alike_region_equals_its_own():
    """A pipeline over two zones and two GPU types (no pool class): its curve and egress, built in an
    alike region's memo, equal those built on its own zones."""
    ctx, fresh = _two_regions(), _two_regions()
    part, mbs, memory = ((0, 13), (13, 26)), 2, (DEFAULT_STAGE_MEMORY,) * 2
    a = stage_options(ctx, "A100-40", part, mbs, 32)[0][0]
    v = stage_options(ctx, "V100-16", part, mbs, 32)[1][0]

    def spec(zones):
        return ((zones[0], zones[2]), (a, v))

    first = make_kinds(ctx, [spec(EAST1)], part, mbs, memory)[0]
    shared = make_kinds(ctx, [spec(EAST4)], part, mbs, memory)[0]
    own = make_kinds(fresh, [spec(EAST4)], part, mbs, memory)[0]
    curve = (own.fill_s, own.two_s, own.period_s, own.egress_usd_per_mb)
    assert (shared.fill_s, shared.two_s, shared.period_s, shared.egress_usd_per_mb) == curve
    assert (first.fill_s, first.two_s, first.period_s, first.egress_usd_per_mb) == curve and curve[3] > 0
    assert shared.zones == (EAST4[0], EAST4[2]) and shared == own
