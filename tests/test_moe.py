"""Mixture-of-experts models (issue #30, part 1): the spec's accounting of MoE blocks (parameters,
FLOPs, TP collectives, activations) against hand-computed values and the dense model it reduces to,
the simulator and planner on the built-in MoE models, the runtime's MoE MLP against a token-by-token
loop, its load-balancing loss against transformers', and the runtime's refusals."""

from __future__ import annotations

import pytest

from sailor.core.errors import SailorInputError
from sailor.model.activations import layer_bytes, moe_mlp_bytes
from sailor.model.moe import MoE
from sailor.model.registry import BUILTIN_MODELS
from sailor.model.spec import Collective, ModelSpec

H, E, K, FE = 64, 4, 2, 32


def _spec(moe: MoE | None = None, **kw) -> ModelSpec:
    base = {"name": "m", "num_blocks": 4, "hidden_size": H, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 96,
            "vocab_size": 300, "max_sequence_length": 64, "gated_mlp": True, "learned_positions": False,
            "bias": False, "rms_norm": True, "tied_embeddings": False}
    return ModelSpec(**(base | kw), moe=moe)


def test_which_blocks_are_moe():
    # blocks j >= first_dense with (j + 1) % sparse_step == 0, not in dense_blocks: of 0..7 that is
    # 1, 3, 5, 7 without 3 -> layers 2, 6, 8
    spec = _spec(MoE(num_experts=E, top_k=K, expert_ffn_size=FE, first_dense=1, sparse_step=2, dense_blocks=(3,)),
                 num_blocks=8)
    assert [i for i in range(spec.num_layers) if spec.is_moe_block(i)] == [2, 6, 8]
    assert not any(_spec().is_moe_block(i) for i in range(6))


def test_an_moe_block_counts_its_experts_router_and_shared_gate():
    moe = MoE(num_experts=E, top_k=K, expert_ffn_size=FE, shared_experts=1, shared_ffn_size=48, shared_gate=True)
    spec, dense = _spec(moe), _spec()
    # the MLP part: E experts of 3·h·f_e and a shared SwiGLU of 3·h·48 (split over TP), the router
    # E·h and the gate h (replicated); the dense block's SwiGLU is 3·h·96
    for tp in (1, 2):
        mlp = 3 * H * (E * FE + 48) // tp + E * H + H
        assert spec.params(1, tp) - dense.params(1, tp) == mlp - 3 * H * 96 // tp
    assert spec.params(0, 1) == dense.params(0, 1) and spec.params(5, 2) == dense.params(5, 2)
    # active: only top_k of the E experts
    assert spec.model_params() - spec.active_params() == 4 * 3 * H * FE * (E - K)


def test_moe_flops_are_a_dense_mlp_of_top_k_experts_plus_the_router():
    moe = MoE(num_experts=E, top_k=K, expert_ffn_size=FE)
    spec, dense = _spec(moe), _spec(ffn_hidden_size=K * FE)
    b, s = 2, 16
    for tp in (1, 2):
        got = spec.forward_flop(1, tp=tp, mbs=b, seq=s)
        assert got == pytest.approx(dense.forward_flop(1, tp=tp, mbs=b, seq=s) + 2 * b * s * E * H)  # router not split
        assert spec.weight_grad_flop(1, tp=tp, mbs=b, seq=s) == pytest.approx(
            dense.weight_grad_flop(1, tp=tp, mbs=b, seq=s) + 2 * b * s * E * H)
    # with a capacity factor the experts' buffers are padded: 1.5x the routed expert FLOPs
    padded = _spec(moe.model_copy(update={"capacity_factor": 1.5}))
    extra = padded.forward_flop(1, tp=1, mbs=b, seq=s) - spec.forward_flop(1, tp=1, mbs=b, seq=s)
    assert extra == pytest.approx(0.5 * 2 * b * s * K * 3 * H * FE)


def test_moe_tp_collectives_reduce_every_routed_copy_and_the_shared_output():
    moe = MoE(num_experts=E, top_k=K, expert_ffn_size=FE, shared_experts=1)
    spec = _spec(moe)
    n = 2 * 16 * H * 2
    fwd, bwd = spec.tp_collectives(1, tp=2, mbs=2, seq=16, elem_bytes=2)
    assert fwd == [(Collective.ALL_REDUCE, n), (Collective.ALL_REDUCE, n * (K + 1))]
    assert bwd == [(Collective.ALL_REDUCE, n)] * 2
    assert _spec().tp_collectives(1, tp=2, mbs=2, seq=16, elem_bytes=2)[0] == [(Collective.ALL_REDUCE, n)] * 2


