"""Evaluation on held-out tokens during training (the job's `recipe.eval`): the plan's own pipeline,
forwards only.

Every `recipe.eval.every` steps, after the step's update, each pipeline runs `recipe.eval.batches`
held-out global batches (`data.eval_tokens`: its share of each, the same samples at every
evaluation) through the forwards of its stage order (`Schedule.order` with the F ops alone, in
their order): every stage of every pipeline runs the same F ops, so the point-to-point transfers
match as in training (`messages`), and under ZeRO-2/3 the rounds of the largest share run, so every
member joins every weight gather. All under `torch.no_grad`: no backward, no gradient, no update.
The loss is taken on each pipeline's last stage exactly as the training loss is (`head_loss`), and
one SUM all-reduce of a slot per pipeline (written by its last stage's TP rank 0 alone) gives every
rank the total.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sailor.plan.orders import FWD, Op
from sailor.runtime.data import eval_tokens
from sailor.runtime.executor import StageExecutor
from sailor.runtime.grad_sync import SyncTimeline
from sailor.runtime.pipeline import P2P, run_pipeline
from sailor.runtime.tensor_parallel import head_loss
from sailor.runtime.tokens import TokenFile
from sailor.runtime.topology import RankRole
from sailor.runtime.zero import ShardedAdamW


def eval_loss(executors: Sequence[StageExecutor], order: Sequence[Op], stage: nn.Module, opt: ShardedAdamW,
              role: RankRole, p2p: P2P, corpus: np.ndarray | TokenFile, *, batches: int, mbs: int, seq: int,
              global_batch: int, device: torch.device) -> float:
    """Collective over all ranks: the mean next-token cross-entropy (nats per token) of the whole
    model over `batches` held-out global batches of `global_batch` samples of `seq` tokens (module
    docstring). `order` is the rank's training order; `opt` its optimizer, whose layer hooks run
    (ZeRO-3 gathers) and whose gradient-sync timeline is restarted afterwards, so the next step is
    timed from its own start."""
    forwards = [op for op in order if op.kind == FWD]
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for k in range(batches):
            tok = torch.from_numpy(eval_tokens(corpus, batch=k, first=role.first_sample,
                                               count=role.microbatches * mbs, seq=seq)).to(device)
            loss_sum, _ = run_pipeline(
                executors, role, p2p, order=forwards, inputs=lambda j, tok=tok: tok[j * mbs:(j + 1) * mbs, :-1].contiguous(),
                targets=lambda j, tok=tok: tok[j * mbs:(j + 1) * mbs, 1:].contiguous(), loss_fn=head_loss(stage),
                loss_scale=1.0)
            total += loss_sum
            for ex in executors:
                ex.saved.clear()  # what the forwards kept for a backward that never comes
    opt.timeline = SyncTimeline(device)
    sums = torch.zeros(role.num_pipelines, dtype=torch.float64, device=device)
    if role.is_last_stage and role.tp_rank == 0:
        sums[role.pipeline] = total
    dist.all_reduce(sums)  # one writer per slot: each slot is that pipeline's loss sum
    return float(sums.sum()) / (batches * global_batch * seq)
