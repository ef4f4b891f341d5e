"""Hugging Face `config.json` <-> ModelSpec, for Llama, Mistral, Qwen2, GPT-NeoX, OPT, GPT-2 and the
mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (torch-free).

`load_hf_config(path)` reads a config file (or the `config.json` in a model folder) and returns the
ModelSpec that the simulator, planner and runtime use. Every key of the file must be accounted for:
- keys the architecture's reader (`sailor.model.hf_readers`) uses become ModelSpec fields (with
  transformers' class default where a file may leave them out, e.g. `num_key_value_heads`);
- keys that cannot change the forward pass or the gradient (token ids, generation settings, labels,
  `dtype`, `initializer_range`...) are listed in `hf_readers._METADATA`;
- keys that change the math are read and either supported or refused (`rope_scaling` of an unknown
  type, a sliding window, router jitter, MoE architectures not built (DeepSeek's MLA, DBRX...),
  quantization, post-norm OPT...);
- dropout is the one setting accepted without being applied (Sailor trains without dropout): each
  non-zero rate is reported once on the `sailor` logger.
Anything else is an unknown field and refused, naming it. Both config layouts are read: the one
transformers 4 writes (`rope_theta`, `rope_scaling`, `rotary_pct`) and the one transformers 5 writes
(`rope_parameters`).

The inverse, the config `sailor export` writes, is `sailor.model.hf_export`.

Raises `SailorInputError(source=file, field=key)` for every problem; nothing else escapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sailor.core.errors import SailorInputError, unknown_name
from sailor.core.fileio import load_json
from sailor.core.schema import validation_error
from sailor.model.hf_readers import READERS, ConfigFields
from sailor.model.spec import ModelSpec

# Keys that must keep the value a causal decoder has (any other value changes the model).
_FIXED = {"is_encoder_decoder": False, "add_cross_attention": False, "tie_encoder_decoder": False,
          "pruned_heads": {}, "cross_attention_hidden_size": None}
# Keys transformers only writes for architectures Sailor does not build: named in the error.
_REFUSED = {
    "quantization_config": "quantized weights are not supported (load the unquantized model)",
}  # mixture-of-experts keys: `_refuse_experts`, before the model_type is looked up
DENSE_SUPPORTED = ("llama", "mistral", "qwen2", "gpt_neox", "opt", "gpt2")
MOE_SUPPORTED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
SUPPORTED = DENSE_SUPPORTED + MOE_SUPPORTED


def load_hf_config(path: str | Path) -> ModelSpec:
    """The ModelSpec of a Hugging Face `config.json` (or of the one in model folder `path`).

    The spec's name is the folder's name for a `config.json`, else the file's stem.

    Raises:
        SailorInputError: missing or invalid file, unsupported architecture, a missing or unknown
            field, or a field whose value Sailor does not implement (file and field named).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    data = load_json(p)
    if not isinstance(data, dict):
        raise SailorInputError(f"expected a JSON object, got {type(data).__name__}", source=str(p))
    name = p.resolve().parent.name if p.name == "config.json" else p.stem
    return spec_from_hf(data, source=str(p), name=name or "hf-model")


def spec_from_hf(data: dict[str, Any], *, source: str, name: str) -> ModelSpec:
    """The ModelSpec of a parsed Hugging Face config (`load_hf_config`; `source` names the file)."""
    f = ConfigFields(data, source)
    model_type = f.get("model_type", str)
    _refuse_experts(data, model_type, source)
    if model_type not in READERS:
        raise unknown_name("model_type", model_type, SUPPORTED, source=source, field="model_type")
    for key, want in _FIXED.items():
        f.require(key, lambda v, w=want: v == w or (v is None and w in ({}, None, False)), want,
                  "Sailor builds decoder-only causal language models", fix=f"it must be {want!r}")
    for key, why in _REFUSED.items():
        if key in data:
            raise f.error(key, why)
    fields = READERS[model_type](f)
    left = f.leftovers()
    if left:
        raise f.error(left[0], f"not a field of {model_type} configs that Sailor knows",
                      fix="remove it if it does not change the model; Sailor refuses what it cannot check")
    try:
        return ModelSpec(name=name, hf_model_type=model_type, **fields)
    except ValidationError as e:
        err = validation_error(e, source)
        # name the key the user wrote (num_hidden_layers, n_embd...), not the ModelSpec field it fills
        head, _, rest = (err.field or "").partition(".")
        if head == "moe":  # a field of the MoE: the first of its config keys the config has
            sub, _, rest = rest.partition(".")
            key = next((k for k in _MOE_CONFIG_KEYS.get(sub, ()) if k in data), None)
        else:
            key = _CONFIG_KEYS.get(model_type, _CONFIG_KEYS["llama"]).get(head)
        if key is None or key not in data:
            raise err from None
        raise SailorInputError(err.message, source=source, field=key + (f".{rest}" if rest else ""), fix=err.fix) from None


