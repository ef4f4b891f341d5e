"""Optimizer settings shared by the distributed runtime and the single-process reference, taken from
the job's recipe (`optim_config`); the learning rate of each step is `specs.recipe.learning_rate`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from sailor.specs.recipe import OptimizerRecipe


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW (or SGD) with global gradient-norm clipping (defaults: `specs.recipe.OptimizerRecipe`'s)."""

    name: str = "adamw"
    """adamw, or sgd (torch's SGD: weight decay added to the gradient, momentum without dampening)."""
    momentum: float = 0.0
    """SGD's momentum (its buffer is the runtime's first-moment buffer, `exp_avg`)."""

    lr: float = 1e-3
    """Peak learning rate; each step's rate is the recipe's schedule of it, passed to the step."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam moments; 0.95 for the second as in GPT-3 (Brown et al. 2020, App. B)."""
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices only (GPT-3, App. B); biases, norms get none."""
    max_grad_norm: float = 1.0
    """Global L2 norm the gradient is clipped to (GPT-3, App. B)."""


def optim_config(recipe: OptimizerRecipe) -> OptimConfig:
    """The runtime's optimizer settings of a job's `recipe.optimizer`."""
    return OptimConfig(name=recipe.name, lr=recipe.lr, betas=tuple(recipe.betas), eps=recipe.eps,
                       weight_decay=recipe.weight_decay, max_grad_norm=recipe.grad_clip, momentum=recipe.momentum)


def build_optimizer(params: Mapping[str, nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (or SGD, `cfg.name`) over `params` (canonical name -> parameter), weight decay on
    parameters with >= 2 dims.

    `foreach=False` keeps the per-parameter update arithmetic identical however the model is split.
    """
    decay = [p for p in params.values() if p.dim() >= 2]
    rest = [p for p in params.values() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=False)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)

