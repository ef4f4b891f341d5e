"""Launch a plan on real clusters: torchrun over ssh, SkyPilot tasks, or a Kubernetes JobSet.

`launch_specs(plan, backend, ...)` returns the documents a backend needs (plain dicts, printed as YAML
documents by `sailor launch --dry-run`); `launch_files(...)` the files `--out` writes (SkyPilot: a
task file per group and `launch.sh`); `launch(...)` starts the torchrun backend over ssh. The
common part (`common`) maps the plan's ranks (`sailor.plan.placement.rank_layout`) onto nodes and torchrun
agents so that torchrun's global ranks are exactly the plan's ranks.

Ports each backend opens (the rendezvous store, a TCPStore without authentication, listens on
`rdzv_port` of rank 0's node; NCCL then connects the ranks on ports of its own choosing):
- torchrun: nothing; the machines of HOSTS.yaml must reach each other, on a private network.
- SkyPilot: no `ports` (SkyPilot's own ssh port only); ranks meet on internal addresses; Sailor and
  the plan come with the task's working directory, checkpoints go to a mounted bucket.
- Kubernetes: container port `rdzv_port` inside the cluster, headless Services (no virtual IP,
  no NodePort or LoadBalancer), and a NetworkPolicy admitting only the job's own pods.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

import yaml

from sailor.core import __version__
from sailor.core.errors import SailorInputError
from sailor.launch.common import LaunchLayout, LaunchOptions, check_image, check_options, launch_layout, node_sizes
from sailor.launch.hosts import HostsFile, check_group_zones, load_hosts
from sailor.launch.skypilot import SkyPilotOptions
from sailor.plan.spec import Plan


class Backend(str, enum.Enum):
    """Where the plan runs."""

    TORCHRUN = "torchrun"
    SKYPILOT = "skypilot"
    KUBERNETES = "kubernetes"


# The image the Dockerfile builds (`docker build -t sailor-train:<version> .`; README "Container image").
DEFAULT_IMAGE = f"sailor-train:{__version__}"
# Seconds rank 0's rendezvous waits for every node on the cloud backends: a group's VMs or pods
# start minutes after another's (provisioning, image pull, setup), beyond torchrun's default 600 s.
CLOUD_RDZV_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True, kw_only=True)
class KubernetesOptions:
    """Kubernetes settings (`sailor.launch.kubernetes.manifests` documents each)."""

    namespace: str = "default"
    indexed_jobs: bool = False
    queue: str | None = None
    max_restarts: int = 0
    checkpoint_claim: str | None = None


def layout_for(plan: Plan, hosts: HostsFile | None = None, source: str = "HOSTS.yaml") -> LaunchLayout:
    """The launch layout, with GPUs per node from HOSTS.yaml where it gives them.

    Raises:
        SailorInputError: a replica's TP is larger than its nodes (a TP group never spans machines,
            so a larger TP would silently get nodes larger than the machines hold); a group in a zone
            neither the plan nor the catalog knows (`check_group_zones`).
    """
    if hosts is not None:
        zones = {r.zone for p in plan.pipelines for r in p.replicas} | set(plan.cluster.zones if plan.cluster else ())
        check_group_zones(hosts, zones, source)
    given = hosts.gpus_per_node() if hosts else {}
    sizes = node_sizes(plan, given)
    for j, p in enumerate(plan.pipelines):
        for i, r in enumerate(p.replicas):
            if r.tp > sizes[r.gpu]:
                k = next((k for k, g in enumerate(hosts.groups) if g.gpu == r.gpu and g.gpus_per_node), None) \
                    if r.gpu in given else None
                raise SailorInputError(
                    f"replica {i} of pipeline {j} has TP {r.tp}, but {r.gpu} machines hold {sizes[r.gpu]} GPUs"
                    f" ({'this file' if k is not None else 'the plan cluster' if plan.cluster else 'the catalog'});"
                    " TP never crosses a node", source=source if k is not None else None,
                    field=f"groups.{k}.gpus_per_node" if k is not None else f"pipelines.{j}.replicas.{i}.tp",
                    fix="plan for nodes of that size, or list machines that hold the TP group")
    return launch_layout(plan, sizes)


def launch_specs(plan: Plan, backend: Backend, opts: LaunchOptions, *, hosts_path: str | Path | None = None,
                 image: str | None = None, name: str = "sailor", k8s: KubernetesOptions | None = None,
                 sky: SkyPilotOptions | None = None) -> list[dict[str, Any]]:
    """The documents `backend` needs to run `plan`.

    Args:
        plan: the plan to run.
        backend: torchrun (one document per node), skypilot (one task per (GPU type, zone)) or
            kubernetes (ConfigMap, NetworkPolicy, a JobSet with one replicated job per (GPU type,
            zone); or a Service and Indexed Jobs).
        opts: worker options (the cloud backends wait CLOUD_RDZV_TIMEOUT_S for the rendezvous
            unless `opts.rdzv_timeout_s` says otherwise).
        hosts_path: HOSTS.yaml (torchrun only; without it the rendezvous host is $SAILOR_RDZV_HOST).
        image: container image: Kubernetes (default DEFAULT_IMAGE), SkyPilot (default: none, Sailor
            is installed from the task's working directory).
        name: JobSet / object name prefix (Kubernetes), task and cluster name prefix (SkyPilot).
        k8s: Kubernetes settings (default KubernetesOptions()).
        sky: SkyPilot settings (default SkyPilotOptions(): working directory ".", the source tree
            `sailor-train/` in it, no bucket).
    Raises:
        SailorInputError: bad options, hosts not matching the plan, GPU types the backend cannot rent,
            names Kubernetes would refuse.
    """
    check_options(opts, plan)
    backend = Backend(backend)
    if hosts_path is not None and backend is not Backend.TORCHRUN:
        raise SailorInputError(f"--hosts is for the torchrun backend, not {backend.value}", source="--hosts")
    if image is not None and backend is Backend.TORCHRUN:
        raise SailorInputError("--image is for the skypilot and kubernetes backends", source="--image")
    if image is not None:
        check_image(image)
    hosts = load_hosts(hosts_path) if hosts_path is not None else None
    layout = layout_for(plan, hosts, str(hosts_path))
    if backend is Backend.TORCHRUN:
        from sailor.launch.torchrun import node_specs
        return node_specs(layout, opts, hosts, str(hosts_path))
    if opts.rdzv_timeout_s is None:
        opts = dataclasses.replace(opts, rdzv_timeout_s=CLOUD_RDZV_TIMEOUT_S)
    if backend is Backend.SKYPILOT:
        from sailor.launch.skypilot import task_specs
        return task_specs(layout, opts, place=_place_of(plan), sky=sky, image=image, name=name)
    if sky is not None:
        raise SailorInputError("--checkpoint-bucket, --managed and --install-from are for the skypilot backend",
                               source="--backend")
    from sailor.launch.kubernetes import check_one_region, manifests
    check_one_region(layout, _known_region_of(plan))
    k = k8s or KubernetesOptions()
    # A JobSet restarted as a whole continues from the newest checkpoint instead of step 0.
    opts = dataclasses.replace(opts, resume_newest=not k.indexed_jobs)
    return manifests(layout, opts, name=name, image=DEFAULT_IMAGE if image is None else image,
                     namespace=k.namespace, indexed_jobs=k.indexed_jobs, queue=k.queue, max_restarts=k.max_restarts,
                     checkpoint_claim=k.checkpoint_claim)


def launch_files(plan: Plan, backend: Backend, opts: LaunchOptions, *, header: str = "",
                 install_from: Path | None = None, **kwargs: Any) -> dict[str, str | bytes]:
    """What `sailor launch --out PATH` writes: {file name: contents}. SkyPilot (PATH is a folder, the
    tasks' working directory): one task file per group, `launch.sh`, `.skyignore`, the plan at
    `opts.worker.plan` and, without an image, Sailor (`skypilot.source_files(install_from)`); the
    others: one multi-document YAML (the key "" is PATH). Other arguments as `launch_specs`."""
    if Backend(backend) is not Backend.SKYPILOT:
        if install_from is not None:
            raise SailorInputError("--install-from is for the skypilot backend", source="--backend")
        return {"": dump_documents(launch_specs(plan, backend, opts, **kwargs), header=header)}
    from sailor.launch.skypilot import SCRIPT, SKYIGNORE, SkyPilotOptions, launch_script, source_files, task_file_names

    sky = kwargs.pop("sky", None) or SkyPilotOptions()
    if install_from is not None and kwargs.get("image"):
        raise SailorInputError("--install-from and --image exclude each other (the image holds Sailor)",
                               source="--install-from")
    install, sources = ("", {}) if kwargs.get("image") else source_files(install_from)
    if install:
        sky = dataclasses.replace(sky, install=install)
    docs = launch_specs(plan, backend, opts, sky=sky, **kwargs)
    layout = layout_for(plan)
    files: dict[str, str | bytes] = {f: dump_documents([d], header=header) for f, d in zip(task_file_names(layout), docs)}
    place = _place_of(plan)
    providers = sorted({place(g.zone)[0] for g in layout.groups()})
    files[SCRIPT] = launch_script(layout, name=kwargs.get("name", "sailor"), managed=sky.managed, providers=providers)
    files[".skyignore"] = SKYIGNORE
    files[opts.worker.plan] = json.dumps(plan.to_dict(), indent=2) + "\n"
    return files | sources


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
    cmds = node_commands(layout_for(plan, hosts, str(hosts_path)), opts, hosts, str(hosts_path))
    return run_over_ssh(cmds, ssh=ssh)


def dump_documents(docs: list[dict[str, Any]], header: str = "") -> str:
    """YAML documents separated by `---`, after an optional comment header."""
    head = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=1 << 16,
                         explicit_start=True)
    return head + body


class _Dumper(yaml.SafeDumper):
    """Safe YAML with multi-line strings (scripts) as literal `|` blocks, the rest one line each,
    and no anchors or aliases (an object used twice is written twice)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def check_backend_gpus(plan: Plan, backend: Backend, *, source: str | None = None) -> None:
    """Refuse a plan with a GPU type the cloud `backend` has no name for (a SkyPilot accelerator on
    the zone's provider, a GKE accelerator label; GPU type cpu has neither), naming the first such
    replica (`pipelines.<j>.replicas.<i>.gpu` of `source`, the plan file). torchrun takes any type.

    Raises:
        SailorInputError: the backend's message, located at the replica.
    """
    if Backend(backend) is Backend.TORCHRUN:
        return
    from sailor.launch.kubernetes import gke_accelerator
    from sailor.launch.skypilot import accelerator

    place = _place_of(plan)
    for j, p in enumerate(plan.pipelines):
        for i, r in enumerate(p.replicas):
            try:
                if Backend(backend) is Backend.SKYPILOT:
                    accelerator(r.gpu, place(r.zone)[0])
                else:
                    gke_accelerator(r.gpu)
            except SailorInputError as e:
                raise e.located(source=source, field_prefix=f"pipelines.{j}.replicas.{i}.gpu") from None


def _place_of(plan: Plan):
    """zone -> (provider, region): in the plan's cluster, or, for a plan without one, in the catalog
    of the provider that has the zone (GCP's for a zone none has: its unknown-zone error)."""
    from sailor import catalog

    def place(zone: str) -> tuple[str, str]:
        prov = plan.cluster.prov.provider_of(zone) if plan.cluster else catalog.provider(catalog.zone_provider(zone) or "gcp")
        return prov.name, prov.region(zone)
    return place


def _known_region_of(plan: Plan):
    """zone -> its region in the provider's catalog, or None for a zone the catalog does not list."""
    from sailor import catalog
    prov = plan.cluster.prov if plan.cluster else catalog.provider("gcp")
    return prov.zone_region.get
