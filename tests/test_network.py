"""Network model: links by class (shared NIC, per-flow cap), overrides per class and zone, measured
curves (clamped, flow counts), our link file, the Sailor importer; collectives built from links
(ring and hierarchical, latency per hop, algorithm pin) and placement (intra- vs inter-node)."""

import json

import pytest

from sailor.catalog import Link, LinkClass
from sailor.core.errors import SailorInputError
from sailor.perf.network import FIT_MAX_BYTES, FIT_MIN_BYTES, CurveFit, NetworkModel
from sailor.perf.network_files import network_for
from sailor.plan.spec import Plan
from sailor.simulator import make_context, simulate
from sailor.simulator.collectives import Member, allreduce_time_s, group_members, ring_crossings, ring_egress
from sailor.specs.cluster import AllreduceAlgorithm, ClusterSpec
from sailor.specs.job import JobSpec

ZA, ZB = "us-central1-a", "us-central1-b"
CLUSTER = ClusterSpec(zones={ZA: {"A100-40": 8}},
                      network={"same_zone": {"latency_s": 0.5, "bandwidth_bytes_per_s": 1e6}})


def test_alpha_beta_by_class_with_cluster_override():
    net = network_for(CLUSTER)
    assert net.p2p_time_s(ZA, "A100-40", ZA, "A100-40", 2e6) == pytest.approx(2.5)
    # catalog default for another class: same_region 0.15 ms + bytes / one flow's 1.3 GB/s
    assert net.p2p_time_s(ZA, "A100-40", ZB, "A100-40", 3e9) == pytest.approx(0.15e-3 + 3e9 / 1.3e9)
    assert net.p2p_time_s(ZA, "A100-40", ZA, "A100-40", 0) == 0.0


def test_class_links_win_over_the_cluster():
    net = NetworkModel(cluster=CLUSTER, class_links={LinkClass.SAME_ZONE: Link(0.0, 4e6)})
    assert net.p2p_time_s(ZA, "A100-40", ZA, "A100-40", 2e6) == pytest.approx(0.5)


def test_concurrent_flows_share_the_nic_of_a_default_link():
    # a link whose NIC one flow can fill: 8 flows of x take 8x the time of one flow of x
    cluster = ClusterSpec(zones={ZA: {"A100-40": 8}}, network={"same_zone": {"latency_s": 0.0, "bandwidth_bytes_per_s": 1e9}})
    net = network_for(cluster)
    one = net.transfer_time_s(ZA, "A100-40", ZA, "A100-40", 1e8, flows=1)
    assert one == pytest.approx(0.1)
    assert net.transfer_time_s(ZA, "A100-40", ZA, "A100-40", 1e8, flows=8) == pytest.approx(8 * one)
    # the catalog's same-zone link: one flow reaches 1.3 GB/s, the NIC 5.0 GB/s for all flows
    net = network_for(ClusterSpec(zones={ZA: {"A100-40": 8}}))
    assert net.transfer_time_s(ZA, "A100-40", ZA, "A100-40", 1e8) == pytest.approx(0.15e-3 + 1e8 / 1.3e9)
    assert net.transfer_time_s(ZA, "A100-40", ZA, "A100-40", 1e8, flows=2) == pytest.approx(0.15e-3 + 2e8 / 2.6e9)
    assert net.transfer_time_s(ZA, "A100-40", ZA, "A100-40", 1e8, flows=8) == pytest.approx(0.15e-3 + 8e8 / 5.0e9)
    # inside a node one direction of the NVLink (600 GB/s both ways) at NCCL's 65 % is shared:
    # 5 µs + 4 x 6e8 / (3e11 x 0.65)
    t = net.transfer_time_s(ZA, "A100-40", ZA, "A100-40", 6e8, flows=4, same_node=True)
    assert t == pytest.approx(5e-6 + 4 * 6e8 / (3e11 * 0.65))
    # a cluster spec may give the intra-node link (e.g. a DGX A100's NVLink) itself
    dgx = ClusterSpec(zones=CLUSTER.zones, network={"same_node": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 2e11}})
    assert network_for(dgx).transfer_time_s(ZA, "A100-40", ZA, "A100-40", 2e9, same_node=True) == pytest.approx(1e-5 + 0.01)
    # and one NIC per GPU between nodes: eight adapters of 21 GB/s, each flow on its own
    ib = ClusterSpec(zones=CLUSTER.zones, network={"same_zone": {"latency_s": 0.0, "bandwidth_bytes_per_s": 8 * 21e9,
                                                                 "flow_bandwidth_bytes_per_s": 21e9}})
    assert network_for(ib).transfer_time_s(ZA, "A100-40", ZA, "A100-40", 21e9, flows=8) == pytest.approx(1.0)
    assert network_for(ib).transfer_time_s(ZA, "A100-40", ZA, "A100-40", 21e9, flows=1) == pytest.approx(1.0)


