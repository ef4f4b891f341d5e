"""The runtime's mixture-of-experts MLP (`ModelSpec.moe`) and its load-balancing loss.

`MoEMLP` replaces a block's dense MLP where `ModelSpec.is_moe_block` says so. Its parameters have
canonical, plan-independent names: `mlp.router.weight` (E, h), `mlp.experts.<j>.{gate,up,down}.weight`
for expert j (its global id: `experts` is a ModuleDict keyed by id, so a rank holds a subset of
them under expert parallelism), `mlp.shared.{gate,up,down}.weight` (the shared experts as one
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

Expert parallelism (`apply_ep`, `plan.experts`): a rank keeps only its EP rank's experts and
`ExpertParallel.run` replaces the local loop: the routed copies, sorted by their expert's place,
go to the EP ranks holding their experts in one all-to-all (`_AllToAll`, torch.distributed
`all_to_all_single` with uneven splits, which gloo and NCCL both run; an all-to-all of the per-expert
counts first), each held expert runs on every row it received, and the outputs come back in a second
all-to-all, whose backward (and the first's) is the reverse all-to-all of the gradients. Under TP the
all-to-all pairs equal TP ranks, so what comes back is still partial over TP and the one `leave`
follows as without EP. The experts' gradients then hold every EP group member's tokens; gradient
sync sums them over the expert's holders (`topology.RankRole.sync_groups`).

`load_balancing_loss` is Hugging Face's `load_balancing_loss_func` (Switch Transformer, Fedus et
al. 2022, eq. 4-6, as transformers computes it over the concatenated layers): for router logits of
L layers over the same N tokens, E · Σ_e F_e · P_e, with F_e the number of top-k choices of expert
e over the L·N rows divided by L·N (so Σ_e F_e = k) and P_e the mean router probability of e over
those rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sailor.model.spec import ModelSpec
from sailor.runtime.topology import RankRole

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
        self.ep: ExpertParallel | None = None  # the all-to-all under expert parallelism (`apply_ep`)
        # the load-balancing loss of a distributed run (`runtime.balance.LoadBalancing`): sees the
        # router logits (N, E) and returns them, adding the loss's gradient in the backward
        self.balance: Callable[[torch.Tensor], torch.Tensor] | None = None

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
        if self.balance is not None:
            logits = self.balance(logits)
        weights, chosen = route(logits, self.top_k, self.renormalise)  # (N, k) fp32, (N, k) int64
        inp = self.enter(flat)
        run = self._run_local if self.ep is None else self.ep.run
        routed, token, slot = run(inp, chosen, self.experts)  # (R, h) partial over TP, (R,), (R,)
        n_routed = routed.shape[0]
        outs = [routed] + ([self.shared(inp)] if self.shared is not None else [])
        combined = self.leave(torch.cat(outs))  # (R + N·[shared], h), summed over TP
        routed = combined[:n_routed] * weights[token, slot].unsqueeze(1)  # fp32 weights, as Mixtral
        out = torch.zeros_like(flat).index_add(0, token, routed.to(flat.dtype))
        if self.shared is not None:
            shared = combined[n_routed:]
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view(shape)

    @staticmethod
    def _run_local(inp: torch.Tensor, chosen: torch.Tensor,
                   experts: nn.ModuleDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every routed copy through its expert, all experts held here: (N, h), (N, k) expert ids ->
        outputs (R, h) of the R = N·k routed copies, expert by expert, and their tokens and slots (R,)."""
        tokens, slots, outs = [], [], []
        for eid, expert in experts.items():
            token, slot = torch.nonzero(chosen == int(eid), as_tuple=True)  # rows routed to this expert
            tokens.append(token)
            slots.append(slot)
            outs.append(expert(inp[token]))  # (R_e, h), partial over TP
        return torch.cat(outs), torch.cat(tokens), torch.cat(slots)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows: rank r sends rows [Σ send[:d], Σ send[:d+1]) of `x` to rank d of
    `group` and receives recv[s] rows from each rank s, in rank order; backward sends the gradient
    back the same way reversed (recv and send swapped)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


