"""`sailor profile`: time the runtime's own layers on this machine and write a profile file.

What is measured, for every TP degree t (with t processes, gloo on CPU / NCCL on CUDA) and every
micro-batch size b:
- forward and backward seconds of the runtime's embedding (layer 0), one block (layers 1..N all share
  its geometry, so one block is timed and its figures stand for every block; a mixture of experts
  mixing dense and MoE blocks times one of each, `layer_kinds`) and the head (final
  norm, LM head and the loss, which the runtime's last stage computes inside its forward);
- on CPU also the whole model as a run trains it: the runtime's own `run_pipeline` over
  RUNTIME_MICROBATCHES micro-batches of a one-stage replica (`_time_pipeline`), its phase timers
  giving the whole model's forward and backward per micro-batch. Every layer time is scaled by that
  whole pass over the sum of the separate ones (`pass_scale`, recorded under settings.pass_scale):
  a stage of a run pays the per-pass overhead once per micro-batch, not once per layer, and a TP
  replica's ranks meet only in the model's all-reduces, never in a barrier per pass. The call's wall
  time outside its phases (the 1F1B loop's bookkeeping) is the runtime's per-micro-batch overhead,
  `runtime.microbatch_overhead_s`, which the simulator adds to every stage's micro-batch. The
  separate layers are timed with their all-reduces, every rank starting together after a barrier, and the
  slowest rank's time kept (the others wait for it in a real run too);
- `warmup` untimed passes, then `repeats` timed ones: the median is the profile, the interquartile
  range its spread (`forward_spread_s`, `backward_spread_s`);
- the backward split as zero-bubble schedules run it (`_time_backward_split`): the input-gradient pass
  (`torch.autograd.grad` w.r.t. the layer's input, keeping the graph and the gradients reaching the
  weights' matmuls) and then the weight-gradient pass (`torch.autograd.grad` w.r.t. the weights from
  those gradients), each timed on its own with `torch.distributed.pipelining`'s `stage_backward_input`
  / `stage_backward_weight` (`backward_input_s`, `backward_weight_s`), in the same repeats as the
  forward and backward, so a drifting load moves all of them alike; on CPU each is scaled by the
  whole model's pass of its kind in the runtime's own `run_pipeline` under ZB-H1 (`layer_row`), as
  the forward and backward are by the 1F1B run. The embedding has no input gradient (its input is
  token ids): its whole backward is the weight pass;
- activation bytes kept for backward per sample and layer (a saved-tensors hook sums the distinct
  tensors autograd keeps, parameters excluded), and the peak bytes allocated (CUDA) or the peak
  resident set of the process (CPU);
- the optimizer step as a training step runs it: `ShardedAdamW`'s norm clipping and AdamW update
  over the rank's TP shard of one block (`_optimizer_s_per_param`), at the first TP degree profiled,
  stored as seconds per parameter.

On CUDA the program is the runtime's: weights and activations in the compute dtype (bf16 for a bf16
job; no autocast), every span timed with CUDA events (`runtime.timing.Stopwatch`) after the ranks
met in a barrier, statistics all-reduced as tensors on the group's device (NCCL reduces CUDA tensors
only), and each rank's device chosen and checked by `runtime.device.rank_device`.

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
import queue as _queue
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_PROFILE_MBS, MAX_PROFILE_PASSES, max_local_processes
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
    """Timed passes per layer and micro-batch size; the median is kept."""
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_MESSAGE = "SAILOR_RANK "  # prefix of a message line a rank prints for the driver
READER_JOIN_S = 30.0  # how long `run_ranks` waits, once its ranks have exited, for their last lines


def run_ranks(target: str, nprocs: int, args: dict[str, Any], *, on_message: Callable[[Any], None] | None = None,
              timeout_s: float = 600.0, port: int | None = None,
              launch: Callable[[int, list[str]], list[str]] | None = None) -> None:
    """Run `target(rank, world, port, args)` ("module:function") in `nprocs` fresh Python processes
    and wait for them: on this machine (`port` None: a free one), or, with `launch`, each as the
    command `launch(rank, argv)` returns, e.g. over ssh on another machine, where `argv` is what follows
    `python` (the arguments dict then travels as its last argument, not on stdin).

    Each rank is `python -m sailor.runtime.profiler` (no re-import of the caller's main module, so it
    works from scripts, stdin and tests). A rank reports with `rank_message(obj)`; every message is
    handed to `on_message` as it arrives. Raises RuntimeError with the failing rank's last stderr lines
    if any rank fails or `timeout_s` passes; every rank is killed before this returns or raises.
    """
    port = _free_port() if port is None else port
    payload = json.dumps(args)
    msgs: _queue.Queue = _queue.Queue()
    procs, errs, readers = [], [], []
    try:
        for rank in range(nprocs):
            err = tempfile.TemporaryFile(mode="w+")
            errs.append(err)
            # Each rank in its own session, as torchrun starts the ranks of `sailor train`
            # (start_new_session in torch.distributed.elastic's SubprocessHandler). With the kernel's
            # autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled = 1, the default) a
            # session is one CFS group, and two gloo TP ranks sharing one group ran the `tiny` model's
            # TP-2 pass at ~45-50 ms per micro-batch of 4 on the 2-core build machines, against
            # ~30-37 ms in separate sessions (same code, same machine, torchrun's timing): the
            # profile must see the scheduling a run sees.
            argv = ["-m", "sailor.runtime.profiler", target, str(rank), str(nprocs), str(port)]
            p = subprocess.Popen([sys.executable, *argv] if launch is None else launch(rank, [*argv, payload]),
                                 stdin=subprocess.PIPE if launch is None else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            procs.append(p)
            if launch is None:
                p.stdin.write(payload)
                p.stdin.close()
            readers.append(threading.Thread(target=_read_messages, args=(p.stdout, msgs), daemon=True))
            readers[-1].start()
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            _drain(msgs, on_message)
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                raise RuntimeError(f"profiling rank {failed[0]} failed: {_tail(errs[failed[0]])}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"profiling ranks did not finish within {timeout_s:.0f} s")
            time.sleep(0.05)
        for p in procs:
            p.wait()
        for t in readers:  # a rank's last lines may still be in its pipe when it has exited
            t.join(timeout=READER_JOIN_S)
        _drain(msgs, on_message)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"profiling rank {failed[0]} failed: {_tail(errs[failed[0]])}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for e in errs:
            e.close()


def rank_message(obj: Any) -> None:
    """Send `obj` (JSON-able) from a rank to the driver's `on_message`."""
    print(RANK_MESSAGE + json.dumps(obj), flush=True)


