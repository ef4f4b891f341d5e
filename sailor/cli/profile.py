"""`sailor profile`: measure this machine's layers (and, with `network`, its links) into files that
`sailor simulate --profiles/--network` and `sailor plan --profiles/--network` read."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Optional

import typer

from sailor import catalog
from sailor.cli.app import app
from sailor.cli.common import MAKES_FOLDERS, require_torch
from sailor.core.errors import SailorInputError, one_line, show

profile_app = typer.Typer(no_args_is_help=False, help="Measure this machine: layer times, memory, links.")
app.add_typer(profile_app, name="profile")

DeviceOpt = typer.Option("cpu", "--device", help="cpu (gloo, fp32, one process per TP rank) or cuda (NCCL, bf16).")


def int_list(text: str, option: str) -> tuple[int, ...]:
    parts = [v.strip() for v in text.split(",") if v.strip()]
    if not all(re.fullmatch(r"-?\d{1,9}", v) for v in parts):
        raise SailorInputError(f"expected comma-separated whole numbers, got {show(text)}", field=option)
    values = tuple(int(v) for v in parts)
    if not values:
        raise SailorInputError("give at least one value", field=option)
    return values


def check_profile_options(opts, job: Path) -> None:
    """`runtime.profiler.check_options` of `opts` (a `ProfileOptions`), before any measuring; an error
    about the job's precision or model (too large to measure here) names the job file `job`, as
    `sailor train` does.

    Raises:
        SailorInputError: naming the option, or the job file and its field.
    """
    from sailor.runtime.profiler import check_options

    try:
        check_options(opts)
    except SailorInputError as e:
        raise (e.located(source=str(job)) if e.field in ("precision", "model") else e) from None


def _progress(label: str, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from sailor.cli.common import progress_bar

    bar = progress_bar(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False)
    task = bar.add_task(label, total=total)
    return bar, (lambda n: bar.advance(task, n))


@profile_app.callback(invoke_without_command=True)
def profile_layers(
    ctx: typer.Context,
    job: Optional[Path] = typer.Option(None, "--job", help="Job spec (YAML/JSON): model, sequence length, precision."),
    device: str = DeviceOpt,
    tp: str = typer.Option("1", "--tp", help="TP degrees, comma-separated, e.g. 1,2,4 (degree t runs t processes)."),
    mbs: str = typer.Option("1,2,4,8", "--mbs", help="Micro-batch sizes (samples), comma-separated, e.g. 1,2,4,8."),
    warmup: int = typer.Option(3, "--warmup", help="Untimed passes before timing, e.g. 3."),
    repeats: int = typer.Option(10, "--repeats", help="Timed passes per layer and size; the median is kept (the whole model's pass: 3x as many, their trimmed mean), e.g. 10."),
    threads: int = typer.Option(1, "--threads", help="CPU threads per process (torchrun gives each rank 1)."),
    concurrency: int = typer.Option(0, "--concurrency", help="Replicas timed at once, e.g. 2; 0: enough to keep"
                                                             " every CPU core busy, as in a multi-process run (1 on cuda)."),
    out: Path = typer.Option(Path("profile.json"), "--out", help="Profile file to write (JSON, sailor.profiles/1)."
                                                                   + MAKES_FOLDERS),
) -> None:
    """Time the runtime's embedding, block and head layers and the optimizer step on this machine."""
    if ctx.invoked_subcommand is not None:
        return
    if job is None:
        raise SailorInputError("no job: pass --job JOB.yaml (or use `sailor profile network --nproc N`)")
    require_torch("profile")
    from sailor.core.fileio import check_output_path, write_json
    from sailor.perf.profiles import profiles_from_dict
    from sailor.runtime.profiler import ProfileOptions, profile_job, profile_steps
    from sailor.specs import load_job

    catalog.check_device(device)
    check_output_path(out, "--out", inputs={"--job": job})  # before minutes of measuring
    opts = ProfileOptions(job=load_job(job), device=device,  # type: ignore[arg-type]
                          tps=int_list(tp, "--tp"), mbs=int_list(mbs, "--mbs"), warmup=warmup, repeats=repeats,
                          threads=threads, concurrency=concurrency)
    check_profile_options(opts, job)
    bar, advance = _progress("profile", profile_steps(opts))
    with bar:
        data = profile_job(opts, progress=advance)
    profiles_from_dict(data, str(out))  # what we write must load
    write_json(out, data)
    gpu = next(iter(data["optimizer"]))
    print(f"profile of {data['model']} on {data['device']} (GPU type {gpu!r}) written to {out}")


