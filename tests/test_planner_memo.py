"""The planner's memo holds what later steps read, compactly: a family's kinds are dropped once the
search is done with it (`kinds.forget_kinds`), group shapes are run-length coded
(`simulator.terms.group_shape`), and the memos of rings and of each shape's rings are emptied when
full (`NetworkModel.ring_links`, `simulator.terms.shape_memo`)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.plan.spec import DEFAULT_STAGE_MEMORY
from sailor.planner import PlanOptions, engine
from sailor.planner.kinds import Kind, forget_kinds, make_kinds
from sailor.planner.space import stage_options
from sailor.simulator import make_context
from sailor.simulator.collectives import Member, group_members
from sailor.simulator.terms import group_shape
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


def _plain_shape(groups: list) -> tuple:
    """The shape without run-length coding: per group (zone, GPU type, TP, node rank, count)."""
    ids: dict[str, int] = {}
    return tuple((m.zone, m.gpu, m.tp, None if m.node is None else ids.setdefault(m.node, len(ids)), n)
                 for m, n in groups)


def _expand(shape: tuple) -> tuple:
    return tuple((z, g, t, None if r is None else r + j, n) for z, g, t, r, n, length in shape for j in range(length))


def test_a_stage_of_one_replica_per_node_is_one_run():
    members = [Member(zone=ZA, gpu="A100-40", tp=4, node=f"n{j}") for j in range(300)]
    assert group_shape(group_members(members)) == ((ZA, "A100-40", 4, 0, 1, 300),)
    two = members[:3] + [Member(zone=ZA, gpu="A100-40", tp=4, node="n2")] + members[3:5]  # n2 holds two
    assert group_shape(group_members(two)) == ((ZA, "A100-40", 4, 0, 1, 2), (ZA, "A100-40", 4, 2, 2, 1),
                                               (ZA, "A100-40", 4, 3, 1, 2))
    unplaced = [Member(zone=z, gpu="V100-16", tp=1) for z in (ZA, ZB, ZB)]
    assert group_shape(group_members(unplaced)) == ((ZA, "V100-16", 1, None, 1, 1), (ZB, "V100-16", 1, None, 2, 1))


member = st.builds(Member, zone=st.sampled_from([ZA, ZB]), gpu=st.sampled_from(["A100-40", "V100-16"]),
                   tp=st.sampled_from([1, 2]), node=st.sampled_from([None, "a", "b", "c", "d", "e"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(member, st.integers(1, 3)), max_size=12),
       st.lists(st.tuples(member, st.integers(1, 3)), max_size=12))
def test_run_length_shapes_are_equal_exactly_when_the_shapes_are(x, y):
    # the coding loses nothing (it expands back) and so keys the memo as the plain shape does
    assert _expand(group_shape(x)) == _plain_shape(x)
    assert (group_shape(x) == group_shape(y)) == (_plain_shape(x) == _plain_shape(y))


def test_forgotten_kinds_take_their_curves_with_them():
    job = JobSpec(model="opt-350m", global_batch_size=64)
    part, mbs, M = ((0, 13), (13, 26)), 2, 32
    memory = (DEFAULT_STAGE_MEMORY,) * 2
    ctx = make_context(job, ClusterSpec(zones={ZA: {"A100-40": 8}, ZB: {"A100-40": 8}},
                                        gpus_per_node={"A100-40": 4}), calibration={})
    a = stage_options(ctx, "A100-40", part, mbs, M)[0]
    specs = [((z, z), (o, o)) for z in (ZA, ZB) for o in a]
    first = make_kinds(ctx, specs, part, mbs, memory)
    curves = [k for k in ctx.memo if k[0] == "kind curves"]
    assert len(curves) == 1 and 0 < len(ctx.memo[curves[0]]) < len(specs)  # alike zones share a curve
    forget_kinds(ctx, part, mbs, memory)
    assert not [k for k in ctx.memo if k[0] in ("kinds", "kind curves")]
    again = make_kinds(ctx, list(reversed(specs)), part, mbs, memory)[::-1]  # built in another batch
    assert [dataclasses.astuple(k) for k in again] == [dataclasses.astuple(k) for k in first]


def _two_zones() -> tuple[JobSpec, ClusterSpec]:
    """OPT-350M at batch 64 on two zones of 16 A100-40, 8 per node."""
    return (JobSpec(model="opt-350m", global_batch_size=64),
            ClusterSpec(zones={ZA: {"A100-40": 16}, ZB: {"A100-40": 16}}, gpus_per_node={"A100-40": 8}))


def _slots(zones, tps, cuts) -> tuple[Member, ...]:
    """A100-40 slots of these zones, TP degrees and node cuts, stage by stage."""
    return tuple(Member(zone=z, gpu="A100-40", tp=t, node_cut=c) for z, t, c in zip(zones, tps, cuts))


def test_node_group_units_are_shared_by_pools_alike_and_equal_to_their_own():
    job, cluster = _two_zones()
    ctx = make_context(job, cluster, calibration={})

    one = [_slots((z, z, z), (2, 2, 4), (False, True, False)) for z in (ZA, ZB)]
    two = _slots((ZA, ZA, ZB), (2, 2, 4), (False, True, False))  # a new pool at stage 2: a block of its own
    units = [engine._node_group_unit(ctx, s) for s in one + [two]]
    assert units[0] == units[1] == 1 and units[2] == 2  # blocks of 2, 2 + 4 GPUs: 8 // 6; of 2, 2, 4: 8 // 4
    assert len([k for k in ctx.memo if k[0] == "node-group unit"]) == 2
    for s, u in zip(one + [two], units):  # each alone, in a context of its own
        assert engine._node_group_unit(make_context(job, cluster, calibration={}), s) == u


def test_kind_boundaries_are_shared_by_pools_alike_and_equal_to_the_placement():
    from sailor.plan.placement import same_node_boundaries
    from sailor.planner.kinds import block_key, kind_boundaries

    job, cluster = _two_zones()
    ctx = make_context(job, cluster, calibration={})

    cases = [_slots((z, z, z, z), (2, 2, 4, 2), (False, False, False, c)) for z in (ZA, ZB) for c in (False, True)]
    cases.append(_slots((ZA, ZA, ZB, ZB), (2, 2, 4, 2), (False,) * 4))  # a new pool at stage 2
    got = [kind_boundaries(ctx, s) for s in cases]
    want = [same_node_boundaries([(m.zone, m.gpu, m.tp) for m in s], cluster.node_size, [m.node_cut for m in s])
            for s in cases]
    assert got == want
    assert got[0] == (True, True, False) and got[1] == (True, True, False) and got[4] == (True, False, True)
    assert len([k for k in ctx.memo if k[0] == "kind boundaries"]) == 3  # ZA and ZB share theirs
    assert all(x is y for x, y in zip(block_key(ctx, cases[0]), block_key(ctx, cases[2])))  # one object per slot


def test_placed_groups_and_renamed_pipelines_are_one_object_each():
    from sailor.planner.alike import canonical_used
    from sailor.planner.score import apart_groups, placed_alone

    job = JobSpec(model="opt-350m", global_batch_size=64)
    cluster = ClusterSpec(zones={ZA: {"A100-40": 32}, ZB: {"A100-40": 32}}, gpus_per_node={"A100-40": 4})
    ctx = make_context(job, cluster, calibration={})
    kind = (Member(zone=ZA, gpu="A100-40", tp=2), Member(zone=ZA, gpu="A100-40", tp=1))
    few, more = apart_groups(ctx, ((kind, 3),)), apart_groups(ctx, ((kind, 6),))
    for n, stages in ((3, few), (6, more)):  # as group_members gives them
        assert stages == [group_members([p[i] for p in placed_alone(ctx, kind, n)]) for i in range(2)]
    assert more[0][0] == few[0][0] and more[0][0] is few[0][0]  # the first pipelines' groups, shared
    used = ((tuple(dataclasses.replace(m, zone=ZB) for m in kind), 2),)
    a, b = canonical_used(ctx, used), canonical_used(ctx, tuple((tuple(s), n) for s, n in used))
    assert a == b and a[0][0] is b[0][0]


def test_a_full_ring_memo_is_emptied_and_answers_as_before(monkeypatch):
    from sailor.perf import network
    from sailor.simulator.collectives import _edge_kinds

    monkeypatch.setattr(network, "RING_MEMO_MAX", 3)
    cluster = ClusterSpec(zones={ZA: {"A100-40": 64}, ZB: {"A100-40": 64}}, gpus_per_node={"A100-40": 4})
    bounded = make_context(JobSpec(model="opt-350m", global_batch_size=64), cluster, calibration={}).network
    rings = [tuple(group_members([Member(zone=ZA if j % k else ZB, gpu="A100-40", tp=1 + j % 2, node=f"n{j}")
                                  for j in range(k + 2)])) for k in range(1, 9)]
    got = []
    for ring in rings + rings[:2]:
        got.append(bounded.ring_links(ring, lambda: _edge_kinds(list(ring))))
        assert len(bounded._routes["rings"]) <= 3
    monkeypatch.setattr(network, "RING_MEMO_MAX", 10**6)
    fresh = make_context(JobSpec(model="opt-350m", global_batch_size=64), cluster, calibration={}).network
    want = [fresh.ring_links(ring, lambda: _edge_kinds(list(ring))) for ring in rings + rings[:2]]
    assert [(lat, [(r.link, t) for r, t in links]) for lat, links in got] == \
        [(lat, [(r.link, t) for r, t in links]) for lat, links in want]


def test_a_full_shape_memo_is_emptied_and_the_syncs_are_as_before(monkeypatch):
    # `terms.shape_memo` (each shape's rings and ring edges) held to 3 shapes: the collectives and
    # the syncs' seconds and egress over groups of many shapes, each asked twice, are those of an
    # unbounded memo
    from sailor.model.spec import Collective
    from sailor.simulator import stage_sync, terms

    cluster = ClusterSpec(zones={ZA: {"A100-40": 64}, ZB: {"A100-40": 64}, "europe-west4-a": {"A100-40": 64}},
                          gpus_per_node={"A100-40": 4})
    job = JobSpec(model="opt-350m", global_batch_size=64)
    zones = [ZA, ZB, "europe-west4-a"]
    cases = [group_members([Member(zone=zones[j % z], gpu="A100-40", tp=1 + j % 2, node=f"n{j // 2}")
                            for j in range(k + 2)]) for k in range(1, 9) for z in (1, 3)]

    def run(ctx) -> list:
        return [(terms.collective_s(ctx, g, kind, nbytes, 1), stage_sync(ctx, g, ((2, 9),)))
                for g in cases + cases for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER)
                for nbytes in (1.0, 3e8)]

    monkeypatch.setattr(terms, "SHAPE_MEMO_MAX", 3)
    bounded = make_context(job, cluster, calibration={})
    got = run(bounded)
    assert 0 < len(bounded.memo["allreduce rings"]) <= 3 and 0 < len(bounded.memo["ring edges"]) <= 3
    monkeypatch.setattr(terms, "SHAPE_MEMO_MAX", 10**6)
    assert got == run(make_context(job, cluster, calibration={}))
    assert len({x for x, _ in got}) > 8 and any(e[2] > 0 for _, e in got)  # many times, some egress
