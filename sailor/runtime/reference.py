"""The single-process reference trainer: the specification every distributed plan must match.

One process, the whole model, the whole global batch in one forward, `torch.nn.utils.clip_grad_norm_`
and the same AdamW settings, data and initial weights as the runtime. The runtime's strongest test
compares its losses and final parameters with this loop.
"""

from __future__ import annotations

import numpy as np
import torch

from sailor.runtime.data import batch_tokens
from sailor.runtime.model import GPT, init_full_model, lm_loss_sum
from sailor.runtime.optim import OptimConfig, build_optimizer
from sailor.runtime.tokens import TokenFile
from sailor.specs.job import JobSpec


def train_reference(job: JobSpec, *, steps: int, seed: int, corpus: np.ndarray | TokenFile,
                    cfg: OptimConfig = OptimConfig(), model: GPT | None = None) -> tuple[list[float], GPT]:
    """Train `job.model` for `steps` steps from its seeded initial weights (or from `model`, e.g.
    `hf_weights.load_full_model`, trained in place) on CPU in fp32.

    Returns the loss of each step (mean next-token cross-entropy over the global batch, nats) and the
    trained model (canonical parameter names).
    """
    model = init_full_model(job.model, seed) if model is None else model
    params = dict(model.named_parameters())
    opt = build_optimizer(params, cfg)
    losses = []
    for step in range(steps):
        tokens = torch.from_numpy(batch_tokens(corpus, seed=seed, step=step, first=0,
                                               count=job.global_batch_size, seq=job.seq))
        loss = lm_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model
