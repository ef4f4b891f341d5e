"""Model specs: layer lists, per-layer parameters (checked against Sailor's llm_info.json), FLOPs,
activation bytes, aliases."""

import json

import pytest

from sailor.core.errors import SailorInputError
from sailor.model.activations import layer_bytes, recompute_transient_bytes
from sailor.model.geometry import LayerKind
from sailor.model.registry import BUILTIN_MODELS, canonical_model_name, get_model
from sailor.model.spec import Collective, Framework, ModelSpec, Recompute


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


# Korthikanti et al. 2022, Table 2 ("Activations memory per transformer layer"), e = 2 bytes, f = 4h,
# with dropout masks; each row is (TP degree, sequence parallel, recompute, bytes / (s*b*h) as a
# function of t and 5as/h).
KORTHIKANTI_TABLE_2 = [
    ("no parallelism", 1, False, Recompute.NONE, lambda t, q: 34 + q),
    ("tensor parallel (baseline)", None, False, Recompute.NONE, lambda t, q: 10 + 24 / t + q / t),
    ("tensor + sequence parallel", None, True, Recompute.NONE, lambda t, q: 34 / t + q / t),
    ("tensor parallel + selective activation recompute", None, False, Recompute.SELECTIVE, lambda t, q: 10 + 24 / t),
    ("tensor + sequence parallel + selective activation recompute", None, True, Recompute.SELECTIVE,
     lambda t, q: 34 / t),
    ("full activation recompute", None, False, Recompute.FULL, lambda t, q: 2),
]


TABLE_2_CASES = [(row, model, b, row[1] or t) for row in KORTHIKANTI_TABLE_2
                 for model, b, t in [("gpt3-175b", 1, 8), ("gpt3-175b", 4, 4), ("opt-350m", 2, 2), ("opt-350m", 1, 1)]
                 if not (row[2] and (row[1] or t) == 1)]  # sequence parallelism needs TP > 1


@pytest.mark.parametrize("row, model, b, t", TABLE_2_CASES, ids=[f"{c[0][0]}-{c[1]}-b{c[2]}-t{c[3]}" for c in TABLE_2_CASES])
def test_megatron_block_reproduces_korthikanti_table_2_exactly(row, model, b, t):
    _, _, sp, recompute, per_sbh = row
    m = get_model(model)
    s, h, a = 2048, m.hidden_size, m.num_heads
    expected = s * b * h * per_sbh(t, 5 * a * s / h)
    got = layer_bytes(m, 5, tp=t, mbs=b, seq=s, elem_bytes=2, framework=Framework.MEGATRON, recompute=recompute,
                             sequence_parallel=sp)
    assert got == expected


