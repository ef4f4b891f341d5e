"""Token files (sailor.runtime.tokens) and `sailor data prepare` (sailor.runtime.dataprep): the
formats nanoGPT, Megatron-LM and numpy write, deterministic plan-independent sampling, bounded
resident memory, a BPE tokenizer trained here, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sailor.core.errors import SailorInputError
from sailor.runtime.data import batch_tokens, check_corpus
from sailor.runtime.dataprep import prepare_tokens
from sailor.runtime.tokens import RELEASE_BYTES, TokenFile, open_tokens, sidecar


def _ids(n: int, high: int, seed: int = 0, dtype=np.uint16) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, n).astype(dtype)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's own numpy 2 warning
def test_nanogpt_bin_npy_and_megatron_files_read_as_written(tmp_path):
    ids = _ids(10_000, 50_000)
    ids.tofile(tmp_path / "train.bin")  # nanoGPT's prepare.py: np.uint16 array .tofile
    big = _ids(10_000, 150_000, dtype=np.uint32)
    np.save(tmp_path / "big.npy", big)
    for path, want in ((tmp_path / "train.bin", ids), (tmp_path / "big.npy", big)):
        t = open_tokens(path)
        assert len(t) == len(want) and t.dtype == want.dtype
        np.testing.assert_array_equal(t[1234:1300], want[1234:1300])
        assert t.max_id() == int(want.max())
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason="megatron-core is not installed")
    torch = pytest.importorskip("torch")
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "mg.bin"), dtype=np.int32)
    docs = [big[:4000].astype(np.int32), big[4000:].astype(np.int32)]
    for doc in docs:
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(str(tmp_path / "mg.idx"))
    t = open_tokens(tmp_path / "mg.bin")  # the dtype comes from Megatron's .idx header
    assert t.dtype == np.int32 and len(t) == 10_000
    np.testing.assert_array_equal(t[3990:4010], big[3990:4010].astype(np.int32))


def test_a_sidecar_gives_a_flat_file_its_dtype(tmp_path):
    ids = _ids(5000, 100_000, dtype=np.uint32)
    ids.tofile(tmp_path / "t.bin")
    assert len(open_tokens(tmp_path / "t.bin")) == 10_000  # without it: nanoGPT's uint16, two ids per token
    sidecar(tmp_path / "t.bin").write_text('{"dtype": "uint32"}')
    t = open_tokens(tmp_path / "t.bin")
    assert len(t) == 5000
    np.testing.assert_array_equal(t[:10], ids[:10])


def test_sampling_is_the_same_from_memory_and_from_the_map_and_does_not_depend_on_the_split(tmp_path):
    ids = _ids(50_000, 30_000)
    ids.tofile(tmp_path / "t.bin")
    t = open_tokens(tmp_path / "t.bin")
    whole = batch_tokens(t, seed=3, step=7, first=0, count=8, seq=128)
    np.testing.assert_array_equal(whole, batch_tokens(ids, seed=3, step=7, first=0, count=8, seq=128))
    # a pipeline taking samples 5..7 sees exactly those rows of the global batch
    np.testing.assert_array_equal(batch_tokens(t, seed=3, step=7, first=5, count=3, seq=128), whole[5:])
    assert whole.dtype == np.int64 and whole.shape == (8, 129)
    assert not np.array_equal(batch_tokens(t, seed=3, step=8, first=0, count=8, seq=128), whole)


def _rss_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_resident_memory_stays_bounded_while_sampling_a_large_file(tmp_path):
    n = 96 * 2**20  # 192 MiB of uint16 ids: 3x the release threshold
    path = tmp_path / "t.bin"
    with open(path, "wb") as f:
        for a in range(0, n, 2**22):
            f.write(_ids(2**22, 60_000, seed=a).tobytes())
    t = open_tokens(path)
    base, peak = _rss_file_kib(), 0
    for step in range(40):
        batch_tokens(t, seed=0, step=step, first=0, count=1000, seq=1024)  # 40k windows all over the file
        peak = max(peak, _rss_file_kib() - base)
    # Without releasing, nearly every page of the file would stay mapped (~192 MiB).
    assert peak * 1024 < RELEASE_BYTES * 1.5, peak


@pytest.mark.parametrize("make,message", [
    (lambda p: p.with_suffix(".bin").write_bytes(b"\x01\x02\x03"), "3 bytes is not a whole number of uint16 tokens"),
    (lambda p: np.save(p.with_suffix(".npy"), np.ones(8, dtype=np.float32)), "token ids must be integers"),
    (lambda p: np.save(p.with_suffix(".npy"), np.ones((2, 4), dtype=np.uint16)), "expected a 1-D array"),
    (lambda p: p.with_suffix(".npy").write_bytes(b"not numpy"), "not a readable .npy file"),
    (lambda p: p.with_suffix(".bin").write_bytes(b""), "holds no tokens"),
])
def test_bad_token_files(tmp_path, make, message):
    base = tmp_path / "bad"
    make(base)
    path = next(tmp_path.iterdir())
    with pytest.raises(SailorInputError, match=message) as e:
        open_tokens(path)
    assert e.value.source == str(path)


def test_truncated_npy_is_refused(tmp_path):
    np.save(tmp_path / "t.npy", _ids(1000, 100))
    data = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(data[:-10])
    with pytest.raises(SailorInputError, match="truncated"):
        open_tokens(tmp_path / "t.npy")


# ---- sailor data prepare ------------------------------------------------------------------------

TEXT = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog; sailors plan {i % 7} pipelines."
                 for i in range(400)) + "\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer of 300 tokens trained here on TEXT (no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tok")
    (folder / "text.txt").write_text(TEXT)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(folder / "text.txt")], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_prepare_text_and_jsonl(tmp_path, tokenizer):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    (tmp_path / "a.txt").write_text(TEXT)
    docs = ["first document", "second one, a little longer", "third"]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d, "id": k}) + "\n" for k, d in enumerate(docs)))
    seen = []
    summary = prepare_tokens([tmp_path / "a.txt", tmp_path / "b.jsonl"], tokenizer=tokenizer, out=tmp_path / "t.npy",
                             eos="<|endoftext|>", progress=seen.append)
    eos = tok.token_to_id("<|endoftext|>")
    want = tok.encode(TEXT, add_special_tokens=False).ids + [eos]  # one piece: TEXT is under 1 MiB
    for d in docs:
        want += tok.encode(d, add_special_tokens=False).ids + [eos]
    got = np.load(tmp_path / "t.npy")  # numpy's own reader
    np.testing.assert_array_equal(got, np.array(want, dtype=np.uint16))
    assert summary["tokens"] == len(want) and summary["documents"] == 4 and summary["dtype"] == "uint16"
    assert sum(seen) == (tmp_path / "a.txt").stat().st_size + (tmp_path / "b.jsonl").stat().st_size
    meta = json.loads(sidecar(tmp_path / "t.npy").read_text())
    assert (meta["vocab_size"], meta["max_id"], meta["tokens"]) == (300, max(want), len(want))
    t = open_tokens(tmp_path / "t.npy")
    assert isinstance(t, TokenFile) and t.max_id() == max(want)
    check_corpus(t, seq=16, vocab_size=300)
    with pytest.raises(SailorInputError, match=r"the tokenizer's vocabulary \(300\) is larger than the model's \(256\)"):
        check_corpus(t, seq=16, vocab_size=256)
    prepare_tokens([tmp_path / "a.txt"], tokenizer=tokenizer, out=tmp_path / "flat.bin")
    np.testing.assert_array_equal(np.fromfile(tmp_path / "flat.bin", dtype=np.uint16), want[:len(want) - 4 - sum(
        len(tok.encode(d, add_special_tokens=False).ids) for d in docs)])


def test_prepare_leaves_nothing_behind_on_bad_input(tmp_path, tokenizer):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(SailorInputError, match="line 2 has no string field 'text'"):
        prepare_tokens([tmp_path / "bad.jsonl"], tokenizer=tokenizer, out=tmp_path / "t.npy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]
    with pytest.raises(SailorInputError, match="has no token '<eos>'"):
        prepare_tokens([tmp_path / "bad.jsonl"], tokenizer=tokenizer, out=tmp_path / "t.npy", eos="<eos>")
    with pytest.raises(SailorInputError, match="not a tokenizer.json"):
        prepare_tokens([tmp_path / "bad.jsonl"], tokenizer=tmp_path / "bad.jsonl", out=tmp_path / "t.npy")
    with pytest.raises(SailorInputError, match="expected a file ending in .npy or .bin"):
        prepare_tokens([tmp_path / "bad.jsonl"], tokenizer=tokenizer, out=tmp_path / "t.txt")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from sailor.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=180)


def _one_line(r: subprocess.CompletedProcess, message: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.integration
def test_cli_refuses_a_vocabulary_or_ids_the_model_cannot_take(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "job.yaml").write_text("model: tiny\nglobal_batch_size: 4\nsequence_length: 32\n")
    # the tiny model has a byte vocabulary of 256; the tokenizer has 300
    _one_line(_cli("data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tokenizer), "--job",
                   str(tmp_path / "job.yaml"), "--out", str(tmp_path / "t.npy")),
              "the tokenizer's vocabulary (300) is larger than the model's (256)")
    assert not (tmp_path / "t.npy").exists()
    r = _cli("data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "t.npy"),
             "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["vocab_size"] == 300
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"micro_batch_size": 2, "stages": [[0, 6]], "job": {"model": "tiny", "global_batch_size": 4,
                                                                                  "sequence_length": 32},
                                "pipelines": [{"microbatches": 2, "replicas": [
                                    {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}]}))
    _one_line(_cli("train", str(plan), "--data", str(tmp_path / "t.npy"), "--steps", "1"),
              "the tokenizer's vocabulary (300) is larger than the model's (256)")
    ids = _ids(1000, 256)
    ids[500] = 999
    ids.tofile(tmp_path / "ids.bin")  # no sidecar: scanned
    _one_line(_cli("train", str(plan), "--data", str(tmp_path / "ids.bin"), "--steps", "1"),
              "token id 999 is beyond the model's vocabulary of 256")


@pytest.mark.integration
def test_cli_names_a_folder_or_a_bad_tokenizer_in_one_line(tmp_path, tokenizer):
    (tmp_path / "docs").mkdir()
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "not-a-tokenizer.json").write_text("{}")
    out = str(tmp_path / "t.npy")
    _one_line(_cli("data", "prepare", str(tmp_path / "docs"), "--tokenizer", str(tokenizer), "--out", out),
              f"{tmp_path / 'docs'}: is a folder, expected a text or .jsonl file")
    _one_line(_cli("data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "not-a-tokenizer.json"),
                   "--out", out), "not a tokenizer.json")
    _one_line(_cli("data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "docs"), "--out", out),
              f"{tmp_path / 'docs'}: is a folder (pass a Hugging Face tokenizer.json)")
    assert not (tmp_path / "t.npy").exists()