def _read_messages(stream, msgs: _queue.Queue) -> None:
    for line in stream:
        if line.startswith(RANK_MESSAGE):
            msgs.put(json.loads(line[len(RANK_MESSAGE):]))


def _tail(err) -> str:
    err.seek(0)
    lines = [line for line in err.read().splitlines() if line.strip()]
    return " | ".join(lines[-3:]) or "no error output"


def _drain(q: _queue.Queue, on_message) -> None:
    while True:
        try:
            msg = q.get_nowait()
        except _queue.Empty:
            return
        if on_message is not None:
            on_message(msg)


def init_rank(rank: int, world: int, port: int, backend: str, timeout_s: float, addr: str = "127.0.0.1") -> None:
    """Join a `world`-process group (rank `rank`, TCP rendezvous on `addr`:`port`, rank 0's machine)."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=_dt.timedelta(seconds=timeout_s))


# ---- one rank ------------------------------------------------------------------------------------
@dataclass
class _LayerResult:
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)


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
    init_rank(rank, world, port, "nccl" if cuda else "gloo", o["timeout_s"])
    tp = o["tp"]
    # TP groups of consecutive ranks; every rank must take part in creating every group.
    groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]
    result = _measure(job, o, rank, tp, groups[rank // tp], world, device)
    if rank == 0:
        Path(o["out"]).write_text(json.dumps(result))
    dist.barrier()  # every rank is past its last collective before any exits


def layer_kinds(spec) -> list[str]:
    """The profiled kind whose figures stand for each layer of `spec`: "embedding", "block" (the
    blocks with the same MLP as block 1), "other block" (in a model mixing dense and MoE blocks,
    those with the other MLP), "head"."""
    first = spec.is_moe_block(1)
    blocks = ["block" if spec.is_moe_block(i) == first else "other block" for i in range(1, spec.num_layers - 1)]
    return ["embedding", *blocks, "head"]


def profiled_layers(spec) -> dict[str, int]:
    """Kind -> the one layer profiled for it (`layer_kinds`): its first layer."""
    out: dict[str, int] = {}
    for i, kind in enumerate(layer_kinds(spec)):
        out.setdefault(kind, i)
    return out


def _build_layer(job: JobSpec, index: int, tp_rank: int, tp: int, group, device, end: int | None = None):
    """Layer `index` (layers [index, end) when `end` is given) of the runtime's GPT, TP-sharded and
    initialised as a training run does."""
    import torch

    from sailor.runtime.model import GPT, init_param, on_meta
    from sailor.runtime.pipeline import build_stage
    from sailor.runtime.tensor_parallel import apply_tp
    from sailor.runtime.worker import materialize

    spec = job.model
    with on_meta():
        stage = GPT(spec)
    build_stage(stage, ((index, index + 1 if end is None else end),))
    apply_tp(stage, tp_rank=tp_rank, tp=tp, group=group)
    materialize(stage, lambda n, s: init_param(n, s, seed=0, num_blocks=spec.num_blocks),
                tp_rank=tp_rank, tp=tp, device=device)
    dtype = profile_dtype(job.precision, device)
    with torch.no_grad():
        for p in stage.parameters():  # the runtime's weights are in the compute dtype (`ShardedAdamW`)
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return stage


def profile_dtype(precision: str, device) -> Any:
    """The weights' and activations' dtype a profile runs in: the runtime's compute dtype, fp32 on
    the CPU and the job's half precision on CUDA."""
    import torch

    if device.type != "cuda":
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def _measure(job: JobSpec, o: dict, rank: int, tp: int, group, world: int, device) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from sailor.runtime.tensor_parallel import head_loss

    spec, seq = job.model, job.seq
    from sailor.runtime.timing import Stopwatch

    cuda = device.type == "cuda"
    dtype = profile_dtype(job.precision, device)  # weights and activations, as the runtime trains
    autocast = _nullcontext  # no autocast: the runtime casts its weights instead
    watch = Stopwatch(device)  # CUDA events on a GPU (`runtime.timing`)
    # kind -> (first layer, end): one layer of each kind.
    kinds = {k: (i, i + 1) for k, i in profiled_layers(spec).items()}
    gen = torch.Generator(device="cpu").manual_seed(1234)
    out: dict[str, Any] = {"times": {}, "split": {}, "runtime_overhead_s": {}, "activation_bytes_per_sample": {},
                           "peak_bytes": 0}

    def finish() -> None:  # wait for this rank's device
        if cuda:
            torch.cuda.synchronize(device)

    def sync() -> None:  # and for every rank
        finish()
        if world > 1:
            dist.barrier()

    for kind, (index, end) in kinds.items():
        layer = _build_layer(job, index, rank % tp, tp, group, device, end)
        for mbs in o["mbs"]:
            tok = torch.randint(0, spec.vocab_size, (mbs, seq), generator=gen).to(device)
            act = torch.randn(mbs, seq, spec.hidden_size, generator=gen).to(device=device, dtype=dtype)

            def forward(layer=layer, tok=tok, act=act, mbs=mbs, kind=kind, inputs=None):  # bound now, not at call time
                if kind == "embedding":
                    return layer(tok)
                x = act.detach().requires_grad_()
                if inputs is not None:
                    inputs.append(x)
                with autocast():
                    y = layer(x)
                return head_loss(layer)(y, tok) * (1.0 / (mbs * seq)) if kind == "head" else y

            res = _LayerResult()
            params = [p for p in layer.parameters() if p.requires_grad]
            split_rows = []
            for r in range(o["warmup"] + o["repeats"]):
                layer.zero_grad(set_to_none=True)
                sync()
                watch.start()
                with autocast():
                    y = forward()
                forward_s = watch.stop()
                grad = None if y.dim() == 0 else torch.ones_like(y)
                sync()
                watch.start()
                torch.autograd.backward(y, grad)
                backward_s = watch.stop()
                # the split passes in the same repeat, so both see the same machine (its load drifts)
                split = _time_backward_split(layer, forward, params, sync, watch)
                if r >= o["warmup"]:
                    res.forward_s.append(forward_s)
                    res.backward_s.append(backward_s)
                    split_rows.append(split)
            # The slowest rank's pass is the replica's (the others wait for it in its all-reduces);
            # collectives on the group's device (NCCL takes CUDA tensors only).
            both = torch.tensor([res.forward_s, res.backward_s], dtype=torch.float64, device=device)
            if world > 1:
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
            out["times"][f"{kind}/{mbs}"] = both.tolist()
            split = torch.tensor(split_rows, dtype=torch.float64, device=device).T.contiguous()
            if world > 1:
                dist.all_reduce(split, op=dist.ReduceOp.MAX)
            out["split"][f"{kind}/{mbs}"] = split.tolist()  # [input-gradient passes, weight-gradient passes]
            if rank == 0:
                rank_message({"tick": 1})
        mbs = max(o["mbs"])
        saved = _saved_bytes(layer, lambda: forward_for(layer, kind, job, mbs, device, autocast))
        out["activation_bytes_per_sample"][kind] = saved / mbs
        del layer
    if o.get("whole_pass"):
        from sailor.plan.orders import ScheduleKind
        from sailor.plan.spec import DEFAULT_SCHEDULE, Schedule

        model = _build_layer(job, 0, rank % tp, tp, group, device, spec.num_layers)
        for mbs in o["mbs"]:
            # (repeats, 4) each: forward, backward (W passes included), W passes, rest per micro-batch
            runs, split = (torch.tensor(_time_pipeline(model, job, o, rank, tp, world, mbs, device, autocast, sync, s),
                                        dtype=torch.float64, device=device)
                           for s in (DEFAULT_SCHEDULE, Schedule(kind=ScheduleKind.ZB_H1)))
            if world > 1:
                dist.all_reduce(runs, op=dist.ReduceOp.MAX)
                dist.all_reduce(split, op=dist.ReduceOp.MAX)
            out["times"][f"model/{mbs}"] = runs[:, :2].T.tolist()
            out["runtime_overhead_s"][str(mbs)] = runs[:, 3].tolist()
            out["split"][f"model/{mbs}"] = [(split[:, 1] - split[:, 2]).tolist(), split[:, 2].tolist()]  # B, W
            if rank == 0:
                rank_message({"tick": 1})
        del model
    per_param = torch.tensor([_optimizer_s_per_param(job, o, rank, tp, world, group, device, sync)],
                             dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(per_param, op=dist.ReduceOp.MAX)
    out["optimizer_s_per_param"] = per_param.item()
    if cuda:
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    else:
        out["peak_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
    return out


def _time_backward_split(layer, forward: Callable[..., Any], params: list, sync: Callable[[], None],
                         watch) -> list[float]:
    """[input_gradient_s, weight_gradient_s] of one backward of `layer` (weights `params`), each
    pass timed alone, every rank starting it together (`sync`) and timed on its device by `watch`
    (`runtime.timing.Stopwatch`), as the forward and backward are: `stage_backward_input` (gradient
    w.r.t. the layer's input; the graph and the gradients flowing into the weights' operations are
    kept) then `stage_backward_weight` (the weights' gradients from those), as a zero-bubble schedule
    runs them. `forward(inputs=list)` runs the layer's forward (loss included for the head) and
    appends its input tensor; the embedding's input is token ids, so its input pass takes 0 s and its
    weight pass is the whole backward."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    layer.zero_grad(set_to_none=True)
    inputs: list = []
    y = forward(inputs=inputs)
    grads = None if y.dim() == 0 else [torch.ones_like(y)]
    sync()
    watch.start()
    if inputs:
        _, groups = stage_backward_input([y], grads, inputs, iter(params))
    input_s = watch.stop() if inputs else 0.0
    sync()
    watch.start()
    if inputs:
        stage_backward_weight(iter(params), groups)
    else:
        torch.autograd.backward(y, None if grads is None else grads[0])
    return [input_s, watch.stop()]


RUNTIME_MICROBATCHES = 8
"""Micro-batches of one timed `run_pipeline` call in the profile: as many as the smallest pipeline of
the closed-loop benchmark's plans (64 samples in micro-batches of 4 over 2 pipelines), so a step's
fixed costs inside `run_pipeline` are spread as in a run."""


def _time_pipeline(model, job: JobSpec, o: dict, rank: int, tp: int, world: int, mbs: int, device, autocast,
                   sync, schedule) -> list[list[float]]:
    """Time the runtime's own training pass: `run_pipeline` in the order of `schedule` (a
    `plan.spec.Schedule` of one chunk: 1F1B, or ZB-H1 and its split backward) over
    RUNTIME_MICROBATCHES micro-batches of `mbs` samples on a one-stage replica holding the whole
    `model` (this rank's TP shard of it).

    Returns one row per timed repeat: [forward_s, backward_s, weight_s, rest_s] per micro-batch,
    where forward, backward (W passes included) and weight (the W passes alone, 0 unless the
    schedule splits the backward) are the runtime's own phase timers (`StageTimes`, what `sailor
    train --metrics` reports per stage) and rest is the call's wall time outside them: the loop's
    Python bookkeeping, input and target slicing, saving and popping micro-batch state, the final
    wait on sends. The replicas of a TP-1 profile run side by side without any collective between them, and
    the ranks of a TP group meet only in the model's own all-reduces: one barrier per call, none
    per pass, as in a training step.
    """
    import torch

    from sailor.plan.spec import Pipeline, Plan, Replica
    from sailor.runtime.executor import NoHooks, StageExecutor
    from sailor.runtime.pipeline import P2P, run_pipeline
    from sailor.runtime.tensor_parallel import head_loss
    from sailor.runtime.topology import derive_topology

    spec, seq, m = job.model, job.seq, RUNTIME_MICROBATCHES
    pipe = Pipeline(microbatches=m, replicas=(Replica(stage=0, gpu=o["gpu"], zone="profile", tp=tp),))
    plan = Plan(micro_batch_size=mbs, stages=((0, spec.num_layers),), pipelines=(pipe,) * (world // tp))
    role = derive_topology(plan).roles[rank]
    assert role.tp_rank == rank % tp and role.num_stages == 1, role
    p2p = P2P(role, shape=(mbs, seq, spec.hidden_size), device=device, timeout=_dt.timedelta(seconds=o["timeout_s"]))
    executor = StageExecutor(model, NoHooks(), first_stage=True)
    gen = torch.Generator(device="cpu").manual_seed(4321)
    tok = torch.randint(0, spec.vocab_size, (m * mbs, seq + 1), generator=gen).to(device)  # (m·mbs, seq + 1)
    rows = []
    for r in range(o["warmup"] + o["repeats"]):
        model.zero_grad(set_to_none=True)  # as the optimizer leaves it at the end of a step
        sync()
        t0 = time.perf_counter()
        with autocast():
            _, times = run_pipeline([executor], role, p2p, order=schedule.order(0, 1, m),
                                    inputs=lambda k: tok[k * mbs:(k + 1) * mbs, :-1],
                                    targets=lambda k: tok[k * mbs:(k + 1) * mbs, 1:], loss_fn=head_loss(model),
                                    loss_scale=1.0 / (m * mbs * seq))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        if r >= o["warmup"]:
            rest = wall - times.forward_s - times.backward_s  # >= 0: the phases lie inside the call
            rows.append([times.forward_s / m, times.backward_s / m, times.weight_s / m, rest / m])
    return rows


def forward_for(layer, kind: str, job: JobSpec, mbs: int, device, autocast):
    """One forward of a profiled layer on fresh inputs (tokens for the embedding, activations else)."""
    import torch

    from sailor.runtime.tensor_parallel import head_loss

    seq, spec = job.seq, job.model
    tok = torch.randint(0, spec.vocab_size, (mbs, seq)).to(device)
    with autocast():
        if kind == "embedding":
            return layer(tok)
        x = torch.randn(mbs, seq, spec.hidden_size, device=device, requires_grad=True)
        y = layer(x)
        return head_loss(layer)(y, tok) if kind == "head" else y


def _saved_bytes(layer, run_forward: Callable[[], Any]) -> float:
    """Bytes of the distinct tensors autograd saves for backward during `run_forward()`, parameters
    excluded (they are counted as weights, not activations)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run_forward()
    del y
    return float(sum(seen.values()))


def _optimizer_s_per_param(job: JobSpec, o: dict, rank: int, tp: int, world: int, group, device, sync) -> float:
    """Seconds per parameter of the runtime's update as a training step runs it: `ShardedAdamW`'s
    global-norm clipping and AdamW step (ZeRO-0, the compute dtype's master and gradient buffers) over
    this rank's TP shard of one block, the layer kind that holds nearly all parameters; the update is
    elementwise, so its time scales with the parameters a rank owns. Only one block is built: timing
    the whole model on one device would not fit a large model's states (issue #32)."""
    import torch

    from sailor.plan.spec import Pipeline, Plan, Replica
    from sailor.runtime.optim import OptimConfig
    from sailor.runtime.timing import Stopwatch
    from sailor.runtime.topology import derive_topology
    from sailor.runtime.zero import ShardedAdamW

    spec = job.model
    layer = _build_layer(job, 1, rank % tp, tp, group, device)
    dtype = profile_dtype(job.precision, device)
    with torch.no_grad():  # ShardedAdamW takes fp32 weights and casts them itself
        for p in layer.parameters():
            p.data = p.data.float()
    params = dict(layer.named_parameters())
    pipe = Pipeline(microbatches=1, replicas=(Replica(stage=0, gpu=o["gpu"], zone="profile", tp=tp),))
    plan = Plan(micro_batch_size=1, stages=((0, spec.num_layers),), pipelines=(pipe,) * (world // tp))
    role = derive_topology(plan).roles[rank]
    cfg = OptimConfig()
    # ZeRO-0 on its own: no collective in the step but the norm's all-reduce over the world (a
    # scalar), as in a training step; `groups` is not used by clip and step.
    opt = ShardedAdamW(params, role, {}, zero=0, sequence_parallel=False, cfg=cfg, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(99)
    watch = Stopwatch(device)
    times = []
    for r in range(2 + o["repeats"]):
        for i, b in enumerate(opt.buckets):
            opt.grad[i] = (torch.randn(b.shard_numel, generator=gen) * 1e-3).to(device)
        sync()
        watch.start()
        opt.clip(cfg.max_grad_norm)
        opt.step()
        if r >= 2:
            times.append(watch.stop())
        else:
            watch.stop()
    n = sum(p.numel() for p in params.values())
    return statistics.median(times) / n


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


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
    """Progress ticks `profile_job` reports: one per (TP degree, layer kind or the whole-model run,
    micro-batch size)."""
    kinds = len(profiled_layers(opts.job.model))
    return len(opts.tps) * (kinds + 1 if whole_pass(opts) else kinds) * len(opts.mbs)


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
              whole: tuple[float, float, float, float] | None) -> tuple[dict[str, list[float]], list[float]]:
    """The times of one (TP, micro-batch) row of the profile (seconds per layer) and the four factors
    that scaled them: [forward, backward, input-gradient, weight-gradient].

    `stats[l]` = (forward, backward, forward spread, backward spread) of layer l timed alone
    (`_stats`), `split[l]` = its input- and weight-gradient passes timed alone
    (`_time_backward_split`), `whole` = the whole model's (forward, backward, input-gradient,
    weight-gradient) seconds per micro-batch inside the runtime's own `run_pipeline`, the first two
    under 1F1B, the last two under ZB-H1 (`_time_pipeline`); None (no whole pass): factors 1.

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
        sf, sb, si, sw = (pass_scale(layers, w) for layers, w in zip((fwd, bwd, bi, bw), whole))
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
    overhead_rows, overhead_by_mbs = [], {}
    with tempfile.TemporaryDirectory(prefix="sailor-profile-") as tmp:
        for tp in sorted(set(opts.tps)):
            path = Path(tmp) / f"tp{tp}.json"
            run_ranks("sailor.runtime.profiler:profile_rank", tp * replicas(opts, tp), {**raw, "tp": tp, "out": str(path)},
                      timeout_s=opts.timeout_s * 4, on_message=(lambda m: progress(m["tick"])) if progress else None)
            res = json.loads(path.read_text())
            for mbs in sorted(set(opts.mbs)):
                stats = {k: _stats(res["times"][f"{k}/{mbs}"]) for k in set(order)}
                split = {k: _stats(res["split"][f"{k}/{mbs}"]) for k in set(order)}
                whole = None
                if whole_pass(opts):
                    fused, zb = _stats(res["times"][f"model/{mbs}"]), _stats(res["split"][f"model/{mbs}"])
                    whole = (fused[0], fused[1], zb[0], zb[1])
                row, scale = layer_row([stats[k] for k in order], [split[k][:2] for k in order], whole)
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
                         # "tp/mbs" -> [forward, backward, input-gradient, weight-gradient] factors
                         # applied to the layer times (`layer_row`; all 1 without a whole pass)
                         "pass_scale": scales,
                         "runtime_microbatches": RUNTIME_MICROBATCHES,
                         # "tp" -> "mbs" -> seconds per micro-batch outside the passes (median per size)
                         "microbatch_overhead_s_by_mbs": overhead_by_mbs},
            "layers": rows, "optimizer": {gpu: {"seconds_per_param": opt_s_per_param}}, "memory": memory,
            **({"runtime": {"microbatch_overhead_s": overhead_rows}} if overhead_rows else {})}


def _stats(both: list[list[float]]) -> tuple[float, float, float, float]:
    """(median forward, median backward, IQR forward, IQR backward) of repeated passes, seconds."""
    import numpy as np
    f, b = np.asarray(both[0]), np.asarray(both[1])
    iqr = lambda a: float(np.percentile(a, 75) - np.percentile(a, 25))  # noqa: E731
    return float(np.median(f)), float(np.median(b)), iqr(f), iqr(b)


def _rank_main(argv: list[str]) -> None:
    """Entry point of one rank: `python -m sailor.runtime.profiler MODULE:FUNCTION RANK WORLD PORT [ARGS]`,
    the function's argument dict as JSON in ARGS, else on stdin."""
    import importlib

    from sailor.core.process import die_with_parent

    die_with_parent()  # never outlive the driver
    target, rank, world, port = argv[:4]
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    fn(int(rank), int(world), int(port), json.loads(argv[4] if len(argv) > 4 else sys.stdin.read()))
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown at exit (see sailor.runtime.worker.main)


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
