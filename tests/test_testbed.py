"""The testbed's pure parts: its file, what it becomes for the planner and the launcher, names and
addresses, the tc commands, the state bookkeeping and the stand-in ssh's argument parsing. No
process is started here (tests/test_testbed_link.py brings a testbed up)."""

import copy
import os
from pathlib import Path

import pytest

import sailor
from sailor.catalog import LinkClass
from sailor.core.errors import SailorInputError
from sailor.core.schema import parse_model
from sailor.launch.hosts import HostsFile
from sailor.runtime.epochs import AGENT_SLOTS_ENV
from sailor.testbed import cgroups, cluster_spec, host, hosts_spec, load_testbed, net
from sailor.testbed.spec import (
    FRAME_BYTES,
    MSS_BYTES,
    TestbedLink,
    loopback_payload_bytes_per_s,
    parse_testbed,
    payload_bytes_per_s,
)
from sailor.testbed.ssh import parse

ROOT = Path(__file__).resolve().parents[1]
BOX = ROOT / "examples" / "testbed.yaml"


@pytest.fixture
def box():
    return load_testbed(BOX)


def raw():
    import yaml
    return yaml.safe_load(BOX.read_text())


# ---- the file ------------------------------------------------------------------------------------
def test_the_example_reads(box):
    assert [n.name for n in box.nodes] == ["a0", "a1", "b0", "w0"]
    assert box.cfs_period_us is None  # each quota's shortest period: 1 ms of quota in it
    assert [box.period_us(d.cpu_quota) for d in box.devices.values()] == [3334, 6667]
    assert net.cpu_quota_us(0.3, 3334) == net.cpu_quota_us(0.15, 6667) == 1000
    assert box.model_copy(update={"cfs_period_us": 5000}).period_us(0.3) == 5000
    assert box.total_cpu_cores() == pytest.approx(2 * 2 * 0.3 + 2 * 0.15)  # ranks; communication: no limit
    a0, a1, b0, w0 = box.nodes
    assert box.link_between(a0, a1) is TestbedLink.SAME_ZONE
    assert box.link_between(a0, b0) is TestbedLink.CROSS_ZONE
    assert box.link_between(b0, w0) is TestbedLink.CROSS_REGION


@pytest.mark.parametrize("edit, field, words", [
    (lambda d: d["nodes"][2].update(device="medium"), "nodes.2.device", "unknown device class 'medium'"),
    (lambda d: d["nodes"][3].update(region="us-central1"), "nodes.3.region", "us-west1-b is in region us-west1"),
    (lambda d: d["nodes"][0].update(zone="mars-1a"), "nodes.0.zone", "mars-1a"),
    (lambda d: d["nodes"][3].update(zone="US-WEST1-B"), "nodes.3.zone", "did you mean 'us-west1-b'?"),
    (lambda d: d["nodes"][3].update(zone="us-west1"), "nodes.3.zone",
     "'us-west1' is a gcp region, not a zone (name one of its zones: us-west1-a, us-west1-b, us-west1-c)"),
    (lambda d: d["devices"]["fast"].update(gpu="A100-80") or d["nodes"][0].update(zone="us-west1-b", region="us-west1"),
     "nodes.0.zone", "gcp does not offer A100-80 in zone 'us-west1-b' (it offers A100-40, H100-80"),
    (lambda d: d["nodes"][1].update(name="a0"), "nodes.1.name", "listed twice"),
    (lambda d: d["nodes"][0].update(name="toolong7"), "nodes.0.name", "1-6 of a-z 0-9"),
    (lambda d: d["nodes"][1].update(ranks=1), "nodes.1.ranks", "node 0 of device class 'fast' has 2"),
    (lambda d: d["devices"]["slow"].update(gpu="A100-40"), "devices.slow.gpu", "both stand for A100-40"),
    (lambda d: d.update(cfs_period_us=10_000) or d["devices"]["slow"].update(cpu_quota=0.05), "devices.slow.cpu_quota",
     "below the kernel's 1000 µs"),
    (lambda d: d["links"].update(cross_zone_mbit_per_s=0), "links.cross_zone_mbit_per_s", "greater than or equal"),
    (lambda d: d.update(extra=1), "extra", "Extra inputs"),
    (lambda d: d.update(name="Box!"), "name", "1-12 of a-z"),
    (lambda d: d["devices"]["fast"].update(gpu="cpu"), "devices.fast.gpu", "no gcp price"),
    (lambda d: d.update(nodes=[]), "nodes", "must list at least 1 entry, got none"),  # was pydantic's "Tuple should ..."
    (lambda d: d.update(nodes=d["nodes"] * 17), "nodes", "must list at most 64 entries, got 68"),
    (lambda d: d.update(cfs_period_us=0), "cfs_period_us", "greater than or equal to 1000 (got 0)"),  # was "than 999"
    (lambda d: d["devices"].update({"": d["devices"]["slow"]}), "devices", "device class name '' is not 1-32"),
])
def test_bad_files_name_the_field(edit, field, words):
    data = copy.deepcopy(raw())
    edit(data)
    with pytest.raises(SailorInputError) as e:
        parse_testbed(data, "tb.yaml")
    assert e.value.source == "tb.yaml" and e.value.field == field
    assert words in e.value.one_line()


