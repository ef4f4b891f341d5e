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

    python benchmarks/runtime_overhead.py [--steps 30] [--repeats 3] [--hidden 128] [--blocks 4] [--seq 64]
        [--boundary-steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_reference  # noqa: E402  (benchmarks/torch_reference.py)


def _model(args) -> dict:
    return {"name": "bench", "num_blocks": args.blocks, "hidden_size": args.hidden, "num_heads": args.heads,
            "vocab_size": 256, "max_sequence_length": args.seq}


def _throughput(times: list[float], warmup: int, tokens_per_step: int) -> float:
    timed = times[warmup:]
    return tokens_per_step * len(timed) / sum(timed)


def boundary_ratios(args, tmp: Path) -> tuple[float, float]:
    """(activation, gradient) bytes crossing the TP-2 -> TP-1 boundary per micro-batch over one
    activation, worst step, from a short 3-rank `sailor train` run (module docstring)."""
    from sailor.runtime.launcher import ExitStatus, TrainOptions, launch, prepare
    from sailor.specs.job import JobSpec

    job = {"model": _model(args), "global_batch_size": args.gbs, "sequence_length": args.seq}
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


def _sailor_times(args, tmp: Path, name: str, memory: list[dict]) -> list[float]:
    """Step times of `sailor train` on 2 data-parallel pipelines of the whole model, stage memory
    options `memory`."""
    from sailor.runtime.launcher import ExitStatus, TrainOptions, launch, prepare

    plan = tmp / f"{name}.json"
    rep = {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}
    per = args.gbs // args.mbs // 2
    plan.write_text(json.dumps({
        "micro_batch_size": args.mbs, "stages": [[0, args.blocks + 2]], "memory": memory,
        "pipelines": [{"microbatches": per, "replicas": [rep]}, {"microbatches": per, "replicas": [rep]}],
        "job": {"model": _model(args), "global_batch_size": args.gbs, "sequence_length": args.seq}}))
    metrics = tmp / f"{name}.jsonl"
    result = launch(prepare(TrainOptions(plan=str(plan), steps=args.steps, metrics=str(metrics))), handle_signals=False)
    assert result.status is ExitStatus.DONE, result.message
    return [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()]


def _torch_times(args, mode: str) -> list[float]:
    """Step times of rank 0 of torch's `mode` (ddp or fsdp2, `torch_reference`) on 2 CPU ranks."""
    return torch_reference.run(mode, _model(args), gbs=args.gbs, mbs=args.mbs, seq=args.seq, steps=args.steps)["times"]


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
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating (median)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--boundary-steps", type=int, default=2, help="steps of the boundary run (0: skip it)")
    ap.add_argument("--no-zero3", action="store_true", help="skip the ZeRO-3 / FSDP2 pair")
    args = ap.parse_args()

    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"sailor": lambda: _sailor_times(args, Path(tmp), "dp", []),
                "DDP": lambda: _torch_times(args, "ddp"),
                "sailor ZeRO-3": lambda: _sailor_times(args, Path(tmp), "zero3", [{"zero": 3}]),
                "FSDP2": lambda: _torch_times(args, "fsdp2")}
        tps, ratios = alternate(args, ("sailor", "DDP"), runs)
        zero3_ratios = []
        if not args.no_zero3:
            more, zero3_ratios = alternate(args, ("sailor ZeRO-3", "FSDP2"), runs)
            tps |= more
        bound = boundary_ratios(args, Path(tmp)) if args.boundary_steps > 0 else (None, None)
    load.append(os.getloadavg()[0])
    ratio = statistics.median(ratios)
    zero3_ratio = statistics.median(zero3_ratios) if zero3_ratios else None
    print(f"model: {args.blocks} blocks, hidden {args.hidden}; global batch {args.gbs}, micro-batch {args.mbs},"
          f" sequence {args.seq}; 2 pipelines x TP 1 (gloo, CPU); {args.steps - args.warmup} timed steps,"
          f" {args.repeats} alternating runs per side; load {load[0]:.1f} -> {load[1]:.1f}")
    print(f"{'runtime':<16}{'tokens/s':>12}")
    for name, value in tps.items():
        print(f"{name:<16}{value:>12,.0f}")
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
                      "steps_timed": args.steps - args.warmup, "repeats": args.repeats, "global_batch": args.gbs,
                      "micro_batch": args.mbs, "seq": args.seq, "hidden": args.hidden, "blocks": args.blocks,
                      "load": load}))


if __name__ == "__main__":
    main()
