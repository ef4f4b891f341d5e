"""Expert parallelism (EP > 1, `plan.experts`) in the simulator: what it changes in a replica's
time per micro-batch, its memory and its stage's gradient sync. How EP ranks are carved out of a
stage's data-parallel replicas, and what the runtime runs, are in `sailor.plan.experts` and
`sailor.runtime.moe`.

Per MoE block and micro-batch of N = b·s tokens, on EP rank q of an EP group of `ep` replicas that
holds n_q of the E routed experts (R = k·c·N routed copies of its own tokens, `roofline.routed_rows`):

- Routed rows. Under uniform routing each expert gets k·N/E rows from each of the ep ranks, so the
  experts of rank q receive ρ_q·R rows, ρ_q = f · ep · n_q / E (1 for the even split with f = 1).
  f is the load-balance assumption (`StageExperts.imbalance`): the rows the busiest rank receives
  over its uniform share, charged to every rank (any rank can be the busiest in a step: its time
  is the slowest rank's anyway, its memory must hold that many rows). Its default, 1, is the balanced load: Megatron-Bridge's published MoE
  benchmarks force-balance the token distribution among experts (NVIDIA-NeMo/Megatron-Bridge,
  docs/performance-summary.md, the note under each container's tables: "we force-balance the token
  distribution among experts and all benchmarks are token-dropless"), and Megatron-Core reports
  that a dropless MoE's imbalance is severe only in the first few hundred iterations
  (NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md, its Mixtral training example).
  A plan sets f > 1 for a router whose load it knows (e.g. measured max/mean token counts).
- Expert compute (`expert_block_s`). Rank q runs its experts' GEMMs over ρ_q·R rows reading n_q
  experts' weights, plus the runtime's sort of the arrived rows by expert and the copy of the
  outputs back to arrival order, and accumulates the weight gradients of its n_q experts alone
  into its gradient buffer (`roofline.expert_ops`). The all-to-alls make every member wait
  for the slowest EP rank of its group, so each member is charged max_q T_experts(q) in place of
  the EP-1 experts' work its layer times hold (the difference is taken from the roofline, also
  on measured layer times). The router, the shared experts and the attention stay per replica:
  each rank routes its own N tokens, as at EP 1, so the layer times keep them unchanged.
- All-to-all (`all_to_all_s`): the dispatch and the combine in the forward, their reverses in the
  backward (two each way), each `collectives.all_to_all_time_s` of b = R·h·e bytes per TP rank
  (every TP rank holds the whole token set and runs its own all-to-all, `runtime.moe`;
  Megatron-LM's dispatcher, with sequence parallelism, splits the tokens over the TP ranks: b/t),
  member q receiving the share n_q/E of them: (1 - n_j/E)·b leave rank j, (ep - 1)/ep·b under the
  even split, over the links the EP group spans (NVLink inside a node, the node's links otherwise).
- Full recomputation re-runs the forward's expert work and its two all-to-alls in the backward.

Gradient sync (`simulate`): the dense parameters (all but the routed experts, `context.ParamShare`)
over the stage's D replicas as without EP; each EP rank's experts over its expert DP group, EP rank
q of every EP group (D/ep members), the ep groups at once (the slowest counts).

Memory (`memory.replica_memory`): the dense parameters and n_q experts' weights, gradients and
optimizer states (ZeRO shards the experts over their D/ep holders, and ZeRO-3 gathers them among
those holders, `terms.layer_gather_s`); the experts' kept activations for ρ_q·R rows in place of
R (`expert_activation_bytes`); the token buffers of one MoE block at a time (`token_buffer_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sailor.model.activations import expert_row_bytes
from sailor.model.spec import Framework, Recompute
from sailor.perf.roofline import expert_ops, ops_time_s, routed_rows
from sailor.plan.experts import StageExperts
from sailor.simulator.collectives import Member, all_to_all_crossings, all_to_all_time_s
from sailor.simulator.context import ParamShare, SimContext
from sailor.simulator.traffic import Crossing


@dataclass(frozen=True)
class EPRank:
    """Expert parallelism as one replica of a stage with EP > 1 sees it (module docstring).

    Attributes:
        ep: EP degree of the stage.
        held: experts this replica's EP rank holds (n_q).
        num_experts: the model's routed experts E.
        imbalance: f, the busiest rank's routed rows over its uniform share.
        group: (GPU type, TP, experts held) of each EP rank of its EP group, in EP-rank order.
        all_to_all_s: seconds of one all-to-all (a dispatch or a combine) of one MoE block and
            micro-batch among the group (`collectives.all_to_all_time_s`).
        expert_replicas: D / ep, the replicas holding each of its experts (its expert DP group).
    """

    ep: int
    held: int
    num_experts: int
    imbalance: float
    group: tuple[tuple[str, int, int], ...]
    all_to_all_s: float
    expert_replicas: int

    def rows(self, held: int) -> float:
        """ρ: routed rows an EP rank holding `held` experts receives over its own R."""
        return self.imbalance * self.ep * held / self.num_experts

    @property
    def share(self) -> ParamShare:
        """The stage's parameters this replica holds: the dense ones and n_q / E of the experts."""
        return ParamShare(dense=True, experts=self.held / self.num_experts)

    @property
    def experts_share(self) -> ParamShare:
        """Its experts alone (what its expert DP group syncs)."""
        return ParamShare(dense=False, experts=self.held / self.num_experts)


