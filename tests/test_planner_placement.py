"""The planner scores the placement the launcher makes (issue #28, item 1), and adding GPUs never makes
its best plan worse (item 2).

- Every finalist's closed-form score equals `simulate(event=False)` of its plan, which places the
  plan's replicas as the launcher does (`plan.placement.rank_layout`), and each of its pipelines has
  the stage boundaries inside a node that the planner timed its kind with (`kinds.kind_boundaries`).
- A pipeline of one pool that fits a node runs its transfers over the intra-node link (hand-computed).
- Monotonicity, as a property over small clusters in exact mode: a cluster with more GPUs (of the same
  or new pools) never gets a slower best plan (throughput) or a dearer one (cost) under the closed form.
"""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sailor.core.errors import InfeasibleError
from sailor.plan.placement import rank_layout, same_node_boundaries
from sailor.plan.spec import DEFAULT_STAGE_MEMORY
from sailor.planner import Objective, PlanOptions, engine, plan_job, tradeoff
from sailor.planner.kinds import Kind, kind_boundaries, make_kind
from sailor.planner import pack
from sailor.planner.pack import Packer, fastest_packings
from sailor.planner.space import Option
from sailor.simulator import Slot, make_context, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZA, ZB, ZW = "us-central1-a", "us-central1-b", "us-west1-b"
# inside a node 100 GB/s, between nodes 1 GB/s with 1 ms: a boundary shows which link it took
FAST_NODE = {"same_node": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e11},
             "same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9},
             "same_region": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9},
             "same_continent": {"latency_s": 5e-3, "bandwidth_bytes_per_s": 5e8}}


def _check_finalists(job: JobSpec, cluster: ClusterSpec, opts: PlanOptions) -> int:
    """Assert, for every finalist of the search, that its closed-form score is simulate(event=False) of
    its plan and that the launcher's placement puts each pipeline's boundaries where the planner
    timed them; returns how many boundaries sat inside a node (so a test can see it checked some)."""
    ctx = make_context(job, cluster, calibration={})
    found = engine.search(ctx, opts)
    assert found.finalists
    size = {g: cluster.node_size(g) for g in cluster.gpu_types()}
    inside = 0
    for _, closed_s, closed_usd, plan in found.finalists:
        est = simulate(plan, ctx, event=False)
        assert est.iteration_time_s == pytest.approx(closed_s, rel=1e-9)
        assert est.cost_per_iteration_usd == pytest.approx(closed_usd, rel=1e-9)
        ranks = rank_layout(plan, size)
        node = {(r.pipeline, r.stage): r.node for r in ranks}
        for j, p in enumerate(plan.pipelines):
            placed = tuple(node[(j, i)] == node[(j, i + 1)] for i in range(plan.num_stages - 1))
            slots = tuple(Slot(zone=r.zone, gpu=r.gpu, tp=r.tp, node_cut=r.node_cut) for r in p.replicas)
            assert placed == kind_boundaries(ctx, slots)
            inside += sum(placed)
    return inside


@pytest.mark.parametrize("zones, per_node", [
    ({ZA: {"A100-40": 16}}, 8),                                   # pipelines of up to 8 GPUs fit a node
    ({ZA: {"A100-40": 12, "V100-16": 12}, ZB: {"A100-40": 12}}, 4),  # heuristic mode (36 GPUs), shared pools
])
def test_every_finalist_is_scored_on_the_launchers_placement(zones, per_node):
    cluster = ClusterSpec(zones=zones, gpus_per_node={g: per_node for z in zones.values() for g in z}, network=FAST_NODE)
    job = JobSpec(model="opt-350m", global_batch_size=64)
    opts = PlanOptions(max_stages=4, max_mbs=8, top_k=6, rescore=6)
    assert _check_finalists(job, cluster, opts) > 0