def test_moe_activation_bytes_by_hand():
    # h 4, E 2, top 1, f_e 2, one token, 2-byte elements, no shared experts:
    # router 4·2 (fp32 softmax) + 8·1 (indices) + 4·2 (top-k and its sum) = 24; one routed copy:
    # 3·2·4 (gathered input, output, weighted copy) + 4·2·2 (SwiGLU) + 4 (fp32 weight) + 32 (four
    # int64 indices) = 76
    spec = ModelSpec(name="m", num_blocks=1, hidden_size=4, num_heads=1, vocab_size=8, max_sequence_length=4,
                     gated_mlp=True, learned_positions=False, bias=False, rms_norm=True,
                     moe=MoE(num_experts=2, top_k=1, expert_ffn_size=2))
    assert moe_mlp_bytes(spec, tp=1, mbs=1, seq=1, e=2) == 100
    dense = spec.model_copy(update={"moe": None})
    mlp_dense = 2 * 16 * 4  # the dense SwiGLU's four (b, s, f) tensors of 2 bytes, f = ffn = 4h = 16
    assert layer_bytes(spec, 1, tp=1, mbs=1, seq=1, elem_bytes=2) == pytest.approx(
        layer_bytes(dense, 1, tp=1, mbs=1, seq=1, elem_bytes=2) - mlp_dense + 100)


def test_the_builtins_plan_and_simulate():
    import sailor

    job = {"model": "mixtral-8x7b", "global_batch_size": 64, "sequence_length": 4096, "precision": "bf16"}
    cluster = {"provider": "gcp", "zones": {"us-central1-a": {"H100-80": 64}}}
    result = sailor.find_plan(job, cluster, max_stages=8, top=0, time_limit=60)
    plan = result.plan
    assert sum(r.tp for p in plan.pipelines for r in p.replicas) <= 64
    est = sailor.simulate(plan)
    assert est.iteration_time_s > 0
    # memory: at least every stage's share of the weights (all 8 experts of its blocks held)
    m = BUILTIN_MODELS["mixtral-8x7b"]
    assert m.total_params() > 46e9


def test_the_roofline_times_moe_and_dense_blocks_apart():
    from sailor.perf.roofline import layer_times
    from sailor.specs.job import JobSpec

    moe = MoE(num_experts=E, top_k=K, expert_ffn_size=FE, dense_blocks=(1,))
    job = JobSpec(model=_spec(moe), global_batch_size=8, sequence_length=64)
    t = layer_times(job, "A100-40", 1, 2)
    assert t[1, 0] != t[2, 0] and t[1, 0] == t[3, 0] and t[2, 0] > 0  # layer 2 is the dense block


# ---- runtime -----------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _runtime_mlp(shared: bool, renormalise: bool):
    from sailor.runtime.moe import MoEMLP

    moe = MoE(num_experts=E, top_k=K, expert_ffn_size=FE, norm_topk_prob=renormalise,
              **({"shared_experts": 1, "shared_ffn_size": 48, "shared_gate": True} if shared else {}))
    torch.manual_seed(0)
    mlp = MoEMLP(_spec(moe))
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    return mlp


@pytest.mark.parametrize("shared, renormalise", [(False, True), (True, False)])
def test_the_moe_mlp_is_a_weighted_sum_of_its_top_k_experts(shared, renormalise):
    mlp = _runtime_mlp(shared, renormalise)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = mlp(x)
        want = torch.zeros_like(x)
        for b in range(2):
            for t in range(5):
                v = x[b, t]
                p = torch.softmax(mlp.router(v), dim=-1)
                top, idx = p.topk(K)
                if renormalise:
                    top = top / top.sum()
                want[b, t] = sum(w * mlp.experts[str(int(j))](v) for w, j in zip(top, idx))
                if shared:
                    want[b, t] += torch.sigmoid(mlp.shared_gate(v)) * mlp.shared(v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_every_expert_gets_a_gradient_even_when_no_token_chose_it():
    mlp = _runtime_mlp(False, True)
    with torch.no_grad():
        mlp.router.weight.zero_()
        mlp.router.weight[:, 0] = torch.tensor([5.0, 4.0, -5.0, -5.0])  # tokens with x0 > 0 pick experts 0, 1
    x = torch.zeros(1, 3, H)
    x[..., 0] = 1.0
    mlp(x).sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())
    assert mlp.experts["3"].down.weight.grad.abs().sum() == 0 and mlp.experts["0"].down.weight.grad.abs().sum() > 0


