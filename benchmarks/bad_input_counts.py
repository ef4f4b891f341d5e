"""Bad input, counted (issue 13): mutated inputs per reader, hostile command lines per class, and the
time the largest accepted values take.

1. readers: `--per-reader` mutants of every reader's seed files (tests/mutate.py, seeded random), each
   checked against the rule (a valid object, or one SailorInputError line naming the file); prints
   accepted / refused / violations per reader.
2. commands: a fixed set of clearly wrong command lines, one group per class of the issue, each run as
   its own process (`python -c "from sailor.cli import main; main()"`, `--timeout-s` each), and
   classified: one line + exit 2 (the promise), traceback, hang, exit 1, accepted (exit 0), or
   exit 2 with several lines. `--tree DIR` runs them against another checkout (e.g. main, for a
   before/after tally); the other sections need this tree.
3. bounded work: wall time of `sailor plan` at the largest global batch, `sailor simulate` at the
   largest event simulation, loading the largest trace, and refusing 10^9 / 10^30.

Prints one line per figure and ends with one JSON line. Usage:
    python benchmarks/bad_input_counts.py [--per-reader 300] [--tree DIR] [--only readers,commands,work]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

JOB = "model: tiny\nglobal_batch_size: 8\n"
LOCAL = "provider: local\nzones:\n  local: {cpu: 4}\n"
GCP = "provider: gcp\nzones:\n  us-central1-a: {A100-40: 8}\n"
REP = {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}
CPU_PLAN = {"micro_batch_size": 2, "stages": [[0, 3], [3, 6]],
            "pipelines": [{"microbatches": 4, "replicas": [REP, REP | {"stage": 1}]}],
            "job": {"model": "tiny", "global_batch_size": 8}}
SREP = [[["A100-40", 4, "us-central1-a"]], 2]
SAILOR = {"mbs": 1, "gbs": 8, "real": 1.0, "max_mem": 8e9,
          "pipeline_list": [{"num_stages": 2, "layers_per_stage": [[0, 1, 2], [3, 4, 5]], "dp": [2, 2],
                             "tmp_per_stage": [[SREP, SREP], [SREP, SREP]]}]}
TRACE = [{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 4}]
PROFILE = {"schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32",
           "layers": [{"gpu": "A100-40", "tp": 2, "mbs": 1, "forward_s": [1e-3] * 6, "backward_s": [2e-3] * 6}]}
SAILOR_PROFILE = {"tiny": {"A100-40": {"1": {"2": {str(i): [1e-3, 2e-3, 1e-4] for i in range(6)}}}}}
NET = {"schema": "sailor.network/1", "links": [{"src_zone": "us-central1-a", "src_gpu": "A100-40",
                                                "dst_zone": "us-central1-a", "dst_gpu": "A100-40", "flows": 2,
                                                "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}]}
SAILOR_NET = {"us-central1-a": {"A100-40": {"2": {"us-central1-a": {"A100-40": {"2": [[0.8, 16.4, 33.0], 2.5e11]}}}}}}
PLAN_GCP = {"micro_batch_size": 1, "stages": [[0, 3], [3, 6]],
            "pipelines": [{"microbatches": 8, "replicas": [{"stage": 0, "gpu": "A100-40", "zone": "us-central1-a",
                                                            "tp": 2}, {"stage": 1, "gpu": "A100-40",
                                                                       "zone": "us-central1-a", "tp": 2}]}]}


def _j(x) -> str:
    return json.dumps(x)


def _sailor(**kw) -> str:
    return _j(SAILOR | kw)


def _replace(doc, old: str, new: str) -> str:
    return _j(doc).replace(old, new)


# (class of the issue, what, files, command line): every one is clearly wrong and must end in one
# line and exit 2.
CASES: list[tuple[str, str, dict[str, str | bytes], list[str]]] = [
    ("1 launch trusts the plan", "layers not covered",
     {"p.json": _j(CPU_PLAN | {"stages": [[0, 3], [3, 5]]})}, ["launch", "p.json", "--backend", "torchrun", "--dry-run"]),
    ("1 launch trusts the plan", "batch arithmetic wrong",
     {"p.json": _j(CPU_PLAN | {"micro_batch_size": 3})}, ["launch", "p.json", "--backend", "kubernetes", "--dry-run"]),
    ("8 settings ignored", "hosts' node size below the plan's TP",
     {"p.json": _j(CPU_PLAN | {"pipelines": [{"microbatches": 4, "replicas": [REP | {"tp": 4}, REP | {"stage": 1}]}]}),
      "h.yaml": "groups: [{zone: local, gpu: cpu, gpus_per_node: 2, hosts: [a, b]}]\n"},
     ["launch", "p.json", "--backend", "torchrun", "--hosts", "h.yaml", "--dry-run"]),
    ("1 launch trusts the plan", "plan without a job",
     {"p.json": _j({k: v for k, v in CPU_PLAN.items() if k != "job"})},
     ["launch", "p.json", "--backend", "torchrun", "--dry-run"]),
    ("2 plan_config import", "unknown GPU type", {"s.json": _replace(SAILOR, '"A100-40"', '"B200"')},
     ["simulate", "s.json", "--job", "job.yaml"]),
    ("2 plan_config import", "unknown zone", {"s.json": _replace(SAILOR, '"us-central1-a"', '"mars-1"')},
     ["simulate", "s.json", "--job", "job.yaml"]),
    ("2 plan_config import", "gpus_per_node 0 (validate)", {"runs-tiny/plan_config_a.json": _replace(SAILOR, "4, ", "0, ")},
     ["validate", "runs-tiny", "--profiles", "prof.json"]),
    ("2 plan_config import", "mbs 0", {"s.json": _sailor(mbs=0)}, ["simulate", "s.json", "--job", "job.yaml"]),
    ("2 plan_config import", "mbs 4.7", {"s.json": _sailor(mbs=4.7)}, ["simulate", "s.json", "--job", "job.yaml"]),
    ("2 plan_config import", "gbs 1024.9", {"s.json": _sailor(gbs=1024.9)}, ["simulate", "s.json", "--job", "job.yaml"]),
    ("3 NaN and inf", "NaN price", {"c.yaml": LOCAL + "prices: {cpu: .nan}\n"}, ["plan", "--job", "job.yaml", "--cluster", "c.yaml"]),
    ("3 NaN and inf", "inf bandwidth", {"c.yaml": GCP + "network: {same_zone: {latency_s: 0, bandwidth_bytes_per_s: .inf}}\n"},
     ["plan", "--job", "job.yaml", "--cluster", "c.yaml"]),
    ("3 NaN and inf", "NaN layer time", {"prof.json": _j(PROFILE).replace("0.001", "NaN", 1)},
     ["simulate", "gcp_plan.json", "--job", "job.yaml", "--cluster", "gcp.yaml", "--profiles", "prof.json"]),
    ("3 NaN and inf", "Infinity latency", {"n.json": _j(NET).replace("1e-05", "Infinity")},
     ["simulate", "gcp_plan.json", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "n.json"]),
    ("3 NaN and inf", "--max-cost-per-hour nan", {}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml",
                                                      "--max-cost-per-hour", "nan"]),
    ("3 NaN and inf", "--time-scale inf", {}, ["run", "--job", "job.yaml", "--cluster", "local.yaml", "--availability",
                                               "trace.json", "--time-scale", "inf"]),
    ("3 NaN and inf", "NaN count in a CSV trace", {"t.csv": "Timestamp,cpu_local\n0,4\n60,nan\n"},
     ["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "t.csv"]),
    ("4 Sailor profile/network readers", "profile leaf not a list",
     {"sp/profiles_tmp.json": _j(SAILOR_PROFILE).replace("[0.001, 0.002, 0.0001]", "0.001", 1)},
     ["simulate", "gcp_plan.json", "--job", "job.yaml", "--cluster", "gcp.yaml", "--profiles", "sp"]),
    ("4 Sailor profile/network readers", "negative time",
     {"sp/profiles_tmp.json": _j(SAILOR_PROFILE).replace("0.002", "-0.002", 1)},
     ["simulate", "gcp_plan.json", "--job", "job.yaml", "--cluster", "gcp.yaml", "--profiles", "sp"]),
    ("4 Sailor profile/network readers", "GPU level not a mapping",
     {"sp/profiles_tmp.json": _j({"tiny": {"A100-40": 7}})},
     ["simulate", "gcp_plan.json", "--job", "job.yaml", "--cluster", "gcp.yaml", "--profiles", "sp"]),
    ("4 Sailor profile/network readers", "network count not a number",
     {"sn/multizone_bandwidths_het.json": _j(SAILOR_NET).replace('"2": {"us', '"two": {"us')},
     ["simulate", "gcp_plan.json", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "sn"]),
    ("4 Sailor profile/network readers", "network leaf malformed",
     {"sn/multizone_bandwidths_het.json": _j(SAILOR_NET).replace("[[0.8, 16.4, 33.0], 250000000000.0]", '"fast"')},
     ["simulate", "gcp_plan.json", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "sn"]),
    ("5 nesting, keys, encodings", "deep JSON", {"deep.json": "[" * 100000 + "]" * 100000}, ["simulate", "deep.json"]),
    ("5 nesting, keys, encodings", "deep YAML", {"deep.yaml": "a: " + "[" * 20000 + "]" * 20000 + "\n"},
     ["plan", "--job", "deep.yaml", "--cluster", "local.yaml"]),
    ("5 nesting, keys, encodings", "YAML complex key", {"c.yaml": "provider: local\nzones:\n  ? [a, b]\n  : {cpu: 4}\n"},
     ["plan", "--job", "job.yaml", "--cluster", "c.yaml"]),
    ("5 nesting, keys, encodings", "non-string GPU key", {"c.yaml": "provider: local\nzones:\n  local: {1: 4}\n"},
     ["plan", "--job", "job.yaml", "--cluster", "c.yaml"]),
    ("5 nesting, keys, encodings", "non-string zone key", {"c.yaml": "provider: gcp\nzones:\n  2024-01-01: {A100-40: 4}\n"},
     ["plan", "--job", "job.yaml", "--cluster", "c.yaml"]),
    ("5 nesting, keys, encodings", "non-UTF-8 file in a validation folder",
     {"runs-tiny/plan_config_b.json": b'{"note": "\xff"}'}, ["validate", "runs-tiny", "--profiles", "prof.json"]),
    ("5 nesting, keys, encodings", "duplicate key in a trace JSON",
     {"t.json": '[{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 4, "count": 2}]'},
     ["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "t.json"]),
    ("5 nesting, keys, encodings", "self-referencing YAML alias", {"j.yaml": "a: &a [*a]\n" + JOB},
     ["plan", "--job", "j.yaml", "--cluster", "local.yaml"]),
    ("5 nesting, keys, encodings", "integer of 5000 digits", {"j.yaml": "model: tiny\nglobal_batch_size: 1" + "0" * 5000 + "\n"},
     ["plan", "--job", "j.yaml", "--cluster", "local.yaml"]),
    ("6 unbounded work", "global batch 10^9", {"j.yaml": "model: tiny\nglobal_batch_size: 1000000000\n"},
     ["plan", "--job", "j.yaml", "--cluster", "local.yaml"]),
    ("6 unbounded work", "global batch 10^30", {"j.yaml": "model: tiny\nglobal_batch_size: " + "1" + "0" * 30 + "\n"},
     ["plan", "--job", "j.yaml", "--cluster", "local.yaml"]),
    ("6 unbounded work", "a trace count of 10^30", {"t.json": _j([{"time_s": 0, "zone": "local", "gpu": "cpu",
                                                                  "count": 10**30}])},
     ["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "t.json"]),
    ("6 unbounded work", "10^9 blocks", {"j.yaml": "model: {name: x, num_blocks: 1000000000, hidden_size: 64, num_heads: 4,"
                                                   " vocab_size: 256, max_sequence_length: 64}\nglobal_batch_size: 8\n"},
     ["plan", "--job", "j.yaml", "--cluster", "local.yaml"]),
    ("7 output paths checked late", "--report under a missing folder's file",
     {"afile": "x"}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--report", "afile/rep"]),
    ("7 output paths checked late", "--plot under a regular file",
     {"afile": "x"}, ["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "trace.json",
                      "--plot", "afile/x.png"]),
    ("7 output paths checked late", "--out under a regular file",
     {"afile": "x"}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--out", "afile/p.json"]),
    ("7 output paths checked late", "profile --out under a regular file",
     {"afile": "x"}, ["profile", "--job", "job.yaml", "--mbs", "1", "--repeats", "1", "--warmup", "0",
                      "--out", "afile/p.json"]),
    ("1 launch trusts the plan", "TP over the node size (the plan's cluster)",
     {"p.json": _j(CPU_PLAN | {"pipelines": [{"microbatches": 4, "replicas": [REP | {"tp": 4}, REP | {"stage": 1}]}],
                               "cluster": {"provider": "local", "zones": {"local": {"cpu": 8}},
                                           "gpus_per_node": {"cpu": 2}}})},
     ["launch", "p.json", "--backend", "torchrun", "--dry-run"]),
    ("8 settings ignored", "gpus_per_node: true", {"c.yaml": LOCAL + "gpus_per_node: {cpu: true}\n"},
     ["plan", "--job", "job.yaml", "--cluster", "c.yaml"]),
    ("8 settings ignored", "num_blocks: true", {"j.yaml": "model: {name: x, num_blocks: true, hidden_size: 64, num_heads: 4,"
                                                          " vocab_size: 256, max_sequence_length: 64}\nglobal_batch_size: 8\n"},
     ["plan", "--job", "j.yaml", "--cluster", "local.yaml"]),
    ("8 settings ignored", "train --timeout-s 0", {}, ["train", "cpu_plan.json", "--timeout-s", "0", "--dry-run"]),
    ("8 settings ignored", "train --timeout-s -1", {}, ["train", "cpu_plan.json", "--timeout-s", "-1", "--dry-run"]),
    ("8 settings ignored", "misspelt key in a link file", {"n.json": _j(NET).replace('"flows"', '"flow"')},
     ["simulate", "gcp_plan.json", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "n.json"]),
    ("9 silent data loss", "train over another run's checkpoints",
     {"ck/step-00000003/manifest.json": "{}"}, ["train", "cpu_plan.json", "--checkpoint-dir", "ck", "--dry-run"]),
]
OUTCOMES = ("one line, exit 2", "traceback", "hang", "exit 1", "accepted (exit 0)", "exit 2, several lines")


def _classify(code: int | None, err: str) -> str:
    if code is None:
        return "hang"
    if "Traceback" in err:
        return "traceback"
    if code == 0:
        return "accepted (exit 0)"
    if code == 2:
        return "one line, exit 2" if len(err.strip().splitlines()) == 1 and err.startswith("error: ") \
            else "exit 2, several lines"
    return "exit 1" if code == 1 else f"exit {code}"


def run_commands(tree: Path, timeout_s: float) -> dict[str, Counter]:
    """Every case of CASES in its own folder and process; returns class -> outcome counts."""
    env = {**os.environ, "PYTHONPATH": str(tree), "SAILOR_TRACEBACK_DIR": tempfile.gettempdir()}
    tally: dict[str, Counter] = {}
    for cls, what, files, args in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            base = {"job.yaml": JOB, "local.yaml": LOCAL, "gcp.yaml": GCP, "cpu_plan.json": _j(CPU_PLAN),
                    "trace.json": _j(TRACE), "prof.json": _j(PROFILE), "gcp_plan.json": _j(PLAN_GCP),
                    "runs-tiny/plan_config_a.json": _j(SAILOR)}
            for name, content in (base | files).items():
                (d / name).parent.mkdir(parents=True, exist_ok=True)
                (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
            t0 = time.perf_counter()
            try:
                r = subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", *args], cwd=d,
                                   capture_output=True, text=True, timeout=timeout_s, env=env)
                outcome = _classify(r.returncode, r.stderr)
            except subprocess.TimeoutExpired:
                outcome = "hang"
        tally.setdefault(cls, Counter())[outcome] += 1
        print(f"  {cls:34s} {what:40s} {outcome:22s} {time.perf_counter() - t0:6.1f} s", flush=True)
    return tally


def run_readers(per_reader: int) -> dict[str, Counter]:
    """`per_reader` seeded mutants of every reader, checked against the rule."""
    from mutate import READERS, TRIED, RandomChooser, check_reader, mutant, write_files

    from sailor.core.errors import SailorWarning

    warnings.simplefilter("ignore", SailorWarning)
    out: dict[str, Counter] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for reader in READERS:
            rng, tally = random.Random(f"bench-{reader.name}"), Counter()
            for _ in range(per_reader):
                folder = Path(tempfile.mkdtemp(dir=tmp))
                write_files(folder, mutant(reader, RandomChooser(rng)))
                try:
                    tally[check_reader(reader, folder)] += 1
                except Exception as e:  # noqa: BLE001 - a violation of the rule, counted
                    tally[f"violation {type(e).__name__}"] += 1
            out[reader.name] = tally
            print(f"  {reader.name:20s} {TRIED[reader.name]:6d} tried: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())),
                  flush=True)
    return out


def _timed(args: list[str], cwd: Path) -> tuple[float, float, int, float]:
    """(wall s, CPU s, exit status, peak RSS MiB of the children so far) of one CLI run. CPU seconds
    do not grow when other jobs load the machine; wall seconds do."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", *args], cwd=cwd,
                       capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, r.returncode, after.ru_maxrss / 1024