def test_a_pipeline_that_fits_a_node_transfers_inside_it():
    # two stages of TP 1 on one pool: one block on one node (2 GPUs per node), so the boundary takes
    # the intra-node link: 10 us + activation / 100 GB/s; on 1-GPU nodes the two nodes' 1 ms + x / 1 GB/s
    job = JobSpec(model="tiny", global_batch_size=4)
    act = 64 * 64 * 4  # tiny: micro-batch 1 x sequence 64 x hidden 64 x fp32
    part = ((0, 3), (3, 6))
    opt = Option(gpu="A100-40", tp=1, forward_s=0.0, backward_s=0.0)
    times = {}
    for per_node in (2, 1):
        cluster = ClusterSpec(zones={ZA: {"A100-40": 4}}, gpus_per_node={"A100-40": per_node}, network=FAST_NODE)
        ctx = make_context(job, cluster, calibration={})
        kind = make_kind(ctx, (ZA, ZA), (opt, opt), part, 1, (DEFAULT_STAGE_MEMORY,) * 2)
        assert kind_boundaries(ctx, kind.slots) == ((True,) if per_node == 2 else (False,))
        one = Slot(zone=ZA, gpu="A100-40", tp=1)
        f = [ctx.stage_compute_s("A100-40", 1, 1, a, e)[0] for a, e in part]
        b = [ctx.stage_compute_s("A100-40", 1, 1, a, e)[1] for a, e in part]
        assert one == kind.slots[0]
        # one micro-batch: forward through both stages, backward back, the boundary crossed twice
        times[per_node] = kind.fill_s - (sum(f) + sum(b))
    assert times[2] == pytest.approx(2 * (1e-5 + act / 1e11), rel=1e-6)
    assert times[1] == pytest.approx(2 * (1e-3 + act / 1e9), rel=1e-6)
    assert same_node_boundaries([(ZA, "A100-40", 1)] * 2, {"A100-40": 2}.get) == (True,)


# ---- monotonicity: more GPUs never make the best plan worse -------------------------------------
# 4 blocks of width 4096 (about 1e9 parameters): compute dwarfs link latency (tests/test_planner_exact.py)
MID = JobSpec(model={"name": "mid", "num_blocks": 4, "hidden_size": 4096, "num_heads": 32, "vocab_size": 50272,
                     "max_sequence_length": 2048}, global_batch_size=4)
POOLS = [(z, g) for z in (ZA, ZB, ZW) for g in ("A100-40", "V100-16", "T4")]


@st.composite
def _cluster_pair(draw):
    """(smaller, larger) clusters, 2 GPUs per node: the smaller has 1-3 zones and 1-2 GPU types with
    0-2 GPUs per pool (as `tests/test_planner_exact.py`'s, small enough for exact mode); the larger
    has every GPU of the smaller and 1-2 more, in its pools or in new zones or of new GPU types."""
    zones = draw(st.lists(st.sampled_from([ZA, ZB, ZW]), min_size=1, max_size=3, unique=True))
    gpus = draw(st.lists(st.sampled_from(["A100-40", "V100-16", "T4"]), min_size=1, max_size=2, unique=True))
    small = {(z, g): draw(st.integers(0, 2)) for z in zones for g in gpus}
    if not any(small.values()):
        small[(zones[0], gpus[0])] = 2
    large = dict(small)
    for p in draw(st.lists(st.sampled_from(POOLS), min_size=1, max_size=2)):
        large[p] = large.get(p, 0) + 1

    def spec(counts):
        out: dict[str, dict[str, int]] = {}
        for (z, g), n in sorted(counts.items()):
            if n:
                out.setdefault(z, {})[g] = n
        types = {g for z in out.values() for g in z}
        return ClusterSpec(zones=out, gpus_per_node={g: 2 for g in types}, network=FAST_NODE)

    return spec(small), spec(large)


def _best(cluster: ClusterSpec, objective: Objective):
    """(exact, best closed-form objective key), or None when no plan fits."""
    try:
        res = plan_job(make_context(MID, cluster), PlanOptions(objective=objective, max_stages=2, max_mbs=4))
    except InfeasibleError:
        return None
    c = res.best_closed
    return res.exact, (c.closed_time_s, c.closed_cost_usd) if objective is Objective.THROUGHPUT else \
        (c.closed_cost_usd, c.closed_time_s)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(pair=_cluster_pair(), objective=st.sampled_from([Objective.THROUGHPUT, Objective.COST]))