def test_zone_links_describe_a_fast_node_and_a_slow_network():
    cluster = ClusterSpec(zones={ZA: {"A100-40": 8}, ZB: {"A100-40": 8}},
                          zone_network={ZA: {"same_node": {"latency_s": 1e-6, "bandwidth_bytes_per_s": 1e11},
                                             "same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}}})
    net = network_for(cluster)
    assert net.p2p_time_s(ZA, "A100-40", ZA, "A100-40", 1e9, same_node=True) == pytest.approx(1e-6 + 0.01)
    assert net.p2p_time_s(ZA, "A100-40", ZA, "A100-40", 1e9) == pytest.approx(1e-3 + 1.0)
    # zone B sets nothing: catalog links (NVLink inside a node, the same-zone default between nodes)
    assert net.p2p_time_s(ZB, "A100-40", ZB, "A100-40", 1e9, same_node=True) == pytest.approx(5e-6 + 1e9 / (3e11 * 0.65))
    assert net.p2p_time_s(ZB, "A100-40", ZB, "A100-40", 1e9) == pytest.approx(0.15e-3 + 1e9 / 1.3e9)


@pytest.mark.parametrize("zone_network, match", [
    ({"us-central1-z": {"same_node": {"latency_s": 0, "bandwidth_bytes_per_s": 1}}}, r"zone_network\.us-central1-z"),
    ({ZA: {"same_region": {"latency_s": 0, "bandwidth_bytes_per_s": 1}}}, r"zone_network\.us-central1-a\.same_region"),
])
def test_bad_zone_links(zone_network, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(zones={ZA: {"A100-40": 8}}, zone_network=zone_network)


def test_curve_fit_is_clamped_to_its_range_and_rejects_non_positive():
    fit = CurveFit(0.0, 1.0, 2.0, 0.0)  # GB/s = L + 2, L = log2(bytes / 1e6)
    assert fit.bandwidth(4e6) == pytest.approx(4e9)
    assert fit.bandwidth(1.0) == pytest.approx(fit.bandwidth(FIT_MIN_BYTES))
    assert fit.bandwidth(1e12) == pytest.approx(fit.bandwidth(FIT_MAX_BYTES))
    assert CurveFit(0.0, 1.0, 2.0, 3e9).bandwidth(4e6) == 3e9  # capped at the measured maximum
    assert CurveFit(0.0, 0.0, -1.0, 0.0).bandwidth(4e6) is None


def test_measured_fit_replaces_alpha_beta_and_falls_back_when_not_positive():
    net = network_for(CLUSTER)
    net.fits[(ZA, "A100-40", ZA, "A100-40", 1)] = CurveFit(0.0, 1.0, 2.0, 0.0)
    assert net.p2p_time_s(ZA, "A100-40", ZA, "A100-40", 4e6) == pytest.approx(4e6 / 4e9)
    net = network_for(CLUSTER)
    net.fits[(ZA, "A100-40", ZA, "A100-40", 1)] = CurveFit(0.0, 0.0, -1.0, 0.0)
    assert net.p2p_time_s(ZA, "A100-40", ZA, "A100-40", 2e6) == pytest.approx(2.5)


def test_unmeasured_flow_counts_scale_down_per_flow_and_share_the_nic_up():
    net = network_for(CLUSTER)
    net.fits[(ZA, "A100-40", ZA, "A100-40", 2)] = CurveFit(0.0, 0.0, 4.0, 0.0)  # 2 flows: 4 GB/s together
    # 1 flow: the measured per-flow 2 GB/s; 8 flows: the 4 GB/s the NIC gave 2
    assert net.transfer_time_s(ZA, "A100-40", ZA, "A100-40", 4e6, flows=1) == pytest.approx(4e6 / 2e9)
    assert net.transfer_time_s(ZA, "A100-40", ZA, "A100-40", 4e6, flows=8) == pytest.approx(8 * 4e6 / 4e9)


def test_our_link_file(tmp_path):
    p = tmp_path / "net.json"
    p.write_text(json.dumps({"schema": "sailor.network/1",
                             "classes": {"same_region": {"latency_s": 0.1, "bandwidth_bytes_per_s": 1e6}},
                             "links": [{"src_zone": ZA, "src_gpu": "A100-40", "dst_zone": ZA,
                                        "dst_gpu": "A100-40", "flows": 1, "latency_s": 0.0,
                                        "bandwidth_bytes_per_s": 2e6},
                                       {"src_zone": ZA, "src_gpu": "A100-40", "dst_zone": ZA,
                                        "dst_gpu": "A100-40", "flows": 1, "latency_s": 0.0,
                                        "bandwidth_bytes_per_s": 8e6, "same_node": True}]}))
    net = network_for(CLUSTER, p)
    assert net.p2p_time_s(ZA, "A100-40", ZB, "A100-40", 1e6) == pytest.approx(1.1)
    assert net.p2p_time_s(ZA, "A100-40", ZA, "A100-40", 1e6) == pytest.approx(0.5)
    assert net.p2p_time_s(ZA, "A100-40", ZA, "A100-40", 1e6, same_node=True) == pytest.approx(0.125)


@pytest.mark.parametrize("data, match", [
    ({"classes": {"same_zone": {"latency_s": 0.1}}}, r"classes\.same_zone\.bandwidth_bytes_per_s: missing field"),
    ({"classes": {"same_zone": {"latency_s": 0.1, "bandwidth_bytes_per_s": 0}}}, r"classes\.same_zone\.bandwidth_bytes_per_s: must be >= 1, got 0"),
    ({"classes": {"same_zone": {"latency_s": -1, "bandwidth_bytes_per_s": 1}}}, r"classes\.same_zone\.latency_s: must be >= 0, got -1"),
    ({"classes": {"nearby": {"latency_s": 0, "bandwidth_bytes_per_s": 1}}}, r"classes\.nearby: unknown link class 'nearby' \(one of same_node"),
    ({"classes": [1]}, r"classes: expected a mapping"),
    ({"links": [{"src_zone": "a"}]}, r"links\.0\.src_gpu: missing field"),
    ({"links": [{"src_zone": "a", "src_gpu": "K80", "dst_zone": "a", "dst_gpu": "T4", "latency_s": 0,
                 "bandwidth_bytes_per_s": 1}]}, r"links\.0\.src_gpu: unknown GPU type 'K80'"),
    ({"links": [{"src_zone": "a", "src_gpu": "T4", "dst_zone": "a", "dst_gpu": "T4", "latency_s": 0,
                 "bandwidth_bytes_per_s": -1}]}, r"links\.0\.bandwidth_bytes_per_s: must be >= 1, got -1"),
    ({"links": [{"src_zone": "a", "src_gpu": "T4", "dst_zone": "a", "dst_gpu": "T4", "latency_s": 0,
                 "bandwidth_bytes_per_s": 1, "same_node": "yes"}]}, r"links\.0\.same_node: must be true or false"),
])
def test_bad_link_file(tmp_path, data, match):
    p = tmp_path / "net.json"
    p.write_text(json.dumps({"schema": "sailor.network/1"} | data))
    with pytest.raises(SailorInputError, match=r"net\.json: " + match):
        network_for(CLUSTER, p)


def test_sailor_network_import(sailor_ref):
    cluster = ClusterSpec(zones={ZA: {"A100-40": 8}, ZB: {"A100-40": 8}})
    net = network_for(cluster, sailor_ref / "network")
    raw = json.loads((sailor_ref / "network" / "multizone_bandwidths_het.json").read_text())
    (c0, c1, c2), mx = raw[ZA]["A100-40"]["1"][ZB]["A100-40"]["1"]
    fit = net.fits[(ZA, "A100-40", ZB, "A100-40", 1)]
    assert (fit.c0, fit.c1, fit.c2, fit.max_bytes_per_s) == (c0, c1, c2, mx)
    assert net.intra_fits and net.source.startswith("sailor:")
    t = net.p2p_time_s(ZA, "A100-40", ZB, "A100-40", 64e6)
    assert t == pytest.approx(64e6 / fit.bandwidth(64e6))


def test_unmeasured_zone_is_consistent_with_the_measured_links_of_its_class(sailor_ref):
    # us-east1 has no measurement. Its default link must not beat the measured V100 links (the
    # slower GPU type's) with the 1 and 4 flows of TP 1 and TP 4 replicas, or the planner drifts to
    # zones nobody measured; with 2 flows it lies between V100 and A100 (the V100 2-flow curve,
    # 1.9 GB/s, is barely above its 1-flow one, which no shared-NIC link follows).
    cluster = ClusterSpec(zones={ZA: {"V100-16": 8, "A100-40": 8}, "us-east1-b": {"V100-16": 8}})
    net = network_for(cluster, sailor_ref / "network")
    for nbytes in (64e6, 256e6, 1e9):
        def t(zone, gpu, flows):
            return net.transfer_time_s(zone, gpu, zone, gpu, nbytes, flows=flows)
        for flows in (1, 4):
            assert t("us-east1-b", "V100-16", flows) >= 0.95 * t(ZA, "V100-16", flows), (flows, nbytes)
            assert t("us-east1-b", "V100-16", flows) <= 2.0 * t(ZA, "A100-40", flows), (flows, nbytes)
        assert t(ZA, "A100-40", 2) <= t("us-east1-b", "V100-16", 2) <= t(ZA, "V100-16", 2), nbytes


def test_ring_allreduce_by_hand():
    net = network_for(CLUSTER)
    a = Member(ZA, "A100-40", 1)
    groups = group_members([a, a, a, a])
    # D = 4, 8 MB: 2(D-1) = 6 hops of α = 0.5 s, and 2(D-1)/D x 8 MB = 12 MB streamed at 1 MB/s
    assert allreduce_time_s(groups, 8e6, net) == pytest.approx(3.0 + 12.0)
    assert allreduce_time_s(group_members([a]), 8e6, net) == 0.0
    # TP 2 members: two rings at once, 6 MB each, through one NIC of 1 MB/s: the same 12 s
    b = Member(ZA, "A100-40", 2)
    assert allreduce_time_s(group_members([b] * 4), 8e6, net) == pytest.approx(3.0 + 12.0)
    # an all-reduce efficiency of 0.5 doubles the streaming only
    assert allreduce_time_s(groups, 8e6, net, efficiency=0.5) == pytest.approx(3.0 + 24.0)


def test_latency_of_a_32_gpu_ring_at_500_us_against_20_us_per_hop():
    # 32 one-GPU replicas, 24 MB: streaming 2·31/32 x 24 MB at 1.5 GB/s = 31 ms; 62 hops of α
    def ring(latency_s):
        cluster = ClusterSpec(zones={ZA: {"A100-40": 32}},
                              network={"same_zone": {"latency_s": latency_s, "bandwidth_bytes_per_s": 1.5e9}})
        return allreduce_time_s(group_members([Member(ZA, "A100-40", 1)] * 32), 24e6, network_for(cluster))
    assert ring(20e-6) == pytest.approx(62 * 20e-6 + 0.031)   # 32.2 ms
    assert ring(500e-6) == pytest.approx(62 * 500e-6 + 0.031)  # 62 ms: half the bandwidth
    assert ring(20e-6) / ring(500e-6) == pytest.approx(0.52, abs=1e-3)


def test_hierarchical_allreduce_and_egress_across_zones():
    cluster = ClusterSpec(zones={ZA: {"A100-40": 8}, ZB: {"A100-40": 8}},
                          network={"same_zone": {"latency_s": 0.0, "bandwidth_bytes_per_s": 1e6},
                                   "same_region": {"latency_s": 0.0, "bandwidth_bytes_per_s": 1e5}})
    net = network_for(cluster)
    a, b = Member(ZA, "A100-40", 1), Member(ZB, "A100-40", 1)
    groups = group_members([a, a, b, b])
    # ring: the slowest edge crosses zones: 2·3/4 x 1 MB / 1e5 = 15 s
    # hierarchical: reduce-scatter in each zone 1/2 x 1 MB / 1e6 = 0.5 s, all-gather the same;
    # across zones 2·1/2 x (1 MB / 2) / 1e5 = 5 s -> 6 s, the cheaper
    assert allreduce_time_s(groups, 1e6, net) == pytest.approx(6.0)
    assert allreduce_time_s(groups, 1e6, net, algorithm=AllreduceAlgorithm.RING) == pytest.approx(15.0)
    pinned = network_for(cluster.model_copy(update={"allreduce": AllreduceAlgorithm.RING}))
    assert allreduce_time_s(groups, 1e6, pinned) == pytest.approx(15.0)
    moved, usd = ring_egress(groups, 1e6, net)
    # two ring edges cross zones, each carrying 2(D-1)/D x 1 MB = 1.5 MB; $0.01 per GB
    assert moved == pytest.approx(3e6)
    assert usd == pytest.approx(3e6 / 1e9 * 0.01)
    # one crossing per edge, named by its zones in either direction
    assert [(c.zones, c.moved_bytes) for c in ring_crossings(groups, 1e6, net)] == [((ZA, ZB), 1.5e6)] * 2


def test_hierarchical_allreduce_across_nodes_moves_every_shard_through_the_nic():
    # two nodes of four TP-1 replicas: each member ends the intra-node reduce-scatter with its own
    # quarter shard, and all four quarters cross to the other node at once, four rings sharing the
    # node's NIC: the NIC carries 4 x 2·1/2 x S/4 = S, not S/4
    cluster = ClusterSpec(zones={ZA: {"A100-40": 8}}, gpus_per_node={"A100-40": 4},
                          network={"same_node": {"latency_s": 0.0, "bandwidth_bytes_per_s": 4e6},
                                   "same_zone": {"latency_s": 0.0, "bandwidth_bytes_per_s": 4e5,
                                                 "flow_bandwidth_bytes_per_s": 1e5}})
    net = network_for(cluster)
    n0, n1 = Member(ZA, "A100-40", 1, node="n0"), Member(ZA, "A100-40", 1, node="n1")
    groups = group_members([n0] * 4 + [n1] * 4)
    # reduce-scatter 3/4 x 1 MB / 4e6 = 0.1875 s, all-gather the same; across the nodes 1 MB / 4e5 = 2.5 s
    assert allreduce_time_s(groups, 1e6, net, algorithm=AllreduceAlgorithm.HIERARCHICAL) == \
        pytest.approx(2 * 0.1875 + 2.5)
    # two TP-2 replicas per node: each of a node's four GPUs holds S/4 after the reduce-scatter
    # (2 flows of 1/2 x S/2 on NVLink: 0.125 s), and the NIC again carries 4 x 2·1/2 x S/4 = S
    m0, m1 = Member(ZA, "A100-40", 2, node="n0"), Member(ZA, "A100-40", 2, node="n1")
    assert allreduce_time_s(group_members([m0] * 2 + [m1] * 2), 1e6, net, algorithm=AllreduceAlgorithm.HIERARCHICAL) == \
        pytest.approx(2 * 0.125 + 2.5)


def test_ring_is_chosen_when_cheaper_than_hierarchical():
    # one zone, every replica on its own node: a single island, so the ring (no hierarchy)
    net = network_for(CLUSTER)
    a = Member(ZA, "A100-40", 1)
    assert allreduce_time_s(group_members([a] * 4), 8e6, net, algorithm=AllreduceAlgorithm.HIERARCHICAL) == \
        pytest.approx(15.0)
    # two zones joined by a link as fast as the zones' own: the ring's 6 hops beat 2 + 2 + 2
    cluster = ClusterSpec(zones={ZA: {"A100-40": 8}, ZB: {"A100-40": 8}},
                          network={"same_zone": {"latency_s": 1.0, "bandwidth_bytes_per_s": 1e12},
                                   "same_region": {"latency_s": 1.0, "bandwidth_bytes_per_s": 1e12}})
    net = network_for(cluster)
    groups = group_members([Member(ZA, "A100-40", 1)] * 3 + [Member(ZB, "A100-40", 1)] * 3)
    ring = allreduce_time_s(groups, 1e6, net, algorithm=AllreduceAlgorithm.RING)
    hier = allreduce_time_s(groups, 1e6, net, algorithm=AllreduceAlgorithm.HIERARCHICAL)
    assert ring == pytest.approx(10.0, rel=1e-3) and hier == pytest.approx(2 * 2 + 2, rel=1e-3)
    assert allreduce_time_s(groups, 1e6, net) == pytest.approx(min(ring, hier))


# ---- placement: links follow rank_layout --------------------------------------------------------
PLACE_JOB = JobSpec(model="tiny", global_batch_size=4)
# inside a node 1 GB/s and 1 ms; between nodes 1 MB/s and 0.1 s: every transfer shows which it took
PLACE_NET = {"same_node": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9},
             "same_zone": {"latency_s": 0.1, "bandwidth_bytes_per_s": 1e6}}


def _placed(gpus_per_node: int) -> tuple[object, Plan]:
    cluster = ClusterSpec(zones={ZA: {"A100-40": 4}}, gpus_per_node={"A100-40": gpus_per_node}, network=PLACE_NET)
    plan = Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 3], [3, 6]], "pipelines": [
        {"microbatches": 2, "replicas": [{"stage": i, "gpu": "A100-40", "zone": ZA, "tp": 1} for i in range(2)]}
        for _ in range(2)]})
    return simulate(plan, make_context(PLACE_JOB, cluster, calibration={})), plan


