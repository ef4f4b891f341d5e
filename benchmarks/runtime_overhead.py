"""Runtime overhead on CPU: tokens/s of `sailor train` on a 2-pipeline homogeneous plan against
`torch.nn.parallel.DistributedDataParallel` on the same model, batch, data and optimizer; and the
same plan under ZeRO-3 against torch's FSDP2 (`zero3_ratio`); torch's runs are `torch_reference.py`.

Both run as 2 gloo ranks under torchrun on this machine, one thread per rank (OMP_NUM_THREADS=1,
torchrun's default and the launcher's); each rank processes its half of the global batch in
micro-batches (DDP skips the all-reduce on all but the last micro-batch with `no_sync`), fp32, the
same AdamW arithmetic (torch's per-tensor loop; the runtime's multi-tensor call gives its bits).
Throughput = tokens of the timed steps / the sum of their step times, the first `--warmup` steps
excluded. The two sides of a pair run alternately, `--repeats` times (who goes first alternates too),
so that a machine whose load changes weighs on both alike: each figure is the median over the
repeats, each ratio the median of the repeats' ratios. Targets (issue #26): sailor >= DDP, sailor
ZeRO-3 >= 95 % of FSDP2. Prints a table, then one JSON line with the figures.

`boundary_bytes_over_activation`: a second, short `sailor train` run (3 gloo ranks, the same model
cut into stage 0 at TP 2 and stage 1 at TP 1, `--boundary-steps` steps) reads the bytes stage 0's
ranks sent across the boundary per step, as the runtime counts them (`pipeline.P2P.sent`, in each
metrics row's `stages`), over micro-batches x one activation (mbs x seq x hidden x element bytes);
its gradient twin is the stage-1 gradient bytes over the same. Scatter-gather sends each once (1.0);
the runtime before it sent one whole activation per receiving rank. `--boundary-steps 0` skips it.

On the testbed (`--testbed [SPEC.yaml]`, root; `sailor testbed`, README "Testbed"): every run of
both pairs puts one rank on each of two nodes (network namespaces), so DDP's and sailor's
all-reduces and FSDP2's and ZeRO-3's all-gathers and reduce-scatters cross the shaped link between
them. Without a file it brings up the built-in pair (`builtin_testbed`): nodes a and b, one rank each
under the same CPU quota (RANK_CORES = 1 core: one thread, as on loopback), in zones us-central1-a and
us-central1-b of one region, joined by a cross-zone link of LINK_MBIT = 400 Mbit/s (Ethernet frames;
NICs and other links 10 Gbit/s), on which syncing the 25 M fp32 gradients of `--hidden 512 --blocks 8`
(~100 MB each way per step) takes seconds, as long as the step's compute. A file's first two nodes
must hold one rank each (`testbed_pair`). sailor's side is `sailor launch --backend torchrun --hosts`
through the testbed's stand-in ssh (`testbed.launch_plan`), the plan's two replicas in the two
nodes' (zone, GPU type); torch's side one torchrun agent per node over the same ssh, the static
rendezvous on the first node's address (`torch_reference.node_commands`, whose command line is the one
sailor's launch gives each node, `sailor.launch.common.torchrun_command`); the stand-in ssh places
every rank of either side in its node's per-rank quota. The testbed is taken down on exit, error,
Ctrl-C or SIGTERM, and the run fails if anything of it is left (`testbed.live_testbed`). The
boundary run stays on this machine's loopback (it counts bytes, not time). Defaults there:
`--steps 12 --warmup 2` (a ZeRO-3 step moves ~400 MB each way: ~9 s at 400 Mbit/s). More keys in the JSON:
`testbed` (file or null for the built-in pair, nodes, zones, link class, cores per rank), `link_mbit`
(the rate one flow between the two nodes reaches: min(link class, both NICs)), `link_bytes` (per
side: the median over its runs of the bytes the first node's veth counted during a run, tx + rx,
Ethernet frames, rendezvous and start-up included), `link_bytes_per_step` (that / `--steps`) and
`link_bytes_runs` (every run's); all null on loopback. Quiet re-measurement (estimated 25-35
minutes on an idle 2-core machine from those bytes at the link's rate plus the loopback compute;
it took 57 minutes at 1-minute load 11 falling to 3, and `--repeats 1` 26 minutes at 4.5-13.6):

    python benchmarks/runtime_overhead.py --hidden 512 --blocks 8 --testbed

    python benchmarks/runtime_overhead.py [--steps 30] [--warmup 5] [--repeats 3] [--hidden 128] [--blocks 4]
        [--seq 64] [--boundary-steps 2] [--no-zero3] [--testbed [SPEC.yaml]]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_reference  # noqa: E402  (benchmarks/torch_reference.py)

LINK_MBIT = 400.0  # the built-in testbed's cross-zone link (Mbit/s of Ethernet frames)
RANK_CORES = 1.0  # the built-in testbed's CPU quota per rank: one core, one thread each as on loopback
FAST_MBIT = 10_000.0  # its NICs and other link classes: far above the cross-zone link, which alone shapes


def _model(args) -> dict:
    return {"name": "bench", "num_blocks": args.blocks, "hidden_size": args.hidden, "num_heads": args.heads,
            "vocab_size": 256, "max_sequence_length": args.seq}


def _throughput(times: list[float], warmup: int, tokens_per_step: int) -> float:
    timed = times[warmup:]
    return tokens_per_step * len(timed) / sum(timed)


def _job(args) -> dict:
    return {"model": _model(args), "global_batch_size": args.gbs, "sequence_length": args.seq}


def boundary_ratios(args, tmp: Path) -> tuple[float, float]:
    """(activation, gradient) bytes crossing the TP-2 -> TP-1 boundary per micro-batch over one
    activation, worst step, from a short 3-rank `sailor train` run (module docstring)."""
    from sailor.runtime.launcher import ExitStatus, launch
    from sailor.runtime.prepare import TrainOptions, prepare
    from sailor.specs.job import JobSpec

    job = _job(args)
    cut = 1 + args.blocks // 2
    plan = tmp / "boundary.json"
    plan.write_text(json.dumps({
        "micro_batch_size": args.mbs, "stages": [[0, cut], [cut, args.blocks + 2]],
        "pipelines": [{"microbatches": args.gbs // args.mbs, "replicas": [
            {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 2}, {"stage": 1, "gpu": "cpu", "zone": "local", "tp": 1}]}],
        "job": job}))
    metrics = tmp / "boundary.jsonl"
    result = launch(prepare(TrainOptions(plan=str(plan), steps=args.boundary_steps, metrics=str(metrics))),
                    handle_signals=False)
    assert result.status is ExitStatus.DONE, result.message
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    spec = JobSpec(**job)
    activation = args.mbs * spec.seq * args.hidden * spec.elem_bytes
    per_step = (args.gbs // args.mbs) * activation
    return (max(r["stages"][0]["sent_activation_bytes"] for r in rows) / per_step,
            max(r["stages"][1]["sent_gradient_bytes"] for r in rows) / per_step)


def _dp_plan(args, memory: list[dict], replicas: tuple[dict, dict]) -> dict:
    """A plan of 2 data-parallel pipelines of the whole model, one replica each (`replicas`), stage
    memory options `memory`, without its job."""
    per = args.gbs // args.mbs // 2
    return {"micro_batch_size": args.mbs, "stages": [[0, args.blocks + 2]], "memory": memory,
            "pipelines": [{"microbatches": per, "replicas": [r]} for r in replicas]}


def _step_times(metrics: Path) -> list[float]:
    return [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines() if '"step_time_s"' in line]


def _sailor_times(args, tmp: Path, name: str, memory: list[dict]) -> list[float]:
    """Step times of `sailor train` on 2 data-parallel pipelines of the whole model on this machine,
    stage memory options `memory`."""
    from sailor.runtime.launcher import ExitStatus, launch
    from sailor.runtime.prepare import TrainOptions, prepare

    plan = tmp / f"{name}.json"
    rep = {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}
    plan.write_text(json.dumps({**_dp_plan(args, memory, (rep, rep)), "job": _job(args)}))
    metrics = tmp / f"{name}.jsonl"
    result = launch(prepare(TrainOptions(plan=str(plan), steps=args.steps, metrics=str(metrics))), handle_signals=False)
    assert result.status is ExitStatus.DONE, result.message
    return _step_times(metrics)


def _torch_times(args, mode: str) -> list[float]:
    """Step times of rank 0 of torch's `mode` (ddp or fsdp2, `torch_reference`) on 2 CPU ranks."""
    return torch_reference.run(mode, _model(args), gbs=args.gbs, mbs=args.mbs, seq=args.seq, steps=args.steps)["times"]


