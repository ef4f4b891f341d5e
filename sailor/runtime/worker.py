"""One rank of `sailor train`: the training loop torchrun starts (`python -m sailor.runtime.worker`).

Order of construction (fixed; each step is its own function; steps 2-5 are `build_rank`, which reads
this stage's memory options `mem = role.memory` (`topology.stage_memory`, the runtime's one reader of them), and
the schedule, `schedule.runtime_schedule(plan)`, the runtime's one reader of it):
1. `derive_topology(plan)`: this rank's role; `create_groups`: the torch groups; `create_sync_lanes`: under
   gloo, the gradient-sync groups' lanes; `create_channel_groups`: one 2-rank group per pipeline channel
   (`messages`).
2. `GPT(spec)` on the `meta` device -> `build_stage` (keep this stage's layers: its chunks under
   interleaving) -> `apply_tp` (with `mem.sequence_parallel`) -> `apply_recompute` (`mem.recompute`,
   `mem.recompute_blocks`, counted over the stage's blocks in layer order).
3. `ShardedAdamW` built over the meta parameters (`mem.zero`, the compute dtype, the tied embedding's
   transfers `tied.tied_for_rank`): the buckets, no state yet.
4. Layer by layer: `materialize_shards` gives the layer's parameters on the device in fp32, this TP
   rank's shards (seeded init; a checkpoint's entries, `checkpoint_io.Reader`; or --init-from, read
   from Hugging Face safetensors), then `ShardedAdamW.adopt` takes them over (fp32 master where
   needed, Adam moments from the checkpoint or zeros, weights cast to bf16 under mixed precision,
   freed under ZeRO-3) before the next layer is materialised: start-up peaks at the steady state
   plus one layer.
5. One `StageExecutor` per chunk (the optimizer's layer hooks around each layer) and the stage's
   op order under the schedule (`Schedule.order`); `P2P` in the compute dtype.
Each step: stop check (all ranks agree) -> `train_step`: the schedule's order over this pipeline's
micro-batches (under ZeRO-2/3 as many rounds as the largest share; losses summed on the device;
each gradient bucket's sample-weighted SUM issued asynchronously once final, `runtime.grad_sync`) ->
`reduce` (waits for every SUM, then the tied embedding's and LM head's gradients added to each other)
-> global-norm clipping -> AdamW at the recipe's learning rate of the step (`specs.recipe.learning_rate`, 1-based
step numbers, so a resumed run goes on at the rate its step has), or under fp16 a skipped step when some gradient overflowed
(`runtime.scaler`) -> metrics (loss, read once per step; timings; fp16: "loss_scale" and "skipped")
to rank 0. After every `recipe.eval.every` steps, `evaluation.eval_loss`: the held-out batches through
the same pipeline, forwards only, the loss taken on each pipeline's last stage as in training; the
step's record gets `eval_loss`. Checkpoints every
`--checkpoint-every` steps (default: the recipe's `checkpoint.every`), at the end and on stop; rank 0
then deletes all but the newest `recipe.checkpoint.keep` (`checkpoint.prune`).

`_train` forms the groups and builds the stage; `run_steps` is the step loop, which
`runtime.inplace` also runs on the stage it built from state moved in memory (a `Live`).

Its settings come from its command line, read by `command.parse` (`command.WorkerSettings`, the one
definition every launch path builds commands from). Rank 0 appends each step's record to `--metrics`,
writes TensorBoard scalars (`--tensorboard`) and prints a progress line every `--log-every` steps on
stdout (`metrics.StepLog`), so a run without a launcher reading its events (`sailor launch`) keeps
them too.

Rank 0 reports to the launcher with single stdout lines `SAILOR_EVENT <json>`: {"event": "started"}
once the process groups are up, {"event": "loaded", "step"} once the weights are in place,
{"event": "step", ...} per step (per stage, MAX over its ranks: `forward_s`, `backward_s`, `wait_s`,
`sync_update_s` from the backward's end to the update's, `sync_exposed_s` the part of it spent waiting
for the gradient collectives), {"event": "checkpoint", "step", "path"}, {"event": "stopped", "step", "checkpoint"},
{"event": "done", "step"}; any rank reports {"event": "error", "rank", "error", "peer_lost"} before exiting 1.
In the first step of a launch every rank reports {"event": "memory", "rank", "stage", "pipeline", "tp",
"params", "grads", "optimizer" (bytes held after the last backward, `ShardedAdamW.held_bytes`),
"activations" ({layer: bytes micro-batch 0 keeps for its backward}, `executor.ActivationMeter`)}.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from sailor.core.process import die_with_parent

if __name__ == "__main__":  # a rank: it ends with torchrun even when torchrun dies during torch's imports (seconds)
    die_with_parent()

import torch  # noqa: E402 - after the line above
import torch.distributed as dist
from torch import nn

from sailor.core.errors import SailorInputError, SailorWarning
from sailor.core.fileio import check_output_path
from sailor.model.hf_files import RECORD_KEY, source_record
from sailor.model.spec import ModelSpec
from sailor.perf.network import backend_for
from sailor.plan import load_plan
from sailor.plan.comms import STAGE_FIELDS, step_statistics_elements
from sailor.plan.orders import Op
from sailor.plan.spec import Plan
from sailor.runtime import checkpoint as ckpt
from sailor.runtime import evaluation
from sailor.runtime.balance import LoadBalancing, load_balancing
from sailor.runtime.checkpoint_io import RankWriter, Reader
from sailor.runtime.command import WorkerSettings, checkpoint_every_for, parse
from sailor.runtime.data import batch_tokens, load_corpus
from sailor.runtime.device import rank_device
from sailor.runtime.executor import ActivationMeter, StageExecutor
from sailor.runtime.grad_sync import backwards_per_layer
from sailor.runtime.groups import create_channel_groups, create_groups, create_sync_lanes, ignore_tags
from sailor.runtime.messages import ACTIVATION, GRADIENT
from sailor.runtime.metrics import StepLog, check_tensorboard
from sailor.runtime.model import GPT, initial_value, on_meta, param_shapes
from sailor.runtime.moe import apply_ep
from sailor.runtime.optim import optim_config
from sailor.runtime.pipeline import P2P, StageTimes, build_stage, run_pipeline
from sailor.runtime.recompute import apply_recompute
from sailor.runtime.scaler import LossScaler, overflowed
from sailor.runtime.schedule import runtime_schedule, step_rounds
from sailor.runtime.sync import barrier
from sailor.runtime.tensor_parallel import apply_tp, head_loss, materialize_shards, shard, sliced_edges
from sailor.runtime.tied import tied_for_rank
from sailor.runtime.topology import RankRole, derive_topology
from sailor.runtime.validate import check_device_precision, check_plan_for_job
from sailor.runtime.zero import ShardedAdamW, compute_dtype
from sailor.specs import load_job
from sailor.specs.job import JobSpec

EVENT_PREFIX = "SAILOR_EVENT "
FAULT_ENV = "SAILOR_FAULT"  # test hook: "<rank>:<step>" makes that rank die (exit 13) at that step
SLOW_WRITER_ENV = "SAILOR_SLOW_WRITER"  # test hook: "<rank>:<seconds>" delays that rank's checkpoint writer


def emit(event: str, **fields: Any) -> None:
    """One event line for the launcher on stdout (`say`)."""
    say(EVENT_PREFIX + json.dumps({"event": event, **fields}))


def say(text: str) -> None:
    """One line on stdout, written with one write(2): the ranks of a node share the pipe, and a line
    written in pieces (print writes the newline apart, unbuffered) can interleave with another
    rank's and be lost. Lines stay under PIPE_BUF (4096 bytes), which a pipe writes atomically."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())



