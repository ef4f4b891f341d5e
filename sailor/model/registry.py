"""The built-in models by name (published configs), their Sailor aliases, and `get_model`: a
ModelSpec from a name, a Hugging Face config path, an inline mapping or a ModelSpec."""

from __future__ import annotations

import os
from typing import Any

from sailor.core.errors import SailorInputError, unknown_name
from sailor.model.moe import MoE
from sailor.model.spec import ModelSpec

# Published configs. OPT: facebook/opt-350m and opt-30b config.json (OPT-350m's 512-wide input/output
# projections are ignored: the public Sailor profiles model it as a plain 1024-wide GPT). GPT-Neo:
# EleutherAI/gpt-neo-2.7B config.json. Llama 3: meta-llama/Meta-Llama-3-8B config.json. GPT-3:
# Brown et al. 2020, Table 2.1. MT-NLG 530B: Smith et al. 2022, "Using DeepSpeed and Megatron to
# Train Megatron-Turing NLG 530B", §3.1 (105 layers, hidden 20480, 128 heads, sequence 2048, GPT-2's
# 50257-token BPE vocabulary). tiny: the CPU test model (byte vocabulary).
BUILTIN_MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(name="opt-350m", num_blocks=24, hidden_size=1024, num_heads=16, vocab_size=50272,
                  max_sequence_length=2048),
        ModelSpec(name="gpt-neo-2.7b", num_blocks=32, hidden_size=2560, num_heads=20, vocab_size=50257,
                  max_sequence_length=2048),
        ModelSpec(name="llama-3-8b", num_blocks=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                  ffn_hidden_size=14336, vocab_size=128256, max_sequence_length=8192, gated_mlp=True,
                  learned_positions=False, bias=False, rms_norm=True, tied_embeddings=False),
        ModelSpec(name="opt-30b", num_blocks=48, hidden_size=7168, num_heads=56, vocab_size=50272,
                  max_sequence_length=2048),
        ModelSpec(name="gpt3-175b", num_blocks=96, hidden_size=12288, num_heads=96, vocab_size=50257,
                  max_sequence_length=2048),
        ModelSpec(name="mt-nlg-530b", num_blocks=105, hidden_size=20480, num_heads=128, vocab_size=50257,
                  max_sequence_length=2048),
        ModelSpec(name="tiny", num_blocks=4, hidden_size=64, num_heads=4, vocab_size=256,
                  max_sequence_length=64),
        # mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336, 32 layers,
        # 32 heads, 8 KV heads, vocab 32000, max_position_embeddings 32768, rms_norm_eps 1e-5,
        # rope_theta 1e6, num_local_experts 8, num_experts_per_tok 2, router_aux_loss_coef 0.02 with
        # output_router_logits false (transformers then adds no aux loss: 0 here), untied. The model
        # card's total: 46.7B parameters (12.9B active per token).
        ModelSpec(name="mixtral-8x7b", num_blocks=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                  ffn_hidden_size=14336, vocab_size=32000, max_sequence_length=32768, gated_mlp=True,
                  learned_positions=False, bias=False, rms_norm=True, tied_embeddings=False, rope_theta=1e6,
                  norm_eps=1e-5, hf_model_type="mixtral",
                  moe=MoE(num_experts=8, top_k=2, expert_ffn_size=14336, norm_topk_prob=True)),
        # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, 48 layers, 32 heads of head_dim 128, 4 KV
        # heads, vocab 151936, max_position_embeddings 40960, rms_norm_eps 1e-6, rope_theta 1e6,
        # num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, norm_topk_prob true,
        # decoder_sparse_step 1, mlp_only_layers [], router_aux_loss_coef 0.001 with output_router_logits
        # false, intermediate_size 6144 (no dense block uses it), untied. The model card: 30.5B
        # parameters in total, 3.3B activated.
        ModelSpec(name="qwen3-30b-a3b", num_blocks=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
                  head_size=128, ffn_hidden_size=6144, vocab_size=151936, max_sequence_length=40960,
                  gated_mlp=True, learned_positions=False, bias=False, rms_norm=True, tied_embeddings=False,
                  rope_theta=1e6, norm_eps=1e-6, qk_norm=True, hf_model_type="qwen3_moe",
                  moe=MoE(num_experts=128, top_k=8, expert_ffn_size=768, norm_topk_prob=True)),
        # Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, 94 layers, 64 heads of head_dim 128, 4 KV
        # heads, vocab 151936, max_position_embeddings 40960, rms_norm_eps 1e-6, rope_theta 1e6,
        # num_experts 128, num_experts_per_tok 8, moe_intermediate_size 1536, norm_topk_prob true,
        # decoder_sparse_step 1, mlp_only_layers [], router_aux_loss_coef 0.001 with output_router_logits
        # false, intermediate_size 12288 (no dense block uses it), untied. The model card: 235B
        # parameters in total, 22B activated.
        ModelSpec(name="qwen3-235b-a22b", num_blocks=94, hidden_size=4096, num_heads=64, num_kv_heads=4,
                  head_size=128, ffn_hidden_size=12288, vocab_size=151936, max_sequence_length=40960,
                  gated_mlp=True, learned_positions=False, bias=False, rms_norm=True, tied_embeddings=False,
                  rope_theta=1e6, norm_eps=1e-6, qk_norm=True, hf_model_type="qwen3_moe",
                  moe=MoE(num_experts=128, top_k=8, expert_ffn_size=1536, norm_topk_prob=True)),
    ]
}



