"""Simulator: iteration time, memory per GPU and cost of a Plan, with a breakdown a user can read.

`simulate(plan, ctx)` runs the event simulation of the plan's pipeline schedule (`schedules`: 1F1B
in the order of DeepSpeed's pipeline engine, `schedule`; interleaved 1F1B and ZB-H1, `schedule_orders`)
for every distinct pipeline, then the gradient reductions, then the optimizer step, in the order
DeepSpeed's `TrainSchedule` ends an iteration (ReduceTiedGrads, ReduceGrads, OptimizerStep):

    iteration_time = max_j pipeline_j + tied + max_i sync_i + max_{replicas} optimizer

- pipeline: every TP rank of a stage sends the full activation to its peer rank of the next stage
  (DeepSpeed's p2p does not split it over TP), so a boundary carries min(t_i, t_i+1) concurrent flows
  of one activation each, plus a calibrated fixed cost per transfer.
- tied: tied input/output embeddings (OPT, GPT-Neo, GPT-3) split over P > 1 stages: the first and
  last stage each hold a copy of the embedding module and all-reduce its gradient between them.
  With P = 1 there is one copy only (`tied_embeddings`).
- sync: each TP rank all-reduces its own gradient shard (params(stage, t) x gradient bytes, norms
  and row-parallel biases included) with its peers of the other D - 1 replicas: a ring over the
  links, and no faster than a GPU type's calibrated all-reduce rate (`allreduce_s`).
- optimizer: proportional to the parameters on one GPU (memory-bound).
The slowest pipeline sets the pace (straggler); the reductions wait for all pipelines. Every p2p transfer and
all-reduce hop between two replicas is modelled on the link between two *nodes* of their zones
(conservative where a launcher co-locates small TP groups on one node): so all pipelines with the
same GPU type, zone and TP degrees take the same time, which the planner relies on. `SimContext` holds the
job, cluster, profiles and network for one simulation or planning call and caches per-(GPU, TP,
micro-batch) layer tables; its caches are keyed on every input and die with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sailor import catalog
from sailor.network import NetworkModel, network_for
from sailor.plan import Plan
from sailor.models import ModelSpec
from sailor.profiles import Profiles, roofline_profiles
from sailor.simulator.collectives import Group, Member, allreduce_time_s, group_members, ring_egress
from sailor.simulator.memory import MemoryBreakdown, replica_memory
from sailor.simulator.calibration import gpu_constant
from sailor.simulator.schedules import ONE_F_ONE_B, PipelineSchedule, PipelineTimes, pipeline_schedule, pipeline_times
from sailor.specs import ClusterSpec, JobSpec


def tied_embeddings(model: ModelSpec) -> bool:
    """True when the model's LM head reuses the input embedding's weights (`ModelSpec.tied_embeddings`;
    also Megatron-DeepSpeed's default, GPTModelPipe's TiedLayerSpec)."""
    return model.tied_embeddings


def embedding_params(model: ModelSpec, tp: int) -> int:
    """Parameters per GPU of the embedding module (word shard + position table), layer 0."""
    return model.params(0, tp)


def head_vocab_params(model: ModelSpec, tp: int) -> int:
    """Parameters per GPU of the LM-head matrix alone (the part a tied model shares), vocab / tp x h."""
    return model.padded_vocab(tp) * model.hidden_size // tp


@dataclass
class SimContext:
    """Everything a simulation needs besides the plan; caches live and die with this object.

    Attributes:
        job, cluster: the specs.
        profiles: layer timings (roofline estimates when None is given to `make_context`).
        network: links of the cluster.
        calibration: per-GPU-type constants fitted on measured runs (see simulator.calibration).
    """

    job: JobSpec
    cluster: ClusterSpec
    profiles: Profiles
    network: NetworkModel
    calibration: dict[str, dict[str, float]] = field(default_factory=dict)
    _cum: dict[tuple[str, int, int], np.ndarray] = field(default_factory=dict, repr=False)
    _split: dict[tuple[str, int, int], np.ndarray] = field(default_factory=dict, repr=False)
    _act: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)
    _params: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    memo: dict[tuple, Any] = field(default_factory=dict, repr=False)
    """Results of pure functions of this context (all-reduce times, pipeline constants), keyed on
    every argument: the planner asks for the same ones many times within one call."""

    def layer_cumsum(self, gpu: str, tp: int, mbs: int) -> np.ndarray:
        """Cumulative forward/backward seconds over layers: array (num_layers + 1, 2), row 0 = 0."""
        key = (gpu, tp, mbs)
        if key not in self._cum:
            t = self.profiles.layer_times(self.job, gpu, tp, mbs)
            if self.profiles.measured(gpu, tp):
                # A profiler times each layer alone between two device synchronisations, so every
                # timing carries a launch-and-sync gap that a real, asynchronous run hides.
                gap = gpu_constant(self.calibration, gpu, "profile_overhead_s", 0.0)
                t = np.maximum(t - gap, 0.0)
            self._cum[key] = np.vstack([np.zeros((1, 2)), np.cumsum(t, axis=0)])
        return self._cum[key]

    def stage_compute_s(self, gpu: str, tp: int, mbs: int, a: int, b: int) -> tuple[float, float]:
        """(forward_s, backward_s) of one micro-batch on layers [a, b) for one replica: the layers'
        times plus, on the forward, the runtime's measured per-micro-batch overhead of a stage
        (`Profiles.microbatch_overhead`: 1F1B bookkeeping outside the passes; 0 when not profiled),
        which a stage pays once per micro-batch whatever its layers."""
        c = self.layer_cumsum(gpu, tp, mbs)
        f, bw = c[b] - c[a]
        return float(f) + self.profiles.microbatch_overhead(gpu, tp), float(bw)

    def stage_backward_split_s(self, gpu: str, tp: int, mbs: int, a: int, b: int) -> tuple[float, float]:
        """(input_gradient_s, weight_gradient_s) of one micro-batch's backward on layers [a, b): the
        profile's measured split less the profiler's per-pass gap (`layer_cumsum`), else the backward
        of `stage_compute_s` split by the FLOP fraction (`Profiles.backward_split`, labelled estimated)."""
        key = (gpu, tp, mbs)
        if key not in self._split:
            backward = np.diff(self.layer_cumsum(gpu, tp, mbs)[:, 1])
            split = self.profiles.backward_split(self.job, gpu, tp, mbs, backward)
            if self.profiles.split_measured(gpu, tp):
                split = np.maximum(split - gpu_constant(self.calibration, gpu, "profile_overhead_s", 0.0), 0.0)
            self._split[key] = np.vstack([np.zeros((1, 2)), np.cumsum(split, axis=0)])
        c = self._split[key]
        bi, bw = c[b] - c[a]
        return float(bi), float(bw)

    def params_cumsum(self, tp: int) -> np.ndarray:
        """Cumulative parameters per GPU over layers at TP `tp`: array (num_layers + 1,)."""
        if tp not in self._params:
            m = self.job.model
            self._params[tp] = np.concatenate([[0], np.cumsum([m.params(i, tp) for i in range(m.num_layers)])])
        return self._params[tp]

    def stage_params(self, tp: int, a: int, b: int) -> float:
        """Parameters per GPU of a replica holding layers [a, b) at TP `tp`.

        Tied embeddings (`tied_embeddings`): a stage holding both the embedding and the head keeps one
        copy (the head's vocab matrix is not counted again); a stage holding the head without the
        embedding keeps a copy of the whole embedding module (DeepSpeed ties the module: word and
        position tables) instead of the head's own matrix."""
        c = self.params_cumsum(tp)
        n = float(c[b] - c[a])
        m = self.job.model
        if tied_embeddings(m) and b == m.num_layers:
            n -= head_vocab_params(m, tp)
            if a > 0:
                n += embedding_params(m, tp)
        return n

    def act_cumsum(self, tp: int, mbs: int) -> np.ndarray:
        key = (tp, mbs)
        if key not in self._act:
            a = self.profiles.activation_bytes_per_layer(self.job, tp, mbs)
            self._act[key] = np.concatenate([[0.0], np.cumsum(a)])
        return self._act[key]

    def boundary_bytes(self, layer_end: int, mbs: int) -> float:
        """Bytes of the activation leaving layer `layer_end - 1` (one micro-batch, full tensor)."""
        return self.job.model.output_bytes(layer_end - 1, mbs=mbs, seq=self.job.seq, elem_bytes=self.job.elem_bytes)

    def framework_bytes(self, gpu: str) -> float:
        """Memory per GPU beyond tensors (bytes): calibrated, else the catalog default."""
        return gpu_constant(self.calibration, gpu, "framework_bytes", catalog.gpu(gpu).framework_bytes)

    def allreduce_efficiency(self, members: list[Member]) -> float:
        """Fraction of the p2p link bandwidth an NCCL ring all-reduce reaches among `members`
        (calibrated per GPU type, 1 by default; the lowest member's value): reductions, chunking and
        the concurrent rings of all TP ranks of a node make it slower than a send/recv sweep."""
        return min(gpu_constant(self.calibration, mb.gpu, "allreduce_efficiency", 1.0) for mb in members)

    def allreduce_bytes_per_s(self, members: list[Member]) -> float | None:
        """Slowest calibrated all-reduce rate among `members` (bytes of one GPU's gradient shard per
        second, independent of the number of replicas), or None when no member's GPU type has one."""
        rates = [self.calibration.get(mb.gpu, {}).get("allreduce_bytes_per_s") for mb in members]
        rates = [float(r) for r in rates if r is not None]
        return min(rates) if rates else None

    def p2p_overhead_s(self, gpu_a: str, gpu_b: str) -> float:
        """Fixed seconds each pipeline transfer pays on top of its bytes (calibrated, 0 by default;
        the larger of the two ends)."""
        return max(gpu_constant(self.calibration, g, "p2p_overhead_s", 0.0) for g in (gpu_a, gpu_b))

    def memory_capacity(self, gpu: str) -> int:
        return catalog.gpu(gpu).memory_bytes


def make_context(job: JobSpec, cluster: ClusterSpec, profiles: Profiles | None = None,
                 network: NetworkModel | None = None,
                 calibration: dict[str, dict[str, float]] | None = None) -> SimContext:
    """A SimContext with roofline profiles and default links where none are given."""
    from sailor.simulator.calibration import default_calibration
    return SimContext(job=job, cluster=cluster, profiles=profiles or roofline_profiles(job),
                      network=network or network_for(cluster),
                      calibration=default_calibration() if calibration is None else calibration)


@dataclass
class ReplicaEstimate:
    """Replica (stage i of pipeline j): per-micro-batch compute (summed over its chunks) and p2p
    (its outgoing transfers), per-iteration sync and optimizer seconds, and memory per GPU (bytes).
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
    schedule: PipelineSchedule = ONE_F_ONE_B
    """The plan's pipeline schedule (`schedules.pipeline_schedule`)."""
    pipeline_passes: list[PipelineTimes] = field(default_factory=list)
    """Per pipeline, the pass times its schedule ran on (`schedule.timeline` redraws it)."""

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
        return self.cost_per_iteration_usd * 3600.0 / self.iteration_time_s

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
            "schedule": {"kind": self.schedule.kind.value, "virtual_stages": self.schedule.virtual_stages},
            "gpus": self.gpus,
            "mfu": self.mfu,
            "breakdown": {"pipeline": self.pipeline_s, "gradient_sync": self.gradient_sync_s,
                          "optimizer": self.optimizer_s},
            "pipeline_times_s": self.pipeline_times_s,
            "estimated": self.estimated,
            "replicas": [r.to_dict() for r in self.replicas],
        }


