"""Live switches on named machines (`sailor run --hosts`, `elastic.inplace` with a `remote.HostPool`).

Unit tests (no process): where a pool's ranks go on the machines (`HostPool.place`,
`inplace.on_machines`), the epoch file's hosts and rendezvous (`runtime.epochs`), the ssh command of
one pool process and the environment it carries, the testbed's slot of one, the machine each
failure on the live path leaves out, and what the start timeout covers.

Integration tests on the testbed (root, network namespaces; skipped, saying which is missing,
elsewhere), through its stand-in ssh: a live shrink from two nodes to one, and a live grow whose
newcomer on the second node dies mid-move (the checkpoint fallback, without that node). With
test_elastic_hosts' stand-in ssh on 127.0.0.x: a live grow onto a host ssh cannot reach.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import own_processes

from sailor.core.errors import SailorInputError
from sailor.elastic.remote import HostPool
from sailor.plan.spec import Plan
from sailor.runtime import epochs
from sailor.specs.cluster import ClusterSpec
from sailor.testbed import support_problem

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = support_problem()
CLUSTER = ClusterSpec(provider="local", zones={"local": {"cpu": 6}}, gpus_per_node={"cpu": 2})
HOSTS = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def _pool(tmp_path: Path) -> HostPool:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump({"groups": [{"zone": "local", "gpu": "cpu", "hosts": HOSTS, "user": "me"}]}))
    return HostPool.load(hosts, CLUSTER, python="/opt/py/bin/python", rdzv_port=29100)


def _dp(ranks: int) -> Plan:
    """`ranks` data-parallel replicas of the tiny model on GPU type cpu (nodes of 2 ranks)."""
    return Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 6]], "pipelines": [
        {"microbatches": 1, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}] * ranks})


def m(i: int) -> tuple[str, str, int]:
    return ("local", "cpu", i)


def test_nodes_go_to_the_machines_holding_the_most_processes(tmp_path):
    """`HostPool.place`: the fuller node first, on the usable machine with the most live processes;
    among equals the first in file order; lost machines never; too few usable machines refused."""
    pool = _pool(tmp_path)
    three = _dp(3)  # node local/cpu/0 holds ranks 0, 1; node 1 holds rank 2
    assert pool.place(three, set(), Counter()) == {"local/cpu/0": m(0), "local/cpu/1": m(1)}
    assert pool.place(three, set(), Counter({m(2): 2, m(1): 1})) == {"local/cpu/0": m(2), "local/cpu/1": m(1)}
    assert pool.place(three, {m(2)}, Counter({m(2): 2, m(1): 1})) == {"local/cpu/0": m(1), "local/cpu/1": m(0)}
    with pytest.raises(SailorInputError, match="more cpu machines in local than are usable"):
        pool.place(_dp(4), {m(0), m(2)}, Counter())


def test_survivors_keep_their_process_newcomers_start_on_their_machine_and_leavers_stay_as_spares(tmp_path):
    """`inplace.on_machines` for a shrink 4 -> 2 (machine 0 keeps both its ranks, machine 1's two
    processes stay there as spares; they leave only when machine 1 is lost), the grow back 2 -> 4
    (machine 1's spares take ranks 2 and 3: no process starts), a grow 2 -> 4 without spares (two
    fresh processes start on machine 1), and a change where a lost machine's ranks come back on a
    spare machine."""
    from sailor.elastic.inplace import on_machines

    pool = _pool(tmp_path)
    four = {0: (0, m(0)), 1: (1, m(0)), 2: (2, m(1)), 3: (3, m(1))}
    assert on_machines(pool, _dp(2), set(), four, [], 4) == ({0: 0, 1: 1}, [], [])
    assert on_machines(pool, _dp(2), {m(1)}, four, [], 4) == ({0: 0, 1: 1}, [], [2, 3])
    kept = {0: (0, m(0)), 1: (1, m(0))}
    # the spares' machine holds more processes than machine 2: the second node goes there, to them in order
    assert on_machines(pool, _dp(4), set(), kept, [(3, m(1)), (2, m(1))], 4) == ({0: 0, 1: 1, 3: 2, 2: 3}, [], [])
    # one spare left on machine 1 (the other died, dropped): it takes rank 2, one fresh process rank 3
    assert on_machines(pool, _dp(4), set(), kept, [(2, m(1))], 4) == ({0: 0, 1: 1, 2: 2, 4: 3}, [m(1)], [])
    two = {0: (0, m(0)), 1: (1, m(0))}
    assert on_machines(pool, _dp(4), set(), two, [], 4) == ({0: 0, 1: 1, 4: 2, 5: 3}, [m(1), m(1)], [])
    # machine 1 holds two processes: it gets the fuller node (ranks 0 and 1, taken in old-rank order)
    moved = {5: (0, m(2)), 7: (1, m(1)), 8: (2, m(1))}
    assert on_machines(pool, _dp(3), set(), moved, [], 9) == ({7: 0, 8: 1, 5: 2}, [], [])
    # a spare on a machine in use takes a rank there before a fresh process would start
    assert on_machines(pool, _dp(4), set(), two, [(2, m(1))], 3) == ({0: 0, 1: 1, 2: 2, 3: 3}, [m(1)], [])
    # machine 1 lost: the plan's second node goes to machine 2, fresh
    assert on_machines(pool, _dp(4), {m(1)}, two, [], 4)[1] == [m(2), m(2)]


def test_a_spare_that_exits_is_dropped_but_a_rank_or_a_leaver_mid_move_fails_the_run():
    """`inplace.busy`: the processes whose exit fails the run. Processes 0..3; the latest epoch's ranks
    are processes 0 and 1."""
    from sailor.elastic.inplace import busy

    latest = {0: 0, 1: 1}
    assert busy(latest, {}, {}) == {0, 1}  # 2 and 3 are spares: their exit drops them
    # a shrink 4 -> 2 under way (no step under the new plan yet): 2 and 3 may still send their state
    assert busy(latest, {0: 0, 1: 1, 2: 2, 3: 3}, {}) == {0, 1, 2, 3}
    # a grow prepared, not published: spare 3 was handed rank 2
    assert busy(latest, {}, {0: 0, 1: 1, 3: 2}) == {0, 1, 3}


def test_an_epoch_on_named_machines_says_where_each_group_meets(tmp_path):
    """The epoch file keeps hosts, port and leavers; a group's store is a FileStore in the control
    folder on this machine, else a TCP store on the host of its first process, a fresh port for each
    store until the ports run round (`epochs.PORTS`)."""
    e = epochs.Epoch(3, ["--steps=3"], {4: 1, 2: 0}, "/p/old.json", {2: 0, 3: 1}, {2: "10.0.0.1", 4: "::1", 3: "b"},
                     29100, (3,))
    epochs.publish(tmp_path, e)
    assert epochs.read(tmp_path, 3) == e and e.first == 2
    assert epochs.init_method(tmp_path, e, "move", 4) == f"tcp://[::1]:{29100 + 7}"
    assert epochs.init_method(tmp_path, e, "train", e.first) == f"tcp://10.0.0.1:{29100 + 6}"
    local = epochs.Epoch(3, [], {0: 0})
    assert epochs.init_method(tmp_path, local, "move", 0) == f"file://{tmp_path / 'epoch-0003.move'}"
    ports = [epochs.store_port(29100, k, name) for k in range(epochs.PORTS // 2) for name in epochs.STORES]
    assert sorted(ports) == list(range(29100, 29100 + epochs.PORTS))
    assert epochs.store_port(29100, epochs.PORTS // 2, "train") == 29100


def test_a_pool_process_runs_in_place_of_the_login_shell_with_its_slot(tmp_path):
    from sailor.launch.torchrun import ssh_argv
    from sailor.runtime.launcher import EVENT_PREFIX

    pool = _pool(tmp_path)
    argv = pool.process_command(m(1), ["/opt/py/bin/python", "-m", "sailor.runtime.inplace", "/ck/control/x", "5", "2"],
                                {"SAILOR_SLOT": "1"}, 5)
    event = shlex.quote(EVENT_PREFIX + json.dumps({"event": "node_up", "node": 5}))
    assert argv == ssh_argv("me@10.0.0.2", f"echo {event}; exec env SAILOR_SLOT=1 /opt/py/bin/python -m"
                                           f" sailor.runtime.inplace /ck/control/x 5 2")
    with pytest.raises(SailorInputError, match="--rdzv-port: must be a TCP port from 1 to 65504"):
        HostPool.load(pool.source, CLUSTER, rdzv_port=65505)


def test_a_pool_process_gets_its_environment_and_the_fault_hook_in_its_command(tmp_path):
    """ssh forwards no environment: a pool process's slot, one OpenMP thread and the move's fault hook
    (when the controller has it set) travel in its command; nothing else of the controller's does."""
    from sailor.elastic.inplace import remote_env

    base = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", epochs.SLOT_ENV: "1"}
    assert remote_env(1, {"PATH": "/bin", "OMP_NUM_THREADS": "8"}) == base
    assert remote_env(1, {"PATH": "/bin", epochs.FAULT_MOVE_ENV: "3:2"}) == {**base, epochs.FAULT_MOVE_ENV: "3:2"}
    argv = _pool(tmp_path).process_command(m(0), ["python"], remote_env(0, {epochs.FAULT_MOVE_ENV: "3:2"}), 3)
    assert f"{epochs.FAULT_MOVE_ENV}=3:2" in argv[-1] and "PATH" not in argv[-1]


