"""torch's own data parallelism on Sailor's model, the reference the runtime is measured against
(`runtime_overhead.py` on CPU, `gpu_check.py` on CUDA): DDP (`torch.nn.parallel.
DistributedDataParallel`) or FSDP2 (`torch.distributed.fsdp.fully_shard`, each transformer block its
own unit and the root holding the tied embedding and the head; re-sharded after forward, gradients
reduce-scattered every micro-batch, as Sailor's ZeRO-3 does).

Both take the global batch in equal shares per rank, in micro-batches (DDP skips the all-reduce on
all but the last with `no_sync`), the same data (`runtime.data.batch_tokens`), loss (summed
cross-entropy over the global tokens), clipping and AdamW settings (`runtime.optim.OptimConfig`)
as `sailor train`, and all-reduce the loss each step as the runtime does. `--device cuda` runs NCCL
with one GPU per rank (LOCAL_RANK) and, in bf16, autocast (DDP) or bf16 parameters with fp32
gradient reduction (FSDP2's `MixedPrecisionPolicy`); `cpu` runs gloo in fp32.

`run(...)` starts `--nproc` ranks under torchrun and returns rank 0's step times (and on CUDA its
peak allocated bytes); this file is also the rank's entry point:

    python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/torch_reference.py \\
        --mode ddp|fsdp2 --model JSON --gbs G --mbs B --seq S --steps K [--device cpu|cuda] [--bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, model: dict | str, *, gbs: int, mbs: int, seq: int, steps: int, nproc: int = 2,
        device: str = "cpu", bf16: bool = False, timeout_s: float = 600) -> dict[str, Any]:
    """Rank 0's {"times": [step seconds], "peak_bytes": CUDA peak allocated or None} of `mode` (ddp or
    fsdp2) on `nproc` ranks. Raises subprocess.CalledProcessError when torchrun fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), __file__,
           "--mode", mode, "--model", json.dumps(model), "--gbs", str(gbs), "--mbs", str(mbs), "--seq", str(seq),
           "--steps", str(steps), "--device", device] + (["--bf16"] if bf16 else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=timeout_s, env=env).stdout
    line = next(x for x in out.splitlines() if x.startswith("TORCH_REFERENCE "))
    return json.loads(line[len("TORCH_REFERENCE "):])


def _rank(args: argparse.Namespace) -> None:
    """One rank (module docstring); rank 0 prints TORCH_REFERENCE and its JSON."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sailor.runtime.data import batch_tokens, load_corpus
    from sailor.runtime.model import init_full_model, lm_loss_sum
    from sailor.runtime.optim import OptimConfig, build_optimizer
    from sailor.specs.job import JobSpec

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    job = JobSpec(model=json.loads(args.model), global_batch_size=args.gbs, sequence_length=args.seq)
    model = init_full_model(job.model, 0).to(device)
    autocast = contextlib.nullcontext
    if args.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
        kw = {"mesh": mesh} | ({"mp_policy": policy} if policy else {})
        for i, layer in model.layers.items():
            if 0 < int(i) < len(model.layers) - 1:  # the blocks; the root keeps the tied embedding and head
                fully_shard(layer, **kw)
        wrapped = fully_shard(model, **kw)
    else:
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        if args.bf16:
            autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    cfg = OptimConfig()
    opt = build_optimizer(dict(model.named_parameters()), cfg)
    corpus = load_corpus()
    share, mbs, seq = args.gbs // world, args.mbs, job.seq
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        tok = torch.from_numpy(batch_tokens(corpus, seed=0, step=step, first=rank * share, count=share,
                                            seq=seq)).to(device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for k in range(share // mbs):
            mb = tok[k * mbs:(k + 1) * mbs]
            last = k == share // mbs - 1
            skip = wrapped.no_sync() if not last and args.mode == "ddp" else contextlib.nullcontext()
            with skip, autocast():
                # DDP and FSDP average over ranks: scale by world / global tokens for the global mean
                loss = lm_loss_sum(wrapped(mb[:, :-1]), mb[:, 1:])
                (loss * world / (args.gbs * seq)).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)  # the loss report sailor's runtime also makes
        loss_sum.item()  # the step ends when its loss is known (the runtime's step time ends there too)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        print("TORCH_REFERENCE " + json.dumps({"times": times, "peak_bytes": peak}), flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see sailor.runtime.worker.main: skip the process group's teardown at exit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("ddp", "fsdp2"), required=True)
    ap.add_argument("--model", required=True, help="a built-in model's name as JSON, or a model dict")
    for name in ("gbs", "mbs", "seq", "steps"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--bf16", action="store_true")
    _rank(ap.parse_args())


if __name__ == "__main__":
    main()