def test_placement_intra_node_against_inter_node():
    # the tiny model's activation: mbs 1 x seq 64 x h 64 x 4 B = 16384 B
    act = 64 * 64 * 4
    shared, _ = _placed(gpus_per_node=4)   # all four replicas on one node
    apart, _ = _placed(gpus_per_node=1)    # every replica on its own node
    p2p_shared = [r.p2p_s for r in shared.replicas if r.stage == 0]
    p2p_apart = [r.p2p_s for r in apart.replicas if r.stage == 0]
    assert p2p_shared == pytest.approx([1e-3 + act / 1e9] * 2)
    assert p2p_apart == pytest.approx([0.1 + act / 1e6] * 2)
    # stage 0's gradient sync between the two pipelines: one flow, 2 members: 2 hops, 1 x grad
    from sailor.simulator import SimContext  # noqa: F401  (the context computes the stage's params)
    ctx = make_context(PLACE_JOB, ClusterSpec(zones={ZA: {"A100-40": 4}}), calibration={})
    grad = ctx.stage_params(1, 0, 3) * 4
    sync_shared = [r.sync_s for r in shared.replicas if r.stage == 0 and r.pipeline == 0][0]
    sync_apart = [r.sync_s for r in apart.replicas if r.stage == 0 and r.pipeline == 0][0]
    tied = PLACE_JOB.model.tied_embeddings  # the first and last stage also sum the tied token matrix's
    emb = PLACE_JOB.model.vocab_size * PLACE_JOB.model.hidden_size * 4 if tied else 0.0  # copies (no position table)
    # pipeline j's two stages sit on one node with 4 GPUs per node; so do both pipelines. One
    # all-reduce per layer bucket (3 of them, 2 hops each), overlapping the stage's backward (at most
    # all of it hidden: the bounds below)
    backward = ctx.stage_compute_s("A100-40", 1, 1, 0, 3)[1]
    for sync, (alpha, beta) in ((sync_shared, (1e-3, 1e9)), (sync_apart, (0.1, 1e6))):
        whole = 3 * 2 * alpha + grad / beta + (2 * alpha + emb / beta if tied else 0.0)
        assert whole - backward - 1e-6 <= sync <= whole + 1e-6  # + 1 byte's time per bucket