def test_sailor_block_bytes_by_hand():
    # tiny: h = 64, a = 4, f = 256, LayerNorm, learned positions, no GQA; s = 64, b = 2, e = 4, t = 2
    m, s, b, e, t = get_model("tiny"), 64, 2, 4, 2
    sbh = s * b * 64
    outside = 4 * e * sbh + 2 * 8 * s * b  # x, norm1 out, norm2 in, norm2 out + LayerNorm mean/rstd
    sdpa = 3 * e * sbh / t + e * sbh / t + 4 * b * 4 * s / t  # q, k, v, output (the out-projection's input), lse
    mlp = 2 * e * s * b * 256 / t  # GeLU input and output
    kw = dict(tp=t, mbs=b, seq=s, elem_bytes=e)
    assert layer_bytes(m, 2, **kw) == outside + sdpa + mlp
    assert layer_bytes(m, 2, **kw, sequence_parallel=True) == outside / t + sdpa + mlp
    # selective keeps the core's inputs (the q, k, v projections) and the output the out-projection reads
    assert layer_bytes(m, 2, **kw, recompute=Recompute.SELECTIVE) == outside + 4 * e * sbh / t + mlp
    assert layer_bytes(m, 2, **kw, recompute=Recompute.FULL) == e * sbh
    assert layer_bytes(m, 2, **kw, recompute=Recompute.FULL, sequence_parallel=True) == e * sbh / t
    # what recomputing one block rebuilds: everything but its input (full); the core's new output and lse
    # (selective: q, k, v are the kept projections here; the recomputed SDPA saves a new output)
    assert recompute_transient_bytes(m, 2, **kw, recompute=Recompute.FULL) == outside + sdpa + mlp - e * sbh
    assert recompute_transient_bytes(m, 2, **kw, recompute=Recompute.SELECTIVE) == e * sbh / t + 4 * b * 4 * s / t
    assert recompute_transient_bytes(m, 0, **kw, recompute=Recompute.FULL) == 0.0
    # embedding: int64 ids, the local ids and bool mask of the vocab-parallel lookup, int64 position ids
    assert layer_bytes(m, 0, **kw) == 8 * s * b + 9 * s * b + 8 * s
    # head at TP 2 (vocab-parallel loss): norm input, stats and output, this rank's logit shard
    # (256 / 2 columns in the compute dtype), fp32 log-sum-exp and int64 local target per token, and
    # the fp32 scaled loss
    assert layer_bytes(m, 5, **kw) == s * b * (2 * e * 64 + 8) + s * b * (e * 128 + 4 + 8) + 4
    # at TP 1: fp32 log-probs over the whole vocabulary, targets, the loss weight and the scaled loss
    assert layer_bytes(m, 5, **{**kw, "tp": 1}) == s * b * (2 * e * 64 + 8) + 4 * s * b * 256 + 8 * s * b + 8


