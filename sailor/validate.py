"""Simulator fidelity: predict measured runs and report the errors (`sailor validate`).

A validation folder holds Sailor-format `plan_config*.json` files that carry measurements: `real`
(iteration time, s) and `max_mem` (peak `nvidia-smi memory.used` over ranks, bytes). For each run we
build the job (the folder's model, fp32, the model's full context, the file's `gbs`) and the cluster
(the plan's own zones, with the GPUs per node the plan names), simulate it with the given profiles
and network fits, and compare.

Errors are signed relative errors, (predicted - measured) / measured, in percent. Memory is compared
on the most-loaded GPU (the measurement is a max over ranks). `fit_calibration` fits the per-GPU-type
memory constants of `simulator.calibration` on a set of runs; `leave_one_out` predicts each run with
constants fitted without it, which is the over-fitting guard.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sailor import catalog
from sailor.errors import SailorInputError
from sailor.models import BUILTIN_MODELS, MODEL_ALIASES, canonical_model_name
from sailor.network import NetworkModel, network_for
from sailor.plan import Plan, plan_from_dict
from sailor.profiles import Profiles
from sailor.simulator import make_context, simulate
from sailor.simulator.calibration import default_calibration, fit_memory
from sailor.specs import ClusterSpec, JobSpec

Calibration = dict[str, dict[str, float]]


@dataclass(frozen=True)
class Run:
    """One measured run: its plan, job and cluster, and what was measured (s, bytes)."""

    name: str
    plan: Plan
    job: JobSpec
    cluster: ClusterSpec
    measured_time_s: float
    measured_memory_bytes: float


@dataclass
class RunResult:
    """Prediction vs measurement for one run; errors in percent, signed (predicted - measured)."""

    name: str
    gpu: str
    measured_time_s: float
    predicted_time_s: float
    measured_memory_bytes: float
    predicted_memory_bytes: float
    loo_time_err_pct: float | None = None
    loo_memory_err_pct: float | None = None

    @property
    def time_err_pct(self) -> float:
        return 100.0 * (self.predicted_time_s / self.measured_time_s - 1.0)

    @property
    def memory_err_pct(self) -> float:
        return 100.0 * (self.predicted_memory_bytes / self.measured_memory_bytes - 1.0)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.name, "gpu": self.gpu, "measured_time_s": self.measured_time_s,
                "predicted_time_s": self.predicted_time_s, "time_err_pct": self.time_err_pct,
                "measured_memory_bytes": self.measured_memory_bytes,
                "predicted_memory_bytes": self.predicted_memory_bytes, "memory_err_pct": self.memory_err_pct,
                "loo_time_err_pct": self.loo_time_err_pct, "loo_memory_err_pct": self.loo_memory_err_pct}


@dataclass
class ValidationReport:
    """Per-run results and summary statistics (mean, median, max of absolute percent errors)."""

    results: list[RunResult]
    calibration: Calibration = field(default_factory=dict)

    @staticmethod
    def _stats(errs: list[float]) -> dict[str, float]:
        a = [abs(e) for e in errs]
        return {"mape_pct": statistics.fmean(a), "median_ape_pct": statistics.median(a), "max_ape_pct": max(a)}

    def summary(self) -> dict[str, Any]:
        """The summary object (`--json` adds `rows`)."""
        t = self._stats([r.time_err_pct for r in self.results])
        m = self._stats([r.memory_err_pct for r in self.results])
        out: dict[str, Any] = {
            "runs": len(self.results),
            "time_mape_pct": t["mape_pct"], "time_median_ape_pct": t["median_ape_pct"], "time_max_ape_pct": t["max_ape_pct"],
            "memory_mape_pct": m["mape_pct"], "memory_median_ape_pct": m["median_ape_pct"],
            "memory_max_ape_pct": m["max_ape_pct"],
        }
        if all(r.loo_time_err_pct is not None for r in self.results):
            lt = self._stats([r.loo_time_err_pct for r in self.results])  # type: ignore[misc]
            lm = self._stats([r.loo_memory_err_pct for r in self.results])  # type: ignore[misc]
            out |= {"loo_time_mape_pct": lt["mape_pct"], "loo_time_max_ape_pct": lt["max_ape_pct"],
                    "loo_memory_mape_pct": lm["mape_pct"], "loo_memory_max_ape_pct": lm["max_ape_pct"]}
        out["calibration"] = self.calibration
        return out

    def to_dict(self) -> dict[str, Any]:
        return self.summary() | {"rows": [r.to_dict() for r in self.results]}


# ---- loading ---------------------------------------------------------------------------------
def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def model_from_folder(folder: Path) -> str:
    """The built-in model a folder name mentions (e.g. `gh200-opt350` -> opt-350m): the longest
    model name or alias contained in it. Raises SailorInputError when none or several equally long
    ones match."""
    name = _norm(folder.name)
    hits: dict[str, str] = {}
    for alias in list(BUILTIN_MODELS) + list(MODEL_ALIASES):
        if _norm(alias) and _norm(alias) in name:
            hits[_norm(alias)] = canonical_model_name(alias)
    if not hits:
        raise SailorInputError(f"cannot tell the model from the folder name {folder.name!r}", source=str(folder),
                               fix="pass --model, e.g. --model opt-350m")
    longest = max(len(k) for k in hits)
    models = {v for k, v in hits.items() if len(k) == longest}
    if len(models) > 1:
        raise SailorInputError(f"folder name {folder.name!r} mentions several models: {sorted(models)}",
                               source=str(folder), fix="pass --model")
    return models.pop()


def _gpus_per_node(raw: dict[str, Any], plan: Plan) -> dict[str, int]:
    """GPUs per node per GPU type as the Sailor plan names them (tmp_per_stage[..][0][0][1])."""
    out: dict[str, int] = {}
    for entry in raw.get("pipeline_list", []):
        for stage in entry.get("tmp_per_stage", []):
            for rep in stage:
                try:
                    gpu, per_node, _zone = rep[0][0]
                except (TypeError, ValueError, IndexError):
                    continue
                out[catalog.canonical_gpu(str(gpu))] = int(per_node)
    return out


def load_runs(folder: str | Path, model: str | None = None) -> list[Run]:
    """Every Sailor plan_config in `folder` that carries `real` and `max_mem`, as Runs (sorted by
    name). Raises SailorInputError when the folder is missing or holds no such file."""
    d = Path(folder)
    if not d.is_dir():
        raise SailorInputError("not a folder", source=str(d))
    model_name = canonical_model_name(model) if model else model_from_folder(d)
    runs: list[Run] = []
    for path in sorted(d.glob("*.json")):
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SailorInputError(f"cannot read: {e}", source=str(path)) from None
        if not isinstance(raw, dict) or "pipeline_list" not in raw or "real" not in raw or "max_mem" not in raw:
            continue
        try:
            t, mem = float(raw["real"]), float(raw["max_mem"])
        except (TypeError, ValueError):
            raise SailorInputError("`real` and `max_mem` must be numbers", source=str(path)) from None
        if t <= 0 or mem <= 0:
            raise SailorInputError(f"`real` ({t}) and `max_mem` ({mem}) must be > 0", source=str(path))
        plan = plan_from_dict(raw, str(path))
        job = JobSpec(model=model_name, global_batch_size=plan.global_batch_size, precision="fp32")
        zones: dict[str, dict[str, int]] = {}
        for (zone, gpu), n in plan.gpu_usage().items():
            zones.setdefault(zone, {})[gpu] = n
        cluster = ClusterSpec(provider="gcp", zones=zones, gpus_per_node=_gpus_per_node(raw, plan))
        try:
            plan.check_against(job, cluster)
        except SailorInputError as e:
            raise e.located(source=str(path)) from None
        name = path.stem.removeprefix("plan_config_")
        runs.append(Run(name=name, plan=plan, job=job, cluster=cluster, measured_time_s=t, measured_memory_bytes=mem))
    if not runs:
        raise SailorInputError("holds no plan_config JSON with `real` and `max_mem`", source=str(d))
    return runs


def default_data_paths(folder: str | Path) -> tuple[Path | None, Path | None]:
    """Profiles and network folders next to a Sailor validation folder (DIR/../../profiles and
    DIR/../../network, the layout of the public Sailor data), or None where absent."""
    root = Path(folder).resolve().parent.parent
    prof, net = root / "profiles", root / "network"
    return (prof if (prof / "profiles_tmp.json").exists() else None,
            net if net.is_dir() else None)


# ---- prediction, fitting, leave-one-out -------------------------------------------------------
@dataclass
class _Prepared:
    """A run's simulation pieces that do not depend on the memory constants."""

    run: Run
    gpu: str
    time_s: float
    fixed_bytes: float  # weights + gradients + optimizer of the most-loaded GPU
    transient_bytes: float  # activations + buffers of that GPU
    grid_times_s: dict[tuple[float, float], float]  # (profile gap, all-reduce efficiency) -> iteration s


