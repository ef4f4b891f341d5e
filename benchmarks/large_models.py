"""Large models: the simulator and the planner against Megatron-LM's published weak-scaling runs.

Every row of Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC'21, arXiv:2104.04473v5): GPT models from 1.7B to 1T parameters,
vocabulary 51,200, sequence 2,048, mixed precision, full activation recomputation, on Selene's
DGX A100 80GB nodes (8 GPUs with NVLink/NVSwitch, 600 GB/s per GPU; 8 x 200 Gb/s HDR InfiniBand per
node, one adapter per GPU). The table's figures were checked against a transcription of the paper
(a public paper-notes file found with the `search` tools; the same numbers as arXiv v5's Table 1).

What is compared, and how:
- Published: "achieved teraFLOP/s per GPU", computed by the paper with its eq. (3),
  F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per iteration, which counts the recomputation
  forward pass. Predicted: the same F divided by the simulated iteration time and the GPU count:
  like with like.
- The simulation: analytic (roofline) A100-80 layer times, `framework: megatron-lm` (materialised
  attention, fused kernels, scatter/gather across stage boundaries), fp16 (the paper's "mixed
  precision"; Megatron-LM's 2021 runs used fp16), full recomputation on every stage, Megatron's
  layer split (l/p blocks per stage, the embedding on the first and the head on the last), the
  published TP t, PP p and DP d = n/(t·p), and the links of a DGX A100 given as cluster network
  overrides: NVLink one direction (300 GB/s) at NCCL's measured 65 % inside a node, 21 GB/s per GPU
  between nodes (a 200 Gb/s HDR adapter with GPUDirect RDMA reaches 20-22 GB/s).
- Schedule: the paper's end-to-end runs use "the interleaved pipeline schedule with the
  scatter/gather optimization enabled" (SC'21 §5.1), so every row with p > 1 (39.1B to 1T) is
  simulated as `interleaved-1f1b`; with p = 1 there is no pipeline to interleave (1F1B). The number
  of chunks per stage v is not in Table 1: each such row tries every v >= 2 that splits the stage's
  l/p blocks evenly (Megatron-LM's `--num-layers-per-virtual-pipeline-stage` must divide them) and
  whose micro-batch count per pipeline is a multiple of p (Megatron-LM's 2021 interleaved schedule
  asserts it). The same row under 1F1B is shown next to it.
- Micro-batch size: Table 1 does not give it. Each row uses the micro-batch size (1, 2, 4 or 8,
  dividing B/d), and for interleaved rows the v, with which OUR simulator predicts the highest
  throughput for the published t and p (labelled "sim-best"); the paper's text only says
  micro-batch sizes were tuned.
- Fits: whether the simulator's peak memory per GPU of the published configuration is within 80 GB.
- Planner: `plan_job` on the same GPUs, job and links, its best plan and prediction next to the
  published configuration's. Its TF/s use the same eq. (3) numerator, so "planner / published cfg"
  is the iteration-time speed-up (a plan that recomputes less does fewer FLOPs than eq. (3) counts).
Second part: `sailor plan` on large jobs a practitioner would run (GPT-3 175B on 1024 A100-80 with
global batch 1536, MT-NLG 530B on 2240 A100-80, Llama-3-8B at sequence 8192 on 32 V100-16 and on
16 L4, OPT-30B on 64 A100-40), on the catalog's GCP links and analytic profiles, with the search
time of each.
These rows are a test of the simulator, not calibration data: no constant is fitted to them (every
efficiency comes from the GPU catalog, each with its independent source).

    python benchmarks/large_models.py [--only 1.7,145.6] [--no-planner]

Ends with one JSON line: mean_abs_error_pct, all_fit, interleaved_rows_within_15_pct, rows (each with
its schedule, v, error and the 1F1B error of the same configuration), scenarios.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from sailor import catalog
from sailor.core.errors import InfeasibleError
from sailor.plan.spec import Plan
from sailor.planner import PlanOptions, plan_job
from sailor.simulator import Estimate, make_context, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZONE = "us-central1-a"
GPU = "A100-80"
VOCAB, SEQ = 51200, 2048
IB_BYTES_PER_S = 21e9  # one 200 Gb/s HDR adapter per GPU, GPUDirect RDMA: 20-22 GB/s achieved
LINK_LATENCY_S = 5e-6  # immaterial at these message sizes (MBs and up)

# Narayanan et al. SC'21 Table 1: (billions of parameters, heads, hidden size, layers, TP, PP, GPUs,
# global batch, achieved teraFLOP/s per GPU).
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def dgx_a100_cluster(gpus: int) -> ClusterSpec:
    """`gpus` A100-80 in one zone, 8 per node, with DGX A100 links as network overrides."""
    spec = catalog.gpu(GPU)
    nvlink = spec.intra_node_bytes_per_s / 2 * spec.efficiency.intra_node  # one direction at NCCL's share
    return ClusterSpec(zones={ZONE: {GPU: gpus}}, gpus_per_node={GPU: 8},
                       network={"same_node": {"latency_s": LINK_LATENCY_S, "bandwidth_bytes_per_s": nvlink},
                                # one adapter per GPU: the node's eight carry eight flows, each at most one's
                                "same_zone": {"latency_s": LINK_LATENCY_S, "bandwidth_bytes_per_s": 8 * IB_BYTES_PER_S,
                                              "flow_bandwidth_bytes_per_s": IB_BYTES_PER_S}})


def gpt_job(billions: float, heads: int, hidden: int, layers: int, batch: int) -> JobSpec:
    model = {"name": f"gpt-{billions:g}b", "num_blocks": layers, "hidden_size": hidden, "num_heads": heads,
             "vocab_size": VOCAB, "max_sequence_length": SEQ}
    return JobSpec(model=model, global_batch_size=batch, precision="fp16", framework="megatron-lm")


def narayanan_flop(job: JobSpec) -> float:
    """FLOPs per iteration by SC'21 eq. (3) (activation recomputation included)."""
    m, B, s = job.model, job.global_batch_size, job.seq
    l, h = m.num_blocks, m.hidden_size
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def published_plan(job: JobSpec, tp: int, pp: int, gpus: int, mbs: int, v: int = 1) -> Plan:
    """Megatron-LM's layout: l/(p·v) blocks per chunk (v chunks per stage, chunk k on stage k mod p;
    v = 1: 1F1B), the embedding with the first chunk, the head with the last; full recomputation
    everywhere; d = n/(t·p) pipelines with equal shares."""
    n_chunks = pp * v
    n_layers, per = job.model.num_layers, job.model.num_blocks // n_chunks
    cuts = [0] + [1 + per * (i + 1) for i in range(n_chunks - 1)] + [n_layers]
    d = gpus // (tp * pp)
    replicas = [{"stage": i, "gpu": GPU, "zone": ZONE, "tp": tp} for i in range(pp)]
    return Plan.model_validate({
        "micro_batch_size": mbs, "stages": [[cuts[i], cuts[i + 1]] for i in range(n_chunks)],
        "pipelines": [{"microbatches": job.global_batch_size // (d * mbs), "replicas": replicas}] * d,
        "memory": [{"recompute": "full"}] * pp,
        **({"schedule": {"kind": "interleaved-1f1b", "virtual_stages": v}} if v > 1 else {})})


def chunk_counts(job: JobSpec, pp: int, microbatches: int) -> list[int]:
    """The v Megatron-LM could run a row with (module docstring): 1 without a pipeline, else every
    v >= 2 dividing the l/p blocks of a stage, with the pipeline's micro-batches a multiple of p."""
    if pp == 1:
        return [1]
    per_stage = job.model.num_blocks // pp
    return [v for v in range(2, per_stage + 1) if per_stage % v == 0 and microbatches % pp == 0]


def best_config(job: JobSpec, cluster: ClusterSpec, ctx, tp: int, pp: int, gpus: int, *,
                interleave: bool) -> tuple[Plan, Estimate]:
    """The sim-best (micro-batch size, v) of a row's published t and p: the fastest that fits, else
    the first tried (module docstring); `interleave` False: 1F1B only."""
    d, batch = gpus // (tp * pp), job.global_batch_size
    best = first = None
    for mbs in (1, 2, 4, 8):
        if (batch // d) % mbs:
            continue
        for v in chunk_counts(job, pp, batch // (d * mbs)) if interleave else [1]:
            plan = published_plan(job, tp, pp, gpus, mbs, v)
            plan.check_against(job, cluster)
            est = simulate(plan, ctx)
            first = first or (plan, est)
            if est.fits_in_memory and (best is None or est.iteration_time_s < best[1].iteration_time_s):
                best = (plan, est)
    return best or first


def tflops(job: JobSpec, est: Estimate) -> float:
    return narayanan_flop(job) / est.iteration_time_s / est.gpus / 1e12


def describe(plan: Plan) -> str:
    mems = {(m.recompute.value, m.recompute_blocks, m.zero, m.sequence_parallel) for m in
            (plan.stage_memory(i) for i in range(plan.num_stages))}
    opts = "; ".join(f"{r}{f'({k})' if k is not None else ''}{f' Z{z}' if z else ''}{' SP' if sp else ''}"
                     for r, k, z, sp in sorted(mems, key=str))
    tps = sorted({r.tp for p in plan.pipelines for r in p.replicas})
    kind = plan.schedule.kind.value
    schedule = "" if kind == "1f1b" else f" {kind}" + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    return (f"t{'/'.join(map(str, tps))} p{plan.num_stages} d{len(plan.pipelines)} b{plan.micro_batch_size}"
            f" ({opts}){schedule}")


# (name, job, GPU type, GPUs) of the practitioner scenarios (issue 12); Sailor's runtime accounting.
SCENARIOS = [
    ("GPT-3 175B, 1024 A100-80", {"model": "gpt3-175b", "global_batch_size": 1536, "precision": "bf16"}, "A100-80", 1024),
    ("MT-NLG 530B, 2240 A100-80", {"model": "mt-nlg-530b", "global_batch_size": 1920, "precision": "bf16"}, "A100-80", 2240),
    ("Llama-3-8B s8192, 32 V100-16", {"model": "llama-3-8b", "global_batch_size": 64, "sequence_length": 8192,
                                      "precision": "fp16"}, "V100-16", 32),
    ("Llama-3-8B s8192, 16 L4", {"model": "llama-3-8b", "global_batch_size": 64, "sequence_length": 8192,
                                 "precision": "bf16"}, "L4", 16),
    ("OPT-30B, 64 A100-40", {"model": "opt-30b", "global_batch_size": 256, "precision": "bf16"}, "A100-40", 64),
]


def table_1(args, con: Console) -> list[dict]:
    """Part 1: every row of SC'21 Table 1 (module docstring)."""
    table = Table(title="SC'21 Table 1 on analytic A100-80 profiles and DGX A100 links (interleaved 1F1B where"
                        " p > 1, as the paper ran it)")
    for col in ("model", "t/p/d", "GPUs", "batch", "schedule", "mbs (sim-best)", "published TF/s", "predicted TF/s",
                "error", "1F1B error", "fits", "peak mem (GB)", "planner TF/s", "planner / published cfg", "search (s)"):
        table.add_column(col, justify="left" if col == "model" else "right")
    plans = Table(title="the planner's plans (t TP, p stages, d pipelines, b micro-batch; (stages' memory options))",
                  min_width=110)
    plans.add_column("model")
    plans.add_column("planner plan")
    rows = []
    for billions, heads, hidden, layers, tp, pp, gpus, batch, published in TABLE_1:
        if args.only and billions not in args.only:
            continue
        job = gpt_job(billions, heads, hidden, layers, batch)
        cluster = dgx_a100_cluster(gpus)
        ctx = make_context(job, cluster)
        d = gpus // (tp * pp)
        plan, est = best_config(job, cluster, ctx, tp, pp, gpus, interleave=True)
        pred = tflops(job, est)
        err = (pred / published - 1) * 100
        plain_plan, plain = (plan, est) if pp == 1 else best_config(job, cluster, ctx, tp, pp, gpus, interleave=False)
        err_1f1b = (tflops(job, plain) / published - 1) * 100
        peak_gb = max(r.peak_memory_bytes for r in est.replicas) / 1e9
        row = {"model_b": billions, "tp": tp, "pp": pp, "dp": d, "gpus": gpus, "batch": batch,
               "schedule": plan.schedule.kind.value, "virtual_stages": plan.virtual_stages,
               "micro_batch": plan.micro_batch_size, "published_tflops": published, "predicted_tflops": round(pred, 1),
               "error_pct": round(err, 1), "error_1f1b_pct": round(err_1f1b, 1),
               "micro_batch_1f1b": plain_plan.micro_batch_size, "fits": est.fits_in_memory,
               "peak_memory_gb": round(peak_gb, 1), "iteration_s": round(est.iteration_time_s, 3)}
        cells = ["-", "-", "-"]
        if not args.no_planner:
            try:
                res = plan_job(make_context(job, cluster), PlanOptions(max_stages=128))
                ptf = tflops(job, res.estimate)
                row |= {"planner_plan": describe(res.plan), "planner_tflops": round(ptf, 1),
                        "planner_vs_published_config": round(ptf / pred, 3),
                        "planner_search_s": round(res.search_time_s, 2)}
                cells = [f"{ptf:.1f}", f"{ptf / pred:.2f}x", f"{res.search_time_s:.1f}"]
            except InfeasibleError as e:
                row |= {"planner_plan": f"infeasible: {e}"}
            plans.add_row(f"{billions:g}B", row["planner_plan"])
        rows.append(row)
        table.add_row(f"{billions:g}B (h {hidden}, l {layers})", f"{tp}/{pp}/{d}", str(gpus), str(batch),
                      "1F1B" if plan.virtual_stages == 1 else f"interleaved v={plan.virtual_stages}",
                      str(plan.micro_batch_size), f"{published}", f"{pred:.1f}", f"{err:+.1f} %", f"{err_1f1b:+.1f} %",
                      "yes" if est.fits_in_memory else "[red]no[/red]", f"{peak_gb:.1f}", *cells)
        print(json.dumps(row), file=sys.stderr, flush=True)
    con.print(table)
    if not args.no_planner:
        con.print(plans)
    return rows


def scenarios(con: Console) -> list[dict]:
    """Part 2: `plan_job` on the practitioner scenarios, GCP links, analytic profiles."""
    table = Table(title="sailor plan on large jobs (catalog GCP links, analytic profiles)")
    for col in ("scenario", "plan", "iterations/s", "TF/s per GPU (model + recompute)", "headroom (GiB)", "search (s)"):
        table.add_column(col, justify="left" if col in ("scenario", "plan") else "right")
    rows = []
    for name, job_dict, gpu, n in SCENARIOS:
        job = JobSpec.model_validate(job_dict)
        cluster = ClusterSpec(zones={ZONE: {gpu: n}})
        try:
            res = plan_job(make_context(job, cluster), PlanOptions())
        except InfeasibleError as e:
            rows.append({"scenario": name, "infeasible": str(e)})
            table.add_row(name, f"infeasible: {e}", "-", "-", "-", "-")
            continue
        est = res.estimate
        row = {"scenario": name, "plan": describe(res.plan), "gpus_used": res.plan.world_size,
               "iters_per_s": round(est.throughput_iters_per_s, 4), "tflops_per_gpu": round(est.flop_per_s_per_gpu / 1e12, 1),
               "headroom_gib": round(est.min_headroom_bytes / 2**30, 1), "search_s": round(res.search_time_s, 2),
               "fits": est.fits_in_memory}
        rows.append(row)
        table.add_row(name, f"{row['plan']} on {res.plan.world_size} GPUs", f"{row['iters_per_s']:.4f}",
                      f"{row['tflops_per_gpu']:.1f}", f"{row['headroom_gib']:.1f}", f"{row['search_s']:.1f}")
        print(json.dumps(row), file=sys.stderr, flush=True)
    con.print(table)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated model sizes (billions), e.g. 1.7,145.6")
    ap.add_argument("--no-planner", action="store_true", help="skip the planner comparison and the scenarios")
    args = ap.parse_args()
    args.only = {float(x) for x in args.only.split(",") if x}
    con = Console(width=200)
    rows = table_1(args, con)
    mean_abs = sum(abs(r["error_pct"]) for r in rows) / len(rows)
    all_fit = all(r["fits"] for r in rows)
    inter = [r for r in rows if r["schedule"] == "interleaved-1f1b"]
    within = all(abs(r["error_pct"]) <= 15.0 for r in inter)
    con.print(f"mean |error| {mean_abs:.1f} % over {len(rows)} rows (target <= 15 %); every published configuration"
              f" fits: {'yes' if all_fit else 'no'}; schedule: interleaved 1F1B where p > 1, rows within ±15 %:"
              f" {sum(abs(r['error_pct']) <= 15.0 for r in inter)} of {len(inter)}; micro-batch (and v): the"
              f" simulator's best for the published TP/PP")
    plans = [] if args.no_planner else scenarios(con)
    print(json.dumps({"mean_abs_error_pct": round(mean_abs, 2), "all_fit": all_fit,
                      "interleaved_rows_within_15_pct": within,
                      "schedule": "interleaved-1f1b where p > 1 (SC'21 §5.1), else 1f1b",
                      "micro_batch": "simulator's best (and v) for the published TP/PP", "rows": rows,
                      "scenarios": plans}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
