"""The search's shortcuts change no result (issue #28, scale): each is checked against the computation
it replaces, run here as the reference.

- `engine._hopeless_alone` (node groups told hopeless before a scorer is built) against scoring
  every node group;
- `prune._uniform_estimate` and `prune._node_group_estimate` leaving out the sync where the rest
  cannot beat the best estimate so far, against computing every sync;
- `pack.PoolPacking.capacity` from the best kind of each GPU count, against every (main, second)
  row of the pools; `pack.PoolPacking.counts` taking each pool's best row for all pools at once,
  against one pool at a time (both with pools left out, `pack.fastest_packings`);
- `pack.bisect` asking several steps' midpoints at once, against one step at a time;
- `kinds.make_kinds` computing what a cut does not change once per uncut twin, against each kind
  built alone in a fresh context;
- `kinds.make_kinds` sharing a curve among the kinds of one pool class (`kinds.pool_class`: zones
  whose links are alike) and, without ZeRO-3, among every D, against each kind built alone with
  every zone apart;
- `simulator.terms.collective_s` memoised by the groups' shape (and its rings,
  `collectives.AllreduceRings`, timed for each byte count), and `simulator.sync.stage_sync`'s ring
  egress per shape (`collectives.RingEdges`), against the collective and the egress computed afresh;
- `collectives.Ring` reading each ring's latency and routes once (`NetworkModel.ring_links`)
  against every edge kind's latency and stream looked up at each call;
- `score.apart_groups` joining the kinds' groups one after the other where their ring keys do not
  overlap, against sorting all of them;
- `NetworkModel.zone_class` (zones whose links are alike computed once: the two-replica sync
  bounds' slots, `prune.alike_slots`, the estimates' transfers and node groups, the hierarchical
  all-reduce's zone islands) against every zone apart;
- `prune.NodeKeys` (a node's estimate computed when the node comes up) against every node's key
  computed first.
All but the fifth together: `plan_job` returns the same plan, estimate, alternatives, candidate count
and Pareto front with the references patched in, on clusters where they come into play (pipelines cut
between nodes over a slow link, ZeRO, several zones, the cost objective).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest

from sailor.model.spec import Collective
from sailor.perf.network import NetworkModel
from sailor.planner import Objective, PlanOptions, engine, pack, paper, plan_job, prune, score
from sailor.planner.finalists import plan_signature
from sailor.planner.kinds import homogeneous_kinds, make_kinds, option_table
from sailor.planner.pack import BISECTION_STEPS, PoolPacking
from sailor.planner.score import placed_alone
from sailor.planner.space import candidate_partitions, memory_candidates
from sailor.simulator import Slot, make_context, stage_sync
from sailor.simulator import collectives
from sailor.simulator.collectives import (
    Hierarchy,
    Member,
    allreduce_time_s,
    group_members,
    ring_crossings,
    ring_egress,
    ring_key,
)
from sailor.simulator.terms import RING_SHARE, collective_s
from sailor.simulator.traffic import totals
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZA, ZB = "us-central1-a", "us-central1-b"
SLOW_NET = {"same_node": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e11},
            "same_zone": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 3.125e9}}
WIDE = {"name": "wide", "num_blocks": 4, "hidden_size": 3072, "num_heads": 3, "vocab_size": 8192,
        "max_sequence_length": 1024, "tied_embeddings": False}


def _rows_capacity(single, free, caps: np.ndarray) -> int:
    """The pools' best packing by every (main, second) row, as `PoolPacking` first computed it."""
    by_pool: dict = {}
    for k, p, g in single:
        if free.get(p, 0) >= g:
            by_pool.setdefault(p, []).append((k, g))
    total = 0
    for p, ks in by_pool.items():
        a = free[p]
        total += max((a // g) * caps[k] + ((a - (a // g) * g) // g2) * caps[j] for k, g in ks for j, g2 in ks)
    return int(total)


def test_pool_packing_capacity_equals_the_best_row_of_every_pool():
    rng = random.Random(5)
    for _ in range(400):
        pools = list(dict.fromkeys((f"z{rng.randint(0, 3)}", f"g{rng.randint(0, 2)}") for _ in range(4)))
        free = {p: rng.randint(0, 40) for p in pools}
        single = [(k, rng.choice(pools), rng.choice([1, 2, 3, 4, 6, 8])) for k in range(rng.randint(1, 12))]
        packing = PoolPacking.build(single, free)
        if packing is None:
            assert all(free[p] < g for _, p, g in single)
            continue
        assert packing.kinds == sorted({k for k, p, g in single if free[p] >= g})
        for _ in range(5):
            caps = np.array([rng.randint(0, 30) for _ in single], dtype=np.int64)
            assert packing.capacity(caps) == _rows_capacity(single, free, caps)
        rows = np.array([[rng.randint(0, 30) for _ in single] for _ in range(3)], dtype=np.int64)
        assert packing.capacity(rows).tolist() == [_rows_capacity(single, free, row) for row in rows]


def _bisect_step_by_step(enough, lo: float, hi: float) -> tuple[tuple[float, float], int]:
    """`pack.bisect` as first written (one midpoint asked per step): (lo, hi) and the steps taken."""
    steps = 0
    for _ in range(BISECTION_STEPS):
        if hi - lo <= 1e-9 * hi:
            break
        mid = 0.5 * (lo + hi)
        if enough(mid):
            hi = mid
        else:
            lo = mid
        steps += 1
    return (lo, hi), steps


def test_a_bisection_asked_several_steps_at_once_ends_where_one_step_at_a_time_does():
    rng = random.Random(8)
    for _ in range(300):
        lo = rng.choice([0.0, rng.uniform(0, 10)])
        hi = lo + rng.choice([1e-12, 1e-8, 1.0, 1e3]) * rng.random()
        threshold = rng.uniform(lo - 1, hi + 1)
        want, steps = _bisect_step_by_step(lambda t: t >= threshold, lo, hi)
        for levels in (1, 2, 3, 4, 6):
            calls = []

            def enough(taus):
                calls.append(len(taus))
                return taus >= threshold
            assert pack.bisect(enough, lo, hi, levels) == want
            assert len(calls) == -(-steps // levels) and max(calls, default=0) < 2 ** levels


def test_cut_kinds_built_together_equal_each_built_alone():
    # 48 GPUs on 8-GPU nodes: the homogeneous kinds and their cuts, built in one batch (twins share
    # stage times and transfers), against each kind's spec built alone in a context of its own
    job = JobSpec(model=WIDE, global_batch_size=16, framework="megatron-lm")
    cluster = ClusterSpec(zones={ZA: {"A100-40": 48}}, gpus_per_node={"A100-40": 8}, network=SLOW_NET)
    ctx = make_context(job, cluster, calibration={})
    gpus, free = cluster.gpu_types(), {(ZA, "A100-40"): 48}
    checked = 0
    for mbs in (1, 2):
        M = job.global_batch_size // mbs
        for part in candidate_partitions(ctx, 3, mbs, gpus)[:2]:
            memory = memory_candidates(ctx, gpus, part, mbs, M, 2, 1)[0]
            table = option_table(ctx, gpus, part, mbs, M, memory)
            kinds = homogeneous_kinds(ctx, table, free, part, mbs, memory)
            assert any(any(k.cuts) for k in kinds)
            for kind in kinds:
                alone = make_kinds(make_context(job, cluster, calibration={}), [kind.spec], part, mbs, memory)[0]
                assert dataclasses.astuple(alone) == dataclasses.astuple(kind)
                assert alone.slots == kind.slots
                checked += 1
    assert checked > 20


def test_kinds_of_alike_zones_share_a_curve_equal_to_each_built_with_every_zone_apart(monkeypatch):
    # three zones, two alike and one with a slower link of its own between nodes (and ZeRO on 16 GB
    # GPUs, kinds rebuilt at a D: without ZeRO-3 at the curve built without D): the kinds built
    # together share one curve per pool class, each equal to the kind built alone in a context where
    # every zone is a class of its own
    zones = [ZA, ZB, "us-central1-c"]
    job = JobSpec(model="opt-30b", global_batch_size=64, precision="fp16")
    cluster = ClusterSpec(zones={z: {"V100-16": 32} for z in zones}, gpus_per_node={"V100-16": 8},
                          zone_network={ZB: {"same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}}})
    ctx = make_context(job, cluster, calibration={})
    gpus, free = cluster.gpu_types(), {(z, g): n for z in zones for g, n in cluster.zones[z].items()}
    built = []
    for P, mbs in ((2, 1), (4, 2)):
        M = job.global_batch_size // mbs
        part = candidate_partitions(ctx, P, mbs, gpus)[0]
        for memory in memory_candidates(ctx, gpus, part, mbs, M, 3, 6):
            table = option_table(ctx, gpus, part, mbs, M, memory)
            kinds = homogeneous_kinds(ctx, table, free, part, mbs, memory)
            at_d = make_kinds(ctx, [k.spec for k in kinds], part, mbs, memory, 8)
            built += [(k, part, mbs, memory, r) for ks, r in ((kinds, None), (at_d, 8)) for k in ks]
    curves = [k for key, known in ctx.memo.items() if key[0] == "kind curves" for k in known]
    assert {max(m.zero for m in k.memory) for k, *_ in built} >= {1, 3}  # ZeRO-3: curves that depend on D
    assert {k.zones[0] for k, *_ in built} == set(zones)
    assert len(curves) < len(built)  # some kinds took the curve of an alike zone's
    monkeypatch.setattr(NetworkModel, "zone_class", lambda self, zone, gpu: (zone, gpu))  # every zone apart
    for kind, part, mbs, memory, replicas in built:  # each alone, in a context of its own
        alone = make_kinds(make_context(job, cluster, calibration={}), [kind.spec], part, mbs, memory, replicas)[0]
        assert dataclasses.astuple(alone) == dataclasses.astuple(kind)
    slow = [k for k, *_ in built if k.zones[0] == ZB]
    fast = {(k.options, k.cuts, k.replicas): k for k, *_ in built if k.zones[0] == ZA}
    assert any(fast[(k.options, k.cuts, k.replicas)].fill_s != k.fill_s
               for k in slow if any(k.cuts) or len(k.options) > 1)  # the slow zone's links: its own curves


def _ring_phase_every_edge(groups, nbytes, net, *, steps, fraction, efficiency, share=1) -> float:
    """A ring phase as first written: each edge kind's latency and stream looked up."""
    if nbytes <= 0:
        return 0.0
    latency, stream = 0.0, 0.0
    for za, ga, ta, zb, gb, tb, on_node in collectives._edge_kinds(groups):
        t = max(1, min(ta, tb))
        latency = max(latency, net.hop_latency_s(za, ga, zb, gb, flows=t * share, same_node=on_node))
        stream = max(stream, net.stream_time_s(za, ga, zb, gb, fraction * nbytes / t, flows=t * share,
                                               same_node=on_node))
    finest = max(1, min(m.tp for m, _ in groups))
    return steps * latency + stream / efficiency + net.collective.processing_s(fraction * nbytes / finest)


@dataclasses.dataclass(frozen=True)
class _RingEveryEdge:
    """`collectives.Ring` as first written: each phase looks up every edge kind's latency and stream
    (`_ring_phase_every_edge`)."""

    groups: list
    net: NetworkModel
    share: int = 1

    @classmethod
    def of(cls, groups, net, share: int = 1) -> "_RingEveryEdge":
        return cls(list(groups), net, share)

    def phase_s(self, nbytes, *, steps, fraction, efficiency) -> float:
        return _ring_phase_every_edge(self.groups, nbytes, self.net, steps=steps, fraction=fraction,
                                      efficiency=efficiency, share=self.share)

    allreduce_s = collectives.Ring.allreduce_s  # 2(D-1) steps of 2(D-1)/D, over `phase_s`


def test_a_ring_phase_from_its_memoised_links_equals_every_edge_looked_up():
    # random rings over four zones (one with links of its own), two GPU types, TP 1-4, named nodes
    # or none, the measured network of the reference data where it applies; several byte counts and
    # shares on each ring (the memo is per ring and share, the bytes vary)
    zones = [ZA, ZB, "us-west1-a", "europe-west4-a"]
    cluster = ClusterSpec(zones={z: {"A100-40": 32, "V100-16": 32} for z in zones},
                          gpus_per_node={"A100-40": 4, "V100-16": 8},
                          zone_network={ZB: {"same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}}})
    net = make_context(JobSpec(model="opt-350m", global_batch_size=64), cluster, calibration={}).network
    rng = random.Random(11)
    checked = set()
    for _ in range(300):
        members = [Member(zone=rng.choice(zones), gpu=rng.choice(["A100-40", "V100-16"]), tp=rng.choice([1, 2, 4]),
                          node=rng.choice([None, "n0", "n1", "n2"])) for _ in range(rng.randint(2, 12))]
        groups = group_members(members)
        for nbytes in (1.0, 3e6, 4e8):
            for share in (1, 2):
                args = dict(steps=rng.randint(1, 20), fraction=rng.choice([0.5, 1.5]), efficiency=0.8, share=share)
                share = args.pop("share")
                got = collectives.Ring.of(groups, net, share).phase_s(nbytes, **args)
                assert got == _ring_phase_every_edge(groups, nbytes, net, share=share, **args)
                checked.add(got)
    assert len(checked) > 500


def _apart_sorted(ctx, used, i: int) -> list:
    """Stage i of `score.apart_groups` as first written: every kind's groups sorted together."""
    parts = [[(ring_key(g), g) for g in group_members([pipe[i] for pipe in placed_alone(ctx, slots, n)])]
             for slots, n in used]
    return [g for _, g in sorted(itertools.chain.from_iterable(parts))]


def test_stage_groups_of_kinds_apart_are_all_of_them_sorted():
    # kinds in up to six pools of three zones (4- and 8-GPU nodes, TP 1-4, pipelines cut between
    # nodes or not), each stage's groups: joined where the kinds' ring keys do not overlap
    zones = [ZA, ZB, "us-west1-a"]
    cluster = ClusterSpec(zones={z: {"A100-40": 64, "V100-16": 64} for z in zones},
                          gpus_per_node={"A100-40": 8, "V100-16": 4})
    ctx = make_context(JobSpec(model="opt-350m", global_batch_size=64), cluster, calibration={})
    rng = random.Random(3)
    pools = [(z, g) for z in zones for g in ("A100-40", "V100-16")]
    for _ in range(200):
        P = rng.randint(1, 4)
        used = tuple((tuple(Slot(zone=z, gpu=g, tp=rng.choice([1, 2, 4]), node_cut=rng.random() < 0.3)
                            for _ in range(P)), rng.randint(1, 9))
                     for z, g in rng.sample(pools, rng.randint(1, len(pools))))
        assert score.apart_groups(ctx, used) == [_apart_sorted(ctx, used, i) for i in range(P)]


def _reference(monkeypatch) -> None:
    """Patch in the computations the shortcuts replace."""
    monkeypatch.setattr(engine, "_hopeless_alone", lambda *args: False)
    monkeypatch.setattr(NetworkModel, "zone_class", lambda self, zone, gpu: (zone, gpu))  # every zone apart
    every_key = prune.node_keys

    def keyed_first(ctx, opts, exact_mode):
        nodes = every_key(ctx, opts, exact_mode)
        for bound, P, mbs in nodes.bounds:
            nodes.key(bound, P, mbs)
        return nodes
    for module in (engine, paper):
        monkeypatch.setattr(module, "node_keys", keyed_first)
    for name in ("_uniform_estimate", "_node_group_estimate"):
        fast = getattr(prune, name)

        def every_sync(*args, _fast=fast):  # the callers pass the best so far last
            *rest, best = args
            return min(best, _fast(*rest, (math.inf, math.inf)))
        monkeypatch.setattr(prune, name, every_sync)
    monkeypatch.setattr(collectives, "Ring", _RingEveryEdge)
    for module in (score, prune):
        monkeypatch.setattr(module, "apart_groups",
                            lambda ctx, used: [_apart_sorted(ctx, used, i) for i in range(len(used[0][0]))])

    def every_row(self, caps, keep=None):  # caps (kinds,) or (T, kinds), as `PoolPacking.capacity` takes them
        rows = np.atleast_2d(caps)
        kept = np.ones(len(self.pools), dtype=bool) if keep is None else keep
        got = [int((np.maximum.reduceat(self.n_main * row[self.main] + self.n_second * row[self.second],
                                        self.starts) * kept).sum()) for row in rows]
        return got[0] if caps.ndim == 1 else np.array(got)
    monkeypatch.setattr(PoolPacking, "capacity", every_row)

    def pool_by_pool(self, caps, n_kinds, keep=None):  # `PoolPacking.counts`, one pool at a time
        vals = self.n_main * caps[self.main] + self.n_second * caps[self.second]
        out = np.zeros(n_kinds, dtype=np.int64)
        for j, (s, e) in enumerate(zip(self.starts, list(self.starts[1:]) + [len(vals)])):
            r = s + int(np.argmax(vals[s:e]))
            if vals[r] > 0 and (keep is None or keep[j]):
                out[self.main[r]] += self.n_main[r]
                out[self.second[r]] += self.n_second[r]
        return out
    monkeypatch.setattr(PoolPacking, "counts", pool_by_pool)
    monkeypatch.setattr(pack, "BATCH_LEVELS", ())  # the bisection one step at a time


def _result(job: JobSpec, cluster: ClusterSpec, opts: PlanOptions) -> tuple:
    r = plan_job(make_context(job, cluster, calibration={}), opts)
    return (plan_signature(r.plan), r.estimate.iteration_time_s, r.estimate.cost_per_iteration_usd,
            [plan_signature(c.plan) for c in r.alternatives], r.candidates, r.points, r.pareto)


CASES = {
    # pipelines cut between nodes over a slow link (node groups, cut kinds packed apart); and the
    # same for the cost objective
    "cut": (JobSpec(model=WIDE, global_batch_size=16, framework="megatron-lm"),
            ClusterSpec(zones={ZA: {"A100-40": 48}}, gpus_per_node={"A100-40": 8}, network=SLOW_NET),
            PlanOptions(max_stages=4, max_mbs=2)),
    # two GPU types in two zones, 4-GPU nodes
    "zones": (JobSpec(model="opt-350m", global_batch_size=64),
              ClusterSpec(zones={ZA: {"A100-40": 24, "V100-16": 16}, ZB: {"A100-40": 16}},
                          gpus_per_node={"A100-40": 4, "V100-16": 4}),
              PlanOptions(max_stages=4, max_mbs=4)),
    "cost": (JobSpec(model=WIDE, global_batch_size=16, framework="megatron-lm"),
             ClusterSpec(zones={ZA: {"A100-40": 48}}, gpus_per_node={"A100-40": 8}, network=SLOW_NET),
             PlanOptions(objective=Objective.COST, max_stages=4, max_mbs=2)),
    # a model that needs ZeRO on 16 GB GPUs (kinds whose constants depend on D)
    # four zones, three alike and one with links of its own, pipelines cut between nodes
    "alike-zones": (JobSpec(model=WIDE, global_batch_size=16, framework="megatron-lm"),
                    ClusterSpec(zones={z: {"A100-40": 16} for z in (ZA, ZB, "us-central1-c", "us-west1-a")},
                                gpus_per_node={"A100-40": 8}, network=SLOW_NET,
                                zone_network={ZB: {"same_zone": {"latency_s": 2e-5, "bandwidth_bytes_per_s": 2e10}}}),
                    PlanOptions(max_stages=4, max_mbs=2)),
    "zero": (JobSpec(model="gpt-neo-2.7b", global_batch_size=64, precision="fp32"),
             ClusterSpec(zones={ZA: {"V100-16": 48}}, gpus_per_node={"V100-16": 8}),
             PlanOptions(max_stages=4, max_mbs=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plans_are_those_of_the_reference_search(case, monkeypatch):
    job, cluster, opts = CASES[case]
    fast = _result(job, cluster, opts)
    _reference(monkeypatch)
    assert _result(job, cluster, opts) == fast


def test_a_collective_is_memoised_only_across_equally_placed_groups():
    # `terms.collective_s` memoised by `group_shape`: groups that differ only in their nodes' names
    # share a value, which is the collective computed afresh for each; other placements do not share
    job = JobSpec(model="opt-350m", global_batch_size=64)
    cluster = ClusterSpec(zones={ZA: {"A100-40": 16}, ZB: {"A100-40": 16, "V100-16": 8}},
                          gpus_per_node={"A100-40": 4, "V100-16": 4})
    calibration = {"V100-16": {"allreduce_efficiency": 0.7}}
    ctx = make_context(job, cluster, calibration=calibration)

    def groups(names: list[str | None], zones: list[str], gpu: str = "A100-40") -> list:
        return group_members([Member(zone=z, gpu=gpu, tp=2, node=n) for n, z in zip(names, zones)])

    def fresh(g: list, kind: Collective, nbytes: float) -> float:
        ring = allreduce_time_s(g, nbytes, ctx.network, efficiency=ctx.allreduce_efficiency([m for m, _ in g]))
        return RING_SHARE[kind] * ring + (ctx.network.collective.startup_s if ring > 0 else 0.0)

    cases = [
        (["a", "a", "b", "b"], [ZA] * 4, "A100-40"),        # two nodes of two replicas
        (["x", "x", "y", "y"], [ZA] * 4, "A100-40"),        # the same, other names
        (["a", "b", "c", "d"], [ZA] * 4, "A100-40"),        # four nodes
        ([None] * 4, [ZA] * 4, "A100-40"),                  # not placed
        (["a", "a", "b", "b"], [ZA, ZA, ZB, ZB], "A100-40"),  # across zones
        (["a", "a", "b", "b"], [ZB] * 4, "V100-16"),        # another GPU type, its efficiency
    ]
    seen = set()
    for kind in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER):
        for nbytes in (1.0, 4e8):
            for names, zones, gpu in cases:
                g = groups(names, zones, gpu)
                value = collective_s(ctx, g, kind, nbytes, 2)
                assert value == fresh(g, kind, nbytes)
                seen.add(value)
    assert len(seen) >= 2 * 2 * 4  # the differently placed groups do not share a value
    # the syncs' egress: each shape's ring edges (`collectives.RingEdges`, the first groups' of the
    # shape) priced for each stage's bytes, as for the groups alone in a context of their own; the
    # edges' totals are those of their crossings
    egress = set()
    for chunks in (((0, 5),), ((5, 12),)):
        for names, zones, gpu in cases:
            g = groups(names, zones, gpu)
            got = stage_sync(ctx, g, chunks)
            assert got == stage_sync(make_context(job, cluster, calibration=calibration), g, chunks)
            assert ring_egress(g, 4e8, ctx.network) == totals(ring_crossings(g, 4e8, ctx.network))
            egress.add(got[2])
    assert len(egress - {0.0}) == 2  # across zones, both stages' bytes


def test_alike_slots_leave_the_two_replica_syncs_as_every_slot_gives_them(monkeypatch):
    # four zones of one provider, one of them with a faster link of its own between nodes
    # (`zone_network`, so the bounds take its slots): its slots stay apart, the other zones' fold into one per (GPU type, TP); the sync floors and the
    # two-replica syncs are those over every slot
    zones = [ZA, ZB, "us-central1-c", "us-west1-a"]
    job = JobSpec(model="opt-350m", global_batch_size=64)
    cluster = ClusterSpec(zones={z: {"A100-40": 16, "V100-16": 8} for z in zones},
                          gpus_per_node={"A100-40": 4, "V100-16": 4},
                          zone_network={zones[2]: {"same_zone": {"latency_s": 1e-6, "bandwidth_bytes_per_s": 1e12}}})
    slots = [Slot(zone=z, gpu=g, tp=t) for z in zones for g in ("A100-40", "V100-16") for t in (1, 2, 4)]

    def syncs(ctx) -> list[float]:
        floors = [prune.sync_floor(ctx, P, pairs=False) for P in (1, 2, 5)]
        return floors + [prune.two_replica_sync(ctx, slots[k:], (2, 9), pairs=False) for k in (0, 12, 18)]

    ctx = make_context(job, cluster, calibration={"V100-16": {"allreduce_efficiency": 0.7}})
    kept = prune.alike_slots(ctx, slots)
    assert [s.zone for s in kept] == [ZA] * 6 + [zones[2]] * 6
    fast = syncs(ctx)
    assert all(x > 0 for x in fast)
    monkeypatch.setattr(NetworkModel, "zone_class", lambda self, zone, gpu: (zone, gpu))  # every zone apart
    assert syncs(make_context(job, cluster, calibration={"V100-16": {"allreduce_efficiency": 0.7}})) == fast


def test_a_hierarchical_allreduce_reduces_alike_zone_islands_once_with_the_same_time(monkeypatch):
    # islands in zones of one class (`NetworkModel.zone_class`) reduced once, against every island
    # reduced: four zones, one with a slower link of its own between nodes, mixed GPU types in one
    zones = [ZA, ZB, "us-central1-c", "us-west1-a"]
    cluster = ClusterSpec(zones={z: {"A100-40": 16, "V100-16": 8} for z in zones},
                          gpus_per_node={"A100-40": 4, "V100-16": 4},
                          zone_network={zones[1]: {"same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}}})
    ctx = make_context(JobSpec(model="opt-350m", global_batch_size=64), cluster, calibration={})
    members = [Member(zone=z, gpu="A100-40", tp=2, node=f"{z}/{k // 2}") for z in zones for k in range(4)]
    cases = [group_members(members), group_members(members[:12] + [Member(zone=zones[3], gpu="V100-16", tp=1)] * 3),
             group_members([Member(zone=z, gpu="V100-16", tp=1) for z in zones for _ in range(3)])]
    fast = [Hierarchy.of(g, ctx.network).allreduce_s(4e8, 1.0) for g in cases]
    monkeypatch.setattr(NetworkModel, "zone_class", lambda self, zone, gpu: (zone, gpu))
    assert [Hierarchy.of(g, ctx.network).allreduce_s(4e8, 1.0) for g in cases] == fast
    assert None not in fast and len(set(fast)) == 3