class ExpertParallel:
    """The all-to-all dispatch and combine of one MoE MLP under expert parallelism (`plan.experts`):
    `placement[q]` are the experts (global ids, sorted) EP rank q of `group` holds; this rank is EP
    rank `ep_rank`."""

    def __init__(self, placement: Sequence[Sequence[int]], ep_rank: int, group) -> None:
        self.placement, self.ep_rank, self.group = [list(ids) for ids in placement], ep_rank, group
        order = [e for ids in self.placement for e in ids]  # experts by (EP rank, id)
        self.position = torch.empty(len(order), dtype=torch.int64)  # expert id -> its place in `order`
        self.position[torch.tensor(order)] = torch.arange(len(order))

    def run(self, inp: torch.Tensor, chosen: torch.Tensor,
            experts: nn.ModuleDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`MoEMLP._run_local` with the experts spread over the EP group: (N, h) input (this TP rank's
        copy), (N, k) expert ids -> the outputs (R, h) of this rank's R = N·k routed copies (partial
        over TP), and their tokens and slots (R,).

        The copies are sorted by their expert's place (EP rank, then id); each EP rank first learns
        how many rows of each of its experts every rank sends (an all-to-all of counts), then the rows
        go out (dispatch), each held expert runs on all rows for it, and the outputs return the same
        way (combine), to the sending rank in its sorted order."""
        k, ep, mine = chosen.shape[1], len(self.placement), self.placement[self.ep_rank]
        place = self.position.to(chosen.device)[chosen.reshape(-1)]  # (N·k,)
        sorted_at = torch.argsort(place, stable=True)  # copy a = token·k + slot
        token, slot = sorted_at // k, sorted_at % k
        counts = torch.bincount(place, minlength=self.position.numel())  # (E,) copies per expert, by place
        widths = [len(ids) for ids in self.placement]
        got = counts.new_empty(ep * len(mine))  # (ep·len(mine),): rows per (source, expert of mine)
        dist.all_to_all_single(got, counts, output_split_sizes=[len(mine)] * ep, input_split_sizes=widths,
                               group=self.group)
        per_place, per_source = counts.tolist(), got.view(ep, len(mine)).tolist()  # the host's copies, once
        bounds = list(accumulate(widths, initial=0))  # EP rank q's experts are places [bounds[q], bounds[q+1])
        send = [sum(per_place[a:b]) for a, b in zip(bounds, bounds[1:])]
        recv = [sum(row) for row in per_source]
        sizes = [sum(col) for col in zip(*per_source)]  # rows per expert of mine
        rows = _AllToAll.apply(inp[token], send, recv, self.group)  # (R', h): by source, then expert
        expert_of_row = torch.arange(len(mine), device=rows.device).repeat(ep).repeat_interleave(
            got, output_size=sum(recv))  # (R',) which of my experts each arriving row is for
        by_expert = torch.argsort(expert_of_row, stable=True)
        outs = [experts[str(e)](x) for e, x in zip(mine, rows[by_expert].split(sizes))]
        out = torch.empty_like(rows).index_copy(0, by_expert, torch.cat(outs))  # back to arrival order
        return _AllToAll.apply(out, recv, send, self.group), token, slot


def apply_ep(stage: nn.Module, role: RankRole, num_experts: int, group) -> None:
    """Expert parallelism on `stage` (a GPT stage before TP, on any device) for `role`'s rank: every
    MoE MLP keeps only the experts of the rank's EP rank (`StageExperts.held`) and dispatches over
    `group` (the role's `ep_group`; None will do for shapes only). Nothing changes with EP 1."""
    ex = role.experts
    if ex.ep == 1:
        return
    placement = [ex.held(q, num_experts) for q in range(ex.ep)]
    held = {str(e) for e in placement[role.ep_rank]}
    for m in stage.modules():
        if isinstance(m, MoEMLP):
            for eid in [e for e in m.experts if e not in held]:
                del m.experts[eid]
            m.ep = ExpertParallel(placement, role.ep_rank, group)


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


def router_statistics(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer's share of the load-balancing loss, from its router logits (N, E): the number of
    top-k choices of each expert (E,) fp32 (no gradient) and the sum of each expert's softmax
    probability over the N rows (E,) fp32 (differentiable)."""
    probs = F.softmax(logits.float(), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=logits.shape[-1]).float(), probs.sum(dim=0)


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Hugging Face `load_balancing_loss_func` (no attention mask) of the router logits of every MoE
    layer over the same N tokens, each (N, E): E · Σ_e (c_e / R) · (p_e / R), with R = L·N rows,
    c_e the number of top-k choices of expert e over all layers and p_e the sum of e's softmax
    probabilities over all rows (`router_statistics` per layer). () fp32; 0 without logits.

    Only p_e carries a gradient, and it is a sum over layers, so d/dθ = (E / R²) Σ_e c_e · dp_e/dθ: a
    pipeline stage gets its layers' exact share once it knows the c_e of the whole forward pass
    (`runtime.balance`)."""
    if not router_logits:
        return torch.zeros(())
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    rows = 0
    for logits in router_logits:
        c, p = router_statistics(logits, top_k)
        counts, probs_sum = counts + c, probs_sum + p
        rows += logits.shape[0]
    return num_experts * torch.sum((counts / rows) * (probs_sum / rows))
