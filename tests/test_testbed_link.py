"""A testbed brought up for real (root, network namespaces, tc, cgroup v1; skipped, saying which is
missing, elsewhere): two nodes joined by one shaped cross-region link, two gloo ranks started by
`sailor launch --backend torchrun` through the stand-in ssh. The bytes crossing the link per
iteration equal what the simulator says crosses it (`Estimate.traffic`) with the TCP/IP overhead of
`spec.wire_bytes`, within 5 %; teardown leaves no namespace, link, cgroup, file or process."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import sailor
from sailor.runtime.post_thread import THREAD_NAME
from sailor.testbed import (
    counters,
    down,
    down_all,
    leftovers,
    load_testbed,
    support_problem,
    up,
)
from sailor.testbed.cgroups import comm_cgroup, rank_cgroup, reserved_threads
from sailor.testbed.host import live_states, processes
from sailor.testbed.spec import parse_testbed, wire_bytes

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = support_problem()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")]

# The tiny model (tied embedding): one stage on each node, DP 2 (the stage's all-reduce holds both
# copies of the token matrix: the LM head keeps its own), or two stages cut across the link (the
# activations, and the tied token matrix's gradient exchanged between the first and last stage).
TIED_JOB = {"model": "tiny", "global_batch_size": 8, "precision": "fp32", "optimizer": "adam"}
DP2 = {"micro_batch_size": 4, "stages": [[0, 6]],
       "pipelines": [{"microbatches": 1, "replicas": [{"stage": 0, "gpu": "A100-40", "zone": "us-central1-a", "tp": 1}]},
                     {"microbatches": 1, "replicas": [{"stage": 0, "gpu": "A100-40", "zone": "us-west1-b", "tp": 1}]}]}
PP2 = {"micro_batch_size": 4, "stages": [[0, 3], [3, 6]],
       "pipelines": [{"microbatches": 2, "replicas": [{"stage": 0, "gpu": "A100-40", "zone": "us-central1-a", "tp": 1},
                                                      {"stage": 1, "gpu": "A100-40", "zone": "us-west1-b", "tp": 1}]}]}


def pair_spec(name: str):
    data = yaml.safe_load((ROOT / "examples" / "testbed_pair.yaml").read_text())
    return parse_testbed({**data, "name": name})


def link_bytes(state) -> int:
    c = counters(state.node("a"))
    return c["tx_bytes"] + c["rx_bytes"]


@contextlib.contextmanager
def threads_seen(state):
    """(the names of the threads found in the testbed's `comm-threads` cgroup, the nodes whose rank
    cgroup `r0` held a thread under SCHED_DEADLINE) while the block runs (polled every 50 ms)."""
    seen: set[str] = set()
    reserved: set[str] = set()
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.05):
            with contextlib.suppress(OSError):
                for tid in Path(comm_cgroup(state.nodes[0]), "tasks").read_text().split():
                    with contextlib.suppress(OSError):
                        seen.add(Path(f"/proc/{tid}/comm").read_text().strip())
            reserved.update(node.name for node in state.nodes if reserved_threads([rank_cgroup(node, 0)]))

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield seen, reserved
    finally:
        done.set()
        t.join()


def launch(state, plan: Path, job: Path, steps: int, log: Path) -> None:
    env = {**os.environ, "PATH": f"{state.bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        p = subprocess.run([sys.executable, "-m", "sailor", "launch", str(plan), "--backend", "torchrun", "--job", str(job),
                            "--hosts", str(state.hosts_file), "--python", sys.executable, "--steps", str(steps),
                            "--device", "cpu", "--log-every", "0", "--timeout-s", "60"],
                           env=env, stdout=out, stderr=subprocess.STDOUT, timeout=110, check=False)
    assert p.returncode == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("layout,kinds", [(DP2, ["sync"]), (PP2, ["p2p", "sync"])], ids=["dp2", "pp2"])
def test_bytes_on_a_shaped_link_match_the_simulator(tmp_path, layout, kinds):
    state = up(pair_spec(f"ci{os.getpid() % 10000}"), tmp_path / "state")
    try:
        assert leftovers(state.prefix)  # it is there
        plan, job = tmp_path / "plan.json", tmp_path / "job.json"
        plan.write_text(json.dumps(layout))
        job.write_text(json.dumps(TIED_JOB))
        estimate = sailor.simulate(plan, job=job, cluster=state.cluster_file)
        assert [(c.zones, c.kind.value) for c in estimate.traffic] == [(("us-central1-a", "us-west1-b"), k) for k in kinds]
        payload = sum(c.moved_bytes for c in estimate.traffic)
        # Two launches, 1 and 4 steps: what they share (start, rendezvous, gloo's connections, the
        # end) cancels, 3 iterations remain.
        moved, posters = [], set()
        for steps in (1, 4):
            before = link_bytes(state)
            with threads_seen(state) as (comm, reserved):
                launch(state, plan, job, steps, tmp_path / f"launch{steps}.log")
            moved.append(link_bytes(state) - before)
            # gloo's socket loop and work threads ran outside the ranks' quotas (`cgroups.place_ranks`)
            assert {"gloo_tcp_loop", "pt_gloo_runloop"} <= comm, comm
            # each rank's compute thread ran under its device's deadline reservation (`testbed.deadline`)
            assert reserved == {n.name for n in state.nodes}, reserved
            posters |= comm & {THREAD_NAME}
            for node in state.nodes:  # the rank ran in its own cgroup, under its quota
                stat = dict(line.split() for line in Path(node.cgroup, "r0", "cpu.stat").read_text().splitlines())
                assert int(stat["nr_periods"]) > 0, node
        # and so did the thread that posts the pipeline's transfers (`runtime.post_thread`); it starts at
        # the first transfer, so the 50 ms poll can miss it in a 1-step run (CI did once): either launch
        assert posters == ({THREAD_NAME} if "p2p" in kinds else set()), posters
        measured = (moved[1] - moved[0]) / 3
        predicted = wire_bytes(payload)
        print(f"link bytes per iteration: measured {measured:.0f}, predicted {predicted:.0f}"
              f" ({payload:.0f} of payload: {[(c.kind.value, c.moved_bytes) for c in estimate.traffic]})")
        assert measured == pytest.approx(predicted, rel=0.05)
    finally:
        down(state)
    assert leftovers(state.prefix) == []
    assert not Path(state.folder).exists()


def test_up_again_and_down_all_remove_what_a_killed_run_left(tmp_path):
    spec = pair_spec(f"cj{os.getpid() % 10000}")
    first = up(spec, tmp_path / "state")
    # a run killed after up (its state file stays): the next `up` of the name removes it first
    second = up(spec, tmp_path / "state")
    try:
        assert leftovers(first.prefix) == [] and leftovers(second.prefix) != []
        # a process inside a node (what a killed launcher leaves running)
        sleeper = subprocess.Popen([sys.executable, "-m", "sailor", "testbed", "exec", "--state-dir",
                                    str(tmp_path / "state"), "b", "--", "sleep", "300"], env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 30
        while sleeper.pid not in processes(second.prefix) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeper.pid in processes(second.prefix)  # exec'd into the node: same pid, in its cgroup
        # a stray namespace with a testbed prefix and no state (a run killed before it wrote one)
        subprocess.run(["ip", "netns", "add", "sbxfff0-x"], check=True)
        (Path(second.folder) / "state.json").unlink()  # and a testbed whose state was lost
        assert live_states(tmp_path / "state") == []
        removed = down_all(tmp_path / "state")
        assert {"sbxfff0", second.prefix} <= set(removed)
    finally:
        subprocess.run(["ip", "netns", "del", "sbxfff0-x"], capture_output=True, check=False)
        if leftovers(second.prefix):
            down(second)
    assert leftovers("sbxfff0") == [] and leftovers(second.prefix) == []
    assert sleeper.wait(timeout=10) == -9  # killed by the sweep


def test_down_all_of_one_state_folder_leaves_the_testbeds_of_another_up(tmp_path):
    # `sailor testbed down --all --state-dir B` once removed every testbed on the machine, A's too
    other = up(pair_spec(f"ck{os.getpid() % 10000}"), tmp_path / "a")
    try:
        subprocess.run(["ip", "netns", "add", "sbxfff1-x"], check=True)  # a stray nobody owns
        removed = down_all(tmp_path / "b")
        assert "sbxfff1" in removed and other.prefix not in removed
        assert leftovers("sbxfff1") == [] and leftovers(other.prefix) != []
        assert [s.prefix for s in live_states(tmp_path / "a")] == [other.prefix]
    finally:
        subprocess.run(["ip", "netns", "del", "sbxfff1-x"], capture_output=True, check=False)
        down(other)
    assert leftovers(other.prefix) == []


def test_without_the_tools_it_says_so_in_one_line(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}  # no ip, no tc
    p = subprocess.run([sys.executable, "-m", "sailor", "testbed", "up", str(ROOT / "examples" / "testbed_pair.yaml")],
                       env=env, capture_output=True, text=True, check=False)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == ["error: sailor testbed: the testbed needs `ip` (iproute2) on PATH"]
    assert load_testbed(ROOT / "examples" / "testbed_pair.yaml").name == "pair"


def test_a_failing_up_removes_what_it_made(tmp_path, monkeypatch):
    from sailor.testbed import host, net

    def broken(*args, **kwargs):  # the last node's shaping fails, after every namespace and veth exists
        return [["ip", "netns", "exec", "sbx0000-none", "tc", "qdisc", "show"]]

    monkeypatch.setattr(net, "ingress_commands", broken)
    made = []
    real_plan = host._plan_state
    monkeypatch.setattr(host, "_plan_state", lambda *a: made.append(real_plan(*a)) or made[-1])
    with pytest.raises(RuntimeError, match="sbx0000-none"):
        up(pair_spec(f"ck{os.getpid() % 10000}"), tmp_path / "state")
    (state,) = made
    assert leftovers(state.prefix) == [] and live_states(tmp_path / "state") == []


def test_ctrl_c_during_up_removes_what_it_made(tmp_path, monkeypatch):
    from sailor.testbed import host

    calls = []
    real_run, real_plan = host.run, host._plan_state

    def interrupted(argv):  # Ctrl-C arrives at the 12th ip/tc command (namespaces and veths exist)
        calls.append(argv)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return real_run(argv)

    made = []
    monkeypatch.setattr(host, "run", interrupted)
    monkeypatch.setattr(host, "_plan_state", lambda *a: made.append(real_plan(*a)) or made[-1])
    with pytest.raises(KeyboardInterrupt):
        up(pair_spec(f"cl{os.getpid() % 10000}"), tmp_path / "state")
    assert len(calls) == 12 and leftovers(made[0].prefix) == [] and live_states(tmp_path / "state") == []
