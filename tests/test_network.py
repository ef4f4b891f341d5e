"""Network model: α–β links by class, overrides, measured curves (clamped), our link file, Sailor
importer, and collectives built from links."""

import json

import pytest

from sailor.catalog import Link, LinkClass
from sailor.errors import SailorInputError
from sailor.network import FIT_MAX_BYTES, FIT_MIN_BYTES, CurveFit, NetworkModel, network_for
from sailor.simulator.collectives import Member, allreduce_time_s, group_members, ring_egress
from sailor.specs import ClusterSpec

CLUSTER = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}},
                      network={"same_zone": {"latency_s": 0.5, "bandwidth_bytes_per_s": 1e6}})


def test_alpha_beta_by_class_with_cluster_override():
    net = network_for(CLUSTER)
    assert net.p2p_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 2e6) == pytest.approx(2.5)
    # catalog default for another class: same_region 0.5 ms + bytes / 1.5 GB/s
    assert net.p2p_time_s("us-central1-a", "A100-40", "us-central1-b", "A100-40", 3e9) == pytest.approx(2.0005)
    assert net.p2p_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 0) == 0.0


def test_class_links_win_over_the_cluster():
    net = NetworkModel(cluster=CLUSTER, class_links={LinkClass.SAME_ZONE: Link(0.0, 4e6)})
    assert net.p2p_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 2e6) == pytest.approx(0.5)


def test_flows_each_get_the_class_bandwidth_inter_node_and_share_it_inside_a_node():
    net = network_for(CLUSTER)
    # 4 flows of 1 MB between two nodes: α + 4 MB / (4 x 1 MB/s)
    assert net.transfer_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 1e6, flows=4) == pytest.approx(1.5)
    # inside a node one direction of the NVLink (600 GB/s both ways) at NCCL's 65 % is shared:
    # 5 µs + 4 x 6e8 / (3e11 x 0.65)
    t = net.transfer_time_s("z", "A100-40", "z", "A100-40", 6e8, flows=4, same_node=True)
    assert t == pytest.approx(5e-6 + 4 * 6e8 / (3e11 * 0.65))
    # a cluster spec may give the intra-node link (e.g. a DGX A100's NVLink) itself
    dgx = ClusterSpec(zones=CLUSTER.zones, network={"same_node": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 2e11}})
    assert network_for(dgx).transfer_time_s("z", "A100-40", "z", "A100-40", 2e9, same_node=True) == pytest.approx(1e-5 + 0.01)


def test_curve_fit_is_clamped_to_its_range_and_rejects_non_positive():
    fit = CurveFit(0.0, 1.0, 2.0, 0.0)  # GB/s = L + 2, L = log2(bytes / 1e6)
    assert fit.bandwidth(4e6) == pytest.approx(4e9)
    assert fit.bandwidth(1.0) == pytest.approx(fit.bandwidth(FIT_MIN_BYTES))
    assert fit.bandwidth(1e12) == pytest.approx(fit.bandwidth(FIT_MAX_BYTES))
    assert CurveFit(0.0, 1.0, 2.0, 3e9).bandwidth(4e6) == 3e9  # capped at the measured maximum
    assert CurveFit(0.0, 0.0, -1.0, 0.0).bandwidth(4e6) is None


def test_measured_fit_replaces_alpha_beta_and_falls_back_when_not_positive():
    net = network_for(CLUSTER)
    net.fits[("us-central1-a", "A100-40", "us-central1-a", "A100-40", 1)] = CurveFit(0.0, 1.0, 2.0, 0.0)
    assert net.p2p_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 4e6) == pytest.approx(4e6 / 4e9)
    net.fits[("us-central1-a", "A100-40", "us-central1-a", "A100-40", 1)] = CurveFit(0.0, 0.0, -1.0, 0.0)
    assert net.p2p_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 2e6) == pytest.approx(2.5)


