"""Plan-independent checkpoints: full tensors by canonical name, written atomically, checksummed.

Layout under the checkpoint folder D:
```
D/step-00000005/manifest.json   {"format", "step", "seed", "model", "global_batch_size",
                                 "files": {"stage-0.pt": {"sha256", "bytes"}}, "tensors": {name: file}}
D/step-00000005/stage-<i>.pt    {canonical name: {"param", "exp_avg", "exp_avg_sq"}} (full tensors)
```
`step` is the number of optimizer steps taken, so resuming runs step `step` next and no sample is
skipped or repeated. Pipeline 0 writes: each of its replicas gathers full tensors over its TP group
and its TP rank 0 writes one file per stage into `D/.tmp-step-<n>/`; rank 0 then hashes the files,
writes the manifest (fsync), renames the folder to `D/step-<n>` and fsyncs `D`. A folder without a
manifest, or whose files do not match their checksums, is never loaded: `find_latest` falls back to
the previous one and says why. Files are read with `torch.load(weights_only=True)` from verified
bytes, so nothing is unpickled beyond tensors and plain containers.

We do not use `torch.distributed.checkpoint`: its resharding works on DTensor meshes, and the replicas
of one stage here have different TP degrees (a meshes-per-replica layout it does not describe); full
tensors per stage are small enough and load under any plan. The import of torch is lazy so that the
launcher can pick a checkpoint without it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sailor.core.errors import SailorInputError

if TYPE_CHECKING:
    from sailor.specs.job import JobSpec

FORMAT = "sailor-checkpoint-1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_STAGE_FILE = re.compile(r"^stage-\d+\.pt$")
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint folder that is incomplete or fails its checksums."""


@dataclass(frozen=True)
class Found:
    """The checkpoint `find_latest` chose, and the newer ones it skipped (with the reason)."""

    path: Path | None
    manifest: dict[str, Any] | None
    skipped: tuple[str, ...]


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of checkpoint folder `path` after checking its shape and every file's size and SHA-256.

    Raises:
        CheckpointError: no manifest, an unknown format, a malformed manifest, or a file missing or
            not matching.
    """
    p = Path(path)
    try:
        manifest = json.loads((p / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{p}: no readable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{p}: unknown format {manifest.get('format') if isinstance(manifest, dict) else None!r}")
    files, tensors, step = manifest.get("files"), manifest.get("tensors"), manifest.get("step")
    if (not isinstance(files, dict) or not isinstance(tensors, dict) or isinstance(step, bool)
            or not isinstance(step, int) or step < 0
            or not all(isinstance(m, dict) and isinstance(m.get("sha256"), str) and isinstance(m.get("bytes"), int)
                       and _STAGE_FILE.match(str(name)) for name, m in files.items())
            or not all(isinstance(f, str) and f in files for f in tensors.values())):
        raise CheckpointError(f"{p}: malformed manifest")
    for name, meta in files.items():
        _read_verified(p / name, meta)
    return manifest


def _read_verified(path: Path, meta: dict[str, Any]) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if len(data) != meta["bytes"] or _sha256(data) != meta["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch")
    return data


def find_latest(root: str | Path) -> Found:
    """The newest checkpoint under `root` that passes its checksums and whose manifest names the step
    of its folder (path None if there is none)."""
    skipped = []
    for d in reversed(_step_dirs(root)):
        try:
            manifest = read_manifest(d)
            if d.name != step_dir(root, manifest["step"]).name:  # the manifest itself is not hashed
                raise CheckpointError(f"{d}: its manifest says step {manifest['step']}")
            return Found(d, manifest, tuple(skipped))
        except CheckpointError as e:
            skipped.append(str(e))
    return Found(None, None, tuple(skipped))


def run_meta(job: "JobSpec", seed: int) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (the data order and parameter shapes
    depend on all of it): seed, model, global batch, and the job's sequence length, precision and
    optimizer. The worker writes it into every manifest; `check_compatible` compares it."""
    return {"seed": seed, "model": job.model.model_dump(mode="json"), "global_batch_size": job.global_batch_size,
            "job": {"sequence_length": job.seq, "precision": job.precision, "optimizer": job.optimizer.value}}