def local_runs(args, tmp: Path) -> dict:
    """The four sides on this machine (loopback): name -> callable giving a run's step times."""
    return {"sailor": lambda: _sailor_times(args, tmp, "dp", []), "DDP": lambda: _torch_times(args, "ddp"),
            "sailor ZeRO-3": lambda: _sailor_times(args, tmp, "zero3", [{"zero": 3}]),
            "FSDP2": lambda: _torch_times(args, "fsdp2")}


# ---- on the testbed ----------------------------------------------------------------------------------
def builtin_testbed(mbit: float = LINK_MBIT, cores: float = RANK_CORES):
    """The testbed `--testbed` brings up without a file: nodes a and b, one rank each of one device
    class (`cores` per rank; it stands for an A100-40 in the cluster spec), in zones us-central1-a
    and us-central1-b, so the ranks' traffic crosses the cross-zone link at `mbit` Mbit/s; NICs and
    the other link classes at FAST_MBIT."""
    from sailor.testbed.spec import parse_testbed

    node = {"region": "us-central1", "device": "rank", "ranks": 1, "nic_mbit_per_s": FAST_MBIT}
    return parse_testbed({"name": "overhead", "devices": {"rank": {"gpu": "A100-40", "cpu_quota": cores}},
                          "links": {"same_zone_mbit_per_s": FAST_MBIT, "cross_zone_mbit_per_s": mbit,
                                    "cross_region_mbit_per_s": FAST_MBIT},
                          "nodes": [{"name": "a", "zone": "us-central1-a", **node},
                                    {"name": "b", "zone": "us-central1-b", **node}]}, "the built-in testbed")


