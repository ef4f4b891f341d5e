"""The SkyPilot backend: one task YAML per (GPU type, zone) group, all wired to one rendezvous.

Each group is its own SkyPilot cluster (one zone and one accelerator type per cluster). Node k of a
group is the node with `SKYPILOT_NODE_RANK` k and runs that node's torchrun agents. The group holding
rank 0 comes first: its head node (SKYPILOT_NODE_RANK 0) hosts the rendezvous store, so that task
opens the rendezvous port and finds its own address in `SKYPILOT_NODE_IPS`. Launch it first, then
pass its head IP to the other tasks:

    sky launch -c sailor-0 task-0.yaml
    sky launch -c sailor-1 task-1.yaml --env SAILOR_RDZV_HOST=$(sky status --ip sailor-0)

The nodes of all groups must reach each other on the rendezvous port and NCCL's ports (one VPC,
or a firewall rule). Every node needs the plan file at `plan_path` (a `file_mounts` entry copies it)
and Sailor (`workdir` syncs this checkout, `setup` installs it).
Task YAML reference: https://docs.skypilot.co/en/latest/reference/yaml-spec.html
"""

from __future__ import annotations

from typing import Any

from sailor.launch.common import (RDZV_HOST_VAR, Group, LaunchLayout, LaunchOptions, backend_name, node_script,
                                  round_up_pow2)

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


def accelerator(gpu: str) -> str:
    """SkyPilot accelerator name of `gpu`; SailorInputError for a type SkyPilot cannot rent on GCP."""
    return backend_name(SKYPILOT_ACCELERATOR, gpu, "SkyPilot accelerator on GCP")


def task_specs(layout: LaunchLayout, opts: LaunchOptions, *, region_of, local_plan: str | None = None,
               workdir: str = ".") -> list[dict[str, Any]]:
    """One SkyPilot task dict per (GPU type, zone) group, the rendezvous group first.

    Args:
        layout: the plan's nodes and agents.
        opts: worker options (`plan_path` is where the plan is mounted on the nodes).
        region_of: zone -> region (the cluster's provider).
        local_plan: the plan file on this machine, copied to `plan_path` with `file_mounts`.
        workdir: the Sailor checkout SkyPilot syncs to the nodes (relative to where `sky launch` runs).
    Raises:
        SailorInputError: a GPU type SkyPilot cannot rent.
    """
    groups = layout.groups()
    rdzv_name = f"sailor-{groups[0].name}"
    out = []
    for k, g in enumerate(groups):
        host_group = k == 0
        accel = f"{accelerator(g.gpu)}:{round_up_pow2(g.gpus_per_node_used, g.nodes[0].gpus_per_node)}"
        resources: dict[str, Any] = {"cloud": "gcp", "region": region_of(g.zone), "zone": g.zone, "accelerators": accel}
        if host_group:
            resources["ports"] = [opts.rdzv_port]
        task: dict[str, Any] = {
            "name": f"sailor-{g.name}",
            "num_nodes": len(g.nodes),
            "resources": resources,
            # Only the rendezvous group knows its address; the others get it with --env at launch.
            "envs": {RDZV_HOST_VAR: "", "SAILOR_RDZV_GROUP": rdzv_name},
            "workdir": workdir,  # this checkout, synced to every node and installed by `setup`
            "setup": f"{opts.python} -m pip install --quiet -e .",
            "run": _run_script(g, layout, opts, host_group),
        }
        if local_plan:
            task["file_mounts"] = {opts.plan_path: local_plan}
        out.append(task)
    return out


def _run_script(g: Group, layout: LaunchLayout, opts: LaunchOptions, host_group: bool) -> str:
    lines = ["set -e"]
    if host_group:  # rank 0 sits on this group's node 0, SkyPilot's head node
        lines.append(f'export {RDZV_HOST_VAR}="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"')
    else:
        lines.append(f': "${{{RDZV_HOST_VAR}:?launch with --env {RDZV_HOST_VAR}=<head IP of the rendezvous group>}}"')
    lines.append('case "$SKYPILOT_NODE_RANK" in')
    for n in g.nodes:
        lines.append(f"  {n.index}) {node_script(n, layout, opts, '$' + RDZV_HOST_VAR)} ;;")
    lines.append('  *) echo "unexpected SKYPILOT_NODE_RANK=$SKYPILOT_NODE_RANK" >&2; exit 1 ;;')
    lines.append("esac")
    return "\n".join(lines) + "\n"
