"""The MoE load-balancing loss in distributed runs (issue #30, `runtime.balance`): per micro-batch, its
statistics carried from chunk to chunk and its gradient added stage by stage. In one process, two
chunks of a model run micro-batch by micro-batch as a pipeline runs them must give the reference's loss
and gradients; (integration, 3-4 processes) plans with pipelines, TP, EP, ZeRO and recomputation must
train as the single-process run with the same micro-batches within 1e-5 at every step."""

from __future__ import annotations

import json

import pytest
import torch

from sailor.model.moe import MoE
from sailor.model.spec import ModelSpec
from sailor.runtime.balance import load_balancing
from sailor.runtime.executor import NoHooks, StageExecutor
from sailor.runtime.model import init_full_model, lm_loss_sum
from sailor.runtime.moe import load_balancing_loss, record_router_logits
from sailor.runtime.reference import training_loss
from sailor.specs.job import JobSpec

E, K, COEF = 4, 2, 0.5


def _spec(**moe) -> ModelSpec:
    return ModelSpec(name="m", num_blocks=4, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                     vocab_size=256, max_sequence_length=64, gated_mlp=True, learned_positions=False, bias=False,
                     rms_norm=True, tied_embeddings=False,
                     moe=MoE(num_experts=E, top_k=K, expert_ffn_size=16, aux_loss_coef=COEF, **moe))


def test_the_reference_averages_the_loss_over_micro_batches():
    torch.manual_seed(0)
    spec = _spec()
    model = init_full_model(spec, 0)
    tokens = torch.randint(0, 256, (4, 17))
    with torch.no_grad(), record_router_logits(model) as logits:
        ce = lm_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
    halves = [load_balancing_loss([x[m * 32:(m + 1) * 32] for x in logits], E, K) for m in (0, 1)]
    with torch.no_grad():
        torch.testing.assert_close(training_loss(model, tokens, 2), ce + COEF * (halves[0] + halves[1]) / 2)
        whole = training_loss(model, tokens)
        torch.testing.assert_close(whole, ce + COEF * load_balancing_loss(logits, E, K))
        # the split matters (by little at initialisation, where routing is near uniform)
        assert float(sum(halves)) / 2 != pytest.approx(float(load_balancing_loss(logits, E, K)), rel=1e-6)
    with pytest.raises(ValueError, match="micro-batches of 3 samples"):
        training_loss(model, tokens, 3)


