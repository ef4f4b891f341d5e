"""The simulator's time terms: per micro-batch compute and transfers of a replica, gradient sync of a
stage, optimizer step; shared with the planner so that both score plans the same way.

A stage's memory options (`plan.spec.StageMemory`) change its time in these ways, all derived in ONE
place, `time_options`:
- recomputation: the backward pass re-runs forward work (`recompute_s`): the whole forward of each
  recomputed block (full), or its attention core (selective, the core's share of the block's
  forward time from the analytic model, `Profiles.attention_core_share`);
- tensor-parallel collectives (`tp_comm_s`, `model.spec.ModelSpec.tp_collectives`) on the intra-node
  link: charged in full where the layer times are a roofline estimate; where they were measured
  with real TP processes they already hold the TP collectives, so only what sequence parallelism
  adds is charged (its backward re-gathers of the column-parallel inputs; an all-reduce and its
  reduce-scatter + all-gather take the same ring time);
- ZeRO (Rajbhandari et al. 2020) over the stage's D data-parallel replicas: the optimizer steps over
  1/D of the parameters (ZeRO >= 1); the gradient all-reduce becomes a reduce-scatter of the
  gradients plus an all-gather of the updated weights (ZeRO-1/2, Megatron-LM's distributed
  optimizer) or a reduce-scatter alone (ZeRO-3), the reduce-scatter run once per micro-batch under
  ZeRO-2/3 (`TimeOptions.sync`, counted by `sync.stage_sync`); under ZeRO-3 each layer's weights are
  all-gathered across D replicas like this one packed on nodes as the launcher packs them
  (`gather_group`), one layer ahead of the compute (the runtime's
  prefetch, `runtime.zero`), so only what a layer's gather takes beyond the previous layer's
  compute shows (`exposed_gathers`): before every forward and backward pass of every micro-batch
  (`zero_gather_s`, `reshard_after_forward` true), or once per iteration, on the first forward
  (`kept_gather_s`, false), which delays the pipeline's fill.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sailor.catalog import LinkClass
from sailor.model.geometry import LayerKind
from sailor.model.spec import Collective, Framework, Recompute
from sailor.plan.placement import BlockFit, node_blocks
from sailor.plan.spec import DEFAULT_STAGE_MEMORY, Plan, StageMemory
from sailor.simulator.collectives import AllreduceRings, Group, Member, same_node, tp_collective_time_s
from sailor.simulator.context import ALL_PARAMS, SimContext, stage_blocks
from sailor.simulator.experts import DENSE_ONLY, EPRank, ep_time_s
from sailor.simulator.schedules import ONE_F_ONE_B, PipelineSchedule, PipelineTimes
from sailor.simulator.traffic import Crossing
from sailor.specs.cluster import ClusterSpec

Slot = Member  # where one replica runs: zone, GPU type, TP degree, and (once placed) its node

SHAPE_MEMO_MAX = 512  # shapes of groups each `shape_memo` keeps
# Share of a ring all-reduce's time (and of its bytes crossing zones) that each collective takes.
RING_SHARE = {Collective.ALL_REDUCE: 1.0, Collective.REDUCE_SCATTER: 0.5, Collective.ALL_GATHER: 0.5}


@dataclass(frozen=True)
class TimeOptions:
    """What a stage's memory options change in its time, for a stage of `replicas` data-parallel
    replicas (built by `time_options`; `replicas` is 1 when nothing depends on it)."""

    recompute: Recompute = Recompute.NONE
    recompute_blocks: int | None = None
    sequence_parallel: bool = False
    zero: int = 0
    replicas: int = 1
    reshard: bool = True  # ZeRO-3: gathered weights freed after every pass (`StageMemory.reshard_after_forward`)
    experts: EPRank | None = None  # expert parallelism of this replica (`simulator.experts`); None: EP 1

    @property
    def optimizer_shards(self) -> int:
        """Parts the optimizer step is split into (ZeRO >= 1: one per replica)."""
        return self.replicas if self.zero >= 1 else 1

    @property
    def expert_shards(self) -> int:
        """Parts the optimizer step over this replica's experts is split into under EP (ZeRO >= 1:
        one per replica of its expert DP group)."""
        return self.experts.expert_replicas if self.experts is not None and self.zero >= 1 else 1

    @property
    def gathers_weights(self) -> bool:
        """ZeRO-3 with more than one replica: weights are all-gathered for every micro-batch."""
        return self.zero >= 3 and self.replicas > 1

    def sync(self) -> tuple[tuple[Collective, str, bool], ...]:
        """Collectives of the gradient sync, as (collective, which state's bytes, once per micro-batch):
        ZeRO-2/3 reduce-scatter the gradients after every micro-batch's backward (a rank keeps only
        its shard of the gradient, so it cannot sum the micro-batches' full gradients first:
        `runtime.zero`, Rajbhandari et al. 2020 §5.2), every other collective runs once per
        iteration."""
        if self.zero == 0:
            return ((Collective.ALL_REDUCE, "gradients", False),)
        if self.zero == 3:
            return ((Collective.REDUCE_SCATTER, "gradients", True),)
        return ((Collective.REDUCE_SCATTER, "gradients", self.zero == 2), (Collective.ALL_GATHER, "weights", False))


DEFAULT_TIME = TimeOptions()


def stage_memory(plan: Plan, stage: int) -> tuple[StageMemory, tuple[StageMemory, ...]]:
    """The simulator's one reader of `Plan.memory`: stage `stage`'s memory options, and the same
    split over its chunks (`Plan.chunk_memory`: `recompute_blocks` counted over the stage's blocks in
    layer order; one chunk unless interleaved). Time (`time_options`), memory (`memory.replica_memory`)
    and traffic take them from here."""
    return plan.stage_memory(stage), plan.chunk_memory(stage)


def time_options(mem: StageMemory = DEFAULT_STAGE_MEMORY, replicas: int = 1) -> TimeOptions:
    """The one place the simulator turns a stage's memory options (from `stage_memory`) into what
    changes its time (see the module docstring); `replicas` = the stage's data-parallel replicas D (the plan's number of pipelines)."""
    return TimeOptions(recompute=mem.recompute, recompute_blocks=mem.recompute_blocks,
                       sequence_parallel=mem.sequence_parallel, zero=mem.zero,
                       replicas=replicas if mem.zero else 1, reshard=mem.reshard_after_forward)


def recomputed_blocks(ctx: SimContext, a: int, e: int, recompute: Recompute, recompute_blocks: int | None) -> tuple[int, int]:
    """(first layer, count) of the blocks of stage [a, e) that are recomputed: the first
    `recompute_blocks` (all when None) under full recomputation, all of them under selective."""
    first, n = stage_blocks(ctx.job.model, a, e)
    if recompute is Recompute.NONE:
        return first, 0
    if recompute is Recompute.FULL and recompute_blocks is not None:
        n = min(n, recompute_blocks)
    return first, n


@dataclass(frozen=True)
class StageTime:
    """One replica's seconds per micro-batch: forward_s and backward_s (totals, every term below
    included) and the parts the memory options, TP and EP add: recompute_s (in the backward),
    tp_comm_s (forward + backward TP collectives charged here), gather_s (ZeRO-3 weight all-gathers,
    forward + backward), all_to_all_s (EP dispatch and combine, forward + backward)."""

    forward_s: float
    backward_s: float
    recompute_s: float = 0.0
    tp_comm_s: float = 0.0
    gather_s: float = 0.0
    all_to_all_s: float = 0.0


def stage_time(ctx: SimContext, slot: Slot, mbs: int, a: int, e: int, opts: TimeOptions = DEFAULT_TIME) -> StageTime:
    """Per-micro-batch forward and backward seconds of one replica holding layers [a, e): the layer
    times (`SimContext.stage_compute_s`) plus recomputation, TP collectives, ZeRO-3 gathers and
    expert parallelism (`experts.ep_time_s`: the experts' work on the EP rank and the all-to-alls)."""
    if opts is DEFAULT_TIME and ctx.tp_comm_included(slot.gpu, slot.tp):
        f, b = ctx.stage_compute_s(slot.gpu, slot.tp, mbs, a, e)  # nothing to add: the common case
        return StageTime(forward_s=f, backward_s=b)
    key = ("stage_time", slot.zone, slot.gpu, slot.tp, mbs, a, e, opts)  # not the node: nothing here reads it
    if key not in ctx.memo:
        f, b = ctx.stage_compute_s(slot.gpu, slot.tp, mbs, a, e)
        rec = recompute_s(ctx, slot, mbs, a, e, opts)
        cf, cb = tp_comm_s(ctx, slot, mbs, a, e, opts)
        gf, gb = zero_gather_s(ctx, slot, mbs, a, e, opts)
        ef, eb, a2a = 0.0, 0.0, 0.0
        if opts.experts is not None:
            rec_blocks = recomputed_blocks(ctx, a, e, opts.recompute, opts.recompute_blocks)
            ef, eb, a2a = ep_time_s(ctx, slot.gpu, slot.tp, mbs, a, e, opts.experts, opts.recompute, rec_blocks)
        ctx.memo[key] = StageTime(forward_s=f + cf + gf + ef, backward_s=b + rec + cb + gb + eb, recompute_s=rec,
                                  tp_comm_s=cf + cb, gather_s=gf + gb, all_to_all_s=a2a)
    return ctx.memo[key]


def recompute_s(ctx: SimContext, slot: Slot, mbs: int, a: int, e: int, opts: TimeOptions) -> float:
    """Seconds the backward of one micro-batch spends re-running forward work: the forward time of
    each recomputed block (full) or the attention core's share of it (selective)."""
    first, n = recomputed_blocks(ctx, a, e, opts.recompute, opts.recompute_blocks)
    if n == 0:
        return 0.0
    c = ctx.layer_cumsum(slot.gpu, slot.tp, mbs)
    forward = float(c[first + n, 0] - c[first, 0])
    if opts.recompute is Recompute.FULL:
        return forward
    return forward * ctx.profiles.attention_core_share(ctx.job, slot.gpu, slot.tp, mbs)


def _tp_comm_cumsum(ctx: SimContext, slot: Slot, mbs: int, recompute: Recompute, sp: bool) -> np.ndarray:
    """Cumulative (forward, backward) seconds of every layer's TP collectives: (num_layers + 1, 2)."""
    key = ("tp_comm", slot.zone, slot.gpu, slot.tp, mbs, recompute, sp)
    if key not in ctx.memo:
        job, m = ctx.job, ctx.job.model
        rows = np.zeros((m.num_layers + 1, 2))
        per_kind: dict = {}  # every block of a kind (dense or MoE) has the same collectives
        for i in range(m.num_layers):
            kind = (m.layer_kind(i), m.is_moe_block(i))
            if kind not in per_kind:
                fwd, bwd = m.tp_collectives(i, tp=slot.tp, mbs=mbs, seq=job.seq, elem_bytes=job.elem_bytes,
                                            framework=job.framework, recompute=recompute, sequence_parallel=sp)
                per_kind[kind] = [sum(tp_collective_time_s(ctx.network, slot.zone, slot.gpu, slot.tp, c, n)
                                      for c, n in ops) for ops in (fwd, bwd)]
            rows[i + 1] = per_kind[kind]
        ctx.memo[key] = np.cumsum(rows, axis=0)
    return ctx.memo[key]


def tp_comm_s(ctx: SimContext, slot: Slot, mbs: int, a: int, e: int, opts: TimeOptions) -> tuple[float, float]:
    """(forward, backward) seconds of TP collectives one micro-batch adds on layers [a, e) beyond
    what the layer times hold (module docstring): all of them for roofline layer times, only
    sequence parallelism's extra for measured ones. Full recomputation repeats the forward's
    collectives in the backward of the recomputed blocks."""
    included = ctx.tp_comm_included(slot.gpu, slot.tp)
    if slot.tp == 1 or (included and not opts.sequence_parallel):
        return 0.0, 0.0
    first, n = recomputed_blocks(ctx, a, e, opts.recompute, opts.recompute_blocks)
    full = opts.recompute is Recompute.FULL

    def total(sp: bool) -> np.ndarray:
        plain = _tp_comm_cumsum(ctx, slot, mbs, Recompute.NONE, sp)
        out = plain[e] - plain[a]
        if full and n:
            rec = _tp_comm_cumsum(ctx, slot, mbs, Recompute.FULL, sp)
            out = out + (rec[first + n] - rec[first]) - (plain[first + n] - plain[first])
        return out

    charged = total(opts.sequence_parallel)
    if included:
        charged = charged - total(False)
    return float(charged[0]), float(charged[1])


def gather_group(ctx: SimContext, slot: Slot, replicas: int) -> list[Group]:
    """The members of a ZeRO-3 gather across a stage's `replicas` replicas like `slot`, placed as the
    launcher packs one pool (`plan.placement`): node_size // TP replicas to a node, each node a group
    (so the gather is hierarchical where a node holds several), the last node holding the rest."""
    per_node = max(1, ctx.cluster.node_size(slot.gpu) // slot.tp)
    return [(dataclasses.replace(slot, node=f"zero3-gather/{k}"), min(per_node, replicas - k * per_node))
            for k in range(-(-replicas // per_node))]


def layer_gather_s(ctx: SimContext, slot: Slot, a: int, e: int, opts: TimeOptions) -> np.ndarray:
    """Seconds of the ZeRO-3 all-gather of each layer of [a, e) (one replica's TP shards), array
    (e - a,), across the stage's D replicas like `slot` placed as `gather_group` packs them; under
    expert parallelism the dense parameters so, then the replica's experts across its D/ep expert
    DP group (`experts`), one after the other."""
    t, wb = slot.tp, ctx.job.state_bytes_per_param["weights"]
    parts = [(opts.replicas, ALL_PARAMS)] if opts.experts is None else \
        [(opts.replicas, DENSE_ONLY), (opts.experts.expert_replicas, opts.experts.experts_share)]
    out = np.zeros(e - a)
    for replicas, share in parts:
        groups = gather_group(ctx, slot, replicas)
        shape = group_shape(groups)
        out += np.array([collective_s(ctx, groups, Collective.ALL_GATHER, t * ctx.stage_params(t, x, x + 1, share) * wb, t,
                                      shape) for x in range(a, e)])
    return out


def exposed_gathers(gather_s: Sequence[float], compute_s: Sequence[float]) -> float:
    """Seconds a pass over n layers takes beyond its compute when each layer's gather (`gather_s`, in
    the pass's order) is issued as the previous layer starts computing (`compute_s`, same order) and
    the first is gathered on demand: g_0 + sum over i >= 1 of max(0, g_i - c_(i-1)). (Layer i starts
    at T_i = T_(i-1) + max(c_(i-1), g_i): its gather starts with layer i-1, after the gathers before
    it, which ended by T_(i-1).)"""
    g, c = np.asarray(gather_s, dtype=float), np.asarray(compute_s, dtype=float)
    return float(g[0] + np.maximum(g[1:] - c[:-1], 0.0).sum()) if len(g) else 0.0


def _pass_gathers_s(ctx: SimContext, slot: Slot, mbs: int, a: int, e: int, opts: TimeOptions) -> tuple[float, float]:
    """(forward, backward) seconds a forward and a backward pass of one micro-batch over layers
    [a, e) wait for their ZeRO-3 gathers (`layer_gather_s`), each prefetched one layer ahead of the
    layers' own compute (`exposed_gathers`; the backward runs the layers in reverse)."""
    g = layer_gather_s(ctx, slot, a, e, opts)
    c = ctx.layer_s(slot.gpu, slot.tp, mbs, a, e)  # (e - a, 2): forward, backward
    return exposed_gathers(g, c[:, 0]), exposed_gathers(g[::-1], c[::-1, 1])


def zero_gather_s(ctx: SimContext, slot: Slot, mbs: int, a: int, e: int, opts: TimeOptions) -> tuple[float, float]:
    """(forward, backward) seconds one micro-batch's passes over layers [a, e) wait for ZeRO-3
    gathers re-done every pass (`reshard` true; module docstring); (0, 0) without ZeRO-3, with one
    replica or with kept weights (`kept_gather_s`)."""
    if not opts.gathers_weights or not opts.reshard:
        return 0.0, 0.0
    return _pass_gathers_s(ctx, slot, mbs, a, e, opts)


def kept_gather_s(ctx: SimContext, slot: Slot, mbs: int, a: int, e: int, opts: TimeOptions) -> float:
    """Seconds the first forward of an iteration over layers [a, e) waits for ZeRO-3 gathers done
    once per iteration (`reshard` false: the weights are then kept until each layer's last
    backward): the forward pass's of `_pass_gathers_s`; 0 otherwise."""
    if not opts.gathers_weights or opts.reshard:
        return 0.0
    return _pass_gathers_s(ctx, slot, mbs, a, e, opts)[0]


def link_transfer(ctx: SimContext, src: Slot, dst: Slot, nbytes: float, *,
                  sliced: tuple[bool, bool] = (False, False)) -> tuple[float, float, float]:
    """(seconds, bytes crossing zones, egress $) of one activation of `nbytes` from replica `src` to
    replica `dst`, and its gradient back (the bytes and $ count both directions).

    Both Sailor's runtime and Megatron-LM scatter it (SC'21 §4.1; Sailor's generalised to replicas
    of different TP degrees, `plan.comms.boundary_pieces`): TP rank s of the sender (TP a) sends only
    its 1/a of the tensor, in one piece per receiving rank (TP b) whose 1/b slice overlaps it, so the
    link carries a + b - gcd(a, b) concurrent flows that add up to the tensor once (taken as equal
    pieces: exact when a == b or one divides the other, which is every Megatron-LM plan), and the
    receiver all-gathers its slices over its intra-node TP link. The gradient comes back over the
    same flows and is gathered by the sender's TP group; the schedule has one time per boundary for
    both directions, so it takes the larger of the two gathers. An end whose chunk runs sequence
    parallelism with a block at that edge (`sliced`: sender's output, receiver's input) holds only
    its slice there and gathers nothing (`runtime.tensor_parallel.sliced_edges`). Each transfer takes the intra-node
    link when both replicas sit on one node (`Slot.node`, from `placed_slots`), and pays the fixed
    cost of its slower end (`SimContext.p2p_overhead_s`: calibrated and profiled, 0 by default). Egress: the tensor once
    each way, each direction at its sender's price (`catalog.Clouds.egress_between`).

    DeepSpeed's pipeline engine (`Framework.DEEPSPEED`, the public Sailor runs) instead has every TP
    rank of the sender send the full activation to its peer rank: min(a, b) concurrent flows of the
    whole tensor, no gather."""
    on_node = same_node(src, dst)
    if ctx.job.framework is Framework.DEEPSPEED:
        flows = min(src.tp, dst.tp)
        per_flow, gather = nbytes, 0.0
    else:
        flows = src.tp + dst.tp - math.gcd(src.tp, dst.tp)
        per_flow = nbytes / flows
        gather = max(0.0 if cut else tp_collective_time_s(ctx.network, end.zone, end.gpu, end.tp,
                                                          Collective.ALL_GATHER, nbytes)
                     for end, cut in zip((src, dst), sliced))
    seconds = (ctx.network.transfer_time_s(src.zone, src.gpu, dst.zone, dst.gpu, per_flow, flows=flows,
                                           same_node=on_node)
               + ctx.p2p_overhead_s((src.gpu, src.tp), (dst.gpu, dst.tp)) + gather)
    lc = ctx.network.link_class(src.zone, dst.zone, on_node)
    if lc in (LinkClass.SAME_NODE, LinkClass.SAME_ZONE):
        return seconds, 0.0, 0.0
    one_way = per_flow * flows  # the activation forward, and as many gradient bytes backward
    prov = ctx.cluster.prov  # each direction pays its sender's price (across providers: internet egress)
    forward, backward = prov.egress_between(src.zone, dst.zone, lc), prov.egress_between(dst.zone, src.zone, lc)
    both = 2.0 * one_way
    usd = both / 1e9 * forward if forward == backward else one_way / 1e9 * (forward + backward)
    return seconds, both, usd


def pipeline_times(ctx: SimContext, slots: Sequence[Slot], stages: Sequence[tuple[int, int]], mbs: int,
                   options: Sequence[Sequence[TimeOptions]] | None = None,
                   schedule: PipelineSchedule = ONE_F_ONE_B) -> PipelineTimes:
    """Pass times of one pipeline under `schedule`: stage i runs on `slots[i]`, chunk u of `stages`
    (the plan's layer ranges in layer order: p·v of them) on stage u mod p, as chunk u // p of that
    stage. `options[i][c]` are the time options of chunk c of stage i (`time_options` of
    `Plan.chunk_memory`; default: none). When the schedule splits the backward (zb-h1), the layers'
    backward in `stage_time` is replaced by its two passes (`SimContext.stage_backward_split_s`):
    the input gradient stays in B with what the options add to the backward (recomputation, TP
    collectives, ZeRO-3 gather), the weight gradient is W. Transfers: `link_transfer`. Megatron-LM
    (`Framework.MEGATRON`) exchanges after every pass with a blocking `batch_isend_irecv` (its 2021
    `p2p_communication`, also under interleaving), so where the schedule's simulation has sends that
    never block (`PipelineSchedule.sends_block` False) each pass's send is charged to the pass that
    sends it and the message arrives when that pass ends. Each transfer between zones is one of
    the result's `crossings` (per micro-batch)."""
    p, v = len(slots), schedule.virtual_stages
    assert len(stages) == p * v, (len(stages), p, v)
    f, b, w = np.zeros((p, v)), np.zeros((p, v)), np.zeros((p, v))
    c = np.zeros(p * v - 1)
    crossings = []
    for u, (a, e) in enumerate(stages):
        i, k = u % p, u // p
        r = slots[i]
        st = stage_time(ctx, r, mbs, a, e, options[i][k] if options else DEFAULT_TIME)
        f[i, k], b[i, k] = st.forward_s, st.backward_s
        if schedule.splits_backward:  # B: the input-gradient pass in place of the layers' backward
            bi, w[i, k] = ctx.stage_backward_split_s(r.gpu, r.tp, mbs, a, e)
            b[i, k] += bi - ctx.stage_compute_s(r.gpu, r.tp, mbs, a, e)[1]
        if u < p * v - 1:
            dst = slots[(u + 1) % p]
            sliced = (_sp_edge(ctx, options, i, k, e - 1), _sp_edge(ctx, options, (u + 1) % p, (u + 1) // p, e))
            c[u], nbytes, dollars = link_transfer(ctx, r, dst, ctx.boundary_bytes(e, mbs), sliced=sliced)
            if nbytes:
                crossings.append(Crossing.between(r.zone, dst.zone, nbytes, dollars))
    if ctx.job.framework is Framework.MEGATRON and not schedule.sends_block:
        for u in range(p * v - 1):  # the activation leaves virtual stage u, its gradient u + 1
            f[u % p, u // p] += c[u]
            b[(u + 1) % p, (u + 1) // p] += c[u]
        c[:] = 0.0
    return PipelineTimes(f, b, w, c, tuple(crossings))


def _sp_edge(ctx: SimContext, options: Sequence[Sequence[TimeOptions]] | None, i: int, k: int, layer: int) -> bool:
    """Whether chunk k of stage i runs sequence parallelism and `layer`, at its edge, is a block:
    that edge crosses the boundary as the rank's slice (`link_transfer`)."""
    return bool(options) and options[i][k].sequence_parallel and ctx.job.model.layer_kind(layer) is LayerKind.BLOCK


def pipeline_arrays(ctx: SimContext, slots: list[Slot], stages, mbs: int,
                    options: list[TimeOptions] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """Per-micro-batch forward, backward and boundary-transfer seconds of one 1F1B pipeline, arrays
    (P,), (P,), (P-1,), plus (bytes crossing zones, egress $) per micro-batch (`pipeline_times` for
    one chunk per stage). `options[i]` are stage i's time options (`time_options`; default: none)."""
    t = pipeline_times(ctx, slots, stages, mbs, [(o,) for o in options] if options else None)
    return t.forward_s[:, 0], t.backward_s[:, 0], t.transfer_s, t.cross_zone_bytes, t.egress_usd


def optimizer_s(ctx: SimContext, slot: Slot, a: int, e: int, opts: TimeOptions = DEFAULT_TIME) -> float:
    """Optimizer-step seconds of one replica holding layers [a, e): over 1/D of its parameters under
    ZeRO >= 1 (linear in the parameters, so a stage's chunks add up); under expert parallelism over
    its dense parameters and its own experts, these over 1/(D/ep) under ZeRO >= 1."""
    if opts.experts is None:
        return ctx.profiles.optimizer_time_s(ctx.job, slot.gpu, ctx.stage_params(slot.tp, a, e) / opts.optimizer_shards)
    params = (ctx.stage_params(slot.tp, a, e, DENSE_ONLY) / opts.optimizer_shards
              + ctx.stage_params(slot.tp, a, e, opts.experts.experts_share) / opts.expert_shards)
    return ctx.profiles.optimizer_time_s(ctx.job, slot.gpu, params)


def collective_s(ctx: SimContext, groups: list[Group], kind: Collective, nbytes: float, t: int,
                 shape: tuple | None = None) -> float:
    """Seconds of one all-reduce, reduce-scatter or all-gather of `nbytes` (a replica's full tensor,
    split in `t` shards, one per TP rank: the flows of each ring edge) across `groups`: ring or
    hierarchical over the links (`collectives.allreduce_time_s`, the cluster spec's algorithm) at
    the lowest calibrated all-reduce efficiency of the members, a reduce-scatter or an all-gather
    taking half of it, plus the backend's start-up of one call (`NetworkModel.collective`). 0 for a
    single member. Memoised by the groups' shape (`group_shape`: all the collectives read of them),
    so the stages of a plan that sync equal bytes over equally placed replicas share one; the rings
    and the efficiency, which do not depend on the bytes, once per shape (`collectives.AllreduceRings`,
    `shape_memo`), so collectives of other bytes over groups of that shape only time them. `shape`:
    `group_shape(groups)` where the caller has it."""
    if sum(n for _, n in groups) < 2:
        return 0.0
    shape = group_shape(groups) if shape is None else shape
    key = ("collective", shape, kind, nbytes)
    if key not in ctx.memo:
        rings_of = shape_memo(ctx, "allreduce rings")
        if shape not in rings_of:
            rings_of[shape] = collective_rings(ctx, groups)
        ctx.memo[key] = timed_collective_s(ctx, *rings_of[shape], kind, nbytes)
    return ctx.memo[key]


def collective_rings(ctx: SimContext, groups: list[Group]) -> tuple[AllreduceRings, float]:
    """(the rings of a collective over `groups`, `collectives.AllreduceRings`; the members' lowest
    calibrated all-reduce efficiency): what `collective_s` reads of the groups, for any bytes."""
    return AllreduceRings.of(groups, ctx.network), ctx.allreduce_efficiency([r for r, _ in groups])


def timed_collective_s(ctx: SimContext, rings: AllreduceRings, efficiency: float, kind: Collective,
                       nbytes: float) -> float:
    """Seconds of one collective of `kind` and `nbytes` over `rings` (`collective_rings`), not
    memoised: a reduce-scatter or an all-gather half the all-reduce, plus the backend's start-up of
    one call (`collective_s`)."""
    ring = rings.time_s(nbytes, efficiency)
    return RING_SHARE[kind] * ring + (ctx.network.collective.startup_s if ring > 0 else 0.0)


def shape_memo(ctx: SimContext, name: str) -> dict:
    """The context's memo `name` of what collectives read of groups of one shape without their bytes
    (`collective_s`' rings, `sync.stage_sync`'s ring edges), keyed by `group_shape`, emptied when it
    holds SHAPE_MEMO_MAX shapes: they are asked for again soon after (the other collectives of one
    stage's sync, the other stages of one plan), and a search meets many thousands of shapes, each
    entry as large as its ring."""
    memo = ctx.memo.setdefault(name, {})
    if len(memo) >= SHAPE_MEMO_MAX:
        memo.clear()
    return memo


def allreduce_s(ctx: SimContext, groups: list[Group], nbytes: float, t: int) -> float:
    """`collective_s` of an all-reduce."""
    return collective_s(ctx, groups, Collective.ALL_REDUCE, nbytes, t)


def group_shape(groups: list[Group]) -> tuple:
    """`groups` with each node name replaced by its rank of first appearance: the collectives read a
    member's node only to tell whether two members share one (`collectives.same_node`, the islands of
    a hierarchical all-reduce), so groups of one shape take the same time and egress (a memo key).
    Run-length coded, as tuples (zone, GPU type, TP, first node's rank or None, count, run length):
    a run is consecutive groups alike but for their nodes, each on the node ranked after the one
    before it (or all on none). A stage's replicas mostly sit one per node, so a key of hundreds of
    groups is a few runs; the planner's memo holds tens of thousands of such keys."""
    ids: dict[str, int] = {}
    runs: list[list] = []
    run: list = [None, None, None, None, None, 0]
    for m, n in groups:
        node = None if m.node is None else ids.setdefault(m.node, len(ids))
        if (m.zone == run[0] and m.gpu == run[1] and m.tp == run[2] and n == run[4]
                and (node is None if run[3] is None else node == run[3] + run[5])):
            run[5] += 1
        else:
            run = [m.zone, m.gpu, m.tp, node, n, 1]
            runs.append(run)
    return tuple(map(tuple, runs))


def place(pipelines: list[list[Slot]], cluster: ClusterSpec) -> list[list[Slot]]:
    """The same slots, [pipeline][stage], with the node the launcher puts each on (`BlockFit`, the
    block placement of `rank_layout`, cut between nodes where a slot's `node_cut` says, with the
    cluster's GPUs per node; the placed slots carry their node and no cut): replicas that share a node
    talk over the intra-node link. Equal placed slots are one object (cheap to count and compare)."""
    sizes: dict[str, int] = {}

    def size(gpu: str) -> int:  # GPUs per node, looked up once per GPU type
        return sizes[gpu] if gpu in sizes else sizes.setdefault(gpu, cluster.node_size(gpu))

    fit = BlockFit(size)
    made: dict[tuple[str, int], Slot] = {}  # (node, TP) -> its placed slot
    keys: dict[int, tuple] = {}  # id of a pipeline list (the planner repeats one) -> its replicas and blocks
    out = []
    for pipe in pipelines:
        got = keys.get(id(pipe))
        if got is None:
            reps = [(sl.zone, sl.gpu, sl.tp) for sl in pipe]
            cuts = [sl.node_cut for sl in pipe] if any(sl.node_cut for sl in pipe) else None
            got = keys[id(pipe)] = (reps, node_blocks(reps, size, cuts), cuts)
        row = []
        for sl, (node, _) in zip(pipe, fit.put(*got)):
            placed = made.get((node, sl.tp))
            if placed is None:
                placed = made[(node, sl.tp)] = Slot(zone=sl.zone, gpu=sl.gpu, tp=sl.tp, node=node)
            row.append(placed)
        out.append(row)
    return out


def placed_slots(plan: Plan, cluster: ClusterSpec) -> list[list[Slot]]:
    """Slots of every replica of `plan`, [pipeline][stage], placed on nodes (`place`)."""
    return place([[Slot(zone=r.zone, gpu=r.gpu, tp=r.tp, node_cut=r.node_cut) for r in p.replicas]
                  for p in plan.pipelines], cluster)
