"""Switch cost of `sailor run` on this machine: from the availability change to the first step
completed under the new plan, phase by phase.

Runs the controller on the local provider (tiny model, global batch 8, <= 4 gloo processes) over a
trace that shrinks 4 -> 2 processes (the running plan loses GPUs: a forced switch) and grows back to
4 (switched because the switch cost is set to 0 here, so the gain always wins). The trace runs on
the `steps` clock (one trace second per training step), so each plan trains the same steps whatever
the machine's load.

By default the switches are live (as `sailor run`'s on the local provider): the surviving ranks keep
their process and state. Phases: replan (planner, cached or not), start (the processes the new plan
lacks start while the old plan trains on; 0 when spares are ready), stop (to the step boundary),
checkpoint (at the boundary: the move planned, and a checkpoint written only when it needs one, so
none here; below), rendezvous
(the move group formed), move (state sent point to point, stages built), first step. Target: <= 2 s
for the shrink and for the grow.

`--restart` measures the restart path instead (every rank stops, checkpoints, exits; a fresh torchrun
loads the checkpoint). Phases: replan, stop, checkpoint, teardown (processes gone), restart (torchrun,
imports, process groups), load (model built, checkpoint loaded), first step. Target: <= 10 s; published
Sailor: about 11 s on 16 V100 (DESIGN.md §7), before rollback.

`--via-ssh` runs the restart path through `sailor run --hosts`: two 2-process "machines" (127.0.0.1
and 127.0.0.2) reached by a stand-in `ssh` that runs each node's command here, with a torchrun agent
per machine and a static rendezvous (the multi-host path, without a network).

`--testbed [SPEC.yaml]` (root; `sailor testbed`, README "Testbed") runs the shrink and the grow across
two nodes (network namespaces) of a testbed through `sailor run --hosts` and the testbed's stand-in
ssh: the built-in pair of `runtime_overhead.py --testbed` (nodes a and b, one rank each under one
core's quota, zones us-central1-a and us-central1-b, a 400 Mbit/s cross-zone link) or a file's first
two nodes (one rank each, `runtime_overhead.load_spec`). The trace offers both nodes' GPUs, then
only the first node's after EVERY steps (node b's process sends its state and stays there as a
spare), then both again after 2 x EVERY (node b's spare takes the new rank and gets its state over
the link; the
run trains TESTBED_STEPS steps, so that the grow happens before the end). The planner plans with this
machine's quick profile (`sailor.runtime.machine.local_profiles`, one thread per rank as under the
quota) named after the nodes' GPU types (`testbed.profile.retag`): with the catalog's roofline an
A100 runs the tiny model so fast that a second one never pays. The testbed is taken down on
exit, error, Ctrl-C or SIGTERM, and the run fails if anything of it is left (`testbed.live_testbed`).
Its JSON line adds `testbed` (file or null, nodes, zones, the link's Mbit/s).

Prints a table, then one JSON line: `switches` (each with `total_s`, its phases and `paused_s`, the
seconds in which no step ran: the total less the start phase), the means, and
`survivors_restarted`: over all switches, the ranks present in both plans (GPUs kept) whose process
id changed (measured: every rank reports its pid when it joins a plan; 0 when survivors stay alive).
Each switch also gives `spares_used`: its new ranks handed to spares, processes already running
(the shrink's leavers, `sailor.elastic.inplace`), which start nothing.

`--large` measures instead one change of a 117.6 M-parameter model (inline: 8 blocks, hidden 1024,
16 heads, FFN 4096, vocabulary 8192, untied; fp32 on CPU, global batch 2 of 32 tokens; 1.41 GB of
fp32 weights and Adam moments): the trace shrinks 2 -> 1 processes after `LARGE_STEPS` steps (the
planner's plans: TP 2, then one rank), once live and once by restarting, each run training
2 x `LARGE_STEPS` steps. Its table and JSON line ("measurement": "large") give each path's total
and phases and the state bytes it moved: live, those sent between processes, kept in place and read
from the checkpoint (the move group's own count, `runtime.inplace`); restart, the size of the
checkpoint every rank wrote and the new ranks read.

Both measurements checkpoint every `recipe.checkpoint.every` steps (100), as `sailor run` does by
default, so a live switch writes no checkpoint at its boundary (`runtime.inplace`; the restart path
always writes one).

    python benchmarks/reconfigure.py [--steps 40] [--processes 4] [--shrink-to 2] [--restart | --via-ssh]
    python benchmarks/reconfigure.py --testbed [SPEC.yaml] [--restart] [--steps 500]
    python benchmarks/reconfigure.py --large
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESTART_PHASES = ("replan_s", "stop_s", "checkpoint_s", "teardown_s", "restart_s", "load_s", "first_step_s")
LIVE_PHASES = ("replan_s", "start_s", "stop_s", "checkpoint_s", "rendezvous_s", "move_s", "first_step_s")
RESTART_TARGET_S, LIVE_TARGET_S = 10.0, 2.0
EVERY = 20  # steps each plan trains (trace seconds on the steps clock)
LARGE_MODEL = {"name": "bench-118m", "num_blocks": 8, "hidden_size": 1024, "num_heads": 16, "ffn_hidden_size": 4096,
               "vocab_size": 8192, "max_sequence_length": 64, "tied_embeddings": False}
LARGE_STEPS = 2  # steps each plan of the large measurement trains
TESTBED_STEPS = 25 * EVERY  # on the testbed: the grow's new process starts while the old plan trains on (tens of s loaded)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help=f"steps of the run (default {4 * EVERY}; on the testbed"
                    f" {TESTBED_STEPS})")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--shrink-to", type=int, default=2)
    ap.add_argument("--via-ssh", action="store_true", help="through `sailor run --hosts` and a stand-in ssh")
    ap.add_argument("--restart", action="store_true", help="switch by restarting every rank from a checkpoint"
                    " (the default switches live, as `sailor run` does on the local provider)")
    ap.add_argument("--large", action="store_true", help="one shrink of a 117.6 M-parameter model, live and by"
                    " restarting (module docstring)")
    ap.add_argument("--testbed", nargs="?", const="", default=None, metavar="SPEC.yaml",
                    help="the shrink and the grow across two nodes of a testbed (root): this file's first two nodes,"
                         " or without one the built-in pair of runtime_overhead.py")
    args = ap.parse_args(argv)
    if args.large:
        return _large()
    live = not (args.restart or args.via_ssh)
    phases, target = (LIVE_PHASES, LIVE_TARGET_S) if live else (RESTART_PHASES, RESTART_TARGET_S)
    from sailor.specs.job import JobSpec

    job = JobSpec(model="tiny", global_batch_size=8)
    steps = args.steps or (TESTBED_STEPS if args.testbed is not None else 4 * EVERY)
    where: dict = {"path": "ssh stand-in" if args.via_ssh else "local"}
    if args.testbed is not None:
        res, ev, where = _on_testbed(args.testbed, job, steps, live)
    else:
        assert 1 <= args.shrink_to < args.processes <= 4, "at most 4 processes on this machine"
        cluster = _local_cluster(args.processes, args.via_ssh)
        res, ev = _run(job, cluster, _local_trace(((0, args.processes), (EVERY, args.shrink_to),
                                                   (2 * EVERY, args.processes))),
                       steps, live=live, hosts=_stand_in_hosts if args.via_ssh else None)
    switches = [e for e in ev if e["event"] == "switch_finished" and not e.get("interrupted")]
    if res.status != 0 or not switches:
        print(f"run did not complete its switches: {res.message}", file=sys.stderr)
        return 1
    for e in switches:  # the seconds no step ran: all but the new processes' start (the old plan trained on)
        e["paused_s"] = e["total_s"] - e["phases_s"].get("start_s", 0.0)
    print(f"{'switch':<22}" + "".join(f"{p[:-2]:>13}" for p in phases) + f"{'total':>10}{'paused':>10}")
    for e in switches:
        label = f"{e['reason']} -> {e['world_size']} procs"
        print(f"{label:<22}" + "".join(f"{e['phases_s'][p]:>13.3f}" for p in phases)
              + f"{e['total_s']:>10.2f}{e['paused_s']:>10.2f}")
    mean = {p: sum(e["phases_s"][p] for e in switches) / len(switches) for p in phases}
    total = sum(e["total_s"] for e in switches) / len(switches)
    print(f"{'mean':<22}" + "".join(f"{mean[p]:>13.3f}" for p in phases) + f"{total:>10.2f}")
    met = all(e["total_s"] <= target for e in switches)
    restarted = sum(e["survivors_restarted"] for e in switches)
    print(f"target <= {target:g} s for every switch: {'met' if met else 'missed'}; surviving ranks restarted:"
          f" {restarted} of {sum(e['survivors'] for e in switches)}"
          + ("" if live else "; published Sailor about 11 s on 16 V100 (before rollback)"))
    print(json.dumps({"benchmark": "reconfigure", **where, "switch": "live" if live else "restart", "load_1min": _load(),
                      "switches": [{"reason": e["reason"], "to_processes": e["world_size"], "total_s": e["total_s"],
                                    "paused_s": e["paused_s"], "survivors": e["survivors"], "survivors_restarted": e["survivors_restarted"],
                                    "spares_used": e.get("spares_used", 0),
                                    **e["phases_s"]} for e in switches],
                      "survivors_restarted": restarted, "mean_total_s": total, "mean_phases_s": mean,
                      "target_s": target, "target_met": met}))
    return 0


def _local_cluster(processes: int, via_ssh: bool = False):
    """The local provider with `processes` "GPUs" of type cpu (on 2-GPU machines `via_ssh`)."""
    from sailor.specs.cluster import ClusterSpec

    return ClusterSpec(provider="local", zones={"local": {"cpu": processes}}, gpus_per_node={"cpu": 2} if via_ssh else {})


def _local_trace(counts) -> list[dict]:
    """The trace rows of (trace second, count of GPU type cpu in zone local) `counts`."""
    return [{"time_s": s, "zone": "local", "gpu": "cpu", "count": n} for s, n in counts]


def _run(job, cluster, rows: list[dict], steps: int, *, live: bool, hosts=None, profiles: str | None = None,
         sizes: bool = False) -> tuple:
    """`sailor run` of `job` on `cluster` over the trace `rows` on the steps clock, the switch cost set
    to 0, planned with `profiles` (None: as `sailor run` without --profiles); with `hosts` (called with a temporary folder and the cluster, giving a `HostPool`) on those
    machines. Returns its RunResult and its events; with `sizes`, each "launch" event that resumed
    from a checkpoint gets that checkpoint's bytes on disk ("checkpoint_bytes", measured before the
    run's folder goes)."""
    from sailor.elastic.availability import load_trace
    from sailor.elastic.controller import run
    from sailor.elastic.events import ClockKind
    from sailor.elastic.options import RunOptions

    with tempfile.TemporaryDirectory(prefix="sailor-reconfigure-") as tmp:
        t = Path(tmp)
        pool = hosts(t, cluster) if hosts is not None else None
        trace = t / "trace.json"
        trace.write_text(json.dumps(rows))
        events = t / "events.jsonl"
        res = run(RunOptions(job=job, cluster=cluster, trace=load_trace(trace, cluster), steps=steps,
                             checkpoint_dir=str(t / "ck"), checkpoint_every=job.recipe.checkpoint.every,
                             events=str(events), clock=ClockKind.STEPS, switch_cost_s=0.0, hosts=pool, in_place=live,
                             profiles=profiles))
        ev = [json.loads(x) for x in events.read_text().splitlines()]
        for e in ev:
            if sizes and e["event"] == "launch" and e["checkpoint"]:
                e["checkpoint_bytes"] = sum(f.stat().st_size for f in Path(e["checkpoint"]).iterdir())
    return res, ev


