"""Mixture-of-experts published throughput: the simulator against Megatron-Core's Mixtral 8x7B figure
and the bf16 MoE rows of Megatron-Bridge's performance summary that Sailor can express.

Each row is the published configuration as a Sailor plan: the published TP, PP, virtual pipeline
stages (VP: `interleaved-1f1b` with v chunks per stage), EP (`experts` on every stage, the even
placement), DP = GPUs / (TP·PP), micro-batch and global batch; bf16, the distributed optimizer as
ZeRO-1, no recomputation (none is published), analytic (roofline) layer times from the GPU catalog,
the imbalance factor at its default 1 (balanced routing; module docstring of
`sailor.simulator.experts`). Published figures are acceptance data: no constant is fitted to them.

Layer split (`megatron_chunks`): Megatron-LM cuts the L blocks into p·v chunks of L/(p·v) blocks,
the embedding with the first chunk and the head with the last; with
`account_for_embedding_in_pipeline_split` and `account_for_loss_in_pipeline_split` (Megatron-Bridge's
Qwen3-235B-A22B recipe sets both: src/megatron/bridge/recipes/qwen/qwen3_moe.py, stored commit
2afd2d34f7d7b2e84095af1a7fd7244902189ebc) the embedding and the loss each take one layer's place, so
each of the p·v chunks holds (L + 2)/(p·v) of Sailor's layers (94 blocks: 2 per chunk at p·v = 48, 4
at 24).

Placement: Megatron's rank order (tp-cp-ep-dp-pp, pipeline outermost) puts stage i of consecutive
data-parallel ranks on one node, so an EP group and the stage's gradient reduce stay inside a node
(an NVLink domain) and the pipeline's activations cross between nodes. The plan says the same with a
node cut before every stage but the first (`Replica.node_cut`, `sailor.plan.placement`): stage i of
the next pipelines fills the same node. Megatron's EP groups are its innermost data-parallel ranks,
Sailor's consecutive pipelines: the same GPUs.

Framework: `sailor`, whose layers run flash attention and whose gradient reduce overlaps the
backward bucket by bucket. Megatron-Core with TransformerEngine runs fused flash attention and
overlaps the gradient reduce (`--overlap-grad-reduce`; Megatron-Bridge's recipes set
`overlap_grad_reduce`); Sailor's `megatron-lm` framework is the 2021 Megatron-LM of SC'21 (attention
scores materialised, the reduce after the last backward), which does not describe these runs: its
prediction is printed beside the other (column "as megatron-lm") and not scored.

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
  for this model).
- Megatron-Bridge: NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md (stored versions,
  commits 00b7660be0254ac6f95f44164ddd0c3e9cc798ed and df0289c180dd20ff26933455c7a0a11084f6a36f;
  containers 25.09, 25.11, 26.02), "Tokens / sec / GPU" as published: no conversion (the rows also
  give "Model TFLOP / sec / GPU"; the predicted TFLOP/s column uses their own ratio of the two).
  Its bf16 MoE rows are the 25.11 container's: DeepSeek-V3 (GB300, GB200), GPT-OSS 120B (GB300,
  GB200, B200, H100; 26.02 adds B300), Qwen3-235B-A22B (GB300, GB200). Scored: the two
  Qwen3-235B-A22B rows (25.11, "DGX-GB300" and "DGX-GB200": 256 GPUs, sequence 4096, GBS 8192;
  GB300 MBS 2, TP 1, PP 4, VP 12, EP 16, 6131 tokens/s/GPU; GB200 MBS 1, TP 1, PP 8, VP 3, EP 32,
  4916 tokens/s/GPU). The GB300 row's GA column says 32, but 8192 / (64 DP x MBS 2) = 64 micro-
  batches, which the plan uses (GPUs, TP, PP, MBS and GBS as published fix it). The rest, with the
  reason, are `LEFT_OUT`. The 25.09 tables give no precision column and describe FP8 quantization
  granularities; every other MoE row is FP8 or NVFP4. The summary notes that the MoE benchmarks
  "force-balance the token distribution among experts and all benchmarks are token-dropless": the
  imbalance factor 1.
- Links. DGX H100 (as benchmarks/fsdp_published.py assumes them): 8-GPU nodes, NVLink at the
  catalog's NCCL share, one 400 Gb/s adapter per GPU between nodes at 50 GB/s achieved. DGX GB200
  and GB300 (NVL72 racks; the catalog's GB200-186 and GB300-279 cite each figure): a node here is
  one rack's NVLink domain of 72 GPUs (NVLink 5, 1.8 TB/s per GPU, at the catalog's NCCL share; the
  catalog's own node is the 4-GPU compute tray), between racks one adapter per GPU: ConnectX-7 400
  Gb/s on GB200 (50 GB/s, the DGX H100 figure), ConnectX-8 800 Gb/s on GB300 (100 GB/s, the same
  share). The summary does not say how the 256 GPUs sat in racks; the plan's cuts give each stage
  a rack of its own (GB300: a stage's 64 GPUs per rack, 4 racks; GB200: a stage's 32, so 8 racks'
  worth of nodes where 4 racks would hold two stages each, which changes only the link of every
  second pipeline boundary's activations), so every EP group and gradient reduce runs over NVLink.
  The catalog has no kernel efficiency measured on Blackwell: these rows run at its defaults.

Memory: Sailor's memory model puts both Qwen3-235B-A22B rows above their GPUs' memory (column
"fits"), nearly all of it the activations Sailor's runtime keeps (unfused RoPE and norms, repeated
KV heads, the experts' intermediates) for the micro-batches the interleaved schedule holds in
flight; Megatron-Bridge ran them without recomputation, so their throughput is scored as published.

Predicted tokens/s/GPU = global batch x sequence / iteration time / GPUs.

    python benchmarks/moe.py

Ends with one JSON line: mean_abs_error_pct over the rows, the rows, and the rows left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

from rich.console import Console
from rich.table import Table

from sailor.model.registry import BUILTIN_MODELS
from sailor.model.spec import ModelSpec
from sailor.plan.spec import Plan
from sailor.simulator import make_context, simulate
from sailor.specs.job import JobSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_published import ZONE, node_cluster  # noqa: E402  (benchmarks/ is not a package)

SUMMARY = "Megatron-Bridge 25.11 (performance-summary.md)"
NVL72 = 72  # GPUs of one NVLink domain of a GB200 / GB300 NVL72 rack (module docstring)


class Row(NamedTuple):
    """One published configuration (module docstring): TP, PP, VP (chunks per stage), EP, micro- and
    global batch; the published TFLOP/s per GPU or tokens/s per GPU (the other None, or both);
    `split_embedding_loss`: the embedding and the loss each take a layer's place in the pipeline
    split; `node`: GPUs per node (NVLink domain), `nic_bytes_per_s`: achieved bytes/s per GPU between
    nodes."""

    source: str
    model: str
    gpu: str
    gpus: int
    seq: int
    tp: int
    pp: int
    vp: int
    ep: int
    mbs: int
    gbs: int
    tflops: float | None
    tokens: float | None
    split_embedding_loss: bool = False
    node: int = 8
    nic_bytes_per_s: float | None = None  # None: benchmarks/fsdp_published.py's figure for the GPU


ROWS = [
    Row("Megatron-Core v0.9 (MoE README)", "mixtral-8x7b", "H100-80", 64, 4096, 1, 4, 8, 8, 1, 256, 468.0, None),
    Row(SUMMARY, "qwen3-235b-a22b", "GB300-279", 256, 4096, 1, 4, 12, 16, 2, 8192, 907.0, 6131.0,
        split_embedding_loss=True, node=NVL72, nic_bytes_per_s=100e9),
    Row(SUMMARY, "qwen3-235b-a22b", "GB200-186", 256, 4096, 1, 8, 3, 32, 1, 8192, 728.0, 4916.0,
        split_embedding_loss=True, node=NVL72, nic_bytes_per_s=50e9),
]

LEFT_OUT = [
    {"source": "Megatron-Bridge", "model": "DeepSeekV3 (bf16; GB300, GB200)",
     "why": "multi-head latent attention (MLA), which Sailor's model refuses by name"},
    {"source": "Megatron-Bridge", "model": "GPT OSS 120B (bf16; GB300, GB200, B300, B200, H100)",
     "why": "biases on the experts, a clamped SwiGLU, attention sinks and 128-token sliding-window layers:"
            " Sailor's MoE blocks are bias-free SwiGLUs with full causal attention; B200 and B300 are not"
            " in the GPU catalog"},
]


def megatron_flop_per_token(m: ModelSpec, seq: int) -> float:
    """Megatron-LM's FLOPs per token of an MoE GPT without shared experts (module docstring)."""
    L, h, a, g = m.num_blocks, m.hidden_size, m.num_heads, m.kv_heads
    attention = 1 + g / a + seq / h
    experts = m.moe.expert_ffn_size / h * m.moe.top_k * 1.5  # gated: h -> 2·f_e and f_e -> h
    logits = m.padded_vocab(1) / (2 * L * h)
    return 12 * L * h * h * (attention + experts + logits)


