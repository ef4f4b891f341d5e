"""Scatter-gather stage boundaries (`runtime.pipeline.P2P`, `plan.comms.boundary_pieces`) on 3 gloo
ranks: stage 0 at TP 2 (ranks 0, 1) feeds stage 1 at TP 1 (rank 2), so activations cross TP 2 -> TP 1
and their gradients TP 1 -> TP 2. Each tensor must arrive whole and bit-exact, and each rank must
send, counted by `P2P.sent`, exactly its 1/t of each activation or gradient (SC'21 §4.1).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from spawn import spawn

from sailor.plan.orders import BWD, FWD, Op
from sailor.plan.spec import Plan

SHAPE = (2, 8, 12)  # (B, T, h): B > 1, so sequence-major slices are not plain rows of the tensor
MICRO = 3
PLAN = {"micro_batch_size": 2, "stages": [[0, 3], [3, 6]],
        "pipelines": [{"microbatches": MICRO, "replicas": [
            {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 2}, {"stage": 1, "gpu": "cpu", "zone": "local", "tp": 1}]}]}


def _tensor(k: int, sign: float) -> torch.Tensor:
    return sign * (torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE) + 1000.0 * k)


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from sailor.runtime.groups import create_channel_groups, create_groups
    from sailor.runtime.messages import op_receives, op_sends
    from sailor.runtime.pipeline import P2P
    from sailor.runtime.topology import derive_topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    topo = derive_topology(Plan.model_validate(PLAN))
    role, timeout = topo.roles[rank], timedelta(seconds=60)
    groups = create_groups(topo, timeout)
    p2p = P2P(role, shape=SHAPE, device=torch.device("cpu"), timeout=timeout,
              channels=create_channel_groups(topo, timeout), tp_group=groups.get(role.tp_group))
    for k in range(MICRO):  # forwards, then backwards (each channel in micro-batch order)
        if role.stage == 0:
            p2p.send(_tensor(k, 1.0), op_sends(role, Op(FWD, 0, k)))
        else:
            assert torch.equal(p2p.receive(op_receives(role, Op(FWD, 0, k))), _tensor(k, 1.0))
    for k in range(MICRO):
        if role.stage == 1:
            p2p.send(_tensor(k, -1.0), op_sends(role, Op(BWD, 0, k)))
        else:
            assert torch.equal(p2p.receive(op_receives(role, Op(BWD, 0, k))), _tensor(k, -1.0))
    p2p.finish()
    Path(out, f"rank{rank}.json").write_text(json.dumps(p2p.sent))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.integration
def test_each_tp_rank_sends_its_share_and_the_receiver_gathers_it_whole(tmp_path):
    spawn(_rank, 3, str(tmp_path / "store"), str(tmp_path), timeout_s=120)
    sent = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    activation = torch.Size(SHAPE).numel() * 4  # bytes of one fp32 activation
    # TP 2 -> TP 1: each sender its half of every activation; TP 1 -> TP 2: the one sender all of it
    assert sent[0] == sent[1] == {"activation": MICRO * activation // 2}
    assert sent[2] == {"gradient": MICRO * activation}
    assert sum(s.get("activation", 0) for s in sent) == MICRO * activation  # every byte crosses once


def test_sequence_parallel_edges_at_stage_boundaries_stay_sliced():
    from sailor.runtime.model import GPT
    from sailor.runtime.pipeline import build_stage
    from sailor.runtime.tensor_parallel import sliced_edges
    from sailor.specs.job import JobSpec

    spec = JobSpec(model="tiny", global_batch_size=8).model  # layers: embedding 0, blocks 1-4, head 5

    def edges(chunks, sp=True):
        with torch.device("meta"):
            stage = build_stage(GPT(spec), chunks)
        return sliced_edges(stage, chunks, sequence_parallel=sp)

    assert edges(((0, 3),)) == ((False, True),)  # fed by the embedding, sends a block's slice
    assert edges(((3, 6),)) == ((True, False),)  # receives a block's slice, gathers for the head
    assert edges(((2, 4),)) == ((True, True),)
    assert edges(((0, 2), (3, 5))) == ((False, True), (True, True))  # interleaved chunks
    assert edges(((0, 1), (5, 6))) == ((False, False), (False, False))  # embedding / head alone
    assert edges(((2, 4),), sp=False) == ((False, False),)
