"""ModelSpec -> Hugging Face `config.json`, the inverse of `sailor.model.hf_config` (torch-free):
`hf_config_from_spec(spec)` writes the config `sailor export` saves for the spec's architecture
(`export_model_type`), and `check_round_trip` checks that reading it back (`hf_config.spec_from_hf`)
gives the spec again; `comparable` / `differences` say what two specs differ in.

Raises `SailorInputError` where a spec has a feature the architecture's config cannot express.
"""

from __future__ import annotations

import math
from typing import Any

from sailor.core.errors import SailorInputError
from sailor.model.geometry import RopeScaling
from sailor.model.hf_config import spec_from_hf
from sailor.model.spec import ModelSpec

# ---- the inverse: ModelSpec -> config.json (for `sailor export`) ---------------------------------------

_ACT_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
FP32_EPS = 2.0 ** -23  # torch.finfo(torch.float32).eps: RMSNorm's epsilon when none is given


def export_model_type(spec: ModelSpec) -> str:
    """The Hugging Face architecture `spec` is written as: its own, else GPT-2 for learned-position
    GPT-style specs (built-ins such as `tiny`), else Llama; a mixture of experts as Qwen3-MoE when
    it normalises q and k per head (OLMoE over all heads), Qwen2-MoE when it has shared experts, else
    Mixtral."""
    if spec.hf_model_type:
        return spec.hf_model_type
    if spec.moe is not None:
        if spec.qk_norm:
            return "olmoe" if spec.qk_norm_span == "all" else "qwen3_moe"
        return "qwen2_moe" if spec.moe.shared_experts else "mixtral"
    return "gpt2" if spec.learned_positions else "llama"


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