def _ended(nodes, events=(), failed=(), first=None, killed=""):
    """A live pool on the machines that ended (what `controller._ended` reads of it)."""
    from types import SimpleNamespace

    from sailor.elastic.remote import NodeLaunch
    from sailor.runtime.launcher import ExitStatus, TrainResult

    machines, rank_machine = nodes
    launch = NodeLaunch(commands=[[]] * len(machines), hosts=[HOSTS[x[2]] for x in machines],
                        node_machine=list(machines), rank_machine=rank_machine)
    result = TrainResult(ExitStatus.FAILED, "", events=[{"event": "node_up", "node": n} if isinstance(n, int) else n
                                                        for n in events], failed=list(failed), failed_process=first)
    return SimpleNamespace(nodes=launch, result=result, killed=killed)


def test_a_rank_that_exits_without_an_error_is_named_with_its_process_last_line():
    """A live pool's rank 0 on a host ssh cannot resolve exits 255 without an error event: the
    message names the rank and carries ssh's own line (it said only "rank 0 exited with status 255")."""
    from sailor.runtime.launcher import TrainResult, finish_result

    ssh = "process 0 on nc.invalid exited with status 255: ssh: Could not resolve hostname nc.invalid"
    res = TrainResult(status=None, message="", failed=[("0", "255")], process_failure=ssh)
    assert finish_result(res, 255, 0, "").message == f"training failed (rank 0 exited with status 255: {ssh});" \
                                                       " all ranks stopped"
    # aborted (no process of its own failed): the rank alone
    res = TrainResult(status=None, message="", failed=[("0", "255")], process_failure="aborted")
    assert finish_result(res, 255, 0, "").message == "training failed (rank 0 exited with status 255); all ranks stopped"


