"""Simulator fidelity: predict measured runs and report the errors (`sailor validate`).

A validation folder (a *set*) holds Sailor-format `plan_config*.json` files that carry measurements:
`real` (iteration time, s) and `max_mem` (peak `nvidia-smi memory.used` over ranks, bytes). For each
run we build the job (the set's model, fp32, the model's full context, the file's `gbs`) and the
cluster (the plan's own zones, with the GPUs per node the plan names; GPU types the provider lists no
price for get price 0, as validation never prices a run), simulate it with the given profiles and
network fits, and compare. Any GPU type of the catalog works, and runs mixing GPU types.

Errors are signed relative errors, (predicted - measured) / measured, in percent. Memory is compared
on the most-loaded GPU (the measurement is a max over ranks). `_fit` fits the per-GPU-type memory
and time constants of `simulator.calibration` on a set of runs.

Several sets (`validate_sets`): predictions with one calibration (shipped, or refitted on the sets
that are not *held out*), per set; leave-one-out per run (constants refitted without the run, on the
fitted sets only); and leave-one-model-out: each model's runs predicted with constants fitted on the
other models' runs. A held-out set is never fitted on, not even in a leave-one-out.

Files that cannot be used (not UTF-8, not JSON, no measurements, an unknown GPU type or zone, a plan
that does not fit the model...) are skipped with one line each (`RunSet.skipped`); a folder with
none left is an input error.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sailor import catalog
from sailor.core.errors import SailorInputError
from sailor.core.fileio import load_json
from sailor.core.limits import MAX_BYTES, MAX_SECONDS
from sailor.core.schema import Checks, parse_model
from sailor.model.registry import BUILTIN_MODELS, MODEL_ALIASES, canonical_model_name
from sailor.model.spec import Framework
from sailor.perf.calibration import default_calibration, fit_memory
from sailor.perf.network import NetworkModel
from sailor.perf.network_files import network_for
from sailor.perf.profile_lookup import Profiles
from sailor.plan import plan_from_dict
from sailor.plan.sailor_config import sailor_gpus_per_node
from sailor.plan.spec import Plan
from sailor.simulator import make_context, simulate
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

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
class RunSet:
    """The usable runs of one validation folder, and one line for each file that was not usable."""

    name: str
    folder: Path
    model: str
    runs: list[Run]
    skipped: list[str] = field(default_factory=list)


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


def _stats(errs: list[float]) -> dict[str, float]:
    a = [abs(e) for e in errs]
    return {"mape_pct": statistics.fmean(a), "median_ape_pct": statistics.median(a), "max_ape_pct": max(a)}


@dataclass
class ValidationReport:
    """Per-run results and summary statistics (mean, median, max of absolute percent errors)."""

    results: list[RunResult]
    calibration: Calibration = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The summary object (`to_dict` adds `rows`)."""
        t = _stats([r.time_err_pct for r in self.results])
        m = _stats([r.memory_err_pct for r in self.results])
        out: dict[str, Any] = {
            "runs": len(self.results),
            "time_mape_pct": t["mape_pct"], "time_median_ape_pct": t["median_ape_pct"], "time_max_ape_pct": t["max_ape_pct"],
            "memory_mape_pct": m["mape_pct"], "memory_median_ape_pct": m["median_ape_pct"],
            "memory_max_ape_pct": m["max_ape_pct"],
        }
        if all(r.loo_time_err_pct is not None for r in self.results):
            lt = _stats([r.loo_time_err_pct for r in self.results])  # type: ignore[misc]
            lm = _stats([r.loo_memory_err_pct for r in self.results])  # type: ignore[misc]
            out |= {"loo_time_mape_pct": lt["mape_pct"], "loo_time_max_ape_pct": lt["max_ape_pct"],
                    "loo_memory_mape_pct": lm["mape_pct"], "loo_memory_max_ape_pct": lm["max_ape_pct"]}
        out["calibration"] = self.calibration
        return out

    def to_dict(self) -> dict[str, Any]:
        return self.summary() | {"rows": [r.to_dict() for r in self.results]}


@dataclass
class SetReport:
    """One set's predictions; `held_out` when it was never fitted on."""

    name: str
    model: str
    held_out: bool
    report: ValidationReport
    skipped: list[str]

    def to_dict(self) -> dict[str, Any]:
        d = self.report.to_dict()
        d.pop("calibration")
        return {"set": self.name, "model": self.model, "held_out": self.held_out, "skipped": self.skipped} | d