# Candidate values of the time constants (`simulator.calibration`): the profiler's per-layer gap (s)
# and the all-reduce efficiency. A grid, not a free optimiser: each run is simulated once per point,
# and fitting (and every leave-one-out refit) then only picks the point with least squared error.
PROFILE_GAP_GRID_S = tuple(k * 25e-6 for k in range(0, 13))  # 0 .. 300 µs
ALLREDUCE_EFFICIENCY_GRID = (1.0, 0.8, 0.6, 0.5, 0.4, 0.35, 0.3, 0.25, 0.2, 0.175, 0.15, 0.125, 0.1)


def _prepare(runs: list[Run], profiles: Profiles, network_path: Path | None) -> list[_Prepared]:
    out = []
    for run in runs:
        net: NetworkModel = network_for(run.cluster, network_path)
        # memory constants at zero: the most-loaded GPU is the one with most fixed + transient bytes
        # (both constants add the same framework and scale transients alike for one GPU type)
        zero = {g: {"framework_bytes": 0.0, "reserve_fraction": 0.0} for g in run.cluster.gpu_types()}
        est = simulate(run.plan, make_context(run.job, run.cluster, profiles, net, calibration=zero))
        top = max(est.replicas, key=lambda r: r.memory.total)
        mem = top.memory
        times = {}
        for gap in PROFILE_GAP_GRID_S:
            for eff in ALLREDUCE_EFFICIENCY_GRID:
                cal = {g: {"profile_overhead_s": gap, "allreduce_efficiency": eff} for g in run.cluster.gpu_types()}
                times[(gap, eff)] = simulate(run.plan, make_context(run.job, run.cluster, profiles, net,
                                                                    calibration=cal)).iteration_time_s
        out.append(_Prepared(run=run, gpu=top.gpu, time_s=est.iteration_time_s,
                             fixed_bytes=mem.weights + mem.gradients + mem.optimizer,
                             transient_bytes=mem.activations + mem.buffers, grid_times_s=times))
    return out