def materialize(stage: nn.Module, full_value, *, tp_rank: int, tp: int, device: torch.device) -> None:
    """Allocate `stage`'s (meta) parameters on `device` and fill each with TP rank `tp_rank`'s shard
    of `full_value(name, full_shape)`, the parameter's full tensor."""
    materialize_shards(stage, lambda name, dim, full: shard(full_value(name, full), dim, tp_rank, tp), tp=tp,
                       device=device)


def model_layout(spec: ModelSpec) -> dict[str, list[int]]:
    """Every canonical parameter of the model with its full (unsharded) shape: what a checkpoint
    must cover, whatever the plan (`model.param_shapes`, as lists)."""
    return {n: list(shape) for n, shape in param_shapes(spec).items()}


def save_checkpoint(root: Path, step: int, meta: dict[str, Any], opt: ShardedAdamW, role: RankRole,
                    device: torch.device, layout: dict[str, list[int]]) -> Path:
    """Collective over all ranks: write checkpoint `step` (layout in `sailor.runtime.checkpoint`).
    Every rank streams the elements it owns (`ShardedAdamW.checkpoint_entries`) to its own file, in
    parallel and without any collective; a blocking barrier waits for all of them before rank 0
    commits (coverage of `layout` checked, manifest, rename), and another before any rank goes on."""
    rank = dist.get_rank()
    if rank == 0:
        ckpt.prepare_tmp(root, step)
    barrier(device)  # the temporary folder exists before anyone writes into it
    writer = RankWriter(ckpt.tmp_dir(root, step), rank,
                        {"stage": role.stage, "pipeline": role.pipeline, "tp_rank": role.tp_rank})
    slow = os.environ.get(SLOW_WRITER_ENV, "")
    if slow.startswith(f"{rank}:"):
        time.sleep(float(slow.split(":", 1)[1]))
    for entry in opt.checkpoint_entries():
        writer.add(*entry)
    writer.close()
    barrier(device)  # every rank's files are on disk
    path = ckpt.step_dir(root, step)
    if rank == 0:
        ckpt.commit(root, step, meta, layout=layout, keys=["param", *ckpt.OPTIMIZER_KEYS] if opt.steps else ["param"],
                    world_size=dist.get_world_size())
    barrier(device)  # the checkpoint is in place before any rank goes on (or exits)
    return path