@dataclass
class MultiReport:
    """Every set's predictions with one calibration, and leave-one-model-out predictions: model ->
    its runs predicted with constants fitted on the other models' fitted (not held-out) runs."""

    sets: list[SetReport]
    calibration: Calibration
    fitted_on: list[str]
    leave_one_model_out: dict[str, ValidationReport]

    def to_dict(self) -> dict[str, Any]:
        lomo = {m: {k: v for k, v in r.to_dict().items() if k != "calibration"}
                for m, r in self.leave_one_model_out.items()}
        return {"sets": [s.to_dict() for s in self.sets], "calibration": self.calibration,
                "fitted_on": self.fitted_on, "leave_one_model_out": lomo,
                "leave_one_model_out_pct": _lomo_pct(self.leave_one_model_out)}


def _lomo_pct(lomo: dict[str, ValidationReport]) -> dict[str, float] | None:
    """Mean |error| over every leave-one-model-out prediction (all models' runs together)."""
    rows = [r for rep in lomo.values() for r in rep.results]
    if not rows:
        return None
    return {"runs": len(rows), "time_mape_pct": _stats([r.time_err_pct for r in rows])["mape_pct"],
            "memory_mape_pct": _stats([r.memory_err_pct for r in rows])["mape_pct"]}


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


def model_from_runs(folder: Path, layer_counts: list[int]) -> str:
    """The built-in model whose layer list (embedding, blocks, head) has as many layers as most of
    the folder's runs cover (e.g. 34 -> gpt-neo-2.7b or llama-3-8b), several told apart by the
    letters of their name in the folder name (`gh200-gptneo` -> gpt-neo-2.7b); the public runs are of
    dense models, so mixtures of experts are not candidates. Raises
    SailorInputError when no count or not exactly one model fits."""
    if not layer_counts:
        raise SailorInputError(f"cannot tell the model from the folder name {folder.name!r} nor from its runs",
                               source=str(folder), fix="pass --model, e.g. --model opt-350m")
    n = max(set(layer_counts), key=layer_counts.count)
    models = sorted(m for m, spec in BUILTIN_MODELS.items() if spec.num_layers == n and spec.moe is None)
    if len(models) > 1:
        named = [m for m in models if re.match(r"[a-z-]*", m).group().replace("-", "") in _norm(folder.name)]
        models = named if len(named) == 1 else models
    if len(models) != 1:
        which = "no built-in model has" if not models else "fits " + ", ".join(models)
        raise SailorInputError(f"its runs cover {n} layers, which {which}", source=str(folder), fix="pass --model")
    return models[0]


def _read_raw(path: Path) -> dict[str, Any]:
    """A file's plan_config object (read by `fileio.load_json`'s rules); raises SailorInputError
    naming the problem."""
    raw = load_json(path)
    if not isinstance(raw, dict) or "pipeline_list" not in raw:
        raise SailorInputError("not a Sailor plan_config (no pipeline_list)", source=str(path))
    if "real" not in raw or "max_mem" not in raw:
        raise SailorInputError("carries no measurements (`real` and `max_mem`)", source=str(path))
    return raw


def _run_from_raw(path: Path, raw: dict[str, Any], model_name: str) -> Run:
    """One Run from a plan_config object; raises SailorInputError naming file and field."""
    src = str(path)
    c = Checks(src)
    t = c.number(raw["real"], "real", lo=0, lo_open=True, hi=MAX_SECONDS, unit="seconds")
    mem = c.number(raw["max_mem"], "max_mem", lo=0, lo_open=True, hi=MAX_BYTES, unit="bytes")
    plan = plan_from_dict(raw, src)
    # the public runs' runtime: DeepSpeed's pipeline engine (full activation per TP rank; the embedding
    # module tied through TiedLayerSpec, `simulator.context.TiedCopies`)
    job = JobSpec(model=model_name, global_batch_size=plan.global_batch_size, precision="fp32",
                  framework=Framework.DEEPSPEED)
    zones: dict[str, dict[str, int]] = {}
    for (zone, gpu), n in plan.gpu_usage().items():
        zones.setdefault(zone, {})[gpu] = n
    gpus = {g for z in zones.values() for g in z}
    unpriced = {g: 0.0 for g in gpus if g not in catalog.provider("gcp").prices_usd_per_gpu_hour}
    cluster = parse_model(ClusterSpec, {"provider": "gcp", "zones": zones, "gpus_per_node": sailor_gpus_per_node(raw, src),
                                        "prices": unpriced}, src)
    try:
        plan.check_against(job, cluster)
    except SailorInputError as e:
        raise e.located(source=src) from None
    return Run(name=path.stem.removeprefix("plan_config_"), plan=plan, job=job, cluster=cluster,
               measured_time_s=t, measured_memory_bytes=mem)


