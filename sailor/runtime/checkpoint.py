"""Plan-independent checkpoints: each rank writes and hashes its own shard; rank 0 commits.

Layout under the checkpoint folder D (format 2):
```
D/step-00000005/manifest.json       {"format", "step", "seed", "model", "global_batch_size", "job",
                                     "keys": ["param", ...], "tensors": {name: full shape},
                                     "ranks": {"<r>": {"stage", "pipeline", "tp_rank", "index", "data"}},
                                     "files": {file name: {"sha256", "bytes"}}}
D/step-00000005/rank-00003.bin      rank 3's elements, fp32 little-endian, entry after entry
D/step-00000005/rank-00003.json     its index: {"rank", "stage", "pipeline", "tp_rank", "file", "bytes",
                                     "sha256", "entries": [{"name", "key", "dim", "start", "width",
                                     "lo", "hi", "offset", "sha256"}]}
```
The layout is independent of the plan: an entry holds elements [lo, hi) of the row-major flattening
of the slice [start, start + width) along `dim` of the full (unsharded) tensor `key` ("param",
"exp_avg", "exp_avg_sq") of canonical parameter `name` (`dim` None: the whole tensor). Each rank
writes the elements it owns under ZeRO (`ShardedAdamW.checkpoint_entries`; an unsharded bucket by its
lowest rank only), so every element is written exactly once and all ranks write in parallel: a
rank streams its entries to its own file, hashing them (SHA-256, per entry and per file) as it
writes, fsyncs, and writes its index. A blocking barrier (`sync.barrier`) then waits for every rank;
rank 0 reads the small index files only (never the data), checks that the entries cover every
element of every tensor of the layout exactly once (`check_coverage`), writes the manifest (fsync),
renames `D/.tmp-step-<n>` to `D/step-<n>` and fsyncs `D`. A rank resuming under any plan reads only
the byte ranges of the entries that overlap its own TP shards, verifying each entry's SHA-256
(`checkpoint_io.Reader`).

`step` is the number of optimizer steps taken, so resuming runs step `step` next and no sample is
skipped or repeated. A folder without a manifest, or whose files do not match it, is never loaded:
`find_latest` (the launcher, before any rank starts) hashes every file, in parallel and streaming,
falls back to the previous checkpoint and says why. Format 1 (`sailor-checkpoint-1`: one
`torch.save` file of full tensors per stage, written by pipeline 0) is still read.

We do not use `torch.distributed.checkpoint`: its resharding works on DTensor meshes, and the replicas
of one stage here have different TP degrees and ZeRO shards (a layout it does not describe). This
module does not import torch, so that the launcher can pick a checkpoint without it; the tensor
side is `checkpoint_io`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sailor.core.errors import SailorInputError

if TYPE_CHECKING:
    from sailor.specs.job import JobSpec

FORMAT = "sailor-checkpoint-2"
FORMAT_1 = "sailor-checkpoint-1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_STAGE_FILE = re.compile(r"^stage-\d+\.pt$")
_RANK_FILE = re.compile(r"^rank-\d{5}\.(bin|json)$")
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")
_CHUNK = 1 << 24  # bytes read per hash update (16 MiB)


class CheckpointError(RuntimeError):
    """A checkpoint folder that is incomplete, does not cover its tensors, or fails its checksums."""


@dataclass(frozen=True)
class Found:
    """The checkpoint `find_latest` chose, and the newer ones it skipped (with the reason)."""

    path: Path | None
    manifest: dict[str, Any] | None
    skipped: tuple[str, ...]


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".tmp-step-{step:08d}"


def rank_files(rank: int) -> tuple[str, str]:
    """(data file, index file) names of rank `rank`."""
    return f"rank-{rank:05d}.bin", f"rank-{rank:05d}.json"


def prepare_tmp(root: str | Path, step: int) -> Path:
    """An empty temporary folder for step `step` (left-overs of a crashed attempt removed)."""
    tmp = tmp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> tuple[str, int]:
    """(SHA-256 hex digest, size in bytes) of file `path`, read in 16 MiB chunks (raises OSError)."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: str | Path, *, verify: bool = True) -> dict[str, Any]:
    """The manifest of checkpoint folder `path` after checking its shape and that every file it lists
    is there with its size; `verify`: also each file's SHA-256 (every file read once, in parallel).
    A rank resuming passes verify=False and checks what it reads, entry by entry.

    Raises:
        CheckpointError: no manifest, an unknown format, a malformed manifest, or a file missing or
            not matching.
    """
    p = Path(path)
    try:
        manifest = json.loads((p / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{p}: no readable manifest ({e})") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if fmt not in (FORMAT, FORMAT_1):
        raise CheckpointError(f"{p / 'manifest.json'}: format: unknown format {fmt!r}")
    problem = _manifest_problem(manifest, fmt)
    if problem:
        raise CheckpointError(f"{p / 'manifest.json'}: {problem}")
    files = manifest["files"]
    names = sorted(files)
    if verify:
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
            list(pool.map(lambda n: _check_file(p / n, files[n], hash_it=True), names))
    else:
        for n in names:
            _check_file(p / n, files[n], hash_it=False)
    return manifest


def _manifest_problem(manifest: dict[str, Any], fmt: str) -> str | None:
    """What is wrong with a manifest of format `fmt`, as "<field>: <problem>" (None: nothing).
    `keys` must be ["param"] or ["param", *OPTIMIZER_KEYS], the two lists `commit` writes."""
    files, tensors, step = manifest.get("files"), manifest.get("tensors"), manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step: {step!r} is not a whole number >= 0"
    if not isinstance(files, dict):
        return "files: not a mapping of file names"
    pattern = _RANK_FILE if fmt == FORMAT else _STAGE_FILE
    for name, m in files.items():
        if not pattern.match(str(name)):
            return f"files.{name}: not a file name of format {fmt}"
        if not (isinstance(m, dict) and isinstance(m.get("sha256"), str) and isinstance(m.get("bytes"), int)
                and not isinstance(m.get("bytes"), bool)):
            return f"files.{name}: needs sha256 (text) and bytes (a whole number)"
    if not isinstance(tensors, dict):
        return "tensors: not a mapping of parameter names"
    if fmt != FORMAT:
        missing = [n for n, f in tensors.items() if f not in files]
        return f"tensors.{missing[0]}: its file is not listed under files" if missing else None
    for name, shape in tensors.items():
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                                for d in shape)):
            return f"tensors.{name}: {shape!r} is not a shape (a list of whole numbers > 0)"
    keys = manifest.get("keys")
    if keys not in (["param"], ["param", *OPTIMIZER_KEYS]):
        return f"keys: {keys!r} is neither ['param'] nor {['param', *OPTIMIZER_KEYS]!r}"
    ranks = manifest.get("ranks")
    if not isinstance(ranks, dict) or not ranks:
        return "ranks: not a non-empty mapping of ranks"
    for r, info in ranks.items():
        if not (isinstance(info, dict) and info.get("index") in files and info.get("data") in files):
            return f"ranks.{r}: its index and data files are not both listed under files"
    return _loss_scaler_problem(manifest.get("loss_scaler", {})) or _scaler_vs_step(manifest)


