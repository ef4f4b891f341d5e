"""Mixture-of-experts published throughput: the simulator against Megatron-Core's Mixtral 8x7B figure
and the bf16 MoE rows of Megatron-Bridge's performance summary.

Each row is the published configuration as a Sailor plan: the published TP, PP, virtual pipeline
stages (VP: `interleaved-1f1b` with v chunks per stage, Megatron's layer split: L/(p·v) blocks per
chunk, the embedding with the first chunk and the head with the last), EP (`experts` on every
stage, the even placement), DP = GPUs / (TP·PP), micro-batch and global batch; bf16, the
distributed optimizer as ZeRO-1, no recomputation (none is published), analytic (roofline) layer
times from the GPU catalog, the imbalance factor at its default 1 (balanced routing; module
docstring of `sailor.simulator.experts`). Published figures are acceptance data: no constant is
fitted to them.

Framework: `sailor`, whose layers run flash attention and whose gradient reduce overlaps the
backward bucket by bucket. Megatron-Core v0.9 with TransformerEngine runs fused flash attention
and its example sets `--overlap-grad-reduce`; Sailor's `megatron-lm` framework is the 2021
Megatron-LM of SC'21 (attention scores materialised, the reduce after the last backward), which
does not describe these runs: its prediction is printed beside the other (column "as megatron-lm")
and not scored. Placement is the launcher's (a pipeline's stages packed on a node), so an EP group
of 8 pipelines spans 4 nodes and its all-to-alls cross InfiniBand, where Megatron's rank order
(tp-cp-ep-dp-pp) keeps them inside a node.

Sources:
- Megatron-Core: NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md (stored version,
  commit 022bcb5afe888664d3fb61adacea6e6c887a97f8): "With MCore v0.9, we've achieved remarkable
  performance of 468 TFLOPS for Mixtral 8X7B bf16 training", and its "Reference Best Parallel
  Mapping" table for that model: dropless, all-to-all dispatcher, BF16, 64 GPUs, sequence 4096,
  TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256, on "8xH100 80GB HBM3, NVLink 4th Generation, InfiniBand
  8x400 Gbit/s" (the table is labelled MCore v0.8's mapping; the 468 TFLOPS is v0.9's, on the same
  page; we take it as measured on that mapping). Its training example uses grouped GEMM, permute
  fusion and the distributed optimizer. Published TFLOP/s are converted to tokens/s/GPU with the
  FLOP count Megatron-LM reports them by (`num_floating_point_operations` in
  megatron/training/training.py, as of MCore v0.9): per token
  12·L·h²·((1 + g/a + s/h) + (f_e/h)·k·3/2 + V/(2·L·h)), g KV groups, a heads, f_e the expert
  width, k the top-k, V the padded vocabulary (attention scores counted in full; later versions of
  that file halve them for the causal mask, which would make the published tokens/s 4 % higher
  for this model). Predicted tokens/s/GPU = global batch x sequence / iteration time / GPUs.
- Megatron-Bridge: NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md (stored versions,
  commits 00b7660be0254ac6f95f44164ddd0c3e9cc798ed and df0289c180dd20ff26933455c7a0a11084f6a36f;
  containers 25.09, 25.11, 26.02), tokens/s/GPU as published. Its bf16 MoE rows, none of which
  Sailor can express today (so none is in the table; each is listed by `LEFT_OUT` with the reason):
  DeepSeek-V3 (GB300, GB200), GPT-OSS 120B (GB300, GB200, B300, B200, H100), Qwen3-235B-A22B
  (GB300, GB200). The 25.09 tables give no precision column and describe FP8 quantization
  granularities; every other MoE row is FP8 or NVFP4.
- Links, as benchmarks/fsdp_published.py assumes them for DGX H100: NVLink inside a node at the
  catalog's NCCL share, one 400 Gb/s adapter per GPU between nodes at 50 GB/s achieved.

    python benchmarks/moe.py

Ends with one JSON line: mean_abs_error_pct over the rows, the rows, and the rows left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sailor.model.registry import BUILTIN_MODELS
from sailor.model.spec import ModelSpec
from sailor.plan.spec import Plan
from sailor.simulator import make_context, simulate
from sailor.specs.job import JobSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_published import ZONE, node_cluster  # noqa: E402  (benchmarks/ is not a package)

# (source, model, GPU, GPUs, seq, TP, PP, VP, EP, MBS, GBS, published TFLOP/s per GPU or None,
#  published tokens/s/GPU or None)
ROWS = [
    ("Megatron-Core v0.9 (MoE README)", "mixtral-8x7b", "H100-80", 64, 4096, 1, 4, 8, 8, 1, 256, 468.0, None),
]

LEFT_OUT = [
    {"source": "Megatron-Bridge", "model": "DeepSeekV3 (bf16; GB300, GB200)",
     "why": "multi-head latent attention (MLA), which Sailor's model refuses by name; GB300/GB200 are not"
            " in the GPU catalog"},
    {"source": "Megatron-Bridge", "model": "GPT OSS 120B (bf16; GB300, GB200, B300, B200, H100)",
     "why": "biases on the experts, a clamped SwiGLU, attention sinks and 128-token sliding-window layers:"
            " Sailor's MoE blocks are bias-free SwiGLUs with full causal attention; B-series GPUs are not in"
            " the catalog"},
    {"source": "Megatron-Bridge", "model": "Qwen3_235B_a22B (bf16; GB300, GB200)",
     "why": "the model is expressible (Qwen3-MoE), but GB300 and GB200 are not in the GPU catalog"},
]


def megatron_flop_per_token(m: ModelSpec, seq: int) -> float:
    """Megatron-LM's FLOPs per token of an MoE GPT without shared experts (module docstring)."""
    L, h, a, g = m.num_blocks, m.hidden_size, m.num_heads, m.kv_heads
    attention = 1 + g / a + seq / h
    experts = m.moe.expert_ffn_size / h * m.moe.top_k * 1.5  # gated: h -> 2·f_e and f_e -> h
    logits = m.padded_vocab(1) / (2 * L * h)
    return 12 * L * h * h * (attention + experts + logits)