def test_a_failure_on_the_live_path_leaves_out_the_machine_that_failed():
    """`launches.failed_machines` for a live pool (one "node" per process, ranks of the latest
    epoch): 2 processes, 0 on machine 0 (rank 0), 1 on machine 1."""
    from sailor.elastic.launches import START_TIMEOUT, dead_ranks, failed_machines
    from sailor.runtime.launcher import finish_result

    def left_out(run) -> set:
        return failed_machines(run, dead_ranks(run.result))

    both = ([m(0), m(1)], {0: m(0), 1: m(1)})
    # ssh could not reach machine 1 at the start: its process exits 255 without saying it is up
    assert left_out(_ended(both, [0], failed=[("1", "255")], first=1)) == {m(1)}
    # machine 1 accepts ssh but never runs the command: the start timeout ends the pool
    timeout = f"{START_TIMEOUT} within 20 s on 10.0.0.1, 10.0.0.2"
    assert left_out(_ended(both, [0, {"event": "joined", "rank": 0}], killed=timeout)) == {m(1)}
    # the same at a grow from machine 0 to both: process 1 started for the switch, no rank yet
    grow = ([m(0), m(1)], {0: m(0)})
    assert left_out(_ended(grow, [0, {"event": "joined", "rank": 0}], killed=timeout)) == {m(1)}
    # ... or it exits 255 (unreachable) before the switch is published
    assert left_out(_ended(grow, [0, {"event": "joined", "rank": 0}], failed=[("", "255")], first=1)) == {m(1)}
    # (the message names the process and its host, which has no rank yet)
    unreachable = _ended(grow, failed=[("", "255")], first=1).result
    unreachable.process_failure = "process 1 on 10.0.0.2 exited with status 255: ssh: connect to host 10.0.0.2"
    assert finish_result(unreachable, 255, 0, "").message == f"training failed ({unreachable.process_failure});" \
                                                              " all ranks stopped"
    # a shrink to machine 0: process 1, which leaves and sends its state, dies during the move; rank 0
    # reports the lost peer
    lost_peer = {"event": "error", "rank": 0, "peer_lost": True}
    assert left_out(_ended(grow, [0, 1, lost_peer], failed=[("", "13"), ("0", "1")], first=1)) == {m(1)}
    # machine 1 goes down whole mid-run (its two ranks killed), machine 0's ranks report the lost peer
    four = ([m(0), m(0), m(1), m(1)], {0: m(0), 1: m(0), 2: m(1), 3: m(1)})
    down = [0, 1, 2, 3, {**lost_peer, "rank": 0}, {**lost_peer, "rank": 1}]
    assert left_out(_ended(four, down, failed=[("2", "-9"), ("3", "-9"), ("0", "1"), ("1", "1")], first=2)) == {m(1)}


