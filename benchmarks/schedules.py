"""Pipeline schedules on this machine: predicted vs measured step time and bubble, per schedule.

A 4-stage plan of a small model (an 8-block GPT of hidden size 384, one pipeline, TP 1, 2
micro-batches of 2 sequences of 128 tokens) under
`1f1b`, `interleaved-1f1b` (v = 2: 8 chunks, stage i holds chunks i and i + 4) and `zb-h1`.
`--stages 2` runs the same model as a 2-stage plan (4 chunks under interleaving). The simulator
gives every stage a device of its own; on a machine with fewer cores than stages (the project's
build machines have 2) the stage processes share the cores, so a stage that waits in the bubble
lends its core to another one and the schedules' step times move together: the 4-stage plan on 2
cores compares the machine's time slicing more than the schedules. With 2 stages each stage has a
core, as on GPUs.
1. `sailor profile` the model on this CPU (micro-batch size of the plans, `--concurrency` = the
   stages: the plans run that many processes, so every layer is timed with as many running at once),
   which also measures each layer's backward split into its input- and weight-gradient passes;
   `sailor profile network --nproc 2` the links between local processes;
2. `sailor simulate --profiles --network --json` each plan (predicted step time, and the bubble of
   the event simulation);
3. `sailor train --steps N --metrics` each plan, the schedules taking turns for `--rounds` rounds
   (a run's time: the median step_time_s after its first `--skip` steps). The background load of a
   shared machine drifts over minutes and moves a run by more than the schedules differ, so the
   measured order compares the schedules within each round: each run's time over the geometric mean
   of its round's three, the median over rounds (`relative`); `step_s` is the median run time;
4. print a table, then, as the last line, one JSON object with `predicted_order_matches_measured`
   (the schedules sorted by predicted step time in the same order as by measured relative step
   time), the order within each round, the per-schedule rows and the 1-minute load average
   (`/proc/loadavg`, as `uptime` shows it) around every run.

Bubble fraction: the share of the pipeline phase the busiest stage waits, 1 - m·max_i t_i / T with
t_i stage i's compute per micro-batch (all chunks, B and W passes) and T the pipeline phase.
Predicted: t_i from the simulator's replica rows, T its pipeline time. Measured: per step, max_i of
the stage's forward + backward seconds over max_i of forward + backward + wait (the runtime's phase
timers, `sailor train --metrics`), the median over steps.

The machine is shared: other jobs take CPU time from the profile and the runs alike; the load is
reported, not waited out (benchmarks/closed_loop.py waits for a quiet machine instead). Under such
load a rank gets the CPU in time slices, so every hand-over between stages can wait for the next
slice of the receiving rank; the model's hidden size (384) keeps passes long against that (a
block's pass is tens of ms of CPU time), as they are against a GPU's launch latencies. Two
micro-batches (m < p) is where the three schedules' predicted times lie furthest apart (about 10 %
from one to the next with this machine's profile; chosen on predictions alone), so that what is
compared is the schedules, not the noise.

On the testbed (`--testbed examples/testbed.yaml`, root) each stage is a rank of the testbed's first
device class under its own CPU quota (`sailor testbed`): a stage waiting in the bubble lends its time
to no other, as on GPUs. Its profile is measured inside that quota (`sailor.testbed.profile`), the
plans simulated on the testbed's cluster spec and launched through its stand-in ssh
(`sailor launch --backend torchrun --hosts`), the stages placed on its nodes by the launcher.

    python benchmarks/schedules.py [--stages 4|2] [--steps 7] [--skip 2] [--rounds 6] [--microbatches 2] [--out DIR]
        [--testbed examples/testbed.yaml]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from closed_loop import _load1, _run, _sailor  # noqa: E402  (benchmarks/ is not a package)
from testbed import launch_plan, live_testbed  # noqa: E402

MODEL = {"name": "gpt-8x384", "num_blocks": 8, "hidden_size": 384, "num_heads": 6, "vocab_size": 512,
         "max_sequence_length": 128, "tied_embeddings": False}
LAYOUTS = {  # stages -> (1F1B/ZB-H1 stages, interleaved v = 2 chunks: stage i holds chunks i and i + p)
    4: ([[0, 3], [3, 5], [5, 7], [7, 10]],  # embedding + 2 blocks, 2, 2, 2 blocks + head
        [[0, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6, 7], [7, 8], [8, 10]]),
    2: ([[0, 5], [5, 10]],  # embedding + 4 blocks, 4 blocks + head
        [[0, 3], [3, 5], [5, 7], [7, 10]]),
}
SCHEDULES = {"1f1b": {"kind": "1f1b"}, "interleaved-1f1b": {"kind": "interleaved-1f1b", "virtual_stages": 2},
             "zb-h1": {"kind": "zb-h1"}}


def plan_body(name: str, p: int, m: int, mbs: int, job: dict, where: tuple[str, str] = ("cpu", "local")) -> dict:
    stages, chunks = LAYOUTS[p]
    schedule = SCHEDULES[name]
    reps = [{"stage": i, "gpu": where[0], "zone": where[1], "tp": 1} for i in range(p)]
    return {"micro_batch_size": mbs, "stages": chunks if schedule["kind"] == "interleaved-1f1b" else stages,
            "schedule": schedule, "pipelines": [{"microbatches": m, "replicas": reps}], "job": job}


def predicted(est: dict, m: int) -> dict:
    """Step time and bubble fraction from `sailor simulate --json`."""
    busy = max(r["forward_s"] + r["backward_s"] for r in est["replicas"])  # per micro-batch, all chunks
    pipe = est["breakdown"]["pipeline"]
    return {"step_s": est["iteration_time_s"], "pipeline_s": pipe, "bubble": 1.0 - m * busy / pipe}


def measured(runs: list[list[dict]], relative: list[float]) -> dict:
    """Step time (median over runs of each run's median), relative step time (median over rounds)
    and bubble fraction (median over all steps) of one schedule's runs (`sailor train --metrics`
    rows per run)."""
    steps = [s for run in runs for s in run]
    bubbles, pipes = [], []
    for s in steps:
        pipe = max(x["forward_s"] + x["backward_s"] + x["wait_s"] for x in s["stages"])
        bubbles.append(1.0 - max(x["forward_s"] + x["backward_s"] for x in s["stages"]) / pipe)
        pipes.append(pipe)
    times = [statistics.median(s["step_time_s"] for s in run) for run in runs]
    return {"step_s": statistics.median(times), "relative": statistics.median(relative),
            "run_step_s": times, "pipeline_s": statistics.median(pipes), "bubble": statistics.median(bubbles)}


def run(args: argparse.Namespace, work: Path, testbed=None) -> dict:
    """Profile, simulate and train the three schedules (module docstring). With `testbed` (spec, live
    state): the device class of the testbed's first node, each stage a rank of that class under its
    own quota, launched through the stand-in ssh over the testbed's links."""
    sailor = _sailor()
    m, mbs = args.microbatches, args.mbs
    job = {"model": MODEL, "global_batch_size": m * mbs, "sequence_length": args.seq, "precision": "fp32"}
    (work / "job.json").write_text(json.dumps(job))
    prof, net = work / "profile.json", work / "network.json"
    load = {"profile_before": _load1()}
    print(f"profiling {MODEL['name']} (load {load['profile_before']:.2f}) ...", file=sys.stderr)
    if testbed is None:
        where = ("cpu", "local")
        _run([sailor, "profile", "--job", str(work / "job.json"), "--device", "cpu", "--tp", "1", "--mbs", str(mbs),
              "--concurrency", str(args.stages), "--repeats", str(args.repeats), "--out", str(prof)])
        _run([sailor, "profile", "network", "--nproc", "2", "--device", "cpu", "--out", str(net)])
        where_args = ["--network", str(net)]
    else:
        from sailor.core.fileio import write_json
        from sailor.testbed.profile import profile_classes
        spec, state = testbed
        first = spec.nodes[0]
        where = (spec.devices[first.device].gpu, first.zone)
        write_json(prof, profile_classes(spec, state, work / "job.json", mbs=str(mbs), classes=[first.device]))
        where_args = ["--cluster", str(state.cluster_file), "--job", str(work / "job.json")]
    load["profile_after"] = _load1()
    rows = {}
    for name in SCHEDULES:
        plan = work / f"{name}.json"
        body = plan_body(name, args.stages, m, mbs, job, where)
        plan.write_text(json.dumps(body if testbed is None else {k: v for k, v in body.items() if k != "job"}))
        est = json.loads(_run([sailor, "simulate", str(plan), "--profiles", str(prof), *where_args, "--json"]))
        rows[name] = {"predicted": predicted(est, m), "estimated": est["estimated"], "load1": []}
    runs: dict[str, list[list[dict]]] = {name: [] for name in SCHEDULES}
    relative: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    round_orders = []
    for r in range(args.rounds):
        for name in SCHEDULES:
            metrics = work / f"{name}-{r}.jsonl"
            before = _load1()
            print(f"training {name}, round {r + 1} (load {before:.2f}) ...", file=sys.stderr)
            if testbed is None:
                _run([sailor, "train", str(work / f"{name}.json"), "--steps", str(args.steps), "--metrics", str(metrics)])
            else:
                metrics.unlink(missing_ok=True)
                launch_plan(testbed[1], work / f"{name}.json", work / "job.json", args.steps, metrics, work / f"{name}-{r}.log")
            rows[name]["load1"] += [before, _load1()]
            runs[name].append([json.loads(line) for line in metrics.read_text().splitlines()][args.skip:])
        times = {n: statistics.median(s["step_time_s"] for s in runs[n][-1]) for n in SCHEDULES}
        mean = statistics.geometric_mean(times.values())
        for n, t in times.items():
            relative[n].append(t / mean)
        round_orders.append(sorted(times, key=times.get))
    for name, row in rows.items():
        row["measured"] = measured(runs[name], relative[name])
        row["error_pct"] = 100.0 * (row["predicted"]["step_s"] - row["measured"]["step_s"]) / row["measured"]["step_s"]
    return {"rows": rows, "load1": load, "round_orders": round_orders}


