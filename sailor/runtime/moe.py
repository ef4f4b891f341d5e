"""The runtime's mixture-of-experts MLP (`ModelSpec.moe`) and its load-balancing loss.

`MoEMLP` replaces a block's dense MLP where `ModelSpec.is_moe_block` says so. Its parameters have
canonical, plan-independent names: `mlp.router.weight` (E, h), `mlp.experts.<j>.{gate,up,down}.weight`
for expert j (its global id: `experts` is a ModuleDict keyed by id, so a rank may hold a subset of
them, as expert parallelism will), `mlp.shared.{gate,up,down}.weight` (the shared experts as one
SwiGLU) and `mlp.shared_gate.weight` (1, h).

Forward for N = B·T tokens (Hugging Face `MixtralSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`,
`Qwen3MoeSparseMoeBlock`, transformers 5): router logits x·Wᵣᵀ (N, E); softmax over the experts in
fp32; the top_k probabilities and their experts (`torch.topk`); renormalised to sum 1 when
`norm_topk_prob` (Mixtral always); each expert runs on the rows routed to it; its output times
the routing weight is added into the token's row; a shared expert's output is added, times
sigmoid(x·w_g) with a shared gate. Every held expert runs, on zero rows when no token chose it, so
every parameter gets a gradient (zeros) on every step.

Tensor parallelism (`MoEMLP.shard`, called by `tensor_parallel.apply_tp`): each expert's and the
shared experts' SwiGLU is split like a dense MLP (gate and up by output rows, down by input
columns); the router and the shared gate stay replicated. The experts read the input through
`enter` (identity forward, all-reduce of the input gradient backward) and their outputs — the
routed rows of every expert and the shared output, concatenated — are summed over the TP group
in one `leave` (all-reduce) before the routing weights and the shared gate apply, so those
weights, the router and its input gradient see whole expert outputs on every rank.

`load_balancing_loss` is Hugging Face's `load_balancing_loss_func` (Switch Transformer, Fedus et
al. 2022, eq. 4-6, as transformers computes it over the concatenated layers): for router logits of
L layers over the same N tokens, E · Σ_e F_e · P_e, with F_e the number of top-k choices of expert
e over the L·N rows divided by L·N (so Σ_e F_e = k) and P_e the mean router probability of e over
those rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from sailor.model.spec import ModelSpec

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}
"""MLP non-linearities by `ModelSpec.act` name (the dense MLP of `runtime.model` uses them too)."""


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)) without biases: one expert, (R, h) -> (R, h)."""

    def __init__(self, h: int, f: int, act: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))

    def shard(self, tp: int) -> None:
        """Replace the three linears by this rank's TP shard shapes (uninitialised, same device):
        gate and up f/tp output rows, down f/tp input columns."""
        h, f = self.gate.weight.shape[1], self.gate.weight.shape[0]
        device = self.gate.weight.device
        self.gate = nn.Linear(h, f // tp, bias=False, device=device)
        self.up = nn.Linear(h, f // tp, bias=False, device=device)
        self.down = nn.Linear(f // tp, h, bias=False, device=device)


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights and experts of each token: (N, E) logits -> (N, k) fp32 weights, (N, k) int64
    expert ids (softmax in fp32, top k, renormalised to sum 1 when `renormalise`)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, chosen


class MoEMLP(nn.Module):
    """A block's mixture-of-experts MLP (module docstring): (B, T, h) -> (B, T, h)."""

    def __init__(self, spec: ModelSpec, experts: list[int] | None = None) -> None:
        """`experts`: the global ids of the routed experts this module holds (default all)."""
        super().__init__()
        moe, h = spec.moe, spec.hidden_size
        assert moe is not None
        self.num_experts, self.top_k, self.renormalise = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.router = nn.Linear(h, moe.num_experts, bias=False)
        held = range(moe.num_experts) if experts is None else experts
        self.experts = nn.ModuleDict({str(j): SwiGLU(h, moe.expert_ffn_size, spec.act) for j in held})
        self.shared = SwiGLU(h, moe.shared_width, spec.act) if moe.shared_experts else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if moe.shared_gate else None
        self.enter: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.leave: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.record: list[torch.Tensor] | None = None  # `record_router_logits` collects the logits here

    def shard(self, tp: int, enter: Callable, leave: Callable) -> None:
        """Split every expert over `tp` ranks (module docstring); `enter` / `leave` are the TP
        group's copy-in (identity forward, all-reduce backward) and reduce-out (all-reduce forward)."""
        for expert in self.experts.values():
            expert.shard(tp)
        if self.shared is not None:
            self.shared.shard(tp)
        self.enter, self.leave = enter, leave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, h)
        logits = self.router(flat)  # (N, E)
        if self.record is not None:
            self.record.append(logits)
        weights, chosen = route(logits, self.top_k, self.renormalise)  # (N, k) fp32, (N, k) int64
        inp = self.enter(flat)
        tokens, slots, outs = [], [], []
        for eid, expert in self.experts.items():
            token, slot = torch.nonzero(chosen == int(eid), as_tuple=True)  # rows routed to this expert
            tokens.append(token)
            slots.append(slot)
            outs.append(expert(inp[token]))  # (R_e, h), partial over TP
        n_routed = sum(o.shape[0] for o in outs)
        if self.shared is not None:
            outs.append(self.shared(inp))
        combined = self.leave(torch.cat(outs))  # (R + N·[shared], h), summed over TP
        token, slot = torch.cat(tokens), torch.cat(slots)
        routed = combined[:n_routed] * weights[token, slot].unsqueeze(1)  # fp32 weights, as Mixtral
        out = torch.zeros_like(flat).index_add(0, token, routed.to(flat.dtype))
        if self.shared is not None:
            shared = combined[n_routed:]
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view(shape)


@contextmanager
def record_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, every `MoEMLP` of `model` appends its router logits (N, E) to the list this
    yields, in the order the layers run (transformers' `output_router_logits`)."""
    logits: list[torch.Tensor] = []
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    for m in layers:
        m.record = logits
    try:
        yield logits
    finally:
        for m in layers:
            m.record = None


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Hugging Face `load_balancing_loss_func` (no attention mask) of the router logits of every MoE
    layer over the same N tokens, each (N, E): E · Σ_e (c_e / R) · (p_e / R), with R = L·N rows,
    c_e the number of top-k choices of expert e over all layers and p_e the sum of e's softmax
    probabilities over all rows. () fp32; 0 without logits."""
    if not router_logits:
        return torch.zeros(())
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    rows = 0
    for logits in router_logits:
        probs = F.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        probs_sum = probs_sum + probs.sum(dim=0)
        rows += probs.shape[0]
    return num_experts * torch.sum((counts / rows) * (probs_sum / rows))