def _large() -> int:
    """The --large measurement (module docstring)."""
    from sailor.specs.job import JobSpec

    job = JobSpec(model=LARGE_MODEL, global_batch_size=2, sequence_length=32)
    out = {}
    for path in ("live", "restart"):
        res, ev = _run(job, _local_cluster(2), _local_trace(((0, 2), (LARGE_STEPS, 1))), 2 * LARGE_STEPS,
                       live=path == "live", sizes=True)
        done = [e for e in ev if e["event"] == "switch_finished" and not e.get("interrupted")]
        if res.status != 0 or len(done) != 1:
            print(f"{path}: the run did not complete its switch: {res.message}", file=sys.stderr)
            return 1
        e = done[0]
        plans = [_describe(p["plan"]) for p in ev if p["event"] == "plan" and p["feasible"]]
        plans = [p for i, p in enumerate(plans) if i == 0 or p != plans[i - 1]]  # (a relaunch plans again)
        moved = {k: e[k] for k in ("sent_bytes", "local_bytes", "checkpoint_bytes") if k in e}
        if path == "restart":
            moved["checkpoint_bytes"] = [x for x in ev if x["event"] == "launch"][-1]["checkpoint_bytes"]
        out[path] = {"total_s": e["total_s"], **e["phases_s"], "survivors": e["survivors"],
                     "survivors_restarted": e["survivors_restarted"], "plans": plans, **moved}
    params = job.model.total_params()
    print(f"{job.model.name}: {params / 1e6:.1f} M parameters, fp32 on CPU ({12 * params / 1e9:.2f} GB of weights"
          f" and Adam moments); shrink {' -> '.join(out['live']['plans'])}")
    for path, phases in (("live", LIVE_PHASES), ("restart", RESTART_PHASES)):
        r = out[path]
        print(f"{path:<8} {r['total_s']:>7.2f} s  " + ", ".join(f"{p[:-2]} {r[p]:.2f}" for p in phases))
        gb = {k: r.get(k, 0) / 1e9 for k in ("sent_bytes", "local_bytes", "checkpoint_bytes")}
        print(f"{'':<8} moved: {gb['sent_bytes']:.2f} GB sent between processes, {gb['local_bytes']:.2f} GB kept in"
              f" place, {gb['checkpoint_bytes']:.2f} GB through the checkpoint; surviving ranks restarted:"
              f" {r['survivors_restarted']} of {r['survivors']}")
    print(json.dumps({"benchmark": "reconfigure", "measurement": "large", "path": "local", "load_1min": _load(),
                      "model": LARGE_MODEL, "params": params, "global_batch_size": job.global_batch_size,
                      "sequence_length": job.seq, "steps_per_plan": LARGE_STEPS, **out}))
    return 0


