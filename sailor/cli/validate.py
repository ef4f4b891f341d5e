"""`sailor validate DIR`: predicted vs measured iteration time and peak memory of measured runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from sailor.cli import app
from sailor.cli.common import JsonOpt, console
from sailor.errors import SailorInputError
from sailor.profiles import load_profiles
from sailor.validate import ValidationReport, default_data_paths, load_runs, validate

GIB = 2**30


@app.command("validate")
def validate_command(
    folder: Path = typer.Argument(..., metavar="DIR", help="Folder of Sailor plan_config JSON files with `real` (s) and"
                                  " `max_mem` (bytes), e.g. ../shared/reference/sailor/validation/gh200-opt350."),
    profiles: Optional[Path] = typer.Option(None, "--profiles", help="Sailor profiles folder (profiles_tmp.json,"
                                            " llm_info.json) or our profile file. Default: DIR/../../profiles."),
    network: Optional[Path] = typer.Option(None, "--network", help="Sailor network folder or our link file."
                                           " Default: DIR/../../network."),
    model: Optional[str] = typer.Option(None, "--model", help="Model of every run (e.g. opt-350m, OPT-350)."
                                        " Default: the model the folder name mentions."),
    fit: bool = typer.Option(False, "--fit", help="Refit the per-GPU-type memory and time constants on these runs and use them."),
    as_json: bool = JsonOpt,
) -> None:
    """Simulate every measured run in DIR and report time and memory errors, with leave-one-out."""
    runs = load_runs(folder, model)
    prof_default, net_default = default_data_paths(folder)
    prof_path = profiles or prof_default
    if prof_path is None:
        raise SailorInputError("no profiles next to the folder (DIR/../../profiles)", source=str(folder),
                               fix="pass --profiles PATH")
    net_path = network or net_default
    if net_path is None:
        raise SailorInputError("no network fits next to the folder (DIR/../../network)", source=str(folder),
                               fix="pass --network PATH")
    report = validate(runs, load_profiles(prof_path, runs[0].job), net_path, fit=fit)
    if as_json:
        print(json.dumps(report.to_dict()))
        return
    render_report(report, title=f"{runs[0].job.model.name} · {folder}")


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
    for gpu, c in sorted(report.calibration.items()):
        out.print(f"{gpu}: " + ", ".join(f"{k} = {v:.4g}" for k, v in sorted(c.items())))
