"""Simulator: iteration time, memory per GPU and cost of a Plan, with a breakdown a user can read.

`simulate(plan, ctx)` runs the event simulation of the plan's pipeline schedule (`schedules`: 1F1B
in the order of DeepSpeed's pipeline engine, `schedule`; interleaved 1F1B and ZB-H1, `schedule_orders`
over the op orders of `sailor.plan.orders`)
for every distinct pipeline, then the gradient reductions, then the optimizer step, in the order
DeepSpeed's `TrainSchedule` ends an iteration (ReduceTiedGrads, ReduceGrads, OptimizerStep), and the
step's two all-reduces over the whole world:

    iteration_time = max_j pipeline_j + tied + max_i sync_i + max_{replicas} optimizer + step

- pipeline: per micro-batch, each replica's forward and backward (`terms.stage_time`: layer times,
  recomputation, TP collectives where the profile lacks them, ZeRO-3 gathers) and the transfers
  across stage boundaries (scatter-gather, as Sailor's runtime and Megatron-LM do: each TP rank
  sends 1/t of the activation and the receiving replica all-gathers it, `terms.link_transfer`), plus
  a calibrated fixed cost per transfer; with ZeRO-3 weights kept for the iteration
  (`reshard_after_forward` false), each stage's once-per-iteration gathers on its first forward
  (`terms.kept_gather_s`), which the pipeline's fill waits for.
- tied: tied input/output embeddings (OPT, GPT-Neo, GPT-3) split over P > 1 stages: the first and
  last stage each hold a copy and exchange its gradient, as the modelled runs hold it
  (`context.TiedCopies`): Sailor's runtime the token matrix alone, kept twice even with P = 1 (the
  one stage's gradient sync then reduces both copies); DeepSpeed the whole embedding module, once
  with P = 1.
- sync: each TP rank all-reduces its own gradient shard (params(stage, t) x gradient bytes, norms
  and row-parallel biases included) with its peers of the other D - 1 replicas (ZeRO: reduce-scatter
  plus all-gather, the reduce-scatter once per micro-batch round under ZeRO-2/3, `sync.stage_sync`):
  a ring or a hierarchical all-reduce over the links at the GPU type's calibrated all-reduce
  efficiency (`terms.collective_s`, `collectives`).
- optimizer: proportional to the parameters on one GPU (memory-bound; 1/D of them under ZeRO).
- step: Sailor's runtime's all-reduce of the gradient norm before the update and of the step's
  statistics after it, each over every rank of the plan (`sync.step_allreduces_s`): latency-bound,
  a few bytes and 2(W-1) hop latencies on a ring of W ranks.
- expert parallelism (`Plan.experts`, EP > 1 on a stage; `experts`): each replica's EP rank goes
  into its stage's time options (its experts' work, the slowest EP rank of its group, and the
  all-to-alls in its passes), its memory (its experts' states, the rows it receives, token
  buffers) and the stage's sync (dense parameters over all D replicas, each EP rank's experts over
  its D/ep holders); the all-to-alls' bytes between zones are traffic of their own kind.
Memory options (`Plan.memory`) are read in one place, `terms.stage_memory`, which `simulate` calls
once per stage and hands to `terms.time_options` (time) and `memory.replica_memory` (memory, per chunk
under interleaving); the schedule (`Plan.schedule`) in one, `schedules.pipeline_schedule`, whose
micro-batches in flight multiply the options' bytes per micro-batch in `replica_memory`. The slowest pipeline sets the pace (straggler);
the reductions wait for all pipelines. Links follow the launcher's placement (`terms.placed_slots`,
from `sailor.plan.placement.pack_replicas`, the block placement of `rank_layout`): a p2p transfer or
ring hop between two replicas on one node uses the intra-node link, any other the link between two
nodes of their zones. Under that placement whether two consecutive stages of a pipeline share a node
depends on the pipeline's own stages alone (`sailor.plan.placement.same_node_boundaries`), so the
planner's fast path times each pipeline type once (`planner.kinds.kind_boundaries`), exactly as every
pipeline of that type runs; its gradient syncs follow the placement of the whole plan.
`SimContext` (`context`) holds the job, cluster, profiles and
network for one simulation or planning call and caches per-(GPU, TP, micro-batch) layer tables; its
caches are keyed on every input and die with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sailor import catalog
from sailor.core.errors import SailorInputError
from sailor.core.units import HOUR_S
from sailor.model.spec import Framework
from sailor.perf.profile_lookup import SPLIT_FROM_FLOPS
from sailor.plan.comms import plan_nccl_bytes
from sailor.plan.spec import Plan, StageMemory
from sailor.simulator.collectives import group_members
from sailor.simulator.context import (
    ALL_PARAMS,
    SimContext,
    TiedCopies,
    embedding_params,
    head_vocab_params,
    make_context,
    tied_embeddings,
)
from sailor.simulator.experts import DENSE_ONLY, EPRank, all_to_all_runs, stage_ep_crossings, stage_ep_ranks
from sailor.simulator.memory import MemoryBreakdown, replica_memory
from sailor.simulator.schedules import (
    ONE_F_ONE_B,
    PipelineSchedule,
    PipelineTimes,
    pipeline_schedule,
)
from sailor.simulator.sync import (
    stage_sync,
    stage_sync_crossings,
    step_allreduces_s,
    tied_sync,
    tied_sync_crossings,
    world_groups,
)
from sailor.simulator.terms import (
    DEFAULT_TIME,
    Slot,
    StageTime,
    TimeOptions,
    allreduce_s,
    collective_s,
    group_shape,
    kept_gather_s,
    link_transfer,
    optimizer_s,
    pipeline_arrays,
    pipeline_times,
    place,
    placed_slots,
    recomputed_blocks,
    stage_memory,
    stage_time,
    time_options,
)
from sailor.simulator.traffic import Crossing, TrafficKind, ZoneTraffic, tally

__all__ = ["DEFAULT_TIME", "Estimate", "ReplicaEstimate", "SimContext", "Slot", "StageTime", "TiedCopies", "TimeOptions",
           "TrafficKind", "ZoneTraffic", "allreduce_s", "collective_s", "embedding_params", "head_vocab_params",
           "link_transfer", "make_context", "optimizer_s", "pipeline_arrays", "pipeline_times", "place", "placed_slots",
           "simulate", "stage_sync", "stage_time", "tied_embeddings", "tied_sync", "time_options"]


@dataclass
class ReplicaEstimate:
    """Replica (stage i of pipeline j): per-micro-batch compute (summed over its chunks; with
    expert parallelism its all-to-alls, also given alone as `all_to_all_s`) and p2p (its outgoing
    transfers), per-iteration sync and optimizer seconds, and memory per GPU (bytes).
    `layers` spans the first to the last layer it holds; `chunks` are its ranges (several under
    interleaving)."""

    pipeline: int
    stage: int
    gpu: str
    zone: str
    tp: int
    layers: tuple[int, int]
    chunks: tuple[tuple[int, int], ...]
    forward_s: float
    backward_s: float
    p2p_s: float
    sync_s: float
    optimizer_s: float
    memory: MemoryBreakdown
    memory_capacity_bytes: int
    recompute_s: float = 0.0
    tp_comm_s: float = 0.0
    gather_s: float = 0.0
    all_to_all_s: float = 0.0

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total

    @property
    def oom(self) -> bool:
        return self.memory.total > self.memory_capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "pipeline": self.pipeline, "gpu": self.gpu, "zone": self.zone, "tp": self.tp,
                "layers": list(self.layers), **({"chunks": [list(c) for c in self.chunks]} if len(self.chunks) > 1 else {}),
                "forward_s": self.forward_s, "backward_s": self.backward_s,
                "p2p_s": self.p2p_s, "sync_s": self.sync_s, "optimizer_s": self.optimizer_s,
                "recompute_s": self.recompute_s, "tp_comm_s": self.tp_comm_s, "zero_gather_s": self.gather_s,
                **({"all_to_all_s": self.all_to_all_s} if self.all_to_all_s else {}),
                "peak_memory_bytes": int(self.peak_memory_bytes), "memory_capacity_bytes": self.memory_capacity_bytes,
                "memory_breakdown_bytes": self.memory.to_dict(), "out_of_memory": self.oom}


@dataclass
class Estimate:
    """What one iteration of a plan costs. Seconds, bytes, $ (USD)."""

    iteration_time_s: float
    pipeline_s: float
    gradient_sync_s: float
    optimizer_s: float
    pipeline_times_s: list[float]
    replicas: list[ReplicaEstimate]
    global_batch_size: int
    sequence_length: int
    gpus: int
    gpu_cost_per_iteration_usd: float
    egress_per_iteration_usd: float
    cross_zone_bytes: float
    model_flop_per_iteration: float
    peak_flop_per_s: float
    estimated: list[str]
    recompute_flop_per_iteration: float = 0.0
    tp_communication: list[str] | None = None
    """Per (GPU type, TP > 1) of the plan: whether its TP collectives were charged from the intra-node
    link or are held by its measured layer times."""
    schedule: PipelineSchedule = ONE_F_ONE_B
    """The plan's pipeline schedule (`schedules.pipeline_schedule`)."""
    pipeline_passes: list[PipelineTimes] = field(default_factory=list)
    """Per pipeline, the pass times its schedule ran on (`schedule.timeline` redraws it)."""
    traffic: list[ZoneTraffic] = field(default_factory=list)
    """`cross_zone_bytes` and `egress_per_iteration_usd` per zone pair and kind (pipeline p2p, gradient
    sync), sorted by pair then kind; one entry per pair and kind that carries bytes (`traffic`)."""
    stage_sync_s: list[float] = field(default_factory=list)
    """Per stage, the seconds of its gradient sync charged after its last backward (`sync.stage_sync`;
    the tied embedding's exchange not included): what the runtime's `sync_exposed_s` measures."""
    step_collectives_s: float = 0.0
    """Seconds of the step's two all-reduces over every rank, the gradient norm's and the statistics'
    (`sync.step_allreduces_s`), part of `iteration_time_s`."""

    @property
    def iteration_parts(self) -> tuple[float, float, float, float]:
        """The parts `iteration_time_s` is the sum of (seconds): the slowest pipeline, the gradient
        sync, the optimizer step and the step's all-reduces, in that order."""
        return self.pipeline_s, self.gradient_sync_s, self.optimizer_s, self.step_collectives_s

    @property
    def throughput_iters_per_s(self) -> float:
        return 1.0 / self.iteration_time_s

    @property
    def samples_per_s(self) -> float:
        return self.global_batch_size / self.iteration_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.sequence_length

    @property
    def cost_per_iteration_usd(self) -> float:
        return self.gpu_cost_per_iteration_usd + self.egress_per_iteration_usd

    @property
    def cost_per_hour_usd(self) -> float:
        return self.cost_per_iteration_usd * HOUR_S / self.iteration_time_s

    @property
    def schedule_timing(self) -> str | None:
        """How the simulator's timing of the plan's pipelines differs from what the runtime runs
        (`PipelineSchedule.runtime_difference`); None without a stage boundary (nothing is sent)."""
        return self.schedule.runtime_difference if any(r.stage > 0 for r in self.replicas) else None

    @property
    def fits_in_memory(self) -> bool:
        return not any(r.oom for r in self.replicas)

    @property
    def min_headroom_bytes(self) -> float:
        """Smallest free memory over all GPUs (negative when something does not fit)."""
        return min(r.memory_capacity_bytes - r.peak_memory_bytes for r in self.replicas)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per iteration / (iteration time x Σ peak FLOP/s)."""
        return self.model_flop_per_iteration / (self.iteration_time_s * self.peak_flop_per_s)

    @property
    def flop_per_s_per_gpu(self) -> float:
        """FLOP/s per GPU counting the recomputation forward (hardware FLOPs, the way Narayanan et
        al. SC'21 report their "achieved teraFLOP/s per GPU")."""
        return (self.model_flop_per_iteration + self.recompute_flop_per_iteration) / (self.iteration_time_s * self.gpus)

    def to_dict(self) -> dict[str, Any]:
        """The `sailor simulate --json` object."""
        return {
            "iteration_time_s": self.iteration_time_s,
            "throughput_iters_per_s": self.throughput_iters_per_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "cost_per_iteration_usd": self.cost_per_iteration_usd,
            "cost_per_hour_usd": self.cost_per_hour_usd,
            "egress_per_iteration_usd": self.egress_per_iteration_usd,
            "cross_zone_bytes_per_iteration": self.cross_zone_bytes,
            "fits_in_memory": self.fits_in_memory,
            # only when not the default, so 1F1B output is what it was before schedules existed
            **({"schedule": {"kind": self.schedule.kind.value, "virtual_stages": self.schedule.virtual_stages}}
               if self.schedule.kind is not ONE_F_ONE_B.kind else {}),
            "gpus": self.gpus,
            "mfu": self.mfu,
            "flop_per_s_per_gpu_with_recompute": self.flop_per_s_per_gpu,
            "tp_communication": self.tp_communication or [],
            "breakdown": {"pipeline": self.pipeline_s, "gradient_sync": self.gradient_sync_s,
                          "optimizer": self.optimizer_s, "step_collectives": self.step_collectives_s},
            "pipeline_times_s": self.pipeline_times_s,
            **({"schedule_timing": self.schedule_timing} if self.schedule_timing else {}),
            "estimated": self.estimated,
            "cross_zone_traffic": [t.to_dict() for t in self.traffic],
            "replicas": [r.to_dict() for r in self.replicas],
        }


# ---- the simulation -------------------------------------------------------------------------------
def _with_nccl(ctx: SimContext, mem: MemoryBreakdown, nccl_bytes: float, gpu: str) -> MemoryBreakdown:
    """A copy of a replica's memory with `nccl_bytes`, the NCCL buffers of the communicators its
    ranks open in this plan (`plan.comms.plan_nccl_bytes`: exact where `replica_memory` assumed
    equal TP degrees everywhere); none where the GPU type's framework memory is calibrated."""
    return dataclasses.replace(mem, nccl=0.0 if ctx.framework_calibrated(gpu) else nccl_bytes)


def _replica_rows(ctx: SimContext, plan: Plan, slots: list[Slot], times: PipelineTimes,
                  opts: list[tuple[TimeOptions, ...]], m: int, memory: list[tuple[StageMemory, tuple[StageMemory, ...]]],
                  sched: PipelineSchedule, ep_ranks: list[EPRank | None], nccl: list[float]) -> list[dict[str, Any]]:
    """Per stage, the `ReplicaEstimate` fields but `pipeline` of one pipeline placed on `slots`, with
    pass times `times`, time options `opts` [stage][chunk], `m` micro-batches, the stages' memory
    options (`terms.stage_memory`), EP rank per stage (None: EP 1) and NCCL buffer bytes per stage
    (`plan.comms.plan_nccl_bytes`); `sync_s` 0 (`simulate` adds it). `simulate` builds the replicas
    of every pipeline of this kind from these rows, so they share one `memory` object (read only)."""
    P, D, mbs = plan.num_stages, len(plan.pipelines), plan.micro_batch_size
    fwd, bwd = times.forward_s.sum(axis=1).tolist(), (times.backward_s + times.weight_s).sum(axis=1).tolist()
    sends = [float(times.transfer_s[i::P].sum()) for i in range(P)]  # outgoing, per micro-batch
    rows = []
    for i, sl in enumerate(slots):
        chunks = plan.stage_chunks(i)
        parts = [stage_time(ctx, sl, mbs, a, e, o) for (a, e), o in zip(chunks, opts[i])]
        mkey = ("replica_memory", sl.gpu, sl.tp, mbs, chunks, i, P, m, memory[i][0], D, sched, ep_ranks[i])
        if mkey not in ctx.memo:  # identical replicas of other pipelines have the same memory
            ctx.memo[mkey] = replica_memory(ctx, sl.gpu, sl.tp, mbs, chunks, stage=i, num_stages=P, microbatches=m,
                                            memory=memory[i][0], replicas=D, schedule=sched, experts=ep_ranks[i])
        rows.append(dict(
            stage=i, gpu=sl.gpu, zone=sl.zone, tp=sl.tp, layers=(chunks[0][0], chunks[-1][1]),
            chunks=chunks, forward_s=fwd[i], backward_s=bwd[i], p2p_s=sends[i], sync_s=0.0,
            optimizer_s=sum(optimizer_s(ctx, sl, a, e, o) for (a, e), o in zip(chunks, opts[i])),
            memory=_with_nccl(ctx, ctx.memo[mkey], nccl[i], sl.gpu), memory_capacity_bytes=ctx.memory_capacity(sl.gpu),
            recompute_s=sum(st.recompute_s for st in parts), tp_comm_s=sum(st.tp_comm_s for st in parts),
            gather_s=sum(st.gather_s for st in parts), all_to_all_s=sum(st.all_to_all_s for st in parts)))
    return rows


def check_modelled(plan: Plan, framework: Framework | None = None) -> None:
    """Raise SailorInputError (naming `experts.<stage>.ep`) for a plan this simulator does not model:
    expert parallelism above 1 under DeepSpeed's pipeline engine (`framework`; its MoE layers are
    not what `simulator.experts` models). Every other EP plan is modelled (`simulator.experts`)."""
    for i in range(plan.num_stages):
        ep = plan.stage_experts(i).ep
        if ep > 1 and framework is Framework.DEEPSPEED:
            raise SailorInputError(f"the simulator does not model expert parallelism under DeepSpeed's pipeline engine"
                                   f" (ep {ep} on stage {i})", field=f"experts.{i}.ep",
                                   fix="use framework sailor or megatron-lm, or ep 1")


def simulate(plan: Plan, ctx: SimContext, *, event: bool = True) -> Estimate:
    """Simulate one iteration of `plan`.

    Args:
        plan: the plan (assumed checked against ctx.job; see Plan.check_against).
        ctx: job, cluster, profiles, network.
        event: True for the event simulation of the plan's schedule, False for its closed form
            (planner fast path).
    Returns:
        Estimate with times (s), memory per GPU (bytes) and cost ($).
    Raises:
        SailorInputError: a plan this simulator does not model (`check_modelled`).
    """
    check_modelled(plan, ctx.job.framework)
    job, mbs = ctx.job, plan.micro_batch_size
    P, D = plan.num_stages, len(plan.pipelines)
    sched = pipeline_schedule(plan, ctx.job.framework)
    memory = [stage_memory(plan, i) for i in range(P)]
    options = [tuple(time_options(mem, D) for mem in chunk_memory) for _, chunk_memory in memory]
    replicas: list[ReplicaEstimate] = []
    pipeline_times_s: list[float] = []
    passes: list[PipelineTimes] = []
    cache: dict[tuple, float] = {}
    egress_usd, cross_bytes = 0.0, 0.0
    crossings: list[tuple[TrafficKind, Crossing, int]] = []  # what the two totals add up, itemised
    slots = placed_slots(plan, ctx.cluster)
    # expert parallelism: each replica's EP rank (`experts`), in its stage's time options
    eps = {i: stage_ep_ranks(ctx, plan.stage_experts(i), [sl[i] for sl in slots], mbs)
           for i in range(P) if plan.stage_experts(i).ep > 1}
    # pipelines of one shape (slots alike but for which nodes they sit on, `group_shape`) share their
    # pass times: `pipeline_times` reads a node only to tell whether two stages share one; with the
    # same micro-batch count and NCCL buffers they also share every replica's figures (`_replica_rows`)
    arrays: dict[tuple, PipelineTimes] = {}
    kinds: dict[tuple, tuple[float, list[dict[str, Any]]]] = {}
    nccl = plan_nccl_bytes(plan)  # [pipeline][stage]
    for j, pipe in enumerate(plan.pipelines):
        m = pipe.microbatches
        shape = (group_shape([(sl, 1) for sl in slots[j]]), tuple(eps[i][j] for i in eps))
        kind = (shape, m, tuple(nccl[j]))
        if kind not in kinds:
            opts = [tuple(dataclasses.replace(o, experts=eps[i][j]) for o in options[i]) if i in eps else options[i]
                    for i in range(P)]
            if shape not in arrays:
                arrays[shape] = pipeline_times(ctx, slots[j], plan.stages, mbs, opts, sched)
            times = arrays[shape]
            key = (times.key, m, event)
            if key not in cache:
                cache[key] = sched.time_s(times, m, event=event)
            # kept ZeRO-3 weights are gathered once, on each stage's first forward: the fill waits for each
            fill = sum(kept_gather_s(ctx, slots[j][i], mbs, a, e, o) for i in range(P)
                       for (a, e), o in zip(plan.stage_chunks(i), opts[i]))
            kinds[kind] = (cache[key] + fill, _replica_rows(ctx, plan, slots[j], times, opts, m, memory, sched,
                                                            [eps[i][j] if i in eps else None for i in range(P)], nccl[j]))
        times = arrays[shape]
        passes.append(times)
        cross_bytes += times.cross_zone_bytes * m
        egress_usd += times.egress_usd * m
        crossings += [(TrafficKind.P2P, c, m) for c in times.crossings]
        pipeline_s, rows = kinds[kind]
        pipeline_times_s.append(pipeline_s)
        replicas += [ReplicaEstimate(pipeline=j, **row) for row in rows]

    tied_s = 0.0
    ends = (memory[0][0].zero, memory[-1][0].zero)  # ZeRO levels of the stages holding the tied copies
    for sl in slots:
        t, eb, eu = tied_sync(ctx, sl[0], sl[-1], P, ends, D)
        tied_s = max(tied_s, t)
        cross_bytes += eb
        egress_usd += eu
        crossings += [(TrafficKind.SYNC, c, 1) for c in tied_sync_crossings(ctx, sl[0], sl[-1], P, ends, D)]
    sync_times = []
    rounds = max(plan.step_rounds(j) for j in range(D))  # a stage group's rounds: its ZeRO-2/3 reduce-scatters
    for i in range(P):
        chunks = plan.stage_chunks(i)
        # (members, the share of the stage's parameters they sync): every replica, all of them; under
        # EP every replica the dense ones, then EP rank q of every group its experts (`experts`)
        syncs = [([sl[i] for sl in slots], ALL_PARAMS if i not in eps else DENSE_ONLY)]
        if i in eps:
            ep = plan.stage_experts(i).ep
            syncs += [([sl[i] for sl in slots[q::ep]], eps[i][q].experts_share) for q in range(ep)]
        times = []
        for members, share in syncs:
            groups = group_members(members)
            t, eb, eu = stage_sync(ctx, groups, chunks, options[i][0], mbs, rounds=rounds,
                                   split_backward=plan.schedule.splits_backward, share=share)
            times.append(t)
            cross_bytes += eb
            egress_usd += eu
            crossings += [(TrafficKind.SYNC, c, 1)
                          for c in stage_sync_crossings(ctx, groups, chunks, options[i][0], rounds=rounds, share=share)]
        sync_times.append(times[0] + max(times[1:], default=0.0))  # the expert DP groups sync at once
        if i in eps:  # the all-to-alls' bytes between zones
            mem = memory[i][1]
            runs = sum(all_to_all_runs(ctx, a, e, c.recompute, recomputed_blocks(ctx, a, e, c.recompute,
                                                                                   c.recompute_blocks))
                       for (a, e), c in zip(chunks, mem))
            for c, count in stage_ep_crossings(ctx, plan.stage_experts(i), [sl[i] for sl in slots], mbs,
                                               [p.microbatches for p in plan.pipelines], runs):
                cross_bytes += c.moved_bytes * count
                egress_usd += c.egress_usd * count
                crossings.append((TrafficKind.ALL_TO_ALL, c, count))
    for rep in replicas:
        rep.sync_s = sync_times[rep.stage] + (tied_s if rep.stage in (0, P - 1) else 0.0)

    sync_s = tied_s + max(sync_times)
    step_s = step_allreduces_s(ctx, world_groups(sl for pipe in slots for sl in pipe), P, D)
    iteration = max(pipeline_times_s) + sync_s + max(r.optimizer_s for r in replicas) + step_s
    gpus: dict[tuple[str, str], int] = {}  # GPUs per (zone, GPU type)
    for p in plan.pipelines:
        for r in p.replicas:
            gpus[(r.zone, r.gpu)] = gpus.get((r.zone, r.gpu), 0) + r.tp
    gpu_usd_per_hour = sum(n * ctx.cluster.price(z, g) for (z, g), n in gpus.items())
    model = job.model
    model_flop = 3.0 * job.global_batch_size * sum(model.forward_flop(i, tp=1, mbs=1, seq=job.seq)
                                                   for i in range(model.num_layers))
    peak = sum(n * catalog.gpu(g).peak(job.precision) for (_, g), n in gpus.items())
    return Estimate(
        iteration_time_s=iteration, pipeline_s=max(pipeline_times_s), gradient_sync_s=sync_s,
        optimizer_s=max(r.optimizer_s for r in replicas), pipeline_times_s=pipeline_times_s, replicas=replicas,
        global_batch_size=plan.global_batch_size, sequence_length=job.seq, gpus=plan.world_size,
        gpu_cost_per_iteration_usd=gpu_usd_per_hour * iteration / HOUR_S, egress_per_iteration_usd=egress_usd,
        cross_zone_bytes=cross_bytes, model_flop_per_iteration=model_flop, peak_flop_per_s=peak,
        # the estimates this plan's replicas stand on: a search leaves others in the shared profiles
        # (a ZB-H1 candidate's split backward, where the plan runs another schedule)
        estimated=sorted(f"{g} TP {t}: {how}" for g, t, how in ctx.profiles.estimates_used
                         if any(r.gpu == g and r.tp == t for r in replicas)
                         and (how != SPLIT_FROM_FLOPS or plan.schedule.splits_backward)),
        recompute_flop_per_iteration=_recompute_flop(plan, ctx, memory), tp_communication=tp_communication(plan, ctx),
        schedule=sched, pipeline_passes=passes, traffic=tally(crossings), stage_sync_s=sync_times,
        step_collectives_s=step_s,
    )


def _recompute_flop(plan: Plan, ctx: SimContext, memory: list[tuple[StageMemory, tuple[StageMemory, ...]]]) -> float:
    """FLOPs the plan's recomputation adds per iteration (every pipeline, every micro-batch), under
    each stage's memory options (`terms.stage_memory`)."""
    job, model = ctx.job, ctx.job.model
    total = 0.0
    for i in range(plan.num_stages):
        for (a, e), mem in zip(plan.stage_chunks(i), memory[i][1]):
            first, n = recomputed_blocks(ctx, a, e, mem.recompute, mem.recompute_blocks)
            per_sample = sum(model.recompute_flop(k, tp=1, mbs=1, seq=job.seq, recompute=mem.recompute)
                             for k in range(first, first + n))
            total += per_sample * plan.global_batch_size
    return total


def tp_communication(plan: Plan, ctx: SimContext) -> list[str]:
    """One line per (GPU type, TP > 1) of the plan: "A100-80 TP 8: charged (intra-node link)" where
    the simulator adds the TP collectives to estimated layer times (roofline, or scaled from TP 1),
    "... included (measured)" where layer times measured at that TP hold them, "... included (scaled
    from TP 4)" where they are scaled from a measurement at another TP > 1 (only sequence
    parallelism's extra is charged in either)."""
    pairs = sorted({(r.gpu, r.tp) for p in plan.pipelines for r in p.replicas if r.tp > 1})
    return [f"{g} TP {t}: " + _tp_comm_source(ctx, g, t) for g, t in pairs]


def _tp_comm_source(ctx: SimContext, gpu: str, tp: int) -> str:
    """How the TP collectives of (gpu, tp > 1) enter the estimate (`tp_communication`)."""
    if not ctx.tp_comm_included(gpu, tp):
        return "charged (intra-node link)"
    src = ctx.profiles.tp_source(gpu, tp)
    return "included (measured)" if src == tp else f"included (scaled from TP {src})"
