"""Pipelines cut between nodes (issue #28, Build item 3): the placement a cut asks for, and the planner
choosing a pipeline cut over a slow inter-node link where it beats the data-parallel cut (hand-computed),
and the data-parallel cut where the link is as fast as a node's own.

The two placements compared, 4 GPUs on two nodes of 2, two pipelines of two TP-1 stages:
- data-parallel cut (the block placement): each pipeline on one node, so the activations stay inside a
  node and each stage's gradient all-reduce crosses the link between the nodes;
- pipeline cut (`Replica.node_cut` on stage 1): both stage 0 replicas on one node, both stage 1
  replicas on the other, so the all-reduces stay inside a node and every activation and its gradient
  crosses the link.
"""

from __future__ import annotations

import pytest
from test_plan import _block_first_fit

from sailor.core.errors import SailorInputError
from sailor.plan import plan_from_dict
from sailor.plan.placement import (
    node_blocks,
    pack_replicas,
    rank_layout,
    same_node_boundaries,
)
from sailor.plan.spec import Plan
from sailor.planner import PlanOptions, SearchSpace, plan_job
from sailor.planner.kinds import segment_cuts
from sailor.simulator import make_context, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZA = "us-central1-a"
A100 = "A100-40"


def test_a_cut_pipeline_puts_each_stage_of_every_pipeline_on_its_own_node():
    sizes = {A100: 8}
    pipe = [(ZA, A100, 1), (ZA, A100, 1)]
    assert node_blocks(pipe, sizes.get) == [0, 0]  # uncut: one block on one node
    assert node_blocks(pipe, sizes.get, [False, True]) == [0, 1]
    assert same_node_boundaries(pipe, sizes.get, [False, True]) == (False,)
    # eight cut pipelines: stage 0 of each on node 0, stage 1 on node 1 (first fit, off the pipeline's own node)
    placed = pack_replicas([pipe] * 8, sizes, [[False, True]] * 8)
    assert placed == [[(f"{ZA}/{A100}/0", j), (f"{ZA}/{A100}/1", j)] for j in range(8)]
    # uncut, the same pipelines fill node 0 with four whole pipelines, then node 1
    assert pack_replicas([pipe] * 8, sizes)[4] == [(f"{ZA}/{A100}/1", 0), (f"{ZA}/{A100}/1", 1)]
    # three segments: a cut block avoids every node its pipeline already holds, not only the last one
    three = [(ZA, A100, 2)] * 3
    assert pack_replicas([three] * 2, sizes, [[False, True, True]] * 2) == [
        [(f"{ZA}/{A100}/0", 0), (f"{ZA}/{A100}/1", 0), (f"{ZA}/{A100}/2", 0)],
        [(f"{ZA}/{A100}/0", 2), (f"{ZA}/{A100}/1", 2), (f"{ZA}/{A100}/2", 2)]]


def test_cut_placement_is_the_plain_first_fit_rule():
    # random pipelines with random cuts over shared pools (the linear-time BlockFit against the rule)
    import random
    rng = random.Random(11)
    sizes = {A100: 8, "V100-16": 4}
    for _ in range(200):
        pipes, cuts = [], []
        for _ in range(rng.randint(1, 30)):
            P = rng.randint(1, 5)
            pipes.append([(rng.choice(["z1", "z2"]), rng.choice(list(sizes)), rng.choice([1, 2, 4])) for _ in range(P)])
            cuts.append([False] + [rng.random() < 0.4 for _ in range(P - 1)])
        assert pack_replicas(pipes, sizes, cuts) == _block_first_fit(pipes, sizes, cuts)


def test_segment_cuts_split_a_pipeline_by_its_gpus():
    assert segment_cuts((1, 1, 1, 1), 2) == (False, False, True, False)
    assert segment_cuts((1, 1, 1, 1), 4) == (False, True, True, True)
    assert segment_cuts((4, 1, 1, 1, 1), 2) == (False, True, False, False, False)  # 4 | 1 + 1 + 1 + 1
    assert segment_cuts((1, 1, 1), 3) == (False, True, True)