# ModelSpec field -> the config key it is read from, per architecture (for messages).
_LLAMA_KEYS = {"num_blocks": "num_hidden_layers", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size",
               "vocab_size": "vocab_size", "max_sequence_length": "max_position_embeddings", "norm_eps": "rms_norm_eps"}
_CONFIG_KEYS = {
    "llama": _LLAMA_KEYS, "mistral": _LLAMA_KEYS, "qwen2": _LLAMA_KEYS, "mixtral": _LLAMA_KEYS, "qwen2_moe": _LLAMA_KEYS,
    "qwen3_moe": _LLAMA_KEYS, "olmoe": _LLAMA_KEYS,
    "gpt_neox": _LLAMA_KEYS | {"norm_eps": "layer_norm_eps"},
    "opt": _LLAMA_KEYS | {"ffn_hidden_size": "ffn_dim"},
    "gpt2": {"num_blocks": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head", "ffn_hidden_size": "n_inner",
             "vocab_size": "vocab_size", "max_sequence_length": "n_positions", "norm_eps": "layer_norm_epsilon"},
}

# MoE field -> the config keys it is read from (`hf_readers._moe`, `_sparse_layers`; each family has
# one of them), for messages; "" is the MoE's own check that top_k <= num_experts, about
# num_experts_per_tok.
_MOE_CONFIG_KEYS = {"": ("num_experts_per_tok",), "top_k": ("num_experts_per_tok",),
                    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
                    "expert_ffn_size": ("moe_intermediate_size", "intermediate_size"),
                    "shared_ffn_size": ("shared_expert_intermediate_size",), "sparse_step": ("decoder_sparse_step",),
                    "dense_blocks": ("mlp_only_layers",)}


# Architectures whose MLPs are mixtures of experts (transformers' model_type); any config with an
# expert-count key is one too, whatever its model_type.
MOE_MODEL_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "dbrx", "olmoe",
                             "phimoe", "granitemoe", "jamba", "jetmoe", "switch_transformers", "nllb_moe"})
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
# What Sailor does not build of a mixture-of-experts architecture it knows: (config key, reason).
_MOE_REFUSED = {
    "deepseek_v2": ("kv_lora_rank", "MLA attention (kv_lora_rank) is not supported"),
    "deepseek_v3": ("kv_lora_rank", "MLA attention (kv_lora_rank) is not supported"),
}


def _refuse_experts(data: dict[str, Any], model_type: str, source: str) -> None:
    """Refuse a mixture-of-experts config Sailor does not build first, for that reason: its
    model_type is often one edit away from a dense one (mixtral/mistral, qwen2_moe/qwen2), and "did
    you mean 'mistral'?" would train another model. Mixtral, Qwen2-MoE and Qwen3-MoE pass."""
    if model_type in MOE_SUPPORTED:
        return
    keys = [k for k in MOE_KEYS if k in data]
    if model_type in _MOE_REFUSED:
        field, what = _MOE_REFUSED[model_type]
        raise SailorInputError(what, source=source, field=field,
                               fix=f"mixture-of-experts architectures Sailor builds: {', '.join(MOE_SUPPORTED)}")
    if model_type in MOE_MODEL_TYPES:
        field, what = "model_type", f"{model_type!r} is a mixture-of-experts model Sailor does not build"
    elif keys:  # a dense model_type (llama) with expert fields: the fields, not the architecture, are MoE
        field, what = keys[0], (f"the config's expert fields ({', '.join(keys)}) make it a mixture-of-experts model,"
                                f" which a {model_type} config cannot be")
    else:
        return
    raise SailorInputError(what, source=source, field=field,
                           fix=f"mixture-of-experts architectures: {', '.join(MOE_SUPPORTED)}; dense:"
                               f" {', '.join(DENSE_SUPPORTED)}")
