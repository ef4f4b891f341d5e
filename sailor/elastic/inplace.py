"""`sailor run`'s live switches (`--in-place`, the default): a pool of rank
processes that lives across plan switches (`InPlaceRun`, with `launches.Running`'s interface), so
the ranks that stay keep their process, weights and optimizer state, and the state moves in memory
(`sailor.runtime.inplace`).

The pool starts one process per rank of the first plan plus spares (already past their imports,
waiting), up to `processes` in all, each `python -m sailor.runtime.inplace CONTROL PROC EPOCH` in a
session of its own, and publishes epoch 0 (`runtime.epochs`): the first plan, resumed from the
prepared checkpoint. A switch (`switch`) assigns the new plan's ranks (each (zone, GPU type) of the
new plan's layout taken first by the processes holding that type now, in rank order, keeping their
rank where they can; then by spares, those past their imports first) and starts the processes it
still lacks; once those are past their imports ("ready" events; the old ranks train on meanwhile)
it publishes the next epoch (the new plan, the new ranks and the old ones; a "switch_published"
event on `events`), then asks the current ranks to stop at the step boundary (their stop file).
Processes of the old plan without a new rank drop their state once it is sent and wait as spares
(on the local provider a GPU is a process slot); after the first step under the new plan, fresh
spares replace any process that ended, up to `processes` (started after the move, not during it),
so a grow rarely waits for a start-up.

On named machines (`sailor run --hosts`, `remote.HostPool`) each process is an ssh session of its
own (`HostPool.process_command`, started through `launcher.EXEC`, so it hangs up when the controller
dies) on the machine of its rank's node (`HostPool.place`: the machines that hold processes first),
in a device slot of that machine (`epochs.SLOT_ENV`), and the epoch files carry each process's host
(its groups meet on rank 0's machine). A process belongs to its machine: the ranks of a machine's
node go to the processes on that machine (keeping their rank where they can), a machine without one
gets fresh processes (the switch is published once they are ready). A process of a machine the new
plan does not use stays there as a spare once it has sent its state (in its device slot, its state
dropped: `runtime.inplace`), so that a later grow onto that machine hands it a rank instead of
starting a process; only the processes of a lost machine (`lost`) leave (exit). No fresh spares are
started there; the control folder lives in the shared `control/` folder and is removed when the pool
ends. A process there gets its environment in its command (`remote_env`: ssh
forwards none). `nodes` (`remote.NodeLaunch`, one "node" per process: its command,
host and machine, and each rank's machine in the latest epoch; it grows as processes start) tells the controller which machines
to leave out after a failure (`launches.failed_machines`).

A spare (a process with no rank in the latest epoch, none in a switch under way: `busy`) that
exits, whatever its status (killed, its machine lost), is dropped from the pool and fails nothing;
a later switch starts a fresh process where it needs one.

The run ends (`result`, a `launcher.TrainResult`) when every rank of the latest epoch has exited:
DONE after the "done" event, STOPPED after a stop that was not a switch, FAILED when a process exited
with an error (`failed` lists (rank, exit status) of those that failed on their own, the first one
first; the others get `launcher.FAIL_GRACE_S` to report, then every process is killed). The
controller restarts every rank from the newest checkpoint after a failure, the checkpoint path,
which for a failure during a switch is the checkpoint the ranks wrote at its step boundary, or, when
they wrote none there (the survivors held every piece and periodic checkpoints are on), the newest
periodic one (`sailor.runtime.inplace`, "Failure").

No process outlives the pool: every process is started from the pool's thread with
PR_SET_PDEATHSIG (`core.process.die_with_parent`), and the pool kills every session it started on
every exit path, the spares included: a spare never outlives its run. After a failure the
controller ends the pool (spares too) and starts a new one from the checkpoint; `--restart` has no
pool. This module never imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sailor.elastic.remote import HostPool, Machine, NodeLaunch
from sailor.launch.hosts import bare_host
from sailor.plan import load_plan
from sailor.plan.placement import rank_layout
from sailor.plan.spec import Plan
from sailor.runtime import epochs
from sailor.runtime.launcher import (
    EVENT_PREFIX,
    EXEC,
    FAIL_GRACE_S,
    ExitStatus,
    TrainResult,
    finish_result,
    kill_groups,
    parse_event,
)
from sailor.runtime.prepare import Prepared

MODULE = "sailor.runtime.inplace"


@dataclass(frozen=True)
class _PendingSwitch:
    """A switch prepared (`InPlaceRun._prepare_switch`) and not published yet: its plan file, process
    id -> rank, the processes that leave, the processes started for it (published once all are past
    their imports), and how many of its ranks went to spares already running."""

    plan_file: str
    ranks: dict[int, int]
    leave: list[int]
    started: set[int]
    spares_used: int = 0


@dataclass
class _Proc:
    argv: list[str]
    machine: Machine | None = None  # on named machines
    slot: int = 0  # its device index there
    popen: subprocess.Popen | None = None  # None until started
    tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=200))

    def alive(self) -> bool:
        return self.popen is None or self.popen.poll() is None


def match(old: dict[int, tuple[int, Hashable]], new: list[tuple[int, Hashable]],
          spares: list[tuple[int, Hashable | None]]) -> dict[int, int]:
    """Process id -> new rank. `old`: process id -> (its rank, where it runs) of the processes with a
    rank now; `new`: (rank, where it must run) of every new rank, in order; `spares`: (process id,
    where it runs, None: anywhere) of the others, in order of preference. Each new rank is taken
    first by the process that had that rank where it must run, then by the lowest-ranked other
    process there, then by the first spare that fits. Raises ValueError when none is left for a rank.
    """
    free = sorted(old, key=lambda p: old[p][0])
    spare = list(spares)
    out: dict[int, int] = {}
    for rank, want in new:
        there = [p for p in free if old[p][1] == want]
        pick = [p for p in there if old[p][0] == rank] or there
        fits = [p for p, at in spare if at is None or at == want]
        if pick:
            free.remove(pick[0])
            out[pick[0]] = rank
        elif fits:
            spare = [(p, at) for p, at in spare if p != fits[0]]
            out[fits[0]] = rank
        else:
            raise ValueError(f"no process left for rank {rank} ({want})")
    return out


def on_machines(pool: HostPool, plan: Plan, lost: set[Machine], old: dict[int, tuple[int, Machine]],
                spares: list[tuple[int, Machine]], next_id: int) -> tuple[dict[int, int], list[Machine], list[int]]:
    """A live pool's ranks of `plan` on named machines (module docstring): (process id -> rank, the
    machine of each process to start, ids `next_id`, `next_id` + 1, ..., the processes that leave).

    `old`: process id -> (rank, machine) of the processes with a rank now; `spares`: (process id,
    machine) of the other live processes, in order of preference. The plan's nodes go where
    `HostPool.place` puts them (the machines holding the most of these processes first, none of
    `lost`); a machine gets as many new processes as its node has ranks beyond the processes it
    holds (its spares first); the processes of a machine no node uses stay as spares, those of a
    lost machine leave.
    """
    at = {p: m for p, (_, m) in old.items()} | dict(spares)
    placed = pool.place(plan, lost, collections.Counter(at.values()))
    layout = rank_layout(plan, pool.node_size)
    new: list[Machine] = []
    for m, n in collections.Counter(placed[i.node] for i in layout).items():
        new += [m] * max(0, n - sum(1 for x in at.values() if x == m))
    fresh = list(enumerate(new, start=next_id))
    ranks = match(old, [(i.rank, placed[i.node]) for i in layout], [*spares, *fresh])
    return ranks, new, [p for p, m in at.items() if m in lost]


def busy(ranks: dict[int, int], moving_from: dict[int, int], pending: dict[int, int]) -> set[int]:
    """The pool processes whose exit fails the run: the ranks of the latest epoch (`ranks`), those of
    the epoch a switch is moving from until its first step (`moving_from`: a leaver may still send
    state), and those a prepared switch assigned (`pending`). Any other process is a spare, dropped
    when it exits (module docstring). Arguments map process id -> rank."""
    return set(ranks) | set(moving_from) | set(pending)


def remote_env(slot: int, environ: dict[str, str]) -> dict[str, str]:
    """The environment a pool process on a named machine gets in its command (ssh forwards none): its
    device slot (`epochs.SLOT_ENV`), one OpenMP thread, unbuffered output, and the move's fault hook
    when `environ` (the controller's) sets it (`epochs.FAULT_MOVE_ENV`, for tests)."""
    hook = {epochs.FAULT_MOVE_ENV: environ[epochs.FAULT_MOVE_ENV]} if epochs.FAULT_MOVE_ENV in environ else {}
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", epochs.SLOT_ENV: str(slot), **hook}


def assign(old_plan: str, old_ranks: dict[int, int], new_plan: str, spares: list[int]) -> dict[int, int]:
    """Process id -> rank under `new_plan` on the local provider (`match`, "where" a rank runs being
    its (zone, GPU type); spares fit anywhere). Raises ValueError when the spares run out."""
    old_layout, new_layout = rank_layout(load_plan(old_plan)), rank_layout(load_plan(new_plan))
    return match({p: (r, (old_layout[r].zone, old_layout[r].gpu)) for p, r in old_ranks.items()},
                 [(i.rank, (i.zone, i.gpu)) for i in new_layout], [(p, None) for p in spares])


class RunHandle:
    """What the controller watches of the ranks it started, in a background thread (`thread`, set by
    the subclass): `launches.Running` (one launch) or `InPlaceRun` (a pool across switches). Events
    arrive on `events` stamped with `time.monotonic()`; `result` or `error` is set once it ended."""

    def __init__(self, prepared: Prepared, stop_file: str | None, nodes=None) -> None:
        self.prepared, self.nodes, self.stop_file = prepared, nodes, stop_file
        self.launched_at = time.monotonic()
        self.started = False  # the ranks' process groups are up
        self.abort = threading.Event()
        self.killed = ""  # why the controller ended it
        self.events: queue.Queue[tuple[float, dict[str, Any]]] = queue.Queue()
        self.result: TrainResult | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def stop(self) -> None:
        """Ask the ranks to stop at the next step boundary (checkpoint, then exit)."""
        Path(self.stop_file).touch()

    def kill(self, why: str) -> None:
        """End every process now."""
        self.killed = self.killed or why
        self.abort.set()

    def done(self) -> bool:
        """True once it has ended (its result or error is set)."""
        return not self.thread.is_alive()


class InPlaceRun(RunHandle):
    """A pool of rank processes running `prepared` and the plans it is switched to (module docstring).
    `work`: a folder for its control files; `processes`: how many processes it keeps on this machine
    (ranks and spares, at least the plan's world size); `hosts`: run them on these machines instead,
    none of `lost` (the controller's set, read at each switch). The run must have a checkpoint folder
    (ValueError). Events arrive on `events` stamped with `time.monotonic()`, as `launches.Running`'s."""

    def __init__(self, prepared: Prepared, work: str, *, processes: int, hosts: HostPool | None = None,
                 lost: set[Machine] | None = None) -> None:
        if not prepared.options.checkpoint_dir:
            raise ValueError("a live switch falls back to a checkpoint when it fails: the run needs a checkpoint folder")
        self.control = Path(tempfile.mkdtemp(dir=work, prefix="inplace-"))
        super().__init__(prepared, self._stop_file(0),
                         None if hosts is None else NodeLaunch(commands=[], hosts=[], node_machine=[], rank_machine={}))
        self.hosts, self.lost = hosts, lost if lost is not None else set()
        world = prepared.plan.world_size
        self.processes = max(processes, world) if hosts is None else world
        self.epoch = 0
        self.plan_file = str(Path(prepared.options.plan).resolve())
        self.ranks: dict[int, int] = {}  # process id -> rank, latest epoch
        self._requests: queue.Queue[str] = queue.Queue()
        self._procs: dict[int, _Proc] = {}
        self._lock = threading.Lock()
        self._ended: list[str] = []  # "done" / "stopped" events that ended the run
        self._switching = 0  # switches published whose old ranks have not stopped yet
        self._refill = False  # start spares after the next step
        self._moving_from: dict[int, int] = {}  # the last switch's old ranks, until its first step
        self._dropped: set[int] = set()  # spares that exited
        self._exits: list[tuple[int, int]] = []  # (process id, exit status) in the order seen
        self._records: list[dict[str, Any]] = []
        self._ready: set[int] = set()  # processes past their imports ("ready" events)
        self._pending: _PendingSwitch | None = None
        # one OpenMP thread per process unless set, as torchrun gives its ranks (a rank per core or GPU)
        self._env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
        if hosts is None:
            self._add(self.processes)
            self._set_ranks({p: p for p in range(world)})
        else:
            self._set_ranks(self._place(prepared.plan, [])[0])
        self.thread = threading.Thread(target=self._run, name="sailor-inplace", daemon=True)
        self.thread.start()

    # ---- the controller's side -----------------------------------------------------------------
    def switch(self, plan_file: str) -> None:
        """Move the run to the plan in `plan_file` at the next step boundary (module docstring)."""
        self._requests.put(str(Path(plan_file).resolve()))

    # ---- the pool's thread ---------------------------------------------------------------------
    def _stop_file(self, k: int) -> str:
        return str(self.control / f"stop-{k}")

    def _argv(self, k: int, resume: bool) -> list[str]:
        """The worker settings of epoch `k` (its plan and stop file); `resume` False: a switch, whose
        state comes from the live ranks, so no checkpoint or Hugging Face folder to start from."""
        settings = dataclasses.replace(self.prepared.settings(self._stop_file(k)), plan=self.plan_file)
        if not resume:
            settings = dataclasses.replace(settings, resume_from=None, init_from=None)
        return settings.argv()

    def _add(self, n: int, machine: Machine | None = None) -> list[int]:
        """Add `n` processes (on `machine`, in its free device slots, on named machines); they start
        with the next `_start`. Returns their process ids."""
        added = []
        for _ in range(n):
            pid = len(self._procs)
            argv = [sys.executable, "-m", MODULE, str(self.control), str(pid), str(self.epoch)]
            if machine is None:
                self._procs[pid] = _Proc(argv)
            else:
                used = {p.slot for p in self._procs.values() if p.machine == machine and p.alive()}
                slot = min(set(range(self.hosts.node_size[machine[1]])) - used)
                argv = [*EXEC, *self.hosts.process_command(machine, [self.hosts.python, *argv[1:]],
                                                           remote_env(slot, self._env), pid)]
                self._procs[pid] = _Proc(argv, machine, slot)
                with self._lock:
                    self.nodes.commands.append(argv)
                    self.nodes.hosts.append(self.hosts.host(machine))
                    self.nodes.node_machine.append(machine)
            added.append(pid)
        return added

    def _start(self) -> None:
        """Start every process added and not started yet, each in a session of its own."""
        for proc in self._procs.values():
            if proc.popen is None:
                proc.popen = subprocess.Popen(proc.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, env=self._env, start_new_session=True)
                for stream in (proc.popen.stdout, proc.popen.stderr):
                    threading.Thread(target=self._read, args=(stream, proc), daemon=True).start()

    def _place(self, plan: Plan, spares: list[int]) -> tuple[dict[int, int], list[int]]:
        """On named machines: (process id -> rank under `plan`, processes that leave) by `on_machines`,
        the processes it asks for added; the latest epoch's ranks are `self.ranks`, the other live
        processes `spares`."""
        at = {p: proc.machine for p, proc in self._procs.items()}
        ranks, new, leave = on_machines(self.hosts, plan, self.lost, {p: (r, at[p]) for p, r in self.ranks.items()},
                                        [(p, at[p]) for p in spares], len(self._procs))
        for m in new:
            self._add(1, m)
        return ranks, leave

    def _set_ranks(self, ranks: dict[int, int]) -> None:
        """`ranks` (process id -> rank) are the latest epoch's; on named machines `nodes` says where
        each rank runs."""
        self.ranks = ranks
        if self.nodes is not None:
            with self._lock:
                self.nodes.rank_machine.clear()
                self.nodes.rank_machine.update({r: self._procs[p].machine for p, r in ranks.items()})

    def _hosts(self) -> dict[int, str] | None:
        """Process id -> host of every process on named machines (epoch files), None on this machine."""
        if self.hosts is None:
            return None
        return {p: bare_host(self.hosts.host(proc.machine)) for p, proc in self._procs.items()}

    def _read(self, stream, proc: _Proc) -> None:
        for line in stream:
            line = line.replace("\r", "")  # an ssh terminal ends lines with \r\n
            if not line.startswith(EVENT_PREFIX):
                proc.tail.append(line)
                continue
            ev = parse_event(line)
            if ev is not None:
                now = time.monotonic()
                with self._lock:
                    kind = ev.get("event")
                    if kind == "stopped" and self._switching:
                        self._switching -= 1
                        self._records.append({**ev, "event": "switch_stop"})
                    else:
                        self._records.append(ev)
                        if kind in ("done", "stopped"):
                            self._ended.append(kind)
                    if kind in ("started", "loaded"):
                        self.started = True
                    if kind == "ready":
                        self._ready.add(int(ev["process"]))
                self.events.put((now, ev))

    def _prepare_switch(self, plan_file: str) -> None:
        """Assign the ranks of the plan in `plan_file` and start the processes it lacks; the switch is
        published (`_publish_switch`) once they are past their imports, the old ranks training on
        meanwhile."""
        with self._lock:  # spares past their imports first
            spares = sorted((p for p in self._procs if p not in self.ranks and self._procs[p].alive()),
                            key=lambda p: (p not in self._ready, p))
        leave: list[int] = []
        before = len(self._procs)
        if self.hosts is not None:
            ranks, leave = self._place(load_plan(plan_file), spares)
        else:
            need = load_plan(plan_file).world_size - len(spares) - len(self.ranks)
            if need > 0:  # newcomers (no spare was ready)
                spares += self._add(need)
            ranks = assign(self.plan_file, self.ranks, plan_file, spares)
        self._start()
        self._pending = _PendingSwitch(plan_file, ranks, leave, set(range(before, len(self._procs))),
                                       sum(1 for p in ranks if p in spares and p < before))

    def _publish_switch(self, pending: _PendingSwitch) -> None:
        """Publish the prepared switch (`_prepare_switch`): the next epoch, then the old ranks' stop request."""
        plan_file, ranks, leave = pending.plan_file, pending.ranks, pending.leave
        self.events.put((time.monotonic(), {"event": "switch_published", "epoch": self.epoch + 1,
                                            "spares_used": pending.spares_used}))
        old_plan, old_ranks = self.plan_file, dict(self.ranks)
        self._moving_from = old_ranks
        self.plan_file, k = plan_file, self.epoch + 1
        self._set_ranks(ranks)
        epochs.publish(self.control, epochs.Epoch(k, self._argv(k, resume=False), ranks, old_plan, old_ranks,
                                                  self._hosts(), self._port(), tuple(leave)))
        old_stop, self.epoch, self.stop_file = self.stop_file, k, self._stop_file(k)
        with self._lock:
            self._switching += 1
        self._refill = self.hosts is None
        Path(old_stop).touch()  # after the epoch file: a rank that stops finds it

    def _port(self) -> int:
        return self.hosts.rdzv_port if self.hosts is not None else 0

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - handed to the controller thread
            self.error = e
        finally:
            kill_groups([p.popen for p in self._procs.values() if p.popen is not None])
            if self.hosts is not None:  # (on the shared storage; on this machine the controller's folder goes)
                shutil.rmtree(self.control, ignore_errors=True)

    def _serve(self) -> None:
        epochs.publish(self.control, epochs.Epoch(0, self._argv(0, resume=True), self.ranks, hosts=self._hosts(),
                                                  port=self._port()))
        self._start()
        failed_at = None
        while not self.abort.is_set():
            if self._pending is None:
                with contextlib.suppress(queue.Empty):
                    self._prepare_switch(self._requests.get_nowait())
            with self._lock:
                ready = self._pending is not None and self._pending.started <= self._ready
            if ready:
                self._publish_switch(self._pending)
                self._pending = None
            working = busy(self.ranks, self._moving_from, self._pending.ranks if self._pending else {})
            for pid, proc in self._procs.items():
                code = proc.popen.poll()
                if code is None or pid in self._dropped or any(pid == p for p, _ in self._exits):
                    continue
                if pid not in working:
                    self._dropped.add(pid)  # a spare: gone from the pool, nothing lost
                    continue
                self._exits.append((pid, code))
                if code and failed_at is None:
                    failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAIL_GRACE_S:
                break
            if failed_at is None and not self._switching and self._requests.empty() \
                    and all(not self._procs[p].alive() for p in self.ranks):
                break  # every rank of the latest epoch has exited cleanly
            if self._moving_from and not self._switching and self._saw_step_since_switch():
                self._moving_from = {}  # the switch is over: its leavers are spares now
                if self._refill:
                    self._refill = False
                    alive = sum(1 for p in self._procs.values() if p.alive())
                    self._add(max(0, self.processes - alive))
                    self._start()
            time.sleep(0.02)
        self._finish(failed_at is not None)

    def _saw_step_since_switch(self) -> bool:
        with self._lock:
            last = next((e for e in reversed(self._records) if e.get("event") in ("step", "switch_stop")), None)
        return last is not None and last["event"] == "step"

    def _finish(self, failed: bool) -> None:
        procs = [p.popen for p in self._procs.values()]
        kill_groups(procs)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        with self._lock:
            records = list(self._records)
        result = TrainResult(ExitStatus.FAILED, "", events=records)
        own = [(pid, code) for pid, code in self._exits if code]
        result.failed = [(str(self.ranks.get(pid, "")), str(code)) for pid, code in own]
        tail = "".join(line for pid, _ in own for line in self._procs[pid].tail)
        if own:
            result.failed_process = own[0][0]
            last = next((x.strip() for x in reversed(self._procs[own[0][0]].tail) if x.strip()), "no output")
            where = f" on {self.nodes.hosts[own[0][0]]}" if self.nodes is not None else ""
            result.process_failure = f"process {own[0][0]}{where} exited with status {own[0][1]}: {last[:200]}"
        returncode = own[0][1] if own else 0
        if not failed and self.abort.is_set():
            returncode, result.process_failure = -9, "aborted"
        elif not failed and not self._ended:
            returncode = 1  # every rank exited without saying it was done or stopped
        self.result = finish_result(result, returncode, 0, tail)
