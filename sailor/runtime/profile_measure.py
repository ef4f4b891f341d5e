"""What one rank of `sailor profile` measures, on the runtime's own layers (`runtime.profiler`
starts the ranks and turns their figures into a profile file).

What is measured, for every TP degree t (with t processes, gloo on CPU / NCCL on CUDA) and every
micro-batch size b:
- forward and backward seconds of the runtime's embedding (layer 0), one block (layers 1..N all share
  its geometry, so one block is timed and its figures stand for every block; a mixture of experts
  mixing dense and MoE blocks times one of each, `layer_kinds`) and the head (final
  norm, LM head and the loss, which the runtime's last stage computes inside its forward);
- on CPU also the whole model as a run trains it: the runtime's own `run_pipeline` over
  RUNTIME_MICROBATCHES micro-batches of a one-stage replica (`_time_pipeline`), with the
  optimizer's layer hooks a training step runs inside its backward (`pass_optimizer`), its phase timers
  giving the whole model's forward and backward per micro-batch. Every layer time is scaled by that
  whole pass, less the runtime's fixed cost of a stage pass (measured apart, `runtime.profile_passes`,
  and charged by the simulator per chunk pass), over the sum of the separate ones (`profiler.pass_scale`,
  recorded under settings.pass_scale): a stage of a run pays the per-pass overhead once per micro-batch, not once per layer, and a TP
  replica's ranks meet only in the model's all-reduces, never in a barrier per pass. The call's wall
  time outside its phases (the 1F1B loop's bookkeeping) is the runtime's per-micro-batch overhead,
  `runtime.microbatch_overhead_s`, which the simulator adds to every stage's micro-batch. The
  separate layers are timed with their all-reduces, every rank starting together after a barrier, and the
  slowest rank's time kept (the others wait for it in a real run too);
- `warmup` untimed passes, then `repeats` timed ones: the median is the profile, the interquartile
  range its spread (`forward_spread_s`, `backward_spread_s`); the whole pass, which scales every
  layer, is timed `WHOLE_PASS_REPEATS` times as often, each repeat the slowest rank's row
  (`slowest_rows`), and its trimmed mean kept (`profiler.whole_stats`);
- the backward split as zero-bubble schedules run it (`_time_backward_split`): the input-gradient pass
  (`torch.autograd.grad` w.r.t. the layer's input, keeping the graph and the gradients reaching the
  weights' matmuls) and then the weight-gradient pass (`torch.autograd.grad` w.r.t. the weights from
  those gradients), each timed on its own with `torch.distributed.pipelining`'s `stage_backward_input`
  / `stage_backward_weight` (`backward_input_s`, `backward_weight_s`), in the same repeats as the
  forward and backward, so a drifting load moves all of them alike; on CPU each is scaled by the
  whole model's pass of its kind in the runtime's own `run_pipeline` under ZB-H1
  (`profiler.layer_row`), as the forward and backward are by the 1F1B run. The embedding has no input gradient (its input is
  token ids): its whole backward is the weight pass;
- activation bytes kept for backward per sample and layer (a saved-tensors hook sums the distinct
  tensors autograd keeps, parameters excluded), and the peak bytes allocated (CUDA) or the peak
  resident set of the process (CPU);
- the optimizer step as a training step runs it: `ShardedAdamW`'s norm clipping and AdamW update
  over the rank's TP shard of one block (`_optimizer_s_per_param`), at the first TP degree profiled,
  stored as seconds per parameter (the norm's scalar all-reduce over the ranks is not in it).

On CUDA the program is the runtime's: weights and activations in the compute dtype (bf16 for a bf16
job; no autocast), every span timed with CUDA events (`runtime.timing.Stopwatch`) after the ranks
met in a barrier, statistics all-reduced as tensors on the group's device (NCCL reduces CUDA tensors
only), and each rank's device chosen and checked by `runtime.device.rank_device`.
"""

from __future__ import annotations

import datetime as _dt
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sailor.runtime.ranks import rank_message
from sailor.specs.job import JobSpec


@dataclass
class _LayerResult:
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)


