"""Hugging Face safetensors weights into the runtime (sailor.runtime.hf_weights): the same logits as
transformers for every architecture, in one process and on plans with TP 2 and two stages; what the
loader refuses; and `sailor export` back to a folder transformers loads with the same logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import ARCHS, MOE_ARCHS, VOCAB, hf_logits, make_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
pytest.importorskip("safetensors")

from sailor.core.errors import SailorInputError  # noqa: E402
from sailor.model.hf_config import load_hf_config  # noqa: E402
from sailor.runtime import checkpoint as ckpt  # noqa: E402
from sailor.runtime.checkpoint_io import write_checkpoint
from sailor.runtime.hf_weights import HFWeights, check_init_from, export_checkpoint  # noqa: E402
from sailor.runtime.hf_weights import load_full_model as _sailor_model  # noqa: E402

ATOL = 1e-4  # fp32


def _tokens(seed: int = 0, batch: int = 2, seq: int = 48) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Every architecture saved once; odd-numbered ones sharded (an index and several files)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for k, arch in enumerate(ARCHS + MOE_ARCHS):
        out[arch] = (root / arch, make_model(arch, root / arch, seed=k, max_shard_size="60KB" if k % 2 else None))
    return out


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_same_logits_as_transformers_in_one_process(arch, models):
    folder, hf = models[arch]
    x = _tokens()
    ref = hf_logits(hf, x)
    with torch.no_grad():
        got = _sailor_model(folder)(x)
    assert got.shape == ref.shape == (2, 48, VOCAB)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert ref.abs().max() > 0.5  # logits of random weights, not zeros


def test_sharded_checkpoints_have_an_index(models):
    assert (models["llama_bias_tied"][0] / "model.safetensors.index.json").exists()
    assert not (models["llama3"][0] / "model.safetensors.index.json").exists()


def test_the_rope_settings_matter(models, tmp_path):
    # Guard against a test that cannot fail: with the scaling or the rotary fraction left out, the
    # logits differ from transformers'.
    x = _tokens()
    for arch, change in (("llama3", {"rope_scaling": None}), ("gpt_neox", {"rotary_fraction": 1.0})):
        folder, hf = models[arch]
        model = _sailor_model(folder)
        wrong = model.spec.model_copy(update=change)
        for block in list(model.layers.values())[1:-1]:
            block.attn.spec, block.attn._inv = wrong, {}
        with torch.no_grad():
            assert (model(x) - hf_logits(hf, x)).abs().max() > 1e-3, arch


PLANS = {
    # stage 0 (embedding + block 1) on TP 2, stage 1 (block 2 + head) on TP 1
    "tp2_then_tp1": {"micro_batch_size": 2, "stages": [[0, 2], [2, 4]], "pipelines": [{"microbatches": 1, "replicas": [
        {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 2}, {"stage": 1, "gpu": "cpu", "zone": "local", "tp": 1}]}]},
    # the head's vocabulary split over TP 2, next to a one-stage TP 1 pipeline... as two pipelines
    "tp1_then_tp2": {"micro_batch_size": 2, "stages": [[0, 1], [1, 4]], "pipelines": [{"microbatches": 1, "replicas": [
        {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}, {"stage": 1, "gpu": "cpu", "zone": "local", "tp": 2}]}]},
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_same_logits_on_plans_with_tp_and_stages(plan, models, tmp_path):
    from hf_forward import run_plan

    x = _tokens(seed=3)
    torch.save(x, tmp_path / "tokens.pt")
    archs = ARCHS + [a for a in MOE_ARCHS if a != "olmoe"]  # OLMoE's q/k norms over all heads: TP 1 only
    run_plan(PLANS[plan], [(a, str(models[a][0]), str(tmp_path / "tokens.pt")) for a in archs], tmp_path)
    for arch in archs:
        got = torch.load(tmp_path / f"{arch}-p0.pt")
        torch.testing.assert_close(got, hf_logits(models[arch][1], x), atol=ATOL, rtol=0, msg=f"{plan} {arch}")


def test_a_bare_gpt2_checkpoint_loads_the_same(models, tmp_path):
    # The original gpt2 checkpoint names its tensors without the `transformer.` prefix.
    from safetensors.torch import load_file, save_file

    folder, hf = models["gpt2"]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, str(bare / "model.safetensors"))
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(_sailor_model(bare)(x), hf_logits(hf, x), atol=ATOL, rtol=0)


def _copy_model(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"))
    return dst


def test_the_loader_refuses_bad_weights(models, tmp_path):
    folder, _ = models["llama3"]
    spec = load_hf_config(folder)
    wrong = _copy_model(folder, tmp_path / "wrong", lambda t: t | {
        "model.layers.1.mlp.up_proj.weight": torch.zeros(80, 64)})
    with pytest.raises(SailorInputError, match=r"shape \[80, 64\] in model.safetensors, the config implies \[96, 64\]") as e:
        HFWeights(wrong, spec).check()
    assert e.value.field == "model.layers.1.mlp.up_proj.weight"
    missing = _copy_model(folder, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if "layers.1.mlp.up" not in k})
    with pytest.raises(SailorInputError, match="missing from the checkpoint"):
        HFWeights(missing, spec).check()
    extra = _copy_model(folder, tmp_path / "extra", lambda t: t | {"model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(SailorInputError, match="a tensor the config does not describe"):
        HFWeights(extra, spec).check()
    ints = _copy_model(folder, tmp_path / "ints", lambda t: t | {"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    with pytest.raises(SailorInputError, match="dtype I32"):
        HFWeights(ints, spec).check()
    truncated = _copy_model(folder, tmp_path / "truncated", lambda t: t)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(SailorInputError, match="not a readable safetensors file .*truncated") as e:
        HFWeights(truncated, spec).check()
    assert e.value.source.endswith("model.safetensors")
    with pytest.raises(SailorInputError, match="the job's model has"):
        check_init_from(folder, load_hf_config(models["mistral"][0]))


def _train_cli(tmp_path: Path, plan: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", "train", str(plan), *args],
                          capture_output=True, text=True, timeout=300)


def _plan_file(tmp_path: Path, folder: Path) -> Path:
    job = {"model": str(folder / "config.json"), "global_batch_size": 4, "sequence_length": 32}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({**PLANS["tp2_then_tp1"], "micro_batch_size": 2,
                                "pipelines": [{**PLANS["tp2_then_tp1"]["pipelines"][0], "microbatches": 2}], "job": job}))
    return plan


@pytest.mark.integration
def test_sailor_train_refuses_bad_weights_before_starting(models, tmp_path):
    folder, _ = models["llama3"]
    plan = _plan_file(tmp_path, folder)
    wrong = _copy_model(folder, tmp_path / "wrong", lambda t: t | {"model.norm.weight": torch.zeros(32)})
    truncated = _copy_model(folder, tmp_path / "truncated", lambda t: t)
    (truncated / "model.safetensors").write_bytes((truncated / "model.safetensors").read_bytes()[:-10])
    for bad, message in ((wrong, "model.norm.weight: shape [32] in model.safetensors, the config implies [64]"),
                         (truncated, "not a readable safetensors file")):
        r = _train_cli(tmp_path, plan, "--init-from", str(bad), "--steps", "1")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr


def _checkpoint_from_hf(folder: Path, root: Path) -> Path:
    """A Sailor checkpoint (step 0, one stage file) holding the weights of an HF model folder."""
    model = _sailor_model(folder)
    return write_checkpoint(root, 0, {"seed": 0, "model": model.spec.model_dump(mode="json"), "global_batch_size": 4},
                            {n: {"param": p.detach().clone()} for n, p in model.named_parameters()})


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_export_loads_back_into_transformers_with_the_same_logits(arch, models, tmp_path):
    import transformers as T

    folder, hf = models[arch]
    step = _checkpoint_from_hf(folder, tmp_path / "ck")
    summary = export_checkpoint(tmp_path / "ck", tmp_path / "out", max_shard_bytes=40_000 if arch == "qwen2" else 2**30)
    assert summary["step"] == 0 and summary["parameters"] == hf.num_parameters()
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.num_parameters() == hf.num_parameters()
    x = _tokens(seed=5)
    torch.testing.assert_close(hf_logits(back, x), hf_logits(hf, x), atol=ATOL, rtol=0)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists() == (arch == "qwen2")
    assert step.exists() and not list(tmp_path.glob(".out.*"))  # no temporary folder left


def test_a_builtin_model_exports_as_gpt2(tmp_path):
    import transformers as T

    from sailor.model.registry import BUILTIN_MODELS
    from sailor.runtime.model import init_full_model

    spec = BUILTIN_MODELS["tiny"]  # learned positions, exact GELU, tied: GPT-2 with activation "gelu"
    model = init_full_model(spec, seed=1)
    write_checkpoint(tmp_path / "ck", 7, {"seed": 1, "model": spec.model_dump(mode="json"), "global_batch_size": 8},
                     {n: {"param": p.detach().clone()} for n, p in model.named_parameters()})
    assert export_checkpoint(tmp_path / "ck", tmp_path / "out")["model_type"] == "gpt2"
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(back, x), model(x), atol=ATOL, rtol=0)


@pytest.mark.integration
def test_export_refuses_a_folder_in_use_and_a_missing_checkpoint(models, tmp_path):
    _checkpoint_from_hf(models["gpt2"][0], tmp_path / "ck")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    r = subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", "export", str(tmp_path / "ck"),
                        "--to", str(tmp_path / "busy")], capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "busy: exists and is not an empty folder" in lines[0], r.stderr
    assert (tmp_path / "busy" / "x").read_text() == "keep me"
    with pytest.raises(SailorInputError, match="no verified checkpoint"):
        export_checkpoint(tmp_path / "busy", tmp_path / "new")


def test_a_checkpoint_written_before_the_new_model_fields_still_matches_its_job():
    from sailor.model.registry import BUILTIN_MODELS
    from sailor.runtime.prepare import _current_model_fields

    tiny = BUILTIN_MODELS["tiny"]
    old = {k: v for k, v in tiny.model_dump(mode="json").items()
           if k in ("name", "num_blocks", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                    "max_sequence_length", "gated_mlp", "learned_positions", "bias", "rms_norm", "tied_embeddings")}
    manifest = {"model": old, "seed": 0, "global_batch_size": 8}
    want = {"seed": 0, "model": tiny.model_dump(mode="json"), "global_batch_size": 8}
    ckpt.check_compatible(_current_model_fields(manifest), want, source="ck")
    with pytest.raises(SailorInputError, match="written with model"):
        ckpt.check_compatible(manifest, want, source="ck")