# Names used by the public Sailor data.
MODEL_ALIASES = {"OPT-350": "opt-350m", "GPT-Neo-2.7": "gpt-neo-2.7b", "LLAMA-3-8": "llama-3-8b",
                 "OPT-30": "opt-30b"}



def canonical_model_name(name: str) -> str:
    """Canonical built-in model name for `name` or a Sailor alias; raises SailorInputError if unknown."""
    if not isinstance(name, str):
        raise unknown_name("model", name, list(BUILTIN_MODELS) + list(MODEL_ALIASES))
    if name in BUILTIN_MODELS:
        return name
    lowered = {k.lower(): v for k, v in MODEL_ALIASES.items()}
    if name in MODEL_ALIASES or name.lower() in lowered:
        return MODEL_ALIASES.get(name) or lowered[name.lower()]
    if name.lower() in BUILTIN_MODELS:
        return name.lower()
    if name and os.path.lexists(name):  # a file or folder of that name: "did you mean 'tiny'?" trains another model
        raise SailorInputError(f"unknown model {name[:80]!r}: no built-in model has that name, and a bare name is"
                               " a path only when it is beside the job file",
                               fix=f"name the config as a path (e.g. model: ./{name[:80]}, relative to the job file)")
    raise unknown_name("model", name, list(BUILTIN_MODELS) + list(MODEL_ALIASES))



def is_builtin_model(name: str) -> bool:
    """True when `name` is a built-in model's name or a Sailor alias (`canonical_model_name` takes it)."""
    try:
        canonical_model_name(name)
    except SailorInputError:
        return False
    return True


def is_config_path(name: str) -> bool:
    """True when a `model:` value names a Hugging Face config file or model folder, not a built-in:
    it ends in .json or contains a path separator."""
    return name.endswith(".json") or "/" in name or "\\" in name



def get_model(spec: str | dict[str, Any] | ModelSpec) -> ModelSpec:
    """A ModelSpec from a built-in name/alias, the path of a Hugging Face `config.json` (or of its
    folder; `sailor.model.hf_config`), an inline architecture mapping, or a ModelSpec.

    Raises:
        SailorInputError: unknown name, or a config file that is missing or not supported.
    """
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, str):
        if is_config_path(spec):
            from sailor.model.hf_config import load_hf_config  # imports this module
            return load_hf_config(spec)
        return BUILTIN_MODELS[canonical_model_name(spec)]
    if not isinstance(spec, dict):
        raise SailorInputError(f"expected a model name or an architecture mapping, got {type(spec).__name__}")
    return ModelSpec.model_validate(spec)
