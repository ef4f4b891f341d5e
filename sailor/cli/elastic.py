"""`sailor run` (train elastically over an availability trace) and `sailor replay` (simulate it).

`sailor run` exit statuses: 0 every step done; 1 the job could not continue (no GPUs left for good,
or launches failing before their first step); 2 bad input; 3 stopped on request (SIGTERM/SIGINT)
after writing a checkpoint; 130 killed by a second interrupt.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from sailor.cli.app import app
from sailor.cli.common import (MAKES_FOLDERS, METRICS_HELP, DataOpt, InitFromOpt, JsonOpt, LogEveryOpt, NetworkOpt, ProfilesOpt, SeedOpt,
                               check_number, choice, console, machine_profiles, require_torch, say_notes_now)
from sailor.core.errors import SailorInputError, counted
from sailor.core.fileio import check_distinct_outputs, check_output_path
from sailor.core.limits import MAX_SECONDS, MAX_TRACE_TIME_S

TraceOpt = typer.Option(..., "--availability", help="Availability trace: CSV (Timestamp + <gpu>_<zone> columns),"
                        ' JSON events [{"time_s", "zone", "gpu", "count"}], or [{"Time", "GPUs"}] for the'
                        " cluster's one zone and GPU type.")
JobReq = typer.Option(..., "--job", help="Job spec (YAML/JSON): model, global_batch_size, precision, optimizer.")
ClusterReq = typer.Option(..., "--cluster", help="Cluster spec (YAML/JSON): provider, prices, node sizes (its zones"
                          " are replaced by the trace's).")
RunCheckpointEveryOpt = typer.Option(None, "--checkpoint-every", min=0, help="Checkpoint every N steps, bounding what a"
                                     " crash rolls back (a live switch then writes none; 0: only at switches and the"
                                     " end; default: the job's recipe.checkpoint.every, 100 unless set).")


@app.command()
def run(
    job: Path = JobReq,
    cluster: Path = ClusterReq,
    availability: Path = TraceOpt,
    steps: Optional[int] = typer.Option(None, "--steps", help="Train until this many optimizer steps in total, e.g. 200"
                                        " (default: the job's recipe.schedule.total_steps, else 100)."),
    seed: int = SeedOpt,
    checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir", help="Checkpoint folder (step-<n>/);"
                                                 " resumed from when it holds a checkpoint. Default: a temporary one."),
    checkpoint_every: Optional[int] = RunCheckpointEveryOpt,
    metrics: Optional[str] = typer.Option(None, "--metrics", help=f"{METRICS_HELP} A step redone after a rollback is"
                                          " written again; with --hosts, name a file on the storage every host sees."),
    log_every: int = LogEveryOpt,
    events: Optional[str] = typer.Option(None, "--events", help="Write one JSON line per controller event to this"
                                         " file (.jsonl); one that holds events already is refused without"
                                         " --append-events." + MAKES_FOLDERS),
    append_events: bool = typer.Option(False, "--append-events", help="Add this run's events after those already in"
                                       " --events (e.g. a run resumed from --checkpoint-dir)."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Clock seconds per trace second (0.01: an hour of"
                                     " trace in 36 s)."),
    clock: str = typer.Option("wall", "--clock", help="What drives trace time: wall (seconds since start) or training"
                              " (seconds spent in training steps; start-up and switches excluded) or steps (one per training step)."),
    switch_cost_s: Optional[float] = typer.Option(None, "--switch-cost-s", help="Assume each switch costs this many"
                                                  " seconds (default: measured, 11.35 s before the first)."),
    profiles: Optional[Path] = ProfilesOpt,
    network: Optional[Path] = NetworkOpt,
    data: Optional[str] = DataOpt,
    init_from: Optional[str] = InitFromOpt,
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="HOSTS.yaml: run the ranks on these machines over ssh"
                                         " (one session per rank, or with --restart torchrun per node; needs"
                                         " --checkpoint-dir on storage they all mount)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu (gloo) or cuda (NCCL); default: cpu for"
                                         " provider local, else cuda."),
    python: Optional[str] = typer.Option(None, "--python", help="With --hosts: Python interpreter on the hosts, with"
                                         " Sailor installed: an absolute path or a command on their PATH"
                                         " (default python3)."),
    rdzv_port: Optional[int] = typer.Option(None, "--rdzv-port", help="With --hosts: port of the rendezvous store on"
                                            " rank 0's host (default 29500; live switches use the 31 above it too)."),
    start_timeout_s: float = typer.Option(300.0, "--start-timeout-s", help="A launch whose ranks have not formed their"
                                          " process groups by then is ended as failed."),
    in_place: bool = typer.Option(False, "--in-place", help="Switch live (the default, locally and with --hosts):"
                                  " the ranks that stay keep their process and state, which moves in memory; a"
                                  " failure during the move falls back to a checkpoint."),
    restart: bool = typer.Option(False, "--restart", help="Switch by restarting: every rank stops, checkpoints and"
                                 " restarts from the checkpoint. Not with --in-place."),
) -> None:
    """Train, keeping the job on the best plan as GPUs come and go (local provider: one process per GPU;
    --hosts: the machines of HOSTS.yaml).

    Exit status: 0 every step done; 1 the job could not continue; 2 bad input; 3 stopped on request
    (SIGTERM/SIGINT) after a checkpoint; 130 killed by a second interrupt.
    """
    require_torch("run")
    from sailor.elastic.events import ClockKind
    from sailor.elastic.options import RunOptions, check_run
    from sailor.elastic.controller import run as run_elastic
    from sailor.elastic.remote import HostPool
    from sailor.runtime.command import checkpoint_every_for, steps_for
    from sailor.runtime.hf_weights import check_init_from
    from sailor.runtime.prepare import check_training_data

    if in_place and restart:  # (one typer flag pair would let the last of them win silently)
        raise SailorInputError("given with --restart; a switch runs either live or by restarting", source="--in-place",
                               fix="pass one of them, or neither for the provider's default")
    clock_kind = choice(ClockKind, clock, "--clock", "clock")
    check_number(time_scale, "--time-scale", lo=0, lo_open=True, hi=1e9)
    check_number(switch_cost_s, "--switch-cost-s", lo=0, hi=MAX_SECONDS)
    check_number(start_timeout_s, "--start-timeout-s", lo=0, lo_open=True, hi=MAX_SECONDS)
    for value, option, folder in ((checkpoint_dir, "--checkpoint-dir", True), (metrics, "--metrics", False),
                                  (events, "--events", False)):
        check_output_path(value, option, folder=folder, inputs={"--job": job, "--cluster": cluster,
                                                                "--availability": availability, "--hosts": hosts})
    check_distinct_outputs({"--checkpoint-dir": checkpoint_dir, "--metrics": metrics, "--events": events})
    job_spec, cluster_spec, trace = load_inputs(job, cluster, availability)
    steps = steps_for(job_spec, steps, fallback=100)
    checkpoint_every = checkpoint_every_for(job_spec, checkpoint_every)
    if not hosts and (python is not None or rdzv_port is not None):
        raise SailorInputError("only with --hosts (they start the hosts' processes)",
                               source="--python" if python is not None else "--rdzv-port",
                               fix="pass --hosts HOSTS.yaml, or leave it out")
    device = device or ("cpu" if cluster_spec.provider == "local" else "cuda")
    if device == "cpu" and job_spec.precision != "fp32":  # before planning, naming the job (not a launch's plan)
        raise SailorInputError(f"the runtime trains in fp32 on cpu, the job says {job_spec.precision}",
                               source=str(job), field="precision", fix="set precision: fp32")
    err = Console(stderr=True, soft_wrap=True)
    pool = HostPool.load(hosts, cluster_spec, python="python3" if python is None else python,
                         rdzv_port=29500 if rdzv_port is None else rdzv_port) if hosts else None
    options = RunOptions(job=job_spec, cluster=cluster_spec, trace=trace, steps=steps, seed=seed,
                         checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, metrics=metrics,
                         events=events, append_events=append_events, time_scale=time_scale, clock=clock_kind,
                         switch_cost_s=switch_cost_s, network=str(network) if network else None, data=data,
                         init_from=init_from, log_every=log_every, hosts=pool, device=device,
                         start_timeout_s=start_timeout_s, in_place=True if in_place else (False if restart else None),
                         on_event=lambda ev: _say(err, ev))
    check_run(options)  # bad options are refused before the machine is measured
    check_training_data(job_spec, data, source=str(job))  # and so are the tokens, and the weights to start from
    if init_from and not (checkpoint_dir and Path(checkpoint_dir).is_dir() and any(Path(checkpoint_dir).iterdir())):
        check_init_from(init_from, job_spec.model)  # (a checkpoint to resume from holds the weights instead)
    prof = trace_profiles(job_spec, cluster_spec, trace, profiles, job_source=str(job))
    say_notes_now()  # where the profile came from: said now, before the run's own lines
    result = run_elastic(dataclasses.replace(options, profiles=prof))
    if result.status == 2:  # a rank refused its input (ExitStatus.BAD_INPUT): its one line
        print(f"error: {result.message}", file=sys.stderr)
        raise typer.Exit(code=2)
    summary = (f"{result.message} ({counted(result.switches, 'switch', 'switches')},"
               f" {counted(result.crashes, 'crash', 'crashes')},"
               f" {counted(result.steps_rolled_back, 'step')} rolled back)")
    err.print(summary, markup=False, highlight=False)
    raise typer.Exit(code=int(result.status))


@app.command()
def replay(
    job: Path = JobReq,
    cluster: Path = ClusterReq,
    availability: Path = TraceOpt,
    profiles: Optional[Path] = ProfilesOpt,
    network: Optional[Path] = NetworkOpt,
    policy: str = typer.Option("sailor", "--policy", help="sailor (re-plan each change, switch when it pays),"
                               " static (keep the first plan until it loses GPUs), homogeneous (one GPU type"
                               " and zone per plan)."),
    duration_s: Optional[float] = typer.Option(None, "--duration-s", help="End of the run in trace seconds"
                                               " (default: last point + the last spacing)."),
    as_json: bool = JsonOpt,
    plot_file: Optional[str] = typer.Option(None, "--plot", help="Write a PNG of GPUs and throughput over time."),
    switch: str = typer.Option("restart", "--switch", help="How a switch is priced: restart (every rank restarts"
                               " from a checkpoint: the published 11.25 s) or live (`sailor run --in-place`: from"
                               " the bytes moved and the links they cross)."),
    checkpoint_every: Optional[int] = RunCheckpointEveryOpt,
) -> None:
    """Simulate a whole elastic run over an availability trace, without training. With --switch live a
    switch is priced as `sailor run` with the same --checkpoint-every would switch (a checkpoint
    written at the switch only with 0)."""
    from sailor.elastic.replay import Policy, plot
    from sailor.elastic.replay import replay as replay_run
    from sailor.elastic.switch_cost import LiveSwitchModel
    from sailor.runtime.command import checkpoint_every_for

    pol = choice(Policy, policy, "--policy", "policy")
    if switch not in ("restart", "live"):
        raise SailorInputError(f"must be restart or live, got {switch!r}", source="--switch")
    if switch == "restart" and checkpoint_every is not None:  # the restart model is the published breakdown
        raise SailorInputError("only with --switch live (a restart always writes its checkpoint)",
                               source="--checkpoint-every", fix="add --switch live, or leave --checkpoint-every out")
    check_number(duration_s, "--duration-s", lo=0, lo_open=True, hi=MAX_TRACE_TIME_S)
    check_output_path(plot_file, "--plot", suffixes=(".png", ".svg", ".pdf"),
                      inputs={"--job": job, "--cluster": cluster, "--availability": availability,
                              "--profiles": profiles, "--network": network})
    job_spec, cluster_spec, trace = load_inputs(job, cluster, availability)
    prof = trace_profiles(job_spec, cluster_spec, trace, profiles, job_source=str(job))
    result = replay_run(job_spec, cluster_spec, trace, policy=pol, profiles_path=prof,
                        network_path=str(network) if network else None, duration_s=duration_s,
                        live=LiveSwitchModel.for_run(checkpoint_every_for(job_spec, checkpoint_every))
                        if switch == "live" else None)
    if plot_file:
        plot(result, plot_file)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    _print_replay(result)


def load_inputs(job: Path, cluster: Path, availability: Path):
    """The job, the cluster and the availability trace of `sailor run` and `replay`: the trace
    replaces the cluster's zones, so the cluster's zone links and per-zone prices must name what the
    trace offers (`ClusterSpec.check_offered`). Returns (JobSpec, ClusterSpec, Trace)."""
    from sailor.elastic.availability import load_trace
    from sailor.specs import load_cluster, load_job

    job_spec, cluster_spec = load_job(job), load_cluster(cluster, zones_from_trace=True)
    trace = load_trace(availability, cluster_spec)
    try:
        cluster_spec.check_offered(trace.peak_zones(), by=f"the trace {trace.source}")
    except SailorInputError as e:
        raise e.located(source=str(cluster)) from None
    return job_spec, cluster_spec, trace


def trace_profiles(job_spec, cluster_spec, trace, profiles: Optional[Path], *, job_source: str):
    """The profiles `sailor run` and `sailor replay` plan with: `--profiles` when given, else what
    `sailor plan` uses on the cluster at the trace's peak availability (`common.machine_profiles`:
    on the local provider the same measured, cached machine profile, so that the same plan gets the
    same predicted step time from all three), else None (roofline; also when the trace never offers
    a GPU). Returns a path as str, loaded Profiles, or None."""
    peak = trace.peak_zones()
    if not any(n > 0 for z in peak.values() for n in z.values()):  # nothing to plan on: nothing to measure
        return str(profiles) if profiles else None
    prof = machine_profiles(job_spec, cluster_spec.with_zones(peak), profiles, job_source=job_source)
    return str(prof) if isinstance(prof, Path) else prof


def _say(err, ev: dict) -> None:
    """One line on stderr for the events a user watches (all are in --events)."""
    kind, on = ev["event"], f" on {', '.join(ev['hosts'])}" if ev.get("hosts") else ""
    line = {
        "launch": lambda: f"launch: {counted(ev['world_size'], 'rank')} from step {ev['resume_step']}{on}",
        "switch_started": lambda: f"switch ({ev['reason']}) after step {ev['step']}",
        "switch_finished": lambda: None if ev.get("interrupted") else f"switched in {ev['total_s']:.1f} s",
        "crash": lambda: f"crash: {ev['message']}" + (f"; left out: {', '.join(ev['hosts'])}" if ev.get("hosts") else ""),
        "rollback": lambda: f"rolled back {counted(ev['steps'], 'step')} to step {ev['to_step']}",
        "start_timeout": lambda: ev["message"],
        "checkpoint_skipped": lambda: ev["reason"],
        "waiting": lambda: f"no plan fits: waiting for trace time {ev['until_trace_time_s']:g} s",
    }.get(kind, lambda: None)()
    if line:
        err.print(line, markup=False, highlight=False)


def _print_replay(result) -> None:
    from rich.table import Table

    t = Table(title=f"replay of {result.trace} ({result.policy.value})")
    for col in ("start (s)", "end (s)", "GPUs avail", "GPUs used", "iter time (s)", "iters/s", "$/hour",
                "switch (s)", "iterations", "cost ($)", "note"):
        t.add_column(col)
    for i in result.intervals:
        t.add_row(f"{i.start_s:,.0f}", f"{i.end_s:,.0f}", str(i.gpus_available), str(i.gpus_used),
                  f"{i.iteration_time_s:.3f}" if i.iteration_time_s else "-", f"{i.throughput_iters_per_s:.3f}",
                  f"{i.cost_per_hour_usd:,.2f}", f"{i.switch_s:.1f}", f"{i.iterations:,.0f}", f"{i.cost_usd:,.2f}",
                  i.note)
    out = console()
    out.print(t)
    tot = result.totals()
    per = f"${tot['usd_per_iteration']:.4f}/iteration" if tot["usd_per_iteration"] is not None else "no iteration"
    out.print(f"total: {tot['iterations']:,.0f} iterations, ${tot['cost_usd']:,.2f} ({per}),"
              f" {counted(tot['switches'], 'switch', 'switches')} losing {tot['switch_time_s']:.1f} s (modelled);"
              f" the planner ran {tot['planning_s']:.2f} s here (not charged: it plans while the job trains)")