def test_the_start_timeout_covers_a_launch_and_a_live_switchs_new_processes():
    """`launches.starting_since`: a launch until its process groups form; a live switch from its
    request until its epoch is published; a restart-path switch's stop and a published live switch
    are not starts."""
    from types import SimpleNamespace

    from sailor.elastic.launches import Switch, starting_since

    run = SimpleNamespace(started=False, launched_at=5.0)
    assert starting_since(run, None) == 5.0
    run.started = True
    assert starting_since(run, None) is None
    live = Switch("gain", began=9.0, stop_requested=10.0, in_place=True)
    assert starting_since(run, live) == 10.0
    live.published = 12.0
    assert starting_since(run, live) is None
    assert starting_since(run, Switch("gain", began=9.0, stop_requested=10.0)) is None


def test_a_switch_still_under_way_when_the_job_ends_is_reported_interrupted():
    """`Controller._finish`: the job's last step came before a live switch's first step; the switch
    ends with an interrupted `switch_finished` before the final event, and a run without one gets
    none."""
    from types import SimpleNamespace

    from sailor.elastic.controller import Controller
    from sailor.elastic.events import EventLog
    from sailor.elastic.launches import Switch
    from sailor.elastic.options import ExitStatus, RunResult

    clock = SimpleNamespace(wall_s=lambda: 1.0, trace_s=lambda: 2.0)
    for switch, expected in ((Switch("lost GPUs", began=1.0, in_place=True), ["switch_finished", "done"]),
                             (None, ["done"])):
        me = SimpleNamespace(switch=switch, log=EventLog(None, clock),
                             result=RunResult(ExitStatus.FAILED, "", steps=60, switches=1))
        me._interrupt_switch = lambda me=me: Controller._interrupt_switch(me)
        assert Controller._finish(me, ExitStatus.DONE, "done: 60 steps") is True
        assert [r["event"] for r in me.log.records] == expected
        assert me.switch is None and me.result.status is ExitStatus.DONE and me.result.switches == 1
        if switch is not None:
            assert me.log.records[0]["interrupted"] is True and me.log.records[0]["reason"] == "lost GPUs"


