"""What a Hugging Face model folder holds besides the weights and the architecture, kept across
`sailor train --init-from FOLDER` and `sailor export` (torch-free).

The architecture round-trips through ModelSpec (`hf_config`), but a ModelSpec has no token ids,
dropout rates, generation settings or tokenizer. They are kept this way:
- `source_record(folder)`: at training time (`--init-from`), what the checkpoint manifest records
  under "hf_source": the folder's absolute path, the config keys `KEPT_KEYS` / `DROPOUT_KEYS` it
  sets, and its `generation_config.json` (small JSON, so an export on another machine still has
  them); a resumed run carries the record on.
- `export_extras(spec, record, source)`: at export, those config keys and files for the new folder:
  from `source` (an explicit folder) or the recorded folder when it exists here (config.json keys,
  generation_config.json, and the tokenizer files `TOKENIZER_FILES` copied byte for byte), else
  from the record (keys and generation config only; no tokenizer).
File names and keys: transformers' `PreTrainedConfig` (token ids), each architecture's config class
(dropout), `GenerationConfig.save_pretrained` (generation_config.json) and
`PreTrainedTokenizerBase.save_pretrained` / sentencepiece and BPE vocab files (tokenizer files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sailor.core.errors import SailorInputError, show
from sailor.core.fileio import load_json
from sailor.model.hf_config import load_hf_config
from sailor.model.hf_export import differences, export_model_type
from sailor.model.hf_readers import LOG
from sailor.model.spec import ModelSpec

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
                 "forced_bos_token_id", "forced_eos_token_id")
KEPT_KEYS = (*TOKEN_ID_KEYS, "tokenizer_class")
# The dropout rates each architecture's config reads (`hf_readers`); Sailor trains without
# dropout, but a model fine-tuned further with transformers uses them.
DROPOUT_KEYS = {"llama": ("attention_dropout",), "mistral": ("attention_dropout",), "qwen2": ("attention_dropout",),
                "gpt_neox": ("attention_dropout", "hidden_dropout"),
                "opt": ("dropout", "attention_dropout", "activation_dropout"),
                "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
RECORD_KEY = "hf_source"  # the manifest's key


@dataclasses.dataclass(frozen=True)
class Extras:
    """What an export adds: `config` keys over the architecture's, files {name: bytes}, and where
    they came from (`source`: a folder, "checkpoint manifest", or None when nothing was known)."""

    config: dict[str, Any]
    files: dict[str, bytes]
    source: str | None


def kept_config(config: dict[str, Any], model_type: str, *, source: str) -> dict[str, Any]:
    """The keys of a parsed config.json that an export keeps, as they are: KEPT_KEYS and
    `model_type`'s dropout keys (their rates were checked when the config was read).

    Raises:
        SailorInputError: a token id that is not an int >= 0 (or a list of them, as Llama 3's
            eos_token_id), or `tokenizer_class` not a string (file and key named). An id beyond the
            vocabulary is kept as the source has it (tiny test models carry GPT-2's 50256).
    """
    keys = (*KEPT_KEYS, *DROPOUT_KEYS.get(model_type, ()))
    out = {k: config[k] for k in keys if config.get(k) is not None}
    for k in TOKEN_ID_KEYS:
        ids = out.get(k)
        if ids is None:
            continue
        for i in ids if isinstance(ids, list) else [ids]:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise SailorInputError(f"a token id is an integer >= 0, got {show(i)}", source=source, field=k)
    if "tokenizer_class" in out and not isinstance(out["tokenizer_class"], str):
        raise SailorInputError(f"expected a string, got {show(out['tokenizer_class'])}", source=source,
                               field="tokenizer_class")
    return out


def source_record(folder: str | Path, spec: ModelSpec) -> dict[str, Any]:
    """What a checkpoint of a run of `spec` records about the Hugging Face folder it started from
    (module docstring): {"folder": absolute path, "config": kept keys, "generation_config": its JSON
    object or None}.

    Raises:
        SailorInputError: an unreadable config.json or generation_config.json, a bad token id.
    """
    p = Path(folder).resolve()
    return {"folder": str(p), "config": _kept_from(p, spec), "generation_config": _generation_config(p)}


def export_extras(spec: ModelSpec, record: dict[str, Any] | None, source: str | Path | None = None) -> Extras:
    """The config keys and files an export of `spec` keeps (module docstring).

    Args:
        spec: the checkpoint's model.
        record: the manifest's RECORD_KEY entry (`source_record`), or None.
        source: a Hugging Face folder given for the export (it must hold the same model).
    Raises:
        SailorInputError: `source` is not a model folder or holds another model (the first differing
            field named); a bad token id.
    """
    if source is not None:
        folder = Path(source)
        with _quiet():  # its dropout rates are kept here, so no "not applied" warning
            theirs = load_hf_config(folder)
        diff = differences(spec, theirs)
        if diff:
            field, want, got = diff[0]
            raise SailorInputError(f"holds another model than the checkpoint: {field} {got!r}, the checkpoint's"
                                   f" {want!r}", source=str(folder), field=field,
                                   fix="name the folder the run started from (--init-from)")
    elif record and Path(record.get("folder", "")).is_dir() and (Path(record["folder"]) / "config.json").is_file():
        folder = Path(record["folder"])
    elif record:
        gen = record.get("generation_config")
        files = {GENERATION_CONFIG: _json_bytes(gen)} if isinstance(gen, dict) else {}
        return Extras(dict(record.get("config") or {}), files, "checkpoint manifest")
    else:
        return Extras({}, {}, None)
    config = _kept_from(folder, spec)
    files = {n: (folder / n).read_bytes() for n in (GENERATION_CONFIG, *TOKENIZER_FILES) if (folder / n).is_file()}
    if GENERATION_CONFIG in files:
        _generation_config(folder)  # valid JSON, or one line naming the file
    return Extras(config, files, str(folder))


def _kept_from(folder: Path, spec: ModelSpec) -> dict[str, Any]:
    """`kept_config` of `folder`'s config.json for a model `spec`."""
    path = folder / "config.json"
    config = load_json(path)
    if not isinstance(config, dict):
        raise SailorInputError(f"expected a JSON object, got {type(config).__name__}", source=str(path))
    return kept_config(config, export_model_type(spec), source=str(path))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    was, LOG.disabled = LOG.disabled, True
    try:
        yield
    finally:
        LOG.disabled = was


def _generation_config(folder: Path) -> dict[str, Any] | None:
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        return None
    data = load_json(path)
    if not isinstance(data, dict):
        raise SailorInputError(f"expected a JSON object, got {type(data).__name__}", source=str(path))
    return data


def _json_bytes(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()