def test_sailor_block_bytes_llama_rope_and_gqa():
    # Llama: RMSNorm (input, rstd and the normalised input), rotary (new q and k, cos/sin tables, and a
    # copy of SDPA's output for the out-projection), 8 KV heads repeated to 32 (new k and v), SwiGLU
    # (4 intermediates); at bf16
    m, s, b, e, t = get_model("llama-3-8b"), 8192, 1, 2, 4
    h, f, kv, d = 4096, 14336, 8 * 128, 128
    sbh = s * b * h
    outside = 2 * (2 * e * sbh + 4 * s * b) + 2 * e * sbh
    sdpa = 3 * e * sbh / t + e * sbh / t + 4 * b * 32 * s / t + 2 * 2 * s * (d // 2) * e
    rest = e * sbh / t + 4 * e * s * b * f / t
    kw = dict(tp=t, mbs=b, seq=s, elem_bytes=e)
    assert layer_bytes(m, 3, **kw) == outside + sdpa + rest
    # the checkpointed core keeps the projections q (h), k and v (kv each), and its output
    assert layer_bytes(m, 3, **kw, recompute=Recompute.SELECTIVE) == (outside + e * s * b * (h + 2 * kv) / t
                                                                          + e * sbh / t + 4 * e * s * b * f / t)
    # the recompute rebuilds everything the core saved: new q, k, v, the output, the lse, RoPE's tables
    assert recompute_transient_bytes(m, 3, **kw, recompute=Recompute.SELECTIVE) == sdpa



def test_sailor_block_bytes_hugging_face_variants():
    # GPT-NeoX-style: parallel residual (both norms read x: 3 tensors of h outside the TP regions, not
    # 4), a quarter of each head's 16 dimensions rotates (cos/sin tables of 4 / 2 columns); OPT-style:
    # ReLU keeps its output, the fc2 input (one f tensor, not two); biases keep nothing. At TP 1 the
    # head's log-probabilities cover the 300 real tokens, not the 384 of the padded vocabulary; at TP 2
    # each rank keeps its logit shard, 384 / 2 = 192 columns on the first (the widest).
    s, b, e, t, h, f = 32, 2, 4, 2, 64, 96
    base = dict(num_blocks=2, hidden_size=h, num_heads=4, vocab_size=300, max_sequence_length=s, ffn_hidden_size=f)
    neox = ModelSpec(name="neox", learned_positions=False, rotary_fraction=0.25, parallel_residual=True, **base)
    opt = ModelSpec(name="opt", activation="relu", position_offset=2, **base)
    kw = dict(tp=t, mbs=b, seq=s, elem_bytes=e)
    sbh = s * b * h
    sdpa = 3 * e * sbh / t + e * sbh / t + 4 * b * 4 * s / t
    rope = 2 * 2 * s * (4 // 2) * e
    copies = 2 * e * sbh / t  # RoPE's new q and k
    outside = 2 * 8 * s * b  # LayerNorm mean and rstd of both norms
    assert layer_bytes(neox, 2, **kw) == 3 * e * sbh + outside + sdpa + rope + e * sbh / t + 2 * e * s * b * f / t
    assert recompute_transient_bytes(neox, 2, **kw, recompute=Recompute.SELECTIVE) == \
        copies + e * sbh / t + 4 * b * 4 * s / t + rope
    # learned positions: the out-projection's input is a view of SDPA's output (no copy, unlike NeoX's RoPE)
    assert layer_bytes(opt, 2, **kw) == 4 * e * sbh + outside + sdpa + e * s * b * f / t
    assert layer_bytes(opt, 3, **{**kw, "tp": 1}) == s * b * (2 * e * h + 8) + 4 * s * b * 300 + 8 * s * b + 8
    assert layer_bytes(opt, 3, **kw) == s * b * (2 * e * h + 8) + s * b * (e * 192 + 4 + 8) + 4


def test_recompute_flops():
    m = get_model("tiny")
    kw = dict(tp=2, mbs=3, seq=64)
    assert m.recompute_flop(2, **kw, recompute=Recompute.FULL) == m.forward_flop(2, **kw)
    assert m.recompute_flop(2, **kw, recompute=Recompute.SELECTIVE) == 4 * 3 * 64 * 64 * 64 / 2
    assert m.recompute_flop(2, **kw, recompute=Recompute.NONE) == 0.0
    assert m.recompute_flop(5, **kw, recompute=Recompute.FULL) == 0.0  # the head is never recomputed
    # full recomputation: forward + recompute + backward = 4 forwards (Narayanan et al. eq. 3, per block)
    f = m.forward_flop(2, **kw)
    assert f + m.recompute_flop(2, **kw, recompute=Recompute.FULL) + m.backward_flop(2, **kw) == 4 * f


def test_tp_collectives_per_layer():
    m = get_model("tiny")
    kw = dict(tp=2, mbs=2, seq=64, elem_bytes=4)
    n = 2 * 64 * 64 * 4
    AR, AG, RS = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    assert m.tp_collectives(2, **kw) == ([(AR, n)] * 2, [(AR, n)] * 2)
    fwd, bwd = m.tp_collectives(2, **kw, sequence_parallel=True)
    assert sorted(fwd) == sorted([(AG, n)] * 2 + [(RS, n)] * 2)
    assert sorted(bwd) == sorted([(AG, n)] * 4 + [(RS, n)] * 2)  # + the re-gathers of the saved inputs
    fwd, bwd = m.tp_collectives(2, **kw, recompute=Recompute.FULL)
    assert fwd == [(AR, n)] * 2 and bwd == [(AR, n)] * 4  # the recompute forward repeats the forward's
    assert m.tp_collectives(2, **kw, recompute=Recompute.SELECTIVE) == m.tp_collectives(2, **kw)
    assert m.tp_collectives(0, **kw) == ([(AR, n)], [])
    assert m.tp_collectives(5, **kw) == ([(AG, 2 * 64 * 256 * 4)], [(AR, n)])  # Sailor gathers the logits
    assert m.tp_collectives(5, **kw, framework=Framework.MEGATRON) == ([(AR, 4 * 2 * 64)] * 3, [(AR, n)])
    assert m.tp_collectives(2, tp=1, mbs=2, seq=64, elem_bytes=4) == ([], [])


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
