"""Launch a plan on real clusters: torchrun over ssh, SkyPilot task YAML, or Kubernetes Jobs.

`launch_specs(plan, backend, ...)` returns the documents a backend needs (plain dicts, printed as YAML
documents by `sailor launch --dry-run`); `launch(...)` starts the torchrun backend over ssh. The
common part (`common`) maps the plan's ranks (`sailor.plan.rank_layout`) onto nodes and torchrun
agents so that torchrun's global ranks are exactly the plan's ranks.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import yaml

from sailor.errors import SailorInputError
from sailor.launch.common import LaunchLayout, LaunchOptions, check_options, launch_layout, node_sizes
from sailor.launch.hosts import HostsFile, load_hosts
from sailor.plan import Plan


class Backend(str, enum.Enum):
    """Where the plan runs."""

    TORCHRUN = "torchrun"
    SKYPILOT = "skypilot"
    KUBERNETES = "kubernetes"


def layout_for(plan: Plan, hosts: HostsFile | None = None) -> LaunchLayout:
    """The launch layout, with GPUs per node from HOSTS.yaml where it gives them."""
    return launch_layout(plan, node_sizes(plan, hosts.gpus_per_node() if hosts else None))


def launch_specs(plan: Plan, backend: Backend, opts: LaunchOptions, *, hosts_path: str | Path | None = None,
                 local_plan: str | None = None, image: str = "sailor:latest", name: str = "sailor") -> list[dict[str, Any]]:
    """The documents `backend` needs to run `plan`.

    Args:
        plan: the plan to run.
        backend: torchrun (one document per node), skypilot (one task per (GPU type, zone)) or
            kubernetes (ConfigMap, Service, one Job per (GPU type, zone)).
        opts: worker options.
        hosts_path: HOSTS.yaml (torchrun only; without it the rendezvous host is $SAILOR_RDZV_HOST).
        local_plan: the plan file on this machine (SkyPilot copies it to the nodes).
        image: container image (Kubernetes).
        name: object name prefix (Kubernetes).
    Raises:
        SailorInputError: bad options, hosts not matching the plan, GPU types the backend cannot rent.
    """
    check_options(opts, plan)
    backend = Backend(backend)
    if hosts_path is not None and backend is not Backend.TORCHRUN:
        raise SailorInputError(f"--hosts is for the torchrun backend, not {backend.value}", source="--hosts")
    hosts = load_hosts(hosts_path) if hosts_path is not None else None
    layout = layout_for(plan, hosts)
    if backend is Backend.TORCHRUN:
        from sailor.launch.torchrun import node_specs
        return node_specs(layout, opts, hosts, str(hosts_path))
    if backend is Backend.SKYPILOT:
        from sailor.launch.skypilot import task_specs
        return task_specs(layout, opts, region_of=_region_of(plan), local_plan=local_plan)
    from sailor.launch.kubernetes import manifests
    return manifests(layout, opts, name=name, image=image)


def launch(plan: Plan, opts: LaunchOptions, hosts_path: str | Path, *, ssh: str = "ssh") -> int:
    """Start `plan` over ssh on the machines of HOSTS.yaml (torchrun backend) and wait.

    Returns:
        0 when every node finished, else the first failing node's ssh exit status.
    Raises:
        SailorInputError: bad options, or hosts not matching the plan (before anything starts).
    """
    from sailor.launch.torchrun import node_commands, run_over_ssh

    check_options(opts, plan)
    hosts = load_hosts(hosts_path)
    cmds = node_commands(layout_for(plan, hosts), opts, hosts, str(hosts_path))
    return run_over_ssh(cmds, ssh=ssh)


def dump_documents(docs: list[dict[str, Any]], header: str = "") -> str:
    """YAML documents separated by `---`, after an optional comment header."""
    head = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=1 << 16,
                         explicit_start=True)
    return head + body


class _Dumper(yaml.SafeDumper):
    """Safe YAML with multi-line strings (scripts) as literal `|` blocks, the rest one line each."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _region_of(plan: Plan):
    from sailor import catalog
    prov = catalog.provider(plan.cluster.provider if plan.cluster else "gcp")
    return prov.region
