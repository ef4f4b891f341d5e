"""The per-architecture readers of Hugging Face configs (torch-free): `READERS[model_type]` turns
the keys of one architecture's `config.json` into ModelSpec fields, reading them through
`ConfigFields`, which checks each value's type and sign and records every key read, so that
`hf_config.spec_from_hf` can refuse any key left over. Keys that cannot change the forward pass or
the gradient (`_METADATA`) are never left over; dropout rates are read and reported, not applied.

Raises `SailorInputError(source=file, field=key)` for every problem.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from sailor.core.errors import SailorInputError, show
from sailor.core.schema import validation_error
from sailor.model.geometry import RopeScaling

LOG = logging.getLogger("sailor")

# Keys that do not change what is computed in training: ids, generation settings, classification
# heads that a causal LM does not build, bookkeeping. (Base `PretrainedConfig` attributes of
# transformers 4 and 5.)
_METADATA = frozenset("""
    _name_or_path architectures model_type transformers_version torch_dtype dtype use_cache
    bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id
    forced_bos_token_id forced_eos_token_id initializer_range init_std id2label label2id num_labels
    return_dict output_attentions output_hidden_states output_scores return_dict_in_generate torchscript
    problem_type tokenizer_class prefix task_specific_params finetuning_task is_decoder
    chunk_size_feed_forward tf_legacy_loss use_bfloat16 remove_invalid_values max_length min_length
    do_sample early_stopping num_beams num_beam_groups diversity_penalty temperature top_k top_p
    typical_p repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size
    bad_words_ids num_return_sequences exponential_decay_length_penalty suppress_tokens
    begin_suppress_tokens _attn_implementation_autoset classifier_dropout
    summary_type summary_use_proj summary_activation summary_proj_to_labels summary_first_dropout
""".split())

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu"}


class ConfigFields:
    """A config mapping that remembers which keys were read, so leftovers can be refused."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data, self.source, self.used = data, source, set()

    def error(self, key: str, message: str, fix: str | None = None) -> SailorInputError:
        return SailorInputError(message, source=self.source, field=key, fix=fix)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, kind: type, default: Any = ..., *, nullable: bool = False, positive: bool = True) -> Any:
        """The value of `key` checked to be a `kind` (int, float, bool, str, dict, list), and > 0 for
        numbers unless `positive` is False; `default` when absent (or null, unless `nullable`);
        required when no default is given."""
        self.used.add(key)
        value = self.data.get(key)
        if value is None:
            if nullable and key in self.data:
                return None
            if default is ...:
                model_type = self.data.get("model_type")
                raise self.error(key, "missing",
                                 fix=f"the {model_type} config needs it" if isinstance(model_type, str) else None)
            return default
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float else \
            (isinstance(value, int) and not isinstance(value, bool)) if kind is int else isinstance(value, kind)
        if not ok:
            raise self.error(key, f"expected {kind.__name__}, got {show(value)}")
        if kind in (int, float) and positive and value <= 0:
            raise self.error(key, f"must be > 0, got {show(value)}")
        return float(value) if kind is float else value

    def require(self, key: str, allowed: Callable[[Any], bool], default: Any, why: str, fix: str) -> Any:
        """Read `key` and refuse any value `allowed` rejects (values that change the math Sailor
        does not implement)."""
        self.used.add(key)
        value = self.data.get(key, default)
        if not allowed(value):
            raise self.error(key, f"{value!r} is not supported: {why}", fix=fix)
        return value

    def dropout(self, *keys: str) -> None:
        """Accept dropout rates, reporting each non-zero one (the runtime trains without dropout)."""
        for key in keys:
            rate = self.get(key, float, 0.0, positive=False)
            if not 0 <= rate < 1:
                raise self.error(key, f"a dropout rate is in [0, 1), got {rate}")
            if rate:
                LOG.warning(f"{self.source}: {key}: dropout {rate} is not applied (Sailor trains without dropout)")

    def leftovers(self) -> list[str]:
        return [k for k in self.data if k not in self.used and k not in _METADATA]