def test_a_plan_file_says_node_cut_only_where_it_cuts():
    reps = [{"stage": 0, "gpu": A100, "zone": ZA}, {"stage": 1, "gpu": A100, "zone": ZA, "node_cut": True}]
    plan = Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 3], [3, 6]],
                                "pipelines": [{"microbatches": 2, "replicas": reps}]})
    d = plan.to_dict()
    assert "node_cut" not in d["pipelines"][0]["replicas"][0] and d["pipelines"][0]["replicas"][1]["node_cut"] is True
    assert Plan.model_validate(d) == plan
    d["pipelines"][0]["replicas"][0]["node_cut"] = True
    with pytest.raises(SailorInputError, match=r"plan\.json: pipelines\.0\.replicas\.0\.node_cut: pipeline 0 is cut"
                                               r" between nodes before stage 0"):
        plan_from_dict(d, "plan.json")


# 4 blocks of h = 3072 with 3 heads (so TP 1 only on 2-GPU nodes), untied embeddings (no tied
# exchange between the first and last stage), Megatron-LM's gradient sync after the last backward (no
# overlap with it): the two placements differ by the terms of the module docstring alone.
H, V, SEQ = 3072, 8192, 1024
WIDE = JobSpec(model={"name": "wide", "num_blocks": 4, "hidden_size": H, "num_heads": 3, "vocab_size": V,
                      "max_sequence_length": SEQ, "tied_embeddings": False}, global_batch_size=8,
               framework="megatron-lm")
NODE_LINK = (1e-5, 1e11)  # inside a node: 10 us, 100 GB/s
SLOW = (1e-4, 3.125e9)    # between the nodes: 100 us, 25 Gb/s
FAST = (1e-4, 1e11)       # between the nodes: 100 us, 100 GB/s


def _cluster(link: tuple[float, float]) -> ClusterSpec:
    net = {"same_node": {"latency_s": NODE_LINK[0], "bandwidth_bytes_per_s": NODE_LINK[1]},
           "same_zone": {"latency_s": link[0], "bandwidth_bytes_per_s": link[1]}}
    return ClusterSpec(zones={ZA: {A100: 4}}, gpus_per_node={A100: 2}, network=net)


def _pair(cut: bool) -> Plan:
    reps = [{"stage": 0, "gpu": A100, "zone": ZA}, {"stage": 1, "gpu": A100, "zone": ZA, "node_cut": cut}]
    return Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 3], [3, 6]],
                                "pipelines": [{"microbatches": 4, "replicas": reps}] * 2})


def _dp_minus_pp(link: tuple[float, float]) -> float:
    """Seconds the data-parallel cut takes beyond the pipeline cut, by hand. Both run the same layers,
    micro-batches and optimizer step; they differ in which link two terms take:

    - the 1F1B pipeline of 2 stages and m = 4 micro-batches crosses its boundary 2m times on the
      critical path (`closed_form_1f1b`: Σ(f + b) + (m - 1)·max(f + b) + 2m·c), c = α + a / β with
      a = micro-batch 1 x 1024 tokens x h 3072 x 4 bytes = 12,582,912 bytes of activation;
    - the gradient all-reduce of 2 replicas (a ring of 2: 2α + S / β), the slowest stage's:
      stage 0 = embedding (V·h + 1024·h) + 2 blocks of 12h² + 13h = 254,883,840 parameters,
      stage 1 = 2 blocks + final norm 2h + head V·h = 251,744,256; fp32 gradients, so S = 4 x
      254,883,840 = 1,019,535,360 bytes.

    DP cut - PP cut = [2α_l + S/β_l - (2α_n + S/β_n)] - 2m·[(α_l + a/β_l) - (α_n + a/β_n)] (l the
    link between the nodes, n inside one). Slow link (100 us, 25 Gb/s = 3.125e9 B/s) against 10 us,
    100 GB/s inside: (0.000200 + 0.326251 - 0.000020 - 0.010195) - 8 x (0.004127 - 0.000136) =
    0.316236 - 0.031926 = 0.284310 s: the pipeline cut wins. Fast link (100 us, 100 GB/s): both
    bandwidth terms cancel, leaving the latencies, (2 - 2m)(α_l - α_n) = -6 x 90 us = -0.000540 s:
    the data-parallel cut wins.
    """
    (al, bl), (an, bn) = link, NODE_LINK
    m = 4
    a = 1 * SEQ * H * 4
    block = 12 * H * H + 13 * H
    S = 4 * max(V * H + SEQ * H + 2 * block, 2 * block + 2 * H + V * H)
    assert S == 1_019_535_360
    return (2 * al + S / bl - (2 * an + S / bn)) - 2 * m * ((al + a / bl) - (an + a / bn))