def test_the_quota_fix_names_the_period_that_works():
    data = copy.deepcopy(raw())
    data["devices"]["slow"]["cpu_quota"] = 0.05
    data["cfs_period_us"] = 10_000
    with pytest.raises(SailorInputError, match=r"cfs_period_us >= 20000"):
        parse_testbed(data)


# ---- what the planner and the launcher see ---------------------------------------------------------
def test_payload_rate_of_a_wire_rate():
    # 100 Mbit/s of frames = 12.5e6 B/s; 1448 of every 1514 bytes are payload
    assert payload_bytes_per_s(100) == pytest.approx(12.5e6 * 1448 / 1514)
    assert (MSS_BYTES, FRAME_BYTES) == (1448, 1514)


def test_the_cluster_spec_offers_the_testbed(box):
    spec = sailor.load_cluster(cluster_spec(box))
    assert spec.zones == {"us-central1-a": {"A100-40": 4}, "us-central1-b": {"V100-16": 1},
                          "us-west1-b": {"V100-16": 1}}
    assert spec.node_size("A100-40") == 2 and spec.node_size("V100-16") == 1
    # cross zone: min(200 Mbit link, 300 Mbit NIC); cross region: 50; same zone: min(400, NIC 300)
    assert spec.link(LinkClass.SAME_REGION).bandwidth_bytes_per_s == pytest.approx(payload_bytes_per_s(200))
    assert spec.link(LinkClass.SAME_CONTINENT).bandwidth_bytes_per_s == pytest.approx(payload_bytes_per_s(50))
    assert spec.link(LinkClass.SAME_ZONE, "us-central1-a").bandwidth_bytes_per_s == pytest.approx(
        payload_bytes_per_s(300))
    assert spec.link(LinkClass.SAME_REGION).flow_bandwidth_bytes_per_s == spec.link(
        LinkClass.SAME_REGION).bandwidth_bytes_per_s  # one flow can fill the shaped class


def test_a_shaped_loopback_is_the_same_node_link(box):
    # examples/testbed.yaml shapes each node's loopback to 1000 Mbit/s: 64 KiB packets, 66 bytes of
    # headers each, so 125e6 x 65470 / 65536 B/s of payload (124.0e6 measured through a node's quota)
    assert loopback_payload_bytes_per_s(1000) == pytest.approx(125e6 * 65470 / 65536)
    spec = sailor.load_cluster(cluster_spec(box))
    assert spec.link(LinkClass.SAME_NODE).bandwidth_bytes_per_s == pytest.approx(loopback_payload_bytes_per_s(1000))
    cmds = net.loopback_commands(box, net.Names("sbx0a1f"), "a0")
    assert [c[5:9] for c in cmds] == [["qdisc", "add", "dev", "lo"], ["class", "add", "dev", "lo"]]
    assert cmds[1][cmds[1].index("rate") + 1] == "1000000000bit"
    assert cmds[1][cmds[1].index("burst") + 1] == "131072b"  # two packets (1 ms at the rate is 125,000 B)
    # without the field the loopback is left alone and the catalog's intra-node link applies
    data = copy.deepcopy(raw())
    del data["links"]["same_node_mbit_per_s"]
    unshaped = parse_testbed(data)
    assert net.loopback_commands(unshaped, net.Names("sbx0a1f"), "a0") == []
    assert "same_node" not in cluster_spec(unshaped)["network"]


def test_a_slow_nic_caps_the_classes(box):
    data = copy.deepcopy(raw())
    data["nodes"][3]["nic_mbit_per_s"] = 20
    spec = sailor.load_cluster(cluster_spec(parse_testbed(data)))
    assert spec.link(LinkClass.SAME_CONTINENT).bandwidth_bytes_per_s == pytest.approx(payload_bytes_per_s(20))
    # the zone of the slow node only
    assert spec.link(LinkClass.SAME_ZONE, "us-west1-b").bandwidth_bytes_per_s == pytest.approx(payload_bytes_per_s(20))
    assert spec.link(LinkClass.SAME_ZONE, "us-central1-a").bandwidth_bytes_per_s == pytest.approx(
        payload_bytes_per_s(300))


