"""The planner's exact mode against brute force over the whole space: pipelines that mix GPU types, TP
degrees and zones from stage to stage, across regions, data parallelism across regions, the stages'
memory options (recomputation, ZeRO, SP) where they are needed, any count of each pipeline and any
split of the batch (the space's rule: batch shares of least makespan, then least egress); and the
search's building blocks (count vectors, maximum flow, water-filling)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from sailor.plan.spec import Plan, StageMemory
from sailor.planner import Constraints, Objective, PlanOptions, plan_job
from sailor.planner.pack import Packer, count_vectors
from sailor.planner.kinds import Kind
from sailor.planner.paper import max_flow
from sailor.planner.score import waterfill
from sailor.planner.space import candidate_partitions, mbs_candidates, memory_candidates, stage_options, zero3_needed
from sailor.simulator import make_context, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

# 4 blocks of width 4096 (about 1e9 parameters, 16 GB of fp32 Adam states): one V100-16 or T4 holds
# half of it, not all; compute (seconds) dwarfs link latency, so pipelines across zones can pay.
MID = JobSpec(model={"name": "mid", "num_blocks": 4, "hidden_size": 4096, "num_heads": 32, "vocab_size": 50272,
                     "max_sequence_length": 2048}, global_batch_size=4)
ZONES = ["us-central1-a", "us-central1-b", "us-west1-b"]  # two regions
NET = {"same_zone": {"latency_s": 1e-6, "bandwidth_bytes_per_s": 2e11},
       "same_region": {"latency_s": 2e-6, "bandwidth_bytes_per_s": 1e11},
       "same_continent": {"latency_s": 4e-6, "bandwidth_bytes_per_s": 5e10}}


def _key(objective: Objective, est) -> tuple[float, float]:
    t, c = est.iteration_time_s, est.cost_per_iteration_usd
    return (t, c) if objective is Objective.THROUGHPUT else (c, t)


def _parts(total: int, n: int):
    """Non-increasing sequences of n positive integers summing to total."""
    def rec(left, k, cap):
        if k == 0:
            if left == 0:
                yield ()
            return
        for first in range(min(cap, left - (k - 1)), 0, -1):
            for rest in rec(left - first, k - 1, first):
                yield (first,) + rest
    yield from rec(total, n, total)


def brute_force(job: JobSpec, cluster: ClusterSpec, opts: PlanOptions):
    """Best objective key over every plan of the space, each scored with simulate(event=False): every
    P, micro-batch, candidate partition and memory candidate of it (the stages' memory options, the
    same `memory_candidates` the planner searches); every pipeline (per stage any GPU type, TP degree
    that fits in memory, and zone that has the GPU type); every multiset of pipelines the GPUs allow
    with as many pipelines as their ZeRO options need; every split of the micro-batches, of which
    those of least makespan (then least egress) count. Memory fits within the planner's margin
    (`PlanOptions.memory_margin`)."""
    ctx = dataclasses.replace(make_context(job, cluster), memory_margin=opts.memory_margin)
    L = job.model.num_layers
    zero_max = 3 if zero3_needed(ctx, opts.max_stages) else 2
    best = None
    for P in range(1, min(L, opts.max_stages) + 1):
        for mbs in mbs_candidates(job.global_batch_size, opts.max_mbs):
            M = job.global_batch_size // mbs
            for part in candidate_partitions(ctx, P, mbs, cluster.gpu_types()):
                for memory in memory_candidates(ctx, cluster.gpu_types(), part, mbs, M, zero_max, opts.memory_per_partition):
                    best = _brute_force_family(ctx, cluster, opts, part, mbs, M, memory, best)
    return best


def _brute_force_family(ctx, cluster, opts, part, mbs, M, memory, best):
    P = len(part)
    per_stage = [[] for _ in range(P)]
    for g in cluster.gpu_types():
        for i, stage in enumerate(stage_options(ctx, g, part, mbs, M, memory)):
            per_stage[i] += [(g, z, o.tp, o.min_replicas) for o in stage for z in ZONES if cluster.available(z, g) >= o.tp]
    pipes = []
    for combo in itertools.product(*per_stage):
        use: dict = {}
        for g, z, t, _ in combo:
            use[(z, g)] = use.get((z, g), 0) + t
        if all(cluster.available(z, g) >= n for (z, g), n in use.items()):
            pipes.append((combo, use))

    def multisets(k, left, chosen):
        if chosen:
            yield list(chosen)
        if len(chosen) == M:
            return
        for j in range(k, len(pipes)):
            if all(left[p] >= n for p, n in pipes[j][1].items()):
                nxt = dict(left)
                for p, n in pipes[j][1].items():
                    nxt[p] -= n
                yield from multisets(j, nxt, chosen + [j])

    free = {(z, g): cluster.available(z, g) for z in ZONES for g in cluster.gpu_types()}
    for ms in multisets(0, free, []):
        if len(ms) < max(d for j in ms for *_, d in pipes[j][0]):
            continue  # a ZeRO option needs more replicas to fit
        live = sorted({j: ms.count(j) for j in ms}.items())

        def splits(i, left):
            if i == len(live):
                if left == 0:
                    yield ()
                return
            n = live[i][1]
            for tot in range(n, left - sum(x[1] for x in live[i + 1:]) + 1):
                for share in _parts(tot, n):
                    for rest in splits(i + 1, left - tot):
                        yield (share,) + rest

        estimates = []
        for split in splits(0, M):
            ps = [{"microbatches": m, "replicas": [{"stage": i, "gpu": g, "zone": z, "tp": t}
                                                    for i, (g, z, t, _) in enumerate(pipes[j][0])]}
                  for (j, _), shares in zip(live, split) for m in shares]
            plan = Plan.model_validate({"micro_batch_size": mbs, "stages": [list(s) for s in part], "pipelines": ps,
                                        "memory": [m.model_dump() for m in memory]})
            estimates.append(simulate(plan, ctx, event=False))
        least = min(e.iteration_time_s for e in estimates)
        for e in estimates:
            if e.iteration_time_s <= least * (1 + 1e-12) and opts.constraints.ok(e.iteration_time_s, e.cost_per_iteration_usd):
                k = _key(opts.objective, e)
                best = k if best is None or k < best else best
    return best


def _random_cluster(seed: int) -> ClusterSpec:
    rng = random.Random(seed)
    zones = rng.sample(ZONES, rng.randint(1, 3))
    gpus = rng.sample(["A100-40", "V100-16", "T4", "A100-80"], rng.randint(1, 2))
    spec = {z: {g: rng.choice([0, 1, 1, 2]) for g in gpus} for z in zones}
    if sum(n for z in spec.values() for n in z.values()) == 0:
        spec[zones[0]][gpus[0]] = 2
    return ClusterSpec(zones=spec, gpus_per_node={g: 2 for g in gpus}, network=NET)


def _features(plan, cluster) -> set[str]:
    out = set()
    if any(len({r.zone for r in p.replicas}) > 1 for p in plan.pipelines):
        out.add("pipeline across zones")
    if any(len({r.gpu for r in p.replicas}) > 1 for p in plan.pipelines):
        out.add("GPU types mixed in a pipeline")
    if len({cluster.prov.region(r.zone) for p in plan.pipelines for r in p.replicas}) > 1:
        out.add("several regions")
    return out


# seeds whose optimum pipelines across zones and regions (20, 26, 38), mixes GPU types (54, 56, 66)
# or runs data parallelism across regions (6, 16, 36), and others
SEEDS = [0, 1, 4, 5, 6, 11, 16, 19, 20, 26, 36, 38, 54, 56, 66, 80]


@pytest.mark.parametrize("seed", SEEDS)
def test_exact_mode_matches_brute_force(seed):
    cluster = _random_cluster(seed)
    objective = Objective.THROUGHPUT if seed % 2 == 0 else Objective.COST
    opts = PlanOptions(objective=objective, max_stages=2, max_mbs=4)
    expected = brute_force(MID, cluster, opts)
    result = plan_job(make_context(MID, cluster), opts)
    assert result.exact
    closed = simulate(result.best_closed.plan, make_context(MID, cluster), event=False)
    assert _key(objective, closed)[0] == pytest.approx(expected[0], rel=1e-9)
    assert result.best_closed.closed_time_s == pytest.approx(closed.iteration_time_s, rel=1e-9)


@pytest.mark.parametrize("seed, feature", [(20, "pipeline across zones"), (38, "several regions"),
                                           (54, "GPU types mixed in a pipeline"), (6, "several regions")])
def test_brute_force_optima_use_the_enlarged_space(seed, feature):
    """The optima the brute-force test checks are not all single-zone, single-type plans."""
    cluster = _random_cluster(seed)
    result = plan_job(make_context(MID, cluster), PlanOptions(max_stages=2, max_mbs=4))
    assert feature in _features(result.best_closed.plan, cluster)


# Needs memory options: 4 blocks of h = 4096 at sequence 4096, fp32 (about 14 GB of weights and Adam
# states), on 16 GB T4s one per node (no TP): one stage only fits with ZeRO or recomputation.
TIGHT = JobSpec(model={"name": "tight", "num_blocks": 4, "hidden_size": 4096, "num_heads": 32, "vocab_size": 8192,
                       "max_sequence_length": 4096}, global_batch_size=4)


@pytest.mark.parametrize("objective", [Objective.THROUGHPUT, Objective.COST])
@pytest.mark.parametrize("zones", [{"us-central1-a": {"T4": 4}}, {"us-central1-a": {"T4": 2}, "us-west1-b": {"T4": 2}}])
def test_exact_mode_matches_brute_force_when_memory_options_are_needed(objective, zones):
    cluster = ClusterSpec(zones=zones, gpus_per_node={"T4": 1}, network=NET)
    opts = PlanOptions(objective=objective, max_stages=2, max_mbs=2)
    ctx = make_context(TIGHT, cluster)
    assert StageMemory() not in memory_candidates(ctx, ["T4"], ((0, 6),), 2, 2)[0]  # one stage needs options
    expected = brute_force(TIGHT, cluster, opts)
    result = plan_job(make_context(TIGHT, cluster), opts)
    assert result.exact
    got = _key(objective, simulate(result.best_closed.plan, make_context(TIGHT, cluster), event=False))
    assert got[0] == pytest.approx(expected[0], rel=1e-9)
    assert result.estimate.fits_in_memory


def test_exact_mode_matches_brute_force_under_a_budget():
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 1, "T4": 2}, "us-west1-b": {"A100-40": 1}},
                          gpus_per_node={"A100-40": 2, "T4": 2}, network=NET)
    base = PlanOptions(max_stages=2, max_mbs=4)
    fast = plan_job(make_context(MID, cluster), base).best_closed
    cheap = plan_job(make_context(MID, cluster), PlanOptions(objective=Objective.COST, max_stages=2, max_mbs=4)).best_closed
    assert cheap.closed_cost_usd < fast.closed_cost_usd
    budget = (fast.closed_cost_usd + cheap.closed_cost_usd) / 2  # rules out the fastest plan
    opts = PlanOptions(max_stages=2, max_mbs=4, constraints=Constraints(max_cost_per_iteration=budget))
    expected = brute_force(MID, cluster, opts)
    result = plan_job(make_context(MID, cluster), opts)
    assert result.exact
    assert result.best_closed.closed_time_s == pytest.approx(expected[0], rel=1e-9)
    assert result.best_closed.closed_cost_usd <= budget


def test_count_vectors_are_every_vector_that_fits():
    cluster = _random_cluster(0)
    ctx = make_context(MID, cluster)
    from sailor.planner.kinds import all_kinds, option_table
    part = ((0, 3), (3, 6))
    memory = (StageMemory(), StageMemory())
    table = option_table(ctx, cluster.gpu_types(), part, 1, 4, memory)
    free = {(z, g): n for z, gp in cluster.zones.items() for g, n in gp.items() if n}
    kinds = all_kinds(ctx, table, free, part, 1, memory, 10_000)
    assert kinds
    got = set(count_vectors(kinds, free, 10**6))
    naive = set()
    for v in itertools.product(*(range(k.fits(free) + 1) for k in kinds)):
        use: dict = {}
        for k, n in zip(kinds, v):
            for p, g in k.use:
                use[p] = use.get(p, 0) + g * n
        if any(v) and all(free[p] >= n for p, n in use.items()):
            naive.add(v)
    assert got == naive
    assert count_vectors(kinds, free, len(naive) - 1) is None


@pytest.mark.parametrize("seed", range(40))
def test_max_flow_equals_scipy(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    cap = rng.integers(0, 6, (n, n)) * (rng.random((n, n)) < 0.5)
    np.fill_diagonal(cap, 0)
    flow = max_flow(cap, 0, n - 1)
    assert flow[0].sum() - flow[:, 0].sum() == maximum_flow(csr_matrix(cap.astype(np.int32)), 0, n - 1).flow_value
    assert (flow >= 0).all() and (flow <= cap).all()
    for v in range(1, n - 1):  # conservation
        assert flow[:, v].sum() == flow[v].sum()


def test_waterfill_takes_the_excess_from_pipelines_that_pay_egress():
    near = Kind(fill_s=1.0, two_s=2.0, period_s=1.0)
    far = Kind(fill_s=1.0, two_s=2.0, period_s=1.0, egress_usd_per_mb=0.5)
    W, shares = waterfill([near, far], (1, 1), 5)  # 3 micro-batches by τ = 3 each; one too many
    assert W == 3.0 and shares == [[3], [2]]
    W, shares = waterfill([far, near], (1, 1), 5)
    assert shares == [[2], [3]]


def test_packing_reaches_the_batch_with_at_most_batch_many_pipelines():
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 64, "V100-16": 64}})
    job = JobSpec(model="opt-350m", global_batch_size=48)
    ctx = make_context(job, cluster)
    from sailor.planner.kinds import homogeneous_kinds, option_table
    part = ((0, 26),)
    memory = (StageMemory(),)
    table = option_table(ctx, cluster.gpu_types(), part, 1, 48, memory)
    free = {("us-central1-a", "A100-40"): 64, ("us-central1-a", "V100-16"): 64}
    kinds = homogeneous_kinds(ctx, table, free, part, 1, memory)
    packer = Packer(kinds, free, 48)
    tau, counts = packer.fastest(np.zeros(len(kinds), dtype=np.int64))
    caps = packer.caps(tau)
    assert (counts * caps).sum() >= 48 and counts.sum() <= 48
    for p, n in free.items():  # within the GPUs
        assert sum(c * dict(k.use).get(p, 0) for k, c in zip(kinds, counts)) <= n
    # nothing faster reaches the batch: at a slightly smaller τ the packing falls short
    below = packer.caps(tau * (1 - 1e-6))
    assert (packer.max_capacity(np.zeros(len(kinds), dtype=np.int64), tau * (1 - 1e-6)) * below).sum() < 48