def test_the_pipeline_cut_is_chosen_over_a_slow_link_and_the_dp_cut_over_a_fast_one():
    assert _dp_minus_pp(SLOW) == pytest.approx(0.284310, abs=1e-6)
    assert _dp_minus_pp(FAST) == pytest.approx(-0.000540, abs=1e-9)
    for link in (SLOW, FAST):
        cluster = _cluster(link)
        ctx = make_context(WIDE, cluster, calibration={})
        dp, pp = (simulate(_pair(cut), ctx, event=False) for cut in (False, True))
        assert dp.iteration_time_s - pp.iteration_time_s == pytest.approx(_dp_minus_pp(link), rel=1e-9)
        # the placements are the ones compared: the cut puts both replicas of a stage on one node
        nodes = {(r.pipeline, r.stage): r.node for r in rank_layout(_pair(True), {A100: 2})}
        assert nodes[(0, 0)] == nodes[(1, 0)] != nodes[(0, 1)] == nodes[(1, 1)]
        res = plan_job(ctx, PlanOptions(max_stages=2, max_mbs=1))
        assert res.exact
        cut = [r.node_cut for p in res.plan.pipelines for r in p.replicas]
        if link is SLOW:
            # the planner cuts the pipeline between the nodes: the pair's pipeline cut is its plan
            assert res.plan.stages == ((0, 3), (3, 6)) and len(res.plan.pipelines) == 2 and cut == [False, True] * 2
            assert res.best_closed.closed_time_s == pytest.approx(pp.iteration_time_s, rel=1e-9)
        else:
            # no cut: data parallelism across the two nodes, no slower than the pair's DP cut
            assert not any(cut) and len(res.plan.pipelines) >= 2
            assert len({r.node for r in rank_layout(res.plan, {A100: 2})}) == 2
            assert res.best_closed.closed_time_s <= dp.iteration_time_s


def test_the_search_cuts_pipelines_between_nodes_beyond_exact_mode():
    # 48 GPUs on six 8-GPU nodes over the slow link (the heuristic search): its plan cuts its
    # pipelines, scores as the simulator times it, and beats the best plan without cuts
    net = {"same_node": {"latency_s": NODE_LINK[0], "bandwidth_bytes_per_s": NODE_LINK[1]},
           "same_zone": {"latency_s": SLOW[0], "bandwidth_bytes_per_s": SLOW[1]}}
    cluster = ClusterSpec(zones={ZA: {A100: 48}}, gpus_per_node={A100: 8}, network=net)
    job = JobSpec(model=WIDE.model, global_batch_size=16, framework="megatron-lm")
    ctx = make_context(job, cluster, calibration={})
    res = plan_job(ctx, PlanOptions(max_stages=4, max_mbs=2))
    assert not res.exact
    assert any(r.node_cut for p in res.plan.pipelines for r in p.replicas)
    best = res.best_closed
    assert simulate(best.plan, ctx, event=False).iteration_time_s == pytest.approx(best.closed_time_s, rel=1e-9)
    # the published planner's space on the same GPUs (its pipelines are never cut) does worse
    paper = plan_job(ctx, PlanOptions(search=SearchSpace.PAPER, max_stages=4, max_mbs=2))
    assert not any(r.node_cut for p in paper.plan.pipelines for r in p.replicas)
    assert paper.estimate.iteration_time_s > res.estimate.iteration_time_s
