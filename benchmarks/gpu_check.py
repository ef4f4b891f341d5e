"""First contact with a GPU (issue #32, item 11): one short check on one CUDA device, <= 10 minutes.

    python benchmarks/gpu_check.py [--model opt-350m] [--seq 512] [--mbs 2] [--microbatches 4]
                                   [--steps 8] [--out DIR]

What it does, in order, each part on its own (a failing part is recorded and the next one runs):
1. identity: the device's name, memory and compute capability, its catalog type
   (`sailor.catalog.cuda`) and whether the installed torch has kernels for it;
2. attention: which scaled-dot-product-attention kernel torch picks for the model's attention shape
   in the compute dtype (flash, memory-efficient, cuDNN or math), read from the CUDA kernels a
   profiled forward and backward launch;
3. profile: `sailor profile --device cuda --tp 1` at two micro-batch sizes (layer times, optimizer
   seconds per parameter), in the precision training runs in (bf16; fp16 before capability 8.0);
4. training: `sailor train --device cuda` of a one-GPU plan for `--steps` steps, in bf16 (when the
   device has bf16, capability >= 8.0) and in fp16; the memory `nvidia-smi` reports is sampled every
   0.1 s, split into start-up (before the first step is logged) and steady state (after), and set
   against `sailor simulate`'s prediction of the same plan; the per-stage forward/backward/wait
   seconds (CUDA events) and step times are kept. A run the runtime refuses (exit 2) is recorded
   with its one line, as what is missing. The prediction is made on a one-zone cluster that gives
   the GPU a price of 0 (only memory is read; several catalog types have no GCP list price);
5. against torch: on 1 GPU, and on all of the machine's GPUs when it has more, `sailor train` of
   data-parallel plans (ZeRO-0 and ZeRO-3) with their predicted step time and MFU, and with 2+ GPUs
   torch's DDP and FSDP2 on the same model and batch (`against_torch`, `torch_reference.py`):
   tokens/s, MFU and memory side by side (issue #26 item 6).

Bad arguments (sizes < 1, an unknown model) exit 2 with one line before anything else, so that a
typo does not spend a GPU session. It ends with one JSON line holding everything. Without a CUDA
device it prints "needs a CUDA device" and exits 2. Nothing here has run on a GPU yet (README "GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # torch_reference


def identity() -> dict[str, Any]:
    import torch

    from sailor.catalog.cuda import check_arch
    from sailor.runtime.device import cuda_identity

    ident = cuda_identity(0)
    return {"name": ident.name, "total_memory_bytes": ident.total_memory, "capability": list(ident.capability),
            "catalog_type": ident.gpu, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "arch_list": torch.cuda.get_arch_list(),
            "arch_problem": check_arch(ident.capability, list(torch.cuda.get_arch_list()), ident.name)}


def attention_kernel(model: str, seq: int, mbs: int, dtype_name: str) -> dict[str, Any]:
    """The SDPA kernels a causal attention forward + backward of the model's shape launches."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from sailor.model.registry import get_model

    spec = get_model(model)
    dtype = getattr(torch, dtype_name)
    h, d = spec.num_heads, spec.hidden_size // spec.num_heads
    q, k, v = (torch.randn(mbs, h, seq, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    kinds = [kind for kind, keys in (("flash", ("flash",)), ("memory-efficient", ("fmha", "efficient", "cutlass")),
                                     ("cudnn", ("cudnn",))) if any(x in n.lower() for n in names for x in keys)]
    return {"dtype": dtype_name, "shape": [mbs, h, seq, d], "kernel": kinds[0] if kinds else "math",
            "cuda_kernels": [n for n in names if any(x in n.lower() for x in ("attention", "fmha", "flash", "cudnn"))][:8]}


class MemorySampler:
    """nvidia-smi's memory.used of GPU 0 every `period_s`, tagged with the steps logged so far."""

    def __init__(self, metrics: Path, period_s: float = 0.1) -> None:
        self.metrics, self.period_s = metrics, period_s
        self.samples: list[tuple[int, int]] = []  # (steps logged, bytes)
        self.error: str | None = None  # why sampling stopped early (e.g. no nvidia-smi on PATH)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _steps(self) -> int:
        try:
            return sum(1 for line in self.metrics.read_text().splitlines() if '"step"' in line)
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                                    "0"], capture_output=True, text=True, check=False, timeout=10)
            except (OSError, subprocess.SubprocessError) as e:  # recorded; the run goes on unsampled
                self.error = f"{type(e).__name__}: {e}"
                return
            if r.returncode == 0 and r.stdout.strip():
                self.samples.append((self._steps(), int(float(r.stdout.split()[0])) * 2**20))
            self._stop.wait(self.period_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self) -> dict[str, int | None]:
        start = [b for s, b in self.samples if s == 0]
        steady = [b for s, b in self.samples if s >= 1]
        return {"startup_peak_bytes": max(start, default=None), "steady_peak_bytes": max(steady, default=None),
                "samples": len(self.samples), **({"sampler_error": self.error} if self.error else {})}


