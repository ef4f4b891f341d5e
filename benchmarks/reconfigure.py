"""Switch cost of `sailor run` on this machine: from the availability change to the first step
completed under the new plan, phase by phase.

Runs the controller on the local provider (tiny model, global batch 8, <= 4 gloo processes) over a
trace that shrinks 4 -> 2 processes (the running plan loses GPUs: a forced switch) and grows back to
4 (switched because the switch cost is set to 0 here, so the gain always wins). The trace runs on
the `steps` clock (one trace second per training step), so each plan trains the same steps whatever
the machine's load.

By default the switches are live (`sailor run --in-place`): the surviving ranks keep their process and
state. Phases: replan (planner, cached or not), stop (to the step boundary), checkpoint (the safety
checkpoint the ranks write at the boundary), rendezvous (the move group formed), move (state sent
point to point, stages built), first step. Target: <= 2 s for the shrink and for the grow.

`--restart` measures the restart path instead (every rank stops, checkpoints, exits; a fresh torchrun
loads the checkpoint). Phases: replan, stop, checkpoint, teardown (processes gone), restart (torchrun,
imports, process groups), load (model built, checkpoint loaded), first step. Target: <= 10 s; published
Sailor: about 11 s on 16 V100 (DESIGN.md §7), before rollback.

`--via-ssh` runs the restart path through `sailor run --hosts`: two 2-process "machines" (127.0.0.1
and 127.0.0.2) reached by a stand-in `ssh` that runs each node's command here, with a torchrun agent
per machine and a static rendezvous (the multi-host path, without a network).

Prints a table, then one JSON line: `switches` (each with `total_s` and its phases), the means, and
`survivors_restarted`: over all switches, the ranks present in both plans (GPUs kept) whose process
id changed (measured: every rank reports its pid when it joins a plan; 0 when survivors stay alive).

    python benchmarks/reconfigure.py [--steps 40] [--processes 4] [--shrink-to 2] [--restart | --via-ssh]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

RESTART_PHASES = ("replan_s", "stop_s", "checkpoint_s", "teardown_s", "restart_s", "load_s", "first_step_s")
LIVE_PHASES = ("replan_s", "stop_s", "checkpoint_s", "rendezvous_s", "move_s", "first_step_s")
RESTART_TARGET_S, LIVE_TARGET_S = 10.0, 2.0
EVERY = 20  # steps each plan trains (trace seconds on the steps clock)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4 * EVERY)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--shrink-to", type=int, default=2)
    ap.add_argument("--via-ssh", action="store_true", help="through `sailor run --hosts` and a stand-in ssh")
    ap.add_argument("--restart", action="store_true", help="switch by restarting every rank from a checkpoint"
                    " (the default switches live: `sailor run --in-place`)")
    args = ap.parse_args(argv)
    assert 1 <= args.shrink_to < args.processes <= 4, "at most 4 processes on this machine"
    live = not (args.restart or args.via_ssh)
    phases, target = (LIVE_PHASES, LIVE_TARGET_S) if live else (RESTART_PHASES, RESTART_TARGET_S)

    from sailor.elastic.availability import load_trace
    from sailor.elastic.controller import run
    from sailor.elastic.events import ClockKind
    from sailor.elastic.options import RunOptions
    from sailor.specs.cluster import ClusterSpec
    from sailor.specs.job import JobSpec

    with tempfile.TemporaryDirectory(prefix="sailor-reconfigure-") as tmp:
        t = Path(tmp)
        cluster = ClusterSpec(provider="local", zones={"local": {"cpu": args.processes}},
                              gpus_per_node={"cpu": 2} if args.via_ssh else {})
        hosts = _stand_in_hosts(t, cluster) if args.via_ssh else None
        trace = t / "trace.json"
        trace.write_text(json.dumps([{"time_s": s, "zone": "local", "gpu": "cpu", "count": n}
                                     for s, n in ((0, args.processes), (EVERY, args.shrink_to),
                                                  (2 * EVERY, args.processes))]))
        events = t / "events.jsonl"
        res = run(RunOptions(job=JobSpec(model="tiny", global_batch_size=8), cluster=cluster,
                             trace=load_trace(trace, cluster), steps=args.steps, checkpoint_dir=str(t / "ck"),
                             checkpoint_every=0, events=str(events), clock=ClockKind.STEPS, switch_cost_s=0.0,
                             hosts=hosts, in_place=live))
        ev = [json.loads(x) for x in events.read_text().splitlines()]
    switches = [e for e in ev if e["event"] == "switch_finished" and not e.get("interrupted")]
    if res.status != 0 or not switches:
        print(f"run did not complete its switches: {res.message}", file=sys.stderr)
        return 1
    print(f"{'switch':<22}" + "".join(f"{p[:-2]:>13}" for p in phases) + f"{'total':>10}")
    for e in switches:
        label = f"{e['reason']} -> {e['world_size']} procs"
        print(f"{label:<22}" + "".join(f"{e['phases_s'][p]:>13.3f}" for p in phases) + f"{e['total_s']:>10.2f}")
    mean = {p: sum(e["phases_s"][p] for e in switches) / len(switches) for p in phases}
    total = sum(e["total_s"] for e in switches) / len(switches)
    print(f"{'mean':<22}" + "".join(f"{mean[p]:>13.3f}" for p in phases) + f"{total:>10.2f}")
    met = all(e["total_s"] <= target for e in switches)
    restarted = sum(e["survivors_restarted"] for e in switches)
    print(f"target <= {target:g} s for every switch: {'met' if met else 'missed'}; surviving ranks restarted:"
          f" {restarted} of {sum(e['survivors'] for e in switches)}"
          + ("" if live else "; published Sailor about 11 s on 16 V100 (before rollback)"))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(json.dumps({"benchmark": "reconfigure", "path": "ssh stand-in" if args.via_ssh else "local",
                      "switch": "live" if live else "restart", "load_1min": load,
                      "switches": [{"reason": e["reason"], "to_processes": e["world_size"], "total_s": e["total_s"],
                                    "survivors": e["survivors"], "survivors_restarted": e["survivors_restarted"],
                                    **e["phases_s"]} for e in switches],
                      "survivors_restarted": restarted, "mean_total_s": total, "mean_phases_s": mean,
                      "target_s": target, "target_met": met}))
    return 0


def _stand_in_hosts(t: Path, cluster):
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
