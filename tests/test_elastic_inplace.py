"""Live switches (`sailor run`'s default on the local provider: `elastic.inplace`, `runtime.inplace`)
on CPU: tiny model, global batch 8, <= 4 gloo processes, tags ignored as under NCCL.

Through the controller: a trace that shrinks 4 -> 2 and grows back to 4 switches twice without
restarting a surviving rank; a process killed in the middle of a move makes the run fall back to the
checkpoint written at the switch, losing no step. Through the pool alone: hand-made plans switched
in turn from TP 2 to data parallelism under ZeRO-1, to 2 pipeline stages, and back to one stage
under ZeRO-3 on 3 ranks. Every kept trajectory holds each step once and its losses equal a
single-process reference within 1e-5 relative; no process outlives a test. No wall-clock time is
asserted: the traces run on the `steps` clock.
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import pytest
from conftest import own_processes

from sailor.elastic.availability import load_trace
from sailor.elastic.controller import run
from sailor.elastic.events import ClockKind
from sailor.elastic.options import RunOptions
from sailor.runtime.epochs import FAULT_MOVE_ENV
from sailor.runtime.launcher import ExitStatus
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

JOB = JobSpec(model="tiny", global_batch_size=8)
LOCAL = ClusterSpec(provider="local", zones={"local": {"cpu": 4}})
RTOL = 1e-5


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _check_losses(metrics: Path, steps: int, losses: list[float], redone: int = 0) -> None:
    """Steps 1..steps each written with the whole global batch, losses as the reference's; `redone`
    steps (trained again after a rollback) written twice, in order."""
    rows = _lines(metrics)
    assert len(rows) == steps + redone and sorted({r["step"] for r in rows}) == list(range(1, steps + 1))
    assert all(b["step"] == a["step"] + 1 or b["step"] <= a["step"] for a, b in zip(rows, rows[1:]))
    for r in rows:
        assert r["samples"] == JOB.global_batch_size
        assert r["loss"] == pytest.approx(losses[r["step"] - 1], rel=RTOL), r["step"]


def _gone(alive, timeout_s: float = 15.0) -> bool:
    end = time.monotonic() + timeout_s
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
    return not alive()


def _options(tmp: Path, steps: int, *counts: tuple[float, int], every: int = 0) -> RunOptions:
    trace = tmp / "trace.json"
    trace.write_text(json.dumps([{"time_s": t, "zone": "local", "gpu": "cpu", "count": n} for t, n in counts]))
    return RunOptions(job=JOB, cluster=LOCAL, trace=load_trace(trace, LOCAL), steps=steps,
                      checkpoint_dir=str(tmp / "ck"), checkpoint_every=every, metrics=str(tmp / "m.jsonl"),
                      events=str(tmp / "e.jsonl"), clock=ClockKind.STEPS, switch_cost_s=0.0, timeout_s=30.0)
    # (in_place left as its default: live on the local provider)


@pytest.mark.integration
def test_shrink_and_grow_in_place_keep_the_survivors_processes(tmp_path, reference_losses, monkeypatch):
    """4 -> 2 -> 4 processes, live: the survivors keep their process, the shrink's leavers wait as
    spares and take the grow's new ranks (same process ids), the losses are the reference's, no
    process is left."""
    monkeypatch.setenv("SAILOR_IGNORE_TAGS", "1")
    steps = 16
    with own_processes() as alive:
        res = run(_options(tmp_path, steps, (0, 4), (4, 2), (8, 4)))
        assert _gone(alive), alive()
    assert res.status is ExitStatus.DONE, res.message
    ev = _lines(tmp_path / "e.jsonl")
    assert [e["world_size"] for e in ev if e["event"] == "launch"] == [4]  # one start, no restart
    finished = [e for e in ev if e["event"] == "switch_finished"]
    assert [(e["reason"], e["world_size"], e["in_place"]) for e in finished] == [("lost GPUs", 2, True),
                                                                                 ("gain", 4, True)]
    for e in finished:  # 2 GPUs in both plans each time, both still in their process
        assert (e["survivors"], e["survivors_restarted"]) == (2, 0), e
        # every piece from a living process (none from the checkpoint), the survivors keeping theirs;
        # the grow's newcomers are sent theirs
        assert e["checkpoint_bytes"] == 0 and e["local_bytes"] > 0 and (e["sent_bytes"] > 0 or e["world_size"] == 2), e
        assert set(e["phases_s"]) == {"replan_s", "start_s", "stop_s", "checkpoint_s", "rendezvous_s", "move_s",
                                      "first_step_s"}
        assert sum(e["phases_s"].values()) == pytest.approx(e["total_s"], abs=1e-6)
    # the shrink's leavers stayed as spares: the grow hands them ranks 2 and 3, no process starts
    assert [e["spares_used"] for e in finished] == [0, 2]
    assert finished[1]["pids"] == finished[0]["pids_before"] and len(set(finished[1]["pids"].values())) == 4
    assert res.switches == 2 and res.crashes == 0 and res.steps_rolled_back == 0
    _check_losses(tmp_path / "m.jsonl", steps, reference_losses)


@pytest.mark.integration
@pytest.mark.parametrize("every", [0, 2])
def test_a_process_killed_mid_move_falls_back_to_a_checkpoint(tmp_path, reference_losses, monkeypatch, every):
    """Process 1 (old rank 1, staying as new rank 1) dies after the move group formed, before any
    state moved: every process of the pool ends and the run restarts on the GPU left (its GPU counts
    as lost) from the newest checkpoint. With --checkpoint-every 0 that is the one the ranks wrote at
    the switch's step boundary: no step is trained twice. With --checkpoint-every 2 the switch wrote
    none (the survivors held every piece): the restart resumes from the newest periodic checkpoint
    and trains the steps after it again, on the same samples; the kept trajectory is the
    reference's either way."""
    monkeypatch.setenv("SAILOR_IGNORE_TAGS", "1")
    monkeypatch.setenv(FAULT_MOVE_ENV, "1:1")
    steps = 24  # (under load the ranks ran the last 7 of 10 steps before the controller asked for the switch)
    with own_processes() as alive:
        res = run(_options(tmp_path, steps, (0, 4), (3, 2), every=every))
        assert _gone(alive), alive()
    assert res.status is ExitStatus.DONE, res.message
    ev = _lines(tmp_path / "e.jsonl")
    switch_step = next(e["step"] for e in ev if e["event"] == "switch_started")
    crashes = [e for e in ev if e["event"] == "crash"]
    assert len(crashes) == 1 and crashes[0]["ranks"] == [1], crashes
    launches = [e for e in ev if e["event"] == "launch"]
    assert [e["world_size"] for e in launches] == [4, 1]
    # the ranks stopped at the boundary after the steps the controller had seen when it asked (they
    # may have gone on a few steps before they saw the request); no step ran after it
    boundary = crashes[0]["last_step"]
    assert boundary >= switch_step
    # the newest checkpoint (any written at the boundary would be it)
    resumed = boundary - boundary % every if every else boundary
    assert launches[1]["resume_step"] == resumed
    assert (launches[1]["checkpoint"] or "").endswith(f"step-{resumed:08d}" if resumed else "")
    assert res.crashes == 1 and res.steps_rolled_back == boundary - resumed
    assert [e["steps"] for e in ev if e["event"] == "rollback"] == ([boundary - resumed] if boundary > resumed else [])
    _check_losses(tmp_path / "m.jsonl", steps, reference_losses, redone=boundary - resumed)