def test_more_gpus_never_make_the_best_plan_worse(pair, objective):
    small, large = pair
    got_small = _best(small, objective)
    if got_small is None:
        return  # nothing to compare (a larger cluster may hold a plan the smaller cannot)
    exact_small, best_small = got_small
    exact_large, best_large = _best(large, objective)
    assert exact_small and exact_large  # both searched the whole space (<= 32 GPUs, few kinds)
    assert best_large[0] <= best_small[0] * (1 + 1e-9)


def test_a_count_vector_scores_the_same_on_a_larger_cluster():
    # the scorer reads a candidate's own pools only: the same pipelines, placed as the launcher
    # places them, take the same time and cost whatever else the cluster offers (so a larger
    # cluster's search ranks the smaller one's candidates as the smaller one's does)
    from sailor.planner.kinds import make_kinds
    from sailor.planner.score import Scorer
    from sailor.planner.space import stage_options

    job = JobSpec(model="opt-350m", global_batch_size=64)
    part, mbs, M = ((0, 13), (13, 26)), 2, 32
    memory = (DEFAULT_STAGE_MEMORY,) * 2
    small = ClusterSpec(zones={ZA: {"A100-40": 8, "V100-16": 8}}, gpus_per_node={"A100-40": 4, "V100-16": 4},
                        network=FAST_NODE)
    large = ClusterSpec(zones={ZA: {"A100-40": 16, "V100-16": 8, "T4": 8}, ZB: {"A100-40": 8}, ZW: {"V100-16": 8}},
                        gpus_per_node={"A100-40": 4, "V100-16": 4, "T4": 4}, network=FAST_NODE)
    got = []
    for cluster in (small, large):
        ctx = make_context(job, cluster, calibration={})
        a = [o for o in stage_options(ctx, "A100-40", part, mbs, M)[0] if o.tp in (1, 2)]
        v = [o for o in stage_options(ctx, "V100-16", part, mbs, M)[1] if o.tp == 1]
        specs = [((ZA, ZA), (a[0], a[0])), ((ZA, ZA), (a[-1], a[-1])), ((ZA, ZA), (a[0], v[0]))]
        kinds = make_kinds(ctx, specs, part, mbs, memory)
        scorer = Scorer(ctx, part, mbs, kinds, M)
        got.append([x for n in ((2, 0, 0), (1, 1, 0), (0, 1, 2), (1, 0, 1))
                    for x in (scorer.score(n).iteration_time_s, scorer.score(n).cost_per_iteration_usd)])
    assert got[0] == pytest.approx(got[1], rel=1e-12)


@st.composite
def _packers(draw):
    """(kinds of a cluster, its free GPUs, kinds of the same cluster with one (zone, GPU type) pool
    more, its free GPUs, M): one-pool kinds of hand-drawn curves and prices, the new pool's kinds
    last; the new pool is in a new zone or a new GPU type in a zone the cluster has."""
    def kinds_in(zone, pools):
        out = []
        for gpu in pools:
            for _ in range(draw(st.integers(1, 2))):
                per = draw(st.floats(0.5, 3.0))
                width = draw(st.sampled_from([1, 2, 4]))
                out.append(Kind(fill_s=3 * per, two_s=4 * per, period_s=per, zones=(zone,), gpus=width,
                                use=(((zone, gpu), width),), usd_per_hour=width * draw(st.floats(1.0, 4.0))))
        return out

    small_kinds, free = [], {}
    zones = draw(st.lists(st.sampled_from([ZA, ZB, ZW]), min_size=1, max_size=3, unique=True))
    for zone in zones:
        pools = draw(st.lists(st.sampled_from(["A100-40", "V100-16"]), min_size=1, max_size=2, unique=True))
        small_kinds += kinds_in(zone, pools)
        free.update({(zone, g): draw(st.integers(0, 12)) for g in pools})
    new = (draw(st.sampled_from(["us-east1-b", *zones])), "T4")
    large_free = {**free, new: draw(st.integers(1, 12))}
    return small_kinds, free, small_kinds + kinds_in(new[0], [new[1]]), large_free, draw(st.integers(1, 40))


class _Vectors:
    """A stand-in scorer: a count vector scores as itself."""

    def score(self, counts):
        return counts


