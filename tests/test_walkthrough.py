"""The README's Hugging Face walk-through, run line for line as a user would (bash, the `sailor`
command): config.json + text -> tokenizer -> token file -> plan -> 20 steps on a heterogeneous CPU
plan -> export -> transformers. Then the exported folder must give transformers the same logits as
Sailor's own forward of the checkpoint, and the TensorBoard files must hold the 20 steps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _walkthrough() -> str:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- walkthrough:start -->\s*```sh\n(.*?)```\s*<!-- walkthrough:end -->", text, re.S)
    assert block, "README.md has no walk-through block"
    return block.group(1)


@pytest.mark.integration
def test_readme_walkthrough(tmp_path):
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    env = dict(os.environ, TMPDIR=str(tmp_path), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", _walkthrough()], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (work,) = [p for p in tmp_path.iterdir() if p.is_dir() and (p / "ck").exists()]
    assert "step 20/20" in r.stderr and "LlamaForCausalLM: 213,568 parameters" in r.stdout

    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 21)) and rows[-1]["loss"] < rows[0]["loss"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(work / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 21))

    from sailor.runtime import checkpoint as ckpt
    from sailor.runtime.checkpoint_io import load_tensors
    from sailor.runtime.model import GPT
    from sailor.specs import load_job

    spec = load_job(work / "job.yaml").model
    found = ckpt.find_latest(work / "ck")
    assert found.manifest["step"] == 20
    model = GPT(spec)
    tensors = load_tensors(found.path, found.manifest, [n for n, _ in model.named_parameters()])
    model.load_state_dict({n: v["param"] for n, v in tensors.items()})
    hf = T.AutoModelForCausalLM.from_pretrained(work / "tiny-llama-hf").eval()
    # --source .: the export keeps the config's token ids and the tokenizer trained above
    assert (work / "tiny-llama-hf" / "tokenizer.json").read_bytes() == (work / "tokenizer.json").read_bytes()
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (0, 0)
    import numpy as np

    ids = torch.from_numpy(np.load(work / "tokens.npy")[1000:1128].astype(np.int64))[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)