def megatron_chunks(m: ModelSpec, chunks: int) -> list[list[int]]:
    """The model's layer list cut as Megatron-LM cuts it into `chunks` virtual stages: L/chunks
    blocks each, the embedding with the first and the head with the last."""
    per = m.num_blocks // chunks
    assert per * chunks == m.num_blocks, (m.num_blocks, chunks)
    ends = [1 + per * (c + 1) for c in range(chunks)]
    ends[-1] = m.num_layers
    return [[0 if c == 0 else ends[c - 1], e] for c, e in enumerate(ends)]


def plan_for(m: ModelSpec, gpu: str, gpus: int, tp: int, pp: int, vp: int, ep: int, mbs: int, gbs: int) -> Plan:
    """The published configuration as a Sailor plan (module docstring)."""
    dp = gpus // (tp * pp)
    body = {"micro_batch_size": mbs, "stages": megatron_chunks(m, pp * vp),
            "pipelines": [{"microbatches": gbs // (dp * mbs),
                           "replicas": [{"stage": i, "gpu": gpu, "zone": ZONE, "tp": tp} for i in range(pp)]}] * dp,
            "memory": [{"zero": 1}] * pp, "experts": [{"ep": ep}] * pp}
    if vp > 1:
        body["schedule"] = {"kind": "interleaved-1f1b", "virtual_stages": vp}
    return Plan.model_validate(body)


def _simulate(row: tuple, framework: str):
    _, name, gpu, gpus, seq, tp, pp, vp, ep, mbs, gbs, _, _ = row
    m = BUILTIN_MODELS[name]
    job = JobSpec(model=m, global_batch_size=gbs, sequence_length=seq, precision="bf16", framework=framework)
    cluster = node_cluster(gpu, gpus)
    plan = plan_for(m, gpu, gpus, tp, pp, vp, ep, mbs, gbs)
    plan.check_against(job, cluster)
    return simulate(plan, make_context(job, cluster))


def predict(row: tuple) -> dict:
    source, name, gpu, gpus, seq, tp, pp, vp, ep, mbs, gbs, tflops, tokens = row
    m = BUILTIN_MODELS[name]
    est = _simulate(row, "sailor")
    other = _simulate(row, "megatron-lm")
    flop = megatron_flop_per_token(m, seq)
    published = tokens if tokens is not None else tflops * 1e12 / flop
    predicted = gbs * seq / est.iteration_time_s / gpus
    worst = max(est.replicas, key=lambda r: r.peak_memory_bytes)
    return {"source": source, "model": name, "gpu": gpu, "gpus": gpus, "seq": seq, "tp": tp, "pp": pp, "vp": vp,
            "ep": ep, "micro_batch": mbs, "global_batch": gbs, "published_tflops_gpu": tflops,
            "published_tps_gpu": round(published, 1), "tokens_per_s_per_gpu": round(predicted, 1),
            "predicted_tflops_gpu": round(predicted * flop / 1e12, 1),
            "error_pct": round((predicted / published - 1) * 100, 1), "iteration_s": round(est.iteration_time_s, 3),
            "as_megatron_lm_tps_gpu": round(gbs * seq / other.iteration_time_s / gpus, 1),
            "as_megatron_lm_fits": bool(other.fits_in_memory),
            "pipeline_s": round(est.pipeline_s, 3), "sync_s": round(est.gradient_sync_s, 3),
            "all_to_all_s_per_microbatch": round(max(r.all_to_all_s for r in est.replicas), 4),
            "fits": bool(est.fits_in_memory), "peak_memory_gb": round(worst.peak_memory_bytes / 1e9, 1)}


def main() -> int:
    rows = [predict(r) for r in ROWS]
    table = Table(title="MoE published vs simulated tokens/s/GPU (bf16, analytic profiles)")
    for col in ("source", "model", "GPUs", "TP/PP/VP/EP", "mbs/gbs", "published", "predicted", "error",
                "pred TF/s", "a2a s/mb", "fits", "peak GB", "as megatron-lm"):
        table.add_column(col, justify="left" if col in ("source", "model") else "right")
    for r in rows:
        table.add_row(r["source"], r["model"], f"{r['gpus']} {r['gpu']}", f"{r['tp']}/{r['pp']}/{r['vp']}/{r['ep']}",
                      f"{r['micro_batch']}/{r['global_batch']}", f"{r['published_tps_gpu']:.0f}",
                      f"{r['tokens_per_s_per_gpu']:.0f}", f"{r['error_pct']:+.1f} %", f"{r['predicted_tflops_gpu']:.0f}",
                      f"{r['all_to_all_s_per_microbatch']:.4f}", "yes" if r["fits"] else "no", f"{r['peak_memory_gb']:.1f}",
                      f"{r['as_megatron_lm_tps_gpu']:.0f}" + ("" if r["as_megatron_lm_fits"] else " (OOM)"))
    con = Console(width=200, file=sys.stdout)
    con.print(table)
    for x in LEFT_OUT:
        con.print(f"left out: {x['source']} {x['model']}: {x['why']}")
    mean = round(sum(abs(r["error_pct"]) for r in rows) / len(rows), 2)
    print(json.dumps({"mean_abs_error_pct": mean, "n_rows": len(rows), "rows": rows, "left_out": LEFT_OUT}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
