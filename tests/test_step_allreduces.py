"""The step's two all-reduces over every rank (`simulator.sync.step_allreduces_s`): their bytes
(`plan.comms.step_allreduce_bytes`), their seconds by hand on small plans with a backend start-up
and processing rate (`perf.network.CollectiveCost`), NCCL's tree across nodes against gloo's ring
(`simulator.collectives.tree_allreduce_s`), what they add to `simulate`'s iteration, and
the planner's closed form charging the same (`planner.score.Scorer.step_collectives`)."""

import dataclasses

import pytest

from sailor.model.spec import Collective
from sailor.perf.network import CollectiveCost
from sailor.plan.comms import step_allreduce_bytes, step_statistics_elements
from sailor.plan.spec import DEFAULT_STAGE_MEMORY, Plan
from sailor.planner.kinds import make_kind
from sailor.planner.score import Scorer
from sailor.planner.space import Option
from sailor.simulator import make_context, placed_slots, simulate
from sailor.simulator.collectives import tree_allreduce_s
from sailor.simulator.sync import step_allreduces_s, world_groups
from sailor.simulator.terms import collective_s
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZA, ZB = "us-central1-a", "us-central1-b"
JOB = JobSpec(model="tiny", global_batch_size=8)
# 1 ms / 100 MB/s between two nodes of a zone, 50 µs / 200 MB/s inside a node, 10 ms / 10 MB/s
# between the zones of a region
LINKS = {"same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e8},
         "same_node": {"latency_s": 5e-5, "bandwidth_bytes_per_s": 2e8},
         "same_region": {"latency_s": 1e-2, "bandwidth_bytes_per_s": 1e7}}
GLOO = CollectiveCost(startup_s=2e-3, processing_bytes_per_s=1e8, backend="gloo")  # 2 ms a call, sums at 100 MB/s


def _ctx(gpus_per_node: int, cost: CollectiveCost = GLOO, zones=(ZA,)):
    cluster = ClusterSpec(zones={z: {"A100-40": 8} for z in zones}, gpus_per_node={"A100-40": gpus_per_node},
                          network=LINKS)
    ctx = make_context(JOB, cluster, calibration={})
    ctx.network.collective = cost
    return ctx


def _plan(pipelines: list[tuple[str, list[int]]], stages=((0, 6),), m: int = 1) -> Plan:
    """One pipeline per (zone, TP per stage), `m` micro-batches each."""
    return Plan.model_validate({"micro_batch_size": 1, "stages": [list(s) for s in stages], "pipelines": [
        {"microbatches": m, "replicas": [{"stage": i, "gpu": "A100-40", "zone": z, "tp": t} for i, t in enumerate(tps)]}
        for z, tps in pipelines]})


def test_the_step_all_reduces_bytes():
    # the norm: one float64; the statistics: 1 + P·5 + D + 2·W float64 (P 2, D 3, W 10: 34)
    assert step_statistics_elements(2, 3, 10) == 34
    assert step_allreduce_bytes(2, 3, 10) == (8, 272)
    assert step_allreduce_bytes(1, 1, 1) == (8, 8 * 9)


def test_three_ranks_on_three_nodes_by_hand():
    # data parallel, 3 pipelines of one TP-1 stage, one GPU per node: a ring of W = 3 ranks over the
    # zone's link (one island of single-rank nodes: no hierarchy). Each all-reduce of S bytes:
    # the 2 ms start-up, 2(W-1) = 4 steps of 1 ms, each rank streaming and summing 2(W-1)/W x S
    # = 4/3 S bytes at 100 MB/s each; S = 8 (the norm) and 8 x (1 + 5 + 3 + 6) = 120 (statistics)
    ctx = _ctx(gpus_per_node=1)
    plan = _plan([(ZA, [1])] * 3)
    want = sum(2e-3 + 4 * 1e-3 + 2 * (4 / 3) * s / 1e8 for s in (8, 120))
    world = world_groups(sl for pipe in placed_slots(plan, ctx.cluster) for sl in pipe)
    assert sum(n for _, n in world) == 3
    assert step_allreduces_s(ctx, world, 1, 3) == pytest.approx(want, rel=1e-12)
    est = simulate(plan, ctx)
    assert est.step_collectives_s == pytest.approx(want, rel=1e-12)
    assert est.iteration_time_s == pytest.approx(est.pipeline_s + est.gradient_sync_s + est.optimizer_s + want,
                                                 rel=1e-12)
    assert est.to_dict()["breakdown"]["step_collectives"] == est.step_collectives_s
    # the default backend (NCCL) charges no start-up and no processing: the steps and the stream
    plain = _ctx(gpus_per_node=1, cost=CollectiveCost())
    assert simulate(plan, plain).step_collectives_s == pytest.approx(
        sum(4 * 1e-3 + (4 / 3) * s / 1e8 for s in (8, 120)), rel=1e-12)


def test_tp_ranks_of_one_node_all_take_part_over_its_link():
    # one pipeline of two TP-2 stages on one 4-GPU node: W = 4 ranks, all on the node, so a ring of
    # 2(W-1) = 6 steps of 50 µs and 2 x 3/4 x S bytes over the node's 200 MB/s link, summed at
    # 100 MB/s; S = 8 and 8 x (1 + 2·5 + 1 + 2·4) = 160
    ctx = _ctx(gpus_per_node=4)
    plan = _plan([(ZA, [2, 2])], stages=((0, 3), (3, 6)))
    want = sum(2e-3 + 6 * 5e-5 + 1.5 * s / 2e8 + 1.5 * s / 1e8 for s in (8, 160))
    est = simulate(plan, ctx)
    assert est.step_collectives_s == pytest.approx(want, rel=1e-12)
    assert est.iteration_time_s == pytest.approx(est.pipeline_s + est.gradient_sync_s + est.optimizer_s + want,
                                                 rel=1e-12)


