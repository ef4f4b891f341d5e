"""A quick profile of this machine for planning on the local provider, measured once and cached.

`sailor plan`, `sailor simulate`, `sailor run` and `sailor replay` on the `local` provider without
`--profiles` would otherwise price every layer with the catalog's nominal CPU roofline, ~100x
faster than `sailor train` runs the tiny model. Instead `local_profiles` times the runtime's own
layers with `sailor profile`'s machinery (`profiler.profile_job`), briefly, at every TP degree the
planner can choose on the cluster (`considered_tps`), each with its real TP processes and their
all-reduces, so that no TP degree is priced from a measurement that ran none of its collectives;
each with as many processes at once as the cluster has GPUs (`replicas_at_once`), as a plan using
them all runs; micro-batch sizes QUICK_MBS (others interpolated), QUICK_WARMUP untimed and
QUICK_REPEATS timed passes. A few seconds per TP degree on the 2-core build machines, most of it
starting the processes.

Each TP degree is cached as a profile file ("sailor.profiles/1") of its own in `cache_dir()`:
$SAILOR_CACHE_DIR, else $XDG_CACHE_HOME/sailor, else ~/.cache/sailor, under `profiles/`. The file
name holds a hash of everything the timings depend on (`cache_key`): the model's architecture, the
sequence length, precision and optimizer, the torch version, the CPU model and core count, the
threads per process, the TP degree and the processes timed at once, the measurement settings and
the Sailor version; a change of any of them measures again (a cluster with more GPUs measures only
the TP degrees it adds, and those whose load changed). Files are written atomically
(`fileio.write_json`). A cache entry that no longer loads is measured again and replaced. Profile
the machine properly (`sailor profile`, `--profiles`) for anything beyond a first plan:
`--profiles` always wins.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sailor.core.errors import SailorInputError
from sailor.core.fileio import write_json
from sailor.core.limits import max_local_processes
from sailor.perf.profile_lookup import Profiles
from sailor.perf.profiles import RUNTIME_ROWS, profiles_from_dict
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

QUICK_MBS = (1, 4)
QUICK_WARMUP = 1
QUICK_REPEATS = 3
LOCAL_GPU = "cpu"  # the local provider's one GPU type


def cache_dir() -> Path:
    """Folder of cached machine profiles (module docstring)."""
    root = os.environ.get("SAILOR_CACHE_DIR")
    if root:
        return Path(root) / "profiles"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sailor" / "profiles"


def considered_tps(job: JobSpec, cluster: ClusterSpec) -> tuple[int, ...]:
    """The TP degrees the planner can choose for the local GPU type on `cluster`: those of
    `ModelSpec.tp_degrees` up to the node size and to the GPUs the cluster offers (a TP group of t
    needs t GPUs; `planner.prune`), e.g. (1, 2, 4) for `tiny` (4 heads) on 4 GPUs."""
    return tuple(job.model.tp_degrees(min(cluster.node_size(LOCAL_GPU), local_gpus(cluster))))


def local_gpus(cluster: ClusterSpec) -> int:
    """GPUs (processes) of the local GPU type `cluster` offers: what a plan using them all runs at once."""
    return max(1, sum(n for z in cluster.zones.values() for g, n in z.items() if g == LOCAL_GPU))


def replicas_at_once(tp: int, processes: int) -> int:
    """TP groups of `tp` timed at once so that the machine runs about `processes` processes, as a
    plan using all of them does (each rank then sees the others' load), capped by
    `limits.max_local_processes`; at least one."""
    return max(1, min(processes, max_local_processes()) // tp)


def cache_key(job: JobSpec, *, tp: int = 1, processes: int = 1, threads: int = 1) -> dict[str, Any]:
    """Everything the quick profile of one TP degree depends on, as a JSON-ready dict."""
    import torch

    from sailor.runtime.profiler import device_description, versions

    return {"schema": 2, "model": job.model.model_dump(mode="json"), "sequence_length": job.seq,
            "precision": job.precision, "optimizer": job.optimizer.value, "torch": torch.__version__,
            "sailor": versions().get("sailor"), "cpu": device_description("cpu"), "cores": os.cpu_count(),
            "threads": threads, "tp": tp, "replicas": replicas_at_once(tp, processes), "mbs": list(QUICK_MBS),
            "warmup": QUICK_WARMUP, "repeats": QUICK_REPEATS}


def cache_path(job: JobSpec, *, tp: int = 1, processes: int = 1, threads: int = 1, folder: Path | None = None) -> Path:
    """Where the quick profile of `job` at TP `tp` on this machine is cached."""
    key = cache_key(job, tp=tp, processes=processes, threads=threads)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (folder or cache_dir()) / f"{job.model.name}-tp{tp}-{digest}.json"


def _measure(job: JobSpec, threads: int, tp: int, replicas: int) -> dict[str, Any]:
    from sailor.runtime.profiler import ProfileOptions, profile_job

    return profile_job(ProfileOptions(job=job, device="cpu", tps=(tp,), mbs=QUICK_MBS, warmup=QUICK_WARMUP,
                                      repeats=QUICK_REPEATS, threads=threads, concurrency=replicas))


def runnable_tps(job: JobSpec, tps: tuple[int, ...]) -> tuple[int, ...]:
    """The degrees of `tps` the runtime can run for `job` on this machine (they divide its heads, FFN
    and vocabulary: `profiler.check_options`; at most `limits.max_local_processes` processes); the
    others stay estimated and are labelled so."""
    from sailor.runtime.profiler import ProfileOptions, check_options

    ok = []
    for t in tps:
        if t > max_local_processes():
            continue
        try:
            check_options(ProfileOptions(job=job, device="cpu", tps=(t,), mbs=QUICK_MBS, concurrency=1))
        except SailorInputError as e:
            if e.field != "--tp":
                raise
            continue
        ok.append(t)
    return tuple(ok)


def merge_profile_dicts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One profile dict ("sailor.profiles/1") from profiles of the same job at different TP degrees:
    their layer, memory and runtime rows side by side, the optimizer figure and header of the first
    (lowest TP), each part's settings under settings.by_tp. Raises ValueError for no parts."""
    if not parts:
        raise ValueError("no profiles to merge")
    out = {k: v for k, v in parts[0].items() if k not in ("layers", "memory", "runtime", "settings")}
    out["layers"] = [row for d in parts for row in d.get("layers", [])]
    out["memory"] = [row for d in parts for row in d.get("memory", [])]
    runtime = {key: [row for d in parts for row in d.get("runtime", {}).get(key, [])] for key in RUNTIME_ROWS}
    if any(runtime.values()):
        out["runtime"] = {key: rows for key, rows in runtime.items() if rows}
    out["settings"] = {"by_tp": {str(d["layers"][0]["tp"]): d.get("settings", {}) for d in parts if d.get("layers")}}
    return out


def _cached(path: Path, job: JobSpec) -> dict[str, Any] | None:
    """The profile dict cached at `path` when it loads and fits `job`; None otherwise."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        profiles_from_dict(data, str(path)).check_job(job, str(path))
        return data
    except (OSError, ValueError):
        return None  # unreadable or stale: measured again and replaced (SailorInputError is a ValueError)


def local_profiles(job: JobSpec, *, tps: tuple[int, ...] = (1,), processes: int = 1, threads: int = 1,
                   folder: Path | None = None,
                   measure: Callable[[JobSpec, int, int, int], dict[str, Any]] | None = None,
                   announce: Callable[[str], None] | None = None) -> tuple[Profiles, str]:
    """Profiles of `job` on this machine's CPU at every TP degree of `tps` the runtime can run
    (`runnable_tps`): each from the cache, else measured now (with `replicas_at_once(tp, processes)`
    TP groups timed together) and cached on its own.

    Args:
        job: what to time (must train in fp32, as the runtime does on CPU).
        tps: TP degrees to measure (`considered_tps`: those the planner can choose).
        processes: GPUs (processes) a plan on the cluster runs at once (`local_gpus`).
        threads: intra-op threads per process (torchrun gives each rank 1).
        folder: the cache folder (default `cache_dir()`).
        measure: the measurement of one TP degree (default `_measure`; tests pass a stand-in):
            (job, threads, tp, replicas) -> a profile dict in our format.
        announce: told one line before each measurement starts (it may take minutes at a long
            sequence), e.g. printed on stderr.
    Returns:
        (profiles, one line saying which TP degrees were measured now, read from the cache, or not
        measured).
    Raises:
        SailorInputError: the job cannot be profiled here (e.g. bf16 on CPU), or the cache folder
            cannot be written.
    """
    want = sorted(set(tps)) or [1]
    runnable = runnable_tps(job, tuple(want)) or (1,)
    parts, fresh, cached, took = [], [], [], 0.0
    for tp in runnable:
        path = cache_path(job, tp=tp, processes=processes, threads=threads, folder=folder)
        data = _cached(path, job)
        if data is None:
            if announce is not None:
                announce(f"measuring this machine at TP {tp} (sequence {job.seq}; minutes at a long sequence,"
                         f" a smaller sequence_length in the job is quicker)")
            t0 = time.perf_counter()
            data = (measure or _measure)(job, threads, tp, replicas_at_once(tp, processes))
            took += time.perf_counter() - t0
            profiles_from_dict(data, str(path))  # what we cache must load
            try:
                write_json(path, data)
            except SailorInputError as e:
                raise SailorInputError(f"cannot cache the machine profile: {e.message}", source=str(path),
                                       fix="set SAILOR_CACHE_DIR to a writable folder, or pass --profiles") from None
            fresh.append(tp)
        else:
            cached.append((tp, data.get("date", "?")))
        parts.append(data)
    where = folder or cache_dir()
    prof = profiles_from_dict(merge_profile_dicts(parts), str(where))
    said = []
    if fresh:
        said.append(f"measured this machine in {took:.1f} s at TP {_tp_list(fresh)} (micro-batch"
                    f" {','.join(map(str, QUICK_MBS))}, {processes} process(es) at once) and cached it in {where}")
    if cached:
        said.append(f"profile of this machine at TP {_tp_list([t for t, _ in cached])} from the cache {where}"
                    f" (measured {min(d for _, d in cached)})")
    skipped = [t for t in want if t not in runnable]
    if skipped:
        said.append(f"TP {_tp_list(skipped)} not measured (the runtime cannot split {job.model.name} that way, or"
                    " this machine cannot run that many processes): estimated, and labelled so")
    return prof, "; ".join(said) + "; `sailor profile` measures more carefully, --profiles uses a profile"


def _tp_list(tps) -> str:
    return ",".join(map(str, tps))
