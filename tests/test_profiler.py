"""`sailor profile` on CPU: the files it writes load, and the simulator uses them (issue 6).

Each profile runs a few gloo processes for a few seconds; no wall-clock times are asserted, only
that values are present, positive and used. Every test checks that no profiling process is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import own_processes

from sailor.core.errors import SailorInputError
from sailor.core.fileio import write_json
from sailor.perf.network import CollectiveCost
from sailor.perf.network_files import network_for
from sailor.perf.profiles import load_profiles, profiles_from_dict
from sailor.runtime.netprofile import fit_alpha_beta, profile_network
from sailor.runtime.profiler import (
    ProfileOptions,
    check_options,
    device_gpu_type,
    layer_row,
    pass_scale,
    profile_job,
    whole_stats,
)
from sailor.runtime.ranks import _free_port
from sailor.specs.cluster import local_cluster
from sailor.specs.job import JobSpec

JOB = JobSpec(model="tiny", global_batch_size=8)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prof") / "profile.json"
    ticks = []
    with own_processes() as alive:
        data = profile_job(ProfileOptions(job=JOB, tps=(1, 2), mbs=(1, 2), warmup=1, repeats=3),
                           progress=ticks.append)
    write_json(path, data)
    # (TP, layer kind, the whole model or the fixed cost per stage pass, micro-batch) measurements
    assert sum(ticks) == 2 * 5 * 2
    assert not alive()  # none of the ranks this fixture started is left
    return path


@pytest.mark.integration
def test_profile_file_loads_with_every_measurement(profile_file):
    raw = json.loads(profile_file.read_text())
    assert raw["schema"] == "sailor.profiles/1" and raw["device"] and raw["date"]
    assert raw["versions"]["torch"].startswith("2.13")
    prof = load_profiles(profile_file, JOB)
    n = JOB.model.num_layers
    for tp in (1, 2):
        assert prof.measured("cpu", tp)
        for mbs in (1, 2):
            t = prof.layer_times(JOB, "cpu", tp, mbs)
            assert t.shape == (n, 2) and np.all(t > 0)
        assert prof.activation_bytes[tp].shape == (n,) and np.all(prof.activation_bytes[tp] > 0)
    # blocks share one geometry, so one measured block stands for all of them
    t = prof.layer_times(JOB, "cpu", 1, 2)
    assert np.all(t[1:-1] == t[1])
    assert prof.optimizer_s_per_param["cpu"] > 0
    row = raw["layers"][0]
    assert len(row["forward_spread_s"]) == n and all(s >= 0 for s in row["backward_spread_s"])
    assert all(m["peak_bytes"] > 0 for m in raw["memory"])
    assert not prof.estimates_used
    # layer times were scaled to the whole model's single pass, for every (TP, micro-batch)
    assert sorted(raw["settings"]["pass_scale"]) == ["1/1", "1/2", "2/1", "2/2"]
    assert all(len(x) == 4 and all(0 < f < 10 for f in x) for x in raw["settings"]["pass_scale"].values())
    # the runtime's time outside the passes, one figure per (GPU type, TP), kept by a save and load
    rows = raw["runtime"]["microbatch_overhead_s"]
    assert [(r["gpu"], r["tp"]) for r in rows] == [("cpu", 1), ("cpu", 2)]
    assert all(0 <= r["seconds"] < 0.1 for r in rows)
    assert prof.microbatch_overhead_s == {("cpu", r["tp"]): r["seconds"] for r in rows}
    assert profiles_from_dict(prof.to_dict()).microbatch_overhead_s == prof.microbatch_overhead_s
    # the fixed cost of one stage pass, from 2-stage pipelines (2 and 4 processes), each direction
    rows = raw["runtime"]["pass_overhead_s"]
    assert [(r["gpu"], r["tp"]) for r in rows] == [("cpu", 1), ("cpu", 2)]
    assert all(0 <= r[k] < 0.05 for r in rows for k in ("forward_s", "backward_s"))
    assert prof.pass_overhead_s == {("cpu", r["tp"]): (r["forward_s"], r["backward_s"]) for r in rows}
    assert sorted(raw["settings"]["pass_overhead_s_by_mbs"]) == ["1", "2"]
    # what a run adds to a pipeline transfer: run and idle latencies measured (> 0), their difference
    rows = raw["runtime"]["p2p_overhead_s"]
    assert [(r["gpu"], r["tp"]) for r in rows] == [("cpu", 1), ("cpu", 2)]
    by_mbs = raw["settings"]["p2p_overhead_s_by_mbs"]
    for tp in ("1", "2"):
        for extra, run, idle in by_mbs[tp].values():
            assert run > 0 and idle > 0 and extra == pytest.approx(max(0.0, run - idle))
    assert prof.p2p_overhead_s == {("cpu", r["tp"]): r["seconds"] for r in rows}
    assert profiles_from_dict(prof.to_dict()).p2p_overhead_s == prof.p2p_overhead_s
    # the backward's input- and weight-gradient passes, timed apart: the embedding has no input gradient
    for tp in (1, 2):
        assert prof.split_measured("cpu", tp)
        split = prof.backward_split(JOB, "cpu", tp, 2, np.zeros(n))
        assert split[0, 0] == 0.0 and np.all(split[1:, 0] > 0) and np.all(split[:, 1] > 0)
    assert not prof.estimates_used


@pytest.mark.parametrize("runtime, match", [
    ({"microbatch_overhead_s": {"cpu": 1e-4}}, "runtime"),
    ({"microbatch_overhead_s": [{"gpu": "cpu", "tp": 1}]}, "microbatch_overhead_s.0"),
    ({"microbatch_overhead_s": [{"gpu": "cpu", "tp": 1, "seconds": -1.0}]}, "microbatch_overhead_s.0.seconds"),
    ({"microbatch_overhead_s": [{"gpu": "cpu", "tp": 0, "seconds": 1e-4}]}, "microbatch_overhead_s.0.tp"),
])
@pytest.mark.integration
def test_bad_runtime_overhead_is_an_input_error(profile_file, runtime, match):
    raw = json.loads(profile_file.read_text())
    with pytest.raises(SailorInputError, match=match):
        profiles_from_dict({**raw, "runtime": runtime}, "p.json")


def test_pass_scale_spreads_the_per_pass_overhead():
    # 6 layers timed alone (ms): embedding 0.07, 4 blocks 0.59, head 0.22, each including one
    # 0.07 ms pass overhead; the whole model in one pass pays it once: 2.65 - 5 x 0.07 = 2.30.
    layers = [0.07, 0.59, 0.59, 0.59, 0.59, 0.22]
    scale = pass_scale(layers, 2.30)
    assert scale == pytest.approx(2.30 / 2.65)
    assert sum(x * scale for x in layers) == pytest.approx(2.30)
    with pytest.raises(AssertionError):
        pass_scale([0.0], 1.0)


def test_layer_row_scales_each_pass_by_its_own_whole_run():
    # 3 layers timed alone (ms): forward, backward, their spreads; input- and weight-gradient passes
    stats = [(0.1, 0.2, 0.01, 0.02), (1.0, 2.0, 0.1, 0.2), (0.4, 0.8, 0.0, 0.04)]
    split = [(0.0, 0.2), (1.0, 0.5), (0.5, 0.1)]
    # whole model per micro-batch: forward 3.0, backward 6.0 (1F1B); input 4.5, weight 4.0 (ZB-H1)
    row, scales = layer_row(stats, split, (3.0, 6.0, 4.5, 4.0))
    assert scales == pytest.approx([3.0 / 1.5, 6.0 / 3.0, 4.5 / 1.5, 4.0 / 0.8])
    assert row["forward_s"] == pytest.approx([0.2, 2.0, 0.8]) and row["backward_s"] == pytest.approx([0.4, 4.0, 1.6])
    assert row["forward_spread_s"] == pytest.approx([0.02, 0.2, 0.0])
    assert row["backward_spread_s"] == pytest.approx([0.04, 0.4, 0.08])
    # the split sums to its own whole passes, not to the 1F1B backward's factor (which gave 0, 2, 1 and 0.4, 1, 0.2)
    assert row["backward_input_s"] == pytest.approx([0.0, 3.0, 1.5]) and sum(row["backward_input_s"]) == pytest.approx(4.5)
    assert row["backward_weight_s"] == pytest.approx([1.0, 2.5, 0.5])
    # the runtime's fixed cost per stage pass (0.3 forward, 0.6 backward) is taken out of the whole
    # passes first (the simulator charges it per chunk pass), the backward's from the input-gradient pass
    row, scales = layer_row(stats, split, (3.0, 6.0, 4.5, 4.0), (0.3, 0.6))
    assert scales == pytest.approx([2.7 / 1.5, 5.4 / 3.0, 3.9 / 1.5, 4.0 / 0.8])
    assert sum(row["forward_s"]) == pytest.approx(2.7) and sum(row["backward_s"]) == pytest.approx(5.4)
    assert sum(row["backward_input_s"]) == pytest.approx(3.9) and sum(row["backward_weight_s"]) == pytest.approx(4.0)
    # no whole pass (CUDA): the times as measured
    row, scales = layer_row(stats, split, None)
    assert scales == [1.0] * 4 and row["backward_input_s"] == [0.0, 1.0, 0.5] and row["forward_s"] == [0.1, 1.0, 0.4]


def test_whole_stats_are_trimmed_means_that_add_up_to_the_mean_sum():
    # 10 repeats of the whole pass (ms): the sum of both phases is steady (9, 10 or 11), the split
    # between them is not; one repeat slowed as a whole (30) and one sped up (2)
    fwd = [2.0, 5.0, 3.0, 6.0, 4.0, 3.5, 5.5, 2.5, 20.0, 1.0]
    bwd = [8.0, 5.0, 7.0, 4.0, 6.0, 5.5, 5.5, 6.5, 10.0, 1.0]
    f, b = whole_stats([fwd, bwd])  # 10 % trimmed at each end: the 30 and the 2 are left out
    assert f == pytest.approx(31.5 / 8) and b == pytest.approx(47.5 / 8)
    assert f + b == pytest.approx(79.0 / 8)  # the mean of the kept sums; the medians gave 4.5 + 5.75
    assert whole_stats([fwd, bwd], trim=0.0) == pytest.approx((52.5 / 10, 58.5 / 10))
    assert whole_stats([[1.0], [2.0]]) == (1.0, 2.0)  # too few repeats to trim: all kept


def test_the_slowest_ranks_row_is_kept_whole():
    import torch

    from sailor.runtime.profile_measure import slowest_rows, whole_pass_repeats
    # 2 replicas x 3 repeats x (forward, backward, weight, rest): each repeat keeps the row of the
    # replica whose call (forward + backward + rest) took longest, never one's forward and the
    # other's backward (their column maxima: 5 + 6 in the first repeat, which neither replica took)
    rows = torch.tensor([[[5.0, 3.0, 0.0, 1.0], [2.0, 6.0, 0.0, 0.5], [4.0, 4.0, 1.0, 0.0]],
                         [[2.0, 6.0, 0.0, 0.5], [3.0, 4.0, 0.0, 0.5], [4.0, 4.0, 2.0, 0.1]]], dtype=torch.float64)
    got = slowest_rows(rows)
    assert got.tolist() == [[5.0, 3.0, 0.0, 1.0], [2.0, 6.0, 0.0, 0.5], [4.0, 4.0, 2.0, 0.1]]
    assert slowest_rows(rows[:1]).tolist() == rows[0].tolist()  # one rank: its rows
    assert whole_pass_repeats(10) == 30 and whole_pass_repeats(1) == 3


@pytest.mark.integration
def test_simulate_cli_uses_the_profile(profile_file, tmp_path):
    plan = tmp_path / "plan.json"
    reps = [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 2}, {"stage": 1, "gpu": "cpu", "zone": "local", "tp": 1}]
    plan.write_text(json.dumps({"micro_batch_size": 2, "stages": [[0, 3], [3, 6]],
                                "pipelines": [{"microbatches": 4, "replicas": reps}],
                                "job": {"model": "tiny", "global_batch_size": 8}}))
    out = subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", "simulate", str(plan),
                          "--profiles", str(profile_file), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    est = json.loads(out.stdout)
    assert est["estimated"] == []
    assert est["iteration_time_s"] > 0
    # without a profile, on the local provider: the cached quick profile of this machine (seeded
    # here with the same file, one cache file per TP degree for the plan's 3 GPUs, so nothing is
    # measured), never the roofline
    from sailor.runtime.machine import cache_path
    from sailor.specs.job import JobSpec
    cache = tmp_path / "cache"
    whole = json.loads(profile_file.read_text())
    for tp in (1, 2):
        seeded = cache_path(JobSpec(model="tiny", global_batch_size=8), tp=tp, processes=3, folder=cache / "profiles")
        seeded.parent.mkdir(parents=True, exist_ok=True)
        part = whole | {k: [r for r in whole[k] if r["tp"] == tp] for k in ("layers", "memory")}
        part["runtime"] = {"microbatch_overhead_s": [r for r in whole["runtime"]["microbatch_overhead_s"] if r["tp"] == tp]}
        seeded.write_text(json.dumps(part))
    out = subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", "simulate", str(plan),
                          "--json"], capture_output=True, text=True, env={**os.environ, "SAILOR_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr
    assert "profile of this machine at TP 1,2 from the cache" in out.stderr and "measured this machine" not in out.stderr
    assert not any("roofline" in e for e in json.loads(out.stdout)["estimated"])


@pytest.mark.integration
def test_network_profile_two_processes(tmp_path):
    # Means of 5 and a 16 MiB point: at 2 repeats (medians then) one scheduling hiccup on a 1 KiB
    # all-reduce (4 ms against 2.5 ms for 4 MiB, seen once in CI) made time fall with size and the fit fail.
    with own_processes() as alive:
        data = profile_network(2, warmup=2, repeats=5, sizes_bytes=(1024, 65536, 1 << 20, 16 << 20))
    path = tmp_path / "net.json"
    write_json(path, data)
    net = network_for(local_cluster(2), path)
    link = data["classes"]["same_zone"]
    assert link["bandwidth_bytes_per_s"] > 0 and link["latency_s"] >= 0
    # the simulator's lookup for two local processes uses the measured link
    nbytes = 1 << 20
    want = link["latency_s"] + nbytes / link["bandwidth_bytes_per_s"]
    assert net.transfer_time_s("local", "cpu", "local", "cpu", nbytes) == pytest.approx(want)
    # the processes share this machine: the links were measured inside one node, where placement
    # puts every local rank
    assert net.transfer_time_s("local", "cpu", "local", "cpu", nbytes, same_node=True) == pytest.approx(want)
    assert all(entry["same_node"] for entry in data["links"])
    # the all-reduce's cost beyond the ring over that link is the simulator's collective cost
    fit = data["collective"]
    assert fit["startup_s"] >= 0 and fit["fit_relative_error"] >= 0
    assert net.collective == CollectiveCost(fit["startup_s"], fit.get("processing_bytes_per_s"), "gloo")  # measured on CPU
    assert not alive()  # none of the ranks this test started is left


def test_fit_alpha_beta_recovers_a_link():
    sizes = np.array([1024 * 4**k for k in range(9)], dtype=float)
    alpha, beta = 40e-6, 3e9
    a, b = fit_alpha_beta(sizes, alpha + sizes / beta)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


@pytest.mark.parametrize("kw, match", [
    ({"tps": (3,)}, "TP 3 does not divide"),
    ({"mbs": (0,)}, "micro-batch sizes must be >= 1"),
    ({"repeats": 0}, "--repeats: must be >= 1, got 0"),
])
def test_bad_options_are_input_errors(kw, match):
    with pytest.raises(SailorInputError, match=match):
        check_options(ProfileOptions(job=JOB, **kw))


def test_cpu_profile_needs_fp32():
    with pytest.raises(SailorInputError, match="trains in fp32"):
        check_options(ProfileOptions(job=JobSpec(model="tiny", global_batch_size=8, precision="bf16")))


def test_gpu_type_of_cpu():
    assert device_gpu_type("cpu") == "cpu"


@pytest.mark.integration
def test_cli_bad_tp_is_one_line_exit_2(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model: tiny\nglobal_batch_size: 8\n")
    out = subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", "profile", "--job", str(job),
                          "--tp", "3"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "TP 3" in out.stderr


def test_split_backward_gives_the_full_backwards_gradients():
    # the passes `sailor profile` times for zero-bubble schedules compute exactly the gradients of one
    # backward: B the input's (no weight gradient yet), W the weights' (a block and a 4-layer slice)
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from sailor.runtime.profile_measure import _build_layer

    for first, end in ((1, None), (1, 5)):
        layer = _build_layer(JOB, first, 0, 1, None, torch.device("cpu"), end)
        params = list(layer.parameters())
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, 64, 64, generator=gen)
        full_x = x.clone().requires_grad_()
        y = layer(full_x)
        dy = torch.randn(y.shape, generator=gen)
        y.backward(dy)
        full = [p.grad.clone() for p in params]
        layer.zero_grad(set_to_none=True)
        split_x = x.clone().requires_grad_()
        dx, groups = stage_backward_input([layer(split_x)], [dy], [split_x], iter(params))
        assert all(p.grad is None for p in params)
        assert torch.equal(dx[0], full_x.grad)
        stage_backward_weight(iter(params), groups)
        assert all(torch.equal(a, p.grad) for a, p in zip(full, params))


@pytest.mark.integration
def test_own_processes_lists_this_tests_children_only():
    # The check above must be able to fail: a child started inside the block is listed (also after
    # its command line changes, through exec), one started outside is not.
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with own_processes() as alive:
            inside = subprocess.Popen(["sh", "-c", f"exec {sys.executable} -c 'import time; time.sleep(30)'"])
        try:
            deadline = time.monotonic() + 10
            while "time.sleep" not in " ".join(cmd for _, cmd in alive()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [pid for pid, _ in alive()] == [inside.pid]
        finally:
            inside.kill()
            inside.wait()
        assert alive() == []
    finally:
        outside.kill()
        outside.wait()


def test_link_pairs_of_a_hosts_file():
    """Testbed-like machines: two 2-GPU A100 machines in one zone, one V100 machine in each of two
    more zones. Links: inside an A100 machine, between the two A100 machines, and from each group's
    first machine to every later group's (the model looks links up both ways)."""
    from sailor.launch.hosts import HostsFile, LinkPair, link_pairs

    hosts = HostsFile.model_validate({"user": "me", "groups": [
        {"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["10.0.0.1", "10.0.0.2"]},
        {"zone": "us-central1-b", "gpu": "V100-16", "hosts": ["10.0.0.3"]},
        {"zone": "us-west1-b", "gpu": "V100-16", "hosts": ["root@10.0.0.4"]}]})
    a, b, w = ("us-central1-a", "A100-40"), ("us-central1-b", "V100-16"), ("us-west1-b", "V100-16")
    pairs = link_pairs(hosts, {"A100-40": 2, "V100-16": 1})
    assert pairs == [LinkPair(a, a, True, ("me@10.0.0.1", "me@10.0.0.1")),
                     LinkPair(a, a, False, ("me@10.0.0.1", "me@10.0.0.2")),
                     LinkPair(a, b, False, ("me@10.0.0.1", "me@10.0.0.3")),
                     LinkPair(a, w, False, ("me@10.0.0.1", "root@10.0.0.4")),
                     LinkPair(b, w, False, ("me@10.0.0.3", "root@10.0.0.4"))]
    assert [p.rendezvous for p in pairs] == ["10.0.0.1"] * 4 + ["10.0.0.3"]
    assert link_pairs(hosts.model_copy(update={"groups": hosts.groups[1:2]}), {"V100-16": 1}) == []


@pytest.mark.integration
def test_network_profile_between_machines_runs_each_pair_where_launch_says(tmp_path):
    """`profile_pairs` with a `launch` that runs each process here under an env marking its machine
    (what ssh does on real ones): both ends of the pair ran, the result came back as a rank message,
    and the file it writes loads, with the measured link for that pair."""
    from sailor.launch.hosts import LinkPair
    from sailor.runtime.netprofile import profile_pairs

    seen = tmp_path / "seen"
    seen.mkdir()

    def launch(dest: str, argv: list[str]) -> list[str]:
        script = f"import pathlib, runpy, sys; pathlib.Path({str(seen)!r}, {dest!r} + sys.argv[2]).touch()"
        return [sys.executable, "-c", script + "; sys.argv = ['x', *sys.argv[1:]]; runpy.run_module("
                "'sailor.runtime.profiler', run_name='__main__')", *argv[2:]]

    pair = LinkPair(("local", "cpu"), ("local", "cpu"), False, ("127.0.0.1", "localhost"))
    with own_processes() as alive:
        # (sizes up to 8 MiB: on loopback 1 MiB can take no longer than 1 KiB, which fits no bandwidth)
        data = profile_pairs([pair], launch, cluster=local_cluster(2), port=_free_port(),
                             sizes_bytes=(1024, 1 << 20, 8 << 20), repeats=3)
    assert sorted(p.name for p in seen.iterdir()) == ["127.0.0.10", "localhost1"]  # rank 0 on the first machine
    path = tmp_path / "net.json"
    write_json(path, data)
    net = network_for(local_cluster(2), path)
    (link,) = data["links"]
    assert link["same_node"] is False and link["bandwidth_bytes_per_s"] > 0
    assert net.transfer_time_s("local", "cpu", "local", "cpu", 1 << 20) == pytest.approx(
        link["latency_s"] + (1 << 20) / link["bandwidth_bytes_per_s"])
    assert len(data["sweep"]["pairs"][0]["p2p_one_way_s"]) == 3
    assert net.collective == CollectiveCost(data["collective"]["startup_s"],
                                            data["collective"].get("processing_bytes_per_s"), "gloo")
    assert not alive()


@pytest.mark.integration
def test_a_model_mixing_dense_and_moe_blocks_profiles_one_of_each(tmp_path):
    # block 0 (layer 1) is a mixture of experts, block 1 (layer 2) dense: each is timed and measured
    # itself, and every layer of the profile carries its own kind's figures
    from sailor.runtime.profile_measure import layer_kinds

    model = {"name": "moe", "num_blocks": 3, "hidden_size": 64, "num_heads": 4, "vocab_size": 256,
             "max_sequence_length": 64, "gated_mlp": True, "learned_positions": False, "bias": False,
             "rms_norm": True, "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32, "dense_blocks": [1]}}
    job = JobSpec(model=model, global_batch_size=8, sequence_length=32)
    assert layer_kinds(job.model) == ["embedding", "block", "other block", "block", "head"]
    ticks = []
    with own_processes() as alive:
        data = profile_job(ProfileOptions(job=job, tps=(1,), mbs=(1,), warmup=1, repeats=2), progress=ticks.append)
    assert not alive()
    # embedding, block, other block, head, whole model, fixed cost per stage pass (5 layers: v = 2)
    assert sum(ticks) == 1 * 6 * 1
    assert [r["tp"] for r in data["runtime"]["pass_overhead_s"]] == [1]
    row = data["layers"][0]
    act = data["memory"][0]["activation_bytes_per_sample"]
    assert len(row["forward_s"]) == len(act) == 5 and all(t > 0 for t in row["forward_s"])
    assert row["forward_s"][1] == row["forward_s"][3] and act[1] == act[3] != act[2]
    write_json(tmp_path / "p.json", data)
    assert load_profiles(tmp_path / "p.json", job).activation_bytes[1][2] == act[2]


def test_run_ranks_keeps_the_last_message_a_rank_printed_before_it_exited(monkeypatch):
    """A rank's last line can still be in its pipe when the process has exited (a loaded machine:
    `sailor profile network --hosts` lost a pair's result, KeyError 'p2p'); run_ranks reads it."""
    import io

    from sailor.runtime import ranks

    class LatePipe:  # the rank's stdout: its one line comes after the process has exited
        def __iter__(self):
            time.sleep(0.3)
            yield ranks.RANK_MESSAGE + json.dumps({"result": {"p2p": 1}}) + "\n"

    class Exited:  # stands in for subprocess.Popen: the rank has already exited with 0
        def __init__(self, argv, **kw):
            self.stdin, self.stdout, self.returncode = io.StringIO(), LatePipe(), 0

        def poll(self):
            return 0

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Exited)
    got = []
    ranks.run_ranks("sailor.runtime.profiler:profile_rank", 1, {}, on_message=got.append, port=1)
    assert got == [{"result": {"p2p": 1}}]