@profile_app.command("network")
def profile_network_command(
    nproc: int = typer.Option(2, "--nproc", help="Local processes taking part, e.g. 2 (>= 4 also measures"
                                                 " concurrent flows)."),
    device: str = DeviceOpt,
    zone: str = typer.Option("local", "--zone", help="Zone name the links are written for."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Untimed rounds per size (default 2; 1 with --hosts)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Timed rounds per size; the median is kept"
                                                                  " (default 5; 3 with --hosts)."),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="HOSTS.yaml: measure the links between these machines"
                                                               " over ssh instead (one pair per link, 1 KiB..4 MiB)."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="With --hosts: the cluster spec the hosts belong to."),
    python: Optional[str] = typer.Option(None, "--python", help="With --hosts: Python interpreter on the hosts,"
                                                                " with Sailor installed (default python3)."),
    port: Optional[int] = typer.Option(None, "--port", min=1, max=65535, help="With --hosts: TCP port of the"
                                       " rendezvous on each pair's first machine (default 29500)."),
    out: Path = typer.Option(Path("network.json"), "--out", help="Link file to write (JSON, sailor.network/1)."
                                                                   + MAKES_FOLDERS),
) -> None:
    """p2p and all-reduce over 1 KiB..64 MiB between local processes (or, with --hosts, p2p between
    machines); fit latency and bandwidth."""
    require_torch("profile network")
    from sailor.core.fileio import check_output_path, write_json
    from sailor.runtime.netprofile import SIZES_BYTES, describe_collective, profile_network

    catalog.check_device(device)
    check_output_path(out, "--out", inputs={"--hosts": hosts, "--cluster": cluster})
    given = [o for o, v in (("--cluster", cluster), ("--python", python), ("--port", port)) if v is not None]
    if hosts is None and given:
        raise SailorInputError("only with --hosts (the links between machines)", field=given[0])
    if hosts is not None:
        data = _profile_hosts(hosts, cluster, python or "python3", 29500 if port is None else port, device,
                              1 if warmup is None else warmup, 3 if repeats is None else repeats)
        write_json(out, data)
        for link in data["links"]:
            print(f"{link['src_gpu']} in {link['src_zone']} -> {link['dst_gpu']} in {link['dst_zone']}"
                  f"{' (same node)' if link['same_node'] else ''}: latency {link['latency_s'] * 1e6:.0f} µs,"
                  f" bandwidth {link['bandwidth_bytes_per_s'] / 1e6:.1f} MB/s")
        print(describe_collective(data["collective"]))
        print(f"{len(data['links'])} links written to {out}")
        return
    bar, advance = _progress("network", len(SIZES_BYTES))
    with bar:
        data = profile_network(nproc, device=device, zone=zone, warmup=2 if warmup is None else warmup,
                               repeats=5 if repeats is None else repeats, progress=advance)
    write_json(out, data)
    link = data["classes"]["same_zone"]
    print(f"link: latency {link['latency_s'] * 1e6:.1f} µs, bandwidth {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s;"
          f" {describe_collective(data['collective'])}; written to {out}")


def _profile_hosts(hosts: Path, cluster: Optional[Path], python: str, port: int, device: str, warmup: int,
                   repeats: int) -> dict:
    """`profile network --hosts`: every link of `launch.hosts.link_pairs`, measured over ssh. A link
    whose measurement fails (ssh cannot reach a machine, a process there fails) ends the command
    with its one `error:` line and exit status 1."""
    import shlex

    from sailor.elastic.remote import HostPool
    from sailor.launch.hosts import link_pairs
    from sailor.launch.torchrun import ssh_argv
    from sailor.runtime.netprofile import HOST_SIZES_BYTES, profile_pairs
    from sailor.specs import load_cluster

    if cluster is None:
        raise SailorInputError("--hosts needs the cluster spec the machines belong to", field="--cluster")
    spec = load_cluster(cluster)
    pool = HostPool.load(hosts, spec, python=python, rdzv_port=port)
    pairs = link_pairs(pool.hosts, pool.node_size)
    if not pairs:
        raise SailorInputError("one machine of one GPU per node has no link to measure", source=str(hosts),
                               field="groups", fix="list two machines, or machines of two groups")
    bar, advance = _progress("links", len(pairs) * len(HOST_SIZES_BYTES))
    try:
        with bar:
            return profile_pairs(pairs, lambda dest, argv: ssh_argv(dest, shlex.join([pool.python, *argv]), pool.ssh),
                                 cluster=spec, port=pool.rdzv_port, device=device, warmup=warmup, repeats=repeats,
                                 progress=advance)
    except RuntimeError as e:  # a machine unreachable or a measurement failed there: not a bug, exit 1
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        raise typer.Exit(code=1) from None
