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
from typing import Any

from sailor.errors import SailorInputError

FORMAT = "sailor-checkpoint-1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
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
    """The manifest of checkpoint folder `path` after checking every file's size and SHA-256.

    Raises:
        CheckpointError: no manifest, an unknown format, or a file missing or not matching.
    """
    p = Path(path)
    try:
        manifest = json.loads((p / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: no readable manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{p}: unknown format {manifest.get('format')!r}")
    for name, meta in manifest["files"].items():
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
    """The newest checkpoint under `root` that passes its checksums (path None if there is none)."""
    r = Path(root)
    steps = sorted((int(m.group(1)), d) for d in (r.iterdir() if r.is_dir() else [])
                   if (m := _STEP_DIR.match(d.name)) and d.is_dir())
    skipped = []
    for _, d in reversed(steps):
        try:
            return Found(d, read_manifest(d), tuple(skipped))
        except CheckpointError as e:
            skipped.append(str(e))
    return Found(None, None, tuple(skipped))


def check_compatible(manifest: dict[str, Any], *, model: dict[str, Any], seed: int, global_batch_size: int,
                     source: str) -> None:
    """Raise SailorInputError unless a checkpoint was made for the same model, seed and global batch
    (data order and parameter shapes depend on them)."""
    for key, want in (("model", model), ("seed", seed), ("global_batch_size", global_batch_size)):
        if manifest.get(key) != want:
            raise SailorInputError(f"the checkpoint was written with {key} {manifest.get(key)!r}, this run has {want!r}",
                                   source=source, fix="resume with the same job and seed, or use another --checkpoint-dir")


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