def test_the_hosts_file_lists_the_nodes_addresses(box):
    addresses = {"a0": "10.200.1.2", "a1": "10.200.2.2", "b0": "10.200.3.2", "w0": "10.200.4.2"}
    hosts = parse_model(HostsFile, hosts_spec(box, addresses), "hosts.yaml")
    assert [(g.zone, g.gpu, g.gpus_per_node, g.hosts) for g in hosts.groups] == [
        ("us-central1-a", "A100-40", 2, ("10.200.1.2", "10.200.2.2")),
        ("us-central1-b", "V100-16", 1, ("10.200.3.2",)),
        ("us-west1-b", "V100-16", 1, ("10.200.4.2",))]


# ---- names, addresses, tc --------------------------------------------------------------------------
def test_names_carry_the_prefix_and_fit_an_interface_name():
    names = net.Names("sbx0a1f")
    for name in (names.node_veth("abcdef"), names.router_veth("abcdef")):
        assert name.startswith("sbx0a1f") and len(name) <= 15  # IFNAMSIZ - 1
    assert names.netns("a0") == "sbx0a1f-a0" and names.router == "sbx0a1f-rt"
    assert names.node_cgroup("a0") == "/sys/fs/cgroup/cpu/sbx0a1f/a0"
    with pytest.raises(AssertionError):
        net.Names("box")


def test_the_block_avoids_used_networks_and_other_testbeds():
    assert net.pick_block([]) == 200
    assert net.pick_block(["10.200.7.0/24", "192.0.2.2/24", "broadcast"]) == 201
    assert net.pick_block(["10.200.0.0/15"], taken=[202]) == 203  # 10.200-201 used, 202 another testbed's
    with pytest.raises(RuntimeError, match="no free"):
        net.pick_block(["10.0.0.0/8"])


def test_node_addresses():
    assert net.node_addresses(201, 2) == [("10.201.1.1", "10.201.1.2"), ("10.201.2.1", "10.201.2.2")]


def _rates(cmd):
    def bits(s):
        return int(s.removesuffix("bit"))
    return bits(cmd[cmd.index("rate") + 1]), bits(cmd[cmd.index("ceil") + 1])


def test_egress_shapes_the_nic_and_each_link_class(box):
    names = net.Names("sbx0001")
    peers = {"a1": "10.200.2.2", "b0": "10.200.3.2", "w0": "10.200.4.2"}
    cmds = net.egress_commands(box, names, "a0", peers)
    assert cmds[0][:4] == ["ip", "netns", "exec", "sbx0001-a0"]
    assert all(c[c.index("dev") + 1] == "sbx0001na0" for c in cmds)
    classes = {c[c.index("classid") + 1]: _rates(c) for c in cmds if "class" in c}
    nic = 300_000_000
    assert classes["1:1"] == (nic, nic)
    assert classes["1:10"][1] == nic  # same zone: min(400, NIC 300)
    assert classes["1:20"][1] == 200_000_000
    assert classes["1:30"][1] == 50_000_000
    children = [v for k, v in classes.items() if k != "1:1"]
    assert sum(rate for rate, _ in children) <= nic  # htb would overrun the NIC otherwise
    assert all(rate <= ceil for rate, ceil in children)
    filters = {c[c.index("dst") + 1]: c[c.index("flowid") + 1] for c in cmds if "filter" in c}
    assert filters == {"10.200.2.2/32": "1:10", "10.200.3.2/32": "1:20", "10.200.4.2/32": "1:30"}


def test_ingress_shapes_the_nic_on_the_router_side(box):
    cmds = net.ingress_commands(box, net.Names("sbx0001"), "w0")
    assert cmds[0][:4] == ["ip", "netns", "exec", "sbx0001-rt"]
    assert all(c[c.index("dev") + 1] == "sbx0001rw0" for c in cmds)
    assert _rates(cmds[1]) == (300_000_000, 300_000_000)


def test_links_turn_segmentation_offload_off():
    (add,) = [c for c in net.node_link_commands(net.Names("sbx0001"), "a0", "10.200.1.1", "10.200.1.2")
              if c[:3] == ["ip", "link", "add"]]
    assert add.count("gso_max_segs") == 2  # both ends


