"""Start-up and checkpoint memory peaks on CPU (issue 32, Build 4 and 5): a model of about 330 MB
(fp32), two gloo ranks as two pipelines of one stage, ZeRO-0 and ZeRO-3.

Each rank measures its resident memory (RSS) above its baseline (process group up, nothing built)
in four phases:
- held: after one training step (weights, Adam moments; gradients dropped), the steady state;
- startup: the peak while `build_rank` builds the stage from seeded weights, layer by layer;
- save: the peak while `save_checkpoint` writes the rank's shard (streamed, 16 MiB host chunks);
- resume: the peak while `build_rank` rebuilds the stage from that checkpoint, measured from the
  RSS once the first build was freed.
Peaks are the kernel's high-water mark (`VmHWM` in /proc/self/status), reset before each phase by
writing 5 to /proc/self/clear_refs (Linux >= 4.0, proc(5)). glibc's malloc is pinned to mmap every
block over 1 MiB (`MALLOC_MMAP_THRESHOLD_`, mallopt(3)), so freed tensors leave the RSS at once and
the RSS tracks live memory.

Bounds: start-up <= held + one layer, save and resume <= held + one layer, where held is the rank's
shard of the state and one layer is the largest layer's unsharded training state in fp32 (weights +
two Adam moments, 12 bytes per parameter): what start-up or resume has in flight for one layer
before the optimizer keeps its shard of it. Prints a table (MiB above baseline, the larger of the
two ranks) and ends with one JSON line. Usage: python benchmarks/checkpoint_memory.py [--blocks 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20


def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) in bytes, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _job(blocks: int):
    from sailor.specs.job import JobSpec

    return JobSpec(model={"name": "ckpt-bench", "num_blocks": blocks, "hidden_size": 1024, "num_heads": 16,
                          "ffn_hidden_size": 4096, "vocab_size": 8192, "max_sequence_length": 64,
                          "tied_embeddings": False}, global_batch_size=2)


def _plan(zero: int, layers: int):
    """One stage of all `layers` layers, two pipelines of TP 1 (data parallel 2), ZeRO-`zero`."""
    from sailor.plan.spec import Plan

    rep = {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}
    return Plan.model_validate({"micro_batch_size": 1, "stages": [[0, layers]], "memory": [{"zero": zero}],
                                "pipelines": [{"microbatches": 1, "replicas": [rep]}] * 2})


def _rank(rank: int, store: str, root: str, out: str, blocks: int) -> None:
    """One rank: the four phases for ZeRO-0 and ZeRO-3; writes its figures (bytes) to `out`."""
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    from sailor.runtime import checkpoint as ckpt
    from sailor.runtime.checkpoint_io import Reader
    from sailor.runtime.data import batch_tokens, load_corpus
    from sailor.runtime.groups import create_groups
    from sailor.runtime.model import lm_loss_sum
    from sailor.runtime.pipeline import P2P, run_pipeline
    from sailor.runtime.topology import derive_topology
    from sailor.runtime.worker import build_rank, model_layout, save_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    cpu, job = torch.device("cpu"), _job(blocks)
    corpus, layout = load_corpus(), model_layout(job.model)
    rows = {}
    for zero in (0, 3):
        plan = _plan(zero, blocks + 2)
        topo = derive_topology(plan)
        role = topo.roles[rank]
        groups = create_groups(topo, datetime.timedelta(seconds=300))
        gc.collect()
        base, _ = _rss()
        _reset_peak()
        rk = build_rank(plan, job, role, groups, device=cpu, seed=0)
        startup = _rss()[1] - base
        tok = torch.from_numpy(batch_tokens(corpus, seed=0, step=0, first=role.first_sample, count=1, seq=job.seq))
        p2p = P2P(role, shape=(1, job.seq, job.model.hidden_size), device=cpu, timeout=datetime.timedelta(seconds=300))
        run_pipeline(rk.executors, role, p2p, order=rk.order, inputs=lambda k, t=tok: t[:, :-1].contiguous(),
                     targets=lambda k, t=tok: t[:, 1:].contiguous(), loss_fn=lm_loss_sum, loss_scale=1.0 / (2 * job.seq))
        rk.optimizer.reduce()
        rk.optimizer.clip(1.0)
        rk.optimizer.step()
        gc.collect()
        held = _rss()[0] - base
        _reset_peak()
        path = save_checkpoint(Path(root) / f"z{zero}", 1, {"seed": 0}, rk.optimizer, role, cpu, layout)
        save = _rss()[1] - base
        del rk, p2p
        gc.collect()
        freed = _rss()[0]
        _reset_peak()
        reader = Reader(path, ckpt.read_manifest(path, verify=False))
        rk = build_rank(plan, job, role, groups, device=cpu, seed=0, reader=reader, step=1)
        reader.close()
        resume = _rss()[1] - freed
        resume_held = _rss()[0] - freed
        del rk
        gc.collect()
        rows[zero] = {"held": held, "startup": startup, "save": save, "resume": resume, "resume_held": resume_held,
                      "freed_above_base": freed - base}
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=5)
    args = ap.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MIB)  # inherited by the spawned ranks (mallopt(3))
    import torch
    import torch.multiprocessing as mp

    from sailor.runtime.model import GPT
    spec = _job(args.blocks).model
    with torch.device("meta"):
        model = GPT(spec)
    params = sum(p.numel() for p in model.parameters())
    layer = max(sum(p.numel() for p in m.parameters()) for m in model.layers.values())
    one_layer = 12 * layer
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        ctx = mp.start_processes(_rank, args=(f"{tmp}/store", f"{tmp}/ck", tmp, args.blocks), nprocs=2, join=False,
                                 start_method="spawn")
        while not ctx.join(timeout=5):
            pass
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
        wall = time.monotonic() - t0
    print(f"model: {params / 1e6:.1f} M parameters, {4 * params / MIB:.0f} MiB fp32; largest layer"
          f" {layer / 1e6:.1f} M parameters, one layer's state (12 B/param) {one_layer / MIB:.1f} MiB; 2 ranks (gloo)")
    print(f"{'ZeRO':>4} {'held':>8} {'startup':>8} {'save':>8} {'resume':>8}   bound (held + one layer)   holds")
    summary = {"params": params, "layer_params": layer, "one_layer_mib": one_layer / MIB, "wall_s": wall, "zero": {}}
    ok_all = True
    for zero in ("0", "3"):
        fig = {k: max(r[zero][k] for r in ranks) / MIB for k in ("held", "startup", "save", "resume", "resume_held")}
        bound = fig["held"] + one_layer / MIB
        ok = all(fig[k] <= bound for k in ("startup", "save", "resume"))
        ok_all &= ok
        print(f"{zero:>4} {fig['held']:8.1f} {fig['startup']:8.1f} {fig['save']:8.1f} {fig['resume']:8.1f}"
              f"   {bound:8.1f}                   {'yes' if ok else 'NO'}")
        summary["zero"][zero] = {**{k: round(v, 1) for k, v in fig.items()}, "bound": round(bound, 1), "holds": ok}
    summary["holds"] = ok_all
    print(json.dumps(summary))
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
