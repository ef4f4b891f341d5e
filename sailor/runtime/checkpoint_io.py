"""The tensor side of checkpoints (layout and commit in `checkpoint`): each rank's shard file,
written as a stream, and the reader that takes any plan's TP shards out of any plan's checkpoint.

Elements are stored as fp32 in the host's byte order (little-endian on every platform torch ships
for), entry after entry; an entry is streamed in chunks of at most 16 MiB (copied to the host one
chunk at a time), and the file's and the entry's SHA-256 are updated with the very bytes written, so
no rank ever holds more than one chunk beyond its own state while saving. Reading takes the entries
that overlap the wanted slice, each read once into a buffer of its size and checked against its
SHA-256 before use.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from sailor.core.errors import SailorInputError
from sailor.core.schema import parse_model
from sailor.model.spec import ModelSpec
from sailor.runtime import checkpoint as ckpt
from sailor.runtime.model import EMBEDDING_WEIGHT, param_shapes, tied_head
from sailor.runtime.tensor_parallel import shard, shard_dim

_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 per host copy
FP32 = torch.float32
assert sys.byteorder == "little", "checkpoint files are little-endian"


class RankWriter:
    """One rank's data file and index in a checkpoint's temporary folder (`checkpoint` docstring).

    Args:
        tmp: the temporary folder (`checkpoint.prepare_tmp`).
        rank: the global rank.
        info: recorded in the index and the manifest ({"stage", "pipeline", "tp_rank"}).
    """

    def __init__(self, tmp: Path, rank: int, info: Mapping[str, Any]) -> None:
        self.tmp, self.rank, self.info = Path(tmp), rank, dict(info)
        self.data_name, self.index_name = ckpt.rank_files(rank)
        self.file: BinaryIO = open(self.tmp / self.data_name, "wb")  # noqa: SIM115  # closed by `close`
        self.hash = hashlib.sha256()
        self.offset = 0
        self.entries: list[dict[str, Any]] = []

    def add(self, name: str, key: str, dim: int | None, start: int, width: int, lo: int, flat: torch.Tensor) -> None:
        """Append elements [lo, lo + numel) of the flattened slice [start, start + width) along `dim`
        of full tensor `key` of parameter `name` (`dim` None: of the whole tensor), `flat` 1-D on any
        device and of any floating dtype (stored as fp32)."""
        entry_hash = hashlib.sha256()
        for part in flat.detach().reshape(-1).split(_CHUNK_ELEMENTS):
            host = part.to("cpu", FP32).contiguous()
            view = memoryview(host.numpy()).cast("B")
            self.file.write(view)
            self.hash.update(view)
            entry_hash.update(view)
        n = flat.numel()
        self.entries.append({"name": name, "key": key, "dim": dim, "start": start, "width": width, "lo": lo,
                             "hi": lo + n, "offset": self.offset, "sha256": entry_hash.hexdigest()})
        self.offset += 4 * n

    def close(self) -> None:
        """Flush and fsync the data file, then write and fsync the index."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        index = {"rank": self.rank, **self.info, "file": self.data_name, "bytes": self.offset,
                 "sha256": self.hash.hexdigest(), "entries": self.entries}
        ckpt.write_synced(self.tmp / self.index_name, json.dumps(index).encode())


