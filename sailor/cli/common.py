"""Options and input loading shared by several commands (defined once, with units in their help)."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import TypeVar
from typing import Optional

import typer

from sailor import catalog
from sailor.errors import SailorInputError
from sailor.network import NetworkModel, network_for
from sailor.plan import Plan
from sailor.profiles import Profiles, load_profiles, roofline_profiles
from sailor.specs import ClusterSpec, JobSpec, load_cluster, load_job

JobOpt = typer.Option(None, "--job", help="Job spec (YAML/JSON): model, global_batch_size, precision, optimizer.")
ClusterOpt = typer.Option(None, "--cluster", help="Cluster spec (YAML/JSON): GPUs available per zone and type, prices.")
ProfilesOpt = typer.Option(None, "--profiles", help="Profile file (ours) or a folder with Sailor's profiles_tmp.json"
                           " and llm_info.json. Default: roofline estimates from the GPU catalog.")
NetworkOpt = typer.Option(None, "--network", help="Link file (ours) or a Sailor network folder. Default: catalog links.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of tables.")


def resolve_specs(plan: Plan | None, job_path: Optional[Path], cluster_path: Optional[Path]) -> tuple[JobSpec, ClusterSpec]:
    """Job and cluster from the flags, else from the plan file; a cluster is derived from the plan's
    own GPU usage when neither gives one. Raises SailorInputError when no job is known."""
    job = load_job(job_path) if job_path else (plan.job if plan else None)
    if job is None:
        raise SailorInputError("no job: the plan file carries none; pass --job JOB.yaml")
    cluster = load_cluster(cluster_path) if cluster_path else (plan.cluster if plan else None)
    if cluster is None and plan is not None:
        zones: dict[str, dict[str, int]] = {}
        for (zone, gpu), n in plan.gpu_usage().items():
            zones.setdefault(zone, {})[gpu] = n
        provider = "local" if set(zones) == {"local"} else "gcp"
        # Name the plan's field for an unknown zone (the derived cluster would only name its own).
        for j, p in enumerate(plan.pipelines):
            for i, r in enumerate(p.replicas):
                try:
                    catalog.provider(provider).region(r.zone)
                except SailorInputError as e:
                    raise e.located(field_prefix=f"pipelines.{j}.replicas.{i}.zone") from None
        cluster = ClusterSpec(provider=provider, zones=zones)
    if cluster is None:
        raise SailorInputError("no cluster: pass --cluster CLUSTER.yaml")
    return job, cluster


def resolve_models(job: JobSpec, cluster: ClusterSpec, profiles_path: Optional[Path],
                   network_path: Optional[Path]) -> tuple[Profiles, NetworkModel]:
    """Profiles (or roofline) and network (or catalog links) for a job on a cluster."""
    profiles = load_profiles(profiles_path, job) if profiles_path else roofline_profiles(job)
    return profiles, network_for(cluster, network_path)


def console():
    """A rich Console; 160 columns wide when output is not a terminal (pipes, CI logs)."""
    from rich.console import Console
    return Console(width=None if sys.stdout.isatty() else 160)


E = TypeVar("E", bound=Enum)


def choice(kind: type[E], value: str, option: str, what: str) -> E:
    """`value` as a member of the enum `kind`; SailorInputError naming `option` and the choices."""
    try:
        return kind(value)
    except ValueError:
        raise SailorInputError(f"unknown {what} {value!r}", source=option,
                               fix=f"one of {', '.join(str(m.value) for m in kind)}") from None