def _loss_scaler_problem(state: Any) -> str | None:
    """What is wrong with a manifest's "loss_scaler" (`LossScaler.state_dict()` of an fp16 run:
    scale, a finite number >= the default min_scale 1; clean_steps and skipped, whole numbers >= 0),
    which the worker passes to `LossScaler(**state)`; None when it is usable or absent."""
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(state, dict) or not set(state) <= {"scale", "clean_steps", "skipped"}:
        return f"loss_scaler: {state!r} is not a mapping of scale, clean_steps and skipped"
    scale = state.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 1.0 <= scale < float("inf"):
        return f"loss_scaler.scale: {scale!r} is not a finite number >= 1"
    bad = [k for k in ("clean_steps", "skipped") if k in state and not whole(state[k])]
    return f"loss_scaler.{bad[0]}: {state[bad[0]]!r} is not a whole number >= 0" if bad else None


def _scaler_vs_step(manifest: dict[str, Any]) -> str | None:
    """A loss scaler that skipped more steps than the checkpoint's run took (`optimizer_steps` < 0)."""
    if optimizer_steps(manifest) < 0:
        return f"loss_scaler.skipped: {manifest['loss_scaler']['skipped']} steps skipped, more than step {manifest['step']}"
    return None


def _check_file(path: Path, meta: Mapping[str, Any], *, hash_it: bool) -> None:
    """Raise CheckpointError unless `path` has the size (and, `hash_it`, the SHA-256) `meta` gives."""
    try:
        if hash_it:
            digest, size = file_sha256(path)
        else:
            digest, size = meta["sha256"], path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if size != meta["bytes"] or digest != meta["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch")