def test_load_balancing_loss_is_transformers(tmp_path):
    T = pytest.importorskip("transformers")
    from hf_models import configs

    from sailor.runtime.hf_weights import load_full_model
    from sailor.runtime.moe import load_balancing_loss, record_router_logits

    for arch in ("mixtral", "qwen2_moe"):
        config = configs()[arch]
        torch.manual_seed(0)
        hf = T.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0.0, 0.2)
        hf.save_pretrained(tmp_path / arch)
        x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = hf(x, output_router_logits=True).aux_loss
            model = load_full_model(tmp_path / arch)
            with record_router_logits(model) as logits:
                model(x)
        moe = model.spec.moe
        assert len(logits) == sum(model.spec.is_moe_block(i) for i in range(model.spec.num_layers))
        got = load_balancing_loss(logits, moe.num_experts, moe.top_k)
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)
        assert got.item() > 0


def test_the_reference_adds_the_weighted_load_balancing_loss():
    from sailor.runtime.model import init_full_model, lm_loss_sum
    from sailor.runtime.moe import load_balancing_loss, record_router_logits
    from sailor.runtime.reference import training_loss

    spec = _spec(MoE(num_experts=E, top_k=K, expert_ffn_size=FE, aux_loss_coef=0.25))
    model = init_full_model(spec, seed=3)
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with record_router_logits(model) as logits:
            ce = lm_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / 32
        aux = load_balancing_loss(logits, E, K)
        assert len(logits) == 4 and aux > 0
        torch.testing.assert_close(training_loss(model, tokens), ce + 0.25 * aux)


def test_the_distributed_runtime_refuses_what_it_cannot_run_yet():
    # (sequence parallelism on an MoE stage is the plan's refusal, for every caller: test_moe_ep)
    from sailor.runtime.validate import check_moe
    from sailor.specs.job import JobSpec

    moe = MoE(num_experts=E, top_k=K, expert_ffn_size=FE)
    job = JobSpec(model=_spec(moe.model_copy(update={"capacity_factor": 1.25})), global_batch_size=8,
                  sequence_length=32)
    with pytest.raises(SailorInputError, match="dropless") as e:
        check_moe(job, source="plan.json", job_source="job.yaml")
    assert (e.value.field, e.value.source) == ("model.moe.capacity_factor", "job.yaml")
    check_moe(JobSpec(model=_spec(moe), global_batch_size=8, sequence_length=32), source="plan.json")


def test_q_and_k_norms_over_all_heads_are_tp_1_only():
    # OLMoE's norms span every head, which a TP split would cut: the planner offers TP 1 only, and a
    # plan asking for more is refused naming the reason
    spec = _spec(MoE(num_experts=E, top_k=K, expert_ffn_size=FE), qk_norm=True, qk_norm_span="all")
    assert spec.tp_degrees(8) == [1] and _spec(qk_norm=True).tp_degrees(8) == [1, 2]
    with pytest.raises(SailorInputError, match="normalises q and k over all heads"):
        spec.check_tp(2)
    # its norms hold a·d + kv·d weights (64 + 32); per-head ones 2·d
    assert spec.params(1, 1) - _spec(MoE(num_experts=E, top_k=K, expert_ffn_size=FE)).params(1, 1) == 64 + 32
    assert _spec(qk_norm=True).params(1, 1) - _spec().params(1, 1) == 2 * 16


@pytest.mark.parametrize("shared, renormalise", [(False, True), (True, False)])
def test_moe_block_activation_bytes_are_what_autograd_saves(shared, renormalise):
    # The runtime's MoE block at TP 1 (fp32 on CPU: norm statistics in fp32 too) keeps exactly what
    # `layer_bytes` counts: the saved-tensor hooks of `sailor profile`
    from sailor.runtime.model import GPT
    from sailor.runtime.profile_measure import _saved_bytes

    mlp = _runtime_mlp(shared, renormalise)
    spec = _spec(MoE(num_experts=E, top_k=K, expert_ffn_size=FE, norm_topk_prob=renormalise,
                     **({"shared_experts": 1, "shared_ffn_size": 48, "shared_gate": True} if shared else {})))
    block = GPT(spec).layers["1"]
    block.mlp = mlp  # random routing weights: tokens spread over the experts
    x = torch.randn(2, 32, H, generator=torch.Generator().manual_seed(4), requires_grad=True)
    assert _saved_bytes(block, lambda: block(x)) == layer_bytes(spec, 1, tp=1, mbs=2, seq=32, elem_bytes=4,
                                                                stats_bytes=4)
