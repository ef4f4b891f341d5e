"""`sailor launch PLAN --backend torchrun|skypilot|kubernetes`: run a plan on a real cluster.

`--dry-run` prints what would run as YAML documents separated by `---`: per-node torchrun commands,
SkyPilot tasks (one per GPU type and zone), or Kubernetes manifests (a JobSet with one replicated
job per GPU type and zone, or Indexed Jobs with `--indexed-jobs`). Without it the torchrun backend
starts every node over ssh from `--hosts` and waits; SkyPilot files and Kubernetes manifests are
meant for `sky launch` / `kubectl apply`, so those backends need `--dry-run` or `--out`. SkyPilot
always needs `--out`: a new folder that becomes the tasks' working directory (task files,
`launch.sh`, the plan, Sailor's source or wheel), synced to every node.

Every rank gets the training settings `sailor train` takes (steps, seed, data, initial weights,
checkpoint folder and interval, metrics, log interval, TensorBoard, timeout, device), through the
worker's one command builder (`sailor.runtime.command.WorkerSettings`). Their paths name files on
the nodes and are passed as given. Rank 0 writes the metrics file and TensorBoard folder on its node
and prints the --log-every lines in its output (ssh session, `sky logs`, pod log).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from sailor.cli.app import app
from sailor.cli.common import (MAKES_FOLDERS, NOTES_AT_END, CheckpointEveryOpt, DataOpt, InitFromOpt, LogEveryOpt, MetricsOpt, SeedOpt,
                               StepsOpt, TensorboardOpt, TimeoutOpt, choice, say_notes_now)
from sailor.core.errors import SailorInputError


@app.command("launch")
def launch_command(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="Plan file (ours, or a Sailor plan_config JSON)."),
    job: Optional[Path] = typer.Option(None, "--job", help="Job spec file, for a plan that carries none (e.g. Sailor's"
                                       " plan_config); read here, and by the ranks at its absolute path (kubernetes:"
                                       " inside the plan's ConfigMap; skypilot: inside the plan in --out)."),
    backend: str = typer.Option(..., "--backend", help="torchrun (ssh per node), skypilot (task YAML) or"
                                                       " kubernetes (Job manifests)."),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="HOSTS.yaml: ssh hosts per zone and GPU type"
                                                               " (torchrun backend)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands / YAML instead of starting anything."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the YAML documents to this file"
                                        " (skypilot: a folder of task files and launch.sh)." + MAKES_FOLDERS),
    steps: Optional[int] = StepsOpt,
    seed: int = SeedOpt,
    data: Optional[str] = DataOpt,
    init_from: Optional[str] = InitFromOpt,
    checkpoint_every: Optional[int] = CheckpointEveryOpt,
    metrics: Optional[str] = MetricsOpt,
    log_every: int = LogEveryOpt,
    tensorboard: Optional[str] = TensorboardOpt,
    timeout_s: float = TimeoutOpt,
    remote_plan: Optional[str] = typer.Option(None, "--remote-plan", help="Path of the plan file on the nodes"
                                              " (default: PLAN's absolute path; /etc/sailor/plan.json on Kubernetes; plan.json,"
                                              " relative to the working directory --out, on SkyPilot)."),
    rdzv_port: int = typer.Option(29500, "--rdzv-port", help="TCP port of the rendezvous store on rank 0's node."),
    python: str = typer.Option("python3", "--python", help="Python interpreter on the nodes."),
    checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir", help="Checkpoint folder on shared storage"
                                                  " (kubernetes: --checkpoint-claim; skypilot: --checkpoint-bucket)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda (NCCL), or cpu (gloo) for a test run;"
                                         " default cpu for a plan on GPU type cpu, else cuda."),
    image: Optional[str] = typer.Option(None, "--image", help="Container image with Sailor and torch (the Dockerfile's);"
                                        " kubernetes default sailor-train:<version>; skypilot default: none, setup"
                                        " installs Sailor from --out (see --install-from)."),
    name: str = typer.Option("sailor", "--name", help="JobSet name and object prefix (kubernetes), cluster prefix"
                             " (skypilot): a DNS-1123 label, e.g. opt350."),
    namespace: str = typer.Option("default", "--namespace", help="Kubernetes namespace of every object."),
    indexed_jobs: bool = typer.Option(False, "--indexed-jobs", help="Kubernetes: plain Indexed Jobs instead of a JobSet"
                                      " (no all-or-nothing admission, no restart as a whole)."),
    queue: Optional[str] = typer.Option(None, "--queue", help="Kubernetes: Kueue LocalQueue that admits the JobSet all"
                                        " or nothing."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Kubernetes: times the JobSet restarts as a whole after"
                                     " a failure (resuming from the newest checkpoint; needs --checkpoint-dir), e.g. 3."),
    allow_public_rendezvous: bool = typer.Option(False, "--allow-public-rendezvous", help="torchrun: accept a public IP"
                                                 " address for node 0 in HOSTS.yaml (its rendezvous store has no"
                                                 " authentication; refused otherwise)."),
    checkpoint_claim: Optional[str] = typer.Option(None, "--checkpoint-claim", help="Kubernetes: PersistentVolumeClaim"
                                                   " (ReadWriteMany) mounted at --checkpoint-dir."),
    checkpoint_bucket: Optional[str] = typer.Option(None, "--checkpoint-bucket", help="SkyPilot: bucket mounted at"
                                                    " --checkpoint-dir on every node, e.g. gs://my-bucket/opt350."),
    managed: bool = typer.Option(False, "--managed", help="SkyPilot: a managed job (sky jobs launch) on spot VMs,"
                                 " recovered on preemption; a plan of one (GPU type, zone) group, with checkpoints."),
    install_from: Optional[Path] = typer.Option(None, "--install-from", help="SkyPilot without --image: Sailor source"
                                                " checkout or sailor_train-*.whl copied into --out and installed by"
                                                " setup (default: the checkout this Sailor runs from)."),
) -> None:
    """Run PLAN with torchrun over ssh, or write its SkyPilot tasks or Kubernetes manifests. Paths of
    --data, --init-from, --checkpoint-dir, --metrics and --tensorboard name files on the nodes."""
    from sailor.core.fileio import check_output_path
    from sailor.launch import Backend, KubernetesOptions, LaunchOptions, check_backend_gpus, launch, launch_files
    from sailor.launch.skypilot import PLAN_FILE, SkyPilotOptions
    from sailor.plan import load_plan
    from sailor.runtime.command import WorkerSettings, check_takes_effect, checkpoint_every_for, steps_for
    from sailor.runtime.validate import check_plan_for_job
    from sailor.specs import load_job

    chosen = choice(Backend, backend, "--backend", "backend")
    check_output_path(out, "--out", folder=chosen is Backend.SKYPILOT,  # before any work
                      inputs={"PLAN": plan_path, "--job": job, "--hosts": hosts, "--install-from": install_from})
    plan = load_plan(plan_path)
    job_spec = load_job(job) if job is not None else plan.job
    check_plan_for_job(plan, job_spec, plan.cluster, source=str(plan_path),  # as `sailor train` does
                       job_source=str(job) if job is not None else None)
    if chosen is not Backend.TORCHRUN and job is not None:  # the ConfigMap / working directory carries the plan
        plan, job = plan.with_specs(job_spec, plan.cluster), None  # now with its job
    try:  # no silent default length for a cluster run; said after the other checks, which keep their messages
        steps, no_steps = steps_for(job_spec, steps, fallback=None), None
    except SailorInputError as e:
        steps, no_steps = 1, e
    if max_restarts and not checkpoint_dir:  # a restart without a checkpoint would start over from step 0
        raise SailorInputError(f"{max_restarts} restarts would each start over from step 0 without a checkpoint",
                               source="--max-restarts", fix="add --checkpoint-dir DIR on storage every node mounts")
    every = checkpoint_every_for(job_spec, checkpoint_every)
    no_checkpoints = None if checkpoint_dir else ("warning: no --checkpoint-dir: the run writes no checkpoint and a"
                                                  " failure loses every step (pass a folder every node mounts; it is"
                                                  f" then written every {every} steps)")
    default_remote = {Backend.KUBERNETES: "/etc/sailor/plan.json", Backend.SKYPILOT: PLAN_FILE}.get(
        chosen, str(plan_path.resolve()))
    worker = WorkerSettings(plan=remote_plan or default_remote, steps=steps, seed=seed, data=data, init_from=init_from,
                            job=None if job is None else str(job.resolve()),
                            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, metrics=metrics,
                            log_every=log_every, tensorboard=tensorboard, timeout_s=timeout_s,
                            device=device or ("cpu" if all(r.gpu == "cpu" for p in plan.pipelines for r in p.replicas)
                                              else "cuda"))
    check_takes_effect(worker)
    opts = LaunchOptions(worker=worker, rdzv_port=rdzv_port, python=python)
    if chosen is Backend.TORCHRUN and not dry_run and hosts is None:
        raise SailorInputError("starting nodes needs --hosts HOSTS.yaml", source="--hosts",
                               fix="or pass --dry-run to print the commands")
    if chosen is Backend.SKYPILOT and out is None:
        raise SailorInputError("the skypilot backend needs a new folder to write the tasks' working directory into"
                               " (task files, launch.sh, the plan and Sailor, synced to every node)", source="--out",
                               fix="pass --out DIR; with --dry-run it also prints the task files")
    if chosen is Backend.SKYPILOT and out.exists() and any(out.iterdir()):
        raise SailorInputError(f"{out} is not empty; every file in it would be synced to the nodes", source="--out",
                               fix="name a new folder")
    if chosen is not Backend.TORCHRUN and not dry_run and out is None:
        raise SailorInputError(f"the {chosen.value} backend only writes specs", source="--backend",
                               fix="pass --dry-run to print them or --out to save them")
    k8s = KubernetesOptions(namespace=namespace, indexed_jobs=indexed_jobs, queue=queue, max_restarts=max_restarts,
                            checkpoint_claim=checkpoint_claim)
    if chosen is not Backend.KUBERNETES and k8s != KubernetesOptions():
        raise SailorInputError("--namespace, --indexed-jobs, --queue, --max-restarts and --checkpoint-claim are for"
                               " the kubernetes backend", source="--backend")
    sky = SkyPilotOptions(workdir=str(out.resolve()) if out is not None else ".", checkpoint_bucket=checkpoint_bucket,
                          managed=managed)
    if chosen is not Backend.SKYPILOT and (sky != SkyPilotOptions(workdir=sky.workdir) or install_from is not None):
        raise SailorInputError("--checkpoint-bucket, --managed and --install-from are for the skypilot backend",
                               source="--backend")
    if chosen is Backend.TORCHRUN and hosts is not None:
        from sailor.launch import layout_for
        from sailor.launch.hosts import check_rendezvous, load_hosts

        hosts_file = load_hosts(hosts)
        check_rendezvous(layout_for(plan, hosts_file, str(hosts)), hosts_file, source=str(hosts),
                         allow_public=allow_public_rendezvous)
    extra = {"sky": sky, "install_from": install_from} if chosen is Backend.SKYPILOT else {}
    try:
        files = launch_files(plan, chosen, opts, header=_header(chosen, plan_path, indexed_jobs), hosts_path=hosts,
                             image=image, name=name, k8s=k8s, **extra)
    except SailorInputError as e:
        if e.source is None:  # a GPU type the backend has no name for: name the plan file and replica
            check_backend_gpus(plan, chosen, source=str(plan_path))
        raise
    if no_steps is not None:
        raise no_steps
    if out is not None:
        _write(out, files)
    if not data:
        NOTES_AT_END.append("warning: no --data: every rank trains on Python's built-in pydoc text as byte"
                            " tokens (pass the token file's path on the nodes)")
    if job_spec.recipe.eval is not None:
        NOTES_AT_END.append(f"note: recipe.eval.data {job_spec.recipe.eval.data} is read on the nodes, relative to"
                            f" the ranks' working folder; launch copies no data there")
    if no_checkpoints:
        NOTES_AT_END.append(no_checkpoints)
    if dry_run:
        print("".join(files.values()) if chosen is not Backend.SKYPILOT else
              "".join(files[f] for f in files if f.endswith(".yaml") and "/" not in f), end="")
        return
    if chosen is Backend.TORCHRUN:
        say_notes_now()  # before the nodes' output: the run ends in typer.Exit, which skips the notes at the end
        status = launch(plan, opts, hosts)
        if status:
            print(f"error: a node failed (ssh exit status {status}); all nodes stopped", file=sys.stderr)
        raise typer.Exit(code=1 if status else 0)


def _write(out: Path, files: dict[str, str | bytes]) -> None:
    """`--out`: the one file at `out`, or (SkyPilot) every file into the folder `out` (names may
    hold folders: the plan's relative path, Sailor's source tree)."""
    from sailor.core.fileio import check_output_path, write_atomic

    if set(files) == {""}:
        write_atomic(out, files[""])
        return
    check_output_path(out, "--out", folder=True)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out / name, text)
        if name.endswith(".sh"):
            (out / name).chmod(0o755)


def _header(backend, plan_path: Path, indexed_jobs: bool) -> str:
    from sailor.launch import Backend

    if backend is Backend.TORCHRUN:
        return (f"sailor launch {plan_path}: one document per node; run `command` on `host`.\n"
                "torchrun node ranks are ordered so that its global ranks equal the plan's ranks.")
    if backend is Backend.SKYPILOT:
        return (f"sailor launch {plan_path}: one SkyPilot task per (GPU type, zone).\n"
                "Start them with launch.sh (sailor launch --out DIR writes it): the first task hosts the\n"
                "rendezvous; the others need --env SAILOR_RDZV_HOST=<internal address of its head node>.")
    if indexed_jobs:
        return (f"sailor launch {plan_path}: ConfigMap, NetworkPolicy, headless Service, one Indexed Job per\n"
                "(GPU type, zone). kubectl apply -f this file; pod 0 of the first Job hosts the rendezvous.")
    return (f"sailor launch {plan_path}: ConfigMap, NetworkPolicy and a JobSet (jobset.x-k8s.io, installed in\n"
            "the cluster) with one replicated job per (GPU type, zone). kubectl apply -f this file.")