def test_the_cgroups_weigh_the_testbed_above_other_tasks_and_cap_each_rank(tmp_path, monkeypatch, box):
    prefix = "sbx00aa"
    monkeypatch.setattr(net, "CGROUP_CPU", str(tmp_path))  # plain folders stand in for the cgroup files
    nodes = tuple(host.NodeState(name=n.name, netns=f"{prefix}-{n.name}", veth=f"{prefix}n{n.name}", address="",
                                 router_address="", cgroup=f"{tmp_path}/{prefix}/{n.name}") for n in box.nodes)
    state = host.TestbedState(name="box", prefix=prefix, block=200, folder=str(tmp_path / "state"), nodes=nodes)
    cgroups.create_cgroups(box, state)
    top = tmp_path / prefix
    assert (top / "cpu.shares").read_text() == "10240"  # ten tasks' weight, not enough to starve kernel threads
    for n in box.nodes:
        assert not (top / n.name / "cpu.cfs_quota_us").exists()  # the node's own: no quota
        for k in range(n.ranks):  # fast 0.3 cores: 1000 of 3334 µs; slow 0.15: 1000 of 6667 µs
            rank = top / n.name / f"r{k}"
            period = {"fast": "3334", "slow": "6667"}[n.device]
            assert (rank / "cpu.cfs_period_us").read_text() == period and (rank / "cpu.cfs_quota_us").read_text() == "1000"
        assert not (top / n.name / f"r{n.ranks}").exists()
    assert not (top / "comm-threads" / "cpu.cfs_quota_us").exists()  # no comm_cpu_quota: no limit
    assert (top / "comm-threads" / "cpu.shares").read_text() == "262144"  # outweighs every node's ranks


def test_cpu_quota():
    assert net.cpu_quota_us(0.45, 10_000) == 4500
    assert net.cpu_quota_us(2 * 0.3, 5000) == 3000


# ---- state bookkeeping ----------------------------------------------------------------------------
def _state(tmp_path, name="box", prefix="sbx00aa", block=200):
    nodes = tuple(host.NodeState(name=n, netns=f"{prefix}-{n}", veth=f"{prefix}n{n}", address=f"10.{block}.{i + 1}.2",
                                 router_address=f"10.{block}.{i + 1}.1", cgroup=f"/sys/fs/cgroup/cpu/{prefix}/{n}")
                  for i, n in enumerate(["a", "b"]))
    return host.TestbedState(name=name, prefix=prefix, block=block, folder=str(tmp_path / name), nodes=nodes)


def _save(state):
    Path(state.folder).mkdir(parents=True)
    (Path(state.folder) / "state.json").write_text(state.to_json())


def test_the_state_round_trips_and_is_found(tmp_path):
    one, two = _state(tmp_path), _state(tmp_path, "pair", "sbx00bb", 201)
    _save(one)
    _save(two)
    assert host.live_states(tmp_path) == [one, two]
    assert host.find_state("pair", tmp_path) == two
    assert host.locate("root@10.201.2.2", tmp_path) == (two, two.nodes[1])
    with pytest.raises(SailorInputError, match="more than one testbed node has the address or name 'a'"):
        host.locate("a", tmp_path)
    with pytest.raises(SailorInputError, match="no testbed node"):
        host.locate("10.9.9.9", tmp_path)
    with pytest.raises(SailorInputError, match="no testbed 'gone' is up"):
        host.find_state("gone", tmp_path)
    assert host.live_states(tmp_path / "none") == []


def test_owner_records_tell_a_live_testbed_of_another_state_folder(tmp_path):
    from sailor.testbed.state import forget_owner, owned, record_owner
    owners, one = tmp_path / "owners", _state(tmp_path / "a")
    assert not owned(one.prefix, owners)  # no record: a stray, which `down --all` removes
    _save(one)
    record_owner(one, owners)
    assert owned(one.prefix, owners) and not owned("sbx00bb", owners)
    (Path(one.folder) / "state.json").unlink()  # its state folder deleted: a stray again
    assert not owned(one.prefix, owners)
    (Path(one.folder) / "state.json").write_text(one.to_json())
    assert owned(one.prefix, owners)
    forget_owner(one.prefix, owners)
    forget_owner(one.prefix, owners)  # twice is fine
    assert not owned(one.prefix, owners)


def test_the_state_folder_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(host.STATE_DIR_ENV, str(tmp_path))
    assert host.state_root() == tmp_path
    assert host.state_root("/x") == Path("/x")
    monkeypatch.delenv(host.STATE_DIR_ENV)
    assert host.state_root() == Path("/run/sailor-testbed")


def test_the_prefix_pattern_takes_only_testbed_names():
    assert net.PREFIX_PATTERN.match("sbx1f2e-a0") and net.PREFIX_PATTERN.match("sbx1f2ena0")
    assert not net.PREFIX_PATTERN.match("sbxzz00-a") and not net.PREFIX_PATTERN.match("eth0")


# ---- the stand-in ssh ----------------------------------------------------------------------------
def test_ssh_arguments_as_the_launcher_passes_them():
    from sailor.launch.torchrun import ssh_argv
    argv = ssh_argv("root@10.200.1.2", "echo hi; torchrun x")
    assert parse(argv[1:]) == (None, "root@10.200.1.2", "bash -c 'echo hi; torchrun x'")
    assert parse(["--state-dir", "/s", "-tt", "a", "true"]) == ("/s", "a", "true")
    with pytest.raises(SailorInputError, match="a destination and a command"):
        parse(["-o", "BatchMode=yes", "--", "a"])


