"""The backend's cost of a collective beyond its ring (`perf.network.CollectiveCost`): hand-computed
all-reduce, reduce-scatter and TP collective times with a start-up and a processing rate, the
defaults (NCCL) unchanged, the fit of `sailor profile network` on synthetic sweeps, and the link
file's `collective` entry read back (bad values refused with exit 2 and one line)."""

import json

import numpy as np
import pytest
from test_cli_bad_input import _base, _main, _refused, _write

from sailor.core.errors import SailorInputError
from sailor.model.spec import Collective
from sailor.perf.network import CollectiveCost
from sailor.perf.network_files import network_for, network_from_ours
from sailor.runtime.netprofile import (
    collective_of_pairs,
    fit_collective,
    pair_members,
    simulated_ring_s,
)
from sailor.simulator import make_context
from sailor.simulator.collectives import Member, group_members, tp_collective_time_s
from sailor.simulator.sync import exposed_sync_s, stage_sync
from sailor.simulator.terms import collective_s
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZA = "us-central1-a"
# one zone, a 0.1 ms / 100 MB/s link between nodes and a 0.05 ms / 200 MB/s one inside a node
CLUSTER = ClusterSpec(zones={ZA: {"A100-40": 8}}, allreduce="ring",
                      network={"same_zone": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e8},
                               "same_node": {"latency_s": 5e-5, "bandwidth_bytes_per_s": 2e8}})
GLOO = CollectiveCost(startup_s=2e-3, processing_bytes_per_s=1e8, backend="gloo")


def _context(cost: CollectiveCost | None):
    ctx = make_context(JobSpec(model="tiny", global_batch_size=8), CLUSTER)
    if cost is not None:
        ctx.network.collective = cost
    return ctx


def _members(d: int) -> list:
    return group_members([Member(zone=ZA, gpu="A100-40", tp=1, node=f"n{k}") for k in range(d)])


def test_an_all_reduce_pays_the_start_up_once_and_its_bytes_at_the_processing_rate():
    # D = 2, S = 1 MB: ring 2 steps x 0.1 ms + 2(D-1)/D x 1e6 / 1e8 = 0.2 ms + 10 ms; each flow
    # processes the same 1e6 bytes at 1e8 B/s (10 ms); the call starts in 2 ms
    ctx = _context(GLOO)
    assert collective_s(ctx, _members(2), Collective.ALL_REDUCE, 1e6, 1) == pytest.approx(2e-3 + 2e-4 + 1e-2 + 1e-2)
    # a reduce-scatter: half the steps and bytes, the whole start-up
    assert collective_s(ctx, _members(2), Collective.REDUCE_SCATTER, 1e6, 1) == pytest.approx(2e-3 + 1e-4 + 1e-2)
    # D = 4: 6 steps, each flow moves and processes 2 x 3/4 x 1e6 = 1.5e6 bytes
    assert collective_s(ctx, _members(4), Collective.ALL_REDUCE, 1e6, 1) == pytest.approx(
        2e-3 + 6e-4 + 1.5e-2 + 1.5e-2)
    # a single member runs no collective and starts none
    assert collective_s(ctx, _members(1), Collective.ALL_REDUCE, 1e6, 1) == 0.0


def test_tp_shards_process_their_own_bytes():
    # two TP 2 replicas on two nodes: 2 flows per ring edge, each with 1e6 / 2 bytes; the NIC
    # (1e8 B/s, shared) moves both flows' 2 x 0.5e6 in 10 ms, each flow's process sums its 0.5e6
    # in 5 ms
    ctx = _context(GLOO)
    groups = group_members([Member(zone=ZA, gpu="A100-40", tp=2, node=f"n{k}") for k in range(2)])
    assert collective_s(ctx, groups, Collective.ALL_REDUCE, 1e6, 2) == pytest.approx(2e-3 + 2e-4 + 1e-2 + 5e-3)


def test_a_tp_collective_pays_the_start_up_and_its_ring_steps_bytes():
    # TP 2, a 32 KiB activation: 2 steps of 16 KiB over the node's link (50 µs + 16384 / 2e8 each),
    # the call's 2 ms, and 2 x 16384 bytes processed at 1e8 B/s
    net = _context(GLOO).network
    step = 5e-5 + 16384 / 2e8
    assert tp_collective_time_s(net, ZA, "A100-40", 2, Collective.ALL_REDUCE, 32768) == pytest.approx(
        2e-3 + 2 * step + 2 * 16384 / 1e8)
    # an all-gather: one step; TP 1: nothing
    assert tp_collective_time_s(net, ZA, "A100-40", 2, Collective.ALL_GATHER, 32768) == pytest.approx(
        2e-3 + step + 16384 / 1e8)
    assert tp_collective_time_s(net, ZA, "A100-40", 1, Collective.ALL_REDUCE, 32768) == 0.0