def meta_stage(spec: ModelSpec, role: RankRole, tp_group=None, ep_group=None) -> nn.Module:
    """Step 2 of the order of construction up to recompute: `GPT(spec)` on the `meta` device (`on_meta`), cut to
    the role's layer chunks (`build_stage`), its MoE MLPs cut to the experts of the role's EP rank
    (`moe.apply_ep`, dispatching over `ep_group`) and TP-sharded (`apply_tp`, with the stage's
    sequence parallelism, over `tp_group`). Its parameters are this rank's TP shards by canonical
    name, in the order the optimizer buckets them; no memory is allocated and no process group is
    touched (None will do as either group for shapes only: `reshard` reads a plan's holdings from it)."""
    with on_meta():
        stage = GPT(spec)
    build_stage(stage, role.chunks)
    if spec.moe is not None:
        apply_ep(stage, role, spec.moe.num_experts, ep_group)
    return apply_tp(stage, tp_rank=role.tp_rank, tp=role.tp, group=tp_group,
                    sequence_parallel=role.memory.sequence_parallel)


@dataclass
class RankModel:
    """One rank's built stage (`build_rank`)."""

    stage: nn.Module
    optimizer: ShardedAdamW
    executors: list[StageExecutor]  # one per chunk of the stage
    order: list[Op]  # this stage's ops per step: the schedule's order over `rounds` micro-batches
    dtype: torch.dtype  # the weights' and activations' compute dtype
    rounds: int  # micro-batch rounds per step (`schedule.step_rounds`)


