"""The Kubernetes backend: one JobSet (default) or Indexed Jobs, one job per (GPU type, zone) group.

**JobSet** (`jobset.x-k8s.io/v1alpha2`, https://jobset.sigs.k8s.io, installed in the cluster as a
CRD and controller): one replicated job per group, each an Indexed Job whose pod k (its
`JOB_COMPLETION_INDEX`) is node k of the group and runs that node's torchrun agents. The JobSet
treats the groups as one workload:
- all or nothing: its pods are created together; with `queue` (a Kueue LocalQueue) Kueue admits the
  JobSet only when quota for every pod exists; without it a group that cannot be scheduled keeps the
  others waiting in the rendezvous until `rdzv_timeout_s`, then the whole JobSet fails;
- restart as a whole: any failed job makes the controller delete every job and create them all again
  (`failurePolicy.maxRestarts` times, `BlockingRecreate`: the old pods are gone first); with a
  checkpoint folder the new pods resume from its newest checkpoint;
- names: JobSet's headless Service (named after the JobSet) gives pod j of replicated job r the
  hostname `<jobset>-<r>-0-<j>`, so rank 0 is at `<jobset>-<first group>-0-0.<jobset>`.

**Indexed Jobs** (`indexed_jobs=True`): plain `batch/v1` Jobs with our own headless Service; no
all-or-nothing admission or joint restart (a failed Job fails alone and the others wait out the
rendezvous timeout).

Both come with a ConfigMap holding the plan (mounted at `worker.plan`) and a NetworkPolicy that lets
only the job's own pods reach its pods (the TCPStore rendezvous and NCCL take any port); nothing is
exposed outside the cluster (no NodePort, LoadBalancer or Ingress; the Services are headless). Pods
are pinned with `nodeSelector` to the GPU product (`cloud.google.com/gke-accelerator`) and zone
(`topology.kubernetes.io/zone`) and ask for `nvidia.com/gpu` in `limits` only, as the NVIDIA device
plugin expects (requests default to limits for extended resources). One cluster must have GPU node
pools in all the plan's zones (a GKE regional cluster covers one region's zones); a plan whose zones
span several regions is refused with one line naming them (`check_one_region`).
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import PurePosixPath
from typing import Any

from sailor.core.errors import SailorInputError, show
from sailor.launch.common import (Group, LaunchLayout, LaunchOptions, backend_name, check_image, node_script,
                                  round_up_pow2)
from sailor.plan.spec import Plan
from sailor.runtime.command import WorkerSettings, option

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
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOB_LABEL = "sailor.dev/job"
GROUP_LABEL = "sailor.dev/group"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # https://kueue.sigs.k8s.io/docs/tasks/run/jobsets/
# RFC 1123 label (what Kubernetes calls a DNS-1123 label: names of Jobs, namespaces, pod hostnames);
# Services need an RFC 1035 label (starting with a letter): every generated name starts with `name`,
# which must start with a letter. https://kubernetes.io/docs/concepts/overview/working-with-objects/names/
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_LABEL_MAX = 63
# A DNS-1123 subdomain (the name of a PersistentVolumeClaim, ConfigMap...): labels joined by dots, at
# most 253 characters (same page).
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_SUBDOMAIN_MAX = 253


def gke_accelerator(gpu: str) -> str:
    """GKE accelerator label of `gpu`; SailorInputError for a type GKE does not offer."""
    return backend_name(GKE_ACCELERATOR, gpu, "GKE accelerator label")


def check_label(value: str, option: str, what: str, given: str | None = None) -> None:
    """Raise SailorInputError (naming `option`) unless `value` is a DNS-1123 label of at most 63
    characters; `what` says which generated name `value` is (e.g. "pod hostname"), built from the
    user's `given` value of `option` (the fix then says how long that may be)."""
    if len(value) > DNS_LABEL_MAX:
        room = DNS_LABEL_MAX - (len(value) - len(given or value))
        raise SailorInputError(f"the {what} {value!r} has {len(value)} characters, more than {DNS_LABEL_MAX}",
                               source=option, fix=f"{option} of at most {room} characters" if room > 0
                               else "fewer GPU types or zones per name")
    if not DNS_LABEL.fullmatch(value):
        raise SailorInputError(f"{value!r} is not a DNS-1123 label", source=option,
                               fix="lower-case letters, digits and '-', starting and ending with a letter or digit")


