"""The Python API at the top of the package: `sailor.find_plan`, `sailor.simulate`, `sailor.load_*`.

What `sailor plan` and `sailor simulate` do, callable from a notebook, returning the objects those
commands print (`PlanResult`, `Estimate`). Every input may be a path (YAML/JSON), a dict in the
file's format, or the object itself. Nothing here imports torch.

    import sailor
    job = sailor.load_job({"model": "opt-350m", "global_batch_size": 1024})
    cluster = sailor.load_cluster({"zones": {"us-central1-a": {"A100-40": 16}}})
    result = sailor.find_plan(job, cluster, objective="cost")
    sailor.simulate(result.plan).iteration_time_s  # the plan carries its job and cluster

(`sailor.plan` is the module holding the `Plan` type, hence `find_plan` for the search.)
"""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Callable, TypeVar, Union

from sailor import catalog
from sailor.core.errors import InfeasibleError, SailorInputError, show
from sailor.core.limits import MAX_BLOCKS
from sailor.core.schema import Checks, parse_model
from sailor.perf.network import NetworkModel
from sailor.perf.network_files import network_for
from sailor.perf.profile_lookup import Profiles, roofline_profiles
from sailor.perf.profiles import load_profiles
from sailor.plan import load_plan
from sailor.plan.spec import Plan
from sailor.planner import Constraints, Objective, PlanOptions, PlanResult, SearchSpace, plan_job
from sailor.planner.options import DEFAULT_MEMORY_MARGIN
from sailor.simulator import Estimate, SimContext, make_context
from sailor.simulator import simulate as simulate_plan
from sailor.specs import load_cluster, load_job
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

__all__ = ["ClusterSpec", "Estimate", "InfeasibleError", "JobSpec", "Plan", "PlanResult", "SailorInputError",
           "find_plan", "load_cluster", "load_job", "load_plan", "simulate"]

Source = Union[str, Path, dict]


def resolve_specs(plan: Plan | None, job: Source | JobSpec | None,
                  cluster: Source | ClusterSpec | None) -> tuple[JobSpec, ClusterSpec]:
    """Job and cluster as given, else the plan's own; a cluster is derived from the plan's GPU usage
    when neither gives one.

    Raises:
        SailorInputError: no job is known, or a zone of the plan is unknown (naming the plan's field).
    """
    job_spec = load_job(job) if job is not None else (plan.job if plan else None)
    if job_spec is None:
        raise SailorInputError("no job: the plan file carries none; pass --job JOB.yaml")
    cluster_spec = load_cluster(cluster) if cluster is not None else (plan.cluster if plan else None)
    if cluster_spec is None and plan is not None:
        zones: dict[str, dict[str, int]] = {}
        for (zone, gpu), n in plan.gpu_usage().items():
            zones.setdefault(zone, {})[gpu] = n
        # The providers whose catalogs hold the plan's zones (GCP for a zone no catalog has: its error).
        names = list(dict.fromkeys(catalog.zone_provider(z) or "gcp" for z in zones)) or ["gcp"]
        provider = names[0] if len(names) == 1 else names
        # Name the plan's field for an unknown zone (the derived cluster would only name its own).
        for j, p in enumerate(plan.pipelines):
            for i, r in enumerate(p.replicas):
                try:
                    catalog.clouds(names).region(r.zone)
                except SailorInputError as e:
                    raise e.located(field_prefix=f"pipelines.{j}.replicas.{i}.zone") from None
        cluster_spec = parse_model(ClusterSpec, {"provider": provider, "zones": zones}, None)  # one line, no traceback
    if cluster_spec is None:
        raise SailorInputError("no cluster: pass --cluster CLUSTER.yaml")
    return job_spec, cluster_spec


def resolve_models(job: JobSpec, cluster: ClusterSpec, profiles: str | Path | Profiles | None,
                   network: str | Path | NetworkModel | None) -> tuple[Profiles, NetworkModel]:
    """Profiles (a file or folder, else roofline estimates) and network (a link file or folder,
    else the catalog's links) for `job` on `cluster`."""
    if not isinstance(profiles, Profiles):
        profiles = load_profiles(profiles, job) if profiles else roofline_profiles(job)
    if not isinstance(network, NetworkModel):
        network = network_for(cluster, network)
    return profiles, network


def context(job: Source | JobSpec, cluster: Source | ClusterSpec, *, profiles: str | Path | Profiles | None = None,
            network: str | Path | NetworkModel | None = None) -> SimContext:
    """A fresh simulation context (job, cluster, profiles, network): one per planning call."""
    job_spec, cluster_spec = load_job(job), load_cluster(cluster)
    prof, net = resolve_models(job_spec, cluster_spec, profiles, network)
    return make_context(job_spec, cluster_spec, prof, net)


E = TypeVar("E", bound=Enum)


def choice(kind: type[E], value: E | str, option: str, what: str) -> E:
    """`value` as a member of the enum `kind`; SailorInputError naming `option` and the choices."""
    try:
        return kind(value)
    except ValueError:
        raise SailorInputError(f"unknown {what} {value!r}", source=option,
                               fix=f"one of {', '.join(str(m.value) for m in kind)}") from None


