"""`sailor validate DIR...`: predicted vs measured iteration time and peak memory of measured runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from sailor.cli.app import app
from sailor.cli.common import JsonOpt, console
from sailor.core.errors import SailorInputError, note
from sailor.core.units import GIB
from sailor.perf.profiles import load_profiles
from sailor.simulator.fidelity import (MultiReport, RunSet, ValidationReport, default_data_paths, load_run_set,
                                       validate_sets)


@app.command("validate")
def validate_command(
    folders: list[Path] = typer.Argument(..., metavar="DIR...", help="Folders of Sailor plan_config JSON files with"
                                         " `real` (s) and `max_mem` (bytes), e.g."
                                         " ../shared/reference/sailor/validation/gh200-opt350."),
    held_out: list[Path] = typer.Option([], "--held-out", metavar="DIR", help="A folder predicted but never fitted"
                                        " on (repeatable), e.g. .../validation/gh200-gptneo."),
    profiles: Optional[Path] = typer.Option(None, "--profiles", exists=True, help="Sailor profiles folder (profiles_tmp.json,"
                                            " llm_info.json) or our profile file. Default: DIR/../../profiles."),
    network: Optional[Path] = typer.Option(None, "--network", help="Sailor network folder or our link file."
                                           " Default: DIR/../../network."),
    model: Optional[str] = typer.Option(None, "--model", help="Model of every run (e.g. opt-350m, OPT-350). Default:"
                                        " the model the folder name mentions, else the one with the runs' layer count."),
    fit: bool = typer.Option(False, "--fit", help="Refit the per-GPU-type memory and time constants on the folders"
                             " that are not held out, and use them (default: the shipped constants)."),
    as_json: bool = JsonOpt,
) -> None:
    """Simulate every measured run in each DIR and report time and memory errors, with leave-one-out
    (per run, on the fitted folders) and leave-one-model-out figures."""
    sets: list[RunSet] = []
    for folder in list(folders) + list(held_out):
        rs = load_run_set(folder, model)
        if not rs.runs:  # one `error:` line per file, the last one ends the command (exit 2)
            if not rs.skipped:
                raise SailorInputError("holds no plan_config JSON file", source=str(folder))
            for line in rs.skipped[:-1]:
                print(f"error: {line}", file=sys.stderr)
            raise SailorInputError(rs.skipped[-1])
        for line in rs.skipped:
            note(f"skipped: {line}")
        if any(s.name == rs.name for s in sets):
            raise SailorInputError(f"two folders are named {rs.name!r}", source=str(folder), fix="give each set once")
        sets.append(rs)
    first = folders[0] if folders else held_out[0]
    prof_default, net_default = default_data_paths(first)
    prof_path = profiles or prof_default
    if prof_path is None:
        raise SailorInputError("no profiles next to the folder (DIR/../../profiles)", source=str(first),
                               fix="pass --profiles PATH")
    net_path = network or net_default
    if net_path is None:
        raise SailorInputError("no network fits next to the folder (DIR/../../network)", source=str(first),
                               fix="pass --network PATH")
    profs = {s.model: load_profiles(prof_path, s.runs[0].job) for s in sets}
    report = validate_sets(sets, profs, net_path, held_out={Path(h).name for h in held_out}, fit=fit)
    if as_json:
        print(json.dumps(report.to_dict()))
        return
    render_multi(report)


def render_report(report: ValidationReport, title: str = "") -> None:
    """One row per run, then the summary."""
    t = Table(title=title or None)
    for col in ("run", "GPU", "time (s)", "predicted (s)", "error (%)", "LOO (%)", "memory (GiB)",
                "predicted (GiB)", "error (%)", "LOO (%)"):
        t.add_column(col, justify="left" if col in ("run", "GPU") else "right")
    for r in report.results:
        t.add_row(r.name, r.gpu, f"{r.measured_time_s:.3f}", f"{r.predicted_time_s:.3f}", f"{r.time_err_pct:+.1f}",
                  f"{r.loo_time_err_pct:+.1f}" if r.loo_time_err_pct is not None else "-",
                  f"{r.measured_memory_bytes / GIB:.2f}", f"{r.predicted_memory_bytes / GIB:.2f}",
                  f"{r.memory_err_pct:+.1f}",
                  f"{r.loo_memory_err_pct:+.1f}" if r.loo_memory_err_pct is not None else "-")
    out = console()
    out.print(t)
    s = report.summary()
    out.print(f"time |error|: mean {s['time_mape_pct']:.1f} %, median {s['time_median_ape_pct']:.1f} %,"
              f" max {s['time_max_ape_pct']:.1f} %")
    out.print(f"memory |error|: mean {s['memory_mape_pct']:.1f} %, median {s['memory_median_ape_pct']:.1f} %,"
              f" max {s['memory_max_ape_pct']:.1f} %")
    if "loo_memory_mape_pct" in s:
        out.print(f"leave-one-out: time mean {s['loo_time_mape_pct']:.1f} % (max {s['loo_time_max_ape_pct']:.1f} %),"
                  f" memory mean {s['loo_memory_mape_pct']:.1f} % (max {s['loo_memory_max_ape_pct']:.1f} %)")


def render_multi(report: MultiReport) -> None:
    """Each set's table and summary, the leave-one-model-out figures and the constants used."""
    out = console()
    for s in report.sets:
        how = "held out: never fitted" if s.held_out else ("fitted on" if s.name in report.fitted_on else
                                                           "shipped constants")
        render_report(s.report, title=f"{s.name} · {s.model} · {how}")
    for model, rep in report.leave_one_model_out.items():
        m = rep.summary()
        out.print(f"leave-one-model-out {model} (constants fitted on the other models' runs): time mean"
                  f" {m['time_mape_pct']:.1f} % (max {m['time_max_ape_pct']:.1f} %), memory mean"
                  f" {m['memory_mape_pct']:.1f} % (max {m['memory_max_ape_pct']:.1f} %) over {m['runs']} runs")
    if not report.leave_one_model_out:
        out.print("leave-one-model-out: none (needs runs of another model that may be fitted on)")
    for gpu, c in sorted(report.calibration.items()):
        out.print(f"{gpu}: " + ", ".join(f"{k} = {v:.4g}" for k, v in sorted(c.items())))
