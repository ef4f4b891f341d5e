"""Hugging Face safetensors weights in and out of the runtime's layer list.

`layout(spec)` says where each canonical parameter (`layers.<i>.attn.q.weight`, ...) lives in a
Hugging Face checkpoint of the spec's architecture (`hf_export.export_model_type`) and how it is
laid out there:
- `plain`: the same matrix; `t`: its transpose (GPT-2's Conv1D stores (in, out));
- `vocab`: the unpadded vocabulary (V, h) of the runtime's padded (V', h) embedding or LM head;
- `cols`: one third of GPT-2's fused `c_attn` (Conv1D (h, 3h): q | k | v along the output columns);
- `heads`: one third of GPT-NeoX's fused `query_key_value` (rows grouped per head as [q | k | v]).
A tied LM head reads the embedding.
Mixture-of-experts blocks read the per-expert layout the Hub holds and transformers' `save_pretrained`
writes (its default `save_original_format`): Mixtral `block_sparse_moe.gate` and
`block_sparse_moe.experts.<j>.w1|w3|w2`, Qwen2/3-MoE and OLMoE `mlp.gate`, `mlp.experts.<j>.gate_proj|up_proj|down_proj`,
`mlp.shared_expert.*` and `mlp.shared_expert_gate` (`_moe_source`).

`HFWeights(folder, spec)` opens a model folder (`model.safetensors`, or shards listed in
`model.safetensors.index.json`), and `check()` verifies every tensor's presence, shape and dtype from
the files' headers without reading data; `read(name, dim, tp_rank, tp)` returns one TP shard of one
canonical parameter, reading only that slice from disk (`safe_open(...).get_slice`). So a rank reads
only its stage's layers and its own shard.

`export_checkpoint` writes a Sailor checkpoint as a Hugging Face model folder (config.json +
safetensors, sharded with an index above `max_shard_bytes`), into a temporary folder renamed into
place. Errors are `SailorInputError`s naming the file and tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from sailor.core.errors import SailorInputError
from sailor.core.fileio import current_umask, load_json
from sailor.model.hf_config import load_hf_config
from sailor.model.hf_export import differences, export_model_type, hf_config_from_spec
from sailor.model.spec import ModelSpec
from sailor.runtime.model import GPT, on_meta, param_shapes, share_tied, tied_head
from sailor.runtime.tensor_parallel import materialize_shards

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size for save_pretrained ("5GB", decimal)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Buffers that older checkpoints carry and that are not parameters (causal masks, RoPE tables).
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                    "rotary_emb.inv_freq")
# Base-model prefix per architecture: checkpoints of the bare model (e.g. the original `gpt2`) omit it.
_PREFIX = {"llama": "model.", "mistral": "model.", "qwen2": "model.", "gpt_neox": "gpt_neox.",
           "opt": "model.", "gpt2": "transformer.", "mixtral": "model.", "qwen2_moe": "model.", "qwen3_moe": "model.",
           "olmoe": "model."}
_LLAMA_LIKE = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# Canonical SwiGLU leaf -> its name in an expert of a Hugging Face MoE checkpoint (the per-expert layout
# transformers writes with save_pretrained's default save_original_format=True, and the Hub holds).
_EXPERT_LEAVES = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
                  "qwen": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}}


@dataclass(frozen=True)
class Source:
    """Where one canonical parameter lives in a Hugging Face checkpoint (module docstring)."""

    hf: str
    kind: Literal["plain", "t", "vocab", "cols", "heads"] = "plain"
    part: int = 0  # q, k, v = 0, 1, 2 for the fused kinds


def _full_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Canonical name -> full shape of every parameter the runtime builds for `spec` (no memory)."""
    return param_shapes(spec)


def layout(spec: ModelSpec) -> dict[str, Source]:
    """Canonical parameter name -> Source, for every parameter of `GPT(spec)`."""
    arch = export_model_type(spec)
    out = {name: _source(arch, spec, name) for name in _full_shapes(spec)}
    head = tied_head(spec)
    if head is not None:
        out[head] = out["layers.0.tok.weight"]
    return out


