"""`sailor run --hosts`: the controller driving torchrun on named machines over ssh (`--restart`: the
launches and failures below; the interrupt test runs the default, live switches, whose own tests are
in test_elastic_live_hosts.py).

The `ssh` on PATH is a stand-in that runs the remote command on this machine (as sshd would, under
`sh -c`) and records its destination, so the whole path runs here: per-node torchrun agents with a
static rendezvous on rank 0's "machine" (127.0.0.x all reach this host), the stop file and plans on
the shared checkpoint folder, rank 0's events over the ssh stream. Machines have 2 "GPUs" each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import yaml
from test_elastic_run import (JOB, SAILOR, _check_trajectory, _lines, _no_leftovers, _trace, _wait, interrupt_controller,
                              ranks_alive, run_disturbed, run_processes)

from sailor.core.errors import SailorInputError
from sailor.elastic.availability import Availability, load_trace
from sailor.elastic.controller import run
from sailor.elastic.events import ClockKind
from sailor.elastic.options import RunOptions
from sailor.elastic.remote import HostPool
from sailor.plan import plan_from_dict
from sailor.runtime.launcher import ExitStatus
from sailor.runtime.prepare import TrainOptions, prepare
from sailor.specs.cluster import ClusterSpec

CLUSTER = ClusterSpec(provider="local", zones={"local": {"cpu": 4}}, gpus_per_node={"cpu": 2})
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


RUN_HERE = "os.execvp('sh', ['sh', '-c', sys.argv[-1]])\n"  # what sshd does with the command


def _setup(tmp_path: Path, monkeypatch, body: str = RUN_HERE) -> HostPool:
    """A fake ssh first on PATH (records its arguments, then runs `body`), HOSTS.yaml with three
    2-GPU machines; returns the pool."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n"
                   f"open({str(tmp_path / 'calls.jsonl')!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n" + body)
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump({"groups": [{"zone": "local", "gpu": "cpu", "hosts": HOSTS}]}))
    return HostPool.load(hosts, CLUSTER, python=sys.executable, rdzv_port=29000 + os.getpid() % 1000)


def _launches(tmp_path: Path) -> list[list[str]]:
    """The sorted ssh destinations of each launch, in launch order (each launch has its own plan file,
    control/plan-<k>.json, k growing)."""
    by_plan: dict[int, list[str]] = {}
    for call in map(json.loads, (tmp_path / "calls.jsonl").read_text().splitlines()):
        k = int(re.search(r"control/plan-(\d+)\.json", call[-1]).group(1))
        by_plan.setdefault(k, []).append(call[-2])
    return [sorted(by_plan[k]) for k in sorted(by_plan)]


def test_pool_capacity_and_placement_skip_lost_machines(tmp_path, monkeypatch):
    pool = _setup(tmp_path, monkeypatch)
    assert pool.capacity("local", "cpu", set()) == 6
    assert pool.capacity("local", "cpu", {("local", "cpu", 0)}) == 4
    assert pool.capacity("us-east1-b", "cpu", set()) == 0  # no group: no machines
    # One pipeline of two TP-2 stages: ranks 0 1 | 2 3, one machine per stage.
    plan = plan_from_dict({"micro_batch_size": 2, "stages": [[0, 3], [3, 6]], "pipelines": [
        {"microbatches": 4, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 2},
                                         {"stage": 1, "gpu": "cpu", "zone": "local", "tp": 2}]}]})
    plan.with_specs(JOB, CLUSTER).save(tmp_path / "plan.json")
    prep = prepare(TrainOptions(plan=str(tmp_path / "plan.json"), stop_file=str(tmp_path / "stop")), local=False)
    nodes = pool.commands(prep, str(tmp_path / "stop"), lost={("local", "cpu", 0)})
    # Machines 1 and 2 are used (0 is lost); rank 0's machine hosts the rendezvous of every agent.
    assert nodes.hosts == [c[-2] for c in nodes.commands] == HOSTS[1:]
    assert nodes.node_machine == [("local", "cpu", 1), ("local", "cpu", 2)]
    assert nodes.rank_machine == {0: ("local", "cpu", 1), 1: ("local", "cpu", 1), 2: ("local", "cpu", 2),
                                  3: ("local", "cpu", 2)}
    assert all(f"--rdzv-endpoint {HOSTS[1]}:{pool.rdzv_port}" in c[-1] for c in nodes.commands)
    assert all("--stop-file=" + str(tmp_path / "stop") in c[-1] for c in nodes.commands)


