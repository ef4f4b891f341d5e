"""The runtime's fixed cost of one stage pass, as `sailor profile` measures it on the CPU.

A stage pass (one chunk's forward or backward of one micro-batch) costs more than its layers: the
executor's start and end of a pass (the input made to require its gradient, the micro-batch's state
saved and popped, the phase clock), the send of its output or input gradient (`P2P.send`: the copy
into the sequence-major layout and the post to the post thread) and the work the transfers' threads
take from the pass while it runs. An interleaved stage of v chunks pays it v times per micro-batch
and direction where a 1F1B stage pays it once, whatever its layers.

What is measured (`rank_pass_overhead`): 2 x TP processes form one pipeline of 2 stages (TP `tp`
each) over the whole model, and run the runtime's own `run_pipeline` over `RUNTIME_MICROBATCHES`
micro-batches of `mbs` samples, alternately as 1F1B (stages [0, h) and [h, L)) and as
interleaved 1F1B with every layer (two at the end when L is odd) a chunk, so each stage holds v =
L // 2 chunks (`pass_plans`): the same layers per rank, the same micro-batches, v chunk passes per
micro-batch and direction in place of 1. The difference of the runtime's own phase timers
(`StageTimes.forward_s`, `backward_s`: what `sailor train --metrics` reports per stage), the slower
rank's, over the (v - 1) x micro-batches extra passes is the fixed cost of one forward and one
backward pass (`pass_overhead_s`). The layers' own time cancels out of the difference, so the
figure holds nothing of them.

`profiler.profile_job` records the figures as `runtime.pass_overhead_s` of the profile, takes them
out of the whole pass before scaling the layers by it (`profiler.layer_row`), and the simulator
charges them once per chunk pass (`SimContext.stage_compute_s`).

The same runs also time the runtime's pipeline transfers (`transfer_latencies`): each op's trace
(`pipeline.OpTrace`, the host's monotonic clock, shared by the processes) gives when a message was
sent (its sender's pass ended) and when its receiver had it; where the receiver was already waiting,
the difference is the transfer's latency. In the two plans above (a run: the sender goes on
computing its next pass while its message leaves) and in a third, the 1F1B plan with one
micro-batch (`idle_plan`: the sender then waits too), the mean over the repeats of each. Their
difference is what a run adds to every pipeline transfer beyond the transfer between idle ranks
(which is what `sailor profile network` prices): `profiler.profile_job` records it as
`runtime.p2p_overhead_s`, and the simulator adds it to every pipeline transfer at either end of
the class (`SimContext.p2p_overhead_s`). On the testbed (`sailor.testbed`), where a rank's
communication threads get a core only between the reserved compute threads of the ranks, one 64
KiB activation between two stages of one node took 2.1 ms (median; 0.4-6 ms between the 10th and
90th percentiles) in a run, against ~0.4 ms between idle ranks.
"""

from __future__ import annotations

import datetime as _dt
import statistics
from collections.abc import Sequence
from typing import Any

from sailor.plan.orders import BWD, FWD, ScheduleKind
from sailor.plan.spec import Pipeline, Plan, Replica, Schedule
from sailor.specs.job import JobSpec

MIN_LAYERS = 4
"""Layers a model needs for the measurement: two chunks per stage of a 2-stage pipeline."""


def pass_plans(num_layers: int, *, tp: int, mbs: int, microbatches: int, gpu: str) -> tuple[Plan, Plan, int]:
    """(1F1B plan, interleaved plan, v): one pipeline of 2 stages of TP `tp` over `num_layers` layers,
    `microbatches` micro-batches of `mbs`; the interleaved plan cuts the layers into 2·v chunks of
    one layer (the last one two when `num_layers` is odd), v = num_layers // 2, and the 1F1B plan
    gives each stage as many layers as it holds in the interleaved one (stage 0: its v chunks of one
    layer, the embedding and v - 1 blocks; stage 1 the rest)."""
    assert num_layers >= MIN_LAYERS, num_layers
    v = num_layers // 2
    chunks = [(i, i + 1) for i in range(2 * v - 1)] + [(2 * v - 1, num_layers)]
    pipe = Pipeline(microbatches=microbatches,
                    replicas=tuple(Replica(stage=i, gpu=gpu, zone="profile", tp=tp) for i in range(2)))
    one = Plan(micro_batch_size=mbs, stages=((0, v), (v, num_layers)), pipelines=(pipe,))
    interleaved = Plan(micro_batch_size=mbs, stages=tuple(chunks), pipelines=(pipe,),
                       schedule=Schedule(kind=ScheduleKind.INTERLEAVED, virtual_stages=v))
    return one, interleaved, v


