"""The SkyPilot backend: one task file per (GPU type, zone) group and a script that launches them.

Why not one file: SkyPilot (0.14) runs a multi-document YAML either as a serial pipeline or, with a
header `execution: parallel`, as a job group; `sky launch` refuses both ("a DAG ... supported by `sky
jobs launch` only"), and a job group gives its jobs each other's addresses only on one Kubernetes
cluster (on cloud VMs it turns that networking off), so GPU groups in several GCP zones could not
find rank 0. Each group is therefore its own SkyPilot cluster (one zone and accelerator type per
cluster, as SkyPilot requires), and `launch.sh` starts them:

1. `sky launch --detach-run` the rendezvous group (it holds rank 0 on its head node,
   SKYPILOT_NODE_RANK 0, whose internal address is the first line of SKYPILOT_NODE_IPS);
2. read that node's internal address over SkyPilot's ssh alias (`ssh <cluster> hostname -I`);
3. launch the other groups at once with `--env SAILOR_RDZV_HOST=<that address>`. Their files set
   SAILOR_RDZV_HOST to null, so SkyPilot refuses a launch without it before provisioning anything.

Security: no task asks for `ports`, so SkyPilot opens nothing beyond its ssh port; the rendezvous
(TCPStore, no authentication) and NCCL go over internal addresses, which SkyPilot's GCP firewall
rule admits from the VPC's own range only (10.128.0.0/9, `sky/provision/gcp/constants.py`). All
groups must be in one VPC (SkyPilot's default for a GCP project). Every node gets the plan at
`worker.plan` (`file_mounts`) and Sailor from the released wheel (`setup`: pip install
`sailor-train[train]==<version>`), or runs in `image` (`image_id: docker:<image>`, no setup).
Task YAML reference: https://docs.skypilot.co/en/latest/reference/yaml-spec.html
"""

from __future__ import annotations

import shlex
from typing import Any

from sailor.core import __version__
from sailor.core.errors import SailorInputError
from sailor.launch.common import (RDZV_HOST_VAR, Group, LaunchLayout, LaunchOptions, backend_name, check_image,
                                  node_script, round_up_pow2)

# Our GPU types -> SkyPilot accelerator names (`sky show-gpus`); only types GCP rents.
SKYPILOT_ACCELERATOR = {
    "A100-40": "A100",
    "A100-80": "A100-80GB",
    "H100-80": "H100",
    "H200-141": "H200",
    "V100-16": "V100",
    "L4": "L4",
    "T4": "T4",
}
RELEASE = f"sailor-train[train]=={__version__}"  # what `setup` installs without an image
SCRIPT = "launch.sh"


def accelerator(gpu: str) -> str:
    """SkyPilot accelerator name of `gpu`; SailorInputError for a type SkyPilot cannot rent on GCP."""
    return backend_name(SKYPILOT_ACCELERATOR, gpu, "SkyPilot accelerator on GCP")


def cluster_names(layout: LaunchLayout, name: str) -> list[str]:
    """The SkyPilot cluster of each group (`layout.groups()` order): `<name>-<k>`."""
    if not name[:1].isalpha() or not all(c.isalnum() or c == "-" for c in name) or name.endswith("-"):
        raise SailorInputError(f"{name!r} cannot prefix SkyPilot cluster names", source="--name",
                               fix="letters, digits and '-', starting with a letter")
    return [f"{name}-{k}" for k in range(len(layout.groups()))]