def check_object_name(value: str, option: str, what: str) -> None:
    """Raise SailorInputError (naming `option`) unless `value`, the name of an existing Kubernetes
    object (`what`, e.g. "PersistentVolumeClaim"), is a DNS-1123 subdomain of at most 253 characters:
    the API server would refuse the manifests only when they are applied."""
    if len(value) > DNS_SUBDOMAIN_MAX or not DNS_SUBDOMAIN.fullmatch(value):
        raise SailorInputError(f"{show(value)} is not a {what} name (a DNS-1123 subdomain of at most"
                               f" {DNS_SUBDOMAIN_MAX} characters)", source=option,
                               fix="lower-case letters, digits, '-' and '.', starting and ending with a letter or digit")


def manifests(layout: LaunchLayout, opts: LaunchOptions, *, name: str = "sailor", image: str,
              namespace: str = "default", indexed_jobs: bool = False, queue: str | None = None,
              max_restarts: int = 0, checkpoint_claim: str | None = None) -> list[dict[str, Any]]:
    """The manifests that run `layout` on Kubernetes, in `kubectl apply` order.

    Args:
        layout: the plan's nodes and agents.
        opts: worker options; the plan is mounted at `opts.worker.plan` (its folder becomes the mount).
        name: the JobSet's name and every object's name prefix (a DNS-1123 label starting with a letter).
        image: container image with Sailor, torch and CUDA (the repository's Dockerfile).
        namespace: where the objects go.
        indexed_jobs: plain Indexed Jobs instead of one JobSet.
        queue: Kueue LocalQueue admitting the JobSet all or nothing (JobSet only).
        max_restarts: times the JobSet is restarted as a whole after a failure (JobSet only).
        checkpoint_claim: PersistentVolumeClaim (ReadWriteMany) mounted at `opts.worker.checkpoint_dir`.
    Returns:
        ConfigMap, NetworkPolicy, then the JobSet, or a headless Service and one Job per group.
    Raises:
        SailorInputError: a GPU type GKE does not offer; a name, namespace or generated hostname that
            is not a DNS-1123 label of at most 63 characters; an empty image; options that do not go
            together (checkpoints, a metrics file or TensorBoard folder outside a claim; queue or
            restarts with Indexed Jobs).
    """
    check_image(image)
    check_label(name, "--name", "name")
    if not name[0].isalpha():
        raise SailorInputError(f"{name!r} must start with a letter (it names Services)", source="--name")
    check_label(namespace, "--namespace", "namespace")
    if not opts.worker.plan.endswith("/" + PLAN_FILE):
        raise SailorInputError(f"the plan is mounted from a ConfigMap as {PLAN_FILE}; got {opts.worker.plan!r}",
                               source="--remote-plan", fix=f"e.g. /etc/sailor/{PLAN_FILE}")
    if checkpoint_claim is not None:
        check_object_name(checkpoint_claim, "--checkpoint-claim", "PersistentVolumeClaim")
    check_outputs_kept(opts.worker, checkpoint_claim)
    if indexed_jobs and (queue or max_restarts):
        raise SailorInputError("--queue and --max-restarts need a JobSet", source="--indexed-jobs",
                               fix="drop --indexed-jobs (JobSet is the default)")
    if queue is not None:
        check_label(queue, "--queue", "queue name")
    if max_restarts < 0:
        raise SailorInputError(f"must be >= 0, got {max_restarts}", source="--max-restarts")
    groups = layout.groups()
    if indexed_jobs:
        service = f"{name}-nodes"
        hosts = {g.name: [f"{name}-{g.name}-{n.index}" for n in g.nodes] for g in groups}
    else:
        service = name  # JobSet's own headless Service
        hosts = {g.name: [f"{name}-{g.name}-0-{n.index}" for n in g.nodes] for g in groups}
    check_label(service, "--name", "Service name", name)
    for g in groups:
        for host in hosts[g.name]:
            check_label(host, "--name", "pod hostname", name)
    rdzv_host = f"{hosts[groups[0].name][0]}.{service}"  # resolved through the namespace's search domain
    pods = {g.name: _pod_template(g, layout, opts, name=name, image=image, rdzv_host=rdzv_host,
                                  subdomain=service if indexed_jobs else None, checkpoint_claim=checkpoint_claim)
            for g in groups}
    out = [_config_map(layout.plan, name, namespace), _network_policy(name, namespace)]
    if indexed_jobs:
        out.append(_service(service, name, namespace))
        out += [_job(g, pods[g.name], name=name, namespace=namespace) for g in groups]
    else:
        out.append(_jobset(groups, pods, name=name, namespace=namespace, queue=queue, max_restarts=max_restarts))
    return out