def test_the_rank_slot_of_a_process():
    run = {"TORCHELASTIC_RUN_ID": "x"}
    assert cgroups.rank_slot({**run, "LOCAL_RANK": "1"}) == 1
    # a node with two agents: the second agent's local rank 0 is the node's device 2
    assert cgroups.rank_slot({**run, "LOCAL_RANK": "0", AGENT_SLOTS_ENV: "2,3"}) == 2
    assert cgroups.rank_slot({**run, "LOCAL_RANK": "1", AGENT_SLOTS_ENV: "2,3"}) == 3
    # on CPU no CUDA_VISIBLE_DEVICES: the agent's slots alone decide
    assert cgroups.rank_slot({**run, "LOCAL_RANK": "0", AGENT_SLOTS_ENV: "1", "CUDA_VISIBLE_DEVICES": "0"}) == 1
    assert cgroups.rank_slot({"LOCAL_RANK": "0"}) is None  # not started by torchrun
    assert cgroups.rank_slot({**run}) is None  # the agent itself
    assert cgroups.rank_slot({**run, "LOCAL_RANK": "4", AGENT_SLOTS_ENV: "0"}) is None


# ---- profiles of the device classes ---------------------------------------------------------------
def _profile(scale: float) -> dict:
    return {"schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32",
            "device": "cpu", "layers": [{"gpu": "cpu", "tp": 1, "mbs": m, "forward_s": [scale * m * 1e-3] * 6,
                                         "backward_s": [2 * scale * m * 1e-3] * 6} for m in (1, 2)],
            "optimizer": {"cpu": {"seconds_per_param": scale * 1e-9}},
            "memory": [{"gpu": "cpu", "tp": 1, "activation_bytes_per_sample": [1000.0] * 6}],
            "runtime": {"microbatch_overhead_s": [{"gpu": "cpu", "tp": 1, "seconds": scale * 1e-4}]}}


def test_class_profiles_become_one_profile_of_their_gpu_types():
    from sailor.perf.profiles import profiles_from_dict
    from sailor.specs import load_job
    from sailor.testbed.profile import merge, retag

    fast, slow = _profile(1.0), _profile(3.0)
    merged = merge([retag(fast, "A100-40"), retag(slow, "V100-16")])
    assert fast["optimizer"] == {"cpu": {"seconds_per_param": 1e-9}}  # the inputs stay as they were
    prof = profiles_from_dict(merged, "merged.json")
    job = load_job(ROOT / "examples" / "tiny_job.yaml")
    assert prof.optimizer_s_per_param == pytest.approx({"A100-40": 1e-9, "V100-16": 3e-9})
    assert {r["gpu"] for r in merged["layers"]} == {"A100-40", "V100-16"} and len(merged["layers"]) == 4
    prof.check_job(job, "merged.json")
    with pytest.raises(SailorInputError, match=r"GPU type\(s\) \['A100-40'\] measured twice"):
        merge([retag(fast, "A100-40"), retag(slow, "A100-40")])
    with pytest.raises(SailorInputError, match="expected a profile of GPU type 'cpu'"):
        retag(retag(fast, "A100-40"), "V100-16")
    other = {**_profile(1.0), "sequence_length": 32}
    with pytest.raises(SailorInputError, match="sequence_length 32 differs"):
        merge([retag(fast, "A100-40"), retag(other, "V100-16")])


def test_a_class_is_profiled_with_every_rank_of_its_node(box):
    from sailor.model.registry import get_model
    from sailor.testbed.profile import class_tps, profile_command
    # a TP group inside one node: fast nodes hold 2 ranks, slow ones 1; the tiny model's 4 heads
    assert class_tps(box, get_model("tiny")) == {"fast": [1, 2], "slow": [1]}
    three = box.model_copy(update={"nodes": tuple(n.model_copy(update={"ranks": 3}) for n in box.nodes)})
    assert class_tps(three, get_model("tiny")) == {"fast": [1, 2], "slow": [1, 2]}  # 3 does not divide 4 heads
    argv = profile_command("job.yaml", "/tmp/p.json", "1,2", python="/py")
    assert argv[:4] == ["/py", "-m", "sailor", "profile"]
    assert argv[argv.index("--tp") + 1] == "1" and argv[argv.index("--threads") + 1] == "1"
    assert argv[argv.index("--concurrency") + 1] == "1" and argv[argv.index("--mbs") + 1] == "1,2"
    argv = profile_command("job.yaml", "/tmp/p.json", "2", python="/py", tps=[1, 2], replicas=2)
    assert argv[argv.index("--tp") + 1] == "1,2" and argv[argv.index("--concurrency") + 1] == "2"