@settings(max_examples=200, deadline=None, derandomize=True)
@given(case=_packers(), where=st.floats(0.0, 1.0))
def test_a_pool_more_keeps_the_cheapest_vectors_of_the_cluster_without_it(case, where):
    # heuristic mode, cost objective or constraints (`tradeoff.trade_off`): at every makespan every
    # cheapest count vector of the cluster without the new pool (a zone, or a GPU type in a zone)
    # is among the larger cluster's candidates, whether or not the larger one's own cheapest
    # vector uses the new pool
    small_kinds, free, large_kinds, large_free, M = case
    small, large = Packer(small_kinds, free, M), Packer(large_kinds, large_free, M)
    lo = min(k.fill_s for k in small_kinds)
    hi = max(k.time_s(M) for k in small_kinds)
    tau = lo + where * (hi - lo)
    pad = (0,) * (len(large_kinds) - len(small_kinds))
    want = {tuple(v) + pad for v in tradeoff.cheapest_variants(small, _Vectors(), tau)}
    assert want <= set(tradeoff.cheapest_variants(large, _Vectors(), tau))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(case=_packers(), start=st.floats(0.05, 5.0), sooner=st.floats(0.2, 1.0))
def test_a_pool_more_keeps_the_makespan_grid_of_the_cluster_without_it(case, start, sooner):
    # the trade-off's makespans (`Packer.tau_grid`) lie on one lattice: a larger cluster, whose
    # fastest packing is no slower and whose kinds include the smaller one's, tries every makespan
    # strictly inside the smaller one's grid
    small_kinds, free, large_kinds, large_free, M = case
    small = Packer(small_kinds, free, M).tau_grid(start)
    large = set(Packer(large_kinds, large_free, M).tau_grid(start * sooner))
    assert set(small[1:-1]) <= large


@settings(max_examples=300, deadline=None, derandomize=True)
@given(case=_packers())
def test_a_pool_more_keeps_the_fastest_packings_of_the_cluster_without_it(case):
    # heuristic mode, throughput objective (`pack.fastest_packings`): every fastest packing of the
    # cluster without the new pool (a zone, or a GPU type in a zone), its own and those leaving out
    # pools it uses, is among the larger cluster's, whether or not the larger one's own fastest
    # packing uses the new pool (the recursion's budget lifted: what it keeps within the budget)
    small_kinds, free, large_kinds, large_free, M = case
    pad = (0,) * (len(large_kinds) - len(small_kinds))
    with mock.patch.object(pack, "FASTEST_RUNS", 10**6, create=True):
        want = {tuple(p[2]) + pad for p in fastest_packings(Packer(small_kinds, free, M), [1] * len(small_kinds))}
        got = {tuple(p[2]) for p in fastest_packings(Packer(large_kinds, large_free, M), [1] * len(large_kinds))}
    assert want <= got


@settings(max_examples=300, deadline=None, derandomize=True)
@given(case=_packers())
def test_a_pool_more_keeps_the_fastest_packing_of_the_cluster_without_it_within_the_budget(case):
    # at the budget the planner runs with (`pack.FASTEST_RUNS`): the smaller cluster's own fastest
    # packing is among the larger one's when the larger one's fastest packing does not use the new
    # pool, or leaves it out within the budget (`pack.drop_order`: pools in the zones that hold the
    # fewest of its pipelines first)
    small_kinds, free, large_kinds, large_free, M = case
    pad = (0,) * (len(large_kinds) - len(small_kinds))
    small = fastest_packings(Packer(small_kinds, free, M), [1] * len(small_kinds))
    large = fastest_packings(Packer(large_kinds, large_free, M), [1] * len(large_kinds))
    if not small:
        return
    new = set(large_free) - set(free)
    first = tuple(int(x) for x in large[0].counts)
    if new & set(pack.drop_order(large_kinds, [first])[: pack.FASTEST_RUNS - 1]) or not new & {
            p for k, n in zip(large_kinds, first) if n for p, _ in k.use}:
        assert tuple(int(x) for x in small[0].counts) + pad in {tuple(int(x) for x in p.counts) for p in large}
