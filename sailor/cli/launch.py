"""`sailor launch PLAN --backend torchrun|skypilot|kubernetes`: run a plan on a real cluster.

`--dry-run` prints what would run as YAML documents separated by `---`: per-node torchrun commands,
SkyPilot tasks (one per GPU type and zone), or Kubernetes manifests (one Job per GPU type and zone).
Without it the torchrun backend starts every node over ssh from `--hosts` and waits; SkyPilot and
Kubernetes documents are meant for `sky launch` / `kubectl apply`, so those backends need `--dry-run`
(or `--out`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from sailor.cli import app
from sailor.cli.common import choice
from sailor.errors import SailorInputError


@app.command("launch")
def launch_command(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="Plan file (ours, or a Sailor plan_config JSON)."),
    backend: str = typer.Option(..., "--backend", help="torchrun (ssh per node), skypilot (task YAML) or"
                                                       " kubernetes (Job manifests)."),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="HOSTS.yaml: ssh hosts per zone and GPU type"
                                                               " (torchrun backend)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands / YAML instead of starting anything."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the YAML documents to this file."),
    steps: int = typer.Option(10, "--steps", help="Optimizer steps to train, e.g. 1000."),
    remote_plan: Optional[str] = typer.Option(None, "--remote-plan", help="Path of the plan file on the nodes"
                                              " (default: PLAN's absolute path; /etc/sailor/plan.json on Kubernetes)."),
    rdzv_port: int = typer.Option(29500, "--rdzv-port", help="TCP port of the rendezvous store on rank 0's node."),
    python: str = typer.Option("python3", "--python", help="Python interpreter on the nodes."),
    checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir", help="Checkpoint folder on shared storage."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda (NCCL), or cpu (gloo) for a test run;"
                                         " default cpu for a plan on GPU type cpu, else cuda."),
    image: str = typer.Option("sailor:latest", "--image", help="Container image with Sailor and torch (kubernetes)."),
    name: str = typer.Option("sailor", "--name", help="Name prefix of the Kubernetes objects."),
) -> None:
    """Run PLAN with torchrun over ssh, or write its SkyPilot tasks or Kubernetes manifests."""
    from sailor.launch import Backend, LaunchOptions, dump_documents, launch, launch_specs
    from sailor.plan import load_plan

    chosen = choice(Backend, backend, "--backend", "backend")
    plan = load_plan(plan_path)
    default_remote = "/etc/sailor/plan.json" if chosen is Backend.KUBERNETES else str(plan_path.resolve())
    opts = LaunchOptions(plan_path=remote_plan or default_remote, steps=steps, rdzv_port=rdzv_port, python=python,
                         checkpoint_dir=checkpoint_dir,
                         device=device or ("cpu" if all(r.gpu == "cpu" for p in plan.pipelines for r in p.replicas)
                                           else "cuda"))
    if chosen is Backend.TORCHRUN and not dry_run and hosts is None:
        raise SailorInputError("starting nodes needs --hosts HOSTS.yaml", source="--hosts",
                               fix="or pass --dry-run to print the commands")
    if chosen is not Backend.TORCHRUN and not dry_run and out is None:
        raise SailorInputError(f"the {chosen.value} backend only writes specs", source="--backend",
                               fix="pass --dry-run to print them or --out FILE to save them")
    docs = launch_specs(plan, chosen, opts, hosts_path=hosts, local_plan=str(plan_path.resolve()), image=image,
                        name=name)
    text = dump_documents(docs, header=_header(chosen, plan_path))
    if out is not None:
        from sailor.fileio import write_atomic
        write_atomic(out, text)
    if dry_run:
        print(text, end="")
        return
    if chosen is Backend.TORCHRUN:
        status = launch(plan, opts, hosts)
        if status:
            print(f"error: a node failed (ssh exit status {status}); all nodes stopped", file=sys.stderr)
        raise typer.Exit(code=1 if status else 0)


def _header(backend, plan_path: Path) -> str:
    from sailor.launch import Backend

    if backend is Backend.TORCHRUN:
        return (f"sailor launch {plan_path}: one document per node; run `command` on `host`.\n"
                "torchrun node ranks are ordered so that its global ranks equal the plan's ranks.")
    if backend is Backend.SKYPILOT:
        return (f"sailor launch {plan_path}: one SkyPilot task per (GPU type, zone).\n"
                "Launch the first task first (it hosts the rendezvous), then the others with\n"
                "--env SAILOR_RDZV_HOST=$(sky status --ip <first cluster>).")
    return (f"sailor launch {plan_path}: ConfigMap, headless Service, one Indexed Job per (GPU type, zone).\n"
            "kubectl apply -f this file; pod 0 of the first Job hosts the rendezvous.")