def _source(arch: str, spec: ModelSpec, name: str) -> Source:
    _, index, rest = name.split(".", 2)
    i = int(index)
    module, leaf = rest.rsplit(".", 1)
    last = spec.num_layers - 1
    if arch in _LLAMA_LIKE:
        if i == 0:
            return Source("model.embed_tokens.weight", "vocab")
        if i == last:
            return Source("lm_head.weight", "vocab") if module == "lm" else Source("model.norm.weight")
        if module.startswith(("mlp.router", "mlp.experts.", "mlp.shared")):
            return Source(f"model.layers.{i - 1}.{_moe_source(arch, module)}.{leaf}")
        block = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "attn.q": "self_attn.q_proj",
                 "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
                 "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj",
                 "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}[module]
        return Source(f"model.layers.{i - 1}.{block}.{leaf}")
    if arch == "gpt_neox":
        if i == 0:
            return Source("gpt_neox.embed_in.weight", "vocab")
        if i == last:
            return Source("embed_out.weight", "vocab") if module == "lm" else Source(f"gpt_neox.final_layer_norm.{leaf}")
        pre = f"gpt_neox.layers.{i - 1}"
        if module in ("attn.q", "attn.k", "attn.v"):
            return Source(f"{pre}.attention.query_key_value.{leaf}", "heads", "qkv".index(module[-1]))
        block = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "attn.o": "attention.dense",
                 "mlp.fc1": "mlp.dense_h_to_4h", "mlp.fc2": "mlp.dense_4h_to_h"}[module]
        return Source(f"{pre}.{block}.{leaf}")
    if arch == "opt":
        if i == 0:
            return Source("model.decoder.embed_tokens.weight", "vocab") if module == "tok" else \
                Source("model.decoder.embed_positions.weight")
        if i == last:
            return Source("lm_head.weight", "vocab") if module == "lm" else Source(f"model.decoder.final_layer_norm.{leaf}")
        block = {"norm1": "self_attn_layer_norm", "norm2": "final_layer_norm", "attn.q": "self_attn.q_proj",
                 "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj", "attn.o": "self_attn.out_proj",
                 "mlp.fc1": "fc1", "mlp.fc2": "fc2"}[module]
        return Source(f"model.decoder.layers.{i - 1}.{block}.{leaf}")
    assert arch == "gpt2", arch
    if i == 0:
        return Source("transformer.wte.weight", "vocab") if module == "tok" else Source("transformer.wpe.weight")
    if i == last:
        return Source("lm_head.weight", "vocab") if module == "lm" else Source(f"transformer.ln_f.{leaf}")
    pre = f"transformer.h.{i - 1}"
    if module in ("attn.q", "attn.k", "attn.v"):
        return Source(f"{pre}.attn.c_attn.{leaf}", "cols", "qkv".index(module[-1]))
    if module in ("norm1", "norm2"):
        return Source(f"{pre}.ln_{module[-1]}.{leaf}")
    conv = {"attn.o": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}[module]
    return Source(f"{pre}.{conv}.{leaf}", "t" if leaf == "weight" else "plain")


def _moe_source(arch: str, module: str) -> str:
    """A block's MoE module in a Hugging Face checkpoint of `arch`: Mixtral's `block_sparse_moe.gate`
    and `block_sparse_moe.experts.<j>.w1|w3|w2`; Qwen2/3-MoE's `mlp.gate`,
    `mlp.experts.<j>.gate_proj|up_proj|down_proj`, `mlp.shared_expert.*` and `mlp.shared_expert_gate`."""
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    leaves = _EXPERT_LEAVES["mixtral" if arch == "mixtral" else "qwen"]
    parts = module.split(".")  # mlp.router | mlp.experts.<j>.<leaf> | mlp.shared.<leaf> | mlp.shared_gate
    if parts[1] == "router":
        return f"{moe}.gate"
    if parts[1] == "experts":
        return f"{moe}.experts.{parts[2]}.{leaves[parts[3]]}"
    if parts[1] == "shared":
        return f"{moe}.shared_expert.{leaves[parts[2]]}"
    return f"{moe}.shared_expert_gate"


def hf_shape(src: Source, canonical: tuple[int, ...], spec: ModelSpec) -> tuple[int, ...]:
    """The shape of `src.hf` in the checkpoint, given the canonical parameter's full shape."""
    if src.kind == "t":
        return canonical[::-1]
    if src.kind == "vocab":
        return (spec.vocab_size, *canonical[1:])
    if src.kind == "cols":  # q, k, v of equal width (GPT-2 has no grouped-query attention)
        return (canonical[1], 3 * canonical[0]) if len(canonical) == 2 else (3 * canonical[0],)
    if src.kind == "heads":
        return (3 * canonical[0], *canonical[1:])
    return canonical


