"""Profiles of the testbed's device classes: `sailor profile` run inside each class's per-rank quota,
its rows named after the GPU type the class stands for, all classes in one file (`sailor testbed
profile`), which `sailor plan --profiles` and `sailor simulate --profiles` read as usual.

Each class is measured at TP 1, one process with one thread (`--threads 1 --concurrency 1`) in the
rank cgroup `r0` of the first node of the class, so the layer times are those of one rank under
its quota. Other TP degrees are the profiles module's scaled estimates (labelled as such).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sailor.core.errors import SailorInputError
from sailor.core.fileio import load_json
from sailor.testbed.cgroups import rank_cgroup
from sailor.testbed.host import TestbedState
from sailor.testbed.spec import TestbedSpec

PROFILED_GPU = "cpu"  # the GPU type `sailor profile --device cpu` writes its rows under


def retag(profile: dict[str, Any], gpu: str) -> dict[str, Any]:
    """A copy of a profile (`sailor.perf.profiles` format) with every row and the optimizer entry of
    GPU type PROFILED_GPU named `gpu` instead.

    Raises:
        SailorInputError: the profile holds another GPU type (it was not measured on the CPU).
    """
    out = copy.deepcopy(profile)
    got = set(out.get("optimizer", {}))
    if got != {PROFILED_GPU}:
        raise SailorInputError(f"expected a profile of GPU type {PROFILED_GPU!r}, got {sorted(got)}",
                               field="optimizer")
    out["optimizer"] = {gpu: out["optimizer"][PROFILED_GPU]}
    rows = out["layers"] + out.get("memory", []) + out.get("runtime", {}).get("microbatch_overhead_s", [])
    for row in rows:
        if row.get("gpu", PROFILED_GPU) == PROFILED_GPU and "gpu" in row:
            row["gpu"] = gpu
    return out


def merge(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """One profile holding the rows of `profiles` (each of other GPU types, all of one job): layers,
    memory and runtime rows concatenated, optimizer entries joined; the rest is the first one's.

    Raises:
        SailorInputError: two profiles of different models, sequence lengths or precisions, or of one GPU type.
    """
    assert profiles
    out = copy.deepcopy(profiles[0])
    for k, p in enumerate(profiles[1:], start=1):
        for key in ("model", "sequence_length", "precision"):
            if p[key] != out[key]:
                raise SailorInputError(f"{key} {p[key]!r} differs from the first profile's {out[key]!r}",
                                       field=f"{k}.{key}")
        both = set(p["optimizer"]) & set(out["optimizer"])
        if both:
            raise SailorInputError(f"GPU type(s) {sorted(both)} measured twice", field=f"{k}.optimizer")
        out["layers"] += p["layers"]
        out["optimizer"].update(p["optimizer"])
        out["memory"] = out.get("memory", []) + p.get("memory", [])
        extra = p.get("runtime", {}).get("microbatch_overhead_s", [])
        if extra:
            out.setdefault("runtime", {}).setdefault("microbatch_overhead_s", []).extend(extra)
    return out


def profile_command(job: str | Path, out: str | Path, mbs: str, python: str = sys.executable) -> list[str]:
    """`sailor profile` of one rank: TP 1, one thread, one replica at a time."""
    return [python, "-m", "sailor", "profile", "--job", str(job), "--device", "cpu", "--tp", "1", "--mbs", mbs,
            "--threads", "1", "--concurrency", "1", "--out", str(out)]


def profile_classes(spec: TestbedSpec, state: TestbedState, job: str | Path, *, mbs: str = "1,2,4",
                    timeout_s: float = 1800.0, classes: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure every device class of the testbed (or those named in `classes`) in its first node's
    rank cgroup `r0` (the node's ranks should not be running meanwhile) and return the merged
    profile, rows named after each class's GPU type.

    Raises:
        RuntimeError: a `sailor profile` run failed (its last output in the message).
    """
    parts = []
    with tempfile.TemporaryDirectory(prefix="sailor-testbed-profile-") as tmp:
        for name, device in spec.devices.items():
            if classes is not None and name not in classes:
                continue
            node = state.node(next(n.name for n in spec.nodes if n.device == name))
            path = Path(tmp) / f"{name}.json"
            cgroup = rank_cgroup(node, 0)

            def enter(cgroup: str = cgroup) -> None:  # in the child, before exec: into the rank's quota
                Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))

            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2])] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
            p = subprocess.run(profile_command(job, path, mbs), preexec_fn=enter, env=env,
                               capture_output=True, text=True, timeout=timeout_s, check=False)
            if p.returncode != 0:
                raise RuntimeError(f"profiling device class {name} failed: {(p.stderr or p.stdout).strip()[-500:]}")
            parts.append(retag(load_json(path), device.gpu))
    return merge(parts)
