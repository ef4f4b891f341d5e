"""`sailor export` keeps what a Hugging Face folder holds besides the architecture and the weights
(sailor.model.hf_files): token ids, dropout rates, generation_config.json and the tokenizer files of
the folder a run started from, so transformers loads the export, tokenizes with it and `generate`s
the same tokens as from the source; from the manifest's record alone when that folder is gone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hf_models import VOCAB

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")

from sailor.core.errors import SailorInputError  # noqa: E402
from sailor.model.hf_config import load_hf_config  # noqa: E402
from sailor.model.hf_files import RECORD_KEY, TOKENIZER_FILES, source_record  # noqa: E402
from sailor.runtime.checkpoint_io import write_checkpoint  # noqa: E402
from sailor.runtime.hf_weights import export_checkpoint, load_full_model  # noqa: E402

SPECIAL = {"pad": 0, "bos": 1, "eos": 2}
GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_new_tokens": 6, "do_sample": False,
              "repetition_penalty": 1.3}


def _source(folder: Path):
    """A tiny random Llama (2 blocks, GQA) with token ids, attention dropout 0.1, a generation config
    and a word-level tokenizer of VOCAB tokens; returns the transformers model (eval mode)."""
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        attention_dropout=0.1, **{f"{k}_token_id": v for k, v in SPECIAL.items()})
    torch.manual_seed(3)
    model = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    T.GenerationConfig(**GENERATION).save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                              pad_token="<pad>").save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    return folder, _source(folder)


def _checkpoint(folder: Path, root: Path, record: dict | None) -> Path:
    """A step-5 checkpoint of `folder`'s weights whose manifest records `record` as the worker does."""
    model = load_full_model(folder)
    meta = {"seed": 0, "model": model.spec.model_dump(mode="json"), "global_batch_size": 4}
    return write_checkpoint(root, 5, meta | ({RECORD_KEY: record} if record else {}),
                            {n: {"param": p.detach().clone()} for n, p in model.named_parameters()})


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_the_export_keeps_ids_dropout_generation_config_and_tokenizer(source, tmp_path):
    folder, hf = source
    spec = load_hf_config(folder)
    record = source_record(folder, spec)  # what the worker writes into every manifest of an --init-from run
    assert record == {"folder": str(folder.resolve()), "generation_config": json.loads(
        (folder / "generation_config.json").read_text()), "config": {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "attention_dropout": 0.1}}
    _checkpoint(folder, tmp_path / "ck", record)
    summary = export_checkpoint(tmp_path / "ck", tmp_path / "out")
    out = tmp_path / "out"
    assert summary["kept_from"] == str(folder.resolve())
    written = {"generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert written <= {p.name for p in folder.iterdir()}
    for name in {p.name for p in folder.iterdir()} & {*TOKENIZER_FILES, "generation_config.json"}:
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name  # byte for byte
        assert name in summary["files"]
    mine, theirs = _config(out), _config(folder)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout"):
        assert mine[key] == theirs[key], key
    back = T.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.config.attention_dropout == 0.1  # kept, not rewritten to 0
    assert back.generation_config.to_dict() == T.GenerationConfig.from_pretrained(folder).to_dict()
    tok = T.AutoTokenizer.from_pretrained(out)
    ids = tok("w5 w17 w250 w3", return_tensors="pt").input_ids
    assert ids.tolist() == [[5, 17, 250, 3]] and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    ref = T.AutoModelForCausalLM.from_pretrained(folder).eval()  # the source as transformers loads it
    mask = torch.ones_like(ids)
    with torch.no_grad():  # greedy, repetition penalty from the generation config: the same tokens as the source
        got, want = back.generate(ids, attention_mask=mask), ref.generate(ids, attention_mask=mask)
    assert got.shape == (1, ids.shape[1] + GENERATION["max_new_tokens"]) and torch.equal(got, want)
    assert torch.equal(hf.lm_head.weight, back.lm_head.weight)  # the checkpoint's (here: the source's) weights
    # Guard: the kept setting matters; without the repetition penalty the greedy tokens differ
    with torch.no_grad():
        plain = back.generate(ids, attention_mask=mask, repetition_penalty=1.0)
    assert not torch.equal(plain, want)


def test_without_the_folder_the_manifest_record_still_gives_ids_and_generation_config(source, tmp_path):
    folder, _hf = source
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    _checkpoint(moved, tmp_path / "ck", source_record(moved, load_hf_config(moved)))
    shutil.rmtree(moved)  # exported on another machine: the folder is not here
    summary = export_checkpoint(tmp_path / "ck", tmp_path / "out")
    assert summary["kept_from"] == "checkpoint manifest"
    assert _config(tmp_path / "out")["eos_token_id"] == 2 and _config(tmp_path / "out")["attention_dropout"] == 0.1
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == \
        json.loads((folder / "generation_config.json").read_text())
    assert not list((tmp_path / "out").glob("tokenizer*"))  # not recorded: only copied from a folder
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.generation_config.repetition_penalty == 1.3


def test_an_explicit_source_is_used_and_must_hold_the_same_model(source, tmp_path):
    folder, _hf = source
    _checkpoint(folder, tmp_path / "ck", None)  # e.g. a run whose model came from a config path, no --init-from
    assert export_checkpoint(tmp_path / "ck", tmp_path / "plain")["kept_from"] is None
    assert "eos_token_id" not in _config(tmp_path / "plain") and not (tmp_path / "plain" / "tokenizer.json").exists()
    summary = export_checkpoint(tmp_path / "ck", tmp_path / "out", source=folder)
    assert summary["kept_from"] == str(folder) and (tmp_path / "out" / "tokenizer.json").exists()
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    cfg = _config(other) | {"num_key_value_heads": 4}
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SailorInputError, match="holds another model than the checkpoint: kv_heads 4") as e:
        export_checkpoint(tmp_path / "ck", tmp_path / "out2", source=other)
    assert "\n" not in e.value.one_line() and not (tmp_path / "out2").exists()


def test_a_token_id_that_is_no_integer_is_refused_naming_it(source, tmp_path):
    folder, _hf = source
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "config.json").write_text(json.dumps(_config(folder) | {"eos_token_id": [2, "</s>"]}))
    with pytest.raises(SailorInputError, match="config.json: eos_token_id: a token id is an integer >= 0, got '</s>'"):
        source_record(bad, load_hf_config(folder))


def _export_cli(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    import sys

    from sailor.cli import main
    monkeypatch.setattr(sys, "argv", ["sailor", "export", *args])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_the_cli_says_when_nothing_is_kept_and_takes_source(source, tmp_path, monkeypatch, capsys):
    folder, _hf = source
    _checkpoint(folder, tmp_path / "ck", None)
    code, _, err = _export_cli([str(tmp_path / "ck"), "--to", str(tmp_path / "a")], monkeypatch, capsys)
    assert code in (0, None) and err.strip().splitlines() == [
        "note: no Hugging Face folder known for this checkpoint: token ids, dropout, generation config and tokenizer"
        " not written (pass --source FOLDER)"], err
    code, out, err = _export_cli([str(tmp_path / "ck"), "--to", str(tmp_path / "b"), "--source", str(folder), "--json"],
                                 monkeypatch, capsys)
    assert code in (0, None) and err == "", err
    summary = json.loads(out)
    assert summary["kept_from"] == str(folder) and "tokenizer.json" in summary["files"]
    code, _, err = _export_cli([str(tmp_path / "ck"), "--to", str(tmp_path / "c"), "--source", str(tmp_path / "nope")],
                               monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nope" in err, err