def sailor(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sailor", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, check=False)


ZONE = "us-central1-a"


def one_gpu_plan(gpu: str, job: dict[str, Any], mbs: int, microbatches: int) -> dict[str, Any]:
    from sailor.model.registry import get_model

    layers = get_model(job["model"]).num_layers
    return {"micro_batch_size": mbs, "stages": [[0, layers]], "job": job,
            "pipelines": [{"microbatches": microbatches,
                           "replicas": [{"stage": 0, "gpu": gpu, "zone": ZONE, "tp": 1}]}]}


def predict(gpu: str, plan_path: Path) -> dict[str, Any]:
    """`sailor simulate`'s memory of the one-GPU plan (bytes per GPU), on a cluster of one `gpu` in
    ZONE priced at 0 $/hour there: the check reads memory only, and V100-32, A100-80-PCIe, H100-PCIe,
    H100-NVL and the RTX/Titan cards have no GCP list price, without which simulate refuses the plan
    (a price in the zone also takes a type GCP does not rent in ZONE, such as H200-141).
    The figure without the sync buffer is given too: the model's sync buffer is DeepSpeed's flat
    gradient copy (simulator.memory); this runtime reduces its ZeRO-0/1 gradient buffers in place."""
    import sailor as api

    cluster = {"provider": "gcp", "zones": {ZONE: {gpu: 1}}, "prices": {ZONE: {gpu: 0.0}}}
    mem = api.simulate(str(plan_path), cluster=cluster).replicas[0].memory
    return {"predicted_bytes": mem.total, "predicted": mem.to_dict(),
            "predicted_without_sync_buffer_bytes": mem.total - mem.sync_buffer}


def check_args(args: argparse.Namespace) -> str | None:
    """One line naming the first bad argument (None: all usable); checked before CUDA is touched."""
    from sailor.core.errors import SailorInputError
    from sailor.model.registry import get_model

    for name in ("seq", "mbs", "microbatches", "steps"):
        if getattr(args, name) < 1:
            return f"--{name}: must be >= 1, got {getattr(args, name)}"
    try:
        spec = get_model(args.model)
    except SailorInputError as e:
        return f"--model: {e.one_line()}"
    if args.seq > spec.max_sequence_length:
        return f"--seq: {args.seq} is longer than {spec.name}'s context ({spec.max_sequence_length})"
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        return f"--out: {args.out} is a file; name a folder for the check's files"
    return None


def train(gpu: str, precision: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One `sailor train` run of the one-GPU plan; memory sampled; prediction from `sailor simulate`."""
    job = {"model": args.model, "global_batch_size": args.mbs * args.microbatches, "sequence_length": args.seq,
           "precision": precision}
    plan_path, metrics = folder / f"plan-{precision}.json", folder / f"metrics-{precision}.jsonl"
    plan_path.write_text(json.dumps(one_gpu_plan(gpu, job, args.mbs, args.microbatches)))
    # `sailor train --metrics` appends: a rerun into the same --out would count the last run's steps
    # (the sampler's start-up/steady split, the first loss)
    metrics.unlink(missing_ok=True)
    out: dict[str, Any] = {"precision": precision}
    try:
        out.update(predict(gpu, plan_path))
    except Exception as e:  # noqa: BLE001 - recorded, the run still goes ahead
        out["predict_error"] = f"{type(e).__name__}: {e}"
    with MemorySampler(metrics) as sampler:
        t0 = time.perf_counter()
        r = sailor("train", str(plan_path), "--device", "cuda", "--steps", str(args.steps), "--metrics", str(metrics),
                   timeout_s=240)
        out["wall_s"] = time.perf_counter() - t0
    out["exit"] = r.returncode
    if r.returncode != 0:
        out["missing" if r.returncode == 2 else "error"] = (r.stderr.strip().splitlines() or [""])[-1]
        return out
    out.update(sampler.peaks())
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [x for x in rows if "step" in x and "stages" in x]
    if steps:
        last = steps[-1]
        out.update(loss_first=steps[0]["loss"], loss_last=last["loss"], step_time_s=last["step_time_s"],
                   tokens_per_s=last["tokens_per_s"], stage_times_s=last["stages"])
    if out.get("steady_peak_bytes") and out.get("predicted_bytes"):
        out["steady_over_predicted"] = out["steady_peak_bytes"] / out["predicted_bytes"]
        out["steady_over_predicted_without_sync_buffer"] = (out["steady_peak_bytes"]
                                                            / out["predicted_without_sync_buffer_bytes"])
    return out


def against_torch(gpu: str, n: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Data parallelism over `n` GPUs of this machine, in bf16 (fp16 before capability 8.0 for Sailor;
    torch's reference then runs fp32): `sailor train` of n one-GPU pipelines under ZeRO-0 and ZeRO-3
    against torch's DDP and FSDP2 (`torch_reference.py`) on the same model, batch and data. Per run:
    tokens/s (the median step after the first two), peak memory, and Sailor's prediction of the step
    time and MFU (`sailor simulate`, analytic profiles, a one-node cluster of n `gpu`s priced at 0)."""
    import statistics

    import sailor as api
    import torch_reference

    precision = "bf16" if args.bf16 else "fp16"
    gbs, tokens = n * args.mbs * args.microbatches, n * args.mbs * args.microbatches * args.seq
    job = {"model": args.model, "global_batch_size": gbs, "sequence_length": args.seq, "precision": precision}
    cluster = {"provider": "gcp", "zones": {ZONE: {gpu: n}}, "prices": {ZONE: {gpu: 0.0}}, "gpus_per_node": {gpu: n}}
    out: dict[str, Any] = {"gpus": n, "precision": precision}
    for zero in (0, 3):
        plan = {**one_gpu_plan(gpu, job, args.mbs, args.microbatches), "memory": [{"zero": zero}] if n > 1 else []}
        plan["pipelines"] = plan["pipelines"] * n
        path, metrics = folder / f"dp{n}-zero{zero}.json", folder / f"dp{n}-zero{zero}.jsonl"
        path.write_text(json.dumps(plan))
        metrics.unlink(missing_ok=True)
        row: dict[str, Any] = {}
        est = api.simulate(str(path), cluster=cluster)
        row.update(predicted_step_s=est.iteration_time_s, predicted_mfu=est.mfu)
        r = sailor("train", str(path), "--device", "cuda", "--steps", str(args.steps), "--metrics", str(metrics),
                   timeout_s=300)
        row["exit"] = r.returncode
        steps = [json.loads(x) for x in metrics.read_text().splitlines() if '"step_time_s"' in x] if metrics.exists() else []
        if r.returncode != 0 or len(steps) < 3:
            row["error"] = (r.stderr.strip().splitlines() or [""])[-1]
        else:
            t = statistics.median(x["step_time_s"] for x in steps[2:])
            row.update(step_s=t, tokens_per_s=tokens / t, mfu=est.model_flop_per_iteration / (t * est.peak_flop_per_s))
        out[f"sailor_zero{zero}"] = row
    if n > 1:
        for mode in ("ddp", "fsdp2"):
            try:
                ref = torch_reference.run(mode, args.model, gbs=gbs, mbs=args.mbs, seq=args.seq, steps=args.steps,
                                          nproc=n, device="cuda", bf16=args.bf16, timeout_s=300)
                t = statistics.median(ref["times"][2:])
                out[mode] = {"step_s": t, "tokens_per_s": tokens / t, "peak_bytes": ref["peak_bytes"]}
            except Exception as e:  # noqa: BLE001 - recorded; the other runs still count
                out[mode] = {"error": f"{type(e).__name__}: {e}"}
        for mine, theirs in (("sailor_zero0", "ddp"), ("sailor_zero3", "fsdp2")):
            a, b = out[mine].get("tokens_per_s"), out[theirs].get("tokens_per_s")
            out[f"{mine}_over_{theirs}"] = a / b if a and b else None
    return out


def profile(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from sailor.runtime.profiler import device_description

    job = folder / "job.json"
    job.write_text(json.dumps({"model": args.model, "global_batch_size": 8, "sequence_length": args.seq,
                               "precision": "bf16" if args.bf16 else "fp16"}))  # what training runs in
    out_file = folder / "profile.json"
    t0 = time.perf_counter()
    r = sailor("profile", "--job", str(job), "--device", "cuda", "--tp", "1", "--mbs", f"1,{args.mbs}", "--warmup", "2",
               "--repeats", "5", "--out", str(out_file), timeout_s=240)
    res: dict[str, Any] = {"exit": r.returncode, "wall_s": time.perf_counter() - t0, "device": device_description("cuda")}
    if r.returncode != 0:
        res["error"] = (r.stderr.strip().splitlines() or [""])[-1]
        return res
    data = json.loads(out_file.read_text())
    res["optimizer"] = data.get("optimizer")
    # per micro-batch size: seconds of the embedding, one block and the head (first, second, last layer)
    res["layers"] = [{"mbs": row["mbs"], "forward_s": [row["forward_s"][i] for i in (0, 1, -1)],
                      "backward_s": [row["backward_s"][i] for i in (0, 1, -1)]} for row in data.get("layers", [])]
    res["peak_bytes"] = [m.get("peak_bytes") for m in data.get("memory", [])]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-350m")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    bad = check_args(args)
    if bad:
        print(f"gpu_check: {bad}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: needs a CUDA device", file=sys.stderr)
        return 2
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sailor-gpu-check-"))
    folder.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"check": "gpu_check", "model": args.model, "seq": args.seq, "mbs": args.mbs,
                              "microbatches": args.microbatches, "steps": args.steps}
    t0 = time.perf_counter()

    def part(name: str, fn, *a) -> Any:
        try:
            result[name] = fn(*a)
        except Exception as e:  # noqa: BLE001 - one part failing must not hide the others
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"gpu_check: {name} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        return result[name]

    ident = part("identity", identity)
    cc = tuple(ident.get("capability", (0, 0)))
    args.bf16 = cc >= (8, 0)
    gpu = ident.get("catalog_type")
    part("attention", attention_kernel, args.model, args.seq, args.mbs, "bfloat16" if args.bf16 else "float16")
    if gpu is None or ident.get("arch_problem"):
        result["skipped"] = "profile and training: the device is not a catalog type or torch cannot run it"
    else:
        part("profile", profile, args, folder)
        runs = []
        for precision in (["bf16"] if args.bf16 else []) + ["fp16"]:
            runs.append(part(f"train_{precision}", train, gpu, precision, args, folder))
        result["train"] = [r.get("precision") for r in runs]
        gpus = torch.cuda.device_count()
        for n in sorted({1, gpus}):
            part(f"against_torch_{n}", against_torch, gpu, n, args, folder)
    result["wall_s"] = time.perf_counter() - t0
    (folder / "gpu_check.json").write_text(json.dumps(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