def _fit_time(ps: list[_Prepared]) -> dict[str, float]:
    """Grid point with the least sum of squared relative time errors over `ps` (one GPU type)."""
    def sse(key: tuple[float, float]) -> float:
        return sum((p.grid_times_s[key] / p.run.measured_time_s - 1.0) ** 2 for p in ps)
    gap, eff = min(ps[0].grid_times_s, key=sse)
    return {"profile_overhead_s": gap, "allreduce_efficiency": eff}


def _predict_time(p: _Prepared, cal: Calibration) -> float:
    c = cal.get(p.gpu, {})
    key = (c.get("profile_overhead_s", 0.0), c.get("allreduce_efficiency", 1.0))
    return p.grid_times_s.get(key, p.time_s) if c else p.grid_times_s[(0.0, 1.0)]


def _predict_memory(p: _Prepared, cal: Calibration, default_framework: float) -> float:
    c = cal.get(p.gpu, {})
    return (p.fixed_bytes + p.transient_bytes * (1.0 + c.get("reserve_fraction", 0.0))
            + c.get("framework_bytes", default_framework))


def _fit(prepared: list[_Prepared]) -> Calibration:
    cal: Calibration = {}
    for gpu in sorted({p.gpu for p in prepared}):
        ps = [p for p in prepared if p.gpu == gpu]
        cal[gpu] = fit_memory(np.array([p.fixed_bytes for p in ps]), np.array([p.transient_bytes for p in ps]),
                              np.array([p.run.measured_memory_bytes for p in ps])) | _fit_time(ps)
    return cal


def fit_calibration(runs: list[Run], profiles: Profiles, network_path: Path | None = None) -> Calibration:
    """Per-GPU-type constants fitted on `runs`: memory (`framework_bytes`, `reserve_fraction`, linear
    least squares) and time (`profile_overhead_s`, `allreduce_efficiency`, least squared relative
    error over `PROFILE_GAP_GRID_S` x `ALLREDUCE_EFFICIENCY_GRID`)."""
    return _fit(_prepare(runs, profiles, network_path))


def validate(runs: list[Run], profiles: Profiles, network_path: Path | None = None, *,
             calibration: Calibration | None = None, fit: bool = False, loo: bool = True) -> ValidationReport:
    """Predict every run and compare with its measurements.

    Args:
        runs: from `load_runs`.
        profiles: layer timings for the runs' model.
        network_path: Sailor network folder or our link file (None: catalog links).
        calibration: constants to use (default: `simulator.calibration.default_calibration()`).
        fit: refit the per-GPU-type constants on these runs first and use them.
        loo: also predict each run with constants fitted on the other runs of its GPU type (time and
            memory constants both refitted without it).
    Returns:
        ValidationReport (times in s, memory in bytes, errors in percent).
    """
    prepared = _prepare(runs, profiles, network_path)
    cal = _fit(prepared) if fit else (default_calibration() if calibration is None else calibration)
    if not fit:  # time with the given constants (they need not lie on the fitting grid)
        for p in prepared:
            net = network_for(p.run.cluster, network_path)
            p.time_s = simulate(p.run.plan, make_context(p.run.job, p.run.cluster, profiles, net,
                                                         calibration=cal)).iteration_time_s
    else:
        for p in prepared:
            p.time_s = _predict_time(p, cal)
    results = []
    for k, p in enumerate(prepared):
        fw = float(catalog.gpu(p.gpu).framework_bytes)
        res = RunResult(name=p.run.name, gpu=p.gpu, measured_time_s=p.run.measured_time_s, predicted_time_s=p.time_s,
                        measured_memory_bytes=p.run.measured_memory_bytes,
                        predicted_memory_bytes=_predict_memory(p, cal, fw))
        if loo:
            others = [q for q in prepared if q is not p and q.gpu == p.gpu]
            loo_cal = _fit(others) if others else {}
            res.loo_memory_err_pct = 100.0 * (_predict_memory(p, loo_cal, fw) / p.run.measured_memory_bytes - 1.0)
            res.loo_time_err_pct = 100.0 * (_predict_time(p, loo_cal) / p.run.measured_time_s - 1.0)
        results.append(res)
    return ValidationReport(results=results, calibration=cal)