def test_the_testbed_puts_a_pool_process_under_its_slots_quota():
    from sailor.testbed.cgroups import rank_slot

    assert rank_slot({epochs.SLOT_ENV: "1", "LOCAL_RANK": "3"}) == 1
    assert rank_slot({"LOCAL_RANK": "3"}) is None  # not started by torchrun, no slot: not a rank


def _on_the_testbed_pair(tmp_path: Path, steps: int, checkpoint_every: int, b_offered: tuple[int, int]):
    """Run `steps` steps of the tiny model (global batch 8) on examples/testbed_pair.yaml (node a in
    us-central1-a, node b in us-west1-b, 100 Mbit/s apart, one A100-40 each, run as gloo processes;
    a profile whose passes take 20 and 40 ms per sample and layer, so that the planner uses both)
    through the testbed's stand-in ssh, the trace offering a's GPU throughout and b's
    `b_offered[0]`, then `b_offered[1]` after 4 steps. Checks that no process of the run and nothing
    of the testbed is left; returns (RunResult, events, node a's address, node b's)."""
    from test_elastic_inplace import _gone, _lines

    from sailor.elastic.availability import load_trace
    from sailor.elastic.controller import run
    from sailor.elastic.events import ClockKind
    from sailor.elastic.options import RunOptions
    from sailor.specs import load_cluster
    from sailor.specs.job import JobSpec
    from sailor.testbed import down, leftovers, up
    from sailor.testbed.spec import parse_testbed

    data = yaml.safe_load((ROOT / "examples" / "testbed_pair.yaml").read_text())
    state = up(parse_testbed({**data, "name": f"lh{os.getpid() % 10000}"}), tmp_path / "state")
    try:
        cluster = load_cluster(state.cluster_file)
        trace = tmp_path / "trace.json"
        trace.write_text(json.dumps([{"time_s": t, "zone": z, "gpu": "A100-40", "count": n} for t, z, n in (
            (0, "us-central1-a", 1), (0, "us-west1-b", b_offered[0]), (4, "us-west1-b", b_offered[1]))]))
        pool = HostPool.load(state.hosts_file, cluster, python=sys.executable, ssh=str(state.bin_dir / "ssh"))
        profile = tmp_path / "profile.json"
        profile.write_text(json.dumps({
            "schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32", "device": "cpu",
            "layers": [{"gpu": "A100-40", "tp": 1, "mbs": m, "forward_s": [0.02 * m] * 6, "backward_s": [0.04 * m] * 6}
                       for m in (1, 2, 4)],
            "optimizer": {"A100-40": {"seconds_per_param": 1e-9}},
            "memory": [{"gpu": "A100-40", "tp": 1, "activation_bytes_per_sample": [1000.0] * 6}]}))
        with own_processes() as alive:
            res = run(RunOptions(job=JobSpec(model="tiny", global_batch_size=8), cluster=cluster,
                                 trace=load_trace(trace, cluster), steps=steps, checkpoint_dir=str(tmp_path / "ck"),
                                 checkpoint_every=checkpoint_every, metrics=str(tmp_path / "m.jsonl"),
                                 events=str(tmp_path / "e.jsonl"), clock=ClockKind.STEPS, switch_cost_s=0.0, hosts=pool,
                                 timeout_s=60.0, profiles=str(profile)))
            assert _gone(alive), alive()
    finally:
        down(state)
    assert leftovers(state.prefix) == []
    a, b = (next(n.address for n in state.nodes if n.name == name) for name in ("a", "b"))
    return res, _lines(tmp_path / "e.jsonl"), a, b