def _on_testbed(testbed: str, job, steps: int, live: bool) -> tuple:
    """The shrink and the grow on the testbed `testbed` (a file, or "" for the built-in pair; module
    docstring): (RunResult, events, the JSON line's keys saying where). Bad input exits 2 in one line
    before the testbed comes up."""
    # (benchmarks/runtime_overhead.py and benchmarks/testbed.py)
    from runtime_overhead import load_spec, testbed_pair
    from testbed import live_testbed

    from sailor.core.errors import SailorInputError
    from sailor.core.fileio import load_json, write_json
    from sailor.elastic.remote import HostPool
    from sailor.runtime.machine import cache_path, local_profiles
    from sailor.specs import load_cluster
    from sailor.testbed.profile import merge, retag

    try:
        spec, source = load_spec(testbed)
    except SailorInputError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        raise SystemExit(2) from None
    a, b, mbit = testbed_pair(spec, source)

    def rows(time_s: float, nodes) -> list[dict]:
        counts: dict[tuple[str, str], int] = {(n.zone, spec.devices[n.device].gpu): 0 for n in (a, b)}
        for n in nodes:
            counts[(n.zone, spec.devices[n.device].gpu)] += n.ranks
        return [{"time_s": time_s, "zone": z, "gpu": g, "count": c} for (z, g), c in counts.items()]

    local_profiles(job, processes=2, announce=lambda line: print(line, file=sys.stderr, flush=True))
    measured = load_json(cache_path(job, processes=2))
    with tempfile.TemporaryDirectory(prefix="sailor-reconfigure-testbed-") as tmp:
        profile = Path(tmp) / "profile.json"
        write_json(profile, merge([retag(measured, g) for g in sorted({spec.devices[n.device].gpu for n in (a, b)})]))
        with live_testbed(spec, Path(tmp)) as (_, state):
            cluster = load_cluster(state.cluster_file)
            res, ev = _run(job, cluster, rows(0, (a, b)) + rows(EVERY, (a,)) + rows(2 * EVERY, (a, b)), steps,
                           live=live, profiles=str(profile),
                           hosts=lambda t, c: HostPool.load(state.hosts_file, c, python=sys.executable,
                                                            ssh=str(state.bin_dir / "ssh")))
    return res, ev, {"path": "testbed", "testbed": {"file": testbed or None, "nodes": [a.name, b.name],
                                                     "zones": [a.zone, b.zone], "link_mbit": mbit}}