def _activation(f: ConfigFields, key: str, default: str) -> str:
    act = f.get(key, str, default)
    if act not in _ACTIVATIONS:
        raise f.error(key, f"activation {act!r} is not supported", fix=f"one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[act]


def _heads(f: ConfigFields, hidden_key: str, heads_key: str, kv_key: str | None = None,
           *, free_head_dim: bool = False) -> tuple[int, int, int]:
    """(hidden size, heads, KV heads), checked to split evenly, naming the config's own keys. With
    `free_head_dim` (Qwen3) `head_dim` may differ from hidden / heads: read it with `_head_size`."""
    hidden, heads = f.get(hidden_key, int), f.get(heads_key, int)
    kv = f.get(kv_key, int, heads) if kv_key else heads
    if not free_head_dim and hidden % heads:
        raise f.error(heads_key, f"{heads} heads do not divide {hidden_key} {hidden}")
    if heads % kv:
        raise f.error(kv_key, f"{kv} KV heads do not divide the {heads} attention heads")
    if free_head_dim:
        return hidden, heads, kv
    hd = f.get("head_dim", int, hidden // heads) if kv_key else hidden // heads
    if hd * heads != hidden:
        raise f.error("head_dim", f"head_dim {hd} x {heads} heads != {hidden_key} {hidden}",
                      fix="Sailor needs head_dim = hidden_size / num_attention_heads")
    return hidden, heads, kv


def _head_size(f: ConfigFields, hidden: int, heads: int) -> dict[str, Any]:
    """`head_size` from a config whose head_dim may be set apart (Qwen3): {} when it is h / a."""
    hd = f.get("head_dim", int, None, nullable=True)
    if hd is None:
        if hidden % heads:
            raise f.error("num_attention_heads", f"{heads} heads do not divide hidden_size {hidden}",
                          fix="or give head_dim")
        return {}
    return {} if hd * heads == hidden else {"head_size": hd}


def _rope(f: ConfigFields, *, theta_key: str = "rope_theta", fraction_key: str | None = None) -> dict[str, Any]:
    """RoPE base, scaling and rotary fraction from either layout: transformers 4 (`rope_theta`,
    `rope_scaling`, NeoX `rotary_pct`/`rotary_emb_base`) or 5 (`rope_parameters`)."""
    out: dict[str, Any] = {}
    params = f.get("rope_parameters", dict, None, nullable=True)
    where = "rope_parameters"
    if params is None:
        params = dict(f.get("rope_scaling", dict, None, nullable=True) or {})
        where = "rope_scaling"
        if f.has(theta_key):
            params["rope_theta"] = f.get(theta_key, float)
        if fraction_key and f.has(fraction_key):
            params["partial_rotary_factor"] = f.get(fraction_key, float)
    else:
        for key in ("rope_scaling", theta_key, *((fraction_key,) if fraction_key else ())):
            if f.has(key):
                raise f.error(key, "given next to rope_parameters", fix="keep one of the two")
            f.used.add(key)
    params = dict(params)
    sub = ConfigFields(params, f.source)
    if "rope_theta" in params:
        out["rope_theta"] = sub.get("rope_theta", float)
    if "partial_rotary_factor" in params:
        out["rotary_fraction"] = sub.get("partial_rotary_factor", float)
    kind = params.get("rope_type", params.get("type", "default"))
    sub.used |= {"rope_type", "type"}
    if kind not in ("default", "linear", "llama3"):
        raise SailorInputError(f"rope scaling type {kind!r} is not supported", source=f.source,
                               field=f"{where}.rope_type", fix="supported: default, linear, llama3")
    if kind != "default":
        scaling = {"kind": kind, "factor": sub.get("factor", float)}
        if kind == "llama3":
            scaling |= {k: sub.get(k, int if k.startswith("original") else float)
                        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        try:
            out["rope_scaling"] = RopeScaling(**scaling)
        except ValidationError as e:
            raise validation_error(e, f.source).located(field_prefix=where) from None
    left = sub.leftovers()
    if left:
        raise SailorInputError(f"unknown {kind} rope parameter", source=f.source, field=f"{where}.{left[0]}",
                               fix="Sailor refuses what it cannot check")
    return out


def _llama(f: ConfigFields, *, free_head_dim: bool = False) -> dict[str, Any]:
    """Llama (1-3), and the common part of Mistral, Qwen2 and their mixtures of experts (transformers'
    LlamaConfig defaults); `free_head_dim`: head_dim may differ from hidden / heads (Qwen3)."""
    hidden, heads, kv = _heads(f, "hidden_size", "num_attention_heads", "num_key_value_heads",
                               free_head_dim=free_head_dim)
    head = _head_size(f, hidden, heads) if free_head_dim else {}
    f.require("pretraining_tp", lambda v: isinstance(v, int) and v >= 1, 1,
              "a number of matmul slices >= 1", fix="use 1")  # slices a matmul; the sum is the same
    f.dropout("attention_dropout")
    if f.get("mlp_bias", bool, False) and f.data.get("model_type") != "llama":
        raise f.error("mlp_bias", f"not a field of {f.data.get('model_type')} configs")
    attention_bias = f.get("attention_bias", bool, False)
    return dict(
        num_blocks=f.get("num_hidden_layers", int), hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv, ffn_hidden_size=f.get("intermediate_size", int),
        vocab_size=f.get("vocab_size", int), max_sequence_length=f.get("max_position_embeddings", int),
        gated_mlp=True, learned_positions=False, rms_norm=True, bias=False,
        qkv_bias=attention_bias, out_bias=attention_bias, mlp_bias=f.get("mlp_bias", bool, False),
        norm_eps=f.get("rms_norm_eps", float, 1e-6), activation=_activation(f, "hidden_act", "silu"),
        tied_embeddings=f.get("tie_word_embeddings", bool, False), **head, **_rope(f))


def _mistral(f: ConfigFields) -> dict[str, Any]:
    """Mistral: Llama with an optional sliding attention window (no biases)."""
    f.used.add("attention_bias")
    if f.data.get("attention_bias"):
        raise f.error("attention_bias", "not a field of mistral configs")
    out = _llama(f)
    window = f.get("sliding_window", int, None, nullable=True)
    return out | ({"sliding_window": window} if window else {})


def _qwen2(f: ConfigFields) -> dict[str, Any]:
    """Qwen2: Llama with biases on q, k, v (not on the output projection); a sliding window only
    where `use_sliding_window` / `layer_types` turn it on."""
    f.used.add("attention_bias")
    if "attention_bias" in f.data:
        raise f.error("attention_bias", "not a field of qwen2 configs (its q, k, v always carry biases)")
    out = _llama(f) | {"qkv_bias": True, "out_bias": False}
    return out | _qwen_window(f, out["num_blocks"])


def _qwen_window(f: ConfigFields, blocks: int) -> dict[str, Any]:
    """{"sliding_window": w} when the Qwen config slides a window over any layer, else {}."""
    window = f.get("sliding_window", int, None, nullable=True, positive=False)  # Qwen2-MoE writes 0 for none
    # transformers 4: layers from max_window_layers on slide when use_sliding_window; 5: layer_types.
    first_sliding = f.get("max_window_layers", int, blocks, positive=False)
    layer_types = f.get("layer_types", list, [])
    bad = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
    if bad:
        raise f.error("layer_types", f"unknown attention type {bad[0]!r}", fix="full_attention or sliding_attention")
    if layer_types and len(layer_types) != blocks:
        raise f.error("layer_types", f"{len(layer_types)} entries for {blocks} layers")
    if layer_types:
        sliding = "sliding_attention" in layer_types
    else:
        sliding = f.get("use_sliding_window", bool, False) and first_sliding < blocks
    f.used.add("use_sliding_window")
    return {"sliding_window": window} if sliding and window else {}


def _moe(f: ConfigFields, *, experts_key: str, ffn_key: str, norm_topk: bool | None) -> dict[str, Any]:
    """The `MoE` fields every supported family shares: expert count and size, top-k, router
    normalisation (`norm_topk` None: the config's norm_topk_prob, default false; Mixtral: always),
    and the load-balancing loss weight: router_aux_loss_coef where output_router_logits is true,
    else 0, as transformers adds it to the loss only then."""
    f.require("router_jitter_noise", lambda v: v in (0, 0.0, None), 0.0,
              "router jitter (random scaling of the router input in training)", fix="set it to 0")
    coef = f.get("router_aux_loss_coef", float, 0.001, positive=False)
    if coef < 0:
        raise f.error("router_aux_loss_coef", f"must be >= 0, got {coef}")
    applied = f.get("output_router_logits", bool, False)
    other = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}[experts_key]
    if experts_key not in f.data and other in f.data:  # transformers maps the one name onto the other
        experts_key = other
    return {"num_experts": f.get(experts_key, int), "top_k": f.get("num_experts_per_tok", int),
            "expert_ffn_size": f.get(ffn_key, int),
            "norm_topk_prob": f.get("norm_topk_prob", bool, False) if norm_topk is None else norm_topk,
            "aux_loss_coef": coef if applied else 0.0}


def _sparse_layers(f: ConfigFields, blocks: int) -> dict[str, Any]:
    """Qwen-MoE's choice of MoE blocks: decoder_sparse_step and mlp_only_layers."""
    dense = f.get("mlp_only_layers", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < blocks for i in dense):
        raise f.error("mlp_only_layers", f"expected layer indices in [0, {blocks}), got {dense!r}")
    return {"sparse_step": f.get("decoder_sparse_step", int, 1), "dense_blocks": tuple(sorted(set(dense)))}


def _mixtral(f: ConfigFields) -> dict[str, Any]:
    """Mixtral: Mistral whose every MLP is num_local_experts SwiGLU experts of intermediate_size,
    top num_experts_per_tok, probabilities always renormalised (transformers' MixtralTopKRouter)."""
    out = _mistral(f)
    moe = _moe(f, experts_key="num_local_experts", ffn_key="intermediate_size", norm_topk=True)
    return out | {"moe": moe}


def _qwen2_moe(f: ConfigFields) -> dict[str, Any]:
    """Qwen2-MoE: Qwen2 attention (q, k, v biases: qkv_bias) and MoE blocks with one shared expert
    of shared_expert_intermediate_size behind a sigmoid gate; the other blocks dense SwiGLUs of
    intermediate_size."""
    f.used.add("attention_bias")
    if "attention_bias" in f.data:
        raise f.error("attention_bias", "not a field of qwen2_moe configs (qkv_bias is)")
    out = _llama(f) | {"qkv_bias": f.get("qkv_bias", bool, True), "out_bias": False}
    blocks = out["num_blocks"]
    moe = _moe(f, experts_key="num_experts", ffn_key="moe_intermediate_size", norm_topk=None)
    moe |= {"shared_experts": 1, "shared_ffn_size": f.get("shared_expert_intermediate_size", int), "shared_gate": True}
    return out | _qwen_window(f, blocks) | {"moe": moe | _sparse_layers(f, blocks)}


def _qwen3_moe(f: ConfigFields) -> dict[str, Any]:
    """Qwen3-MoE: Llama attention (attention_bias on q, k, v and o) with head_dim set apart and an
    RMSNorm over each head of q and k; MoE blocks without shared experts. A sliding window, where
    use_sliding_window turns it on, covers every layer (max_window_layers is not read by
    transformers' Qwen3-MoE)."""
    out = _llama(f, free_head_dim=True) | {"qk_norm": True}
    blocks = out["num_blocks"]
    window = f.get("sliding_window", int, None, nullable=True)
    f.get("max_window_layers", int, blocks, positive=False)
    if f.get("use_sliding_window", bool, False) and window:
        out["sliding_window"] = window
    moe = _moe(f, experts_key="num_experts", ffn_key="moe_intermediate_size", norm_topk=None)
    return out | {"moe": moe | _sparse_layers(f, blocks)}


def _olmoe(f: ConfigFields) -> dict[str, Any]:
    """OLMoE: Llama attention (attention_bias on q, k, v and o) with one RMSNorm over all q heads and
    one over all k heads (transformers' OlmoeAttention: q_norm of hidden_size), every block an MoE of
    num_experts SwiGLU experts of intermediate_size; clip_qkv (clamping q, k, v) is refused."""
    f.require("clip_qkv", lambda v: v is None, None, "clamping q, k and v", fix="set it to null")
    out = _llama(f) | {"qk_norm": True, "qk_norm_span": "all"}
    return out | {"moe": _moe(f, experts_key="num_experts", ffn_key="intermediate_size", norm_topk=None)}


def _gpt_neox(f: ConfigFields) -> dict[str, Any]:
    """GPT-NeoX / Pythia: LayerNorm, partial rotary, parallel residual, biases everywhere, untied."""
    f.dropout("attention_dropout", "hidden_dropout")
    hidden, heads, _ = _heads(f, "hidden_size", "num_attention_heads")
    return dict(
        num_blocks=f.get("num_hidden_layers", int), hidden_size=hidden,
        num_heads=heads, ffn_hidden_size=f.get("intermediate_size", int),
        vocab_size=f.get("vocab_size", int), max_sequence_length=f.get("max_position_embeddings", int),
        learned_positions=False, bias=True, qkv_bias=f.get("attention_bias", bool, True),
        out_bias=f.get("attention_bias", bool, True), mlp_bias=True, norm_eps=f.get("layer_norm_eps", float, 1e-5),
        activation=_activation(f, "hidden_act", "gelu"), parallel_residual=f.get("use_parallel_residual", bool, True),
        tied_embeddings=f.get("tie_word_embeddings", bool, False),
        **({"rotary_fraction": 0.25} | _rope(f, theta_key="rotary_emb_base", fraction_key="rotary_pct")))


def _opt(f: ConfigFields) -> dict[str, Any]:
    """OPT (pre-norm sizes: 125m, 1.3b and up): learned positions offset by 2, ReLU, biases, tied."""
    hidden, heads, _ = _heads(f, "hidden_size", "num_attention_heads")
    f.require("do_layer_norm_before", lambda v: v is True, True, "post-norm OPT (opt-350m) is not built by Sailor",
              fix="a pre-norm OPT size (125m, 1.3b, ...)")
    f.require("word_embed_proj_dim", lambda v: v in (None, hidden), hidden,
              "an embedding narrower than hidden_size needs project_in/project_out (opt-350m)",
              fix="a pre-norm OPT size (125m, 1.3b, ...)")
    f.require("_remove_final_layer_norm", lambda v: v is False, False, "OPT without its final norm",
              fix="set it to false")
    f.require("layer_norm_elementwise_affine", lambda v: v is True, True, "LayerNorm without weights",
              fix="set it to true")
    f.require("layerdrop", lambda v: v in (0, 0.0), 0.0, "LayerDrop skips whole layers in training",
              fix="set it to 0")
    f.dropout("dropout", "attention_dropout", "activation_dropout")
    return dict(
        num_blocks=f.get("num_hidden_layers", int), hidden_size=hidden, num_heads=heads,
        ffn_hidden_size=f.get("ffn_dim", int), vocab_size=f.get("vocab_size", int),
        max_sequence_length=f.get("max_position_embeddings", int), bias=f.get("enable_bias", bool, True),
        activation=_activation(f, "activation_function", "relu"), position_offset=2,
        tied_embeddings=f.get("tie_word_embeddings", bool, True))


def _gpt2(f: ConfigFields) -> dict[str, Any]:
    """GPT-2: learned positions, LayerNorm, tanh-GELU, biases everywhere (Conv1D), tied."""
    f.require("scale_attn_weights", lambda v: v is True, True, "attention without 1/sqrt(head_dim)", fix="set it to true")
    f.require("scale_attn_by_inverse_layer_idx", lambda v: v is False, False, "per-layer attention scaling",
              fix="set it to false")
    f.get("reorder_and_upcast_attn", bool, False)  # fp32 attention scores: the same math in fp32
    f.dropout("resid_pdrop", "embd_pdrop", "attn_pdrop")
    hidden, heads, _ = _heads(f, "n_embd", "n_head")
    positions = f.get("n_positions", int)
    f.require("n_ctx", lambda v: v in (None, positions), positions, "n_ctx differs from n_positions",
              fix="make them equal")
    return dict(
        num_blocks=f.get("n_layer", int), hidden_size=hidden, num_heads=heads,
        ffn_hidden_size=f.get("n_inner", int, None, nullable=True), vocab_size=f.get("vocab_size", int),
        max_sequence_length=positions, activation=_activation(f, "activation_function", "gelu_new"),
        norm_eps=f.get("layer_norm_epsilon", float, 1e-5), tied_embeddings=f.get("tie_word_embeddings", bool, True))


READERS: dict[str, Callable[[ConfigFields], dict[str, Any]]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gpt_neox": _gpt_neox, "opt": _opt, "gpt2": _gpt2,
    "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe}
