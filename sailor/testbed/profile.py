"""Profiles of the testbed's device classes: `sailor profile` run inside each class's per-rank quota,
its rows named after the GPU type the class stands for, all classes in one file (`sailor testbed
profile`), which `sailor plan --profiles` and `sailor simulate --profiles` read as usual.

Each class is measured at every TP degree its nodes have ranks for (`class_tps`), one thread per
process, inside the first node of the class as a run there is: in its network namespace (the TP
collectives cross its loopback, shaped like a run's), each rank in its own rank cgroup (`r0`, `r1`,
...) under its quota and gloo's threads outside the quotas (`cgroups.place_ranks`), so the layer
times are those of the class's ranks, their TP collectives included. A TP-2 replica's passes are
not a TP-1 pass's halves plus the collectives' bytes: each rank's quota runs in its own CFS periods,
so a per-layer all-reduce also waits for the partner's next slice of its quota (one TP-2 replica of
the `tiny` model on a node of two 0.3-core ranks, 6 micro-batches of 2, load 2.7: 0.475 s of passes
per step measured, 0.185 s predicted from times scaled from TP 1).

Every rank of the testbed is busy meanwhile, as the ranks of a plan's run are (`profile_rounds`):
one round per TP degree, in which each class measured at that degree fills its first node with
replicas (node ranks / TP of them, timed together as `sailor profile --concurrency` does), and
every other node runs its own class's TP-1 profile over all its ranks, started again until the
round's measurements end. This is `sailor profile`'s own rule on a CPU (every core busy, as in a
multi-process run) applied to the testbed's devices: a quota is a ceiling per CFS period, not a
share of a core kept for the rank, and a rank of a class ran slower when the testbed's other ranks
ran too. Measured on the 2-core build machine (`tiny`, fast class at 0.3 cores, TP 1, forward +
backward per micro-batch of 1 and 2; 1-minute load 0.2 rising to 9 from other work): 19.9 and
27.3 ms with the rank alone, 44.0 / 57.5 and 39.9 / 62.6 ms in the two nodes of the class with every
rank busy; a quiet data-parallel run of four ranks of the class (`benchmarks/testbed.py`'s dp_fast)
measured 33.7 ms per micro-batch of 1 where the profile taken alone had said 25.0. Under heavy
load from other work (1-minute load 10-30) the two profiles of TP 1 came out alike (other work then
slows a lone rank as much), while a TP-2 group measured 104-135 ms per micro-batch of 2 busy against
75-79 ms alone, and a TP-2 run's passes 0.387 s per step, predicted 0.313 s busy and 0.237 s alone. Not the caches: a quota'd transformer layer's passes per CPU-second
did not change with a busy process beside it on the same or the other core; what else slows a
quota'd rank when the cores are busy (their run queues at each refill of its quota) was not isolated.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sailor.core.errors import SailorInputError
from sailor.core.fileio import load_json
from sailor.core.scratch import scratch_dir
from sailor.model.spec import ModelSpec
from sailor.perf.profiles import RUNTIME_ROWS
from sailor.specs import load_job
from sailor.testbed import guard
from sailor.testbed.cgroups import PLACE_EVERY_S, place_ranks, rank_cgroups
from sailor.testbed.host import TestbedState, node_processes
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
    rows = out["layers"] + out.get("memory", []) + [row for key in RUNTIME_ROWS for row in out.get("runtime", {}).get(key, [])]
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
        for key in RUNTIME_ROWS:
            extra = p.get("runtime", {}).get(key, [])
            if extra:
                out.setdefault("runtime", {}).setdefault(key, []).extend(extra)
    return out


def profile_command(job: str | Path, out: str | Path, mbs: str, python: str = sys.executable,
                    tps: Sequence[int] = (1,), replicas: int = 1) -> list[str]:
    """`sailor profile` of one device class: TP degrees `tps`, one thread per process, `replicas` TP
    groups timed at once."""
    return [python, "-m", "sailor", "profile", "--job", str(job), "--device", "cpu", "--tp", ",".join(map(str, tps)),
            "--mbs", mbs, "--threads", "1", "--concurrency", str(replicas), "--out", str(out)]


RANK_LAUNCHER = ("-m", "sailor.runtime.profiler")
"""How a rank of `sailor profile` is started (`ranks.run_ranks`): `python -m sailor.runtime.profiler
TARGET RANK WORLD PORT`, TARGET one of PROFILE_TARGETS for the ranks that time the device."""
PROFILE_TARGETS = ("sailor.runtime.profiler:profile_rank", "sailor.runtime.profile_passes:rank_pass_overhead")
"""The layers' ranks, and those of the fixed cost of a stage pass (2 x TP of them,
`runtime.profile_passes`); the network sweep's ranks are not a device's."""


def profile_rank_slot(argv: Sequence[str], ranks: int | None = None) -> int | None:
    """The device index on its node of a `sailor profile` rank with command line `argv`
    (RANK_LAUNCHER, one of PROFILE_TARGETS): its rank, modulo the node's `ranks` where given (the
    replicas measured in a node are as many as fit its ranks, `profile_classes`, but the 2 x TP ranks
    of the stage pass's cost may be more: two share a rank cgroup, the first placed under its deadline
    reservation, the second under the cgroup's CFS quota, `cgroups.place_ranks`); None for any other
    process."""
    n = len(RANK_LAUNCHER)
    for i in range(len(argv) - n - 1):
        if tuple(argv[i:i + n]) == RANK_LAUNCHER and argv[i + n] in PROFILE_TARGETS and argv[i + n + 1].isdigit():
            rank = int(argv[i + n + 1])
            return rank % ranks if ranks else rank
    return None


def _profile_slot(node_ranks: int) -> Callable[[str], int | None]:
    """`profile_rank_slot` of a process, by pid, on a node of `node_ranks` ranks (raises OSError when
    the process is gone)."""
    return lambda pid: profile_rank_slot(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"),
                                         node_ranks)


class _Placed:
    """`argv` running in `node`'s network namespace and cgroup, its output kept in a temporary file."""

    def __init__(self, argv: list[str], node: NodeState, env: dict[str, str]) -> None:
        def enter() -> None:  # in the child, before exec
            Path(node.cgroup, "cgroup.procs").write_text(str(os.getpid()))
            # `stop` must reach it even when this process started with SIGTERM ignored, which a child
            # inherits (SIGINT, ignored in a script's background job, never reached it: killed 10 s later)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

        self.node = node
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(["ip", "netns", "exec", node.netns, *argv], preexec_fn=enter, env=env,  # noqa: PLW1509
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        """End it (SIGTERM first, on which `sailor profile` ends its ranks and removes its folder) and
        every process left in the node."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in node_processes(self.node):  # ranks run in sessions of their own (`ranks.run_ranks`)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


STOP_WAIT_S = 10.0  # how long a stopped `sailor profile` may take to end its ranks before it is killed


def _run_round(measured: dict[str, list[str]], busy: dict[str, list[str]], state: TestbedState, env: dict[str, str],
               timeout_s: float, ranks: dict[str, int]) -> dict[str, tuple[int, str]]:
    """Run the commands `measured` and `busy` (node name -> argv) at once, each in its node
    (`_Placed`), moving their profiling ranks into their rank cgroups while they run (`place_ranks`;
    `ranks`: node name -> its ranks, `profile_rank_slot`; `testbed.guard` watches this process),
    each busy one started again whenever it ends, until every measured one has ended; then stop the
    busy ones. Node name -> (exit status, output) of the measured ones.

    Raises:
        RuntimeError: a busy command failed (its last output in the message), or the measured ones
            ran longer than `timeout_s`; everything started is stopped first.
    """
    running: dict[str, _Placed] = {}
    slot_of = {n: _profile_slot(ranks[n]) for n in {**measured, **busy}}
    deadline = time.monotonic() + timeout_s
    watch = guard.start(os.getpid(), [c for n in slot_of for c in rank_cgroups(state.node(n))])
    try:
        for n, argv in {**measured, **busy}.items():
            running[n] = _Placed(argv, state.node(n), env)
        while any(running[n].proc.poll() is None for n in measured):
            if time.monotonic() > deadline:
                raise RuntimeError(f"`sailor profile` did not finish within {timeout_s:.0f} s")
            for n in busy:
                if running[n].proc.poll() is not None:
                    if running[n].proc.returncode != 0:
                        raise RuntimeError(f"the load of node {n} failed: {running[n].output().strip()[-500:]}")
                    running[n].stop()
                    running[n] = _Placed(busy[n], state.node(n), env)
            for n in running:
                with contextlib.suppress(OSError):
                    place_ranks(state.node(n), slot_of[n])
            time.sleep(PLACE_EVERY_S)
        return {n: (running[n].proc.returncode, running[n].output()) for n in measured}
    finally:
        for r in running.values():
            r.stop()
        watch.kill()
        watch.wait()


def class_tps(spec: TestbedSpec, model: ModelSpec) -> dict[str, list[int]]:
    """Device class -> the TP degrees it is profiled at: those of `model` (`ModelSpec.tp_degrees`)
    up to the ranks of one of its nodes (a TP group lives inside one node)."""
    return {name: model.tp_degrees(next(n.ranks for n in spec.nodes if n.device == name)) for name in spec.devices}


def profile_rounds(spec: TestbedSpec, tps: dict[str, list[int]],
                   classes: Sequence[str] | None = None) -> list[dict[str, tuple[str, int] | None]]:
    """The rounds in which the device classes (all, or those named in `classes`) are measured at
    their TP degrees `tps` (`class_tps`): one per TP degree, in increasing order, mapping every node
    of the testbed to (device class, TP degree) where the round measures that class at that degree
    (the class's first node), else to None (the node is kept busy: `profile_classes`)."""
    chosen = [c for c in spec.devices if classes is None or c in classes]
    rounds = []
    for t in sorted({t for c in chosen for t in tps[c]}):
        first = {next(n.name for n in spec.nodes if n.device == c): c for c in chosen if t in tps[c]}
        rounds.append({n.name: (first[n.name], t) if n.name in first else None for n in spec.nodes})
    return rounds


def profile_classes(spec: TestbedSpec, state: TestbedState, job: str | Path, *, mbs: str = "1,2,4",
                    timeout_s: float = 1800.0, classes: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure every device class of the testbed (or those named in `classes`) in its first node at
    every TP degree the node's ranks allow, with every rank of the testbed busy (module docstring;
    nothing else should run on the testbed meanwhile), and return the merged profile, rows named
    after each class's GPU type.

    Raises:
        RuntimeError: a `sailor profile` run failed (its last output in the message) or ran past `timeout_s`.
    """
    from sailor.runtime.machine import merge_profile_dicts

    tps = class_tps(spec, load_job(job).model)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2])] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    job = Path(job).resolve()
    parts: dict[str, list[dict[str, Any]]] = {}
    with scratch_dir("sailor-testbed-profile-") as tmp:
        for nodes in profile_rounds(spec, tps, classes):
            measured, busy = {}, {}
            for node in spec.nodes:
                if nodes[node.name] is None:  # the load: its own class's TP-1 profile, every rank busy
                    busy[node.name] = profile_command(job, Path(tmp) / f"busy-{node.name}.json", mbs,
                                                      replicas=node.ranks)
                else:
                    name, t = nodes[node.name]
                    measured[node.name] = profile_command(job, Path(tmp) / f"{name}-tp{t}.json", mbs, tps=[t],
                                                          replicas=node.ranks // t)
            for node, (code, output) in _run_round(measured, busy, state, env, timeout_s,
                                                   {n.name: n.ranks for n in spec.nodes}).items():
                name, t = nodes[node]
                if code != 0:
                    raise RuntimeError(f"profiling device class {name} at TP {t} failed: {output.strip()[-500:]}")
                parts.setdefault(name, []).append(load_json(Path(tmp) / f"{name}-tp{t}.json"))
    return tp1_pass_overhead(merge([retag(merge_profile_dicts(parts[name]), spec.devices[name].gpu)
                                    for name in spec.devices if name in parts]))


def tp1_pass_overhead(profile: dict[str, Any]) -> dict[str, Any]:
    """`profile` with the fixed costs of a stage pass and of a pipeline transfer
    (`runtime.pass_overhead_s`, `runtime.p2p_overhead_s`) at TP 1 only; the simulator takes them for
    every TP degree (the nearest measured). At TP t its measurement runs 2·t
    ranks of the class in one node (`runtime.profile_passes`), which at t >= 2 outnumber a node's
    ranks: the ranks beyond them share a device's cgroup without a reservation of their own
    (`cgroups.place_ranks`; before, with one each beside the other nodes kept busy, they exceeded
    the deadline bandwidth the kernel admits on this 2-core machine, and the figure came out as 0
    forward and 4.0 ms backward where TP 1's was 0.25 and 0.04 ms, 2026-12-05)."""
    runtime = profile.get("runtime", {})
    for key in ("pass_overhead_s", "p2p_overhead_s"):
        if key in runtime:
            runtime[key] = [r for r in runtime[key] if r["tp"] == 1]
    return profile