def test_each_round_measures_a_class_per_tp_degree_while_the_other_nodes_are_busy(box):
    from sailor.testbed.profile import profile_rounds

    tps = {"fast": [1, 2], "slow": [1]}
    # examples/testbed.yaml: a0, a1 fast; b0, w0 slow. TP 1: both classes in their first nodes at once
    assert profile_rounds(box, tps) == [{"a0": ("fast", 1), "a1": None, "b0": ("slow", 1), "w0": None},
                                        {"a0": ("fast", 2), "a1": None, "b0": None, "w0": None}]
    assert profile_rounds(box, tps, classes=["slow"]) == [{"a0": None, "a1": None, "b0": ("slow", 1), "w0": None}]
    assert profile_rounds(box, {"fast": [2], "slow": [1]}, classes=["fast"]) == [
        {"a0": ("fast", 2), "a1": None, "b0": None, "w0": None}]
    assert profile_rounds(box, tps, classes=[]) == []


class _FakePlaced:
    """Stands in for `profile._Placed`: a command that ends (exit 0, or `fail`) after `polls` polls."""
    started: list[list[str]] = []
    stopped: list[list[str]] = []
    polls = {"measure": 3, "busy": 1}
    fail: set[str] = set()

    def __init__(self, argv, node, env):
        self.argv, self.left = argv, self.polls[argv[0]]
        self.proc = self
        self.returncode = None
        self.started.append(argv)

    def poll(self):
        self.left -= 1
        if self.left < 0 and self.returncode is None:
            self.returncode = 1 if self.argv[0] in self.fail else 0
        return self.returncode

    def output(self):
        return f"output of {self.argv[1]}"

    def stop(self):
        self.stopped.append(self.argv)


def test_a_round_keeps_its_busy_nodes_busy_until_the_measured_ones_end(box, monkeypatch, tmp_path):
    from sailor.testbed import profile

    prefix = "sbx00ab"
    state = host.TestbedState(name="box", prefix=prefix, block=200, folder=str(tmp_path / "box"), nodes=tuple(
        host.NodeState(name=n, netns=f"{prefix}-{n}", veth=f"{prefix}n{n}", address=f"10.200.{i + 1}.2",
                       router_address=f"10.200.{i + 1}.1", cgroup=f"/sys/fs/cgroup/cpu/{prefix}/{n}")
        for i, n in enumerate(["a0", "a1", "w0"])))
    placed = []
    ranks = {"a0": 2, "a1": 2, "w0": 1}
    monkeypatch.setattr(profile, "_Placed", _FakePlaced)
    monkeypatch.setattr(profile, "place_ranks", lambda node, slot_of: placed.append(node.name))
    monkeypatch.setattr(profile, "PLACE_EVERY_S", 0.0)
    guards = []

    class FakeGuard:  # `guard.start`: watches this process while the round runs
        def __init__(self, pid, cgroups):
            self.pid, self.ended = pid, False
            guards.append(self)

        def kill(self):
            self.ended = True

        def wait(self):
            assert self.ended

    monkeypatch.setattr(profile.guard, "start", FakeGuard)
    _FakePlaced.started, _FakePlaced.stopped, _FakePlaced.fail = [], [], set()
    res = profile._run_round({"a0": ["measure", "a0"]}, {"a1": ["busy", "a1"], "w0": ["busy", "w0"]}, state, {}, 60, ranks)
    assert res == {"a0": (0, "output of a0")}
    assert [(g.pid, g.ended) for g in guards] == [(os.getpid(), True)]
    # the measured command polled 4 times (ends at the 4th); each busy one ended after 2 polls and was
    # started again, and every command was stopped at the end or when it ended
    assert _FakePlaced.started.count(["busy", "a1"]) == 2 and _FakePlaced.started.count(["measure", "a0"]) == 1
    assert len(_FakePlaced.stopped) == len(_FakePlaced.started)
    assert set(placed) == {"a0", "a1", "w0"}
    _FakePlaced.started, _FakePlaced.stopped, _FakePlaced.fail = [], [], {"busy"}
    with pytest.raises(RuntimeError, match="the load of node a1 failed: output of a1"):
        profile._run_round({"a0": ["measure", "a0"]}, {"a1": ["busy", "a1"]}, state, {}, 60, ranks)
    assert len(_FakePlaced.stopped) == len(_FakePlaced.started) == 2
    _FakePlaced.started, _FakePlaced.stopped, _FakePlaced.fail = [], [], set()
    with pytest.raises(RuntimeError, match="did not finish within -1 s"):
        profile._run_round({"a0": ["measure", "a0"]}, {}, state, {}, -1, ranks)
    assert _FakePlaced.stopped == [["measure", "a0"]]
    assert len(guards) == 3 and all(g.ended for g in guards)  # ended on failure too


