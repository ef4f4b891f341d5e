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

`run(...)` starts `--nproc` ranks under torchrun (here, or on each of `hosts` over ssh, e.g. a
testbed's nodes) and returns rank 0's step times (and on CUDA its peak allocated bytes), which rank 0
writes to `--out` (printed as `TORCH_REFERENCE {json}` without it); this file is also the rank's
entry point:

    python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/torch_reference.py \\
        --mode ddp|fsdp2 --model JSON --gbs G --mbs B --seq S --steps K [--device cpu|cuda] [--bf16] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RDZV_PORT = 29500  # the static rendezvous on the first host (torchrun's default port)
RDZV_TIMEOUT_S = 120  # how long the first host's agent waits for the others


def run(mode: str, model: dict | str, *, gbs: int, mbs: int, seq: int, steps: int, nproc: int = 2,
        device: str = "cpu", bf16: bool = False, timeout_s: float = 600, hosts: list[str] | None = None,
        ssh: str = "ssh", log: Path | None = None) -> dict[str, Any]:
    """Rank 0's {"times": [step seconds], "peak_bytes": CUDA peak allocated or None} of `mode` (ddp or
    fsdp2) on `nproc` ranks here, or, with `hosts` (ssh destinations), `nproc` ranks on each of them,
    started by `ssh` (`node_commands`), their output to `log` (default: this process's).

    Raises:
        subprocess.CalledProcessError: torchrun failed here.
        RuntimeError: a host's torchrun failed (its ssh exit status).
        TimeoutError, subprocess.TimeoutExpired: the ranks ran past `timeout_s`.
    """
    with tempfile.TemporaryDirectory(prefix="sailor-torch-reference-") as tmp:
        out = Path(tmp) / "rank0.json"
        entry = [__file__, "--mode", mode, "--model", json.dumps(model), "--gbs", str(gbs), "--mbs", str(mbs),
                 "--seq", str(seq), "--steps", str(steps), "--device", device, "--out", str(out)] + (["--bf16"] if bf16 else [])
        if hosts is None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                            *entry], capture_output=True, text=True, check=True, timeout=timeout_s, env=env)
        else:
            from sailor.launch.torchrun import run_over_ssh

            with open(log, "w") if log else contextlib.nullcontext() as f:
                status = run_over_ssh(node_commands(hosts, entry, nproc), ssh=ssh, log=f, timeout_s=timeout_s)
            if status:
                raise RuntimeError(f"torch's {mode} on {', '.join(hosts)} failed (ssh exit status {status})"
                                   + (f"; see {log}" if log else ""))
        return json.loads(out.read_text())


def node_commands(hosts: list[str], entry: list[str], nproc: int, python: str = sys.executable) -> list:
    """One `sailor.launch.torchrun.NodeCommand` per host (ssh destination): a torchrun agent of
    `nproc` ranks running `entry` (this file and its options), node rank = the host's index, the
    static rendezvous on the first host's address, port RDZV_PORT (`launch.common.torchrun_command`,
    the command sailor's own launch runs on each node)."""
    from sailor.launch.common import torchrun_command
    from sailor.launch.hosts import bare_host
    from sailor.launch.torchrun import NodeCommand

    return [NodeCommand(node=h, destination=h, script=torchrun_command(
        python, entry, nnodes=len(hosts), node_rank=k, nproc=nproc, rdzv_host=bare_host(hosts[0]), rdzv_port=RDZV_PORT,
        rdzv_timeout_s=RDZV_TIMEOUT_S)) for k, h in enumerate(hosts)]


def _rank(args: argparse.Namespace) -> None:
    """One rank (module docstring); rank 0 writes its JSON to --out, or prints TORCH_REFERENCE and it."""
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
        result = json.dumps({"times": times, "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None})
        if args.out:
            Path(args.out).write_text(result)
        else:
            print("TORCH_REFERENCE " + result, flush=True)
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
    ap.add_argument("--out", help="rank 0 writes its JSON here (default: printed)")
    _rank(ap.parse_args())


if __name__ == "__main__":
    main()
