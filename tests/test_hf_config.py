"""Hugging Face config.json -> ModelSpec (sailor.model.hf_config): every supported architecture, published
configs in transformers 4's layout, parameter counts equal to transformers' own, and bad input."""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import ARCHS, MOE_ARCHS, configs

from sailor.core.errors import SailorInputError
from sailor.model.hf_config import load_hf_config, spec_from_hf
from sailor.model.hf_export import comparable, differences, hf_config_from_spec
from sailor.model.registry import BUILTIN_MODELS
from sailor.model.spec import ModelSpec
from sailor.specs import load_job
from sailor.specs.job import JobSpec

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")


def _hf_count(config) -> int:
    with torch.device("meta"):
        return T.AutoModelForCausalLM.from_config(config).num_parameters()


def _save_config(config, folder: Path) -> Path:
    config.save_pretrained(folder)
    return folder / "config.json"


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_tiny_config_becomes_a_spec_with_transformers_parameter_count(arch, tmp_path):
    from sailor.runtime.model import GPT

    config = configs()[arch]
    spec = load_hf_config(_save_config(config, tmp_path / arch))
    assert spec.name == arch and spec.hf_model_type == config.model_type
    assert (spec.num_blocks, spec.hidden_size, spec.num_heads, spec.vocab_size) == (2, 64, 4, 300)
    assert spec.model_params() == _hf_count(config)  # unpadded vocabulary, tied head once
    # What the runtime builds is what ModelSpec.params counts, layer by layer (padded vocabulary,
    # the tied head as its own copy on the last stage).
    model = GPT(spec)
    for i in range(spec.num_layers):
        assert sum(p.numel() for p in model.layers[str(i)].parameters()) == spec.params(i, 1), (arch, i)


# Published configs as their model folders hold them (transformers 4 layout). Counts are checked
# against transformers building each model on the meta device (no weights, no download).
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
             "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
             "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0",
             "use_cache": True, "vocab_size": 128256}
LLAMA31_8B = LLAMA3_8B | {"max_position_embeddings": 131072, "mlp_bias": False, "rope_scaling": {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    "rope_type": "llama3"}}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
              "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
              "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}
PYTHIA_160M = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
               "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
               "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 12,
               "num_hidden_layers": 12, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
               "torch_dtype": "float16", "transformers_version": "4.24.0", "use_cache": True,
               "use_parallel_residual": True, "vocab_size": 50304}
GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
        "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
        "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
        "summary_use_proj": True, "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": 50257}
OPT_125M = {"_name_or_path": "s3://models/opt-125m", "_remove_final_layer_norm": False,
            "activation_dropout": 0.0, "activation_function": "relu", "architectures": ["OPTForCausalLM"],
            "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True, "dropout": 0.1,
            "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0,
            "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 12,
            "num_hidden_layers": 12, "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16",
            "transformers_version": "4.21.0.dev0", "use_cache": True, "vocab_size": 50272,
            "word_embed_proj_dim": 768}
QWEN2_05B = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
             "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
             "intermediate_size": 4864, "max_position_embeddings": 131072, "max_window_layers": 24,
             "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
             "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True,
             "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
             "use_sliding_window": False, "vocab_size": 151936}
# mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen1.5-MoE-A2.7B and Qwen/Qwen3-30B-A3B config.json
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
                "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
                "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
                "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True,
                "vocab_size": 32000}
QWEN15_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
              "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
              "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
              "model_type": "qwen2_moe", "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "transformers_version": "4.39.0.dev0", "use_cache": True,
              "use_sliding_window": False, "vocab_size": 151936, "decoder_sparse_step": 1,
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
              "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
              "router_aux_loss_coef": 0.001}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                 "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
                 "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
                 "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                 "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
                 "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
                 "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
                 "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                 "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
                 "vocab_size": 151936}
# Qwen/Qwen3-235B-A22B config.json: the 30B-A3B's keys at its own sizes
QWEN3_235B_A22B = QWEN3_30B_A3B | {"hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 94,
                                   "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_hidden_layers": 94}
# allenai/OLMoE-1B-7B-0924 config.json (6.9B parameters, 1.3B active)
OLMOE_1B_7B = {"architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "bos_token_id": None, "clip_qkv": None, "eos_token_id": 50279, "hidden_act": "silu",
               "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 1024,
               "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": False,
               "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
               "num_key_value_heads": 16, "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
               "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
               "use_cache": True, "vocab_size": 50304}