def test_without_a_measured_cost_the_ring_is_charged_as_before():
    # the default (NCCL) adds nothing: the ring's steps and bytes alone
    ctx = _context(None)
    assert ctx.network.collective == CollectiveCost()
    assert collective_s(ctx, _members(2), Collective.ALL_REDUCE, 1e6, 1) == pytest.approx(2e-4 + 1e-2)
    assert tp_collective_time_s(ctx.network, ZA, "A100-40", 2, Collective.ALL_REDUCE, 32768) == pytest.approx(
        2 * (5e-5 + 16384 / 2e8))


def test_each_layer_bucket_of_an_overlapped_sync_pays_a_start_up():
    # Sailor's runtime all-reduces one bucket per layer: the exposed sync with a start-up per call
    # is at least the start-up more than without (the last bucket's call runs after the backward)
    # and at most one start-up per layer more
    layers = _context(None).job.model.num_layers
    plain, started, gloo = (stage_sync(_context(cost), _members(2), [(0, layers)], mbs=1)[0]
                            for cost in (None, CollectiveCost(startup_s=2e-3), GLOO))
    assert plain + 2e-3 - 1e-12 <= started <= plain + layers * 2e-3 + 1e-12
    assert gloo > started  # and the processing of the bytes on top


def _pair(src: str, dst: str, same_node: bool = False) -> dict:
    return {"src_zone": src, "src_gpu": "A100-40", "dst_zone": dst, "dst_gpu": "A100-40", "flows": 1,
            "latency_s": 1e-3, "bandwidth_bytes_per_s": 6e6, "same_node": same_node}


def test_the_ring_a_sweep_is_compared_with_is_the_simulators():
    # two members on two nodes of one zone: 2 steps of 0.1 ms and x / 1e8; on one node: the node's
    # link (50 µs, 2e8 B/s); four members: 6 steps, 2 x 3/4 x; a collective cost on the model is left out
    net = network_for(CLUSTER)
    net.collective = GLOO
    sizes = np.array([1024.0, 1 << 20])
    pair = [Member(zone=ZA, gpu="A100-40", tp=1, node=n) for n in ("a", "b")]
    assert simulated_ring_s(net, pair, sizes) == pytest.approx(2e-4 + sizes / 1e8)
    assert simulated_ring_s(net, pair_members(_pair(ZA, ZA, same_node=True)), sizes) == pytest.approx(1e-4 + sizes / 2e8)
    four = [Member(zone=ZA, gpu="A100-40", tp=1, node=f"n{k}") for k in range(4)]
    assert simulated_ring_s(net, four, sizes) == pytest.approx(6e-4 + 1.5 * sizes / 1e8)


def test_fit_recovers_start_up_and_rate_pooled_over_links():
    # a sweep file of two pairs, measured = the simulator's ring over the cluster's links + 2 ms +
    # x / 130 MB/s exactly: the fit finds both, whichever links the ring runs over
    sizes = [1024 * 4**k for k in range(7)]
    links = [_pair(ZA, ZA), _pair(ZA, ZA, same_node=True)]
    for net in (network_for(CLUSTER), network_from_ours(CLUSTER, {"schema": "sailor.network/1", "links": links}, "x")):
        rings = [simulated_ring_s(net, pair_members(link), sizes) for link in links]
        data = {"links": links, "sweep": {"sizes_bytes": sizes, "pairs": [
            {"allreduce_s": list(r + 2e-3 + np.array(sizes) / 130e6)} for r in rings]}}
        got = collective_of_pairs(net, data)
        assert got["startup_s"] == pytest.approx(2e-3, rel=1e-9)
        assert got["processing_bytes_per_s"] == pytest.approx(130e6, rel=1e-9)
        assert got["fit_relative_error"] == pytest.approx(0.0, abs=1e-12)
    assert collective_of_pairs(net, {"links": [], "sweep": {"sizes_bytes": sizes, "pairs": []}}) is None


def test_fit_leaves_out_what_the_sweep_does_not_show():
    # measured exactly as the ring: no start-up, no processing rate
    sizes = np.array([1024 * 4**k for k in range(7)], dtype=float)
    ring = 2e-4 + sizes / 35e6
    got = fit_collective(sizes, ring, ring)
    assert got["startup_s"] == pytest.approx(0.0, abs=1e-12) and "processing_bytes_per_s" not in got
    # faster than the ring by a fixed 0.05 ms (a residual that does not grow with the bytes, and
    # is negative): both clipped at 0, the model then the ring
    got = fit_collective(sizes, ring - 5e-5, ring)
    assert got["startup_s"] == 0.0 and "processing_bytes_per_s" not in got
    # a residual that only grows with the bytes: a rate, no start-up
    got = fit_collective(sizes, ring + sizes / 1e8, ring)
    assert got["startup_s"] == pytest.approx(0.0, abs=1e-12)
    assert got["processing_bytes_per_s"] == pytest.approx(1e8, rel=1e-9)


