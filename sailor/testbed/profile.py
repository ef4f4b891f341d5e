"""Profiles of the testbed's device classes: `sailor profile` run inside each class's per-rank quota,
its rows named after the GPU type the class stands for, all classes in one file (`sailor testbed
profile`), which `sailor plan --profiles` and `sailor simulate --profiles` read as usual.

Each class is measured at every TP degree its nodes have ranks for (`class_tps`), one replica at a time with one thread per process (`--threads 1 --concurrency 1`),
inside the first node of the class as a run there is: in its network namespace (the TP collectives
cross its loopback, shaped like a run's), each TP rank in its own rank cgroup (`r0`, `r1`, ...) under
its quota and gloo's threads outside the quotas (`cgroups.place_ranks`), so the layer times are
those of the class's ranks, their TP collectives included. A TP-2 replica's passes are not a TP-1
pass's halves plus the collectives' bytes: each rank's quota runs in its own CFS periods, so a
per-layer all-reduce also waits for the partner's next slice of its quota (one TP-2 replica of the
`tiny` model on a node of two 0.3-core ranks, 6 micro-batches of 2, load 2.7: 0.475 s of passes
per step measured, 0.185 s predicted from times scaled from TP 1).
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sailor.core.errors import SailorInputError
from sailor.core.fileio import load_json
from sailor.model.spec import ModelSpec
from sailor.specs import load_job
from sailor.testbed.cgroups import PLACE_EVERY_S, place_ranks
from sailor.testbed.host import TestbedState
from sailor.testbed.spec import TestbedSpec
from sailor.testbed.state import NodeState

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


def profile_command(job: str | Path, out: str | Path, mbs: str, python: str = sys.executable,
                    tps: Sequence[int] = (1,)) -> list[str]:
    """`sailor profile` of one device class: TP degrees `tps`, one thread per process, one replica at a time."""
    return [python, "-m", "sailor", "profile", "--job", str(job), "--device", "cpu", "--tp", ",".join(map(str, tps)),
            "--mbs", mbs, "--threads", "1", "--concurrency", "1", "--out", str(out)]


PROFILE_RANK = ("-m", "sailor.runtime.profiler", "sailor.runtime.profiler:profile_rank")
"""How a rank of `sailor profile` is started (`profiler.run_ranks`): `python -m sailor.runtime.profiler
sailor.runtime.profiler:profile_rank RANK WORLD PORT`."""


def profile_rank_slot(argv: Sequence[str]) -> int | None:
    """The device index on its node of a `sailor profile` rank with command line `argv` (PROFILE_RANK):
    its rank, since one replica is measured at a time (its TP ranks 0..t-1); None for any other
    process."""
    n = len(PROFILE_RANK)
    for i in range(len(argv) - n):
        if tuple(argv[i:i + n]) == PROFILE_RANK and argv[i + n].isdigit():
            return int(argv[i + n])
    return None


def _profile_slot(pid: str) -> int | None:
    """`profile_rank_slot` of process `pid`. Raises OSError when the process is gone."""
    return profile_rank_slot(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"))


def _run_placed(argv: list[str], node: NodeState, env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run `argv` in `node`'s network namespace and cgroup, moving its profiling ranks into their
    rank cgroups while it runs (`place_ranks`); (exit status, output).

    Raises:
        RuntimeError: it ran longer than `timeout_s` (it is killed first).
    """
    def enter() -> None:  # in the child, before exec
        Path(node.cgroup, "cgroup.procs").write_text(str(os.getpid()))

    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.Popen(["ip", "netns", "exec", node.netns, *argv], preexec_fn=enter, env=env,  # noqa: PLW1509
                             stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        try:
            while p.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"`sailor profile` did not finish within {timeout_s:.0f} s")
                with contextlib.suppress(OSError):
                    place_ranks(node, _profile_slot)
                time.sleep(PLACE_EVERY_S)
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()
        log.seek(0)
        return p.returncode, log.read()


def class_tps(spec: TestbedSpec, model: ModelSpec) -> dict[str, list[int]]:
    """Device class -> the TP degrees it is profiled at: those of `model` (`ModelSpec.tp_degrees`)
    up to the ranks of one of its nodes (a TP group lives inside one node)."""
    return {name: model.tp_degrees(next(n.ranks for n in spec.nodes if n.device == name)) for name in spec.devices}


def profile_classes(spec: TestbedSpec, state: TestbedState, job: str | Path, *, mbs: str = "1,2,4",
                    timeout_s: float = 1800.0, classes: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure every device class of the testbed (or those named in `classes`) in its first node
    (module docstring; the node's ranks should not be running meanwhile) at every TP degree the
    node's ranks allow, and return the merged profile, rows named after each class's GPU type.

    Raises:
        RuntimeError: a `sailor profile` run failed (its last output in the message) or ran past `timeout_s`.
    """
    tps = class_tps(spec, load_job(job).model)
    parts = []
    with tempfile.TemporaryDirectory(prefix="sailor-testbed-profile-") as tmp:
        for name, device in spec.devices.items():
            if classes is not None and name not in classes:
                continue
            first = next(n for n in spec.nodes if n.device == name)
            path = Path(tmp) / f"{name}.json"
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2])] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
            argv = profile_command(Path(job).resolve(), path, mbs, tps=tps[name])
            code, output = _run_placed(argv, state.node(first.name), env, timeout_s)
            if code != 0:
                raise RuntimeError(f"profiling device class {name} failed: {output.strip()[-500:]}")
            parts.append(retag(load_json(path), device.gpu))
    return merge(parts)
