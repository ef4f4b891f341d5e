"""One launch of a plan as `sailor run`'s controller (`sailor.elastic.controller`) watches it: the
launch in a background thread (`Running`; a live pool across switches is `inplace.InPlaceRun`), the
timestamps of a switch or recovery in progress (`Switch`), whether processes are still starting (the
start timeout, `starting_since`), whom a failed launch blames (`dead_ranks`, `failed_machines`), and
killing what is left (`kill_children`).

This module never imports torch: the runtime runs in other processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sailor.elastic.inplace import RunHandle
from sailor.elastic.remote import Machine, NodeLaunch
from sailor.runtime.launcher import TrainResult, launch
from sailor.runtime.prepare import Prepared

START_TIMEOUT = "the ranks' process groups did not form"  # how a start timeout's message begins


class Running(RunHandle):
    """One launch of a prepared run in a background thread (`RunHandle`). With `nodes` (a host pool's
    launch) the ranks run on those machines, else on this one."""

    def __init__(self, prepared: Prepared, nodes: NodeLaunch | None = None) -> None:
        super().__init__(prepared, prepared.options.stop_file, nodes)
        self.thread = threading.Thread(target=self._run, name="sailor-launch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = launch(self.prepared, on_event=lambda ev: self.events.put((time.monotonic(), ev)),
                                 handle_signals=False, commands=self.nodes.commands if self.nodes else None,
                                 labels=self.nodes.hosts if self.nodes else None, abort=self.abort)
        except BaseException as e:  # noqa: BLE001 - handed to the controller thread
            self.error = e


@dataclass
class Switch:
    """Timestamps (monotonic s) of a switch or recovery in progress."""

    reason: str
    began: float
    replan_s: float = 0.0
    stop_requested: float | None = None
    last_step_after_request: float | None = None
    stopped: float | None = None
    exited: float | None = None
    launched: float | None = None
    started: float | None = None
    loaded: float | None = None
    in_place: bool = False
    """Switched live (`inplace`): no process exits; the phases are the start of the processes the new
    plan lacks (the old plan training on), the stop, the checkpoint, the rendezvous of the move group
    and the move (state sent, stages built)."""
    published: float | None = None
    """A live switch's epoch published (its new processes ready)."""
    pids_before: dict[int, int] = field(default_factory=dict)
    """Rank -> process id under the plan switched from."""
    spares_used: int = 0
    """A live switch's new ranks handed to spares, processes already running (`inplace`)."""
    moved: dict[str, int] = field(default_factory=dict)
    """A live switch's state bytes sent between processes, kept in place, read from the checkpoint
    (the move group's "started" event: sent_bytes, local_bytes, checkpoint_bytes)."""

    def phases(self, first_step: float) -> dict[str, float]:
        """Seconds of each phase, in order; they add up to the total from the change to the first step."""
        req = self.stop_requested if self.stop_requested is not None else self.began + self.replan_s
        boundary = max(req, self.last_step_after_request or req)
        stopped = self.stopped or boundary
        exited = self.exited or stopped
        launched = self.launched or exited
        started = self.started or launched
        loaded = self.loaded or started
        if self.in_place:
            published = max(req, self.published or req)
            boundary = max(boundary, published)
            stopped = max(stopped, boundary)
            return {"replan_s": req - self.began, "start_s": published - req, "stop_s": boundary - published,
                    "checkpoint_s": stopped - boundary, "rendezvous_s": started - stopped, "move_s": loaded - started,
                    "first_step_s": first_step - loaded}
        return {"replan_s": req - self.began, "stop_s": boundary - req, "checkpoint_s": stopped - boundary,
                "teardown_s": exited - stopped, "restart_s": started - exited, "load_s": loaded - started,
                "first_step_s": first_step - loaded}


def starting_since(run: RunHandle, sw: Switch | None) -> float | None:
    """Since when (monotonic s) the controller waits for processes to start, None when it waits for
    none: a launch's, until its ranks' process groups form; a live switch's new processes, from the
    switch's request until its epoch is published (the old plan trains on meanwhile). Past
    `RunOptions.start_timeout_s` the controller ends the run as failed: a live switch then falls
    back to the checkpoint path, without the machines that never started (`failed_machines`)."""
    if not run.started:
        return run.launched_at
    if sw is not None and sw.in_place and sw.published is None:
        return sw.stop_requested
    return None


def dead_ranks(res: TrainResult) -> set[int]:
    """Ranks that died on their own (not stopped by torchrun, not only victims of a lost peer).

    A rank that reported its own error is one. Otherwise only torchrun's root cause (its first
    failure) counts: when a rank is killed, its TP and pipeline peers fail right after it on the
    broken collective, often without a word, and must not be counted as lost GPUs too."""
    errors = [e for e in res.events if e.get("event") == "error"]
    own = {int(e["rank"]) for e in errors if not e.get("peer_lost")}
    if own:
        return own
    reported = {int(e["rank"]) for e in errors}
    silent = [int(r) for r, code in res.failed if r.isdigit() and int(r) not in reported and code != "-15"]
    return set(silent[:1])


def failed_machines(run: Running, dead: set[int]) -> set[Machine]:
    """Machines of a host-pool launch to leave out after it failed:

    - those of the dead ranks;
    - else, when the launch timed out starting, the machines whose node never said it was up (a host
      that accepts ssh but never runs the command), else those none of whose ranks joined;
    - else the machines none of whose ranks reported an error (ranks that lose a peer report it, so a
      machine that went down whole is the silent one);
    - else (all or none silent: ssh could not connect) the machine of the node that failed first.
    A rule applies only when it singles out some machines but not all.
    """
    if run.nodes is None or run.result is None:
        return set()
    nodes, events = run.nodes, run.result.events
    if dead:
        return {nodes.rank_machine[r] for r in dead if r in nodes.rank_machine}
    every = set(nodes.node_machine)
    said = {"node_up": {nodes.node_machine[e["node"]] for e in events if e.get("event") == "node_up"}}
    for kind in ("joined", "error"):
        said[kind] = {nodes.rank_machine.get(int(e["rank"])) for e in events if e.get("event") == kind}
    for kind in (("node_up", "joined") if run.killed.startswith(START_TIMEOUT) else ("error",)):
        if said[kind] & every and every - said[kind]:
            return every - said[kind]
    first = run.result.failed_process
    return {nodes.node_machine[first]} if first is not None else set()


def kill_children() -> None:
    """SIGKILL the process group of every child of this process (torchrun runs in its own session)."""
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)
