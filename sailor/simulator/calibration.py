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
- `allreduce_efficiency` (dimensionless): fraction of the p2p link bandwidth (the NCCL send/recv
  fits) that the gradient all-reduces reach (reduction kernels, chunking, the t concurrent rings of a
  node's TP ranks, DeepSpeed's flatten/unflatten around them).
- `compute_factor` (dimensionless): a training run's per-stage compute time (the runtime's
  forward_s + backward_s per micro-batch, waits excluded) over the sum of the profiled layer times
  of that stage; multiplies measured layer times. 1 on GPUs (profiling and training run the same
  kernels). On local CPU processes it is ~2: the profiler times one layer at a time with its weights
  and inputs hot in cache, while a run's ranks interleave whole stages, their p2p copies and the
  loss on shared cores and caches (and, on the shared build machines, other jobs' processes).
The catalog holds a default `framework_bytes` per GPU type; a GPU type with no entry here uses it,
no reserve, no profiler gap and efficiency 1. `sailor validate DIR --fit` refits these on a folder of measured runs (`fit_memory`
below: linear least squares on relative error) and `leave_one_out` shows how they generalise.
"""

from __future__ import annotations

import numpy as np

# gpu -> constant -> value. Units: framework_bytes in bytes, reserve_fraction dimensionless.
#
# GH200-96: fitted by `sailor validate ../shared/reference/sailor/validation/gh200-opt350 --fit`
# (sailor.validate.fit_calibration) on the 15 measured OPT-350 runs of the public Sailor artifact
# (Alps Clariden, 4 GH200 per node), profiles and network fits from ../shared/reference/sailor/
# {profiles,network}. Memory: linear least squares on relative error of the most-loaded GPU's
# nvidia-smi peak. Time: least squared relative error of iteration time over the grids in
# sailor.validate. Leave-one-out errors are reported by the same command.
CALIBRATION: dict[str, dict[str, float]] = {
    "GH200-96": {
        "framework_bytes": 4.638e9,  # 4.3 GiB: CUDA 12 context + kernels, NCCL buffers of ~6 groups
        "reserve_fraction": 0.107,  # caching allocator: 10.7 % of the transient tensors
        "profile_overhead_s": 125e-6,  # 125 µs per profiled layer pass
        "allreduce_efficiency": 0.175,  # ring all-reduce at 17.5 % of send/recv bandwidth
    },
    # cpu (local gloo processes, 2-vCPU build machine): `compute_factor` fitted by `fit_compute_factor`
    # (median over stages) on the 2-process runs of benchmarks/closed_loop.py (tiny model, global
    # batch 64, micro-batch 4; plans dp2, pp2, pp2_uneven, dp2_shares; 3 runs, 15 stage ratios from
    # 1.4 to 5.3, median 2.3), profiles by `sailor profile` taken before the runs.
    "cpu": {
        "compute_factor": 2.3,
    },
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
    weights + gradients + optimizer states and transient = activations + buffers. Solved as linear
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


def fit_compute_factor(measured_stage_s: np.ndarray, profiled_stage_s: np.ndarray) -> float:
    """Fit `compute_factor` of one GPU type: the median over stages of measured / profiled compute.

    Args:
        measured_stage_s: arrays (stages,), a run's forward + backward seconds per micro-batch of each
            stage (the runtime's metrics, waits excluded).
        profiled_stage_s: arrays (stages,), the profiled layer times of the same stages, summed.
    Returns:
        The factor (dimensionless); the median, so one disturbed stage does not move it.
    """
    meas, prof = np.asarray(measured_stage_s, dtype=float), np.asarray(profiled_stage_s, dtype=float)
    assert meas.shape == prof.shape and meas.size >= 1 and np.all(prof > 0)
    return float(np.median(meas / prof))
