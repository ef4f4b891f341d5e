"""benchmarks/runtime_overhead.py on the testbed, without starting anything: torch's per-node
torchrun commands (parsed by torchrun's own parser), the built-in testbed and the pair of nodes the
ranks run on, and refusals of testbed files that cannot run the pair (exit 2, one line)."""

from __future__ import annotations

import shlex
import sys

import pytest
from benchmark_module import load_benchmark

from sailor.core.errors import SailorInputError
from sailor.launch.common import torchrun_command
from sailor.testbed.spec import TestbedLink, parse_testbed


def _torchrun(command: str):
    """(environment, torchrun's parsed arguments) of a `torchrun_command` line."""
    run = pytest.importorskip("torch.distributed.run")
    argv = shlex.split(command)
    python = next(i for i, a in enumerate(argv) if i > 0 and "=" not in a)  # `env K=V ... PYTHON -m ...`
    assert argv[0] == "env" and argv[python + 1:python + 3] == ["-m", "sailor.runtime.launcher"]
    env = dict(a.split("=", 1) for a in argv[1:python])
    return env, run.get_args_parser().parse_args(argv[python + 3:])


def test_torchrun_command_is_a_static_rendezvous_agent_running_the_entry():
    entry = ["/x/torch_reference.py", "--model", '{"name": "a b"}', "--out", "/t/r.json"]
    env, args = _torchrun(torchrun_command("/venv/bin/python", entry, nnodes=3, node_rank=2, nproc=4,
                                           rdzv_host="10.0.1.2", rdzv_port=29501, rdzv_timeout_s=60,
                                           env={"CUDA_VISIBLE_DEVICES": "0,1"}))
    assert env == {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("3", 2, "4")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_conf, args.max_restarts) == \
        ("static", "10.0.1.2:29501", "timeout=60", 0)
    assert [args.training_script, *args.training_script_args] == entry


def test_a_shell_variable_rendezvous_host_is_left_to_the_shell():
    cmd = torchrun_command("python3", ["-m", "m"], nnodes=1, node_rank=0, nproc=1, rdzv_host="$HOST", rdzv_port=1)
    assert "--rdzv-endpoint ${HOST}:1 " in cmd and "--rdzv-conf" not in cmd


def test_torch_runs_one_agent_per_host_meeting_on_the_first():
    ref = load_benchmark("torch_reference")
    cmds = ref.node_commands(["root@10.9.1.2", "10.9.2.2"], ["/b/torch_reference.py", "--mode", "ddp"], 1,
                             python="/venv/bin/python")
    assert [(c.node, c.destination) for c in cmds] == [("root@10.9.1.2", "root@10.9.1.2"), ("10.9.2.2", "10.9.2.2")]
    parsed = [_torchrun(c.script)[1] for c in cmds]
    assert [a.node_rank for a in parsed] == [0, 1]
    for a in parsed:
        assert (a.nnodes, a.nproc_per_node, a.rdzv_endpoint) == ("2", "1", f"10.9.1.2:{ref.RDZV_PORT}")
        assert [a.training_script, *a.training_script_args] == ["/b/torch_reference.py", "--mode", "ddp"]


def _module():
    return load_benchmark("runtime_overhead")


def test_the_builtin_testbed_joins_two_one_rank_nodes_by_the_shaped_cross_zone_link():
    ro = _module()
    spec = ro.builtin_testbed(mbit=250.0, cores=0.5)
    a, b, mbit = ro.testbed_pair(spec)
    assert (a.name, b.name, a.ranks, b.ranks) == ("a", "b", 1, 1)
    assert spec.link_between(a, b) is TestbedLink.CROSS_ZONE and mbit == 250.0
    assert {spec.devices[n.device].cpu_quota for n in (a, b)} == {0.5}
    assert min(a.nic_mbit_per_s, b.nic_mbit_per_s, spec.links.same_zone_mbit_per_s) > 250.0  # the link alone shapes


def _spec(nodes: list[dict], cross_zone: float = 300.0):
    return parse_testbed({"name": "t", "devices": {"d": {"gpu": "A100-40", "cpu_quota": 0.5},
                                                  "e": {"gpu": "V100-16", "cpu_quota": 0.5}},
                          "links": {"same_zone_mbit_per_s": 900, "cross_zone_mbit_per_s": cross_zone,
                                    "cross_region_mbit_per_s": 50}, "nodes": nodes})


def _node(name: str, zone: str = "us-central1-a", region: str = "us-central1", ranks: int = 1, nic: float = 1000):
    """A node of device class d, or of class e where it holds 2 ranks (a class has one rank count)."""
    return {"name": name, "zone": zone, "region": region, "device": "d" if ranks == 1 else "e", "ranks": ranks,
            "nic_mbit_per_s": nic}


@pytest.mark.parametrize("nodes, mbit", [
    ([_node("a"), _node("b", "us-central1-b", nic=120)], 120.0),  # the slower NIC caps the cross-zone link
    ([_node("a"), _node("b")], 900.0),  # one zone: the same-zone link
    ([_node("a"), _node("w", "us-west1-b", "us-west1"), _node("c", ranks=2)], 50.0),  # the first two nodes only
])
def test_the_pair_rate_is_the_slowest_of_link_class_and_nics(nodes, mbit):
    assert _module().testbed_pair(_spec(nodes))[2] == mbit


@pytest.mark.parametrize("nodes", [[_node("a")], [_node("a", ranks=2), _node("b")], [_node("a"), _node("b", ranks=2)]])
def test_a_testbed_without_two_one_rank_nodes_first_is_refused(nodes):
    with pytest.raises(SailorInputError, match="one rank each") as e:
        _module().testbed_pair(_spec(nodes), "t.yaml")
    assert e.value.one_line().startswith("t.yaml: nodes:")


def test_a_bad_testbed_file_exits_2_with_one_line_before_anything_starts(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "tb.yaml"
    bad.write_text("name: t\ndevices: {d: {gpu: A100-40, cpu_quota: 0.5}}\nlinks: {same_zone_mbit_per_s: 1,"
                   " cross_zone_mbit_per_s: 1, cross_region_mbit_per_s: 1}\nnodes:\n"
                   "  - {name: a, zone: us-central1-a, region: us-central1, device: d, ranks: 2, nic_mbit_per_s: 1}\n")
    ro = _module()
    monkeypatch.setattr(ro, "alternate", lambda *a: pytest.fail("ran"))
    monkeypatch.setattr(sys, "argv", ["runtime_overhead.py", "--testbed", str(bad)])
    with pytest.raises(SystemExit) as e:
        ro.main()
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {bad}: nodes:")


def test_the_builtin_testbed_is_refused_where_its_quotas_exceed_the_cores(monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # two ranks of one core each
    with pytest.raises(SailorInputError, match="more than the 1 of this machine") as e:
        _module().load_spec("")
    assert e.value.one_line().startswith("the built-in testbed: devices:")
