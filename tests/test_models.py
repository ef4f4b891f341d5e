"""Model specs: layer lists, per-layer parameters (checked against Sailor's llm_info.json), FLOPs,
activation bytes, aliases."""

import json

import pytest

from sailor.errors import SailorInputError
from sailor.models import BUILTIN_MODELS, LayerKind, ModelSpec, canonical_model_name, get_model


def test_layer_counts():
    assert get_model("opt-350m").num_layers == 26  # embedding + 24 blocks + head
    assert get_model("tiny").num_layers == 6
    m = get_model("tiny")
    assert [m.layer_kind(i) for i in (0, 1, 4, 5)] == [LayerKind.EMBEDDING, LayerKind.BLOCK, LayerKind.BLOCK,
                                                       LayerKind.HEAD]


def test_sailor_aliases():
    assert canonical_model_name("OPT-350") == "opt-350m"
    assert canonical_model_name("opt-350") == "opt-350m"
    assert canonical_model_name("GPT-Neo-2.7") == "gpt-neo-2.7b"
    assert canonical_model_name("LLAMA-3-8") == "llama-3-8b"
    assert get_model("OPT-30").num_layers == 50
    with pytest.raises(SailorInputError, match=r"unknown model 'opt-351m'.*did you mean 'opt-350m'"):
        get_model("opt-351m")


def test_tiny_params_by_hand():
    m = get_model("tiny")  # h = 64, f = 256, V = 256 (already a multiple of 128), positions 64
    # embedding: V*h + positions*h = 16384 + 4096
    assert m.params(0, 1) == 20480
    # block: QKV 64*192 + out 64*64 + MLP 2*64*256 = 49152 weights, biases 192 + 256 sharded,
    # 2 LayerNorms (4*64) + 2 row-parallel biases (2*64) replicated = 384
    assert m.params(1, 1) == 49152 + 448 + 384
    assert m.params(1, 2) == (49152 + 448) // 2 + 384
    # head: final LayerNorm 128 + V*h
    assert m.params(5, 1) == 128 + 16384
    # V is padded to 128 * tp: at TP 4 it is 512, so each GPU holds 128 rows
    assert m.padded_vocab(4) == 512 and m.params(0, 4) == 128 * 64 + 4096


def test_opt350_params_match_sailor_llm_info_exactly(sailor_ref):
    info = json.loads((sailor_ref / "profiles" / "llm_info.json").read_text())["OPT-350"]
    m = get_model("OPT-350")
    for tp in (1, 2, 4, 8):
        for layer in range(m.num_layers):
            assert m.params(layer, tp) == info[str(tp)][str(layer)]["params_floats"], (tp, layer)


def test_opt350_output_bytes_match_sailor_llm_info(sailor_ref):
    info = json.loads((sailor_ref / "profiles" / "llm_info.json").read_text())["OPT-350"]["1"]
    m = get_model("opt-350m")
    for layer in range(m.num_layers - 1):
        assert m.output_bytes(layer, mbs=1, seq=2048, elem_bytes=4) == info[str(layer)]["act_output_bytes"]


def test_flops_by_hand():
    m = get_model("tiny")
    # block forward: 2*b*s*(h(h+2kvd) + h^2 + 2hf) + 4*b*s^2*h, b=1 s=64 h=64 f=256
    matmul = 2 * 64 * (64 * 192 + 64 * 64 + 2 * 64 * 256)
    assert m.forward_flop(1, tp=1, mbs=1, seq=64) == matmul + 4 * 64 * 64 * 64
    assert m.forward_flop(1, tp=2, mbs=3, seq=64) == pytest.approx(3 * (matmul + 4 * 64**3) / 2)
    assert m.forward_flop(0, tp=1, mbs=1, seq=64) == 0.0
    assert m.forward_flop(5, tp=1, mbs=1, seq=64) == 2 * 64 * 64 * 256
    assert m.backward_flop(2, tp=1, mbs=1, seq=64) == 2 * m.forward_flop(2, tp=1, mbs=1, seq=64)


def test_block_activation_bytes_match_korthikanti_for_half_precision():
    # Korthikanti et al. Table 2, no recomputation: s*b*h*(10 + 24/t) + 5*a*s^2*b/t for e = 2, f = 4h
    m = get_model("opt-350m")
    s, b, h, a = 2048, 2, 1024, 16
    for t in (1, 2, 4):
        expected = s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t
        assert m.activation_bytes(3, tp=t, mbs=b, seq=s, elem_bytes=2) == pytest.approx(expected)


def test_total_params_of_opt350_is_about_350m():
    m = get_model("opt-350m")
    # total_params counts the LM head's matrix apart from the embedding; a tied model stores it once
    unique = m.total_params() - m.padded_vocab(1) * m.hidden_size
    assert 330e6 < unique < 370e6


def test_tp_degrees_divide_heads():
    m = get_model("llama-3-8b")  # 32 heads, 8 KV heads
    assert m.tp_degrees(16) == [1, 2, 4, 8]
    m.check_tp(8)
    with pytest.raises(SailorInputError, match="TP 3 does not divide the 32 attention heads"):
        m.check_tp(3)


def test_invalid_geometry_is_rejected():
    with pytest.raises(ValueError, match="hidden_size 100 is not divisible by num_heads 3"):
        ModelSpec(name="x", num_blocks=1, hidden_size=100, num_heads=3, vocab_size=10, max_sequence_length=8)
    with pytest.raises(ValueError, match="num_blocks"):
        ModelSpec(name="x", num_blocks=-1, hidden_size=64, num_heads=4, vocab_size=10, max_sequence_length=8)


def test_builtin_models_are_frozen():
    with pytest.raises(Exception, match="frozen"):
        BUILTIN_MODELS["tiny"].num_blocks = 8
