"""FSDP published throughput: the simulator against MosaicML llm-foundry's MPT table and torchtitan's Llama rows.

Pure fully-sharded data parallelism (PyTorch FSDP FULL_SHARD / FSDP2 `fully_shard`) is a one-stage
plan with `{"zero": 3}` on every replica (weights gathered per layer and freed after each pass:
`reshard_after_forward` left at its default, true, which both frameworks use), TP 1, one replica per
GPU, `framework: sailor` (memory-efficient attention, as both codebases run flash attention),
bf16, analytic (roofline) profiles from the GPU catalog. Published figures are acceptance data:
no constant is fitted to them.

Sources (each row's figures are copied into the tables below, one row per published line):
- llm-foundry: mosaicml/llm-foundry, scripts/train/benchmarking/README.md (stored version, commit
  061f2c7ce64e655100286584a7629e2a09f827ba), tables "A100 80GB with 1600 Gbps node-node
  interconnect (RoCE)", "A100 40GB with 1600 Gbps node-node interconnect (RoCE)" and "H100 80GB
  BF16". Kept: every sequence-2048 row of the three tables (FULL_SHARD, bf16 / amp_bf16), columns
  model, # GPUs, MicroBatchSize, GradAccum, GlobalBatchSize, Activation Checkpointing, Throughput
  (T/s/GPU). The MPT geometry (d_model, n_heads, n_layers; vocabulary 50,368, MLP 4h, biases,
  LayerNorm with bias, learned positions, tied embeddings) reproduces the table's NumParams column
  exactly for all nine sizes (tests/test_fsdp_published.py). Activation checkpointing True ->
  `recompute: full` on every block.
- torchtitan: pytorch/torchtitan, docs/performance.md (stored version, commit
  041336434916bdc0f88c1f89fda176fd3c2092e4): "Llama 3 performance numbers" and "Llama 2
  performance numbers", FSDP2 (1D) on 64 A100 (80GB), local batch 1 or 2 (global = local x 64, no
  gradient accumulation), WPS = tokens per second per GPU. Kept: activation checkpointing "no",
  "full" (every block recomputed) and "selective layer" (torchtitan's `selective_ac_option` "2":
  every second block checkpointed -> `recompute: full` with `recompute_blocks` = N/2). Left out:
  the "selective op" rows (op-level checkpointing that keeps every other matmul output: no Sailor
  memory option says that), the 405B rows (FSDP2 + TP, Float8 options), and the later H100 tables
  of newer versions of the file (torch.compile and Float8).
- Links: the MosaicML tables say "1600 Gbps node-node interconnect (RoCE)", i.e. 8 x 200 Gb/s per
  8-GPU node, one adapter per GPU; torchtitan's file does not describe its A100 cluster, so the
  same 8-GPU NVLink node with one 200 Gb/s adapter per GPU is assumed. Between nodes: 21 GB/s per
  GPU (the achieved figure for one 200 Gb/s adapter with GPUDirect RDMA used by
  benchmarks/large_models.py); inside a node: NVLink one direction at the catalog's NCCL share.
  H100 rows: same shape with the catalog's H100 NVLink and 50 GB/s per GPU between nodes (one
  400 Gb/s adapter per GPU, the DGX H100 layout, at the same ~85 % share as 21 of 25 GB/s).

Compared: predicted tokens/s/GPU = global batch x sequence / simulated iteration time / GPUs,
against the published tokens/s/GPU (the two count the same tokens; no FLOP formula involved).

    python benchmarks/fsdp_published.py [--source mpt|torchtitan]

Runs on older versions of the package too (it sets no plan field newer than `recompute_blocks`).
Ends with one JSON line: mean_abs_error_pct (all rows), per-source means, rows.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from sailor import catalog
from sailor.model.spec import ModelSpec
from sailor.plan.spec import Plan
from sailor.simulator import make_context, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZONE = "us-central1-a"
LINK_LATENCY_S = 5e-6
# Achieved bytes/s per GPU between nodes: one adapter per GPU (module docstring).
INTER_NODE_BYTES_PER_S = {"A100-80": 21e9, "A100-40": 21e9, "H100-80": 50e9}

MPT_VOCAB = 50368
# MPT sizes of llm-foundry's benchmark yamls: name -> (d_model, n_heads, n_layers, published NumParams at seq 2048).
MPT_SIZES = {
    "125m": (768, 12, 12, 125311488), "350m": (1024, 16, 24, 355985408), "760m": (1536, 12, 24, 760470528),
    "1b": (2048, 16, 24, 1315950592), "3b": (2560, 20, 32, 2651837440), "7b": (4096, 32, 32, 6658859008),
    "13b": (5120, 40, 40, 12853954560), "30b": (7168, 56, 48, 29975214080), "70b": (8192, 64, 80, 64862437376),
}

# llm-foundry scripts/train/benchmarking/README.md @061f2c7, every SeqLen 2048 row of the A100-80,
# A100-40 and H100 BF16 tables: (model, GPU, # GPUs, MicroBatchSize, GradAccum, GlobalBatchSize,
# Activation Checkpointing, Throughput (T/s/GPU)).
MPT_ROWS = [
    # A100 80GB, 1600 Gbps RoCE
    ("70b", "A100-80", 64, 8, 4, 2048, True, 410),
    ("70b", "A100-80", 32, 2, 16, 1024, True, 373),
    ("30b", "A100-80", 8, 3, 21, 504, True, 916),
    ("13b", "A100-80", 8, 2, 3, 48, False, 2262),
    ("7b", "A100-80", 8, 6, 2, 96, False, 4641),
    ("3b", "A100-80", 8, 10, 2, 160, False, 10811),
    ("1b", "A100-80", 8, 14, 4, 448, False, 20513),
    ("760m", "A100-80", 8, 24, 2, 384, False, 32434),
    ("350m", "A100-80", 8, 32, 2, 512, False, 58782),
    ("125m", "A100-80", 8, 40, 2, 640, False, 142830),
    ("125m", "A100-80", 8, 32, 2, 512, False, 141737),
    # A100 40GB, 1600 Gbps RoCE
    ("70b", "A100-40", 128, 4, 1, 512, True, 376),
    ("70b", "A100-40", 64, 2, 1, 128, True, 276),
    ("30b", "A100-40", 128, 6, 1, 768, True, 865),
    ("30b", "A100-40", 32, 4, 1, 128, True, 857),
    ("13b", "A100-40", 128, 16, 1, 2048, True, 1972),
    ("13b", "A100-40", 64, 16, 1, 1024, True, 1976),
    ("13b", "A100-40", 32, 14, 1, 448, True, 1998),
    ("13b", "A100-40", 16, 10, 1, 160, True, 1993),
    ("13b", "A100-40", 8, 4, 16, 512, True, 1668),
    ("7b", "A100-40", 128, 18, 1, 2304, True, 3623),
    ("7b", "A100-40", 64, 18, 1, 1152, True, 3665),
    ("7b", "A100-40", 32, 18, 1, 576, True, 3725),
    ("7b", "A100-40", 16, 16, 1, 256, True, 3645),
    ("7b", "A100-40", 8, 12, 4, 384, True, 3679),
    ("3b", "A100-40", 128, 6, 1, 768, False, 9538),
    ("3b", "A100-40", 64, 6, 1, 384, False, 9736),
    ("3b", "A100-40", 32, 6, 1, 192, False, 9914),
    ("3b", "A100-40", 16, 5, 1, 80, False, 9750),
    ("3b", "A100-40", 8, 5, 8, 320, False, 10065),
    ("1b", "A100-40", 128, 10, 1, 1280, False, 18647),
    ("1b", "A100-40", 64, 10, 1, 640, False, 19001),
    ("1b", "A100-40", 32, 10, 1, 320, False, 15555),
    ("1b", "A100-40", 16, 8, 1, 128, False, 19085),
    ("1b", "A100-40", 8, 8, 8, 512, False, 19271),
    ("760m", "A100-40", 128, 12, 1, 1536, False, 28940),
    ("760m", "A100-40", 64, 12, 1, 768, False, 29344),
    ("760m", "A100-40", 32, 12, 1, 384, False, 29648),
    ("760m", "A100-40", 16, 12, 1, 192, False, 29607),
    ("760m", "A100-40", 8, 12, 4, 384, False, 30173),
    ("350m", "A100-40", 128, 18, 1, 2304, False, 51934),
    ("350m", "A100-40", 64, 18, 1, 1152, False, 52689),
    ("350m", "A100-40", 32, 18, 1, 576, False, 53811),
    ("350m", "A100-40", 16, 18, 1, 288, False, 55413),
    ("350m", "A100-40", 8, 16, 4, 512, False, 55995),
    ("125m", "A100-40", 128, 26, 1, 3328, False, 123936),
    ("125m", "A100-40", 64, 26, 1, 1664, False, 125234),
    ("125m", "A100-40", 32, 26, 1, 832, False, 127122),
    ("125m", "A100-40", 16, 26, 1, 416, False, 130535),
    ("125m", "A100-40", 8, 26, 3, 624, False, 136334),
    # H100 80GB BF16
    ("70b", "H100-80", 64, 8, 4, 2048, True, 1039),
    ("70b", "H100-80", 32, 2, 16, 1024, True, 882),
    ("30b", "H100-80", 32, 14, 3, 1344, True, 2308),
    ("30b", "H100-80", 16, 10, 3, 480, True, 2263),
    ("30b", "H100-80", 8, 3, 21, 504, True, 2002),
    ("13b", "H100-80", 64, 2, 1, 128, False, 4800),
    ("13b", "H100-80", 32, 2, 1, 64, False, 4811),
    ("13b", "H100-80", 16, 2, 1, 32, False, 4767),
    ("13b", "H100-80", 8, 2, 1, 16, False, 4792),
    ("7b", "H100-80", 8, 6, 1, 48, False, 10643),
    ("3b", "H100-80", 64, 6, 3, 1152, False, 22525),
    ("3b", "H100-80", 32, 6, 3, 576, False, 23021),
    ("3b", "H100-80", 16, 10, 3, 480, False, 24142),
    ("1b", "H100-80", 64, 20, 1, 1280, False, 44402),
    ("1b", "H100-80", 32, 20, 1, 640, False, 45130),
    ("1b", "H100-80", 16, 20, 1, 320, False, 46037),
    ("1b", "H100-80", 8, 14, 1, 112, False, 45455),
    ("760m", "H100-80", 32, 24, 1, 768, False, 67971),
    ("760m", "H100-80", 16, 24, 1, 384, False, 68551),
    ("760m", "H100-80", 8, 24, 2, 384, False, 63147),
]

# Llama geometries (Meta's published configs, as Hugging Face's config.json gives them): name ->
# (blocks, hidden, heads, KV heads, MLP width, vocabulary, context).
LLAMA = {
    "llama-3-8b": (32, 4096, 32, 8, 14336, 128256, 8192),
    "llama-3-70b": (80, 8192, 64, 8, 28672, 128256, 8192),
    "llama-2-13b": (40, 5120, 40, 40, 13824, 32000, 4096),
    "llama-2-70b": (80, 8192, 64, 8, 28672, 32000, 4096),
}

# torchtitan docs/performance.md @0413364, FSDP2 on 64 A100-80: (model, local batch, activation
# checkpointing, WPS per GPU, published MFU %). "selective layer" = every second block checkpointed.
TORCHTITAN_ROWS = [
    ("llama-3-8b", 1, "selective layer", 2904, 56.8),
    ("llama-3-70b", 1, "full", 331, 51.7),
    ("llama-2-13b", 2, "no", 2162, 61.1),
    ("llama-2-13b", 2, "selective layer", 1914, 54.1),
    ("llama-2-70b", 2, "full", 353, 50.5),
]
TORCHTITAN_GPUS = 64


def mpt_model(size: str) -> ModelSpec:
    """The MPT benchmark model `size` (key of MPT_SIZES) at sequence 2048, GPT-2-style layers."""
    d, heads, layers, _ = MPT_SIZES[size]
    return ModelSpec(name=f"mpt-{size}", num_blocks=layers, hidden_size=d, num_heads=heads, vocab_size=MPT_VOCAB,
                     max_sequence_length=2048)


def llama_model(name: str) -> ModelSpec:
    """A Llama 2 / 3 model of LLAMA: RMSNorm, SwiGLU, rotary positions, no biases, untied head."""
    blocks, hidden, heads, kv_heads, ffn, vocab, context = LLAMA[name]
    return ModelSpec(name=name, num_blocks=blocks, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     ffn_hidden_size=ffn, vocab_size=vocab, max_sequence_length=context, gated_mlp=True,
                     learned_positions=False, bias=False, rms_norm=True, tied_embeddings=False)


def node_cluster(gpu: str, gpus: int, per_node: int = 8, per_gpu: float | None = None,
                 price: float | None = None) -> ClusterSpec:
    """`gpus` GPUs of type `gpu` in one zone, `per_node` per node (NVLink inside it at the catalog's
    NCCL share), one adapter per GPU between nodes reaching `per_gpu` bytes/s (default
    INTER_NODE_BYTES_PER_S[gpu]), the node's adapters shared by its flows (module docstring);
    `price` $/GPU-hour for a GPU type the zone lists none for (None: the catalog's)."""
    spec = catalog.gpu(gpu)
    nvlink = spec.intra_node_bytes_per_s / 2 * spec.efficiency.intra_node
    per_gpu = INTER_NODE_BYTES_PER_S[gpu] if per_gpu is None else per_gpu
    return ClusterSpec(zones={ZONE: {gpu: gpus}}, gpus_per_node={gpu: per_node},
                       prices={} if price is None else {gpu: price},
                       network={"same_node": {"latency_s": LINK_LATENCY_S, "bandwidth_bytes_per_s": nvlink},
                                "same_zone": {"latency_s": LINK_LATENCY_S, "bandwidth_bytes_per_s": per_node * per_gpu,
                                              "flow_bandwidth_bytes_per_s": per_gpu}})


def fsdp_plan(model: ModelSpec, gpu: str, gpus: int, mbs: int, accum: int, recompute_blocks: int | None) -> Plan:
    """One stage holding every layer, `gpus` TP-1 replicas with ZeRO-3, `accum` micro-batches of
    `mbs` each; `recompute_blocks` None: no recomputation, else `full` on that many blocks."""
    memory: dict = {"zero": 3}
    if recompute_blocks is not None:
        memory |= {"recompute": "full",
                   **({} if recompute_blocks == model.num_blocks else {"recompute_blocks": recompute_blocks})}
    return Plan.model_validate({
        "micro_batch_size": mbs, "stages": [[0, model.num_layers]],
        "pipelines": [{"microbatches": accum, "replicas": [{"stage": 0, "gpu": gpu, "zone": ZONE, "tp": 1}]}] * gpus,
        "memory": [memory]})


def predict(model: ModelSpec, gpu: str, gpus: int, mbs: int, accum: int, recompute_blocks: int | None) -> dict:
    """Simulated tokens/s/GPU, MFU and peak memory of one FSDP row."""
    job = JobSpec(model=model, global_batch_size=mbs * accum * gpus, precision="bf16", framework="sailor")
    cluster = node_cluster(gpu, gpus)
    plan = fsdp_plan(model, gpu, gpus, mbs, accum, recompute_blocks)
    plan.check_against(job, cluster)
    est = simulate(plan, make_context(job, cluster))
    return {"tokens_per_s_per_gpu": float(job.global_batch_size * job.seq / est.iteration_time_s / gpus),
            "mfu_pct": float(100 * est.mfu), "fits": bool(est.fits_in_memory), "iteration_s": float(est.iteration_time_s),
            "peak_memory_gb": float(max(r.peak_memory_bytes for r in est.replicas) / 1e9)}


def mpt_rows() -> list[dict]:
    rows = []
    for size, gpu, gpus, mbs, accum, batch, ckpt, published in MPT_ROWS:
        assert mbs * accum * gpus == batch, (size, gpu, gpus)
        model = mpt_model(size)
        p = predict(model, gpu, gpus, mbs, accum, model.num_blocks if ckpt else None)
        rows.append({"source": "llm-foundry", "model": f"mpt-{size}", "gpu": gpu, "gpus": gpus, "seq": 2048,
                     "micro_batch": mbs, "grad_accum": accum, "global_batch": batch,
                     "activation_checkpointing": "full" if ckpt else "no", "published_tps_gpu": published, **p})
    return rows


def torchtitan_rows() -> list[dict]:
    rows = []
    for name, local, ac, published, mfu in TORCHTITAN_ROWS:
        model = llama_model(name)
        blocks = {"no": None, "full": model.num_blocks, "selective layer": model.num_blocks // 2}[ac]
        p = predict(model, "A100-80", TORCHTITAN_GPUS, local, 1, blocks)
        rows.append({"source": "torchtitan", "model": name, "gpu": "A100-80", "gpus": TORCHTITAN_GPUS,
                     "seq": model.max_sequence_length, "micro_batch": local, "grad_accum": 1,
                     "global_batch": local * TORCHTITAN_GPUS, "activation_checkpointing": ac,
                     "published_tps_gpu": published, "published_mfu_pct": mfu, **p})
    return rows


def mean_abs(rows: list[dict]) -> float | None:
    return round(sum(abs(r["error_pct"]) for r in rows) / len(rows), 2) if rows else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", choices=("mpt", "torchtitan"), help="only this source's rows")
    args = ap.parse_args()
    rows = ([] if args.source == "torchtitan" else mpt_rows()) + ([] if args.source == "mpt" else torchtitan_rows())
    table = Table(title="FSDP (ZeRO-3, one stage, TP 1) published vs simulated tokens/s/GPU, analytic profiles")
    for col in ("source", "model", "GPU", "GPUs", "seq", "mbs x accum", "AC", "published", "predicted", "error",
                "pred MFU", "fits", "peak GB"):
        table.add_column(col, justify="left" if col in ("source", "model", "GPU", "AC") else "right")
    for r in rows:
        r["error_pct"] = round((r["tokens_per_s_per_gpu"] / r["published_tps_gpu"] - 1) * 100, 1)
        for k in ("tokens_per_s_per_gpu", "mfu_pct", "iteration_s", "peak_memory_gb"):
            r[k] = round(r[k], 3 if k == "iteration_s" else 1)
        table.add_row(r["source"], r["model"], r["gpu"], str(r["gpus"]), str(r["seq"]),
                      f"{r['micro_batch']} x {r['grad_accum']}", r["activation_checkpointing"],
                      f"{r['published_tps_gpu']}", f"{r['tokens_per_s_per_gpu']:.0f}", f"{r['error_pct']:+.1f} %",
                      f"{r['mfu_pct']:.1f} %", "yes" if r["fits"] else "no", f"{r['peak_memory_gb']:.1f}")
    con = Console(width=200, file=sys.stdout)
    con.print(table)
    by_source = {s: mean_abs([r for r in rows if r["source"] == s]) for s in ("llm-foundry", "torchtitan")}
    con.print(f"mean |error| {mean_abs(rows)} % over {len(rows)} rows; by source: {by_source}")
    print(json.dumps({"mean_abs_error_pct": mean_abs(rows), "mean_abs_error_pct_by_source": by_source,
                      "rows_within_15_pct": int(sum(abs(r["error_pct"]) <= 15.0 for r in rows)), "n_rows": len(rows),
                      "all_fit": all(r["fits"] for r in rows), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