def test_ranks_go_to_the_processes_that_hold_their_gpu_type_then_to_spares(tmp_path):
    """`assign`: a process keeps its rank when the new plan has it on the same (zone, GPU type);
    others of the type fill the remaining ranks in old-rank order, then spares; too few is refused."""
    from sailor.elastic.inplace import assign

    four, two = _plan(tmp_path / "4.json", (1,), (1,), (1,), (1,)), _plan(tmp_path / "2.json", (1,), (1,))
    assert assign(four, {5: 0, 6: 1, 7: 2, 8: 3}, two, []) == {5: 0, 6: 1}
    assert assign(four, {5: 3, 6: 0, 7: 2, 8: 1}, two, []) == {6: 0, 8: 1}
    assert assign(two, {5: 0, 6: 1}, four, [9, 10, 11]) == {5: 0, 6: 1, 9: 2, 10: 3}
    with pytest.raises(ValueError, match="no process left for rank 3"):
        assign(two, {5: 0, 6: 1}, four, [9])


def test_a_switch_keeps_the_state_without_a_checkpoint_only_when_every_piece_has_a_living_holder(tmp_path):
    """`runtime.inplace.state_kept`: no next epoch (a plain stop) -> False; a shrink from 2 pipeline
    stages to one whose old ranks both live (the leaver sends its stage) -> True, with the move kept
    for the switch; the same switch with the second stage's rank gone -> False (its layers come from
    the checkpoint)."""
    from sailor.runtime import epochs
    from sailor.runtime.command import WorkerSettings
    from sailor.runtime.inplace import state_kept

    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": "tiny", "global_batch_size": 8}))
    two = _plan(tmp_path / "pp2.json", (1, 1), stages=((0, 3), (3, 6)))
    one = _plan(tmp_path / "one.json", (1,))
    argv = WorkerSettings(plan=one, job=str(job), steps=4).argv()
    moves: dict = {}
    assert not state_kept(tmp_path, 0, moves) and not moves
    epochs.publish(tmp_path, epochs.Epoch(1, argv, {5: 0}, two, {5: 0, 6: 1}))
    assert state_kept(tmp_path, 0, moves)
    world, rp = moves[1]
    assert world == [5, 6] and not rp.needs_checkpoint and rp.moved_elements()["sent"] > 0
    epochs.publish(tmp_path, epochs.Epoch(2, argv, {5: 0}, two, {5: 0}))
    assert not state_kept(tmp_path, 1, moves) and moves[2][1].needs_checkpoint


