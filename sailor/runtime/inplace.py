"""One process of a live-reconfigured run (`python -m sailor.runtime.inplace CONTROL PROC EPOCH`,
started by `sailor.elastic.inplace.InPlaceRun`): it trains as a rank of one plan after another
without exiting, following the epoch files of the control folder (`runtime.epochs`).

A process waits for epoch EPOCH, then for each epoch in turn:
- no rank in it: a spare waits for the next epoch; a process that was a rank sends its state
  (below), drops it (`drop_state`) and waits as a spare, in its device slot, for a later epoch that
  gives it a rank (it then joins as a newcomer does, past its imports already); either exits instead
  when the epoch says it leaves (its machine is lost);
- a fresh epoch ("old" null): it forms the default group (the epoch's "train" store), builds its stage
  from the checkpoint of its settings' --resume-from (or the initial weights) as `worker._train`
  does, and trains (`worker.run_steps`);
- a switch: the epoch's ranks stopped at a step boundary s (`worker.run_steps`), then each process
  destroys its process groups. At the stop they wrote checkpoint s only when the move needs it
  (`state_kept`: some piece has no living holder), or when periodic checkpoints are off
  (--checkpoint-every 0: the switch's checkpoint is then the only one). The processes with a rank in
  the new plan, plus the leaving ones that hold pieces nobody staying holds, form the move group
  (store "move"): the first process of the old plan in it hands on what the old ranks know (s,
  the newest checkpoint's step, the fp16 loss scaler, the Hugging Face record; one broadcast: a
  newcomer knows none of it), then `reshard.move_state` gives every new rank its pieces of weights,
  fp32 master and Adam moments point to point from the live holders, and from checkpoint s only what
  no process in the group holds. When leavers took part, the new ranks then form a group of their
  own (store "train"), since the step loop's collectives run over the world. Each builds its
  stage from what it received (`worker.build_rank`, exactly as a load of checkpoint s under the new
  plan) and trains on from step s: data indexed by global sample and the learning rate follow the
  step, so no sample is skipped or repeated.
Every process computes the same move (`reshard_plan.plan_reshard` over the epoch file's old and new
ranks, first with the staying processes alone, then, if that needs the checkpoint, with the leavers
that hold pieces), so the group's membership needs no message. The stores are files in the control folder on this
machine, TCP stores on the host of the group's first process on named machines (`epochs.init_method`).

Failure: anything that goes wrong in a switch (a process dies, a collective times out after
--timeout-s, `ReshardError`) makes the process report and exit 1; the controller then kills the pool
and restarts every rank from the newest complete checkpoint. With --checkpoint-every 0 that is
checkpoint s, complete before any state moved: nothing is trained twice. Otherwise the switch wrote
none (the survivors held every piece), and the fallback is the newest periodic checkpoint, at most
--checkpoint-every - 1 steps before s: the steps after it are trained again on the same samples
(data indexed by global sample, learning rate by step), so the kept trajectory is the one an
uninterrupted run trains, and a rollback of fewer than --checkpoint-every steps is the price of not
writing the whole state at every switch.

Events (`worker.emit`, as the worker's, from the epoch's rank 0 unless said): "ready" (every process,
once its imports are done), "joined" (every rank of every epoch: rank, pid, epoch, process),
"started" (the first group of the epoch formed: the move group of a switch, with the state bytes its
move sends between processes, keeps in place and reads from the checkpoint: sent_bytes, local_bytes,
checkpoint_bytes), "loaded", "step", "checkpoint", "stopped", "done", "error" (any process).
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

from sailor.core.process import die_with_parent

if __name__ == "__main__":  # a pool process: it ends with its parent even when that dies during torch's imports
    die_with_parent()

import torch  # noqa: E402 - after the line above
import torch.distributed as dist

from sailor.core.errors import SailorInputError, SailorWarning
from sailor.plan import load_plan
from sailor.plan.spec import Plan
from sailor.runtime import checkpoint as ckpt
from sailor.runtime import epochs
from sailor.runtime.checkpoint_io import Reader
from sailor.runtime.command import WorkerSettings, parse
from sailor.runtime.device import rank_device
from sailor.runtime.groups import create_groups, create_sync_lanes
from sailor.runtime.reshard import ReshardError, move_state
from sailor.runtime.reshard_plan import CHECKPOINT, ReshardPlan, plan_reshard
from sailor.runtime.sync import barrier
from sailor.runtime.topology import derive_topology
from sailor.runtime.validate import check_plan_for_job
from sailor.runtime.worker import (
    Live,
    _exit,
    _report,
    _train,
    build_rank,
    emit,
    init_world,
    run_steps,
    step_log,
)
from sailor.runtime.zero import compute_dtype
from sailor.specs import load_job
from sailor.specs.job import JobSpec


def settings(e: epochs.Epoch, rank: int | None = None) -> tuple[WorkerSettings, Plan, JobSpec]:
    """The epoch's worker settings, plan and job (checked as `worker.train` checks them), with this
    process's RANK, WORLD_SIZE and LOCAL_RANK set for the code that reads them (`rank` None: left as
    they are; LOCAL_RANK, the device index, is the process's slot on its machine where it has one,
    `epochs.SLOT_ENV`, else the rank)."""
    args = parse(e.argv[2:] if e.argv[:1] == ["-m"] else e.argv)
    plan = load_plan(args.plan)
    job = check_plan_for_job(plan, load_job(args.job) if args.job else plan.job, plan.cluster, source=args.plan,
                             job_source=args.job, world_size=plan.world_size)
    if rank is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(plan.world_size),
                          LOCAL_RANK=os.environ.get(epochs.SLOT_ENV, str(rank)))
    return args, plan, job


def state_kept(control: Path, k: int, moves: dict[int, tuple[list[int], ReshardPlan]]) -> bool:
    """`worker.Live.stop_keeps_state` of a rank of epoch `k`: True when epoch k+1 is published (the stop
    is a switch) and its move (`move_group`, kept in `moves` by epoch for `switch`) takes every piece
    from a living process, so that no checkpoint needs to be written at the step boundary."""
    e = epochs.read(control, k + 1)
    if e is None:
        return False
    args, plan, job = settings(e)
    moves[e.number] = move_group(e, plan, job, torch.device(args.device))
    return not moves[e.number][1].needs_checkpoint


def move_group(e: epochs.Epoch, plan: Plan, job: JobSpec, device: torch.device) -> tuple[list[int], ReshardPlan]:
    """The processes of epoch `e`'s move group (the new ranks' in rank order, then the leavers that
    send) and the move (`plan_reshard` with old rank -> group rank), the same on every process. The
    leavers come in only when the staying processes alone leave pieces to the checkpoint. `device`:
    only its type counts (`zero.compute_dtype`)."""
    old_plan = load_plan(e.old_plan)
    by_rank = sorted(e.ranks, key=e.ranks.get)
    weights_fp32 = compute_dtype(job.precision, device) == torch.float32

    def planned(world: list[int]) -> ReshardPlan:
        survivors = {e.old_ranks[p]: world.index(p) for p in world if p in e.old_ranks}
        return plan_reshard(old_plan, plan, job.model, survivors, weights_fp32=weights_fp32)

    rp = planned(by_rank)
    if rp.needs_checkpoint:
        leavers = sorted((p for p in e.old_ranks if p not in e.ranks), key=e.old_ranks.get)
        every = planned(by_rank + leavers)
        sending = {every.process(t.src) for t in every.transfers if t.src != CHECKPOINT}
        senders = [p for i, p in enumerate(leavers) if len(by_rank) + i in sending]
        if senders:
            by_rank += senders
            rp = planned(by_rank)
    return by_rank, rp


def switch(control: Path, e: epochs.Epoch, proc: int, held: list[Live],
           moves: dict[int, tuple[list[int], ReshardPlan]]) -> Live | None:
    """This process's part in switch epoch `e` (module docstring); returns its Live under the new plan,
    or None when it has no rank in it (its process groups destroyed). `held`: its state under the last
    epoch (empty for a newcomer), taken out of the list so that no reference outlives the move: the
    old stage and optimizer are freed before the new ones are built. `moves`: `move_group`s already
    computed, by epoch (`state_kept`).

    Raises:
        ReshardError: no process of the last epoch takes part (there is no live state to move).
    """
    live = held.pop() if held else None
    rank = e.ranks.get(proc)
    args, plan, job = settings(e, rank if rank is not None else -1)
    device = live.device if live is not None else rank_device(args.device)
    if live is not None:
        dist.destroy_process_group()  # every group of the last epoch
    world, rp = moves.pop(e.number, None) or move_group(e, plan, job, device)
    if proc not in world:  # a leaver whose pieces others hold
        live = None
        drop_state(device)
        return None
    me = world.index(proc)
    init_world(args, job, device, init_method=epochs.init_method(control, e, "move", world[0]), rank=me,
               world_size=len(world))
    if me == 0:  # (bytes: fp32 elements, moments included: `ReshardPlan.moved_elements`)
        emit("started", world_size=len(world), **{f"{k}_bytes": 4 * n for k, n in rp.moved_elements().items()})
    if os.environ.get(epochs.FAULT_MOVE_ENV) == f"{proc}:{e.number}":
        os._exit(13)
    # What the old ranks know of the run (a newcomer does not), from the first of them in the group:
    # the step they stopped before, the step of the newest checkpoint, the fp16 loss scaler's state and
    # the Hugging Face record (`worker.Live`).
    old = [i for i, p in enumerate(world) if p in e.old_ranks]
    if not old:
        raise ReshardError("no process of the last plan takes part in the move: there is no live state")
    run = [live.stopped, live.saved_at, live.scaler_state, live.record] if live is not None else [None] * 4
    dist.broadcast_object_list(run, src=old[0], device=device)
    start, saved_at, scaler_state, record = run
    reader = None
    if rp.needs_checkpoint and rank is not None:  # written at the stop (`state_kept` said False)
        path = ckpt.step_dir(args.checkpoint_dir, start)
        reader = Reader(path, ckpt.read_manifest(path, verify=False))
    state = move_state(rp, live.rk.optimizer if live is not None else None, device=device, checkpoint=reader)
    live = None  # the old stage and optimizer go before the new ones are built
    gc.collect()  # (the stage's hooks and the optimizer refer to each other)
    if state is None:
        dist.destroy_process_group()
        drop_state(device)
        return None
    if len(world) != plan.world_size:  # leavers took part: the new ranks form a world of their own
        dist.destroy_process_group()
        init_world(args, job, device, init_method=epochs.init_method(control, e, "train", e.first), rank=rank,
                   world_size=plan.world_size)
    topo = derive_topology(plan)
    groups = create_groups(topo, timedelta(seconds=args.timeout_s))
    lanes = create_sync_lanes(topo, groups, timedelta(seconds=args.timeout_s))
    try:
        rk = build_rank(plan, job, topo.roles[rank], groups, device=device, seed=args.seed, reader=state,
                        step=state.steps, lanes=lanes)
    finally:
        state.close()
        if reader is not None:
            reader.close()
    return Live(args, plan, job, topo, groups, rk, device, start=start, saved_at=saved_at,
                scaler_state=scaler_state, record=record)


def drop_state(device: torch.device) -> None:
    """Free what a process that left the plan held (a spare's): its stage, optimizer and groups are
    unreferenced by then; the collection frees their reference cycles (the stage's hooks and the
    optimizer refer to each other) and, on CUDA, the caching allocator gives its blocks back to the
    device. The CUDA context itself stays (a few hundred MB of device memory): a spare keeps its
    device for the rank it may be handed."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up() -> None:
    """Pay now, before the "ready" event, what a process's first switch or step would otherwise wait
    for: the split backward's module (`executor.StageExecutor.backward_input`, ZB-H1 schedules), whose
    package imports torch._dynamo (1.1 s of CPU in a fresh process here at load 7, 2 s in a testbed
    rank starting during a grow).
    Building models on the meta device no longer imports it (`model.on_meta`)."""
    import torch.distributed.pipelining._backward  # noqa: F401


def serve(control: Path, proc: int, first_epoch: int) -> None:
    """The epochs of process `proc` from `first_epoch` on (module docstring); returns when the run is
    done, a stop was not a switch, or an epoch says it leaves (a spare waits until the pool ends it)."""
    live, k = None, first_epoch
    moves: dict[int, tuple[list[int], ReshardPlan]] = {}  # `state_kept`'s moves, for `switch`
    warm_up()
    emit("ready", process=proc, pid=os.getpid())  # from here on a switch waits on nothing slow
    while True:
        e = epochs.wait(control, k)
        rank = e.ranks.get(proc)
        if rank is None and proc not in (e.old_ranks or {}):
            if proc in e.leave:
                return  # a spare on a lost machine
            k += 1  # a spare: not needed yet
            continue
        if rank is not None:
            emit("joined", rank=rank, pid=os.getpid(), epoch=k, process=proc)
        if e.old_plan is None:  # a fresh start from the checkpoint (or the initial weights)
            args, plan, job = settings(e, rank)
            log = step_log(args, plan, job)
            try:
                init = {"init_method": epochs.init_method(control, e, "train", e.first), "rank": rank,
                        "world_size": plan.world_size}
                live = _train(args, plan, job, log, init=init,
                              stop_keeps_state=functools.partial(state_kept, control, k, moves))
            finally:
                if log is not None:
                    log.close()
        else:
            held, live = [live] if live is not None else [], None
            live = switch(control, e, proc, held, moves)
            if live is None:  # left the plan: a spare from now on, or gone with its machine
                if proc in e.leave:
                    return
                k += 1
                continue
            live.stop_keeps_state = functools.partial(state_kept, control, k, moves)
            log = step_log(live.args, live.plan, live.job)
            try:
                run_steps(live, log)
            finally:
                if log is not None:
                    log.close()
        if live.stopped is None or epochs.read(control, k + 1) is None:
            barrier(live.device)  # every rank is past its last transfer before any exits (`worker.main`)
            return
        k += 1


def main(argv: list[str] | None = None) -> None:
    """Entry point: exits 0 when done or stopped, 2 after reporting bad arguments, 1 after
    reporting any other error (`worker._report`)."""
    warnings.simplefilter("ignore", SailorWarning)
    argv = sys.argv[1:] if argv is None else argv
    control, proc, first = Path(argv[0]), int(argv[1]), int(argv[2])
    try:
        serve(control, proc, first)
        code = 0
    except SailorInputError as e:
        _report(e, int(os.environ.get("RANK", "-1")))
        code = 2
    except BaseException as e:  # noqa: BLE001 - report which process failed and why, then fail fast
        _report(e, int(os.environ.get("RANK", "-1")))
        code = 1
    _exit(code)


if __name__ == "__main__":
    main()