DENSE_ONLY = ParamShare(dense=True, experts=0.0)
"""The parameters every replica of a stage holds under EP (synced over all D replicas)."""


def dispatch_bytes(ctx: SimContext, tp: int, mbs: int) -> float:
    """Bytes b one TP rank's all-to-all of one MoE block moves out of a micro-batch's routed rows
    before they are split among the EP ranks: R·h·e (Megatron-LM: R·h·e / t; module docstring)."""
    job = ctx.job
    b = routed_rows(job.model, mbs=mbs, seq=job.seq) * job.model.hidden_size * job.elem_bytes
    return b / tp if job.framework is Framework.MEGATRON else b


def _experts_s(ctx: SimContext, gpu: str, tp: int, mbs: int, held: int, rows: float, ep: bool) -> tuple[float, float]:
    """(forward, backward) roofline seconds of one MoE block's routed experts on one GPU
    (`roofline.expert_ops`); memoised in the context."""
    key = ("experts_s", gpu, tp, mbs, held, rows, ep)
    if key not in ctx.memo:
        job = ctx.job
        fwd, bwd = expert_ops(job.model, tp=tp, mbs=mbs, seq=job.seq, e=job.elem_bytes, experts=held, rows=rows, ep=ep,
                              grad_bytes=job.state_bytes_per_param["gradients"])
        ctx.memo[key] = (ops_time_s(fwd, gpu, job.precision), ops_time_s(bwd, gpu, job.precision))
    return ctx.memo[key]


def expert_block_s(ctx: SimContext, gpu: str, tp: int, mbs: int, x: EPRank) -> tuple[float, float]:
    """(forward, backward) seconds one MoE block of one micro-batch adds on a replica (GPU `gpu`,
    TP `tp`) under expert parallelism `x`, beyond its layer times: the slowest EP rank's experts
    in place of the EP-1 experts' work, plus two all-to-alls each way (module docstring)."""
    busiest = [_experts_s(ctx, g, t, mbs, n, x.rows(n), True) for g, t, n in x.group]
    base = _experts_s(ctx, gpu, tp, mbs, x.num_experts, 1.0, False)
    return (max(f for f, _ in busiest) - base[0] + 2 * x.all_to_all_s,
            max(b for _, b in busiest) - base[1] + 2 * x.all_to_all_s)


def moe_blocks(ctx: SimContext, a: int, e: int) -> int:
    """MoE blocks among layers [a, e)."""
    return sum(ctx.job.model.is_moe_block(i) for i in range(a, e))


def ep_time_s(ctx: SimContext, gpu: str, tp: int, mbs: int, a: int, e: int, x: EPRank,
              recompute: Recompute, recomputed: tuple[int, int]) -> tuple[float, float, float]:
    """(forward, backward, all-to-all) seconds expert parallelism adds to one micro-batch of a
    replica holding layers [a, e): `expert_block_s` per MoE block, and under full recomputation
    the forward's part again in the backward of each recomputed MoE block (`recomputed` = (first
    layer, count) of the recomputed blocks, `terms.recomputed_blocks`); the third value is the
    all-to-all seconds among them (forward and backward, recomputation included)."""
    n = moe_blocks(ctx, a, e)
    if n == 0:
        return 0.0, 0.0, 0.0
    f, b = expert_block_s(ctx, gpu, tp, mbs, x)
    again = _recomputed_moe(ctx, recompute, recomputed)
    return n * f, n * b + again * f, all_to_all_runs(ctx, a, e, recompute, recomputed) * x.all_to_all_s


