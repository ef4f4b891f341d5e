"""What `sailor run` is asked to do (`RunOptions`), how it ended (`RunResult`), and the checks of
the options before anything starts (`check_run`). `controller` runs them.

This module never imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sailor import catalog
from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_STEPS, max_local_processes
from sailor.elastic.availability import Trace
from sailor.elastic.events import ClockKind
from sailor.elastic.remote import HostPool
from sailor.perf.profile_lookup import Profiles
from sailor.runtime.launcher import ExitStatus
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What `sailor run` is asked to do. Units: steps, seconds."""

    job: JobSpec
    cluster: ClusterSpec
    trace: Trace
    steps: int = 100
    """Train until this many optimizer steps in total."""
    seed: int = 0
    checkpoint_dir: str | None = None
    """Checkpoints (step-<n>/); a temporary folder when None. An existing folder is resumed from."""
    checkpoint_every: int = 20
    """Checkpoint every N steps, so a crash rolls back at most N - 1 steps; a live switch then writes
    none (`sailor.runtime.inplace`). 0: only at switches (and the end)."""
    metrics: str | None = None
    """Rank 0 appends one JSON line per step here (with `hosts`: on storage every host sees)."""
    log_every: int = 0
    """Rank 0 prints loss, tokens/s and MFU every N steps on stdout (0: never)."""
    events: str | None = None
    """One JSON line per controller event is appended here (`events.EventLog`); a file that exists and
    is not empty is refused unless `append_events` (two runs' events would be mixed)."""
    append_events: bool = False
    """Add this run's events after those already in `events` (e.g. a run resumed from its checkpoint)."""
    time_scale: float = 1.0
    """Clock seconds per trace second (0.01 replays an hour of trace in 36 s)."""
    clock: ClockKind = ClockKind.WALL
    """What drives trace time: wall seconds, or seconds spent training (`Clock`)."""
    switch_cost_s: float | None = None
    """Assume every switch costs this many seconds instead of measuring (None: measure)."""
    profiles: str | Profiles | None = None
    """Profiles file/folder, loaded Profiles (the local machine's: `cli.common.machine_profiles`), or
    None for roofline estimates (`Replanner`)."""
    network: str | None = None
    data: str | None = None
    init_from: str | None = None
    """Hugging Face model folder whose weights start the run (read while no checkpoint exists)."""
    device: str = "cpu"
    hosts: HostPool | None = None
    """Run the ranks on these machines over ssh (`sailor.elastic.remote`); None: the local provider."""
    timeout_s: float = 60.0
    """Seconds a collective may wait before the runtime fails (a lost peer is noticed by torchrun first)."""
    on_event: Callable[[dict[str, Any]], None] | None = None
    """Called with every event record as it is logged (from the controller's thread)."""
    start_timeout_s: float = 300.0
    """Seconds a launch may take to bring up its ranks' process groups before it is ended as failed
    (a host that accepts ssh but never joins would otherwise hang the run)."""
    in_place: bool | None = None
    """Switch plans live (`sailor.elastic.inplace`): the ranks that stay keep their process and state,
    which moves in memory, on the local provider and on `hosts` alike. False: every switch restarts
    every rank from a checkpoint (`sailor run --restart`). None (the default): live (`switches_live`)."""

    @property
    def switches_live(self) -> bool:
        """Whether a switch is live (`in_place`, None resolved: live)."""
        return self.in_place is not False


@dataclass
class RunResult:
    """How `run` ended: status (0 done, 1 failed, 3 stopped on request, 130 killed by a second
    interrupt), a message, the steps kept, and counts of what happened."""

    status: ExitStatus
    message: str
    steps: int
    switches: int = 0
    crashes: int = 0
    steps_rolled_back: int = 0
    switch_s: list[float] = field(default_factory=list)


def check_run(o: RunOptions) -> None:
    """Refuse options `Controller` cannot run, before anything starts (and before `sailor run` measures
    the machine): a non-local provider without hosts, hosts without a shared checkpoint folder, GPU
    types the device cannot be, steps out of range, a trace that offers nothing or more processes than
    this machine runs, hosts that do not cover the trace, bad costs and timeouts, an events file that
    holds events already (without `append_events`) or `append_events` without one.

    Raises:
        SailorInputError: naming the option or file.
    """
    if o.cluster.provider != "local" and o.hosts is None:
        raise SailorInputError(f"the cluster's provider is {o.cluster.provider!r}: name its machines", source="--cluster",
                               fix="pass --hosts HOSTS.yaml, or use provider: local (zone local, GPU type cpu)")
    if o.hosts is not None and not o.checkpoint_dir:
        raise SailorInputError("runs on other hosts need a checkpoint folder they all see at the same path",
                               source="--checkpoint-dir", fix="pass --checkpoint-dir on shared storage")
    # On named machines, --device cpu runs a GPU plan's ranks as gloo processes, as `sailor launch`
    # does (the testbed's device classes stand for GPU types); locally only GPU type cpu runs on cpu.
    catalog.check_device(o.device, (g for _, g in offered(o.trace)), what="the trace offers",
                         cpu_runs_any=o.hosts is not None)
    if not 1 <= o.steps <= MAX_STEPS:
        raise SailorInputError(f"must be between 1 and {MAX_STEPS:,} (limits.MAX_STEPS), got {o.steps}", source="--steps")
    if not offered(o.trace):
        raise SailorInputError("the trace never offers a GPU", source=o.trace.source,
                               fix="give some zone and GPU type a count above 0")
    if o.hosts is not None:
        o.hosts.check_covers(offered(o.trace))
    most = max(s.total() for s in o.trace.snapshots)
    if o.hosts is None and o.device == "cpu" and most > max_local_processes():
        raise SailorInputError(f"the trace offers up to {most} GPUs, each a process on this machine; it runs at most"
                               f" {max_local_processes()} (4 per CPU core)", source=o.trace.source,
                               fix="lower the trace's counts, or run on real machines with --hosts")
    if o.switch_cost_s is not None and not 0 <= o.switch_cost_s < float("inf"):
        raise SailorInputError(f"must be a number of seconds >= 0, got {o.switch_cost_s}", source="--switch-cost-s")
    if not o.start_timeout_s > 0:
        raise SailorInputError(f"must be > 0, got {o.start_timeout_s}", source="--start-timeout-s")
    if o.checkpoint_every < 0:
        raise SailorInputError(f"must be >= 0, got {o.checkpoint_every}", source="--checkpoint-every")
    if o.append_events and o.events is None:
        raise SailorInputError("only with --events (the file to add this run's events to)", source="--append-events",
                               fix="pass --events FILE, or leave --append-events out")
    if o.events is not None and not o.append_events and os.path.isfile(o.events) and os.path.getsize(o.events) > 0:
        raise SailorInputError(f"{o.events} holds events already (an earlier run's?); this run's would be mixed into"
                               " them", source="--events",
                               fix="name a new file, or pass --append-events to add this run's after them")


def offered(trace: Trace) -> set[tuple[str, str]]:
    """(zone, GPU type) pairs the trace ever offers GPUs of."""
    return {(z, g) for snap in trace.snapshots for z, gpus in snap.zones.items() for g, n in gpus.items() if n}