def testbed_pair(spec, source: str = "the built-in testbed"):
    """(node, node, Mbit/s between them) of the testbed `spec`: its first two nodes, which hold the two
    ranks of either side, and the rate one flow between them reaches, min(their link class, both
    NICs) (README, the testbed's links).

    Raises:
        SailorInputError: naming `source` and field nodes, when `spec` has fewer than two nodes or
            either of the first two holds more than one rank (two replicas on one node would talk
            over its loopback, not the link).
    """
    from sailor.core.errors import SailorInputError

    if len(spec.nodes) < 2 or spec.nodes[0].ranks != 1 or spec.nodes[1].ranks != 1:
        raise SailorInputError("the two ranks of each side run on the first two nodes, which must hold one rank each",
                               source=source, field="nodes", fix="list two nodes of ranks: 1 first")
    a, b = spec.nodes[:2]
    return a, b, min(spec.links.mbit_per_s(spec.link_between(a, b)), a.nic_mbit_per_s, b.nic_mbit_per_s)


def testbed_runs(args, tmp: Path, spec, state) -> tuple[dict, dict[str, list[int]]]:
    """The four sides on the live testbed `state` (of `spec`), one rank on each of `testbed_pair`'s
    nodes: sailor through `sailor launch --backend torchrun` and torch through one torchrun agent
    per node, both over the testbed's stand-in ssh; (name -> callable giving a run's step times,
    name -> bytes the first node's veth counted during each run so far, both directions)."""
    from testbed import launch_plan, link_bytes  # benchmarks/testbed.py

    a, b, _ = testbed_pair(spec)
    places = tuple({"stage": 0, "gpu": spec.devices[n.device].gpu, "zone": n.zone, "tp": 1} for n in (a, b))
    job = tmp / "job.json"
    job.write_text(json.dumps(_job(args)))
    hosts = [state.node(n.name).address for n in (a, b)]
    timeout_s = 600 + 60 * args.steps  # a hang, not a slow step: a ZeRO-3 step took 37 s at load 17
    moved: dict[str, list[int]] = {}

    def sailor(name: str, memory: list[dict]) -> list[float]:
        plan, metrics = tmp / f"{name}.json", tmp / f"{name}.jsonl"
        plan.write_text(json.dumps(_dp_plan(args, memory, places)))
        metrics.unlink(missing_ok=True)
        launch_plan(state, plan, job, args.steps, metrics, tmp / f"{name}.log", timeout_s=timeout_s)
        return _step_times(metrics)

    def torch(mode: str) -> list[float]:
        return torch_reference.run(mode, _model(args), gbs=args.gbs, mbs=args.mbs, seq=args.seq, steps=args.steps,
                                   nproc=1, hosts=hosts, ssh=str(state.bin_dir / "ssh"), log=tmp / f"{mode}.log",
                                   timeout_s=timeout_s)["times"]

    def counted(name: str, run):
        def counted_run() -> list[float]:
            before = link_bytes(state, a.name)
            times = run()
            moved.setdefault(name, []).append(link_bytes(state, a.name) - before)
            return times
        return counted_run

    return {"sailor": counted("sailor", lambda: sailor("dp", [])), "DDP": counted("DDP", lambda: torch("ddp")),
            "sailor ZeRO-3": counted("sailor ZeRO-3", lambda: sailor("zero3", [{"zero": 3}])),
            "FSDP2": counted("FSDP2", lambda: torch("fsdp2"))}, moved


