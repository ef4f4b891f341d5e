"""Re-planning for a new availability, with a cache owned by one controller or replay.

The planner builds a fresh SimContext per call (nothing leaks between calls). `Replanner` adds one
cache on top, keyed on *every* input of a planning call: the job, the whole cluster spec with the
new availability (prices, node sizes, network overrides included), the profiles and network files
(path, size and modification time), and the planner options. Planning the same availability twice
(e.g. a trace that goes 4 -> 2 -> 4) is then free; anything else that differs is planned again. The
cache lives as long as its `Replanner`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

from sailor.core.errors import InfeasibleError, SailorInputError
from sailor.elastic.availability import Zones
from sailor.perf.network_files import network_for
from sailor.perf.profile_lookup import Profiles, roofline_profiles
from sailor.perf.profiles import load_profiles
from sailor.plan.spec import Plan
from sailor.planner import PlanOptions, plan_job
from sailor.simulator import Estimate, SimContext, make_context, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec


@dataclass(frozen=True)
class Planned:
    """A plan for one availability, its event-simulated estimate, and how long planning took (s);
    `cached` is True when the plan came from the cache (`replan_s` is then the lookup time)."""

    plan: Plan
    estimate: Estimate
    replan_s: float
    cached: bool


class Replanner:
    """Plans `job` on `cluster` with other availabilities; caches results (module docstring).

    Args:
        job: what to train.
        cluster: provider, prices, node sizes and network overrides (its own `zones` are not used).
        profiles_path: profiles file/folder, loaded Profiles (e.g. the machine profile `sailor plan`
            measures on the local provider: `cli.common.machine_profiles`), or None for roofline
            estimates.
        network_path: link file/Sailor network folder, or None for the catalog's links.
        options: planner options (objective, constraints, search space).
    Raises:
        SailorInputError: profiles that cannot be read (from the constructor).
    """

    def __init__(self, job: JobSpec, cluster: ClusterSpec, *, profiles_path: str | Profiles | None = None,
                 network_path: str | None = None, options: PlanOptions | None = None) -> None:
        self.job = job
        self.cluster = cluster
        self.options = options or PlanOptions()
        self.network_path = network_path
        if isinstance(profiles_path, Profiles):  # held for this Replanner's life: its identity is the key
            self.profiles, profiles_key = profiles_path, f"profiles object {id(profiles_path)}"
        else:
            self.profiles = load_profiles(profiles_path, job) if profiles_path else roofline_profiles(job)
            profiles_key = _file_key(profiles_path)
        self._static_key = (json.dumps(job.to_dict(), sort_keys=True), profiles_key,
                            _file_key(network_path), repr(self.options))
        self._plans: dict[Hashable, Planned | InfeasibleError] = {}
        self._contexts: dict[Hashable, SimContext] = {}

    def cluster_for(self, zones: Zones) -> ClusterSpec:
        """The cluster spec with availability `zones` (validated again)."""
        return self.cluster.with_zones(zones)

    def context(self, zones: Zones) -> SimContext:
        """A SimContext for availability `zones` (one per availability, reused for scoring)."""
        key = self._key(zones)
        if key not in self._contexts:
            cluster = self.cluster_for(zones)
            self._contexts[key] = make_context(self.job, cluster, self.profiles, network_for(cluster, self.network_path))
        return self._contexts[key]

    def plan(self, zones: Zones) -> Planned:
        """The best plan for availability `zones`.

        Raises:
            InfeasibleError: no plan fits (also when no GPU is available); cached like a plan.
        """
        t0 = time.perf_counter()
        key = self._key(zones)
        hit = self._plans.get(key)
        if hit is None:
            try:
                result = plan_job(self.context(zones), self.options)
                hit = Planned(result.plan, result.estimate, time.perf_counter() - t0, cached=False)
            except InfeasibleError as e:
                hit = e
            self._plans[key] = hit
            if isinstance(hit, InfeasibleError):
                raise hit
            return hit
        if isinstance(hit, InfeasibleError):
            raise hit
        return Planned(hit.plan, hit.estimate, time.perf_counter() - t0, cached=True)

    def score(self, plan: Plan, zones: Zones) -> Estimate | None:
        """The estimate of an existing `plan` on availability `zones`; None when it no longer fits."""
        try:
            plan.check_against(self.job, self.cluster_for(zones))
        except SailorInputError:  # GPUs or a zone gone: it does not fit
            return None
        return simulate(plan, self.context(zones))

    def _key(self, zones: Zones) -> Hashable:
        cluster = self.cluster_for(zones)
        return (*self._static_key, json.dumps(cluster.to_dict(), sort_keys=True))


def _file_key(path: str | None) -> str:
    """Identity of an input file or folder: its path, size and modification time ('' when none)."""
    if not path:
        return ""
    p = Path(path).resolve()
    try:
        st = p.stat()
        return f"{p}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return str(p)