def test_our_link_file(tmp_path):
    p = tmp_path / "net.json"
    p.write_text(json.dumps({"schema": "sailor.network/1",
                             "classes": {"same_region": {"latency_s": 0.1, "bandwidth_bytes_per_s": 1e6}},
                             "links": [{"src_zone": "us-central1-a", "src_gpu": "A100-40", "dst_zone": "us-central1-a",
                                        "dst_gpu": "A100-40", "flows": 1, "latency_s": 0.0,
                                        "bandwidth_bytes_per_s": 2e6}]}))
    net = network_for(CLUSTER, p)
    assert net.p2p_time_s("us-central1-a", "A100-40", "us-central1-b", "A100-40", 1e6) == pytest.approx(1.1)
    assert net.p2p_time_s("us-central1-a", "A100-40", "us-central1-a", "A100-40", 1e6) == pytest.approx(0.5)


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
])
def test_bad_link_file(tmp_path, data, match):
    p = tmp_path / "net.json"
    p.write_text(json.dumps({"schema": "sailor.network/1"} | data))
    with pytest.raises(SailorInputError, match=r"net\.json: " + match):
        network_for(CLUSTER, p)


def test_sailor_network_import(sailor_ref):
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}, "us-central1-b": {"A100-40": 8}})
    net = network_for(cluster, sailor_ref / "network")
    raw = json.loads((sailor_ref / "network" / "multizone_bandwidths_het.json").read_text())
    (c0, c1, c2), mx = raw["us-central1-a"]["A100-40"]["1"]["us-central1-b"]["A100-40"]["1"]
    fit = net.fits[("us-central1-a", "A100-40", "us-central1-b", "A100-40", 1)]
    assert (fit.c0, fit.c1, fit.c2, fit.max_bytes_per_s) == (c0, c1, c2, mx)
    assert net.intra_fits and net.source.startswith("sailor:")
    t = net.p2p_time_s("us-central1-a", "A100-40", "us-central1-b", "A100-40", 64e6)
    assert t == pytest.approx(64e6 / fit.bandwidth(64e6))


def test_ring_allreduce_by_hand():
    net = network_for(CLUSTER)
    a = Member("us-central1-a", "A100-40", 1)
    groups = group_members([a, a, a, a])
    # D = 4, 8 MB: 2(D-1) = 6 steps of α + (8 MB / 4) / β = 0.5 + 2 = 2.5 s
    assert allreduce_time_s(groups, 8e6, net) == pytest.approx(15.0)
    assert allreduce_time_s(group_members([a]), 8e6, net) == 0.0
    # TP 2 members: each step moves 2 MB over 2 flows, each at the class bandwidth: 0.5 + 1 s
    b = Member("us-central1-a", "A100-40", 2)
    assert allreduce_time_s(group_members([b] * 4), 8e6, net) == pytest.approx(6 * 1.5)


def test_hierarchical_allreduce_and_egress_across_zones():
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}, "us-central1-b": {"A100-40": 8}},
                          network={"same_zone": {"latency_s": 0.0, "bandwidth_bytes_per_s": 1e6},
                                   "same_region": {"latency_s": 0.0, "bandwidth_bytes_per_s": 1e5}})
    net = network_for(cluster)
    a, b = Member("us-central1-a", "A100-40", 1), Member("us-central1-b", "A100-40", 1)
    groups = group_members([a, a, b, b])
    # flat: 6 steps, slowest edge crosses zones: 1 MB / 4 / 1e5 = 2.5 s -> 15 s
    # hierarchical: intra 2(2-1) x (1 MB / 2 / 1e6 = 0.5) = 1 s; cross 2(2-1) x (1 MB / 2 / 2 / 1e5 = 2.5) = 5 s
    assert allreduce_time_s(groups, 1e6, net) == pytest.approx(6.0)
    moved, usd = ring_egress(groups, 1e6, net)
    # two ring edges cross zones, each carrying 2(D-1)/D x 1 MB = 1.5 MB; $0.01 per GB
    assert moved == pytest.approx(3e6)
    assert usd == pytest.approx(3e6 / 1e9 * 0.01)