def test_availability_is_capped_by_usable_machines_until_a_fresh_count(tmp_path, monkeypatch):
    pool = _setup(tmp_path, monkeypatch)
    trace = load_trace(_trace(tmp_path, (0, 8), (10, 8), (20, 5)), CLUSTER.model_copy(update={"zones": {"local": {"cpu": 8}}}))
    avail = Availability(trace, pool)
    avail.advance(0)
    assert avail.zones() == {"local": {"cpu": 6}}  # 8 offered, 3 machines x 2
    avail.lost[("local", "cpu")] += 1
    avail.lost_machines.add(("local", "cpu", 2))
    held = avail.lost_machines  # as a live in-place run holds it (`InPlaceRun(lost=...)`)
    assert avail.zones() == {"local": {"cpu": 4}}
    avail.advance(10)  # the same count again: no fresh observation, the machine stays out
    assert avail.zones() == {"local": {"cpu": 4}}
    avail.advance(20)  # a new count: the deductions end
    assert avail.zones() == {"local": {"cpu": 5}} and not avail.lost_machines
    assert held is avail.lost_machines and not held  # the run's placement sees the machine back too


def test_cpu_runs_a_gpu_trace_on_named_machines_only(tmp_path):
    """--device cpu trains GPU types as gloo processes on named machines (the testbed's device
    classes), as `sailor launch` does; on this machine's local provider only GPU type cpu runs."""
    from sailor.elastic.options import check_run

    gcp = ClusterSpec(provider="gcp", zones={"us-central1-a": {"A100-40": 2}}, gpus_per_node={"A100-40": 2})
    trace = tmp_path / "a100.json"
    trace.write_text(json.dumps([{"time_s": 0, "zone": "us-central1-a", "gpu": "A100-40", "count": 2}]))
    opts = RunOptions(job=JOB, cluster=gcp, trace=load_trace(trace, gcp), checkpoint_dir=str(tmp_path / "ck"),
                      device="cpu", hosts=HostPool.load(_a100_hosts(tmp_path), gcp))
    check_run(opts)  # accepted
    with pytest.raises(SailorInputError, match="--device: the trace offers GPU type A100-40, which --device cpu cannot"):
        check_run(RunOptions(**{**vars(opts), "hosts": None, "cluster": gcp.model_copy(update={"provider": "local"})}))


def test_switches_are_live_by_default(tmp_path, monkeypatch):
    """`RunOptions.in_place`: None switches live on the local provider and on hosts; False restarts
    anywhere; True is accepted on both."""
    from sailor.elastic.options import check_run

    trace = load_trace(_trace(tmp_path, (0, 4)), CLUSTER)
    local = RunOptions(job=JOB, cluster=CLUSTER, trace=trace, checkpoint_dir=str(tmp_path / "ck"))
    on_hosts = RunOptions(**{**vars(local), "hosts": _setup(tmp_path, monkeypatch)})
    assert local.switches_live and on_hosts.switches_live
    assert not RunOptions(**{**vars(local), "in_place": False}).switches_live
    assert RunOptions(**{**vars(local), "in_place": True}).switches_live
    check_run(local)
    check_run(on_hosts)
    check_run(RunOptions(**{**vars(on_hosts), "in_place": False}))
    check_run(RunOptions(**{**vars(on_hosts), "in_place": True}))
    assert not RunOptions(**{**vars(on_hosts), "in_place": False}).switches_live