def check_one_region(layout: LaunchLayout, region_of) -> None:
    """Raise SailorInputError, naming the regions, when the plan's zones lie in more than one region.

    Why refused rather than split: a GKE cluster's node pools live in one region, so a JobSet whose
    groups select zones of two regions never schedules; one JobSet per region's cluster would need
    rank 0's TCPStore (no authentication) exposed across clusters and pod-to-pod routes for NCCL,
    which nothing here can set up or check. `region_of(zone)` is the catalog's region, or None for a
    zone it does not list (not counted).
    """
    regions = sorted({r for g in layout.groups() if (r := region_of(g.zone)) is not None})
    if len(regions) > 1:
        raise SailorInputError(f"the plan spans regions {', '.join(regions)}, but a Kubernetes cluster's GPU node pools"
                               " lie in one region", source="--backend",
                               fix="launch it with --backend skypilot (groups meet on VPC-internal addresses), or"
                               " plan with the zones of one region")


def check_outputs_kept(worker: WorkerSettings, checkpoint_claim: str | None) -> None:
    """Raise SailorInputError unless what the ranks write outlives their pods: checkpoints need
    `checkpoint_claim` (mounted at the checkpoint folder, which a claim needs), and a metrics file or
    TensorBoard folder must lie in that folder."""
    if worker.checkpoint_dir and not checkpoint_claim:
        raise SailorInputError("checkpoints in a pod's own file system are lost with the pod", source="--checkpoint-dir",
                               fix="pass --checkpoint-claim PVC (a ReadWriteMany volume claim mounted there)")
    if checkpoint_claim and not worker.checkpoint_dir:
        raise SailorInputError("a checkpoint claim needs a folder to mount it at", source="--checkpoint-claim",
                               fix="pass --checkpoint-dir, e.g. /ckpt")
    for name in ("metrics", "tensorboard"):
        path = getattr(worker, name)
        if path and not (checkpoint_claim and PurePosixPath(posixpath.normpath(path)).is_relative_to(worker.checkpoint_dir)):
            raise SailorInputError(f"{path} would be in a pod's own file system, lost with the pod", source=option(name),
                                   fix="name a path under --checkpoint-dir with --checkpoint-claim, e.g. /ckpt/metrics.jsonl")


def _labels(name: str, group: str | None = None) -> dict[str, str]:
    return {JOB_LABEL: name, **({GROUP_LABEL: group} if group else {})}


def _config_map(plan: Plan, name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-plan", "namespace": namespace, "labels": _labels(name)},
            "data": {PLAN_FILE: json.dumps(plan.to_dict(), separators=(",", ":"))}}


def _network_policy(name: str, namespace: str) -> dict[str, Any]:
    # The rendezvous store has no authentication: only this job's pods may connect to them, on any
    # port (TCPStore, NCCL). Enforced where the cluster's network plugin implements NetworkPolicy
    # (GKE Dataplane V2, Calico, Cilium).
    pods = {"matchLabels": _labels(name)}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-internal", "namespace": namespace, "labels": _labels(name)},
            "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": pods}]}]}}