def test_planner_scores_the_sync_of_the_placement_it_builds():
    # one stage, TP 1 on 4-GPU nodes: the planner's closed form must see the co-located replicas'
    # intra-node (hierarchical) all-reduce that the simulation of its plan sees
    from sailor.planner import PlanOptions, plan_job
    cluster = ClusterSpec(zones={ZA: {"A100-40": 8}}, gpus_per_node={"A100-40": 4},
                          network={"same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e8}})
    ctx = make_context(JobSpec(model="opt-350m", global_batch_size=16), cluster, calibration={})
    res = plan_job(ctx, PlanOptions(max_stages=1, top_k=3))
    for choice in [res.best_closed] + res.alternatives:
        plan = choice.plan
        closed = simulate(plan, ctx, event=False)
        assert closed.iteration_time_s == pytest.approx(choice.closed_time_s, rel=1e-9)
    # 8 TP-1 replicas on two nodes: reduce-scatter in each node (NVLink, negligible here), all-reduce
    # of the four quarter shards across the two nodes, all-gather: the shared NIC carries
    # 4 x 2·1/2 x S/4 = S, where the flat ring over 8 nodes streams 2·7/8 x S over every NIC
    from sailor.plan.spec import DEFAULT_STAGE_MEMORY
    from sailor.planner.kinds import make_kind
    from sailor.planner.score import Scorer
    from sailor.planner.space import Option
    dp8 = Plan.model_validate({"micro_batch_size": 2, "stages": [[0, 26]], "pipelines": [
        {"microbatches": 1, "replicas": [{"stage": 0, "gpu": "A100-40", "zone": ZA, "tp": 1}]}] * 8})
    # (DeepSpeed's one all-reduce of the stage after the backward, so the bytes alone set the ratio)
    ds = JobSpec(model="opt-350m", global_batch_size=16, framework="deepspeed")
    together = make_context(ds, cluster, calibration={})
    apart = make_context(ds, cluster.model_copy(update={"gpus_per_node": {"A100-40": 1}}), calibration={})
    assert simulate(dp8, together).gradient_sync_s == pytest.approx(simulate(dp8, apart).gradient_sync_s / 1.75, rel=0.01)
    for c in (together, ctx):
        kind = make_kind(c, (ZA,), (Option(gpu="A100-40", tp=1, forward_s=0.0, backward_s=0.0),), ((0, 26),), 2,
                         (DEFAULT_STAGE_MEMORY,))
        assert Scorer(c, ((0, 26),), 2, [kind], 8).sync((8,))[0] == pytest.approx(simulate(dp8, c).gradient_sync_s)
