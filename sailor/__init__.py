"""Sailor: plan, simulate and run LLM training on heterogeneous, geo-distributed, changing GPU clusters.

One folder per layer, from the bottom up: core, catalog, model, specs, perf, plan, simulator, planner,
runtime, launch, report, elastic, then `api` and `cli` (README "Layout"). Imports run down only; torch
is imported by `runtime` alone.

The Python API (`sailor.api`, loaded on first use so that `import sailor` stays cheap):

    import sailor
    job = sailor.load_job("examples/opt350_job.yaml")          # a path, a dict or a JobSpec
    cluster = sailor.load_cluster({"zones": {"us-central1-a": {"A100-40": 32}}})
    result = sailor.find_plan(job, cluster, objective="throughput")   # PlanResult, as `sailor plan`
    estimate = sailor.simulate(result.plan)                     # Estimate, as `sailor simulate`
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sailor.core import __version__

# Names served from sailor.api; `sailor.plan` stays the module of the Plan type.
_API = ("ClusterSpec", "Estimate", "InfeasibleError", "JobSpec", "Plan", "PlanResult", "SailorInputError",
        "find_plan", "load_cluster", "load_job", "load_plan", "simulate")
__all__ = ["__version__", *_API]

if TYPE_CHECKING:
    from sailor.api import (ClusterSpec, Estimate, InfeasibleError, JobSpec, Plan, PlanResult, SailorInputError,
                            find_plan, load_cluster, load_job, load_plan, simulate)


def __getattr__(name: str) -> Any:
    if name in _API:
        from sailor import api
        return getattr(api, name)
    raise AttributeError(f"module 'sailor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
