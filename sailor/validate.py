"""Simulator fidelity: predict measured runs and report the errors (`sailor validate`).

A validation folder holds Sailor-format `plan_config*.json` files that carry measurements: `real`
(iteration time, s) and `max_mem` (peak `nvidia-smi memory.used` over ranks, bytes). For each run we
build the job (the folder's model, fp32, the model's full context, the file's `gbs`) and the cluster
(the plan's own zones, with the GPUs per node the plan names), simulate it with the given profiles
and network fits, and compare.

Errors are signed relative errors, (predicted - measured) / measured, in percent. Memory is compared
on the most-loaded GPU (the measurement is a max over ranks). `fit_calibration` fits the per-GPU-type
memory and time constants of `simulator.calibration` on a set of runs; `leave_one_out` predicts each run with
constants fitted without it, which is the over-fitting guard.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sailor import catalog
from sailor.errors import SailorInputError, note
from sailor.fileio import Checks, load_json, parse_model
from sailor.limits import MAX_BYTES, MAX_SECONDS
from sailor.models import BUILTIN_MODELS, MODEL_ALIASES, canonical_model_name
from sailor.network import NetworkModel, network_for
from sailor.plan import Plan, plan_from_dict
from sailor.plan_config import sailor_gpus_per_node
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


def load_runs(folder: str | Path, model: str | None = None) -> list[Run]:
    """Every Sailor plan_config in `folder` that carries `real` and `max_mem`, as Runs (sorted by
    name). Raises SailorInputError when the folder is missing or holds no such file."""
    d = Path(folder)
    if not d.is_dir():
        raise SailorInputError("not a folder", source=str(d))
    model_name = canonical_model_name(model) if model else model_from_folder(d)
    runs: list[Run] = []
    for path in sorted(d.glob("*.json")):
        raw = load_json(path)
        if not isinstance(raw, dict) or "pipeline_list" not in raw or "real" not in raw or "max_mem" not in raw:
            note("skipped: not a Sailor plan_config with `real` and `max_mem` (a measured run)", source=str(path))
            continue
        c = Checks(str(path))
        t = c.number(raw["real"], "real", lo=0, lo_open=True, hi=MAX_SECONDS, unit="seconds")
        mem = c.number(raw["max_mem"], "max_mem", lo=0, lo_open=True, hi=MAX_BYTES, unit="bytes")
        plan = plan_from_dict(raw, str(path))
        job = JobSpec(model=model_name, global_batch_size=plan.global_batch_size, precision="fp32")
        zones: dict[str, dict[str, int]] = {}
        for (zone, gpu), n in plan.gpu_usage().items():
            zones.setdefault(zone, {})[gpu] = n
        cluster = parse_model(ClusterSpec, {"provider": "gcp", "zones": zones,
                                            "gpus_per_node": sailor_gpus_per_node(raw, str(path))}, str(path))
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
    net: NetworkModel
    profiles: Profiles
    time_s: float
    fixed_bytes: float  # weights + gradients + optimizer of the most-loaded GPU
    transient_bytes: float  # activations + buffers of that GPU


# Time constants of `simulator.calibration` fitted per GPU type: name -> (start, lower, upper). The
# all-reduce rate is fitted as its inverse, seconds per byte (iteration time is linear in it; lower
# bound 0 = no rate limit beyond the links). A constant that no run constrains (no pipeline, or no
# data parallelism, among the runs) stays at its start.
TIME_CONSTANTS: dict[str, tuple[float, float, float]] = {
    "profile_overhead_s": (150e-6, 0.0, 1e-3),
    "p2p_overhead_s": (500e-6, 0.0, 10e-3),
    "allreduce_s_per_byte": (0.5e-9, 0.0, 1e-8),
}


def _time_calibration(gpu: str, x: dict[str, float], base: Calibration | None = None) -> Calibration:
    """`base` (default: the shipped constants) with GPU type `gpu`'s time constants set from `x`."""
    cal = default_calibration() if base is None else {g: dict(v) for g, v in base.items()}
    c = cal.setdefault(gpu, {})
    c["profile_overhead_s"] = x["profile_overhead_s"]
    c["p2p_overhead_s"] = x["p2p_overhead_s"]
    c.pop("allreduce_efficiency", None)
    if x["allreduce_s_per_byte"] > 0:
        c["allreduce_bytes_per_s"] = 1.0 / x["allreduce_s_per_byte"]
    else:
        c.pop("allreduce_bytes_per_s", None)
    return cal