def write_checkpoint(root: str | Path, step: int, meta: dict[str, Any],
                     tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> Path:
    """Write full tensors {name: {key: tensor}} as a one-rank checkpoint of step `step` and commit it
    (a single process: tests, conversions). Every name must have the same keys. Returns the folder."""
    tmp = ckpt.prepare_tmp(root, step)
    writer = RankWriter(tmp, 0, {"stage": 0, "pipeline": 0, "tp_rank": 0})
    for name, entry in tensors.items():
        for key, t in entry.items():
            writer.add(name, key, None, 0, 0, 0, t.reshape(-1))
    writer.close()
    keys = sorted({k for e in tensors.values() for k in e}, key=lambda k: (k != "param", k))
    return ckpt.commit(root, step, meta, layout={n: list(next(iter(e.values())).shape) for n, e in tensors.items()},
                       keys=keys, world_size=1)


def check_model_matches_tensors(path: str | Path, manifest: Mapping[str, Any]) -> ModelSpec:
    """The model spec of checkpoint `path`'s manifest, after checking that it describes the tensors
    the manifest lists: the manifest is not hashed, so a hand-edited `model` (say hidden_size 128 over
    64-wide weights) would otherwise build, resume or export a model its own tensors do not fit. Every
    user of a checkpoint's model goes through here: resume (`prepare.prepare`) and `sailor export`.

    Checked: the canonical parameter names of `GPT(spec)` (`model.param_shapes`) are those listed (a
    tied head may be absent), and, in format 2 (which records full shapes), each shape. The field
    named is the model's figure the tensors contradict where one can be read off them (num_blocks from
    the layer count, hidden_size from the embedding's width), else `model` with the first tensor.

    Raises:
        SailorInputError: naming `path`/manifest.json and the field.
    """
    source = str(Path(path) / "manifest.json")
    try:  # a hand-edited or foreign manifest: named as an inline job model is (model.hidden_size: ...)
        spec = parse_model(ModelSpec, manifest.get("model"), source)
    except SailorInputError as e:
        raise e.located(field_prefix="model") from None
    want, have = param_shapes(spec), manifest["tensors"]
    layers = {int(n.split(".")[1]) for n in have if n.split(".")[:1] == ["layers"] and n.split(".")[1].isdigit()}
    if layers and max(layers) + 1 != spec.num_layers:
        raise SailorInputError(f"num_blocks {spec.num_blocks} means {spec.num_layers} layers, the checkpoint's"
                               f" tensors have {max(layers) + 1} ({max(layers) - 1} blocks)", source=source,
                               field="model.num_blocks", fix="the manifest's model must be the one that was trained")
    embedding = have.get(EMBEDDING_WEIGHT)
    if manifest.get("format") == ckpt.FORMAT and isinstance(embedding, list) and embedding[-1:] != [spec.hidden_size]:
        raise SailorInputError(f"hidden_size {spec.hidden_size}, the checkpoint's embedding {EMBEDDING_WEIGHT} is"
                               f" {embedding[-1]} wide", source=source, field="model.hidden_size",
                               fix="the manifest's model must be the one that was trained")
    head = tied_head(spec)
    missing = [n for n in want if n not in have and n != head]
    extra = [n for n in have if n not in want]
    wrong = [n for n in want if n in have and manifest.get("format") == ckpt.FORMAT and tuple(have[n]) != want[n]]
    if missing or extra or wrong:
        name = (missing or extra or wrong)[0]
        what = ("the model has it, the checkpoint does not" if missing else "the checkpoint has it, the model does not"
                if extra else f"the model implies shape {list(want[name])}, the checkpoint holds {have[name]}")
        raise SailorInputError(f"does not describe the checkpoint's tensors: {name}: {what}", source=source,
                               field="model", fix="the manifest's model must be the one that was trained")
    return spec


Rect = tuple[int, int, int, int, int]  # (row0, col0, rows, cols, position in the entry's data)


def as_2d(shape: list[int], dim: int) -> tuple[int, int, int]:
    """(rows, cols, dim) of a tensor of `shape` seen as 2-D (a vector as one row, sliced along its
    columns)."""
    if len(shape) == 1:
        return 1, shape[0], 1
    if len(shape) == 2:
        return shape[0], shape[1], dim
    raise ckpt.CheckpointError(f"tensors of {len(shape)} dimensions are not supported")


def entry_rects(dim: int | None, start: int, width: int, lo: int, hi: int, shape: list[int]) -> list[Rect]:
    """Elements [lo, hi) of the row-major flattening of the slice [start, start + width) along `dim`
    of a full tensor of `shape` (`dim` None: of the whole tensor; the checkpoint's entries, `checkpoint`
    docstring) as rectangles of the full tensor seen as 2-D (`as_2d`): (row0, col0, rows, cols,
    position of the rectangle's first element counted from element `lo`), row by row in flat order. A
    flat range of a row-major slice is at most a partial first row, whole rows and a partial last row."""
    _, cols, dim2 = as_2d(shape, 0 if dim is None else dim)
    start, width = (0, shape[0]) if dim is None else (start, width)
    if len(shape) == 1:
        row_off, col_off, w = 0, start, width
    elif dim2 == 0:
        row_off, col_off, w = start, 0, cols
    else:
        row_off, col_off, w = 0, start, width
    out, pos = [], 0
    r, c = divmod(lo, w)
    r_end, c_end = divmod(hi, w)
    if c and r < r_end:  # a partial first row
        out.append((r, c, 1, w - c, pos))
        pos += w - c
        r, c = r + 1, 0
    if r < r_end:
        out.append((r, 0, r_end - r, w, pos))
        pos += (r_end - r) * w
        r = r_end
    if c_end > c:
        out.append((r, c, 1, c_end - c, pos))
    return [(a + row_off, b + col_off, h, ww, p) for a, b, h, ww, p in out]


class Reader:
    """The tensors of a checkpoint folder, read slice by slice (formats 1 and 2).

    Args:
        path: the checkpoint folder.
        manifest: its manifest (`checkpoint.read_manifest`, with or without `verify`).

    Raises:
        CheckpointError: (from the methods) an index or entry that fails its SHA-256, or a tensor the
            checkpoint does not hold.
    """

    def __init__(self, path: str | Path, manifest: Mapping[str, Any]) -> None:
        self.path, self.manifest = Path(path), manifest
        self.v1 = manifest["format"] == ckpt.FORMAT_1
        self.files: dict[str, BinaryIO] = {}
        self._v1_cache: tuple[str, dict] | None = None
        self.entries: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
        if self.v1:
            return
        for info in manifest["ranks"].values():
            raw = ckpt.read_verified(self.path / info["index"], manifest["files"][info["index"]])
            for e in json.loads(raw)["entries"]:
                self.entries.setdefault((e["name"], e["key"]), []).append((info["data"], e))

    def held_keys(self) -> list[str]:
        """The tensors held per parameter ("param", and the Adam moments once a step was taken)."""
        if self.v1:
            return ["param", *ckpt.OPTIMIZER_KEYS] if self.manifest["step"] > 0 else ["param"]
        return list(self.manifest["keys"])

    def shape(self, name: str) -> list[int]:
        if self.v1:
            return list(self._v1_tensors(name)[name]["param"].shape)
        if name not in self.manifest["tensors"]:
            raise ckpt.CheckpointError(f"{self.path}: no tensors for {name}")
        return list(self.manifest["tensors"][name])

    def shard(self, name: str, key: str, tp_rank: int, tp: int) -> torch.Tensor:
        """TP rank `tp_rank`'s shard (of `tp`, along `tensor_parallel.shard_dim(name)`) of full tensor
        `key` of parameter `name`, fp32 on the host."""
        dim = shard_dim(name)
        if self.v1:
            return shard(self._v1_tensors(name)[name][key], dim, tp_rank, tp)
        shape = self.shape(name)
        lo, n = (0, shape[0]) if dim is None or tp == 1 else (tp_rank * shape[dim] // tp, shape[dim] // tp)
        return self.slice(name, key, 0 if dim is None or tp == 1 else dim, lo, n)

    def slice(self, name: str, key: str, dim: int, start: int, width: int) -> torch.Tensor:
        """Slice [start, start + width) along `dim` of full tensor `key` of `name` (format 2)."""
        shape = self.shape(name)
        out_shape = list(shape)
        out_shape[dim] = width
        out = torch.empty(out_shape, dtype=FP32)
        rows, cols, d2 = as_2d(shape, dim)
        r0, r1, c0, c1 = (start, start + width, 0, cols) if d2 == 0 else (0, rows, start, start + width)
        out2 = out.view(r1 - r0, c1 - c0)
        filled = 0
        for fname, e in self.entries.get((name, key), []):
            rects = entry_rects(e["dim"], e["start"], e["width"], e["lo"], e["hi"], shape)
            hits = [(a, b, h, w, p) for a, b, h, w, p in rects if a < r1 and a + h > r0 and b < c1 and b + w > c0]
            if not hits:
                continue
            data = self._entry(fname, e)
            for a, b, h, w, p in hits:
                rect = data[p:p + h * w].view(h, w)
                ra, rb, ca, cb = max(a, r0), min(a + h, r1), max(b, c0), min(b + w, c1)
                out2[ra - r0:rb - r0, ca - c0:cb - c0] = rect[ra - a:rb - a, ca - b:cb - b]
                filled += (rb - ra) * (cb - ca)
        if filled != out.numel():  # the commit checked coverage: a hand-made or foreign folder
            raise ckpt.CheckpointError(f"{self.path}: {key} of {name} is not fully covered ({filled} of {out.numel()})")
        return out

    def _entry(self, fname: str, e: Mapping[str, Any]) -> torch.Tensor:
        """An entry's elements (fp32, 1-D) after checking their SHA-256."""
        f = self.files.get(fname)
        if f is None:
            try:
                f = self.files[fname] = open(self.path / fname, "rb")  # noqa: SIM115  # closed by `close`
            except OSError as err:
                raise ckpt.CheckpointError(f"{self.path / fname}: cannot read ({err})") from None
        data = torch.empty(e["hi"] - e["lo"], dtype=FP32)
        view = memoryview(data.numpy()).cast("B")
        f.seek(e["offset"])
        got = f.readinto(view)
        if got != len(view) or hashlib.sha256(view).hexdigest() != e["sha256"]:
            raise ckpt.CheckpointError(f"{self.path / fname}: checksum mismatch in {e['key']} of {e['name']}")
        return data

    def _v1_tensors(self, name: str) -> dict[str, dict[str, torch.Tensor]]:
        """Format 1: the verified stage file holding `name`, loaded whole (the last one is kept)."""
        import io

        fname = self.manifest["tensors"].get(name)
        if fname is None:
            raise ckpt.CheckpointError(f"{self.path}: no tensors for {name}")
        if self._v1_cache is None or self._v1_cache[0] != fname:
            self._v1_cache = None
            data = ckpt.read_verified(self.path / fname, self.manifest["files"][fname])
            self._v1_cache = (fname, torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"))
        return self._v1_cache[1]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
        self._v1_cache = None


def load_tensors(path: str | Path, manifest: Mapping[str, Any], names: Iterable[str],
                 keys: Iterable[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Full tensors {name: {key: tensor}} of canonical parameters `names`, for `keys` (None: every
    key the checkpoint holds), each entry read verified.

    Raises:
        CheckpointError: an entry fails its checksum or a name is missing.
    """
    reader = Reader(path, manifest)
    try:
        keys = reader.held_keys() if keys is None else list(keys)
        return {n: {k: reader.shard(n, k, 0, 1) for k in keys} for n in names}
    finally:
        reader.close()
