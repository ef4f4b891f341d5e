"""The mixture-of-experts load-balancing loss (`moe.aux_loss_coef` > 0) of a distributed run.

What is minimised. Each micro-batch m (N = micro_batch_size · seq tokens) has its own loss
aux_m = `moe.load_balancing_loss` of its forward pass over all L MoE layers of the model (R = L·N
router rows), as the single-process reference computes it with the same micro-batches
(`reference.training_loss`); it enters the step's loss weighted by the micro-batch's share of the
global batch, coef · (N / tokens of the global batch) · aux_m, so that one micro-batch (the whole
batch) gives transformers' loss.

aux_m = (E / R²) · Σ_e c_e · p_e, where c_e counts the top-k choices of expert e over every layer and
token of m and p_e sums e's router probability over them. c_e has no gradient, and p_e is a sum of
per-layer terms, so given the micro-batch's c_e each stage's share of the gradient is that of
g · Σ_{its layers} p_{l,e}, with g_e = coef · N · S · E · c_e / R² (S: the per-token scale of the
step's loss, `run_pipeline`'s `loss_scale`). A stage therefore needs c_e before its backward of m,
and only its own layers' probabilities:

- forward: every MoE layer's router logits go through `Slot.tap`, which adds the layer's counts and
  probability sums (`moe.router_statistics`) to the micro-batch's running statistics (2E,) fp64
  (counts, then probability sums): those of the earlier virtual stages, received with the activation
  (`pipeline.P2P`'s side message on the same channel, right after it, so each channel keeps one
  order), plus this chunk's; they are sent on with the output;
- the last virtual stage has them all after its forward: it computes aux_m (its value goes into the
  reported loss) and g, which travels back with the input gradients (a side message (E,) fp64);
- backward: `_BalanceGradient`, the identity on the router logits in the forward, adds
  g · d(Σ_t softmax(z_t))/dz = p ⊙ (g − p·g) to their gradient in the backward.

TP: every TP rank routes the full token set with the replicated router, so all hold the same
statistics and add the same gradient to their replicated router path (as the loss's own). EP: each
rank routes its own tokens; counts stay per micro-batch. DP: each pipeline's micro-batches are their
own. Recomputation re-runs the forward inside the backward: the slot then adds no statistics.
"""

from __future__ import annotations

import torch
from torch import nn

from sailor.model.spec import ModelSpec
from sailor.runtime.messages import ACTIVATION, GRADIENT
from sailor.runtime.moe import MoEMLP, router_statistics


class _BalanceGradient(torch.autograd.Function):
    """Identity on router logits (N, E); backward adds p ⊙ (g − p·g) (p = softmax in fp32, g = the
    slot's (E,) gradient of the loss with respect to Σ_t p_t)."""

    @staticmethod
    def forward(ctx, logits, slot):
        ctx.save_for_backward(logits)
        ctx.slot = slot
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        g = ctx.slot.grad
        assert g is not None, "the load-balancing gradient of a micro-batch was not known before its backward"
        probs = torch.softmax(logits.float(), dim=-1)
        g = g.to(probs.dtype)
        extra = probs * (g - (probs * g).sum(dim=-1, keepdim=True))
        return grad + extra.to(grad.dtype), None


class Slot:
    """One micro-batch's load-balancing state on one chunk: `stats` (2E,) fp64, the counts and
    probability sums of the virtual stages up to this chunk (module docstring); `grad` (E,) fp64,
    d loss / d p_e, known before its backward."""

    def __init__(self, stats: torch.Tensor, top_k: int) -> None:
        self.stats, self.top_k = stats, top_k
        self.collecting, self.grad = True, None

    def tap(self, logits: torch.Tensor) -> torch.Tensor:
        """A layer's router logits (N, E) in: its statistics added (in the forward), the logits out
        through `_BalanceGradient`."""
        if self.collecting:
            with torch.no_grad():
                counts, probs = router_statistics(logits, self.top_k)
                e = counts.numel()
                self.stats[:e] += counts
                self.stats[e:] += probs
        return _BalanceGradient.apply(logits, self)