def _a100_hosts(tmp_path: Path) -> Path:
    hosts = tmp_path / "a100-hosts.yaml"
    hosts.write_text(yaml.safe_dump({"groups": [{"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["10.0.0.1"]}]}))
    return hosts


def test_hosts_must_agree_with_the_clusters_node_size(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump({"groups": [{"zone": "local", "gpu": "cpu", "gpus_per_node": 4,
                                                 "hosts": HOSTS}]}))
    with pytest.raises(SailorInputError, match=r"groups\.0\.gpus_per_node.*4 GPUs per node.*nodes of 2"):
        HostPool.load(hosts, CLUSTER)


@pytest.mark.integration
def test_shrink_then_sigkill_on_hosts(tmp_path, monkeypatch, reference_losses):
    """4 GPUs on machines .1/.2; the trace shrinks to 2 (stop via the shared stop file, relaunch on one
    machine); back to 4, then rank 3 is SIGKILLed: its machine is taken out and the job goes on with
    4 GPUs on .1 and the spare .3, rolled back to the last checkpoint. Losses equal the reference."""
    pool = _setup(tmp_path, monkeypatch)
    steps = 60
    metrics, events = tmp_path / "m.jsonl", tmp_path / "e.jsonl"
    # The steps clock: the changes come after steps 8 and 16 whatever a step takes (on the training clock
    # a launch's first step, 1.8 s with a pipeline's warm-up, jumped past both changes at once).
    trace = load_trace(_trace(tmp_path, (0, 4), (8, 2), (16, 4)), CLUSTER)
    opts = RunOptions(job=JOB, cluster=CLUSTER, trace=trace, steps=steps, checkpoint_dir=str(tmp_path / "ck"),
                      checkpoint_every=5, metrics=str(metrics), events=str(events), clock=ClockKind.STEPS,
                      switch_cost_s=0.0, hosts=pool, timeout_s=30.0, in_place=False)

    def kill_rank_3_after_the_regrowth(out: dict, alive) -> None:
        _wait(lambda: sum(1 for e in _lines(events) if e["event"] == "launch") == 3 or "res" in out)
        before = len(_lines(metrics))
        _wait(lambda: len(_lines(metrics)) >= before + 3 or "res" in out)
        assert "res" not in out, out["res"].message
        _wait(lambda: 3 in ranks_alive(alive), 30)
        os.kill(ranks_alive(alive)[3], signal.SIGKILL)

    res = run_disturbed(opts, str(tmp_path), kill_rank_3_after_the_regrowth)
    ev = _lines(events)
    assert [e["world_size"] for e in ev if e["event"] == "launch"] == [4, 2, 4, 4]
    assert _launches(tmp_path) == [HOSTS[:2], HOSTS[:1], HOSTS[:2], [HOSTS[0], HOSTS[2]]]
    assert [e for e in ev if e["event"] == "machines"][0]["machines"] == {"cpu@local": 3}
    crash = [e for e in ev if e["event"] == "crash"]
    assert len(crash) == 1 and crash[0]["ranks"] == [3] and crash[0]["hosts"] == [HOSTS[1]]
    assert next(e for e in reversed(ev) if e["event"] == "availability")["machines_lost"] == [HOSTS[1]]
    _check_trajectory(metrics, steps, reference_losses, rolled_back=res.steps_rolled_back)


def _run_opts(tmp_path: Path, pool: HostPool, steps: int, **kw) -> RunOptions:
    return RunOptions(job=JOB, cluster=CLUSTER, trace=load_trace(_trace(tmp_path, (0, 4)), CLUSTER), steps=steps,
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=5, metrics=str(tmp_path / "m.jsonl"),
                      events=str(tmp_path / "e.jsonl"), clock=ClockKind.TRAINING, hosts=pool, timeout_s=30.0,
                      in_place=False, **kw)


@pytest.mark.integration
def test_unreachable_host_is_left_out_and_a_spare_used(tmp_path, monkeypatch, reference_losses):
    """ssh cannot connect to 127.0.0.2 (exit 255, as ssh does): the launch fails, the message names the
    host and ssh's own words, and the relaunch uses the spare 127.0.0.3."""
    refuse = (f"if sys.argv[-2] == {HOSTS[1]!r}:\n"
              "    sys.stderr.write('ssh: connect to host ' + sys.argv[-2] + ' port 22: Connection refused\\n')\n"
              "    sys.exit(255)\n")
    pool = _setup(tmp_path, monkeypatch, refuse + RUN_HERE)
    with run_processes(str(tmp_path)) as alive:
        res = run(_run_opts(tmp_path, pool, steps=8))
        _no_leftovers(alive)
    assert res.status is ExitStatus.DONE, res.message
    ev = _lines(tmp_path / "e.jsonl")
    crash = [e for e in ev if e["event"] == "crash"]
    assert len(crash) == 1 and crash[0]["hosts"] == [HOSTS[1]] and crash[0]["ranks"] == []
    assert f"{HOSTS[1]} exited with status 255: ssh: connect to host {HOSTS[1]} port 22: Connection refused" \
        in crash[0]["message"]
    assert _launches(tmp_path) == [HOSTS[:2], [HOSTS[0], HOSTS[2]]]
    _check_trajectory(tmp_path / "m.jsonl", 8, reference_losses, rolled_back=0)


@pytest.mark.integration
def test_a_machine_that_goes_down_whole_is_left_out(tmp_path, monkeypatch, reference_losses):
    """Node 1's torchrun agent and both its ranks are SIGKILLed at once (the machine went down): no
    rank is named by torchrun, but ranks 0 and 1 report the lost peer, so the silent machine
    127.0.0.2 is left out and the job goes on with 4 GPUs on 127.0.0.1 and 127.0.0.3."""
    pool = _setup(tmp_path, monkeypatch)
    metrics, events = tmp_path / "m.jsonl", tmp_path / "e.jsonl"

    def kill_machine_1(out: dict, alive) -> None:
        _wait(lambda: len(_lines(metrics)) >= 7 or "res" in out)
        assert "res" not in out, out["res"].message
        ranks = ranks_alive(alive)
        node = [pid for pid, cmd in alive() if "--node-rank 1 " in cmd and pid not in ranks.values()]
        for pgid in dict.fromkeys(os.getpgid(pid) for pid in (*node, ranks[2], ranks[3])):  # the node's session first
            os.killpg(pgid, signal.SIGKILL)

    res = run_disturbed(_run_opts(tmp_path, pool, steps=30), str(tmp_path), kill_machine_1)
    crash = [e for e in _lines(events) if e["event"] == "crash"]
    assert len(crash) == 1 and crash[0]["ranks"] == [] and crash[0]["hosts"] == [HOSTS[1]]
    assert _launches(tmp_path) == [HOSTS[:2], [HOSTS[0], HOSTS[2]]]
    _check_trajectory(metrics, 30, reference_losses, rolled_back=res.steps_rolled_back)


@pytest.mark.integration
def test_a_host_that_never_runs_the_command_is_left_out_after_the_start_timeout(tmp_path, monkeypatch,
                                                                               reference_losses):
    """ssh to 127.0.0.2 connects but its command never starts, so no process group can form: the
    launch is ended after --start-timeout-s, the host whose node never said it was up is left out,
    and the job runs on 127.0.0.1 and the spare 127.0.0.3. (The limit leaves the relaunch's 4 ranks
    time to import torch on a loaded machine: 20 s did not, now and then.)"""
    pool = _setup(tmp_path, monkeypatch, f"if sys.argv[-2] == {HOSTS[1]!r}:\n    time.sleep(600)\n" + RUN_HERE)
    with run_processes(str(tmp_path)) as alive:
        res = run(_run_opts(tmp_path, pool, steps=8, start_timeout_s=45.0))
        _no_leftovers(alive)
        assert not alive(), alive()
    assert res.status is ExitStatus.DONE, res.message
    ev = _lines(tmp_path / "e.jsonl")
    timeouts = [e for e in ev if e["event"] == "start_timeout"]
    assert len(timeouts) == 1 and "did not form within 45 s on 127.0.0.1, 127.0.0.2" in timeouts[0]["message"]
    crash = [e for e in ev if e["event"] == "crash"]
    assert len(crash) == 1 == res.crashes and crash[0]["hosts"] == [HOSTS[1]]
    assert _launches(tmp_path) == [HOSTS[:2], [HOSTS[0], HOSTS[2]]]
    _check_trajectory(tmp_path / "m.jsonl", 8, reference_losses, rolled_back=0)


@pytest.mark.integration
def test_cli_hosts_errors_are_one_line(tmp_path, monkeypatch, capsys):
    """Each bad `sailor run --hosts` input: exit 2, one `error:` line naming the option or field, no
    file made. The first case runs the console command in a process of its own (what a user sees on
    stderr, imports included); the others run `sailor.cli.main` in this process (the same code path,
    without 15 interpreter start-ups)."""
    import subprocess

    from test_cli_bad_input import _refused

    job, cluster = tmp_path / "job.yaml", tmp_path / "cluster.yaml"
    job.write_text("model: tiny\nglobal_batch_size: 8\n")
    cluster.write_text(yaml.safe_dump({"provider": "gcp", "zones": {"us-central1-a": {"A100-40": 8}}}))
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([{"time_s": 0, "zone": "us-central1-a", "gpu": "A100-40", "count": 8}]))
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump({"groups": [{"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["a0"]}]}))
    bad = {}
    for name, groups in (("dash", [{"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["-oProxyCommand=x"]}]),
                         ("twice", [{"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["a0", "a0"]}]),
                         ("zone", [{"zone": "nowhere", "gpu": "A100-40", "hosts": ["a0"]}]),
                         ("other", [{"zone": "us-central1-b", "gpu": "A100-40", "hosts": ["a0"]}])):
        bad[name] = tmp_path / f"{name}.yaml"
        bad[name].write_text(yaml.safe_dump({"groups": groups}))
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps([{"time_s": 0, "zone": "us-central1-a", "gpu": "A100-40", "count": 0}]))
    base = ["run", "--job", str(job), "--cluster", str(cluster), "--availability", str(trace)]
    r = subprocess.run([*SAILOR, *base], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--hosts HOSTS.yaml" in r.stderr, r.stderr
    for extra, want in ((["--hosts", str(hosts)], "--checkpoint-dir"),
                        (["--hosts", str(tmp_path / "none.yaml")], "none.yaml"),
                        (["--hosts", str(hosts), *ck, "--rdzv-port", "0"], "--rdzv-port"),
                        (["--python", "python3"], "--python: only with --hosts"),
                        (["--hosts", str(hosts), *ck, "--python", ".venv/bin/python"], "--python: '.venv/bin/python' is"),
                        (["--hosts", str(hosts), *ck, "--python", "-oX"], "--python: '-oX' is not"),
                        (["--hosts", str(hosts), *ck, "--switch-cost-s", "nan"], "--switch-cost-s: expected a finite number"),
                        (["--hosts", str(hosts), *ck, "--python", ""], "--python: '' is not"),
                        (["--hosts", str(hosts), *ck, "--availability", str(zero)], "zero.json: the trace never offers"),
                        (["--hosts", str(bad["dash"]), *ck], "groups.0.hosts: '-oProxyCommand=x' is not a host"),
                        (["--hosts", str(bad["twice"]), *ck], "groups.0.hosts.1: host a0 is listed twice"),
                        (["--hosts", str(bad["zone"]), *ck], "groups.0.zone: unknown gcp zone 'nowhere'"),
                        (["--hosts", str(bad["other"]), *ck], "other.yaml: groups: no group holds GPUs the trace"),
                        (["--hosts", str(hosts), *ck, "--device", "tpu"], "--device: unknown device 'tpu'")):
        assert want in _refused(base + extra, tmp_path, monkeypatch, capsys), extra


@pytest.mark.integration
@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_interrupted_controller_leaves_nothing_on_the_hosts(tmp_path, monkeypatch, how):
    """SIGINT: the ranks on both machines stop at a step boundary with a checkpoint (shared stop
    file); SIGKILL of the controller: its ssh sessions get SIGTERM from the kernel and end the ranks."""
    pool = _setup(tmp_path, monkeypatch)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER.model_dump(mode="json", exclude_defaults=True)))
    job = tmp_path / "job.yaml"
    job.write_text("model: tiny\nglobal_batch_size: 8\n")
    interrupt_controller(["--job", str(job), "--cluster", str(cluster), "--availability", str(_trace(tmp_path, (0, 4))),
                          "--hosts", pool.source, "--python", sys.executable, "--rdzv-port", str(pool.rdzv_port)],
                         tmp_path, how, world_size=4)