def check_compatible(manifest: dict[str, Any], want: dict[str, Any], *, source: str) -> None:
    """Raise SailorInputError unless a checkpoint was written by a run with the same `run_meta`
    (a manifest written before `job` was recorded is compared on seed, model and global batch)."""
    fix = "resume with the same job and seed, or use another --checkpoint-dir"
    for key, value in want.items():
        have = manifest.get(key)
        if key == "job" and isinstance(have, dict):
            for k, v in value.items():
                if have.get(k) != v:
                    raise SailorInputError(f"the checkpoint was written by a job with {k} {have.get(k)!r}, this"
                                           f" run's job has {v!r}", source=source, fix=fix)
        elif key != "job" and have != value:
            raise SailorInputError(f"the checkpoint was written with {key} {_describe(have)}, this run has"
                                   f" {_describe(value)}", source=source, fix=fix)


def _describe(value: Any) -> str:
    """A model dict as "name (N blocks, hidden H)", anything else as its repr."""
    if isinstance(value, dict) and {"name", "num_blocks", "hidden_size"} <= value.keys():
        return f"{value['name']} ({value['num_blocks']} blocks, hidden {value['hidden_size']})"
    return repr(value)


def _step_dirs(root: str | Path) -> list[Path]:
    """The `step-<n>` folders under `root`, oldest first (verified or not)."""
    r = Path(root)
    steps = sorted((int(m.group(1)), d) for d in (r.iterdir() if r.is_dir() else [])
                   if (m := _STEP_DIR.match(d.name)) and d.is_dir())
    return [d for _, d in steps]


def newest_step_dir(root: str | Path) -> Path | None:
    """The newest `step-<n>` folder under `root`, verified or not (None when there is none)."""
    dirs = _step_dirs(root)
    return dirs[-1] if dirs else None


def load_tensors(path: str | Path, manifest: dict[str, Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """Full tensors (param and optimizer moments) of canonical parameters `names` from a checkpoint,
    reading only the files that hold them, each verified against its checksum.

    Raises:
        CheckpointError: a file fails its checksum or a name is missing.
    """
    import torch

    p = Path(path)
    missing = [n for n in names if n not in manifest["tensors"]]
    if missing:
        raise CheckpointError(f"{p}: no tensors for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    out: dict[str, dict[str, Any]] = {}
    for fname in sorted({manifest["tensors"][n] for n in names}):
        data = _read_verified(p / fname, manifest["files"][fname])
        content = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        out.update({n: v for n, v in content.items() if n in names})
    return out


def write_stage_file(tmp: Path, stage: int, tensors: dict[str, dict[str, Any]]) -> None:
    """Write one stage's full tensors into the temporary folder (fsynced)."""
    import torch

    buf = io.BytesIO()
    torch.save(tensors, buf)
    for name, data in ((f"stage-{stage}.pt", buf.getvalue()),
                       (f"stage-{stage}.names.json", json.dumps(sorted(tensors)).encode())):
        with open(tmp / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".tmp-step-{step:08d}"


def prepare_tmp(root: str | Path, step: int) -> Path:
    """An empty temporary folder for step `step` (left-overs of a crashed attempt removed)."""
    tmp = tmp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(root: str | Path, step: int, meta: dict[str, Any]) -> Path:
    """Hash the stage files in the temporary folder, write the manifest and rename the folder into
    place atomically. `meta` holds seed, model and global batch size. Returns the final folder."""
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    files, tensors = {}, {}
    for f in sorted(tmp.glob("stage-*.pt")):
        data = f.read_bytes()
        files[f.name] = {"sha256": _sha256(data), "bytes": len(data)}
        names_file = f.with_suffix(".names.json")
        for name in json.loads(names_file.read_text()):
            tensors[name] = f.name
        names_file.unlink()
    manifest = {"format": FORMAT, "step": step, **meta, "files": files, "tensors": tensors}
    with open(tmp / "manifest.json", "w") as f:
        f.write(json.dumps(manifest, indent=1))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # the same step written again (e.g. a rerun): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(Path(root))
    return final