@pytest.mark.integration
@pytest.mark.skipif(PROBLEM is not None, reason=f"the testbed needs {PROBLEM}")
def test_a_live_shrink_across_two_testbed_nodes(tmp_path, reference_losses, monkeypatch):
    """`_on_the_testbed_pair`, b's GPU taken away: the switch is live: rank 0 keeps its process on
    node a, node b's process sends its state and stays there as a spare until the run ends (no
    process left: `_on_the_testbed_pair`); the losses equal the single-process reference within
    1e-5, each step once."""
    from test_elastic_inplace import _check_losses

    from sailor.runtime.launcher import ExitStatus

    monkeypatch.setenv("SAILOR_IGNORE_TAGS", "1")
    steps = 8
    res, ev, a, b = _on_the_testbed_pair(tmp_path, steps, checkpoint_every=4, b_offered=(1, 0))
    assert res.status is ExitStatus.DONE, res.message
    launches = [e for e in ev if e["event"] == "launch"]
    assert [(e["world_size"], sorted(e["hosts"])) for e in launches] == [(2, sorted([a, b]))]
    (finished,) = [e for e in ev if e["event"] == "switch_finished"]
    assert (finished["reason"], finished["world_size"], finished["in_place"]) == ("lost GPUs", 1, True)
    assert (finished["survivors"], finished["survivors_restarted"], finished["spares_used"]) == (1, 0, 0)
    assert res.switches == 1 and res.crashes == 0 and res.steps_rolled_back == 0
    _check_losses(tmp_path / "m.jsonl", steps, reference_losses)


@pytest.mark.integration
@pytest.mark.skipif(PROBLEM is not None, reason=f"the testbed needs {PROBLEM}")
def test_a_process_dying_mid_move_across_testbed_nodes_falls_back_to_a_checkpoint(tmp_path, reference_losses,
                                                                                     monkeypatch):
    """`_on_the_testbed_pair`, b's GPU offered after 4 steps: the live grow starts process 1 on node b
    (new rank 1), which dies once the switch's move group has formed, before it has received its
    state from node a (the fault hook reaches it in its ssh command). The pool ends, rank 1's
    machine b is left out (node a's rank reported the lost peer) and the run restarts on node a from
    the newest checkpoint; the kept trajectory is the reference's, the steps after that checkpoint
    trained again on the same samples."""
    from test_elastic_inplace import _check_losses

    from sailor.runtime.launcher import ExitStatus
    from sailor.runtime.worker import SLOW_WRITER_ENV

    monkeypatch.setenv("SAILOR_IGNORE_TAGS", "1")
    monkeypatch.setenv(epochs.FAULT_MOVE_ENV, "1:1")
    # Node a trains on while b's process starts (seconds): its checkpoints, every 2 steps, are slowed so
    # that the run does not end first (the testbed's ssh passes the environment on, as real ssh does not)
    monkeypatch.setenv(SLOW_WRITER_ENV, "0:0.6")
    steps, every = 60, 2
    res, ev, a, b = _on_the_testbed_pair(tmp_path, steps, checkpoint_every=every, b_offered=(0, 1))
    assert res.status is ExitStatus.DONE, res.message
    (crash,) = [e for e in ev if e["event"] == "crash"]
    assert (crash["ranks"], crash["hosts"]) == ([1], [b]) and "exited with status 13" in crash["message"], crash
    launches = [e for e in ev if e["event"] == "launch"]
    assert [(e["world_size"], e["hosts"]) for e in launches] == [(1, [a]), (1, [a])]
    boundary = crash["last_step"]
    resumed = boundary - boundary % every
    assert launches[1]["resume_step"] == resumed and res.steps_rolled_back == boundary - resumed
    assert res.crashes == 1
    _check_losses(tmp_path / "m.jsonl", steps, reference_losses, redone=boundary - resumed)