def plan_options(*, objective: Objective | str = Objective.THROUGHPUT, search: SearchSpace | str = SearchSpace.FULL,
                 max_cost_per_iteration: float | None = None, max_cost_per_hour: float | None = None,
                 min_throughput: float | None = None, max_stages: int = 16, top: int = 3,
                 time_limit: float | None = None, memory_margin: float = DEFAULT_MEMORY_MARGIN) -> PlanOptions:
    """PlanOptions from `sailor plan`'s settings (see `find_plan`), checked the same for the API and
    the CLI. Raises SailorInputError (named as `sailor plan`'s option) for a budget or time limit that
    is not a finite positive number (0 would refuse every plan), a throughput floor that is not a
    finite number >= 0, a `max_stages` that is not a whole number from 1 to MAX_BLOCKS + 2, a `top`
    that is not a whole number >= 0, or a memory margin outside [0, 1)."""
    for name, value in (("max_cost_per_iteration", max_cost_per_iteration), ("max_cost_per_hour", max_cost_per_hour),
                        ("min_throughput", min_throughput), ("time_limit", time_limit)):
        if value is not None:
            _finite_number(value, "--" + name.replace("_", "-"), zero=name == "min_throughput")
    Checks("--max-stages").whole(max_stages, "", lo=1, hi=MAX_BLOCKS + 2)
    Checks("--top").whole(top, "", lo=0)
    return PlanOptions(objective=choice(Objective, objective, "objective", "objective"),
                       search=choice(SearchSpace, search, "search", "search space"),
                       max_stages=max_stages, top_k=top, time_limit_s=time_limit, memory_margin=memory_margin,
                       constraints=Constraints(max_cost_per_iteration=max_cost_per_iteration,
                                               max_cost_per_hour=max_cost_per_hour, min_throughput=min_throughput))


def _finite_number(value: object, option: str, *, zero: bool) -> None:
    """Raise SailorInputError naming `option` unless `value` is a finite number > 0 (>= 0 with `zero`)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and (value > 0 or zero and value == 0)):
        raise SailorInputError(f"must be a finite {'non-negative' if zero else 'positive'} number, got {show(value)}",
                               source=option)


def find_plan(job: Source | JobSpec, cluster: Source | ClusterSpec, *, profiles: str | Path | Profiles | None = None,
              network: str | Path | NetworkModel | None = None, objective: Objective | str = Objective.THROUGHPUT,
              search: SearchSpace | str = SearchSpace.FULL, max_cost_per_iteration: float | None = None,
              max_cost_per_hour: float | None = None, min_throughput: float | None = None, max_stages: int = 16,
              top: int = 3, time_limit: float | None = None, memory_margin: float = DEFAULT_MEMORY_MARGIN,
              progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """The best plan for `job` on the GPUs `cluster` offers: what `sailor plan` prints.

    Args:
        job, cluster: paths, dicts or specs (`load_job`, `load_cluster`).
        profiles: a profile file or Sailor profile folder, or Profiles; default roofline estimates.
        network: a link file or Sailor network folder, or a NetworkModel; default catalog links.
        objective: "throughput" (max iterations/s) or "cost" (min $/iteration).
        search: "full" (ours), "paper" (the published space) or "homogeneous" (one GPU type in one zone).
        max_cost_per_iteration: $ per iteration; max_cost_per_hour: $/hour; min_throughput: iterations/s.
        max_stages: the largest pipeline depth P tried; top: alternatives kept.
        time_limit: seconds after which the search takes the best plan found (None: no limit).
        memory_margin: fraction of each GPU's memory a plan leaves free (`PlanOptions.memory_margin`).
        progress: called as progress(done, total) while the search runs.
    Returns:
        PlanResult: `.plan` (carrying job and cluster), `.estimate`, `.alternatives`, `.search_time_s`.
    Raises:
        SailorInputError: bad input; InfeasibleError (a subclass): no plan fits, with the reason.
    """
    opts = plan_options(objective=objective, search=search, max_cost_per_iteration=max_cost_per_iteration,
                        max_cost_per_hour=max_cost_per_hour, min_throughput=min_throughput, max_stages=max_stages,
                        top=top, time_limit=time_limit, memory_margin=memory_margin)
    if progress is not None and not callable(progress):
        raise SailorInputError(f"progress must be a function of (done, total), got {type(progress).__name__}",
                               source="progress")
    return plan_job(context(job, cluster, profiles=profiles, network=network), opts, progress=progress)


def simulate(plan: Source | Plan, *, job: Source | JobSpec | None = None, cluster: Source | ClusterSpec | None = None,
             profiles: str | Path | Profiles | None = None,
             network: str | Path | NetworkModel | None = None) -> Estimate:
    """One iteration of `plan` simulated: what `sailor simulate` prints.

    Args:
        plan: a plan path, dict or Plan. job / cluster: default the plan's own (a cluster is derived
            from the plan's GPUs when it has none). profiles, network: as in `find_plan`.
    Returns:
        Estimate: iteration time (s), memory per GPU (bytes), $/iteration, per-replica breakdown.
    Raises:
        SailorInputError: bad input, or a plan that does not fit the job or cluster.
    """
    p = load_plan(plan)
    job_spec, cluster_spec = resolve_specs(p, job, cluster)
    p.check_against(job_spec, cluster_spec)
    return simulate_plan(p, context(job_spec, cluster_spec, profiles=profiles, network=network))
