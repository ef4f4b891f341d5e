"""When to switch plans: the expected gain over the remaining work against the switch cost.

The rule (`decide`), with o and n the iteration times (s) of the current and the new plan, R the
iterations still to run, and C the seconds a switch costs (nothing is trained during it):

    switch  if the current plan uses GPUs that are gone (it cannot continue: always), or
            if R x (o - n) > C                       (time saved over the remaining work > time lost)

which is the same as (new throughput - old throughput) x remaining time > C x new throughput, with
throughputs 1/n and 1/o and remaining time R x o. With no current plan (start, or after a crash)
there is nothing to compare: the new plan is taken.

C comes from `SwitchCosts`: the mean of the switches measured so far in this run, or before the
first one an estimate: for live switches the model of `switch_cost.LiveSwitchModel` (bytes moved
over the links), else the published restart cost (`DEFAULT_SWITCH_COST_S`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sailor.elastic.availability import Zones

# Published reconfiguration cost of Sailor on 16 V100 (DESIGN.md §7: planner 0.1 s, teardown 3 s,
# group init 4.5 s, rebuild 2.5 s, broadcast 1.25 s), rounded: used until a switch has been measured.
DEFAULT_SWITCH_COST_S = 11.35


@dataclass
class SwitchCosts:
    """Switch costs measured in this run (seconds from the availability change to the first step
    completed under the new plan), and the estimate used before any was measured.

    `fixed_s`, when set, replaces both (a user who knows the cost of their cluster, or a test).
    """

    default_s: float = DEFAULT_SWITCH_COST_S
    fixed_s: float | None = None
    measured_s: list[float] = field(default_factory=list)

    def record(self, seconds: float) -> None:
        """Add one measured switch (seconds >= 0)."""
        assert seconds >= 0.0, seconds
        self.measured_s.append(seconds)

    def estimate_s(self, model_s: float | None = None) -> float:
        """Seconds the next switch is expected to cost: fixed, else the measured mean, else `model_s`
        (a cost model's estimate for this switch) when given, else the default."""
        if self.fixed_s is not None:
            return self.fixed_s
        if self.measured_s:
            return sum(self.measured_s) / len(self.measured_s)
        return self.default_s if model_s is None else model_s


@dataclass(frozen=True)
class Decision:
    """Whether to switch, why, and the numbers behind it (seconds)."""

    switch: bool
    reason: str
    gain_s: float   # R x (o - n): training time saved by the new plan over the remaining work
    cost_s: float   # C: expected time lost to the switch


def lost_gpus(usage: Counter, zones: Zones) -> bool:
    """True when a plan's GPU usage {(zone, gpu): count} exceeds what `zones` offers."""
    return any(n > zones.get(z, {}).get(g, 0) for (z, g), n in usage.items())


def decide(*, lost: bool, old_iteration_s: float | None, new_iteration_s: float, remaining_iterations: float,
           switch_cost_s: float) -> Decision:
    """Apply the switch rule (module docstring).

    Args:
        lost: the current plan uses GPUs that are no longer available.
        old_iteration_s: the current plan's iteration time (s) on this availability, None when no plan
            is running or it no longer fits.
        new_iteration_s: the new plan's iteration time (s), in the same units as old_iteration_s.
        remaining_iterations: iterations still to train (>= 0).
        switch_cost_s: C, seconds a switch is expected to cost.
    Returns:
        The Decision.
    """
    if lost:
        return Decision(True, "the current plan lost GPUs", float("inf"), switch_cost_s)
    if old_iteration_s is None:
        return Decision(True, "no plan is running", float("inf"), switch_cost_s)
    gain = max(remaining_iterations, 0.0) * (old_iteration_s - new_iteration_s)
    if gain > switch_cost_s:
        return Decision(True, f"saves {gain:.3g} s over the remaining work, more than the {switch_cost_s:.3g} s"
                              " a switch costs", gain, switch_cost_s)
    return Decision(False, f"saves {gain:.3g} s over the remaining work, not more than the {switch_cost_s:.3g} s"
                           " a switch costs", gain, switch_cost_s)
