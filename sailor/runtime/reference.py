"""The single-process reference trainer: the specification every distributed plan must match.

One process, the whole model, the whole global batch in one forward, `torch.nn.utils.clip_grad_norm_`
and the same recipe (AdamW settings, learning rate of each step, evaluation), data and initial
weights as the runtime. The runtime's strongest test compares its losses, learning rates, eval losses
and final parameters with this loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sailor.runtime.data import batch_tokens, eval_tokens
from sailor.runtime.model import GPT, init_full_model, lm_loss_sum
from sailor.runtime.moe import load_balancing_loss, record_router_logits
from sailor.runtime.optim import OptimConfig, build_optimizer, optim_config
from sailor.runtime.tokens import TokenFile
from sailor.specs.job import JobSpec


def train_reference(job: JobSpec, *, steps: int, seed: int, corpus: np.ndarray | TokenFile,
                    cfg: OptimConfig | None = None, model: GPT | None = None,
                    eval_corpus: np.ndarray | TokenFile | None = None,
                    log: list[dict[str, Any]] | None = None,
                    micro_batch_size: int | None = None) -> tuple[list[float], GPT]:
    """Train `job.model` for `steps` steps from its seeded initial weights (or from `model`, e.g.
    `hf_weights.load_full_model`, trained in place) on CPU in fp32, with `job.recipe` (`cfg`
    overrides its optimizer settings; each step's learning rate is `job.recipe.lr(step)`).

    With `job.recipe.eval` and `eval_corpus` (its held-out tokens), evaluates after every
    `eval.every` steps (`evaluate`). `log`, when given, gets one dict per step: {"step" (1-based),
    "loss", "lr"}, plus "eval_loss" where evaluated, as the runtime's metrics lines have them.
    `micro_batch_size` splits the batch for the load-balancing loss only (`training_loss`).

    Returns the loss of each step (mean next-token cross-entropy over the global batch, nats) and the
    trained model (canonical parameter names).
    """
    model = init_full_model(job.model, seed) if model is None else model
    cfg = optim_config(job.recipe.optimizer) if cfg is None else cfg
    params = dict(model.named_parameters())
    opt = build_optimizer(params, cfg)
    losses = []
    for step in range(steps):
        lr = job.recipe.lr(step + 1)
        for group in opt.param_groups:
            group["lr"] = lr
        tokens = torch.from_numpy(batch_tokens(corpus, seed=seed, step=step, first=0,
                                               count=job.global_batch_size, seq=job.seq))
        loss = training_loss(model, tokens, micro_batch_size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        record: dict[str, Any] = {"step": step + 1, "loss": losses[-1], "lr": lr}
        ev = job.recipe.eval
        if ev is not None and eval_corpus is not None and (step + 1) % ev.every == 0:
            record["eval_loss"] = evaluate(job, model, eval_corpus)
        if log is not None:
            log.append(record)
    return losses, model


def training_loss(model: GPT, tokens: torch.Tensor, micro_batch_size: int | None = None) -> torch.Tensor:
    """The loss one step minimises on a (B, T + 1) token batch: the mean next-token cross-entropy
    (nats), plus, for a mixture of experts with `moe.aux_loss_coef` > 0, that weight times the
    load-balancing loss (`moe.load_balancing_loss`, as transformers adds it with
    output_router_logits) of the whole batch's forward pass, or, with `micro_batch_size` b, the mean
    of that loss over the consecutive b-sample micro-batches (each over its own rows of every layer's
    router logits), as a distributed run with micro-batches of b samples applies it (`runtime.balance`;
    one micro-batch: the whole batch). () fp32. Raises ValueError when b does not divide B."""
    moe = model.spec.moe
    with record_router_logits(model) as router_logits:
        logits = model(tokens[:, :-1])
    loss = lm_loss_sum(logits, tokens[:, 1:]) / tokens[:, 1:].numel()
    if moe is not None and moe.aux_loss_coef > 0:
        samples, seq = tokens.shape[0], tokens.shape[1] - 1
        b = micro_batch_size or samples
        if samples % b:
            raise ValueError(f"micro-batches of {b} samples do not divide a batch of {samples}")
        aux = [load_balancing_loss([x[m * b * seq:(m + 1) * b * seq] for x in router_logits], moe.num_experts,
                                   moe.top_k) for m in range(samples // b)]  # rows are (sample, position)
        loss = loss + moe.aux_loss_coef * torch.stack(aux).mean()
    return loss


@torch.no_grad()
def evaluate(job: JobSpec, model: GPT, corpus: np.ndarray | TokenFile) -> float:
    """Mean next-token cross-entropy (nats) of `model` over `job.recipe.eval.batches` held-out global
    batches of `corpus` (`data.eval_tokens`): forward only, no gradient, no update."""
    ev = job.recipe.eval
    assert ev is not None
    total = 0.0
    for k in range(ev.batches):
        tokens = torch.from_numpy(eval_tokens(corpus, batch=k, first=0, count=job.global_batch_size, seq=job.seq))
        total += lm_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]).item()
    return total / (ev.batches * job.global_batch_size * job.seq)