def _sim_time(p: _Prepared, cal: Calibration) -> float:
    return simulate(p.run.plan, make_context(p.run.job, p.run.cluster, p.profiles, p.net,
                                             calibration=cal)).iteration_time_s


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
        out.append(_Prepared(run=run, gpu=top.gpu, net=net, profiles=profiles, time_s=est.iteration_time_s,
                             fixed_bytes=mem.weights + mem.gradients + mem.optimizer,
                             transient_bytes=mem.activations + mem.buffers))
    return out


def _fit_time(gpu: str, ps: list[_Prepared]) -> dict[str, float]:
    """Time constants of GPU type `gpu` with the least sum of squared relative iteration-time errors
    over `ps` (bounded least squares, scipy's trust-region reflective method; each residual
    evaluation simulates every run)."""
    from scipy.optimize import least_squares  # heavy import, only when fitting

    names = list(TIME_CONSTANTS)
    start = np.array([TIME_CONSTANTS[k][0] for k in names])
    meas = np.array([p.run.measured_time_s for p in ps])

    def residuals(v: np.ndarray) -> np.ndarray:
        cal = _time_calibration(gpu, dict(zip(names, v)))
        return np.array([_sim_time(p, cal) for p in ps]) / meas - 1.0

    sol = least_squares(residuals, start, bounds=([TIME_CONSTANTS[k][1] for k in names],
                                                  [TIME_CONSTANTS[k][2] for k in names]),
                        x_scale=start, diff_step=1e-3)
    fitted = _time_calibration(gpu, dict(zip(names, sol.x.tolist())), base={})[gpu]
    return fitted


def _predict_memory(p: _Prepared, cal: Calibration, default_framework: float) -> float:
    c = cal.get(p.gpu, {})
    return (p.fixed_bytes + p.transient_bytes * (1.0 + c.get("reserve_fraction", 0.0))
            + c.get("framework_bytes", default_framework))


def _fit(prepared: list[_Prepared]) -> Calibration:
    cal: Calibration = {}
    for gpu in sorted({p.gpu for p in prepared}):
        ps = [p for p in prepared if p.gpu == gpu]
        cal[gpu] = fit_memory(np.array([p.fixed_bytes for p in ps]), np.array([p.transient_bytes for p in ps]),
                              np.array([p.run.measured_memory_bytes for p in ps])) | _fit_time(gpu, ps)
    return cal


def _with_defaults(fitted: Calibration) -> Calibration:
    """The shipped constants with the fitted GPU types' entries replaced by `fitted`."""
    return default_calibration() | {g: dict(v) for g, v in fitted.items()}


def fit_calibration(runs: list[Run], profiles: Profiles, network_path: Path | None = None) -> Calibration:
    """Per-GPU-type constants fitted on `runs`: memory (`framework_bytes`, `reserve_fraction`, linear
    least squares) and time (`profile_overhead_s`, `p2p_overhead_s`, `allreduce_bytes_per_s`, least
    squared relative error, `TIME_CONSTANTS`)."""
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
            memory constants both refitted without it); none for a run that is its type's only one.
    Returns:
        ValidationReport (times in s, memory in bytes, errors in percent).
    """
    prepared = _prepare(runs, profiles, network_path)
    cal = _fit(prepared) if fit else (default_calibration() if calibration is None else calibration)
    for p in prepared:
        p.time_s = _sim_time(p, _with_defaults(cal) if fit else cal)
    results = []
    for k, p in enumerate(prepared):
        fw = float(catalog.gpu(p.gpu).framework_bytes)
        res = RunResult(name=p.run.name, gpu=p.gpu, measured_time_s=p.run.measured_time_s, predicted_time_s=p.time_s,
                        measured_memory_bytes=p.run.measured_memory_bytes,
                        predicted_memory_bytes=_predict_memory(p, cal, fw))
        others = [q for q in prepared if q is not p and q.gpu == p.gpu]
        if loo and others:  # with no other run of its GPU type there is nothing to fit on
            loo_cal = _fit(others)
            res.loo_memory_err_pct = 100.0 * (_predict_memory(p, loo_cal, fw) / p.run.measured_memory_bytes - 1.0)
            res.loo_time_err_pct = 100.0 * (_sim_time(p, _with_defaults(loo_cal)) / p.run.measured_time_s - 1.0)
        results.append(res)
    return ValidationReport(results=results, calibration=cal)