def _service(service: str, name: str, namespace: str) -> dict[str, Any]:
    # Headless: no virtual IP, one DNS record per pod; publishNotReady so rank 0's name resolves
    # while the pods are still starting (they have no readiness probe anyway).
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": service, "namespace": namespace, "labels": _labels(name)},
            "spec": {"clusterIP": "None", "selector": _labels(name), "publishNotReadyAddresses": True}}


def _pod_template(g: Group, layout: LaunchLayout, opts: LaunchOptions, *, name: str, image: str, rdzv_host: str,
                  subdomain: str | None, checkpoint_claim: str | None) -> dict[str, Any]:
    gpus = round_up_pow2(g.gpus_per_node_used, g.nodes[0].gpus_per_node)
    lines = ['case "$JOB_COMPLETION_INDEX" in']
    for n in g.nodes:
        lines.append(f"  {n.index}) exec bash -c {_sq(node_script(n, layout, opts, '$SAILOR_RDZV_HOST'))} ;;")
    lines += ['  *) echo "unexpected JOB_COMPLETION_INDEX=$JOB_COMPLETION_INDEX" >&2; exit 1 ;;', "esac"]
    mount_dir = opts.worker.plan.rsplit("/", 1)[0] or "/"
    mounts = [{"name": "plan", "mountPath": mount_dir, "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"}]  # NCCL and data loaders need more than 64 MiB
    volumes: list[dict[str, Any]] = [{"name": "plan", "configMap": {"name": f"{name}-plan"}},
                                     {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if checkpoint_claim:
        mounts.append({"name": "checkpoints", "mountPath": opts.worker.checkpoint_dir})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint_claim}})
    container = {
        "name": "worker", "image": image, "command": ["bash", "-c", "\n".join(lines) + "\n"],
        "env": [{"name": "SAILOR_RDZV_HOST", "value": rdzv_host},
                {"name": "SAILOR_RDZV_PORT", "value": str(opts.rdzv_port)},
                {"name": "SAILOR_GROUP", "value": g.name}],
        "ports": [{"containerPort": opts.rdzv_port, "name": "rendezvous"}],
        "resources": {"limits": {"nvidia.com/gpu": gpus}},
        "volumeMounts": mounts,
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "nodeSelector": {"cloud.google.com/gke-accelerator": gke_accelerator(g.gpu), "topology.kubernetes.io/zone": g.zone},
        "containers": [container], "volumes": volumes,
    }
    if subdomain:
        spec = {"subdomain": subdomain, **spec}
    return {"metadata": {"labels": _labels(name, g.name)}, "spec": spec}


def _job_spec(g: Group, pod: dict[str, Any]) -> dict[str, Any]:
    return {"completionMode": "Indexed", "completions": len(g.nodes), "parallelism": len(g.nodes),
            "backoffLimit": 0,  # a failed rank fails its job at once (the JobSet then restarts them all)
            "template": pod}


def _job(g: Group, pod: dict[str, Any], *, name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{name}-{g.name}", "namespace": namespace, "labels": _labels(name, g.name)},
            "spec": _job_spec(g, pod)}


def _jobset(groups: list[Group], pods: dict[str, dict[str, Any]], *, name: str, namespace: str, queue: str | None,
            max_restarts: int) -> dict[str, Any]:
    labels = _labels(name) | ({KUEUE_QUEUE_LABEL: queue} if queue else {})
    return {
        "apiVersion": JOBSET_API, "kind": "JobSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All"},
            "failurePolicy": {"maxRestarts": max_restarts, "restartStrategy": "BlockingRecreate"},
            "replicatedJobs": [{"name": g.name, "replicas": 1,
                                "template": {"metadata": {"labels": _labels(name, g.name)},
                                             "spec": _job_spec(g, pods[g.name])}} for g in groups],
        },
    }


def _sq(text: str) -> str:
    """Single-quote `text` for bash."""
    return "'" + text.replace("'", "'\"'\"'") + "'"