def build_rank(plan: Plan, job: JobSpec, role: RankRole, groups: dict, *, device: torch.device, seed: int,
               reader: Reader | None = None, init_from: str | None = None, step: int = 0,
               dtype: torch.dtype | None = None, lanes: dict | None = None) -> RankModel:
    """Steps 2-5 of the order of construction (module docstring) for this rank's stage, layer by
    layer: each layer's parameters are materialised on `device` in fp32 (this TP rank's shards),
    handed to the optimizer (`ShardedAdamW.adopt`: fp32 master and moments of the owned ranges, the
    weights cast to the compute dtype, freed under ZeRO-3) before the next layer's, so the peak is
    the steady state plus one layer. Values from `reader` (a checkpoint, with its Adam moments);
    else `init_from`, a Hugging Face model folder; else the seeded initial weights. `step`: the
    optimizer steps the checkpoint's run took (`checkpoint.optimizer_steps`: fp16's skipped steps
    do not count), which Adam's bias correction goes on from. `reader` may be any object with the
    Reader's `shard(name, key, tp_rank, tp)` and `held_keys()` (`reshard.ReceivedState`: pieces
    received from live ranks). `dtype` overrides the compute dtype of
    `job.precision` on `device` (tests run bf16 on CPU with it). `lanes`: the gradient-sync groups'
    lanes (`groups.create_sync_lanes`; None: none)."""
    spec, mem = job.model, role.memory
    stage = meta_stage(spec, role, groups.get(role.tp_group), groups.get(role.ep_group))
    apply_recompute(stage, mem)
    dtype = dtype or compute_dtype(job.precision, device)
    tied = tied_for_rank(spec, plan, derive_topology(plan), role.rank)
    opt = ShardedAdamW(dict(stage.named_parameters()), role, groups, zero=mem.zero,
                       sequence_parallel=mem.sequence_parallel, cfg=optim_config(job.recipe.optimizer), dtype=dtype,
                       tied=tied, device=device, reshard_after_forward=mem.reshard_after_forward, lanes=lanes)
    tp_rank, tp = role.tp_rank, role.tp
    weights = None
    if reader is not None:
        def value(name, dim, full):
            return reader.shard(name, "param", tp_rank, tp)
    elif init_from is not None:
        from sailor.runtime.hf_weights import (
            HFWeights,  # safetensors: only when asked for
        )
        weights = HFWeights(init_from, spec)

        def value(name, dim, full):
            return weights.read(name, dim, tp_rank, tp, full)
    else:
        def value(name, dim, full):
            return shard(initial_value(spec, name, full, seed=seed), dim, tp_rank, tp)
    moments = reader is not None and ckpt.OPTIMIZER_KEYS[0] in reader.held_keys()
    assert moments or step == 0, step  # a checkpoint written before the first optimizer step has no moments
    for key, layer in stage.layers.items():
        prefix = f"layers.{key}."
        materialize_shards(layer, value, tp=tp, device=device, prefix=prefix)
        params = dict(layer.named_parameters(prefix=prefix.rstrip(".")))
        opt.adopt(int(key), params, (lambda k, names=tuple(params): {n: reader.shard(n, k, tp_rank, tp) for n in names})
                  if moments else None)
    if weights is not None:
        weights.close()
    opt.steps = step
    rounds = step_rounds(plan, role)
    executors = [StageExecutor(stage, opt, first_stage=role.is_first_stage and c == 0, layers=chunk)
                 for c, chunk in enumerate(role.chunks)]
    order = runtime_schedule(plan).order(role.stage, role.num_stages, rounds)
    opt.expect_backwards(backwards_per_layer(order, role.chunks))  # overlapped gradient reduction
    return RankModel(stage, opt, executors, order, dtype, rounds)


@dataclass
class StepResult:
    """What one `train_step` did on this rank."""

    loss_sum: torch.Tensor  # () fp64 on the device: this pipeline's loss sum (nats; 0 off the head's stage)
    times: StageTimes
    grad_norm: float  # the world's unscaled gradient norm before clipping (inf or NaN on an overflow)
    skipped: bool  # fp16 overflow: no update was made


def sync_exposed_s(opt: ShardedAdamW) -> float:
    """Seconds of the last step's gradient sync that did not hide under the backward: from the end of
    the stage's last backward to every collective waited on (`grad_sync.SyncTimeline`); 0 when the
    step recorded no backward end (the optimizer was not told its backward counts)."""
    tl = opt.last_timeline.seconds() if opt.last_timeline is not None else None
    if tl is None or tl["backward_end_s"] is None:
        return 0.0
    return max(0.0, tl["waited_s"] - tl["backward_end_s"])


