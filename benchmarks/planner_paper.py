"""Planner on the Sailor paper's scenarios, with the public reference profiles and network.

OPT-350M, global batch 1024, fp32, 4 GPUs per node, prices A100-40 3.673385 and V100-16 2.859998
$/GPU-hour (the paper's); A100-80 at the catalog's list price. For every scenario and every search
space (full = ours, paper = the published space, homogeneous = one GPU type in one zone): search
time, plan, iterations/s and $/iteration (event-simulated). Prints a table and ends with one JSON
line. Targets (2-core machine): (a) 128 <= 0.1 s, (b) 128+384 <= 6 s, (e) 128+384 <= 12 s, (f) <= 2 s;
full never worse than paper, strictly better on heterogeneous scenarios. The older search that
`planner.engine` replaced is not part of sailor, so it is not compared here.

    python benchmarks/planner_paper.py [--only a,b] [--shared PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sailor.core.errors import InfeasibleError
from sailor.perf.network_files import network_for
from sailor.perf.profiles import load_profiles
from sailor.planner import Constraints, Objective, PlanOptions, SearchSpace, plan_job
from sailor.simulator import make_context
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_scale import describe  # noqa: E402  (one plan description for both planner benchmarks)

PRICES = {"A100-40": 3.673385, "V100-16": 2.859998}  # the paper's $/GPU-hour
NODE = {"A100-40": 4, "V100-16": 4, "A100-80": 4}
ZONES5 = ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-b"]
OPT = JobSpec(model="opt-350m", global_batch_size=1024, precision="fp32")
NEO = JobSpec(model="gpt-neo-2.7b", global_batch_size=2048, precision="fp32")


def scenarios():
    """(id, job, zones, objective, constraints) for every scenario of the issue."""
    for n in (32, 80, 128):
        yield f"a-{n}", OPT, {"us-central1-a": {"A100-40": n}}, Objective.THROUGHPUT, Constraints()
    for n in (32, 80, 128):
        yield f"b-{n}+{3 * n}", OPT, {"us-central1-a": {"A100-40": n, "V100-16": 3 * n}}, Objective.THROUGHPUT, Constraints()
    for n in (32, 80, 128):
        yield f"c-5x{n}", OPT, {z: {"A100-40": n} for z in ZONES5}, Objective.THROUGHPUT, Constraints()
    two = {z: {"A100-40": 128, "V100-16": 128} for z in ZONES5[:2]}
    yield "d-cost@0.2it/s", OPT, two, Objective.COST, Constraints(min_throughput=0.2)
    yield "d-thr@1.2$/it", OPT, two, Objective.THROUGHPUT, Constraints(max_cost_per_iteration=1.2)
    for n in (32, 80, 128):
        yield f"e-{n}+{3 * n}", NEO, {"us-central1-a": {"A100-40": n, "V100-16": 3 * n}}, Objective.THROUGHPUT, Constraints()
    yield "f-3x256", OPT, {"us-central1-a": {"A100-40": 256, "V100-16": 256, "A100-80": 256}}, Objective.THROUGHPUT, Constraints()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated scenario letters, e.g. a,b")
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"),
                    help="folder holding reference/sailor (default: ../shared next to the repo)")
    args = ap.parse_args()
    ref = Path(args.shared) / "reference" / "sailor"
    if not ref.is_dir():
        print(f"skipped: the reference data folder {ref} is absent")
        print(json.dumps({"skipped": f"{ref} absent"}))
        return 0
    only = set(filter(None, args.only.split(",")))
    con = Console(width=200)
    table = Table(title="sailor plan on the paper's scenarios (reference profiles and network)")
    for col in ("scenario", "search", "time (s)", "it/s", "$/it", "GPUs", "plan"):
        table.add_column(col, justify="left" if col in ("scenario", "search", "plan") else "right")
    rows = []
    for sid, job, zones, objective, constraints in scenarios():
        if only and sid[0] not in only:
            continue
        cluster = ClusterSpec(zones=zones, gpus_per_node=NODE, prices=PRICES)
        profiles = load_profiles(ref / "profiles", job)
        network = network_for(cluster, ref / "network")
        for space in SearchSpace:
            ctx = make_context(job, cluster, profiles, network)
            opts = PlanOptions(objective=objective, constraints=constraints, search=space)
            try:
                r = plan_job(ctx, opts)
            except InfeasibleError as e:
                rows.append({"scenario": sid, "search": space.value, "infeasible": str(e)})
                table.add_row(sid, space.value, "-", "-", "-", "-", f"infeasible: {e}")
                continue
            e = r.estimate
            row = {"scenario": sid, "search": space.value, "search_time_s": round(r.search_time_s, 4),
                   "iters_per_s": e.throughput_iters_per_s, "cost_per_iteration_usd": e.cost_per_iteration_usd,
                   "gpus": r.plan.world_size, "plan": describe(r.plan)}
            rows.append(row)
            table.add_row(sid, space.value, f"{r.search_time_s:.2f}", f"{e.throughput_iters_per_s:.4f}",
                          f"{e.cost_per_iteration_usd:.4f}", str(r.plan.world_size), row["plan"])
            print(json.dumps(row), file=sys.stderr, flush=True)
    con.print(table)
    gains = {}
    for sid in dict.fromkeys(r["scenario"] for r in rows):
        by = {r["search"]: r for r in rows if r["scenario"] == sid and "iters_per_s" in r}
        k = "cost_per_iteration_usd" if sid.startswith("d-cost") else "iters_per_s"

        def gain(other: str) -> float | None:
            if "full" not in by or other not in by:
                return None
            f, p = by["full"][k], by[other][k]
            return (p / f - 1) if k.startswith("cost") else (f / p - 1)
        gains[sid] = gain("paper")
    con.print("full vs paper (relative gain in the objective): "
              + ", ".join(f"{k} {v:+.1%}" for k, v in gains.items() if v is not None))
    never_worse = all(v is None or v >= -1e-9 for v in gains.values())
    con.print(f"full never worse than paper: {never_worse}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps({"rows": rows, "full_vs_paper_gain": gains, "full_never_worse_than_paper": never_worse}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