PUBLISHED = {"llama-3-8b": LLAMA3_8B, "llama-3.1-8b": LLAMA31_8B, "mistral-7b": MISTRAL_7B,
             "pythia-160m": PYTHIA_160M, "gpt2": GPT2, "opt-125m": OPT_125M, "qwen2-0.5b": QWEN2_05B,
             "mixtral-8x7b": MIXTRAL_8X7B, "qwen1.5-moe-a2.7b": QWEN15_MOE, "qwen3-30b-a3b": QWEN3_30B_A3B,
             "qwen3-235b-a22b": QWEN3_235B_A22B, "olmoe-1b-7b": OLMOE_1B_7B}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs(name, tmp_path, caplog):
    data = PUBLISHED[name]
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="sailor"):
        spec = load_hf_config(path.parent)  # a model folder works as well as its config.json
    assert spec.name == name
    assert spec.model_params() == _hf_count(T.AutoConfig.from_pretrained(path.parent))
    dropouts = [r.getMessage() for r in caplog.records]
    if name in ("gpt2", "opt-125m"):  # their dropout of 0.1 is named, not silently dropped
        assert dropouts and all("is not applied (Sailor trains without dropout)" in m for m in dropouts)
    else:
        assert not dropouts


def test_llama3_config_is_the_builtin_geometry_with_its_rope_base():
    spec = spec_from_hf(LLAMA3_8B, source="config.json", name="llama-3-8b")
    builtin = BUILTIN_MODELS["llama-3-8b"]
    for layer in range(builtin.num_layers):
        assert spec.params(layer, 8) == builtin.params(layer, 8)
        assert spec.forward_flop(layer, tp=8, mbs=1, seq=8192) == builtin.forward_flop(layer, tp=8, mbs=1, seq=8192)
    assert spec.rope_theta == 500000.0 and spec.norm_eps == 1e-5 and spec.rope_scaling is None
    scaled = spec_from_hf(LLAMA31_8B, source="config.json", name="llama-3.1-8b").rope_scaling
    assert (scaled.kind, scaled.factor, scaled.original_max_position_embeddings) == ("llama3", 8.0, 8192)


@pytest.mark.parametrize("name, data", [("mixtral-8x7b", MIXTRAL_8X7B), ("qwen3-30b-a3b", QWEN3_30B_A3B),
                                        ("qwen3-235b-a22b", QWEN3_235B_A22B)])