def layer_kinds(spec) -> list[str]:
    """The profiled kind whose figures stand for each layer of `spec`: "embedding", "block" (the
    blocks with the same MLP as block 1), "other block" (in a model mixing dense and MoE blocks,
    those with the other MLP), "head"."""
    first = spec.is_moe_block(1)
    blocks = ["block" if spec.is_moe_block(i) == first else "other block" for i in range(1, spec.num_layers - 1)]
    return ["embedding", *blocks, "head"]


def profiled_layers(spec) -> dict[str, int]:
    """Kind -> the one layer profiled for it (`layer_kinds`): its first layer."""
    out: dict[str, int] = {}
    for i, kind in enumerate(layer_kinds(spec)):
        out.setdefault(kind, i)
    return out


def _build_layer(job: JobSpec, index: int, tp_rank: int, tp: int, group, device, end: int | None = None):
    """Layer `index` (layers [index, end) when `end` is given) of the runtime's GPT, TP-sharded and
    initialised as a training run does (`build_layers`)."""
    return build_layers(job, ((index, index + 1 if end is None else end),), tp_rank, tp, group, device)


def build_layers(job: JobSpec, chunks, tp_rank: int, tp: int, group, device):
    """The layers of `chunks` (half-open layer ranges) of the runtime's GPT, TP-sharded, initialised
    as a training run does and cast to the profile's dtype (`profile_dtype`)."""
    import torch

    from sailor.runtime.model import GPT, init_param, on_meta
    from sailor.runtime.pipeline import build_stage
    from sailor.runtime.tensor_parallel import apply_tp
    from sailor.runtime.worker import materialize

    spec = job.model
    with on_meta():
        stage = GPT(spec)
    build_stage(stage, tuple(chunks))
    apply_tp(stage, tp_rank=tp_rank, tp=tp, group=group)
    materialize(stage, lambda n, s: init_param(n, s, seed=0, num_blocks=spec.num_blocks),
                tp_rank=tp_rank, tp=tp, device=device)
    dtype = profile_dtype(job.precision, device)
    with torch.no_grad():
        for p in stage.parameters():  # the runtime's weights are in the compute dtype (`ShardedAdamW`)
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return stage