def test_a_profiling_rank_runs_on_the_device_of_its_rank(monkeypatch):
    import subprocess
    import sys

    from sailor.runtime import ranks
    from sailor.testbed.profile import profile_rank_slot

    launched = []  # the argv `ranks.run_ranks` starts each rank with, caught before anything runs

    def refuse(argv, **kw):
        launched.append(argv)
        raise OSError("not started")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    with pytest.raises(OSError):
        ranks.run_ranks("sailor.runtime.profiler:profile_rank", 2, {}, port=1234)
    monkeypatch.undo()
    assert launched == [[sys.executable, "-m", "sailor.runtime.profiler", "sailor.runtime.profiler:profile_rank",
                         "0", "2", "1234"]]
    assert profile_rank_slot(launched[0]) == 0
    assert profile_rank_slot([*launched[0][:4], "1", "2", "1234"]) == 1
    # the 2 x TP ranks of the stage pass's fixed cost: on a node of one rank both share its cgroup
    passes = [*launched[0][:3], "sailor.runtime.profile_passes:rank_pass_overhead"]
    assert [profile_rank_slot([*passes, str(r), "2", "9"], 1) for r in (0, 1)] == [0, 0]
    assert [profile_rank_slot([*passes, str(r), "4", "9"], 2) for r in range(4)] == [0, 1, 0, 1]
    assert profile_rank_slot(["/py", "-m", "sailor.runtime.profiler", "sailor.runtime.netprofile:network_rank", "0", "2", "9"]) is None
    assert profile_rank_slot(["/py", "-m", "sailor", "profile", "--tp", "2"]) is None  # the driver
    assert profile_rank_slot(launched[0][:4]) is None


# ---- the command line on bad input (in-process: nothing is created, no process starts) ------------
def _cli(args, monkeypatch, capsys):
    import sys

    from sailor.cli import main
    monkeypatch.setattr(sys, "argv", ["sailor", *args])
    with pytest.raises(SystemExit) as e:
        main()
    return e.value.code, capsys.readouterr().err.splitlines()


def test_the_command_refuses_bad_input_in_one_line(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "tb.yaml"
    bad.write_text(BOX.read_text().replace("device: slow, ranks: 1, nic_mbit_per_s: 300}\n  - {name: w0",
                                           "device: medium, ranks: 1, nic_mbit_per_s: 300}\n  - {name: w0"))
    assert _cli(["testbed", "up", str(bad), "--state-dir", str(tmp_path / "s")], monkeypatch, capsys) == (
        2, [f"error: {bad}: nodes.2.device: unknown device class 'medium' (known: fast, slow)"])
    assert _cli(["testbed", "down", "--state-dir", str(tmp_path / "s")], monkeypatch, capsys) == (
        2, ["error: sailor testbed down: give FILE|NAME or --all (one of them)"])
    assert not (tmp_path / "s").exists()


def test_down_of_a_testbed_that_is_not_up_says_so_and_succeeds(tmp_path, monkeypatch, capsys):
    """`sailor testbed down` run twice: the second finds nothing to remove, which is what was asked
    (exit 0, one line naming the state folder and what is up there); a --state-dir that does not
    exist names no testbed at all (exit 2). Only a temporary state folder: taking a testbed down is
    stood in for (it removes the state file last), and the machine's support is not asked."""
    import sys

    from sailor import testbed
    from sailor.cli import main

    def down(state):
        Path(state.folder, "state.json").unlink()

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["sailor", "testbed", "down", *args])
        with pytest.raises(SystemExit) as e:
            main()
        out, err = capsys.readouterr()
        return e.value.code, out.splitlines(), err.splitlines()

    monkeypatch.setattr(host, "check_support", lambda: None)
    monkeypatch.setattr(testbed, "down", down)
    state = tmp_path / "s"
    _save(_state(state))
    _save(_state(state, "pair", "sbx00bb", 201))
    assert run("box", "--state-dir", str(state)) == (0, ["removed testbed box (sbx00aa)"], [])
    assert run("box", "--state-dir", str(state)) == (
        0, [f"testbed box is not up (state in {state}): nothing to remove; up there: pair"], [])
    assert [s.name for s in host.live_states(state)] == ["pair"]
    assert run("box", "--state-dir", str(tmp_path / "typo")) == (
        2, [], [f"error: --state-dir: {tmp_path / 'typo'} does not exist: no testbed was ever up there (name the"
                " folder `sailor testbed up` was given)"])


