"""Per-GPU-type constants fitted once on measured runs (never per run).

Each constant is physical and the same for every run on that GPU type:
- `framework_bytes` (bytes): memory `nvidia-smi` counts beyond the tensors: CUDA context and
  loaded kernels, cuBLAS workspaces, NCCL communicator buffers (Megatron-DeepSpeed opens TP, PP, DP,
  embedding and model-parallel groups).
- `reserve_fraction` (dimensionless): memory the PyTorch caching allocator keeps reserved beyond the
  transient tensors it hands out (activations, p2p buffers, logits), as a fraction of them: block
  rounding and freed-but-cached segments.
- `profile_overhead_s` (s): the launch-and-synchronise gap a per-layer profiler adds to every
  measured layer forward and backward, which an asynchronous training run hides; subtracted from
  measured layer times only.
- `p2p_overhead_s` (s): fixed cost of one pipeline transfer (an activation or a gradient across a
  stage boundary) beyond its bytes on the link fit: work that does not scale with the bytes, on the
  compute stream where nothing hides it (NCCL launch and completion of a blocking send/recv,
  DeepSpeed's host-side dispatch and receive-buffer handling; with TP, its partitioned transfers add
  a metadata message and a gather over the TP group). Added to every boundary transfer.
- `allreduce_efficiency` (dimensionless): fraction of the point-to-point link bandwidth (the NCCL
  send/recv fits, or an α–β link) that a gradient all-reduce reaches. It scales the bandwidth term
  of the ring and hierarchical models of `simulator.collectives` (whose shape, 2(D-1)/D of the data
  per flow plus 2(D-1) hop latencies, comes from the algorithm, not from a fit): reduction kernels,
  the NCCL channels an all-reduce uses against the many a p2p sweep fills, the framework's
  flatten / divide / unflatten copies around the call (DeepSpeed's `allreduce_bucket`). A property
  of the GPU type's software stack and links, the same for every model and every D.
The catalog holds a default `framework_bytes` per GPU type (gpus.yaml, with its source); a GPU type
with no entry here uses it, no reserve, no profiler gap, no p2p overhead and efficiency 1. `sailor
validate DIR --fit` refits these on a folder of measured runs (`fit_memory` below: linear least
squares on relative error; time constants: `sailor.simulator.fidelity.TIME_CONSTANTS`) and reports
leave-one-out errors.
"""

from __future__ import annotations

import numpy as np

# gpu -> constant -> value. Units: framework_bytes in bytes, reserve_fraction dimensionless.
#
# GH200-96: fitted by `sailor validate ../shared/reference/sailor/validation/gh200-opt350 --fit`
# (sailor.simulator.fidelity.validate_sets with fit=True) on the 15 measured OPT-350 runs of the public Sailor artifact
# (Alps Clariden, 4 GH200 per node) and on nothing else: the GPT-Neo-2.7B runs of the same cluster
# (validation/gh200-gptneo) are predicted with these constants, never fitted. Profiles and network
# fits from ../shared/reference/sailor/{profiles,network}. Memory: linear least squares on relative
# error of the most-loaded GPU's nvidia-smi peak. Time: bounded least squares on the relative error of
# iteration time (sailor.simulator.fidelity._fit_time). Which runs pin what: profile_overhead_s the
# micro-batch-1 runs against their profile (N1_D1_M4_G1/G32: 71 ms per micro-batch measured vs 82.5 ms
# profiled over 52 layer passes) with the micro-batch-8 ones; p2p_overhead_s the 4-stage runs (3
# boundaries, a middle stage pays 4 transfers per micro-batch); allreduce_efficiency the runs with
# D = 2..32 replicas (90 M fp32 parameters per GPU at one stage, 363 MB, all-reduced in ~0.15 s where
# the NCCL send/recv fits at 23 GB/s per GPU would take ~0.03 s). See README "Measured results".
CALIBRATION: dict[str, dict[str, float]] = {
    "GH200-96": {
        "framework_bytes": 4.400e9,  # 4.1 GiB: CUDA 12 context + kernels, NCCL buffers of ~6 groups
        "reserve_fraction": 0.1075,  # caching allocator: 10.75 % of the transient tensors
        "profile_overhead_s": 172e-6,  # 172 µs per profiled layer pass (forward or backward)
        "p2p_overhead_s": 513e-6,  # 0.51 ms per pipeline transfer on top of its bytes
        "allreduce_efficiency": 0.150,  # gradient all-reduces reach 15 % of the p2p link bandwidth
    },
    # cpu: no constants. `sailor profile` times the layers as a run executes them (1 thread per
    # process, ranks in their own sessions as torchrun starts them, every core busy, the per-pass
    # overhead removed by `sailor.runtime.profiler.pass_scale`, the runtime's per-micro-batch overhead
    # and fixed cost per stage pass measured), and benchmarks/closed_loop.py compares runs with that
    # profile directly.
}


def default_calibration() -> dict[str, dict[str, float]]:
    """A copy of the fitted constants (callers may modify their copy)."""
    return {g: dict(v) for g, v in CALIBRATION.items()}


def gpu_constant(calibration: dict[str, dict[str, float]], gpu: str, name: str, default: float) -> float:
    """Calibrated constant `name` of GPU type `gpu`, else `default`."""
    return float(calibration.get(gpu, {}).get(name, default))


def fit_memory(fixed_bytes: np.ndarray, transient_bytes: np.ndarray, measured_bytes: np.ndarray) -> dict[str, float]:
    """Fit `framework_bytes` F and `reserve_fraction` r of one GPU type from measured peak memory.

    Model per run k (its most-loaded GPU): measured_k = fixed_k + (1 + r)·transient_k + F, with fixed =
    weights + gradients + optimizer states + the gradient sync buffer and transient = activations +
    buffers (`MemoryBreakdown.persistent`, `.transient`). Solved as linear
    least squares on relative error (each row divided by measured_k), so small and large runs count
    alike. r is clipped at 0 (a reserve is never negative) and F refitted alone in that case.

    Args:
        fixed_bytes, transient_bytes, measured_bytes: arrays (runs,), bytes.
    Returns:
        {"framework_bytes": F, "reserve_fraction": r}.
    """
    fixed, trans, meas = (np.asarray(x, dtype=float) for x in (fixed_bytes, transient_bytes, measured_bytes))
    assert fixed.shape == trans.shape == meas.shape and fixed.size >= 1
    y = (meas - fixed - trans) / meas
    if fixed.size >= 2:
        A = np.stack([trans / meas, 1.0 / meas], axis=1)
        (r, F), *_ = np.linalg.lstsq(A, y, rcond=None)
    else:
        r, F = 0.0, 0.0
    if fixed.size < 2 or r < 0:
        r = 0.0
        F = float(np.sum(y * meas / meas**2) / np.sum(1.0 / meas**2))
    return {"framework_bytes": float(F), "reserve_fraction": float(r)}
