"""`sailor replay`: a trace-driven simulation of a whole elastic run, without training.

For each interval of the trace (from one snapshot to the next) a policy picks the plan that runs;
the simulator gives its iteration time and cost; a switch costs what the restart model says
(`RestartModel`), or with `live` the cost of a live switch from the bytes it moves
(`switch_cost.LiveSwitchModel`: `sailor run --in-place`), during which no iteration is done but the
GPUs are paid for. A restart after an idle gap costs the restart model either way.

The planner's search is not charged: `sailor run` plans while the running plan trains on (its
switch's `replan_s` phase ends where the stop is requested), and a switch is decided once the new
plan is known, so the search costs the same whether it switches or not. Its wall-clock seconds in
this process are reported apart (`Interval.replan_s`, `planning_s` in the totals): they depend on
this machine and its load, and on the plan cache (an availability seen before is planned in no
time), so charging them would make the replayed iterations and $ differ from run to run.

Policies (`Policy`):
- `sailor`: re-plan with the full planner at every change; switch with the rule of `policy.decide`
  (always when the running plan lost GPUs; else when the gain over the rest of the trace beats the
  switch cost).
- `static`: keep the first plan while every GPU it uses is still there, ignoring GPUs that appear;
  when it loses GPUs, re-plan (full planner) for what is available then, and keep that plan again.
- `homogeneous`: like `sailor`, but the planner searches one GPU type in one zone only
  (`SearchSpace.HOMOGENEOUS`), as systems without heterogeneous plans would.

Accounting per interval of d seconds: a switch at its start loses min(switch, d) seconds (the rest is
not carried over); iterations = (d - lost) / iteration time; $ = GPU $/hour of the plan x d / 3600
(GPUs are paid for during the switch too) + egress $ per iteration x iterations. With no feasible plan
(too few GPUs) nothing runs and nothing is paid. The first plan's start-up is not counted as a switch
(every policy pays it alike). The last snapshot lasts `duration_s - its time`; by default as long as
the spacing between the trace's last two points (one hour for a one-row trace).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from sailor.core.errors import InfeasibleError, SailorInputError
from sailor.core.units import HOUR_S
from sailor.elastic.availability import Trace, Zones
from sailor.elastic.policy import decide, lost_gpus
from sailor.elastic.replan import Planned, Replanner
from sailor.elastic.switch_cost import LiveSwitchModel
from sailor.perf.profile_lookup import Profiles
from sailor.planner import PlanOptions, SearchSpace
from sailor.simulator import Estimate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

DEFAULT_LAST_INTERVAL_S = HOUR_S  # a one-row trace says nothing about its length: assume an hour


class Policy(str, Enum):
    """How a replayed run reacts to availability changes (module docstring)."""

    SAILOR = "sailor"
    STATIC = "static"
    HOMOGENEOUS = "homogeneous"


@dataclass(frozen=True)
class RestartModel:
    """Seconds to restart a job on a new plan, besides planning: the published breakdown of Sailor's
    reconfiguration on 16 V100 (DESIGN.md §7; arXiv:2504.17096): teardown 3 s, process-group init
    4.5 s, model rebuild 2.5 s, parameter broadcast 1.25 s."""

    teardown_s: float = 3.0
    group_init_s: float = 4.5
    rebuild_s: float = 2.5
    broadcast_s: float = 1.25

    @property
    def total_s(self) -> float:
        """Seconds of a restart, planning excluded."""
        return self.teardown_s + self.group_init_s + self.rebuild_s + self.broadcast_s


@dataclass
class Interval:
    """One trace interval as replayed. Seconds, $, iterations."""

    start_s: float
    end_s: float
    gpus_available: int
    gpus_used: int
    plan: dict[str, Any] | None
    iteration_time_s: float | None
    throughput_iters_per_s: float
    cost_per_hour_usd: float
    cost_per_iteration_usd: float | None
    switched: bool
    switch_s: float          # seconds lost to the switch at the start of this interval (modelled)
    replan_s: float          # planner wall-clock seconds at its start, measured here: reported, not charged
    iterations: float
    cost_usd: float
    note: str


@dataclass
class ReplayResult:
    """A replayed run: its intervals and totals."""

    policy: Policy
    trace: str
    intervals: list[Interval] = field(default_factory=list)

    @property
    def iterations(self) -> float:
        """Iterations done over the whole run."""
        return sum(i.iterations for i in self.intervals)

    @property
    def cost_usd(self) -> float:
        """$ paid over the whole run."""
        return sum(i.cost_usd for i in self.intervals)

    @property
    def usd_per_iteration(self) -> float | None:
        """$ per iteration (None when nothing was trained)."""
        return self.cost_usd / self.iterations if self.iterations > 0 else None

    @property
    def switch_time_s(self) -> float:
        """Seconds lost to switches."""
        return sum(i.switch_s for i in self.intervals)

    @property
    def switches(self) -> int:
        """Number of switches (restarts after an idle gap included)."""
        return sum(i.switched for i in self.intervals)

    @property
    def planning_s(self) -> float:
        """Wall-clock seconds spent in the planner by this process (not charged: module docstring)."""
        return sum(i.replan_s for i in self.intervals)

    @property
    def duration_s(self) -> float:
        """Seconds from the first snapshot to the end of the run."""
        return self.intervals[-1].end_s - self.intervals[0].start_s if self.intervals else 0.0

    def totals(self) -> dict[str, Any]:
        """The totals as a JSON-ready dict."""
        return {"policy": self.policy.value, "trace": self.trace, "duration_s": self.duration_s,
                "iterations": self.iterations, "cost_usd": self.cost_usd, "usd_per_iteration": self.usd_per_iteration,
                "switches": self.switches, "switch_time_s": self.switch_time_s, "planning_s": self.planning_s}

    def to_dict(self) -> dict[str, Any]:
        """The `sailor replay --json` object."""
        return {"totals": self.totals(), "intervals": [asdict(i) for i in self.intervals]}


def replay(job: JobSpec, cluster: ClusterSpec, trace: Trace, *, policy: Policy = Policy.SAILOR,
           profiles_path: str | Profiles | None = None, network_path: str | None = None, duration_s: float | None = None,
           restart: RestartModel | None = None, live: LiveSwitchModel | None = None,
           options: PlanOptions | None = None) -> ReplayResult:
    """Replay a whole run over `trace` under `policy` (module docstring).

    Args:
        job, cluster: what to train; the cluster gives provider, prices, node sizes and network.
        trace: the availability over time.
        policy: sailor, static or homogeneous.
        profiles_path, network_path: as for `sailor plan` (None: roofline, catalog links); profiles
            may also be loaded Profiles (`Replanner`).
        duration_s: end of the run (s from the trace's start); default in the module docstring.
        restart: the restart model (default: the published breakdown).
        live: price switches between plans as live switches with this model instead (module docstring).
        options: planner options (objective, constraints); `search` is set by the policy.
    Returns:
        ReplayResult with one Interval per snapshot.
    Raises:
        SailorInputError: a duration that ends before the last snapshot, unreadable profiles.
    """
    restart = restart or RestartModel()
    opts = options or PlanOptions()
    opts = PlanOptions(**{**opts.__dict__, "search": SearchSpace.HOMOGENEOUS if policy is Policy.HOMOGENEOUS
                          else SearchSpace.FULL})
    snaps = trace.snapshots
    end = _end_s(trace, duration_s)
    planner = Replanner(job, cluster, profiles_path=profiles_path, network_path=network_path, options=opts)
    out = ReplayResult(policy, trace.source)
    current: Planned | None = None
    for k, snap in enumerate(snaps):
        t1 = snaps[k + 1].time_s if k + 1 < len(snaps) else end
        zones = snap.zones
        lost = current is not None and lost_gpus(current.plan.gpu_usage(), zones)
        replan_s, note = 0.0, ""
        chosen: Planned | None = current
        if current is None or lost or policy is not Policy.STATIC:
            candidate = _plan(planner, zones)
            replan_s = candidate.replan_s if candidate else 0.0
            chosen, note = _choose(planner, policy, current, candidate, lost, zones, remaining_s=end - snap.time_s,
                                   switch_s=_switch_s(planner, zones, restart, live, current, candidate))
        switched = current is not None and chosen is not None and chosen.plan != current.plan
        restarted = current is None and chosen is not None and k > 0 and out.intervals[-1].plan is None
        switch_s = _switch_s(planner, zones, restart, live, current, chosen) if (switched or restarted) else 0.0
        out.intervals.append(_interval(planner, chosen, zones, snap.time_s, t1, switch_s, replan_s,
                                       switched or restarted, note))
        current = chosen
    return out


def _switch_s(planner: Replanner, zones: Zones, restart: RestartModel, live: LiveSwitchModel | None,
              old: Planned | None, new: Planned | None) -> float:
    """Seconds a switch from `old` to `new` costs (planning not charged: module docstring): the live
    model's when given and both plans exist, else the restart model's."""
    if live is None or old is None or new is None:
        return restart.total_s
    return live.seconds(planner.context(zones), old.plan, new.plan)


def _end_s(trace: Trace, duration_s: float | None) -> float:
    last = trace.last_point_s
    if duration_s is not None:
        if duration_s <= last:
            raise SailorInputError(f"the run must end after the trace's last point ({last:g} s), got {duration_s:g} s",
                                   source="--duration-s")
        return duration_s
    return last + (trace.spacing_s or DEFAULT_LAST_INTERVAL_S)


def _plan(planner: Replanner, zones: Zones) -> Planned | None:
    try:
        return planner.plan(zones)
    except InfeasibleError:
        return None


def _choose(planner: Replanner, policy: Policy, current: Planned | None, candidate: Planned | None, lost: bool,
            zones: Zones, *, remaining_s: float, switch_s: float) -> tuple[Planned | None, str]:
    """The plan to run in this interval, and why."""
    if candidate is None:
        if current is not None and not lost:
            return current, "no plan fits the new availability; keeping the running plan"
        return None, "no plan fits the available GPUs"
    if current is None:
        return candidate, "start"
    if lost:
        return candidate, "the running plan lost GPUs"
    if policy is Policy.STATIC or candidate.plan == current.plan:
        return current, "keep"
    old = planner.score(current.plan, zones)
    old_s = old.iteration_time_s if old is not None else None
    remaining_iters = remaining_s / old_s if old_s else 0.0
    d = decide(lost=False, old_iteration_s=old_s, new_iteration_s=candidate.estimate.iteration_time_s,
               remaining_iterations=remaining_iters, switch_cost_s=switch_s)
    return (candidate if d.switch else current), d.reason


def _interval(planner: Replanner, planned: Planned | None, zones: Zones, t0: float, t1: float, switch_s: float,
              replan_s: float, switched: bool, note: str) -> Interval:
    avail = sum(n for z in zones.values() for n in z.values())
    d = t1 - t0
    if planned is None:
        return Interval(t0, t1, avail, 0, None, None, 0.0, 0.0, None, False, 0.0, replan_s, 0.0, 0.0, note)
    est: Estimate = planner.score(planned.plan, zones) or planned.estimate
    lost_s = min(switch_s, d)
    iters = (d - lost_s) / est.iteration_time_s
    gpu_usd_per_hour = est.gpu_cost_per_iteration_usd * HOUR_S / est.iteration_time_s
    cost = gpu_usd_per_hour * d / HOUR_S + est.egress_per_iteration_usd * iters
    return Interval(t0, t1, avail, planned.plan.world_size, planned.plan.to_dict(with_specs=False),
                    est.iteration_time_s, est.throughput_iters_per_s, est.cost_per_hour_usd,
                    est.cost_per_iteration_usd, switched, lost_s, replan_s, iters, cost, note)


def plot(result: ReplayResult, path: str) -> None:
    """Write a PNG: GPUs available and used, and throughput, over time (matplotlib, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    xs = [i.start_s for i in result.intervals] + [result.intervals[-1].end_s]
    for values, label, ax in (([i.gpus_available for i in result.intervals], "GPUs available", ax1),
                              ([i.gpus_used for i in result.intervals], "GPUs used", ax1),
                              ([i.throughput_iters_per_s for i in result.intervals], "iterations/s", ax2)):
        ax.step(xs, values + values[-1:], where="post", label=label)
    for i in result.intervals:
        if i.switched:
            ax2.axvline(i.start_s, color="red", alpha=0.3, linewidth=1)
    ax1.set_ylabel("GPUs")
    ax2.set_ylabel("throughput (iterations/s)")
    ax2.set_xlabel("time (s)")
    ax1.legend()
    ax1.set_title(f"{result.policy.value}: {result.iterations:,.0f} iterations, ${result.cost_usd:,.2f}")
    fig.tight_layout()
    from sailor.report.figures import save_figure
    save_figure(fig, path)
    plt.close(fig)


def dumps(result: ReplayResult) -> str:
    """The `--json` output."""
    return json.dumps(result.to_dict(), indent=2)