def idle_plan(one: Plan) -> Plan:
    """`one` (the 1F1B plan of `pass_plans`) with a single micro-batch: every transfer then leaves a
    sender that has nothing else to run and reaches a receiver that waits for it."""
    return one.model_copy(update={"pipelines": (one.pipelines[0].model_copy(update={"microbatches": 1}),)})


def transfer_latencies(stages: Sequence[Sequence[Sequence[Any]]], v: int) -> list[float]:
    """Seconds from a pipeline message's send to its arrival, for every message whose receiver was
    already waiting for it, in one step of one pipeline.

    Args:
        stages: stages[i][r] = the `pipeline.OpTrace`s of one step of rank r of stage i (its TP ranks;
            p = len(stages) stages in all), in the host's clock.
        v: chunks per stage (virtual stage u = c·p + i holds chunk c of stage i).
    Returns:
        One latency per (receiving rank, received op) whose op began (`start_s`) before the message
        was sent: its `ready_s` less the send, the last `end_s` of the matching op among the sending
        stage's ranks (a forward of virtual stage u receives from u - 1's forward of the same
        micro-batch, a backward from u + 1's backward). Receivers that began later waited for their
        own turn, not for the transfer, and are left out. Every latency of a real trace is positive:
        a sender reads its `end_s` before posting its sends, and a receiver its `ready_s` once it
        has its input from every rank of the sending stage (its slice, then the TP gather).
    """
    p = len(stages)
    ends: dict[tuple[int, str, int, int], float] = {}
    for i, ranks in enumerate(stages):
        for ops in ranks:
            for op in ops:
                key = (i, op.kind, op.chunk, op.micro_batch)
                ends[key] = max(ends.get(key, op.end_s), op.end_s)
    out = []
    for i, ranks in enumerate(stages):
        for ops in ranks:
            for op in ops:
                if not op.received or op.kind not in (FWD, BWD):
                    continue
                src = op.chunk * p + i + (-1 if op.kind == FWD else 1)
                assert 0 <= src < p * v, (op, p, v)
                sent = ends[(src % p, op.kind, src // p, op.micro_batch)]
                if op.start_s < sent:
                    out.append(op.ready_s - sent)
    return out


def mean_latency_s(latencies: Sequence[float]) -> float:
    """Mean of transfer latencies in seconds (`transfer_latencies`), 0 when there are none. The mean,
    not the median: the schedule pays every transfer's delay, and the latencies are skewed."""
    return statistics.fmean(latencies) if latencies else 0.0


def p2p_overhead_s(run: Sequence[float], idle: Sequence[float]) -> float:
    """Seconds a run adds to each pipeline transfer: the `mean_latency_s` of the `run` latencies less
    that of the `idle` ones; 0 when negative (noise) or when either is empty."""
    if not run or not idle:
        return 0.0
    return max(0.0, mean_latency_s(run) - mean_latency_s(idle))


def pass_overhead_s(one: list[float], interleaved: list[float], v: int, microbatches: int) -> float:
    """Seconds one chunk pass costs beyond its layers: (interleaved - 1F1B) / ((v - 1)·microbatches),
    the phase's seconds per step of one rank under each plan of `pass_plans`; 0 when the difference
    is negative (noise: a pass costs no less than its layers)."""
    assert v >= 2 and microbatches >= 1, (v, microbatches)
    return max(0.0, (interleaved - one) / ((v - 1) * microbatches))


def rank_pass_overhead(rank: int, world: int, port: int, o: dict[str, Any]) -> None:
    """One of the 2·TP ranks of the measurement (run by `ranks.run_ranks`; module docstring): for each
    micro-batch size in `o["mbs"]`, `o["warmup"]` untimed and `o["repeats"]` timed repeats, each
    running the 1F1B plan, the interleaved one and the one-micro-batch one (`idle_plan`); rank 0
    reports, per size, the slower rank's [1F1B forward, 1F1B backward, interleaved forward,
    interleaved backward] seconds per step of each repeat, and the transfer latencies
    (`transfer_latencies`) of the first two plans ("run") and of the third ("idle"), as one message
    {"pass_overhead": {mbs: rows}, "p2p_latency": {mbs: {"run": [s...], "idle": [s...]}}}."""
    import torch
    import torch.distributed as dist

    from sailor.runtime.profile_measure import RUNTIME_MICROBATCHES
    from sailor.runtime.ranks import init_rank, rank_message

    job = JobSpec.model_validate(o["job"])
    torch.set_num_threads(o["threads"])
    init_rank(rank, world, port, "gloo", o["timeout_s"])
    tp = world // 2
    tp_groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(2)]  # every rank makes both
    out, latency = {}, {}
    for mbs in o["mbs"]:
        one, interleaved, v = pass_plans(job.model.num_layers, tp=tp, mbs=mbs, microbatches=RUNTIME_MICROBATCHES, gpu=o["gpu"])
        plans = (one, interleaved, idle_plan(one))
        runs = [_PlanRun(job, plan, rank, tp_groups[rank // tp], mbs, o["timeout_s"]) for plan in plans]
        rows, traces = [], [[] for _ in runs]  # traces[plan][repeat]: this rank's ops of one step
        for r in range(o["warmup"] + o["repeats"]):
            timed = r >= o["warmup"]
            row = []
            for run, kept in zip(runs, traces):
                trace: list = []
                row += run.step(trace)
                if timed:
                    kept.append(trace)
            if timed:
                rows.append(row[:4])
        slowest = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[str(mbs)] = slowest.tolist()
        every: list = [None] * world
        dist.all_gather_object(every, (runs[0].role.stage, traces))
        if rank == 0:
            lat = []
            for plan, chunks in enumerate((1, v, 1)):
                lat.append([x for rep in range(len(rows)) for x in transfer_latencies(
                    [[t[plan][rep] for s, t in every if s == i] for i in range(2)], chunks)])
            latency[str(mbs)] = {"run": lat[0] + lat[1], "idle": lat[2]}
        del runs
    if rank == 0:
        rank_message({"pass_overhead": out, "p2p_latency": latency})
    dist.barrier()  # every rank is past its last collective before any exits


class _PlanRun:
    """This rank's stage of `plan` (a `pass_plans` plan), built as a run builds it, with the channels,
    optimizer hooks and executors `run_pipeline` needs; `step()` runs one step's passes."""

    def __init__(self, job: JobSpec, plan: Plan, rank: int, tp_group, mbs: int, timeout_s: float) -> None:
        import torch

        from sailor.runtime.executor import StageExecutor
        from sailor.runtime.groups import create_channel_groups
        from sailor.runtime.pipeline import P2P
        from sailor.runtime.profile_measure import build_layers, pass_optimizer
        from sailor.runtime.schedule import runtime_schedule, step_rounds
        from sailor.runtime.tensor_parallel import head_loss
        from sailor.runtime.topology import derive_topology

        spec, seq, device = job.model, job.seq, torch.device("cpu")
        topo = derive_topology(plan)
        self.role = role = topo.roles[rank]
        timeout = _dt.timedelta(seconds=timeout_s)
        self.p2p = P2P(role, shape=(mbs, seq, spec.hidden_size), device=device, timeout=timeout,
                       channels=create_channel_groups(topo, timeout), tp_group=tp_group)
        self.model = build_layers(job, role.chunks, role.tp_rank, role.tp, tp_group, device)
        self.order = runtime_schedule(plan).order(role.stage, role.num_stages, step_rounds(plan, role))
        self.opt = pass_optimizer(self.model, role, self.order, tp_group)
        self.executors = [StageExecutor(self.model, self.opt, first_stage=role.is_first_stage and c == 0, layers=chunk)
                          for c, chunk in enumerate(role.chunks)]
        m = role.microbatches
        gen = torch.Generator(device="cpu").manual_seed(4321)
        self.tok = torch.randint(0, spec.vocab_size, (m * mbs, seq + 1), generator=gen)  # (m·mbs, seq + 1)
        self.mbs, self.loss_fn, self.loss_scale = mbs, head_loss(self.model), 1.0 / (m * mbs * seq)

    def step(self, trace: list | None = None) -> tuple[float, float]:
        """(forward_s, backward_s) of this rank's passes in one step (`StageTimes`); `trace` gets the
        step's `pipeline.OpTrace`s (`run_pipeline`)."""
        from sailor.runtime.pipeline import run_pipeline

        tok, mbs = self.tok, self.mbs
        self.model.zero_grad(set_to_none=True)  # as the optimizer leaves it at the end of a step
        _, times = run_pipeline(self.executors, self.role, self.p2p, order=self.order,
                                inputs=lambda k: tok[k * mbs:(k + 1) * mbs, :-1],
                                targets=lambda k: tok[k * mbs:(k + 1) * mbs, 1:], loss_fn=self.loss_fn,
                                loss_scale=self.loss_scale, trace=trace)
        self.opt.reduce()
        return times.forward_s, times.backward_s
