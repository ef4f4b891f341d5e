"""Tiny random Hugging Face models of every supported architecture, made locally from config objects
(no download): the ground truth for the importer, the weight loader and the exporter tests."""

from __future__ import annotations

from pathlib import Path

import pytest

VOCAB = 300  # not a multiple of 128: the runtime pads it to 384, which the tests must see through


def configs() -> dict[str, object]:
    """name -> a transformers config of a 2-block model, 64 wide, 4 heads (GQA where the family has it)."""
    T = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
    common = dict(vocab_size=VOCAB, max_position_embeddings=64)
    llama = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, **common)
    return {
        # Llama 3: grouped-query attention, RoPE base 500000 with llama3 scaling of a 16-token context
        "llama3": T.LlamaConfig(**llama, num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        # Llama with biases everywhere, tied embeddings and linear RoPE scaling
        "llama_bias_tied": T.LlamaConfig(**llama, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                         rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "mistral": T.MistralConfig(**llama, num_key_value_heads=2, sliding_window=64, head_dim=16),
        # Qwen2: q, k, v biases, no output bias; tied as the 0.5B model is
        "qwen2": T.Qwen2Config(**llama, num_key_value_heads=2, tie_word_embeddings=True),
        # GPT-NeoX: parallel residual, half the head dimensions rotate, fused per-head QKV
        "gpt_neox": T.GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                    rotary_pct=0.5, **common),
        "opt": T.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                           dropout=0.0, **common),
        # GPT-2: Conv1D weights, fused QKV columns, tanh GELU, tied
        "gpt2": T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0),
        # Mixtral: 4 experts of width 96, top 2, renormalised
        "mixtral": T.MixtralConfig(**llama, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        # Qwen2-MoE: block 0 MoE (4 experts of 32, top 2, not renormalised, a gated shared expert of 48),
        # block 1 a dense SwiGLU of 96 (mlp_only_layers)
        "qwen2_moe": T.Qwen2MoeConfig(**llama, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                      mlp_only_layers=[1]),
        # Qwen3-MoE: head_dim 32 (not 64 / 4), per-head q and k norms, 4 experts of 32, top 2, renormalised
        "qwen3_moe": T.Qwen3MoeConfig(**llama, num_key_value_heads=2, head_dim=32, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        # OLMoE: one q norm over all heads (64 weights), one k norm over both KV heads (32), 4 experts of
        # width 96, top 2, not renormalised
        "olmoe": T.OlmoeConfig(**llama, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
    }


ARCHS = ["llama3", "llama_bias_tied", "mistral", "qwen2", "gpt_neox", "opt", "gpt2"]
MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]  # mixtures of experts (no sequence parallelism yet;
# OLMoE: TP 1 only)


def make_model(name: str, folder: Path, *, seed: int = 0, max_shard_size: str | None = None):
    """Save a random tiny model `name` (every weight, norms and biases included, N(0, 0.2)) into
    `folder` with safetensors; returns the transformers model (eval mode)."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(configs()[name]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kw)
    return model


def hf_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(tokens).logits