def test_two_chunks_micro_batch_by_micro_batch_give_the_reference_loss_and_gradients():
    # chunk 0 holds the embedding and blocks 1-2, chunk 1 blocks 3-4 and the head (layers 0-2, 3-5);
    # 2 micro-batches of 2 samples; statistics forward and the gradient vector back as the pipeline
    # passes them, forwards of both micro-batches first (as a deep pipeline does)
    spec = _spec(first_dense=1)  # block 1 dense: chunk 0 holds one MoE block, chunk 1 two
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    ref = init_full_model(spec, 0)
    training_loss(ref, tokens, 2).backward()
    model = init_full_model(spec, 0)
    chunks = [StageExecutor(model, NoHooks(), first_stage=True, layers=(0, 3)),
              StageExecutor(model, NoHooks(), first_stage=False, layers=(3, 6))]
    lb = load_balancing(model, spec, tokens=2 * 16, device=torch.device("cpu"))
    scale, total, outs, sides = 1.0 / tokens[:, 1:].numel(), 0.0, {}, {}
    for k in (0, 1):
        mb = tokens[2 * k:2 * k + 2]
        lb.begin_forward(0, k, None)
        x = chunks[0].forward(k, mb[:, :-1])
        sent = lb.end_forward(0, k)
        lb.begin_forward(1, k, sent)

        def loss(logits, k=k, mb=mb):
            nonlocal total
            value = lm_loss_sum(logits, mb[:, 1:])
            total += float(value.detach()) + float(lb.finish(1, k, scale))
            return value * scale
        outs[k] = chunks[1].forward(k, x.detach(), loss=loss)
        lb.end_forward(1, k)
    for k in (0, 1):
        lb.begin_backward(1, k, None)
        grad = chunks[1].backward(k, None)
        sides[k] = lb.end_backward(1, k)
        lb.begin_backward(0, k, sides[k])
        chunks[0].backward(k, grad)
        lb.end_backward(0, k)
    assert not lb.slots
    with torch.no_grad():
        want = float(training_loss(init_full_model(spec, 0), tokens, 2))
    assert total * scale == pytest.approx(want, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    router = "layers.3.mlp.router.weight"
    without = init_full_model(spec.model_copy(update={"moe": spec.moe.model_copy(update={"aux_loss_coef": 0})}), 0)
    training_loss(without, tokens, 2).backward()
    assert not torch.allclose(dict(without.named_parameters())[router].grad, dict(model.named_parameters())[router].grad)


# ---- training (integration) ---------------------------------------------------------------------------

STEPS, RTOL = 3, 1e-5


def _rep(stage: int, tp: int = 1) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


def _train(body: dict, tmp_path) -> None:
    """`sailor train` of `_spec()` (global batch 8, micro-batches of 2, sequence 16) on `body` for STEPS
    steps; every loss equals the single-process run's with the same micro-batches within RTOL, and the
    load-balancing loss is a visible part of it."""
    from conftest import live_processes

    from sailor.runtime.data import load_corpus
    from sailor.runtime.groups import IGNORE_TAGS_ENV
    from sailor.runtime.launcher import ExitStatus, launch
    from sailor.runtime.prepare import TrainOptions, prepare
    from sailor.runtime.reference import train_reference

    job = {"model": _spec().model_dump(mode="json"), "global_batch_size": 8, "sequence_length": 16}
    plan, metrics = tmp_path / "plan.json", tmp_path / "metrics.jsonl"
    plan.write_text(json.dumps({"micro_batch_size": 2, "job": job, **body}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(IGNORE_TAGS_ENV, "1")  # matched in posting order, as under NCCL
        result = launch(prepare(TrainOptions(plan=str(plan), steps=STEPS, metrics=str(metrics), timeout_s=60)),
                        handle_signals=False)
    assert result.status is ExitStatus.DONE, result.message
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    spec = JobSpec(**job)
    want, _ = train_reference(spec, steps=STEPS, seed=0, corpus=load_corpus(), micro_batch_size=2)
    assert [r["loss"] for r in rows] == pytest.approx(want, rel=RTOL)
    dense = spec.model_copy(update={"model": _spec().model_copy(update={"moe": _spec().moe.model_copy(
        update={"aux_loss_coef": 0.0})})})
    without, _ = train_reference(dense, steps=1, seed=0, corpus=load_corpus())
    assert rows[0]["loss"] - without[0] > 100 * RTOL * rows[0]["loss"]  # COEF · aux, aux near k = 2 at first
    assert not live_processes(str(tmp_path))


@pytest.mark.integration
def test_two_stages_tp2_then_tp1_with_zero1_and_recomputation_equal_the_single_process_run(tmp_path):
    # 1F1B over 4 micro-batches: stage 0 (embedding, blocks 1-2) on TP 2 under ZeRO-1, stage 1 (blocks
    # 3-4, head) on TP 1 with every block recomputed: statistics cross a 2 -> 1 boundary forward, the
    # gradient vector a 1 -> 2 one back
    _train({"stages": [[0, 3], [3, 6]], "memory": [{"zero": 1}, {"recompute": "full"}],
            "pipelines": [{"microbatches": 4, "replicas": [_rep(0, 2), _rep(1)]}]}, tmp_path)


@pytest.mark.integration
def test_ep2_on_two_stages_of_two_pipelines_equals_the_single_process_run(tmp_path):
    # 2 pipelines of 2 stages, EP 2 on both stages: each rank routes its own micro-batches, its
    # experts' rows travel over the all-to-all; each pipeline's micro-batches carry their own statistics
    _train({"stages": [[0, 3], [3, 6]], "experts": [{"ep": 2}, {"ep": 2}], "memory": [{"zero": 2}, {}],
            "pipelines": [{"microbatches": 2, "replicas": [_rep(0), _rep(1)]}] * 2}, tmp_path)


SCHEDULES = {
    # ZB-H1: the gradient vector is added in the input-gradient pass, the router's weight gradient
    # follows in the deferred weight pass
    "zb-h1": {"stages": [[0, 3], [3, 6]], "schedule": {"kind": "zb-h1"},
              "pipelines": [{"microbatches": 4, "replicas": [_rep(0), _rep(1)]}]},
    # interleaved 1F1B, 2 chunks per stage: statistics go 0 -> 1 -> 0 -> 1 and back, chunk by chunk
    "interleaved": {"stages": [[0, 2], [2, 3], [3, 5], [5, 6]],
                    "schedule": {"kind": "interleaved-1f1b", "virtual_stages": 2},
                    "pipelines": [{"microbatches": 4, "replicas": [_rep(0), _rep(1)]}]},
}


@pytest.mark.integration
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_other_schedules_equal_the_single_process_run(schedule, tmp_path):
    _train(SCHEDULES[schedule], tmp_path)
