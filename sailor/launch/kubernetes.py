"""The Kubernetes backend: one Indexed batch/v1 Job per (GPU type, zone) group, on GKE node labels.

Manifests, in order: a ConfigMap holding the plan (mounted at `plan_path`), a headless Service that
gives every pod a DNS name, then one Job per group. Pod k of a group's Job (`JOB_COMPLETION_INDEX`
k) is node k of that group and runs its torchrun agents. The rendezvous group's pod 0 holds rank 0
and hosts the rendezvous store at `<job>-0.<service>` (an Indexed Job's pod is named
`<job>-<index>`, and `subdomain` puts it under the headless Service). Pods are pinned with
`nodeSelector` to the GPU product (`cloud.google.com/gke-accelerator`) and the zone
(`topology.kubernetes.io/zone`). One cluster must have node pools in all the plan's zones (a GKE
regional cluster covers one region's zones).
"""

from __future__ import annotations

import json
from typing import Any

from sailor.errors import SailorInputError
from sailor.launch.common import Group, LaunchLayout, LaunchOptions, backend_name, node_script, round_up_pow2
from sailor.plan import Plan

# Our GPU types -> GKE accelerator labels (`cloud.google.com/gke-accelerator` node label values),
# from https://cloud.google.com/kubernetes-engine/docs/how-to/gpus (GPU quota / availability table).
GKE_ACCELERATOR = {
    "A100-40": "nvidia-tesla-a100",
    "A100-80": "nvidia-a100-80gb",
    "H100-80": "nvidia-h100-80gb",
    "H200-141": "nvidia-h200-141gb",
    "V100-16": "nvidia-tesla-v100",
    "L4": "nvidia-l4",
    "T4": "nvidia-tesla-t4",
}
PLAN_FILE = "plan.json"


def gke_accelerator(gpu: str) -> str:
    """GKE accelerator label of `gpu`; SailorInputError for a type GKE does not offer."""
    return backend_name(GKE_ACCELERATOR, gpu, "GKE accelerator label")


def manifests(layout: LaunchLayout, opts: LaunchOptions, *, name: str = "sailor", image: str,
              namespace: str = "default") -> list[dict[str, Any]]:
    """ConfigMap, headless Service and one Indexed Job per (GPU type, zone) group.

    Args:
        layout: the plan's nodes and agents.
        opts: worker options; the plan is mounted at `opts.plan_path` (its folder becomes the mount).
        name: prefix of every object's name (a DNS-1123 label).
        image: container image with Sailor, torch and CUDA.
        namespace: where the objects go.
    Raises:
        SailorInputError: a GPU type GKE does not offer, or a bad name.
    """
    if not name.replace("-", "").isalnum() or not name[0].isalpha() or name != name.lower():
        raise SailorInputError(f"name {name!r} is not a DNS-1123 label", source="--name",
                               fix="lower-case letters, digits and '-', starting with a letter")
    if not opts.plan_path.endswith("/" + PLAN_FILE):
        raise SailorInputError(f"the plan is mounted from a ConfigMap as {PLAN_FILE}; got {opts.plan_path!r}",
                               source="--remote-plan", fix=f"e.g. /etc/sailor/{PLAN_FILE}")
    groups = layout.groups()
    service = f"{name}-nodes"
    rdzv_host = f"{name}-{groups[0].name}-0.{service}.{namespace}.svc.cluster.local"
    out: list[dict[str, Any]] = [_config_map(layout.plan, name, namespace), _service(service, name, namespace)]
    out += [_job(g, layout, opts, name=name, image=image, namespace=namespace, service=service, rdzv_host=rdzv_host)
            for g in groups]
    return out


def _config_map(plan: Plan, name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-plan", "namespace": namespace},
            "data": {PLAN_FILE: json.dumps(plan.to_dict(), separators=(",", ":"))}}


def _service(service: str, name: str, namespace: str) -> dict[str, Any]:
    # Headless: no virtual IP, one DNS record per pod; publishNotReady so rank 0's name resolves
    # while the pods are still starting (they have no readiness probe anyway).
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": service, "namespace": namespace},
            "spec": {"clusterIP": "None", "selector": {"sailor.dev/job": name}, "publishNotReadyAddresses": True}}


def _job(g: Group, layout: LaunchLayout, opts: LaunchOptions, *, name: str, image: str, namespace: str,
         service: str, rdzv_host: str) -> dict[str, Any]:
    gpus = round_up_pow2(g.gpus_per_node_used, g.nodes[0].gpus_per_node)
    lines = ['case "$JOB_COMPLETION_INDEX" in']
    for n in g.nodes:
        lines.append(f"  {n.index}) exec bash -c {_sq(node_script(n, layout, opts, '$SAILOR_RDZV_HOST'))} ;;")
    lines += ['  *) echo "unexpected JOB_COMPLETION_INDEX=$JOB_COMPLETION_INDEX" >&2; exit 1 ;;', "esac"]
    mount_dir = opts.plan_path.rsplit("/", 1)[0] or "/"
    container = {
        "name": "worker", "image": image, "command": ["bash", "-c", "\n".join(lines) + "\n"],
        "env": [{"name": "SAILOR_RDZV_HOST", "value": rdzv_host},
                {"name": "SAILOR_RDZV_PORT", "value": str(opts.rdzv_port)},
                {"name": "SAILOR_GROUP", "value": g.name}],
        "ports": [{"containerPort": opts.rdzv_port, "name": "rendezvous"}],
        "resources": {"limits": {"nvidia.com/gpu": gpus}},
        "volumeMounts": [{"name": "plan", "mountPath": mount_dir, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],  # NCCL and data loaders need more than 64 MiB
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": f"{name}-{g.name}", "namespace": namespace,
                     "labels": {"sailor.dev/job": name, "sailor.dev/group": g.name}},
        "spec": {
            "completionMode": "Indexed", "completions": len(g.nodes), "parallelism": len(g.nodes),
            "backoffLimit": 0,  # a failed rank fails the job: restart from a checkpoint, not in place
            "template": {
                "metadata": {"labels": {"sailor.dev/job": name, "sailor.dev/group": g.name}},
                "spec": {
                    "subdomain": service, "restartPolicy": "Never",
                    "nodeSelector": {"cloud.google.com/gke-accelerator": gke_accelerator(g.gpu),
                                     "topology.kubernetes.io/zone": g.zone},
                    "containers": [container],
                    "volumes": [{"name": "plan", "configMap": {"name": f"{name}-plan"}},
                                {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                },
            },
        },
    }


def _sq(text: str) -> str:
    """Single-quote `text` for bash."""
    return "'" + text.replace("'", "'\"'\"'") + "'"