def profile_dtype(precision: str, device) -> Any:
    """The weights' and activations' dtype a profile runs in: the runtime's compute dtype, fp32 on
    the CPU and the job's half precision on CUDA."""
    import torch

    if device.type != "cuda":
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def measure(job: JobSpec, o: dict, rank: int, tp: int, group, world: int, device) -> dict[str, Any]:
    """Everything rank `rank` of a `world`-process profile measures (module docstring), its TP group
    `group` of `tp` consecutive ranks, options `o` as `profiler.profile_rank` receives them: times
    keyed "kind/mbs" (and "model/mbs" for the whole pass: the row of the rank whose call took
    longest, `slowest_rows`), each the slowest rank's per repeat, with
    the whole pass's per-micro-batch overhead, activation bytes per sample by kind, the peak bytes
    and the optimizer's seconds per parameter."""
    import torch
    import torch.distributed as dist

    from sailor.runtime.tensor_parallel import head_loss

    spec, seq = job.model, job.seq
    from sailor.runtime.timing import Stopwatch

    cuda = device.type == "cuda"
    dtype = profile_dtype(job.precision, device)  # weights and activations, as the runtime trains
    autocast = _nullcontext  # no autocast: the runtime casts its weights instead
    watch = Stopwatch(device)  # CUDA events on a GPU (`runtime.timing`)
    # kind -> (first layer, end): one layer of each kind.
    kinds = {k: (i, i + 1) for k, i in profiled_layers(spec).items()}
    gen = torch.Generator(device="cpu").manual_seed(1234)
    out: dict[str, Any] = {"times": {}, "split": {}, "runtime_overhead_s": {}, "activation_bytes_per_sample": {},
                           "peak_bytes": 0}

    def finish() -> None:  # wait for this rank's device
        if cuda:
            torch.cuda.synchronize(device)

    def sync() -> None:  # and for every rank
        finish()
        if world > 1:
            dist.barrier()

    for kind, (index, end) in kinds.items():
        layer = _build_layer(job, index, rank % tp, tp, group, device, end)
        for mbs in o["mbs"]:
            tok = torch.randint(0, spec.vocab_size, (mbs, seq), generator=gen).to(device)
            act = torch.randn(mbs, seq, spec.hidden_size, generator=gen).to(device=device, dtype=dtype)

            def forward(layer=layer, tok=tok, act=act, mbs=mbs, kind=kind, inputs=None):  # bound now, not at call time
                if kind == "embedding":
                    return layer(tok)
                x = act.detach().requires_grad_()
                if inputs is not None:
                    inputs.append(x)
                with autocast():
                    y = layer(x)
                return head_loss(layer)(y, tok) * (1.0 / (mbs * seq)) if kind == "head" else y

            res = _LayerResult()
            params = [p for p in layer.parameters() if p.requires_grad]
            split_rows = []
            for r in range(o["warmup"] + o["repeats"]):
                layer.zero_grad(set_to_none=True)
                sync()
                watch.start()
                with autocast():
                    y = forward()
                forward_s = watch.stop()
                grad = None if y.dim() == 0 else torch.ones_like(y)
                sync()
                watch.start()
                torch.autograd.backward(y, grad)
                backward_s = watch.stop()
                # the split passes in the same repeat, so both see the same machine (its load drifts)
                split = _time_backward_split(layer, forward, params, sync, watch)
                if r >= o["warmup"]:
                    res.forward_s.append(forward_s)
                    res.backward_s.append(backward_s)
                    split_rows.append(split)
            # The slowest rank's pass is the replica's (the others wait for it in its all-reduces);
            # collectives on the group's device (NCCL takes CUDA tensors only).
            both = torch.tensor([res.forward_s, res.backward_s], dtype=torch.float64, device=device)
            if world > 1:
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
            out["times"][f"{kind}/{mbs}"] = both.tolist()
            split = torch.tensor(split_rows, dtype=torch.float64, device=device).T.contiguous()
            if world > 1:
                dist.all_reduce(split, op=dist.ReduceOp.MAX)
            out["split"][f"{kind}/{mbs}"] = split.tolist()  # [input-gradient passes, weight-gradient passes]
            if rank == 0:
                rank_message({"tick": 1})
        mbs = max(o["mbs"])
        saved = _saved_bytes(layer, lambda bound=layer: forward_for(bound, kind, job, mbs, device, autocast))
        out["activation_bytes_per_sample"][kind] = saved / mbs
        del layer
    if o.get("whole_pass"):
        from sailor.plan.orders import ScheduleKind
        from sailor.plan.spec import DEFAULT_SCHEDULE, Schedule

        model = _build_layer(job, 0, rank % tp, tp, group, device, spec.num_layers)
        for mbs in o["mbs"]:
            # (repeats, 4) each: forward, backward (W passes included), W passes, rest per micro-batch
            runs, split = (torch.tensor(_time_pipeline(model, job, o, rank, tp, world, mbs, device, autocast, sync, s,
                                                       group), dtype=torch.float64, device=device)
                           for s in (DEFAULT_SCHEDULE, Schedule(kind=ScheduleKind.ZB_H1)))
            if world > 1:
                runs, split = (slowest_rows(torch.stack(_all_gather(rows, world))) for rows in (runs, split))
            out["times"][f"model/{mbs}"] = runs[:, :2].T.tolist()
            out["runtime_overhead_s"][str(mbs)] = runs[:, 3].tolist()
            out["split"][f"model/{mbs}"] = [(split[:, 1] - split[:, 2]).tolist(), split[:, 2].tolist()]  # B, W
            if rank == 0:
                rank_message({"tick": 1})
        del model
    per_param = torch.tensor([_optimizer_s_per_param(job, o, rank, tp, world, group, device, sync)],
                             dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(per_param, op=dist.ReduceOp.MAX)
    out["optimizer_s_per_param"] = per_param.item()
    if cuda:
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    else:
        out["peak_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
    return out


def _time_backward_split(layer, forward: Callable[..., Any], params: list, sync: Callable[[], None],
                         watch) -> list[float]:
    """[input_gradient_s, weight_gradient_s] of one backward of `layer` (weights `params`), each
    pass timed alone, every rank starting it together (`sync`) and timed on its device by `watch`
    (`runtime.timing.Stopwatch`), as the forward and backward are: `stage_backward_input` (gradient
    w.r.t. the layer's input; the graph and the gradients flowing into the weights' operations are
    kept) then `stage_backward_weight` (the weights' gradients from those), as a zero-bubble schedule
    runs them. `forward(inputs=list)` runs the layer's forward (loss included for the head) and
    appends its input tensor; the embedding's input is token ids, so its input pass takes 0 s and its
    weight pass is the whole backward."""
    import torch
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    layer.zero_grad(set_to_none=True)
    inputs: list = []
    y = forward(inputs=inputs)
    grads = None if y.dim() == 0 else [torch.ones_like(y)]
    sync()
    watch.start()
    if inputs:
        _, groups = stage_backward_input([y], grads, inputs, iter(params))
    input_s = watch.stop() if inputs else 0.0
    sync()
    watch.start()
    if inputs:
        stage_backward_weight(iter(params), groups)
    else:
        torch.autograd.backward(y, None if grads is None else grads[0])
    return [input_s, watch.stop()]


RUNTIME_MICROBATCHES = 8
"""Micro-batches of one timed `run_pipeline` call in the profile: as many as the smallest pipeline of
the closed-loop benchmark's plans (64 samples in micro-batches of 4 over 2 pipelines), so a step's
fixed costs inside `run_pipeline` are spread as in a run."""


def _time_pipeline(model, job: JobSpec, o: dict, rank: int, tp: int, world: int, mbs: int, device, autocast,
                   sync, schedule, group=None) -> list[list[float]]:
    """Time the runtime's own training pass: `run_pipeline` in the order of `schedule` (a
    `plan.spec.Schedule` of one chunk: 1F1B, or ZB-H1 and its split backward) over
    RUNTIME_MICROBATCHES micro-batches of `mbs` samples on a one-stage replica holding the whole
    `model` (this rank's TP shard of it).

    Returns one row per timed repeat (`whole_pass_repeats` of `o["repeats"]`): [forward_s,
    backward_s, weight_s, rest_s] per micro-batch,
    where forward, backward (W passes included) and weight (the W passes alone, 0 unless the
    schedule splits the backward) are the runtime's own phase timers (`StageTimes`, what `sailor
    train --metrics` reports per stage) and rest is the call's wall time outside them: the loop's
    Python bookkeeping, input and target slicing, saving and popping micro-batch state, the final
    wait on sends. The replicas of a TP-1 profile run side by side without any collective between them, and
    the ranks of a TP group meet only in the model's own all-reduces: one barrier per call, none
    per pass, as in a training step.
    """
    import torch

    from sailor.plan.spec import Pipeline, Plan, Replica
    from sailor.runtime.executor import StageExecutor
    from sailor.runtime.pipeline import P2P, run_pipeline
    from sailor.runtime.tensor_parallel import head_loss
    from sailor.runtime.topology import derive_topology

    spec, seq, m = job.model, job.seq, RUNTIME_MICROBATCHES
    pipe = Pipeline(microbatches=m, replicas=(Replica(stage=0, gpu=o["gpu"], zone="profile", tp=tp),))
    plan = Plan(micro_batch_size=mbs, stages=((0, spec.num_layers),), pipelines=(pipe,) * (world // tp))
    role = derive_topology(plan).roles[rank]
    assert role.tp_rank == rank % tp and role.num_stages == 1, role
    p2p = P2P(role, shape=(mbs, seq, spec.hidden_size), device=device, timeout=_dt.timedelta(seconds=o["timeout_s"]))
    order = schedule.order(0, 1, m)
    alone = Plan(micro_batch_size=mbs, stages=plan.stages, pipelines=(pipe,))  # this replica without the others
    opt = pass_optimizer(model, derive_topology(alone).roles[rank % tp], order, group)
    executor = StageExecutor(model, opt, first_stage=True)
    gen = torch.Generator(device="cpu").manual_seed(4321)
    tok = torch.randint(0, spec.vocab_size, (m * mbs, seq + 1), generator=gen).to(device)  # (m·mbs, seq + 1)
    rows = []
    for r in range(o["warmup"] + whole_pass_repeats(o["repeats"])):
        model.zero_grad(set_to_none=True)  # as the optimizer leaves it at the end of a step
        sync()
        t0 = time.perf_counter()
        with autocast():
            _, times = run_pipeline([executor], role, p2p, order=order,
                                    inputs=lambda k: tok[k * mbs:(k + 1) * mbs, :-1],
                                    targets=lambda k: tok[k * mbs:(k + 1) * mbs, 1:], loss_fn=head_loss(model),
                                    loss_scale=1.0 / (m * mbs * seq))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        opt.reduce()  # waits for the sums over the TP group, outside the pass as a run's gradient sync is
        if r >= o["warmup"]:
            rest = wall - times.forward_s - times.backward_s  # >= 0: the phases lie inside the call
            rows.append([times.forward_s / m, times.backward_s / m, times.weight_s / m, rest / m])
    return rows


WHOLE_PASS_REPEATS = 3
"""Timed repeats of the whole pass (`_time_pipeline`) per repeat of a layer: the whole pass scales
every layer time of its row (`profiler.layer_row`), and one repeat's split between its forward and
backward phases moves far more than their sum does. On the testbed (`sailor.testbed`: `tiny`, the
0.3- and 0.15-core classes at TP 1, micro-batches 1 and 2, 2026-12-06) one repeat's forward per
micro-batch varied by 14-43 % (coefficient of variation over a profile's repeats), its backward by
4-20 %, their sum by 2-10 % (one process at full speed, without a quota: 2-9 %, each alike); with the
median of 10 repeats the model's forward at micro-batch 2 came out 7.7-10.4 ms (0.3 cores) and
17.0-21.9 ms (0.15 cores) in four profiles, with the trimmed mean of 30 (`profiler.whole_stats`)
7.5-8.8 and 17.3-17.8 ms in three."""


def whole_pass_repeats(repeats: int) -> int:
    """Timed repeats of the whole pass for `repeats` per layer (`WHOLE_PASS_REPEATS`)."""
    return WHOLE_PASS_REPEATS * repeats


def slowest_rows(rows):
    """The rows of the slowest rank, repeat by repeat: `rows` (ranks, repeats, 4) of `_time_pipeline`
    (forward, backward, weight, rest per micro-batch) -> (repeats, 4), each repeat the row of the
    rank whose call took longest (forward + backward + rest). Replicas of a TP-1 profile never wait
    for each other, and in a run only their whole steps meet (the gradient sync): a run waits for the
    slowest replica's step, not for one replica's forward and another's backward. Taking each column's
    maximum instead added the chance split of a repeat's time between its phases to both (one rank's
    slow forward, the other's slow backward): on the testbed's 0.3-core class (two replicas, five
    profiles) the column maxima's mean was 5-24 % above the slowest rank's forward, 1-10 % above
    its backward and 3-10 % above its sum. The ranks of a TP group wait for each other in every
    layer, so their rows are alike."""
    import torch

    total = rows[..., 0] + rows[..., 1] + rows[..., 3]  # (ranks, repeats)
    slowest = total.argmax(dim=0)  # (repeats,)
    return rows[slowest, torch.arange(rows.shape[1])]


def _all_gather(t, world: int) -> list:
    """`t` of every rank of the world, in rank order."""
    import torch
    import torch.distributed as dist

    every = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(every, t)
    return every


def pass_optimizer(model, role, order, tp_group=None):
    """The runtime's optimizer (`zero.ShardedAdamW`, ZeRO-0) over `model`, whose layer hooks the
    executor of the profile's whole pass calls as a training step's does: after each layer's backward
    its gradients go into the bucket buffers and are freed (`ZeroLayerHooks.after_backward`), work on
    the rank's own thread inside its backward that every run pays, at any data-parallel degree.
    `role` is this rank's in a plan of its replica alone: the buckets of parameters every rank of
    the replica holds whole are summed over its TP group (`tp_group`, the process group of this
    replica's ranks, whatever their numbers in the profile), as in a run; the others have one rank
    and no collective (`reduce` waits for those issued). Measured on the 2-core build
    machine, the `tiny` model unthrottled and quiet, per micro-batch of 1: backward 2.75 ms CPU
    without the hooks, 3.83 ms in `sailor train` of one rank (the forward 1.65 and 1.81). `order`: the
    pass's ops (`Schedule.order`), whose backwards per layer tell the hooks when a bucket is final.
    The model's parameters are cast to fp32 and back to the profile's dtype (the optimizer takes fp32
    weights)."""
    import torch

    from sailor.runtime.grad_sync import backwards_per_layer
    from sailor.runtime.optim import OptimConfig
    from sailor.runtime.zero import ShardedAdamW

    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.float()
    groups = {role.tp_group: tp_group} if role.tp > 1 else {}
    opt = ShardedAdamW(dict(model.named_parameters()), role, groups, zero=0, sequence_parallel=False, cfg=OptimConfig(),
                       dtype=dtype)
    opt.expect_backwards(backwards_per_layer(order, role.chunks))
    return opt


def forward_for(layer, kind: str, job: JobSpec, mbs: int, device, autocast):
    """One forward of a profiled layer on fresh inputs (tokens for the embedding, activations else)."""
    import torch

    from sailor.runtime.tensor_parallel import head_loss

    seq, spec = job.seq, job.model
    tok = torch.randint(0, spec.vocab_size, (mbs, seq)).to(device)
    with autocast():
        if kind == "embedding":
            return layer(tok)
        x = torch.randn(mbs, seq, spec.hidden_size, device=device, requires_grad=True)
        y = layer(x)
        return head_loss(layer)(y, tok) if kind == "head" else y


def _saved_bytes(layer, run_forward: Callable[[], Any]) -> float:
    """Bytes of the distinct tensors autograd saves for backward during `run_forward()`, parameters
    excluded (they are counted as weights, not activations)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run_forward()
    del y
    return float(sum(seen.values()))


def _optimizer_s_per_param(job: JobSpec, o: dict, rank: int, tp: int, world: int, group, device, sync) -> float:
    """Seconds per parameter of the runtime's update as a training step runs it: `ShardedAdamW`'s
    global-norm clipping and AdamW step (ZeRO-0, the compute dtype's master and gradient buffers) over
    this rank's TP shard of one block, the layer kind that holds nearly all parameters; the update is
    elementwise, so its time scales with the parameters a rank owns. Only one block is built: timing
    the whole model on one device would not fit a large model's states (issue #32). The clipping's
    all-reduce of one scalar over the profile's ranks is left out: its time is a collective's
    latency, not a cost per parameter, and divided by one block's parameters it came out as a
    per-parameter cost (the testbed's fast class, two ranks profiled at once, 2026-12-05: 1.2e-7 s
    per parameter against 2.3e-8 for the slow class measured alone at half its speed, so a
    data-parallel step of the `tiny` model was predicted 0.023 s, 20 %, too slow). The simulator
    charges no such scalar all-reduce."""
    import torch

    from sailor.plan.spec import Pipeline, Plan, Replica
    from sailor.runtime.optim import OptimConfig
    from sailor.runtime.timing import Stopwatch
    from sailor.runtime.topology import derive_topology
    from sailor.runtime.zero import ShardedAdamW

    spec = job.model
    layer = _build_layer(job, 1, rank % tp, tp, group, device)
    dtype = profile_dtype(job.precision, device)
    with torch.no_grad():  # ShardedAdamW takes fp32 weights and casts them itself
        for p in layer.parameters():
            p.data = p.data.float()
    params = dict(layer.named_parameters())
    pipe = Pipeline(microbatches=1, replicas=(Replica(stage=0, gpu=o["gpu"], zone="profile", tp=tp),))
    plan = Plan(micro_batch_size=1, stages=((0, spec.num_layers),), pipelines=(pipe,) * (world // tp))
    role = derive_topology(plan).roles[rank]
    cfg = OptimConfig()
    # ZeRO-0 on its own: no collective in the step but the norm's all-reduce over the world (a
    # scalar), as in a training step; `groups` is not used by clip and step.
    opt = ShardedAdamW(params, role, {}, zero=0, sequence_parallel=False, cfg=cfg, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(99)
    watch = Stopwatch(device)
    times = []
    for r in range(2 + o["repeats"]):
        for i, b in enumerate(opt.buckets):
            opt.grad[i] = (torch.randn(b.shard_numel, generator=gen) * 1e-3).to(device)
        sync()
        watch.start()
        opt.owned_norm_sq()  # clip's own work; its all-reduce of one scalar over the world is not timed
        opt.step()
        if r >= 2:
            times.append(watch.stop())
        else:
            watch.stop()
    n = sum(p.numel() for p in params.values())
    return statistics.median(times) / n


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