def train_step(rk: RankModel, role: RankRole, p2p: P2P, tok: torch.Tensor, *, mbs: int, loss_scale: float,
               scaler: LossScaler | None, meter: ActivationMeter | None = None,
               after_backward: Callable[[], None] | None = None, lr: float | None = None,
               balance: LoadBalancing | None = None) -> StepResult:
    """One optimizer step of this rank on its (n_local, T + 1) tokens `tok`: the schedule's passes
    (each micro-batch's loss times `loss_scale` and the loss scale S of `scaler`, 1 without one),
    `after_backward()` (the memory event), `reduce`, clipping (gradients divided by S), then the
    AdamW step at learning rate `lr` (default: the optimizer's `cfg.lr`), or `skip` when `scaler` is given and the world's gradient norm is not finite (every
    rank sees the same norm, so all skip together), and `scaler.update`. Micro-batch slices are
    copied so that what a micro-batch keeps is its own (B, T) tokens. `balance`: the MoE
    load-balancing loss (`runtime.balance.load_balancing`), added per micro-batch."""
    opt = rk.optimizer
    scale = scaler.scale if scaler is not None else 1.0
    loss_sum, times = run_pipeline(
        rk.executors, role, p2p, order=rk.order, inputs=lambda k: tok[k * mbs:(k + 1) * mbs, :-1].contiguous(),
        targets=lambda k: tok[k * mbs:(k + 1) * mbs, 1:].contiguous(), loss_fn=head_loss(rk.stage),
        loss_scale=loss_scale * scale, meter=meter, balance=balance)
    if after_backward is not None:
        after_backward()
    opt.reduce()
    grad_norm = opt.clip(opt.cfg.max_grad_norm, scale=scale)
    skipped = scaler is not None and overflowed(grad_norm)
    if skipped:
        opt.skip()
    else:
        opt.step(lr)
    if scaler is not None:
        scaler.update(skipped)
    return StepResult(loss_sum, times, grad_norm, skipped)


