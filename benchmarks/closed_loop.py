"""Closed loop on this machine: profile, simulate, train, compare predicted and measured step time.

1. `sailor profile` the job's model on this device (TP 1 and 2, the plans' micro-batch size) and
   `sailor profile network --nproc 2` the links between local processes;
2. for each plan below, `sailor simulate --profiles --network --json` (predicted iteration time) and
   `sailor train --steps N --metrics` (measured: median step_time_s after the first `--skip` steps);
3. `sailor plan` for a 2-process local cluster *without* profiles (so it measures this machine
   briefly itself, `sailor.runtime.machine`, into a fresh cache) and `sailor train` of the plan it
   picks: the `local_plan` row, whose prediction must be within 2x of the measured step time;
4. print a table, then, as the last line, one JSON object with `mean_abs_error_pct` (over the plans
   of step 2), `local_plan` and the per-plan rows. Target on the 2-core CPU build machines: mean
   absolute error <= 10 %.

Other jobs on a shared machine change both sides of the comparison, so the profile and every run
first wait (up to QUIET_WAIT_S) for a quiet machine: 1-minute load below QUIET_LOAD and other
processes using fewer than QUIET_BUSY_CORES cores. Each row records the load before and after its run
and the cores other processes used during it (/proc/stat minus our own CPU time); a run disturbed
by them is repeated once.

Plans (the `tiny` model, 2 processes each, so every process has a core):
  dp2       1 stage x 2 pipelines (data parallel)
  pp2       2 stages, layers split 3 | 3
  tp2       1 stage at TP 2
  pp2_uneven 2 stages, layers split 2 | 4
  dp2_shares 1 stage x 2 pipelines taking 3/4 and 1/4 of the batch

    python benchmarks/closed_loop.py [--device cpu] [--steps 10] [--skip 3] [--gbs 64] [--mbs 4]
        [--model tiny] [--seq N] [--out DIR] [--single-device --mbs 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUIET_LOAD = 1.0  # 1-minute load average below which the machine counts as quiet
QUIET_BUSY_CORES = 0.3  # and cores kept busy by other processes over a 2-s sample
QUIET_WAIT_S = 240.0  # give up waiting (and say so in the output) after this long


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (/proc/stat, steal counted as busy)."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return sum(v) - v[3] - v[4], sum(v)


def _load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Foreign:
    """CPU time other processes used while a block ran: the machine's busy time (/proc/stat) minus
    this script's own and its children's CPU time, in cores (0 on a machine that ran only us)."""

    def __enter__(self):
        self.t0, self.j0, self.own0 = time.monotonic(), _busy_jiffies(), _children_cpu_s() + time.process_time()
        return self

    def __exit__(self, *exc):
        wall = time.monotonic() - self.t0
        j1 = _busy_jiffies()
        ncpu = os.cpu_count() or 1
        busy_s = (j1[0] - self.j0[0]) / max(j1[1] - self.j0[1], 1) * ncpu * wall
        own_s = _children_cpu_s() + time.process_time() - self.own0
        self.cores = max(0.0, (busy_s - own_s) / max(wall, 1e-9))
        return False


def wait_quiet(max_wait_s: float = QUIET_WAIT_S) -> dict:
    """Sleep until the 1-minute load is below QUIET_LOAD and other processes keep fewer than
    QUIET_BUSY_CORES cores busy (at most `max_wait_s`); returns what was seen."""
    t0 = time.monotonic()
    while True:
        with Foreign() as f:
            time.sleep(2.0)
        load = _load1()
        # The load average also counts this benchmark's own runs of the last minute; the busy cores of
        # other processes do not, so they decide once our own runs are part of the load.
        quiet = f.cores < QUIET_BUSY_CORES and (load < QUIET_LOAD or time.monotonic() - t0 > 10.0)
        if quiet or time.monotonic() - t0 > max_wait_s:
            return {"load1": load, "busy_cores": round(f.cores, 2), "quiet": quiet,
                    "waited_s": round(time.monotonic() - t0, 1)}
        time.sleep(5.0)


def _rep(stage: int, tp: int, gpu: str) -> dict:
    return {"stage": stage, "gpu": gpu, "zone": "local", "tp": tp}


def plans(gbs: int, mbs: int, gpu: str) -> dict[str, dict]:
    """The benchmark's plans for a global batch of `gbs` samples in micro-batches of `mbs`."""
    m = gbs // mbs
    one = [[0, 6]]
    return {
        "dp2": {"stages": one, "pipelines": [{"microbatches": m // 2, "replicas": [_rep(0, 1, gpu)]}] * 2},
        "pp2": {"stages": [[0, 3], [3, 6]],
                "pipelines": [{"microbatches": m, "replicas": [_rep(0, 1, gpu), _rep(1, 1, gpu)]}]},
        "tp2": {"stages": one, "pipelines": [{"microbatches": m, "replicas": [_rep(0, 2, gpu)]}]},
        "pp2_uneven": {"stages": [[0, 2], [2, 6]],
                       "pipelines": [{"microbatches": m, "replicas": [_rep(0, 1, gpu), _rep(1, 1, gpu)]}]},
        "dp2_shares": {"stages": one, "pipelines": [{"microbatches": 3 * m // 4, "replicas": [_rep(0, 1, gpu)]},
                                                    {"microbatches": m // 4, "replicas": [_rep(0, 1, gpu)]}]},
    }


def single_device_plans(gbs: int, mbs_list: list[int], gpu: str) -> dict[str, tuple[int, dict]]:
    """One process, one stage, one pipeline per micro-batch size: name -> (mbs, plan body)."""
    return {f"single_mbs{b}": (b, {"stages": [[0, 0]], "pipelines": [{"microbatches": gbs // b,
                                                                      "replicas": [_rep(0, 1, gpu)]}]})
            for b in mbs_list}


def _sailor() -> str:
    exe = Path(sys.executable).parent / "sailor"
    return str(exe) if exe.exists() else (shutil.which("sailor") or "sailor")


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc.stdout


def closed_loop(args: argparse.Namespace, work: Path) -> list[dict]:
    """Profile, then simulate and train every plan; returns the per-plan rows."""
    sailor = _sailor()
    model = {"model": args.model, "global_batch_size": args.gbs,
             "precision": "fp32" if args.device == "cpu" else "bf16"}
    if args.seq:
        model["sequence_length"] = args.seq
    job = work / "job.json"
    job.write_text(json.dumps(model))
    prof, net = work / "profile.json", work / "network.json"

    mbs_list = [int(b) for b in str(args.mbs).split(",")]
    tps = "1" if args.single_device else "1,2"

    def profile() -> str:
        machine = wait_quiet(args.quiet_wait_s)
        print(f"profiling {args.model} on {args.device} ({machine}) ...", file=sys.stderr)
        _run([sailor, "profile", "--job", str(job), "--device", args.device, "--tp", tps, "--mbs", str(args.mbs),
              "--repeats", str(args.repeats), "--out", str(prof)])
        return next(iter(json.loads(prof.read_text())["optimizer"]))

    gpu = profile()
    net_args = []
    if not args.single_device:
        _run([sailor, "profile", "network", "--nproc", "2", "--device", args.device, "--out", str(net)])
        net_args = ["--network", str(net)]
    num_layers = len(json.loads(prof.read_text())["layers"][0]["forward_s"])
    if args.single_device:
        todo = {n: (b, {**body, "stages": [[0, num_layers]]}) for n, (b, body) in
                single_device_plans(args.gbs, mbs_list, gpu).items()}
    else:
        todo = {n: (mbs_list[0], body) for n, body in plans(args.gbs, mbs_list[0], gpu).items()}
    rows = []
    if not args.single_device and not args.plans:
        rows.append(local_plan(args, work, sailor, job))
    for k, (name, (mbs, body)) in enumerate(todo.items()):
        if args.plans and name not in args.plans:
            continue
        if args.reprofile and k:
            # A shared machine's background load drifts over minutes: profile again just before each
            # run, so prediction and measurement see the same machine.
            profile()
        plan = work / f"{name}.json"
        plan.write_text(json.dumps({"micro_batch_size": mbs, **body, "job": model}))
        est = json.loads(_run([sailor, "simulate", str(plan), "--profiles", str(prof), *net_args, "--json"]))
        steps, machine = _train(args, plan, work / f"{name}.jsonl", name)
        measured = statistics.median(s["step_time_s"] for s in steps)
        predicted = est["iteration_time_s"]
        ratios = []
        if body["pipelines"][0]["replicas"][0]["tp"] == 1:  # TP stages also hold all-reduce waits
            layer = next(r for r in json.loads(prof.read_text())["layers"] if r["tp"] == 1 and r["mbs"] == mbs)
            m = max(p["microbatches"] for p in body["pipelines"])
            for i, (a, e) in enumerate(body["stages"]):
                meas = statistics.median(s["stages"][i]["forward_s"] + s["stages"][i]["backward_s"] for s in steps) / m
                ratios.append(meas / (sum(layer["forward_s"][a:e]) + sum(layer["backward_s"][a:e])))
        rows.append({"plan": name, "compute_ratio_per_stage": ratios, "stages": body["stages"],
                     "pipelines": [p["microbatches"] for p in body["pipelines"]],
                     "tp": body["pipelines"][0]["replicas"][0]["tp"], "predicted_s": predicted,
                     "measured_s": measured, "error_pct": 100.0 * (predicted - measured) / measured,
                     "measured_spread_s": max(s["step_time_s"] for s in steps) - min(s["step_time_s"] for s in steps),
                     "estimated": est["estimated"], "machine": machine})
    return rows


def _train(args: argparse.Namespace, plan: Path, metrics: Path, name: str) -> tuple[list[dict], dict]:
    """`sailor train` of `plan` on a quiet machine (a second try when other processes took CPU time
    during the run); (steps after the first `--skip`, machine record)."""
    for attempt in range(2):
        before = wait_quiet(args.quiet_wait_s)
        print(f"training {name} ({before}) ...", file=sys.stderr)
        metrics.unlink(missing_ok=True)
        with Foreign() as during:
            _run([_sailor(), "train", str(plan), "--steps", str(args.steps), "--metrics", str(metrics),
                  "--device", args.device])
        if during.cores < QUIET_BUSY_CORES:
            break
    machine = {"load1_before": before["load1"], "load1_after": _load1(),
               "other_busy_cores_during": round(during.cores, 2), "attempts": attempt + 1}
    return [json.loads(line) for line in metrics.read_text().splitlines()][args.skip:], machine


def local_plan(args: argparse.Namespace, work: Path, sailor: str, job: Path) -> dict:
    """`sailor plan` on a 2-process local cluster without profiles (it measures the machine itself,
    into a cache of its own here), then train the plan it picks: predicted vs measured step time."""
    cluster = work / "local2.json"
    cluster.write_text(json.dumps({"provider": "local", "zones": {"local": {"cpu": 2}}}))
    plan = work / "local_plan.json"
    wait_quiet(args.quiet_wait_s)
    env = {**os.environ, "SAILOR_CACHE_DIR": str(work / "cache")}
    proc = subprocess.run([sailor, "plan", "--job", str(job), "--cluster", str(cluster), "--out", str(plan), "--json"],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"sailor plan failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(proc.stderr.strip(), file=sys.stderr)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    steps, machine = _train(args, plan, work / "local_plan.jsonl", "local_plan")
    measured = statistics.median(s["step_time_s"] for s in steps)
    predicted = got["estimate"]["iteration_time_s"]
    p = got["plan"]
    return {"plan": "local_plan", "stages": p["stages"], "pipelines": [q["microbatches"] for q in p["pipelines"]],
            "tp": p["pipelines"][0]["replicas"][0]["tp"], "micro_batch_size": p["micro_batch_size"],
            "predicted_s": predicted, "measured_s": measured, "error_pct": 100.0 * (predicted - measured) / measured,
            "ratio": predicted / measured, "estimated": got["estimate"]["estimated"], "planner_note": proc.stderr.strip(),
            "compute_ratio_per_stage": [], "machine": machine}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the model's)")
    ap.add_argument("--gbs", type=int, default=64)
    ap.add_argument("--mbs", default="4", help="micro-batch size; with --single-device a comma-separated sweep")
    ap.add_argument("--single-device", action="store_true",
                    help="one process per plan (a single GPU): plans single_mbs<b> for each micro-batch size b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out (warm-up)")
    ap.add_argument("--repeats", type=int, default=20, help="profiler repeats")
    ap.add_argument("--plans", nargs="*", help="only these plans")
    ap.add_argument("--reprofile", action=argparse.BooleanOptionalAction, default=False,
                    help="profile again before each plan (off: every profile and run waits for a quiet machine)")
    ap.add_argument("--quiet-wait-s", type=float, default=QUIET_WAIT_S,
                    help="longest wait (s) for a quiet machine before each profile and run")
    ap.add_argument("--out", help="keep profile, plans and metrics in this folder")
    args = ap.parse_args()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        rows = closed_loop(args, Path(args.out))
    else:
        with tempfile.TemporaryDirectory(prefix="sailor-closed-loop-") as tmp:
            rows = closed_loop(args, Path(tmp))
    print(f"{'plan':<12} {'stages':<18} {'micro-batches':<14} {'TP':>3} {'predicted (s)':>14} {'measured (s)':>13}"
          f" {'error (%)':>10}")
    for r in rows:
        print(f"{r['plan']:<12} {str(r['stages']):<18} {str(r['pipelines']):<14} {r['tp']:>3} {r['predicted_s']:>14.4f}"
              f" {r['measured_s']:>13.4f} {r['error_pct']:>+10.1f}")
    local = next((r for r in rows if r["plan"] == "local_plan"), None)
    rows = [r for r in rows if r is not local]
    mae = statistics.mean(abs(r["error_pct"]) for r in rows)
    ratios = [x for r in rows for x in r["compute_ratio_per_stage"]]
    if ratios:
        print(f"in-run / profiled compute per stage and micro-batch: median {statistics.median(ratios):.2f}"
              f" (range {min(ratios):.2f} .. {max(ratios):.2f})")
    loads = [r["machine"]["load1_before"] for r in rows] + [r["machine"]["load1_after"] for r in rows]
    print(f"1-minute load average around the runs: {min(loads):.2f} .. {max(loads):.2f}; other processes'"
          f" busy cores during them: max {max(r['machine']['other_busy_cores_during'] for r in rows):.2f}")
    if local:
        print(f"local plan (sailor plan without profiles, machine measured by the planner): predicted"
              f" {local['predicted_s']:.4f} s, measured {local['measured_s']:.4f} s, ratio {local['ratio']:.2f}"
              f" (target 0.5 .. 2)")
    print(json.dumps({"mean_abs_error_pct": mae, "plans": len(rows), "local_plan": local,
                      "device": args.device, "model": args.model,
                      "load1_range": [min(loads), max(loads)],
                      "global_batch_size": args.gbs, "micro_batch_size": args.mbs, "rows": rows}))


if __name__ == "__main__":
    main()