def load_spec(testbed: str | None):
    """(spec, source) of `--testbed`: None without it, the built-in testbed for an empty value, else
    the file; checked for two nodes of one rank each (`testbed_pair`) and for this machine's cores.

    Raises:
        SailorInputError: naming the file and field.
    """
    if testbed is None:
        return None, None
    from sailor.testbed import load_testbed
    from sailor.testbed.host import check_cores

    spec, source = (load_testbed(testbed), testbed) if testbed else (builtin_testbed(), "the built-in testbed")
    testbed_pair(spec, source)
    check_cores(spec, source)
    return spec, source


def alternate(args, pair: tuple[str, str], runs: dict) -> tuple[dict[str, float], list[float]]:
    """({name: median tokens/s}, [ratio first/second per repeat]) of the pair `pair` (names of
    `runs`: name -> callable giving step times), run alternately `args.repeats` times (module
    docstring)."""
    tokens, tps, ratios = args.gbs * args.seq, {name: [] for name in pair}, []
    for r in range(args.repeats):
        for name in pair if r % 2 == 0 else reversed(pair):
            tps[name].append(_throughput(runs[name](), args.warmup, tokens))
        ratios.append(tps[pair[0]][-1] / tps[pair[1]][-1])
    return {name: statistics.median(v) for name, v in tps.items()}, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 30; on the testbed 12)")
    ap.add_argument("--warmup", type=int, default=None, help="first steps not timed (default 5; on the testbed 2)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating (median)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--boundary-steps", type=int, default=2, help="steps of the boundary run (0: skip it)")
    ap.add_argument("--no-zero3", action="store_true", help="skip the ZeRO-3 / FSDP2 pair")
    ap.add_argument("--testbed", nargs="?", const="", default=None, metavar="SPEC.yaml",
                    help="run both sides across the nodes of a testbed (`sailor testbed`, root): this file's first two"
                         f" nodes, or without one the built-in pair joined by a {LINK_MBIT:g} Mbit/s cross-zone link")
    args = ap.parse_args()
    on_testbed = args.testbed is not None
    args.steps = args.steps if args.steps is not None else 12 if on_testbed else 30
    args.warmup = args.warmup if args.warmup is not None else 2 if on_testbed else 5
    from sailor.core.errors import SailorInputError

    try:  # bad input: one line, exit status 2, before anything starts
        spec, source = load_spec(args.testbed)
    except SailorInputError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        raise SystemExit(2) from None

    load = [os.getloadavg()[0]]
    moved: dict[str, list[int]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sailor-overhead-")))
        if spec is None:
            runs = local_runs(args, tmp)
        else:
            from testbed import live_testbed  # benchmarks/testbed.py

            _, state = stack.enter_context(live_testbed(spec, tmp))
            runs, moved = testbed_runs(args, tmp, spec, state)
        tps, ratios = alternate(args, ("sailor", "DDP"), runs)
        zero3_ratios = []
        if not args.no_zero3:
            more, zero3_ratios = alternate(args, ("sailor ZeRO-3", "FSDP2"), runs)
            tps |= more
        bound = boundary_ratios(args, tmp) if args.boundary_steps > 0 else (None, None)
    load.append(os.getloadavg()[0])
    ratio = statistics.median(ratios)
    zero3_ratio = statistics.median(zero3_ratios) if zero3_ratios else None
    where, link_mbit, testbed = "this machine's loopback", None, None
    if spec is not None:
        a, b, link_mbit = testbed_pair(spec, source)
        testbed = {"file": args.testbed or None, "nodes": [a.name, b.name], "zones": [a.zone, b.zone],
                   "link": spec.link_between(a, b).value, "rank_cores": [spec.devices[n.device].cpu_quota for n in (a, b)]}
        where = (f"testbed {spec.name}: nodes {a.name} ({a.zone}) and {b.name} ({b.zone}), one rank each,"
                 f" {testbed['link']} link {link_mbit:g} Mbit/s")
    per_run = {name: statistics.median(v) for name, v in moved.items()} or None
    per_step = {name: v / args.steps for name, v in per_run.items()} if per_run else None
    print(f"model: {args.blocks} blocks, hidden {args.hidden}; global batch {args.gbs}, micro-batch {args.mbs},"
          f" sequence {args.seq}; 2 pipelines x TP 1 (gloo, CPU) on {where}; {args.steps - args.warmup} timed steps"
          f" of {args.steps}, {args.repeats} alternating runs per side; load {load[0]:.1f} -> {load[1]:.1f}")
    print(f"{'runtime':<16}{'tokens/s':>12}" + (f"{'link MB/step':>14}" if per_step else ""))
    for name, value in tps.items():
        print(f"{name:<16}{value:>12,.0f}" + (f"{per_step[name] / 1e6:>14.1f}" if per_step else ""))
    print(f"ratio sailor / DDP: {ratio:.3f} (target >= 1.0)")
    if zero3_ratio is not None:
        print(f"ratio sailor ZeRO-3 / FSDP2: {zero3_ratio:.3f} (target >= 0.95)")
    if bound[0] is not None:
        print(f"TP 2 -> TP 1 boundary, bytes per micro-batch / activation: {bound[0]:.3f} forward, "
              f"{bound[1]:.3f} backward (target <= 1.05)")
    print(json.dumps({"sailor_tokens_per_s": tps["sailor"], "ddp_tokens_per_s": tps["DDP"], "ratio": ratio,
                      "zero3_tokens_per_s": tps.get("sailor ZeRO-3"), "fsdp2_tokens_per_s": tps.get("FSDP2"),
                      "zero3_ratio": zero3_ratio,
                      "ratio_runs": ratios, "zero3_ratio_runs": zero3_ratios,
                      "boundary_bytes_over_activation": bound[0], "boundary_gradient_bytes_over_activation": bound[1],
                      "testbed": testbed, "link_mbit": link_mbit, "link_bytes": per_run, "link_bytes_per_step": per_step,
                      "link_bytes_runs": moved or None,
                      "steps_timed": args.steps - args.warmup, "repeats": args.repeats, "global_batch": args.gbs,
                      "micro_batch": args.mbs, "seq": args.seq, "hidden": args.hidden, "blocks": args.blocks,
                      "load": load}))


if __name__ == "__main__":
    main()
