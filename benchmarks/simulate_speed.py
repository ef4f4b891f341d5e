"""Simulator speed: one 512-GPU plan with 64 micro-batches per pipeline, simulated with the 1F1B event
simulation (plus sync, optimizer, memory and cost). Target: under 20 ms per `simulate` call.

The plan is OPT-350M on a heterogeneous, two-zone cluster: 32 pipelines of 8 stages at TP 2 (16 GPUs
each), half on A100-40 in us-central1-a and half on V100-16 in us-central1-b, with roofline
profiles and catalog links. Each timed call uses a fresh SimContext (cold caches, as a planner
re-scoring a new candidate would see); the warm figure reuses one context. Prints a table, then
one JSON line with the figures. `--schedule` simulates the same layer chunks under another pipeline
schedule: zb-h1 on the same 8 stages, interleaved-1f1b with the 8 chunks on 4 stages (v = 2, 8 GPUs
per pipeline, 256 GPUs); the target is the 1F1B one.

    python benchmarks/simulate_speed.py [--repeats 20] [--schedule 1f1b|zb-h1|interleaved-1f1b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sailor.plan.spec import Plan
from sailor.simulator import make_context, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

TARGET_S = 0.020
STAGES = [[0, 4], [4, 7], [7, 10], [10, 13], [13, 16], [16, 19], [19, 22], [22, 26]]
MICROBATCHES, MBS, TP = 64, 1, 2


def bench_plan(schedule: str = "1f1b") -> tuple[Plan, JobSpec, ClusterSpec]:
    v = 2 if schedule == "interleaved-1f1b" else 1
    pipelines = []
    for j in range(32):
        gpu, zone = ("A100-40", "us-central1-a") if j % 2 == 0 else ("V100-16", "us-central1-b")
        pipelines.append({"microbatches": MICROBATCHES,
                          "replicas": [{"stage": i, "gpu": gpu, "zone": zone, "tp": TP} for i in range(len(STAGES) // v)]})
    plan = Plan.model_validate({"micro_batch_size": MBS, "stages": STAGES, "pipelines": pipelines,
                                "schedule": {"kind": schedule} | ({"virtual_stages": v} if v > 1 else {})})
    job = JobSpec(model="opt-350m", global_batch_size=plan.global_batch_size)
    cluster = ClusterSpec(zones={"us-central1-a": {"A100-40": 256}, "us-central1-b": {"V100-16": 256}})
    plan.check_against(job, cluster)
    assert plan.world_size == 512 // v
    return plan, job, cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20, help="timed calls (after one warm-up call)")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "zb-h1", "interleaved-1f1b"],
                    help="pipeline schedule of the plan (see above)")
    args = ap.parse_args()
    plan, job, cluster = bench_plan(args.schedule)
    simulate(plan, make_context(job, cluster))  # warm-up: imports, catalog load
    cold = []
    for _ in range(args.repeats):
        ctx = make_context(job, cluster)
        t0 = time.perf_counter()
        est = simulate(plan, ctx)
        cold.append(time.perf_counter() - t0)
    ctx = make_context(job, cluster)
    simulate(plan, ctx)
    warm = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        simulate(plan, ctx)
        warm.append(time.perf_counter() - t0)
    figures = {
        "schedule": args.schedule, "gpus": plan.world_size, "pipelines": len(plan.pipelines), "stages": plan.num_stages,
        "microbatches_per_pipeline": MICROBATCHES,
        "cold_median_ms": 1e3 * statistics.median(cold), "cold_max_ms": 1e3 * max(cold),
        "warm_median_ms": 1e3 * statistics.median(warm), "target_ms": 1e3 * TARGET_S,
        "iteration_time_s": est.iteration_time_s,
    }
    figures["meets_target"] = figures["cold_median_ms"] < figures["target_ms"]
    print(f"{'plan':<34}{plan.world_size} GPUs, {len(plan.pipelines)} pipelines x {plan.num_stages} stages x TP {TP},"
          f" {MICROBATCHES} micro-batches each, {est.schedule.label}")
    print(f"{'simulate, fresh context (ms)':<34}median {figures['cold_median_ms']:.2f}, max {figures['cold_max_ms']:.2f}")
    print(f"{'simulate, warm context (ms)':<34}median {figures['warm_median_ms']:.2f}")
    print(f"{'target (ms)':<34}{figures['target_ms']:.0f} -> {'met' if figures['meets_target'] else 'MISSED'}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