def _layer_count(raw: dict[str, Any]) -> int | None:
    try:
        return sum(len(ls) for ls in raw["pipeline_list"][0]["layers_per_stage"])
    except (KeyError, IndexError, TypeError):
        return None


def load_run_set(folder: str | Path, model: str | None = None) -> RunSet:
    """Every Sailor plan_config in `folder` with `real` and `max_mem`, as Runs (sorted by name), and
    one line for every JSON file that could not be used. The model: `model`, else the one the
    folder name mentions, else the built-in model with the runs' layer count. Raises
    SailorInputError when the folder is missing or its model cannot be told."""
    d = Path(folder)
    if not d.is_dir():
        raise SailorInputError("not a folder", source=str(d))
    raws: list[tuple[Path, dict[str, Any]]] = []
    skipped: list[str] = []
    for path in sorted(d.glob("*.json")):
        try:
            raws.append((path, _read_raw(path)))
        except SailorInputError as e:
            skipped.append(e.one_line())
    if model:
        model_name = canonical_model_name(model)
    else:
        try:
            model_name = model_from_folder(d)
        except SailorInputError:
            model_name = model_from_runs(d, [n for _, raw in raws if (n := _layer_count(raw)) is not None])
    runs: list[Run] = []
    for path, raw in raws:
        try:
            runs.append(_run_from_raw(path, raw, model_name))
        except SailorInputError as e:
            skipped.append(e.one_line())
    return RunSet(name=d.name, folder=d, model=model_name, runs=runs, skipped=skipped)


def load_runs(folder: str | Path, model: str | None = None) -> list[Run]:
    """The usable runs of `folder` (see `load_run_set`). Raises SailorInputError when the folder is
    missing or holds no usable run (naming the first problem)."""
    rs = load_run_set(folder, model)
    if not rs.runs:
        first = f"; {rs.skipped[0]}" if rs.skipped else ""
        raise SailorInputError(f"holds no usable plan_config JSON with `real` and `max_mem`"
                               f" ({len(rs.skipped)} file(s) skipped{first})", source=str(rs.folder))
    return rs.runs


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
    fixed_bytes: float  # weights + gradients + optimizer + sync buffer of the most-loaded GPU
    transient_bytes: float  # activations + buffers of that GPU


# Time constants of `simulator.calibration` fitted per GPU type: name -> (start, lower, upper). The
# all-reduce efficiency η is fitted as its inverse, the all-reduce slowdown 1/η (the bandwidth term
# of every all-reduce is linear in it); bounds 0.5..50. A constant that no run constrains (no
# pipeline, or no data parallelism, among the runs) stays at its start.
TIME_CONSTANTS: dict[str, tuple[float, float, float]] = {
    "profile_overhead_s": (150e-6, 0.0, 1e-3),
    "p2p_overhead_s": (500e-6, 0.0, 10e-3),
    "allreduce_slowdown": (2.0, 0.5, 50.0),
}


def _time_calibration(gpu: str, x: dict[str, float], base: Calibration | None = None) -> Calibration:
    """`base` (default: the shipped constants) with GPU type `gpu`'s time constants set from `x`."""
    cal = default_calibration() if base is None else {g: dict(v) for g, v in base.items()}
    c = cal.setdefault(gpu, {})
    c["profile_overhead_s"] = x["profile_overhead_s"]
    c["p2p_overhead_s"] = x["p2p_overhead_s"]
    c["allreduce_efficiency"] = 1.0 / x["allreduce_slowdown"]
    return cal


def _sim_time(p: _Prepared, cal: Calibration) -> float:
    return simulate(p.run.plan, make_context(p.run.job, p.run.cluster, p.profiles, p.net, calibration=cal)).iteration_time_s


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
                             fixed_bytes=mem.persistent, transient_bytes=mem.transient))
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
    return _time_calibration(gpu, dict(zip(names, sol.x.tolist())), base={})[gpu]