def task_specs(layout: LaunchLayout, opts: LaunchOptions, *, region_of, mounts: dict[str, str] | None = None,
               image: str | None = None, name: str = "sailor") -> list[dict[str, Any]]:
    """One SkyPilot task dict per (GPU type, zone) group, the rendezvous group first.

    Args:
        layout: the plan's nodes and agents.
        opts: worker options (`worker.plan` is where the plan is mounted on the nodes).
        region_of: zone -> region (the cluster's provider).
        mounts: node path -> file on this machine, copied to the nodes with `file_mounts` (the plan at
            `worker.plan`, and the job at `worker.job` when one is given).
        image: a container image with Sailor and torch (`image_id: docker:<image>`); None installs
            the released wheel in `setup` instead.
        name: prefix of the task (and, in `launch.sh`, cluster) names.
    Raises:
        SailorInputError: a GPU type SkyPilot cannot rent; an empty image.
    """
    if image is not None:
        check_image(image)
    cluster_names(layout, name)  # checks the prefix
    out = []
    for k, g in enumerate(layout.groups()):
        accel = f"{accelerator(g.gpu)}:{round_up_pow2(g.gpus_per_node_used, g.nodes[0].gpus_per_node)}"
        resources: dict[str, Any] = {"infra": f"gcp/{region_of(g.zone)}/{g.zone}", "accelerators": accel}
        if image:
            resources["image_id"] = f"docker:{image}"
        task: dict[str, Any] = {"name": f"{name}-{g.name}", "num_nodes": len(g.nodes), "resources": resources}
        if k > 0:  # null: required, so `sky launch` refuses before provisioning when it is not given
            task["envs"] = {RDZV_HOST_VAR: None}
        if mounts:
            task["file_mounts"] = dict(mounts)
        if not image:
            task["setup"] = f"{opts.python} -m pip install --quiet {shlex.quote(RELEASE)}"
        task["run"] = _run_script(g, layout, opts, host_group=k == 0)
        out.append(task)
    return out


def _run_script(g: Group, layout: LaunchLayout, opts: LaunchOptions, host_group: bool) -> str:
    lines = ["set -e"]
    if host_group:  # rank 0 sits on this group's node 0, SkyPilot's head node
        lines.append(f'export {RDZV_HOST_VAR}="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"')
    lines.append('case "$SKYPILOT_NODE_RANK" in')
    for n in g.nodes:
        lines.append(f"  {n.index}) {node_script(n, layout, opts, '$' + RDZV_HOST_VAR)} ;;")
    lines.append('  *) echo "unexpected SKYPILOT_NODE_RANK=$SKYPILOT_NODE_RANK" >&2; exit 1 ;;')
    lines.append("esac")
    return "\n".join(lines) + "\n"


def task_file_names(layout: LaunchLayout) -> list[str]:
    """The task file of each group: `<k>-<group>.yaml`."""
    return [f"{k}-{g.name}.yaml" for k, g in enumerate(layout.groups())]


def launch_script(layout: LaunchLayout, *, name: str = "sailor") -> str:
    """`launch.sh`: the rendezvous group first, its head's internal address, then the other groups
    at once (module docstring). Run it from anywhere; it reads the task files next to it."""
    files, clusters = task_file_names(layout), cluster_names(layout, name)
    q = shlex.quote
    lines = [
        "#!/usr/bin/env bash",
        f"# sailor launch --backend skypilot: {len(files)} SkyPilot cluster(s), one per (GPU type, zone).",
        f"# Stop them all: sky down {' '.join(clusters)}",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f"sky launch --yes --detach-run --cluster {q(clusters[0])} {q(files[0])}",
    ]
    if len(files) > 1:
        lines += [
            "# rank 0's node: its internal address (the first one; the external address is NAT, not on the VM)",
            f"rdzv=$(ssh {q(clusters[0])} hostname -I | awk '{{print $1}}')",
            'test -n "$rdzv" || { echo "no internal address for the rendezvous node" >&2; exit 1; }',
            "pids=()",
        ]
        for f, c in zip(files[1:], clusters[1:]):
            lines.append(f'sky launch --yes --detach-run --cluster {q(c)} {q(f)} --env {RDZV_HOST_VAR}="$rdzv" &'
                         " pids+=($!)")
        lines.append('for p in "${pids[@]}"; do wait "$p"; done')
    lines.append(f'echo "launched; rank 0 logs: sky logs {clusters[0]}"')
    return "\n".join(lines) + "\n"