def test_epoch_files_round_trip(tmp_path):
    from sailor.runtime import epochs

    assert epochs.read(tmp_path, 1) is None
    e = epochs.Epoch(1, ["-m", "x", "--steps=3"], {4: 0, 2: 1}, "/p/old.json", {2: 0, 3: 1})
    path = epochs.publish(tmp_path, e)
    assert path == epochs.epoch_file(tmp_path, 1) and epochs.read(tmp_path, 1) == e == epochs.wait(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-0001.json"]  # no temporary file left


def test_live_switch_phases_add_up_to_the_total():
    from sailor.elastic.launches import Switch

    sw = Switch("gain", began=10.0, replan_s=0.5, stop_requested=10.5, last_step_after_request=11.0, stopped=11.25,
                launched=11.25, started=11.5, loaded=12.0, in_place=True)
    assert sw.phases(12.5) == {"replan_s": 0.5, "start_s": 0.0, "stop_s": 0.5, "checkpoint_s": 0.25,
                               "rendezvous_s": 0.25, "move_s": 0.5, "first_step_s": 0.5}
    # a newcomer ready 0.25 s after the request: the epoch is published then, the old plan training on
    sw.published = 10.75
    assert sw.phases(12.5) == {"replan_s": 0.5, "start_s": 0.25, "stop_s": 0.25, "checkpoint_s": 0.25,
                               "rendezvous_s": 0.25, "move_s": 0.5, "first_step_s": 0.5}


def test_the_steps_clock_counts_steps():
    from sailor.elastic.events import Clock

    clock = Clock(2.0, ClockKind.STEPS)
    for seconds in (5.0, 0.1, 7.0):
        clock.add_step(seconds)
    assert clock.trace_s() == 1.5  # 3 steps at 2 steps per trace second
    clock.wait_until(4.0, lambda: False)
    assert clock.trace_s() == 4.0


def _plan(path: Path, *pipelines: tuple[int, ...], stages=((0, 6),), zero: int = 0) -> str:
    """A CPU plan file: one tuple of per-stage TP degrees per pipeline, global batch 8 split evenly."""
    from sailor.plan.spec import Plan

    plan = Plan.model_validate({
        "micro_batch_size": 2, "stages": [list(s) for s in stages], "memory": [{"zero": zero}] * len(stages),
        "pipelines": [{"microbatches": 4 // len(pipelines), "replicas": [
            {"stage": i, "gpu": "cpu", "zone": "local", "tp": t} for i, t in enumerate(tps)]} for tps in pipelines]})
    plan.save(path)
    return str(path)


@pytest.mark.integration
def test_tp_pipeline_and_zero_changes_in_place(tmp_path, reference_losses, monkeypatch):
    """On 2 processes: TP 2 (ZeRO-0) -> 2 data-parallel replicas under ZeRO-1 -> 2 pipeline stages
    (layers 0-2 | 3-5) -> 2 replicas under ZeRO-3, each switch asked for after every third step. The
    pool keeps its 2 processes throughout, and the losses are the reference's. Checkpoints every 5
    steps: a switch writes none at its boundary (the two processes hold every piece) unless a
    periodic one falls there."""
    from sailor.elastic.inplace import InPlaceRun
    from sailor.runtime.prepare import TrainOptions, prepare

    monkeypatch.setenv("SAILOR_IGNORE_TAGS", "1")
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": "tiny", "global_batch_size": 8}))
    plans = [_plan(tmp_path / "p0.json", (2,)), _plan(tmp_path / "p1.json", (1,), (1,), zero=1),
             _plan(tmp_path / "p2.json", (1, 1), stages=((0, 3), (3, 6))),
             _plan(tmp_path / "p3.json", (1,), (1,), zero=3)]
    steps, every, checkpoint_every = 12, 3, 5
    prep = prepare(TrainOptions(plan=plans[0], job=str(job), steps=steps, checkpoint_dir=str(tmp_path / "ck"),
                                checkpoint_every=checkpoint_every, metrics=str(tmp_path / "m.jsonl"), timeout_s=30.0))
    with own_processes() as alive:
        pool = InPlaceRun(prep, str(tmp_path), processes=2)
        joined: list[dict] = []
        stopped: list[dict] = []
        switched = 0
        while not pool.done():
            try:
                _, ev = pool.events.get(timeout=0.5)
            except queue.Empty:
                continue
            joined += [ev] if ev["event"] == "joined" else []
            stopped += [ev] if ev["event"] == "stopped" else []
            if ev["event"] == "step" and ev["step"] % every == 0 and ev["step"] < steps:
                switched += 1
                pool.switch(plans[switched])
        pool.thread.join()
        assert _gone(alive), alive()
    assert pool.error is None and pool.result.status is ExitStatus.DONE, pool.result.message
    assert switched == 3
    pids = {(e["epoch"], e["rank"]): e["pid"] for e in joined}
    assert sorted(pids) == [(k, r) for k in range(4) for r in range(2)]
    assert len(set(pids.values())) == 2  # the same two processes all along
    assert len(stopped) == 3 and all((e["checkpoint"] is None) == (e["step"] % checkpoint_every != 0)
                                     for e in stopped), stopped
    _check_losses(tmp_path / "m.jsonl", steps, reference_losses)
