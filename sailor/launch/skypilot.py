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
groups must be in one VPC (SkyPilot's default for a GCP project).

Across providers: each group's `infra:` names its own cloud, region and zone (`infra`; a plan may
span GCP, AWS and Azure). Their VMs reach rank 0's internal address, and each other's NCCL sockets,
only where the clouds' networks are joined (a VPN or interconnect routing each cloud's internal
range), which SkyPilot does not set up: `launch.sh` of such a plan says so.

What every node gets (`SkyPilotOptions`):
- the task's working directory (`workdir:`, synced by SkyPilot to `~/sky_workdir` on every node, where
  `setup` and `run` start): the folder `sailor launch --out` writes, holding the task files, the plan
  at a relative path (`plan.json`), and Sailor itself: a copy of the source checkout Sailor runs from
  (`sailor-train/`: pyproject.toml, README.md, the `sailor` package) or a wheel (`--install-from`);
- `setup`: `pip install './sailor-train[train]'` (or the wheel's file name with `[train]`) from that
  folder, never a name looked up on a package index; or, with `image`, nothing (`image_id:
  docker:<image>` holds Sailor);
- checkpoints: a bucket mounted at the checkpoint folder on every node of every group (`file_mounts`,
  `{source: gs://... or s3://..., mode: MOUNT}`: gcsfuse / mountpoint, files visible to every node once
  closed), so every group writes into, and resumes from, the same `step-*` folders; a checkpoint
  folder without a bucket is refused (each VM's disk is its own).

Managed jobs (`managed=True`, `sky jobs launch`): SkyPilot's jobs controller recovers a task whose
spot VMs are preempted (`job_recovery`, strategy FAILOVER: same zone first) by provisioning new ones
and running `run` again, which resumes from the newest checkpoint in the bucket. Only for a plan of
one group: the other groups of a multi-group plan were told rank 0's internal address at launch, and
a recovered rendezvous group comes back on a new address they would never learn.
Task YAML reference: https://docs.skypilot.co/en/latest/reference/yaml-spec.html
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import shlex
import tomllib
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from sailor.core.errors import SailorInputError
from sailor.launch.common import (RDZV_HOST_VAR, Group, LaunchLayout, LaunchOptions, backend_name, check_image,
                                  node_script, round_up_pow2)

# Our GPU types -> SkyPilot accelerator names (`sky show-gpus`), per provider: the types each one
# rents (the catalog's aws.yaml and azure.yaml list the instances; SkyPilot's own catalogs name an
# A100 80GB PCIe "A100-80GB" and the H100 NVL of Azure's NC H100 v5 "H100").
SKYPILOT_ACCELERATOR = {
    "A100-40": "A100",
    "A100-80": "A100-80GB",
    "H100-80": "H100",
    "H200-141": "H200",
    "V100-16": "V100",
    "L4": "L4",
    "T4": "T4",
}
SKYPILOT_ACCELERATORS = {
    "gcp": SKYPILOT_ACCELERATOR,
    "aws": {"A100-40": "A100", "A100-80": "A100-80GB", "H100-80": "H100", "H200-141": "H200", "V100-16": "V100",
            "V100-32": "V100-32GB", "L4": "L4", "T4": "T4"},
    "azure": {"A100-40": "A100", "A100-80": "A100-80GB", "A100-80-PCIe": "A100-80GB", "H100-80": "H100",
              "H100-NVL": "H100", "V100-16": "V100", "V100-32": "V100-32GB", "T4": "T4"},
}
# Providers whose VMs SkyPilot places by region only: `infra: <provider>/<region>` (SkyPilot's
# sky/clouds/azure.py: "Azure does not support zones").
REGION_ONLY = frozenset({"azure"})
SCRIPT = "launch.sh"
PLAN_FILE = "plan.json"  # the plan, in the task's working directory
SOURCE_DIR = "sailor-train"  # Sailor's source tree, in the task's working directory
DISTRIBUTION = "sailor-train"  # pyproject's [project] name
# A wheel of the distribution (PEP 427 file name: `-` in the name becomes `_`).
WHEEL = re.compile(r"sailor_train-[A-Za-z0-9_.+!]+-[A-Za-z0-9_.]+-[A-Za-z0-9_.]+-[A-Za-z0-9_.]+\.whl")
# Bucket URIs SkyPilot mounts (`sky.data.storage`): GCS or S3, bucket names as both define them
# (3-63 lower-case letters, digits, '-', '_', '.'; starting and ending with a letter or digit).
BUCKET = re.compile(r"(gs|s3)://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/[A-Za-z0-9._/-]*)?")
SKYIGNORE = "# sailor launch: every file in this folder is synced to the nodes (SkyPilot reads .skyignore, not git)\n"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SkyPilotOptions:
    """SkyPilot settings (module docstring).

    Attributes:
        workdir: the folder SkyPilot syncs to every node (`workdir:`); `sailor launch` gives the
            absolute `--out` folder, so the files launch from anywhere; "." is the folder `sky` runs in.
        install: what `setup` installs, relative to the working directory: SOURCE_DIR (a source
            tree) or a wheel's file name; ignored with an image.
        checkpoint_bucket: gs://BUCKET[/PATH] or s3://BUCKET[/PATH] mounted at the checkpoint folder.
        managed: write a managed job (`sky jobs launch`, spot VMs recovered on preemption).
    """

    workdir: str = "."
    install: str = SOURCE_DIR
    checkpoint_bucket: str | None = None
    managed: bool = False


def accelerator(gpu: str, provider: str = "gcp") -> str:
    """SkyPilot accelerator name of `gpu` on `provider`; SailorInputError for a type SkyPilot cannot
    rent there (or a provider it has no table for)."""
    return backend_name(SKYPILOT_ACCELERATORS.get(provider, {}), gpu, f"SkyPilot accelerator on {provider}")


def infra(provider: str, region: str, zone: str) -> str:
    """SkyPilot's `infra:` of a group in `zone` (SkyPilot >= 0.10: `<cloud>/<region>/<zone>`, or
    `<cloud>/<region>` where the cloud has no zones, REGION_ONLY), e.g. gcp/us-central1/us-central1-a,
    aws/us-east-1/us-east-1a, azure/eastus."""
    return f"{provider}/{region}" if provider in REGION_ONLY else f"{provider}/{region}/{zone}"


def cluster_names(layout: LaunchLayout, name: str) -> list[str]:
    """The SkyPilot cluster of each group (`layout.groups()` order): `<name>-<k>`."""
    if not name[:1].isalpha() or not all(c.isalnum() or c == "-" for c in name) or name.endswith("-"):
        raise SailorInputError(f"{name!r} cannot prefix SkyPilot cluster names", source="--name",
                               fix="letters, digits and '-', starting with a letter")
    return [f"{name}-{k}" for k in range(len(layout.groups()))]


def check_sky_options(layout: LaunchLayout, opts: LaunchOptions, sky: SkyPilotOptions) -> None:
    """Raise SailorInputError (one line, naming the option) unless the plan path is relative inside
    the working directory, checkpoints go to a bucket (a bucket needs a folder to mount at, an
    absolute one), and a managed job has one group and checkpoints to resume from."""
    plan = opts.worker.plan
    if PurePosixPath(plan).is_absolute() or ".." in PurePosixPath(posixpath.normpath(plan)).parts:
        raise SailorInputError(f"{plan!r}: on SkyPilot the plan lies in the task's working directory",
                               source="--remote-plan", fix=f"a relative path, e.g. {PLAN_FILE}")
    ck, bucket = opts.worker.checkpoint_dir, sky.checkpoint_bucket
    if ck and not bucket:
        raise SailorInputError("each SkyPilot VM has its own disk, so the groups would not share checkpoints",
                               source="--checkpoint-dir", fix="pass --checkpoint-bucket gs://BUCKET/PATH (mounted there)")
    if bucket and not ck:
        raise SailorInputError("a checkpoint bucket needs a folder to mount it at", source="--checkpoint-bucket",
                               fix="pass --checkpoint-dir, e.g. /ckpt")
    if bucket and not BUCKET.fullmatch(bucket):
        name = re.match(r"(gs|s3)://([^/]*)", bucket)
        why = (f"its bucket name {name.group(2)!r} has {len(name.group(2))} characters; bucket names have 3 to 63"
               if name and not 3 <= len(name.group(2)) <= 63 else "is not a gs:// or s3:// bucket URI")
        raise SailorInputError(f"{bucket!r}: {why}", source="--checkpoint-bucket", fix="e.g. gs://my-bucket/sailor/opt350")
    if ck and not PurePosixPath(ck).is_absolute():
        raise SailorInputError(f"{ck!r}: a bucket is mounted at an absolute folder", source="--checkpoint-dir",
                               fix="e.g. /ckpt")
    if sky.managed and len(layout.groups()) > 1:
        raise SailorInputError(f"a managed job needs a plan of one (GPU type, zone) group; this plan has"
                               f" {len(layout.groups())} (a recovered rendezvous group would get an address the"
                               " others never learn)", source="--managed", fix="drop --managed (launch.sh starts the"
                               " groups as clusters), or plan on one GPU type in one zone")
    if sky.managed and not ck:
        raise SailorInputError("a recovered managed job without checkpoints starts again from step 0",
                               source="--managed", fix="pass --checkpoint-dir /ckpt --checkpoint-bucket gs://BUCKET/PATH")


def task_specs(layout: LaunchLayout, opts: LaunchOptions, *, place, sky: SkyPilotOptions | None = None,
               image: str | None = None, name: str = "sailor") -> list[dict[str, Any]]:
    """One SkyPilot task dict per (GPU type, zone) group, the rendezvous group first.

    Args:
        layout: the plan's nodes and agents.
        opts: worker options (`worker.plan` is the plan's path relative to the working directory).
        place: zone -> (provider, region) from the cluster's catalog (a plan may span providers:
            each group goes to its own, `infra`).
        sky: working directory, what setup installs, checkpoint bucket, managed job (default
            SkyPilotOptions()).
        image: a container image with Sailor and torch (`image_id: docker:<image>`); None installs
            `sky.install` from the working directory in `setup` instead.
        name: prefix of the task (and, in `launch.sh`, cluster) names.
    Raises:
        SailorInputError: a GPU type SkyPilot cannot rent; an empty image; `check_sky_options`.
    """
    sky = sky or SkyPilotOptions()
    if image is not None:
        check_image(image)
    cluster_names(layout, name)  # checks the prefix
    check_sky_options(layout, opts, sky)
    if opts.worker.checkpoint_dir:  # a recovered job, or launch.sh run again, continues from the bucket
        opts = dataclasses.replace(opts, resume_newest=True)
    out = []
    for k, g in enumerate(layout.groups()):
        provider, region = place(g.zone)
        accel = f"{accelerator(g.gpu, provider)}:{round_up_pow2(g.gpus_per_node_used, g.nodes[0].gpus_per_node)}"
        resources: dict[str, Any] = {"infra": infra(provider, region, g.zone), "accelerators": accel}
        if image:
            resources["image_id"] = f"docker:{image}"
        if sky.managed:  # spot VMs; preemptions recovered without limit, a failing run is not retried
            resources |= {"use_spot": True, "job_recovery": {"strategy": "FAILOVER", "max_restarts_on_errors": 0}}
        task: dict[str, Any] = {"name": f"{name}-{g.name}", "workdir": sky.workdir, "num_nodes": len(g.nodes),
                                "resources": resources}
        if k > 0:  # null: required, so `sky launch` refuses before provisioning when it is not given
            task["envs"] = {RDZV_HOST_VAR: None}
        if sky.checkpoint_bucket:
            task["file_mounts"] = {opts.worker.checkpoint_dir: {"source": sky.checkpoint_bucket, "mode": "MOUNT"}}
        if not image:  # from the synced working directory (setup starts there): nothing looked up by name
            task["setup"] = f"{opts.python} -m pip install --quiet {shlex.quote('./' + sky.install + '[train]')}"
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


def launch_script(layout: LaunchLayout, *, name: str = "sailor", managed: bool = False,
                  providers: Sequence[str] = ()) -> str:
    """`launch.sh`: the rendezvous group first, its head's internal address, then the other groups
    at once (module docstring); `managed`: `sky jobs launch` of the one group. Run it from anywhere;
    it reads the task files next to it. `providers`: the clouds the groups go to; more than one gets
    a warning in the script (and on stderr when it runs) that the groups reach rank 0's internal
    address only where the clouds' networks are joined (module docstring)."""
    files, clusters = task_file_names(layout), cluster_names(layout, name)
    q = shlex.quote
    if managed:
        return "\n".join([
            "#!/usr/bin/env bash",
            "# sailor launch --backend skypilot --managed: one managed job on spot VMs, recovered on preemption",
            f"# and resumed from the newest checkpoint. Watch: sky jobs queue; logs: sky jobs logs --name {name};"
            f" stop: sky jobs cancel --name {name}",
            "set -euo pipefail",
            'cd "$(dirname "$0")"',
            f"sky jobs launch --yes --name {q(name)} {q(files[0])}",
        ]) + "\n"
    lines = [
        "#!/usr/bin/env bash",
        f"# sailor launch --backend skypilot: {len(files)} SkyPilot cluster(s), one per (GPU type, zone).",
        f"# Stop them all: sky down {' '.join(clusters)}",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f"sky launch --yes --detach-run --cluster {q(clusters[0])} {q(files[0])}",
    ]
    if len(providers) > 1:
        note = (f"this plan spans {', '.join(providers)}: the groups reach rank 0's internal address only if"
                " these clouds' networks are joined (VPN or interconnect routing each one's internal range)")
        lines[4:4] = [f"# {note}", f"echo {q('sailor launch: ' + note)} >&2"]
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


def source_files(install_from: Path | None = None) -> tuple[str, dict[str, bytes]]:
    """What `setup` installs and the files that carry it into the working directory.

    Args:
        install_from: a Sailor source checkout (a folder whose pyproject.toml names the distribution
            `sailor-train`) or a wheel of it (`sailor_train-*.whl`); None: the checkout this Sailor
            runs from.
    Returns:
        (`SkyPilotOptions.install`, {path relative to the working directory: bytes}): SOURCE_DIR and
        the checkout's pyproject.toml, README.md and `sailor` package (no caches), or the wheel's
        file name and the wheel.
    Raises:
        SailorInputError: a path that is neither; no checkout to run from (Sailor was installed
            from a wheel) and none given.
    """
    if install_from is None:
        root = Path(__file__).resolve().parents[2]
        if not _is_checkout(root):
            raise SailorInputError("Sailor was not installed from a source checkout, so there is nothing to sync to the"
                                   " nodes", source="--install-from", fix="pass --install-from CHECKOUT_OR_WHEEL, or"
                                   " --image with Sailor inside")
        install_from = root
    p = Path(install_from)
    if p.is_file() and WHEEL.fullmatch(p.name):
        return p.name, {p.name: p.read_bytes()}
    if not p.is_dir() or not _is_checkout(p):
        raise SailorInputError(f"{p} is not a Sailor source checkout or a sailor_train-*.whl wheel",
                               source="--install-from", fix=f"a folder whose pyproject.toml names {DISTRIBUTION},"
                               " or a wheel built from it (pip wheel --no-deps .)")
    files = {f"{SOURCE_DIR}/{n}": (p / n).read_bytes() for n in ("pyproject.toml", "README.md")}
    for f in sorted((p / "sailor").rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".pyo"):
            files[f"{SOURCE_DIR}/{f.relative_to(p).as_posix()}"] = f.read_bytes()
    return SOURCE_DIR, files


def _is_checkout(root: Path) -> bool:
    """True when `root` holds pyproject.toml naming DISTRIBUTION, README.md and the `sailor` package."""
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return project.get("name") == DISTRIBUTION and (root / "README.md").is_file() and \
        (root / "sailor" / "__init__.py").is_file()
