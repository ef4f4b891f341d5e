"""`sailor run` end to end on CPU (local provider, tiny model, global batch 8, <= 4 gloo ranks).

A trace that shrinks and grows (4 -> 2 -> 4 processes) on the restart path (`--restart`; the live
path's switches are `test_elastic_inplace`'s); two SIGKILLed workers and SIGINT and SIGKILL of the
controller, each on both paths (a live pool, the default, and torchrun launches); a corrupted
checkpoint. Every run's kept trajectory must hold each step
once, with the global batch's samples, and its loss must equal a single-process reference within
1e-5 relative; no process may outlive a test. The shrink-and-grow trace runs on the `steps` clock
(on the `training` clock a few slow steps under load skipped the shrink), the others on the
`training` clock, so that the machine's start-up time does not decide which plan trains (no
wall-clock time is asserted).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import live_processes, own_processes

from sailor.elastic.availability import load_trace
from sailor.elastic.controller import run
from sailor.elastic.events import ClockKind
from sailor.elastic.options import RunOptions, RunResult
from sailor.runtime import epochs
from sailor.runtime.launcher import ExitStatus
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

JOB = JobSpec(model="tiny", global_batch_size=8)
LOCAL = ClusterSpec(provider="local", zones={"local": {"cpu": 4}})
RTOL = 1e-5
SAILOR = [sys.executable, "-c", "from sailor.cli import main; main()"]
PATHS = [pytest.param(True, id="live"), pytest.param(False, id="restart")]  # RunOptions.in_place


def _trace(tmp: Path, *counts: tuple[float, int]):
    p = tmp / "trace.json"
    p.write_text(json.dumps([{"time_s": t, "zone": "local", "gpu": "cpu", "count": n} for t, n in counts]))
    return p


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _check_trajectory(metrics: Path, steps: int, losses: list[float], rolled_back: int) -> None:
    """Each step 1..steps kept once with the whole global batch, loss = reference; redone steps are
    the only extra lines."""
    rows = _lines(metrics)
    kept = {r["step"]: r for r in rows}
    assert sorted(kept) == list(range(1, steps + 1))
    assert len(rows) == steps + rolled_back
    assert sum(r["samples"] for r in kept.values()) == steps * JOB.global_batch_size
    for s, r in kept.items():
        assert r["samples"] == JOB.global_batch_size and r["tokens"] == JOB.global_batch_size * JOB.seq
        assert r["loss"] == pytest.approx(losses[s - 1], rel=RTOL), s
    for r in rows:  # a redone step trains the same samples: the same loss as its first attempt
        assert r["loss"] == pytest.approx(kept[r["step"]]["loss"], rel=RTOL)




def _wait(cond, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.05)


def _no_leftovers(alive, timeout_s: float = 15.0) -> None:
    """Wait until no process of the test is left (`alive`: `run_processes`' lister); fails naming
    those still alive after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while (left := alive()) and time.monotonic() < end:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


@contextlib.contextmanager
def run_processes(marker: str):
    """Yields a lister of (pid, command line) of the test's live processes: those started inside the
    block (`conftest.own_processes`: a live pool's processes name only a control folder elsewhere) and
    any whose command line names `marker` (the test's folder, as torchrun's ranks do)."""
    with own_processes() as marked:
        yield lambda: list({**dict(live_processes(marker)), **dict(marked())}.items())


@pytest.mark.integration
def test_shrink_and_grow_4_2_4_by_restarts(tmp_path, reference_losses):
    # (with global batch 8 a third GPU does not pay: 3 uneven replicas are predicted slower than 2)
    steps = 40
    opts = RunOptions(job=JOB, cluster=LOCAL, trace=load_trace(_trace(tmp_path, (0, 4), (5, 2), (10, 4)), LOCAL),
                      steps=steps, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=10,
                      metrics=str(tmp_path / "m.jsonl"), events=str(tmp_path / "e.jsonl"), clock=ClockKind.STEPS,
                      switch_cost_s=0.0, in_place=False)
    with run_processes(str(tmp_path)) as alive:
        res = run(opts)
        _no_leftovers(alive)
    assert res.status is ExitStatus.DONE, res.message
    ev = _lines(tmp_path / "e.jsonl")
    assert [e["world_size"] for e in ev if e["event"] == "launch"] == [4, 2, 4]
    assert [e["zones"]["local"]["cpu"] for e in ev if e["event"] == "availability"] == [4, 2, 4]
    started = [e for e in ev if e["event"] == "switch_started"]
    finished = [e for e in ev if e["event"] == "switch_finished" and not e.get("interrupted")]
    assert [e["reason"] for e in started] == ["lost GPUs", "gain"] and res.switches == 2
    for e in finished:
        assert not e["in_place"]
        assert set(e["phases_s"]) == {"replan_s", "stop_s", "checkpoint_s", "teardown_s", "restart_s", "load_s",
                                      "first_step_s"}
        assert sum(e["phases_s"].values()) == pytest.approx(e["total_s"], abs=1e-6)
    plans = [e for e in ev if e["event"] == "plan"]
    assert all(e["predicted_throughput_iters_per_s"] > 0 for e in plans)
    assert res.steps_rolled_back == 0 and ev[-1]["event"] == "done"
    _check_trajectory(tmp_path / "m.jsonl", steps, reference_losses, rolled_back=0)


def run_disturbed(opts: RunOptions, marker: str, disturb) -> RunResult:
    """Run the controller in a thread while `disturb(out, alive)` acts on the job (`"res" in out` once
    the run has ended; `alive`: the lister of `run_processes(marker)`); once it has ended, no process
    of the test may be left (whatever is, is killed). Returns the result, which must be DONE."""
    out: dict = {}
    with run_processes(marker) as alive:
        t = threading.Thread(target=lambda: out.setdefault("res", run(opts)), daemon=True)
        t.start()
        try:
            disturb(out, alive)
            t.join(timeout=240)
            assert not t.is_alive()
            _no_leftovers(alive)
        finally:
            for pid, _ in alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert out["res"].status is ExitStatus.DONE, out["res"].message
    return out["res"]


@pytest.mark.integration
@pytest.mark.parametrize("live", PATHS)
def test_two_sigkills_roll_back_and_continue_on_survivors(tmp_path, reference_losses, live):
    steps, rng = 60, random.Random(7)
    metrics, events = tmp_path / "m.jsonl", tmp_path / "e.jsonl"
    opts = RunOptions(job=JOB, cluster=LOCAL, trace=load_trace(_trace(tmp_path, (0, 4)), LOCAL), steps=steps,
                      checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=5, metrics=str(metrics),
                      events=str(events), timeout_s=30.0, in_place=live)

    def kill_twice(out: dict, alive) -> None:
        # a crash takes its GPU away: 4 -> 3 GPUs, on which 2 replicas are the best plan (3 uneven
        # shares of global batch 8 are predicted slower), then 3 -> 2
        for kill, world in enumerate((4, 2)):
            # Wait until this launch (world ranks) has trained past a checkpoint, then kill a random rank.
            _wait(lambda: sum(1 for e in _lines(events) if e["event"] == "launch") == kill + 1)
            before = len(_lines(metrics))
            _wait(lambda: len(_lines(metrics)) >= before + 7 or "res" in out)
            assert "res" not in out, out["res"].message
            _wait(lambda: sorted(ranks_alive(alive)) == list(range(world)), 30)  # still starting under load
            os.kill(rng.choice(sorted(ranks_alive(alive).values())), signal.SIGKILL)
            _wait(lambda: sum(1 for e in _lines(events) if e["event"] == "crash") == kill + 1, 60)

    res = run_disturbed(opts, str(tmp_path), kill_twice)
    ev = _lines(events)
    assert [e["world_size"] for e in ev if e["event"] == "launch"] == [4, 2, 2]
    crashes = [e for e in ev if e["event"] == "crash"]
    assert len(crashes) == 2 and all(len(e["ranks"]) == 1 for e in crashes)
    rollbacks = [e for e in ev if e["event"] == "rollback"]
    assert sum(e["steps"] for e in rollbacks) == res.steps_rolled_back
    assert all(e["to_step"] % 5 == 0 and 0 <= e["steps"] < 5 + 1 for e in rollbacks)
    _check_trajectory(metrics, steps, reference_losses, rolled_back=res.steps_rolled_back)


@pytest.mark.integration
def test_corrupt_checkpoint_is_never_loaded(tmp_path, reference_losses):
    trace = _trace(tmp_path, (0, 2))
    ck, metrics, events = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "e.jsonl"
    base = dict(job=JOB, cluster=LOCAL, trace=load_trace(trace, LOCAL), checkpoint_dir=str(ck), checkpoint_every=3,
                metrics=str(metrics), events=str(events))
    with run_processes(str(tmp_path)) as alive:
        assert run(RunOptions(steps=6, **base)).status is ExitStatus.DONE
        stage = max((ck / "step-00000006").glob("rank-*.bin"), key=lambda f: f.stat().st_size)  # a rank holding data
        data = bytearray(stage.read_bytes())
        data[len(data) // 2] ^= 0xFF
        stage.write_bytes(bytes(data))
        res = run(RunOptions(steps=8, append_events=True, **base))  # the events of both runs in one file
        _no_leftovers(alive)
    assert res.status is ExitStatus.DONE, res.message
    ev = _lines(events)
    skipped = [e for e in ev if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and "step-00000006" in skipped[0]["reason"] and "checksum" in skipped[0]["reason"]
    assert [e["resume_step"] for e in ev if e["event"] == "launch"] == [0, 3]
    # Steps 4..6 were trained twice (first run, then after falling back to step 3): the same losses.
    _check_trajectory(metrics, 8, reference_losses, rolled_back=3)


def ranks_alive(alive) -> dict[int, int]:
    """rank -> pid of the rank processes among `alive()` ((pid, command line) pairs): a torchrun worker
    has its RANK in its environment; a live pool's process (`python -m sailor.runtime.inplace CONTROL
    PROC EPOCH`) has the rank the newest epoch file of CONTROL gives process PROC (a spare has none)."""
    out = {}
    for pid, cmd in alive():
        argv = cmd.split()
        if "sailor.runtime.inplace" in argv:
            control, proc = argv[argv.index("sailor.runtime.inplace") + 1: argv.index("sailor.runtime.inplace") + 3]
            newest = max((int(f.stem.split("-")[1]) for f in Path(control).glob("epoch-*.json")), default=None)
            rank = epochs.read(control, newest).ranks.get(int(proc)) if newest is not None else None
            if rank is not None:
                out[rank] = pid
            continue
        if "sailor.runtime.worker" not in cmd or "sailor.runtime.launcher" in cmd:
            continue  # (torchrun's own command line names the worker module too, after the launcher's)
        try:
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and b"LOCAL_RANK" in env:
            out[int(env[b"RANK"])] = pid
    return out


def interrupt_controller(args: list[str], tmp: Path, how: str, world_size: int) -> None:
    """Run `sailor run ARGS --steps 100000` with metrics, events and checkpoints in `tmp`; once 3 steps
    are done on `world_size` ranks, SIGINT it (exit 3, the last step checkpointed, a `stopped` event),
    SIGINT it twice (exit 130: killed, or 3 when the ranks had already stopped) or SIGKILL it. No process
    of the run may be left either way, nor any of its scratch folders (`core.scratch`) or torchrun's
    logs in its temp folder (TMPDIR)."""
    metrics, ck, scratch = tmp / "m.jsonl", tmp / "ck", tmp / "tmpdir"
    scratch.mkdir()
    with run_processes(str(tmp)) as alive:
        proc = subprocess.Popen([*SAILOR, "run", *args, "--steps", "100000", "--checkpoint-dir", str(ck),
                                 "--metrics", str(metrics), "--events", str(tmp / "e.jsonl")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, TMPDIR=str(scratch)))
        try:
            _wait(lambda: len(_lines(metrics)) >= 3 or proc.poll() is not None)
            assert proc.poll() is None, proc.communicate()
            assert sorted(ranks_alive(alive)) == list(range(world_size))
            if how == "sigint":
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=60)
                assert proc.returncode == 3, err
                assert f"launch: {world_size} ranks from step 0" in err  # what the user watches on stderr
                assert _lines(tmp / "e.jsonl")[-1]["event"] == "stopped"
                kept = max(r["step"] for r in _lines(metrics))
                assert (ck / f"step-{kept:08d}" / "manifest.json").exists()
            elif how == "sigint2":  # the second one kills the job, unless the ranks stopped cleanly first
                proc.send_signal(signal.SIGINT)
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=60)
                assert (proc.returncode, "killed by a second interrupt" in err) in ((130, True), (3, False)), err
            else:
                proc.kill()
                proc.wait(timeout=10)
            _no_leftovers(alive)  # (a folder's watcher is one of the run's processes: it has done its work)
            assert sorted(f.name for pattern in ("sailor-*", "torchelastic_*") for f in scratch.glob(pattern)) == []
        finally:
            if proc.poll() is None:
                proc.kill()
            for pid, _ in alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.integration
@pytest.mark.parametrize("live", PATHS)
@pytest.mark.parametrize("how", ["sigint", "sigint2", "sigkill"])
def test_interrupted_controller_leaves_no_process(tmp_path, how, live):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": "tiny", "global_batch_size": 8}))
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"provider": "local", "zones": {"local": {"cpu": 2}}}))
    interrupt_controller(["--job", str(job), "--cluster", str(cluster), "--availability",
                          str(_trace(tmp_path, (0, 2))), *([] if live else ["--restart"])], tmp_path, how, world_size=2)