class LoadBalancing:
    """The load-balancing loss of one rank's chunks (module docstring): `begin_forward` /
    `end_forward` around a forward op, `finish` inside the last virtual stage's loss,
    `begin_backward` / `end_backward` around a backward op.

    Args:
        stage: the rank's stage module (its `MoEMLP`s get the tap).
        spec: the model (E, top_k, coef and L, its number of MoE layers).
        tokens: N, the tokens of one micro-batch.
        device: where the statistics live (that of the transfers).
    """

    def __init__(self, stage: nn.Module, spec: ModelSpec, tokens: int, device: torch.device) -> None:
        moe = spec.moe
        assert moe is not None
        self.num_experts, self.top_k, self.coef = moe.num_experts, moe.top_k, moe.aux_loss_coef
        self.rows = tokens * sum(spec.is_moe_block(i) for i in range(spec.num_layers))  # R = L·N
        self.tokens, self.device = tokens, device
        self.slots: dict[tuple[int, int], Slot] = {}  # (chunk, micro-batch) -> its state
        self.current: Slot | None = None
        for m in stage.modules():
            if isinstance(m, MoEMLP):
                m.balance = self._tap

    @property
    def side_sizes(self) -> dict[str, int]:
        """Elements (fp64) of the side message of each transfer kind: (counts, probability sums)
        forward, g backward."""
        return {ACTIVATION: 2 * self.num_experts, GRADIENT: self.num_experts}

    def _tap(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.current is None else self.current.tap(logits)

    def begin_forward(self, chunk: int, k: int, received: torch.Tensor | None) -> None:
        """Micro-batch `k`'s forward of `chunk` starts, from the statistics `received` with its input
        (None: the first virtual stage)."""
        stats = torch.zeros(2 * self.num_experts, dtype=torch.float64, device=self.device) if received is None \
            else received.clone()
        self.current = self.slots[(chunk, k)] = Slot(stats, self.top_k)

    def end_forward(self, chunk: int, k: int) -> torch.Tensor:
        """The statistics to send on with the output (2E,) fp64."""
        slot = self.slots[(chunk, k)]
        slot.collecting, self.current = False, None
        return slot.stats

    def finish(self, chunk: int, k: int, loss_scale: float) -> torch.Tensor:
        """On the last virtual stage, once all of micro-batch `k`'s MoE layers ran: its slot's gradient
        g (module docstring), and coef · N · aux_k, this micro-batch's share of the step's loss sum
        (() fp64, no gradient)."""
        slot, e = self.slots[(chunk, k)], self.num_experts
        counts, probs = slot.stats[:e], slot.stats[e:]
        scale = self.coef * self.tokens * e / self.rows ** 2
        slot.grad = counts * (scale * loss_scale)
        return scale * torch.dot(counts, probs)

    def begin_backward(self, chunk: int, k: int, received: torch.Tensor | None) -> None:
        """Micro-batch `k`'s backward of `chunk` starts, with g `received` with the output gradient
        (None: the last virtual stage, whose `finish` set it)."""
        slot = self.current = self.slots[(chunk, k)]
        if received is not None:
            slot.grad = received.clone()

    def end_backward(self, chunk: int, k: int) -> torch.Tensor:
        """g to send back with the input gradient (E,) fp64; the slot is done."""
        self.current = None
        return self.slots.pop((chunk, k)).grad


def load_balancing(stage: nn.Module, spec: ModelSpec, tokens: int, device: torch.device) -> LoadBalancing | None:
    """The `LoadBalancing` of a rank's stage, or None when the model has no load-balancing loss (dense,
    or `moe.aux_loss_coef` 0)."""
    if spec.moe is None or spec.moe.aux_loss_coef <= 0:
        return None
    return LoadBalancing(stage, spec, tokens, device)