def megatron_chunks(m: ModelSpec, chunks: int, split_embedding_loss: bool = False) -> list[list[int]]:
    """The model's layer list cut as Megatron-LM cuts it into `chunks` virtual stages (module
    docstring): L/chunks blocks each, the embedding with the first and the head with the last; with
    `split_embedding_loss` (L + 2)/chunks layers each, the embedding and the head counted as layers.
    Raises ValueError when the layers do not divide evenly."""
    counted, extra = (m.num_layers, 0) if split_embedding_loss else (m.num_blocks, 1)
    per = counted // chunks
    if per * chunks != counted:
        raise ValueError(f"{counted} layers of {m.name} do not split into {chunks} equal chunks")
    ends = [extra + per * (c + 1) for c in range(chunks)]
    ends[-1] = m.num_layers
    return [[0 if c == 0 else ends[c - 1], e] for c, e in enumerate(ends)]


def plan_for(m: ModelSpec, row: Row) -> Plan:
    """The published configuration as a Sailor plan, stage i of consecutive pipelines on one node
    (module docstring)."""
    dp = row.gpus // (row.tp * row.pp)
    replicas = [{"stage": i, "gpu": row.gpu, "zone": ZONE, "tp": row.tp, **({"node_cut": True} if i else {})}
                for i in range(row.pp)]
    body = {"micro_batch_size": row.mbs, "stages": megatron_chunks(m, row.pp * row.vp, row.split_embedding_loss),
            "pipelines": [{"microbatches": row.gbs // (dp * row.mbs), "replicas": replicas}] * dp,
            "memory": [{"zero": 1}] * row.pp, "experts": [{"ep": row.ep}] * row.pp}
    if row.vp > 1:
        body["schedule"] = {"kind": "interleaved-1f1b", "virtual_stages": row.vp}
    return Plan.model_validate(body)


def _simulate(row: Row, framework: str):
    m = BUILTIN_MODELS[row.model]
    job = JobSpec(model=m, global_batch_size=row.gbs, sequence_length=row.seq, precision="bf16", framework=framework)
    # the benchmark reports no cost; a price is needed where no zone lists one (GB200, GB300)
    cluster = node_cluster(row.gpu, row.gpus, row.node, row.nic_bytes_per_s, price=0.0)
    plan = plan_for(m, row)
    plan.check_against(job, cluster)
    return simulate(plan, make_context(job, cluster))


def published_tokens(row: Row) -> float:
    """Published tokens/s/GPU: as published, else the published TFLOP/s over Megatron-LM's FLOPs
    per token (module docstring)."""
    if row.tokens is not None:
        return row.tokens
    return row.tflops * 1e12 / megatron_flop_per_token(BUILTIN_MODELS[row.model], row.seq)


def flop_per_token(row: Row) -> float:
    """FLOPs per token the source counts: its own TFLOP/s over its tokens/s where it publishes both,
    else Megatron-LM's formula."""
    if row.tokens is not None and row.tflops is not None:
        return row.tflops * 1e12 / row.tokens
    return megatron_flop_per_token(BUILTIN_MODELS[row.model], row.seq)


def predict(row: Row) -> dict:
    est = _simulate(row, "sailor")
    other = _simulate(row, "megatron-lm")
    published = published_tokens(row)
    predicted = row.gbs * row.seq / est.iteration_time_s / row.gpus
    worst = max(est.replicas, key=lambda r: r.peak_memory_bytes)
    fields = {k: v for k, v in row._asdict().items() if k not in ("mbs", "gbs", "tflops", "tokens")}
    return fields | {
        "micro_batch": row.mbs, "global_batch": row.gbs, "published_tflops_gpu": row.tflops,
        "published_tps_gpu": round(published, 1), "tokens_per_s_per_gpu": round(predicted, 1),
        "predicted_tflops_gpu": round(predicted * flop_per_token(row) / 1e12, 1),
        "error_pct": round((predicted / published - 1) * 100, 1), "iteration_s": round(est.iteration_time_s, 3),
        "as_megatron_lm_tps_gpu": round(row.gbs * row.seq / other.iteration_time_s / row.gpus, 1),
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