def test_only_sailors_runtime_runs_them():
    # DeepSpeed's pipeline engine (the public runs `sailor validate` reads) reduces in its own way
    ctx = _ctx(gpus_per_node=1)
    ds = make_context(JobSpec(model="tiny", global_batch_size=8, framework="deepspeed"), ctx.cluster, calibration={})
    ds.network.collective = GLOO
    plan = _plan([(ZA, [1])] * 3)
    assert simulate(plan, ctx).step_collectives_s > 0
    assert simulate(plan, ds).step_collectives_s == 0.0


def test_one_rank_runs_no_collective():
    ctx = _ctx(gpus_per_node=1)
    est = simulate(_plan([(ZA, [1])]), ctx)
    assert est.step_collectives_s == 0.0
    assert est.iteration_time_s == pytest.approx(est.pipeline_s + est.gradient_sync_s + est.optimizer_s, rel=1e-12)


def _kind(ctx, zone: str):
    return make_kind(ctx, (zone,), (Option(gpu="A100-40", tp=1, forward_s=0.0, backward_s=0.0),), ((0, 6),), 1,
                     (DEFAULT_STAGE_MEMORY,))


@pytest.mark.parametrize("zones", [(ZA,), (ZA, ZB)])
def test_the_planners_closed_form_charges_what_simulate_does(zones):
    # 2 pipelines per zone on 4-GPU nodes (two ranks on a node); across two zones the world is
    # hierarchical (kinds in separate pools: placed apart, `score.placed_apart`); in one zone two
    # kinds of the same pool are placed together
    ctx = _ctx(gpus_per_node=4, zones=zones)
    kinds = [_kind(ctx, z) for z in zones] if len(zones) > 1 else [_kind(ctx, ZA), _kind(ctx, ZA)]
    counts = (2, 2)
    scorer = Scorer(ctx, ((0, 6),), 1, kinds, 8)
    plan = _plan([(z, [1]) for z in (zones * 2 if len(zones) == 1 else zones) for _ in range(2)], m=2)  # 8 in all
    est = simulate(plan, ctx, event=False)
    assert scorer.step_collectives(counts) == pytest.approx(est.step_collectives_s, rel=1e-12)
    assert est.step_collectives_s > 0
    cand = scorer.score(counts)
    assert cand.shares == [[2, 2], [2, 2]]
    assert cand.iteration_time_s == pytest.approx(est.iteration_time_s, rel=1e-9)


def test_nccl_takes_the_tree_across_nodes_where_it_is_cheaper_and_gloo_the_ring():
    # 4 pipelines of one TP-2 stage, 2 GPUs per node: W = 8 ranks on N = 4 nodes, r = 2 on each. NCCL's
    # tree: 2·((r - 1)·(50 µs + S/200 MB/s) + ⌈log2 4⌉·(1 ms + S/100 MB/s)) = 4.1 ms + ...; its ring:
    # 14 steps of 1 ms, and the hierarchy over the nodes 2 x 1 step inside a node + 6 steps of 1 ms
    # across them: both dearer, so the tree. Gloo (no tree) pays its ring or hierarchy
    plan = _plan([(ZA, [2])] * 4)
    tree = [2 * ((5e-5 + s / 2e8) + 2 * (1e-3 + s / 1e8)) for s in step_allreduce_bytes(1, 4, 8)]
    nccl = _ctx(gpus_per_node=2, cost=CollectiveCost())
    world = world_groups(sl for pipe in placed_slots(plan, nccl.cluster) for sl in pipe)
    assert sorted(n for _, n in world) == [2, 2, 2, 2]
    assert tree_allreduce_s(world, 8, nccl.network) == pytest.approx(tree[0], rel=1e-12)
    assert step_allreduces_s(nccl, world, 1, 4) == pytest.approx(sum(tree), rel=1e-12)
    assert simulate(plan, nccl).step_collectives_s == pytest.approx(sum(tree), rel=1e-12)
    gloo = _ctx(gpus_per_node=2, cost=dataclasses.replace(CollectiveCost(), backend="gloo"))
    rings = sum(collective_s(gloo, world, Collective.ALL_REDUCE, s, 1) for s in step_allreduce_bytes(1, 4, 8))
    assert step_allreduces_s(gloo, world, 1, 4) == pytest.approx(rings, rel=1e-12)
    assert rings > sum(tree) + 3e-3  # at least the 2 x 2 more hops of 1 ms, less what the tree's bytes add
    # on one node the tree is the chain through its ranks: no cheaper than the ring, which NCCL keeps
    one = _plan([(ZA, [2])] * 2)
    inside = _ctx(gpus_per_node=4, cost=CollectiveCost())
    ranks = world_groups(sl for pipe in placed_slots(one, inside.cluster) for sl in pipe)
    assert tree_allreduce_s(ranks, 8, inside.network) == pytest.approx(2 * 3 * (5e-5 + 8 / 2e8), rel=1e-12)
