"""A quick profile of this machine for planning on the local provider, measured once and cached.

`sailor plan` (and `sailor simulate`) on the `local` provider without `--profiles` would otherwise
price every layer with the catalog's nominal CPU roofline, ~100x faster than `sailor train` runs the
tiny model. Instead `local_profiles` times the runtime's own layers with `sailor profile`'s machinery
(`profiler.profile_job`), briefly: TP 1 only (other TP degrees are scaled from it and labelled
estimated), micro-batch sizes QUICK_MBS (others interpolated), QUICK_WARMUP untimed and
QUICK_REPEATS timed passes; a few seconds on the 2-core build machines, most of it starting the
processes.

The result is cached as a profile file ("sailor.profiles/1") in `cache_dir()`:
$SAILOR_CACHE_DIR, else $XDG_CACHE_HOME/sailor, else ~/.cache/sailor, under `profiles/`. The file
name holds a hash of everything the timings depend on (`cache_key`): the model's architecture, the
sequence length, precision and optimizer, the torch version, the CPU model and core count, the
threads per process, the measurement settings and the Sailor version; a change of any of them
measures again. Files are written atomically (`fileio.write_json`). A cache entry that no longer
loads is measured again and replaced. Profile the machine properly (`sailor profile`, `--profiles`)
for anything beyond a first plan: `--profiles` always wins.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from sailor.core.errors import SailorInputError
from sailor.core.fileio import write_json
from sailor.perf.profiles import Profiles, profiles_from_dict
from sailor.specs.job import JobSpec

QUICK_TPS = (1,)
QUICK_MBS = (1, 4)
QUICK_WARMUP = 1
QUICK_REPEATS = 3


def cache_dir() -> Path:
    """Folder of cached machine profiles (module docstring)."""
    root = os.environ.get("SAILOR_CACHE_DIR")
    if root:
        return Path(root) / "profiles"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sailor" / "profiles"


def cache_key(job: JobSpec, *, threads: int = 1) -> dict[str, Any]:
    """Everything a quick profile's timings depend on, as a JSON-ready dict."""
    import torch

    from sailor.runtime.profiler import device_description, versions

    return {"schema": 1, "model": job.model.model_dump(mode="json"), "sequence_length": job.seq,
            "precision": job.precision, "optimizer": job.optimizer.value, "torch": torch.__version__,
            "sailor": versions().get("sailor"), "cpu": device_description("cpu"), "cores": os.cpu_count(),
            "threads": threads, "tps": list(QUICK_TPS), "mbs": list(QUICK_MBS), "warmup": QUICK_WARMUP,
            "repeats": QUICK_REPEATS}


def cache_path(job: JobSpec, *, threads: int = 1, folder: Path | None = None) -> Path:
    """Where the quick profile of `job` on this machine is cached."""
    digest = hashlib.sha256(json.dumps(cache_key(job, threads=threads), sort_keys=True).encode()).hexdigest()[:16]
    return (folder or cache_dir()) / f"{job.model.name}-{digest}.json"


def _measure(job: JobSpec, threads: int) -> dict[str, Any]:
    from sailor.runtime.profiler import ProfileOptions, profile_job

    return profile_job(ProfileOptions(job=job, device="cpu", tps=QUICK_TPS, mbs=QUICK_MBS, warmup=QUICK_WARMUP,
                                      repeats=QUICK_REPEATS, threads=threads))


def local_profiles(job: JobSpec, *, threads: int = 1, folder: Path | None = None,
                   measure: Callable[[JobSpec, int], dict[str, Any]] | None = None) -> tuple[Profiles, str]:
    """Profiles of `job` on this machine's CPU: from the cache, else measured now and cached.

    Args:
        job: what to time (must train in fp32, as the runtime does on CPU).
        threads: intra-op threads per process (torchrun gives each rank 1).
        folder: the cache folder (default `cache_dir()`).
        measure: the measurement (default `_measure`; tests pass a stand-in); returns a profile dict
            in our format.
    Returns:
        (profiles, one line saying where they came from).
    Raises:
        SailorInputError: the job cannot be profiled here (e.g. bf16 on CPU), or the cache folder
            cannot be written.
    """
    path = cache_path(job, threads=threads, folder=folder)
    if path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            prof = profiles_from_dict(data, str(path))
            prof.check_job(job, str(path))
            return prof, f"profile of this machine from the cache {path} (measured {data.get('date', '?')})"
        except (OSError, ValueError):
            pass  # unreadable or stale: measure again and replace it (SailorInputError is a ValueError)
    t0 = time.perf_counter()
    data = (measure or _measure)(job, threads)
    took = time.perf_counter() - t0
    prof = profiles_from_dict(data, str(path))
    try:
        write_json(path, data)
    except SailorInputError as e:
        raise SailorInputError(f"cannot cache the machine profile: {e.message}", source=str(path),
                               fix="set SAILOR_CACHE_DIR to a writable folder, or pass --profiles") from None
    return prof, (f"measured this machine in {took:.1f} s (TP {','.join(map(str, QUICK_TPS))}, micro-batch"
                  f" {','.join(map(str, QUICK_MBS))}) and cached it at {path}; `sailor profile` measures"
                  " more carefully, --profiles uses a profile")