def _recomputed_moe(ctx: SimContext, recompute: Recompute, recomputed: tuple[int, int]) -> int:
    """MoE blocks among the recomputed blocks (first layer, count) whose forward is re-run in full."""
    return moe_blocks(ctx, recomputed[0], recomputed[0] + recomputed[1]) if recompute is Recompute.FULL else 0


def all_to_all_runs(ctx: SimContext, a: int, e: int, recompute: Recompute, recomputed: tuple[int, int]) -> int:
    """All-to-alls one micro-batch runs on layers [a, e) (arguments as `ep_time_s`): four per MoE
    block, two more per MoE block whose forward full recomputation re-runs."""
    return 4 * moe_blocks(ctx, a, e) + 2 * _recomputed_moe(ctx, recompute, recomputed)


def expert_activation_bytes(ctx: SimContext, tp: int, mbs: int, a: int, e: int, x: EPRank,
                            recompute: Recompute, recomputed: tuple[int, int]) -> tuple[float, float]:
    """(kept per micro-batch, recomputation transient) bytes the MoE blocks in [a, e) hold under
    EP beyond the EP-1 activations: the experts' inputs and SwiGLU intermediates
    (`activations.expert_row_bytes`) for ρ_q·R arrived rows in place of R own rows (negative when
    the rank receives fewer). A block full recomputation re-runs (arguments as `ep_time_s`) keeps
    none of them and rebuilds them during its backward, one block at a time (the transient)."""
    job = ctx.job
    R = routed_rows(job.model, mbs=mbs, seq=job.seq)
    block = (x.rows(x.held) - 1.0) * R * expert_row_bytes(job.model, tp=tp, e=job.elem_bytes)
    again = _recomputed_moe(ctx, recompute, recomputed)
    return (moe_blocks(ctx, a, e) - again) * block, block if again else 0.0


def token_buffer_bytes(ctx: SimContext, tp: int, mbs: int, x: EPRank) -> float:
    """Bytes of the dispatch and combine buffers of one MoE block (one at a time): the dispatched
    copies of its R own rows and the ρ_q·R arrived rows, h·e bytes each."""
    job = ctx.job
    R = routed_rows(job.model, mbs=mbs, seq=job.seq)
    return (1.0 + x.rows(x.held)) * R * job.model.hidden_size * job.elem_bytes


def stage_ep_ranks(ctx: SimContext, ex: StageExperts, members: Sequence[Member], mbs: int) -> list[EPRank]:
    """The `EPRank` of each replica of one stage with expert parallelism `ex` (ep > 1), whose D
    replicas sit at `members` (placed slots, in pipeline order): EP group g is pipelines
    [g·ep, (g+1)·ep), pipeline j its EP rank j % ep (`plan.experts`); one all-to-all time per group
    (`collectives.all_to_all_time_s` of `dispatch_bytes` at the group's TP, shares n_q / E)."""
    E, D = ctx.job.model.moe.num_experts, len(members)
    held = [len(ex.held(q, E)) for q in range(ex.ep)]
    shares = [n / E for n in held]
    out = []
    for group in ex.ep_groups(D):
        slots = [members[j] for j in group]
        a2a = all_to_all_time_s(ctx.network, slots, dispatch_bytes(ctx, slots[0].tp, mbs), shares)
        info = tuple((sl.gpu, sl.tp, n) for sl, n in zip(slots, held))
        out += [EPRank(ep=ex.ep, held=held[q], num_experts=E, imbalance=ex.imbalance, group=info, all_to_all_s=a2a,
                       expert_replicas=D // ex.ep) for q in range(ex.ep)]
    return out


def stage_ep_crossings(ctx: SimContext, ex: StageExperts, members: Sequence[Member], mbs: int,
                       microbatches: Sequence[int], runs: int) -> list[tuple[Crossing, int]]:
    """(crossing, times per iteration) of the bytes between zones of every EP group of one stage
    (`stage_ep_ranks`' arguments; `collectives.all_to_all_crossings` of one all-to-all), each run
    `runs` times per micro-batch (`all_to_all_runs`) and `microbatches[j]` micro-batches (one count
    per EP group, `plan.experts.check_plan_experts`)."""
    E = ctx.job.model.moe.num_experts
    shares = [len(ex.held(q, E)) / E for q in range(ex.ep)]
    out = []
    for group in ex.ep_groups(len(members)):
        slots = [members[j] for j in group]
        out += [(c, runs * microbatches[group[0]])
                for c in all_to_all_crossings(ctx.network, slots, dispatch_bytes(ctx, slots[0].tp, mbs), shares)]
    return out