def _network_file(collective) -> dict:
    return {"schema": "sailor.network/1", "classes": {"same_zone": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e8}},
            "collective": collective}


def test_the_link_file_carries_the_collective_cost(tmp_path):
    path = tmp_path / "n.json"
    path.write_text(json.dumps(_network_file({"startup_s": 2e-3, "processing_bytes_per_s": 1.3e8,
                                              "fit_relative_error": 0.04})))
    assert network_for(CLUSTER, path).collective == CollectiveCost(2e-3, 1.3e8)
    path.write_text(json.dumps(_network_file({"startup_s": 1e-3})))
    assert network_for(CLUSTER, path).collective == CollectiveCost(1e-3, None, "nccl")  # the default backend
    path.write_text(json.dumps(_network_file({"startup_s": 1e-3, "backend": "gloo"})))
    assert network_for(CLUSTER, path).collective == CollectiveCost(1e-3, None, "gloo")
    # the fit writes the backend it was given (`sailor profile network`: the one it measured with)
    assert fit_collective([1e6, 2e6], [2e-3, 3e-3], [1e-3, 2e-3], "gloo")["backend"] == "gloo"
    assert "backend" not in fit_collective([1e6, 2e6], [2e-3, 3e-3], [1e-3, 2e-3])


@pytest.mark.parametrize("collective, words", [
    ({"startup_s": -1e-3}, "collective.startup_s: must be >= 0, got -0.001"),
    ({"startup_s": 1e-3, "processing_bytes_per_s": 0}, "collective.processing_bytes_per_s: must be >="),
    ({"startup_s": "2 ms"}, "collective.startup_s: expected a number of seconds, got '2 ms'"),
    ({"processing_bytes_per_s": 1e8}, "collective.startup_s: missing field"),
    ({"startup_s": 1e-3, "efficiency": 0.8}, "collective.efficiency: unknown field 'efficiency'"),
    ([1e-3], "collective: expected a mapping"),
    ({"startup_s": 1e-3, "backend": "mpi"}, "collective.backend: unknown backend 'mpi'"),
])
def test_bad_collective_costs_are_refused(tmp_path, monkeypatch, capsys, collective, words):
    path = tmp_path / "n.json"
    path.write_text(json.dumps(_network_file(collective)))
    with pytest.raises(SailorInputError) as e:
        network_for(CLUSTER, path)
    assert words in str(e.value), str(e.value)
    # through the command line: exit 2, one line naming the file and the field
    _base(tmp_path)
    _write(tmp_path, {"bad.json": _network_file(collective)})
    line = _refused(["plan", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "bad.json"], tmp_path,
                    monkeypatch, capsys)
    assert "bad.json" in line and words.split(":")[0] in line, line


def test_a_good_collective_cost_plans(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    _write(tmp_path, {"n.json": _network_file({"startup_s": 2e-3, "processing_bytes_per_s": 1.3e8})})
    code, _, err = _main(["plan", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "n.json"], tmp_path,
                         monkeypatch, capsys)
    assert code == 0, err


def test_under_a_split_backward_the_sync_hides_under_the_weight_passes_only():
    # ZB-H1: a layer's gradients are final after its last W pass, and the stage ends on W passes:
    # each layer's bucket hides under the W passes of the layers below, not their whole backward
    ctx = _context(GLOO)
    layers = ctx.job.model.num_layers
    groups = _members(2)
    order = list(reversed(range(layers)))
    weight = [ctx.stage_backward_split_s("A100-40", 1, 1, x, x + 1)[1] for x in order]
    whole = [ctx.layer_s("A100-40", 1, 1)[x, 1] for x in order]
    assert all(w <= b for w, b in zip(weight, whole)) and sum(weight) < sum(whole)  # the embedding's: all W
    params = ctx.stage_params(1, 0, layers)
    full = collective_s(ctx, groups, Collective.ALL_REDUCE, ctx.job.state_bytes_per_param["gradients"] * params, 1)
    start = collective_s(ctx, groups, Collective.ALL_REDUCE, 1.0, 1)
    per = [start + (full - start) * ctx.stage_params(1, x, x + 1) / params for x in order]
    split = stage_sync(ctx, groups, [(0, layers)], mbs=1, split_backward=True)[0]
    assert split == pytest.approx(exposed_sync_s(per, weight))
    whole_sync = stage_sync(ctx, groups, [(0, layers)], mbs=1)[0]
    assert whole_sync == pytest.approx(exposed_sync_s(per, whole)) and whole_sync < split