def test_moe_builtins_are_their_published_configs(name, data):
    # The built-in is the published config.json, layer by layer; its totals are the model cards':
    # Mixtral 8x7B 46.7B (12.9B active), Qwen3-30B-A3B 30.5B (3.3B activated). Exact counts by hand:
    # Mixtral per block 4096·(4096 + 2·1024)·2 attention + 8·3·4096·14336 experts + 8·4096 router +
    # 2·4096 norms = 1,451,270,144; x32 + 2·32000·4096 + 4096 = 46,702,792,704. Qwen3 per block
    # 2048·(4096 + 2·512) + 4096·2048 attention + 2·128 q/k norms + 128·3·2048·768 experts + 128·2048
    # router + 2·2048 norms = 623,120,640; x48 + 2·151936·2048 + 2048 = 30,532,122,624. Qwen3-235B per
    # block 4096·(8192 + 2·512) + 8192·4096 + 2·128 + 128·3·4096·1536 + 128·4096 + 2·4096 = 2,487,755,008;
    # x94 + 2·151936·4096 + 4096 = 235,093,634,560 (transformers' num_parameters() on the meta device
    # says the same, test_published_configs); active: 8 experts of 128.
    spec, builtin = spec_from_hf(data, source="config.json", name=name), BUILTIN_MODELS[name]
    assert differences(spec, builtin) == []
    for layer in range(builtin.num_layers):
        assert spec.params(layer, 4) == builtin.params(layer, 4)
        assert spec.forward_flop(layer, tp=4, mbs=1, seq=4096) == builtin.forward_flop(layer, tp=4, mbs=1, seq=4096)
    total, active = {"mixtral-8x7b": (46_702_792_704, 12_879_925_248),
                     "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
                     "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520)}[name]
    assert (builtin.model_params(), builtin.active_params()) == (total, active)
    # the cards' figures and their last digit: "235B in total and 22B activated" for Qwen3-235B-A22B
    card_total, card_active, digit = {"mixtral-8x7b": (46.7, 12.9, 0.1), "qwen3-30b-a3b": (30.5, 3.3, 0.1),
                                      "qwen3-235b-a22b": (235, 22, 1)}[name]
    assert abs(total / 1e9 - card_total) < digit / 2 and abs(active / 1e9 - card_active) < 0.6 * digit  # Qwen3: 3.35


def test_sliding_window_limits_the_sequence(tmp_path):
    spec = spec_from_hf(MISTRAL_7B, source="config.json", name="mistral-7b")
    assert spec.sliding_window == 4096
    assert JobSpec(model=spec, global_batch_size=8, sequence_length=4096).seq == 4096
    with pytest.raises(ValueError, match="exceeds mistral-7b's sliding attention window of 4096"):
        JobSpec(model=spec, global_batch_size=8, sequence_length=8192)  # the default (4096) would fit
    # Qwen2 turns the window on only with use_sliding_window (or layer_types), so 0.5B has none.
    assert spec_from_hf(QWEN2_05B, source="c", name="q").sliding_window is None
    on = spec_from_hf(QWEN2_05B | {"use_sliding_window": True, "max_window_layers": 20, "sliding_window": 1024},
                      source="c", name="q")
    assert on.sliding_window == 1024


BAD = [
    (lambda c: c | {"num_experts_per_tok": 2}, "num_experts_per_tok", "mixture-of-experts"),
    (lambda c: c | {"model_type": "dbrx"}, "model_type", "'dbrx' is a mixture-of-experts model Sailor does not build"),
    (lambda c: c | {"model_type": "deepseek_v3", "kv_lora_rank": 512}, "kv_lora_rank",
     r"MLA attention \(kv_lora_rank\) is not supported"),
    (lambda c: c | {"model_type": "olmoe", "clip_qkv": 8.0}, "clip_qkv", "clamping q, k and v"),
    (lambda c: c | {"model_type": "mixtral"}, "num_local_experts", "missing"),
    (lambda c: c | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type",
     "rope scaling type 'yarn' is not supported"),
    (lambda c: c | {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}}, "rope_scaling.beta_fast",
     "unknown linear rope parameter"),
    (lambda c: c | {"my_new_thing": 1}, "my_new_thing", "not a field of llama configs that Sailor knows"),
    (lambda c: c | {"quantization_config": {"bits": 4}}, "quantization_config", "quantized"),
    (lambda c: c | {"head_dim": 64}, "head_dim", "head_dim 64 x 32 heads != hidden_size 4096"),
    (lambda c: c | {"hidden_act": "quick_gelu"}, "hidden_act", "activation 'quick_gelu' is not supported"),
    (lambda c: c | {"num_hidden_layers": "32"}, "num_hidden_layers", "expected int"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "hidden_size", "missing"),
    (lambda c: c | {"is_encoder_decoder": True}, "is_encoder_decoder", "decoder-only"),
    (lambda c: c | {"num_key_value_heads": 5}, "num_key_value_heads", "5 KV heads do not divide the 32 attention heads"),
]


@pytest.mark.parametrize("mutate,field,message", BAD, ids=[b[1] for b in BAD])
def test_unsupported_or_unknown_fields_are_named(mutate, field, message):
    with pytest.raises(SailorInputError, match=message) as e:
        spec_from_hf(mutate(copy.deepcopy(LLAMA3_8B)), source="cfg/config.json", name="x")
    assert e.value.source == "cfg/config.json"
    assert e.value.field == field


def test_other_architectures_refuse_what_they_cannot_build():
    with pytest.raises(SailorInputError, match="post-norm OPT") as e:
        spec_from_hf(OPT_125M | {"do_layer_norm_before": False, "word_embed_proj_dim": 512}, source="c", name="x")
    assert e.value.field == "do_layer_norm_before"
    with pytest.raises(SailorInputError, match="per-layer attention scaling"):
        spec_from_hf(GPT2 | {"scale_attn_by_inverse_layer_idx": True}, source="c", name="x")
    with pytest.raises(SailorInputError, match="LayerDrop"):
        spec_from_hf(OPT_125M | {"layerdrop": 0.1}, source="c", name="x")
    with pytest.raises(SailorInputError, match="q, k, v always carry biases"):
        spec_from_hf(QWEN2_05B | {"attention_bias": False}, source="c", name="x")


