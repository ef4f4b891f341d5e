"""`sailor data prepare`: text or JSONL -> a token file, with a Hugging Face `tokenizers` tokenizer.json.

Inputs are read as a stream and never held whole:
- `*.jsonl`: one JSON object per line, a document per line (its `text_field`);
- anything else: UTF-8 text, one document per file, encoded in pieces of about `PIECE_BYTES` cut
  after a line break (a tokenizer sees each piece on its own; pieces end at line breaks so that
  words are never split).
Ids are encoded without the tokenizer's special tokens (no BOS added); `eos`, when given, is appended
after every document. The output (`.npy`, or a flat `.bin` as nanoGPT writes) is written to a
temporary file in its folder, fsynced and renamed; then its sidecar `NAME.json` records dtype,
count, the tokenizer's vocabulary size and SHA-256, and the largest id (`sailor.runtime.tokens`).
The dtype is uint16 when the vocabulary fits, else uint32.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sailor.core.errors import SailorInputError
from sailor.core.fileio import check_input_file, check_output_path, open_atomic, write_json
from sailor.runtime.tokens import sidecar, sidecar_meta, token_dtype, write_npy_header

PIECE_BYTES = 1 << 20  # text is tokenized in pieces of about 1 MiB
BATCH = 256  # documents or pieces per encode_batch call


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json; SailorInputError when it cannot be read."""
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError:
        raise SailorInputError("`sailor data prepare` needs the tokenizers package, which is not installed",
                               source="--tokenizer", fix="pip install 'sailor-train[train]'") from None
    p = Path(path)
    check_input_file(p, folder="is a folder", fix="pass a Hugging Face tokenizer.json")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises plain Exceptions for any parse error
        raise SailorInputError(f"not a tokenizer.json ({str(e).splitlines()[0][:200]})", source=str(p)) from None


def _documents(path: Path, text_field: str, progress: Callable[[int], None]) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pieces of one input file, calling `progress(bytes)` as it reads."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise SailorInputError(f"cannot read: {e.strerror}", source=str(path)) from None
    with f:
        if path.suffix.lower() == ".jsonl":
            for n, line in enumerate(f, 1):
                progress(len(line))
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise SailorInputError(f"line {n} is not JSON ({e})", source=str(path)) from None
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise SailorInputError(f"line {n} has no string field {text_field!r}", source=str(path),
                                           fix="choose the field with --text-field")
                yield text, True
            return
        rest = b""
        while True:
            block = f.read(PIECE_BYTES)
            progress(len(block))
            data = rest + block
            cut = _cut(data) if block else len(data)
            piece, rest = (data[:cut], data[cut:]) if cut else (b"", data)
            if piece or not block:
                try:
                    yield piece.decode("utf-8"), not block
                except UnicodeDecodeError as e:
                    raise SailorInputError(f"not UTF-8 text ({e.reason} at byte {e.start} of a piece)",
                                           source=str(path)) from None
            if not block:
                return


def _cut(data: bytes) -> int:
    """Where to end a piece of text: after its last line break; in a long run without one, after
    its last space, else before an incomplete UTF-8 character; 0 to read more first."""
    cut = data.rfind(b"\n") + 1
    if cut or len(data) < 4 * PIECE_BYTES:
        return cut
    cut = data.rfind(b" ") + 1
    if cut:
        return cut
    cut = len(data)
    while cut > 0 and data[cut - 1] & 0xC0 == 0x80:  # continuation bytes of a multi-byte character
        cut -= 1
    return cut - 1 if cut and data[cut - 1] >= 0xC0 else cut


def check_inputs(inputs: list[str | Path]) -> list[Path]:
    """The input paths of `prepare_tokens`, each an existing regular file.

    Raises:
        SailorInputError: a path that is missing, unreadable, a folder (its files are to be named),
            or not a regular file (a device, FIFO or socket): `fileio.check_input_file`.
    """
    paths = [Path(p) for p in inputs]
    for p in paths:
        check_input_file(p, folder=f"is a folder, expected a text or .jsonl file (name the files in it, e.g. {p}/*.txt)")
    return paths


def prepare_tokens(inputs: list[str | Path], *, tokenizer: str | Path, out: str | Path, text_field: str = "text",
                   eos: str | None = None, model_vocab: int | None = None,
                   progress: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """Tokenize `inputs` into token file `out` (module docstring); returns a summary
    {"out", "tokens", "documents", "vocab_size", "dtype", "seconds"}.

    Raises:
        SailorInputError: a missing or unreadable input or tokenizer, a tokenizer vocabulary larger
            than `model_vocab`, an unknown `eos` token, an output name not ending in .npy or .bin
            or naming an input or the tokenizer,
            or no tokens at all. Nothing is left behind on any error.
    """
    t0 = time.perf_counter()
    out = Path(out)
    check_output_path(out, "--out", suffixes=(".npy", ".bin"), inputs={"INPUT": list(inputs), "--tokenizer": tokenizer})
    paths = check_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if model_vocab is not None and vocab > model_vocab:
        raise SailorInputError(f"the tokenizer's vocabulary ({vocab}) is larger than the model's ({model_vocab})",
                               source=str(tokenizer), fix="use the model's own tokenizer, or a model with a larger vocab_size")
    eos_id = None
    if eos is not None:
        eos_id = tok.token_to_id(eos)
        if eos_id is None:
            raise SailorInputError(f"the tokenizer has no token {eos!r}", source="--eos")
    dtype = token_dtype(vocab)
    npy = out.suffix.lower() == ".npy"
    count, documents, top = 0, 0, -1
    with open_atomic(out, "wb") as f:
        header = write_npy_header(f, dtype, 0) if npy else 0

        def flush(batch: list[tuple[str, bool]]) -> None:
            nonlocal count, documents, top
            for (_, ends), enc in zip(batch, tok.encode_batch([t for t, _ in batch], add_special_tokens=False)):
                ids = enc.ids + ([eos_id] if ends and eos_id is not None else [])
                documents += ends
                if ids:
                    arr = np.asarray(ids, dtype=dtype)
                    top = max(top, int(arr.max()))
                    f.write(arr.tobytes())
                    count += arr.size

        batch: list[tuple[str, bool]] = []
        for p in paths:
            for piece in _documents(p, text_field, progress):
                batch.append(piece)
                if len(batch) == BATCH:
                    flush(batch)
                    batch = []
        flush(batch)
        if count == 0:
            raise SailorInputError("the inputs hold no text to tokenize", source=str(paths[0]))
        if npy:
            assert write_npy_header(f, dtype, count) == header  # same length: numpy pads to 64 bytes
            f.seek(0, os.SEEK_END)
    digest = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    write_json(sidecar(out), sidecar_meta(out, dtype=dtype, count=count, vocab_size=vocab, max_id=top, extra={
        "tokenizer": str(Path(tokenizer).resolve()), "tokenizer_sha256": digest, "documents": documents,
        "eos_id": eos_id, "sources": [str(p) for p in paths]}))
    return {"out": str(out), "tokens": count, "documents": documents, "vocab_size": vocab, "dtype": dtype.name,
            "seconds": time.perf_counter() - t0}