def check_args(args: argparse.Namespace):
    """Refuse settings no run can use, before any work: sizes and counts below 1, fewer than one timed
    step after --skip, a testbed file that does not read or has fewer ranks of its first node's device
    class than the plans have stages. Returns the testbed spec (None without --testbed).

    Raises:
        SailorInputError: naming the option or the testbed file.
    """
    from sailor.core.errors import SailorInputError

    for option in ("microbatches", "mbs", "seq", "steps", "rounds", "repeats"):
        if getattr(args, option) < 1:
            raise SailorInputError(f"must be >= 1, got {getattr(args, option)}", source=f"--{option}")
    if not 0 <= args.skip < args.steps:
        raise SailorInputError(f"need 0 <= --skip < --steps (a timed step), got --skip {args.skip}", source="--skip")
    if args.testbed is None:
        return None
    from sailor.testbed import load_testbed

    spec = load_testbed(args.testbed)
    first = spec.nodes[0].device
    if sum(n.ranks for n in spec.nodes if n.device == first) < args.stages:
        raise SailorInputError(f"the {args.stages}-stage plans need {args.stages} ranks of device class {first!r}",
                               source=str(args.testbed), field="nodes", fix="or pass --stages 2")
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, choices=sorted(LAYOUTS), default=4,
                    help="pipeline stages (processes): 4 as issue #16 asks; 2 gives each stage a core of this 2-core machine")
    ap.add_argument("--microbatches", type=int, default=2, help="micro-batches per step (m)")
    ap.add_argument("--mbs", type=int, default=2, help="micro-batch size (samples)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (tokens)")
    ap.add_argument("--steps", type=int, default=7, help="steps per run")
    ap.add_argument("--skip", type=int, default=2, help="first steps of each run left out (warm-up)")
    ap.add_argument("--rounds", type=int, default=6, help="runs per schedule, taking turns")
    ap.add_argument("--repeats", type=int, default=5, help="profiler repeats")
    ap.add_argument("--out", help="keep profile, plans and metrics in this folder")
    ap.add_argument("--testbed", type=Path, help="run on this testbed (`sailor testbed`, root): one rank per stage of"
                                                 " the first node's device class, under per-rank quotas")
    args = ap.parse_args()
    from sailor.core.errors import SailorInputError

    try:
        spec = check_args(args)
    except SailorInputError as e:  # bad input: one line, exit status 2, before any work
        print(f"error: {e.one_line()}", file=sys.stderr)
        raise SystemExit(2) from None
    with contextlib.ExitStack() as stack:
        work = Path(args.out) if args.out else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sailor-schedules-")))
        work.mkdir(parents=True, exist_ok=True)
        testbed = stack.enter_context(live_testbed(spec, work)) if spec else None
        res = run(args, work, testbed)
    rows = res["rows"]
    print(f"{'schedule':<18} {'predicted (s)':>14} {'measured (s)':>13} {'error (%)':>10} {'relative':>9}"
          f" {'bubble pred':>12} {'bubble meas':>12} {'runs (s)':>28} {'load1 around runs':>20}")
    for name, r in rows.items():
        m = r["measured"]
        print(f"{name:<18} {r['predicted']['step_s']:>14.4f} {m['step_s']:>13.4f} {r['error_pct']:>+10.1f}"
              f" {m['relative']:>9.3f} {r['predicted']['bubble']:>12.3f} {m['bubble']:>12.3f}"
              f" {' '.join(f'{t:.2f}' for t in m['run_step_s']):>28} {min(r['load1']):>9.2f} .. {max(r['load1']):<6.2f}")
    pred_order = sorted(rows, key=lambda n: rows[n]["predicted"]["step_s"])
    meas_order = sorted(rows, key=lambda n: rows[n]["measured"]["relative"])
    print(f"predicted order (fastest first): {' < '.join(pred_order)}; measured (relative): {' < '.join(meas_order)}")
    print("order within each round: " + "; ".join(" < ".join(o) for o in res["round_orders"]))
    print(f"1-minute load average (uptime): profile {res['load1']['profile_before']:.2f} .. "
          f"{res['load1']['profile_after']:.2f}; runs as above")
    print(json.dumps({"predicted_order_matches_measured": pred_order == meas_order, "predicted_order": pred_order,
                      "measured_order": meas_order, "round_orders": res["round_orders"],
                      "rounds_matching_prediction": sum(o == pred_order for o in res["round_orders"]), "model": MODEL, "stages": args.stages, "cpu_cores": os.cpu_count(), "microbatches": args.microbatches,
                      "micro_batch_size": args.mbs, "sequence_length": args.seq, "load1": res["load1"],
                      "rows": rows}))


if __name__ == "__main__":
    main()
