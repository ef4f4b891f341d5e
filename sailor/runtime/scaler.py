"""Dynamic loss scaling for fp16 mixed precision (Micikevicius et al. 2018, "Mixed Precision Training",
§3.2; Megatron-LM's `DynamicGradScaler`; `torch.amp.GradScaler`).

fp16 keeps 5 exponent bits: gradients below 2^-24 flush to zero. The loss is multiplied by a scale S
before backward, so every gradient is S times larger and stays representable; the fp32 master
gradients are divided by S again before clipping and the update (`ShardedAdamW.clip(scale=S)`).
When any gradient element overflowed (inf or NaN anywhere in the world) the step is skipped: no
weight and no Adam moment changes, the optimizer's step count does not advance, and S is
multiplied by `backoff` (not below `min_scale`). After `growth_interval` consecutive clean steps S
is multiplied by `growth`. Defaults are Megatron-LM's (`--initial-loss-scale` 2^32,
`--loss-scale-window` 1000, `--min-loss-scale` 1; backoff 0.5 and growth 2 as in its
`DynamicGradScaler` and in torch.amp). Megatron's hysteresis (lower S only after that many
overflows; its default is 2) is not implemented: S is lowered at every overflow, as torch.amp does.

Every rank must take the same decision. The overflow check rides on the gradient-norm all-reduce
(SUM over the world of each rank's owned squares, `ShardedAdamW.clip`): one non-finite element
anywhere makes every rank's result non-finite, so all DP, TP and PP ranks see it at once and no
extra collective is needed. bf16 has fp32's exponent range and trains without a scaler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LossScaler:
    """The dynamic loss scale of one rank (identical on every rank: they see the same overflows)."""

    scale: float = 2.0 ** 32
    """S: the factor the loss is multiplied by before backward."""
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 1000
    """Consecutive clean steps after which S grows."""
    min_scale: float = 1.0
    clean_steps: int = 0
    """Clean steps since the last overflow or growth."""
    skipped: int = 0
    """Steps skipped so far (over the scaler's life)."""

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.growth > 1 and 0 < self.backoff < 1 and self.growth_interval >= 1
                and 0 < self.min_scale <= self.scale):
            raise ValueError(f"bad loss scaler settings: {self}")

    def update(self, overflow: bool) -> None:
        """After a step: `overflow` (the step was skipped) lowers S; the `growth_interval`-th clean
        step in a row raises it."""
        if overflow:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0


    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint keeps (the worker writes it into the manifest as "loss_scaler"), so a
        resumed run goes on at the scale it reached: `LossScaler(**state)` rebuilds it with the
        default settings."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}


def overflowed(grad_norm: float) -> bool:
    """True when the world's gradient norm (of scaled gradients, `ShardedAdamW.clip`) is inf or NaN:
    some rank holds a non-finite gradient element."""
    return not math.isfinite(grad_norm)