# ---- device speed as a deadline reservation -------------------------------------------------------
def test_the_deadline_reservation_is_the_quota_of_its_period():
    import struct

    from sailor.testbed import deadline

    # struct sched_attr, version 0: size, policy, flags, nice, priority, runtime, deadline, period
    size, policy, flags, nice, prio, runtime, dl, period = struct.unpack("=IIQiIQQQ", deadline.sched_attr(0.3, 500))
    assert (size, policy, flags, nice, prio) == (48, 6, 1, 0, 0)  # SCHED_DEADLINE, reset on fork
    assert (runtime, dl, period) == (150_000, 500_000, 500_000)  # 0.3 of 500 µs, in ns
    assert struct.unpack("=IIQiIQQQ", deadline.sched_attr(0.15))[5:] == (75_000, 500_000, 500_000)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="0 < cores <= 1"):
            deadline.sched_attr(bad)


def test_a_rank_cgroup_quota_in_cores(tmp_path):
    (tmp_path / "cpu.cfs_quota_us").write_text("1000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("3334\n")
    assert cgroups.quota_cores(str(tmp_path)) == pytest.approx(0.29994)
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroups.quota_cores(str(tmp_path)) is None


def test_reservations_beyond_the_kernels_deadline_bandwidth_are_refused(box, monkeypatch):
    from sailor.testbed import deadline

    monkeypatch.setattr(host.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(deadline, "bandwidth_limit", lambda cpus=None: 0.95 * cpus)
    host.check_cores(box)  # 4 x 0.3 + 2 x 0.15 = 1.5, and 4 nodes' guards of 0.02: 1.58 of 1.9: admitted
    monkeypatch.setattr(deadline, "bandwidth_limit", lambda cpus=None: 1.55)  # the ranks fit, with the guards not
    with pytest.raises(SailorInputError, match="add up to 1.58 cores, more than the 1.55"):
        host.check_cores(box)


def test_a_testbed_profile_keeps_the_stage_pass_and_transfer_costs_of_tp_1_only():
    from sailor.testbed.profile import tp1_pass_overhead

    rows = [{"gpu": "A100-40", "tp": 1, "forward_s": 2.5e-4, "backward_s": 4e-5},
            {"gpu": "A100-40", "tp": 2, "forward_s": 0.0, "backward_s": 4e-3},
            {"gpu": "V100-16", "tp": 1, "forward_s": 2.2e-4, "backward_s": 1.2e-4}]
    p2p = [{"gpu": "A100-40", "tp": 2, "seconds": 9e-3}, {"gpu": "A100-40", "tp": 1, "seconds": 2e-3}]
    out = tp1_pass_overhead({"runtime": {"pass_overhead_s": rows, "p2p_overhead_s": p2p,
                                         "microbatch_overhead_s": [{"gpu": "A100-40", "tp": 2}]}})
    assert out["runtime"]["pass_overhead_s"] == [rows[0], rows[2]]
    assert out["runtime"]["p2p_overhead_s"] == [p2p[1]]
    assert out["runtime"]["microbatch_overhead_s"] == [{"gpu": "A100-40", "tp": 2}]  # other rows stay
    assert tp1_pass_overhead({"layers": []}) == {"layers": []}


def test_a_state_folder_that_is_a_file_is_refused_in_one_line(tmp_path, monkeypatch):
    afile = tmp_path / "state.yaml"
    afile.write_text("x")
    with pytest.raises(SailorInputError, match="is not a folder") as e:
        host.state_root(afile)
    assert e.value.one_line().startswith("--state-dir: ")
    monkeypatch.setenv(host.STATE_DIR_ENV, str(afile))
    with pytest.raises(SailorInputError) as e:
        host.state_root()
    assert e.value.one_line().startswith(f"{host.STATE_DIR_ENV}: ")
    assert host.state_root(tmp_path / "new") == tmp_path / "new"  # missing: made by `up`


def test_a_device_holds_one_reservation_however_many_ranks_share_it(tmp_path, monkeypatch):
    node = host.NodeState(name="a0", netns="sbx00ab-a0", veth="sbx00aban0", address="10.200.1.2",
                          router_address="10.200.1.1", cgroup=str(tmp_path / "a0"))
    for d in ("a0", "a0/r0", "a0/r1"):
        (tmp_path / d).mkdir()
    (tmp_path / "a0" / "cgroup.procs").write_text("101\n102\n103\n")
    reserved: dict[str, list[int]] = {}
    monkeypatch.setattr(cgroups, "reserve", lambda tid, cg: reserved.setdefault(cg, []).append(tid))
    monkeypatch.setattr(cgroups, "reserved_threads", lambda cgs: [t for cg in cgs for t in reserved.get(cg, [])])
    slots = {"101": 0, "102": 0, "103": 1}  # two ranks on device 0 (a stage pass's 2·TP ranks at TP 2)
    assert cgroups.place_ranks(node, slots.get) == 3
    assert reserved == {cgroups.rank_cgroup(node, 0): [101], cgroups.rank_cgroup(node, 1): [103]}
