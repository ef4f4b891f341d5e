"""A forward pass of Hugging Face weights through the runtime's own pieces on a plan (gloo processes):
what `sailor train --init-from` builds, minus the training loop. Used by test_hf_weights.py.

Each process: `derive_topology` -> `create_groups`, `create_channel_groups` -> `GPT` on meta ->
`build_stage` -> `apply_tp` -> `materialize_hf` (its stage's layers, its TP shard) -> forward of one
micro-batch, activations crossing stage boundaries through the runtime's `P2P` (the transfers of
micro-batch 0's forward, `messages.op_receives` / `op_sends`). TP rank 0 of each pipeline's last
stage saves the logits.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path


def _rank(rank: int, world: int, init_file: str, cases: list[tuple[str, str, str]], plan_dict: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    from sailor.model.hf_config import load_hf_config
    from sailor.plan.orders import FWD, Op
    from sailor.plan.spec import Plan
    from sailor.runtime.groups import create_channel_groups, create_groups
    from sailor.runtime.hf_weights import HFWeights, materialize_hf
    from sailor.runtime.messages import op_receives, op_sends
    from sailor.runtime.model import GPT
    from sailor.runtime.pipeline import P2P, build_stage
    from sailor.runtime.tensor_parallel import VocabParallelHead, apply_tp
    from sailor.runtime.topology import derive_topology

    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    plan = Plan.model_validate(plan_dict)
    topo = derive_topology(plan)
    role = topo.roles[rank]
    groups = create_groups(topo, timeout)
    channels = create_channel_groups(topo, timeout)
    fwd = Op(FWD, 0, 0)
    for name, folder, tokens_file in cases:
        spec = load_hf_config(folder)
        tokens = torch.load(tokens_file)
        with torch.device("meta"):
            stage = GPT(spec)
        build_stage(stage, role.chunks)
        apply_tp(stage, tp_rank=role.tp_rank, tp=role.tp, group=groups.get(role.tp_group))
        materialize_hf(stage, HFWeights(folder, spec), tp_rank=role.tp_rank, tp=role.tp, device=torch.device("cpu"))
        p2p = P2P(role, shape=(tokens.shape[0], tokens.shape[1], spec.hidden_size), device=torch.device("cpu"),
                  timeout=timeout, channels=channels, tp_group=groups.get(role.tp_group))
        with torch.no_grad():
            x = stage(tokens if role.is_first_stage else p2p.receive(op_receives(role, fwd)))
            if role.is_last_stage:
                heads = [m for m in stage.modules() if isinstance(m, VocabParallelHead)]
                if heads:  # under TP each rank holds its vocabulary shard of the logits
                    x = heads[0].all_logits(x)
                if role.tp_rank == 0:
                    torch.save(x, Path(out) / f"{name}-p{role.pipeline}.pt")
            else:
                p2p.send(x, op_sends(role, fwd))
            p2p.finish()
        dist.barrier()
    dist.destroy_process_group()


def run_plan(plan_dict: dict, cases: list[tuple[str, str, str]], out: Path) -> None:
    """Run every (name, model folder, tokens .pt) case on `plan_dict`; logits land in
    `out/<name>-p<pipeline>.pt`."""
    import torch.multiprocessing as mp

    world = sum(r["tp"] for p in plan_dict["pipelines"] for r in p["replicas"])
    init_file = str(out / f"init-{os.getpid()}")
    mp.spawn(_rank, args=(world, init_file, cases, plan_dict, str(out)), nprocs=world, join=True)