@pytest.mark.integration
def test_a_live_grow_onto_an_unreachable_host_falls_back_without_it(tmp_path, monkeypatch, reference_losses):
    """test_elastic_hosts' stand-in ssh (127.0.0.x, 2 GPUs each), which cannot connect to 127.0.0.2
    (exit 255, as ssh): the run starts on 127.0.0.1 with 2 GPUs; when 4 are offered, the live grow
    starts its new processes on 127.0.0.2, whose ssh fails before the switch is published. The pool
    ends and the run restarts from the newest checkpoint with 4 GPUs on 127.0.0.1 and the spare
    127.0.0.3; the kept trajectory is the reference's and no process is left."""
    from test_elastic_hosts import CLUSTER as LOCAL_PAIRS
    from test_elastic_hosts import HOSTS as LOOPBACK
    from test_elastic_hosts import RUN_HERE, _setup
    from test_elastic_run import (
        _check_trajectory,
        _lines,
        _no_leftovers,
        _trace,
        run_processes,
    )

    from sailor.elastic.availability import load_trace
    from sailor.elastic.controller import run
    from sailor.elastic.events import ClockKind
    from sailor.elastic.options import RunOptions
    from sailor.runtime.launcher import ExitStatus
    from sailor.runtime.worker import SLOW_WRITER_ENV
    from sailor.specs.job import JobSpec

    refuse = (f"if sys.argv[-2] == {LOOPBACK[1]!r}:\n"
              "    sys.stderr.write('ssh: connect to host ' + sys.argv[-2] + ' port 22: Connection refused\\n')\n"
              "    sys.exit(255)\n")
    pool = _setup(tmp_path, monkeypatch, refuse + RUN_HERE)
    monkeypatch.setenv("SAILOR_IGNORE_TAGS", "1")
    monkeypatch.setenv(SLOW_WRITER_ENV, "0:0.6")  # the old plan must not finish during the failed start
    steps = 30
    opts = RunOptions(job=JobSpec(model="tiny", global_batch_size=8), cluster=LOCAL_PAIRS,
                      trace=load_trace(_trace(tmp_path, (0, 2), (4, 4)), LOCAL_PAIRS), steps=steps,
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2, metrics=str(tmp_path / "m.jsonl"),
                      events=str(tmp_path / "e.jsonl"), clock=ClockKind.STEPS, switch_cost_s=0.0, hosts=pool,
                      timeout_s=30.0)
    with run_processes(str(tmp_path)) as alive:
        res = run(opts)
        _no_leftovers(alive)
        assert not alive(), alive()
    assert res.status is ExitStatus.DONE, res.message
    ev = _lines(tmp_path / "e.jsonl")
    assert [(e["world_size"], sorted(set(e["hosts"]))) for e in ev if e["event"] == "launch"] == \
        [(2, LOOPBACK[:1]), (4, [LOOPBACK[0], LOOPBACK[2]])]
    assert [e["switch"] for e in ev if e["event"] == "decision"][:1] == [True]
    (crash,) = [e for e in ev if e["event"] == "crash"]
    assert (crash["ranks"], crash["hosts"]) == ([], [LOOPBACK[1]]), crash
    assert f"on {LOOPBACK[1]} exited with status 255: ssh: connect to host {LOOPBACK[1]} port 22: Connection refused" \
        in crash["message"], crash
    assert res.crashes == 1 and res.switches == 1
    _check_trajectory(tmp_path / "m.jsonl", steps, reference_losses, rolled_back=res.steps_rolled_back)