def read_verified(path: Path, meta: Mapping[str, Any]) -> bytes:
    """The bytes of a small file after checking them against `meta` ({"sha256", "bytes"})."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
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


def check_coverage(layout: Mapping[str, Iterable[int]], keys: Iterable[str], entries: Iterable[Mapping[str, Any]],
                   *, source: str) -> None:
    """Raise CheckpointError unless `entries` (the rank indexes' entries) cover every element of
    tensor `key` of every parameter of `layout` ({name: full shape}) exactly once, for each of `keys`.

    Every entry of one tensor must slice it along the same dimension (or be the whole tensor); the
    slices must partition that dimension, and the entries' flat ranges [lo, hi) each slice's elements.
    """
    by: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for e in entries:
        by.setdefault((e["name"], e["key"]), []).append(e)
    want = {(n, k) for n in layout for k in keys}
    extra = sorted(set(by) - want)
    if extra:
        raise CheckpointError(f"{source}: entries for {extra[0][1]} of {extra[0][0]}, which the layout does not have")
    for name, shape in layout.items():
        shape = list(shape)
        numel = _prod(shape)
        for key in keys:
            got = by.get((name, key))
            if not got:
                raise CheckpointError(f"{source}: no rank wrote {key} of {name}")
            slices: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
            for e in got:
                dim, start, width = (0, 0, shape[0]) if e["dim"] is None else (e["dim"], e["start"], e["width"])
                slices.setdefault((dim, start, width), []).append((e["lo"], e["hi"]))
            dims = {d for d, _, _ in slices}
            if len(dims) != 1 or not 0 <= next(iter(dims)) < len(shape):
                raise CheckpointError(f"{source}: {key} of {name} is sliced along dimensions {sorted(dims)}")
            dim = dims.pop()
            bounds = sorted((s, s + w) for _, s, w in slices)
            if not _partitions(bounds, shape[dim]):
                raise CheckpointError(f"{source}: the slices of {key} of {name} do not cover dimension {dim}"
                                      f" ({shape[dim]}) exactly once: {bounds[:4]}")
            for (_, start, width), ranges in slices.items():
                if not _partitions(sorted(ranges), numel // shape[dim] * width):
                    raise CheckpointError(f"{source}: the entries of {key} of {name} (slice {start}+{width}) do not"
                                          f" cover it exactly once: {sorted(ranges)[:4]}")


def _partitions(ranges: list[tuple[int, int]], n: int) -> bool:
    """Whether sorted half-open `ranges` are non-empty and tile [0, n) exactly."""
    end = 0
    for lo, hi in ranges:
        if lo != end or hi <= lo:
            return False
        end = hi
    return end == n


def _prod(shape: Iterable[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def commit(root: str | Path, step: int, meta: dict[str, Any], *, layout: Mapping[str, Iterable[int]],
           keys: Iterable[str], world_size: int) -> Path:
    """Rank 0, after every rank wrote its files into `tmp_dir(root, step)` and passed a blocking
    barrier: check each rank's index (present, its data file's size) and the coverage of `layout` for
    `keys`, write the manifest listing every rank's files with the hashes their indexes give (the data
    is not read again), and rename the folder into place atomically. `meta`: `run_meta`. Returns the
    final folder.

    Raises:
        CheckpointError: a rank's index or data file is missing or of the wrong size, or the entries
            do not cover the layout exactly once (nothing is renamed).
    """
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    keys = list(keys)
    files: dict[str, dict[str, Any]] = {}
    ranks: dict[str, dict[str, Any]] = {}
    entries: list[dict[str, Any]] = []
    for r in range(world_size):
        data_name, index_name = rank_files(r)
        try:
            raw = (tmp / index_name).read_bytes()
            index = json.loads(raw)
            size = (tmp / data_name).stat().st_size
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{tmp}: rank {r} wrote no complete shard ({e})") from None
        if index.get("rank") != r or index.get("file") != data_name or size != index.get("bytes"):
            raise CheckpointError(f"{tmp / index_name}: does not describe {data_name} ({size} bytes)")
        files[data_name] = {"sha256": index["sha256"], "bytes": size}
        files[index_name] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
        ranks[str(r)] = {k: index.get(k) for k in ("stage", "pipeline", "tp_rank")} | {"index": index_name,
                                                                                        "data": data_name}
        entries += index["entries"]
    layout = {n: list(s) for n, s in layout.items()}
    check_coverage(layout, keys, entries, source=str(tmp))
    manifest = {"format": FORMAT, "step": step, **meta, "keys": keys, "tensors": layout, "ranks": ranks,
                "files": files}
    write_synced(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
    _fsync_dir(tmp)
    if final.exists():  # the same step written again (e.g. a rerun): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(Path(root))
    return final


def optimizer_steps(manifest: Mapping[str, Any]) -> int:
    """Optimizer steps a checkpoint's run had taken: its `step` less the steps fp16 skipped on an
    overflow (its "loss_scaler"'s `skipped`, `runtime.scaler`), which advanced the step but not the
    optimizer (Adam's bias correction counts optimizer steps; the moments exist once one was taken)."""
    return manifest["step"] - int((manifest.get("loss_scaler") or {}).get("skipped", 0))


def run_meta(job: JobSpec, seed: int) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (the data order and parameter shapes
    depend on all of it): seed, model, global batch, and the job's sequence length, precision and
    optimizer, and the recipe's optimizer settings and schedule (a resumed run goes on with the same
    ones). The worker writes it into every manifest; `check_compatible` compares it."""
    recipe = job.recipe.model_dump(mode="json", include={"optimizer", "schedule"})
    return {"seed": seed, "model": job.model.model_dump(mode="json"), "global_batch_size": job.global_batch_size,
            "job": {"sequence_length": job.seq, "precision": job.precision, "optimizer": job.optimizer.value,
                    "recipe": recipe}}


def check_compatible(manifest: dict[str, Any], want: dict[str, Any], *, source: str) -> None:
    """Raise SailorInputError unless a checkpoint was written by a run with the same `run_meta`
    (a manifest written before `job` was recorded is compared on seed, model and global batch; one
    written before the recipe was recorded, without it)."""
    fix = "resume with the same job and seed, or use another --checkpoint-dir"
    for key, value in want.items():
        have = manifest.get(key)
        if key == "job" and isinstance(have, dict):
            for k, v in value.items():
                if k == "recipe" and k not in have:
                    continue
                if k == "recipe" and isinstance(have[k], dict) and have[k] != v:
                    path, old, new = _first_difference(have[k], v, "recipe")
                    raise SailorInputError(f"the checkpoint was written by a job with {path} {old!r}, this run's job"
                                           f" has {new!r}", source=source, fix=fix)
                if have.get(k) != v:
                    raise SailorInputError(f"the checkpoint was written by a job with {k} {have.get(k)!r}, this"
                                           f" run's job has {v!r}", source=source, fix=fix)
        elif key != "job" and have != value:
            raise SailorInputError(f"the checkpoint was written with {key} {_describe(have)}, this run has"
                                   f" {_describe(value)}", source=source, fix=fix)


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any]:
    """(dotted path, value in `a`, value in `b`) of the first leaf where two nested dicts differ
    (keys in sorted order); (path, a, b) when they differ at the top."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    return path, a, b


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


def prune(root: str | Path, *, keep: int, upto: int) -> list[Path]:
    """Delete all but the newest `keep` (>= 1) `step-<n>` folders with n <= `upto`, the step just
    committed (the recipe's `checkpoint.keep`; rank 0 calls it after each commit, so the one just
    written is always kept). Folders of later steps are left alone: they exist only when a run went
    back to an earlier checkpoint because they failed verification (`find_latest`), and the run
    replaces them as it reaches their steps. Returns the folders deleted, oldest first."""
    assert keep >= 1, keep
    old = [d for d in _step_dirs(root) if int(_STEP_DIR.match(d.name).group(1)) <= upto][:-keep]
    for d in old:
        shutil.rmtree(d, ignore_errors=True)
    return old


def newest_step_dir(root: str | Path) -> Path | None:
    """The newest `step-<n>` folder under `root`, verified or not (None when there is none)."""
    dirs = _step_dirs(root)
    return dirs[-1] if dirs else None
