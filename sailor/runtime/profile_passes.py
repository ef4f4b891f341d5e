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
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from sailor.plan.orders import ScheduleKind
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


def pass_overhead_s(one: list[float], interleaved: list[float], v: int, microbatches: int) -> float:
    """Seconds one chunk pass costs beyond its layers: (interleaved - 1F1B) / ((v - 1)·microbatches),
    the phase's seconds per step of one rank under each plan of `pass_plans`; 0 when the difference
    is negative (noise: a pass costs no less than its layers)."""
    assert v >= 2 and microbatches >= 1, (v, microbatches)
    return max(0.0, (interleaved - one) / ((v - 1) * microbatches))


def rank_pass_overhead(rank: int, world: int, port: int, o: dict[str, Any]) -> None:
    """One of the 2·TP ranks of the measurement (run by `ranks.run_ranks`; module docstring): for each
    micro-batch size in `o["mbs"]`, `o["warmup"]` untimed and `o["repeats"]` timed repeats, each
    running the 1F1B plan then the interleaved one; rank 0 reports, per size, the slower rank's
    [1F1B forward, 1F1B backward, interleaved forward, interleaved backward] seconds per step of each
    repeat as one message {"pass_overhead": {mbs: rows}}."""
    import torch
    import torch.distributed as dist

    from sailor.runtime.profile_measure import RUNTIME_MICROBATCHES
    from sailor.runtime.ranks import init_rank, rank_message

    job = JobSpec.model_validate(o["job"])
    torch.set_num_threads(o["threads"])
    init_rank(rank, world, port, "gloo", o["timeout_s"])
    tp = world // 2
    tp_groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(2)]  # every rank makes both
    out = {}
    for mbs in o["mbs"]:
        plans = pass_plans(job.model.num_layers, tp=tp, mbs=mbs, microbatches=RUNTIME_MICROBATCHES, gpu=o["gpu"])[:2]
        runs = [_PlanRun(job, plan, rank, tp_groups[rank // tp], mbs, o["timeout_s"]) for plan in plans]
        rows = []
        for r in range(o["warmup"] + o["repeats"]):
            row = [s for run in runs for s in run.step()]
            if r >= o["warmup"]:
                rows.append(row)
        slowest = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[str(mbs)] = slowest.tolist()
        del runs
    if rank == 0:
        rank_message({"pass_overhead": out})
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

    def step(self) -> tuple[float, float]:
        """(forward_s, backward_s) of this rank's passes in one step (`StageTimes`)."""
        from sailor.runtime.pipeline import run_pipeline

        tok, mbs = self.tok, self.mbs
        self.model.zero_grad(set_to_none=True)  # as the optimizer leaves it at the end of a step
        _, times = run_pipeline(self.executors, self.role, self.p2p, order=self.order,
                                inputs=lambda k: tok[k * mbs:(k + 1) * mbs, :-1],
                                targets=lambda k: tok[k * mbs:(k + 1) * mbs, 1:], loss_fn=self.loss_fn,
                                loss_scale=self.loss_scale)
        self.opt.reduce()
        return times.forward_s, times.backward_s