def hf_config_from_spec(spec: ModelSpec) -> dict[str, Any]:
    """A config.json mapping for `spec` in transformers 4's layout (which transformers 5 reads too).

    Raises:
        SailorInputError: the spec has a feature the chosen architecture cannot express (found by
            reading the result back and comparing, `check_round_trip`).
    """
    kind = export_model_type(spec)
    eps = spec.norm_eps or (FP32_EPS if spec.rms_norm else 1e-5)
    common = {"model_type": kind, "vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tied_embeddings}
    if kind in _ARCHITECTURES:
        out = common | {
            "architectures": [_ARCHITECTURES[kind]],
            "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn, "num_hidden_layers": spec.num_blocks,
            "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": spec.max_sequence_length, "rms_norm_eps": eps,
            "hidden_act": _ACT_NAMES[spec.act], "rope_theta": spec.rope_theta,
            "rope_scaling": _rope_scaling_dict(spec.rope_scaling)}
        if kind in ("llama", "qwen3_moe", "olmoe"):
            out["attention_bias"] = spec.has_qkv_bias
        if kind == "olmoe":
            out["clip_qkv"] = None
        if kind == "llama":
            out["mlp_bias"] = spec.has_mlp_bias
        if kind in ("mistral", "mixtral"):
            out["sliding_window"] = spec.sliding_window
        if kind in ("qwen2", "qwen2_moe"):
            out |= {"use_sliding_window": spec.sliding_window is not None, "sliding_window": spec.sliding_window,
                    "max_window_layers": 0 if spec.sliding_window else spec.num_blocks}
        if kind == "qwen3_moe":
            out |= {"head_dim": spec.head_dim, "use_sliding_window": spec.sliding_window is not None,
                    "sliding_window": spec.sliding_window}
        if spec.moe is not None:
            out |= _moe_config(spec, kind)
    elif kind == "gpt_neox":
        out = common | {
            "architectures": ["GPTNeoXForCausalLM"], "hidden_size": spec.hidden_size,
            "intermediate_size": spec.ffn, "num_hidden_layers": spec.num_blocks, "num_attention_heads": spec.num_heads,
            "max_position_embeddings": spec.max_sequence_length, "layer_norm_eps": eps,
            "hidden_act": _ACT_NAMES[spec.act], "rotary_pct": spec.rotary_fraction, "rotary_emb_base": spec.rope_theta,
            "rope_scaling": _rope_scaling_dict(spec.rope_scaling), "use_parallel_residual": spec.parallel_residual,
            "attention_bias": spec.has_qkv_bias}
    elif kind == "opt":
        out = common | {
            "architectures": ["OPTForCausalLM"], "hidden_size": spec.hidden_size, "ffn_dim": spec.ffn,
            "num_hidden_layers": spec.num_blocks, "num_attention_heads": spec.num_heads,
            "max_position_embeddings": spec.max_sequence_length, "word_embed_proj_dim": spec.hidden_size,
            "do_layer_norm_before": True, "enable_bias": spec.bias, "activation_function": _ACT_NAMES[spec.act],
            "dropout": 0.0, "attention_dropout": 0.0}
    else:
        out = common | {
            "architectures": ["GPT2LMHeadModel"], "n_embd": spec.hidden_size, "n_inner": spec.ffn,
            "n_layer": spec.num_blocks, "n_head": spec.num_heads, "n_positions": spec.max_sequence_length,
            "layer_norm_epsilon": eps, "activation_function": _ACT_NAMES[spec.act],
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    check_round_trip(spec, out)
    return out


def _moe_config(spec: ModelSpec, kind: str) -> dict[str, Any]:
    """The MoE keys of a `kind` config for `spec` (what it cannot express, `check_round_trip` finds)."""
    moe = spec.moe
    out = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef,
           "output_router_logits": moe.aux_loss_coef > 0}
    if kind == "mixtral":
        return out | {"num_local_experts": moe.num_experts, "intermediate_size": moe.expert_ffn_size,
                      "router_jitter_noise": 0.0}
    if kind == "olmoe":
        return out | {"num_experts": moe.num_experts, "intermediate_size": moe.expert_ffn_size,
                      "norm_topk_prob": moe.norm_topk_prob}
    dense = [j for j in range(spec.num_blocks) if (j + 1) % moe.sparse_step == 0 and not moe.is_sparse(j)]
    out |= {"num_experts": moe.num_experts, "moe_intermediate_size": moe.expert_ffn_size,
            "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": moe.sparse_step, "mlp_only_layers": dense}
    if kind == "qwen2_moe":
        out |= {"shared_expert_intermediate_size": moe.shared_width or spec.ffn, "qkv_bias": spec.has_qkv_bias}
    return out


def _rope_scaling_dict(scaling: RopeScaling | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    d = {"rope_type": scaling.kind, "factor": scaling.factor}
    if scaling.kind == "llama3":
        d |= {"low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
              "original_max_position_embeddings": scaling.original_max_position_embeddings}
    return d


def comparable(spec: ModelSpec) -> dict[str, Any]:
    """The fields of `spec` that decide the math, with defaults resolved (name and origin dropped):
    two specs with equal `comparable` build the same model."""
    d = spec.model_dump(exclude={"name", "hf_model_type", "num_kv_heads", "ffn_hidden_size", "activation",
                                 "qkv_bias", "out_bias", "mlp_bias", "norm_eps", "bias", "head_size", "moe"})
    d |= {"kv_heads": spec.kv_heads, "ffn": spec.ffn, "act": spec.act, "qkv_bias": spec.has_qkv_bias,
          "out_bias": spec.has_out_bias, "mlp_bias": spec.has_mlp_bias, "head_dim": spec.head_dim,
          "norm_eps": spec.norm_eps or (FP32_EPS if spec.rms_norm else 1e-5), "moe": _comparable_moe(spec)}
    if not d["learned_positions"]:
        d["max_sequence_length"] = None  # only sizes a learned table
    else:
        d["rope_theta"] = None  # unused without rotary
    if spec.moe is not None and all(spec.is_moe_block(i) for i in range(1, spec.num_layers - 1)):
        d["ffn"] = None  # no dense MLP uses it
    return d


def _comparable_moe(spec: ModelSpec) -> dict[str, Any] | None:
    """The MoE fields that decide the math: which blocks are MoE (however the spec says it), the
    shared experts as the one SwiGLU they form, and the rest as they are."""
    if spec.moe is None:
        return None
    moe = spec.moe
    d = moe.model_dump(exclude={"first_dense", "sparse_step", "dense_blocks", "shared_experts", "shared_ffn_size"})
    return d | {"moe_blocks": tuple(i for i in range(1, spec.num_layers - 1) if spec.is_moe_block(i)),
                "shared_width": moe.shared_width}


def differences(a: ModelSpec, b: ModelSpec) -> list[tuple[str, Any, Any]]:
    """(field, a's value, b's value) wherever `a` and `b` build different models (`comparable`)."""
    x, y = comparable(a), comparable(b)
    return [(k, x[k], y[k]) for k in x if not _same(x[k], y[k])]


def check_round_trip(spec: ModelSpec, config: dict[str, Any]) -> None:
    """Raise SailorInputError unless `config` reads back as the same model as `spec`."""
    diff = differences(spec, spec_from_hf(config, source="exported config.json", name=spec.name))
    if diff:
        field, want, got = diff[0]
        raise SailorInputError(f"a {config['model_type']} config cannot express {spec.name}'s {field}"
                               f" ({want!r}; it would read back as {got!r})", field=field)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b