# ---- building blocks shared with the planner ------------------------------------------------------
Slot = Member  # where one replica runs: zone, GPU type, TP degree


def pipeline_arrays(ctx: SimContext, slots: list[Slot], stages, mbs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """Per-micro-batch forward, backward and boundary-transfer seconds of one 1F1B pipeline, arrays
    (P,), (P,), (P-1,), plus (bytes crossing zones, egress $) per micro-batch (`schedules.pipeline_times`
    for one chunk per stage; transfers by `schedules.link_transfer`)."""
    t = pipeline_times(ctx, slots, stages, mbs)
    return t.forward_s[:, 0], t.backward_s[:, 0], t.transfer_s, t.cross_zone_bytes, t.egress_usd


def optimizer_s(ctx: SimContext, slot: Slot, a: int, e: int) -> float:
    """Optimizer-step seconds of one replica holding layers [a, e)."""
    return ctx.profiles.optimizer_time_s(ctx.job, slot.gpu, ctx.stage_params(slot.tp, a, e))


def allreduce_s(ctx: SimContext, groups: list[Group], nbytes: float, t: int) -> float:
    """Seconds of one gradient all-reduce of `nbytes` (a replica's gradient, split in `t` shards, one
    per TP rank) across `groups`: the ring over the links (`allreduce_time_s`) divided by the
    calibrated all-reduce efficiency, and no faster than one GPU's shard (nbytes / t) at the slowest
    calibrated `allreduce_bytes_per_s` of the members (a rate that does not depend on the number of
    replicas, as measured on GH200; see calibration.py). 0 for a single member."""
    if sum(n for _, n in groups) < 2:
        return 0.0
    members = [r for r, _ in groups]
    ring = allreduce_time_s(groups, nbytes, ctx.network) / ctx.allreduce_efficiency(members)
    rate = ctx.allreduce_bytes_per_s(members)
    return max(ring, nbytes / t / rate) if rate is not None else ring


def stage_sync(ctx: SimContext, groups: list[Group], chunks: tuple[tuple[int, int], ...]) -> tuple[float, float, float]:
    """(seconds, bytes crossing zones, egress $) of the gradient all-reduce of the layer ranges
    `chunks` (one stage's, `Plan.stage_chunks`) across the replicas of that stage, given as (Slot,
    count) groups in ring order (`group_members`). Each of the t ranks all-reduces its own shard of
    params(stage, t) parameters (replicated norms and biases included), t = the finest common
    sharding's flow count (`allreduce_s`); a stage's chunks are reduced together."""
    key = ("stage_sync", tuple(groups), tuple(chunks))
    if key not in ctx.memo:
        t = min(r.tp for r, _ in groups)
        nbytes = t * sum(ctx.stage_params(t, a, e) for a, e in chunks) * ctx.job.state_bytes_per_param["gradients"]
        ctx.memo[key] = (allreduce_s(ctx, groups, nbytes, t), *ring_egress(groups, nbytes, ctx.network))
    return ctx.memo[key]


def tied_sync(ctx: SimContext, first: Slot, last: Slot, num_stages: int) -> tuple[float, float, float]:
    """(seconds, bytes crossing zones, egress $) of the all-reduce of tied embedding gradients between
    a pipeline's first and last stage (DeepSpeed ReduceTiedGrads); 0 for one stage or untied models."""
    if num_stages < 2 or not tied_embeddings(ctx.job.model):
        return 0.0, 0.0, 0.0
    key = ("tied_sync", first, last)
    if key not in ctx.memo:
        groups = group_members([first, last])
        t = min(first.tp, last.tp)
        nbytes = t * embedding_params(ctx.job.model, t) * ctx.job.state_bytes_per_param["gradients"]
        ctx.memo[key] = (allreduce_s(ctx, groups, nbytes, t), *ring_egress(groups, nbytes, ctx.network))
    return ctx.memo[key]


# ---- the simulation -------------------------------------------------------------------------------
def simulate(plan: Plan, ctx: SimContext, *, event: bool = True) -> Estimate:
    """Simulate one iteration of `plan`.

    Args:
        plan: the plan (assumed checked against ctx.job; see Plan.check_against).
        ctx: job, cluster, profiles, network.
        event: True for the event simulation of the plan's schedule, False for its closed form
            (planner fast path).
    Returns:
        Estimate with times (s), memory per GPU (bytes) and cost ($).
    """
    job, mbs = ctx.job, plan.micro_batch_size
    P = plan.num_stages
    sched = pipeline_schedule(plan)
    replicas: list[ReplicaEstimate] = []
    pipeline_times_s: list[float] = []
    passes: list[PipelineTimes] = []
    cache: dict[tuple, float] = {}
    egress_usd, cross_bytes = 0.0, 0.0
    slots = [[Slot(zone=r.zone, gpu=r.gpu, tp=r.tp) for r in p.replicas] for p in plan.pipelines]
    for j, pipe in enumerate(plan.pipelines):
        m = pipe.microbatches
        times = pipeline_times(ctx, slots[j], plan.stages, mbs, sched)
        passes.append(times)
        cross_bytes += times.cross_zone_bytes * m
        egress_usd += times.egress_usd * m
        key = (times.key, m, event)
        if key not in cache:
            cache[key] = sched.time_s(times, m, event=event)
        pipeline_times_s.append(cache[key])
        fwd, bwd = times.forward_s.sum(axis=1).tolist(), (times.backward_s + times.weight_s).sum(axis=1).tolist()
        sends = [float(times.transfer_s[i::P].sum()) for i in range(P)]  # outgoing, per micro-batch
        for i, r in enumerate(pipe.replicas):
            chunks = plan.stage_chunks(i)
            mkey = ("replica_memory", r.gpu, r.tp, mbs, chunks, i, P, m, sched)
            if mkey not in ctx.memo:  # identical replicas of other pipelines have the same memory
                ctx.memo[mkey] = replica_memory(ctx, r.gpu, r.tp, mbs, chunks, stage=i, num_stages=P, microbatches=m,
                                                schedule=sched)
            replicas.append(ReplicaEstimate(
                pipeline=j, stage=i, gpu=r.gpu, zone=r.zone, tp=r.tp, layers=(chunks[0][0], chunks[-1][1]),
                chunks=chunks, forward_s=fwd[i], backward_s=bwd[i], p2p_s=sends[i], sync_s=0.0,
                optimizer_s=sum(optimizer_s(ctx, slots[j][i], a, e) for a, e in chunks),
                memory=dataclasses.replace(ctx.memo[mkey]), memory_capacity_bytes=ctx.memory_capacity(r.gpu)))

    tied_s = 0.0
    for sl in slots:
        t, eb, eu = tied_sync(ctx, sl[0], sl[-1], P)
        tied_s = max(tied_s, t)
        cross_bytes += eb
        egress_usd += eu
    sync_times = []
    for i in range(P):
        t, eb, eu = stage_sync(ctx, group_members([sl[i] for sl in slots]), plan.stage_chunks(i))
        sync_times.append(t)
        cross_bytes += eb
        egress_usd += eu
    for rep in replicas:
        rep.sync_s = sync_times[rep.stage] + (tied_s if rep.stage in (0, P - 1) else 0.0)

    sync_s = tied_s + max(sync_times)
    iteration = max(pipeline_times_s) + sync_s + max(r.optimizer_s for r in replicas)
    gpu_usd_per_hour = sum(r.tp * ctx.cluster.price(r.zone, r.gpu) for p in plan.pipelines for r in p.replicas)
    model = job.model
    model_flop = 3.0 * job.global_batch_size * sum(model.forward_flop(i, tp=1, mbs=1, seq=job.seq)
                                                   for i in range(model.num_layers))
    peak = sum(r.tp * catalog.gpu(r.gpu).peak(job.precision) for p in plan.pipelines for r in p.replicas)
    return Estimate(
        iteration_time_s=iteration, pipeline_s=max(pipeline_times_s), gradient_sync_s=sync_s,
        optimizer_s=max(r.optimizer_s for r in replicas), pipeline_times_s=pipeline_times_s, replicas=replicas,
        global_batch_size=plan.global_batch_size, sequence_length=job.seq, gpus=plan.world_size,
        gpu_cost_per_iteration_usd=gpu_usd_per_hour * iteration / 3600.0, egress_per_iteration_usd=egress_usd,
        cross_zone_bytes=cross_bytes, model_flop_per_iteration=model_flop, peak_flop_per_s=peak,
        estimated=sorted(f"{g} TP {t}: {how}" for g, t, how in ctx.profiles.estimates_used
                         if any(r.gpu == g and r.tp == t for r in replicas)),
        schedule=sched, pipeline_passes=passes,
    )
