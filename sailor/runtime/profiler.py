"""`sailor profile`: time the runtime's own layers on this machine and write a profile file.

The driver checks the options (`check_options`), then for every TP degree t starts t processes for
each replica measured at once (`runtime.ranks.run_ranks`), each running `profile_rank`, which joins
the process group and measures what `runtime.profile_measure` lists: layer forward and backward times
and the split backward, on CPU the whole model's pass in the runtime's `run_pipeline`, activation
bytes, peak memory and the optimizer step. On CPU it also starts 2·t processes that measure the
runtime's fixed cost of one stage pass (`runtime.profile_passes`, `measure_pass_overhead`).
`profile_job` turns their repeats into the profile's rows: medians and interquartile ranges
(`_stats`), layer times scaled by the whole pass (the trimmed mean of its repeats, `whole_stats`)
less its fixed cost (`layer_row`, `pass_scale`),
the runtime's per-micro-batch overhead and its fixed cost per stage pass.

Load: on CPU every profiling process uses `threads` intra-op threads (default 1), as torchrun gives
each rank of a multi-process `sailor train` run (it sets OMP_NUM_THREADS=1), and `concurrency`
replicas are timed at once, in lockstep (default: enough TP groups to give every core a process).
A "cpu GPU" is thus one core while the other cores are busy too, which is what every rank of a
multi-process run sees. Every rank runs in its own session, as torchrun starts them (see
`run_ranks`: the kernel's autogroup scheduler treats a session as one group). On the 2-core build
machines (2 cores, 1 thread per core) the effect of the concurrent replicas is
small: the `tiny` model's whole pass at micro-batch 4 took 2.27 / 4.04 ms (forward / backward) in one
process alone and 2.51 / 4.29 ms in each of two at once. Other jobs on the machine are not modelled:
profile and train on a quiet machine (benchmarks/closed_loop.py waits for one).

The GPU type of the file is named after the device: `cpu`, or the catalog name of the CUDA device
(`device_gpu_type`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_PROFILE_MBS, MAX_PROFILE_PASSES, max_local_processes
from sailor.core.scratch import scratch_dir
from sailor.perf.network import backend_for
from sailor.runtime.profile_measure import (
    RUNTIME_MICROBATCHES,
    layer_kinds,
    measure,
    profiled_layers,
    whole_pass_repeats,
)
from sailor.runtime.profile_passes import MIN_LAYERS, mean_latency_s, p2p_overhead_s, pass_overhead_s, pass_plans
from sailor.runtime.ranks import init_rank, rank_main, run_ranks
from sailor.specs.job import JobSpec

Device = Literal["cpu", "cuda"]

@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """What `profile_job` measures."""

    job: JobSpec
    """Model, sequence length and precision the layers are timed at."""
    device: Device = "cpu"
    """cpu (gloo, fp32) or cuda (NCCL; weights in the job's compute dtype, as the runtime trains)."""
    tps: tuple[int, ...] = (1,)
    """TP degrees; degree t runs t processes."""
    mbs: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes (samples)."""
    warmup: int = 3
    """Untimed passes before timing (allocator, caches, lazy init)."""
    repeats: int = 10
    """Timed passes per layer and micro-batch size; the median is kept (the whole model's pass:
    `profile_measure.WHOLE_PASS_REPEATS` times as many, their trimmed mean, `whole_stats`)."""
    threads: int = 1
    """CPU intra-op threads per process (torchrun's default for multi-process runs)."""
    concurrency: int = 0
    """Replicas measured at once (each a TP group of t processes, all timed in lockstep); 0 = as many
    as fill the CPU cores (cpu) or 1 (cuda). See the module docstring."""
    timeout_s: float = 300.0
    """Seconds any collective may wait before the profile fails."""


def device_gpu_type(device: Device, index: int = 0) -> str:
    """Catalog GPU type of this machine's `device` (`runtime.device.device_gpu_type`: the exact
    driver name and memory band of `sailor.catalog.cuda`)."""
    from sailor.runtime.device import device_gpu_type as exact

    return exact(device, index)


def device_description(device: Device) -> str:
    """Human-readable name of the device measured (CPU model or CUDA device name)."""
    if device == "cuda":
        import torch
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def check_options(opts: ProfileOptions) -> None:
    """Raise SailorInputError for options the runtime could not run: TP degrees that do not divide
    the heads, FFN or vocabulary, non-positive sizes, a precision the device does not train in, or
    more TP processes than CUDA devices."""
    from sailor.runtime.model import runtime_vocab

    m = opts.job.model
    if not opts.tps or not opts.mbs:
        raise SailorInputError("give at least one TP degree and one micro-batch size", field="--tp/--mbs")
    for t in opts.tps:
        if t < 1:
            raise SailorInputError(f"TP degree must be >= 1, got {t}", field="--tp")
        for what, n in (("heads", m.num_heads), ("kv heads", m.kv_heads), ("ffn size", m.ffn),
                        ("vocabulary", runtime_vocab(m))):
            if n % t:
                raise SailorInputError(f"TP {t} does not divide {m.name}'s {what} ({n})", field="--tp")
    if any(b < 1 for b in opts.mbs):
        raise SailorInputError(f"micro-batch sizes must be >= 1, got {list(opts.mbs)}", field="--mbs")
    if any(b > MAX_PROFILE_MBS for b in opts.mbs):
        raise SailorInputError(f"micro-batch sizes must be <= {MAX_PROFILE_MBS}, got {list(opts.mbs)}", field="--mbs")
    lowest = {"--warmup": (opts.warmup, 0), "--repeats": (opts.repeats, 1), "--threads": (opts.threads, 1),
              "--concurrency": (opts.concurrency, 0)}
    highest = {"--warmup": MAX_PROFILE_PASSES, "--repeats": MAX_PROFILE_PASSES, "--threads": 1024}
    for option, (value, lo) in lowest.items():  # the option at fault, alone
        if value < lo:
            raise SailorInputError(f"must be >= {lo}, got {value}", field=option)
        if option in highest and value > highest[option]:
            raise SailorInputError(f"must be <= {highest[option]}, got {value}", field=option)
    if opts.device == "cpu" and max(t * replicas(opts, t) for t in opts.tps) > max_local_processes():
        raise SailorInputError(f"TP x replicas at once would start more processes than this machine can run"
                               f" ({max_local_processes()}, 4 per CPU core)", field="--tp/--concurrency")
    if opts.device == "cpu" and opts.job.precision != "fp32":
        raise SailorInputError(f"the runtime trains in fp32 on cpu, the job says {opts.job.precision}",
                               field="precision", fix="set precision: fp32 in the job")
    if opts.device == "cpu":
        _check_host_memory(opts)
    if opts.device == "cuda":
        import torch
        device_gpu_type("cuda")
        need = max(t * replicas(opts, t) for t in opts.tps)
        if need > torch.cuda.device_count():
            raise SailorInputError(f"the profile needs {need} CUDA devices (TP x replicas at once), this machine"
                                   f" has {torch.cuda.device_count()}", field="--tp")


def _check_host_memory(opts: ProfileOptions) -> None:
    """Refuse a CPU profile whose fp32 weights and gradients alone (8 bytes per parameter) exceed the
    memory this machine has available (`limits.available_memory_bytes`): at TP degree t, each of
    t x `replicas(opts, t)` processes holds 1/t of the whole model (`whole_pass`). Activations and
    the optimizer's moments come on top, so a refused job could never be measured here; without
    the check it swapped or was killed for memory minutes later (mixtral-8x7b: 374 GB per copy).

    Raises:
        SailorInputError: at field `model`.
    """
    from sailor.core.limits import available_memory_bytes

    have = available_memory_bytes()
    params = opts.job.model.total_params()
    copies = max(replicas(opts, t) for t in opts.tps)
    need = copies * params * 8
    if have is not None and need > have:
        raise SailorInputError(f"measuring {opts.job.model.name} ({params / 1e9:.3g}B parameters) on this CPU needs"
                               f" at least {need / 2**30:,.1f} GiB (fp32 weights and gradients of {copies} model"
                               f" cop{'y' if copies == 1 else 'ies'} measured at once), more than the"
                               f" {have / 2**30:,.1f} GiB available", field="model",
                               fix="pass --profiles with a profile measured where the model fits, or a smaller model")


def profile_rank(rank: int, world: int, port: int, o: dict[str, Any]) -> None:
    """One rank of a TP-`world` profile (run by `run_ranks`): times every layer kind at every
    micro-batch size; rank 0 writes the results to `o["out"]` as JSON."""
    import torch
    import torch.distributed as dist

    job = JobSpec.model_validate(o["job"])
    from sailor.runtime.device import rank_device

    cuda = o["device"] == "cuda"
    device = rank_device("cuda", rank) if cuda else torch.device("cpu")  # arch check, current device
    if not cuda:
        torch.set_num_threads(o["threads"])
    init_rank(rank, world, port, backend_for(o["device"]), o["timeout_s"])
    tp = o["tp"]
    # TP groups of consecutive ranks; every rank must take part in creating every group.
    groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]
    result = measure(job, o, rank, tp, groups[rank // tp], world, device)
    if rank == 0:
        Path(o["out"]).write_text(json.dumps(result))
    dist.barrier()  # every rank is past its last collective before any exits


# ---- the driver ----------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    """Library versions recorded in a profile (and in the machine-profile cache key). Sailor's is
    `sailor.core.__version__`, the one place the distribution (`sailor-train`, not `sailor`, which is
    another project's name on the index) takes its version from, so a source checkout run without
    installing records it too."""
    import numpy
    import torch

    from sailor.core import __version__
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "sailor": __version__, "cuda": str(torch.version.cuda)}


def replicas(opts: ProfileOptions, tp: int) -> int:
    """TP groups measured at once for TP degree `tp` (`ProfileOptions.concurrency`)."""
    if opts.concurrency:
        return opts.concurrency
    if opts.device == "cuda":
        return 1
    return max(1, (os.cpu_count() or 1) // tp)


def whole_pass(opts: ProfileOptions) -> bool:
    """Whether the whole model is also timed in one pass (on CPU; see `pass_scale`). On CUDA the whole
    model of a large job need not fit one device, and the per-layer sync gap there is the calibrated
    `profile_overhead_s` instead."""
    return opts.device == "cpu"


def profile_steps(opts: ProfileOptions) -> int:
    """Progress ticks `profile_job` reports: one per (TP degree, layer kind, the whole-model run or
    the fixed cost per stage pass where measured, micro-batch size)."""
    kinds = len(profiled_layers(opts.job.model))
    per_tp = [(kinds + (1 if whole_pass(opts) else 0) + (1 if measures_pass_overhead(opts, t) else 0)) * len(opts.mbs)
              for t in opts.tps]
    return sum(per_tp)


def measures_pass_overhead(opts: ProfileOptions, tp: int) -> bool:
    """Whether the fixed cost of a stage pass is measured at TP `tp` (`runtime.profile_passes`): on
    CPU (with the whole pass it is taken out of), for a model of at least `MIN_LAYERS` layers, when
    this machine can run the 2·`tp` processes of its 2-stage pipeline (`max_local_processes`)."""
    return whole_pass(opts) and opts.job.model.num_layers >= MIN_LAYERS and 2 * tp <= max_local_processes()


def measure_pass_overhead(opts: ProfileOptions, raw: dict[str, Any], tp: int,
                          progress: Callable[[int], None] | None = None
                          ) -> tuple[dict[int, tuple[float, float]], dict[int, tuple[float, float, float]]]:
    """The runtime's fixed costs at TP `tp` (`runtime.profile_passes`: 2·`tp` processes, options `raw`
    as the profile's ranks get them): {micro-batch size: (forward, backward) seconds of one stage
    pass}, each the median over the repeats of `pass_overhead_s`, and {micro-batch size: (seconds
    a run adds to a pipeline transfer, `p2p_overhead_s`; mean latency in a run; mean latency between
    idle ranks, both `mean_latency_s`)}; both {} where not measured (`measures_pass_overhead`). Raises RuntimeError if a
    rank fails."""
    if not measures_pass_overhead(opts, tp):
        return {}, {}
    got: dict[str, Any] = {}
    run_ranks("sailor.runtime.profile_passes:rank_pass_overhead", 2 * tp, raw,
              timeout_s=opts.timeout_s * 4, on_message=got.update)
    if progress:
        progress(len(opts.mbs))
    v = pass_plans(opts.job.model.num_layers, tp=tp, mbs=1, microbatches=RUNTIME_MICROBATCHES, gpu="cpu")[2]
    passes, p2p = {}, {}
    for mbs, rows in got["pass_overhead"].items():  # rows: [1F1B forward, 1F1B backward, interleaved forward, interleaved backward]
        passes[int(mbs)] = tuple(statistics.median(pass_overhead_s(r[d], r[2 + d], v, RUNTIME_MICROBATCHES) for r in rows)
                                 for d in (0, 1))
    for mbs, lat in got["p2p_latency"].items():
        run, idle = lat["run"], lat["idle"]
        p2p[int(mbs)] = (p2p_overhead_s(run, idle), mean_latency_s(run), mean_latency_s(idle))
    return passes, p2p


def pass_scale(layer_s: list[float], whole_s: float) -> float:
    """Factor that turns layers timed one at a time into layers timed inside one pass: the whole
    model's pass over the sum of its layers' separate passes (dimensionless).

    Every separately timed layer carries one pass overhead (a barrier, a Python call and, backward,
    one start of the autograd engine; ~70-90 µs per pass on the 2-core build machines, against
    ~0.6 ms forward of a `tiny` block) that a training stage pays once per micro-batch, not once per
    layer. Scaling each layer by this factor spreads the difference over the layers in proportion to
    their time, so any stage's sum is within a fraction of one pass overhead of its own pass.
    """
    total = float(sum(layer_s))
    assert total > 0 and whole_s > 0, (total, whole_s)
    return whole_s / total


def layer_row(stats: list[tuple[float, float, float, float]], split: list[tuple[float, float]],
              whole: tuple[float, float, float, float] | None,
              fixed: tuple[float, float] = (0.0, 0.0)) -> tuple[dict[str, list[float]], list[float]]:
    """The times of one (TP, micro-batch) row of the profile (seconds per layer) and the four factors
    that scaled them: [forward, backward, input-gradient, weight-gradient].

    `stats[l]` = (forward, backward, forward spread, backward spread) of layer l timed alone
    (`_stats`), `split[l]` = its input- and weight-gradient passes timed alone
    (`_time_backward_split`), `whole` = the whole model's (forward, backward, input-gradient,
    weight-gradient) seconds per micro-batch inside the runtime's own `run_pipeline`, the first two
    under 1F1B, the last two under ZB-H1 (`_time_pipeline`); None (no whole pass): factors 1.
    `fixed`: the runtime's fixed cost of one forward and one backward stage pass
    (`runtime.profile_passes`), which the simulator charges once per chunk pass: the whole pass's
    forward, backward and input-gradient pass (where ZB-H1 charges it) are taken less it before
    scaling, so the layers hold none of it.

    Each kind of pass is scaled by its own whole pass (`pass_scale`): the split passes by the split
    backward as ZB-H1 runs it, never by the fused backward's factor. The two differ on a CPU quota
    (a testbed's device class, `sailor.testbed`): a pass shorter than the quota's CFS period runs at
    the full core's speed when the period's quota is not yet spent, and one throttled period longer
    when it is, so the medians of the short passes timed alone fall on either side by chance (one
    class's profile at 0.3 cores: input plus weight passes 0.38x the backward at micro-batch 1 and
    3.2x at micro-batch 2), while a whole run over several micro-batches meets the quota at its
    average rate.
    """
    sf = sb = si = sw = 1.0
    fwd, bwd = [s[0] for s in stats], [s[1] for s in stats]
    bi, bw = [s[0] for s in split], [s[1] for s in split]
    if whole is not None:
        less = (whole[0] - fixed[0], whole[1] - fixed[1], whole[2] - fixed[1], whole[3])
        sf, sb, si, sw = (pass_scale(layers, w) for layers, w in zip((fwd, bwd, bi, bw), less))
    row = {"forward_s": [x * sf for x in fwd], "backward_s": [x * sb for x in bwd],
           "forward_spread_s": [s[2] * sf for s in stats], "backward_spread_s": [s[3] * sb for s in stats],
           "backward_input_s": [x * si for x in bi], "backward_weight_s": [x * sw for x in bw]}
    return row, [sf, sb, si, sw]


def profile_job(opts: ProfileOptions, *, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Measure the runtime's layers for `opts` (module docstring) and return the profile as a dict in
    our format ("sailor.profiles/1"), ready for `write_json` and `profiles_from_dict`.

    `progress(n)` is called with each batch of n finished measurements (`profile_steps` in all).
    Raises SailorInputError for bad options (`check_options`), RuntimeError if a rank fails.
    """
    check_options(opts)
    gpu = device_gpu_type(opts.device)
    spec = opts.job.model
    order = layer_kinds(spec)  # the profiled kind standing for each layer
    rows, memory = [], []
    opt_s_per_param = None
    raw = {"job": opts.job.to_dict() | {"model": spec.model_dump(mode="json")},
           **{k: v for k, v in asdict(opts).items() if k != "job"}, "whole_pass": whole_pass(opts), "gpu": gpu}
    scales: dict[str, list[float]] = {}
    overhead_rows, overhead_by_mbs, pass_rows, pass_by_mbs, p2p_rows, p2p_by_mbs = [], {}, [], {}, [], {}
    with scratch_dir("sailor-profile-") as tmp:
        for tp in sorted(set(opts.tps)):
            path = Path(tmp) / f"tp{tp}.json"
            run_ranks("sailor.runtime.profiler:profile_rank", tp * replicas(opts, tp), {**raw, "tp": tp, "out": str(path)},
                      timeout_s=opts.timeout_s * 4, on_message=(lambda m: progress(m["tick"])) if progress else None)
            res = json.loads(path.read_text())
            fixed, p2p = measure_pass_overhead(opts, {**raw, "tp": tp}, tp, progress)
            if fixed:
                pass_by_mbs[str(tp)] = {str(b): list(f) for b, f in sorted(fixed.items())}
                pass_rows.append({"gpu": gpu, "tp": tp, **{f"{d}_s": statistics.median(f[i] for f in fixed.values())
                                                          for i, d in enumerate(("forward", "backward"))}})
            if p2p:  # one figure per (GPU type, TP), as the other fixed costs
                p2p_by_mbs[str(tp)] = {str(b): list(x) for b, x in sorted(p2p.items())}
                p2p_rows.append({"gpu": gpu, "tp": tp, "seconds": statistics.median(x[0] for x in p2p.values())})
            for mbs in sorted(set(opts.mbs)):
                stats = {k: _stats(res["times"][f"{k}/{mbs}"]) for k in set(order)}
                split = {k: _stats(res["split"][f"{k}/{mbs}"]) for k in set(order)}
                whole = None
                if whole_pass(opts):
                    fused, zb = whole_stats(res["times"][f"model/{mbs}"]), whole_stats(res["split"][f"model/{mbs}"])
                    whole = (fused[0], fused[1], zb[0], zb[1])
                row, scale = layer_row([stats[k] for k in order], [split[k][:2] for k in order], whole,
                                       fixed.get(mbs, (0.0, 0.0)))
                rows.append({"gpu": gpu, "tp": tp, "mbs": mbs, **row})
                if whole is not None:
                    scales[f"{tp}/{mbs}"] = scale
            if whole_pass(opts):
                # One figure per (GPU type, TP): the bookkeeping does not grow with the micro-batch.
                by_mbs = {mbs: statistics.median(res["runtime_overhead_s"][str(mbs)]) for mbs in sorted(set(opts.mbs))}
                overhead_by_mbs[str(tp)] = {str(b): v for b, v in by_mbs.items()}
                overhead_rows.append({"gpu": gpu, "tp": tp, "seconds": statistics.median(by_mbs.values())})
            act = res["activation_bytes_per_sample"]
            memory.append({"gpu": gpu, "tp": tp, "peak_bytes": res["peak_bytes"],
                           "activation_bytes_per_sample": [act[k] for k in order]})
            if opt_s_per_param is None:
                opt_s_per_param = res["optimizer_s_per_param"]
    return {"schema": "sailor.profiles/1", "model": spec.name, "sequence_length": opts.job.seq,
            "precision": opts.job.precision, "source": f"sailor profile ({gpu})",
            "device": device_description(opts.device), "versions": versions(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "settings": {"warmup": opts.warmup, "repeats": opts.repeats, "threads": opts.threads,
                         "replicas_at_once": {str(t): replicas(opts, t) for t in sorted(set(opts.tps))},
                         "statistic": "median", "spread": "interquartile range",
                         # the whole pass (`pass_scale`): more repeats, their mean (`whole_stats`)
                         "whole_pass": {"repeats": whole_pass_repeats(opts.repeats), "statistic": "mean",
                                        "trimmed_each_end": WHOLE_PASS_TRIM},
                         # "tp/mbs" -> [forward, backward, input-gradient, weight-gradient] factors
                         # applied to the layer times (`layer_row`; all 1 without a whole pass)
                         "pass_scale": scales,
                         "runtime_microbatches": RUNTIME_MICROBATCHES,
                         # "tp" -> "mbs" -> seconds per micro-batch outside the passes (median per size)
                         "microbatch_overhead_s_by_mbs": overhead_by_mbs,
                         # "tp" -> "mbs" -> [forward, backward] seconds of a stage pass's fixed cost
                         "pass_overhead_s_by_mbs": pass_by_mbs,
                         # "tp" -> "mbs" -> [p2p overhead, mean latency in a run, between idle ranks] (s)
                         "p2p_overhead_s_by_mbs": p2p_by_mbs},
            "layers": rows, "optimizer": {gpu: {"seconds_per_param": opt_s_per_param}}, "memory": memory,
            **({"runtime": {"microbatch_overhead_s": overhead_rows,
                            **({"pass_overhead_s": pass_rows} if pass_rows else {}),
                            **({"p2p_overhead_s": p2p_rows} if p2p_rows else {})}} if overhead_rows else {})}


WHOLE_PASS_TRIM = 0.1
"""Share of the whole pass's repeats left out at each end (by their time in both phases) before
the mean, `whole_stats`."""


def whole_stats(both: list[list[float]], trim: float = WHOLE_PASS_TRIM) -> tuple[float, float]:
    """(mean first phase, mean second phase) of the whole pass's repeats
    `both` = [first phase per repeat, second phase per repeat] (forward and backward, or input- and
    weight-gradient passes), seconds, the repeats whose sum of both phases is among the `trim`
    shortest or longest left out of the means.

    The mean, not the median: a run's step is the sum of its passes, and one repeat's time moves
    between its phases by chance far more than their sum does (`profile_measure.WHOLE_PASS_REPEATS`),
    so the two means add up to the mean of the sums, where two medians need not. Trimmed by the sum,
    so a repeat slowed or sped up as a whole (a process starting beside it) is left out of both."""
    import numpy as np
    f, b = np.asarray(both[0]), np.asarray(both[1])
    order = np.argsort(f + b, kind="stable")
    cut = int(len(order) * trim)
    keep = order[cut:len(order) - cut]
    return float(f[keep].mean()), float(b[keep].mean())


def _stats(both: list[list[float]]) -> tuple[float, float, float, float]:
    """(median forward, median backward, IQR forward, IQR backward) of repeated passes, seconds."""
    import numpy as np
    f, b = np.asarray(both[0]), np.asarray(both[1])
    iqr = lambda a: float(np.percentile(a, 75) - np.percentile(a, 25))  # noqa: E731
    return float(np.median(f)), float(np.median(b)), iqr(f), iqr(b)


if __name__ == "__main__":
    rank_main(sys.argv[1:])
