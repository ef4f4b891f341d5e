"""`sailor train`'s launcher: validate, then run torchrun with one process per rank of the plan
(on this machine; `sailor run --hosts` gives one ssh command per node instead, see `launch`). What
is checked before, and the `Prepared` run this starts, are in `runtime.prepare`.

Exit statuses (`ExitStatus`): 0 every step done; 1 a rank failed (the whole job is ended within
seconds: torchrun stops the other ranks, and the launcher kills the process group); 2 bad input,
reported before any process starts, or by a rank that refused its input (a SailorInputError, e.g.
its GPU: no kernels for it in this torch, bf16 before sm_80; the rank's one line); 3 stopped on
request after writing a checkpoint; 130 killed by a second interrupt.

Stop protocol: SIGTERM or SIGINT to the launcher (or creating the `stop_file`) asks every rank to
finish its current step; they agree at the next step boundary, write a checkpoint (if a checkpoint
folder is set) and exit; the launcher then exits 3. A second signal kills the job at once.

torchrun (or ssh) runs in its own session (process group); every rank has the kernel kill it if
torchrun dies (PR_SET_PDEATHSIG), the local torchrun gets SIGTERM if the launcher dies (a remote one
is hung up by its ssh terminal), and the launcher kills every group it started on every exit path,
so no process is left behind. Every rank gets its settings from `command.WorkerSettings`
(`prepare.worker_settings`);
rank 0 of the worker writes the metrics lines (`--metrics`) and TensorBoard files itself.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor.core.process import die_with_parent
from sailor.core.scratch import scratch_dir
from sailor.runtime.prepare import Prepared

EVENT_PREFIX = "SAILOR_EVENT "  # the worker's event lines (sailor.runtime.worker.emit)
MONITOR_INTERVAL_S = 0.2  # how often torchrun checks its ranks: a crash is noticed within this
FAIL_GRACE_S = 3.0  # after one process fails, how long the others (other nodes) get to end on their own
EXIT_GRACE_S = 30.0  # after rank 0 reports the end (done, stopped), how long the processes get to exit
# Runs a command that gets SIGTERM when the launcher dies (`core.process`): what no launcher may leave behind.
EXEC = (sys.executable, "-m", "sailor.core.process")


class ExitStatus(enum.IntEnum):
    """Exit statuses of `sailor train` (module docstring)."""

    DONE = 0
    FAILED = 1
    BAD_INPUT = 2
    STOPPED = 3
    KILLED = 130

@dataclass
class TrainResult:
    """How a run ended."""

    status: ExitStatus
    message: str
    last_step: int | None = None  # steps completed (as counted by the last step event)
    checkpoint: str | None = None  # the last checkpoint written
    events: list[dict[str, Any]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (rank, exit status) torchrun reported, root cause first
    stderr_tail: str = ""  # the end of torchrun's output when the run failed (the first failing node's first)
    failed_process: int | None = None  # index of the command (node) that failed first
    process_failure: str = ""  # "<label> exited with status <n>: <its last line>", or "aborted"

def worker_command(prep: Prepared, stop_file: str, log_dir: str) -> list[str]:
    """The local torchrun command line (through `_main`): every rank on this machine. torchrun keeps
    its logs under `log_dir` (the launch's scratch folder)."""
    return [sys.executable, "-m", "sailor.runtime.launcher", "--standalone", "--log-dir", log_dir,
            "--nproc-per-node", str(prep.plan.world_size), "--monitor-interval", str(MONITOR_INTERVAL_S),
            *prep.settings(stop_file).argv()]


def launch(prep: Prepared, *, on_event: Callable[[dict[str, Any]], None] | None = None,
           handle_signals: bool = True, echo_stderr: bool = False,
           commands: Sequence[Sequence[str]] | None = None, labels: Sequence[str] | None = None,
           abort: threading.Event | None = None) -> TrainResult:
    """Start the ranks of `prep` and wait for them; `on_event` sees every worker event (progress).

    Args:
        prep: the validated run.
        on_event: called (from a reader thread) with each worker event, e.g. {"event": "step", ...}.
        handle_signals: install the SIGTERM/SIGINT stop protocol (on the main thread only).
        echo_stderr: copy the processes' stderr to ours.
        commands: the processes to start, each in its own session. Default: one local torchrun for
            every rank (`worker_command`). `sailor run --hosts` passes one ssh per node
            (`sailor.launch.torchrun.ssh_argv`); they must watch `prep.options.stop_file`.
        labels: a name per command for messages (e.g. its host).
        abort: once set, every process is killed at once (status FAILED, "aborted").
    Returns:
        TrainResult (`failed_process`: index of the command that failed first). Rank 0 of the
        worker writes `options.metrics` and `options.tensorboard` and adds `mfu` to its step events
        (`metrics.StepLog`); this call only reads the events.

    When one process fails, the others get FAIL_GRACE_S to end on their own (their ranks notice the
    lost peer and say so, which tells the root cause from its victims); then every process group is
    killed. No process outlives this call.
    """
    o = prep.options
    assert commands is None or o.stop_file, "commands of a run must watch its stop file"
    with scratch_dir("sailor-train-") as tmp:
        stop_file = o.stop_file or os.path.join(tmp, "stop")
        argvs = [[*EXEC, *c] for c in commands] if commands else [worker_command(prep, stop_file, os.path.join(tmp, "torchrun"))]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        result = TrainResult(ExitStatus.FAILED, "")
        lock = threading.Lock()
        signals = {"count": 0}
        ended: list[float] = []  # when rank 0 reported the run's end
        procs: list[subprocess.Popen] = []
        tails: list[collections.deque[str]] = []
        readers: list[threading.Thread] = []

        def on_line(line: str, tail: collections.deque[str], stream) -> None:
            line = line.replace("\r", "")  # an ssh terminal ends lines with \r\n
            if not line.startswith(EVENT_PREFIX):
                tail.append(line)  # torchrun's failure report; over ssh -tt stderr arrives on stdout
                if stream is not None:
                    stream.write(line)
                return
            ev = parse_event(line)
            if ev is not None:
                with lock:
                    result.events.append(ev)
                    if ev.get("event") in ("done", "stopped"):
                        ended.append(time.monotonic())
                if on_event:
                    on_event(ev)

        def read(pipe, tail, stream) -> None:
            for line in pipe:
                on_line(line, tail, stream)

        def on_signal(signum, frame) -> None:
            signals["count"] += 1
            if signals["count"] == 1:
                Path(stop_file).touch()  # ranks agree on it at the next step boundary
            else:
                kill_groups(procs)

        old = {}
        if handle_signals and threading.current_thread() is threading.main_thread():
            old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        order: list[int] = []
        try:
            for argv in argvs:
                proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
                procs.append(proc)
                tails.append(collections.deque(maxlen=200))
                readers += [threading.Thread(target=read, args=(proc.stdout, tails[-1], sys.stdout), daemon=True),
                            threading.Thread(target=read, args=(proc.stderr, tails[-1],
                                                                sys.stderr if echo_stderr else None), daemon=True)]
                readers[-2].start()
                readers[-1].start()
            returncode = _wait_all(procs, order, abort, ended)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            kill_groups(procs)
            for t in readers:
                t.join(timeout=5)
        # The failure report of the process that failed first comes first (its root cause).
        first = next((i for i in order if procs[i].returncode), None)
        order += [i for i in range(len(procs)) if i not in order]
        stderr_tail = "".join(line for i in order for line in tails[i])
        if first is not None:
            result.failed_process = first
            last = next((x.strip() for x in reversed(tails[first]) if x.strip()), "no output")
            name = labels[first] if labels else "torchrun"
            result.process_failure = f"{name} exited with status {procs[first].returncode}: {last[:200]}"
        elif abort is not None and abort.is_set():
            returncode, result.process_failure = -signal.SIGKILL, "aborted"
        return finish_result(result, returncode, signals["count"], stderr_tail)


def _wait_all(procs: list[subprocess.Popen], order: list[int], abort: threading.Event | None,
              ended: list[float]) -> int:
    """Wait for every process, appending the index of each to `order` as it exits. Once one has
    failed, the others get FAIL_GRACE_S; once rank 0 has reported the end (`ended`), they get
    EXIT_GRACE_S (a process stuck on its way out must not hang the launcher); `abort` set ends the
    wait. Returns 0, or the first failure's exit status."""
    failed_at = None
    while len(order) < len(procs) and not (abort is not None and abort.is_set()):
        if ended and time.monotonic() - ended[0] > EXIT_GRACE_S:
            break
        order += [i for i, p in enumerate(procs) if i not in order and p.poll() is not None]
        if failed_at is None and any(procs[i].returncode for i in order):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAIL_GRACE_S:
            break
        time.sleep(0.1)
    return next((procs[i].returncode for i in order if procs[i].returncode), 0)


def parse_event(line: str) -> dict[str, Any] | None:
    """The event of a worker's event line (`EVENT_PREFIX` + JSON, `worker.emit`); None for a line
    that is not one or whose JSON is cut or broken."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        return json.loads(line[len(EVENT_PREFIX):])
    except ValueError:
        return None


def kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every process group of `procs` (each was started in a session of its own)."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def finish_result(result: TrainResult, returncode: int, signals: int, stderr_tail: str) -> TrainResult:
    """`result` completed from its events and how its processes ended: last step, newest checkpoint,
    and the exit status (`returncode`, `signals` = stop signals received, `stderr_tail` for messages)."""
    steps = [e for e in result.events if e["event"] == "step"]
    result.last_step = steps[-1]["step"] if steps else None
    ckpts = [e for e in result.events if e["event"] in ("checkpoint", "stopped") and e.get("checkpoint", e.get("path"))]
    if ckpts:
        result.checkpoint = ckpts[-1].get("path") or ckpts[-1].get("checkpoint")
    stopped = [e for e in result.events if e["event"] == "stopped"]
    errors = [e for e in result.events if e["event"] == "error"]
    if returncode == 0 and stopped:
        result.status = ExitStatus.STOPPED
        where = f"; checkpoint {result.checkpoint}" if result.checkpoint else " (no --checkpoint-dir: nothing saved)"
        result.message = f"stopped on request before step {stopped[-1]['step'] + 1}{where}"
    elif returncode == 0:
        result.status = ExitStatus.DONE
        result.message = f"done: {result.last_step or 0} steps"
    elif signals >= 2:
        result.status = ExitStatus.KILLED
        result.message = "killed by a second interrupt"
    elif refused := _refused_input(errors):
        # A rank refused what it was given (its GPU: no kernels in this torch, no bf16; too few GPUs):
        # bad input, exit 2 with the rank's one line, as every check before the start.
        result.status = ExitStatus.BAD_INPUT
        result.failed = result.failed or failed_ranks(stderr_tail)
        result.message = refused
    else:
        result.status = ExitStatus.FAILED
        result.failed = result.failed or failed_ranks(stderr_tail)
        why = _first_failure(errors, result.failed, result.process_failure) or result.process_failure \
            or f"exit status {returncode}"
        if len(why) > 300:
            why = why[:297] + "..."
        result.message = f"training failed ({why}); all ranks stopped"
        result.stderr_tail = stderr_tail[-4000:]
    return result


def failed_ranks(stderr: str) -> list[tuple[str, str]]:
    """(rank, exit status) of each failed rank in torchrun's failure report, root cause first."""
    if "Root Cause" in stderr:
        i = stderr.index("Root Cause")
        stderr = stderr[i:] + stderr[:i]
    out, rank = [], None
    for line in stderr.splitlines():
        s = line.strip()
        if s.startswith("rank") and ":" in s:
            rank = s.split(":", 1)[1].split("(")[0].strip()
        elif s.startswith("exitcode") and ":" in s and rank is not None:
            out.append((rank, s.split(":", 1)[1].split("(")[0].strip()))
            rank = None
    return out


def _refused_input(errors: list[dict[str, Any]]) -> str | None:
    """"rank <r>: <line>" of the first rank that stopped on bad input (a SailorInputError: its error
    event reads "SailorInputError: <one line>", `worker._report`), or None."""
    prefix = "SailorInputError: "
    own = [e for e in errors if str(e.get("error", "")).startswith(prefix)]
    return f"rank {own[0]['rank']}: {own[0]['error'][len(prefix):]}" if own else None


def _first_failure(errors: list[dict[str, Any]], failures: list[tuple[str, str]],
                   process_failure: str = "") -> str | None:
    """The most likely cause: a rank's own error; else a rank that died without one (not one torchrun
    stopped with SIGTERM), followed by `process_failure` (the first failed process's last line: ssh's
    "Could not resolve hostname" for a live pool's rank on an unreachable host); else an error of a
    rank that only lost contact with a peer. A failed process without a rank (rank "": a live pool's
    process started for a switch not yet published) is left to the caller's `process_failure`, which
    names its host."""
    own = [e for e in errors if not e.get("peer_lost")]
    if own:
        return f"rank {own[0]['rank']} failed: {own[0]['error']}"
    reported = {str(e["rank"]) for e in errors}
    silent = [(r, c) for r, c in failures if r and r not in reported and c != "-15"]
    if silent:
        why = f"rank {silent[0][0]} exited with status {silent[0][1]}"
        return f"{why}: {process_failure}" if process_failure and process_failure != "aborted" else why
    if errors:
        return f"rank {errors[0]['rank']} failed: {errors[0]['error']}"
    return None


def _main(argv: list[str]) -> None:
    """torchrun with arguments `argv` (what `python -m sailor.runtime.launcher` runs: the local
    `worker_command`, and every node's agents, `launch.common.torchrun_command`). Unless `argv` (or
    torchrun's PET_LOG_DIR) names a log folder, torchrun keeps its logs in a scratch folder of this
    process (`core.scratch`), removed when it ends however it ends: left to itself, torchrun makes a
    torchelastic_XXXX folder in the temp folder of each node and never removes it."""
    # Made to receive SIGTERM when the launcher dies (Linux; kept across exec), then torchrun (it stops
    # its ranks).
    die_with_parent(signal.SIGTERM)
    from torch.distributed.run import main, parse_args

    if parse_args(argv).log_dir is not None:
        main(argv)
        return
    with scratch_dir("sailor-torchrun-") as tmp:
        main(["--log-dir", tmp, *argv])


if __name__ == "__main__":
    _main(sys.argv[1:])