def test_the_api_reads_a_job_with_a_relative_model_path_from_any_folder(tmp_path, monkeypatch):
    # sailor.load_job is the CLI's loader: the config.json next to the job is found from another folder,
    # with the job given by a relative or an absolute path
    import sailor
    (tmp_path / "run" / "m").mkdir(parents=True)
    (tmp_path / "run" / "m" / "config.json").write_text(json.dumps(configs()["llama3"].to_dict()))
    (tmp_path / "run" / "job.yaml").write_text("model: m/config.json\nglobal_batch_size: 4\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for path in ("../run/job.yaml", tmp_path / "run" / "job.yaml"):
        assert sailor.load_job(path).model.num_kv_heads == 2
    assert sailor.load_job is load_job
    # a plan carrying that job reads its relative model path from the plan file's folder too
    plan = {"micro_batch_size": 1, "stages": [[0, 6]], "job": {"model": "m/config.json", "global_batch_size": 4},
            "pipelines": [{"microbatches": 4, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}]}
    (tmp_path / "run" / "plan.json").write_text(json.dumps(plan))
    assert sailor.load_plan("../run/plan.json").job.model.num_kv_heads == 2


@pytest.mark.integration
def test_job_reads_a_config_relative_to_itself_and_the_cli_says_what_is_wrong(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(configs()["llama3"].to_dict()))
    (tmp_path / "job.yaml").write_text("model: m/config.json\nglobal_batch_size: 4\n")
    job = load_job(tmp_path / "job.yaml")
    assert job.model.hf_model_type == "llama" and job.model.num_kv_heads == 2
    # the model folder next to a job file in the current folder ("./m" must not become the name "m")
    (tmp_path / "job2.yaml").write_text("model: ./m\nglobal_batch_size: 4\n")
    monkeypatch.chdir(tmp_path)
    assert load_job("job2.yaml").model == job.model
    # The plan file carries the spec inline, so it no longer needs the config file.
    assert JobSpec.model_validate(job.to_dict()) == job
    bad = json.loads((tmp_path / "m" / "config.json").read_text()) | {"rope_parameters": {"rope_type": "dynamic",
                                                                                           "factor": 2.0}}
    (tmp_path / "m" / "config.json").write_text(json.dumps(bad))
    (tmp_path / "cluster.yaml").write_text("provider: local\nzones: {local: {cpu: 2}}\n")
    r = subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", "plan", "--job",
                        str(tmp_path / "job.yaml"), "--cluster", str(tmp_path / "cluster.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "rope_parameters.rope_type: rope scaling type 'dynamic' is not supported" in lines[0]
    assert "config.json" in lines[0] and "job.yaml" in lines[0]


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_export_config_reads_back_as_the_same_model(arch, tmp_path):
    spec = load_hf_config(_save_config(configs()[arch], tmp_path / arch))
    written = hf_config_from_spec(spec)
    assert comparable(spec_from_hf(written, source="x", name=spec.name)) == comparable(spec)
    path = tmp_path / "out" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(written))
    assert _hf_count(T.AutoConfig.from_pretrained(path.parent)) == spec.model_params()


def test_builtin_models_export_as_gpt2_or_llama_and_the_rest_is_refused():
    assert hf_config_from_spec(BUILTIN_MODELS["tiny"])["model_type"] == "gpt2"
    assert hf_config_from_spec(BUILTIN_MODELS["llama-3-8b"])["model_type"] == "llama"
    odd = ModelSpec(name="odd", num_blocks=1, hidden_size=64, num_heads=4, vocab_size=256, max_sequence_length=16,
                    rms_norm=True)  # learned positions with RMSNorm: no Hugging Face architecture has both
    with pytest.raises(SailorInputError, match="gpt2 config cannot express odd's rms_norm"):
        hf_config_from_spec(odd)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 70000) | st.floats(-1e6, 1e6, allow_nan=False)
                     | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(base=st.sampled_from(list(PUBLISHED.values())),
       changes=st.dictionaries(st.sampled_from(sorted({k for c in PUBLISHED.values() for k in c} | {"rope_parameters",
                                                                                                 "layer_types"})),
                               _JSON, min_size=1, max_size=4))
def test_any_config_gives_a_spec_or_one_input_error(base, changes):
    # The reader rule: a valid ModelSpec or a SailorInputError naming the file, never another exception.
    try:
        spec = spec_from_hf(base | changes, source="c.json", name="x")
    except SailorInputError as e:
        assert e.source == "c.json" and e.message
    else:
        assert isinstance(spec, ModelSpec)
