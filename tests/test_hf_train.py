"""`sailor train --init-from` on a heterogeneous plan (two stages, pipelines of TP 2 + 1 and 1 + 2,
shares 3 : 1) trains exactly like one process started from the same Hugging Face weights, on a
nanoGPT-style token file: the first loss is transformers' own, every later loss and the final weights
match the single-process reference, and a tied head stays equal to the embedding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf_models import VOCAB, make_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")

from sailor.runtime import checkpoint as ckpt  # noqa: E402
from sailor.runtime.data import batch_tokens, load_corpus  # noqa: E402
from sailor.runtime.hf_weights import load_full_model  # noqa: E402
from sailor.runtime.launcher import ExitStatus, TrainOptions, launch, prepare  # noqa: E402
from sailor.runtime.reference import train_reference  # noqa: E402
from sailor.specs import JobSpec  # noqa: E402

STEPS, RTOL = 3, 1e-5
# Adam's first steps move an element by up to lr = 1e-3 whatever its gradient's size, so an element
# whose gradient is near rounding level (a saturated SiLU gate of these N(0, 0.2) weights) can differ
# by a small fraction of that between two summation orders: 10 % of one step.
PARAM_ATOL = 1e-4


def _rep(stage: int, tp: int) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


@pytest.mark.parametrize("arch", ["gpt2", "llama3"])  # tied + Conv1D + learned positions; GQA + llama3 RoPE
def test_init_from_on_a_mixed_plan_equals_the_single_process_run(arch, tmp_path):
    folder = tmp_path / arch
    hf = make_model(arch, folder, max_shard_size="60KB")
    data = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, VOCAB, 20_000).astype(np.uint16).tofile(data)  # as nanoGPT writes it
    job = {"model": str(folder / "config.json"), "global_batch_size": 8, "sequence_length": 32}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"micro_batch_size": 2, "stages": [[0, 2], [2, 4]], "job": job, "pipelines": [
        {"microbatches": 3, "replicas": [_rep(0, 2), _rep(1, 1)]},
        {"microbatches": 1, "replicas": [_rep(0, 1), _rep(1, 2)]}]}))
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
    got = ckpt.load_tensors(found.path, found.manifest, list(found.manifest["tensors"]))
    for name, p in model.state_dict().items():  # a tied model's state dict names the head too
        if name.endswith("attn.k.bias"):
            # Its exact gradient is 0 (a key bias adds q.b to every score of a row; softmax ignores
            # that), so Adam turns rounding noise into steps of size lr: different in any two runs,
            # and without effect on the outputs.
            continue
        torch.testing.assert_close(got[name]["param"], p, rtol=RTOL, atol=PARAM_ATOL, msg=name)
    if arch == "gpt2":
        assert torch.equal(got["layers.0.tok.weight"]["param"], got["layers.3.lm.weight"]["param"])
    assert all(0 < r["mfu"] < 1 for r in rows)