def step_log(s: WorkerSettings, plan: Plan, job: JobSpec) -> StepLog | None:
    """Rank 0's StepLog (metrics file, TensorBoard, progress lines), after checking that its outputs
    can be written here (SailorInputError naming the option); None on the other ranks."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    check_output_path(s.metrics, "--metrics")
    check_output_path(s.tensorboard, "--tensorboard", folder=True)
    check_tensorboard(s.tensorboard)
    return StepLog(plan, job, metrics=s.metrics, tensorboard=s.tensorboard, every=s.log_every, total_steps=s.steps,
                   write=say)


def train(args: WorkerSettings) -> None:
    """The training loop of this rank (module docstring)."""
    plan = load_plan(args.plan)
    # Re-checked here, before any process group forms: a plan that reaches a worker without `sailor
    # train`'s checks (a hand-run torchrun, a launch on other hosts) must not crash mid-run or train
    # the wrong number of samples.
    job: JobSpec = check_plan_for_job(plan, load_job(args.job) if args.job else plan.job, plan.cluster,
                                      source=args.plan, job_source=args.job,
                                      world_size=int(os.environ.get("WORLD_SIZE", "1")))
    log = step_log(args, plan, job)  # before the process groups: a bad output path fails at once
    try:
        _train(args, plan, job, log)
    finally:
        if log is not None:
            log.close()


def _train(args: WorkerSettings, plan: Plan, job: JobSpec, log: StepLog | None,
           init: dict[str, Any] | None = None, stop_keeps_state: Callable[[], bool] | None = None) -> Live:
    """The training loop proper: `train` once the plan, job and rank 0's StepLog are in place; `init`:
    the rendezvous arguments of `init_world` (none: torchrun's); `stop_keeps_state`: `Live`'s. Returns
    the rank's Live as `run_steps` left it."""
    rank = int(os.environ.get("RANK", "0"))
    device = rank_device(args.device)  # LOCAL_RANK's GPU, refused when this torch has no kernels for it
    init_world(args, job, device, **(init or {}))
    topo = derive_topology(plan)
    assert topo.world_size == dist.get_world_size(), (topo.world_size, dist.get_world_size())
    role = topo.roles[rank]
    groups = create_groups(topo, timedelta(seconds=args.timeout_s))
    lanes = create_sync_lanes(topo, groups, timedelta(seconds=args.timeout_s))
    if rank == 0:
        emit("started", world_size=topo.world_size)  # process groups are up (the controller times phases)
    start, reader, manifest = 0, None, {}
    if args.resume_from:
        # The launcher verified every file's checksum; each rank checks the entries it reads.
        manifest = ckpt.read_manifest(args.resume_from, verify=False)
        start = manifest["step"]
        reader = Reader(args.resume_from, manifest)
    rk = build_rank(plan, job, role, groups, device=device, seed=args.seed, reader=reader,
                    init_from=args.init_from, step=ckpt.optimizer_steps(manifest) if reader is not None else 0,
                    lanes=lanes)
    if reader is not None:
        reader.close()
    # what `sailor export` keeps of the Hugging Face folder the run started from (rank 0 writes it; every
    # rank holds it, so that any can hand it on in a live switch)
    record = manifest.get(RECORD_KEY) or (source_record(args.init_from, job.model) if args.init_from else None)
    live = Live(args, plan, job, topo, groups, rk, device, start=start,
                saved_at=start if args.resume_from else None, scaler_state=manifest.get("loss_scaler"), record=record,
                stop_keeps_state=stop_keeps_state)
    run_steps(live, log)
    return live


def init_world(args: WorkerSettings, job: JobSpec, device: torch.device, **init: Any) -> None:
    """Form the default process group of this rank (NCCL on CUDA after the precision check, else gloo;
    collectives time out after `args.timeout_s`; `init`: init_process_group's rendezvous arguments,
    none: torchrun's environment), then `ignore_tags` (SAILOR_IGNORE_TAGS=1: tag 0 everywhere, as under NCCL)."""
    cuda = args.device == "cuda"
    if cuda:
        check_device_precision(job.precision, torch.cuda.get_device_capability(device),
                               device_name=torch.cuda.get_device_name(device))
    # A bound device makes torch create NCCL communicators eagerly, at new_group (`groups`).
    dist.init_process_group(backend_for("cuda" if cuda else "cpu"), timeout=timedelta(seconds=args.timeout_s),
                            device_id=device if cuda else None, **init)
    ignore_tags()


@dataclass
class Live:
    """One rank's training under one plan, built and in the default process group (`run_steps`).

    `start`: the step that runs next (0-based; data and learning rate follow it); `saved_at`: the step
    of a checkpoint that already holds this state (None: none); `scaler_state`: the fp16 loss scaler's
    `state_dict` to go on from (None: a fresh one); `record`: what `sailor export` keeps of the Hugging
    Face folder the run started from (every rank holds it; rank 0 writes it into the manifests);
    `stop_keeps_state`: asked (on every rank, the answers agreed by a MIN all-reduce) at a stop request
    when periodic checkpoints are on (--checkpoint-every > 0): True when the state lives on without a
    checkpoint (a live switch whose ranks hold every piece the new plan needs, `inplace`), and the stop
    then writes none; None: every stop writes one. `run_steps` sets `stopped` (the step a stop request
    stopped before) and keeps `saved_at` and `scaler_state` current."""

    args: WorkerSettings
    plan: Plan
    job: JobSpec
    topo: Any  # topology.Topology
    groups: dict
    rk: RankModel
    device: torch.device
    start: int = 0
    saved_at: int | None = None
    scaler_state: dict | None = None
    record: dict | None = None
    stop_keeps_state: Callable[[], bool] | None = None
    stopped: int | None = None


def run_steps(live: Live, log: StepLog | None) -> None:
    """The step loop of `live` from `live.start` to `args.steps`: the pipeline channels, a barrier
    (every rank's stage is built), the "loaded" event, then the steps (module docstring). On a stop
    request it writes the checkpoint of the step it stopped before (unless one holds it, or
    `live.stop_keeps_state` says none is needed), emits "stopped" and returns with `live.stopped` set;
    after the last step it emits "done"."""
    args, plan, job, rk, device, start = live.args, live.plan, live.job, live.rk, live.device, live.start
    spec, mbs, seq, gbs = job.model, plan.micro_batch_size, job.seq, job.global_batch_size
    topo, groups, rank = live.topo, live.groups, dist.get_rank()
    role = topo.roles[rank]
    timeout = timedelta(seconds=args.timeout_s)
    channels = create_channel_groups(topo, timeout, device)  # one group per pipeline channel (`pipeline`)
    barrier(device)  # every rank's stage is built before the first step
    if rank == 0:
        emit("loaded", step=start)  # weights and optimizer state in place; step `start` runs next
    opt = rk.optimizer
    # fp16: the loss scale goes on from the checkpoint's (its manifest's "loss_scaler"), if it has one.
    scaler = LossScaler(**(live.scaler_state or {})) if rk.dtype == torch.float16 else None
    p2p = P2P(role, shape=(mbs, seq, spec.hidden_size), device=device, timeout=timeout, dtype=rk.dtype,
              channels=channels, tp_group=groups.get(role.tp_group),
              sliced=sliced_edges(rk.stage, role.chunks, sequence_parallel=role.memory.sequence_parallel))
    balance = load_balancing(rk.stage, spec, mbs * seq, device)  # MoE load-balancing loss, if any
    corpus = load_corpus(args.data)
    recipe = job.recipe
    eval_corpus = load_corpus(recipe.eval.data) if recipe.eval is not None else None
    every = checkpoint_every_for(job, args.checkpoint_every)
    meta = ckpt.run_meta(job, args.seed)
    if rank == 0 and live.record:  # what `sailor export` keeps of the Hugging Face folder the run started from
        meta |= {RECORD_KEY: live.record}
    if scaler is not None:
        meta["loss_scaler"] = scaler.state_dict()
    layout = model_layout(spec)
    root = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    fault = os.environ.get(FAULT_ENV, "")
    n_local = role.microbatches * mbs

    def stop_requested() -> float:
        return 1.0 if args.stop_file and os.path.exists(args.stop_file) else 0.0

    # The ranks agree on a stop request at every step boundary. Before the first step that takes its
    # own all-reduce; afterwards the request rides on the step's one MAX all-reduce of its statistics.
    flag = torch.tensor([stop_requested()], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    stop = flag.item() > 0
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        if stop:
            path = None
            if root is not None and live.saved_at == step:
                path = ckpt.step_dir(root, step)
            elif root is not None and not (every and _state_kept(live, device)):
                path = save_checkpoint(root, step, meta, opt, role, device, layout)
                live.saved_at = step
            if rank == 0:
                emit("stopped", step=step, checkpoint=str(path) if path else None)
            live.stopped, live.scaler_state = step, meta.get("loss_scaler")
            return
        if fault == f"{rank}:{step}":
            os._exit(13)
        tok = torch.from_numpy(batch_tokens(corpus, seed=args.seed, step=step, first=role.first_sample,
                                            count=n_local, seq=seq)).to(device)
        meter = ActivationMeter() if step == start else None
        t1 = 0.0

        def backward_done(meter=meter) -> None:
            nonlocal t1
            t1 = time.perf_counter()
            if meter is not None:
                emit("memory", rank=rank, stage=role.stage, pipeline=role.pipeline, tp=role.tp, **opt.held_bytes(),
                     activations=meter.per_layer)

        scale = scaler.scale if scaler is not None else None  # this step's loss scale
        sent_before = dict(p2p.sent)
        res = train_step(rk, role, p2p, tok, mbs=mbs, loss_scale=1.0 / (gbs * seq), scaler=scaler, meter=meter,
                         after_backward=backward_done, lr=recipe.lr(step + 1), balance=balance)
        times = res.times
        if scaler is not None:
            meta["loss_scaler"] = scaler.state_dict()  # into the manifests of later checkpoints
        t2 = time.perf_counter()
        # One MAX all-reduce per step carries: the stop request, each stage's timings (MAX over its
        # ranks), each pipeline's loss sum in its own slot (only its last stage's TP rank 0 writes
        # it, and losses are >= 0, so MAX picks it out; rank 0 adds the slots), and each rank's bytes
        # sent across stage boundaries this step, activations and gradients, in its own two slots
        # (`plan.comms.step_statistics_elements`; the simulator prices it, `simulator.sync.step_allreduces_s`).
        P, D, W, k = role.num_stages, role.num_pipelines, topo.world_size, len(STAGE_FIELDS)
        stats = torch.zeros(step_statistics_elements(P, D, W), dtype=torch.float64, device=device)
        stats[0] = stop_requested()
        stats[1 + role.stage * k: 1 + (role.stage + 1) * k] = torch.tensor(
            [times.forward_s, times.backward_s, times.wait_s, t2 - t1, sync_exposed_s(opt)], dtype=torch.float64)
        if role.is_last_stage and role.tp_rank == 0:
            stats[1 + P * k + role.pipeline] = res.loss_sum  # on the device: no sync here
        stats[1 + P * k + D + 2 * rank: 3 + P * k + D + 2 * rank] = torch.tensor(
            [p2p.sent.get(kind, 0) - sent_before.get(kind, 0) for kind in (ACTIVATION, GRADIENT)], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        stop = stats[0].item() > 0
        stage_times = stats[1: 1 + P * k].view(P, k)
        loss_total = float(stats[1 + P * k: 1 + P * k + D].sum())
        sent = stats[1 + P * k + D:].view(W, 2).tolist()
        step_time = time.perf_counter() - t0
        eval_loss = None
        if eval_corpus is not None and (step + 1) % recipe.eval.every == 0:
            eval_loss = evaluation.eval_loss(rk.executors, rk.order, rk.stage, opt, role, p2p, eval_corpus,
                                             batches=recipe.eval.batches, mbs=mbs, seq=seq, global_batch=gbs,
                                             device=device)
        if rank == 0:
            record = {"step": step + 1, "loss": loss_total / (gbs * seq), "lr": recipe.lr(step + 1),
                      **({"eval_loss": eval_loss} if eval_loss is not None else {}),
                      "samples": gbs, "tokens": gbs * seq,
                      "step_time_s": step_time, "tokens_per_s": gbs * seq / step_time,
                      "grad_norm": None if res.skipped else res.grad_norm,
                      "stages": [dict(zip(STAGE_FIELDS, row))
                                 for row in stage_times.tolist()]}
            for r in topo.roles:  # bytes the stage's ranks sent across its boundaries (`pipeline.P2P.sent`)
                row = record["stages"][r.stage]
                row["sent_activation_bytes"] = row.get("sent_activation_bytes", 0) + int(sent[r.rank][0])
                row["sent_gradient_bytes"] = row.get("sent_gradient_bytes", 0) + int(sent[r.rank][1])
            if scaler is not None:  # the scale this step's loss was multiplied by, and whether it was skipped
                record.update(loss_scale=scale, skipped=res.skipped, skipped_steps=scaler.skipped)
            log.on_step(record)  # adds its MFU
            emit("step", **record)
        done = step + 1
        if root is not None and (done == args.steps or (every and done % every == 0)):
            path = save_checkpoint(root, done, meta, opt, role, device, layout)
            live.saved_at = done
            if rank == 0:
                ckpt.prune(root, keep=recipe.checkpoint.keep, upto=done)
                emit("checkpoint", step=done, path=str(path))
    if rank == 0:
        emit("done", step=max(args.steps, start))


def _state_kept(live: Live, device: torch.device) -> bool:
    """`live.stop_keeps_state()` agreed over the world (True only when every rank says so: a rank that
    read the control files a moment earlier may not have seen the switch yet)."""
    if live.stop_keeps_state is None:
        return False
    kept = torch.tensor([float(live.stop_keeps_state())], device=device)
    dist.all_reduce(kept, op=dist.ReduceOp.MIN)
    return kept.item() > 0


def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank: exits 2 after reporting bad arguments, 1 after reporting any other error."""
    warnings.simplefilter("ignore", SailorWarning)  # the command that started the ranks said it already
    rank = int(os.environ.get("RANK", "0"))
    # Every rank says it is up before it waits for its peers: a host whose ranks never say so is the
    # one that keeps the process groups from forming (the controller leaves it out).
    emit("joined", rank=rank, pid=os.getpid())
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except SailorInputError as e:
        _report(e, rank)
        _exit(2)
    try:
        train(args)
        # Every rank is past its last transfer before any exits. Then leave without running the
        # process groups' C++ destructors: tearing down gloo's threads at exit intermittently aborts
        # ("terminate called without an active exception", SIGABRT), which torchrun reports as a failure.
        barrier(torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu"))
        code = 0
    except BaseException as e:  # report which rank failed and why, then fail fast
        _report(e, rank)
        code = 1
    _exit(code)


def _report(e: BaseException, rank: int) -> None:
    """Say why this rank failed: an error event for the launcher, and on stderr one line for bad
    input or the traceback."""
    text = f"{type(e).__name__}: {e}"
    # A rank that lost contact with a peer is usually a victim, not the cause: say so, so the
    # launcher can name the rank that failed first.
    peer_lost = isinstance(e, (TimeoutError, dist.DistError)) or any(
        s in text for s in ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out"))
    first_line = (text.splitlines() or [""])[0][:1000]  # keeps the event line under PIPE_BUF
    emit("error", rank=rank, error=first_line, peer_lost=peer_lost)
    if isinstance(e, SailorInputError):  # bad input: its one line says it all
        print(f"error: {e.one_line()}", file=sys.stderr)
    else:
        traceback.print_exc()


def _exit(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