def _describe(plan: dict) -> str:
    """"<ranks> x TP <tp>" of a plan dict (one stage per pipeline) or "<ranks> ranks" otherwise."""
    reps = [r for p in plan["pipelines"] for r in p["replicas"]]
    ranks = sum(r["tp"] for r in reps)
    if len(plan["stages"]) == 1:
        return f"{len(reps)} x TP {reps[0]['tp']}" if len({r["tp"] for r in reps}) == 1 else f"{ranks} ranks"
    return f"{ranks} ranks in {len(plan['stages'])} stages"


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _stand_in_hosts(t: Path, cluster):  # (`_run`'s hosts)
    """HOSTS.yaml with two 2-process machines, and an `ssh` first on PATH that runs the command here."""
    import yaml

    from sailor.elastic.remote import HostPool

    (t / "bin").mkdir()
    ssh = t / "bin" / "ssh"
    ssh.write_text(f"#!{sys.executable}\nimport os, sys\nos.execvp('sh', ['sh', '-c', sys.argv[-1]])\n")
    ssh.chmod(0o755)
    os.environ["PATH"] = f"{t / 'bin'}{os.pathsep}{os.environ['PATH']}"
    hosts = t / "hosts.yaml"
    hosts.write_text(yaml.safe_dump({"groups": [{"zone": "local", "gpu": "cpu", "hosts": ["127.0.0.1", "127.0.0.2"]}]}))
    return HostPool.load(hosts, cluster, python=sys.executable, rdzv_port=29000 + os.getpid() % 1000)


if __name__ == "__main__":
    sys.exit(main())