def run_work() -> dict[str, float]:
    """Wall seconds of the largest accepted values, and of refusing values beyond them."""
    from sailor.core.limits import MAX_GLOBAL_BATCH, MAX_PIPELINE_TASKS, MAX_TRACE_POINTS

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "job.yaml").write_text(f"model: tiny\nglobal_batch_size: {MAX_GLOBAL_BATCH}\n")
        (d / "opt.yaml").write_text(f"model: opt-350m\nglobal_batch_size: {MAX_GLOBAL_BATCH}\n")
        (d / "local.yaml").write_text(LOCAL)
        (d / "g9.yaml").write_text("model: tiny\nglobal_batch_size: 1000000000\n")
        (d / "g30.yaml").write_text("model: tiny\nglobal_batch_size: " + "1" + "0" * 30 + "\n")
        stages = MAX_PIPELINE_TASKS // MAX_GLOBAL_BATCH  # the largest event simulation one pipeline may run
        layers = [[i * 26 // stages, (i + 1) * 26 // stages] for i in range(stages)]
        plan = {"micro_batch_size": 1, "stages": layers, "pipelines": [{"microbatches": MAX_GLOBAL_BATCH, "replicas": [
            {"stage": i, "gpu": "A100-40", "zone": "us-central1-a", "tp": 1} for i in range(stages)]}],
            "job": {"model": "opt-350m", "global_batch_size": MAX_GLOBAL_BATCH}}
        (d / "big.json").write_text(json.dumps(plan))
        rows = ["Timestamp,cpu_local"] + [f"{t},{1 + t % 4}" for t in range(MAX_TRACE_POINTS)]
        (d / "trace.csv").write_text("\n".join(rows) + "\n")
        for key, args in [
            ("plan_tiny_local4_max_batch_s", ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--json"]),
            ("plan_opt350_paper_b128_max_batch_s", ["plan", "--job", "opt.yaml", "--cluster",
                                                    str(ROOT / "examples" / "paper_b128.yaml"), "--json"]),
            (f"simulate_{stages}_stages_x_{MAX_GLOBAL_BATCH}_microbatches_s", ["simulate", "big.json", "--json"]),
            ("refuse_global_batch_1e9_s", ["plan", "--job", "g9.yaml", "--cluster", "local.yaml"]),
            ("refuse_global_batch_1e30_s", ["plan", "--job", "g30.yaml", "--cluster", "local.yaml"]),
        ]:
            wall, cpu, code, rss = _timed(args, d)
            out[key] = round(wall, 2)
            out[key.removesuffix("_s") + "_cpu_s"] = round(cpu, 2)
            print(f"  {key:48s} {wall:7.2f} s wall, {cpu:6.2f} s CPU (exit {code}, peak RSS of children so far"
                  f" {rss:.0f} MiB)", flush=True)
        from sailor.elastic.availability import load_trace
        from sailor.specs.cluster import ClusterSpec

        t0 = time.perf_counter()
        load_trace(d / "trace.csv", ClusterSpec(provider="local", zones={"local": {"cpu": 4}}))
        out[f"load_trace_{MAX_TRACE_POINTS}_points_s"] = round(time.perf_counter() - t0, 2)
        print(f"  load_trace of {MAX_TRACE_POINTS} points {out[f'load_trace_{MAX_TRACE_POINTS}_points_s']:.2f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-reader", type=int, default=300)
    ap.add_argument("--tree", type=Path, default=ROOT, help="checkout whose `sailor` the commands run (default this one)")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="a command still running then is a hang")
    ap.add_argument("--only", default="readers,commands,work")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    result: dict = {"tree": str(a.tree)}
    if "readers" in parts and a.tree == ROOT:
        print(f"readers ({a.per_reader} mutated inputs each):")
        readers = run_readers(a.per_reader)
        result["readers"] = {k: dict(v) for k, v in readers.items()}
        result["readers_tried"] = sum(sum(v.values()) for v in readers.values())
        result["readers_violations"] = sum(n for v in readers.values() for k, n in v.items() if k.startswith("violation"))
    if "commands" in parts:
        print(f"commands ({len(CASES)} clearly wrong command lines, against {a.tree}):")
        tally = run_commands(a.tree, a.timeout_s)
        total = sum(tally.values(), Counter())
        for cls, c in tally.items():
            print(f"  {cls:34s} " + ", ".join(f"{o} {c[o]}" for o in OUTCOMES if c[o]))
        print("  total: " + ", ".join(f"{o} {total[o]}" for o in OUTCOMES))
        result["commands"] = {o: total[o] for o in OUTCOMES}
        result["commands_by_class"] = {k: dict(v) for k, v in tally.items()}
    if "work" in parts and a.tree == ROOT:
        print("bounded work (wall time):")
        result["work_s"] = run_work()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
