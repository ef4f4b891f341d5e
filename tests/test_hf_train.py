"""`sailor train --init-from` on a heterogeneous plan (two stages, pipelines of TP 2 + 1 and 1 + 2,
shares 3 : 1) trains exactly like one process started from the same Hugging Face weights, on a
nanoGPT-style token file: the first loss is transformers' own, every later loss and the final weights
match the single-process reference, and a tied head stays equal to the embedding. The same holds
for every architecture under memory options (recomputation, sequence parallelism, ZeRO-1/2/3), whose
saved activations equal `sailor.model.activations.stage_activation_bytes` and whose ZeRO-3 checkpoint exports back to
transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_models import ARCHS, VOCAB, make_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")

from sailor.model.activations import stage_activation_bytes  # noqa: E402
from sailor.plan.spec import Plan  # noqa: E402
from sailor.runtime import checkpoint as ckpt
from sailor.runtime.checkpoint_io import load_tensors  # noqa: E402
from sailor.runtime.data import batch_tokens, load_corpus  # noqa: E402
from sailor.runtime.hf_weights import export_checkpoint, load_full_model  # noqa: E402
from sailor.runtime.launcher import ExitStatus, launch  # noqa: E402
from sailor.runtime.model import GPT  # noqa: E402
from sailor.runtime.prepare import TrainOptions, prepare  # noqa: E402
from sailor.runtime.reference import train_reference  # noqa: E402
from sailor.specs.job import JobSpec  # noqa: E402

STEPS, RTOL = 3, 1e-5
# Adam's first steps move an element by up to lr = 1e-3 whatever its gradient's size, so an element
# whose gradient is near rounding level (a saturated SiLU gate of these N(0, 0.2) weights) can differ
# by a small fraction of that between two summation orders: 10 % of one step.
PARAM_ATOL = 1e-4


def _rep(stage: int, tp: int) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


def _train(arch: str, plan_body: dict, tmp_path) -> tuple:
    """`sailor train --init-from` of model `arch` on `plan_body` for STEPS steps on a nanoGPT-style
    token file; checks the first loss against transformers' and every loss and the final weights
    against the single-process reference. Returns (result, rows, the last checkpoint's tensors, the
    model folder)."""
    folder = tmp_path / arch
    hf = make_model(arch, folder, max_shard_size="60KB")
    data = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, VOCAB, 20_000).astype(np.uint16).tofile(data)  # as nanoGPT writes it
    job = {"model": str(folder / "config.json"), "global_batch_size": 8, "sequence_length": 32}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"micro_batch_size": 2, "stages": [[0, 2], [2, 4]], "job": job, **plan_body}))
    metrics = tmp_path / "metrics.jsonl"
    result = launch(prepare(TrainOptions(plan=str(plan), steps=STEPS, data=str(data), init_from=str(folder),
                                         metrics=str(metrics), checkpoint_dir=str(tmp_path / "ck"), timeout_s=60)),
                    handle_signals=False)
    assert result.status is ExitStatus.DONE, result.message
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]

    corpus = load_corpus(data)
    tokens = torch.from_numpy(batch_tokens(corpus, seed=0, step=0, first=0, count=8, seq=32))
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
    assert rows[0]["loss"] == pytest.approx(first, rel=RTOL)  # before any update: transformers' loss

    spec = JobSpec(**job)
    losses, model = train_reference(spec, steps=STEPS, seed=0, corpus=corpus, model=load_full_model(folder))
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=RTOL)
    found = ckpt.find_latest(tmp_path / "ck")
    # what `sailor export` keeps: the folder the run started from and its token ids, recorded by rank 0
    record = found.manifest["hf_source"]
    # (a config without an eos id records none)
    assert record["folder"] == str(folder.resolve()) and record["config"].get("eos_token_id") == hf.config.eos_token_id
    got = load_tensors(found.path, found.manifest, list(found.manifest["tensors"]))
    for name, p in model.state_dict().items():  # a tied model's state dict names the head too
        if name.endswith("attn.k.bias"):
            # Its exact gradient is 0 (a key bias adds q.b to every score of a row; softmax ignores
            # that), so Adam turns rounding noise into steps of size lr: different in any two runs,
            # and without effect on the outputs.
            continue
        torch.testing.assert_close(got[name]["param"], p, rtol=RTOL, atol=PARAM_ATOL, msg=name)
    if spec.model.tied_embeddings:
        head = f"layers.{spec.model.num_layers - 1}.lm.weight"
        assert torch.equal(got["layers.0.tok.weight"]["param"], got[head]["param"])
    return result, rows, got, folder


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["gpt2", "llama3"])  # tied + Conv1D + learned positions; GQA + llama3 RoPE
def test_init_from_on_a_mixed_plan_equals_the_single_process_run(arch, tmp_path):
    _, rows, _, _ = _train(arch, {"pipelines": [
        {"microbatches": 3, "replicas": [_rep(0, 2), _rep(1, 1)]},
        {"microbatches": 1, "replicas": [_rep(0, 1), _rep(1, 2)]}]}, tmp_path)
    assert all(0 < r["mfu"] < 1 for r in rows)


@pytest.mark.integration
def test_a_mixture_of_experts_on_tp_and_stages_equals_the_single_process_run(tmp_path):
    # Qwen2-MoE: layer 1 (4 experts, a gated shared expert) on a TP 2 stage, layer 2 (dense) on the
    # next stage; the experts' shards, the one all-reduce of their outputs and the replicated router
    # train exactly as one process does
    _train("qwen2_moe", {"pipelines": [{"microbatches": 4, "replicas": [_rep(0, 2), _rep(1, 1)]}]}, tmp_path)


# Memory options on every architecture's blocks: sequence parallelism with selective recomputation
# (the attention core with each RoPE variant) and ZeRO-3 on one stage, full recomputation and ZeRO-1/2
# on the other; the tied copies sit on stages of different ZeRO stages and TP degrees.
MEMORY_PLANS = [
    {"memory": [{"recompute": "selective", "zero": 3, "sequence_parallel": True}, {"recompute": "full", "zero": 2}],
     "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 2), _rep(1, 1)]},
                   {"microbatches": 1, "replicas": [_rep(0, 2), _rep(1, 1)]}]},
    {"memory": [{"recompute": "full", "zero": 1}, {"recompute": "selective", "zero": 3, "sequence_parallel": True}],
     "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 1), _rep(1, 2)]},
                   {"microbatches": 1, "replicas": [_rep(0, 1), _rep(1, 2)]}]},
]


@pytest.mark.integration
@pytest.mark.parametrize("arch", ARCHS)
def test_memory_options_with_every_architecture_equal_the_single_process_run(arch, tmp_path):
    import transformers as T

    body = MEMORY_PLANS[ARCHS.index(arch) % 2]
    result, _, got, folder = _train(arch, body, tmp_path)
    # what each replica's widest TP rank kept for its backward, at its TP degree, is the runtime
    # formula's (under TP the head's ranks keep their vocabulary shard's logits: the last shard of the
    # 300 real tokens is narrower), and no rank kept more
    spec = load_full_model(folder).spec
    plan = Plan.model_validate({"micro_batch_size": 2, "stages": [[0, 2], [2, 4]], **body})
    events = [e for e in result.events if e["event"] == "memory"]
    assert len(events) == 6
    replicas: dict[tuple, list[dict[int, float]]] = {}
    for e in events:
        replicas.setdefault((e["pipeline"], e["stage"], e["tp"]), []).append(
            {int(k): v for k, v in e["activations"].items()})
    for (_, stage, tp), kept in replicas.items():
        want = stage_activation_bytes(spec, plan.stages[stage], plan.stage_memory(stage), mbs=2, seq=32, tp=tp,
                                      elem_bytes=4)
        assert {k: max(r[k] for r in kept) for k in want} == want, (stage, tp, kept)
        assert all(r.keys() == want.keys() and all(r[k] <= want[k] for k in want) for r in kept), kept
    # the last checkpoint (written from ZeRO-3 shards) exports to a folder transformers loads, with
    # the logits of the runtime's model holding the checkpoint's weights
    export_checkpoint(tmp_path / "ck", tmp_path / "out")
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    trained = GPT(spec)
    trained.load_state_dict({n: t["param"] for n, t in got.items()})
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, trained(x), atol=1e-4, rtol=0)


@pytest.mark.integration
def test_a_mixture_of_experts_under_zero_and_recomputation_equals_the_single_process_run(tmp_path):
    # Mixtral's MoE blocks recomputed (full, then selective) with their experts' weights sharded by
    # ZeRO-3 and ZeRO-2 over two pipelines: the same losses and weights as one process
    _train("mixtral", {"memory": [{"recompute": "full", "zero": 3}, {"recompute": "selective", "zero": 2}],
                       "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 1), _rep(1, 1)]},
                                     {"microbatches": 1, "replicas": [_rep(0, 1), _rep(1, 1)]}]}, tmp_path)


@pytest.mark.integration
def test_olmoe_on_two_pipeline_stages_equals_the_single_process_run(tmp_path):
    # OLMoE (q and k norms over all heads, so TP 1): a 2-rank pipeline, one block per stage
    _train("olmoe", {"pipelines": [{"microbatches": 4, "replicas": [_rep(0, 1), _rep(1, 1)]}]}, tmp_path)