def _predict_memory(p: _Prepared, cal: Calibration) -> float:
    c = cal.get(p.gpu, {})
    return (p.fixed_bytes + p.transient_bytes * (1.0 + c.get("reserve_fraction", 0.0))
            + c.get("framework_bytes", float(catalog.gpu(p.gpu).framework_bytes)))


def _fit(prepared: list[_Prepared]) -> Calibration:
    """Constants of every GPU type that is the most-loaded one of some run in `prepared`."""
    cal: Calibration = {}
    for gpu in sorted({p.gpu for p in prepared}):
        ps = [p for p in prepared if p.gpu == gpu]
        cal[gpu] = fit_memory(np.array([p.fixed_bytes for p in ps]), np.array([p.transient_bytes for p in ps]),
                              np.array([p.run.measured_memory_bytes for p in ps])) | _fit_time(gpu, ps)
    return cal


def _with_defaults(fitted: Calibration) -> Calibration:
    """The shipped constants with the fitted GPU types' entries replaced by `fitted`."""
    return default_calibration() | {g: dict(v) for g, v in fitted.items()}


def _result(p: _Prepared, cal: Calibration) -> RunResult:
    return RunResult(name=p.run.name, gpu=p.gpu, measured_time_s=p.run.measured_time_s,
                     predicted_time_s=_sim_time(p, cal), measured_memory_bytes=p.run.measured_memory_bytes,
                     predicted_memory_bytes=_predict_memory(p, cal))


def _leave_one_out(res: RunResult, p: _Prepared, pool: list[_Prepared]) -> None:
    """Fill `res`'s leave-one-out errors: constants refitted on the runs of `pool` of p's GPU type
    other than p (none when there are none)."""
    others = [q for q in pool if q is not p and q.gpu == p.gpu]
    if not others:
        return
    cal = _with_defaults(_fit(others))
    res.loo_memory_err_pct = 100.0 * (_predict_memory(p, cal) / p.run.measured_memory_bytes - 1.0)
    res.loo_time_err_pct = 100.0 * (_sim_time(p, cal) / p.run.measured_time_s - 1.0)


def validate_sets(sets: list[RunSet], profiles_for: dict[str, Profiles], network_path: Path | None = None, *,
                  held_out: set[str] = frozenset(), fit: bool = False, loo: bool = True) -> MultiReport:
    """Predict every set with one calibration and add leave-one-model-out predictions.

    Args:
        sets: from `load_run_set`, each with at least one run.
        profiles_for: model name -> profiles of that model.
        network_path: Sailor network folder or our link file (None: catalog links).
        held_out: names of sets never fitted on (no refit, no leave-one-out, no pool of a
            leave-one-model-out fit).
        fit: refit the constants on the runs of the sets not held out (else: the shipped ones).
        loo: leave-one-out per run of the fitted sets.
    Returns:
        MultiReport; its `calibration` is what the predictions used.
    """
    prepared = {s.name: _prepare(s.runs, profiles_for[s.model], network_path) for s in sets}
    pool = [p for s in sets if s.name not in held_out for p in prepared[s.name]]
    fitted_on = [s.name for s in sets if s.name not in held_out] if fit else []
    cal = _with_defaults(_fit(pool)) if fit and pool else default_calibration()
    reports = []
    for s in sets:
        results = []
        for p in prepared[s.name]:
            res = _result(p, cal)
            if loo and s.name not in held_out:
                _leave_one_out(res, p, pool)
            results.append(res)
        reports.append(SetReport(name=s.name, model=s.model, held_out=s.name in held_out,
                                 report=ValidationReport(results=results, calibration=cal), skipped=s.skipped))
    lomo: dict[str, ValidationReport] = {}
    for model in dict.fromkeys(s.model for s in sets):
        others = [p for s in sets if s.model != model and s.name not in held_out for p in prepared[s.name]]
        if not others:
            continue
        lcal = _with_defaults(_fit(others))
        mine = [p for s in sets if s.model == model for p in prepared[s.name]]
        known = {p.gpu for p in others}
        results = [_result(p, lcal) for p in mine if p.gpu in known]  # a GPU type the pool never saw: no figure
        if results:
            lomo[model] = ValidationReport(results=results, calibration=lcal)
    return MultiReport(sets=reports, calibration=cal, fitted_on=fitted_on, leave_one_model_out=lomo)