class HFWeights:
    """A Hugging Face model folder's safetensors weights for `spec` (module docstring).

    Raises (at construction and in `check`):
        SailorInputError: no weights file, a bad index, a file that is truncated or not
            safetensors, a missing, extra or misshapen tensor (file and tensor named).
    """

    def __init__(self, folder: str | Path, spec: ModelSpec) -> None:
        self.folder, self.spec = Path(folder), spec
        self.layout = layout(spec)
        self._open: dict[tuple[Path, str], Any] = {}  # (file, framework) -> safe_open handle
        self.files = self._files()  # tensor name in the checkpoint -> file
        self.prefix = _PREFIX[export_model_type(spec)]
        # A bare base-model checkpoint (no prefix on its names, e.g. the original gpt2) is read as
        # transformers reads it.
        self.bare = not any(k.startswith(self.prefix) for k in self.files)

    def _files(self) -> dict[str, Path]:
        index = self.folder / INDEX
        if index.exists():
            data = load_json(index)
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise SailorInputError("expected a weight_map of tensor name -> file", source=str(index),
                                       field="weight_map")
            files = {k: self.folder / v for k, v in wm.items()}
            for k, f in files.items():
                if not f.is_file():
                    raise SailorInputError(f"lists {f.name} for {k}, which does not exist", source=str(index),
                                           field=f"weight_map.{k}")
            return files
        single = self.folder / SINGLE
        if not single.is_file():
            raise SailorInputError(f"no {SINGLE} or {INDEX}", source=str(self.folder),
                                   fix="pass a Hugging Face model folder saved with safetensors")
        return {k: single for k in self._handle(single, "numpy").keys()}

    def _handle(self, path: Path, framework: str = "pt"):
        from safetensors import SafetensorError, safe_open

        key = (path, framework)
        if key not in self._open:
            try:
                self._open[key] = safe_open(str(path), framework=framework)
            except (SafetensorError, OSError) as e:
                raise SailorInputError(f"not a readable safetensors file ({e})", source=str(path),
                                       fix="the file may be truncated: copy or download it again") from None
        return self._open[key]

    def _slice(self, hf: str, framework: str = "pt"):
        handle = self._handle(self.files[hf], framework)
        try:
            return handle.get_slice(hf)
        except Exception as e:  # safetensors raises its own error types for a tensor the index misplaces
            raise SailorInputError(f"cannot be read from {self.files[hf].name} ({e})", source=str(self.folder),
                                   field=hf) from None

    def _name(self, hf: str) -> str:
        return hf[len(self.prefix):] if self.bare and hf.startswith(self.prefix) else hf

    def check(self) -> None:
        """Every canonical parameter's tensor present with the shape `spec` implies and a float
        dtype; no tensor left over that is not a known buffer (or a tied head's duplicate)."""
        shapes = _full_shapes(self.spec)
        used: dict[str, tuple[int, ...]] = {}
        for name, src in self.layout.items():
            used[self._name(src.hf)] = hf_shape(src, shapes[name], self.spec)
        for hf, want in used.items():
            if hf not in self.files:
                raise SailorInputError("missing from the checkpoint", source=str(self.folder), field=hf,
                                       fix=f"it must hold the weights of the model in {self.folder / 'config.json'}")
            sl = self._slice(hf, "numpy")
            got, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if got != want:
                raise SailorInputError(f"shape {list(got)} in {self.files[hf].name}, the config implies {list(want)}",
                                       source=str(self.folder), field=hf)
            if dtype not in _FLOAT_DTYPES:
                raise SailorInputError(f"dtype {dtype}, expected one of {', '.join(_FLOAT_DTYPES)}",
                                       source=str(self.folder), field=hf)
        head = tied_head(self.spec)
        ignorable = {self._name("lm_head.weight")} if head is not None else set()
        for hf in self.files:
            if hf not in used and hf not in ignorable and not hf.endswith(_BUFFER_SUFFIXES):
                raise SailorInputError(f"a tensor the config does not describe (in {self.files[hf].name})",
                                       source=str(self.folder), field=hf,
                                       fix="the config and the weights must be of the same model")

    def read(self, name: str, dim: int | None, tp_rank: int, tp: int, full: tuple[int, ...]) -> torch.Tensor:
        """TP rank `tp_rank`'s shard (1/tp of dimension `dim`; all of it when `dim` is None) of
        canonical parameter `name` whose full shape is `full`, as fp32, reading only that slice."""
        src = self.layout[name]
        hf = self._name(src.hf)
        sl = self._slice(hf)
        if dim is None or tp == 1:
            dim, a, b = 0, 0, full[0]
        else:
            a, b = tp_rank * full[dim] // tp, (tp_rank + 1) * full[dim] // tp
        if src.kind == "t":
            part = sl[:, a:b] if dim == 0 else sl[a:b]
            out = part.T if part.dim() == 2 else part
        elif src.kind == "vocab":
            assert dim == 0
            rows = sl[a:min(b, self.spec.vocab_size)] if a < self.spec.vocab_size else None
            out = torch.zeros((b - a, *full[1:]), dtype=torch.float32)
            if rows is not None:
                out[: rows.shape[0]] = rows
        elif src.kind == "cols":
            assert dim == 0
            off = src.part * full[0]
            out = sl[:, off + a:off + b].T if len(full) == 2 else sl[off + a:off + b]
        elif src.kind == "heads":
            assert dim == 0
            hd = self.spec.head_dim
            block = sl[3 * a:3 * b]  # heads a/hd .. b/hd, each [q | k | v]
            out = block.reshape((b - a) // hd, 3, hd, *full[1:])[:, src.part].reshape(b - a, *full[1:])
        else:
            out = sl[:, a:b] if dim == 1 else sl[a:b]
        return out.to(torch.float32).contiguous()

    def close(self) -> None:
        self._open.clear()


def check_init_from(folder: str | Path, spec: ModelSpec, *, source: str = "--init-from") -> None:
    """Refuse `--init-from FOLDER` before training: its config.json must describe `spec` (the job's
    model) and its weights must pass `HFWeights.check`.

    Raises:
        SailorInputError: naming the folder, file and field or tensor.
    """
    p = Path(folder)
    if not p.is_dir():
        raise SailorInputError(f"{p} is not a folder", source=source, fix="pass a Hugging Face model folder")
    diff = differences(spec, load_hf_config(p / "config.json"))
    if diff:
        field, want, got = diff[0]
        raise SailorInputError(f"the job's model has {field} {want!r}, this config {got!r}",
                               source=str(p / "config.json"), field=field, fix=f"use model: {p / 'config.json'} in the job")
    HFWeights(p, spec).check()
    from sailor.model.hf_files import source_record
    source_record(p, spec)  # what the checkpoints will record for `sailor export`: token ids, generation config


def materialize_hf(stage: torch.nn.Module, weights: HFWeights, *, tp_rank: int, tp: int,
                   device: torch.device) -> None:
    """Allocate `stage`'s (meta, TP-sharded) parameters on `device` and fill each with its shard
    from `weights`, read from disk shard by shard."""
    materialize_shards(stage, lambda name, dim, full: weights.read(name, dim, tp_rank, tp, full), tp=tp,
                       device=device)
    weights.close()


def load_full_model(folder: str | Path, spec: ModelSpec | None = None) -> GPT:
    """The whole model of a Hugging Face folder as one runtime GPT on CPU (TP 1), a tied head sharing
    the embedding's Parameter as in `model.init_full_model`: the single-process reference."""
    spec = spec or load_hf_config(folder)
    with on_meta():
        model = GPT(spec)
    weights = HFWeights(folder, spec)
    weights.check()
    materialize_hf(model, weights, tp_rank=0, tp=1, device=torch.device("cpu"))
    return share_tied(model)


# ---- export ---------------------------------------------------------------------------------------

def hf_tensors(spec: ModelSpec, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical full tensors -> the Hugging Face checkpoint's tensors (padding rows dropped, fused
    and transposed layouts rebuilt; a tied head is not written, transformers ties it on load)."""
    out: dict[str, torch.Tensor] = {}
    head = tied_head(spec)
    for name, src in layout(spec).items():
        if name == head:
            continue
        t = params[name].detach().to(torch.float32)
        if src.kind == "t":
            out[src.hf] = t.T.contiguous() if t.dim() == 2 else t.contiguous()
        elif src.kind == "vocab":
            out[src.hf] = t[: spec.vocab_size].contiguous()
        elif src.kind in ("cols", "heads"):
            shape = hf_shape(src, tuple(t.shape), spec)
            buf = out.setdefault(src.hf, torch.empty(shape))
            if src.kind == "cols":
                w = t.shape[0]
                view = buf[:, src.part * w:(src.part + 1) * w] if t.dim() == 2 else buf[src.part * w:(src.part + 1) * w]
                view.copy_(t.T if t.dim() == 2 else t)
            else:
                hd = spec.head_dim
                buf.view(t.shape[0] // hd, 3, hd, *t.shape[1:])[:, src.part].copy_(t.view(-1, hd, *t.shape[1:]))
        else:
            out[src.hf] = t.contiguous()
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *,
                      max_shard_bytes: int = MAX_SHARD_BYTES, source: str | Path | None = None) -> dict[str, Any]:
    """Write the Sailor checkpoint `checkpoint` (a step folder, or a checkpoint folder: its newest
    verified step) as a Hugging Face model folder `out_dir` (which must not exist or be empty),
    atomically (a temporary folder renamed), with the usual permissions (folder 0777, files 0666, less
    the umask). The manifest's model must describe its tensors (`check_model_matches_tensors`).

    Token ids, dropout rates, generation_config.json and the tokenizer files come from `source` (a
    Hugging Face folder of the same model), else from the folder the run started from as the
    manifest records it (`sailor.model.hf_files`).

    Returns a summary: {"step", "model_type", "files", "parameters", "kept_from"} ("kept_from": where
    those came from, None when nothing was known).

    Raises:
        SailorInputError: no verified checkpoint, a manifest whose model does not fit its tensors,
            an `out_dir` that is not empty, a model the Hugging Face architectures cannot express, or
            a `source` holding another model.
    """
    from safetensors.torch import save_file

    from sailor.model.hf_files import RECORD_KEY, export_extras
    from sailor.runtime.checkpoint_io import check_model_matches_tensors, load_tensors

    path, manifest = _find_checkpoint(Path(checkpoint))
    spec = check_model_matches_tensors(path, manifest)
    extras = export_extras(spec, manifest.get(RECORD_KEY), source)
    config = hf_config_from_spec(spec) | extras.config | {"torch_dtype": "float32"}
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SailorInputError("exists and is not an empty folder", source=str(out), fix="export to a new folder")
    names = [n for n in _full_shapes(spec) if n in manifest["tensors"]]
    full = {n: v["param"] for n, v in load_tensors(path, manifest, names, keys=["param"]).items()}
    tensors = hf_tensors(spec, full)
    shards = _shard(tensors, max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        umask = current_umask()
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make the export unreadable to others
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        files = [SINGLE] if len(shards) == 1 else \
            [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
        for fname, part in zip(files, shards):
            save_file(part, str(tmp / fname), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                     "weight_map": {k: f for f, part in zip(files, shards) for k in part}}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for fname, data in extras.files.items():  # generation config and tokenizer, as the source has them
            (tmp / fname).write_bytes(data)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fchmod(fh.fileno(), 0o666 & ~umask)  # safetensors writes 0600
                os.fsync(fh.fileno())
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"step": manifest["step"], "model_type": config["model_type"],
            "files": files + ["config.json", *extras.files], "parameters": spec.model_params(),
            "kept_from": extras.source}


def _find_checkpoint(p: Path) -> tuple[Path, dict[str, Any]]:
    from sailor.runtime import checkpoint as ckpt

    if (p / "manifest.json").exists():
        try:
            return p, ckpt.read_manifest(p)
        except ckpt.CheckpointError as e:
            raise SailorInputError(str(e), source=str(p)) from None
    if not p.is_dir():
        raise SailorInputError("is a file, expected a checkpoint folder" if p.exists() else "no such checkpoint folder",
                               source=str(p), fix="pass the --checkpoint-dir of sailor train, or a step-<n> folder in it")
    found = ckpt.find_latest(p)
    if found.path is None:
        why = f" ({'; '.join(found.skipped)})" if found.skipped else ""
        raise SailorInputError(f"no verified checkpoint{why}", source=str(p),
                               fix="pass a folder written by sailor train --checkpoint-dir, or one of its step-* folders")
    return found.path, found.manifest


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors split into files of at most `max_bytes` (a larger tensor gets a file of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards
